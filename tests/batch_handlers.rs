//! Batch handlers (`orders: idem::Batch<T>`): the function runs once on the new messages of a
//! batch and writes their effects set-based. Against real databases (PostgreSQL, MariaDB,
//! SQLite) and, through `build()`, on RabbitMQ: duplicates inside one batch and across
//! batches, per-message results stored and replayed to duplicates, one message failed by the
//! handler among 200 (only it is dead-lettered), a message failing transiently (retried
//! alone, the batch running again without it), a permanent failure that names no culprit (the
//! batch is split until the message that fails alone is found), a panic (the batch is retried).
//!
//! On MariaDB also a broker connection closed and a database outage under batch handlers.
//!
//! The handler reacts to its orders' ids: `…-poison` is failed by index (permanent),
//! `…-flaky` is failed by index (transient) the first time it is seen, `…-whole` fails the
//! whole batch (permanent, no culprit named), `…-panic` panics the first time it is seen.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

#[derive(Debug, serde::Deserialize)]
struct Order {
    order_id: String,
    customer: String,
    amount_cents: i64,
}

/// What the handlers saw: the size of every batch they were called with, and the keys seen;
/// and how many calls ran at once, at most.
#[derive(Clone, Default)]
struct Seen(
    Arc<Mutex<(Vec<usize>, HashSet<String>)>>,
    Arc<(AtomicUsize, AtomicUsize)>,
);

/// One handler call in flight, counted while it lives.
struct InFlight(Arc<(AtomicUsize, AtomicUsize)>);

impl Drop for InFlight {
    fn drop(&mut self) {
        self.0.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Seen {
    fn lock(&self) -> std::sync::MutexGuard<'_, (Vec<usize>, HashSet<String>)> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records a call with `len` messages.
    fn called(&self, len: usize) {
        self.lock().0.push(len);
    }

    /// Whether `key` is seen for the first time.
    fn first(&self, key: &str) -> bool {
        self.lock().1.insert(key.to_owned())
    }

    fn largest_batch(&self) -> usize {
        self.lock().0.iter().copied().max().unwrap_or(0)
    }

    /// Counts a handler call until the guard is dropped.
    fn enter(&self) -> InFlight {
        let now = self.1.0.fetch_add(1, Ordering::SeqCst) + 1;
        self.1.1.fetch_max(now, Ordering::SeqCst);
        InFlight(self.1.clone())
    }

    /// The most handler calls that ran at once.
    fn most_at_once(&self) -> usize {
        self.1.1.load(Ordering::SeqCst)
    }
}

/// Plays the script of the orders' ids; `Ok` when every order may be written.
fn script(orders: &idem::Batch<Order>, seen: &Seen) -> Result<(), idem::BatchError> {
    seen.called(orders.len());
    for (i, order) in orders.iter().enumerate() {
        let id = order.order_id.as_str();
        let first = seen.first(id);
        if id.ends_with("-poison") {
            return Err(idem::BatchError::item(
                i,
                idem::HandlerError::permanent("scripted: refused"),
            ));
        }
        if id.ends_with("-flaky") && first {
            return Err(idem::BatchError::item(
                i,
                idem::HandlerError::transient("scripted: busy"),
            ));
        }
        if id.ends_with("-whole") {
            return Err(idem::HandlerError::permanent("scripted: the batch is refused").into());
        }
        if id.ends_with("-panic") && first {
            panic!("scripted panic");
        }
    }
    Ok(())
}

/// Each customer's total in `orders`, by customer (rows locked in one order).
fn totals(orders: &idem::Batch<Order>) -> Vec<(&str, i64)> {
    let mut totals: std::collections::BTreeMap<&str, i64> = Default::default();
    for order in orders.iter() {
        *totals.entry(order.customer.as_str()).or_default() += order.amount_cents;
    }
    totals.into_iter().collect()
}

const TABLES: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS idem_bh_orders (order_id VARCHAR(191) NOT NULL, customer VARCHAR(191) NOT NULL, amount_cents BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS idem_bh_balances (customer VARCHAR(191) PRIMARY KEY, cents BIGINT NOT NULL)",
];

macro_rules! batch_suite {
    ($module:ident, $store:ident, $db:ty, $inbox:ty, $pool:expr, $upsert:literal, $applied:literal, $balances:literal) => {
        mod $module {
            use super::*;
            use crate::common::broker::{self, amqp_url};
            use crate::common::running::{DEADLINE, start};
            use crate::common::{unique, wait_until};
            use idem::rabbitmq::{RabbitConfig, RabbitTransport};
            use idem::transport::{QueueSpec, Transport};
            use idem::{Batch, BatchError, Envelope, Outcome, RetryPolicy, Runtime, idempotent};
            use std::time::Duration;

            /// Writes the batch set-based: one multi-row insert of the orders, one multi-row
            /// upsert of the customers' totals. Its result per order: ten times the amount.
            #[idempotent(
                store = $store,
                key = "orders.order_id",
                queue = "idem-test-batch-handlers-unset",
                batch = 200
            )]
            async fn place(
                tx: &mut sqlx::Transaction<'_, $db>,
                orders: Batch<Order>,
                seen: &Seen,
            ) -> Result<Vec<i64>, BatchError> {
                let _in_flight = seen.enter();
                script(&orders, seen)?;
                let mut insert = sqlx::QueryBuilder::<$db>::new(
                    "INSERT INTO idem_bh_orders (order_id, customer, amount_cents) ",
                );
                insert.push_values(orders.iter(), |mut row, order| {
                    row.push_bind(order.order_id.as_str())
                        .push_bind(order.customer.as_str())
                        .push_bind(order.amount_cents);
                });
                insert.build().execute(&mut **tx).await?;
                let mut upsert =
                    sqlx::QueryBuilder::<$db>::new("INSERT INTO idem_bh_balances (customer, cents) ");
                upsert.push_values(totals(&orders), |mut row, (customer, cents)| {
                    row.push_bind(customer).push_bind(cents);
                });
                upsert.push($upsert);
                upsert.build().execute(&mut **tx).await?;
                Ok(orders.iter().map(|o| o.amount_cents * 10).collect())
            }

            fn registration() -> &'static idem::registry::Registration {
                idem::registry::find(concat!(module_path!(), "::place")).unwrap()
            }

            fn order(id: &str, customer: &str, cents: i64) -> Envelope {
                let body = serde_json::json!({"order_id": id, "customer": customer, "amount_cents": cents});
                Envelope::new(body.to_string()).with_message_id(id)
            }

            async fn applied(pool: &sqlx::Pool<$db>, prefix: &str) -> HashMap<String, i64> {
                sqlx::query_as::<_, (String, i64)>($applied)
                .bind(format!("{prefix}%"))
                .fetch_all(pool)
                .await
                .unwrap()
                .into_iter()
                .collect()
            }

            async fn balances(pool: &sqlx::Pool<$db>, prefix: &str) -> HashMap<String, i64> {
                sqlx::query_as::<_, (String, i64)>($balances)
                .bind(format!("{prefix}%"))
                .fetch_all(pool)
                .await
                .unwrap()
                .into_iter()
                .collect()
            }

            /// One batch through the pipeline: copies inside it are duplicates of their first
            /// delivery with its result; the whole batch again gets every stored result back.
            #[tokio::test]
            async fn results_are_stored_per_message_and_replayed_to_duplicates() {
                let (pool, _dir) = $pool;
                let stores = idem::store::Stores::new()
                    .with(<$inbox>::new(pool.clone()))
                    .with_state(Seen::default());
                let prefix = unique("bh-r");
                let batch: Vec<Envelope> = [1, 2, 1, 3, 2]
                    .iter()
                    .map(|n| order(&format!("{prefix}-{n}"), &format!("{prefix}-c"), *n))
                    .collect();
                let outcomes = registration().invoke_batch(&stores, &batch).await.unwrap();
                let labels: Vec<_> = outcomes.iter().map(Outcome::label).collect();
                assert_eq!(labels, ["processed", "processed", "duplicate", "processed", "duplicate"]);
                let again = registration().invoke_batch(&stores, &batch).await.unwrap();
                let results: Vec<(&str, Option<i64>)> = again
                    .iter()
                    .map(|o| match o {
                        Outcome::Duplicate { output, .. } => ("duplicate", output.decode::<i64>().ok()),
                        other => (other.label(), None),
                    })
                    .collect();
                assert_eq!(
                    results,
                    [1, 2, 1, 3, 2].map(|n| ("duplicate", Some(n * 10))),
                    "each duplicate gets its own message's stored result"
                );
                // One delivery on its own (a runtime without batching): a batch of one.
                let single = order(&format!("{prefix}-4"), &format!("{prefix}-c"), 4);
                let outcome = registration().invoke(&stores, &single).await.unwrap();
                assert_eq!(outcome.label(), "processed", "{outcome:?}");
                let again = registration().invoke(&stores, &single).await.unwrap();
                let Outcome::Duplicate { output, .. } = &again else { panic!("{again:?}") };
                assert_eq!(output.decode::<i64>().unwrap(), 40);
                let applied = applied(&pool, &prefix).await;
                assert_eq!(applied.len(), 4);
                assert!(applied.values().all(|n| *n == 1), "{applied:?}");
                assert_eq!(balances(&pool, &prefix).await, HashMap::from([(format!("{prefix}-c"), 10)]));
            }

            /// One member whose claim the store refuses (a trigger on the inbox refuses its
            /// key) is settled alone, dead-lettered with reason `store`; the batch handler
            /// commits every other member once.
            #[tokio::test]
            async fn a_member_the_store_refuses_is_settled_alone() {
                let (pool, _dir) = $pool;
                let table = format!("bh_refusing_{}", std::process::id());
                let inbox = <$inbox>::new(pool.clone()).table(&table).unwrap();
                let outbox = idem::store::OutboxStore::outbox_table(&inbox).unwrap().to_owned();
                let drop_all = || async {
                    for name in [table.clone(), format!("{table}_deliveries"), format!("{table}_dead_letters"), format!("{table}_versions"), format!("{outbox}_parked"), outbox.clone()] {
                        let drop = format!("DROP TABLE IF EXISTS {name}");
                        sqlx::query(sqlx::AssertSqlSafe(drop)).execute(&pool).await.unwrap();
                    }
                };
                drop_all().await;
                inbox.migrate().await.unwrap();
                let prefix = unique("bh-refused");
                let ids: Vec<String> = (0..20).map(|n| format!("{prefix}-{n}")).collect();
                for statement in crate::common::refusing::$module(&table, &ids[7]) {
                    sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&pool).await.unwrap();
                }
                let stores = idem::store::Stores::new().with(inbox).with_state(Seen::default());
                let batch: Vec<Envelope> = ids.iter().map(|id| order(id, &format!("{prefix}-c"), 1)).collect();
                let outcomes = registration().invoke_batch(&stores, &batch).await.unwrap();
                for (n, outcome) in outcomes.iter().enumerate() {
                    match (n, outcome) {
                        (7, Outcome::Rejected(r)) => assert_eq!(r.reason, idem::RejectReason::Store, "{r}"),
                        (7, other) => panic!("the refused member: {other:?}"),
                        (_, outcome) => assert_eq!(outcome.label(), "processed", "member {n}: {outcome:?}"),
                    }
                }
                let applied = applied(&pool, &prefix).await;
                assert_eq!(applied.len(), 19, "{applied:?}");
                assert!(applied.values().all(|n| *n == 1) && !applied.contains_key(&ids[7]), "{applied:?}");
                assert_eq!(balances(&pool, &prefix).await, HashMap::from([(format!("{prefix}-c"), 19)]));
                drop_all().await;
            }

            /// Through `build()` on RabbitMQ: 600 orders (copies inside batches and across
            /// them), one failed by index, one failing transiently once, one failing the batch
            /// with no culprit. Only the transient one is retried: the batch ran again without
            /// it.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn only_the_failing_messages_of_a_batch_are_dead_lettered() {
                let stats = failing_messages(false).await;
                assert_eq!(stats.retried, 1, "only the transient failure: {stats:?}");
                assert_eq!(stats.processed, 598, "{stats:?}");
                assert_eq!(stats.duplicates, 60 + 49, "{stats:?}");
                assert_eq!(stats.panics, 0, "{stats:?}");
            }

            /// The same with one order panicking the first time: its batch is retried, and
            /// every order still takes effect once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn a_panic_retries_the_batch() {
                let stats = failing_messages(true).await;
                assert_eq!(stats.panics, 1, "{stats:?}");
                assert!(stats.retried > 1, "the panicking batch retried: {stats:?}");
            }

            async fn failing_messages(panic: bool) -> idem::Snapshot {
                let (pool, _dir) = $pool;
                let queue = unique("idem-test-bh");
                let policy =
                    RetryPolicy::new(5, Duration::from_millis(100), 2, Duration::from_secs(1)).unwrap();
                let rabbit = RabbitConfig::new(amqp_url()).connection_name(format!("idem-test:{queue}"));
                let consumer = registration().consumer();
                let mut spec = QueueSpec::new(queue.clone(), consumer);
                spec.retry_delays = policy.delays();
                RabbitTransport::new(rabbit.clone()).declare(&[spec]).await.unwrap();
                let seen = Seen::default();
                let publisher = broker::publisher().await;
                let prefix = queue.clone();
                // None of these is a multiple of 10: none has a copy inside its batch.
                let id = |n: usize| match n {
                    17 => format!("{prefix}-{n}-poison"),
                    231 => format!("{prefix}-{n}-flaky"),
                    321 => format!("{prefix}-{n}-whole"),
                    480 if panic => format!("{prefix}-{n}-panic"),
                    n => format!("{prefix}-{n}"),
                };
                let customer = |n: usize| format!("{prefix}-c{}", n % 13);
                let mut sent = Vec::new();
                for n in 0..600 {
                    sent.push(n);
                    if n % 10 == 0 {
                        sent.push(n); // a copy right behind: inside the same batch
                    }
                }
                sent.extend(0..50); // copies of the first batch's orders, in a later one
                for &n in &sent {
                    let envelope = order(&id(n), &customer(n), (n % 7) as i64 + 1);
                    broker::publish(&publisher, &queue, Some(&id(n)), &envelope.body).await;
                }
                let running = start(
                    Runtime::builder()
                        .transport(RabbitTransport::new(rabbit))
                        .store(<$inbox>::new(pool.clone()))
                        .state(seen.clone())
                        .handlers([consumer])
                        .handler_queue(consumer, &queue)
                        .retry(policy.clone())
                        .concurrency(1),
                );
                wait_until("every delivery settled", DEADLINE, || async {
                    let now = running.now();
                    now.processed + now.duplicates + now.dead_lettered >= sent.len() as u64
                })
                .await;
                let stats = running.shut_down().await;
                // Order 17 is sent twice (its copy in a later batch is refused again: a
                // dead-lettered message leaves no marker).
                assert_eq!(stats.dead_lettered, 3, "{stats:?}");
                // A panic retries its whole batch, also the messages of passes that committed
                // before it (a batch split in halves): they come back as duplicates.
                assert_eq!(stats.processed + stats.duplicates, 598 + 60 + 49, "{stats:?}");
                // One batch at a time: a batch's passes (its halves too) end before the next
                // batch's handler runs.
                assert_eq!(seen.most_at_once(), 1, "handler calls overlapped");
                assert!(
                    seen.largest_batch() > 100,
                    "the handler ran on whole batches (largest {})",
                    seen.largest_batch()
                );
                let applied = applied(&pool, &prefix).await;
                let expected: HashSet<String> =
                    (0..600).filter(|n| ![17, 321].contains(n)).map(id).collect();
                assert_eq!(applied.keys().cloned().collect::<HashSet<_>>(), expected);
                assert!(applied.values().all(|n| *n == 1), "an order applied twice");
                let mut totals: HashMap<String, i64> = HashMap::new();
                for n in (0..600).filter(|n| ![17, 321].contains(n)) {
                    *totals.entry(customer(n)).or_default() += (n % 7) as i64 + 1;
                }
                assert_eq!(balances(&pool, &format!("{prefix}-c")).await, totals);
                let dead = broker::drain(&idem::rabbitmq::dlq(&queue)).await;
                let mut dead_ids: Vec<String> = dead.iter().filter_map(|m| m.message_id()).collect();
                dead_ids.sort();
                assert_eq!(dead_ids, [id(17), id(17), id(321)]);
                let records = <$inbox>::new(pool.clone()).dead_letters(&queue).await.unwrap();
                assert!(
                    dead.iter().all(|m| records.iter().any(|r| r.reason == "handler"
                        && r.describes(m.message_id().as_deref(), &m.body))),
                    "each dead letter recorded with reason `handler`: {records:?}"
                );
                broker::delete_topology(&queue, &policy.delays()).await;
                stats
            }
        }
    };
}

async fn postgres() -> (sqlx::PgPool, Option<tempfile::TempDir>) {
    let pool = common::postgres(8).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.tests'))::text")
        .execute(&mut *tx)
        .await
        .unwrap();
    for table in TABLES {
        sqlx::query(table).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    idem::sql::PgInbox::new(pool.clone())
        .migrate()
        .await
        .unwrap();
    (pool, None)
}

async fn mysql() -> (sqlx::MySqlPool, Option<tempfile::TempDir>) {
    let pool = common::mysql(8).await;
    for table in TABLES {
        sqlx::query(table).execute(&pool).await.unwrap();
    }
    idem::sql::MySqlInbox::new(pool.clone())
        .migrate()
        .await
        .unwrap();
    (pool, None)
}

async fn sqlite() -> (sqlx::SqlitePool, Option<tempfile::TempDir>) {
    let (pool, dir) = common::sqlite(4).await;
    for table in TABLES {
        sqlx::query(table).execute(&pool).await.unwrap();
    }
    idem::sql::SqliteInbox::new(pool.clone())
        .migrate()
        .await
        .unwrap();
    (pool, Some(dir))
}

batch_suite!(
    postgres,
    Postgres,
    sqlx::Postgres,
    idem::sql::PgInbox,
    postgres().await,
    " ON CONFLICT (customer) DO UPDATE SET cents = idem_bh_balances.cents + excluded.cents",
    "SELECT order_id, count(*) FROM idem_bh_orders WHERE order_id LIKE $1 GROUP BY order_id",
    "SELECT customer, cents FROM idem_bh_balances WHERE customer LIKE $1"
);
batch_suite!(
    mysql,
    MySql,
    sqlx::MySql,
    idem::sql::MySqlInbox,
    mysql().await,
    " ON DUPLICATE KEY UPDATE cents = cents + VALUES(cents)",
    "SELECT order_id, CAST(count(*) AS SIGNED) FROM idem_bh_orders WHERE order_id LIKE ? GROUP BY order_id",
    "SELECT customer, cents FROM idem_bh_balances WHERE customer LIKE ?"
);
batch_suite!(
    sqlite,
    Sqlite,
    sqlx::Sqlite,
    idem::sql::SqliteInbox,
    sqlite().await,
    " ON CONFLICT (customer) DO UPDATE SET cents = idem_bh_balances.cents + excluded.cents",
    "SELECT order_id, count(*) FROM idem_bh_orders WHERE order_id LIKE ? GROUP BY order_id",
    "SELECT customer, cents FROM idem_bh_balances WHERE customer LIKE ?"
);

/// On MariaDB, under the batch handler, with the default retry policy: the broker connection
/// closed under load, then the database cut off (a TCP proxy in front of it) and restored: the
/// batches wait for the store (no retry, no attempt spent), every order takes effect once,
/// nothing is dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_mariadb_a_closed_connection_and_an_outage_lose_and_double_nothing() {
    use common::broker::{self, amqp_url};
    use common::running::{DEADLINE, start};
    use common::{unique, wait_until};
    use idem::rabbitmq::{RabbitConfig, RabbitTransport};
    use idem::transport::{QueueSpec, Transport};

    let (direct, _) = mysql().await;
    let (proxy, proxied) = common::proxy::mysql().await;
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .connect(&proxied)
        .await
        .unwrap();
    let consumer = "batch_handlers::mysql::place";
    let queue = unique("idem-test-bh-outage");
    let policy = idem::RetryPolicy::default();
    let rabbit = RabbitConfig::new(amqp_url()).connection_name(format!("idem-test:{queue}"));
    let mut spec = QueueSpec::new(queue.clone(), consumer);
    spec.retry_delays = policy.delays();
    RabbitTransport::new(rabbit.clone())
        .declare(&[spec])
        .await
        .unwrap();
    const ORDERS: usize = 1000;
    let publisher = broker::publisher().await;
    let publish = |range: std::ops::Range<usize>| {
        let (publisher, queue) = (&publisher, &queue);
        async move {
            for n in range {
                let id = format!("{queue}-{n}");
                let body = serde_json::json!({"order_id": id, "customer": format!("{queue}-c{}", n % 7), "amount_cents": 3});
                broker::publish(publisher, queue, Some(&id), body.to_string().as_bytes()).await;
            }
        }
    };
    // The second half is published once the database is cut off, so that it meets the outage
    // however fast the first half went.
    publish(0..ORDERS / 2).await;
    let running = start(
        idem::Runtime::builder()
            .transport(RabbitTransport::new(rabbit))
            .store(idem::sql::MySqlInbox::new(pool))
            .state(Seen::default())
            .handlers([consumer])
            .handler_queue(consumer, &queue)
            .retry(policy.clone())
            .batch(50)
            .concurrency(1),
    );
    wait_until("some progress", DEADLINE, || async {
        running.now().processed >= 100
    })
    .await;
    assert!(broker::close_connections(&format!("idem-test:{queue}")) >= 1);
    wait_until(
        "progress after the broker connection closed",
        DEADLINE,
        || async { running.now().processed >= 300 },
    )
    .await;
    proxy.cut();
    publish(ORDERS / 2..ORDERS).await;
    // Every order of the second half is published by now, during the outage; the batch that
    // met it waits (however few members it has: the consumer may have caught up and taken the
    // second half as it came), and the rest wait behind it in the queue.
    wait_until("a batch waiting for the store", DEADLINE, || async {
        running.now().pauses >= 1 && running.now().unavailable >= 1
    })
    .await;
    proxy.restore();
    let count = || async {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT CAST(count(*) AS SIGNED), CAST(count(DISTINCT order_id) AS SIGNED) FROM idem_bh_orders WHERE order_id LIKE ?",
        )
        .bind(format!("{queue}-%"))
        .fetch_one(&direct)
        .await
        .unwrap()
    };
    wait_until("every order applied", DEADLINE, || async {
        count().await.1 == ORDERS as i64
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.dead_lettered, seen.retried), (0, 0), "{seen:?}");
    assert_eq!(
        count().await,
        (ORDERS as i64, ORDERS as i64),
        "each order once"
    );
    let cents: i64 = sqlx::query_scalar(
        "SELECT CAST(COALESCE(sum(cents), 0) AS SIGNED) FROM idem_bh_balances WHERE customer LIKE ?",
    )
    .bind(format!("{queue}-c%"))
    .fetch_one(&direct)
    .await
    .unwrap();
    assert_eq!(cents, 3 * ORDERS as i64, "every amount added once");
    broker::delete_topology(&queue, &policy.delays()).await;
}
