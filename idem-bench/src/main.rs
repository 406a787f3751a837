//! `idem-bench`: end-to-end throughput and peak memory of idem against handwritten lapin + sqlx
//! consumers, on the same workload, in the same run, alternating.
//!
//! Every run of every consumer starts from empty tables and a freshly filled queue; the consumer
//! runs in its own process (so its peak RSS is its own) and is timed from its first handler call
//! to its last settlement; afterwards the effects are checked (every distinct order once,
//! balances exact, queue empty). The table gives medians and ratios.

mod curve;
mod full_row;
mod handwritten;
mod http;
mod latency;
mod nats;
mod outbox;
mod parent;
mod prefill;
mod report;
mod steady;
mod with_idem;
mod workload;

use anyhow::Context as _;
use clap::{Parser, Subcommand, ValueEnum};
use handwritten::{Inbox, Writes};
use idem::nats::{NatsConfig, NatsTransport};
use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use prefill::InboxTable;
use std::time::Duration;

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
    /// Rows in every measured consumer's inbox before its runs. Several sizes (ascending, comma
    /// separated) measure at each in turn, filling up between them, and print the curve:
    /// `--prefill 0,1000000,5000000,10000000`.
    #[arg(long, value_delimiter = ',', default_value = "0")]
    prefill: Vec<u64>,
    /// The dedup keys of the orders and of the prefilled rows (default: `sequential` without
    /// `--prefill`, `uuid4` with it).
    #[arg(long, value_enum)]
    keys: Option<workload::Keys>,
    /// After the largest size, measure again with a day's worth of rows expired (a seventh of
    /// the inbox, topped up before each run) and each consumer's sweeper deleting them while it
    /// runs; then idem's sweeper alone, deleting a day's worth.
    #[arg(long)]
    sweep: bool,
    /// The sweepers' pause after each batch, in multiples of its time (idem's runtime: its
    /// `sweep_pause`; the handwritten consumers' cleanup the same).
    #[arg(long, default_value_t = idem::DEFAULT_SWEEP_PAUSE)]
    sweep_pause: u32,
    /// PostgreSQL's autovacuum during the benchmark: `on` (as a user's server has it), `off`,
    /// or `server` (as the server is configured). `on` and `off` use `ALTER SYSTEM` and restore
    /// the setting at the end.
    #[arg(long, value_enum, default_value = "server")]
    autovacuum: AutovacuumSetting,
    /// With several `--prefill` sizes: draw the curve (msgs/s against inbox rows, one line per
    /// consumer) into this PNG.
    #[arg(long)]
    plot: Option<std::path::PathBuf>,
    /// After the throughput runs, run every consumer again fed at this many messages a second,
    /// and print the latency from each order's publish to its commit (p50, p99) beside the
    /// consumer's most msgs/s.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..))]
    latency_rate: Option<u32>,
    /// The broker the consumers run on: RabbitMQ (lapin) or NATS JetStream (async-nats).
    #[arg(long, value_enum, default_value = "rabbitmq")]
    broker: Broker,
    /// NATS with JetStream, for `--broker nats`.
    #[arg(long, env = "NATS_URL", default_value = "nats://127.0.0.1:4222")]
    nats_url: String,
    /// With `--broker nats`: the handwritten consumers wait for JetStream to confirm each ack,
    /// as idem does, instead of sending plain acks.
    #[arg(long)]
    nats_confirmed_acks: bool,
    /// RabbitMQ, for `--broker rabbitmq`.
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
        /// Delete expired inbox rows while consuming (idem: its runtime's sweeper).
        #[arg(long)]
        sweeping: bool,
    },
    /// The Idempotency-Key layer against the same axum route with no idempotency and with a
    /// handwritten key table: req/s and latency at N concurrent connections.
    Http(http::HttpBench),
    /// The outbox: dispatch latency at a steady rate, and a relay draining a backlog against a
    /// raw publish-with-confirms loop.
    Outbox(outbox::OutboxBench),
    /// idem's batch handler under a full inflow for minutes with a short retention, its
    /// sweeper at work or not: throughput and the expired rows left.
    SteadySweep(steady::SteadyBench),
}

/// `--broker`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum Broker {
    Rabbitmq,
    Nats,
}

/// `--autovacuum`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
enum AutovacuumSetting {
    On,
    Off,
    Server,
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
    /// As `idem-ordered-4`, with `KeyPolicy::Retire`: no key is parked, so no delivery asks
    /// whether its key is (the cost of parking, measured against the default).
    IdemOrdered4Retire,
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
            Self::IdemOrdered4Retire => "idem, ordered, 4 partitions, keys retired",
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
            Self::IdemOrdered4Retire => Some(4),
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

    /// Where the consumer keeps its dedup markers.
    fn inbox(self) -> InboxTable {
        match self {
            Self::Hand | Self::HandBatch | Self::HandSet => InboxTable::Bare,
            Self::HandSetRetained | Self::HandLean => InboxTable::Lean,
            Self::HandSetFull | Self::HandLeanFull => InboxTable::Full,
            _ => InboxTable::Idem,
        }
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
        None => runtime.block_on(parent::bench(cli.bench)),
        Some(Command::Consume {
            variant,
            queue,
            expect,
            sweeping,
        }) => runtime.block_on(consume(&cli.bench, variant, &queue, expect, sweeping)),
        Some(Command::Http(http)) => runtime.block_on(http::run(http)),
        Some(Command::Outbox(outbox)) => runtime.block_on(outbox::run(outbox)),
        Some(Command::SteadySweep(steady)) => runtime.block_on(steady::run(steady)),
    }
}

/// A pool of `connections` to `url`, statements unlogged (a prefill's inserts take seconds).
async fn pool(url: &str, connections: u32) -> anyhow::Result<sqlx::PgPool> {
    use sqlx::ConnectOptions as _;
    let options: sqlx::postgres::PgConnectOptions = url
        .parse()
        .with_context(|| format!("not a PostgreSQL URL: {url}"))?;
    sqlx::postgres::PgPoolOptions::new()
        .max_connections(connections)
        .connect_with(options.disable_statement_logging())
        .await
        .with_context(|| format!("cannot connect to {url}"))
}

/// The child process: one consumer, then a `RESULT` line with its time and peak RSS.
async fn consume(
    b: &Bench,
    variant: Variant,
    queue: &str,
    expect: usize,
    sweeping: bool,
) -> anyhow::Result<()> {
    let pool = pool(&b.database_url, b.workers as u32 + 2).await?;
    // idem's runtime sweeps with its default settings in every run (with nothing expired, a
    // sweep finds nothing); a handwritten consumer sweeps when asked, as its cleanup job would,
    // on a connection of its own.
    if sweeping && !variant.uses_idem() {
        tokio::spawn(prefill::sweep_forever(
            self::pool(&b.database_url, 1).await?,
            variant.inbox(),
            b.sweep_pause,
        ));
    }
    let linger = Duration::from_millis(5);
    let nats = (b.broker == Broker::Nats).then_some(b.nats_url.as_str());
    let nats_ack = match b.nats_confirmed_acks {
        true => nats::Ack::Confirmed,
        false => nats::Ack::Plain,
    };
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
            match nats {
                Some(url) => nats::batched(url, pool, queue, expect, batching, nats_ack).await?,
                None => handwritten::batched(&b.amqp_url, pool, queue, expect, batching).await?,
            }
        }
        Variant::HandLean | Variant::HandLeanFull => {
            drop(pool);
            let inbox = match variant {
                Variant::HandLeanFull => Inbox::Full,
                _ => Inbox::Retained,
            };
            match nats {
                Some(url) => {
                    let workers = nats::Workers {
                        count: b.workers,
                        prefetch: b.prefetch,
                        inbox,
                        ack: nats_ack,
                    };
                    nats::lean_per_message(url, &b.database_url, queue, expect, workers).await?
                }
                None => {
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
            }
        }
        Variant::Idem
        | Variant::IdemPooled
        | Variant::IdemBatch
        | Variant::IdemSet
        | Variant::IdemOutbox
        | Variant::IdemSetOutbox
        | Variant::IdemOrdered4
        | Variant::IdemOrdered16
        | Variant::IdemOrdered4Retire => {
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
                retire_keys: variant == Variant::IdemOrdered4Retire,
                sweep_pause: b.sweep_pause,
            };
            let elapsed = match nats {
                Some(url) => {
                    let config = NatsConfig::new(url).connection_name("idem-bench");
                    with_idem::run(NatsTransport::new(config), pool, queue, expect, mode).await?
                }
                None => {
                    let rabbit = RabbitConfig::new(&b.amqp_url).connection_name("idem-bench");
                    with_idem::run(RabbitTransport::new(rabbit), pool, queue, expect, mode).await?
                }
            };
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
