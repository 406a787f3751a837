//! The orders example: an order consumer whose non-idempotent writes (an order row and a
//! balance increment) are made effectively exactly once by idem, and which stages an
//! `OrderBilled` event in its transaction (the outbox); a shipping consumer that books each
//! billed order's shipment (`shipping.rs`), the second hop; and a status consumer that applies
//! each order's status updates in order (`status.rs`).
//!
//! - `cargo run --example orders` (or `-- demo`): publishes a few thousand orders with ~20%
//!   duplicates (some concurrent), malformed messages and a reused id, consumes them, and checks
//!   that every balance adds up. Uses NATS JetStream when `NATS_URL` is set (or the broker URL
//!   is a `nats://` one), else RabbitMQ when it is reachable, the in-memory transport
//!   otherwise; the embedded SQLite file unless `DATABASE_URL` names PostgreSQL or MySQL/MariaDB.
//! - `cargo run --example orders -- consume`: the long-running consumer.
//!
//! `--help` lists the configuration; every setting can come from the environment
//! (`ORDERS_BATCH=200` tries batch mode; `ORDERS_BATCH_HANDLER=1` books each batch set-based
//! with the batch handler of `batch.rs`).

mod batch;
mod db;
mod demo;
mod handlers;
mod http;
mod parked;
mod shipping;
mod status;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use db::Db;
use idem::nats::{NatsConfig, NatsTransport};
use idem::rabbitmq::{Publisher, QueueType, RabbitConfig, RabbitTransport};
use idem::sql::{MySqlInbox, PgInbox, SqliteInbox};
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
    /// The RabbitMQ broker, or several separated by commas (failover order).
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        global = true
    )]
    amqp_url: String,
    /// A NATS server with JetStream: when set, the example runs on NATS instead of RabbitMQ
    /// (as it does when the broker URL above is a `nats://` one).
    #[arg(long, env = "NATS_URL", global = true)]
    nats_url: Option<String>,
    /// Where the inbox and the orders live: a `sqlite:` URL or file path (embedded, the
    /// default), a `postgres://` or a `mysql://` (MySQL or MariaDB) URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "sqlite://idem-orders.db",
        global = true
    )]
    database_url: String,
    /// The queue to consume (its dead letters go to `<queue>.dlq`); status updates come
    /// through the exchange `<queue>.status`.
    #[arg(long, env = "ORDERS_QUEUE", default_value = "orders", global = true)]
    queue: String,
    /// The type of the example's queues.
    #[arg(long, value_enum, env = "ORDERS_QUEUE_TYPE", default_value_t = QueueKind::Classic, global = true)]
    queue_type: QueueKind,
    /// Partition queues of the status updates (`<queue>.status.p0` …), each consumed in order
    /// [default: 4 when RabbitMQ's consistent-hash plugin is enabled, else 1, which needs no
    /// plugin].
    #[arg(
        long = "status-partitions",
        env = "ORDERS_STATUS_PARTITIONS",
        global = true
    )]
    partitions_wanted: Option<usize>,
    /// The partitions in use, once the broker was asked ([`status_partitions`]).
    #[arg(skip)]
    status_partitions: usize,
    /// Orders (and status updates) processed at once, one transaction each (orders: ignored
    /// in batch mode).
    #[arg(long, env = "ORDERS_CONCURRENCY", default_value_t = 8, global = true)]
    concurrency: usize,
    /// Batch mode: up to this many orders per transaction (0: one transaction per order;
    /// with the batch handler, 0 means 200).
    #[arg(long, env = "ORDERS_BATCH", default_value_t = 0, global = true)]
    batch: usize,
    /// Book orders with the batch handler (`batch.rs`): one multi-row insert and one upsert
    /// per batch instead of two statements per order. The same books, the same inbox rows.
    #[arg(long, env = "ORDERS_BATCH_HANDLER", global = true, value_parser = clap::builder::BoolishValueParser::new(), default_value = "false")]
    batch_handler: bool,
    /// Deliveries without a settlement (the consumer died on the message, or lost its
    /// connection) before a message is dead-lettered as `poison`.
    #[arg(long, env = "ORDERS_POISON_LIMIT", default_value_t = idem::DEFAULT_POISON_LIMIT, global = true)]
    poison_limit: u32,
    /// Where messages come from: NATS JetStream, RabbitMQ, or the in-memory transport (demo
    /// only). `auto`: NATS when `NATS_URL` is set, else RabbitMQ if reachable, else in memory.
    #[arg(long, value_enum, env = "ORDERS_TRANSPORT", default_value_t = TransportKind::Auto, global = true)]
    transport: TransportKind,
    /// How long to wait at start-up for a database or a broker that cannot be reached yet
    /// (the runtime's `start_deadline`), in seconds.
    #[arg(long, env = "ORDERS_START_DEADLINE_SECS", default_value_t = idem::DEFAULT_START_DEADLINE.as_secs(), global = true)]
    start_deadline_secs: u64,
    /// NATS only: how long JetStream waits for a delivery's settlement before it delivers it
    /// again, in seconds (a consumer that died on a message held it until then).
    #[arg(long, env = "ORDERS_ACK_WAIT_SECS", default_value_t = idem::nats::DEFAULT_ACK_WAIT.as_secs(), global = true)]
    ack_wait_secs: u64,
    /// NATS only: on a JetStream cluster, how many servers hold each stream (3 to survive the
    /// loss of one server of three).
    #[arg(long, env = "ORDERS_NATS_REPLICAS", default_value_t = 1, global = true)]
    nats_replicas: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum QueueKind {
    /// Classic queues (one node).
    Classic,
    /// Quorum queues (replicated across a cluster).
    Quorum,
}

impl Settings {
    /// The RabbitMQ configuration: `AMQP_URL` and the queue type.
    fn rabbit(&self) -> RabbitConfig {
        let queue_type = match self.queue_type {
            QueueKind::Classic => QueueType::Classic,
            QueueKind::Quorum => QueueType::Quorum,
        };
        RabbitConfig::new(&self.amqp_url).queue_type(queue_type)
    }

    /// The NATS server to run on, when the settings choose NATS: `NATS_URL`, or a `nats://`
    /// broker URL.
    fn nats(&self) -> Option<NatsConfig> {
        let names_nats =
            idem::transport::Broker::of_url(&self.amqp_url) == Ok(idem::transport::Broker::Nats);
        let url = match (&self.nats_url, names_nats) {
            (Some(url), _) => url.clone(),
            (None, true) => self.amqp_url.clone(),
            (None, false) if self.transport == TransportKind::Nats => {
                "nats://127.0.0.1:4222".to_owned()
            }
            (None, false) => return None,
        };
        match self.transport {
            TransportKind::Auto | TransportKind::Nats => Some(
                NatsConfig::new(url)
                    .ack_wait(std::time::Duration::from_secs(self.ack_wait_secs))
                    .replicas(self.nats_replicas),
            ),
            TransportKind::Rabbitmq | TransportKind::Memory => None,
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum TransportKind {
    /// RabbitMQ if reachable, else in memory (demo only).
    Auto,
    /// RabbitMQ.
    Rabbitmq,
    /// NATS JetStream (`NATS_URL`, default nats://127.0.0.1:4222).
    Nats,
    /// In memory, nothing installed (demo only).
    Memory,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            // lapin logs every connection the broker closes as an error; idem says what
            // it means, and the probe for the consistent-hash plugin closes one on purpose.
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "warn,lapin=off".into()),
        )
        .init();
    let mut cli = Cli::parse();
    anyhow::ensure!(
        cli.settings.concurrency > 0,
        "ORDERS_CONCURRENCY must be at least 1"
    );
    anyhow::ensure!(
        cli.settings.ack_wait_secs > 0,
        "ORDERS_ACK_WAIT_SECS must be at least 1"
    );
    // Without a subcommand the demo runs, its options read from the environment: a wrong
    // value stops it here, before it connects.
    let command = match cli.command {
        Some(command) => command,
        None => Command::Demo(
            demo::Options::from_env()
                .context("the demo's settings (ORDERS_COUNT, ORDERS_DUP_RATE)")?,
        ),
    };
    cli.settings.status_partitions = status_partitions(&cli.settings).await?;
    let settings = &cli.settings;
    let db = connect_patiently(settings).await?;
    match command {
        Command::Consume { metrics_addr } => consume(settings, &db, metrics_addr).await,
        Command::Demo(options) => demo::run(settings, &db, &options).await,
    }
}

async fn consume(
    settings: &Settings,
    db: &Db,
    metrics_addr: Option<std::net::SocketAddr>,
) -> anyhow::Result<()> {
    anyhow::ensure!(
        settings.transport != TransportKind::Memory,
        "`consume` needs a broker; the in-memory transport is for `demo`"
    );
    let metrics = match metrics_addr {
        Some(_) => Some(
            idem::telemetry::prometheus()
                .and_then(|builder| builder.install_recorder())
                .context("cannot install the Prometheus recorder")?,
        ),
        None => None,
    };
    let builder = runtime(settings, db);
    let runtime = match settings.nats() {
        Some(nats) => builder.transport(NatsTransport::new(nats)),
        None => builder.transport(RabbitTransport::new(settings.rabbit())),
    }
    .build()?;
    if let (Some(addr), Some(metrics)) = (metrics_addr, metrics) {
        http::serve(addr, metrics, runtime.health())
            .await
            .with_context(|| format!("cannot serve at --metrics-addr {addr}"))?;
    }
    tracing::info!(queue = settings.queue, "consuming orders");
    runtime.run_until(idem::shutdown_signal()).await?;
    Ok(())
}

/// Connects to the database and sets up its tables, waiting with backoff, up to the start
/// deadline (`--start-deadline-secs`, 30 s), while the server cannot be reached or is
/// restarting: as the runtime waits for its inbox. Any other failure (a wrong URL,
/// credentials, a schema error) ends the start at once.
async fn connect_patiently(settings: &Settings) -> anyhow::Result<Db> {
    let patience = std::time::Duration::from_secs(settings.start_deadline_secs);
    let deadline = tokio::time::Instant::now() + patience;
    let mut backoff = std::time::Duration::from_millis(100);
    loop {
        // One attempt waits for the pool's first connection up to the deadline, no longer.
        let attempt = tokio::time::timeout_at(
            deadline,
            Db::connect(&settings.database_url, settings.concurrency),
        );
        let Ok(connected) = attempt.await else {
            anyhow::bail!(
                "cannot reach the database at DATABASE_URL ({}) within {} s (--start-deadline-secs)",
                idem::telemetry::redact_url(&settings.database_url),
                patience.as_secs()
            );
        };
        match connected {
            Ok(db) => return Ok(db),
            Err(e) if unreachable(&e) && tokio::time::Instant::now() + backoff < deadline => {
                tracing::warn!(error = %e, retry_in = ?backoff, "the database cannot be reached yet; waiting");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(std::time::Duration::from_secs(5));
            }
            Err(e) => return Err(e),
        }
    }
}

/// Whether `error` says the database cannot be reached or is restarting (it may answer soon).
fn unreachable(error: &anyhow::Error) -> bool {
    error
        .chain()
        .any(|cause| match cause.downcast_ref::<sqlx::Error>() {
            // A server that closes the connection mid-handshake (it is going down, or a proxy in
            // front of it is) answers with garbage: a protocol error, as transient as the rest.
            Some(
                sqlx::Error::Io(_)
                | sqlx::Error::PoolTimedOut
                | sqlx::Error::Tls(_)
                | sqlx::Error::Protocol(_),
            ) => true,
            Some(sqlx::Error::Database(db)) => db
                .code()
                .is_some_and(|code| code.starts_with("57") || code.starts_with("08")),
            _ => false,
        })
}

/// Status partitions when the broker has the consistent-hash exchange type.
const DEFAULT_PARTITIONS: usize = 4;

/// How many partitions the status updates run on: `ORDERS_STATUS_PARTITIONS`, else 4 when
/// RabbitMQ has the consistent-hash plugin, else 1 (one ordered queue behind a fanout
/// exchange, which needs no plugin), said in one line. More than one without the plugin is an
/// error naming both fixes.
async fn status_partitions(settings: &Settings) -> anyhow::Result<usize> {
    let wanted = settings.partitions_wanted;
    if let Some(n) = wanted {
        anyhow::ensure!(
            (1..=idem::MAX_PARTITIONS).contains(&n),
            "ORDERS_STATUS_PARTITIONS must be 1 to {}",
            idem::MAX_PARTITIONS
        );
    }
    // The in-memory transport and NATS route partitions themselves: no plugin to ask for.
    if settings.transport == TransportKind::Memory || settings.nats().is_some() || wanted == Some(1)
    {
        return Ok(wanted.unwrap_or(DEFAULT_PARTITIONS));
    }
    match idem::rabbitmq::consistent_hash_available(&settings.rabbit()).await {
        // Unreachable: the broker's own checks say what is wrong (or the demo runs in memory).
        Err(_) | Ok(true) => Ok(wanted.unwrap_or(DEFAULT_PARTITIONS)),
        Ok(false) => match wanted {
            Some(n) => anyhow::bail!(
                "ORDERS_STATUS_PARTITIONS={n} needs RabbitMQ's consistent-hash exchange: enable \
                 the plugin (`rabbitmq-plugins enable rabbitmq_consistent_hash_exchange`) or set \
                 ORDERS_STATUS_PARTITIONS=1"
            ),
            None => {
                eprintln!(
                    "RabbitMQ's consistent-hash plugin is not enabled: status updates run in order \
                     on one partition (`rabbitmq-plugins enable rabbitmq_consistent_hash_exchange` \
                     spreads them over {DEFAULT_PARTITIONS})"
                );
                Ok(1)
            }
        },
    }
}

/// The batch size the batch handler gets unless `ORDERS_BATCH` says.
const DEFAULT_HANDLER_BATCH: usize = 200;

/// The runtime for the orders and status handlers on `db`, without a transport yet.
fn runtime(settings: &Settings, db: &Db) -> RuntimeBuilder {
    // Two functions book orders as consumer `orders` on each database (one order at a time,
    // or a batch at once): the runtime is given the one to run by its name.
    let orders = match (db, settings.batch_handler) {
        (Db::Sqlite(_), false) => "place_order_sqlite",
        (Db::Postgres(_), false) => "place_order_postgres",
        (Db::MySql(_), false) => "place_order_mysql",
        (Db::Sqlite(_), true) => "place_orders_batch_sqlite",
        (Db::Postgres(_), true) => "place_orders_batch_postgres",
        (Db::MySql(_), true) => "place_orders_batch_mysql",
    };
    let builder = Runtime::builder()
        .handlers([orders, shipping::function(db), status::CONSUMER])
        .handler_queue("orders", &settings.queue)
        .handler_queue(
            shipping::CONSUMER,
            handlers::Billing::of(&settings.queue).queue,
        )
        .handler_concurrency(shipping::CONSUMER, settings.concurrency)
        .state(handlers::Billing::of(&settings.queue))
        .handler_queue(status::CONSUMER, status::exchange(&settings.queue))
        .ordered(status::CONSUMER, settings.status_partitions)
        .handler_concurrency(status::CONSUMER, settings.concurrency)
        .poison_limit(settings.poison_limit)
        .start_deadline(std::time::Duration::from_secs(settings.start_deadline_secs));
    // Batch mode (orders only; status updates run one transaction each, in order) keeps its
    // defaults: one batch in flight, prefetch three times the batch.
    let batch = match (settings.batch, settings.batch_handler) {
        (0, true) => DEFAULT_HANDLER_BATCH,
        (size, _) => size,
    };
    let builder = match batch {
        0 => builder
            .concurrency(settings.concurrency)
            .prefetch(u16::try_from(settings.concurrency * 4).unwrap_or(u16::MAX)),
        size => builder.handler_batch("orders", size),
    };
    match db {
        Db::Sqlite(pool) => builder.store(SqliteInbox::new(pool.clone())),
        Db::Postgres(pool) => builder.store(PgInbox::new(pool.clone())),
        Db::MySql(pool) => builder.store(MySqlInbox::new(pool.clone())),
    }
}

/// NATS, RabbitMQ or the in-memory transport, as configured and reachable.
enum Broker {
    Nats(NatsTransport),
    Rabbit(Box<(RabbitTransport, Publisher)>),
    Memory(MemoryTransport),
}

impl Broker {
    async fn open(settings: &Settings) -> anyhow::Result<Self> {
        if settings.transport == TransportKind::Memory {
            return Ok(Self::Memory(MemoryTransport::new()));
        }
        if let Some(config) = settings.nats() {
            let redacted = config.redacted_url();
            let transport = NatsTransport::new(config);
            // Connects (declaring nothing yet): a server that is not there fails here.
            idem::transport::Transport::declare(&transport, &[])
                .await
                .with_context(|| {
                    format!(
                        "NATS is not reachable at {redacted} (NATS_URL); start it with JetStream \
                         (`nats-server -js`, or `docker compose up -d nats`), or unset NATS_URL"
                    )
                })?;
            return Ok(Self::Nats(transport));
        }
        let config = settings.rabbit();
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
