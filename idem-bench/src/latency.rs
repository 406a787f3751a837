//! `--latency-rate R`: end-to-end latency at a fixed offered rate, after the throughput runs.
//! Each consumer runs in its own process, as in the throughput runs, while the benchmark
//! publishes the workload at `R` messages a second. An order's latency runs from its publish
//! until the commit of its row: a trigger on the orders table sends the order id with
//! `NOTIFY`, which PostgreSQL delivers when the transaction commits, to a listener in the
//! benchmark, on the same clock as the publish; the trigger costs each transaction a
//! notification. Each run reports how far the feed fell behind its schedule at most, so that a
//! feed that did not hold the rate shows. The orders published in the first [`WARM_UP`] are
//! left out while the consumer starts.

use crate::parent::{child, fresh_queue, run_order};
use crate::workload::{self, Order, Workload};
use crate::{Bench, Broker, nats, with_idem};
use anyhow::{Context as _, bail};
use idem::rabbitmq::{Publisher, RabbitConfig};
use sqlx::postgres::PgListener;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The channel the trigger notifies.
const CHANNEL: &str = "idem_bench_committed";

/// The orders published this early in a run are not counted: the consumer is starting.
const WARM_UP: Duration = Duration::from_secs(2);

/// How often the feed publishes what is due.
const TICK: Duration = Duration::from_millis(5);

/// Removes the trigger.
pub const DROP_TRIGGER: &str = "DROP TRIGGER IF EXISTS idem_bench_committed ON bench_orders";

/// The trigger that reports each order row's commit.
const TRIGGER: [&str; 3] = [
    "CREATE OR REPLACE FUNCTION idem_bench_committed() RETURNS trigger LANGUAGE plpgsql AS
     $$ BEGIN PERFORM pg_notify('idem_bench_committed', NEW.order_id); RETURN NEW; END $$",
    "DROP TRIGGER IF EXISTS idem_bench_committed ON bench_orders",
    "CREATE TRIGGER idem_bench_committed AFTER INSERT ON bench_orders
     FOR EACH ROW EXECUTE FUNCTION idem_bench_committed()",
];

/// p50 and p99 of one run, in milliseconds.
#[derive(Debug, Clone, Copy)]
struct Quantiles {
    p50: f64,
    p99: f64,
}

/// Runs every consumer `b.runs` times (alternating as the throughput runs do) fed at `rate`,
/// and prints each run's p50 and p99 and their medians. `rates` are the consumers' median
/// msgs/s of the throughput runs, printed beside them.
pub async fn measure(
    b: &Bench,
    rate: u32,
    pool: &sqlx::PgPool,
    workload: &Workload,
    rates: &[f64],
) -> anyhow::Result<()> {
    let measured = runs(b, rate, pool, workload).await;
    sqlx::query(DROP_TRIGGER).execute(pool).await?;
    let measured = measured?;
    println!(
        "latency, publish → commit, at {rate} msgs/s offered ({:?}; medians of {} runs, the first {} s of each left out):",
        b.broker,
        b.runs,
        WARM_UP.as_secs()
    );
    println!("| consumer | most msgs/s | p50 ms | p99 ms |\n|---|---:|---:|---:|");
    for (column, runs) in measured.iter().enumerate() {
        let median = |f: fn(&Quantiles) -> f64| crate::report::median(runs.iter().map(f).collect());
        println!(
            "| {} | {:.0} | {:.2} | {:.2} |",
            b.variants[column].name(),
            rates.get(column).copied().unwrap_or(f64::NAN),
            median(|q| q.p50),
            median(|q| q.p99)
        );
    }
    Ok(())
}

/// Each run of each consumer: its quantiles, by consumer.
async fn runs(
    b: &Bench,
    rate: u32,
    pool: &sqlx::PgPool,
    workload: &Workload,
) -> anyhow::Result<Vec<Vec<Quantiles>>> {
    let mut measured = vec![Vec::new(); b.variants.len()];
    for run in 1..=b.runs {
        for column in run_order(b.variants.len(), run, b.alternate) {
            let variant = b.variants[column];
            // The reset drops the trigger a run left behind; each run sets it again.
            workload::reset(pool, with_idem::TABLE, None).await?;
            for statement in TRIGGER {
                sqlx::raw_sql(sqlx::AssertSqlSafe(statement))
                    .execute(pool)
                    .await?;
            }
            let queue = variant.queue();
            match b.broker {
                Broker::Rabbitmq => fresh_queue(&b.amqp_url, &queue, variant).await?,
                Broker::Nats => {
                    let consumer = variant.uses_idem().then_some(with_idem::CONSUMER);
                    nats::fresh_queue(&b.nats_url, &queue, consumer).await?;
                }
            }
            let mut listener = PgListener::connect(&b.database_url).await?;
            listener.listen(CHANNEL).await?;
            let committed: Arc<Mutex<Vec<(String, Instant)>>> = Arc::default();
            let listening = tokio::spawn(listen(listener, committed.clone(), workload.unique));
            let consumer = {
                let (queue, messages) = (queue.clone(), b.messages);
                tokio::spawn(async move { child(variant, &queue, messages, false).await })
            };
            let (sent, lag) = feed(b, &queue, workload, rate).await?;
            consumer.await??;
            workload::verify(pool, workload)
                .await
                .with_context(|| format!("{} left wrong effects", variant.name()))?;
            let deadline = Instant::now() + Duration::from_secs(10);
            while !listening.is_finished() && Instant::now() < deadline {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            if listening.is_finished() {
                listening.await??;
            } else {
                listening.abort();
            }
            let committed =
                std::mem::take(&mut *committed.lock().unwrap_or_else(|e| e.into_inner()));
            let quantiles = quantiles(&sent, &committed, workload.unique)?;
            eprintln!(
                "latency run {run}: {:<26} p50 {:>7.2} ms  p99 {:>7.2} ms  feed behind by {:.1} ms at most  (effects exact)",
                variant.name(),
                quantiles.p50,
                quantiles.p99,
                lag.as_secs_f64() * 1e3
            );
            measured[column].push(quantiles);
        }
    }
    Ok(measured)
}

/// Records each notified order id with the time it arrived, until `expected` have.
async fn listen(
    mut listener: PgListener,
    committed: Arc<Mutex<Vec<(String, Instant)>>>,
    expected: usize,
) -> anyhow::Result<()> {
    loop {
        let notification = listener.recv().await?;
        let at = Instant::now();
        let mut committed = committed.lock().unwrap_or_else(|e| e.into_inner());
        committed.push((notification.payload().to_owned(), at));
        if committed.len() >= expected {
            return Ok(());
        }
    }
}

/// The quantiles of commit − first publish over the orders published after the warm-up;
/// every order must have been notified.
fn quantiles(
    sent: &HashMap<String, Instant>,
    committed: &[(String, Instant)],
    expected: usize,
) -> anyhow::Result<Quantiles> {
    if committed.len() != expected {
        bail!("{} commits notified for {expected} orders", committed.len());
    }
    let start = sent.values().min().copied().context("nothing was sent")?;
    let mut latencies: Vec<f64> = committed
        .iter()
        .filter_map(|(id, at)| {
            let published = sent.get(id)?;
            (*published >= start + WARM_UP).then(|| (*at - *published).as_secs_f64() * 1e3)
        })
        .collect();
    latencies.sort_by(f64::total_cmp);
    if latencies.is_empty() {
        bail!("no order was published after the warm-up: raise --messages");
    }
    // Nearest rank: the smallest latency at least a share `p` of the orders had.
    let at = |p: f64| {
        let rank = (latencies.len() as f64 * p).ceil() as usize;
        latencies[rank.clamp(1, latencies.len()) - 1]
    };
    Ok(Quantiles {
        p50: at(0.5),
        p99: at(0.99),
    })
}

/// Publishes the workload to `queue` at `rate` messages a second, confirmed as it goes: when
/// each order was first published, and the most the feed fell behind its schedule.
async fn feed(
    b: &Bench,
    queue: &str,
    workload: &Workload,
    rate: u32,
) -> anyhow::Result<(HashMap<String, Instant>, Duration)> {
    let mut sink = match b.broker {
        Broker::Rabbitmq => Sink::Rabbit(Box::new(
            Publisher::connect(&RabbitConfig::new(&b.amqp_url)).await?,
        )),
        Broker::Nats => Sink::Nats(Box::new(nats::feeder(&b.nats_url).await?)),
    };
    let mut sent = HashMap::with_capacity(workload.unique);
    let mut lag = Duration::ZERO;
    let started = Instant::now();
    let mut ticker = tokio::time::interval(TICK);
    let mut next = 0;
    let total = workload.messages.len();
    while next < total {
        ticker.tick().await;
        let due = ((started.elapsed().as_secs_f64() * f64::from(rate)) as usize).min(total);
        if due <= next {
            continue;
        }
        // The orders are stamped as they are sent; how far the feed fell behind its schedule
        // is reported beside the quantiles.
        let now = Instant::now();
        let scheduled = started + Duration::from_secs_f64(next as f64 / f64::from(rate));
        lag = lag.max(now.saturating_duration_since(scheduled));
        for order in &workload.messages[next..due] {
            sent.entry(order.order_id.clone()).or_insert(now);
        }
        sink.publish(queue, &workload.messages[next..due]).await?;
        next = due;
    }
    Ok((sent, lag))
}

/// Where the feed publishes.
enum Sink {
    Rabbit(Box<Publisher>),
    Nats(Box<async_nats::jetstream::Context>),
}

impl Sink {
    /// Publishes `orders` and waits for the broker's confirms.
    async fn publish(&mut self, queue: &str, orders: &[Order]) -> anyhow::Result<()> {
        match self {
            Self::Rabbit(publisher) => {
                for order in orders {
                    let message = idem::Envelope::new(serde_json::to_vec(order)?)
                        .with_message_id(order.order_id.as_str())
                        .with_content_type("application/json");
                    publisher.publish_unconfirmed(queue, &message).await?;
                }
                publisher.wait_for_confirms().await?;
            }
            Self::Nats(js) => nats::publish_orders(js, queue, orders).await?,
        }
        Ok(())
    }
}
