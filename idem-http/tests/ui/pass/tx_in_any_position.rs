//! A transactional layer wraps handlers whose `Tx` is of its store's database, in any
//! position; an external layer is a tower layer on any route.

use axum::Router;
use axum::extract::State;
use axum::routing::post;
use idem_http::{ConfigError, Idempotency, Tx};
use idem_sqlx::SqliteInbox;
use sqlx::{Sqlite, SqlitePool};

async fn first(mut tx: Tx<Sqlite>, body: String) -> String {
    let _ = &mut **tx;
    body
}

async fn second(State(_pool): State<SqlitePool>, mut tx: Tx<Sqlite>, body: String) -> String {
    let _ = &mut **tx;
    body
}

async fn last(State(_pool): State<SqlitePool>, mut tx: Tx<Sqlite>) -> &'static str {
    let _ = &mut **tx;
    "done"
}

/// Eight arguments, the `Tx` last: the most `WritesIn` covers.
#[allow(clippy::too_many_arguments)]
async fn eighth(_: u8, _: u8, _: u8, _: u8, _: u8, _: u8, _: u8, mut tx: Tx<Sqlite>) {
    let _ = &mut **tx;
}

async fn call_bank(body: String) -> String {
    body
}

fn app(pool: SqlitePool) -> Result<Router, ConfigError> {
    let idempotent = Idempotency::transactional(SqliteInbox::new(pool.clone()), "payments")
        .shared_key_space()
        .layer()?;
    let external = Idempotency::external(SqliteInbox::new(pool.clone()), "charges")
        .shared_key_space()
        .layer()?;
    Ok(Router::new()
        .route("/first", post(idempotent.handler(first)))
        .route("/second", post(idempotent.handler(second)))
        .route("/last", post(idempotent.handler(last)))
        .route("/charge", post(call_bank).layer(external))
        .with_state(pool))
}

fn wraps_eight_arguments(pool: SqlitePool) -> Result<(), ConfigError> {
    let idempotent = Idempotency::transactional(SqliteInbox::new(pool), "eight")
        .shared_key_space()
        .layer()?;
    let _ = idempotent.handler(eighth);
    Ok(())
}

fn main() {
    let _ = (app, wraps_eight_arguments);
}
