//! The payments example: an HTTP API whose `POST /payments` runs once per `Idempotency-Key`,
//! however often a client retries it.
//!
//! `cargo run --example payments` serves on `PAYMENTS_ADDR` (default `127.0.0.1:8080`) with the
//! embedded SQLite file unless `DATABASE_URL` names PostgreSQL or MySQL/MariaDB.
//!
//! ```text
//! curl -i -X POST http://127.0.0.1:8080/payments -H 'Authorization: Bearer alice' \
//!      -H 'Idempotency-Key: "order-1"' -H 'content-type: application/json' \
//!      -d '{"customer": "alice", "amount_cents": 1250}'
//! ```
//! The same command again answers the stored `201` with `Idempotent-Replayed: true`; another
//! body with the same key answers 422, and no key 400. Keys are scoped by the client's stable
//! principal, never by the raw token: here the subject a token names (`alice` for `alice` and
//! for a refreshed `alice.v2`), so a client that refreshes its token and retries is still the
//! same client, and is charged once.

use anyhow::Context as _;
use axum::Router;
use axum::extract::Json;
use axum::http::{StatusCode, request::Parts};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use clap::Parser;
use idem::http::{Idempotency, Tx};
use idem::sql::{MySqlInbox, PgInbox, SqliteInbox};
use idem::sqlx::{self, MySql, Postgres, Sqlite};
use idem::telemetry::redact_url;
use std::net::SocketAddr;
use std::time::Duration;

/// The payments example of idem's HTTP layer.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Settings {
    /// Where to serve.
    #[arg(long, env = "PAYMENTS_ADDR", default_value = "127.0.0.1:8080")]
    addr: SocketAddr,
    /// Where the keys and the payments live: a `sqlite:` URL or file path (embedded, the
    /// default), a `postgres://` or a `mysql://` (MySQL or MariaDB) URL.
    #[arg(long, env = "DATABASE_URL", default_value = "sqlite://idem-orders.db")]
    database_url: String,
}

/// The table the handler writes.
const SCHEMA: &str = "CREATE TABLE IF NOT EXISTS payments (
    payment_id TEXT PRIMARY KEY, customer TEXT NOT NULL, amount_cents BIGINT NOT NULL)";
const MYSQL_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS payments (
    payment_id VARCHAR(64) PRIMARY KEY, customer TEXT NOT NULL, amount_cents BIGINT NOT NULL)";

/// `POST /payments`'s body.
#[derive(Debug, serde::Deserialize)]
struct NewPayment {
    customer: String,
    amount_cents: i64,
}

impl NewPayment {
    /// Refuses a payment that cannot be made, before anything is written (so the answer is not
    /// stored, and the client may correct the request under the same key).
    fn invalid(&self) -> Option<Response> {
        let problem = if self.customer.trim().is_empty() {
            "customer must not be empty"
        } else if self.amount_cents <= 0 {
            "amount_cents must be positive"
        } else {
            return None;
        };
        Some(
            (
                StatusCode::BAD_REQUEST,
                Json(serde_json::json!({ "error": problem })),
            )
                .into_response(),
        )
    }
}

/// A new payment id: idem's unique token (process, time and a counter).
fn payment_id() -> String {
    format!("pay_{}", idem::store::owner_token())
}

/// The handler, once per database (they differ in the transaction type and placeholders).
macro_rules! create_payment {
    ($name:ident, $db:ty, $insert:literal) => {
        async fn $name(mut tx: Tx<$db>, Json(payment): Json<NewPayment>) -> Response {
            if let Some(refused) = payment.invalid() {
                return refused;
            }
            let payment_id = payment_id();
            let inserted = sqlx::query($insert)
                .bind(&payment_id)
                .bind(&payment.customer)
                .bind(payment.amount_cents)
                .execute(&mut **tx)
                .await;
            match inserted {
                Ok(_) => (
                    StatusCode::CREATED,
                    Json(serde_json::json!({ "payment_id": payment_id })),
                )
                    .into_response(),
                Err(e) => {
                    tracing::error!(error = %e, "inserting the payment failed");
                    StatusCode::INTERNAL_SERVER_ERROR.into_response()
                }
            }
        }
    };
}

create_payment!(
    create_sqlite,
    Sqlite,
    "INSERT INTO payments (payment_id, customer, amount_cents) VALUES ($1, $2, $3)"
);
create_payment!(
    create_postgres,
    Postgres,
    "INSERT INTO payments (payment_id, customer, amount_cents) VALUES ($1, $2, $3)"
);
create_payment!(
    create_mysql,
    MySql,
    "INSERT INTO payments (payment_id, customer, amount_cents) VALUES (?, ?, ?)"
);

/// The client a request comes from, as a stable principal (none: the layer answers 401): the
/// subject its bearer token names, before the first `.` (`alice.v2` is `alice`). What follows
/// the subject (here a rotation, in a real token a signature and an expiry) changes when the
/// client refreshes its token and is never part of its identity. This demo checks no
/// signature: a real service takes the subject its authentication verified (a JWT's `sub`,
/// the account an API key belongs to), never the raw token.
fn principal(parts: &Parts) -> Option<String> {
    let value = parts.headers.get("authorization")?.to_str().ok()?;
    let token = value.strip_prefix("Bearer ")?;
    let subject = token.split('.').next()?;
    (!subject.is_empty()).then(|| subject.to_owned())
}

/// The route, its layer on `store`, and a sweeper expiring old keys.
fn route<S, H, A, P, T>(store: S, handler: H) -> anyhow::Result<Router>
where
    S: idem::store::RuntimeStore + Clone,
    H: idem::http::WritesIn<S::Tx<'static>, A, P> + axum::handler::Handler<T, ()>,
    T: 'static,
{
    tokio::spawn(idem::http::sweep_every(
        store.clone(),
        Duration::from_secs(60),
    ));
    let idempotent = Idempotency::transactional(store, "payments.create")
        .identity(principal)
        .layer()?;
    Ok(Router::new().route("/payments", post(idempotent.handler(handler))))
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let settings = Settings::parse();
    let url = settings.database_url.as_str();
    let app = if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let options = idem::sql::urls::postgres_options(url).with_context(|| {
            format!("DATABASE_URL ({}) is not a PostgreSQL URL", redact_url(url))
        })?;
        let pool = sqlx::PgPool::connect_with(options).await.with_context(|| {
            format!(
                "cannot connect to PostgreSQL at DATABASE_URL ({})",
                redact_url(url)
            )
        })?;
        sqlx::query(SCHEMA).execute(&pool).await?;
        let store = PgInbox::new(pool);
        store.migrate().await?;
        route(store, create_postgres)?
    } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
        let url = url.replacen("mariadb://", "mysql://", 1);
        let pool = sqlx::MySqlPool::connect(&url).await.with_context(|| {
            format!(
                "cannot connect to MySQL/MariaDB at DATABASE_URL ({})",
                redact_url(&url)
            )
        })?;
        sqlx::query(MYSQL_SCHEMA).execute(&pool).await?;
        let store = MySqlInbox::new(pool);
        store.migrate().await?;
        route(store, create_mysql)?
    } else if url.starts_with("sqlite:") || !url.contains("://") {
        let pool = idem::sql::sqlite::pool(url)
            .await
            .with_context(|| format!("cannot open SQLite database DATABASE_URL ({url})"))?;
        let store = SqliteInbox::new(pool.clone());
        store.migrate().await?;
        sqlx::query(SCHEMA).execute(&pool).await?;
        route(store, create_sqlite)?
    } else {
        anyhow::bail!(
            "DATABASE_URL must be a sqlite: URL, a file path, a postgres:// or a mysql:// URL, got {}",
            redact_url(url)
        )
    };
    let listener = tokio::net::TcpListener::bind(settings.addr)
        .await
        .with_context(|| format!("cannot listen on PAYMENTS_ADDR ({})", settings.addr))?;
    println!(
        "payments: serving POST http://{}/payments (database {})",
        listener.local_addr()?,
        redact_url(url)
    );
    axum::serve(listener, app)
        .with_graceful_shutdown(async {
            let _ = tokio::signal::ctrl_c().await;
        })
        .await?;
    Ok(())
}
