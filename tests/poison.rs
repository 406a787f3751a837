//! A message that crashes its consumer every time, on a classic queue: real `orders consume`
//! processes abort on it (fault injection before the commit) and are restarted, until the
//! message is dead-lettered as `poison` after the poison limit's 5 deliveries without a
//! settlement; then the queue moves on.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::{self, amqp_url};
use idem::{DEFAULT_POISON_LIMIT, RetryPolicy};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_its_consumer_ends_in_the_dlq_as_poison() {
    let binary = common::faulty_orders::build();
    let queue = common::unique("idem-poison");
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("orders.db");
    broker::declare_orders_queue(&queue).await;
    let publisher = broker::publisher().await;
    let order = |id: &str| {
        serde_json::json!({"order_id": id, "customer": "c", "amount_cents": 5}).to_string()
    };
    let poison = format!("{queue}-poison");
    broker::publish(&publisher, &queue, Some(&poison), order(&poison).as_bytes()).await;
    let consume = |fault: &str| {
        Command::new(&binary)
            .arg("consume")
            .env("AMQP_URL", amqp_url())
            .env("DATABASE_URL", &database)
            .env("ORDERS_QUEUE", &queue)
            .env("IDEM_FAULT", fault)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let dlq = idem::rabbitmq::dlq(&queue);
    let started = Instant::now();
    let mut crashes = 0;
    // Every commit aborts the process: each run dies on the message, until it is refused.
    while broker::count(&dlq).await == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "never dead-lettered ({crashes} crashes)"
        );
        assert!(
            crashes <= DEFAULT_POISON_LIMIT,
            "{crashes} crashes and still delivered"
        );
        let mut child = consume("before_commit=1");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert_eq!(
                    status.signal(),
                    Some(6),
                    "the consumer aborts on the message"
                );
                crashes += 1;
                break;
            }
            if broker::count(&dlq).await > 0 || Instant::now() > deadline {
                child.kill().unwrap();
                child.wait().unwrap();
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(
        crashes, DEFAULT_POISON_LIMIT,
        "one crash per delivery up to the limit"
    );
    assert_eq!(broker::count(&dlq).await, 1, "dead-lettered once");
    let pool = idem::sql::sqlite::pool(&database.to_string_lossy())
        .await
        .unwrap();
    let records = idem::sql::SqliteInbox::new(pool.clone())
        .dead_letters(&queue)
        .await
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(
        (records[0].reason.as_str(), records[0].key.as_str()),
        ("poison", poison.as_str())
    );
    let dead = broker::drain(&idem::rabbitmq::dlq(&queue)).await;
    assert!(records[0].describes(Some(&poison), &dead[0].body));

    // The queue moves on: the next order is processed by a healthy consumer.
    let next = format!("{queue}-next");
    broker::publish(&publisher, &queue, Some(&next), order(&next).as_bytes()).await;
    let healthy = common::KillOnDrop(consume(""));
    let stored = |id: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE order_id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap_or(0)
        }
    };
    common::wait_until("the next order stored", Duration::from_secs(30), || {
        let stored = stored(next.clone());
        async move { stored.await == 1 }
    })
    .await;
    drop(healthy);
    assert_eq!(
        stored(poison.clone()).await,
        0,
        "the poison message never committed"
    );
    broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
}
