//! `idem-bench`: end-to-end throughput and peak memory of idem against handwritten lapin + sqlx
//! consumers, on the same workload, in the same run, alternating.
//!
//! Every run of every consumer starts from empty tables and a freshly filled queue; the consumer
//! runs in its own process (so its peak RSS is its own) and is timed from its first handler call
//! to its last settlement; afterwards the effects are checked (every distinct order once,
//! balances exact, queue empty). The table gives medians and ratios.

mod full_row;
mod handwritten;
mod http;
mod outbox;
mod report;
mod with_idem;
mod workload;

use anyhow::{Context as _, bail};
use clap::{Parser, Subcommand, ValueEnum};
use handwritten::{Inbox, Writes};
use idem::RetryPolicy;
use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use idem::transport::Transport;
use idem::transport::{Partition, QueueSpec};
use lapin::options::{ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{FieldTable, ShortString};
use report::{Sample, Table};
use std::process::Stdio;
use std::time::Duration;
use workload::Workload;

#[derive(Parser, Debug)]
#[command(about = "idem against handwritten lapin + sqlx consumers: msgs/s and peak RSS")]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
    #[command(flatten)]
    bench: Bench,
}

#[derive(clap::Args, Debug, Clone)]
struct Bench {
    /// Messages per run (duplicates included).
    #[arg(long, default_value_t = 50_000)]
    messages: usize,
    /// Share of messages that are exact copies of an earlier one.
    #[arg(long, default_value_t = 0.1)]
    dup_rate: f64,
    /// Runs of each consumer (the table shows medians).
    #[arg(long, default_value_t = 3)]
    runs: usize,
    /// Messages per transaction in the batched consumers.
    #[arg(long, default_value_t = 200)]
    batch: usize,
    /// Workers of the per-message consumers.
    #[arg(long, default_value_t = 8)]
    workers: usize,
    /// Prefetch of the per-message consumers (the batched ones use 3 × batch, idem's default).
    #[arg(long, default_value_t = 32)]
    prefetch: u16,
    /// Batches in flight in idem's batch mode.
    #[arg(long, default_value_t = 1)]
    batches_in_flight: usize,
    /// Tokio worker threads of every process (default: one per core).
    #[arg(long)]
    runtime_threads: Option<usize>,
    /// Install a Prometheus recorder in idem's consumers, so that its metrics are recorded
    /// (and their cost measured); batch-mode consumers then report how full their batches were.
    #[arg(long)]
    metrics: bool,
    /// Alternate the order of the consumers between runs: odd runs as listed in `--variants`,
    /// even runs the first consumer and then the others in reverse. With two or three
    /// consumers, over every two runs each one follows each of the others equally often, so
    /// what a run leaves behind (the database's background work, the broker's) is not always
    /// paid by the same consumer.
    #[arg(long)]
    alternate: bool,
    /// Which consumers to run, in this order within each run (see `--alternate`).
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "hand,hand-batch,idem,idem-batch"
    )]
    variants: Vec<Variant>,
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

#[derive(Subcommand, Debug)]
enum Command {
    /// Runs one consumer until `expect` deliveries are settled (started by the benchmark).
    #[command(hide = true)]
    Consume {
        #[arg(long)]
        variant: Variant,
        #[arg(long)]
        queue: String,
        #[arg(long)]
        expect: usize,
    },
    /// The Idempotency-Key layer against the same axum route with no idempotency and with a
    /// handwritten key table: req/s and latency at N concurrent connections.
    Http(http::HttpBench),
    /// The outbox: dispatch latency at a steady rate, and a relay draining a backlog against a
    /// raw publish-with-confirms loop.
    Outbox(outbox::OutboxBench),
}

/// The consumers compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Variant {
    /// Handwritten, one transaction per message, N workers.
    Hand,
    /// Handwritten, batched, multiple ack.
    HandBatch,
    /// Handwritten, batched, the batch's orders written set-based, multiple ack.
    HandSet,
    /// Handwritten, set-based batches as `hand-set`, claiming in the lean consumer's inbox
    /// (an arrival time with an index on it, for removing old rows).
    HandSetRetained,
    /// Handwritten, set-based batches as `hand-set`, writing idem's own inbox row (fingerprint,
    /// status, timestamps, the `expires_at` index) with idem's claim statement and comparing
    /// the stored fingerprints of duplicates: idem's guarantees in SQL, by hand.
    HandSetFull,
    /// Handwritten, one transaction per message, N workers each holding its own connection,
    /// a narrow inbox with an arrival-time index.
    HandLean,
    /// Handwritten, lean per message as `hand-lean`, writing idem's own inbox row with idem's
    /// claim statement and comparing the stored fingerprint of a duplicate.
    HandLeanFull,
    /// idem, one transaction per message.
    Idem,
    /// idem, one transaction per message, each on a connection acquired from the pool (no
    /// connection kept by a worker: `hold_connections(Duration::ZERO)`).
    IdemPooled,
    /// idem, batch mode.
    IdemBatch,
    /// idem, batch mode, a batch handler writing set-based.
    IdemSet,
    /// idem, one transaction per message, staging one event per message in the outbox.
    IdemOutbox,
    /// idem's batch handler, staging one event per message in the outbox.
    IdemSetOutbox,
    /// idem, one transaction per message, ordered by order id over 4 partitions.
    IdemOrdered4,
    /// idem, one transaction per message, ordered by order id over 16 partitions.
    IdemOrdered16,
}

impl Variant {
    fn name(self) -> &'static str {
        match self {
            Self::Hand => "handwritten, per message",
            Self::HandBatch => "handwritten, batched",
            Self::HandSet => "handwritten, set-based batches",
            Self::HandSetRetained => "handwritten, set-based, inbox with retention index",
            Self::HandSetFull => "handwritten, set-based, idem's inbox row",
            Self::HandLean => "handwritten, lean per message",
            Self::HandLeanFull => "handwritten, lean, idem's inbox row",
            Self::Idem => "idem, per message",
            Self::IdemPooled => "idem, per message, pooled",
            Self::IdemBatch => "idem, batch mode",
            Self::IdemSet => "idem, batch handler",
            Self::IdemOutbox => "idem, per message + outbox",
            Self::IdemSetOutbox => "idem, batch handler + outbox",
            Self::IdemOrdered4 => "idem, ordered, 4 partitions",
            Self::IdemOrdered16 => "idem, ordered, 16 partitions",
        }
    }

    /// Whether the handler stages one event per order in the outbox.
    fn stages_events(self) -> bool {
        matches!(self, Self::IdemOutbox | Self::IdemSetOutbox)
    }

    /// The partitions of an ordered variant (its queue is then an exchange).
    fn partitions(self) -> Option<usize> {
        match self {
            Self::IdemOrdered4 => Some(4),
            Self::IdemOrdered16 => Some(16),
            _ => None,
        }
    }

    fn queue(self) -> String {
        format!(
            "idem-bench-{}",
            self.to_possible_value()
                .map(|v| v.get_name().to_owned())
                .unwrap_or_default()
        )
    }

    fn uses_idem(self) -> bool {
        !matches!(
            self,
            Self::Hand
                | Self::HandBatch
                | Self::HandSet
                | Self::HandSetRetained
                | Self::HandSetFull
                | Self::HandLean
                | Self::HandLeanFull
        )
    }
}

fn main() -> anyhow::Result<()> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env().unwrap_or_else(|_| "warn".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    let mut builder = tokio::runtime::Builder::new_multi_thread();
    if let Some(threads) = cli.bench.runtime_threads {
        builder.worker_threads(threads);
    }
    let runtime = builder.enable_all().build()?;
    match cli.command {
        None => runtime.block_on(bench(cli.bench)),
        Some(Command::Consume {
            variant,
            queue,
            expect,
        }) => runtime.block_on(consume(&cli.bench, variant, &queue, expect)),
        Some(Command::Http(http)) => runtime.block_on(http::run(http)),
        Some(Command::Outbox(outbox)) => runtime.block_on(outbox::run(outbox)),
    }
}

async fn pool(url: &str, connections: u32) -> anyhow::Result<sqlx::PgPool> {
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .connect(url)
        .await
        .with_context(|| format!("cannot connect to {url}"))
}

/// The child process: one consumer, then a `RESULT` line with its time and peak RSS.
async fn consume(b: &Bench, variant: Variant, queue: &str, expect: usize) -> anyhow::Result<()> {
    let pool = pool(&b.database_url, b.workers as u32 + 2).await?;
    let linger = Duration::from_millis(5);
    let elapsed = match variant {
        Variant::Hand => {
            handwritten::per_message(&b.amqp_url, pool, queue, expect, b.workers, b.prefetch)
                .await?
        }
        Variant::HandBatch | Variant::HandSet | Variant::HandSetRetained | Variant::HandSetFull => {
            let (writes, inbox) = match variant {
                Variant::HandSet => (Writes::SetBased, Inbox::Bare),
                Variant::HandSetRetained => (Writes::SetBased, Inbox::Retained),
                Variant::HandSetFull => (Writes::SetBased, Inbox::Full),
                _ => (Writes::PerOrder, Inbox::Bare),
            };
            let batching = handwritten::Batching {
                size: b.batch,
                linger,
                writes,
                inbox,
            };
            handwritten::batched(&b.amqp_url, pool, queue, expect, batching).await?
        }
        Variant::HandLean | Variant::HandLeanFull => {
            drop(pool);
            let inbox = match variant {
                Variant::HandLeanFull => Inbox::Full,
                _ => Inbox::Retained,
            };
            handwritten::lean_per_message(
                &b.amqp_url,
                &b.database_url,
                queue,
                expect,
                b.workers,
                b.prefetch,
                inbox,
            )
            .await?
        }
        Variant::Idem
        | Variant::IdemPooled
        | Variant::IdemBatch
        | Variant::IdemSet
        | Variant::IdemOutbox
        | Variant::IdemSetOutbox
        | Variant::IdemOrdered4
        | Variant::IdemOrdered16 => {
            let recorder = match b.metrics {
                true => Some(
                    metrics_exporter_prometheus::PrometheusBuilder::new()
                        .install_recorder()
                        .context("installing the metrics recorder")?,
                ),
                false => None,
            };
            let batched = matches!(
                variant,
                Variant::IdemBatch | Variant::IdemSet | Variant::IdemSetOutbox
            );
            let mode = with_idem::Mode {
                batch: if batched { b.batch } else { 0 },
                concurrency: if batched {
                    b.batches_in_flight
                } else {
                    b.workers
                },
                prefetch: b.prefetch,
                partitions: variant.partitions(),
                batch_handler: matches!(variant, Variant::IdemSet | Variant::IdemSetOutbox),
                outbox: variant.stages_events(),
                keep_connections: variant != Variant::IdemPooled,
            };
            let rabbit = RabbitConfig::new(&b.amqp_url).connection_name("idem-bench");
            let elapsed = with_idem::run(rabbit, pool, queue, expect, mode).await?;
            if let Some(recorder) = recorder.filter(|_| batched) {
                eprintln!("{}", report::batch_fill(&recorder.render()));
            }
            elapsed
        }
    };
    println!(
        "RESULT {} {} {}",
        elapsed.as_micros(),
        report::peak_rss_kib().unwrap_or(0),
        report::cpu_ms().unwrap_or(0)
    );
    Ok(())
}

/// The order of the consumers (indexes into `--variants`) in run `run` (from 1): as listed, or
/// with `alternate` in even runs the first and then the others in reverse.
fn run_order(variants: usize, run: usize, alternate: bool) -> Vec<usize> {
    if alternate && run.is_multiple_of(2) && variants > 0 {
        std::iter::once(0).chain((1..variants).rev()).collect()
    } else {
        (0..variants).collect()
    }
}

/// The parent: for each run, each consumer in turn on a fresh queue and empty tables.
async fn bench(b: Bench) -> anyhow::Result<()> {
    let workload = Workload::new(b.messages, b.dup_rate);
    eprintln!(
        "workload: {} messages, {} distinct orders ({} duplicates), {} runs of {:?}",
        b.messages,
        workload.unique,
        b.messages - workload.unique,
        b.runs,
        b.variants
    );
    let pool = pool(&b.database_url, 2).await?;
    with_idem::inbox(pool.clone())?.migrate().await?;
    let mut table = Table::new(b.variants.iter().map(|v| v.name()).collect());
    for run in 1..=b.runs {
        for column in run_order(b.variants.len(), run, b.alternate) {
            let variant = b.variants[column];
            workload::reset(&pool, with_idem::TABLE).await?;
            let queue = variant.queue();
            fresh_queue(&b.amqp_url, &queue, variant).await?;
            workload
                .publish(
                    &RabbitConfig::new(&b.amqp_url),
                    &queue,
                    variant.partitions().is_some(),
                )
                .await?;
            let sample = child(variant, &queue, b.messages).await?;
            workload::verify(&pool, &workload)
                .await
                .with_context(|| format!("{} left wrong effects", variant.name()))?;
            let mut left = 0;
            for queue in queues(&queue, variant) {
                left += workload::left_in_queue(&b.amqp_url, &queue).await?;
            }
            if left > 0 {
                bail!("{} left {left} messages in the queue", variant.name());
            }
            if variant.stages_events() {
                let billed = workload::left_in_queue(&b.amqp_url, with_idem::BILLED).await?;
                if billed as usize != workload.unique {
                    bail!(
                        "{} published {billed} events for {} orders",
                        variant.name(),
                        workload.unique
                    );
                }
            }
            eprintln!(
                "run {run}: {:<26} {:>9.0} msgs/s  CPU {:>6.2} s  peak RSS {:>6.1} MiB  (effects exact)",
                variant.name(),
                sample.rate(b.messages),
                sample.cpu.as_secs_f64(),
                sample.rss_kib as f64 / 1024.0
            );
            table.add(column, sample);
        }
    }
    println!("{}", table.render(b.messages));
    Ok(())
}

/// The queues a variant consumes: `queue`, or an ordered variant's partition queues.
fn queues(queue: &str, variant: Variant) -> Vec<String> {
    match variant.partitions() {
        Some(count) => (0..count)
            .map(|index| Partition::queue_name(queue, index))
            .collect(),
        None => vec![queue.to_owned()],
    }
}

/// Deletes `queue` (and idem's queues around it; for an ordered variant its partitions and
/// exchange) and declares it anew, empty.
async fn fresh_queue(url: &str, queue: &str, variant: Variant) -> anyhow::Result<()> {
    let delays = RetryPolicy::default().delays();
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .with_context(|| format!("cannot reach RabbitMQ at {url}"))?;
    let channel = connection.create_channel().await?;
    for queue in queues(queue, variant) {
        let mut names = vec![queue.clone(), idem::rabbitmq::dlq(&queue)];
        names.extend(
            delays
                .iter()
                .map(|d| idem::rabbitmq::retry_queue(&queue, *d)),
        );
        for name in names {
            channel
                .queue_delete(
                    ShortString::from(name.as_str()),
                    QueueDeleteOptions::default(),
                )
                .await?;
        }
    }
    if let Some(count) = variant.partitions() {
        channel
            .exchange_delete(ShortString::from(queue), ExchangeDeleteOptions::default())
            .await?;
        RabbitTransport::new(RabbitConfig::new(url))
            .declare(&QueueSpec::partitions(queue, with_idem::CONSUMER, count))
            .await?;
    } else if variant.uses_idem() {
        let mut spec = QueueSpec::new(queue, with_idem::CONSUMER);
        spec.retry_delays = delays;
        // Where the outbox variants' events go, emptied: nothing consumes it.
        let billed = QueueSpec::new(with_idem::BILLED, "bench.billed");
        RabbitTransport::new(RabbitConfig::new(url))
            .declare(&[spec, billed])
            .await?;
        channel
            .queue_purge(
                ShortString::from(with_idem::BILLED),
                lapin::options::QueuePurgeOptions::default(),
            )
            .await?;
    } else {
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .queue_declare(ShortString::from(queue), durable, FieldTable::default())
            .await?;
    }
    let _ = connection.close(200, ShortString::from("declared")).await;
    Ok(())
}

/// Runs one consumer in a child process and reads its result.
async fn child(variant: Variant, queue: &str, expect: usize) -> anyhow::Result<Sample> {
    let exe = std::env::current_exe()?;
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // The benchmark's own options first, then the subcommand.
    args.extend([
        "consume".to_owned(),
        "--variant".to_owned(),
        variant
            .to_possible_value()
            .map(|v| v.get_name().to_owned())
            .unwrap_or_default(),
        "--queue".to_owned(),
        queue.to_owned(),
        "--expect".to_owned(),
        expect.to_string(),
    ]);
    let output = tokio::process::Command::new(exe)
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?
        .wait_with_output()
        .await?;
    if !output.status.success() {
        bail!("{} failed: {}", variant.name(), output.status);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .context("the consumer printed no result")?;
    Sample::parse(line)
}

#[cfg(test)]
mod tests {
    use super::run_order;

    #[test]
    fn without_alternation_every_run_keeps_the_listed_order() {
        for run in 1..=4 {
            assert_eq!(run_order(3, run, false), vec![0, 1, 2]);
        }
    }

    #[test]
    fn alternated_runs_let_each_consumer_follow_each_other_equally_often() {
        assert_eq!(run_order(3, 1, true), vec![0, 1, 2]);
        assert_eq!(run_order(3, 2, true), vec![0, 2, 1]);
        assert_eq!(run_order(3, 3, true), vec![0, 1, 2]);
        assert_eq!(run_order(0, 2, true), Vec::<usize>::new());
        for variants in [2, 3] {
            // Six runs back to back: every ordered pair (predecessor, consumer) of two
            // different consumers occurs, each about as often as the others.
            let sequence: Vec<usize> = (1..=6)
                .flat_map(|run| run_order(variants, run, true))
                .collect();
            let mut pairs = std::collections::HashMap::new();
            for pair in sequence.windows(2) {
                *pairs.entry((pair[0], pair[1])).or_insert(0) += 1;
            }
            assert!(pairs.keys().all(|(a, b)| a != b), "{pairs:?}");
            assert_eq!(pairs.len(), variants * (variants - 1), "{pairs:?}");
            let counts: Vec<i32> = pairs.values().copied().collect();
            let spread = counts.iter().max().unwrap() - counts.iter().min().unwrap();
            assert!(spread <= 1, "{variants} consumers: {pairs:?}");
        }
    }
}
