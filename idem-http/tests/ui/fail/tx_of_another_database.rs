//! A handler writing in a PostgreSQL transaction behind a layer whose keys are in SQLite.

use axum::routing::post;
use idem_http::{Idempotency, Tx};
use idem_sqlx::SqliteInbox;
use sqlx::{Postgres, SqlitePool};

async fn create(mut tx: Tx<Postgres>, body: String) -> String {
    let _ = &mut **tx;
    body
}

fn app(pool: SqlitePool) -> axum::Router {
    let idempotent = Idempotency::transactional(SqliteInbox::new(pool), "payments")
        .shared_key_space()
        .layer()
        .unwrap();
    axum::Router::new().route("/payments", post(idempotent.handler(create)))
}

fn main() {
    let _ = app;
}
