//! `idem-bench outbox`: the outbox on RabbitMQ and PostgreSQL. Its dispatch latency (from the
//! commit until the broker confirmed the staged message) at a steady rate, and the runtime's
//! relay draining a backlog against a raw publish-with-confirms loop of the same messages
//! (pipelined, confirms awaited per 500), run alternately.

mod backlog;
mod handwritten;
mod latency;
mod next_hop;

use crate::workload::Order;
use anyhow::bail;
use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use idem::sql::PgInbox;
use idem::transport::{QueueSpec, Transport};
use idem::{Context, HandlerError, Outgoing, Runtime, RuntimeBuilder, idempotent};

/// Settings of `idem-bench outbox`.
#[derive(clap::Args, Debug, Clone)]
pub struct OutboxBench {
    /// Messages per second of the latency run.
    #[arg(long, default_value_t = 1000)]
    rate: u64,
    /// Seconds of the latency run.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
    /// Rows of the relay's backlog.
    #[arg(long, default_value_t = 100_000)]
    backlog: usize,
    /// Runs of the relay and of the raw loop, alternating (the table shows medians).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Leave the events unconsumed in the latency runs (their queue grows by `rate` messages a
    /// second); by default a consumer takes them as they arrive, as the next hop would.
    #[arg(long)]
    events_unconsumed: bool,
    /// Run idem after the handwritten consumers in each latency run, rather than first.
    #[arg(long)]
    idem_last: bool,
    /// The broker.
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f"
    )]
    amqp_url: String,
    /// The database (PostgreSQL).
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "postgres://postgres@127.0.0.1:5432/test"
    )]
    database_url: String,
}

/// The inbox of the outbox benchmark (its outbox: `bench_outbox_outbox`).
const TABLE: &str = "bench_outbox_inbox";
/// The queue the latency run consumes.
const ORDERS: &str = "idem-bench-outbox-orders";
/// The queue the staged messages go to.
const BILLED: &str = "idem-bench-outbox-billed";

/// Where the handler's events go (runtime state).
struct Billed(String);

/// Stages one event per order, and writes nothing else: the latency run's handler.
#[idempotent(store = Postgres, consumer = "bench.billing", queue = "bench-billing", key = "order.order_id")]
async fn bill(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order: Order,
    ctx: &Context<'_>,
    billed: &Billed,
) -> Result<(), HandlerError> {
    idem::outbox::stage(tx, ctx, Outgoing::to_queue(&billed.0, &order)?).await?;
    Ok(())
}

/// A runtime of the billing handler alone, consuming the orders queue.
fn billing(inbox: &PgInbox, rabbit: &RabbitConfig) -> RuntimeBuilder {
    Runtime::builder()
        .transport(RabbitTransport::new(rabbit.clone()))
        .store(inbox.clone())
        .state(Billed(BILLED.to_owned()))
        .handlers(["bench.billing"])
        .handler_queue("bench.billing", ORDERS)
}

/// Runs both measurements and prints their tables.
pub async fn run(b: OutboxBench) -> anyhow::Result<()> {
    let pool = crate::pool(&b.database_url, 12).await?;
    let inbox = PgInbox::new(pool.clone()).table(TABLE)?;
    inbox.migrate().await?;
    handwritten::create_hand_tables(&pool).await?;
    let rabbit = RabbitConfig::new(&b.amqp_url).connection_name("idem-bench-outbox");
    let transport = RabbitTransport::new(rabbit.clone());
    for queue in [ORDERS, BILLED] {
        let mut spec = QueueSpec::new(queue, "bench.billing");
        spec.retry_delays = idem::RetryPolicy::default().delays();
        transport.declare(&[spec]).await?;
    }
    let metrics = latency::recorder()?;
    latency::latency(&b, &pool, &inbox, &rabbit, &metrics).await?;
    backlog::backlog(&b, &pool, &inbox, &rabbit, &metrics).await
}

fn median(mut values: Vec<f64>) -> f64 {
    values.sort_by(f64::total_cmp);
    values.get(values.len() / 2).copied().unwrap_or(f64::NAN)
}

/// Rows left in the benchmark's outbox.
async fn outbox_rows(pool: &sqlx::PgPool) -> anyhow::Result<i64> {
    Ok(
        sqlx::query_scalar("SELECT count(*) FROM bench_outbox_outbox")
            .fetch_one(pool)
            .await?,
    )
}

/// Empties the benchmark's inbox, outbox and queues.
async fn reset(pool: &sqlx::PgPool, amqp_url: &str) -> anyhow::Result<()> {
    sqlx::query("TRUNCATE bench_outbox_inbox, bench_outbox_outbox, bench_outbox_hand, bench_outbox_hand_outbox")
        .execute(pool)
        .await?;
    let connection =
        lapin::Connection::connect(amqp_url, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    for queue in [ORDERS, BILLED] {
        channel
            .queue_purge(queue.into(), lapin::options::QueuePurgeOptions::default())
            .await?;
    }
    let _ = connection.close(200, "purged".into()).await;
    Ok(())
}

/// Checks a latency run's events: with `b.events_unconsumed`, that the billed queue holds
/// `expected` messages; otherwise that `events` received exactly `expected` distinct ones,
/// and returns their end-to-end quantiles.
async fn check_events(
    b: &OutboxBench,
    events: Option<next_hop::Events>,
    expected: usize,
) -> anyhow::Result<Option<latency::Quantiles>> {
    match events {
        Some(events) => events.finish(expected).await.map(Some),
        None => check_queue(&b.amqp_url, expected).await.map(|()| None),
    }
}

/// Fails unless the billed queue holds `expected` messages.
async fn check_queue(amqp_url: &str, expected: usize) -> anyhow::Result<()> {
    let held = crate::workload::left_in_queue(amqp_url, BILLED).await? as usize;
    if held != expected {
        bail!("{BILLED} holds {held} messages, expected {expected}");
    }
    Ok(())
}
