//! The dispatch latency at a steady rate: orders published at `--rate` for `--seconds`, each
//! consumed by a handler that stages one event; from its commit until the broker confirmed the
//! event. Against three handwritten lapin + sqlx consumers, run alternately under the same
//! feed: one that publishes its event itself right after its commit and awaits the confirm
//! (no outbox: the floor any post-commit publish pays), one doing the same work as idem's
//! outbox (the event's row staged in the order's transaction, published after the commit,
//! deleted once confirmed, then the ack), and one that also keeps idem's contract of acking
//! without waiting for the dispatch.

use super::handwritten::{HandEvent, handwritten_run};
use super::next_hop::Events;
use super::{ORDERS, OutboxBench, billing, outbox_rows, reset};
use crate::workload::Order;
use anyhow::{Context as _, bail};
use idem::Envelope;
use idem::rabbitmq::{Publisher, RabbitConfig};
use idem::sql::PgInbox;
use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The handwritten consumers run after idem in each run, by the names the output gives them.
const HANDWRITTEN: [(&str, HandEvent); 3] = [
    ("handwritten publish-after-commit", HandEvent::AfterCommit),
    ("handwritten outbox", HandEvent::Outbox),
    ("handwritten outbox acking first", HandEvent::OutboxDetached),
];

/// The runtime's dispatch histogram.
const HISTOGRAM: &str = "idem_outbox_dispatch_seconds";

/// When the feed published each order, by order id.
pub(super) type Sent = Arc<Mutex<HashMap<String, Instant>>>;

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
pub(super) struct Quantiles {
    p50: f64,
    p90: f64,
    p99: f64,
    max: f64,
}

/// Runs the runtime and the handwritten consumers alternately, `b.runs` times each, and
/// prints each run's quantiles and their medians.
pub(super) async fn latency(
    b: &OutboxBench,
    pool: &sqlx::PgPool,
    inbox: &PgInbox,
    rabbit: &RabbitConfig,
    recorder: &PrometheusHandle,
) -> anyhow::Result<()> {
    // By consumer: idem, then the handwritten ones in the order of `HANDWRITTEN`.
    let mut dispatch: [Vec<Quantiles>; 4] = Default::default();
    let mut end_to_end: [Vec<Quantiles>; 4] = Default::default();
    let last = |name: &str, runs: &[Quantiles]| Some(format!("{name} {}", line(runs.last()?)));
    for run in 1..=b.runs {
        let order = match b.idem_last {
            false => [0_usize, 1, 2, 3],
            true => [1, 2, 3, 0],
        };
        for n in order {
            let (quantiles, e2e) = match n.checked_sub(1) {
                None => idem_run(b, pool, inbox, rabbit, recorder).await?,
                Some(hand) => handwritten_run(b, pool, rabbit, HANDWRITTEN[hand].1).await?,
            };
            dispatch[n].push(quantiles);
            end_to_end[n].extend(e2e);
        }
        eprintln!("latency run {run}: {}", by_consumer(&dispatch, last));
        if end_to_end.iter().all(|runs| runs.len() == run) {
            eprintln!(
                "  end to end (order published → event at the next hop): {}",
                by_consumer(&end_to_end, last)
            );
        }
    }
    let medians = |runs: &[Vec<Quantiles>; 4]| {
        by_consumer(runs, |name, runs| {
            let median_of = |f: fn(&Quantiles) -> f64| super::median(runs.iter().map(f).collect());
            let (p50, p99) = (median_of(|q| q.p50), median_of(|q| q.p99));
            Some(format!("{name} p50 {p50:.2} ms, p99 {p99:.2} ms"))
        })
    };
    let per_run = |runs: &[Vec<Quantiles>; 4]| {
        by_consumer(runs, |name, runs| {
            let p99: Vec<String> = runs.iter().map(|q| format!("{:.2}", q.p99)).collect();
            Some(format!("{name} p99: {}", p99.join(", ")))
        })
    };
    println!(
        "outbox dispatch latency (commit → confirm) at {} msgs/s, {} s per run, medians of {}: {}",
        b.rate,
        b.seconds,
        b.runs,
        medians(&dispatch)
    );
    println!("  per run, {}", per_run(&dispatch));
    if !end_to_end[0].is_empty() {
        println!(
            "end to end (order published → event at the next hop), medians of {}: {}",
            end_to_end[0].len(),
            medians(&end_to_end)
        );
        println!("  per run, {}", per_run(&end_to_end));
    }
    Ok(())
}

/// One line of a run's quantiles.
fn line(q: &Quantiles) -> String {
    format!(
        "p50 {:.2} ms p90 {:.2} ms p99 {:.2} ms max {:.1} ms",
        q.p50, q.p90, q.p99, q.max
    )
}

/// What `show` says of each consumer's runs (idem's first), joined.
fn by_consumer(
    runs: &[Vec<Quantiles>; 4],
    show: impl Fn(&str, &[Quantiles]) -> Option<String>,
) -> String {
    let names = std::iter::once("idem").chain(HANDWRITTEN.iter().map(|(name, _)| *name));
    names
        .zip(runs)
        .filter_map(|(name, runs)| show(name, runs))
        .collect::<Vec<_>>()
        .join("; ")
}

/// One run of the runtime: its quantiles from the histogram's buckets, and the end-to-end
/// quantiles when the events are consumed.
async fn idem_run(
    b: &OutboxBench,
    pool: &sqlx::PgPool,
    inbox: &PgInbox,
    rabbit: &RabbitConfig,
    recorder: &PrometheusHandle,
) -> anyhow::Result<(Quantiles, Option<Quantiles>)> {
    reset(pool, &b.amqp_url).await?;
    let sent = Sent::default();
    let events = Events::start(b, sent.clone()).await?;
    let before = buckets(recorder);
    let runtime = billing(inbox, rabbit).build()?;
    let stats = runtime.stats();
    let health = runtime.health();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));
    // Fed once it consumes, as the handwritten consumers are: its start is not timed.
    let ready_by = Instant::now() + Duration::from_secs(30);
    while !health.readiness().await.ready {
        if Instant::now() > ready_by {
            bail!("the runtime did not become ready");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let total = feed(b, &sent).await?;
    let deadline = Instant::now() + Duration::from_secs(120);
    while (stats.snapshot().settled() as usize) < total || outbox_rows(pool).await? > 0 {
        if Instant::now() > deadline {
            bail!("the latency run did not drain: {:?}", stats.snapshot());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let _ = stop.send(());
    task.await??;
    let end_to_end = super::check_events(b, events, total).await?;
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
    let dispatch = Quantiles {
        p50: from_buckets(&counts, 0.5),
        p90: from_buckets(&counts, 0.9),
        p99: from_buckets(&counts, 0.99),
        max: from_buckets(&counts, 1.0),
    };
    Ok((dispatch, end_to_end))
}

/// Publishes `b.rate` orders a second for `b.seconds` to the orders queue, noting in `sent`
/// when each went; returns how many.
pub(super) async fn feed(b: &OutboxBench, sent: &Sent) -> anyhow::Result<usize> {
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
        sent.lock()
            .map_err(|_| anyhow::anyhow!("poisoned"))?
            .insert(order.order_id.clone(), Instant::now());
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

/// p50, p90, p99 and the largest of `took`.
pub(super) fn quantiles(mut took: Vec<Duration>) -> Quantiles {
    took.sort();
    let at = |q: f64| {
        let rank = ((q * took.len() as f64).ceil() as usize).clamp(1, took.len().max(1));
        took.get(rank - 1)
            .map_or(f64::NAN, |d| d.as_secs_f64() * 1000.0)
    };
    Quantiles {
        p50: at(0.5),
        p90: at(0.9),
        p99: at(0.99),
        max: at(1.0),
    }
}
