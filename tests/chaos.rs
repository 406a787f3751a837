//! Chaos: several `orders consume` processes (built with `fault-injection`) drain 400 orders
//! with duplicates and malformed messages through both hops of the example (orders,
//! then the `OrderBilled` events their outbox publishes to shipping), while processes are
//! killed with SIGKILL at random (each after 3 s of life at least) and abort themselves before and after commits, half-way
//! through dead-lettering, between a commit and its outbox dispatch and between a publish and
//! the removal of its outbox row; every killed process is restarted. Once a third of the
//! orders is stored the database is cut off for two seconds (a proxy in front of it drops
//! every connection), and once two thirds are, the broker closes the consumers' connections.
//! Afterwards the orders stored and shipped are exactly those sent (by id), every balance is
//! exact, each customer's parcels count that customer's orders, no outbox row is left
//! unpublished, and the dead letters are exactly the malformed messages, each with its record.
//!
//! It runs on the machine's broker with classic queues, once more with the orders booked by the
//! batch handler (`ORDERS_BATCH_HANDLER=1`, batches of 50), once more on the 3-node
//! cluster of `scripts/rabbitmq-cluster` with quorum queues replicated on every node, the
//! consumers given every node's address, and once more on NATS JetStream, where the consumers
//! reach the server through a proxy that drops every connection for two seconds instead of
//! the broker closing them. On NATS the run has a server of its own (`nats-server` must be on
//! the PATH), which it kills with SIGKILL and starts again on its store once half the orders
//! are stored. Last, on a JetStream cluster of its own (three `nats-server` processes, every
//! stream held by all three, the consumers given a proxy to each), where it kills the server
//! leading the orders' stream once half the orders are stored, and starts it again once
//! another server leads it.
//!
//! A run is judged only once every queue (or stream) of both hops is empty, retry queues
//! included, and its consumers stopped: late copies and redeliveries, the ones most likely to
//! race a killed original, are judged too. Each crash point must have fired (the aborting
//! processes write their point to `IDEM_FAULT_REPORT`), the database cut must have broken
//! connections and the connection kill closed some. The run prints its seed;
//! `IDEM_CHAOS_SEED=<seed>` replays its choices.
//!
//! An order's or a shipment's message in a dead-letter queue fails the run at once; that and a
//! run that does not converge say where the missing orders and shipments are; with
//! `IDEM_CHAOS_LOGS=<dir>` the consumers also log at debug level into `<dir>/<queue>.log`.
//!
//! The runs take turns. Two at once on a 2-core machine starve each other's restarts: each
//! took 145–166 s (about 200 kills) against 21–23 s alone (16–28 kills), because a consumer
//! that starts slowly is killed again before it settles anything. The kills come at the same
//! pace either way; a run that shares the machine only lasts longer.
//!
//! The default is a short run (`cargo test --workspace` includes it). The long run:
//! `IDEM_CHAOS_ORDERS=20000 IDEM_CHAOS_PROCESSES=4 cargo test --release --test chaos -- --nocapture`.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::amqp_url;
use common::bus::Bus;
use common::cluster::Cluster;
use common::watched::Watched;
use idem::rabbitmq::QueueType;
use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::process::Command;
use std::time::{Duration, Instant};

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// The consumer processes; each is killed when dropped, so none outlives the test.
struct Children(Vec<Watched>);

impl Children {
    /// Stops them as an operator does (SIGTERM) and waits until they are gone.
    fn stop(&mut self) {
        for child in &mut self.0 {
            let _ = Command::new("kill")
                .args(["-TERM", &child.id().to_string()])
                .status();
        }
        for child in &mut self.0 {
            let _ = child.child.wait();
        }
    }
}

/// A tiny xorshift generator: chaos that is different every run but needs no dependency.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killed_and_crashing_consumers_never_lose_or_double_an_order() {
    chaos(Bus::rabbit(&amqp_url(), QueueType::Classic).await, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn with_the_batch_handler() {
    let batch_handler = [("ORDERS_BATCH_HANDLER", "1"), ("ORDERS_BATCH", "50")];
    chaos(
        Bus::rabbit(&amqp_url(), QueueType::Classic).await,
        &batch_handler,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_cluster_with_quorum_queues() {
    let Some(cluster) = Cluster::up().await else {
        return;
    };
    chaos(Bus::rabbit(&cluster.urls, QueueType::Quorum).await, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_nats_jetstream() {
    chaos(Bus::nats_of_its_own().await, &[]).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_a_jetstream_cluster() {
    let Some(bus) = Bus::nats_cluster_of_its_own().await else {
        return;
    };
    chaos(bus, &[]).await;
}

/// How long a consumer runs at least before the run may kill it (see the kill in `chaos`).
const MIN_LIFE: Duration = Duration::from_secs(3);

/// Held by the chaos run under way: the runs take turns (see the top of the file).
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The chaos run against `bus`, the consumers given the settings `env` besides.
async fn chaos(bus: Bus, env: &[(&str, &str)]) {
    let _turn = TURN.lock().await;
    let orders = setting("IDEM_CHAOS_ORDERS", 400);
    let processes = setting("IDEM_CHAOS_PROCESSES", 3);
    let malformed = 10;
    let binary = common::faulty_orders::build();

    let queue = common::unique("idem-chaos");
    let (proxy, database_url) = common::proxy::postgres().await;
    let pool = common::postgres(4).await;
    let mut orders_per_customer: HashMap<String, i64> = HashMap::new();
    // IDEM_CHAOS_SEED=<n> replays a run's choices (its copies, kills and pauses); the run
    // prints the seed it used.
    let seed = std::env::var("IDEM_CHAOS_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| {
            (u64::from(std::process::id()) << 32)
                ^ u64::from(std::time::UNIX_EPOCH.elapsed().unwrap().subsec_nanos())
        });
    eprintln!(
        "chaos ({}): seed {seed} (IDEM_CHAOS_SEED={seed} replays it)",
        bus.name()
    );
    let mut rng = Rng(seed | 1);
    // Each crash point aborts a process at its first chance in the run and says so here.
    let report = tempfile::NamedTempFile::new().unwrap();

    // Topology as the consumers declare it, then the workload.
    bus.declare(&queue).await;
    let mut expected: HashMap<String, i64> = HashMap::new();
    let mut deliveries = 0;
    for n in 0..orders {
        let (id, customer, cents) = (
            format!("{queue}-{n}"),
            format!("{queue}-c{}", n % 37),
            (n % 997) as i64 + 1,
        );
        *expected.entry(customer.clone()).or_default() += cents;
        *orders_per_customer.entry(customer.clone()).or_default() += 1;
        let body = serde_json::json!({"order_id": id, "customer": customer, "amount_cents": cents})
            .to_string();
        let message = idem::Envelope::new(body).with_message_id(id.as_str());
        let copies = if rng.below(5) == 0 {
            2 + rng.below(2)
        } else {
            1
        };
        for copy in 0..copies {
            bus.publish(&queue, &message, copy).await;
            deliveries += 1;
        }
        if n % 500 == 499 {
            bus.confirm().await;
        }
    }
    for n in 0..malformed {
        let message = idem::Envelope::new("{not json").with_message_id(format!("{queue}-bad-{n}"));
        bus.publish(&queue, &message, 0).await;
        deliveries += 1;
    }
    bus.confirm().await;

    // IDEM_CHAOS_LOGS=<dir>: the consumers log at debug level, all into <dir>/<queue>.log.
    let logs = std::env::var("IDEM_CHAOS_LOGS")
        .ok()
        .map(|dir| std::path::Path::new(&dir).join(format!("{queue}.log")));
    let spawn = || -> Watched {
        let mut command = Command::new(&binary);
        bus.point(&mut command);
        command
            .arg("consume")
            .env("DATABASE_URL", &database_url)
            .env("ORDERS_QUEUE", &queue)
            .env("ORDERS_CONCURRENCY", "4")
            // The default poison limit: only runs that started and never settled count, and
            // no valid order may be refused by it.
            .env(
                "IDEM_FAULT",
                "before_commit=0.003,after_commit=0.003,in_dead_letter=0.3,\
                 after_commit_before_dispatch=0.003,after_publish_before_mark=0.003",
            )
            .env("IDEM_FAULT_REPORT", report.path())
            .env(
                "RUST_LOG",
                if logs.is_some() {
                    "info,idem=debug"
                } else {
                    "error"
                },
            )
            .envs(env.iter().copied());
        Watched::spawn_logging("orders consume", &mut command, logs.as_deref())
    };
    let mut children = Children((0..processes).map(|_| spawn()).collect());
    let (mut kills, mut faults, mut stops, mut unreachable_at_start) = (0, 0, 0, 0);
    let started = Instant::now();
    let stored = |pool: sqlx::PgPool, prefix: String| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE order_id LIKE $1")
            .bind(format!("{prefix}-%"))
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
    };
    let dead = || bus.dead(&queue);
    let shipped = |pool: sqlx::PgPool, prefix: String| async move {
        sqlx::query_as::<_, (i64, i64)>(
            "SELECT (SELECT count(*) FROM shipments WHERE order_id LIKE $1),
                    (SELECT count(*) FROM idem_outbox WHERE key LIKE $1)",
        )
        .bind(format!("{prefix}-%"))
        .fetch_one(&pool)
        .await
        .unwrap_or((0, -1))
    };
    let billed = format!("{queue}.billed");
    // Both hops: the orders and the events their outbox publishes to shipping.
    let hops = [queue.as_str(), billed.as_str()];
    // The consumers declare the second hop when they start.
    common::wait_until(
        "the consumers to declare the shipping queue",
        Duration::from_secs(60),
        || bus.declared(&billed),
    )
    .await;
    // On a cluster every stream of both hops is held by every server.
    for (stream, replicas) in bus.stream_replicas(&hops).await {
        assert_eq!(replicas, bus.replicas(), "servers holding `{stream}`");
    }
    let (mut broken, mut closed, mut restarted) = (0, false, false);
    let mut cut = false;
    // When the books first were complete: from then on only copies are left to settle.
    let mut complete: Option<Instant> = None;
    loop {
        // Keep every slot running: count the faults (self-aborts), restart the dead.
        // A process that exited with a code (not a signal) did not crash on a fault: it
        // refused to start or failed for good, and its replacements would too.
        for child in &mut children.0 {
            if let Some(status) = child.exited() {
                match status.signal() {
                    Some(6) => faults += 1,
                    Some(_) => {}
                    // Started while the broker was away (its server restarting, the proxy
                    // cut): the example stops at once, naming it, and a supervisor starts it
                    // again, as here.
                    None if child.stderr_tail(20).contains("cannot reach the broker") => {
                        unreachable_at_start += 1;
                    }
                    None => child.assert_running(),
                }
                *child = spawn();
            }
        }
        // An order or a shipment in a dead-letter queue will not come back: say so at once,
        // not after the time limit. (The malformed messages are the only expected ones.)
        let dead_now = dead().await;
        let billed_dead = bus.dead(&billed).await;
        if dead_now > malformed || billed_dead > 0 {
            let whereabouts =
                common::whereabouts::report(&pool, &queue, bus.on_machine_rabbitmq()).await;
            let letters: Vec<String> = bus
                .dead_letters(&queue)
                .await
                .iter()
                .map(|l| format!("{:?} {:?} {:?}", l.message_id, l.reason, l.copy))
                .collect();
            panic!(
                "dead-lettered: {dead_now} orders' messages (only the {malformed} malformed \
                 ones belong there) and {billed_dead} shipments' messages\n{whereabouts}\n\
                 the orders' dead letters (message id, reason, copy):\n{}",
                letters.join("\n")
            );
        }
        let stored_now = stored(pool.clone(), queue.clone()).await;
        if !cut && stored_now >= orders as i64 / 3 {
            // The database goes away under load, and comes back. A cut that finds no open
            // connection (every process just restarted after a crash point, not yet connected)
            // proves nothing: the database comes back at once and the cut is tried again.
            broken = proxy.cut();
            if broken > 0 {
                tokio::time::sleep(Duration::from_secs(2)).await;
                cut = true;
            }
            proxy.restore();
        }
        if !restarted && bus.can_restart() && stored_now >= orders as i64 / 2 {
            // The broker's server dies (SIGKILL) and comes back on its store, where it can.
            restarted = bus.restart_server(&queue).await;
        }
        if !closed && stored_now >= 2 * orders as i64 / 3 && bus.can_close() {
            closed = bus.close_connections(&queue).await;
        }
        let (shipments, unpublished) = shipped(pool.clone(), queue.clone()).await;
        let left = bus.left(&hops).await;
        let books = stored_now >= orders as i64
            && dead_now >= malformed
            && shipments >= orders as i64
            && unpublished == 0;
        if !books {
            complete = None;
        } else if left > 0
            && complete.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(120)
        {
            panic!(
                "the books are complete, but {left} messages stayed in the queues for 120 s:\n{}",
                bus.describe(&hops).await
            );
        }
        // Judged only once every fault was made: a run whose books were done before the
        // connection kill (or the server restart) came makes it on the idle consumers.
        let faults_made = (closed || !bus.can_close()) && (restarted || !bus.can_restart()) && cut;
        if books && left == 0 && faults_made {
            // Judged only once no copy is left anywhere: the consumers stop, and what they
            // held unacknowledged is back in its queue, where it must not be.
            children.stop();
            let left = bus.left(&hops).await;
            if left == 0 {
                break;
            }
            stops += 1;
            eprintln!(
                "chaos: {left} messages were still held when the consumers stopped; running them"
            );
            children = Children((0..processes).map(|_| spawn()).collect());
        }
        if started.elapsed() >= Duration::from_secs(600) {
            // Which of the four did not come, so that a failure says where to look.
            let whereabouts =
                common::whereabouts::report(&pool, &queue, bus.on_machine_rabbitmq()).await;
            panic!(
                "chaos run did not converge in 600 s: orders stored {stored_now} of {orders}, \
                 dead letters {dead_now} of {malformed}, shipments {shipments} of {orders}, \
                 outbox rows unpublished {unpublished}, messages left in the queues {left}\n{whereabouts}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200 + rng.below(600))).await;
        // The victim is one that has had the time to start and settle something: killing
        // processes still starting kills whatever message they were given, again and again,
        // until the poison limit rightly refuses it (a supervisor's restart backoff spares
        // production that). Each process lives at least `MIN_LIFE`.
        let grown: Vec<usize> = (0..children.0.len())
            .filter(|i| children.0[*i].age() >= MIN_LIFE)
            .collect();
        if grown.is_empty() {
            continue;
        }
        let victim = grown[rng.below(grown.len() as u64) as usize];
        children.0[victim].child.kill().unwrap(); // SIGKILL
        children.0[victim].child.wait().unwrap();
        kills += 1;
        children.0[victim] = spawn();
    }

    // Exact sets: every order and shipment by id, every dead letter by id with its record.
    let ids = |table: &'static str| {
        let pool = pool.clone();
        let prefix = format!("{queue}-%");
        async move {
            let mut ids: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
                "SELECT order_id FROM {table} WHERE order_id LIKE $1 ORDER BY order_id"
            )))
            .bind(prefix)
            .fetch_all(&pool)
            .await
            .unwrap();
            ids.sort();
            ids
        }
    };
    let mut expected_ids: Vec<String> = (0..orders).map(|n| format!("{queue}-{n}")).collect();
    expected_ids.sort();
    // The books' rows are written once per order id whatever happens; the ledger and the
    // shipment log have no unique key, so a second application shows there as a second row.
    let (stored_ids, shipped_ids) = (ids("orders").await, ids("shipments").await);
    let (ledger_ids, logged_ids) = (ids("ledger").await, ids("shipment_log").await);
    let ledger_cents: i64 = sqlx::query_scalar::<_, Option<i64>>(
        "SELECT sum(cents)::int8 FROM ledger WHERE order_id LIKE $1",
    )
    .bind(format!("{queue}-%"))
    .fetch_one(&pool)
    .await
    .unwrap()
    .unwrap_or(0);
    let balances: HashMap<String, i64> =
        sqlx::query_as("SELECT customer, cents FROM balances WHERE customer LIKE $1")
            .bind(format!("{queue}-c%"))
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let wrong_balances = expected
        .iter()
        .filter(|(c, cents)| balances.get(*c) != Some(cents))
        .count();
    let records = idem::sql::PgInbox::new(pool.clone())
        .dead_letters(&queue)
        .await
        .unwrap();
    let mut dead: Vec<(Option<String>, bool)> = bus
        .dead_letters(&queue)
        .await
        .iter()
        .map(|m| {
            let recorded = records
                .iter()
                .any(|r| r.reason == "decode" && r.describes(m.message_id.as_deref(), &m.body));
            (m.message_id.clone(), recorded)
        })
        .collect();
    dead.sort();
    let expected_dead: Vec<(Option<String>, bool)> = (0..malformed)
        .map(|n| (Some(format!("{queue}-bad-{n}")), true))
        .collect();
    let parcels: HashMap<String, i64> =
        sqlx::query_as("SELECT customer, n FROM parcels WHERE customer LIKE $1")
            .bind(format!("{queue}-c%"))
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let wrong_parcels = orders_per_customer
        .iter()
        .filter(|(c, n)| parcels.get(*c) != Some(n))
        .count();
    let (_, unpublished) = shipped(pool.clone(), queue.clone()).await;
    let left = bus.left(&hops).await;
    // Each crash point fired, as the aborting processes reported.
    let reported = std::fs::read_to_string(report.path()).unwrap_or_default();
    let fired = |point: &str| reported.lines().filter(|l| *l == point).count();
    let points = [
        "before_commit",
        "after_commit",
        "in_dead_letter",
        "after_commit_before_dispatch",
        "after_publish_before_mark",
    ];
    let fired_per_point: Vec<(&str, usize)> = points.iter().map(|p| (*p, fired(p))).collect();
    eprintln!(
        "chaos ({}{}): seed {seed}, messages {deliveries}, duplicates {}, malformed {malformed}, processes {processes}, kills {kills}, faults {faults} {fired_per_point:?}, \
         database connections cut {broken}, connections closed {closed}, server restarted {restarted}, stops before the end {stops}, started while the broker was away {unreachable_at_start}, \
         orders stored {} of {orders}, wrong balances {wrong_balances}, shipments {} of {orders}, wrong parcels {wrong_parcels}, unpublished {unpublished}, messages left {left}, dead letters {}, {:.1} s",
        bus.name(),
        if env.is_empty() {
            String::new()
        } else {
            format!(", {env:?}")
        },
        deliveries - orders - malformed,
        stored_ids.len(),
        shipped_ids.len(),
        dead.len(),
        started.elapsed().as_secs_f64()
    );
    assert!(
        stored_ids == expected_ids,
        "the orders stored are not exactly the orders sent"
    );
    assert!(
        shipped_ids == expected_ids,
        "the orders shipped are not exactly the orders sent"
    );
    assert!(
        ledger_ids == expected_ids,
        "the ledger does not hold each order exactly once"
    );
    assert!(
        logged_ids == expected_ids,
        "the shipment log does not hold each order exactly once"
    );
    assert_eq!(
        ledger_cents,
        expected.values().sum::<i64>(),
        "the ledger's amounts are not the orders'"
    );
    assert_eq!(
        wrong_balances, 0,
        "balances that are not the sum of their orders"
    );
    assert_eq!(
        wrong_parcels, 0,
        "parcel counts that are not the customer's orders"
    );
    assert_eq!(unpublished, 0, "outbox rows left unpublished");
    assert_eq!(left, 0, "messages left in the queues");
    assert_eq!(
        dead, expected_dead,
        "the dead letters are not exactly the malformed messages, each with its `decode` record"
    );
    assert!(kills > 0, "nothing was killed; the run proves nothing");
    for (point, n) in &fired_per_point {
        assert!(*n > 0, "the crash point {point} never fired");
    }
    assert!(broken > 0, "cutting the database broke no connection");
    assert!(
        closed || !bus.can_close(),
        "closing the consumers' broker connections closed none"
    );
    assert!(
        restarted || !bus.can_restart(),
        "the broker's server was never restarted"
    );
    bus.delete(&queue).await;
    bus.delete(&billed).await;
}
