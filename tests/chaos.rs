//! Chaos: several `orders consume` processes (built with `fault-injection`) drain 600 orders
//! with duplicates and malformed messages through both hops of the example (orders,
//! then the `OrderBilled` events their outbox publishes to shipping), while processes are
//! killed with SIGKILL at random and abort themselves before and after commits, half-way
//! through dead-lettering, between a commit and its outbox dispatch and between a publish and
//! the removal of its outbox row; every killed process is restarted. Once a third of the
//! orders is stored the database is cut off for two seconds (a proxy in front of it drops
//! every connection), and once two thirds are, the broker closes the consumers' connections.
//! Afterwards every unique order is stored exactly once, every balance is exact, every order
//! is shipped exactly once, each customer's parcels count that customer's orders, no outbox
//! row is left unpublished, and every malformed message is in the dead-letter queue exactly
//! once.
//!
//! It runs on the machine's broker with classic queues, once more with the orders booked by the
//! batch handler (`ORDERS_BATCH_HANDLER=1`, batches of 50), once more on the 3-node
//! cluster of `scripts/rabbitmq-cluster` with quorum queues replicated on every node, the
//! consumers given every node's address, and once more on NATS JetStream, where the consumers
//! reach the server through a proxy that drops every connection for two seconds instead of
//! the broker closing them. On NATS the run has a server of its own (when `nats-server` is on
//! the PATH), which it kills with SIGKILL and starts again on its store once half the orders
//! are stored.
//!
//! An order's or a shipment's message in a dead-letter queue fails the run at once; that and a
//! run that does not converge say where the missing orders and shipments are; with
//! `IDEM_CHAOS_LOGS=<dir>` the consumers also log at debug level into `<dir>/<queue>.log`.
//!
//! The three runs take turns. Two at once on a 2-core machine starve each other's restarts: each
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

/// The consumer processes; whatever happens to the test, none outlives it.
/// The consumer processes; each is killed when dropped.
struct Children(Vec<Watched>);

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

/// Held by the chaos run under way: the runs take turns (see the top of the file).
static TURN: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The chaos run against `bus`, the consumers given the settings `env` besides.
async fn chaos(bus: Bus, env: &[(&str, &str)]) {
    let _turn = TURN.lock().await;
    let orders = setting("IDEM_CHAOS_ORDERS", 600);
    let processes = setting("IDEM_CHAOS_PROCESSES", 3);
    let malformed = 10;
    let binary = common::faulty_orders::build();

    let queue = common::unique("idem-chaos");
    let (proxy, database_url) = common::proxy::postgres().await;
    let pool = common::postgres(4).await;
    let mut orders_per_customer: HashMap<String, i64> = HashMap::new();
    let mut rng = Rng((u64::from(std::process::id()) * 0x9E37_79B9) | 1);

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
    let (mut kills, mut faults) = (0, 0);
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
    let (mut cut, mut closed, mut restarted) = (false, false, false);
    loop {
        // Keep every slot running: count the faults (self-aborts), restart the dead.
        // A process that exited with a code (not a signal) did not crash on a fault: it
        // refused to start or failed for good, and its replacements would too.
        for child in &mut children.0 {
            if let Some(status) = child.exited() {
                match status.signal() {
                    Some(6) => faults += 1,
                    Some(_) => {}
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
            panic!(
                "dead-lettered: {dead_now} orders' messages (only the {malformed} malformed \
                 ones belong there) and {billed_dead} shipments' messages\n{whereabouts}"
            );
        }
        let stored_now = stored(pool.clone(), queue.clone()).await;
        if !cut && stored_now >= orders as i64 / 3 {
            // The database goes away under load, and comes back.
            proxy.cut();
            tokio::time::sleep(Duration::from_secs(2)).await;
            proxy.restore();
            cut = true;
        }
        if !restarted && bus.can_restart() && stored_now >= orders as i64 / 2 {
            // The broker's server dies (SIGKILL) and comes back on its store, where it can.
            restarted = bus.restart_server().await;
        }
        if !closed && stored_now >= 2 * orders as i64 / 3 && bus.can_close() {
            closed = bus.close_connections(&queue).await;
        }
        let (shipments, unpublished) = shipped(pool.clone(), queue.clone()).await;
        if stored_now >= orders as i64
            && dead_now >= malformed
            && shipments >= orders as i64
            && unpublished == 0
        {
            break;
        }
        if started.elapsed() >= Duration::from_secs(600) {
            // Which of the four did not come, so that a failure says where to look.
            let whereabouts =
                common::whereabouts::report(&pool, &queue, bus.on_machine_rabbitmq()).await;
            panic!(
                "chaos run did not converge in 600 s: orders stored {stored_now} of {orders}, \
                 dead letters {dead_now} of {malformed}, shipments {shipments} of {orders}, \
                 outbox rows unpublished {unpublished}\n{whereabouts}"
            );
        }
        tokio::time::sleep(Duration::from_millis(200 + rng.below(600))).await;
        let victim = rng.below(children.0.len() as u64) as usize;
        children.0[victim].child.kill().unwrap(); // SIGKILL
        children.0[victim].child.wait().unwrap();
        kills += 1;
        children.0[victim] = spawn();
    }
    for child in &mut children.0 {
        let _ = Command::new("kill")
            .args(["-TERM", &child.id().to_string()])
            .status();
    }
    for child in &mut children.0 {
        let _ = child.child.wait();
    }

    let per_order: Vec<(String, i64)> =
        sqlx::query_as("SELECT order_id, 1::bigint FROM orders WHERE order_id LIKE $1")
            .bind(format!("{queue}-%"))
            .fetch_all(&pool)
            .await
            .unwrap();
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
    let dead = bus.dead_letters(&queue).await;
    let dead_letters = dead.len();
    let records = idem::sql::PgInbox::new(pool.clone())
        .dead_letters(&queue)
        .await
        .unwrap();
    let reasons = dead
        .iter()
        .filter(|m| {
            records
                .iter()
                .any(|r| r.describes(m.message_id.as_deref(), &m.body))
        })
        .count();
    let shipments: Vec<(String, i64)> =
        sqlx::query_as("SELECT order_id, 1::bigint FROM shipments WHERE order_id LIKE $1")
            .bind(format!("{queue}-%"))
            .fetch_all(&pool)
            .await
            .unwrap();
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
    let violations = orders.abs_diff(per_order.len())
        + wrong_balances
        + malformed.abs_diff(dead_letters)
        + orders.abs_diff(shipments.len())
        + wrong_parcels
        + unpublished.unsigned_abs() as usize;
    eprintln!(
        "chaos ({}{}): messages {deliveries}, duplicates {}, malformed {malformed}, processes {processes}, kills {kills}, faults {faults}, \
         database cut {cut}, connections closed {closed}, server restarted {restarted}, \
         violations {violations} (orders stored {} of {orders}, wrong balances {wrong_balances}, shipments {} of {orders}, wrong parcels {wrong_parcels}, unpublished {unpublished}, dead letters {dead_letters}, recorded {reasons}), {:.1} s",
        bus.name(),
        if env.is_empty() {
            String::new()
        } else {
            format!(", {env:?}")
        },
        deliveries - orders - malformed,
        per_order.len(),
        shipments.len(),
        started.elapsed().as_secs_f64()
    );
    assert_eq!(violations, 0);
    assert_eq!(reasons, dead_letters, "a dead letter without its record");
    assert!(kills > 0, "nothing was killed; the run proves nothing");
    assert!(
        restarted || !bus.can_restart(),
        "the broker's server was never restarted"
    );
    bus.delete(&queue).await;
    bus.delete(&billed).await;
}
