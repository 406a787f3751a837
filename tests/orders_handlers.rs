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
use idem::sqlx::{self, PgPool};
use idem::store::Stores;
use idem::testing::{Harness, json};
use std::str::FromStr;

/// A pool of 8 connections whose tables (the inbox among them) live in a schema of their own,
/// and the schema's name.
async fn pool_in_own_schema() -> (PgPool, String) {
    let schema = common::unique("harness").replace('-', "_");
    let admin = common::postgres(1).await;
    // The name is made here from a prefix, the process id and a counter.
    sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
        .execute(&admin)
        .await
        .unwrap();
    let options = sqlx::postgres::PgConnectOptions::from_str(&common::postgres_url())
        .unwrap()
        .options([("search_path", schema.as_str())]);
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect_with(options)
        .await
        .unwrap();
    for statement in handlers::SCHEMA {
        sqlx::query(statement).execute(&pool).await.unwrap();
    }
    (pool, schema)
}

/// Copies sent at once run on separate connections of the pool: the database's unique key lets
/// one through, and the balance is booked once; a lost ack's redelivery is a duplicate.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn on_a_postgres_pool_copies_at_once_book_an_order_once() {
    let (pool, schema) = pool_in_own_schema().await;
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
    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
        .execute(&common::postgres(1).await)
        .await
        .unwrap();
}
