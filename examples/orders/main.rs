//! The orders example: an order consumer whose non-idempotent writes (an order row and a
//! balance increment) are made effectively exactly once by idem.
//!
//! - `cargo run --example orders` (or `-- demo`): publishes a few thousand orders with ~20%
//!   duplicates (some concurrent), malformed messages and a reused id, consumes them, and checks
//!   that every balance adds up. Uses RabbitMQ when it is reachable, the in-memory transport
//!   otherwise; the embedded SQLite file unless `DATABASE_URL` names PostgreSQL or MySQL/MariaDB.
//! - `cargo run --example orders -- consume`: the long-running consumer.
//!
//! `--help` lists the configuration; every setting can come from the environment
//! (`ORDERS_BATCH=200` tries batch mode).

mod demo;
mod handlers;
mod http;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use idem::rabbitmq::{Publisher, RabbitConfig, RabbitTransport};
use idem::sql::{MySqlInbox, PgInbox, SqliteInbox};
use idem::sqlx;
use idem::telemetry::redact_url;
use idem::transport::MemoryTransport;
use idem::{Runtime, RuntimeBuilder};

/// The orders example of idem.
#[derive(Debug, Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    settings: Settings,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Consume orders until interrupted (SIGINT or SIGTERM).
    Consume {
        /// Serve Prometheus metrics at http://HOST:PORT/metrics (idem's message outcomes,
        /// handler and claim durations, rows swept, sweeper lag, connection state), and
        /// /healthz (the process is up) and /readyz (consuming, broker connected, database
        /// answering; 503 with the reasons otherwise).
        #[arg(long, env = "ORDERS_METRICS_ADDR", value_name = "HOST:PORT")]
        metrics_addr: Option<std::net::SocketAddr>,
    },
    /// Publish a workload, consume it, and check the books (the default).
    Demo(demo::Options),
}

/// Settings shared by both commands.
#[derive(Debug, clap::Args)]
struct Settings {
    /// The RabbitMQ broker.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        global = true
    )]
    amqp_url: String,
    /// Where the inbox and the orders live: a `sqlite:` URL or file path (embedded, the
    /// default), a `postgres://` or a `mysql://` (MySQL or MariaDB) URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "sqlite://idem-orders.db",
        global = true
    )]
    database_url: String,
    /// The queue to consume (its dead letters go to `<queue>.dlq`).
    #[arg(long, env = "ORDERS_QUEUE", default_value = "orders", global = true)]
    queue: String,
    /// Orders processed at once, one transaction each (ignored in batch mode).
    #[arg(long, env = "ORDERS_CONCURRENCY", default_value_t = 8, global = true)]
    concurrency: usize,
    /// Batch mode: up to this many orders per transaction (0: one transaction per order).
    #[arg(long, env = "ORDERS_BATCH", default_value_t = 0, global = true)]
    batch: usize,
    /// Deliveries without a settlement (the consumer died on the message, or lost its
    /// connection) before a message is dead-lettered as `poison`.
    #[arg(long, env = "ORDERS_POISON_LIMIT", default_value_t = idem::DEFAULT_POISON_LIMIT, global = true)]
    poison_limit: u32,
    /// Where messages come from: RabbitMQ, or the in-memory transport (demo only).
    #[arg(long, value_enum, env = "ORDERS_TRANSPORT", default_value_t = TransportKind::Auto, global = true)]
    transport: TransportKind,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TransportKind {
    /// RabbitMQ if reachable, else in memory (demo only).
    Auto,
    /// RabbitMQ.
    Rabbitmq,
    /// In memory, nothing installed (demo only).
    Memory,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .init();
    let cli = Cli::parse();
    let settings = &cli.settings;
    anyhow::ensure!(
        settings.concurrency > 0,
        "ORDERS_CONCURRENCY must be at least 1"
    );
    let db = Db::connect(&settings.database_url, settings.concurrency).await?;
    match cli.command {
        Some(Command::Consume { metrics_addr }) => consume(settings, &db, metrics_addr).await,
        Some(Command::Demo(options)) => demo::run(settings, &db, &options).await,
        None => demo::run(settings, &db, &demo::Options::default()).await,
    }
}

async fn consume(
    settings: &Settings,
    db: &Db,
    metrics_addr: Option<std::net::SocketAddr>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        settings.transport != TransportKind::Memory,
        "`consume` needs RabbitMQ; the in-memory transport is for `demo`"
    );
    let metrics = match metrics_addr {
        Some(_) => Some(
            metrics_exporter_prometheus::PrometheusBuilder::new()
                .install_recorder()
                .context("cannot install the Prometheus recorder")?,
        ),
        None => None,
    };
    let transport = RabbitTransport::new(RabbitConfig::new(&settings.amqp_url));
    let runtime = runtime(settings, db).transport(transport).build()?;
    if let (Some(addr), Some(metrics)) = (metrics_addr, metrics) {
        http::serve(addr, metrics, runtime.health())
            .await
            .with_context(|| format!("cannot serve at --metrics-addr {addr}"))?;
    }
    tracing::info!(queue = settings.queue, "consuming orders");
    runtime.run_until(shutdown_signal()).await?;
    Ok(())
}

/// The runtime for the orders handler on `db`, without a transport yet.
fn runtime(settings: &Settings, db: &Db) -> RuntimeBuilder {
    let builder = Runtime::builder()
        .handlers(["orders"])
        .handler_queue("orders", &settings.queue)
        .poison_limit(settings.poison_limit);
    // Batch mode keeps its defaults: one batch in flight, prefetch twice the batch.
    let builder = match settings.batch {
        0 => builder
            .concurrency(settings.concurrency)
            .prefetch(u16::try_from(settings.concurrency * 4).unwrap_or(u16::MAX)),
        size => builder.batch(size),
    };
    match db {
        Db::Sqlite(pool) => builder.store(SqliteInbox::new(pool.clone())),
        Db::Postgres(pool) => builder.store(PgInbox::new(pool.clone())),
        Db::MySql(pool) => builder.store(MySqlInbox::new(pool.clone())),
    }
}

/// RabbitMQ or the in-memory transport, as configured and reachable.
enum Broker {
    Rabbit(Box<(RabbitTransport, Publisher)>),
    Memory(MemoryTransport),
}

impl Broker {
    async fn open(settings: &Settings) -> anyhow::Result<Self> {
        if settings.transport == TransportKind::Memory {
            return Ok(Self::Memory(MemoryTransport::new()));
        }
        let config = RabbitConfig::new(&settings.amqp_url);
        match Publisher::connect(&config).await {
            Ok(publisher) => Ok(Self::Rabbit(Box::new((
                RabbitTransport::new(config),
                publisher,
            )))),
            Err(e) if settings.transport == TransportKind::Auto => {
                eprintln!(
                    "RabbitMQ is not reachable at AMQP_URL ({e}).\n\
                     Running the demo on the in-memory transport instead (--transport memory);\n\
                     start RabbitMQ (`rabbitmq-server -detached`, or `docker compose up -d`) to use it."
                );
                Ok(Self::Memory(MemoryTransport::new()))
            }
            Err(e) => Err(e).context(
                "RabbitMQ is not reachable at AMQP_URL; start it or pass --transport memory",
            ),
        }
    }
}

async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut terminate = match tokio::signal::unix::signal(
            tokio::signal::unix::SignalKind::terminate(),
        ) {
            Ok(signal) => signal,
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the consumer");
                let _ = interrupt.await;
                return;
            }
        };
        tokio::select! {
            _ = interrupt => {}
            _ = terminate.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}

/// The database holding the inbox and the orders.
pub enum Db {
    /// The embedded default.
    Sqlite(sqlx::SqlitePool),
    /// A PostgreSQL server.
    Postgres(sqlx::PgPool),
    /// A MySQL or MariaDB server.
    MySql(sqlx::MySqlPool),
}

impl Db {
    /// Connects, creates the example's tables and migrates the inbox.
    async fn connect(url: &str, concurrency: usize) -> anyhow::Result<Self> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(u32::try_from(concurrency + 2).unwrap_or(u32::MAX))
                .connect(url)
                .await
                .with_context(|| {
                    format!(
                        "cannot connect to PostgreSQL at DATABASE_URL ({})",
                        redact_url(url)
                    )
                })?;
            let mut tx = pool.begin().await?;
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.orders.schema'))::text")
                .execute(&mut *tx)
                .await?;
            for statement in handlers::SCHEMA {
                sqlx::query(statement).execute(&mut *tx).await?;
            }
            tx.commit().await?;
            PgInbox::new(pool.clone()).migrate().await?;
            Ok(Self::Postgres(pool))
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            let url = url.replacen("mariadb://", "mysql://", 1);
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(u32::try_from(concurrency + 2).unwrap_or(u32::MAX))
                .connect(&url)
                .await
                .with_context(|| {
                    format!(
                        "cannot connect to MySQL/MariaDB at DATABASE_URL ({})",
                        redact_url(&url)
                    )
                })?;
            // MySQL runs DDL outside transactions; IF NOT EXISTS makes concurrent starts safe.
            for statement in handlers::MYSQL_SCHEMA {
                sqlx::query(statement).execute(&pool).await?;
            }
            MySqlInbox::new(pool.clone()).migrate().await?;
            Ok(Self::MySql(pool))
        } else if url.starts_with("sqlite:") || !url.contains("://") {
            let pool = idem::sql::sqlite::pool(url)
                .await
                .with_context(|| format!("cannot open SQLite database DATABASE_URL ({url})"))?;
            SqliteInbox::new(pool.clone()).migrate().await?;
            for statement in handlers::SCHEMA {
                sqlx::query(statement).execute(&pool).await?;
            }
            Ok(Self::Sqlite(pool))
        } else {
            anyhow::bail!(
                "DATABASE_URL must be a sqlite: URL, a file path, a postgres:// or a mysql:// URL, got {}",
                redact_url(url)
            )
        }
    }

    /// Each balance whose customer starts with `prefix`, and the number of orders whose id does.
    async fn books(
        &self,
        customer_prefix: &str,
        order_prefix: &str,
    ) -> anyhow::Result<(Vec<(String, i64)>, i64)> {
        const BALANCES: &str = "SELECT customer, cents FROM balances WHERE customer LIKE $1";
        const ORDERS: &str = "SELECT count(*) FROM orders WHERE order_id LIKE $1";
        const MYSQL_BALANCES: &str = "SELECT customer, cents FROM balances WHERE customer LIKE ?";
        const MYSQL_ORDERS: &str = "SELECT count(*) FROM orders WHERE order_id LIKE ?";
        let (customers, orders) = (format!("{customer_prefix}%"), format!("{order_prefix}%"));
        Ok(match self {
            Self::Sqlite(pool) => (
                sqlx::query_as(BALANCES)
                    .bind(&customers)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_scalar(ORDERS)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
            ),
            Self::Postgres(pool) => (
                sqlx::query_as(BALANCES)
                    .bind(&customers)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_scalar(ORDERS)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
            ),
            Self::MySql(pool) => (
                sqlx::query_as(MYSQL_BALANCES)
                    .bind(&customers)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_scalar(MYSQL_ORDERS)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
            ),
        })
    }
}
