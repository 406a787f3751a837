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

/// Describes every metric to the installed recorder (units and help texts).
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(MESSAGES, "Deliveries settled, by consumer and outcome");
    describe_counter!(
        DEAD_LETTERS,
        "Deliveries dead-lettered, by consumer and reason"
    );
    describe_counter!(
        DEAD_LETTERS_UNRECORDED,
        "Dead letters moved without their record (it could not be written), by consumer"
    );
    describe_histogram!(HANDLER_DURATION, Unit::Seconds, "Time spent in the handler");
    describe_histogram!(
        CLAIM_DURATION,
        Unit::Seconds,
        "Time spent claiming dedup keys"
    );
    describe_histogram!(
        COMMIT_DURATION,
        Unit::Seconds,
        "Time spent committing the transaction of a message or a batch"
    );
    describe_counter!(ROWS_SWEPT, "Expired inbox rows deleted by the sweeper");
    describe_gauge!(
        SWEEPER_LAG,
        Unit::Seconds,
        "Age of the oldest expired inbox row left after a sweep"
    );
    describe_gauge!(INBOX_ROWS, "Inbox rows after the last sweep (estimated)");
    describe_gauge!(
        INBOX_OLDEST,
        Unit::Seconds,
        "Age of the inbox row that expires first, after the last sweep"
    );
    describe_gauge!(
        INBOX_EXPIRED,
        "Expired inbox rows the last sweep left (counted up to 1,000,000)"
    );
    describe_gauge!(
        SWEEP_BUSY,
        Unit::Seconds,
        "Time the last inbox sweep spent in its delete statements"
    );
    describe_gauge!(
        SWEEP_PAUSED,
        Unit::Seconds,
        "Time the last inbox sweep paused between its delete statements"
    );
    describe_counter!(PANICS, "Handler panics (the message is retried)");
    describe_counter!(
        SETTLE_FAILURES,
        "Settlements the transport could not send (the broker redelivers)"
    );
    describe_gauge!(MAILBOX_DEPTH, "Deliveries waiting in the handler's mailbox");
    describe_histogram!(
        BATCH_DELIVERIES,
        Unit::Count,
        "Deliveries per batch (below the batch size when the linger ended the gathering)"
    );
    describe_histogram!(
        BATCH_FILL,
        Unit::Seconds,
        "From a batch's first delivery until it was gathered (at most the linger)"
    );
    describe_histogram!(
        BATCH_WAIT,
        Unit::Seconds,
        "How long a batch worker ready for its next batch waited for that batch's first delivery"
    );
    describe_gauge!(
        BROKER_CONNECTED,
        "1 while the queue's consumer is consuming, else 0"
    );
    describe_counter!(
        RECONNECTS,
        "Lost connections or channels of the queue's consumer"
    );
    describe_gauge!(
        STORE_PAUSED,
        "1 while the store cannot write and its handlers' consumption is paused, else 0"
    );
    describe_counter!(
        STORE_PAUSES,
        "Times the store could not write and paused its handlers' consumption"
    );
    describe_counter!(OUTBOX_PUBLISHED, "Outbox messages published and removed");
    describe_counter!(
        OUTBOX_UNROUTABLE,
        "Outbox messages the broker could not route (kept and retried)"
    );
    describe_counter!(
        OUTBOX_PARKED,
        "Outbox rows the broker refused (unroutable, not carriable, nacked, a channel closed over them), parked"
    );
    describe_counter!(
        OUTBOX_GIVEN_UP,
        "Parked outbox rows the broker kept refusing, given up as outbox dead letters"
    );
    describe_gauge!(
        OUTBOX_LAG,
        Unit::Seconds,
        "How long the oldest outbox row a relay pass took had waited"
    );
    describe_counter!(
        OUTBOX_STAGED,
        "Messages staged by handlers that committed (replies included)"
    );
    describe_histogram!(
        OUTBOX_DISPATCH,
        Unit::Seconds,
        "From a commit that staged messages until the broker confirmed them"
    );
}

/// Counts `count` messages staged by `consumer` in a transaction that committed.
pub(crate) fn staged(consumer: &'static str, count: u64) {
    metrics::counter!(OUTBOX_STAGED, "consumer" => consumer).increment(count);
}

/// Records how long a dispatch took from its commit.
pub(crate) fn dispatched(store: &'static str, since_commit: Duration) {
    metrics::histogram!(OUTBOX_DISPATCH, "store" => store).record(since_commit.as_secs_f64());
}

/// Counts what one outbox pass (`by`: `dispatch` or `relay`) of `store` did.
pub(crate) fn relayed(store: &'static str, by: &'static str, report: &crate::outbox::RelayReport) {
    if report.published > 0 {
        metrics::counter!(OUTBOX_PUBLISHED, "store" => store, "by" => by)
            .increment(report.published);
    }
    if report.unroutable > 0 {
        metrics::counter!(OUTBOX_UNROUTABLE, "store" => store).increment(report.unroutable);
    }
    if report.parked > 0 {
        metrics::counter!(OUTBOX_PARKED, "store" => store).increment(report.parked);
    }
    if report.given_up > 0 {
        metrics::counter!(OUTBOX_GIVEN_UP, "store" => store).increment(report.given_up);
    }
    if let Some(oldest) = report.oldest.filter(|_| by == "relay") {
        metrics::gauge!(OUTBOX_LAG, "store" => store).set(oldest.as_secs_f64());
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

pub(crate) fn handler_duration(consumer: &'static str, elapsed: Duration) {
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
pub(crate) fn store_paused(store: crate::store::StoreKind, paused: bool) {
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

pub(crate) fn swept(store: &'static str, report: &crate::store::SweepReport) {
    metrics::counter!(ROWS_SWEPT, "store" => store).increment(report.deleted);
    metrics::gauge!(SWEEPER_LAG, "store" => store).set(report.lag.as_secs_f64());
    metrics::gauge!(INBOX_ROWS, "store" => store).set(report.rows as f64);
    metrics::gauge!(INBOX_OLDEST, "store" => store).set(report.oldest.as_secs_f64());
    metrics::gauge!(INBOX_EXPIRED, "store" => store).set(report.expired as f64);
    metrics::gauge!(SWEEP_BUSY, "store" => store).set(report.busy.as_secs_f64());
    metrics::gauge!(SWEEP_PAUSED, "store" => store).set(report.paused.as_secs_f64());
}
