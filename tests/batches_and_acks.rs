//! Batch mode and coalesced acks against real RabbitMQ and PostgreSQL: an ack never covers a
//! delivery whose transaction has not committed; batches take effect once through duplicates,
//! handler failures, a closed broker connection and a database outage, with the handler run
//! per message in batch mode and with the consumer's batch handler; in batch mode the consumer
//! reads the broker only while a batch gathers, and the prefetch holds three batches.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;
#[path = "common/runtime_fixture.rs"]
mod runtime_fixture;

use common::running::*;
use common::{broker, wait_until};
use idem::RetryPolicy;
use idem::rabbitmq::{QueueType, RabbitTransport};
use idem::transport::{
    BoxFuture, Delivery, Demand, QueueSpec, StopSignal, Transport, TransportError,
};
use runtime_fixture::*;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, watch};

/// While no batch gathers, the consumer leaves what the broker delivered in its client's
/// buffer (no wake-up per delivery); when one gathers, it hands all of it over.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_gated_consumer_hands_deliveries_over_only_while_a_batch_gathers() {
    let f = fixture("gated", fast_retries(), QueueType::Classic, None).await;
    const ORDERS: usize = 5;
    for n in 0..ORDERS {
        f.publish_order(n, 1).await;
    }
    let mut spec = QueueSpec::new(f.queue.clone(), CONSUMER);
    spec.retry_delays = f.policy.delays();
    let (wants, demand) = Demand::gated();
    spec.demand = demand;
    let transport = RabbitTransport::new(f.rabbit.clone());
    let (mailbox_tx, mut mailbox) = mpsc::channel(32);
    let (stop_tx, stop) = watch::channel(false);
    let consuming = tokio::spawn(transport.consume(spec, 32, mailbox_tx, stop));
    wait_until("the broker to deliver every order", DEADLINE, || async {
        broker::count(&f.queue).await == 0 && broker::unacked(&f.queue) == ORDERS
    })
    .await;
    // Nothing to await: the check is that nothing comes while no batch gathers.
    let early = tokio::time::timeout(Duration::from_millis(500), mailbox.recv()).await;
    assert!(
        early.is_err(),
        "a delivery was handed over while no batch gathered"
    );
    let gathering = wants.gathering();
    let mut got = Vec::new();
    while got.len() < ORDERS {
        let delivery = tokio::time::timeout(DEADLINE, mailbox.recv()).await;
        got.push(delivery.unwrap().expect("the consumer is running"));
    }
    drop(gathering);
    for delivery in got {
        delivery.settle.ack().await.unwrap();
    }
    stop_tx.send(true).unwrap();
    consuming.await.unwrap();
    transport.close().await;
    wait_until("the acks to reach the broker", DEADLINE, || async {
        broker::unacked(&f.queue) == 0 && broker::count(&f.queue).await == 0
    })
    .await;
    f.cleanup().await;
}

/// The RabbitMQ transport, noting whether the runtime gated each queue's consumer.
struct Noting {
    inner: RabbitTransport,
    gated: Arc<Mutex<Vec<bool>>>,
}

impl Transport for Noting {
    fn declare<'a>(&'a self, queues: &'a [QueueSpec]) -> BoxFuture<'a, Result<(), TransportError>> {
        self.inner.declare(queues)
    }

    fn consume(
        &self,
        queue: QueueSpec,
        prefetch: u16,
        mailbox: mpsc::Sender<Delivery>,
        stop: StopSignal,
    ) -> BoxFuture<'static, ()> {
        let mut gated = self.gated.lock().unwrap_or_else(|e| e.into_inner());
        gated.push(queue.demand.is_gated());
        self.inner.consume(queue, prefetch, mailbox, stop)
    }

    fn close(&self) -> BoxFuture<'_, ()> {
        self.inner.close()
    }
}

/// The runtime gates the consumer of a handler in batch mode, and only then.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_runtime_gates_batch_mode_consumers_only() {
    for batch in [0, 8] {
        let f = fixture("gating", fast_retries(), QueueType::Classic, None).await;
        const ORDERS: usize = 50;
        for n in 0..ORDERS {
            f.publish_order(n, 3).await;
        }
        let gated = Arc::new(Mutex::new(Vec::new()));
        let transport = Noting {
            inner: RabbitTransport::new(f.rabbit.clone()),
            gated: gated.clone(),
        };
        let running = start(f.runtime().transport(transport).batch(batch));
        wait_until("every order applied", DEADLINE, || async {
            f.effects().await.len() == ORDERS
        })
        .await;
        running.shut_down().await;
        f.assert_exactly_once(ORDERS, |_| 3).await;
        assert_eq!(*gated.lock().unwrap(), [batch > 0], "batch {batch}");
        f.cleanup().await;
    }
}

/// In batch mode the prefetch defaults to three batches: while a batch is in its handlers the
/// broker has sent the next two (one to claim while this one commits, one to gather), and no
/// more.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_mode_prefetches_three_batches_by_default() {
    let f = fixture("prefetch", fast_retries(), QueueType::Classic, None).await;
    // Above a third of the per-message default (32), which is the least it ever is.
    const BATCH: usize = 20;
    const ORDERS: usize = 5 * BATCH;
    f.script.set(&f.key(0), &[Step::WaitForRelease]);
    for n in 0..ORDERS {
        f.publish_order(n, 1).await;
    }
    let running = start(f.runtime_with_defaults().batch(BATCH));
    wait_until("the first batch's handlers to start", DEADLINE, || async {
        f.script.started(&f.key(0))
    })
    .await;
    wait_until("the broker to send three batches", DEADLINE, || async {
        broker::unacked(&f.queue) >= 3 * BATCH
    })
    .await;
    assert_eq!(
        broker::unacked(&f.queue),
        3 * BATCH,
        "more than the prefetch"
    );
    assert_eq!(broker::count(&f.queue).await, ORDERS - 3 * BATCH);
    f.script.release(&f.key(0));
    wait_until("every order applied", DEADLINE, || async {
        f.effects().await.len() == ORDERS
    })
    .await;
    running.shut_down().await;
    f.assert_exactly_once(ORDERS, |_| 1).await;
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn an_ack_never_covers_an_uncommitted_delivery() {
    let f = fixture("watermark", fast_retries(), QueueType::Classic, None).await;
    // The first delivery is slow and will never commit in this life; the fast ones after it
    // (other customers: no lock in common with it) commit while it waits. A
    // `basic.ack(multiple)` for them that covered it would remove it from the broker, and the
    // crash below would lose it.
    f.script.set(&f.key(0), &[Step::WaitThenFail]);
    const FAST: usize = 6;
    for n in 0..=FAST {
        f.publish_order(n, 1).await;
    }
    let running = start(f.runtime().concurrency(4).prefetch(16));
    wait_until(
        "the slow one started and the fast ones committed",
        DEADLINE,
        || async { f.script.started(&f.key(0)) && running.now().processed == FAST as u64 },
    )
    .await;
    // The first delivery must stay unacked while it is uncommitted (the fast ones may be
    // acked, one by one): watch the broker for a while (an absence cannot be awaited; this is a
    // bounded observation, not a wait).
    let watch = Instant::now();
    while watch.elapsed() < Duration::from_secs(2) {
        let unacked = broker::unacked(&f.queue);
        assert!(
            unacked >= 1,
            "an ack covered the uncommitted first delivery"
        );
    }
    // The consumer's connection dies while the slow delivery is in its transaction, which then
    // fails: the broker must still hold it, and redeliver it.
    assert!(broker::close_connections(&format!("idem-test:{}", f.queue)) >= 1);
    f.script.release(&f.key(0));
    wait_until(
        "the slow order redelivered and applied",
        DEADLINE,
        || async { f.effects().await.len() == FAST + 1 },
    )
    .await;
    let seen = running.shut_down().await;
    assert_eq!(seen.dead_lettered, 0);
    f.assert_exactly_once(FAST + 1, |_| 1).await;
    f.cleanup().await;
}

/// Which function of the fixture's consumer runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Function {
    /// `record`: one message at a time, in batch mode.
    PerMessage,
    /// `record_batch`: the batch handler.
    BatchHandler,
}

impl Function {
    fn runtime(self, f: &Fixture, pool: sqlx::PgPool) -> idem::RuntimeBuilder {
        match self {
            Self::PerMessage => f.runtime_with(pool),
            Self::BatchHandler => f.batch_handler_runtime_with(pool),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batches_take_effect_once_through_duplicates_failures_and_a_closed_connection() {
    through_failures_and_a_closed_connection(Function::PerMessage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn batch_handlers_take_effect_once_through_duplicates_failures_and_a_closed_connection() {
    through_failures_and_a_closed_connection(Function::BatchHandler).await;
}

async fn through_failures_and_a_closed_connection(function: Function) {
    let f = fixture("batches", fast_retries(), QueueType::Classic, None).await;
    const ORDERS: usize = 1500;
    // Two orders fail transiently once: their batches run again with a savepoint per message
    // and only they are retried.
    f.script
        .set(&f.key(7), &[Step::FailTransient, Step::FailTransient]);
    f.script
        .set(&f.key(700), &[Step::FailTransient, Step::FailTransient]);
    // The batch holding order 300 waits in its transaction while the connection is closed; it
    // then commits, its acks cannot be sent, and its redelivered copies must be duplicates.
    f.script.set(&f.key(300), &[Step::WaitForRelease]);
    let mut published = 0;
    for n in 0..ORDERS {
        for _ in 0..(n % 3 + 1) {
            f.publish_order(n, 2).await;
            published += 1;
        }
    }
    let running = start(
        function
            .runtime(&f, f.pool.clone())
            .batch(50)
            .prefetch(100)
            .concurrency(1)
            .linger(Duration::from_millis(20)),
    );
    wait_until("a batch in its transaction", DEADLINE, || async {
        f.script.started(&f.key(300))
    })
    .await;
    assert!(broker::close_connections(&format!("idem-test:{}", f.queue)) >= 1);
    f.script.release(&f.key(300));
    wait_until("every order applied", DEADLINE, || async {
        f.effects().await.len() == ORDERS
    })
    .await;
    wait_until("every delivery settled", DEADLINE, || async {
        broker::count(&f.queue).await == 0
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(seen.dead_lettered, 0, "{seen:?}");
    assert!(seen.retried >= 2, "{seen:?}");
    assert!(
        seen.settled() >= published as u64,
        "{seen:?} of {published}"
    );
    f.assert_exactly_once(ORDERS, |_| 2).await;
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_outage_under_batches_loses_and_doubles_nothing() {
    database_outage(Function::PerMessage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_outage_under_batch_handlers_loses_and_doubles_nothing() {
    database_outage(Function::BatchHandler).await;
}

/// A batch whose store could not write keeps its place: after the outage it runs again before
/// the batch behind it runs its handlers, as one worker's batches always do (two batches
/// running at once lock shared rows in different orders: a deadlock, retried, spends an
/// attempt; a CI run of the outage test below met one).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_that_waited_for_its_store_runs_again_before_the_next_batch() {
    let f = fixture(
        "batch-keeps-place",
        fast_retries(),
        QueueType::Classic,
        None,
    )
    .await;
    let (proxy, proxied) = proxied_postgres().await;
    let running = start(
        Function::PerMessage
            .runtime(&f, proxied)
            .batch(10)
            .linger(Duration::from_secs(1))
            .concurrency(1),
    );
    // The runtime is up (its start-up checks wrote to the store) once a first order applies.
    f.publish_order(20, 3).await;
    wait_until("the first order applied", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    // The first batch's first order, once the store writes again, waits for the test.
    f.script.set(&f.key(0), &[Step::WaitForRelease]);
    proxy.cut();
    for n in 0..20 {
        f.publish_order(n, 3).await;
    }
    wait_until("the store paused", DEADLINE, || async {
        running.now().pauses >= 1
    })
    .await;
    proxy.restore();
    wait_until("the first batch ran again", DEADLINE, || async {
        f.script.started(&f.key(0))
    })
    .await;
    // Nothing to await: the check is that the second batch does not start meanwhile (before
    // the fix it started within milliseconds of the restore).
    let overtaken = tokio::time::timeout(Duration::from_secs(2), async {
        while f.script.attempts(&f.key(10)).is_empty() {
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    })
    .await;
    assert!(
        overtaken.is_err(),
        "the next batch ran its handlers while the batch that waited for the store had not committed"
    );
    f.script.release(&f.key(0));
    wait_until("every order applied", DEADLINE, || async {
        f.effects().await.len() == 21
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.retried, seen.dead_lettered), (0, 0), "{seen:?}");
    f.assert_exactly_once(21, |_| 3).await;
    f.cleanup().await;
}

/// With the default retry policy: the outage pauses the batches, spending no attempt.
async fn database_outage(function: Function) {
    let f = fixture(
        "batch-db-outage",
        RetryPolicy::default(),
        QueueType::Classic,
        None,
    )
    .await;
    let (proxy, proxied) = proxied_postgres().await;
    const ORDERS: usize = 1000;
    for n in 0..ORDERS {
        f.publish_order(n, 5).await;
    }
    // One batch in flight (the fixture's runtime has four workers): these orders share seven
    // balance rows, which concurrent batches lock in different orders (see the README). A
    // linger of 1 s instead of the default 5 ms: with a thousand orders waiting, every batch
    // then has its 40 (a CI run on a busy machine, with the default, counted 39 deliveries
    // waiting below: the batch the cut caught had gathered 39).
    let running = start(
        function
            .runtime(&f, proxied)
            .batch(40)
            .linger(Duration::from_secs(1))
            .prefetch(120)
            .concurrency(1),
    );
    wait_until("some progress", DEADLINE, || async {
        running.now().processed >= 100
    })
    .await;
    proxy.cut();
    wait_until("the store paused", DEADLINE, || async {
        running.now().pauses >= 1
    })
    .await;
    proxy.restore();
    wait_until("every order applied", DEADLINE, || async {
        f.effects().await.len() == ORDERS
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.dead_lettered, seen.retried),
        (0, 0),
        "no attempt spent on the outage: {seen:?}"
    );
    // Every delivery of the batch the cut caught waited for the store, with no attempt spent.
    assert!(seen.unavailable >= 40, "whole batches waited: {seen:?}");
    f.assert_exactly_once(ORDERS, |_| 5).await;
    f.cleanup().await;
}

/// A batch one of whose keys another transaction holds (uncommitted, as a slow copy elsewhere
/// does) waits for it a bounded time, then runs its members one by one: the nine others commit
/// while the key is still held, and the held one is retried alone once it is let go, each order
/// applied once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_key_held_elsewhere_holds_up_only_its_own_message_in_a_batch() {
    use idem::store::{ClaimRequest, Fingerprint, InboxStore};
    let f = fixture("held-key", RetryPolicy::default(), QueueType::Classic, None).await;
    const ORDERS: usize = 10;
    let held_key = f.key(4);
    let store = idem::sql::PgInbox::new(f.pool.clone());
    let fingerprint = Fingerprint::of(b"another copy");
    let request = ClaimRequest {
        consumer: CONSUMER,
        key: &held_key,
        fingerprint: &fingerprint,
        attempt: 1,
        retention: Duration::from_secs(60),
    };
    let mut holder = store.begin().await.unwrap();
    store.claim(&mut holder, &request).await.unwrap();
    for n in 0..ORDERS {
        f.publish_order(n, 2).await;
    }
    let running = start(f.runtime_with_defaults().batch(ORDERS));
    let others = || async {
        let effects = f.effects().await;
        effects.len() == ORDERS - 1 && !effects.contains_key(&f.key(4))
    };
    wait_until(
        "the nine others applied while the key is held",
        DEADLINE,
        others,
    )
    .await;
    store.rollback(holder).await;
    wait_until("the held order applied once let go", DEADLINE, || async {
        f.effects().await.len() == ORDERS
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(seen.dead_lettered, 0, "{seen:?}");
    assert!(
        seen.retried >= 1,
        "the held one was retried alone: {seen:?}"
    );
    f.assert_exactly_once(ORDERS, |_| 2).await;
    f.cleanup().await;
}

/// The batch claim's bound on lock waits holds for the claim only: the transaction's own
/// `lock_timeout` (here 7 s, set before the claim) is what the handlers' statements get after
/// it.
#[tokio::test]
async fn the_batch_claims_bound_on_lock_waits_is_the_claims_only() {
    use idem::store::{ClaimRequest, Fingerprint, InboxStore};
    let pool = common::postgres(1).await;
    let store = idem::sql::PgInbox::new(pool.clone());
    store.migrate().await.unwrap();
    let fingerprint = Fingerprint::of(b"{}");
    let keys = [common::unique("bound-a"), common::unique("bound-b")];
    let requests: Vec<ClaimRequest<'_>> = keys
        .iter()
        .map(|key| ClaimRequest {
            consumer: "bound.test",
            key,
            fingerprint: &fingerprint,
            attempt: 1,
            retention: Duration::from_secs(60),
        })
        .collect();
    let mut tx = store.begin().await.unwrap();
    sqlx::query("SET LOCAL lock_timeout = '7s'")
        .execute(&mut *tx)
        .await
        .unwrap();
    store.claim_batch(&mut tx, &requests).await.unwrap();
    let after: String = sqlx::query_scalar("SHOW lock_timeout")
        .fetch_one(&mut *tx)
        .await
        .unwrap();
    store.rollback(tx).await;
    assert_eq!(after, "7s");
}
