//! The orders example's handler tests, under the test harness (`idem::testing`): what a team
//! writes for its own handlers. An in-memory SQLite database, no broker; copies, a lost ack,
//! reordering, a transient database error, a conflict and a malformed message; status updates
//! applied once each and never older than the applied version. `cargo test`
//! runs them as `tests/orders_handlers.rs` (the example's binary stays the plain one the other
//! tests start).

use crate::handlers::{OrderPlaced, SCHEMA};
use crate::status::{CONSUMER as STATUS, SQLITE_SCHEMA as STATUS_SCHEMA, StatusUpdate};
use idem::sqlx::{self, SqlitePool};
use idem::testing::{Harness, json};

async fn harness() -> (Harness, SqlitePool) {
    let (harness, pool) = idem::testing::sqlite().await.expect("in-memory SQLite");
    // The order handler stages its `OrderBilled` in the outbox (the harness publishes nothing).
    let harness = harness.state(crate::handlers::Billing::of("orders"));
    for statement in SCHEMA.iter().chain(&STATUS_SCHEMA) {
        sqlx::query(*statement)
            .execute(&pool)
            .await
            .expect("schema");
    }
    (harness, pool)
}

fn order(id: &str, customer: &str, cents: i64) -> idem::Envelope {
    let order = OrderPlaced {
        order_id: id.to_owned(),
        customer: customer.to_owned(),
        amount_cents: cents,
    };
    json(id, &order).expect("serializable")
}

async fn balance(pool: &SqlitePool, customer: &str) -> i64 {
    sqlx::query_scalar("SELECT cents FROM balances WHERE customer = ?")
        .bind(customer)
        .fetch_optional(pool)
        .await
        .expect("balance")
        .unwrap_or(0)
}

async fn orders(pool: &SqlitePool) -> i64 {
    sqlx::query_scalar("SELECT COUNT(*) FROM orders")
        .fetch_one(pool)
        .await
        .expect("count")
}

/// The ledger's order ids, sorted: one row per booking of an order.
async fn ledger(pool: &SqlitePool) -> Vec<String> {
    sqlx::query_scalar("SELECT order_id FROM ledger ORDER BY order_id")
        .fetch_all(pool)
        .await
        .expect("ledger")
}

fn labels(outcomes: &[idem::Outcome]) -> Vec<&'static str> {
    outcomes.iter().map(idem::Outcome::label).collect()
}

#[tokio::test]
async fn copies_and_a_lost_ack_book_an_order_once() {
    let (harness, pool) = harness().await;
    let placed = order("o-1", "ada", 250);
    let copies = harness.send_copies("orders", &placed, 3).await.unwrap();
    let mut seen = labels(&copies);
    seen.sort_unstable();
    assert_eq!(seen, ["duplicate", "duplicate", "processed"]);
    // Committed, but the ack was lost: the broker delivers it again.
    let again = harness.redeliver("orders", &placed).await.unwrap();
    assert_eq!(again.label(), "duplicate");
    assert_eq!((orders(&pool).await, balance(&pool, "ada").await), (1, 250));
    assert_eq!(ledger(&pool).await, ["o-1"], "booked once");
    assert!(harness.dead_letters().is_empty());
}

#[tokio::test]
async fn reordered_orders_add_up_the_same() {
    let (harness, pool) = harness().await;
    let sent = [
        order("o-3", "bo", 3),
        order("o-1", "bo", 1),
        order("o-2", "bo", 2),
    ];
    let outcomes = harness.send_all("orders", sent).await.unwrap();
    assert_eq!(labels(&outcomes), ["processed"; 3]);
    assert_eq!(balance(&pool, "bo").await, 6);
    assert_eq!(ledger(&pool).await, ["o-1", "o-2", "o-3"]);
}

#[tokio::test]
async fn a_transient_database_error_is_retried_and_applied_once() {
    let (harness, pool) = harness().await;
    harness.inject_transient(2);
    let attempts = harness
        .deliver("orders", order("o-9", "cy", 90))
        .await
        .unwrap();
    assert_eq!(labels(&attempts), ["retry", "retry", "processed"]);
    assert_eq!((orders(&pool).await, balance(&pool, "cy").await), (1, 90));
    assert_eq!(
        ledger(&pool).await,
        ["o-9"],
        "the retries rolled back, the last run booked"
    );
}

#[tokio::test]
async fn retries_run_out_into_a_dead_letter() {
    let (harness, pool) = harness().await;
    let harness = Harness::max_attempts(harness, 2).unwrap();
    harness.inject_transient(5);
    let attempts = harness
        .deliver("orders", order("o-5", "di", 5))
        .await
        .unwrap();
    assert_eq!(labels(&attempts), ["retry", "retry"]);
    let dead = harness.dead_letters();
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].dead_letter.reason, "retries-exhausted");
    assert_eq!(orders(&pool).await, 0);
    assert!(ledger(&pool).await.is_empty());
}

#[tokio::test]
async fn a_reused_id_and_a_malformed_message_are_dead_lettered_with_reasons() {
    let (harness, pool) = harness().await;
    harness
        .send("orders", order("o-7", "ed", 70))
        .await
        .unwrap();
    let reused = harness
        .send("orders", order("o-7", "ed", 71))
        .await
        .unwrap();
    assert_eq!(reused.label(), "conflict");
    let malformed = idem::Envelope::new("{not json").with_message_id("bad-1");
    harness.send("orders", malformed).await.unwrap();
    let reasons: Vec<_> = harness
        .dead_letters()
        .into_iter()
        .map(|d| (d.dead_letter.reason, d.dead_letter.key))
        .collect();
    assert_eq!(
        reasons,
        [
            ("conflict".to_owned(), Some("o-7".to_owned())),
            ("decode".to_owned(), None)
        ]
    );
    assert_eq!(balance(&pool, "ed").await, 70);
    assert_eq!(ledger(&pool).await, ["o-7"], "the reused id never booked");
}

fn status(order_id: &str, status: &str, version: i64) -> idem::Envelope {
    let update = StatusUpdate {
        order_id: order_id.to_owned(),
        status: status.to_owned(),
        version,
    };
    json(&format!("{order_id}:{version}"), &update).expect("serializable")
}

/// The order's status row and the versions applied to it, in the order applied.
async fn status_of(pool: &SqlitePool, order_id: &str) -> (Option<(String, i64)>, Vec<i64>) {
    let current = sqlx::query_as("SELECT status, version FROM order_status WHERE order_id = ?")
        .bind(order_id)
        .fetch_optional(pool)
        .await
        .expect("status");
    let applied =
        sqlx::query_scalar("SELECT version FROM status_log WHERE order_id = ? ORDER BY id")
            .bind(order_id)
            .fetch_all(pool)
            .await
            .expect("log");
    (current, applied)
}

#[tokio::test]
async fn a_status_update_older_than_the_applied_one_is_stale() {
    let (harness, pool) = harness().await;
    let sent = [
        status("o-4", "placed", 1),
        status("o-4", "packed", 3),
        status("o-4", "placed", 1),
        status("o-4", "paid", 2),
    ];
    let outcomes = harness.send_all(STATUS, sent).await.unwrap();
    assert_eq!(
        labels(&outcomes),
        ["processed", "processed", "duplicate", "stale"]
    );
    let (current, applied) = status_of(&pool, "o-4").await;
    assert_eq!(current, Some(("packed".to_owned(), 3)));
    assert_eq!(applied, [1, 3], "version 2 never applied after 3");
    // The stale update is neither stored nor dead-lettered: sent again, it is judged again.
    let again = harness
        .send(STATUS, status("o-4", "paid", 2))
        .await
        .unwrap();
    assert_eq!(again.label(), "stale");
    assert!(harness.dead_letters().is_empty());
}
