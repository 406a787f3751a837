//! The command line.

use clap::{Args, Parser, Subcommand};

/// The idem operator tool: dead letters with their reasons, the inbox, and parked outbox rows.
#[derive(Debug, Parser)]
#[command(name = "idem", version, about, long_about = None)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
    /// The broker, or several separated by commas (tried in order): its scheme names it
    /// (`amqp://`, `amqps://` RabbitMQ; `nats://`, `tls://` NATS JetStream).
    #[arg(
        long,
        env = "AMQP_URL",
        default_value = "amqp://guest:guest@127.0.0.1:5672/%2f",
        global = true,
        hide_env_values = true
    )]
    pub amqp_url: String,
    /// A NATS server with JetStream: when set (or when the broker URL above is a `nats://`
    /// one), dead letters are read from its streams instead of RabbitMQ's queues.
    #[arg(long, env = "NATS_URL", global = true, hide_env_values = true)]
    pub nats_url: Option<String>,
    /// For an `amqps://` broker whose certificate a private CA signed: a PEM file of CA
    /// certificates to trust beside the system's roots.
    #[arg(long, env = "AMQP_TLS_CA", global = true, value_name = "PEM_FILE")]
    pub amqp_tls_ca: Option<std::path::PathBuf>,
    /// How long, in seconds, any one answer of the broker may take (connecting, reading,
    /// publishing, confirming): a broker that accepts the connection and then says nothing, or
    /// blocks publishers under a resource alarm, fails the command instead of holding it.
    #[arg(
        long,
        env = "IDEM_BROKER_TIMEOUT",
        default_value = "30",
        value_parser = seconds,
        global = true,
        value_name = "SECONDS"
    )]
    pub broker_timeout: std::time::Duration,
    /// The database holding the inbox: a `postgres://`, `mysql://` or `sqlite:` URL.
    #[arg(
        long,
        env = "DATABASE_URL",
        default_value = "sqlite://idem-orders.db",
        global = true,
        hide_env_values = true
    )]
    pub database_url: String,
    /// The inbox table (its dead-letter records are in `<table>_dead_letters`).
    #[arg(
        long,
        env = "IDEM_INBOX_TABLE",
        default_value = "idem_inbox",
        global = true
    )]
    pub table: String,
    /// Print JSON instead of text, for scripts.
    #[arg(long, global = true)]
    pub json: bool,
}

/// What to do.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Dead letters of a queue (`<queue>.dlq`) with the reasons recorded in the inbox.
    #[command(subcommand)]
    Dlq(Dlq),
    /// The inbox: rows per consumer and status, one key, forgetting a key, sweeping.
    #[command(subcommand)]
    Inbox(Inbox),
    /// The outbox: rows the broker refused (no queue bound, not carriable, nacked), parked out
    /// of the relay's way, and those given up after refusals for too long (outbox dead
    /// letters).
    #[command(subcommand)]
    Outbox(Outbox),
    /// Print the SQL that creates the inbox's tables at this idem's schema version, for a
    /// migration tool of your own (nothing is connected to).
    Schema {
        /// The database: `postgres`, `mysql` (MariaDB) or `sqlite`; by default the one
        /// DATABASE_URL names.
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(
            idem::sql::dialect::DIALECTS.iter().map(|entry| entry.name)
        ))]
        dialect: Option<String>,
    },
}

/// `idem outbox …`
#[derive(Debug, Subcommand)]
pub enum Outbox {
    /// List the parked rows, oldest first, each with why the broker refused it and whether the
    /// relay gave it up (an outbox dead letter: only `release` sends it again).
    Parked,
    /// Put parked rows back into the outbox (once their queue exists): the relay publishes
    /// them at its next pass, with their ids.
    Release {
        /// The rows to release (`seq` as `idem outbox parked` lists them).
        #[arg(required_unless_present = "all", conflicts_with = "all")]
        seqs: Vec<i64>,
        /// Release every parked row.
        #[arg(long)]
        all: bool,
    },
    /// Remove parked rows for good: they are never published.
    Drop {
        /// The rows to remove (`seq` as `idem outbox parked` lists them).
        #[arg(required_unless_present = "given_up", conflicts_with = "given_up")]
        seqs: Vec<i64>,
        /// Remove every row the relay gave up.
        #[arg(long)]
        given_up: bool,
    },
}

/// The queue whose dead letters are meant.
#[derive(Debug, Args)]
pub struct QueueArg {
    /// The consumed queue (its dead letters are in `<queue>.dlq`).
    #[arg(long, short, env = "IDEM_QUEUE")]
    pub queue: String,
}

/// `idem dlq …`
#[derive(Debug, Subcommand)]
pub enum Dlq {
    /// List the dead letters, oldest first, each with its reason (the queue is left as it is),
    /// and the keys of ordered handlers parked behind them, with how many messages wait and
    /// since when.
    List {
        #[command(flatten)]
        queue: QueueArg,
        /// List at most this many.
        #[arg(long, default_value_t = 100)]
        limit: u64,
    },
    /// Show one dead letter: properties, headers, body and its record.
    Show {
        #[command(flatten)]
        queue: QueueArg,
        /// Its message id, or `sha256:<prefix>` of its body's fingerprint.
        id: String,
    },
    /// Publish dead letters again, to their queue or `--to`: the message id, body and headers
    /// stay, RabbitMQ's `x-death` and idem's attempt count go. The inbox is asked first: a key
    /// it applied with the same payload is resolved without publishing; one applied with
    /// another payload, or whose dedup window is over (its first failure is longer ago than
    /// its consumer's retention), is refused. Else the failure is cleared so that the message
    /// is processed again.
    Replay {
        #[command(flatten)]
        queue: QueueArg,
        /// The dead letters to replay (message ids, or `sha256:<prefix>`).
        #[arg(required_unless_present_any = ["all", "key"], conflicts_with_all = ["all", "key"])]
        ids: Vec<String>,
        /// Replay every dead letter of the queue.
        #[arg(long, conflicts_with = "key")]
        all: bool,
        /// Release the parked key `KEY` of an ordered handler: its dead-lettered message runs
        /// again, then the messages parked behind it, in their order, once each (see `idem
        /// dlq list` for the parked keys of a queue). `--queue` names the partition queue or
        /// the handler's own queue.
        #[arg(long, conflicts_with_all = ["to", "keep"])]
        key: Option<String>,
        /// Publish to this queue instead of the one each message was dead-lettered from.
        #[arg(long)]
        to: Option<String>,
        /// Leave the dead letters in the DLQ (copy rather than move).
        #[arg(long)]
        keep: bool,
        /// Replay dead letters beyond their dedup window too (their first failure is longer
        /// ago than their consumer's retention, or their record does not say): a copy applied
        /// meanwhile may have been swept from the inbox, and the message would then be
        /// applied twice.
        #[arg(long)]
        force: bool,
    },
    /// Release the parked key `KEY` of an ordered handler without its dead-lettered message:
    /// the message is removed from the DLQ and kept in the inbox's `_skipped` table with the
    /// reason, and the messages parked behind it run, in their order, once each. `--queue`
    /// names the partition queue or the handler's own queue.
    Skip {
        #[command(flatten)]
        queue: QueueArg,
        /// The parked key.
        #[arg(long)]
        key: String,
        /// Why it is skipped: kept with the message.
        #[arg(long)]
        reason: String,
    },
}

/// `idem inbox …`
#[derive(Debug, Subcommand)]
pub enum Inbox {
    /// Rows per consumer and status, the oldest row, rows expired but not yet swept, and
    /// dead-letter records per consumer.
    Stats,
    /// Everything the inbox holds for one key.
    Show {
        /// The consumer identity (`consumer = ...` of the handler).
        consumer: String,
        /// The dedup key.
        key: String,
    },
    /// Remove a key's row, redelivery count and dead-letter record: its next message is
    /// processed as new.
    Forget {
        /// The consumer identity.
        consumer: String,
        /// The dedup key.
        key: String,
    },
    /// Delete every expired row now, as the runtime's sweeper does.
    Sweep {
        /// Rows per delete statement.
        #[arg(long, default_value_t = 1000)]
        batch: u32,
    },
}

/// A timeout in seconds (fractions allowed): above 0, at most a day.
fn seconds(text: &str) -> Result<std::time::Duration, String> {
    let secs: f64 = text
        .trim()
        .parse()
        .map_err(|_| format!("`{text}` is not a number of seconds"))?;
    if secs > 0.0 && secs <= 86_400.0 {
        Ok(std::time::Duration::from_secs_f64(secs))
    } else {
        Err(format!(
            "`{text}`: give a number of seconds above 0 and at most 86400"
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::seconds;
    use std::time::Duration;

    #[test]
    fn a_timeout_is_a_positive_finite_number_of_seconds() {
        assert_eq!(seconds("30"), Ok(Duration::from_secs(30)));
        assert_eq!(seconds("0.5"), Ok(Duration::from_millis(500)));
        for wrong in ["0", "-1", "inf", "NaN", "1e9", "soon", ""] {
            let refused = seconds(wrong).unwrap_err();
            assert!(refused.contains(wrong), "{wrong}: {refused}");
        }
    }
}
