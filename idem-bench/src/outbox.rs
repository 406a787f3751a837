//! `idem-bench outbox`: the outbox on RabbitMQ and PostgreSQL. Its dispatch latency (from the
//! commit until the broker confirmed the staged message) at a steady rate, and the runtime's
//! relay draining a backlog against a raw publish-with-confirms loop of the same messages
//! (pipelined, confirms awaited per 500), run alternately.

use crate::workload::Order;
use anyhow::{Context as _, bail};
use idem::rabbitmq::{Publisher, RabbitConfig, RabbitTransport};
use idem::sql::PgInbox;
use idem::transport::{QueueSpec, Transport};
use idem::{Context, Envelope, HandlerError, Outgoing, Runtime, RuntimeBuilder, idempotent};
use metrics_exporter_prometheus::PrometheusHandle;
use std::time::{Duration, Instant};

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
    let rabbit = RabbitConfig::new(&b.amqp_url).connection_name("idem-bench-outbox");
    let transport = RabbitTransport::new(rabbit.clone());
    for queue in [ORDERS, BILLED] {
        let mut spec = QueueSpec::new(queue, "bench.billing");
        spec.retry_delays = idem::RetryPolicy::default().delays();
        transport.declare(&[spec]).await?;
    }
    let metrics = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .context("installing the metrics recorder")?;
    latency(&b, &pool, &inbox, &rabbit, &metrics).await?;
    backlog(&b, &pool, &inbox, &rabbit, &metrics).await
}

/// Consumes orders published at `b.rate` per second for `b.seconds`, each staging one event,
/// and reads the dispatch latency's quantiles from the runtime's own histogram.
async fn latency(
    b: &OutboxBench,
    pool: &sqlx::PgPool,
    inbox: &PgInbox,
    rabbit: &RabbitConfig,
    recorder: &PrometheusHandle,
) -> anyhow::Result<()> {
    reset(pool, &b.amqp_url).await?;
    let runtime = billing(inbox, rabbit).build()?;
    let stats = runtime.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));
    let publisher = Publisher::connect(&RabbitConfig::new(&b.amqp_url)).await?;
    let total = (b.rate * b.seconds) as usize;
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / b.rate.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
    let started = Instant::now();
    for n in 0..total {
        tick.tick().await;
        let order = Order {
            order_id: format!("lat-{n}"),
            customer: format!("c{}", n % 50),
            amount_cents: 1,
        };
        let message = Envelope::new(serde_json::to_vec(&order)?).with_message_id(&order.order_id);
        publisher.publish_unconfirmed(ORDERS, &message).await?;
        if n % 100 == 99 {
            publisher.wait_for_confirms().await?;
        }
    }
    publisher.wait_for_confirms().await?;
    let published = started.elapsed();
    let deadline = Instant::now() + Duration::from_secs(120);
    while (stats.snapshot().settled() as usize) < total || outbox_rows(pool).await? > 0 {
        if Instant::now() > deadline {
            bail!("the latency run did not drain: {:?}", stats.snapshot());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    task.await??;
    let scrape = recorder.render();
    let quantile = |q: &str| {
        let series =
            format!("idem_outbox_dispatch_seconds{{store=\"postgres\",quantile=\"{q}\"}} ");
        scrape
            .lines()
            .find_map(|l| l.strip_prefix(series.as_str()))
            .and_then(|v| v.trim().parse::<f64>().ok())
            .map_or(f64::NAN, |s| s * 1000.0)
    };
    let delivered = crate::workload::left_in_queue(&b.amqp_url, BILLED).await?;
    println!(
        "outbox dispatch latency at {} msgs/s ({} orders published in {:.1} s, {} events in {BILLED}): p50 {:.2} ms, p90 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
        b.rate,
        total,
        published.as_secs_f64(),
        delivered,
        quantile("0.5"),
        quantile("0.9"),
        quantile("0.99"),
        quantile("1"),
    );
    Ok(())
}

/// Drains a backlog of `b.backlog` rows, staged outside any handler, with the runtime's own
/// relay, against a raw loop publishing the same messages with confirms, alternately; prints
/// msgs/s of each and their ratio.
async fn backlog(
    b: &OutboxBench,
    pool: &sqlx::PgPool,
    inbox: &PgInbox,
    rabbit: &RabbitConfig,
    metrics: &PrometheusHandle,
) -> anyhow::Result<()> {
    let messages: Vec<Outgoing> = (0..b.backlog)
        .map(|n| {
            let order = Order {
                order_id: format!("o-{n}"),
                customer: format!("c{}", n % 50),
                amount_cents: 1,
            };
            Outgoing::to_queue(BILLED, &order).map(|m| m.with_message_id(format!("o-{n}")))
        })
        .collect::<Result<_, _>>()?;
    let (mut relayed, mut raw) = (Vec::new(), Vec::new());
    for run in 1..=b.runs {
        reset(pool, &b.amqp_url).await?;
        let runtime = billing(inbox, rabbit)
            .relay(Duration::from_millis(500), Duration::ZERO)
            .build()?;
        let health = runtime.health();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(runtime.run_until(async {
            let _ = stopped.await;
        }));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !health.is_consuming() {
            if Instant::now() > deadline {
                bail!("the runtime did not start");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let before = relay_published(metrics);
        let depth = QueueDepth::open(&b.amqp_url, BILLED).await?;
        // Staged in one transaction: its commit wakes the relay (LISTEN/NOTIFY).
        let mut tx = pool.begin().await?;
        for message in &messages {
            inbox.stage(&mut tx, message.clone()).await?;
        }
        tx.commit().await?;
        let started = Instant::now();
        // Done when the last message is confirmed, as for the raw loop: the queue holds them
        // all (a confirm follows the enqueue).
        let deadline = started + Duration::from_secs(300);
        while (depth.count().await? as usize) < b.backlog {
            if Instant::now() > deadline {
                bail!("the relay did not drain the backlog");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let elapsed = started.elapsed();
        // And every row removed.
        while relay_published(metrics) - before < b.backlog as u64 {
            if Instant::now() > deadline {
                bail!("the relay did not remove the rows it published");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = stop.send(());
        task.await??;
        let left = outbox_rows(pool).await?;
        if left > 0 {
            bail!("the relay left {left} rows");
        }
        check_queue(&b.amqp_url, b.backlog).await?;
        relayed.push(b.backlog as f64 / elapsed.as_secs_f64());

        reset(pool, &b.amqp_url).await?;
        let publisher = Publisher::connect(rabbit).await?;
        let started = Instant::now();
        for chunk in messages.chunks(500) {
            for message in chunk {
                publisher
                    .publish_unconfirmed_to(
                        &message.exchange,
                        &message.routing_key,
                        &message.envelope,
                    )
                    .await?;
            }
            publisher.wait_for_confirms().await?;
        }
        let elapsed = started.elapsed();
        check_queue(&b.amqp_url, b.backlog).await?;
        raw.push(b.backlog as f64 / elapsed.as_secs_f64());
        eprintln!(
            "run {run}: relay {:.0} msgs/s, raw publish-with-confirms loop {:.0} msgs/s",
            relayed[run - 1],
            raw[run - 1]
        );
    }
    let (relay, raw) = (median(relayed), median(raw));
    println!(
        "outbox relay draining {} rows: {relay:.0} msgs/s; raw publish-with-confirms loop of the same messages: {raw:.0} msgs/s; ratio {:.2} (medians of {})",
        b.backlog,
        relay / raw,
        b.runs
    );
    Ok(())
}

/// A queue's message count, asked on one channel held open.
struct QueueDepth {
    _connection: lapin::Connection,
    channel: lapin::Channel,
    queue: &'static str,
}

impl QueueDepth {
    async fn open(amqp_url: &str, queue: &'static str) -> anyhow::Result<Self> {
        let connection =
            lapin::Connection::connect(amqp_url, lapin::ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        Ok(Self {
            _connection: connection,
            channel,
            queue,
        })
    }

    async fn count(&self) -> anyhow::Result<u32> {
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = self
            .channel
            .queue_declare(self.queue.into(), passive, Default::default())
            .await?;
        Ok(declared.message_count())
    }
}

/// Rows the runtime's relays published and removed so far (`idem_outbox_published_total`).
fn relay_published(metrics: &PrometheusHandle) -> u64 {
    let series = "idem_outbox_published_total{store=\"postgres\",by=\"relay\"} ";
    metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0)
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
    sqlx::query("TRUNCATE bench_outbox_inbox, bench_outbox_outbox")
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

/// Fails unless the billed queue holds `expected` messages.
async fn check_queue(amqp_url: &str, expected: usize) -> anyhow::Result<()> {
    let held = crate::workload::left_in_queue(amqp_url, BILLED).await? as usize;
    if held != expected {
        bail!("{BILLED} holds {held} messages, expected {expected}");
    }
    Ok(())
}
