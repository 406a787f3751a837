//! TLS to the database with the build's TLS feature (`tls-rustls` by default; `.ci/run` runs
//! this file again built with `tls-native` alone): a `sslmode=require` PostgreSQL URL connects
//! over TLS, and a handler's inbox works over that connection.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests unwrap: a panic is a failure with its message

mod common;

use idem::prelude::*;
use idem::sql::PgInbox;
use idem::store::Stores;
use idem::testing::Harness;

#[derive(serde::Deserialize)]
struct Ping {
    id: String,
}

#[idempotent(key = "ping.id", consumer = "tls.ping", store = Postgres)]
async fn ping(
    _tx: &mut Transaction<'_, sqlx::Postgres>,
    ping: Ping,
) -> Result<String, HandlerError> {
    Ok(format!("pong {}", ping.id))
}

#[tokio::test]
async fn postgres_with_sslmode_require_runs_the_inbox_over_tls() {
    let url = common::postgres_url();
    let separator = if url.contains('?') { '&' } else { '?' };
    let url = format!("{url}{separator}sslmode=require");
    let pool = sqlx::PgPool::connect(&url)
        .await
        .unwrap_or_else(|e| panic!("sslmode=require: {e}"));
    let ssl: bool = sqlx::query_scalar("SELECT ssl FROM pg_stat_ssl WHERE pid = pg_backend_pid()")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert!(ssl, "the connection is not encrypted");
    let inbox = PgInbox::new(pool);
    inbox.migrate().await.unwrap();
    let harness = Harness::new(Stores::new().with(inbox));
    let id = common::unique("tls");
    let ping = serde_json::json!({ "id": id });
    let first = harness.send_json("tls.ping", &id, &ping).await.unwrap();
    let again = harness.send_json("tls.ping", &id, &ping).await.unwrap();
    assert_eq!((first.label(), again.label()), ("processed", "duplicate"));
    assert_eq!(
        again.output().unwrap().decode::<String>().unwrap(),
        format!("pong {id}")
    );
}
