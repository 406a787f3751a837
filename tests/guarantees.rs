//! The guarantees, written once and run on both brokers: each test below runs on RabbitMQ
//! (classic queues, the machine's broker) and on NATS JetStream (`NATS_URL`), through the same
//! runtime and a real SQLite inbox: copies take effect once, also in two runtimes at once and
//! in batch mode; the same key with another payload is dead-lettered as a conflict; a
//! transient failure is retried as the next attempt after its delay, and a permanent failure
//! and an undecodable body are dead-lettered once with their reasons and records; the outbox
//! takes each event to the next hop once; an ordered handler's updates apply in publish order
//! across two runtimes. Poison, closed connections, the database cut and the
//! broker's restart run on both brokers in `tests/poison.rs` and `tests/chaos.rs`; what only
//! one broker has is in `tests/rabbitmq.rs` and `tests/nats.rs`.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::bus::Bus;
use common::running::{DEADLINE, start, start_watched};
use common::{unique, wait_until};
use idem::RuntimeBuilder;
use idem::prelude::*;
use idem::sql::SqliteInbox;
use idem::transport::QueueSpec;
use sqlx::SqlitePool;
use std::time::Duration;

#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
struct Order {
    id: String,
    cents: i64,
    /// `once`: fails transiently on its first attempt; `always`: fails for good.
    fail: Option<String>,
    /// A queue to send the order on to, through the outbox.
    forward_to: Option<String>,
    /// Send it on no earlier than this many milliseconds after it is staged.
    #[serde(default)]
    delay_ms: Option<u64>,
}

fn order(id: &str, cents: i64) -> Order {
    Order {
        id: id.to_owned(),
        cents,
        fail: None,
        forward_to: None,
        delay_ms: None,
    }
}

#[idempotent(key = "order.id", store = Sqlite, consumer = "guarantees.orders")]
async fn guarantees_orders(
    tx: &mut Transaction<'_, sqlx::Sqlite>,
    order: Order,
    ctx: &Context<'_>,
) -> Result<(), HandlerError> {
    if let Some(once) = order.fail.as_deref().filter(|f| f.starts_with("once")) {
        ATTEMPTS
            .lock()
            .unwrap()
            .push((once.to_owned(), ctx.attempt(), std::time::Instant::now()));
    }
    match order.fail.as_deref() {
        Some(f) if f.starts_with("once") && ctx.attempt() == 1 => {
            return Err(HandlerError::transient("not yet"));
        }
        Some("always") => return Err(HandlerError::permanent("no such customer")),
        _ => {}
    }
    sqlx::query("INSERT INTO applied (handler, id, cents, attempt) VALUES ('orders', ?, ?, ?)")
        .bind(&order.id)
        .bind(order.cents)
        .bind(i64::from(ctx.attempt()))
        .execute(&mut **tx)
        .await?;
    if let Some(queue) = &order.forward_to {
        let delay = order.delay_ms.map(Duration::from_millis);
        let shipped = Order {
            forward_to: None,
            delay_ms: None,
            ..order
        };
        let mut message = Outgoing::to_queue(queue.as_str(), &shipped)?;
        if let Some(delay) = delay {
            message = message.deliver_after(delay);
        }
        idem::outbox::stage(tx, ctx, message).await?;
    }
    Ok(())
}

#[idempotent(key = "order.id", store = Sqlite, consumer = "guarantees.shipping")]
async fn guarantees_shipping(
    tx: &mut Transaction<'_, sqlx::Sqlite>,
    order: Order,
    ctx: &Context<'_>,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO applied (handler, id, cents, attempt) VALUES ('shipping', ?, ?, ?)")
        .bind(&order.id)
        .bind(order.cents)
        .bind(i64::from(ctx.attempt()))
        .execute(&mut **tx)
        .await?;
    sqlx::query("INSERT INTO arrivals (id, at_ms) VALUES (?, ?)")
        .bind(&order.id)
        .bind(idem::transport::headers::epoch_ms())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Update {
    id: String,
    order: String,
    seq: i64,
    fail_once: bool,
}

/// The updates that already failed once.
/// When each attempt of an order that fails once (`fail: "once…"`, named per test) began.
static ATTEMPTS: std::sync::Mutex<Vec<(String, u32, std::time::Instant)>> =
    std::sync::Mutex::new(Vec::new());

static FAILED_ONCE: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Applies an order's status updates, refusing (for good) one that does not follow the last
/// applied.
#[idempotent(key = "update.id", store = Sqlite, consumer = "guarantees.status")]
async fn guarantees_status(
    tx: &mut Transaction<'_, sqlx::Sqlite>,
    update: Update,
    ctx: &Context<'_>,
) -> Result<(), HandlerError> {
    if update.fail_once {
        let mut failed = FAILED_ONCE.lock().unwrap();
        if !failed.contains(&update.id) {
            failed.push(update.id.clone());
            return Err(HandlerError::transient("a deadlock, say"));
        }
    }
    let last: Option<i64> = sqlx::query_scalar("SELECT MAX(seq) FROM status WHERE order_id = ?")
        .bind(&update.order)
        .fetch_one(&mut **tx)
        .await?;
    if last.unwrap_or(0) + 1 != update.seq {
        return Err(HandlerError::permanent(format!(
            "update {} of {} after {last:?}: out of order",
            update.seq, update.order
        )));
    }
    sqlx::query("INSERT INTO status (order_id, seq, routing_key) VALUES (?, ?, ?)")
        .bind(&update.order)
        .bind(update.seq)
        .bind(ctx.envelope().routing_key.as_deref())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The retry policy of the suite: short delays.
fn policy() -> RetryPolicy {
    RetryPolicy::new(3, Duration::from_millis(300), 2, Duration::from_secs(1)).unwrap()
}

/// One test's broker, queues and database.
struct World {
    bus: Bus,
    pool: SqlitePool,
    _dir: tempfile::TempDir,
    orders: String,
    shipping: String,
}

impl World {
    async fn new(bus: Bus, name: &str) -> Self {
        let (pool, dir) = common::sqlite(4).await;
        SqliteInbox::new(pool.clone()).migrate().await.unwrap();
        for table in [
            "CREATE TABLE applied (handler TEXT NOT NULL, id TEXT NOT NULL, cents INTEGER NOT NULL, attempt INTEGER NOT NULL)",
            "CREATE TABLE status (order_id TEXT NOT NULL, seq INTEGER NOT NULL, routing_key TEXT)",
            "CREATE TABLE arrivals (id TEXT NOT NULL, at_ms INTEGER NOT NULL)",
        ] {
            sqlx::query(table).execute(&pool).await.unwrap();
        }
        let (orders, shipping) = (unique(&format!("g-{name}")), unique("g-ship"));
        // Declared before anything is published, as a producer's deployment does.
        let specs = [
            (orders.as_str(), "guarantees.orders"),
            (shipping.as_str(), "guarantees.shipping"),
        ]
        .map(|(queue, consumer)| {
            let mut spec = QueueSpec::new(queue, consumer);
            spec.retry_delays = policy().delays();
            spec
        });
        bus.declare_specs(&specs).await;
        Self {
            bus,
            pool,
            _dir: dir,
            orders,
            shipping,
        }
    }

    /// A runtime of both handlers on `pool`.
    fn runtime_on(&self, pool: &SqlitePool) -> RuntimeBuilder {
        self.bus
            .transport(Runtime::builder())
            .store(SqliteInbox::new(pool.clone()))
            .handlers(["guarantees.orders", "guarantees.shipping"])
            .handler_queue("guarantees.orders", self.orders.as_str())
            .handler_queue("guarantees.shipping", self.shipping.as_str())
            .retry(policy())
            .relay(Duration::from_millis(200), Duration::from_millis(100))
    }

    fn runtime(&self) -> RuntimeBuilder {
        self.runtime_on(&self.pool)
    }

    /// Publishes copy `copy` of `order` to the orders queue (message id = the order id).
    async fn publish(&self, order: &Order, copy: u64) {
        let body = serde_json::to_vec(order).unwrap();
        self.publish_body(&order.id, body, copy).await;
    }

    async fn publish_body(&self, message_id: &str, body: Vec<u8>, copy: u64) {
        let message = idem::Envelope::new(body).with_message_id(message_id);
        self.bus.publish(&self.orders, &message, copy).await;
    }

    /// `(handler, id, cents, attempt)` of every application of an order, sorted. The table has
    /// no unique key: an order applied twice is there twice.
    async fn applied(&self) -> Vec<Applied> {
        let mut applied: Vec<Applied> =
            sqlx::query_as("SELECT handler, id, cents, attempt FROM applied")
                .fetch_all(&self.pool)
                .await
                .unwrap();
        applied.sort_unstable();
        applied
    }

    async fn cleanup(self) {
        for queue in [&self.orders, &self.shipping] {
            self.bus.delete_with(queue, &policy().delays()).await;
        }
    }
}

/// One application of an order: `(handler, id, cents, attempt)`.
type Applied = (String, String, i64, i64);

/// What `handler` must have applied: each of `orders` (id, cents) once, at attempt 1; sorted
/// as [`World::applied`] returns them.
fn each_once(handler: &str, orders: impl IntoIterator<Item = (String, i64)>) -> Vec<Applied> {
    let mut expected: Vec<Applied> = orders
        .into_iter()
        .map(|(id, cents)| (handler.to_owned(), id, cents, 1))
        .collect();
    expected.sort_unstable();
    expected
}

/// Runs each test on RabbitMQ and on NATS JetStream.
macro_rules! on_both_brokers {
    ($($test:ident),* $(,)?) => {
        mod rabbitmq {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    // The ordered handler's partitions need the consistent-hash plugin.
                    let url = super::common::broker::with_the_plugin().await.url.clone();
                    super::$test(super::Bus::of_url(&url).await).await;
                }
            )*
        }
        mod nats {
            $(
                #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
                async fn $test() {
                    // async-nats takes a URL without its scheme; the table of brokers needs it.
                    let url = super::common::bus::nats_url();
                    let url = match url.contains("://") {
                        true => url,
                        false => format!("nats://{url}"),
                    };
                    super::$test(super::Bus::of_url(&url).await).await;
                }
            )*
        }
    };
}

on_both_brokers!(
    copies_take_effect_once,
    copies_in_two_runtimes_at_once_take_effect_once,
    the_same_key_with_another_payload_is_dead_lettered_as_a_conflict,
    a_message_older_than_the_dedup_window_is_refused_unless_its_key_is_known,
    a_scheduled_send_arrives_after_its_time_once_across_a_relay_restart,
    failures_are_retried_or_dead_lettered_once_with_their_reasons,
    the_outbox_takes_each_event_to_the_next_hop_once,
    in_batch_mode_copies_take_effect_once_and_a_failure_is_retried,
    ordered_updates_apply_in_publish_order_across_two_runtimes,
);

async fn copies_take_effect_once(bus: Bus) {
    let w = World::new(bus, "once").await;
    let mut published = 0;
    for n in 0..40 {
        for copy in 0..(n % 3 + 1) {
            w.publish(&order(&format!("o-{n}"), n as i64), copy).await;
            published += 1;
        }
    }
    w.bus.confirm().await;
    let running = start(w.runtime());
    wait_until("every copy settled", DEADLINE, || async {
        running.now().settled() >= published
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.processed, seen.duplicates, seen.dead_lettered),
        (40, published - 40, 0)
    );
    let orders = (0..40).map(|n| (format!("o-{n}"), n));
    assert_eq!(w.applied().await, each_once("orders", orders));
    w.cleanup().await;
}

/// Two runtimes on two connection pools consume the same queue at once, and every order comes
/// in three copies: the inbox's unique key settles each order once, whichever runtime gets
/// which copy; both runtimes apply some.
async fn copies_in_two_runtimes_at_once_take_effect_once(bus: Bus) {
    let w = World::new(bus, "two").await;
    // The same database file, through connections of the second runtime's own.
    let other_pool = common::sqlite_at(&w._dir.path().join("idem.db"), 4).await;
    // Both consume before the first copy is published: neither can take every copy alone.
    let (first, first_health) = start_watched(w.runtime());
    let (second, second_health) = start_watched(w.runtime_on(&other_pool));
    wait_until("both runtimes consuming", DEADLINE, || async {
        first_health.is_consuming() && second_health.is_consuming()
    })
    .await;
    for n in 0..60 {
        for copy in 0..3 {
            w.publish(&order(&format!("c-{n}"), n), copy).await;
        }
    }
    w.bus.confirm().await;
    wait_until("every copy settled", DEADLINE, || async {
        first.now().settled() + second.now().settled() >= 180
    })
    .await;
    let (a, b) = (first.shut_down().await, second.shut_down().await);
    assert_eq!(a.processed + b.processed, 60, "{a:?} {b:?}");
    assert_eq!(a.duplicates + b.duplicates, 120, "{a:?} {b:?}");
    assert_eq!(a.dead_lettered + b.dead_lettered, 0);
    assert!(
        a.processed > 0 && b.processed > 0,
        "both runtimes applied orders: {a:?} {b:?}"
    );
    let orders = (0..60).map(|n| (format!("c-{n}"), n));
    assert_eq!(w.applied().await, each_once("orders", orders));
    w.cleanup().await;
}

async fn the_same_key_with_another_payload_is_dead_lettered_as_a_conflict(bus: Bus) {
    let w = World::new(bus, "conflict").await;
    w.publish(&order("k-1", 5), 0).await;
    w.bus.confirm().await;
    let running = start(w.runtime());
    wait_until("the first applied", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    // The same key, another amount: a producer that reused an id.
    w.publish(&order("k-1", 6), 1).await;
    w.bus.confirm().await;
    wait_until("the second settled", DEADLINE, || async {
        running.now().conflicts == 1
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.conflicts), (1, 1), "{seen:?}");
    assert_eq!(w.applied().await, [("orders".into(), "k-1".into(), 5, 1)]);
    let letters = w.bus.dead_letters(&w.orders).await;
    // The reason is in the store's record (RabbitMQ moves the message itself to the DLQ;
    // NATS also puts the reason in a header).
    assert_eq!(letters.len(), 1);
    let body: Order = serde_json::from_slice(&letters[0].body).unwrap();
    assert_eq!(body.cents, 6, "the second payload is the one refused");
    let records = SqliteInbox::new(w.pool.clone())
        .dead_letters(&w.orders)
        .await
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(
        (records[0].reason.as_str(), records[0].key.as_str()),
        ("conflict", "k-1")
    );
    w.cleanup().await;
}

/// The dedup window: a message published longer ago than its consumer's retention (120 s
/// before, against 30 s) whose key the inbox does not hold is dead-lettered as
/// `beyond-dedup-window`, not applied as new; an old copy of a key the inbox holds is still a
/// duplicate; a message within the window is applied. The publish time travels as the broker
/// carries it (AMQP `timestamp`, NATS `Idem-Published`).
async fn a_message_older_than_the_dedup_window_is_refused_unless_its_key_is_known(bus: Bus) {
    let w = World::new(bus, "window").await;
    let now = idem::transport::headers::epoch_ms();
    let old = now - 120_000;
    let message = |id: &str, published: i64| {
        idem::Envelope::new(serde_json::to_vec(&order(id, 3)).unwrap())
            .with_message_id(id)
            .with_published_at_ms(published)
    };
    w.bus.publish(&w.orders, &message("w-1", now), 0).await;
    w.bus.confirm().await;
    let runtime = w
        .bus
        .transport(Runtime::builder())
        .store(SqliteInbox::new(w.pool.clone()).outbox_give_up(Duration::from_secs(10)))
        .handlers(["guarantees.orders"])
        .handler_queue("guarantees.orders", w.orders.as_str())
        .retry(policy())
        .retention(Duration::from_secs(30));
    let running = start(runtime);
    wait_until("w-1 applied", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    w.bus.publish(&w.orders, &message("w-1", old), 1).await;
    w.bus.publish(&w.orders, &message("w-2", old), 0).await;
    w.bus.confirm().await;
    wait_until("both settled", DEADLINE, || async {
        let seen = running.now();
        seen.duplicates == 1 && seen.dead_lettered == 1
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.processed, seen.duplicates, seen.dead_lettered),
        (1, 1, 1),
        "{seen:?}"
    );
    assert_eq!(w.applied().await, [("orders".into(), "w-1".into(), 3, 1)]);
    let records = SqliteInbox::new(w.pool.clone())
        .dead_letters(&w.orders)
        .await
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(
        (records[0].reason.as_str(), records[0].key.as_str()),
        ("beyond-dedup-window", "w-2")
    );
    assert!(
        records[0].detail.contains("not applied as new"),
        "{records:?}"
    );
    w.cleanup().await;
}

/// A scheduled send: the order's event is staged to go 3 s later; the runtime that staged it
/// stops before then, and another starts. The event arrives once, not before its time, and
/// published as of its time.
async fn a_scheduled_send_arrives_after_its_time_once_across_a_relay_restart(bus: Bus) {
    let w = World::new(bus, "later").await;
    let later = Order {
        forward_to: Some(w.shipping.clone()),
        delay_ms: Some(3_000),
        ..order("l-1", 4)
    };
    let published = idem::transport::headers::epoch_ms();
    w.publish(&later, 0).await;
    w.bus.confirm().await;
    let first = start(w.runtime());
    wait_until("the order applied", DEADLINE, || async {
        first.now().processed == 1
    })
    .await;
    first.shut_down().await;
    let waiting: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_outbox")
        .fetch_one(&w.pool)
        .await
        .unwrap();
    assert_eq!(waiting, 1, "the event waits in the outbox for its time");

    let second = start(w.runtime());
    wait_until("the event applied", DEADLINE, || async {
        second.now().processed == 1
    })
    .await;
    let seen = second.shut_down().await;
    assert_eq!((seen.processed, seen.duplicates), (1, 0), "{seen:?}");
    let mut expected = each_once("orders", [("l-1".to_owned(), 4)]);
    expected.extend(each_once("shipping", [("l-1".to_owned(), 4)]));
    expected.sort_unstable();
    assert_eq!(w.applied().await, expected);
    let arrived: i64 = sqlx::query_scalar("SELECT at_ms FROM arrivals WHERE id = 'l-1'")
        .fetch_one(&w.pool)
        .await
        .unwrap();
    assert!(
        arrived >= published + 3_000,
        "arrived {} ms after the order was published, before its 3 s",
        arrived - published
    );
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_outbox")
        .fetch_one(&w.pool)
        .await
        .unwrap();
    assert_eq!(left, 0);
    w.cleanup().await;
}

async fn failures_are_retried_or_dead_lettered_once_with_their_reasons(bus: Bus) {
    let w = World::new(bus, "fail").await;
    let once = Order {
        fail: Some(format!("once {}", w.orders)),
        ..order("t-1", 7)
    };
    let always = Order {
        fail: Some("always".to_owned()),
        ..order("p-1", 9)
    };
    w.publish(&once, 0).await;
    w.publish(&always, 0).await;
    // Bytes that are not JSON, nor UTF-8, with a NUL: dead-lettered as undecodable.
    let bad: &[u8] = b"\xff\x00{not json";
    w.publish_body("bad-1", bad.to_vec(), 0).await;
    w.bus.confirm().await;
    let running = start(w.runtime());
    wait_until("all three settled", DEADLINE, || async {
        let now = running.now();
        now.processed == 1 && now.dead_lettered == 2
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.retried, seen.processed, seen.dead_lettered),
        (1, 1, 2)
    );
    // The retry waited out the policy's first delay (300 ms, less up to a quarter of jitter
    // where the broker delays each copy on its own) and ran as attempt 2: measured between
    // the two attempts' starts, not from the runtime's start.
    let attempts: Vec<(u32, std::time::Instant)> = ATTEMPTS
        .lock()
        .unwrap()
        .iter()
        .filter(|(name, ..)| Some(name) == once.fail.as_ref())
        .map(|(_, attempt, at)| (*attempt, *at))
        .collect();
    assert_eq!(
        attempts.iter().map(|(a, _)| *a).collect::<Vec<_>>(),
        [1, 2],
        "one failed attempt, then one retry"
    );
    let gap = attempts[1].1 - attempts[0].1;
    assert!(
        gap >= Duration::from_millis(225),
        "the retry came {gap:?} after the first attempt"
    );
    assert_eq!(w.applied().await, [("orders".into(), "t-1".into(), 7, 2)]);
    let mut letters = w.bus.dead_letters(&w.orders).await;
    assert_eq!(letters.len(), 2, "each dead-lettered once");
    letters.sort_by_key(|l| l.body.starts_with(b"\xff"));
    assert_eq!(letters[0].message_id.as_deref(), Some("p-1"));
    assert_eq!(letters[1].body, bad);
    let records = SqliteInbox::new(w.pool.clone())
        .dead_letters(&w.orders)
        .await
        .unwrap();
    assert_eq!(records.len(), 2, "{records:?}");
    assert!(
        records
            .iter()
            .any(|r| (r.reason.as_str(), r.key.as_str()) == ("handler", "p-1"))
    );
    assert!(
        records
            .iter()
            .any(|r| r.reason == "decode" && r.describes(Some("bad-1"), bad))
    );
    w.cleanup().await;
}

async fn the_outbox_takes_each_event_to_the_next_hop_once(bus: Bus) {
    let w = World::new(bus, "outbox").await;
    for n in 0..10 {
        let forwarded = Order {
            forward_to: Some(w.shipping.clone()),
            ..order(&format!("s-{n}"), n)
        };
        // Each order twice: its event is staged once.
        for copy in 0..2 {
            w.publish(&forwarded, copy).await;
        }
    }
    w.bus.confirm().await;
    let running = start(w.runtime());
    wait_until("both hops processed", DEADLINE, || async {
        running.now().processed >= 20
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.dead_lettered), (20, 0), "{seen:?}");
    let orders = || (0..10).map(|n| (format!("s-{n}"), n));
    let mut expected = each_once("orders", orders());
    expected.extend(each_once("shipping", orders()));
    assert_eq!(w.applied().await, expected, "each order and its event once");
    let unpublished: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_outbox")
        .fetch_one(&w.pool)
        .await
        .unwrap();
    assert_eq!(unpublished, 0);
    // A destination no queue takes is refused by name on both brokers, never dropped.
    let nowhere = Outgoing::to_queue(unique("g-nowhere"), &order("x", 1)).unwrap();
    let sent = w.bus.outbound().publish(&nowhere).await;
    assert!(
        matches!(&sent, Err(idem::transport::OutboundError::Unroutable { destination })
            if *destination == nowhere.destination),
        "{sent:?}"
    );
    w.cleanup().await;
}

/// Batch mode (one transaction per batch of deliveries): copies within a batch and across
/// batches take effect once, and a transient failure in a batch is retried as the next
/// attempt while the rest of its batch commits.
async fn in_batch_mode_copies_take_effect_once_and_a_failure_is_retried(bus: Bus) {
    let w = World::new(bus, "batch").await;
    let mut published = 0;
    for n in 0..60 {
        let mut o = order(&format!("b-{n}"), n);
        if n == 8 {
            o.fail = Some("once".to_owned());
        }
        for copy in 0..(n % 2 + 1) {
            w.publish(&o, copy as u64).await;
            published += 1;
        }
    }
    w.bus.confirm().await;
    let running = start(w.runtime().batch(16));
    wait_until("every order applied", DEADLINE, || async {
        running.now().processed >= 60
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.dead_lettered), (60, 0));
    assert!(seen.retried >= 1, "{seen:?}");
    assert_eq!(seen.duplicates, published - 60, "{seen:?}");
    // The failed order applied once, as attempt 2; every other once, as attempt 1.
    let mut expected = each_once("orders", (0..60).map(|n| (format!("b-{n}"), n)));
    for applied in &mut expected {
        if applied.1 == "b-8" {
            applied.3 = 2;
        }
    }
    expected.sort_unstable();
    assert_eq!(w.applied().await, expected);
    w.cleanup().await;
}

/// An ordered handler on two partitions, consumed by two runtimes at once: every order's ten
/// status updates apply in publish order (an update out of order would be dead-lettered), with
/// transient failures retried in place, and each delivery's routing key is its order's key.
async fn ordered_updates_apply_in_publish_order_across_two_runtimes(bus: Bus) {
    let w = World::new(bus, "ordered").await;
    let source = unique("g-status");
    let mut partitions = QueueSpec::partitions(&source, "guarantees.status", 2);
    for spec in &mut partitions {
        spec.retry_delays = policy().delays();
    }
    w.bus.declare_specs(&partitions).await;
    let mut updates = Vec::new();
    for seq in 1..=10 {
        for order in 0..20 {
            let update = Update {
                id: format!("{source}-{order}:{seq}"),
                order: format!("{source}-{order}"),
                seq,
                fail_once: (order + seq) % 7 == 0,
            };
            let mut message = Outgoing::to_topic(&source, &update.order, &update).unwrap();
            message.envelope.message_id = Some(update.id.clone());
            updates.push(message);
        }
    }
    for result in w.bus.outbound().publish_all(&updates).await {
        result.unwrap();
    }
    let runtime = || {
        w.bus
            .transport(Runtime::builder())
            .store(SqliteInbox::new(w.pool.clone()))
            .handlers(["guarantees.status"])
            .handler_queue("guarantees.status", source.as_str())
            .ordered("guarantees.status", 2)
            .retry(policy())
    };
    let (a, b) = (start(runtime()), start(runtime()));
    wait_until("every update settled", DEADLINE, || async {
        let (a, b) = (a.now(), b.now());
        a.processed + b.processed + a.dead_lettered + b.dead_lettered >= 200
    })
    .await;
    let (a, b) = (a.shut_down().await, b.shut_down().await);
    assert_eq!(
        a.dead_lettered + b.dead_lettered,
        0,
        "an update out of order"
    );
    assert_eq!(a.processed + b.processed, 200);
    assert!(
        a.retried + b.retried > 0,
        "no transient failure was retried"
    );
    let applied: Vec<(String, i64)> =
        sqlx::query_as("SELECT order_id, seq FROM status ORDER BY rowid")
            .fetch_all(&w.pool)
            .await
            .unwrap();
    assert_eq!(applied.len(), 200);
    for order in 0..20 {
        let key = format!("{source}-{order}");
        let seqs: Vec<i64> = applied
            .iter()
            .filter(|(o, _)| *o == key)
            .map(|(_, s)| *s)
            .collect();
        assert_eq!(seqs, (1..=10).collect::<Vec<_>>(), "{key}");
    }
    // Each delivery's routing key is the key it was published with (its order), not the
    // partition it came through.
    let keyed: Vec<(String, Option<String>)> = sqlx::query_as(
        "SELECT order_id, routing_key FROM status WHERE routing_key IS NOT order_id",
    )
    .fetch_all(&w.pool)
    .await
    .unwrap();
    assert!(
        keyed.is_empty(),
        "routing keys that are not the order: {:?}",
        &keyed[..keyed.len().min(3)]
    );
    for spec in &partitions {
        w.bus.delete_with(&spec.queue, &policy().delays()).await;
    }
    w.bus.delete_source(&source).await;
    w.cleanup().await;
}
