//! A handler that takes no `Tx` behind a transactional layer: its writes could not commit with
//! the key.

use idem_http::Idempotency;
use idem_sqlx::SqliteInbox;
use sqlx::SqlitePool;

async fn create(body: String) -> String {
    body
}

fn app(pool: SqlitePool) {
    let idempotent = Idempotency::transactional(SqliteInbox::new(pool), "payments")
        .shared_key_space()
        .layer()
        .unwrap();
    let _ = idempotent.handler(create);
}

fn main() {
    let _ = app;
}
