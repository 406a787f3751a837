//! The runtime on the in-memory transport and SQLite: what it does without a broker, including
//! a panicking handler, concurrent copies, and its start-up checks.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::running::start;
use common::wait_until;
use idem::sql::SqliteInbox;
use idem::transport::MemoryTransport;
use idem::{Envelope, HandlerError, RetryPolicy, Runtime, RuntimeError, idempotent};
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
    panic: bool,
}

/// Keys a handler has seen, in order: runtime state the test gives (`.state(seen.clone())`) and
/// reads. Clones share it.
#[derive(Clone, Default)]
struct Seen(Arc<Mutex<Vec<String>>>);

impl Seen {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<String>> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Records `key`; whether it was the first time.
    fn first(&self, key: &str) -> bool {
        let mut seen = self.lock();
        let first = !seen.iter().any(|k| k == key);
        seen.push(key.to_owned());
        first
    }

    fn all(&self) -> Vec<String> {
        self.lock().clone()
    }
}

#[idempotent(store = Sqlite, queue = "mem-orders", consumer = "mem.orders", key = "order.order_id")]
async fn record(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    order: Order,
    seen: &Seen,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO effects (key) VALUES ($1)")
        .bind(&order.order_id)
        .execute(&mut **tx)
        .await?;
    if seen.first(&order.order_id) && order.panic {
        panic!("handler bug on {}", order.order_id);
    }
    Ok(())
}

#[idempotent(store = Postgres, queue = "mem-pg", consumer = "mem.pg")]
async fn needs_postgres(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    _m: serde_json::Value,
) -> Result<(), HandlerError> {
    Ok(())
}

/// Two functions that claim one consumer identity: `build()` must refuse to run both.
#[idempotent(store = Sqlite, queue = "mem-dup-a", consumer = "mem.dup")]
async fn dup_first(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    _m: serde_json::Value,
) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(store = Sqlite, queue = "mem-dup-b", consumer = "mem.dup")]
async fn dup_second(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    _m: serde_json::Value,
) -> Result<(), HandlerError> {
    Ok(())
}

/// Two handlers on one queue: `build()` must refuse to run both.
#[idempotent(store = Sqlite, queue = "mem-shared", consumer = "mem.shared.a")]
async fn shared_a(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    _m: serde_json::Value,
) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(store = Sqlite, queue = "mem-shared", consumer = "mem.shared.b")]
async fn shared_b(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    _m: serde_json::Value,
) -> Result<(), HandlerError> {
    Ok(())
}

/// A fresh SQLite database with the `effects` table and a migrated inbox.
async fn orders_inbox(connections: u32) -> (sqlx::SqlitePool, tempfile::TempDir, SqliteInbox) {
    let (pool, dir) = common::sqlite(connections).await;
    sqlx::query("CREATE TABLE effects (key TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    let inbox = SqliteInbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    (pool, dir, inbox)
}

/// The `mem.orders` runtime on `transport` and `inbox`, retrying quickly (3 attempts from 20 ms).
fn orders_runtime(transport: &MemoryTransport, inbox: SqliteInbox) -> idem::RuntimeBuilder {
    Runtime::builder()
        .transport(transport.clone())
        .store(inbox)
        .handlers(["mem.orders"])
        .state(Seen::default())
        .retry(
            RetryPolicy::new(3, Duration::from_millis(20), 2, Duration::from_millis(100)).unwrap(),
        )
}

async fn effects(pool: &sqlx::SqlitePool, key: &str) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM effects WHERE key = $1")
        .bind(key)
        .fetch_one(pool)
        .await
        .unwrap()
}

fn message(id: &str, panic: bool) -> Envelope {
    Envelope::new(serde_json::json!({"order_id": id, "panic": panic}).to_string())
        .with_message_id(id)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn panics_are_retried_and_concurrent_copies_take_effect_once() {
    let (pool, _dir, inbox) = orders_inbox(4).await;
    let transport = MemoryTransport::new();
    let running = start(orders_runtime(&transport, inbox).concurrency(4));
    let stats = running.stats.clone();

    transport.publish("mem-orders", message("boom", true));
    transport.publish_copies("mem-orders", &message("twin", false), 8);
    transport.publish("mem-orders", message("after", false));
    wait_until(
        "every delivery settled",
        Duration::from_secs(30),
        || async { stats.snapshot().settled() == 10 },
    )
    .await;
    running.shut_down().await;

    let seen = stats.snapshot();
    assert_eq!(
        (seen.panics, seen.retried),
        (1, 1),
        "the panic was caught and retried"
    );
    assert_eq!(
        (seen.processed, seen.duplicates, seen.dead_lettered),
        (3, 7, 0)
    );
    for key in ["boom", "twin", "after"] {
        assert_eq!(effects(&pool, key).await, 1, "{key}");
    }
    assert_eq!(transport.pending("mem-orders"), 0);
}

/// Writes to a second database that is down (as the handler's `?` on another pool gives):
/// unavailable every time, while its own store writes.
#[idempotent(store = Sqlite, queue = "mem-replica", consumer = "mem.replica", key = "order.order_id")]
async fn to_replica(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    order: Order,
) -> Result<(), HandlerError> {
    match order.order_id.starts_with("down") {
        true => Err(HandlerError::unavailable(
            "the replica this handler writes to is down",
        )),
        false => Ok(()),
    }
}

/// A message that fails as unavailable while its store's probe writes commit is not the store's
/// fault: after three waits it is retried as a transient failure, spending its attempts, and
/// dead-lettered as `retries-exhausted` when they run out; it never pauses the store for ever,
/// and the message behind it is processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_keeps_failing_as_unavailable_while_the_store_writes_is_retried() {
    let (_pool, _dir, inbox) = orders_inbox(2).await;
    let transport = MemoryTransport::new();
    let running = start(
        Runtime::builder()
            .transport(transport.clone())
            .store(inbox)
            .handlers(["mem.replica"])
            // Two attempts 20 ms apart (the default is five, from 1 s): the message runs out of
            // attempts while the test waits.
            .retry(
                RetryPolicy::new(2, Duration::from_millis(20), 2, Duration::from_millis(20))
                    .unwrap(),
            ),
    );
    let stats = running.stats.clone();
    transport.publish("mem-replica", message("down-1", false));
    transport.publish("mem-replica", message("fine-1", false));
    wait_until("both settled", Duration::from_secs(60), || async {
        stats.snapshot().settled() == 2
    })
    .await;
    running.shut_down().await;
    let seen = stats.snapshot();
    assert_eq!(
        (seen.processed, seen.dead_lettered, seen.retried),
        (1, 1, 1),
        "{seen:?}"
    );
    assert_eq!(seen.unavailable, 6, "three waits per attempt: {seen:?}");
    let dead = transport.dead_letters("mem-replica");
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].1.reason, "retries-exhausted");
    assert!(dead[0].1.detail.contains("replica"), "{}", dead[0].1.detail);
}

#[tokio::test]
async fn wrong_configuration_fails_at_start_saying_what_to_change() {
    let error = |builder: idem::RuntimeBuilder| builder.build().err().unwrap().to_string();
    let (pool, _dir) = common::sqlite(1).await;
    let no_transport = error(
        Runtime::builder()
            .store(SqliteInbox::new(pool.clone()))
            .handlers(["mem.orders"])
            .state(Seen::default()),
    );
    assert!(no_transport.contains("call .transport"), "{no_transport}");
    let missing = error(
        Runtime::builder()
            .transport(MemoryTransport::new())
            .handlers(["mem.pg"]),
    );
    assert!(
        missing.contains("no Postgres store")
            && missing.contains(".store(idem::sql::PgInbox::new(pool))"),
        "{missing}"
    );
    let unknown = error(
        Runtime::builder()
            .transport(MemoryTransport::new())
            .handlers(["nobody"]),
    );
    assert!(
        unknown.contains("no registered handler has consumer = \"nobody\""),
        "{unknown}"
    );
    let zero = Runtime::builder()
        .transport(MemoryTransport::new())
        .store(SqliteInbox::new(pool.clone()))
        .handlers(["mem.orders"])
        .state(Seen::default())
        .prefetch(0)
        .build();
    assert!(matches!(zero, Err(RuntimeError::Setting { .. })));
    let batch = error(
        Runtime::builder()
            .transport(MemoryTransport::new())
            .store(SqliteInbox::new(pool))
            .handlers(["mem.orders"])
            .state(Seen::default())
            .batch(100)
            .prefetch(50),
    );
    assert!(
        batch.contains("batches 100 deliveries but prefetch is 50")
            && batch.contains("set .prefetch(300)"),
        "{batch}"
    );
}

/// A handler asking for state nobody gave is refused by `build()`, naming the type and the
/// handler, in either mode; given the state, the same configuration builds.
#[tokio::test]
async fn a_handler_asking_for_state_nobody_gave_is_refused_at_build() {
    let (pool, _dir) = common::sqlite(1).await;
    let builder = |consumer: &str| {
        Runtime::builder()
            .transport(MemoryTransport::new())
            .store(SqliteInbox::new(pool.clone()))
            .handlers([consumer])
    };
    for (consumer, function) in [("mem.orders", "record"), ("mem.notify", "notify")] {
        let error = builder(consumer)
            .build()
            .err()
            .expect("refused")
            .to_string();
        assert!(
            error.contains(&format!("handler `{function}` (consumer \"{consumer}\")"))
                && error.contains("asks for state of type `runtime_memory::Seen`")
                && error.contains("give it with .state(value)")
                && error.contains("(state given: none)"),
            "{error}"
        );
        let other = builder(consumer)
            .state(42_u32)
            .build()
            .err()
            .expect("refused");
        assert!(
            matches!(&other, RuntimeError::MissingState { given, .. } if given == "u32"),
            "{other}"
        );
        builder(consumer).state(Seen::default()).build().unwrap();
    }
}

/// The test harness refuses a handler whose state it was not given, as `build()` does, and
/// hands it the state it was given.
#[tokio::test]
async fn the_harness_gives_handlers_their_state() {
    let (_pool, _dir, inbox) = orders_inbox(1).await;
    let stores = idem::store::Stores::new().with(inbox);
    let bare = idem::testing::Harness::new(stores.clone());
    let body = serde_json::json!({"order_id": "h-1", "panic": false});
    let error = bare
        .send_json("mem.orders", "h-1", &body)
        .await
        .unwrap_err();
    assert!(
        error
            .to_string()
            .contains("asks for state of type `runtime_memory::Seen`")
            && error.to_string().contains("Harness::state(value)"),
        "{error}"
    );
    // Run directly, without the harness's check, the handler fails transiently: retried, not lost.
    let record = idem::registry::find("mem.orders").unwrap();
    let envelope = Envelope::new(body.to_string()).with_message_id("h-1");
    let outcome = record.invoke(&stores, &envelope).await.unwrap();
    assert!(
        matches!(&outcome, idem::Outcome::Retry(t) if t.message.contains("no state of type `runtime_memory::Seen`")),
        "{outcome:?}"
    );
    let seen = Seen::default();
    let harness = idem::testing::Harness::new(stores).state(seen.clone());
    let outcome = harness.send_json("mem.orders", "h-1", &body).await.unwrap();
    assert_eq!(outcome.label(), "processed");
    assert_eq!(seen.all(), ["h-1"], "the handler wrote to the state given");
}

/// `build()` refuses handlers that would suppress or starve each other, naming both functions.
#[tokio::test]
async fn handlers_sharing_a_consumer_or_a_queue_are_refused_at_build() {
    let (pool, _dir) = common::sqlite(1).await;
    let build = |consumers: &[&str], queue: Option<(&str, &str)>| {
        let mut builder = Runtime::builder()
            .transport(MemoryTransport::new())
            .store(SqliteInbox::new(pool.clone()))
            .state(Seen::default())
            .handlers(consumers.iter().copied());
        if let Some((consumer, queue)) = queue {
            builder = builder.handler_queue(consumer, queue);
        }
        builder.build().err().map(|e| e.to_string())
    };
    let consumer = build(&["mem.dup"], None).expect("a shared consumer is refused");
    assert!(
        consumer.contains("`dup_first` and `dup_second` both use consumer = \"mem.dup\" on Sqlite"),
        "{consumer}"
    );
    let queue = build(&["mem.shared.a", "mem.shared.b"], None).expect("a shared queue is refused");
    assert!(
        queue.contains("`shared_a` and `shared_b` both consume queue \"mem-shared\""),
        "{queue}"
    );
    let moved = build(
        &["mem.orders", "mem.shared.a"],
        Some(("mem.shared.a", "mem-orders")),
    )
    .expect("a queue shared through handler_queue is refused");
    assert!(
        moved.contains("`record` and `shared_a` both consume queue \"mem-orders\""),
        "{moved}"
    );
    assert_eq!(build(&["mem.orders", "mem.shared.a"], None), None);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_mode_takes_effect_once_through_copies_and_a_panic() {
    let (pool, _dir, inbox) = orders_inbox(4).await;
    let transport = MemoryTransport::new();
    let running = start(orders_runtime(&transport, inbox).batch(16));
    let stats = running.stats.clone();
    // Copies land in the same batch and in different ones; the panic fails its whole batch
    // once, and every message in it is retried.
    let mut published = 0;
    for n in 0..100 {
        let copies = n % 3 + 1;
        transport.publish_copies("mem-orders", &message(&format!("b{n}"), false), copies);
        published += copies as u64;
    }
    transport.publish("mem-orders", message("batch-boom", true));
    published += 1;
    wait_until(
        "every delivery settled",
        Duration::from_secs(30),
        || async { stats.snapshot().processed == 101 },
    )
    .await;
    running.shut_down().await;
    let seen = stats.snapshot();
    assert_eq!(seen.panics, 1, "{seen:?}");
    assert_eq!(seen.dead_lettered, 0, "{seen:?}");
    assert_eq!(seen.processed + seen.duplicates, published, "{seen:?}");
    for n in 0..100 {
        assert_eq!(effects(&pool, &format!("b{n}")).await, 1, "b{n}");
    }
    assert_eq!(effects(&pool, "batch-boom").await, 1);
    assert_eq!(transport.pending("mem-orders"), 0);
}

#[tokio::test]
async fn an_inbox_never_migrated_stops_the_start_instead_of_dead_lettering_everything() {
    let (pool, _dir) = common::sqlite(1).await;
    let transport = MemoryTransport::new();
    transport.publish("mem-orders", message("kept", false));
    let runtime = Runtime::builder()
        .transport(transport.clone())
        .store(SqliteInbox::new(pool))
        .handlers(["mem.orders"])
        .state(Seen::default())
        .build()
        .unwrap();
    let error = runtime.run_until(async {}).await.unwrap_err().to_string();
    assert!(
        error.contains("idem_inbox") && error.contains("migrate()"),
        "{error}"
    );
    assert_eq!(
        transport.pending("mem-orders"),
        1,
        "the message is untouched"
    );
    assert!(transport.dead_letters("mem-orders").is_empty());
}

/// The external handler: its "downstream" is the keys it calls with, in `calls`.
#[idempotent(store = Sqlite, queue = "mem-notify", consumer = "mem.notify", mode = "external", lease = "1s")]
async fn notify(
    order: Order,
    calls: &Seen,
    ctx: &idem::Context<'_>,
) -> Result<String, HandlerError> {
    calls.first(ctx.idempotency_key());
    if order.panic {
        return Err(HandlerError::permanent("no such recipient"));
    }
    Ok(format!("sent {}", order.order_id))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn external_mode_in_batches_on_sqlite_calls_each_key_once() {
    let (pool, _dir) = common::sqlite(4).await;
    let inbox = SqliteInbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    let transport = MemoryTransport::new();
    let calls = Seen::default();
    let running = start(
        Runtime::builder()
            .transport(transport.clone())
            .store(inbox)
            .state(calls.clone())
            .handlers(["mem.notify"])
            // Quick retries (the default waits 1 s, 4 s, …): a batch member retried comes back
            // while the test waits.
            .retry(
                RetryPolicy::new(6, Duration::from_millis(50), 2, Duration::from_millis(800))
                    .unwrap(),
            )
            .batch(8)
            .concurrency(2),
    );
    let stats = running.stats.clone();
    let mut published = 0;
    for n in 0..40 {
        let copies = n % 3 + 1;
        transport.publish_copies("mem-notify", &message(&format!("n{n}"), false), copies);
        published += copies as u64;
    }
    transport.publish_copies("mem-notify", &message("nobody", true), 2);
    published += 2;
    wait_until(
        "every delivery settled",
        Duration::from_secs(30),
        || async { stats.snapshot().settled() == published },
    )
    .await;
    running.shut_down().await;
    let seen = stats.snapshot();
    assert_eq!((seen.processed, seen.dead_lettered), (40, 2), "{seen:?}");
    let calls = calls.all();
    for n in 0..40 {
        let key = format!("n{n}");
        assert_eq!(
            calls.iter().filter(|k| **k == key).count(),
            1,
            "{key} called more than once"
        );
    }
    assert_eq!(
        calls.iter().filter(|k| *k == "nobody").count(),
        1,
        "a failed key ran again"
    );
    let reasons: Vec<_> = transport
        .dead_letters("mem-notify")
        .into_iter()
        .map(|(_, d)| d.reason)
        .collect();
    assert!(
        reasons.contains(&"handler".to_owned())
            && reasons.contains(&"previously-failed".to_owned()),
        "{reasons:?}"
    );
}

#[tokio::test]
async fn the_runtime_retention_applies_to_handlers_without_their_own() {
    let (pool, _dir, inbox) = orders_inbox(2).await;
    let transport = MemoryTransport::new();
    // An hour of retention needs an outbox that gives a refused row up within it.
    let inbox = inbox.outbox_give_up(Duration::from_secs(1800));
    let running = start(
        Runtime::builder()
            .transport(transport.clone())
            .store(inbox)
            .handlers(["mem.orders"])
            .state(Seen::default())
            .retention(Duration::from_secs(3600)),
    );
    let stats = running.stats.clone();
    transport.publish("mem-orders", message("kept-an-hour", false));
    wait_until("processed", Duration::from_secs(10), || async {
        stats.snapshot().processed == 1
    })
    .await;
    running.shut_down().await;
    // SQLite timestamps are Unix milliseconds.
    let kept: i64 = sqlx::query_scalar(
        "SELECT expires_at - created_at FROM idem_inbox WHERE key = 'kept-an-hour'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(kept, 3_600_000);
}
