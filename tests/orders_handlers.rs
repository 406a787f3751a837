//! The orders example's handlers under the test harness: `examples/orders/tests.rs`, compiled
//! beside the example's `handlers.rs` and `status.rs` as a test of their own (on in-memory SQLite), and the
//! harness over a PostgreSQL pool of the test's own, as a service's tests would use it.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests unwrap: a panic is a failure with its message

mod common;
#[path = "../examples/orders/handlers.rs"]
#[allow(dead_code)]
mod handlers;
#[path = "../examples/orders/status.rs"]
#[allow(dead_code)]
mod status;
#[path = "../examples/orders/tests.rs"]
mod tests;

use idem::sql::PgInbox;
use idem::sqlx;
use idem::store::Stores;
use idem::testing::{Harness, json};

/// A schema of its own holding the example's tables, with a pool of 8 connections on it.
async fn pool_in_own_schema() -> common::OwnSchema {
    let schema = common::OwnSchema::create("harness", 8).await;
    for statement in handlers::SCHEMA {
        sqlx::query(statement).execute(&schema.pool).await.unwrap();
    }
    schema
}

/// Copies sent at once run on separate connections of the pool: the database's unique key lets
/// one through, and the balance and the ledger are booked once; a lost ack's redelivery is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_postgres_pool_copies_at_once_book_an_order_once() {
    let schema = pool_in_own_schema().await;
    let pool = schema.pool.clone();
    let inbox = PgInbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    let harness = Harness::new(Stores::new().with(inbox)).state(handlers::Billing::of("orders"));
    let placed = json(
        "pg-1",
        &handlers::OrderPlaced {
            order_id: "pg-1".into(),
            customer: "fay".into(),
            amount_cents: 40,
        },
    )
    .unwrap();
    let outcomes = harness.send_copies("orders", &placed, 8).await.unwrap();
    let processed = outcomes.iter().filter(|o| o.label() == "processed").count();
    let duplicates = outcomes.iter().filter(|o| o.label() == "duplicate").count();
    assert_eq!((processed, duplicates), (1, 7), "{outcomes:?}");
    let again = harness.redeliver("orders", &placed).await.unwrap();
    assert_eq!(again.label(), "duplicate");
    let cents: i64 = sqlx::query_scalar("SELECT cents FROM balances WHERE customer = 'fay'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(cents, 40);
    let ledger: Vec<String> = sqlx::query_scalar("SELECT order_id FROM ledger")
        .fetch_all(&pool)
        .await
        .unwrap();
    assert_eq!(ledger, ["pg-1"], "one booking of the order");
    schema.drop().await;
}
