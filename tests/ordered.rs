//! Ordered, partitioned consumption (`RuntimeBuilder::ordered`) on RabbitMQ and PostgreSQL:
//! the handler records every update it applies, in the order it applies them, and the tests
//! compare that sequence with the publish order per key.
//!
//! - Three processes with 8 workers each share 8 partitions of 200 keys × 50 updates, while
//!   processes are killed with SIGKILL and restarted and a connection is closed by the broker:
//!   every key's updates are applied once each, in publish order.
//! - Inside one process, a transient failure is retried in place (no retry queue exists), so
//!   nothing of its key overtakes it; with `KeyPolicy::Retire`, a dead-lettered message does
//!   not hold its key back (the default, parking the key, is `tests/parking.rs`'s).
//! - An exchange of another type under the handler's queue name stops the start with an error
//!   that names the plugin and the exchange.
//! - The builder refuses an ordered handler that is batched, has no partitions or is not run;
//!   the in-memory transport routes an ordered handler's exchange by routing key too, and the
//!   partitions share the handler's concurrency.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::{self, amqp_url};
use common::running::{DEADLINE, start};
use common::{unique, wait_until};
use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use idem::sql::PgInbox;
use idem::transport::{MemoryTransport, Partition, QueueSpec, Transport};
use idem::{Envelope, HandlerError, KeyPolicy, RetryPolicy, Runtime, RuntimeError, idempotent};
use std::collections::{HashMap, HashSet};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

const CONSUMER: &str = "ordered.steps";

/// One update of one key; `run` keeps concurrent tests apart in the shared log table.
#[derive(serde::Deserialize)]
struct Step {
    run: String,
    key: String,
    version: i64,
}

/// Message ids that fail: transiently a number of times, or permanently; and how many
/// updates are in the handler at once (the most seen), each taking `work`.
#[derive(Default)]
struct Faults {
    transient: Mutex<HashMap<String, u32>>,
    permanent: HashSet<String>,
    work: Duration,
    in_handler: AtomicUsize,
    most_in_handler: Arc<AtomicUsize>,
}

/// Counts an update in the handler until it is dropped.
struct InHandler<'a>(&'a Faults);

impl<'a> InHandler<'a> {
    fn enter(faults: &'a Faults) -> Self {
        let now = faults.in_handler.fetch_add(1, Ordering::SeqCst) + 1;
        faults.most_in_handler.fetch_max(now, Ordering::SeqCst);
        Self(faults)
    }
}

impl Drop for InHandler<'_> {
    fn drop(&mut self) {
        self.0.in_handler.fetch_sub(1, Ordering::SeqCst);
    }
}

#[idempotent(store = Postgres, consumer = "ordered.steps", queue = "ordered-steps")]
async fn apply_step(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    step: Step,
    ctx: &idem::Context<'_>,
    faults: &Faults,
) -> Result<(), HandlerError> {
    let _counted = InHandler::enter(faults);
    let id = ctx.envelope().message_id.clone().unwrap_or_default();
    if !faults.work.is_zero() {
        tokio::time::sleep(faults.work).await; // the handler's work, not synchronisation
    }
    if faults.permanent.contains(&id) {
        return Err(HandlerError::permanent("this update is refused"));
    }
    if let Some(left) = faults.transient.lock().unwrap().get_mut(&id)
        && *left > 0
    {
        *left -= 1;
        return Err(HandlerError::transient("the database blinked"));
    }
    sqlx::query("INSERT INTO idem_test_ordered_log (run, key, version) VALUES ($1, $2, $3)")
        .bind(&step.run)
        .bind(&step.key)
        .bind(step.version)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

async fn setup(connections: u32) -> sqlx::PgPool {
    let pool = common::postgres(connections).await;
    PgInbox::new(pool.clone()).migrate().await.unwrap();
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS idem_test_ordered_log (id BIGSERIAL PRIMARY KEY, run TEXT NOT NULL, key TEXT NOT NULL, version BIGINT NOT NULL)",
    )
    .execute(&pool)
    .await
    .unwrap();
    pool
}

fn fast_retries() -> RetryPolicy {
    RetryPolicy::new(5, Duration::from_millis(50), 2, Duration::from_millis(400)).unwrap()
}

fn rabbit(exchange: &str, name: &str) -> RabbitConfig {
    RabbitConfig::new(amqp_url()).connection_name(format!("idem-test:{exchange}:{name}"))
}

/// Declares the exchange and partition queues before anything is published to them.
async fn declare(exchange: &str, partitions: usize) {
    RabbitTransport::new(rabbit(exchange, "declare"))
        .declare(&QueueSpec::partitions(exchange, CONSUMER, partitions))
        .await
        .unwrap();
}

fn step(run: &str, key: &str, version: i64) -> Envelope {
    let body = serde_json::json!({"run": run, "key": key, "version": version});
    Envelope::new(body.to_string())
        .with_message_id(format!("{key}:{version}"))
        .with_content_type("application/json")
}

/// Publishes every key's versions in order, routed by key: bursts of up to 5 consecutive
/// versions of one key, so that a key's updates sit side by side in its partition (where
/// concurrent workers would take them at once), the keys' bursts interleaved.
async fn publish_steps(run: &str, keys: &[String], versions: i64) {
    let publisher = broker::publisher().await;
    for first in (1..=versions).step_by(5) {
        for key in keys {
            for version in first..=(first + 4).min(versions) {
                publisher
                    .publish_unconfirmed_to(run, key, &step(run, key, version))
                    .await
                    .unwrap();
            }
        }
        publisher.wait_for_confirms().await.unwrap();
    }
}

/// The versions applied per key, in the order they were applied.
async fn applied(pool: &sqlx::PgPool, run: &str) -> HashMap<String, Vec<i64>> {
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, version FROM idem_test_ordered_log WHERE run = $1 ORDER BY id")
            .bind(run)
            .fetch_all(pool)
            .await
            .unwrap();
    let mut applied: HashMap<String, Vec<i64>> = HashMap::new();
    for (key, version) in rows {
        applied.entry(key).or_default().push(version);
    }
    applied
}

async fn logged(pool: &sqlx::PgPool, run: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_test_ordered_log WHERE run = $1")
        .bind(run)
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Whether every partition queue is empty, ready and unacknowledged.
async fn drained(exchange: &str, partitions: usize) -> bool {
    for index in 0..partitions {
        let queue = Partition::queue_name(exchange, index);
        if broker::count(&queue).await > 0 || broker::unacked(&queue) > 0 {
            return false;
        }
    }
    true
}

async fn delete_topology(exchange: &str, partitions: usize) {
    for index in 0..partitions {
        broker::delete_topology(&Partition::queue_name(exchange, index), &[]).await;
    }
    broker::delete_exchange(exchange).await;
}

/// A consumer process: the ordering test's child, run from the test binary itself.
fn spawn_child(exchange: &str, partitions: usize, index: usize) -> Child {
    Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "ordered_child", "--nocapture"])
        .env("IDEM_ORDERED_EXCHANGE", exchange)
        .env("IDEM_ORDERED_PARTITIONS", partitions.to_string())
        .env("IDEM_ORDERED_CHILD", index.to_string())
        .env("AMQP_URL", amqp_url())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap()
}

/// The consumer processes; whatever happens to the test, none outlives it.
struct Children(Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for child in &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_key_is_applied_in_publish_order_across_killed_processes() {
    broker::with_the_plugin().await;
    const KEYS: usize = 200;
    const VERSIONS: i64 = 50;
    const PARTITIONS: usize = 8;
    let total = KEYS as i64 * VERSIONS;
    let pool = setup(4).await;
    let run = unique("idem-ordered");
    declare(&run, PARTITIONS).await;
    let keys: Vec<String> = (0..KEYS).map(|i| format!("{run}-k{i}")).collect();
    let mut children = Children(
        (0..3)
            .map(|index| spawn_child(&run, PARTITIONS, index))
            .collect(),
    );
    let publishing = tokio::spawn({
        let (run, keys) = (run.clone(), keys.clone());
        async move { publish_steps(&run, &keys, VERSIONS).await }
    });

    // SIGKILL a process at 10 %, 30 % and 50 % of the updates applied (each restarted), and
    // have the broker close one process's connection at 70 %.
    let mut kills = 0;
    for (step, percent) in [10, 30, 50, 70].into_iter().enumerate() {
        wait_until(
            &format!("{percent} % of the updates applied"),
            Duration::from_secs(180),
            || async { logged(&pool, &run).await * 100 >= total * percent },
        )
        .await;
        let victim = step % children.0.len();
        if percent < 70 {
            let child = &mut children.0[victim];
            child.kill().unwrap();
            let status = child.wait().unwrap();
            assert_eq!(status.signal(), Some(9), "killed with SIGKILL");
            children.0[victim] = spawn_child(&run, PARTITIONS, victim);
            kills += 1;
        } else {
            let name = format!("idem-test:{run}:child-{victim}");
            wait_until("the broker closed a connection", DEADLINE, || async {
                broker::close_connections(&name) > 0
            })
            .await;
        }
    }
    publishing.await.unwrap();
    wait_until("every update applied", Duration::from_secs(180), || async {
        logged(&pool, &run).await >= total
    })
    .await;
    wait_until("every partition drained", DEADLINE, || async {
        drained(&run, PARTITIONS).await
    })
    .await;

    assert_eq!(kills, 3);
    assert_eq!(logged(&pool, &run).await, total, "no update applied twice");
    let applied = applied(&pool, &run).await;
    let expected: Vec<i64> = (1..=VERSIONS).collect();
    assert_eq!(applied.len(), KEYS);
    for key in &keys {
        assert_eq!(applied[key], expected, "the updates of {key}, as applied");
    }
    for index in 0..PARTITIONS {
        let dlq = idem::rabbitmq::dlq(&Partition::queue_name(&run, index));
        assert_eq!(broker::count(&dlq).await, 0, "nothing dead-lettered");
    }
    drop(children);
    delete_topology(&run, PARTITIONS).await;
}

/// The child of the ordering test: consumes the partitions until it is killed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "child process of every_key_is_applied_in_publish_order_across_killed_processes"]
async fn ordered_child() {
    let exchange = std::env::var("IDEM_ORDERED_EXCHANGE").expect("run by the ordering test");
    let partitions: usize = std::env::var("IDEM_ORDERED_PARTITIONS")
        .unwrap()
        .parse()
        .unwrap();
    let index = std::env::var("IDEM_ORDERED_CHILD").unwrap();
    let pool = setup(8).await;
    let runtime = Runtime::builder()
        .transport(RabbitTransport::new(rabbit(
            &exchange,
            &format!("child-{index}"),
        )))
        .store(PgInbox::new(pool))
        .state(Faults::default())
        .handlers([CONSUMER])
        .handler_queue(CONSUMER, &exchange)
        .ordered(CONSUMER, partitions)
        .concurrency(8)
        .retry(fast_retries())
        .without_sweeper()
        .build()
        .unwrap();
    runtime.run_until(std::future::pending()).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_failure_is_retried_in_place_and_a_retired_key_moves_on_past_its_dead_letter() {
    broker::with_the_plugin().await;
    const KEYS: usize = 20;
    const VERSIONS: i64 = 5;
    const PARTITIONS: usize = 4;
    let pool = setup(8).await;
    let run = unique("idem-ordered-retry");
    let keys: Vec<String> = (0..KEYS).map(|i| format!("{run}-k{i}")).collect();
    // Every key's version 2 fails twice before it succeeds; the first key's version 3 is
    // refused for good; the second key's version 4 fails every attempt.
    let mut transient: HashMap<String, u32> = keys.iter().map(|k| (format!("{k}:2"), 2)).collect();
    transient.insert(format!("{}:4", keys[1]), 5);
    let faults = Faults {
        transient: Mutex::new(transient),
        permanent: HashSet::from([format!("{}:3", keys[0])]),
        ..Faults::default()
    };
    // Declared, bindings and all, before anything is published: a queue that exists before
    // its binding does would let the exchange's hash ring change under the publishes, and a
    // key's later versions reach another partition (seen: one key applied as 4, 1, 5, 2, 3).
    declare(&run, PARTITIONS).await;
    let running = start(
        Runtime::builder()
            .transport(RabbitTransport::new(rabbit(&run, "runtime")))
            .store(PgInbox::new(pool.clone()))
            .state(faults)
            .handlers([CONSUMER])
            .handler_queue(CONSUMER, &run)
            .ordered(CONSUMER, PARTITIONS)
            .key_policy(CONSUMER, KeyPolicy::Retire)
            .concurrency(8)
            .retry(fast_retries()),
    );
    publish_steps(&run, &keys, VERSIONS).await;
    let total = KEYS * VERSIONS as usize;
    wait_until("every update settled", DEADLINE, || async {
        running.now().settled() >= total as u64
    })
    .await;
    let stats = running.shut_down().await;

    assert_eq!(stats.retried, 2 * KEYS as u64 + 4, "{stats:?}");
    assert_eq!(stats.dead_lettered, 2, "{stats:?}");
    assert_eq!(stats.processed, total as u64 - 2, "{stats:?}");
    let applied = applied(&pool, &run).await;
    assert_eq!(
        applied[&keys[0]],
        vec![1, 2, 4, 5],
        "the refused update is skipped"
    );
    assert_eq!(
        applied[&keys[1]],
        vec![1, 2, 3, 5],
        "the update out of attempts is skipped"
    );
    for key in &keys[2..] {
        assert_eq!(applied[key], vec![1, 2, 3, 4, 5], "the updates of {key}");
    }
    let mut dead = 0;
    let mut records = Vec::new();
    for index in 0..PARTITIONS {
        let queue = Partition::queue_name(&run, index);
        records.extend(
            PgInbox::new(pool.clone())
                .dead_letters(&queue)
                .await
                .unwrap(),
        );
        dead += broker::count(&idem::rabbitmq::dlq(&queue)).await;
        for delay in fast_retries().delays() {
            let retry_queue = idem::rabbitmq::retry_queue(&queue, delay);
            assert!(
                !broker::exists(&retry_queue).await,
                "an ordered partition has no retry queue ({retry_queue})"
            );
        }
    }
    assert_eq!(dead, 2, "the two updates are in their partitions' DLQs");
    // Retried in place, the update out of attempts has no retry copy to carry when its
    // failures began: its record has it all the same, before the waits of its four retries.
    let exhausted = records
        .iter()
        .find(|r| r.reason == "retries-exhausted")
        .expect("the record of the update out of attempts");
    let first = exhausted
        .first_failed_at_ms
        .expect("when its failures began");
    assert!(
        exhausted.dead_lettered_at_ms - first >= 500,
        "its failures began {} ms before its dead letter; its retries waited at least 560 ms",
        exhausted.dead_lettered_at_ms - first
    );
    delete_topology(&run, PARTITIONS).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_exchange_of_another_type_stops_the_start() {
    broker::with_the_plugin().await;
    let pool = setup(2).await;
    let run = unique("idem-ordered-direct");
    broker::declare_direct_exchange(&run).await;
    let runtime = Runtime::builder()
        .transport(RabbitTransport::new(rabbit(&run, "runtime")))
        .store(PgInbox::new(pool))
        .state(Faults::default())
        .handlers([CONSUMER])
        .handler_queue(CONSUMER, &run)
        .ordered(CONSUMER, 2)
        .build()
        .unwrap();
    let error = runtime.run_until(async {}).await.unwrap_err().to_string();
    assert!(error.contains(&run), "names the exchange: {error}");
    assert!(
        error.contains("rabbitmq_consistent_hash_exchange"),
        "names the plugin: {error}"
    );
    delete_topology(&run, 2).await;
}

#[tokio::test]
async fn the_builder_refuses_what_cannot_be_ordered() {
    let pool = setup(1).await;
    let builder = || {
        Runtime::builder()
            .transport(MemoryTransport::new())
            .store(PgInbox::new(pool.clone()))
            .state(Faults::default())
            .handlers([CONSUMER])
    };
    let refused = |result: Result<Runtime, RuntimeError>| match result {
        Err(RuntimeError::Setting { setting, problem }) => format!("{setting}: {problem}"),
        Err(other) => panic!("another error: {other}"),
        Ok(_) => panic!("built"),
    };
    let batched = refused(builder().ordered(CONSUMER, 4).batch(10).build());
    assert!(
        batched.contains("one transaction per delivery"),
        "{batched}"
    );
    let none = refused(builder().ordered(CONSUMER, 0).build());
    assert!(none.contains("give 1 to 1024"), "{none}");
    let too_many = refused(builder().ordered(CONSUMER, 1025).build());
    assert!(too_many.contains("give 1 to 1024"), "{too_many}");
    let unknown = refused(builder().ordered("ordered.nobody", 4).build());
    assert!(unknown.contains("ordered.nobody"), "{unknown}");
    assert!(builder().ordered(CONSUMER, 4).build().is_ok());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_memory_transport_routes_an_ordered_exchange_by_key() {
    let pool = setup(16).await;
    let run = unique("idem-ordered-memory");
    let transport = MemoryTransport::new();
    let keys: Vec<String> = (0..10).map(|i| format!("{run}-k{i}")).collect();
    let most_in_handler = Arc::new(AtomicUsize::new(0));
    let faults = Faults {
        transient: Mutex::new(keys.iter().map(|k| (format!("{k}:1"), 1)).collect()),
        work: Duration::from_millis(5),
        most_in_handler: most_in_handler.clone(),
        ..Faults::default()
    };
    let running = start(
        Runtime::builder()
            .transport(transport.clone())
            .store(PgInbox::new(pool.clone()))
            .state(faults)
            .handlers([CONSUMER])
            .handler_queue(CONSUMER, &run)
            .ordered(CONSUMER, 3)
            .concurrency(4)
            .retry(fast_retries()),
    );
    wait_until("the partitions are declared", DEADLINE, || async {
        transport.exists(&Partition::queue_name(&run, 2))
    })
    .await;
    for version in 1..=4 {
        for key in &keys {
            transport.publish(
                &run,
                step(&run, key, version).with_routing_key(key.as_str()),
            );
        }
    }
    wait_until("every update settled", DEADLINE, || async {
        running.now().processed >= 40
    })
    .await;
    let stats = running.shut_down().await;
    assert_eq!(stats.retried, 10, "{stats:?}");
    let applied = applied(&pool, &run).await;
    for key in &keys {
        assert_eq!(applied[key], vec![1, 2, 3, 4], "the updates of {key}");
    }
    let used = (0..3)
        .filter(|i| transport.acked(&Partition::queue_name(&run, *i)) > 0)
        .count();
    assert!(used > 1, "ten keys spread over the partitions");
    let most = most_in_handler.load(Ordering::SeqCst);
    assert!(
        (2..=4).contains(&most),
        "the three partitions share a concurrency of 4: {most} at once"
    );
}
