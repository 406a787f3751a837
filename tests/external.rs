//! External mode (`mode = "external"`) against a real HTTP payment service that charges at most
//! once per idempotency key: concurrent copies, a lease that expires mid-call and is taken over,
//! permanent and transient failures, and a consumer process killed with SIGKILL after the call
//! but before the row was completed. The figure each test asserts: charges per payment = 1,
//! counted by the service whatever idempotency key a call carried.
//!
//! PostgreSQL and MariaDB run the same suite; the kill test runs the whole runtime on RabbitMQ.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::charges;
use idem::{Context, HandlerError, Outcome, idempotent};
use serde::{Deserialize, Serialize};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

#[derive(Debug, Deserialize)]
struct Payment {
    payment_id: String,
    amount_cents: i64,
    /// The provider answers this key's first call 503.
    #[serde(default)]
    flaky: bool,
    /// The provider takes this long to answer.
    #[serde(default)]
    slow_ms: u64,
}

#[derive(Debug, PartialEq, Serialize, Deserialize)]
struct Receipt {
    charge_id: String,
}

/// The payment provider the handlers call, given to them as runtime state: its address, and
/// the test's hold on runs after their call. Clones share the holds.
#[derive(Clone)]
struct Provider {
    addr: SocketAddr,
    holds: Arc<Mutex<Holds>>,
}

#[derive(Default)]
struct Holds {
    /// Keys whose next run, after its call, waits until the test releases them (once per entry).
    after_call: Vec<String>,
    released: Vec<String>,
}

impl Provider {
    /// The test service (in a child process, the parent's, through `IDEM_CHARGES_ADDR`).
    fn new() -> Self {
        Self {
            addr: charges::addr(),
            holds: Arc::default(),
        }
    }

    fn holds(&self) -> std::sync::MutexGuard<'_, Holds> {
        self.holds.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The next run of `key` waits after its call until [`Provider::release`].
    fn hold_after_call(&self, key: &str) {
        self.holds().after_call.push(key.to_owned());
    }

    fn release(&self, key: &str) {
        self.holds().released.push(key.to_owned());
    }
}

/// Charges the payment with the message's idempotency key, then follows the test's script.
async fn pay(
    payment: Payment,
    provider: &Provider,
    ctx: &Context<'_>,
) -> Result<Receipt, HandlerError> {
    let mut extra = Vec::new();
    if payment.flaky {
        extra.push(("X-Fail-First", "1".to_owned()));
    }
    if payment.slow_ms > 0 {
        extra.push(("X-Delay-Ms", payment.slow_ms.to_string()));
    }
    let answer = charges::charge(
        provider.addr,
        ctx.idempotency_key(),
        &payment.payment_id,
        payment.amount_cents,
        &extra,
    )
    .await
    .map_err(HandlerError::transient)?;
    if std::env::var("IDEM_EXT_HANG").is_ok_and(|k| k == payment.payment_id) {
        // The crash test's child: the charge is made, the row not yet completed. Killed here.
        println!("IDEM-CHARGED");
        std::future::pending::<()>().await;
    }
    let hold = {
        let mut holds = provider.holds();
        let found = holds
            .after_call
            .iter()
            .position(|k| *k == payment.payment_id);
        found.map(|i| holds.after_call.remove(i)).is_some()
    };
    if hold {
        let deadline = Instant::now() + Duration::from_secs(60);
        while !provider.holds().released.contains(&payment.payment_id) {
            assert!(Instant::now() < deadline, "never released");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }
    match answer.status {
        200 | 201 => Ok(Receipt {
            charge_id: answer.body,
        }),
        402 => Err(HandlerError::permanent(format!(
            "the card was declined: {}",
            answer.body
        ))),
        status => Err(HandlerError::transient(format!(
            "the provider answered {status}"
        ))),
    }
}

#[idempotent(store = Postgres, key = "payment.payment_id", mode = "external", lease = "2s", consumer = "ext.pay", queue = "idem-test-ext")]
async fn pay_postgres(
    payment: Payment,
    provider: &Provider,
    ctx: &Context<'_>,
) -> Result<Receipt, HandlerError> {
    pay(payment, provider, ctx).await
}

#[idempotent(store = MySql, key = "payment.payment_id", mode = "external", lease = "2s", consumer = "ext.pay")]
async fn pay_mysql(
    payment: Payment,
    provider: &Provider,
    ctx: &Context<'_>,
) -> Result<Receipt, HandlerError> {
    pay(payment, provider, ctx).await
}

/// `pay_postgres` with a lease of 10 s, for the kill test: the next process must meet the lease
/// still held, however long a busy machine takes to start it.
#[idempotent(store = Postgres, key = "payment.payment_id", mode = "external", lease = "10s", consumer = "ext.pay.killed", queue = "idem-test-ext")]
async fn pay_killed(
    payment: Payment,
    provider: &Provider,
    ctx: &Context<'_>,
) -> Result<Receipt, HandlerError> {
    pay(payment, provider, ctx).await
}

fn payment(id: &str, amount: i64) -> serde_json::Value {
    serde_json::json!({"payment_id": id, "amount_cents": amount})
}

fn envelope(body: &serde_json::Value) -> idem::Envelope {
    idem::Envelope::new(body.to_string())
}

macro_rules! external_suite {
    ($module:ident, $store:ident, $db:ty, $inbox:ty, $pool:expr, $row:expr) => {
        mod $module {
            use super::common::{unique, wait_until};
            use super::*;
            use idem::store::Stores;

            async fn stores() -> (Stores, sqlx::Pool<$db>) {
                let pool = $pool;
                let inbox = <$inbox>::new(pool.clone());
                inbox.migrate().await.unwrap();
                (Stores::new().with(inbox).with_state(Provider::new()), pool)
            }

            async fn run(stores: &Stores, body: &serde_json::Value) -> Outcome {
                let registration = idem::registry::handlers()
                    .into_iter()
                    .find(|r| r.consumer() == "ext.pay" && r.store() == <$inbox as idem::store::InboxStore>::KIND)
                    .unwrap();
                registration.invoke(stores, &envelope(body)).await.unwrap()
            }

            /// Runs a copy until it settles (not "retry"), as the broker would redeliver it;
            /// returns the outcome and how many retries it met first.
            async fn settle(stores: &Stores, body: &serde_json::Value) -> (Outcome, usize) {
                let deadline = Instant::now() + Duration::from_secs(30);
                let mut retries = 0;
                loop {
                    let outcome = run(stores, body).await;
                    if !matches!(outcome, Outcome::Retry(_)) {
                        return (outcome, retries);
                    }
                    retries += 1;
                    assert!(Instant::now() < deadline, "never settled: {outcome:?}");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
            }

            /// The key's row: status and attempts.
            async fn row(pool: &sqlx::Pool<$db>, key: &str) -> (String, i32) {
                sqlx::query_as($row)
                    .bind("ext.pay")
                    .bind(key)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            fn charge_id(outcome: &Outcome) -> String {
                outcome.output().unwrap().decode::<Receipt>().unwrap().charge_id
            }

            #[tokio::test]
            async fn concurrent_copies_make_one_charge() {
                const COPIES: usize = 16;
                let (stores, pool) = stores().await;
                let id = unique("pay");
                // A slow provider: the first copy holds the lease while the others arrive.
                let mut body = payment(&id, 1250);
                body["slow_ms"] = 300.into();
                let start = std::sync::Arc::new(tokio::sync::Barrier::new(COPIES));
                let tasks: Vec<_> = (0..COPIES)
                    .map(|_| {
                        let (stores, body, start) = (stores.clone(), body.clone(), start.clone());
                        tokio::spawn(async move {
                            start.wait().await;
                            settle(&stores, &body).await
                        })
                    })
                    .collect();
                let mut labels = std::collections::BTreeMap::new();
                let (mut ids, mut held) = (std::collections::BTreeSet::new(), 0);
                for task in tasks {
                    let (outcome, retries) = task.await.unwrap();
                    held += retries;
                    ids.insert(charge_id(&outcome));
                    *labels.entry(outcome.label()).or_insert(0) += 1;
                }
                assert_eq!(labels, [("duplicate", COPIES - 1), ("processed", 1)].into());
                assert!(held > 0, "no copy ever found the lease held: the copies did not overlap");
                assert_eq!(ids.len(), 1, "every copy replays the one charge: {ids:?}");
                assert_eq!((charges::calls(&id), charges::charges(&id)), (1, 1));
                assert_eq!(row(&pool, &id).await, ("completed".to_owned(), 1));
            }

            #[tokio::test]
            async fn an_expired_lease_is_taken_over_and_the_downstream_deduplicates() {
                let (stores, pool) = stores().await;
                let id = unique("pay");
                let body = payment(&id, 990);
                let provider = stores.state().get::<Provider>().unwrap().clone();
                provider.hold_after_call(&id);
                // The first copy charges, then stalls past its 2 s lease.
                let first = tokio::spawn({
                    let (stores, body) = (stores.clone(), body.clone());
                    async move { run(&stores, &body).await }
                });
                wait_until("the first call", Duration::from_secs(20), || async { charges::calls(&id) == 1 }).await;
                // A second copy waits out the lease, takes over, calls again with the same key.
                let (second, retries) = settle(&stores, &body).await;
                assert_eq!(second.label(), "processed", "{second:?}");
                assert!(retries > 0, "the lease was not respected");
                assert_eq!(row(&pool, &id).await, ("completed".to_owned(), 2));
                provider.release(&id);
                // The stalled copy has lost its lease: it writes nothing and is retried...
                let first = first.await.unwrap();
                assert!(
                    matches!(&first, Outcome::Retry(t) if t.message.contains("lease expired")),
                    "{first:?}"
                );
                // ...and its retry is a duplicate replaying the charge.
                let again = run(&stores, &body).await;
                assert_eq!(again.label(), "duplicate");
                assert_eq!(charge_id(&again), charge_id(&second));
                assert_eq!((charges::calls(&id), charges::charges(&id)), (2, 1));
            }

            /// Three runs crashed before this copy (their counts stand in the store) and a
            /// fourth consumer holds the lease: the copy is retried without running, and takes
            /// back only its own count, so the crashed runs still count toward the poison limit.
            #[tokio::test]
            async fn a_copy_that_finds_the_lease_held_leaves_earlier_crashes_counted() {
                use idem::store::{ClaimRequest, DeadLetterStore, Lease, LeaseStore};
                let (stores, pool) = stores().await;
                let inbox = <$inbox>::new(pool.clone());
                let id = unique("pay");
                let body = payment(&id, 700);
                let fingerprint = idem::store::Fingerprint::of(body.to_string().as_bytes());
                let request = ClaimRequest {
                    consumer: "ext.pay",
                    key: &id,
                    fingerprint: &fingerprint,
                    attempt: 2,
                    retention: Duration::from_secs(3600),
                };
                for _ in 0..3 {
                    inbox.count_delivery(&request).await.unwrap();
                }
                let leased = inbox.lease(&request, "another-consumer", Duration::from_secs(60)).await;
                assert!(matches!(leased, Ok(Lease::Acquired { .. })), "{leased:?}");
                let registration = idem::registry::handlers()
                    .into_iter()
                    .find(|r| r.consumer() == "ext.pay" && r.store() == <$inbox as idem::store::InboxStore>::KIND)
                    .unwrap();
                let mut copy = envelope(&body);
                copy.redelivered = true;
                copy.attempt = 2;
                // The runtime's default poison limit.
                let stores = stores.with_poison_limit(Some(idem::DEFAULT_POISON_LIMIT));
                let outcome = registration.invoke(&stores, &copy).await.unwrap();
                assert!(matches!(outcome, Outcome::Retry(_)), "{outcome:?}");
                assert_eq!(charges::calls(&id), 0, "the copy ran although the lease was held");
                let report = inbox.show("ext.pay", &id).await.unwrap();
                assert_eq!(report.deliveries, Some(3), "the crashed runs' counts: {report:?}");
            }

            #[tokio::test]
            async fn a_permanent_failure_is_recorded_and_never_run_again() {
                let (stores, pool) = stores().await;
                let id = unique("pay");
                let declined = payment(&id, -5);
                let first = run(&stores, &declined).await;
                assert!(
                    matches!(&first, Outcome::Rejected(r) if r.reason == idem::RejectReason::Handler),
                    "{first:?}"
                );
                assert_eq!(row(&pool, &id).await, ("failed".to_owned(), 1));
                let later = run(&stores, &declined).await;
                let Outcome::Rejected(rejection) = &later else { panic!("{later:?}") };
                assert_eq!(rejection.reason, idem::RejectReason::PreviouslyFailed);
                assert!(rejection.message.contains("declined"), "{rejection:?}");
                assert_eq!(charges::calls(&id), 1, "a failed key was run again");
                // Another payload under the failed key is a conflict, not a rerun.
                let other = run(&stores, &payment(&id, 5)).await;
                assert_eq!(other.label(), "conflict");
                assert_eq!((charges::calls(&id), charges::charges(&id)), (1, 0));
            }

            #[tokio::test]
            async fn a_transient_failure_releases_the_lease_for_the_retry() {
                let (stores, pool) = stores().await;
                let id = unique("pay");
                let mut body = payment(&id, 300);
                body["flaky"] = true.into();
                let first = run(&stores, &body).await;
                assert!(matches!(&first, Outcome::Retry(t) if t.message.contains("503")), "{first:?}");
                // Released: the retry takes over at once instead of waiting out the lease.
                let second = run(&stores, &body).await;
                assert_eq!(second.label(), "processed", "{second:?}");
                assert_eq!(row(&pool, &id).await, ("completed".to_owned(), 2));
                assert_eq!((charges::calls(&id), charges::charges(&id)), (2, 1));
            }
        }
    };
}

external_suite!(
    postgres,
    Postgres,
    sqlx::Postgres,
    idem::sql::PgInbox,
    common::postgres(10).await,
    "SELECT status, attempts FROM idem_inbox WHERE consumer = $1 AND key = $2"
);
external_suite!(
    mysql,
    MySql,
    sqlx::MySql,
    idem::sql::MySqlInbox,
    common::mysql(10).await,
    "SELECT status, attempts FROM idem_inbox WHERE consumer = ? AND `key` = ?"
);

/// The whole runtime on RabbitMQ and PostgreSQL: a consumer process is killed after its call to
/// the provider, before it completed the row; the next consumer waits out the lease, takes the
/// key over and calls again with the same key.
mod killed {
    use super::common::broker::{self, amqp_url};
    use super::common::{unique, wait_until};
    use super::*;
    use idem::rabbitmq::{RabbitConfig, RabbitTransport};
    use idem::sql::PgInbox;
    use idem::transport::{QueueSpec, Transport};
    use idem::{RetryPolicy, Runtime, RuntimeBuilder};

    /// The killed consumer, with a lease of 10 s (`pay_killed`).
    const CONSUMER: &str = "ext.pay.killed";

    /// Retries 0.2 s, 0.4 s, 0.8 s, 1.6 s, 3.2 s and three times 4 s apart: 18.2 s in all
    /// (13.6 s at least, jittered), longer than the killed consumer's 10 s lease.
    fn policy() -> RetryPolicy {
        RetryPolicy::new(9, Duration::from_millis(200), 2, Duration::from_secs(4)).unwrap()
    }

    /// The killed consumer's runtime.
    fn killed_runtime(pool: sqlx::PgPool, queue: &str) -> RuntimeBuilder {
        runtime(pool, queue, CONSUMER).retry(policy())
    }

    /// A runtime of `consumer` alone, consuming `queue`.
    fn runtime(pool: sqlx::PgPool, queue: &str, consumer: &str) -> RuntimeBuilder {
        let rabbit = RabbitConfig::new(amqp_url()).connection_name(format!("idem-test:{queue}"));
        Runtime::builder()
            .transport(RabbitTransport::new(rabbit))
            .store(PgInbox::new(pool))
            .state(Provider::new())
            .handlers([consumer])
            .handler_queue(consumer, queue)
            // Two workers: the redelivered copy and its retries may run beside each other.
            .concurrency(2)
    }

    async fn row(pool: &sqlx::PgPool, key: &str) -> Option<(String, i32)> {
        sqlx::query_as("SELECT status, attempts FROM idem_inbox WHERE consumer = $1 AND key = $2")
            .bind(CONSUMER)
            .bind(key)
            .fetch_optional(pool)
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn a_consumer_killed_after_the_call_is_taken_over_with_one_charge() {
        let pool = super::common::postgres(4).await;
        PgInbox::new(pool.clone()).migrate().await.unwrap();
        let queue = unique("idem-test-ext");
        let mut spec = QueueSpec::new(queue.clone(), CONSUMER);
        spec.retry_delays = policy().delays();
        RabbitTransport::new(RabbitConfig::new(amqp_url()))
            .declare(&[spec])
            .await
            .unwrap();
        let id = unique("pay");
        let publisher = broker::publisher().await;
        let body = payment(&id, 4200).to_string();
        broker::publish(&publisher, &queue, Some(&id), body.as_bytes()).await;

        let mut child = std::process::Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "killed::crash_child",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env("IDEM_EXT_QUEUE", &queue)
            .env("IDEM_EXT_HANG", &id)
            .env("IDEM_CHARGES_ADDR", charges::addr().to_string())
            .stdout(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let charged = tokio::task::spawn_blocking(move || {
            use std::io::BufRead;
            std::io::BufReader::new(stdout)
                .lines()
                .map_while(Result::ok)
                .any(|l| l.ends_with("IDEM-CHARGED"))
        });
        let charged = tokio::time::timeout(Duration::from_secs(60), charged).await;
        child.kill().unwrap(); // SIGKILL: charged, not completed, not acked
        child.wait().unwrap();
        assert!(
            matches!(charged, Ok(Ok(true))),
            "the child never charged: {charged:?}"
        );
        assert_eq!((charges::calls(&id), charges::charges(&id)), (1, 1));
        assert_eq!(row(&pool, &id).await, Some(("in_progress".to_owned(), 1)));

        let running = killed_runtime(pool.clone(), &queue).build().unwrap();
        let stats = running.stats();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(running.run_until(async {
            let _ = stopped.await;
        }));
        wait_until(
            "the key to be completed",
            Duration::from_secs(30),
            || async {
                row(&pool, &id)
                    .await
                    .is_some_and(|(status, _)| status == "completed")
            },
        )
        .await;
        wait_until("the queue to drain", Duration::from_secs(30), || async {
            broker::count(&queue).await == 0 && broker::unacked(&queue) == 0
        })
        .await;
        let _ = stop.send(());
        task.await.unwrap().unwrap();
        let snapshot = stats.snapshot();
        assert_eq!(snapshot.processed, 1, "{snapshot:?}");
        assert!(
            snapshot.retried >= 1,
            "the live lease was not waited for: {snapshot:?}"
        );
        assert_eq!(snapshot.dead_lettered, 0, "{snapshot:?}");
        assert_eq!(row(&pool, &id).await, Some(("completed".to_owned(), 2)));
        assert_eq!(
            (charges::calls(&id), charges::charges(&id)),
            (2, 1),
            "calls under the key, charges for the payment"
        );
        broker::delete_topology(&queue, &policy().delays()).await;
    }

    /// The consumer process `a_consumer_killed_after_the_call_is_taken_over_with_one_charge`
    /// kills once its handler has charged.
    #[tokio::test]
    #[ignore = "child process of a_consumer_killed_after_the_call_is_taken_over_with_one_charge"]
    async fn crash_child() {
        let queue = std::env::var("IDEM_EXT_QUEUE").expect("run by the kill test");
        let pool = super::common::postgres(2).await;
        let running = killed_runtime(pool, &queue).build().unwrap();
        running
            .run_until(std::future::pending::<()>())
            .await
            .unwrap();
    }

    #[tokio::test]
    async fn windows_that_would_run_a_copy_twice_are_refused_at_start_up() {
        let pool = super::common::postgres(1).await;
        let rabbit = RabbitConfig::new(amqp_url()).message_ttl(Duration::from_secs(30 * 86_400));
        let too_long_ttl = Runtime::builder()
            .transport(RabbitTransport::new(rabbit))
            .store(PgInbox::new(pool.clone()))
            .state(Provider::new())
            .handlers(["ext.pay"])
            .build();
        let err = too_long_ttl.err().expect("refused").to_string();
        assert!(
            err.contains("message TTL of 2592000s, longer than the 604800s retention"),
            "{err}"
        );

        // The same TTL under a longer runtime retention starts.
        let rabbit = RabbitConfig::new(amqp_url()).message_ttl(Duration::from_secs(30 * 86_400));
        Runtime::builder()
            .transport(RabbitTransport::new(rabbit))
            .store(PgInbox::new(pool.clone()))
            .state(Provider::new())
            .handlers(["ext.pay"])
            .retention(Duration::from_secs(31 * 86_400))
            .build()
            .unwrap();

        // A 2 s lease whose rows are kept 2 s: the sweeper could delete a key in progress.
        let err = runtime(pool.clone(), "idem-test-ext", "ext.pay")
            .retention(Duration::from_secs(2))
            .build()
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("holds its lease for 2s, but its inbox rows are kept only 2s")
                && err.contains("raise the retention"),
            "{err}"
        );

        // A 2 s lease against a retry policy that gives up after 1 s of delays.
        let short = RetryPolicy::new(2, Duration::from_secs(1), 1, Duration::from_secs(1)).unwrap();
        let err = runtime(pool.clone(), "idem-test-ext", "ext.pay")
            .retry(short)
            .build()
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("holds its lease for 2s") && err.contains("shorten the lease"),
            "{err}"
        );

        // Rows kept 10 s against a retry policy whose delays add up to 81 s: its last retries
        // would be older than the dedup window.
        let err = runtime(pool.clone(), "idem-test-ext", "ext.pay")
            .retry(RetryPolicy::default())
            .retention(Duration::from_secs(10))
            .build()
            .err()
            .expect("refused")
            .to_string();
        assert!(
            err.contains("the retry policy waits 81s") && err.contains("kept only 10s"),
            "{err}"
        );

        // Rows kept 2 days against an outbox relay that tries a refused row for 3: a row
        // published that late would be older than the dedup window; 2 days start.
        let give_up = |days: u64| {
            Runtime::builder()
                .transport(RabbitTransport::new(RabbitConfig::new(amqp_url())))
                .store(
                    PgInbox::new(pool.clone()).outbox_give_up(Duration::from_secs(days * 86_400)),
                )
                .state(Provider::new())
                .handlers(["ext.pay"])
                .retention(Duration::from_secs(2 * 86_400))
                .build()
        };
        let err = give_up(3).err().expect("refused").to_string();
        assert!(
            err.contains("keeps trying a refused row for 259200s")
                && err.contains("outbox_give_up"),
            "{err}"
        );
        give_up(2).unwrap();
    }
}
