//! `idem-bench steady-sweep`: idem's batch handler under a full inflow for minutes, its inbox
//! rows expiring after a short retention, with the runtime's sweeper at work or without one,
//! alternating: the throughput of each, and the expired rows the sweeper leaves, sampled through
//! the run. A publisher keeps the queue topped up beside the consumer, so the inflow is as much
//! as the machine takes.

use crate::with_idem::{CONSUMER, FirstCall, TABLE, inbox};
use crate::workload::{CUSTOMERS, Order, reset};
use anyhow::Context as _;
use idem::rabbitmq::{Publisher, RabbitConfig, RabbitTransport};
use idem::transport::{QueueSpec, Transport};
use sqlx::PgPool;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

/// `idem-bench steady-sweep`.
#[derive(clap::Args, Debug)]
pub struct SteadyBench {
    /// Minutes each run lasts.
    #[arg(long, default_value_t = 10)]
    minutes: u64,
    /// The inbox's retention, in seconds.
    #[arg(long, default_value_t = 60)]
    retention_secs: u64,
    /// Messages per batch of the batch handler.
    #[arg(long, default_value_t = 200)]
    batch: usize,
    /// Runs of each setting, alternating: sweeping, not sweeping, …
    #[arg(long, default_value_t = 1)]
    runs: usize,
    /// Messages the publisher keeps waiting in the queue.
    #[arg(long, default_value_t = 60_000)]
    backlog: u32,
    /// Seconds between two samples.
    #[arg(long, default_value_t = 20)]
    sample_secs: u64,
    /// RabbitMQ.
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

/// The queue of the runs.
const QUEUE: &str = "idem-bench-steady";

/// One sample of a run.
#[derive(Debug, Clone, Copy)]
struct Sample {
    /// Seconds into the run.
    at: f64,
    /// Deliveries processed so far.
    processed: u64,
    /// Inbox rows expired and not yet deleted.
    expired: i64,
    /// Inbox rows.
    rows: i64,
}

/// What one run measured.
struct Measured {
    sweeping: bool,
    samples: Vec<Sample>,
}

impl Measured {
    /// Deliveries per second from the first sample after `from` seconds to the last.
    fn rate_from(&self, from: f64) -> f64 {
        let Some(first) = self.samples.iter().find(|s| s.at >= from) else {
            return 0.0;
        };
        let Some(last) = self.samples.last() else {
            return 0.0;
        };
        (last.processed - first.processed) as f64 / (last.at - first.at).max(1.0)
    }

    /// The expired rows of the samples after `from` seconds: (least, most, last).
    fn expired_from(&self, from: f64) -> (i64, i64, i64) {
        let expired: Vec<i64> = self
            .samples
            .iter()
            .filter(|s| s.at >= from)
            .map(|s| s.expired)
            .collect();
        (
            expired.iter().copied().min().unwrap_or(0),
            expired.iter().copied().max().unwrap_or(0),
            expired.last().copied().unwrap_or(0),
        )
    }
}

/// Runs the benchmark and prints its report.
pub async fn run(b: SteadyBench) -> anyhow::Result<()> {
    let pool = crate::pool(&b.database_url, 24).await?;
    let mut measured = Vec::new();
    for round in 0..b.runs {
        for sweeping in [true, false] {
            eprintln!(
                "run {} of {}: {} for {} min",
                round + 1,
                b.runs,
                if sweeping { "sweeping" } else { "no sweeper" },
                b.minutes
            );
            let samples = one_run(&b, &pool, sweeping, round).await?;
            measured.push(Measured { sweeping, samples });
        }
    }
    report(&b, &measured);
    Ok(())
}

/// One run: the tables emptied, the queue declared and topped up, idem's batch handler consuming
/// with a retention of `b.retention_secs`, its sweeper at work or not; samples every
/// `b.sample_secs`.
async fn one_run(
    b: &SteadyBench,
    pool: &PgPool,
    sweeping: bool,
    round: usize,
) -> anyhow::Result<Vec<Sample>> {
    let retention = Duration::from_secs(b.retention_secs);
    // Retries and the relay's give-up within the retention, as start-up requires of a short
    // one (the workload never fails).
    let store = inbox(pool.clone())?
        .retention(retention)?
        .outbox_give_up(retention / 2);
    let retry = idem::RetryPolicy::new(3, Duration::from_secs(1), 2, retention / 4)?;
    store.migrate().await?;
    reset(pool, TABLE, None).await?;
    let rabbit = RabbitConfig::new(&b.amqp_url);
    let transport = RabbitTransport::new(rabbit.clone());
    let mut spec = QueueSpec::new(QUEUE, CONSUMER);
    spec.retry_delays = retry.delays();
    transport.declare(&[spec]).await?;
    crate::workload::purge(&b.amqp_url, QUEUE).await?;

    let stop = Arc::new(AtomicBool::new(false));
    let publisher = tokio::spawn(top_up(
        rabbit,
        b.amqp_url.clone(),
        b.backlog,
        format!("steady-{round}-{}", u8::from(sweeping)),
        stop.clone(),
    ));
    let mut builder = idem::Runtime::builder()
        .transport(transport)
        .store(store)
        .state(FirstCall::default())
        .handlers(["place_orders"])
        .handler_queue(CONSUMER, QUEUE)
        .retry(retry)
        .batch(b.batch);
    if !sweeping {
        builder = builder.without_sweeper();
    }
    let runtime = builder.build()?;
    let stats = runtime.stats();
    let (stopping, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));
    let started = Instant::now();
    let end = started + Duration::from_secs(b.minutes * 60);
    let mut samples = Vec::new();
    let count =
        format!("SELECT count(*) FILTER (WHERE expires_at < now()), count(*) FROM \"{TABLE}\"");
    while Instant::now() < end {
        tokio::time::sleep(Duration::from_secs(b.sample_secs)).await;
        let (expired, rows): (i64, i64) = sqlx::query_as(sqlx::AssertSqlSafe(count.as_str()))
            .fetch_one(pool)
            .await?;
        let sample = Sample {
            at: started.elapsed().as_secs_f64(),
            processed: stats.snapshot().processed,
            expired,
            rows,
        };
        eprintln!(
            "  {:>5.0} s: {:>9} processed, {:>9} inbox rows, {:>8} expired",
            sample.at, sample.processed, sample.rows, sample.expired
        );
        samples.push(sample);
        if task.is_finished() {
            anyhow::bail!("the runtime stopped early: {:?}", task.await);
        }
    }
    stop.store(true, Ordering::SeqCst);
    publisher.await??;
    let _ = stopping.send(());
    task.await??;
    let seen = stats.snapshot();
    anyhow::ensure!(
        seen.dead_lettered == 0 && seen.retried == 0,
        "unexpected outcomes: {seen:?}"
    );
    Ok(samples)
}

/// Publishes new orders to the queue whenever fewer than `backlog` wait there, until `stop`.
async fn top_up(
    rabbit: RabbitConfig,
    url: String,
    backlog: u32,
    prefix: String,
    stop: Arc<AtomicBool>,
) -> anyhow::Result<()> {
    let publisher = Publisher::connect(&rabbit)
        .await
        .context("the benchmark's publisher")?;
    let mut n: u64 = 0;
    while !stop.load(Ordering::SeqCst) {
        if crate::workload::left_in_queue(&url, QUEUE).await? >= backlog {
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        for _ in 0..5_000 {
            let order = Order {
                order_id: format!("{prefix}-{n:012}"),
                customer: format!("customer-{:04}", n as usize % CUSTOMERS),
                amount_cents: 1,
            };
            n += 1;
            let message = idem::Envelope::new(serde_json::to_vec(&order)?)
                .with_message_id(order.order_id.as_str())
                .with_content_type("application/json");
            publisher.publish_unconfirmed(QUEUE, &message).await?;
        }
        publisher.wait_for_confirms().await?;
    }
    Ok(())
}

/// Prints, per run, the throughput after the first sweep could have run (retention + 60 s) and
/// the expired rows left over that window; then the throughput with the sweeper against without
/// it.
fn report(b: &SteadyBench, measured: &[Measured]) {
    let from = b.retention_secs as f64 + 60.0;
    println!(
        "\nidem's batch handler (batch {}), retention {} s, {} min per run; from {from:.0} s on:\n",
        b.batch, b.retention_secs, b.minutes
    );
    println!("| sweeper | msgs/s | expired rows left (least–most, last) | inbox rows at the end |");
    println!("|---|---:|---:|---:|");
    for m in measured {
        let (least, most, last) = m.expired_from(from);
        println!(
            "| {} | {:.0} | {least}–{most}, {last} | {} |",
            if m.sweeping { "at work" } else { "none" },
            m.rate_from(from),
            m.samples.last().map_or(0, |s| s.rows)
        );
    }
    let mean = |sweeping: bool| {
        let rates: Vec<f64> = measured
            .iter()
            .filter(|m| m.sweeping == sweeping)
            .map(|m| m.rate_from(from))
            .collect();
        rates.iter().sum::<f64>() / rates.len().max(1) as f64
    };
    let (with, without) = (mean(true), mean(false));
    if without > 0.0 {
        println!(
            "\nwith the sweeper ÷ without: {:.2} ({with:.0} against {without:.0} msgs/s)",
            with / without
        );
    }
}
