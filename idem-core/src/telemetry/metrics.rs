//! The metrics idem records (the table in the module above lists them), and the functions
//! that record them.

use std::time::Duration;

/// Deliveries settled, by consumer and outcome.
pub const MESSAGES: &str = "idem_messages_total";
/// Dead letters, by consumer and reason.
pub const DEAD_LETTERS: &str = "idem_dead_letters_total";
/// Dead letters moved without their record in the store (it could not be written for a reason
/// that retrying will not fix), by consumer: their reason is only in their headers.
pub const DEAD_LETTERS_UNRECORDED: &str = "idem_dead_letters_unrecorded_total";
/// Time in the user's handler.
pub const HANDLER_DURATION: &str = "idem_handler_duration_seconds";
/// Time claiming keys.
pub const CLAIM_DURATION: &str = "idem_claim_duration_seconds";
/// Time committing a transaction that processed a message or a batch.
pub const COMMIT_DURATION: &str = "idem_commit_duration_seconds";
/// Expired inbox rows deleted.
pub const ROWS_SWEPT: &str = "idem_inbox_rows_swept_total";
/// How far the sweeper is behind.
pub const SWEEPER_LAG: &str = "idem_sweeper_lag_seconds";
/// The inbox's rows (estimated), after the last sweep.
pub const INBOX_ROWS: &str = "idem_inbox_rows";
/// The age of the inbox row that expires first, after the last sweep.
pub const INBOX_OLDEST: &str = "idem_inbox_oldest_row_age_seconds";
/// Expired inbox rows not yet deleted, after the last sweep.
pub const INBOX_EXPIRED: &str = "idem_inbox_expired_rows";
/// Time the last sweep spent deleting.
pub const SWEEP_BUSY: &str = "idem_inbox_sweep_busy_seconds";
/// Time the last sweep paused between its delete statements.
pub const SWEEP_PAUSED: &str = "idem_inbox_sweep_paused_seconds";
/// Handler panics.
pub const PANICS: &str = "idem_handler_panics_total";
/// Settlements the transport could not send.
pub const SETTLE_FAILURES: &str = "idem_settle_failures_total";
/// Deliveries waiting in a handler's mailbox.
pub const MAILBOX_DEPTH: &str = "idem_mailbox_depth";
/// Deliveries per batch (batch mode).
pub const BATCH_DELIVERIES: &str = "idem_batch_deliveries";
/// From a batch's first delivery until it was gathered (batch mode).
pub const BATCH_FILL: &str = "idem_batch_fill_seconds";
/// How long a batch worker waited for its next batch's first delivery (batch mode).
pub const BATCH_WAIT: &str = "idem_batch_wait_seconds";
/// Whether a queue's consumer is consuming.
pub const BROKER_CONNECTED: &str = "idem_broker_connected";
/// Lost connections or channels of a queue's consumer.
pub const RECONNECTS: &str = "idem_reconnects_total";

/// Whether a store cannot write for now, and its handlers' consumption is paused.
pub const STORE_PAUSED: &str = "idem_store_paused";
/// Times a store could not write and paused its handlers' consumption.
pub const STORE_PAUSES: &str = "idem_store_pauses_total";

/// Outbox messages published and removed.
pub const OUTBOX_PUBLISHED: &str = "idem_outbox_published_total";
/// Outbox messages the broker could not route.
pub const OUTBOX_UNROUTABLE: &str = "idem_outbox_unroutable_total";
/// Outbox rows the broker refused, parked out of the relay's way.
pub const OUTBOX_PARKED: &str = "idem_outbox_parked_total";
/// Parked outbox rows given up (outbox dead letters).
pub const OUTBOX_GIVEN_UP: &str = "idem_outbox_given_up_total";
/// How long the oldest outbox row a relay pass took had waited.
pub const OUTBOX_LAG: &str = "idem_outbox_lag_seconds";
/// Messages staged by handlers that committed.
pub const OUTBOX_STAGED: &str = "idem_outbox_staged_total";
/// From a commit that staged messages until the broker confirmed them.
pub const OUTBOX_DISPATCH: &str = "idem_outbox_dispatch_seconds";
/// Outbox relay passes that failed (the database or the broker); the lag is not known then.
pub const OUTBOX_RELAY_FAILURES: &str = "idem_outbox_relay_failures_total";
/// Handler calls under way.
pub const HANDLERS_RUNNING: &str = "idem_handlers_running";
/// An ordered handler's keys parked behind a dead-lettered message.
pub const PARKED_KEYS: &str = "idem_parked_keys";
/// How long the oldest parked key of an ordered handler has waited.
pub const PARKED_AGE: &str = "idem_parked_key_age_seconds";

/// Bucket bounds, in seconds, for the durations idem records: from half a millisecond (a claim
/// on a local database) to half a minute (a handler calling a slow service).
pub const DURATION_BUCKETS: &[f64] = &[
    0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0,
];

/// Bucket bounds for [`BATCH_DELIVERIES`], in deliveries.
pub const BATCH_SIZE_BUCKETS: &[f64] =
    &[1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0, 200.0, 500.0, 1000.0];

/// Every histogram idem records, with its bucket bounds. An exporter that renders histograms
/// as buckets (Prometheus's `histogram_quantile`, which the dashboard uses) needs them set per
/// metric; `idem::telemetry::prometheus()` (feature `prometheus`) sets them all.
pub const HISTOGRAMS: &[(&str, &[f64])] = &[
    (HANDLER_DURATION, DURATION_BUCKETS),
    (CLAIM_DURATION, DURATION_BUCKETS),
    (COMMIT_DURATION, DURATION_BUCKETS),
    (OUTBOX_DISPATCH, DURATION_BUCKETS),
    (BATCH_FILL, DURATION_BUCKETS),
    (BATCH_WAIT, DURATION_BUCKETS),
    (BATCH_DELIVERIES, BATCH_SIZE_BUCKETS),
];

/// Each counter, with its help text.
const COUNTER_HELP: [(&str, &str); 14] = [
    (MESSAGES, "Deliveries settled, by consumer and outcome"),
    (
        DEAD_LETTERS,
        "Deliveries dead-lettered, by consumer and reason",
    ),
    (
        DEAD_LETTERS_UNRECORDED,
        "Dead letters moved without their record (it could not be written), by consumer",
    ),
    (ROWS_SWEPT, "Expired inbox rows deleted by the sweeper"),
    (PANICS, "Handler panics (the message is retried)"),
    (
        SETTLE_FAILURES,
        "Settlements the transport could not send (the broker redelivers)",
    ),
    (
        RECONNECTS,
        "Lost connections or channels of the queue's consumer",
    ),
    (
        STORE_PAUSES,
        "Times the store could not write and paused its handlers' consumption",
    ),
    (OUTBOX_PUBLISHED, "Outbox messages published and removed"),
    (
        OUTBOX_UNROUTABLE,
        "Outbox messages the broker could not route (kept and retried)",
    ),
    (
        OUTBOX_PARKED,
        "Outbox rows the broker refused (unroutable, not carriable, nacked, a channel closed over them), parked",
    ),
    (
        OUTBOX_GIVEN_UP,
        "Parked outbox rows the broker kept refusing, given up as outbox dead letters",
    ),
    (
        OUTBOX_STAGED,
        "Messages staged by handlers that committed (replies included)",
    ),
    (
        OUTBOX_RELAY_FAILURES,
        "Outbox relay passes that failed (the database or the broker)",
    ),
];

/// Each gauge, with its unit where it has one, and its help text.
const GAUGE_HELP: [(&str, Option<metrics::Unit>, &str); 13] = [
    (
        SWEEPER_LAG,
        Some(metrics::Unit::Seconds),
        "Age of the oldest expired inbox row left after a sweep",
    ),
    (
        INBOX_ROWS,
        None,
        "Inbox rows after the last sweep (estimated)",
    ),
    (
        INBOX_OLDEST,
        Some(metrics::Unit::Seconds),
        "Age of the inbox row that expires first, after the last sweep",
    ),
    (
        INBOX_EXPIRED,
        None,
        "Expired inbox rows the last sweep left (counted up to 1,000,000)",
    ),
    (
        SWEEP_BUSY,
        Some(metrics::Unit::Seconds),
        "Time the last inbox sweep spent in its delete statements",
    ),
    (
        SWEEP_PAUSED,
        Some(metrics::Unit::Seconds),
        "Time the last inbox sweep paused between its delete statements",
    ),
    (
        MAILBOX_DEPTH,
        None,
        "Deliveries waiting in the handler's mailbox",
    ),
    (
        BROKER_CONNECTED,
        None,
        "1 while the queue's consumer is consuming, else 0",
    ),
    (
        STORE_PAUSED,
        None,
        "1 while the store cannot write and its handlers' consumption is paused, else 0",
    ),
    (
        OUTBOX_LAG,
        Some(metrics::Unit::Seconds),
        "How long the oldest outbox row a relay pass took had waited",
    ),
    (
        PARKED_KEYS,
        None,
        "Keys of the ordered handler parked behind a dead-lettered message",
    ),
    (
        PARKED_AGE,
        Some(metrics::Unit::Seconds),
        "How long the handler's oldest parked key has waited (0: none is parked)",
    ),
    (HANDLERS_RUNNING, None, "Handler calls under way"),
];

/// Each histogram, with its unit and help text.
const HISTOGRAM_HELP: [(&str, metrics::Unit, &str); 7] = [
    (
        HANDLER_DURATION,
        metrics::Unit::Seconds,
        "Time spent in the handler",
    ),
    (
        CLAIM_DURATION,
        metrics::Unit::Seconds,
        "Time spent claiming dedup keys",
    ),
    (
        COMMIT_DURATION,
        metrics::Unit::Seconds,
        "Time spent committing the transaction of a message or a batch",
    ),
    (
        BATCH_DELIVERIES,
        metrics::Unit::Count,
        "Deliveries per batch (below the batch size when the linger ended the gathering)",
    ),
    (
        BATCH_FILL,
        metrics::Unit::Seconds,
        "From a batch's first delivery until it was gathered (at most the linger)",
    ),
    (
        BATCH_WAIT,
        metrics::Unit::Seconds,
        "How long a batch worker ready for its next batch waited for that batch's first delivery",
    ),
    (
        OUTBOX_DISPATCH,
        metrics::Unit::Seconds,
        "From a commit that staged messages until the broker confirmed them",
    ),
];

/// Describes every metric to the installed recorder (units and help texts).
pub fn describe() {
    use metrics::{describe_counter, describe_gauge, describe_histogram};
    for (name, help) in COUNTER_HELP {
        describe_counter!(name, help);
    }
    for (name, unit, help) in GAUGE_HELP {
        match unit {
            Some(unit) => describe_gauge!(name, unit, help),
            None => describe_gauge!(name, help),
        }
    }
    for (name, unit, help) in HISTOGRAM_HELP {
        describe_histogram!(name, unit, help);
    }
}

/// Counts `count` messages staged by `consumer` in a transaction that committed.
pub(crate) fn staged(consumer: &'static str, count: u64) {
    metrics::counter!(OUTBOX_STAGED, "consumer" => consumer).increment(count);
}

/// Records how long a dispatch took from its commit.
pub(crate) fn dispatched(store: &'static str, since_commit: Duration) {
    metrics::histogram!(OUTBOX_DISPATCH, "store" => store).record(since_commit.as_secs_f64());
}

/// Counts a relay pass of `store` that failed.
pub(crate) fn relay_failed(store: &'static str) {
    metrics::counter!(OUTBOX_RELAY_FAILURES, "store" => store).increment(1);
}

/// A handler call under way, counted in [`HANDLERS_RUNNING`] until it is ended or dropped (a
/// panic, a cancelled delivery); [`HandlerRun::end`] records its duration.
pub(crate) struct HandlerRun {
    consumer: &'static str,
    started: std::time::Instant,
}

impl HandlerRun {
    pub(crate) fn start(consumer: &'static str) -> Self {
        metrics::gauge!(HANDLERS_RUNNING, "consumer" => consumer).increment(1.0);
        Self {
            consumer,
            started: std::time::Instant::now(),
        }
    }

    /// Records the call's duration.
    pub(crate) fn end(self) {
        handler_duration(self.consumer, self.started.elapsed());
    }
}

impl Drop for HandlerRun {
    fn drop(&mut self) {
        metrics::gauge!(HANDLERS_RUNNING, "consumer" => self.consumer).decrement(1.0);
    }
}

pub(crate) fn message(consumer: &'static str, outcome: &'static str) {
    metrics::counter!(MESSAGES, "consumer" => consumer, "outcome" => outcome).increment(1);
}

/// Counts a dead letter of `consumer` for `reason`; transports call it for the deliveries they
/// dead-letter themselves (a delivery the AMQP client cannot parse).
pub fn dead_letter(consumer: &str, reason: &str) {
    metrics::counter!(DEAD_LETTERS, "consumer" => consumer.to_owned(), "reason" => reason.to_owned())
        .increment(1);
}

/// Counts a dead letter of `consumer` moved without its record in the store; transports call
/// it for the deliveries they dead-letter themselves.
pub fn dead_letter_unrecorded(consumer: &str) {
    metrics::counter!(DEAD_LETTERS_UNRECORDED, "consumer" => consumer.to_owned()).increment(1);
}

fn handler_duration(consumer: &'static str, elapsed: Duration) {
    metrics::histogram!(HANDLER_DURATION, "consumer" => consumer).record(elapsed.as_secs_f64());
}

pub(crate) fn claim_duration(consumer: &'static str, elapsed: Duration) {
    metrics::histogram!(CLAIM_DURATION, "consumer" => consumer).record(elapsed.as_secs_f64());
}

pub(crate) fn commit_duration(consumer: &'static str, elapsed: Duration) {
    metrics::histogram!(COMMIT_DURATION, "consumer" => consumer).record(elapsed.as_secs_f64());
}

pub(crate) fn panicked(consumer: &'static str) {
    metrics::counter!(PANICS, "consumer" => consumer).increment(1);
}

pub(crate) fn settle_failed(consumer: &'static str) {
    metrics::counter!(SETTLE_FAILURES, "consumer" => consumer).increment(1);
}

pub(crate) fn mailbox_depth(consumer: &'static str, depth: usize) {
    metrics::gauge!(MAILBOX_DEPTH, "consumer" => consumer).set(depth as f64);
}

/// Records a batch of `deliveries` whose first delivery came `waited` after its worker was
/// ready for it, and which was gathered `filled_in` after that first delivery.
pub(crate) fn batch_gathered(
    consumer: &'static str,
    deliveries: usize,
    waited: Duration,
    filled_in: Duration,
) {
    metrics::histogram!(BATCH_DELIVERIES, "consumer" => consumer).record(deliveries as f64);
    metrics::histogram!(BATCH_WAIT, "consumer" => consumer).record(waited.as_secs_f64());
    metrics::histogram!(BATCH_FILL, "consumer" => consumer).record(filled_in.as_secs_f64());
}

/// Records whether `store` is paused (it cannot write for now); a pause is counted too.
pub(crate) fn store_paused(store: crate::model::StoreKind, paused: bool) {
    let label = store.label();
    metrics::gauge!(STORE_PAUSED, "store" => label).set(if paused { 1.0 } else { 0.0 });
    if paused {
        metrics::counter!(STORE_PAUSES, "store" => label).increment(1);
    }
}

/// Records whether `queue`'s consumer is consuming; transports call it.
pub fn broker_connected(queue: &str, connected: bool) {
    let value = if connected { 1.0 } else { 0.0 };
    metrics::gauge!(BROKER_CONNECTED, "queue" => queue.to_owned()).set(value);
}

/// Counts a lost connection or channel of `queue`'s consumer; transports call it.
pub fn reconnect(queue: &str) {
    metrics::counter!(RECONNECTS, "queue" => queue.to_owned()).increment(1);
}

/// The gauges a sweep sets.
pub(crate) const SWEEP_GAUGES: [&str; 6] = [
    SWEEPER_LAG,
    INBOX_ROWS,
    INBOX_OLDEST,
    INBOX_EXPIRED,
    SWEEP_BUSY,
    SWEEP_PAUSED,
];

/// Records `consumer`'s parked keys: how many, and how long the oldest has waited.
pub(crate) fn parked_keys(consumer: &'static str, keys: u64, oldest: Duration) {
    metrics::gauge!(PARKED_KEYS, "consumer" => consumer).set(keys as f64);
    metrics::gauge!(PARKED_AGE, "consumer" => consumer).set(oldest.as_secs_f64());
}

/// Marks `store`'s sweep gauges as not this process's to tell: another process holds the
/// sweeper's lock. They are set to NaN, which Prometheus's `max` and comparisons pass over, so
/// the value of a sweep this process made earlier does not stay behind as if it were current.
pub(crate) fn not_sweeping(store: &'static str) {
    for gauge in SWEEP_GAUGES {
        metrics::gauge!(gauge, "store" => store).set(f64::NAN);
    }
}

/// A recorder for unit tests: keeps each counter's and gauge's value by name and labels, and
/// the names of the histograms described to it. Install it on the test's thread with
/// `metrics::set_default_local_recorder` (a current-thread tokio test runs its tasks there).
#[cfg(test)]
pub(crate) mod captured {
    use metrics::{
        Counter, Gauge, Histogram, Key, KeyName, Metadata, Recorder, SharedString, Unit,
    };
    use std::collections::HashMap;
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::sync::{Arc, Mutex};

    #[derive(Default)]
    pub(crate) struct Captured {
        values: Mutex<HashMap<String, Arc<AtomicU64>>>,
        pub(crate) histograms: Mutex<Vec<String>>,
    }

    impl Captured {
        /// `name{label}` as `name{k=v,…}` (labels in their order).
        fn id(key: &Key) -> String {
            let labels: Vec<String> = key
                .labels()
                .map(|l| format!("{}={}", l.key(), l.value()))
                .collect();
            format!("{}{{{}}}", key.name(), labels.join(","))
        }

        fn cell(&self, key: &Key) -> Arc<AtomicU64> {
            let mut values = self.values.lock().unwrap_or_else(|e| e.into_inner());
            values.entry(Self::id(key)).or_default().clone()
        }

        /// The gauge `series` (`name{k=v}`), if it was set.
        pub(crate) fn gauge(&self, series: &str) -> Option<f64> {
            let values = self.values.lock().unwrap_or_else(|e| e.into_inner());
            values
                .get(series)
                .map(|v| f64::from_bits(v.load(Ordering::SeqCst)))
        }

        /// The counter `series` (`name{k=v}`), if it was counted.
        pub(crate) fn counter(&self, series: &str) -> Option<u64> {
            let values = self.values.lock().unwrap_or_else(|e| e.into_inner());
            values.get(series).map(|v| v.load(Ordering::SeqCst))
        }
    }

    impl Recorder for Captured {
        fn describe_counter(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_gauge(&self, _: KeyName, _: Option<Unit>, _: SharedString) {}
        fn describe_histogram(&self, key: KeyName, _: Option<Unit>, _: SharedString) {
            let mut histograms = self.histograms.lock().unwrap_or_else(|e| e.into_inner());
            histograms.push(key.as_str().to_owned());
        }
        fn register_counter(&self, key: &Key, _: &Metadata<'_>) -> Counter {
            Counter::from_arc(self.cell(key))
        }
        fn register_gauge(&self, key: &Key, _: &Metadata<'_>) -> Gauge {
            Gauge::from_arc(self.cell(key))
        }
        fn register_histogram(&self, _: &Key, _: &Metadata<'_>) -> Histogram {
            Histogram::noop()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::captured::Captured;
    use super::*;

    #[test]
    fn every_histogram_has_its_buckets() {
        let captured = Captured::default();
        metrics::with_local_recorder(&captured, describe);
        let mut described = captured.histograms.into_inner().unwrap();
        described.sort();
        let mut bucketed: Vec<String> = HISTOGRAMS.iter().map(|(n, _)| (*n).to_owned()).collect();
        bucketed.sort();
        assert_eq!(described, bucketed);
        for (name, buckets) in HISTOGRAMS {
            assert!(
                buckets.windows(2).all(|w| w[0] < w[1]),
                "{name}: bounds must rise"
            );
        }
    }

    #[test]
    fn a_handler_run_is_counted_while_it_lasts_even_when_it_unwinds() {
        let captured = Captured::default();
        let running = "idem_handlers_running{consumer=c}";
        metrics::with_local_recorder(&captured, || {
            let first = HandlerRun::start("c");
            let second = HandlerRun::start("c");
            assert_eq!(captured.gauge(running), Some(2.0));
            first.end();
            assert_eq!(captured.gauge(running), Some(1.0));
            drop(second); // a panic or a cancelled delivery drops it
            assert_eq!(captured.gauge(running), Some(0.0));
        });
    }
}
