//! A worker keeps its database connection from one message (or batch) to the next (no pool
//! acquire, no ping on every return), gives it up when the database drops it without failing the message,
//! and leaves connections in the pool for everything else: against real RabbitMQ and
//! PostgreSQL, through `build()`.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::{self, amqp_url, publish};
use common::running::{DEADLINE, start};
use common::{unique, wait_until};
use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use idem::sql::PgInbox;
use idem::transport::{QueueSpec, Transport};
use idem::{HandlerError, RetryPolicy, Runtime, RuntimeBuilder, idempotent};
use serde::Deserialize;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const CONSUMER: &str = "held.probe";

#[derive(Debug, Deserialize)]
struct Probe {
    id: String,
}

/// The server processes (`pg_backend_pid()`) the handler's transactions ran in, in order, each
/// with the time the handler ran.
#[derive(Clone, Default)]
struct Backends(Arc<Mutex<Vec<(i32, Instant)>>>);

impl Backends {
    fn all(&self) -> Vec<i32> {
        self.0.lock().unwrap().iter().map(|(pid, _)| *pid).collect()
    }

    /// When the handler ran, message by message.
    fn times(&self) -> Vec<Instant> {
        self.0.lock().unwrap().iter().map(|(_, at)| *at).collect()
    }
}

#[idempotent(store = Postgres, queue = "held-overridden", consumer = "held.probe", key = "probe.id")]
async fn note_backend(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    probe: Probe,
    backends: &Backends,
) -> Result<(), HandlerError> {
    let _ = probe.id;
    let pid: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
        .fetch_one(&mut **tx)
        .await?;
    backends.0.lock().unwrap().push((pid, Instant::now()));
    Ok(())
}

/// A fresh queue, its runtime's builder (`concurrency` workers on `inbox`) and the handler's
/// record of backends.
async fn setup(
    name: &str,
    inbox: PgInbox,
    concurrency: usize,
) -> (String, RuntimeBuilder, Backends) {
    inbox.migrate().await.unwrap();
    let queue = unique(&format!("idem-test-{name}"));
    let rabbit = RabbitConfig::new(amqp_url()).connection_name(format!("idem-test:{queue}"));
    RabbitTransport::new(rabbit.clone())
        .declare(&[QueueSpec::new(queue.clone(), CONSUMER)])
        .await
        .unwrap();
    let backends = Backends::default();
    let builder = Runtime::builder()
        .transport(RabbitTransport::new(rabbit))
        .store(inbox)
        .state(backends.clone())
        .handlers(["note_backend"])
        .handler_queue(CONSUMER, &queue)
        .concurrency(concurrency)
        // One delivery ahead (the default is 32): a worker's transactions run one after the
        // other, message by message, which is what the connections they use are judged by.
        .prefetch(1);
    (queue, builder, backends)
}

async fn publish_probes(queue: &str, range: std::ops::Range<usize>) {
    let publisher = broker::publisher().await;
    for n in range {
        let id = format!("{queue}-{n}");
        let body = serde_json::json!({ "id": id }).to_string();
        publish(&publisher, queue, Some(&id), body.as_bytes()).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_worker_keeps_its_connection_and_replaces_one_the_database_dropped() {
    // Six idle connections the pool would hand out in turn.
    let pool = common::postgres(6).await;
    let (queue, builder, backends) = setup("held", PgInbox::new(pool), 1).await;
    publish_probes(&queue, 0..12).await;
    let running = start(builder);
    wait_until("the first messages settled", DEADLINE, || async {
        running.now().settled() >= 12
    })
    .await;
    let first: BTreeSet<i32> = backends.all().into_iter().collect();
    assert_eq!(
        first.len(),
        1,
        "one worker's twelve transactions ran on {} connections: {first:?}",
        first.len()
    );

    // The database drops the worker's connection while it waits for the next message.
    let held = *first.iter().next().unwrap();
    let admin = common::postgres(1).await;
    let terminated: bool = sqlx::query_scalar("SELECT pg_terminate_backend($1)")
        .bind(held)
        .fetch_one(&admin)
        .await
        .unwrap();
    assert!(terminated);
    publish_probes(&queue, 12..16).await;
    wait_until("the later messages settled", DEADLINE, || async {
        running.now().settled() >= 16
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.processed, seen.retried, seen.dead_lettered),
        (16, 0, 0),
        "a dropped connection cost a message its first attempt: {seen:?}"
    );
    let later = &backends.all()[12..];
    assert!(
        later.iter().all(|pid| *pid != held),
        "a message ran on the terminated backend: {later:?}"
    );
    broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn workers_leave_connections_in_a_small_pool() {
    // Three connections, four workers: one worker keeps a connection, two stay in the pool for
    // the other workers, the relay, the sweeper and the test's own queries.
    let pool = common::postgres(3).await;
    let (queue, builder, backends) = setup("small-pool", PgInbox::new(pool.clone()), 4).await;
    publish_probes(&queue, 0..60).await;
    let running = start(builder);
    wait_until("every message settled", DEADLINE, || async {
        running.now().settled() >= 60
    })
    .await;
    // The pool still answers while the runtime runs.
    let one: i32 = sqlx::query_scalar("SELECT 1")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(one, 1);
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.processed, seen.retried, seen.dead_lettered),
        (60, 0, 0),
        "{seen:?}"
    );
    assert_eq!(backends.all().len(), 60);
    broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_kept_connection_goes_back_after_its_time_and_zero_keeps_none() {
    // Keeping nothing: the pool hands its six idle connections out in turn.
    let inbox = PgInbox::new(common::postgres(6).await).hold_connections(Duration::ZERO);
    let (queue, builder, backends) = setup("hold-none", inbox, 1).await;
    publish_probes(&queue, 0..12).await;
    let starting = Instant::now();
    let running = start(builder);
    wait_until("every message settled", DEADLINE, || async {
        running.now().settled() >= 12
    })
    .await;
    // Start-up and twelve messages, on this machine, now.
    let twelve = starting.elapsed();
    running.shut_down().await;
    let used: BTreeSet<i32> = backends.all().into_iter().collect();
    assert!(
        used.len() > 1,
        "without keeping, twelve transactions still ran on one connection"
    );
    broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;

    // Kept for `hold`, twice what start-up and twelve messages took above (3 s at least, so
    // that a start-up slowed by a busy machine still fits): the first two messages, waiting
    // before the runtime starts, run well within it, and a message after it runs on another
    // connection.
    let hold = (twelve * 2).max(Duration::from_secs(3));
    let inbox = PgInbox::new(common::postgres(6).await).hold_connections(hold);
    let (queue, builder, backends) = setup("hold-short", inbox, 1).await;
    publish_probes(&queue, 0..2).await;
    let starting = Instant::now();
    let running = start(builder);
    wait_until("the first messages settled", DEADLINE, || async {
        running.now().settled() >= 2
    })
    .await;
    let times = backends.times();
    // The worker took its connection after `starting`, and the second message's transaction
    // began before its handler ran: within `hold` of the take, so on the kept connection.
    assert!(
        times[1] - starting < hold,
        "the second message ran {:?} after start-up began, past the {hold:?} hold: \
         the test cannot tell keeping from not",
        times[1] - starting
    );
    // The worker took the connection before the first message's handler ran: once `hold` has
    // passed since then, the connection has been kept for its time (what is tested, not a
    // synchronisation).
    tokio::time::sleep_until((times[0] + hold).into()).await;
    publish_probes(&queue, 2..3).await;
    wait_until("the last message settled", DEADLINE, || async {
        running.now().settled() >= 3
    })
    .await;
    running.shut_down().await;
    let pids = backends.all();
    assert_eq!(pids[0], pids[1], "two messages in a row changed connection");
    assert_ne!(
        pids[1], pids[2],
        "the connection was kept past its time ({hold:?}): {pids:?}"
    );
    broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
}

/// Runs 60 probes in batches of 5 (at most two batches in flight) on `inbox`, and returns
/// the distinct backends their transactions ran on.
async fn backends_of_batches(name: &str, inbox: PgInbox) -> BTreeSet<i32> {
    let (queue, builder, backends) = setup(name, inbox, 1).await;
    publish_probes(&queue, 0..60).await;
    let running = start(builder.batch(5).prefetch(10));
    wait_until("every message settled", DEADLINE, || async {
        running.now().settled() >= 60
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.processed, seen.retried, seen.dead_lettered),
        (60, 0, 0),
        "{seen:?}"
    );
    broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
    backends.all().into_iter().collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_batch_worker_keeps_a_connection_per_batch_in_flight() {
    // Six idle connections the pool would hand out in turn; twelve batches, taking turns on
    // the worker's two kept connections (each handed from a batch to the one after next).
    let kept = backends_of_batches("batch-held", PgInbox::new(common::postgres(6).await)).await;
    assert!(
        kept.len() <= 2,
        "twelve batches ran on {} connections: {kept:?}",
        kept.len()
    );
    let inbox = PgInbox::new(common::postgres(6).await).hold_connections(Duration::ZERO);
    let pooled = backends_of_batches("batch-pooled", inbox).await;
    assert!(
        pooled.len() > 2,
        "without keeping, twelve batches still ran on {pooled:?}: the test cannot tell"
    );
}
