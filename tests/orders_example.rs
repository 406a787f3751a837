//! The orders example's status updates, run as a user runs the example:
//!
//! - `orders demo` on RabbitMQ and on the in-memory transport checks its books and that every
//!   order's status versions were applied once each, in order, and parks the key of an order
//!   whose update 2 is malformed, then releases it: 3 and 4 applied after 1;
//! - two `orders consume` processes on PostgreSQL with `ORDERS_QUEUE_TYPE=quorum` and
//!   `ORDERS_STATUS_PARTITIONS=3` declare the status exchange and its partition queues, and
//!   apply status updates published to `<queue>.status` (routing key = order id) in order per
//!   order while one of them is killed with SIGKILL and restarted; their `AMQP_URL` lists a
//!   broker that refuses connections before the real one;
//! - `ORDERS_BATCH_HANDLER=1`: the demo's books are exact on SQLite, PostgreSQL and MariaDB,
//!   and orders booked one at a time are duplicates to the batch handler afterwards (the two
//!   share the consumer's inbox rows).

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::{self, amqp_url};
use common::running::DEADLINE;
use common::watched::{self, Watched};
use common::{KillOnDrop, orders_example, unique, wait_until};
use idem::Envelope;
use idem::transport::Partition;
use std::collections::HashMap;
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::Duration;

const STATUSES: [&str; 5] = ["placed", "paid", "packed", "shipped", "delivered"];

/// The lines of a demo's report that say its books are exact: the balances, the ledger and the
/// shipment log (no unique key: an order booked or shipped twice shows there) and the parcels.
const EXACT: [&str; 4] = [
    "balances             exact",
    "ledger               exact  (400 rows: one per order booked)",
    "parcels              exact",
    "shipment log         exact  (400 rows: one per order shipped)",
];

fn assert_exact(report: &str) {
    for line in EXACT {
        assert!(report.lines().any(|l| l == line), "no `{line}` in {report}");
    }
}

fn demo(queue: &str, transport: &str, database: &str) -> String {
    demo_with(queue, transport, database, &[])
}

fn demo_with(queue: &str, transport: &str, database: &str, env: &[(&str, &str)]) -> String {
    let output = Command::new(orders_example())
        .args(["demo", "--orders", "400"])
        .envs(env.iter().copied())
        .env("AMQP_URL", amqp_url())
        .env("DATABASE_URL", database)
        .env("ORDERS_QUEUE", queue)
        .env("ORDERS_TRANSPORT", transport)
        .env("RUST_LOG", "error")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&output.stdout).into_owned();
    assert!(
        output.status.success(),
        "the demo failed: {stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    stdout
}

#[tokio::test]
async fn the_demo_applies_every_status_update_once_in_order() {
    broker::with_the_plugin().await;
    let dir = tempfile::tempdir().unwrap();
    for transport in ["rabbitmq", "memory"] {
        let queue = unique("idem-example-demo");
        let database = dir.path().join(format!("{transport}.db"));
        let report = demo(&queue, transport, database.to_str().unwrap());
        let line = report
            .lines()
            .find(|l| l.starts_with("status updates"))
            .unwrap_or_else(|| panic!("no status line in {report}"));
        assert!(
            line.contains("orders 100, 4 partitions of") && line.ends_with("in order: exact)"),
            "{transport}: {line}"
        );
        assert_exact(&report);
        assert!(
            report.contains("2 later updates parked behind it, not applied (applied: [1])")
                && report.contains("released             [1, 3, 4]"),
            "{transport}: the parked key and its release: {report}"
        );
        if transport == "rabbitmq" {
            for index in 0..4 {
                let partition = Partition::queue_name(&format!("{queue}.status"), index);
                assert!(broker::exists(&partition).await, "{partition} declared");
            }
            broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
        }
    }
}

#[tokio::test]
async fn the_batch_handler_keeps_the_same_books_on_every_database() {
    broker::with_the_plugin().await;
    let dir = tempfile::tempdir().unwrap();
    let sqlite = dir.path().join("batch.db");
    for database in [
        sqlite.to_str().unwrap().to_owned(),
        common::postgres_url(),
        common::mysql_url(),
    ] {
        let queue = unique("idem-example-batch-handler");
        let report = demo_with(
            &queue,
            "rabbitmq",
            &database,
            &[("ORDERS_BATCH_HANDLER", "1")],
        );
        assert_exact(&report);
        assert!(
            report.contains("orders stored            400  (expected 400)"),
            "{report}"
        );
        assert!(report.contains("(rejected 3, conflict 1;"), "{report}");
        broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
    }
}

/// Orders booked one at a time by `orders consume`, then sent again to `orders consume` with
/// the batch handler: every copy is a duplicate, nothing is booked twice.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_booked_one_at_a_time_are_duplicates_to_the_batch_handler() {
    broker::with_the_plugin().await;
    let queue = unique("idem-example-switch");
    let pool = common::postgres(2).await;
    broker::declare_orders_queue(&queue).await;
    let publisher = broker::publisher().await;
    let publish_all = || async {
        for n in 0..300 {
            let id = format!("{queue}-{n}");
            let body = serde_json::json!({"order_id": id, "customer": format!("{queue}-c{}", n % 7), "amount_cents": n + 1});
            broker::publish(&publisher, &queue, Some(&id), body.to_string().as_bytes()).await;
        }
    };
    let booked = || async {
        sqlx::query_scalar::<_, Option<i64>>(
            "SELECT sum(cents)::bigint FROM balances WHERE customer LIKE $1",
        )
        .bind(format!("{queue}-c%"))
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    let orders = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE order_id LIKE $1")
            .bind(format!("{queue}-%"))
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    // One ledger row per booking: an order booked twice is there twice.
    let ledger = || async {
        let mut ids: Vec<String> =
            sqlx::query_scalar("SELECT order_id FROM ledger WHERE order_id LIKE $1")
                .bind(format!("{queue}-%"))
                .fetch_all(&pool)
                .await
                .unwrap();
        ids.sort_unstable();
        ids
    };
    let mut every_order: Vec<String> = (0..300).map(|n| format!("{queue}-{n}")).collect();
    every_order.sort_unstable();
    publish_all().await;
    let consumer = |batch_handler: &str| {
        KillOnDrop(
            Command::new(orders_example())
                .arg("consume")
                .env("AMQP_URL", amqp_url())
                .env("DATABASE_URL", common::postgres_url())
                .env("ORDERS_QUEUE", &queue)
                .env("ORDERS_BATCH_HANDLER", batch_handler)
                .env("RUST_LOG", "error")
                .stdout(Stdio::null())
                .stderr(Stdio::inherit())
                .spawn()
                .unwrap(),
        )
    };
    let single = consumer("0");
    wait_until("300 orders booked one at a time", DEADLINE, || async {
        orders().await == 300
    })
    .await;
    drop(single);
    assert_eq!(ledger().await, every_order, "each order booked once");
    publish_all().await;
    let batched = consumer("1");
    wait_until("the copies consumed", DEADLINE, || async {
        broker::count(&queue).await == 0 && broker::unacked(&queue) == 0
    })
    .await;
    drop(batched);
    assert_eq!(orders().await, 300);
    assert_eq!(
        booked().await,
        Some((1..=300).sum::<i64>()),
        "every amount booked once"
    );
    // Had the batch handler its own key space, each copy would have reached it and been
    // booked again: the ledger would hold it twice.
    assert_eq!(ledger().await, every_order, "each order booked once");
    assert_eq!(broker::count(&idem::rabbitmq::dlq(&queue)).await, 0);
    broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
}

fn consume(queue: &str) -> Watched {
    Watched::spawn(
        "orders consume",
        Command::new(orders_example())
            .arg("consume")
            // A broker that refuses first: the example fails over to the next address.
            .env(
                "AMQP_URL",
                format!("amqp://guest:guest@127.0.0.1:1/%2f,{}", amqp_url()),
            )
            .env("DATABASE_URL", common::postgres_url())
            .env("ORDERS_QUEUE", queue)
            .env("ORDERS_QUEUE_TYPE", "quorum")
            .env("ORDERS_STATUS_PARTITIONS", "3")
            .env("RUST_LOG", "error"),
    )
}

fn update(order_id: &str, version: i64) -> Envelope {
    let status = STATUSES[version as usize - 1];
    let body = serde_json::json!({"order_id": order_id, "status": status, "version": version});
    Envelope::new(body.to_string())
        .with_message_id(format!("{order_id}:{version}"))
        .with_content_type("application/json")
}

/// The type of `queue`, from the broker.
fn queue_type(queue: &str) -> Option<String> {
    let listed = common::rabbitmqctl()
        .args(["list_queues", "-q", "name", "type"])
        .output()
        .unwrap();
    String::from_utf8_lossy(&listed.stdout)
        .lines()
        .filter_map(|l| l.split_once('\t'))
        .find(|(name, _)| *name == queue)
        .map(|(_, kind)| kind.trim().to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn orders_consume_applies_status_updates_in_order_across_a_kill() {
    broker::with_the_plugin().await;
    const ORDERS: usize = 60;
    let queue = unique("idem-example-status");
    let exchange = format!("{queue}.status");
    let pool = common::postgres(2).await;
    let [mut first, mut second] = [consume(&queue), consume(&queue)];
    let declared = || async { broker::exists(&Partition::queue_name(&exchange, 2)).await };
    let watching = &mut [&mut first, &mut second];
    watched::wait_until(
        "the status partitions are declared",
        DEADLINE,
        watching,
        declared,
    )
    .await;
    assert!(
        !broker::exists(&Partition::queue_name(&exchange, 3)).await,
        "ORDERS_STATUS_PARTITIONS=3 makes three partitions"
    );
    assert_eq!(
        queue_type(&Partition::queue_name(&exchange, 0)).as_deref(),
        Some("quorum")
    );
    assert_eq!(queue_type(&queue).as_deref(), Some("quorum"));

    let orders: Vec<String> = (0..ORDERS).map(|n| format!("{queue}-o{n}")).collect();
    let publisher = broker::publisher().await;
    let applied = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM status_log WHERE order_id LIKE $1")
            .bind(format!("{queue}-%"))
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    for version in 1..=STATUSES.len() as i64 {
        for order in &orders {
            publisher
                .publish_unconfirmed_to(&exchange, order, &update(order, version))
                .await
                .unwrap();
        }
        publisher.wait_for_confirms().await.unwrap();
        if version == 2 {
            let watching = &mut [&mut first, &mut second];
            let some = || async { applied().await > 0 };
            watched::wait_until("some updates applied", DEADLINE, watching, some).await;
            first.child.kill().unwrap();
            assert_eq!(
                first.child.wait().unwrap().signal(),
                Some(9),
                "killed with SIGKILL"
            );
            first = consume(&queue);
        }
    }
    let total = (ORDERS * STATUSES.len()) as i64;
    let all = || async { applied().await >= total };
    let watching = &mut [&mut first, &mut second];
    watched::wait_until(
        "every update applied",
        Duration::from_secs(120),
        watching,
        all,
    )
    .await;

    let log: Vec<(String, i64)> = sqlx::query_as(
        "SELECT order_id, version FROM status_log WHERE order_id LIKE $1 ORDER BY id",
    )
    .bind(format!("{queue}-%"))
    .fetch_all(&pool)
    .await
    .unwrap();
    let mut sequences: HashMap<String, Vec<i64>> = HashMap::new();
    for (order, version) in log {
        sequences.entry(order).or_default().push(version);
    }
    let expected: Vec<i64> = (1..=STATUSES.len() as i64).collect();
    for order in &orders {
        assert_eq!(
            sequences[order], expected,
            "the versions of {order}, as applied"
        );
        let current: (String, i64) =
            sqlx::query_as("SELECT status, version FROM order_status WHERE order_id = $1")
                .bind(order)
                .fetch_one(&pool)
                .await
                .unwrap();
        assert_eq!(current, ("delivered".to_owned(), 5));
    }
    drop((first, second));
    broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
}
