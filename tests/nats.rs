//! What is JetStream's own in the runtime on NATS (`idem::nats`), against a real server and a
//! real SQLite inbox: JetStream's duplicate window, in-progress signals, dead letters with
//! their reason in headers, the outbox's ids as `Nats-Msg-Id`, a connection cut, streams
//! deleted under the consumer (and acks that must not cross their re-creation), TLS, a start without a server and the orders demo. The
//! guarantees both brokers share are tested once for both in `tests/guarantees.rs`. NATS must
//! listen on `NATS_URL` (default `nats://127.0.0.1:4222`) with JetStream enabled.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use async_nats::HeaderMap;
use async_nats::jetstream::Context as JetStream;
use common::bus::{jetstream_or_fail, nats_url};
use common::running::{DEADLINE, start};
use common::watched;
use common::{unique, wait_until};
use idem::nats::{NatsConfig, NatsTransport};
use idem::prelude::*;
use idem::sql::SqliteInbox;
use idem::transport::{QueueSpec, Transport};
use sqlx::SqlitePool;
use std::time::Duration;

#[derive(serde::Serialize, serde::Deserialize)]
struct Order {
    id: String,
    cents: i64,
    /// `once`: fails transiently on its first attempt; `transient`: on every attempt;
    /// `always`: fails for good; `brief`: takes 1.5 s; `slow`: 3.5 s; `slower`: 8 s.
    fail: Option<String>,
    /// A queue to send the order on to, through the outbox.
    forward_to: Option<String>,
}

/// The ids of the orders whose handler has started, in order.
static STARTED: std::sync::Mutex<Vec<String>> = std::sync::Mutex::new(Vec::new());

/// Whether the handler of order `id` has started.
fn started(id: &str) -> bool {
    STARTED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|started| started == id)
}

#[idempotent(key = "order.id", store = Sqlite, consumer = "nats.orders")]
async fn nats_orders(
    tx: &mut Transaction<'_, sqlx::Sqlite>,
    order: Order,
    ctx: &Context<'_>,
) -> Result<(), HandlerError> {
    STARTED
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(order.id.clone());
    match order.fail.as_deref() {
        Some("once") if ctx.attempt() == 1 => return Err(HandlerError::transient("not yet")),
        Some("transient") => return Err(HandlerError::transient("still not")),
        Some("always") => return Err(HandlerError::permanent("no such customer")),
        Some("brief") => tokio::time::sleep(Duration::from_millis(1500)).await,
        Some("slow") => tokio::time::sleep(Duration::from_millis(3500)).await,
        Some("slower") => tokio::time::sleep(Duration::from_secs(8)).await,
        _ => {}
    }
    sqlx::query(
        "INSERT INTO nats_applied (handler, id, cents, attempt) VALUES ('orders', ?, ?, ?)",
    )
    .bind(&order.id)
    .bind(order.cents)
    .bind(i64::from(ctx.attempt()))
    .execute(&mut **tx)
    .await?;
    if let Some(queue) = &order.forward_to {
        let shipped = Order {
            forward_to: None,
            fail: None,
            ..order
        };
        idem::outbox::stage(tx, ctx, Outgoing::to_queue(queue.as_str(), &shipped)?).await?;
    }
    Ok(())
}

#[idempotent(key = "order.id", store = Sqlite, consumer = "nats.shipping")]
async fn nats_shipping(
    tx: &mut Transaction<'_, sqlx::Sqlite>,
    order: Order,
    ctx: &Context<'_>,
) -> Result<(), HandlerError> {
    let message_id = ctx.message_id().unwrap_or_default().to_owned();
    sqlx::query("INSERT INTO nats_applied (handler, id, cents, attempt, message_id) VALUES ('shipping', ?, ?, ?, ?)")
        .bind(&order.id)
        .bind(order.cents)
        .bind(i64::from(ctx.attempt()))
        .bind(message_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// A SQLite database of the test's own: the migrated inbox and the handlers' tables.
async fn database() -> (SqlitePool, tempfile::TempDir) {
    let (pool, dir) = common::sqlite(4).await;
    SqliteInbox::new(pool.clone()).migrate().await.unwrap();
    for table in [
        "CREATE TABLE nats_applied (handler TEXT NOT NULL, id TEXT NOT NULL, cents INTEGER NOT NULL, attempt INTEGER NOT NULL, message_id TEXT)",
    ] {
        sqlx::query(table).execute(&pool).await.unwrap();
    }
    (pool, dir)
}

/// One test's world: its queues, its SQLite inbox with the handlers' table, its transport.
struct World {
    js: JetStream,
    pool: SqlitePool,
    _dir: tempfile::TempDir,
    orders: String,
    shipping: String,
    transport: NatsTransport,
}

impl World {
    async fn new(name: &str) -> Self {
        Self::with_url(name, &nats_url()).await
    }

    /// A world whose transport connects to `url` (a proxy, say).
    async fn with_url(name: &str, url: &str) -> Self {
        let js = jetstream_or_fail().await;
        let (pool, dir) = database().await;
        let transport = NatsTransport::new(NatsConfig::new(url));
        let (orders, shipping) = (unique(&format!("nats-{name}")), unique("nats-ship"));
        // Declared before anything is published, as a producer's deployment does.
        let specs = [
            QueueSpec::new(orders.as_str(), "nats.orders"),
            QueueSpec::new(shipping.as_str(), "nats.shipping"),
        ];
        transport.declare(&specs).await.unwrap();
        Self {
            js,
            pool,
            _dir: dir,
            orders,
            shipping,
            transport,
        }
    }

    fn runtime(&self) -> idem::RuntimeBuilder {
        Runtime::builder()
            .transport(self.transport.clone())
            .store(SqliteInbox::new(self.pool.clone()))
            .handlers(["nats.orders", "nats.shipping"])
            .handler_queue("nats.orders", self.orders.as_str())
            .handler_queue("nats.shipping", self.shipping.as_str())
            .retry(
                RetryPolicy::new(3, Duration::from_millis(300), 2, Duration::from_secs(1)).unwrap(),
            )
            .relay(Duration::from_millis(200), Duration::from_millis(100))
    }

    /// Publishes `order` to the orders queue as JetStream message `nats_id`; whether JetStream
    /// took it as a duplicate of an earlier one.
    async fn publish(&self, nats_id: &str, order: &Order) -> bool {
        self.publish_bytes(nats_id, serde_json::to_vec(order).unwrap())
            .await
    }

    /// Publishes `body` as it is to the orders queue as JetStream message `nats_id`; whether
    /// JetStream took it as a duplicate of an earlier one.
    async fn publish_bytes(&self, nats_id: &str, body: Vec<u8>) -> bool {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", nats_id);
        let ack = self
            .js
            .publish_with_headers(self.orders.clone(), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
        ack.duplicate
    }

    /// Publishes `order` as JetStream message `nats_id` again and again until the orders
    /// queue's stream takes it: after the stream was deleted, until the consumer declared it
    /// again (a publish to a subject no stream holds is refused).
    async fn publish_once_declared(&self, nats_id: &str, order: &Order) {
        wait_until("the stream declared again", DEADLINE, || async {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", nats_id);
            let body = serde_json::to_vec(order).unwrap();
            match self
                .js
                .publish_with_headers(self.orders.clone(), headers, body.into())
                .await
            {
                Ok(ack) => ack.await.is_ok(),
                Err(_) => false,
            }
        })
        .await;
    }

    /// `(handler, id, cents, attempt, message_id)` of every application of an order, sorted.
    /// The table has no unique key: an order applied twice is there twice.
    async fn applied(&self) -> Vec<(String, String, i64, i64, Option<String>)> {
        let mut applied: Vec<_> =
            sqlx::query_as("SELECT handler, id, cents, attempt, message_id FROM nats_applied")
                .fetch_all(&self.pool)
                .await
                .unwrap();
        applied.sort_unstable();
        applied
    }

    /// `(handler, id)` of every application of an order, sorted.
    async fn applied_ids(&self) -> Vec<(String, String)> {
        applied_ids(&self.pool).await
    }

    async fn cleanup(self) {
        for queue in [&self.orders, &self.shipping] {
            let stream = format!("IDEM_{queue}");
            for name in [
                stream.clone(),
                format!("{stream}_RETRY"),
                format!("{stream}_DLQ"),
            ] {
                let _ = self.js.delete_stream(&name).await;
            }
        }
    }
}

/// `(handler, id)` of every application of an order in `pool`, sorted.
async fn applied_ids(pool: &SqlitePool) -> Vec<(String, String)> {
    let mut applied: Vec<(String, String)> = sqlx::query_as("SELECT handler, id FROM nats_applied")
        .fetch_all(pool)
        .await
        .unwrap();
    applied.sort_unstable();
    applied
}

/// Each of `ids` applied once by `handler`, sorted as [`applied_ids`] returns them.
fn each_once(handler: &str, ids: impl IntoIterator<Item = String>) -> Vec<(String, String)> {
    let mut expected: Vec<(String, String)> =
        ids.into_iter().map(|id| (handler.to_owned(), id)).collect();
    expected.sort_unstable();
    expected
}

/// A runtime of the orders handler alone, on `queue`, through `transport`, on `pool`.
fn orders_alone(transport: &NatsTransport, pool: &SqlitePool, queue: &str) -> idem::RuntimeBuilder {
    Runtime::builder()
        .transport(transport.clone())
        .store(SqliteInbox::new(pool.clone()))
        .handlers(["nats.orders"])
        .handler_queue("nats.orders", queue)
}

fn order(id: &str, cents: i64) -> Order {
    Order {
        id: id.to_owned(),
        cents,
        fail: None,
        forward_to: None,
    }
}

/// How many messages `stream` holds.
async fn stored(js: &JetStream, stream: &str) -> u64 {
    let mut stream = js.get_stream(stream).await.unwrap();
    stream.info().await.unwrap().state.messages
}

/// The durable consumer idem's `nats.orders` handler reads `queue` through, for reading what
/// JetStream counted (deliveries, pending, acks pending).
async fn orders_consumer(
    js: &async_nats::jetstream::Context,
    queue: &str,
) -> async_nats::jetstream::consumer::PullConsumer {
    js.get_stream(format!("IDEM_{queue}"))
        .await
        .unwrap()
        .get_consumer("nats_orders")
        .await
        .unwrap()
}

/// JetStream's duplicate window: a copy published again with a JetStream id it took is
/// dropped before it reaches the inbox; and the shutdown waits for the acks' confirm, so
/// nothing is left in the work queue. (Copies JetStream keeps are settled by the inbox: `tests/guarantees.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jetstream_drops_a_copy_with_an_id_it_took_and_the_queue_ends_empty() {
    let w = World::new("window").await;
    for n in 0..10 {
        assert!(
            !w.publish(&format!("o-{n}"), &order(&format!("o-{n}"), n))
                .await
        );
    }
    assert!(w.publish("o-0", &order("o-0", 0)).await, "kept twice");
    let running = start(w.runtime());
    wait_until("every order settled", DEADLINE, || async {
        running.now().settled() >= 10
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.processed, seen.duplicates, seen.dead_lettered),
        (10, 0, 0)
    );
    let mut stream = w.js.get_stream(format!("IDEM_{}", w.orders)).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 0);
    w.cleanup().await;
}

/// Acks are plain and confirmed in bulk: of 300 deliveries, each is acked once without asking
/// for an answer, and a few confirms (acks asking for JetStream's answer, on a delivery
/// already acked) follow them, the last one after every plain ack; the runtime's shutdown
/// waits for it, so the work queue is empty as soon as the shutdown returns.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn acks_are_plain_and_confirmed_in_bulk_the_last_before_the_shutdown_ends() {
    use futures_util::StreamExt as _;
    let w = World::new("bulk").await;
    // What the consumer sends JetStream about its deliveries, seen on a connection of the
    // test's own: the ack subjects are ordinary subjects.
    let watcher = async_nats::connect(nats_url()).await.unwrap();
    let mut acks = watcher
        .subscribe(format!("$JS.ACK.IDEM_{}.nats_orders.>", w.orders))
        .await
        .unwrap();
    watcher.flush().await.unwrap();
    let orders = 300;
    for n in 0..orders {
        w.publish(&format!("b-{n}"), &order(&format!("b-{n}"), n))
            .await;
    }
    let started = std::time::Instant::now();
    let running = start(w.runtime());
    wait_until("every order settled", DEADLINE, || async {
        running.now().settled() >= orders as u64
    })
    .await;
    running.shut_down().await;
    let ran = started.elapsed();
    let mut stream = w.js.get_stream(format!("IDEM_{}", w.orders)).await.unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 0);

    // Plain acks (no reply subject) and confirms (a reply subject), in the server's order,
    // until every delivery's plain ack and a confirm after the last of them were seen.
    let (mut plain, mut confirms, mut confirmed_last) = (0, 0, false);
    let seen = tokio::time::timeout(DEADLINE, async {
        while let Some(message) = acks.next().await {
            if message.payload.as_ref() == b"+WPI" {
                continue; // in progress
            }
            assert_eq!(message.payload.as_ref(), b"+ACK");
            match message.reply {
                None => {
                    plain += 1;
                    confirmed_last = false;
                }
                Some(_) => {
                    confirms += 1;
                    confirmed_last = true;
                }
            }
            if plain == orders && confirmed_last {
                return;
            }
        }
    })
    .await;
    assert!(
        seen.is_ok(),
        "{plain} plain acks, {confirms} confirms, the last confirmed: {confirmed_last}"
    );
    // One confirm per linger (50 ms) at most while acks come, whatever the machine's speed
    // (a count of acks would depend on it: a slow disk spreads 300 commits over seconds).
    let most = i64::try_from(ran.as_millis() / 50).unwrap() + 2;
    assert!(
        (1..=most.min(orders / 3)).contains(&confirms),
        "{confirms} confirms for {orders} acks in {ran:?}"
    );
    w.cleanup().await;
}

/// A retry copy whose removal from the retry stream JetStream never confirms (a proxy drops
/// the answers to confirmed acks for longer than the confirm waits): the forwarder warns and
/// goes on, so the queue's session is never ended, and the order is applied once, on its
/// second attempt, with both streams empty afterwards.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_retry_copy_whose_removal_is_not_confirmed_does_not_end_the_session() {
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let target = nats_url()
        .trim_start_matches("nats://")
        .rsplit('@')
        .next()
        .unwrap()
        .to_owned();
    let (dropping, dropped) = (Arc::new(AtomicBool::new(false)), Arc::default());
    let proxy = common::proxy::Proxy::start_dropping_nats_answers(
        &target,
        dropping.clone(),
        Arc::clone(&dropped),
    )
    .await;
    let w = World::with_url("unconfirmed", &format!("nats://127.0.0.1:{}", proxy.port())).await;
    let mut once = order("u-1", 1);
    once.fail = Some("once".to_owned());
    w.publish("u-1", &once).await;
    let running = start(w.runtime());
    // The first attempt failed: its copy waits in the retry stream, the original is acked.
    let (queue, retries) = (
        format!("IDEM_{}", w.orders),
        format!("IDEM_{}_RETRY", w.orders),
    );
    wait_until("the copy in the retry stream", DEADLINE, || async {
        stored(&w.js, &retries).await == 1
    })
    .await;
    wait_until("the original acked", DEADLINE, || async {
        let mut orders = orders_consumer(&w.js, &w.orders).await;
        orders.info().await.unwrap().num_ack_pending == 0
    })
    .await;
    // From now on no confirmed ack is answered, the forwarder's removal of the copy among them.
    dropping.store(true, Ordering::SeqCst);
    let opened = tokio::time::Instant::now();
    let watched = w.orders.clone();
    let transport = w.transport.clone();
    let session_lost = Arc::new(AtomicBool::new(false));
    let lost = session_lost.clone();
    let watching = tokio::spawn(async move {
        loop {
            if !transport.connected(&watched) {
                lost.store(true, Ordering::SeqCst);
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    });
    wait_until("the second attempt applied", DEADLINE, || async {
        w.applied().await.len() == 1
    })
    .await;
    // The stimulus: the answers stay away longer than a confirm waits (5 s), so the removal's
    // confirm fails while the session runs on.
    tokio::time::sleep_until(opened + Duration::from_secs(7)).await;
    dropping.store(false, Ordering::SeqCst);
    watching.abort();
    assert!(dropped.load(Ordering::SeqCst) >= 1, "no answer was dropped");
    assert!(
        !session_lost.load(Ordering::SeqCst),
        "the queue's session ended"
    );
    wait_until("both streams empty", DEADLINE, || async {
        stored(&w.js, &retries).await == 0 && stored(&w.js, &queue).await == 0
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.dead_lettered), (1, 0));
    let applied = w.applied().await;
    assert_eq!(applied.len(), 1, "{applied:?}");
    assert_eq!(
        applied[0].3, 2,
        "applied on its second attempt: {applied:?}"
    );
    w.cleanup().await;
}

/// A queue of its own, on a transport with an ack wait of 1 s, holding one order whose handler
/// takes 3.5 s.
struct Slow {
    js: JetStream,
    pool: SqlitePool,
    _db: tempfile::TempDir,
    transport: NatsTransport,
    queue: String,
}

impl Slow {
    async fn published(name: &str, id: &str) -> Self {
        let js = jetstream_or_fail().await;
        let (pool, _db) = database().await;
        let transport =
            NatsTransport::new(NatsConfig::new(nats_url()).ack_wait(Duration::from_secs(1)));
        let queue = unique(name);
        transport
            .declare(&[QueueSpec::new(queue.as_str(), "nats.orders")])
            .await
            .unwrap();
        let mut slow = order(id, 1);
        slow.fail = Some("slow".to_owned());
        let message = idem::Envelope::new(serde_json::to_vec(&slow).unwrap()).with_message_id(id);
        transport.publish(&queue, &message, None).await.unwrap();
        Self {
            js,
            pool,
            _db,
            transport,
            queue,
        }
    }
}

/// A handler that runs longer than the ack wait is not redelivered while it runs: JetStream is
/// told the delivery is in progress. With an ack wait of 1 s, a handler of 3.5 s would
/// otherwise see its message delivered again three times.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_longer_than_the_ack_wait_is_not_redelivered_while_it_runs() {
    let Slow {
        js,
        pool,
        _db,
        transport,
        queue,
    } = Slow::published("nats-slow", "slow-1").await;
    let running = start(orders_alone(&transport, &pool, &queue));
    wait_until("the slow order applied", DEADLINE, || async {
        running.now().processed >= 1
    })
    .await;
    // Every delivery, redeliveries included, takes a consumer sequence number.
    let mut consumer = orders_consumer(&js, &queue).await;
    let delivered = consumer.info().await.unwrap().delivered.consumer_sequence;
    let seen = running.shut_down().await;
    assert_eq!(
        delivered, 1,
        "the message was delivered again while its handler ran"
    );
    assert_eq!((seen.processed, seen.duplicates), (1, 0));
    transport.delete_queue(&queue).await.unwrap();
}

/// Deliveries the process holds but no handler has taken yet are told in progress too: one
/// handler at a time, each run longer than the ack wait, and more orders than it holds at once.
/// Every order is delivered once. (Before, messages the client had pulled ahead waited in its
/// buffer untold, and JetStream delivered them again while the process held them.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn deliveries_waiting_for_a_handler_are_not_redelivered() {
    let js = jetstream_or_fail().await;
    let (pool, _db) = database().await;
    let transport =
        NatsTransport::new(NatsConfig::new(nats_url()).ack_wait(Duration::from_secs(1)));
    let queue = unique("nats-held");
    transport
        .declare(&[QueueSpec::new(queue.as_str(), "nats.orders")])
        .await
        .unwrap();
    let ids: Vec<String> = (0..6).map(|n| format!("h-{n}")).collect();
    for id in &ids {
        let mut brief = order(id, 1);
        brief.fail = Some("brief".to_owned());
        let message = idem::Envelope::new(serde_json::to_vec(&brief).unwrap()).with_message_id(id);
        transport.publish(&queue, &message, None).await.unwrap();
    }
    let running = start(
        orders_alone(&transport, &pool, &queue)
            .concurrency(1)
            .prefetch(2),
    );
    wait_until("every order applied", DEADLINE, || async {
        running.now().processed >= 6
    })
    .await;
    let mut consumer = orders_consumer(&js, &queue).await;
    // Every delivery, redeliveries included, takes a consumer sequence number.
    let delivered = consumer.info().await.unwrap().delivered.consumer_sequence;
    let seen = running.shut_down().await;
    assert_eq!(
        delivered, 6,
        "orders delivered again while the process held them"
    );
    assert_eq!((seen.processed, seen.duplicates), (6, 0));
    assert_eq!(applied_ids(&pool).await, each_once("orders", ids));
    transport.delete_queue(&queue).await.unwrap();
}

/// A runtime asked to stop while a handler longer than the ack wait runs keeps telling
/// JetStream the delivery is in progress until it settles: a second process consuming the
/// queue is not handed the message meanwhile. (The signals stopped with the consumer, and the
/// second process ran it again a second after the stop.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_handler_running_at_shutdown_is_still_told_in_progress() {
    let Slow {
        js,
        pool,
        _db,
        transport,
        queue,
    } = Slow::published("nats-stopping", "slow-2").await;
    let mut consumer = orders_consumer(&js, &queue).await;
    let first = start(orders_alone(&transport, &pool, &queue));
    // Its handler running, not only the delivery in the process's mailbox (a stop then gives
    // it back unstarted; a CI run under load met that).
    wait_until("the first process running the order", DEADLINE, || {
        let mut consumer = consumer.clone();
        async move {
            let info = consumer.info().await.unwrap().clone();
            info.num_ack_pending == 1 && info.num_pending == 0 && started("slow-2")
        }
    })
    .await;
    // A second process on the queue, with a connection of its own, pulling.
    let other = NatsTransport::new(NatsConfig::new(nats_url()).ack_wait(Duration::from_secs(1)));
    let second = start(orders_alone(&other, &pool, &queue));
    let seen = first.shut_down().await;
    assert_eq!(seen.processed, 1, "{seen:?}");
    let delivered = consumer.info().await.unwrap().delivered.consumer_sequence;
    let other_seen = second.shut_down().await;
    assert_eq!(
        delivered, 1,
        "the message was delivered again while its handler ran at shutdown"
    );
    assert_eq!(other_seen.settled(), 0, "{other_seen:?}");
    assert_eq!(
        applied_ids(&pool).await,
        each_once("orders", ["slow-2".to_owned()])
    );
    transport.delete_queue(&queue).await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_carries_its_reason_detail_and_source_queue_in_headers() {
    let w = World::new("fail").await;
    let always = Order {
        fail: Some("always".to_owned()),
        ..order("p-1", 9)
    };
    w.publish("p-1", &always).await;
    // Bytes that are not JSON, nor UTF-8, with a NUL: dead-lettered as undecodable.
    w.publish_bytes("bad-1", b"\xff\x00{not json".to_vec())
        .await;
    let running = start(w.runtime());
    wait_until("both dead-lettered", DEADLINE, || async {
        running.now().dead_lettered == 2
    })
    .await;
    running.shut_down().await;
    // Each once in the dead-letter stream, with its reason, detail and source queue.
    let dlq =
        w.js.get_stream(format!("IDEM_{}_DLQ", w.orders))
            .await
            .unwrap();
    // The two dead letters arrive in either order.
    let mut letters = [
        dlq.get_raw_message(1).await.unwrap(),
        dlq.get_raw_message(2).await.unwrap(),
    ];
    letters.sort_by_key(|l| l.payload.starts_with(b"\xff"));
    let (letter, undecodable) = (&letters[0], &letters[1]);
    let header = |name: &str| letter.headers.get(name).map(|v| v.as_str().to_owned());
    assert_eq!(
        header("Idem-Dead-Letter-Reason").as_deref(),
        Some("handler")
    );
    assert_eq!(header("Idem-Source-Queue"), Some(w.orders.clone()));
    assert!(
        header("Idem-Dead-Letter-Detail")
            .unwrap()
            .contains("no such customer")
    );
    let body: serde_json::Value = serde_json::from_slice(&letter.payload).unwrap();
    assert_eq!(body["id"], "p-1");
    assert_eq!(&undecodable.payload[..], b"\xff\x00{not json");
    assert_eq!(
        undecodable
            .headers
            .get("Idem-Dead-Letter-Reason")
            .map(|v| v.as_str()),
        Some("decode")
    );
    let third = dlq.get_raw_message(3).await;
    assert!(
        matches!(&third, Err(e) if e.kind() == async_nats::jetstream::stream::RawMessageErrorKind::NoMessageFound),
        "dead-lettered twice: {third:?}"
    );
    w.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_outbox_publishes_through_jetstream_with_its_message_ids() {
    let w = World::new("outbox").await;
    for n in 0..10 {
        let forwarded = Order {
            forward_to: Some(w.shipping.clone()),
            ..order(&format!("s-{n}"), n)
        };
        w.publish(&format!("s-{n}"), &forwarded).await;
    }
    let running = start(w.runtime());
    wait_until("both hops processed", DEADLINE, || async {
        running.now().processed >= 20
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.dead_lettered), (20, 0));
    let ids = || (0..10).map(|n| format!("s-{n}"));
    let mut expected = each_once("orders", ids());
    expected.extend(each_once("shipping", ids()));
    assert_eq!(
        w.applied_ids().await,
        expected,
        "each order and its event once"
    );
    let applied = w.applied().await;
    let shipped = applied.iter().filter(|a| a.0 == "shipping");
    for (_, id, _, _, message_id) in shipped {
        // The outbox's deterministic id travelled as `Nats-Msg-Id`.
        let expected = idem::outbox::outbox_message_id("nats.orders", id, 0);
        assert_eq!(message_id.as_deref(), Some(expected.as_str()), "{id}");
    }
    w.cleanup().await;
}

/// The connection of the runtime's transport is cut under load and restored: consuming
/// resumes, and every order still takes effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_connection_cut_under_load_loses_nothing_and_doubles_nothing() {
    let mut w = World::new("cut").await;
    let server = nats_url();
    let address = server
        .rsplit('@')
        .next()
        .unwrap()
        .trim_start_matches("nats://");
    let proxy = common::proxy::Proxy::start(address).await;
    w.transport = NatsTransport::new(NatsConfig::new(format!(
        "nats://127.0.0.1:{}",
        proxy.port()
    )));
    for n in 0..300 {
        w.publish(&format!("c-{n}"), &order(&format!("c-{n}"), n))
            .await;
    }
    let running = start(w.runtime());
    wait_until("a third processed", DEADLINE, || async {
        running.now().processed >= 100
    })
    .await;
    proxy.cut();
    wait_until("the consumer noticed", DEADLINE, || async {
        !w.transport.connected(&w.orders)
    })
    .await;
    // The client tries to reconnect while the server is away.
    wait_until("two reconnects refused", DEADLINE, || async {
        proxy.refused() >= 2
    })
    .await;
    proxy.restore();
    wait_until("every order processed", DEADLINE, || async {
        running.now().processed >= 300
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.dead_lettered), (300, 0));
    assert_eq!(
        w.applied_ids().await,
        each_once("orders", (0..300).map(|n| format!("c-{n}"))),
        "an order applied twice or lost"
    );
    let name = format!("IDEM_{}", w.orders);
    let js = w.js.clone();
    wait_until("the work queue emptied", DEADLINE, || {
        let (js, name) = (js.clone(), name.clone());
        async move {
            let mut stream = js.get_stream(name).await.unwrap();
            stream.info().await.unwrap().state.messages == 0
        }
    })
    .await;
    // A subject no stream holds is unroutable: the relay parks such a row.
    let nowhere = Outgoing::to_queue(unique("nats-nowhere"), &order("x", 1)).unwrap();
    let sent = w.transport.outbound().unwrap().publish(&nowhere).await;
    assert!(
        matches!(&sent, Err(idem::transport::OutboundError::Unroutable { destination })
            if *destination == nowhere.destination),
        "{sent:?}"
    );
    w.cleanup().await;
}

/// Messages stored with a status on their version line (`NATS/1.0 503`, `100`, `408`), as a
/// raw client can publish them and the server stores them: the client reads the status, and a
/// pull took them for what the server says of the pull (no responders, a heartbeat, an expired
/// request), so each either ended the session or was never handed to a handler, and was
/// delivered again after every ack wait. They are deliveries (they carry an ack subject) and
/// are applied as any other.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn messages_stored_with_a_status_line_are_handled_as_messages() {
    let w = World::new("status").await;
    let address = nats_url()
        .rsplit('@')
        .next()
        .unwrap()
        .trim_start_matches("nats://")
        .to_owned();
    let good = |n: usize| format!("st-{n}");
    for n in 0..5 {
        w.publish(&good(n), &order(&good(n), 1)).await;
    }
    let odd = ["503", "100", "408"];
    for status in odd {
        let id = format!("status-{status}");
        let header = format!("NATS/1.0 {status}\r\nNats-Msg-Id: {id}\r\n\r\n");
        let body = serde_json::to_vec(&order(&id, 1)).unwrap();
        common::raw_nats::publish(
            &format!("nats://{address}"),
            &w.orders,
            header.as_bytes(),
            &body,
        )
        .await;
    }
    for n in 5..10 {
        w.publish(&good(n), &order(&good(n), 1)).await;
    }
    let running = start(orders_alone(&w.transport, &w.pool, &w.orders));
    wait_until("every order applied", DEADLINE, || async {
        w.applied_ids().await.len() == 13
    })
    .await;
    let seen = running.shut_down().await;
    let ids = (0..10)
        .map(good)
        .chain(odd.map(|status| format!("status-{status}")));
    assert_eq!(
        w.applied_ids().await,
        each_once("orders", ids),
        "an order applied twice or lost"
    );
    assert_eq!((seen.processed, seen.dead_lettered), (13, 0), "{seen:?}");
    let mut consumer = orders_consumer(&w.js, &w.orders).await;
    let info = consumer.info().await.unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    w.cleanup().await;
}

/// Messages whose headers the client cannot parse, as a producer in another language sends them
/// and the server stores them (a value in latin-1, a name with a space): async-nats drops its
/// connection on a delivery of one. Each is dead-lettered once with reason `unparsable`, its
/// record in the store and its body as it was, after at most one cut each; the good orders
/// around them are applied once each and the queue drains. (Before, the connection was cut at
/// every redelivery, for ever, and the queue never drained.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn messages_the_client_cannot_parse_are_dead_lettered_after_one_cut_each() {
    let mut w = World::new("unparsable").await;
    let server = nats_url();
    let address = server
        .rsplit('@')
        .next()
        .unwrap()
        .trim_start_matches("nats://")
        .to_owned();
    let proxy = common::proxy::Proxy::start(&address).await;
    w.transport = NatsTransport::new(NatsConfig::new(format!(
        "nats://127.0.0.1:{}",
        proxy.port()
    )));
    let good = |n: usize| format!("u-{n}");
    for n in 0..10 {
        w.publish(&good(n), &order(&good(n), 1)).await;
    }
    let bad: [(&str, &[u8]); 2] = [
        ("bad-latin1", b"Tenant: caf\xe9"),
        ("bad-name", b"Bad Name: x"),
    ];
    for (id, line) in bad {
        let header = [
            b"NATS/1.0\r\nNats-Msg-Id: ".as_slice(),
            id.as_bytes(),
            b"\r\n",
            line,
            b"\r\n\r\n",
        ]
        .concat();
        let body = serde_json::to_vec(&order(id, 1)).unwrap();
        common::raw_nats::publish(&format!("nats://{address}"), &w.orders, &header, &body).await;
    }
    for n in 10..20 {
        w.publish(&good(n), &order(&good(n), 1)).await;
    }
    let running = start(orders_alone(&w.transport, &w.pool, &w.orders));
    wait_until(
        "the good applied and the bad dead-lettered",
        DEADLINE,
        || async { w.applied_ids().await.len() == 20 && letters(&w).await.len() == 2 },
    )
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        w.applied_ids().await,
        each_once("orders", (0..20).map(good)),
        "an order applied twice or lost"
    );
    assert_eq!((seen.processed, seen.dead_lettered), (20, 0));
    let mut letters: Vec<_> = letters(&w)
        .await
        .into_iter()
        .map(|(_, reason, id)| (reason, id))
        .collect();
    letters.sort_unstable();
    assert_eq!(
        letters,
        [
            ("unparsable".to_owned(), "bad-latin1".to_owned()),
            ("unparsable".to_owned(), "bad-name".to_owned())
        ]
    );
    let mut records: Vec<(String, String, Option<String>)> = sqlx::query_as(
        "SELECT consumer, reason, message_id FROM idem_inbox_dead_letters ORDER BY message_id",
    )
    .fetch_all(&w.pool)
    .await
    .unwrap();
    records.sort_unstable();
    let record = |id: &str| {
        (
            "nats.orders".to_owned(),
            "unparsable".to_owned(),
            Some(id.to_owned()),
        )
    };
    assert_eq!(records, [record("bad-latin1"), record("bad-name")]);
    // The first connection, and at most one more for each message the client cannot parse.
    assert!(
        (2..=3).contains(&proxy.accepted()),
        "{} connections",
        proxy.accepted()
    );
    let mut consumer = orders_consumer(&w.js, &w.orders).await;
    let info = consumer.info().await.unwrap();
    assert_eq!((info.num_pending, info.num_ack_pending), (0, 0));
    w.cleanup().await;
}

/// Processes that start together on a new queue all declare it. One of them creating a stream
/// between another's read and its create, then widening the dead-letter stream's duplicate
/// window, made the other's create fail ("stream name already in use with a different
/// configuration"), and its start with it: a CI chaos run lost a consumer process this way.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn processes_starting_together_on_a_new_queue_all_declare_it() {
    let js = jetstream_or_fail().await;
    for round in 0..10 {
        let queue = unique(&format!("nats-together-{round}"));
        let transports: Vec<NatsTransport> = (0..6)
            .map(|_| NatsTransport::new(NatsConfig::new(nats_url())))
            .collect();
        // Connected first, so that the declarations race each other, not the connections.
        for transport in &transports {
            let warm = unique("nats-warm");
            transport
                .declare(&[QueueSpec::new(warm.as_str(), "nats.orders")])
                .await
                .unwrap();
            transport.delete_queue(&warm).await.unwrap();
        }
        let spec = [QueueSpec::new(queue.as_str(), "nats.orders")];
        let declared =
            futures_util::future::join_all(transports.iter().map(|t| t.declare(&spec))).await;
        for result in declared {
            result.unwrap();
        }
        transports[0].delete_queue(&queue).await.unwrap();
    }
    drop(js);
}

/// Two queues whose names differ only where a stream name cannot follow (`.` and `_`) would
/// share a stream: the second is refused, naming the subject the stream holds.
#[tokio::test]
async fn two_queues_that_would_share_a_stream_are_refused() {
    let js = jetstream_or_fail().await;
    let base = unique("nats-share");
    let transport = NatsTransport::new(NatsConfig::new(nats_url()));
    let dotted = format!("{base}.a");
    transport
        .declare(&[QueueSpec::new(dotted.as_str(), "nats.orders")])
        .await
        .unwrap();
    let refused = transport
        .declare(&[QueueSpec::new(format!("{base}_a"), "nats.orders")])
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains(&format!("not `{base}_a`")) && refused.contains(&dotted),
        "{refused}"
    );
    transport.delete_queue(&dotted).await.unwrap();
    drop(js);
}

/// The handler's durable consumer and its stream are deleted under the running consumer (an
/// operator's mistake): the consumer declares them again and goes on with new messages.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_deleted_under_the_consumer_are_declared_again() {
    let w = World::new("deleted").await;
    let running = start(w.runtime());
    w.publish("d-1", &order("d-1", 1)).await;
    wait_until("the first order", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    w.js.delete_stream(format!("IDEM_{}", w.orders))
        .await
        .unwrap();
    w.publish_once_declared("d-2", &order("d-2", 2)).await;
    wait_until("the second order", DEADLINE, || async {
        running.now().processed == 2
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.dead_lettered), (2, 0));
    assert_eq!(
        w.applied_ids().await,
        each_once("orders", ["d-1".to_owned(), "d-2".to_owned()])
    );
    w.cleanup().await;
}

/// The work stream is deleted while a delivery of it is in its handler, and declared again by
/// the consumer; a new message (sequence 1 again) is in its handler when the first one
/// commits. The first one's ack, which names only the stream, the durable and sequences, is
/// not sent: JetStream would take it for the new message's and remove that one unhandled.
/// Both are applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ack_from_a_stream_since_deleted_does_not_remove_a_new_message() {
    let w = World::new("recreated").await;
    let stream = format!("IDEM_{}", w.orders);
    let running = start(w.runtime());
    let slow = |id: &str, fail: &str| Order {
        fail: Some(fail.to_owned()),
        ..order(id, 1)
    };
    w.publish("old-1", &slow("old-1", "slow")).await;
    let pending = || async {
        let Ok(stream) = w.js.get_stream(&stream).await else {
            return None;
        };
        let mut consumer: async_nats::jetstream::consumer::PullConsumer =
            stream.get_consumer("nats_orders").await.ok()?;
        let info = consumer.info().await.ok()?;
        Some((info.num_ack_pending, info.ack_floor.stream_sequence))
    };
    wait_until("the first order in its handler", DEADLINE, || async {
        pending().await == Some((1, 0))
    })
    .await;
    w.js.delete_stream(&stream).await.unwrap();
    w.publish_once_declared("new-1", &slow("new-1", "slower"))
        .await;
    let world = &w;
    let applied = move |id: &'static str| async move {
        world
            .applied_ids()
            .await
            .contains(&("orders".to_owned(), id.to_owned()))
    };
    wait_until("the first order applied", DEADLINE, || applied("old-1")).await;
    // Until the new message is applied, the new durable's ack floor stays at 0: read before
    // the books, so that an ack of its own (after its commit) is not taken for a foreign one.
    while !applied("new-1").await {
        let seen = pending().await;
        if seen.is_some_and(|(_, floor)| floor > 0) {
            assert!(
                applied("new-1").await,
                "the new message was acked ({seen:?}: ack pending, ack floor) before its handler committed"
            );
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    wait_until("the new order settled", DEADLINE, || async {
        pending().await == Some((0, 1))
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.dead_lettered), (2, 0));
    assert_eq!(
        w.applied_ids().await,
        each_once("orders", ["new-1".to_owned(), "old-1".to_owned()])
    );
    w.cleanup().await;
}

/// The dead-letter stream of `w`'s orders queue: `(sequence, reason, order id)` of each letter
/// it holds, oldest first.
async fn letters(w: &World) -> Vec<(u64, String, String)> {
    let mut dlq =
        w.js.get_stream(format!("IDEM_{}_DLQ", w.orders))
            .await
            .unwrap();
    let state = dlq.info().await.unwrap().state.clone();
    let mut found = Vec::new();
    for sequence in state.first_sequence..=state.last_sequence {
        let Ok(letter) = dlq.get_raw_message(sequence).await else {
            continue;
        };
        let reason = letter
            .headers
            .get("Idem-Dead-Letter-Reason")
            .map(|v| v.as_str().to_owned())
            .unwrap_or_default();
        let body: serde_json::Value = serde_json::from_slice(&letter.payload).unwrap_or_default();
        let id = body["id"].as_str().unwrap_or_default().to_owned();
        found.push((sequence, reason, id));
    }
    found
}

/// A producer that reuses a message id for two payloads (two JetStream ids), both failing
/// transiently on their first attempt: each retry copy is named after the delivery it settles,
/// not after the message id, so JetStream keeps both. One is applied; the other is
/// dead-lettered as the conflict it is. (Named after the message id, the second copy was
/// dropped as a duplicate of the first, and the payload was nowhere.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_payloads_under_one_message_id_both_retried_end_applied_and_in_conflict() {
    let w = World::new("reused").await;
    for (nats_id, cents) in [("r-a", 1), ("r-b", 2)] {
        let mut headers = HeaderMap::new();
        headers.insert("Nats-Msg-Id", nats_id);
        headers.insert("Idem-Message-Id", "r-1");
        let once = Order {
            fail: Some("once".to_owned()),
            ..order("r-1", cents)
        };
        let body = serde_json::to_vec(&once).unwrap();
        w.js.publish_with_headers(w.orders.clone(), headers, body.into())
            .await
            .unwrap()
            .await
            .unwrap();
    }
    let running = start(w.runtime());
    wait_until("one applied and one in conflict", DEADLINE, || async {
        let now = running.now();
        now.processed == 1 && now.conflicts == 1
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (
            seen.retried,
            seen.processed,
            seen.conflicts,
            seen.dead_lettered
        ),
        (2, 1, 1, 1)
    );
    assert_eq!(
        w.applied_ids().await,
        each_once("orders", ["r-1".to_owned()])
    );
    let letters = letters(&w).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(
        (letters[0].1.as_str(), letters[0].2.as_str()),
        ("conflict", "r-1")
    );
    w.cleanup().await;
}

/// A dead letter replayed and dead-lettered again within JetStream's duplicate window: the
/// second dead letter is named after its own delivery, so the stream keeps it. (Named after
/// the message id, it was dropped as a duplicate of the first, which the replay had removed:
/// the store held a record and the stream nothing.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_replayed_and_dead_lettered_again_is_in_the_stream() {
    let w = World::new("again").await;
    let always = Order {
        fail: Some("always".to_owned()),
        ..order("g-1", 7)
    };
    w.publish("g-1", &always).await;
    let running = start(w.runtime());
    // Counted before its letter is published: the letter itself is awaited.
    wait_until("dead-lettered", DEADLINE, || async {
        running.now().dead_lettered == 1 && !letters(&w).await.is_empty()
    })
    .await;
    let first = letters(&w).await;
    assert_eq!(first.len(), 1, "{first:?}");
    let reader = w.transport.dead_letters(&w.orders).await.unwrap();
    let letter = reader.next().await.unwrap().unwrap();
    reader
        .replay(&letter, &w.orders, idem::transport::PublishTime::Kept)
        .await
        .unwrap();
    reader.remove(&letter).await.unwrap();
    reader.close().await;
    wait_until("dead-lettered again", DEADLINE, || async {
        running.now().dead_lettered == 2
    })
    .await;
    running.shut_down().await;
    let second = letters(&w).await;
    assert_eq!(second.len(), 1, "{second:?}");
    assert!(second[0].0 > first[0].0, "{first:?} then {second:?}");
    assert_eq!(
        (second[0].1.as_str(), second[0].2.as_str()),
        ("handler", "g-1")
    );
    assert!(w.applied_ids().await.is_empty());
    w.cleanup().await;
}

/// A message that fails transiently on every attempt: its retry copies carry when its first
/// attempt failed, and its dead letter's record keeps that beside the last failure, with the
/// attempts counted and the consumer's retention.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_record_keeps_when_its_failures_began() {
    let w = World::new("history").await;
    let stuck = Order {
        fail: Some("transient".to_owned()),
        ..order("h-1", 7)
    };
    w.publish("h-1", &stuck).await;
    let running = start(w.runtime());
    wait_until("dead-lettered", DEADLINE, || async {
        running.now().dead_lettered == 1
    })
    .await;
    running.shut_down().await;
    let inbox = SqliteInbox::new(w.pool.clone());
    let record = inbox
        .dead_letter("nats.orders", "h-1")
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (record.reason.as_str(), record.attempts),
        ("retries-exhausted", 3)
    );
    let first = record.first_failed_at_ms.unwrap();
    assert!(
        record.dead_lettered_at_ms - first >= 675,
        "two retries of 300 and 600 ms, less a quarter of jitter at most, lie between the first failure and the last: {record:?}"
    );
    assert_eq!(record.retention, Some(idem::sql::DEFAULT_RETENTION));
    w.cleanup().await;
}

/// The dead-letter stream deleted under a running consumer, then a malformed message: the
/// failed dead-letter publish declares the stream again and gives the delivery back with a
/// delay, so the letter lands after one failed settlement. (Before, the stream was never
/// declared again and the delivery came back at once, tens of thousands of times a minute.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_stream_deleted_under_the_consumer_is_declared_again() {
    let w = World::new("nodlq").await;
    let running = start(w.runtime());
    w.publish("n-1", &order("n-1", 1)).await;
    wait_until("the first order", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    w.js.delete_stream(format!("IDEM_{}_DLQ", w.orders))
        .await
        .unwrap();
    w.publish_bytes("bad-1", b"{not json".to_vec()).await;
    let dlq = format!("IDEM_{}_DLQ", w.orders);
    wait_until(
        "the dead letter in a stream declared again",
        DEADLINE,
        || async {
            match w.js.get_stream(&dlq).await {
                Ok(mut stream) => stream.info().await.is_ok_and(|i| i.state.messages == 1),
                Err(_) => false,
            }
        },
    )
    .await;
    let seen = running.shut_down().await;
    // The first dead-letter publish failed; the delivery came back once and its letter landed.
    assert_eq!(
        (seen.settle_failures, seen.dead_lettered),
        (1, 2),
        "{seen:?}"
    );
    let letters = letters(&w).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].1, "decode");
    w.cleanup().await;
}

/// The outbox's `publish_all` of more messages than the client lets a context await at once
/// (5,000) finishes, every message confirmed and in the stream. (It sent them all before it
/// awaited any confirm, and the 5,001st send waited for ever.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_outbox_publishes_more_messages_at_once_than_the_client_awaits() {
    let w = World::new("many").await;
    let messages: Vec<Outgoing> = (0..6_000)
        .map(|n| Outgoing::to_queue(w.shipping.as_str(), &order(&format!("m-{n}"), n)).unwrap())
        .collect();
    let outbound = w.transport.outbound().unwrap();
    let results = tokio::time::timeout(DEADLINE, outbound.publish_all(&messages))
        .await
        .expect("publish_all of 6,000 messages did not finish");
    assert_eq!(results.len(), 6_000);
    assert!(results.iter().all(Result::is_ok));
    let mut stream =
        w.js.get_stream(format!("IDEM_{}", w.shipping))
            .await
            .unwrap();
    assert_eq!(stream.info().await.unwrap().state.messages, 6_000);
    w.cleanup().await;
}

/// Settings that drifted from what idem declares: a stream kept in memory, or a work stream
/// with an age limit, is refused, naming the setting and the fix; a durable consumer whose ack
/// wait and delivery limit were changed by hand is updated back (a delivery limit strands
/// the message JetStream stops delivering; an ack wait the in-progress signals are not paced
/// for redelivers running handlers).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn drifted_stream_settings_are_refused_and_a_drifted_consumer_is_updated() {
    use async_nats::jetstream::consumer::{AckPolicy, pull};
    use async_nats::jetstream::stream::{Config, RetentionPolicy, StorageType};
    let js = jetstream_or_fail().await;
    let transport = NatsTransport::new(NatsConfig::new(nats_url()));
    let (memory, aged) = (unique("nats-memory"), unique("nats-aged"));
    for (queue, storage, max_age) in [
        (&memory, StorageType::Memory, Duration::ZERO),
        (&aged, StorageType::File, Duration::from_secs(3600)),
    ] {
        js.create_stream(Config {
            name: format!("IDEM_{queue}"),
            subjects: vec![queue.clone()],
            retention: RetentionPolicy::WorkQueue,
            storage,
            max_age,
            ..Config::default()
        })
        .await
        .unwrap();
    }
    let refused = |queue: &str| {
        let transport = transport.clone();
        let queue = queue.to_owned();
        async move {
            transport
                .declare(&[QueueSpec::new(queue.as_str(), "nats.orders")])
                .await
                .unwrap_err()
                .to_string()
        }
    };
    let why = refused(&memory).await;
    assert!(
        why.contains("storage is Memory") && why.contains("delete the stream"),
        "{why}"
    );
    let why = refused(&aged).await;
    assert!(
        why.contains("max_age is 3600s") && why.contains("max_age 0"),
        "{why}"
    );

    let queue = unique("nats-drift");
    let spec = QueueSpec::new(queue.as_str(), "nats.orders");
    transport
        .declare(std::slice::from_ref(&spec))
        .await
        .unwrap();
    let stream = js.get_stream(format!("IDEM_{queue}")).await.unwrap();
    let by_hand = pull::Config {
        durable_name: Some("nats_orders".to_owned()),
        filter_subject: queue.clone(),
        ack_policy: AckPolicy::Explicit,
        ack_wait: Duration::from_secs(2),
        max_deliver: 3,
        max_ack_pending: 10_000,
        ..pull::Config::default()
    };
    let mut changed = stream.create_consumer(by_hand).await.unwrap();
    let info = changed.info().await.unwrap().config.clone();
    assert_eq!(
        (info.ack_wait, info.max_deliver),
        (Duration::from_secs(2), 3)
    );
    transport
        .declare(std::slice::from_ref(&spec))
        .await
        .unwrap();
    let info = changed.info().await.unwrap().config.clone();
    assert_eq!(
        (info.ack_wait, info.max_deliver),
        (idem::nats::DEFAULT_ACK_WAIT, -1)
    );
    for queue in [&memory, &aged, &queue] {
        transport.delete_queue(queue).await.unwrap();
    }
}

/// A dead-letter stream that refuses the letter (full, discarding new messages): the delivery
/// comes back after a delay that doubles with each delivery, not at once, and its letter lands
/// once there is room. Over 3 s the delays (250 ms, 500 ms, 1 s, 2 s) allow at most 5 failed
/// settlements; given back at once, it failed thousands of times.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_the_stream_refuses_is_tried_again_with_growing_delays() {
    use async_nats::jetstream::stream::{Config, DiscardPolicy};
    let w = World::new("fulldlq").await;
    let dlq = format!("IDEM_{}_DLQ", w.orders);
    w.js.delete_stream(&dlq).await.unwrap();
    let full =
        w.js.create_stream(Config {
            name: dlq.clone(),
            subjects: vec![format!("{}.dlq", w.orders)],
            max_messages: 1,
            discard: DiscardPolicy::New,
            ..Config::default()
        })
        .await
        .unwrap();
    w.js.publish(format!("{}.dlq", w.orders), "filler".into())
        .await
        .unwrap()
        .await
        .unwrap();
    w.publish_bytes("bad-2", b"{not json".to_vec()).await;
    let running = start(w.runtime());
    wait_until("the first refused dead letter", DEADLINE, || async {
        running.now().settle_failures >= 1
    })
    .await;
    let window = std::time::Instant::now();
    tokio::time::sleep(Duration::from_secs(3)).await;
    let failed = running.now().settle_failures;
    assert!(
        failed <= 5,
        "{failed} failed settlements within {:?} of the first",
        window.elapsed()
    );
    full.purge().await.unwrap();
    wait_until("the letter in the stream", DEADLINE, || {
        let mut full = full.clone();
        async move { full.info().await.is_ok_and(|i| i.state.messages == 1) }
    })
    .await;
    running.shut_down().await;
    let letters = letters(&w).await;
    assert_eq!(letters.len(), 1, "{letters:?}");
    assert_eq!(letters[0].1, "decode");
    w.cleanup().await;
}

/// An ordered handler's partition count lives on the server: a producer that declared no
/// partitions (a process of its own, as a service that only publishes is) routes each key to
/// the partition the consumers read; and a process that declares another count for the source
/// is refused, naming both. (The producer sent to `<source>.<key>`, which no stream holds, and
/// two counts split a key over two partitions.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn every_producer_routes_a_key_to_the_partition_the_server_records() {
    use idem::transport::lane_of;
    let js = jetstream_or_fail().await;
    let source = unique("nats-parts");
    let consumers = NatsTransport::new(NatsConfig::new(nats_url()));
    consumers
        .declare(&QueueSpec::partitions(&source, "nats.orders", 4))
        .await
        .unwrap();
    let producer = NatsTransport::new(NatsConfig::new(nats_url()));
    let keys: Vec<String> = (0..20).map(|n| format!("customer-{n}")).collect();
    let messages: Vec<Outgoing> = keys
        .iter()
        .map(|key| Outgoing::to_topic(&source, key, &order(key, 1)).unwrap())
        .collect();
    for sent in producer.outbound().unwrap().publish_all(&messages).await {
        sent.unwrap();
    }
    for index in 0..4 {
        let expected = keys
            .iter()
            .filter(|key| lane_of(Some(key.as_str()), 4) == index)
            .count();
        let mut stream = js
            .get_stream(format!("IDEM_{source}_p{index}"))
            .await
            .unwrap();
        let held = stream.info().await.unwrap().state.messages;
        assert_eq!(held, expected as u64, "partition {index}");
    }
    assert_eq!(
        producer
            .route(&Destination::topic(&source, "customer-3"))
            .await
            .unwrap(),
        format!("{source}.p{}", lane_of(Some("customer-3"), 4))
    );
    let other = NatsTransport::new(NatsConfig::new(nats_url()));
    let why = other
        .declare(&QueueSpec::partitions(&source, "nats.orders", 8))
        .await
        .unwrap_err()
        .to_string();
    assert!(
        why.contains("records 4 partitions") && why.contains("declares 8"),
        "{why}"
    );
    for index in 0..4 {
        consumers
            .delete_queue(&format!("{source}.p{index}"))
            .await
            .unwrap();
    }
    assert!(consumers.delete_source(&source).await.unwrap());
    assert!(!consumers.delete_source(&source).await.unwrap());
}

/// JetStream that does not answer at start-up (a server still recovering its store, a cluster
/// electing a leader): the start waits for it, up to the start deadline, instead of failing at
/// the first request that timed out. A server of the test's own runs without JetStream, its
/// API taken by a client of the test's that never answers; once a declaration has timed out
/// and been tried again, the server starts again with JetStream on the same port, and an order
/// published then is applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_start_waits_for_jetstream_that_does_not_answer_yet() {
    use futures_util::StreamExt;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};
    let Some(node) = common::nats_node::NatsNode::start_without_jetstream().await else {
        return;
    };
    let silent = async_nats::connect(node.url()).await.unwrap();
    let mut requests = silent.subscribe("$JS.API.>").await.unwrap();
    silent.flush().await.unwrap();
    let seen = Arc::new(AtomicUsize::new(0));
    let counted = seen.clone();
    let counting = tokio::spawn(async move {
        while requests.next().await.is_some() {
            counted.fetch_add(1, Ordering::SeqCst);
        }
    });
    let (pool, _dir) = database().await;
    let queue = unique("nats-unanswered");
    let transport = NatsTransport::new(NatsConfig::new(node.url()));
    let running = start(orders_alone(&transport, &pool, &queue));
    wait_until("a declaration tried again", DEADLINE, || async {
        seen.load(Ordering::SeqCst) >= 2 || running.task.is_finished()
    })
    .await;
    if running.task.is_finished() {
        panic!("the start gave up: {:?}", running.task.await.unwrap());
    }
    counting.abort();
    drop(silent);
    node.restart_with_jetstream().await;
    let js = async_nats::jetstream::new(async_nats::connect(node.url()).await.unwrap());
    // Published until the queue's stream takes it: a CI run saw the stream listed and a publish
    // a moment later answered "no responders" by the server just started.
    wait_until(
        "the queue declared and the order taken",
        DEADLINE,
        || async {
            let mut headers = HeaderMap::new();
            headers.insert("Nats-Msg-Id", "late-1");
            let body = serde_json::to_vec(&order("late-1", 1)).unwrap();
            match js
                .publish_with_headers(queue.clone(), headers, body.into())
                .await
            {
                Ok(ack) => ack.await.is_ok(),
                Err(_) => false,
            }
        },
    )
    .await;
    wait_until("the order applied", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.dead_lettered), (1, 0));
    assert_eq!(
        applied_ids(&pool).await,
        each_once("orders", ["late-1".to_owned()])
    );
}

#[tokio::test]
async fn a_start_without_a_server_fails_naming_the_url_and_its_variable() {
    let transport = NatsTransport::new(
        NatsConfig::new("nats://user:secret@127.0.0.1:1").connect_timeout(Duration::from_secs(1)),
    );
    let (pool, _dir) = common::sqlite(2).await;
    SqliteInbox::new(pool.clone()).migrate().await.unwrap();
    let runtime = Runtime::builder()
        .transport(transport)
        .store(SqliteInbox::new(pool))
        .handlers(["nats.orders"])
        .handler_queue("nats.orders", unique("nats-down"))
        .start_deadline(Duration::from_secs(2))
        .build()
        .unwrap();
    let started = tokio::time::Instant::now();
    let failed = tokio::time::timeout(
        Duration::from_secs(30),
        runtime.run_until(std::future::pending()),
    )
    .await
    .expect("the start did not fail");
    let error = failed.unwrap_err().to_string();
    assert!(error.contains("nats://user:***@127.0.0.1:1"), "{error}");
    assert!(error.contains("NATS_URL"), "{error}");
    assert!(!error.contains("secret"), "{error}");
    assert!(started.elapsed() < Duration::from_secs(20));
}

/// Several server URLs, comma-separated: the client tries them in turn, so a first that does
/// not answer is passed over, and orders take effect once through the second. (Before, the
/// list was given to the client as one URL, and every start failed: "invalid port number".)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn several_server_urls_are_tried_in_turn() {
    let mut w = World::new("urls").await;
    w.transport = NatsTransport::new(NatsConfig::new(format!(
        "nats://127.0.0.1:1, {}",
        nats_url()
    )));
    w.publish("s-1", &order("s-1", 1)).await;
    let running = start(w.runtime());
    wait_until("applied", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    running.shut_down().await;
    assert_eq!(
        w.applied_ids().await,
        each_once("orders", ["s-1".to_owned()])
    );
    w.cleanup().await;
}

/// `NatsConfig::replicas`: on a JetStream cluster a queue's streams are held by that many
/// servers, and streams an earlier start declared with another count are scaled to it; a
/// server that is not clustered refuses more than one, and the start fails saying so.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn streams_are_held_by_the_replicas_configured() {
    let queue = unique("nats-replicas");
    let single = NatsTransport::new(NatsConfig::new(nats_url()).replicas(3));
    let refused = single
        .declare(&[QueueSpec::new(queue.as_str(), "nats.orders")])
        .await
        .unwrap_err()
        .to_string();
    assert!(refused.contains("replicas"), "{refused}");
    let Some(cluster) = common::nats_cluster::NatsCluster::start().await else {
        return;
    };
    let spec = [QueueSpec::new(queue.as_str(), "nats.orders")];
    let replicas =
        |count: usize| NatsTransport::new(NatsConfig::new(cluster.urls()).replicas(count));
    replicas(1).declare(&spec).await.unwrap();
    let js = async_nats::jetstream::new(async_nats::connect(cluster.url(0)).await.unwrap());
    let held = || async {
        let mut held = Vec::new();
        for suffix in ["", "_RETRY", "_DLQ"] {
            let mut stream = js
                .get_stream(format!("IDEM_{queue}{suffix}"))
                .await
                .unwrap();
            held.push(stream.info().await.unwrap().config.num_replicas);
        }
        held
    };
    assert_eq!(held().await, [1, 1, 1]);
    replicas(3).declare(&spec).await.unwrap();
    assert_eq!(held().await, [3, 3, 3]);
}

/// The orders example on NATS (`NATS_URL` set): the same books, the same two hops, the same
/// ordered status updates on four partitions, exact; a run killed mid-way spoils nothing for
/// the next one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_orders_example_runs_on_nats_with_exact_books_even_after_a_killed_run() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("orders.db");
    let database = database.to_str().unwrap().to_owned();
    let queue = unique("nats-orders-demo");
    let demo = || {
        let mut command = std::process::Command::new(common::orders_example());
        command
            .env("NATS_URL", nats_url())
            .env("DATABASE_URL", &database)
            .env("ORDERS_QUEUE", &queue)
            .env_remove("ORDERS_STATUS_PARTITIONS")
            .env_remove("ORDERS_TRANSPORT")
            .env("RUST_LOG", "error");
        command
    };
    let exact = |output: &std::process::Output| {
        let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            output.status.success(),
            "the demo failed:\n{stdout}{stderr}"
        );
        assert!(
            stdout.contains("transport            NATS JetStream"),
            "{stdout}"
        );
        let status = stdout
            .lines()
            .find(|l| l.starts_with("status updates"))
            .unwrap();
        assert!(
            status.contains("4 partitions of") && status.ends_with("in order: exact)"),
            "{status}"
        );
        for line in [
            "balances             exact",
            "ledger               exact  (2000 rows: one per order booked)",
            "parcels              exact",
            "shipment log         exact  (2000 rows: one per order shipped)",
            "outbox unpublished         0",
        ] {
            assert!(stdout.lines().any(|l| l == line), "no `{line}` in {stdout}");
        }
    };
    exact(&demo().output().unwrap());

    // A run killed mid-way, with its deliveries in the streams and its outbox rows unsent.
    let pool = idem::sql::sqlite::pool(&database).await.unwrap();
    let stored = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders")
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let before = stored().await;
    let mut killed = watched::Watched::spawn("orders", &mut demo());
    watched::wait_until(
        "the run under way",
        DEADLINE,
        &mut [&mut killed],
        || async { stored().await > before },
    )
    .await;
    drop(killed); // SIGKILL
    exact(&demo().output().unwrap());
    // Across the three runs, the killed one included (its orders half done, its outbox rows
    // left to the next run's relay), no order was booked or shipped twice, and every order
    // stored has exactly one ledger row.
    for (log, query) in [
        ("ledger", "SELECT order_id FROM ledger"),
        ("shipment_log", "SELECT order_id FROM shipment_log"),
    ] {
        let mut logged: Vec<String> = sqlx::query_scalar(query).fetch_all(&pool).await.unwrap();
        logged.sort_unstable();
        let total = logged.len();
        logged.dedup();
        assert_eq!(logged.len(), total, "{log}: an order twice");
    }
    let mut booked: Vec<String> = sqlx::query_scalar("SELECT order_id FROM ledger")
        .fetch_all(&pool)
        .await
        .unwrap();
    let mut stored_orders: Vec<String> = sqlx::query_scalar("SELECT order_id FROM orders")
        .fetch_all(&pool)
        .await
        .unwrap();
    booked.sort_unstable();
    stored_orders.sort_unstable();
    assert_eq!(booked, stored_orders, "every stored order booked once");

    let transport = NatsTransport::new(NatsConfig::new(nats_url()));
    let exchange = format!("{queue}.status");
    let mut queues = vec![queue.clone(), format!("{queue}.billed")];
    queues.extend((0..4).map(|i| idem::transport::Partition::queue_name(&exchange, i)));
    for queue in queues {
        transport.delete_queue(&queue).await.unwrap();
    }
}

/// Over TLS, on a NATS server of the test's own (`nats-server --tls` with a certificate that a
/// CA made with `openssl` signed): with the CA trusted (`tls_ca_pem_file`) every order takes
/// effect once; without it the start fails, naming the server and the certificate it refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_tls_orders_take_effect_once_and_an_unknown_ca_is_refused() {
    if !common::own_servers::can_start("nats-server", "a TLS server of the test's own") {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    common::tls_node::certificates(dir.path());
    let port = common::tls_node::free_port();
    let file = |name: &str| dir.path().join(name).display().to_string();
    let server = std::process::Command::new("nats-server")
        .args([
            "-a",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-js",
            "-sd",
            &file("js"),
        ])
        .args([
            "--tls",
            "--tlscert",
            &file("server.pem"),
            "--tlskey",
            &file("server.key"),
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let _server = common::KillOnDrop(server);
    wait_until("the TLS server listening", DEADLINE, || async {
        tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
    })
    .await;
    let url = format!("tls://127.0.0.1:{port}");

    let refused = NatsTransport::new(NatsConfig::new(url.as_str()))
        .declare(&[])
        .await
        .unwrap_err()
        .to_string();
    assert!(
        refused.contains(&format!("cannot reach the broker at {url}"))
            && refused.contains("UnknownIssuer"),
        "{refused}"
    );

    let transport = NatsTransport::new(
        NatsConfig::new(url.as_str()).tls_ca_pem_file(dir.path().join("ca.pem")),
    );
    let (pool, _db) = database().await;
    let queue = unique("nats-tls");
    transport
        .declare(&[QueueSpec::new(queue.as_str(), "nats.orders")])
        .await
        .unwrap();
    for n in 0..20 {
        let body = serde_json::to_vec(&order(&format!("tls-{n}"), n)).unwrap();
        let message = idem::Envelope::new(body).with_message_id(format!("tls-{n}"));
        for _ in 0..2 {
            // The same JetStream id twice: JetStream keeps one.
            transport.publish(&queue, &message, None).await.unwrap();
        }
    }
    let running = start(orders_alone(&transport, &pool, &queue));
    wait_until("every order", DEADLINE, || async {
        running.now().processed >= 20
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.dead_lettered), (20, 0));
    assert_eq!(
        applied_ids(&pool).await,
        each_once("orders", (0..20).map(|n| format!("tls-{n}")))
    );
}
