//! The orders example: an order consumer whose non-idempotent writes (an order row and a
//! balance increment) are made effectively exactly once by idem's inbox.
//!
//! `cargo run --example orders` runs the demo against an embedded SQLite file: a few thousand
//! orders with duplicates (some delivered concurrently), malformed messages and a reused id,
//! then checks that every balance adds up. `--help` lists the configuration.

mod demo;
mod handlers;

use anyhow::Context as _;
use clap::Parser;
use idem::sql::{PgInbox, SqliteInbox};
use idem::{StoreKind, Stores};

/// The orders example of idem.
#[derive(Debug, Parser)]
#[command(version, about)]
struct Cli {
    /// Where the inbox and the orders live: a `sqlite:` URL or file path (embedded, the
    /// default) or a `postgres://` URL.
    #[arg(long, env = "DATABASE_URL", default_value = "sqlite://idem-orders.db")]
    database_url: String,
    /// How many distinct orders the demo sends.
    #[arg(long, env = "ORDERS_COUNT", default_value_t = 2000)]
    orders: usize,
    /// The share of deliveries that are duplicates (0.0 to 0.9).
    #[arg(long, env = "ORDERS_DUP_RATE", default_value_t = 0.2)]
    dup_rate: f64,
    /// How many deliveries are processed at once.
    #[arg(long, env = "ORDERS_CONCURRENCY", default_value_t = 8)]
    concurrency: usize,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let cli = Cli::parse();
    anyhow::ensure!(
        (0.0..=0.9).contains(&cli.dup_rate),
        "ORDERS_DUP_RATE must be between 0.0 and 0.9, got {}",
        cli.dup_rate
    );
    anyhow::ensure!(cli.concurrency > 0, "ORDERS_CONCURRENCY must be at least 1");

    let (stores, store, db) = connect(&cli.database_url).await?;
    let handlers = idem::registry::for_store(store);
    idem::registry::validate(&handlers)?;
    let handler = handlers
        .into_iter()
        .find(|r| r.consumer() == "orders")
        .context("the orders handler is not registered")?;
    let config = demo::Config {
        orders: cli.orders,
        dup_rate: cli.dup_rate,
        concurrency: cli.concurrency,
    };
    let report = demo::run(handler, &stores, &db, &config).await?;
    println!("{report}");
    anyhow::ensure!(report.exact(), "effects are not exact");
    Ok(())
}

/// The database the demo checks its results in.
pub enum Db {
    /// The embedded default.
    Sqlite(sqlx::SqlitePool),
    /// A PostgreSQL server.
    Postgres(sqlx::PgPool),
}

async fn connect(url: &str) -> anyhow::Result<(Stores, StoreKind, Db)> {
    if url.starts_with("postgres://") || url.starts_with("postgresql://") {
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(16)
            .connect(url)
            .await
            .with_context(|| format!("cannot connect to PostgreSQL at {url}"))?;
        for statement in handlers::SCHEMA {
            sqlx::query(statement).execute(&pool).await?;
        }
        let inbox = PgInbox::new(pool.clone());
        inbox.migrate().await?;
        Ok((
            Stores::new().with(inbox),
            StoreKind::Postgres,
            Db::Postgres(pool),
        ))
    } else if url.starts_with("sqlite:") || !url.contains("://") {
        let pool = idem::sql::sqlite::pool(url)
            .await
            .with_context(|| format!("cannot open SQLite database {url}"))?;
        for statement in handlers::SCHEMA {
            sqlx::query(statement).execute(&pool).await?;
        }
        let inbox = SqliteInbox::new(pool.clone());
        inbox.migrate().await?;
        Ok((
            Stores::new().with(inbox),
            StoreKind::Sqlite,
            Db::Sqlite(pool),
        ))
    } else {
        anyhow::bail!(
            "DATABASE_URL must be a sqlite: URL, a file path or a postgres:// URL, got {url}"
        )
    }
}
