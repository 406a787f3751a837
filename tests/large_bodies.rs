//! The consumer's memory with large bodies, measured on the user's path: `orders consume` (a
//! real process, the default prefetch) takes 100 orders of 15 MiB each, and its peak resident
//! set (`VmHWM`) stays within the bound the README states: the broker sends no more than
//! `prefetch` unacknowledged deliveries, so the process holds at most that many bodies, each
//! once in the AMQP client's buffer and once in the handler's hands.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::{self, amqp_url};
use common::watched::{self, Watched};
use common::{orders_example, unique};
use std::process::Command;
use std::time::Duration;

const ORDERS: usize = 100;
const BODY: usize = 15 << 20;
/// The example's prefetch: `ORDERS_CONCURRENCY` (8) × 4, the runtime's default of 32.
const PREFETCH: u64 = 32;

/// The peak resident set of process `pid`, in bytes.
fn peak_rss(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    let kib: u64 = status
        .lines()
        .find_map(|line| line.strip_prefix("VmHWM:"))
        .and_then(|value| value.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap();
    kib * 1024
}

/// The README's bound: 64 MiB for the process itself, and two copies of each of `prefetch`
/// bodies.
fn stated_bound(body: u64) -> u64 {
    (64 << 20) + 2 * PREFETCH * body
}

#[cfg(target_os = "linux")]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_of_large_bodies_stays_within_the_stated_memory_bound() {
    let schema = common::OwnSchema::create("idem_large", 2).await;
    let queue = unique("idem-large");
    broker::declare_orders_queue(&queue).await;
    let publisher = broker::publisher().await;
    let customer = format!("{queue}-c");
    let padding = "x".repeat(BODY);
    for n in 0..ORDERS {
        let id = format!("{queue}-{n}");
        // Written out, not serialised: the ids and the padding need no escaping, and serde_json
        // scanning 15 MiB for escapes a hundred times, unoptimised, took half this test's time.
        let body = format!(
            r#"{{"order_id":"{id}","customer":"{customer}","amount_cents":1,"note":"{padding}"}}"#
        )
        .into_bytes();
        assert!(body.len() >= BODY && body.len() < idem::rabbitmq::DEFAULT_MAX_BODY);
        broker::publish(&publisher, &queue, Some(&id), &body).await;
    }
    drop(publisher);
    let mut consumer = Watched::spawn(
        "orders consume",
        Command::new(orders_example())
            .arg("consume")
            .env("AMQP_URL", amqp_url())
            .env("DATABASE_URL", &schema.url)
            .env("ORDERS_QUEUE", &queue)
            .env("RUST_LOG", "error"),
    );
    let pool = &schema.pool;
    let deadline = Duration::from_secs(300);
    watched::wait_until(
        "every order applied",
        deadline,
        &mut [&mut consumer],
        || async {
            let applied: i64 = sqlx::query_scalar("SELECT count(*) FROM orders")
                .fetch_one(pool)
                .await
                .unwrap_or(0);
            applied == ORDERS as i64
        },
    )
    .await;
    let peak = peak_rss(consumer.id());
    drop(consumer);
    let bound = stated_bound(BODY as u64);
    eprintln!(
        "{ORDERS} orders of {} MiB at prefetch {PREFETCH}: peak RSS {} MiB (bound {} MiB)",
        BODY >> 20,
        peak >> 20,
        bound >> 20
    );
    assert!(
        peak <= bound,
        "peak RSS {} MiB, over the stated {} MiB",
        peak >> 20,
        bound >> 20
    );
    assert_eq!(broker::count(&idem::rabbitmq::dlq(&queue)).await, 0);
    broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
    schema.drop().await;
}
