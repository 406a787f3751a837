//! A lease is the external mode's: a transactional configuration has none to set.

use idem_http::Idempotency;
use idem_sqlx::SqliteInbox;
use sqlx::SqlitePool;
use std::time::Duration;

fn config(pool: SqlitePool) {
    let _ = Idempotency::transactional(SqliteInbox::new(pool), "payments")
        .lease(Duration::from_secs(30));
}

fn main() {
    let _ = config;
}
