//! The inbox against real databases: PostgreSQL (at `DATABASE_URL`), MariaDB/MySQL (at
//! `MYSQL_URL`) and SQLite (a temporary file). One suite, instantiated once per database.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use std::path::Path;

const SCHEMA: [&str; 2] = [
    "CREATE TABLE IF NOT EXISTS idem_test_effects (consumer TEXT NOT NULL, key TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS idem_test_balances (customer TEXT PRIMARY KEY, cents BIGINT NOT NULL)",
];

/// The test's own statements, in each dialect's placeholders and quoting.
struct Sql {
    insert_effect: &'static str,
    upsert_balance: &'static str,
    balance: &'static str,
    count_effects: &'static str,
    count_inbox: &'static str,
    count_custom: &'static str,
    /// Inserts a balance row that exists already: a primary key violation.
    insert_balance: &'static str,
}

const PORTABLE_SQL: Sql = Sql {
    insert_effect: "INSERT INTO idem_test_effects (consumer, key, amount_cents) VALUES ($1, $2, $3)",
    upsert_balance: "INSERT INTO idem_test_balances (customer, cents) VALUES ($1, $2)
        ON CONFLICT (customer) DO UPDATE SET cents = idem_test_balances.cents + excluded.cents",
    balance: "SELECT cents FROM idem_test_balances WHERE customer = $1",
    count_effects: "SELECT count(*) FROM idem_test_effects WHERE consumer = $1 AND key = $2",
    count_inbox: "SELECT count(*) FROM idem_inbox WHERE consumer = $1 AND key = $2",
    count_custom: "SELECT count(*) FROM idem_inbox_custom WHERE key = $1",
    insert_balance: "INSERT INTO idem_test_balances (customer, cents) VALUES ($1, 0)",
};

const MYSQL_SQL: Sql = Sql {
    insert_effect: "INSERT INTO idem_test_effects (consumer, `key`, amount_cents) VALUES (?, ?, ?)",
    upsert_balance: "INSERT INTO idem_test_balances (customer, cents) VALUES (?, ?)
        ON DUPLICATE KEY UPDATE cents = cents + VALUES(cents)",
    balance: "SELECT cents FROM idem_test_balances WHERE customer = ?",
    count_effects: "SELECT count(*) FROM idem_test_effects WHERE consumer = ? AND `key` = ?",
    count_inbox: "SELECT count(*) FROM idem_inbox WHERE consumer = ? AND `key` = ?",
    count_custom: "SELECT count(*) FROM idem_inbox_custom WHERE `key` = ?",
    insert_balance: "INSERT INTO idem_test_balances (customer, cents) VALUES (?, 0)",
};

async fn mysql_setup(
    connections: u32,
    _: Option<&Path>,
) -> (sqlx::MySqlPool, Option<tempfile::TempDir>) {
    let pool = common::mysql(connections).await;
    for statement in [
        "CREATE TABLE IF NOT EXISTS idem_test_effects (consumer VARCHAR(191) NOT NULL,
            `key` VARCHAR(191) NOT NULL, amount_cents BIGINT NOT NULL) ENGINE = InnoDB",
        "CREATE TABLE IF NOT EXISTS idem_test_balances (customer VARCHAR(191) PRIMARY KEY,
            cents BIGINT NOT NULL) ENGINE = InnoDB",
    ] {
        sqlx::query(statement)
            .execute(&pool)
            .await
            .expect("test schema");
    }
    (pool, None)
}

/// How many sessions are inside a claim. (InnoDB's lock-wait tables list only the waiters that
/// have reached the lock manager, which under 32 copies is not all of the blocked ones; the
/// process list shows every statement in flight.) The other tests of the suite run claims too,
/// so this may count a few of theirs: the copies then overlap a little less, and still must
/// yield one effect.
async fn mysql_lock_waiters(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    _: &sqlx::MySqlPool,
) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.PROCESSLIST
         WHERE info LIKE 'INSERT IGNORE INTO `idem_inbox`%' AND id <> CONNECTION_ID()",
    )
    .fetch_one(&mut **tx)
    .await
    .expect("INNODB_LOCK_WAITS")
}

async fn pg_setup(connections: u32, _: Option<&Path>) -> (sqlx::PgPool, Option<tempfile::TempDir>) {
    let pool = common::postgres(connections).await;
    let mut tx = pool.begin().await.expect("begin");
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.tests'))::text")
        .execute(&mut *tx)
        .await
        .expect("lock");
    for statement in SCHEMA {
        sqlx::query(statement)
            .execute(&mut *tx)
            .await
            .expect("test schema");
    }
    tx.commit().await.expect("commit");
    (pool, None)
}

async fn sqlite_setup(
    connections: u32,
    path: Option<&Path>,
) -> (sqlx::SqlitePool, Option<tempfile::TempDir>) {
    let (pool, dir) = match path {
        Some(path) => (common::sqlite_at(path, connections).await, None),
        None => {
            let (pool, dir) = common::sqlite(connections).await;
            (pool, Some(dir))
        }
    };
    for statement in SCHEMA {
        sqlx::query(statement)
            .execute(&pool)
            .await
            .expect("test schema");
    }
    (pool, dir)
}

/// How many transactions wait on a lock this transaction holds.
async fn pg_lock_waiters(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_locks WHERE locktype = 'transactionid' AND NOT granted
         AND transactionid = (txid_current() % 4294967296)::text::xid",
    )
    .fetch_one(&mut **tx)
    .await
    .expect("pg_locks")
}

/// SQLite shows no queue on its write lock, but a writer holds a connection of the pool while
/// it waits for it: with this transaction holding the lock (`BEGIN IMMEDIATE`), every other
/// connection taken from the pool belongs to a copy whose `BEGIN IMMEDIATE` queues behind this
/// one (the tests' copies take a connection only to claim).
async fn sqlite_lock_waiters(
    _: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    pool: &sqlx::SqlitePool,
) -> i64 {
    let taken = pool
        .size()
        .saturating_sub(u32::try_from(pool.num_idle()).unwrap_or(u32::MAX));
    i64::from(taken) - 1
}

/// How many sessions wait for a lock inside a statement on the inbox `table`.
/// (The activity view is read once per transaction unless its snapshot is cleared.)
async fn pg_claims_waiting(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    _: &sqlx::PgPool,
    table: &str,
) -> i64 {
    sqlx::query("SELECT pg_stat_clear_snapshot()")
        .execute(&mut **tx)
        .await
        .expect("pg_stat_clear_snapshot");
    sqlx::query_scalar(
        "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock'
         AND query LIKE '%\"' || $1 || '\"%' AND pid <> pg_backend_pid()",
    )
    .bind(table)
    .fetch_one(&mut **tx)
    .await
    .expect("pg_stat_activity")
}

/// How many sessions are inside a claim on the inbox `table` (see [`mysql_lock_waiters`]).
async fn mysql_claims_waiting(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    _: &sqlx::MySqlPool,
    table: &str,
) -> i64 {
    sqlx::query_scalar(
        "SELECT count(*) FROM information_schema.PROCESSLIST
         WHERE info LIKE CONCAT('INSERT IGNORE INTO `', ?, '`%') AND id <> CONNECTION_ID()",
    )
    .bind(table)
    .fetch_one(&mut **tx)
    .await
    .expect("PROCESSLIST")
}

/// SQLite writers queue on the file lock, which nothing shows: the connections other claims
/// hold while they wait for it (see [`sqlite_lock_waiters`]).
async fn sqlite_claims_waiting(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    pool: &sqlx::SqlitePool,
    _: &str,
) -> i64 {
    sqlite_lock_waiters(tx, pool).await
}

macro_rules! inbox_suite {
    ($module:ident, $store:ident, $db:ty, $inbox:ty, $setup:ident, $lock_waiters:ident, $claims_waiting:ident, $sql:ident, $refusing:ident) => {
        mod $module {
            use super::common::{unique, wait_until};
            use idem::{Context, Envelope, HandlerError, Outcome, RejectReason, idempotent};
use idem::store::{Stores};
            use serde::{Deserialize, Serialize};
            use std::collections::{BTreeSet, HashMap, VecDeque};
            use std::sync::{Arc, Mutex};
            use std::time::Duration;

            type Tx<'c> = sqlx::Transaction<'c, $db>;
            type Pool = sqlx::Pool<$db>;

            #[derive(Debug, Deserialize)]
            struct Order {
                order_id: String,
                customer: String,
                amount_cents: i64,
            }

            #[derive(Debug, PartialEq, Serialize, Deserialize)]
            struct Receipt {
                balance: i64,
            }

            /// What the `record` handler does after its writes, per key, in order.
            #[derive(Debug)]
            enum Step {
                FailTransient,
                FailPermanent,
                /// Insert the customer's balance row again: the database refuses it.
                ViolateConstraint,
                AwaitLockWaiters(i64),
                /// Wait for that many waiters, then fail permanently.
                AwaitLockWaitersThenFail(i64),
                /// Wait until that many sessions wait inside a claim on the inbox table named.
                AwaitClaimsWaiting(String, i64),
                SignalAndHang,
            }

            /// The `record` handler's script, given to it as state; clones share it.
            #[derive(Clone, Default)]
            pub(super) struct Scripts(Arc<Mutex<Scripted>>);

            #[derive(Default)]
            struct Scripted {
                /// The fixture's pool, whose connections in use show SQLite's waiting writers.
                pool: Option<Pool>,
                steps: HashMap<String, VecDeque<Step>>,
                /// Keys whose handler has written and now hangs.
                signalled: BTreeSet<String>,
            }

            impl Scripts {
                fn set(&self, key: &str, steps: Vec<Step>) {
                    self.0.lock().unwrap().steps.insert(key.to_owned(), steps.into());
                }

                fn pool(&self) -> Pool {
                    self.0.lock().unwrap().pool.clone().expect("the fixture's pool")
                }

                fn next_step(&self, key: &str) -> Option<Step> {
                    self.0.lock().unwrap().steps.get_mut(key)?.pop_front()
                }

                /// Whether the handler of `key` has taken its scripted steps (it has run, and
                /// holds its claim while it follows the last one).
                fn started(&self, key: &str) -> bool {
                    self.0.lock().unwrap().steps.get(key).is_none_or(VecDeque::is_empty)
                }

                fn signalled(&self, key: &str) -> bool {
                    self.0.lock().unwrap().signalled.contains(key)
                }

                /// Whether the handler of `key` signalled since the last call.
                fn take_signal(&self, key: &str) -> bool {
                    self.0.lock().unwrap().signalled.remove(key)
                }
            }

            async fn apply(tx: &mut Tx<'_>, consumer: &str, key: &str, customer: &str, cents: i64) -> Result<i64, sqlx::Error> {
                sqlx::query(super::$sql.insert_effect)
                    .bind(consumer)
                    .bind(key)
                    .bind(cents)
                    .execute(&mut **tx)
                    .await?;
                sqlx::query(super::$sql.upsert_balance)
                    .bind(customer)
                    .bind(cents)
                    .execute(&mut **tx)
                    .await?;
                sqlx::query_scalar(super::$sql.balance)
                    .bind(customer)
                    .fetch_one(&mut **tx)
                    .await
            }

            async fn await_lock_waiters(tx: &mut Tx<'_>, pool: &Pool, n: i64) {
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                while super::$lock_waiters(tx, pool).await < n {
                    assert!(std::time::Instant::now() < deadline, "{n} copies never queued behind the claim");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }

            async fn await_claims_waiting(tx: &mut Tx<'_>, pool: &Pool, table: &str, n: i64) {
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                while super::$claims_waiting(tx, pool, table).await < n {
                    assert!(std::time::Instant::now() < deadline, "{n} claims never waited on {table}");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            }

            /// Records an order (effect row, balance increment), then follows its script.
            #[idempotent(store = $store, key = "order.order_id")]
            async fn record(tx: &mut Tx<'_>, order: Order, ctx: &Context<'_>, scripts: &Scripts) -> Result<Receipt, HandlerError> {
                let balance = apply(tx, ctx.consumer(), &order.order_id, &order.customer, order.amount_cents).await?;
                match scripts.next_step(&order.order_id) {
                    None => {}
                    Some(Step::FailTransient) => return Err(HandlerError::transient("scripted transient failure")),
                    Some(Step::FailPermanent) => return Err(HandlerError::permanent("scripted permanent failure")),
                    Some(Step::ViolateConstraint) => {
                        sqlx::query(super::$sql.insert_balance).bind(&order.customer).execute(&mut **tx).await?;
                    }
                    Some(Step::AwaitLockWaiters(n)) => await_lock_waiters(tx, &scripts.pool(), n).await,
                    Some(Step::AwaitClaimsWaiting(table, n)) => await_claims_waiting(tx, &scripts.pool(), &table, n).await,
                    Some(Step::AwaitLockWaitersThenFail(n)) => {
                        await_lock_waiters(tx, &scripts.pool(), n).await;
                        return Err(HandlerError::permanent("scripted permanent failure"));
                    }
                    Some(Step::SignalAndHang) => {
                        scripts.0.lock().unwrap().signalled.insert(order.order_id.clone());
                        println!("IDEM-WRITTEN");
                        std::future::pending::<()>().await;
                    }
                }
                Ok(Receipt { balance })
            }

            /// A second subscriber of the same orders.
            #[idempotent(store = $store, key = "order.order_id")]
            async fn audit(tx: &mut Tx<'_>, order: Order, ctx: &Context<'_>) -> Result<(), HandlerError> {
                apply(tx, ctx.consumer(), &order.order_id, &format!("audit-{}", order.customer), order.amount_cents).await?;
                Ok(())
            }

            #[idempotent(store = $store)]
            async fn by_message_id(tx: &mut Tx<'_>, order: Order, ctx: &Context<'_>) -> Result<String, HandlerError> {
                apply(tx, ctx.consumer(), ctx.idempotency_key(), &order.customer, order.amount_cents).await?;
                Ok(ctx.idempotency_key().to_owned())
            }

            #[idempotent(store = $store, key = "header:x-idempotency-key")]
            async fn by_header(tx: &mut Tx<'_>, order: Order, ctx: &Context<'_>) -> Result<String, HandlerError> {
                apply(tx, ctx.consumer(), ctx.idempotency_key(), &order.customer, order.amount_cents).await?;
                Ok(ctx.idempotency_key().to_owned())
            }

            #[idempotent(store = $store, key = "cloudevents")]
            async fn by_cloudevent(tx: &mut Tx<'_>, order: Order, ctx: &Context<'_>) -> Result<String, HandlerError> {
                apply(tx, ctx.consumer(), ctx.idempotency_key(), &order.customer, order.amount_cents).await?;
                Ok(ctx.idempotency_key().to_owned())
            }

            struct Fixture {
                pool: Pool,
                stores: Stores,
                scripts: Scripts,
                _dir: Option<tempfile::TempDir>,
            }

            async fn fixture(connections: u32) -> Fixture {
                fixture_at(connections, None).await
            }

            async fn fixture_at(connections: u32, path: Option<&std::path::Path>) -> Fixture {
                let (pool, dir) = super::$setup(connections, path).await;
                let inbox = <$inbox>::new(pool.clone());
                inbox.migrate().await.expect("migrate");
                // Every connection back in the pool before a test counts those taken.
                wait_until("the pool's connections to be idle", Duration::from_secs(10), || async {
                    pool.num_idle() == pool.size() as usize
                })
                .await;
                let scripts = Scripts::default();
                scripts.0.lock().unwrap().pool = Some(pool.clone());
                Fixture { pool, stores: Stores::new().with(inbox).with_state(scripts.clone()), scripts, _dir: dir }
            }

            fn consumer(name: &str) -> String {
                format!("{}::{name}", module_path!())
            }

            async fn run(f: &Fixture, handler: &str, envelope: &Envelope) -> Outcome {
                let registration = idem::registry::find(&consumer(handler)).expect("registered handler");
                registration.invoke(&f.stores, envelope).await.expect("store present")
            }

            fn order(id: &str, customer: &str, cents: i64) -> Envelope {
                let body = serde_json::json!({"order_id": id, "customer": customer, "amount_cents": cents});
                Envelope::new(body.to_string()).with_message_id(id)
            }

            async fn effects(pool: &Pool, handler: &str, key: &str) -> i64 {
                sqlx::query_scalar(super::$sql.count_effects)
                    .bind(consumer(handler))
                    .bind(key)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            async fn balance(pool: &Pool, customer: &str) -> Option<i64> {
                sqlx::query_scalar(super::$sql.balance)
                    .bind(customer)
                    .fetch_optional(pool)
                    .await
                    .unwrap()
            }

            async fn inbox_rows(pool: &Pool, handler: &str, key: &str) -> i64 {
                sqlx::query_scalar(super::$sql.count_inbox)
                    .bind(consumer(handler))
                    .bind(key)
                    .fetch_one(pool)
                    .await
                    .unwrap()
            }

            #[tokio::test]
            async fn same_message_twice_has_one_effect_and_replays_the_outcome() {
                let f = fixture(2).await;
                let (id, customer) = (unique("o"), unique("c"));
                let first = run(&f, "record", &order(&id, &customer, 250)).await;
                let Outcome::Processed { output, .. } = &first else { panic!("{first:?}") };
                assert_eq!(output.decode::<Receipt>().unwrap(), Receipt { balance: 250 });

                let second = run(&f, "record", &order(&id, &customer, 250).with_attempt(2)).await;
                let Outcome::Duplicate { key, output } = &second else { panic!("{second:?}") };
                assert_eq!(key, &id);
                assert_eq!(output.decode::<Receipt>().unwrap(), Receipt { balance: 250 });
                assert_eq!(effects(&f.pool, "record", &id).await, 1);
                assert_eq!(balance(&f.pool, &customer).await, Some(250));
                assert_eq!(inbox_rows(&f.pool, "record", &id).await, 1);
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn thirty_two_concurrent_copies_have_one_effect() {
                const COPIES: usize = 32;
                let f = Arc::new(fixture(COPIES as u32).await);
                let (id, customer) = (unique("o"), unique("c"));
                // The winner holds its transaction open until every other copy queues on its key.
                f.scripts.set(&id, vec![Step::AwaitLockWaiters(COPIES as i64 - 1)]);
                let start = Arc::new(tokio::sync::Barrier::new(COPIES));
                let tasks: Vec<_> = (0..COPIES)
                    .map(|_| {
                        let (f, start, envelope) = (f.clone(), start.clone(), order(&id, &customer, 100));
                        tokio::spawn(async move {
                            start.wait().await;
                            run(&f, "record", &envelope).await
                        })
                    })
                    .collect();
                let mut labels = HashMap::new();
                for task in tasks {
                    let outcome = task.await.unwrap();
                    if let Outcome::Duplicate { output, .. } = &outcome {
                        assert_eq!(output.decode::<Receipt>().unwrap(), Receipt { balance: 100 });
                    }
                    *labels.entry(outcome.label()).or_insert(0) += 1;
                }
                assert_eq!(labels, HashMap::from([("processed", 1), ("duplicate", COPIES - 1)]));
                assert_eq!(effects(&f.pool, "record", &id).await, 1);
                assert_eq!(balance(&f.pool, &customer).await, Some(100));
            }

            /// The poison limit counts only runs of the handler on redeliveries that started and
            /// never settled (here the run is dropped mid-handler, as a consumer that dies there
            /// leaves it), each counted in a transaction of its own. Runs that settled (transient
            /// failures) do not count; past the limit the message is refused as `poison` and
            /// nothing runs, and settling that refusal leaves the runs that died counted; a fresh
            /// delivery of the key (a replay) still runs; a copy of a completed key is a duplicate
            /// whatever its count.
            #[tokio::test]
            async fn only_runs_that_never_settled_count_toward_the_poison_limit() {
                let f = fixture(2).await;
                let stores = Stores::new()
                    .with(<$inbox>::new(f.pool.clone()))
                    .with_state(f.scripts.clone())
                    .with_poison_limit(Some(2));
                let record = idem::registry::find(&consumer("record")).expect("registered handler");
                let (id, customer) = (unique("o"), unique("c"));
                let mut redelivered = order(&id, &customer, 9);
                redelivered.redelivered = true;
                let dies_in_handler = || async {
                    let run = record.invoke(&stores, &redelivered);
                    let signalled = wait_until("the handler ran", Duration::from_secs(20), || async {
                        f.scripts.take_signal(&id)
                    });
                    tokio::select! {
                        outcome = run => panic!("the run was to hang: {outcome:?}"),
                        () = signalled => {}
                    }
                };
                // Three redeliveries whose handler failed transiently: settled, never counted.
                f.scripts.set(&id, vec![Step::FailTransient, Step::FailTransient, Step::FailTransient]);
                for _ in 0..3 {
                    let outcome = record.invoke(&stores, &redelivered).await.unwrap();
                    assert_eq!(outcome.label(), "retry", "{outcome:?}");
                }
                // Two redeliveries whose consumer died in the handler: the next one is refused.
                f.scripts.set(&id, vec![Step::SignalAndHang, Step::SignalAndHang]);
                dies_in_handler().await;
                dies_in_handler().await;
                let third = record.invoke(&stores, &redelivered).await.unwrap();
                let Outcome::Rejected(r) = &third else { panic!("{third:?}") };
                assert_eq!((r.reason, r.key.as_deref()), (RejectReason::Poison, Some(id.as_str())));
                assert!(r.message.contains("started 2 times"), "{r}");
                assert_eq!(effects(&f.pool, "record", &id).await, 0);
                assert_eq!(inbox_rows(&f.pool, "record", &id).await, 0);

                // Settling the refusal took back its own run only: the two deaths still count,
                // and the next redelivery is refused too.
                let fourth = record.invoke(&stores, &redelivered).await.unwrap();
                assert!(
                    matches!(&fourth, Outcome::Rejected(r) if r.reason == RejectReason::Poison),
                    "{fourth:?}"
                );
                // A replay (a fresh delivery) completes the key: a redelivered copy of it is a
                // duplicate, past the limit or not.
                let replayed = record.invoke(&stores, &order(&id, &customer, 9)).await.unwrap();
                assert_eq!(replayed.label(), "processed", "{replayed:?}");
                let copy = record.invoke(&stores, &redelivered).await.unwrap();
                assert_eq!(copy.label(), "duplicate", "{copy:?}");
                assert_eq!(balance(&f.pool, &customer).await, Some(9));
            }

            /// A dead letter's record: written in a transaction of its own, replaced (not added)
            /// when the same key is dead-lettered again but keeping the earliest first failure,
            /// read back by queue and by key with its history, tied to its message;
            /// `clear_failure` removes the poison count but keeps a completed row and the
            /// record, which goes only while no later failure replaced it; `forget` removes
            /// everything.
            #[tokio::test]
            async fn a_dead_letter_record_is_replaced_cleared_and_forgotten() {
                use idem::store::DeadLetterStore;
                let f = fixture(2).await;
                let inbox = <$inbox>::new(f.pool.clone());
                let (id, customer, queue) = (unique("o"), unique("c"), unique("q"));
                let envelope = order(&id, &customer, 5);
                let letter = |reason: &str| idem::transport::DeadLetter::new(
                    reason,
                    format!("{reason} detail"),
                    consumer("record"),
                    Some(id.clone()),
                    2,
                );
                let now = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_millis() as i64;
                let (first, hour) = (now - 60_000, Duration::from_secs(3600));
                for (reason, began, retention) in [
                    ("conflict", first, Duration::from_secs(7 * 86_400)),
                    ("handler", now - 1_000, hour),
                ] {
                    let record = idem::store::DeadLetterRecord::new(&letter(reason), &envelope, &queue)
                        .with_history(Some(began), retention);
                    inbox.record_dead_letter(&record).await.unwrap();
                }
                let records = inbox.dead_letters(&queue).await.unwrap();
                assert_eq!(records.len(), 1, "replaced, not added: {records:?}");
                let r = &records[0];
                assert_eq!((r.reason.as_str(), r.key.as_str(), r.keyed, r.attempts), ("handler", id.as_str(), true, 2));
                assert_eq!(r.first_failed_at_ms, Some(first), "the earliest first failure is kept");
                assert_eq!(r.retention, Some(hour), "the latest retention");
                assert_eq!(r.dedup_window_ends_ms(), Some(first + 3_600_000));
                assert!((r.dead_lettered_at_ms - now).abs() < 60_000, "{r:?}");
                assert!(r.describes(envelope.message_id.as_deref(), &envelope.body));
                assert!(!r.describes(Some("another id"), &envelope.body));
                assert_eq!(inbox.dead_letter(&consumer("record"), &id).await.unwrap().as_ref(), Some(r));

                // A key longer than a database's key column (MySQL's 191 characters) is still
                // recorded, under its fingerprint there.
                let (long_queue, long_key) = (unique("q"), "k".repeat(300));
                let mut long = letter("decode");
                long.key = Some(long_key.clone());
                let record = idem::store::DeadLetterRecord::new(&long, &envelope, &long_queue);
                inbox.record_dead_letter(&record).await.unwrap();
                let records = inbox.dead_letters(&long_queue).await.unwrap();
                assert_eq!(records.len(), 1);
                assert!(records[0].key == long_key || records[0].key.starts_with("sha256:"));
                assert!(records[0].describes(envelope.message_id.as_deref(), &envelope.body));

                // The key was processed after all: clearing its failure keeps the completed row.
                assert_eq!(run(&f, "record", &envelope).await.label(), "processed");
                let cleared = inbox.clear_failure(&consumer("record"), &id).await.unwrap();
                assert_eq!((cleared.row, cleared.dead_letter), (false, false));
                assert_eq!(inbox.dead_letters(&queue).await.unwrap().len(), 1);
                // A record read before a later failure replaced it is not removed; the one
                // read now is.
                let mut earlier = r.clone();
                earlier.dead_lettered_at_ms -= 1;
                assert!(!inbox.forget_dead_letter(&earlier).await.unwrap());
                assert!(inbox.forget_dead_letter(r).await.unwrap());
                assert!(inbox.dead_letters(&queue).await.unwrap().is_empty());
                // A record written without a history takes the time it is written.
                let plain = idem::store::DeadLetterRecord::new(&letter("handler"), &envelope, &queue);
                inbox.record_dead_letter(&plain).await.unwrap();
                let r = inbox.dead_letter(&consumer("record"), &id).await.unwrap().unwrap();
                assert_eq!(r.first_failed_at_ms, Some(r.dead_lettered_at_ms), "{r:?}");
                assert_eq!((r.retention, r.dedup_window_ends_ms()), (None, None));
                assert!(inbox.forget_dead_letter(&r).await.unwrap());
                let shown = inbox.show(&consumer("record"), &id).await.unwrap();
                assert_eq!(shown.row.map(|row| row.status).as_deref(), Some("completed"));
                let stats = inbox.stats().await.unwrap();
                assert!(stats.statuses.iter().any(|s| s.consumer == consumer("record") && s.status == "completed" && s.rows >= 1));
                // Forgotten: the next copy is processed as new.
                let forgot = inbox.forget(&consumer("record"), &id).await.unwrap();
                assert!(forgot.row);
                assert_eq!(run(&f, "record", &envelope).await.label(), "processed");
                assert_eq!(balance(&f.pool, &customer).await, Some(10));
            }

            /// `?` on the database's own refusal: the store classifies it (a key violation is
            /// permanent), and nothing the handler wrote is kept.
            #[tokio::test]
            async fn a_constraint_violation_in_the_handler_is_classified_by_the_store() {
                let f = fixture(2).await;
                let (id, customer) = (unique("o"), unique("c"));
                f.scripts.set(&id, vec![Step::ViolateConstraint]);
                let failed = run(&f, "record", &order(&id, &customer, 40)).await;
                let Outcome::Rejected(r) = &failed else { panic!("{failed:?}") };
                assert_eq!(r.reason, RejectReason::Handler);
                assert!(r.message.starts_with("permanent failure"), "{r}");
                assert_eq!(inbox_rows(&f.pool, "record", &id).await, 0);
                assert_eq!(effects(&f.pool, "record", &id).await, 0);
                assert_eq!(balance(&f.pool, &customer).await, None);
            }

            #[tokio::test]
            async fn failed_handler_rolls_back_everything_and_a_retry_processes_once() {
                let f = fixture(2).await;
                for (step, label) in [(Step::FailTransient, "retry"), (Step::FailPermanent, "rejected")] {
                    let (id, customer) = (unique("o"), unique("c"));
                    f.scripts.set(&id, vec![step]);
                    let failed = run(&f, "record", &order(&id, &customer, 70)).await;
                    assert_eq!(failed.label(), label, "{failed:?}");
                    assert_eq!(failed.key(), Some(id.as_str()));
                    if let Outcome::Rejected(r) = &failed {
                        assert_eq!(r.reason, RejectReason::Handler);
                        assert!(r.message.contains("scripted permanent failure"), "{r}");
                    }
                    assert_eq!(inbox_rows(&f.pool, "record", &id).await, 0);
                    assert_eq!(effects(&f.pool, "record", &id).await, 0);
                    assert_eq!(balance(&f.pool, &customer).await, None);

                    let retried = run(&f, "record", &order(&id, &customer, 70).with_attempt(2)).await;
                    assert_eq!(retried.label(), "processed", "{retried:?}");
                    assert_eq!(run(&f, "record", &order(&id, &customer, 70)).await.label(), "duplicate");
                    assert_eq!(effects(&f.pool, "record", &id).await, 1);
                    assert_eq!(balance(&f.pool, &customer).await, Some(70));
                }
            }

            #[tokio::test]
            async fn a_batch_commits_together_and_a_failing_message_rolls_back_alone() {
                let f = fixture(2).await;
                let customer = unique("c");
                let ids: Vec<String> = (0..5).map(|_| unique("o")).collect();
                let [a, b, c, seen, e] = [0, 1, 2, 3, 4].map(|i| ids[i].clone());
                assert_eq!(run(&f, "record", &order(&seen, &customer, 1)).await.label(), "processed");
                // A failure rolls back the fast pass, and the batch runs again with a savepoint
                // per message: each of these fails in both passes.
                f.scripts.set(&b, vec![Step::FailPermanent, Step::FailPermanent]);
                f.scripts.set(&e, vec![Step::FailTransient, Step::FailTransient]);
                let batch = vec![
                    order(&a, &customer, 10),
                    order(&b, &customer, 20),
                    order(&c, &customer, 30),
                    order(&a, &customer, 10),
                    order(&seen, &customer, 1),
                    order(&e, &customer, 50),
                    order(&c, &customer, 31),
                    Envelope::new("not json"),
                ];
                let registration = idem::registry::find(&consumer("record")).expect("registered handler");
                let outcomes = registration.invoke_batch(&f.stores, &batch).await.expect("store present");
                let labels: Vec<&str> = outcomes.iter().map(Outcome::label).collect();
                assert_eq!(
                    labels,
                    ["processed", "rejected", "processed", "duplicate", "duplicate", "retry", "conflict", "rejected"],
                    "{outcomes:#?}"
                );
                // The copy of `a` replays the result `a` stored in the same transaction.
                let receipt: Receipt = outcomes[3].output().unwrap().decode().unwrap();
                assert_eq!(receipt, Receipt { balance: 1 + 10 });
                // The failed messages' writes and markers were rolled back to their savepoints.
                for (id, applied) in [(&a, 1), (&b, 0), (&c, 1), (&seen, 1), (&e, 0)] {
                    assert_eq!(effects(&f.pool, "record", id).await, applied, "effects of {id}");
                    assert_eq!(inbox_rows(&f.pool, "record", id).await, applied, "marker of {id}");
                }
                assert_eq!(balance(&f.pool, &customer).await, Some(1 + 10 + 30));
                // Redelivered, the failed ones are processed; nothing is applied twice.
                let again = vec![order(&b, &customer, 20), order(&e, &customer, 50), order(&a, &customer, 10)];
                let outcomes = registration.invoke_batch(&f.stores, &again).await.unwrap();
                let labels: Vec<&str> = outcomes.iter().map(Outcome::label).collect();
                assert_eq!(labels, ["processed", "processed", "duplicate"]);
                assert_eq!(balance(&f.pool, &customer).await, Some(1 + 10 + 30 + 20 + 50));
                for id in &ids {
                    assert_eq!(effects(&f.pool, "record", id).await, 1, "effects of {id}");
                }
            }

            /// Two batches sharing 150 keys, run at once on separate connections, the second
            /// in the opposite order: every key is claimed by one of them (the other sees a
            /// duplicate, or retries), and every order is applied once. On MySQL and SQLite
            /// this is the multi-row claim; on PostgreSQL the array claim.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn overlapping_batches_on_two_connections_claim_each_key_once() {
                let f = Arc::new(fixture(4).await);
                let customer = unique("c");
                let ids: Vec<String> = (0..450).map(|_| unique("o")).collect();
                let first: Vec<Envelope> = ids[..300].iter().map(|id| order(id, &customer, 1)).collect();
                let mut second: Vec<Envelope> = ids[150..].iter().map(|id| order(id, &customer, 1)).collect();
                second.reverse();
                let runs = [first, second].map(|mut batch| {
                    let f = f.clone();
                    tokio::spawn(async move {
                        let registration = idem::registry::find(&consumer("record")).unwrap();
                        let mut processed = 0;
                        while !batch.is_empty() {
                            let outcomes = registration.invoke_batch(&f.stores, &batch).await.unwrap();
                            processed += outcomes.iter().filter(|o| o.label() == "processed").count();
                            assert!(
                                outcomes.iter().all(|o| ["processed", "duplicate", "retry"].contains(&o.label())),
                                "{outcomes:?}"
                            );
                            batch = batch
                                .into_iter()
                                .zip(&outcomes)
                                .filter(|(_, o)| o.label() == "retry")
                                .map(|(envelope, _)| envelope)
                                .collect();
                        }
                        processed
                    })
                });
                let mut processed = 0;
                for run in runs {
                    processed += run.await.unwrap();
                }
                assert_eq!(processed, 450, "each key processed by one batch");
                for id in &ids {
                    assert_eq!(effects(&f.pool, "record", id).await, 1, "effects of {id}");
                    assert_eq!(inbox_rows(&f.pool, "record", id).await, 1, "marker of {id}");
                }
                assert_eq!(balance(&f.pool, &customer).await, Some(450));
            }

            /// Competing consumers on a fresh inbox (a table so small that MariaDB's optimizer
            /// scans it): two batches of one consumer with no key in common, their keys
            /// interleaved in the index, claimed at once on separate connections, 20 times over.
            /// Neither claim waits on the other's new rows, so none is ever retried (a locking
            /// read of the claimed rows scanned into the other batch's new rows and deadlocked).
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn disjoint_batches_claimed_at_once_on_a_fresh_table_never_retry() {
                let f = fixture(4).await;
                let (table, stores) = own_inbox(&f, "idem_fresh").await;
                for _ in 0..20 {
                    let ids: Vec<String> = (0..400).map(|_| unique("o")).collect();
                    let runs = [0, 1].map(|side| {
                        let stores = stores.clone();
                        let customer = unique("c");
                        let batch: Vec<Envelope> = ids
                            .iter()
                            .skip(side)
                            .step_by(2)
                            .map(|id| order(id, &customer, 1))
                            .collect();
                        tokio::spawn(async move {
                            let registration = idem::registry::find(&consumer("record")).unwrap();
                            registration.invoke_batch(&stores, &batch).await.unwrap()
                        })
                    });
                    for run in runs {
                        let outcomes = run.await.unwrap();
                        assert!(
                            outcomes.iter().all(|o| o.label() == "processed"),
                            "{:?}",
                            outcomes.iter().find(|o| o.label() != "processed")
                        );
                    }
                }
                drop_inbox(&f.pool, &table).await;
            }

            /// Two batches sharing keys, given in opposite orders, both held up inside their
            /// claims by a third transaction that holds the middle key: each batch claims its
            /// keys in key order, so neither takes a key the other is waiting to pass, and
            /// none deadlocks (a deadlock would turn one batch's messages into retries).
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn batches_sharing_keys_in_opposite_orders_never_deadlock() {
                let f = fixture(4).await;
                let (table, stores) = own_inbox(&f, "idem_lock_order").await;
                let (prefix, customer) = (unique("o"), unique("c"));
                let [a, b, z] = ["a", "b", "z"].map(|k| format!("{prefix}-{k}"));
                f.scripts.set(&b, vec![Step::AwaitClaimsWaiting(table.clone(), 2)]);
                let holder = {
                    let (stores, envelope) = (stores.clone(), order(&b, &customer, 1));
                    tokio::spawn(async move {
                        let registration = idem::registry::find(&consumer("record")).unwrap();
                        registration.invoke(&stores, &envelope).await.unwrap()
                    })
                };
                let started = || async { f.scripts.started(&b) };
                wait_until("the middle key's copy", Duration::from_secs(20), started).await;
                let runs = [[&a, &b, &z], [&z, &b, &a]].map(|keys| {
                    let stores = stores.clone();
                    let batch: Vec<Envelope> = keys.iter().map(|k| order(k, &customer, 1)).collect();
                    tokio::spawn(async move {
                        let registration = idem::registry::find(&consumer("record")).unwrap();
                        registration.invoke_batch(&stores, &batch).await.unwrap()
                    })
                });
                let mut labels = Vec::new();
                for run in runs {
                    labels.extend(run.await.unwrap().iter().map(Outcome::label));
                }
                assert_eq!(holder.await.unwrap().label(), "processed");
                assert!(labels.iter().all(|l| ["processed", "duplicate"].contains(l)), "{labels:?}");
                assert_eq!(labels.iter().filter(|l| **l == "processed").count(), 2, "{labels:?}");
                drop_inbox(&f.pool, &table).await;
            }

            /// One member of a batch whose claim the store refuses (a trigger refuses its key)
            /// is settled alone, dead-lettered with reason `store`; every other member commits,
            /// once.
            #[tokio::test]
            async fn a_member_the_store_refuses_is_settled_alone() {
                let f = fixture(2).await;
                let (table, stores) = own_inbox(&f, "refusing").await;
                let customer = unique("c");
                let ids: Vec<String> = (0..20).map(|_| unique("o")).collect();
                for statement in super::common::refusing::$refusing(&table, &ids[7]) {
                    sqlx::query(sqlx::AssertSqlSafe(statement)).execute(&f.pool).await.unwrap();
                }
                let batch: Vec<Envelope> = ids.iter().map(|id| order(id, &customer, 1)).collect();
                let registration = idem::registry::find(&consumer("record")).unwrap();
                let outcomes = registration.invoke_batch(&stores, &batch).await.unwrap();
                for (n, outcome) in outcomes.iter().enumerate() {
                    match (n, outcome) {
                        (7, Outcome::Rejected(r)) => assert_eq!(r.reason, RejectReason::Store, "{r}"),
                        (7, other) => panic!("the refused member: {other:?}"),
                        (_, outcome) => assert_eq!(outcome.label(), "processed", "member {n}: {outcome:?}"),
                    }
                }
                for (n, id) in ids.iter().enumerate() {
                    assert_eq!(effects(&f.pool, "record", id).await, i64::from(n != 7), "effects of member {n}");
                }
                assert_eq!(balance(&f.pool, &customer).await, Some(19));
                drop_inbox(&f.pool, &table).await;
            }

            /// A fresh inbox table of this process named after `name`, migrated, and stores
            /// that use it with the fixture's scripts.
            async fn own_inbox(f: &Fixture, name: &str) -> (String, Arc<Stores>) {
                let table = format!("{name}_{}", std::process::id());
                drop_inbox(&f.pool, &table).await;
                let inbox = <$inbox>::new(f.pool.clone()).table(&table).unwrap();
                inbox.migrate().await.unwrap();
                (table, Arc::new(Stores::new().with(inbox).with_state(f.scripts.clone())))
            }

            /// Drops the inbox `table` with its companion tables and its schema version.
            async fn drop_inbox(pool: &Pool, table: &str) {
                for suffix in ["", "_deliveries", "_dead_letters", "_versions"] {
                    let drop = format!("DROP TABLE IF EXISTS {table}{suffix}");
                    sqlx::query(sqlx::AssertSqlSafe(drop)).execute(pool).await.unwrap();
                }
                let forget = format!("DELETE FROM idem_schema_version WHERE inbox_table = '{table}'");
                sqlx::query(sqlx::AssertSqlSafe(forget)).execute(pool).await.unwrap();
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn transaction_dropped_before_commit_records_nothing() {
                let f = Arc::new(fixture(2).await);
                let (id, customer) = (unique("o"), unique("c"));
                f.scripts.set(&id, vec![Step::SignalAndHang]);
                let task = {
                    let (f, envelope) = (f.clone(), order(&id, &customer, 40));
                    tokio::spawn(async move { run(&f, "record", &envelope).await })
                };
                // Wait until the handler has written inside its transaction, then abandon it.
                let written = || async { f.scripts.signalled(&id) };
                wait_until("the handler's writes", Duration::from_secs(20), written).await;
                task.abort();
                assert!(task.await.unwrap_err().is_cancelled());
                assert_eq!(inbox_rows(&f.pool, "record", &id).await, 0);
                assert_eq!(effects(&f.pool, "record", &id).await, 0);

                let again = run(&f, "record", &order(&id, &customer, 40)).await;
                assert_eq!(again.label(), "processed", "{again:?}");
                assert_eq!(effects(&f.pool, "record", &id).await, 1);
                assert_eq!(balance(&f.pool, &customer).await, Some(40));
            }

            #[tokio::test]
            async fn process_killed_before_commit_records_nothing() {
                let dir = tempfile::tempdir().unwrap();
                let db = dir.path().join("crash.db");
                let (id, customer) = (unique("o"), unique("c"));
                let test = concat!(stringify!($module), "::crash_child");
                let mut child = std::process::Command::new(std::env::current_exe().unwrap())
                    .args(["--exact", test, "--include-ignored", "--nocapture", "--test-threads=1"])
                    .env("IDEM_CRASH_ORDER", &id)
                    .env("IDEM_CRASH_CUSTOMER", &customer)
                    .env("IDEM_CRASH_SQLITE", &db)
                    .stdout(std::process::Stdio::piped())
                    .spawn()
                    .unwrap();
                let stdout = child.stdout.take().unwrap();
                let written = tokio::task::spawn_blocking(move || {
                    use std::io::BufRead;
                    std::io::BufReader::new(stdout).lines().map_while(Result::ok).any(|l| l.ends_with("IDEM-WRITTEN"))
                });
                let written = tokio::time::timeout(Duration::from_secs(60), written).await;
                child.kill().unwrap(); // SIGKILL, mid-transaction
                child.wait().unwrap();
                assert!(matches!(written, Ok(Ok(true))), "the child never reached its write: {written:?}");

                let f = fixture_at(2, Some(&db)).await;
                assert_eq!(inbox_rows(&f.pool, "record", &id).await, 0);
                assert_eq!(effects(&f.pool, "record", &id).await, 0);
                let again = run(&f, "record", &order(&id, &customer, 55)).await;
                assert_eq!(again.label(), "processed", "{again:?}");
                assert_eq!(effects(&f.pool, "record", &id).await, 1);
                assert_eq!(balance(&f.pool, &customer).await, Some(55));
            }

            /// Run by `process_killed_before_commit_records_nothing` in a child process, which
            /// it kills while this handler's transaction is open.
            #[tokio::test]
            #[ignore = "child process of process_killed_before_commit_records_nothing"]
            async fn crash_child() {
                let id = std::env::var("IDEM_CRASH_ORDER").expect("run by process_killed_before_commit_records_nothing");
                let customer = std::env::var("IDEM_CRASH_CUSTOMER").unwrap();
                let db = std::path::PathBuf::from(std::env::var("IDEM_CRASH_SQLITE").unwrap());
                let f = fixture_at(1, Some(&db)).await;
                f.scripts.set(&id, vec![Step::SignalAndHang]);
                let outcome = run(&f, "record", &order(&id, &customer, 55)).await;
                panic!("the handler was meant to hang until killed, but returned {outcome:?}");
            }

            #[tokio::test]
            async fn same_key_with_a_different_body_is_a_conflict() {
                let f = fixture(2).await;
                let (id, customer) = (unique("o"), unique("c"));
                assert_eq!(run(&f, "record", &order(&id, &customer, 300)).await.label(), "processed");
                let conflict = run(&f, "record", &order(&id, &customer, 999)).await;
                assert_eq!(conflict, Outcome::Conflict { key: id.clone() });
                assert_eq!(effects(&f.pool, "record", &id).await, 1);
                assert_eq!(balance(&f.pool, &customer).await, Some(300));
            }

            #[tokio::test]
            async fn two_consumers_of_one_message_each_process_it_once() {
                let f = fixture(2).await;
                let (id, customer) = (unique("o"), unique("c"));
                let message = order(&id, &customer, 10);
                for _ in 0..2 {
                    run(&f, "record", &message).await;
                    run(&f, "audit", &message).await;
                }
                assert_eq!(effects(&f.pool, "record", &id).await, 1);
                assert_eq!(effects(&f.pool, "audit", &id).await, 1);
                assert_eq!(inbox_rows(&f.pool, "record", &id).await, 1);
                assert_eq!(inbox_rows(&f.pool, "audit", &id).await, 1);
                assert_eq!(balance(&f.pool, &customer).await, Some(10));
            }

            #[tokio::test]
            async fn every_key_source() {
                let f = fixture(2).await;
                let body = |customer: &str| {
                    serde_json::json!({"order_id": "ignored", "customer": customer, "amount_cents": 1}).to_string()
                };
                let customer = unique("c");
                let id = unique("m");
                let by_id = Envelope::new(body(&customer)).with_message_id(&id);
                let by_header = Envelope::new(body(&customer)).with_header("x-idempotency-key", id.as_str());
                let by_event = Envelope::new(body(&customer))
                    .with_header("cloudEvents:source", "/shop/orders")
                    .with_header("cloudEvents:id", id.as_str());
                let cases = [
                    ("by_message_id", by_id, id.clone(), "message_id property"),
                    ("by_header", by_header, id.clone(), "`x-idempotency-key` header"),
                    ("by_cloudevent", by_event, format!("/shop/orders {id}"), "CloudEvents `source`"),
                ];
                for (handler, envelope, key, missing) in cases {
                    let first = run(&f, handler, &envelope).await;
                    assert_eq!(first.output().unwrap().decode::<String>().unwrap(), key, "{handler}");
                    assert_eq!(run(&f, handler, &envelope).await.label(), "duplicate", "{handler}");
                    assert_eq!(effects(&f.pool, handler, &key).await, 1, "{handler}");

                    let keyless = Envelope::new(body(&customer));
                    let Outcome::Rejected(r) = run(&f, handler, &keyless).await else { panic!("{handler}") };
                    assert_eq!(r.reason, RejectReason::MissingKey, "{handler}");
                    assert!(r.message.contains(missing), "{handler}: {r}");
                }
                // The field key: one payload field, whatever the message id.
                let field_id = unique("o");
                let envelope = order(&field_id, &customer, 1).with_message_id("some-other-id");
                assert_eq!(run(&f, "record", &envelope).await.key(), Some(field_id.as_str()));
                let empty = order("", &customer, 1);
                let Outcome::Rejected(r) = run(&f, "record", &empty).await else { panic!("empty key") };
                assert_eq!(r.reason, RejectReason::MissingKey);
                assert!(r.message.contains("order.order_id"), "{r}");

                for bad in ["not json", r#"{"order_id": "x"}"#, r#"{"order_id": 5, "customer": "c", "amount_cents": 1}"#] {
                    let Outcome::Rejected(r) = run(&f, "record", &Envelope::new(bad).with_message_id("x")).await else {
                        panic!("{bad}")
                    };
                    assert_eq!(r.reason, RejectReason::Decode, "{bad}");
                    assert!(r.message.contains("Order"), "{r}");
                }
                assert_eq!(balance(&f.pool, &customer).await, Some(4));
            }

            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_copy_waiting_on_a_rolled_back_claim_processes_it() {
                let f = Arc::new(fixture(2).await);
                let (id, customer) = (unique("o"), unique("c"));
                // Whichever copy claims first waits for the other to queue behind it, then fails.
                f.scripts.set(&id, vec![Step::AwaitLockWaitersThenFail(1)]);
                let copies: Vec<_> = (0..2)
                    .map(|_| {
                        let (f, envelope) = (f.clone(), order(&id, &customer, 5));
                        tokio::spawn(async move { run(&f, "record", &envelope).await })
                    })
                    .collect();
                let mut labels = Vec::new();
                for copy in copies {
                    labels.push(copy.await.unwrap().label());
                }
                labels.sort();
                assert_eq!(labels, ["processed", "rejected"]);
                assert_eq!(effects(&f.pool, "record", &id).await, 1);
                assert_eq!(balance(&f.pool, &customer).await, Some(5));
            }

            /// A batch whose claim waits on another transaction's uncommitted claim of one of its
            /// keys: once that commits, the key is a duplicate with the stored result, and the
            /// batch's other keys are processed. On PostgreSQL the claim's own read cannot see a
            /// row committed after its statement began, so this is the claim's second read.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_batch_waiting_on_an_uncommitted_claim_sees_it_committed() {
                let f = Arc::new(fixture(3).await);
                let (id, customer) = (unique("o"), unique("c"));
                // The single copy holds its claim open until the batch queues behind it.
                f.scripts.set(&id, vec![Step::AwaitLockWaiters(1)]);
                let single = {
                    let (f, envelope) = (f.clone(), order(&id, &customer, 7));
                    tokio::spawn(async move { run(&f, "record", &envelope).await })
                };
                let deadline = std::time::Instant::now() + Duration::from_secs(20);
                while !f.scripts.started(&id) {
                    assert!(std::time::Instant::now() < deadline, "the single copy never ran");
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                let others = [unique("o"), unique("o")];
                let batch: Vec<Envelope> = [&id, &others[0], &others[1]]
                    .into_iter()
                    .map(|key| order(key, &customer, 7))
                    .collect();
                let registration = idem::registry::find(&consumer("record")).unwrap();
                let outcomes = registration.invoke_batch(&f.stores, &batch).await.unwrap();
                assert_eq!(single.await.unwrap().label(), "processed");
                let Outcome::Duplicate { key, output } = &outcomes[0] else { panic!("{outcomes:?}") };
                assert_eq!(key, &id);
                assert_eq!(output.decode::<Receipt>().unwrap(), Receipt { balance: 7 });
                assert_eq!(
                    outcomes[1..].iter().map(Outcome::label).collect::<Vec<_>>(),
                    ["processed", "processed"]
                );
                for key in [&id, &others[0], &others[1]] {
                    assert_eq!(effects(&f.pool, "record", key).await, 1, "effects of {key}");
                }
                assert_eq!(balance(&f.pool, &customer).await, Some(21));
            }

            #[tokio::test]
            async fn migrate_is_repeatable_and_the_table_is_configurable() {
                let f = fixture(2).await;
                let inbox = <$inbox>::new(f.pool.clone());
                inbox.migrate().await.unwrap();
                idem::sql::migrate(&f.pool).await.unwrap();
                let custom = inbox.clone().table("idem_inbox_custom").unwrap();
                custom.migrate().await.unwrap();
                let stores = Stores::new().with(custom).with_state(f.scripts.clone());
                let (id, customer) = (unique("o"), unique("c"));
                let registration = idem::registry::find(&consumer("record")).unwrap();
                let outcome = registration.invoke(&stores, &order(&id, &customer, 1)).await.unwrap();
                assert_eq!(outcome.label(), "processed");
                let rows: i64 = sqlx::query_scalar(super::$sql.count_custom)
                    .bind(&id)
                    .fetch_one(&f.pool)
                    .await
                    .unwrap();
                assert_eq!(rows, 1);
                assert_eq!(inbox_rows(&f.pool, "record", &id).await, 0);

                let err = inbox.table("idem_inbox; DROP TABLE idem_test_balances").unwrap_err();
                assert!(err.to_string().contains("invalid inbox table name"), "{err}");
                let missing = idem::registry::find(&consumer("record")).unwrap().invoke(&Stores::new(), &order(&id, &customer, 1)).await;
                assert!(missing.unwrap_err().to_string().contains(concat!("no ", stringify!($store), " store was provided")));
            }
        }
    };
}

inbox_suite!(
    postgres,
    Postgres,
    sqlx::Postgres,
    idem::sql::PgInbox,
    pg_setup,
    pg_lock_waiters,
    pg_claims_waiting,
    PORTABLE_SQL,
    postgres
);
inbox_suite!(
    mysql,
    MySql,
    sqlx::MySql,
    idem::sql::MySqlInbox,
    mysql_setup,
    mysql_lock_waiters,
    mysql_claims_waiting,
    MYSQL_SQL,
    mysql
);
inbox_suite!(
    sqlite,
    Sqlite,
    sqlx::Sqlite,
    idem::sql::SqliteInbox,
    sqlite_setup,
    sqlite_lock_waiters,
    sqlite_claims_waiting,
    PORTABLE_SQL,
    sqlite
);

#[test]
fn registered_consumers_are_unique() {
    let handlers = idem::registry::handlers();
    assert_eq!(handlers.len(), 15);
    idem::registry::validate(&handlers).unwrap();
    let record = idem::registry::find("inbox::postgres::record").unwrap();
    assert_eq!(
        record.key(),
        idem::handler::KeySource::Field("order.order_id")
    );
    assert_eq!(
        record.store(),
        <idem::sql::PgInbox as idem::store::InboxStore>::KIND
    );
}

/// MariaDB's own transient failures, produced for real and fed through the classification.
mod mysql_errors {
    use super::common::unique;
    use idem::ErrorClass;
    use idem::sql::classify_sqlx;
    use idem::store::Stores;
    use sqlx::Executor;

    /// Holds `customer`'s balance row locked in a transaction of its own.
    async fn lock_balance(
        pool: &sqlx::MySqlPool,
        customer: &str,
    ) -> sqlx::Transaction<'static, sqlx::MySql> {
        sqlx::query("INSERT INTO idem_test_balances (customer, cents) VALUES (?, 0)")
            .bind(customer)
            .execute(pool)
            .await
            .unwrap();
        let mut tx = pool.begin().await.unwrap();
        sqlx::query("SELECT cents FROM idem_test_balances WHERE customer = ? FOR UPDATE")
            .bind(customer)
            .execute(&mut *tx)
            .await
            .unwrap();
        tx
    }

    #[tokio::test]
    async fn a_lock_wait_timeout_in_the_handler_is_retried_then_processed() {
        let (pool, _) = super::mysql_setup(2, None).await;
        // The handler's connections give up on a lock after one second.
        let impatient = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(1)
            .after_connect(|conn, _| {
                Box::pin(async move {
                    conn.execute("SET SESSION innodb_lock_wait_timeout = 1")
                        .await
                        .map(drop)
                })
            })
            .connect(&super::common::mysql_url())
            .await
            .unwrap();
        let inbox = idem::sql::MySqlInbox::new(impatient);
        inbox.migrate().await.expect("migrate");
        let stores = Stores::new()
            .with(inbox)
            .with_state(super::mysql::Scripts::default());
        let (id, customer) = (unique("o"), unique("c"));
        let holder = lock_balance(&pool, &customer).await;
        let body = serde_json::json!({"order_id": id, "customer": customer, "amount_cents": 7});
        let envelope = idem::Envelope::new(body.to_string());
        let record = idem::registry::find("inbox::mysql::record").unwrap();

        let blocked = record.invoke(&stores, &envelope).await.unwrap();
        assert_eq!(blocked.label(), "retry", "{blocked:?}");
        let idem::Outcome::Retry(transient) = &blocked else {
            unreachable!()
        };
        assert!(
            transient.message.contains("Lock wait timeout"),
            "{transient:?}"
        );
        holder.rollback().await.unwrap();

        let again = record.invoke(&stores, &envelope).await.unwrap();
        assert_eq!(again.label(), "processed", "{again:?}");
        let cents: i64 =
            sqlx::query_scalar("SELECT cents FROM idem_test_balances WHERE customer = ?")
                .bind(&customer)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(cents, 7);
    }

    #[tokio::test]
    async fn a_deadlock_is_transient() {
        let (pool, _) = super::mysql_setup(2, None).await;
        let (a, b) = (unique("c"), unique("c"));
        let mut first = lock_balance(&pool, &a).await;
        let mut second = lock_balance(&pool, &b).await;
        let lock = "UPDATE idem_test_balances SET cents = cents + 1 WHERE customer = ?";
        // Each already holds its own row and now asks for the other's: whichever statement
        // arrives second closes a cycle, and InnoDB breaks it by failing one of them.
        let (one, two) = tokio::join!(
            sqlx::query(lock).bind(&b).execute(&mut *first),
            sqlx::query(lock).bind(&a).execute(&mut *second),
        );
        let error = match (one, two) {
            (Err(e), Ok(_)) | (Ok(_), Err(e)) => e,
            other => panic!("expected exactly one deadlock victim, got {other:?}"),
        };
        assert!(error.to_string().contains("Deadlock"), "{error}");
        assert_eq!(classify_sqlx(&error), ErrorClass::Transient);
    }
}

/// A table an idem of schema version 1 made (no lease columns), with a row in it, is upgraded
/// in place by `migrate`, its row kept and claimable as a duplicate.
#[tokio::test]
async fn a_version_1_table_is_upgraded_in_place() {
    use idem::store::{ClaimRequest, Fingerprint, InboxStore};
    let (pool, _dir) = common::sqlite(1).await;
    for statement in [
        r#"CREATE TABLE "idem_inbox" (consumer TEXT NOT NULL, key TEXT NOT NULL, fingerprint BLOB NOT NULL,
            status TEXT NOT NULL CHECK (status IN ('in_progress', 'completed', 'failed')), outcome TEXT,
            attempts INTEGER NOT NULL, created_at INTEGER NOT NULL, completed_at INTEGER,
            expires_at INTEGER NOT NULL, PRIMARY KEY (consumer, key)) WITHOUT ROWID"#,
        r#"CREATE INDEX "idem_inbox_expires_at" ON "idem_inbox" (expires_at)"#,
        "CREATE TABLE idem_schema_version (inbox_table TEXT PRIMARY KEY, version INTEGER NOT NULL, migrated_at INTEGER NOT NULL)",
        "INSERT INTO idem_schema_version VALUES ('idem_inbox', 1, 0)",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    let fingerprint = Fingerprint::of(b"old");
    sqlx::query(
        "INSERT INTO idem_inbox VALUES ('c', 'k', ?1, 'completed', NULL, 1, 0, 0, 9999999999999)",
    )
    .bind(fingerprint.as_bytes().as_slice())
    .execute(&pool)
    .await
    .unwrap();
    let inbox = idem::sql::SqliteInbox::new(pool.clone());
    // The probe reads what later versions added (the first it meets: version 3's delivery
    // counts), and fails for good, naming the table.
    let refused = inbox.check().await.unwrap_err();
    assert!(
        refused.class() == idem::ErrorClass::Permanent
            && refused.to_string().contains("inbox table `idem_inbox`")
            && refused
                .to_string()
                .contains("no such table: idem_inbox_deliveries"),
        "{refused}"
    );
    inbox.migrate().await.unwrap();
    inbox.check().await.unwrap();
    let version: i64 = sqlx::query_scalar(
        "SELECT version FROM idem_schema_version WHERE inbox_table = 'idem_inbox'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(version, i64::from(idem::sql::SCHEMA_VERSION));
    let request = ClaimRequest {
        consumer: "c",
        key: "k",
        fingerprint: &fingerprint,
        attempt: 1,
        retention: std::time::Duration::from_secs(60),
    };
    let mut tx = inbox.begin().await.unwrap();
    let claim = inbox.claim(&mut tx, &request).await.unwrap();
    assert_eq!(
        claim,
        idem::store::Claim::Existing {
            fingerprint,
            output: None
        }
    );
    inbox.rollback(tx).await;
}

/// On PostgreSQL, version 8 drops version 1's check of `status` (the server prepares a table's
/// checks anew in every statement that writes it, so each claim paid for it): a table of version 7
/// with the check and a row loses the check in `migrate`, keeps the row, and claims still write
/// `completed`.
#[tokio::test]
async fn a_postgres_table_loses_its_status_check_in_version_8() {
    let schema = common::OwnSchema::create("idem_test_check", 2).await;
    let pool = schema.pool.clone();
    let inbox = idem::sql::PgInbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    let checks = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM pg_constraint WHERE conrelid = 'idem_inbox'::regclass AND contype = 'c'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(checks().await, 0, "a new table has no check");
    // The table as version 7 left it: the check of version 1, and a row.
    for statement in [
        "ALTER TABLE idem_inbox ADD CONSTRAINT idem_inbox_status_check CHECK (status IN ('in_progress', 'completed', 'failed'))",
        "UPDATE idem_schema_version SET version = 7 WHERE inbox_table = 'idem_inbox'",
        "INSERT INTO idem_inbox (consumer, key, fingerprint, status, attempts, created_at, expires_at)
         VALUES ('c', 'old', '\\x00', 'completed', 1, now(), now() + interval '1 day')",
    ] {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    assert_eq!(checks().await, 1);
    inbox.migrate().await.unwrap();
    assert_eq!(checks().await, 0, "version 8 dropped the check");
    let version: i32 = sqlx::query_scalar(
        "SELECT version FROM idem_schema_version WHERE inbox_table = 'idem_inbox'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(version, idem::sql::SCHEMA_VERSION);
    assert_eq!(claim_once(&inbox, "new").await, idem::store::Claim::Claimed);
    let statuses: Vec<(String, String)> =
        sqlx::query_as("SELECT key, status FROM idem_inbox ORDER BY key")
            .fetch_all(&pool)
            .await
            .unwrap();
    assert_eq!(
        statuses,
        [
            ("new".into(), "completed".into()),
            ("old".into(), "completed".into())
        ]
    );
    drop(inbox);
    schema.drop().await;
}

/// An older idem on a newer schema (a rollback, or old processes beside new ones in a rolling
/// deploy): `migrate()` leaves a schema whose recorded oldest reader is this idem's version or
/// older as it is, and the inbox works on it; one that needs a newer idem, or records no oldest
/// reader, is refused naming both versions. On PostgreSQL and SQLite.
#[tokio::test]
async fn an_older_idem_runs_on_a_newer_schema_only_where_it_is_recorded_as_compatible() {
    use idem::sql::{READERS_FROM, SCHEMA_VERSION};
    let newer = SCHEMA_VERSION + 1;
    let schema = common::OwnSchema::create("idem_test_newer", 2).await;
    let (sqlite, _dir) = common::sqlite(2).await;
    let pg = schema.pool.clone();
    let postgres = idem::sql::PgInbox::new(pg.clone());
    let lite = idem::sql::SqliteInbox::new(sqlite.clone());
    postgres.migrate().await.unwrap();
    lite.migrate().await.unwrap();
    let version_of = |name: &'static str| {
        let (pg, sqlite) = (pg.clone(), sqlite.clone());
        let query = format!("SELECT version FROM idem_schema_version WHERE inbox_table = '{name}'");
        async move {
            let on_pg: i32 = sqlx::query_scalar(sqlx::AssertSqlSafe(query.clone()))
                .fetch_one(&pg)
                .await
                .unwrap();
            let on_sqlite: i32 = sqlx::query_scalar(sqlx::AssertSqlSafe(query))
                .fetch_one(&sqlite)
                .await
                .unwrap();
            (on_pg, on_sqlite)
        }
    };
    assert_eq!(
        version_of("idem_inbox@readers").await,
        (READERS_FROM, READERS_FROM)
    );
    let set = |name: &'static str, version: Option<i32>| {
        let (pg, sqlite) = (pg.clone(), sqlite.clone());
        let statement = match version {
            Some(v) => {
                format!("UPDATE idem_schema_version SET version = {v} WHERE inbox_table = '{name}'")
            }
            None => format!("DELETE FROM idem_schema_version WHERE inbox_table = '{name}'"),
        };
        async move {
            sqlx::query(sqlx::AssertSqlSafe(statement.clone()))
                .execute(&pg)
                .await
                .unwrap();
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(&sqlite)
                .await
                .unwrap();
        }
    };

    // A newer idem migrated the tables, recording that this one still runs on them.
    set("idem_inbox", Some(newer)).await;
    postgres.migrate().await.unwrap();
    lite.migrate().await.unwrap();
    assert_eq!(
        version_of("idem_inbox").await,
        (newer, newer),
        "left as it is"
    );
    for claimed in [
        claim_once(&postgres, "k").await,
        claim_once(&lite, "k").await,
    ] {
        assert_eq!(claimed, idem::store::Claim::Claimed);
    }

    // It records that only an idem of its own version runs on them; or it records nothing.
    set("idem_inbox@readers", Some(newer)).await;
    for refused in [postgres.migrate().await, lite.migrate().await] {
        let message = refused.unwrap_err().to_string();
        assert!(
            message.contains(&format!(
                "schema version {newer}, newer than the {SCHEMA_VERSION} this idem knows, \
                 and runs with an idem of schema version {newer} or later only"
            )),
            "{message}"
        );
    }
    set("idem_inbox@readers", None).await;
    assert!(postgres.migrate().await.is_err());
    assert!(lite.migrate().await.is_err());
    drop(postgres);
    schema.drop().await;
}

/// Claims `key` of consumer `c` in `inbox` (the key's bytes as the body) and commits.
async fn claim_once<S: idem::store::InboxStore>(inbox: &S, key: &str) -> idem::store::Claim {
    use idem::store::{ClaimRequest, Fingerprint};
    let fingerprint = Fingerprint::of(key.as_bytes());
    let request = ClaimRequest {
        consumer: "c",
        key,
        fingerprint: &fingerprint,
        attempt: 1,
        retention: std::time::Duration::from_secs(60),
    };
    let mut tx = inbox.begin().await.unwrap();
    let claimed = inbox.claim(&mut tx, &request).await.unwrap();
    inbox.commit(tx).await.unwrap();
    claimed
}

/// A migration cancelled while it holds MySQL's migration lock (`GET_LOCK`, which belongs to
/// the session) must not leave that lock with a pooled connection: the next migration, from
/// another pool, goes through while the first pool lives on.
#[tokio::test]
async fn a_cancelled_mysql_migration_leaves_its_lock_free() {
    let table = format!(
        "idem_cancel_{}_{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_micros()
    );
    let (pool_a, pool_b) = (common::mysql(2).await, common::mysql(2).await);
    idem::sql::migrate(&pool_b).await.unwrap(); // the version table exists
    // Holds the version row the migration will write, uncommitted: the migration, holding the
    // lock, waits on it.
    let mut blocker = pool_b.begin().await.unwrap();
    sqlx::query("INSERT INTO idem_schema_version VALUES (?, 0, UTC_TIMESTAMP(6))")
        .bind(&table)
        .execute(&mut *blocker)
        .await
        .unwrap();
    let a = idem::sql::MySqlInbox::new(pool_a.clone())
        .table(&table)
        .unwrap();
    let migrating = tokio::spawn(async move { a.migrate().await });
    common::wait_until(
        "the migration to wait while holding the lock",
        std::time::Duration::from_secs(20),
        || async {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM information_schema.PROCESSLIST
                 WHERE id = IS_USED_LOCK('idem.migrate') AND info LIKE 'INSERT INTO idem_schema_version%'",
            )
            .fetch_one(&pool_b)
            .await
            .unwrap()
                == 1
        },
    )
    .await;
    migrating.abort();
    assert!(migrating.await.unwrap_err().is_cancelled());
    blocker.rollback().await.unwrap();

    let b = idem::sql::MySqlInbox::new(pool_b.clone())
        .table(&table)
        .unwrap();
    tokio::time::timeout(std::time::Duration::from_secs(20), b.migrate())
        .await
        .expect("the cancelled migration's lock was never released")
        .unwrap();
    idem::store::InboxStore::check(&b).await.unwrap();
    drop(pool_a);
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP TABLE `{table}`")))
        .execute(&pool_b)
        .await
        .unwrap();
    sqlx::query("DELETE FROM idem_schema_version WHERE inbox_table = ?")
        .bind(&table)
        .execute(&pool_b)
        .await
        .unwrap();
}
