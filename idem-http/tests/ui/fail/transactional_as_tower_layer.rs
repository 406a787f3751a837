//! A transactional layer put on a route as a tower layer: its handler's `Tx` would be checked
//! only at run time, so it is not a tower layer.

use axum::routing::post;
use idem_http::{Idempotency, Tx};
use idem_sqlx::SqliteInbox;
use sqlx::{Sqlite, SqlitePool};

async fn create(mut tx: Tx<Sqlite>, body: String) -> String {
    let _ = &mut **tx;
    body
}

fn app(pool: SqlitePool) -> axum::Router {
    let idempotent = Idempotency::transactional(SqliteInbox::new(pool), "payments")
        .shared_key_space()
        .layer()
        .unwrap();
    axum::Router::new().route("/payments", post(create).layer(idempotent))
}

fn main() {
    let _ = app;
}
