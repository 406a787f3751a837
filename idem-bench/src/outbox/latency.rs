//! The dispatch latency at a steady rate: orders published at `--rate` for `--seconds`, each
//! consumed by a handler that stages one event; from its commit until the broker confirmed the
//! event. Against a handwritten lapin + sqlx consumer that publishes its event itself right
//! after its commit and awaits the confirm (no outbox: the floor any post-commit publish
//! pays), run alternately under the same feed.

use super::{BILLED, ORDERS, OutboxBench, billing, outbox_rows, reset};
use crate::workload::Order;
use anyhow::{Context as _, bail};
use futures_util::StreamExt;
use idem::Envelope;
use idem::rabbitmq::{Publisher, RabbitConfig};
use idem::sql::PgInbox;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use sqlx::{Connection as _, PgConnection};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The runtime's dispatch histogram.
const HISTOGRAM: &str = "idem_outbox_dispatch_seconds";

/// Creates the handwritten consumer's inbox, `bench_outbox_hand`: the narrow row a lean
/// consumer writes per message.
pub(super) async fn create_hand_inbox(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_outbox_hand (consumer TEXT NOT NULL, key TEXT NOT NULL, \
         received_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (consumer, key))",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// The handwritten consumer's workers (the runtime's default concurrency) and prefetch (its
/// default prefetch).
const WORKERS: usize = 8;
const PREFETCH: u16 = 32;

/// The recorder, with the dispatch histogram in fine buckets (¼ ms up to 20 ms) so that each
/// run's quantiles can be read from the difference of two scrapes.
pub(super) fn recorder() -> anyhow::Result<PrometheusHandle> {
    let mut bounds: Vec<f64> = (1..=80).map(|n| f64::from(n) * 0.000_25).collect();
    bounds.extend([
        0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.0, 5.0,
    ]);
    PrometheusBuilder::new()
        .set_buckets_for_metric(Matcher::Full(HISTOGRAM.to_owned()), &bounds)?
        .install_recorder()
        .context("installing the metrics recorder")
}

/// p50, p99 and the largest of one run, in milliseconds.
#[derive(Debug, Clone, Copy)]
struct Quantiles {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

/// Runs the runtime and the handwritten consumer alternately, `b.runs` times each, and prints
/// each run's quantiles and their medians.
pub(super) async fn latency(
    b: &OutboxBench,
    pool: &sqlx::PgPool,
    inbox: &PgInbox,
    rabbit: &RabbitConfig,
    recorder: &PrometheusHandle,
) -> anyhow::Result<()> {
    let (mut with_idem, mut by_hand) = (Vec::new(), Vec::new());
    for run in 1..=b.runs {
        let idem = idem_run(b, pool, inbox, rabbit, recorder).await?;
        let hand = handwritten_run(b, pool, rabbit).await?;
        eprintln!(
            "latency run {run}: idem p50 {:.2} ms p90 {:.2} ms p99 {:.2} ms max {:.1} ms; handwritten p50 {:.2} ms p90 {:.2} ms p99 {:.2} ms max {:.1} ms",
            idem.p50, idem.p90, idem.p99, idem.max, hand.p50, hand.p90, hand.p99, hand.max
        );
        with_idem.push(idem);
        by_hand.push(hand);
    }
    let median_of =
        |runs: &[Quantiles], f: fn(&Quantiles) -> f64| super::median(runs.iter().map(f).collect());
    println!(
        "outbox dispatch latency (commit → confirm) at {} msgs/s, {} s per run, medians of {}: idem p50 {:.2} ms, p99 {:.2} ms; handwritten publish-after-commit p50 {:.2} ms, p99 {:.2} ms",
        b.rate,
        b.seconds,
        b.runs,
        median_of(&with_idem, |q| q.p50),
        median_of(&with_idem, |q| q.p99),
        median_of(&by_hand, |q| q.p50),
        median_of(&by_hand, |q| q.p99),
    );
    println!(
        "  per run, idem p99: {}; handwritten p99: {}",
        listed(&with_idem),
        listed(&by_hand)
    );
    Ok(())
}

fn listed(runs: &[Quantiles]) -> String {
    let p99: Vec<String> = runs.iter().map(|q| format!("{:.2}", q.p99)).collect();
    p99.join(", ")
}

/// One run of the runtime: its quantiles from the histogram's buckets.
async fn idem_run(
    b: &OutboxBench,
    pool: &sqlx::PgPool,
    inbox: &PgInbox,
    rabbit: &RabbitConfig,
    recorder: &PrometheusHandle,
) -> anyhow::Result<Quantiles> {
    reset(pool, &b.amqp_url).await?;
    let before = buckets(recorder);
    let runtime = billing(inbox, rabbit).build()?;
    let stats = runtime.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));
    let total = feed(b).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while (stats.snapshot().settled() as usize) < total || outbox_rows(pool).await? > 0 {
        if Instant::now() > deadline {
            bail!("the latency run did not drain: {:?}", stats.snapshot());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    task.await??;
    super::check_queue(&b.amqp_url, total).await?;
    let after = buckets(recorder);
    let counts: Vec<(f64, u64)> = after
        .iter()
        .map(|(bound, n)| {
            let earlier = before
                .iter()
                .find(|(b, _)| b == bound)
                .map_or(0, |(_, n)| *n);
            (*bound, n - earlier)
        })
        .collect();
    Ok(Quantiles {
        p50: from_buckets(&counts, 0.5),
        p90: from_buckets(&counts, 0.9),
        p99: from_buckets(&counts, 0.99),
        max: from_buckets(&counts, 1.0),
    })
}

/// Publishes `b.rate` orders a second for `b.seconds` to the orders queue; returns how many.
async fn feed(b: &OutboxBench) -> anyhow::Result<usize> {
    let publisher = Publisher::connect(&RabbitConfig::new(&b.amqp_url)).await?;
    let total = (b.rate * b.seconds) as usize;
    let mut tick = tokio::time::interval(Duration::from_micros(1_000_000 / b.rate.max(1)));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Burst);
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
    Ok(total)
}

/// The cumulative bucket counts of the dispatch histogram: `(upper bound, count)`.
fn buckets(recorder: &PrometheusHandle) -> Vec<(f64, u64)> {
    let prefix = format!("{HISTOGRAM}_bucket{{store=\"postgres\",le=\"");
    recorder
        .render()
        .lines()
        .filter_map(|line| {
            let rest = line.strip_prefix(prefix.as_str())?;
            let (bound, count) = rest.split_once("\"} ")?;
            Some((bound.parse().ok()?, count.trim().parse().ok()?))
        })
        .filter(|(bound, _): &(f64, u64)| bound.is_finite())
        .collect()
}

/// Quantile `q` of cumulative bucket counts, interpolated within its bucket, in milliseconds.
fn from_buckets(counts: &[(f64, u64)], q: f64) -> f64 {
    let Some(&(_, total)) = counts.last() else {
        return f64::NAN;
    };
    let rank = (q * total as f64).ceil().max(1.0) as u64;
    let mut lower = (0.0, 0);
    for &(bound, count) in counts {
        if count >= rank {
            let (low, below) = lower;
            let share = (rank - below) as f64 / (count - below).max(1) as f64;
            return (low + (bound - low) * share) * 1000.0;
        }
        lower = (bound, count);
    }
    f64::NAN
}

/// One run of the handwritten consumer: `WORKERS` tasks, each holding its own connection,
/// taking deliveries from one consumer; per order an inbox row in its own transaction, then,
/// after the commit, the event published and its confirm awaited, then the ack.
async fn handwritten_run(
    b: &OutboxBench,
    pool: &sqlx::PgPool,
    rabbit: &RabbitConfig,
) -> anyhow::Result<Quantiles> {
    reset(pool, &b.amqp_url).await?;
    let total = (b.rate * b.seconds) as usize;
    let connection =
        lapin::Connection::connect(&b.amqp_url, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            ORDERS.into(),
            "handwritten".into(),
            BasicConsumeOptions::default(),
            Default::default(),
        )
        .await?;
    let consumer = Arc::new(tokio::sync::Mutex::new(consumer.take(total)));
    let publisher = Arc::new(Publisher::connect(rabbit).await?);
    let took = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..WORKERS {
        let mut db = PgConnection::connect(&b.database_url).await?;
        let (consumer, publisher, took) = (consumer.clone(), publisher.clone(), took.clone());
        workers.spawn(async move {
            loop {
                let next = consumer.lock().await.next().await;
                let Some(delivery) = next else {
                    return anyhow::Ok(());
                };
                let delivery = delivery?;
                let order: Order = serde_json::from_slice(&delivery.data)?;
                let mut tx = db.begin().await?;
                let claimed = sqlx::query(
                    "INSERT INTO bench_outbox_hand (consumer, key) VALUES ('handwritten', $1) \
                     ON CONFLICT DO NOTHING",
                )
                .bind(&order.order_id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                tx.commit().await?;
                if claimed == 1 {
                    let committed = Instant::now();
                    let event = Envelope::new(serde_json::to_vec(&order)?)
                        .with_message_id(format!("billed-{}", order.order_id));
                    publisher.publish("", BILLED, &event).await?;
                    let elapsed = committed.elapsed();
                    took.lock()
                        .map_err(|_| anyhow::anyhow!("poisoned"))?
                        .push(elapsed);
                }
                delivery.ack(BasicAckOptions::default()).await?;
            }
        });
    }
    let fed = feed(b).await?;
    while let Some(done) = workers.join_next().await {
        done??;
    }
    let _ = connection.close(200, "done".into()).await;
    super::check_queue(&b.amqp_url, fed).await?;
    let mut took = std::mem::take(&mut *took.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    took.sort();
    let at = |q: f64| {
        let rank = ((q * took.len() as f64).ceil() as usize).clamp(1, took.len().max(1));
        took.get(rank - 1)
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
    };
    Ok(Quantiles {
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
        max: at(1.0),
    })
}
