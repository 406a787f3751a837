//! A 3-node RabbitMQ cluster (`scripts/rabbitmq-cluster`) with quorum queues replicated on every
//! node, consumed by two `orders consume` processes given the three nodes' addresses (the
//! example's `AMQP_URL` list) while the cluster loses the node that leads the queue (and that
//! the consumers are connected to), or restarts as a whole: every order takes effect once,
//! processing resumes within seconds, and nothing is lost from the queue or the dead-letter
//! queue.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker;
use common::cluster::Cluster;
use common::{KillOnDrop, orders_example, unique, wait_until};
use idem::rabbitmq::QueueType;
use std::collections::HashMap;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const ORDERS: usize = 2500;
const MALFORMED: usize = 10;

/// What happens to the cluster under load.
#[derive(Debug, Clone, Copy)]
enum Disruption {
    /// `rabbitmqctl stop_app` on the node that leads the queue, later `start_app`.
    LeaderStops,
    /// Every node stopped, then all started again.
    WholeClusterRestarts,
}

async fn stored(pool: &sqlx::PgPool, queue: &str) -> usize {
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE order_id LIKE $1")
        .bind(format!("{queue}-%"))
        .fetch_one(pool)
        .await
        .unwrap_or(0) as usize
}

async fn shipped(pool: &sqlx::PgPool, queue: &str) -> usize {
    sqlx::query_scalar::<_, i64>("SELECT count(*) FROM shipments WHERE order_id LIKE $1")
        .bind(format!("{queue}-%"))
        .fetch_one(pool)
        .await
        .unwrap_or(0) as usize
}

/// The order ids of this run in `table`, which must hold each once (`orders` and `shipments`
/// key them; the `ledger` and the `shipment_log` do not, so a double application shows there).
async fn ids(pool: &sqlx::PgPool, table: &str, queue: &str) -> std::collections::BTreeSet<String> {
    let ids: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT order_id FROM {table} WHERE order_id LIKE $1"
    )))
    .bind(format!("{queue}-%"))
    .fetch_all(pool)
    .await
    .unwrap();
    let set: std::collections::BTreeSet<String> = ids.iter().cloned().collect();
    assert_eq!(set.len(), ids.len(), "an order id twice in {table}");
    set
}

async fn survive(disruption: Disruption) {
    let Some(cluster) = Cluster::up().await else {
        return;
    };
    let queue = unique("idem-cluster");
    let pool = common::postgres(4).await;
    // Declared through node 1, which leads the queue (the broker places a quorum queue's leader
    // on the node its declaring client is connected to).
    broker::declare_orders_queue_on(&cluster.urls, &queue, QueueType::Quorum).await;
    assert_eq!(
        cluster.members(&queue),
        [1, 2, 3],
        "a replica on every node"
    );
    assert_eq!(cluster.leader(&queue, 1), Some(1));

    let publisher = broker::publisher_on(&cluster.urls).await;
    let mut expected: HashMap<String, i64> = HashMap::new();
    for n in 0..ORDERS {
        let (id, customer, cents) = (
            format!("{queue}-{n}"),
            format!("{queue}-c{}", n % 31),
            (n % 89) as i64 + 1,
        );
        *expected.entry(customer.clone()).or_default() += cents;
        let body = serde_json::json!({"order_id": id, "customer": customer, "amount_cents": cents})
            .to_string();
        let message = idem::Envelope::new(body).with_message_id(id.as_str());
        for _ in 0..(1 + n % 3 / 2) {
            publisher
                .publish_unconfirmed(&queue, &message)
                .await
                .unwrap();
        }
        if n == ORDERS / 2 {
            for bad in 0..MALFORMED {
                let message =
                    idem::Envelope::new("{not json").with_message_id(format!("{queue}-bad-{bad}"));
                publisher
                    .publish_unconfirmed(&queue, &message)
                    .await
                    .unwrap();
            }
        }
    }
    publisher.wait_for_confirms().await.unwrap();
    drop(publisher);

    let consume = || {
        KillOnDrop(
            Command::new(orders_example())
                .arg("consume")
                .env("AMQP_URL", &cluster.urls)
                .env("DATABASE_URL", common::postgres_url())
                .env("ORDERS_QUEUE", &queue)
                .env("ORDERS_QUEUE_TYPE", "quorum")
                .env("ORDERS_CONCURRENCY", "4")
                .env("RUST_LOG", "error")
                .stdout(Stdio::null())
                .spawn()
                .unwrap(),
        )
    };
    let consumers = [consume(), consume()];
    wait_until("some progress", Duration::from_secs(60), || async {
        stored(&pool, &queue).await >= 300
    })
    .await;
    let leader = 1;
    let disrupted = Instant::now();
    // The orders stored while the cluster was (partly) down: counted when no node of the
    // cluster runs any more (the whole-cluster restart), or when the leader's application is
    // stopped (its clients moved on to the others).
    let before = match disruption {
        Disruption::LeaderStops => {
            cluster.stop_app(leader).await;
            stored(&pool, &queue).await
        }
        Disruption::WholeClusterRestarts => {
            cluster.stop_all().await;
            let before = stored(&pool, &queue).await;
            cluster.start_all().await;
            before
        }
    };
    let took = disrupted.elapsed();
    assert!(
        before < ORDERS,
        "every order was stored before the cluster went down; the test proves nothing"
    );
    let resumed = Instant::now();
    wait_until(
        "processing resumed on a surviving node",
        Duration::from_secs(30),
        || async { stored(&pool, &queue).await >= before + 100 },
    )
    .await;
    eprintln!(
        "{disruption:?}: done in {:.1} s with {before} of {ORDERS} orders stored; 100 more \
         stored {:.1} s later",
        took.as_secs_f64(),
        resumed.elapsed().as_secs_f64()
    );
    if let Disruption::LeaderStops = disruption {
        let new_leader = cluster.leader(&queue, if leader == 2 { 3 } else { 2 });
        assert!(
            new_leader.is_some_and(|n| n != leader),
            "{new_leader:?} leads"
        );
    }
    let dlq = idem::rabbitmq::dlq(&queue);
    // Two waits, so that a failure says which of the two did not happen.
    wait_until("every order stored", Duration::from_secs(120), || async {
        stored(&pool, &queue).await >= ORDERS
    })
    .await;
    wait_until(
        "every malformed message in the DLQ",
        Duration::from_secs(60),
        || async { broker::count_on(&cluster.urls, &dlq).await >= MALFORMED },
    )
    .await;
    if let Disruption::LeaderStops = disruption {
        cluster.start_app(leader).await;
    }
    // Judged once no copy is left anywhere: in both hops (the orders and the events their
    // outbox publishes to shipping), ready or unacknowledged, retry queues included. Late
    // copies and redeliveries are those most likely to race a stopped node's.
    let dlq_suffix = ".dlq";
    let ours = format!("{queue}.");
    let in_flight =
        |name: &str| (name == queue || name.starts_with(&ours)) && !name.ends_with(dlq_suffix);
    wait_until(
        "every queue of both hops empty",
        Duration::from_secs(120),
        || async { cluster.held(2, in_flight) == 0 },
    )
    .await;
    wait_until("every order shipped", Duration::from_secs(60), || async {
        shipped(&pool, &queue).await >= ORDERS
    })
    .await;
    for mut consumer in consumers {
        let _ = Command::new("kill")
            .args(["-TERM", &consumer.0.id().to_string()])
            .status();
        let _ = consumer.0.wait();
    }

    let balances: HashMap<String, i64> =
        sqlx::query_as("SELECT customer, cents FROM balances WHERE customer LIKE $1")
            .bind(format!("{queue}-c%"))
            .fetch_all(&pool)
            .await
            .unwrap()
            .into_iter()
            .collect();
    let expected_ids: std::collections::BTreeSet<String> =
        (0..ORDERS).map(|n| format!("{queue}-{n}")).collect();
    assert_eq!(
        ids(&pool, "orders", &queue).await,
        expected_ids,
        "every order stored once"
    );
    assert_eq!(
        ids(&pool, "shipments", &queue).await,
        expected_ids,
        "every order shipped once"
    );
    // No unique key there: a second application would show as a second row.
    assert_eq!(
        ids(&pool, "ledger", &queue).await,
        expected_ids,
        "every order booked once"
    );
    assert_eq!(
        ids(&pool, "shipment_log", &queue).await,
        expected_ids,
        "every order logged shipped once"
    );
    assert_eq!(balances, expected, "every order's amount added once");
    assert_eq!(
        cluster.held(2, in_flight),
        0,
        "messages left when the consumers stopped"
    );
    let dead = broker::drain_on(&cluster.urls, &dlq).await;
    let records = idem::sql::PgInbox::new(pool.clone())
        .dead_letters(&queue)
        .await
        .unwrap();
    let mut dead: Vec<(Option<String>, bool)> = dead
        .iter()
        .map(|m| {
            let recorded = records
                .iter()
                .any(|r| r.reason == "decode" && r.describes(m.message_id().as_deref(), &m.body));
            (m.message_id(), recorded)
        })
        .collect();
    dead.sort();
    let expected_dead: Vec<(Option<String>, bool)> = (0..MALFORMED)
        .map(|n| (Some(format!("{queue}-bad-{n}")), true))
        .collect();
    assert_eq!(
        dead, expected_dead,
        "each malformed message dead-lettered once, with its `decode` record"
    );
    assert_eq!(
        broker::count_on(
            &cluster.urls,
            &idem::rabbitmq::dlq(&format!("{queue}.billed"))
        )
        .await,
        0,
        "no shipment dead-lettered"
    );
    // Every queue and exchange of this run: the orders' and the example's next hops'.
    cluster
        .purge(|name| name == queue || name.starts_with(&ours))
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_node_leading_a_quorum_queue_stops_under_load() {
    survive(Disruption::LeaderStops).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_whole_cluster_restarts_under_load() {
    survive(Disruption::WholeClusterRestarts).await;
}
