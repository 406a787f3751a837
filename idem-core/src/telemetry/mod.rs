//! What idem reports: one `delivery` span per delivery ([`delivery_span`]), and metrics
//! through the `metrics` facade: install any recorder (for example
//! `metrics-exporter-prometheus`, with the bucket bounds of [`HISTOGRAMS`]) to collect them;
//! without one they cost next to nothing.
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `idem_messages_total` | counter | `consumer`, `outcome`: `processed`, `duplicate`, `stale`, `conflict`, `rejected`, `retried`, `dead_lettered` (retries exhausted), `unavailable` (held while its store could not write, tried again as the same attempt), `parked` (stored behind its key's dead letter, an ordered handler's) |
//! | `idem_dead_letters_total` | counter | `consumer`, `reason` (the record's reason code) |
//! | `idem_dead_letters_unrecorded_total` | counter | `consumer`: dead letters moved without their record, which the store refused for a reason retrying will not fix (the reason is logged) |
//! | `idem_handler_duration_seconds` | histogram | `consumer` |
//! | `idem_claim_duration_seconds` | histogram | `consumer` (a claim, a lease, or a batch's claim) |
//! | `idem_commit_duration_seconds` | histogram | `consumer`: the commit of a transaction that processed a message or a batch |
//! | `idem_inbox_rows_swept_total` | counter | `store` |
//! | `idem_sweeper_lag_seconds` | gauge | `store`: age of the oldest expired row left after a sweep (the sweep gauges are NaN in a process that found another holding the sweeper's lock) |
//! | `idem_inbox_rows` | gauge | `store`: the inbox's rows after a sweep (PostgreSQL and MySQL: estimated from the table's statistics) |
//! | `idem_inbox_oldest_row_age_seconds` | gauge | `store`: age of the row that expires first, after a sweep |
//! | `idem_inbox_expired_rows` | gauge | `store`: expired rows a sweep left (up to 1,000,000): the sweeper falling behind |
//! | `idem_inbox_sweep_busy_seconds` | gauge | `store`: time the last sweep spent in its delete statements |
//! | `idem_inbox_sweep_paused_seconds` | gauge | `store`: time the last sweep paused between them, leaving the database to the consumers |
//! | `idem_handler_panics_total` | counter | `consumer` |
//! | `idem_settle_failures_total` | counter | `consumer`: settlements the transport could not send |
//! | `idem_mailbox_depth` | gauge | `consumer`: deliveries waiting in the handler's mailbox |
//! | `idem_batch_deliveries` | histogram | `consumer` (batch mode): deliveries per batch, below the batch size when the linger ended the gathering |
//! | `idem_batch_fill_seconds` | histogram | `consumer` (batch mode): from a batch's first delivery until it was gathered (at most the linger) |
//! | `idem_batch_wait_seconds` | histogram | `consumer` (batch mode): how long a worker ready for its next batch waited for that batch's first delivery |
//! | `idem_store_paused` | gauge | `store`: 1 while the store cannot write (read-only, full, restarting) and its handlers' consumption is paused, else 0 |
//! | `idem_store_pauses_total` | counter | `store`: times the store could not write and paused its handlers' consumption |
//! | `idem_broker_connected` | gauge | `queue`: 1 while its consumer is consuming, else 0 |
//! | `idem_reconnects_total` | counter | `queue`: lost connections or channels of its consumer |
//! | `idem_outbox_published_total` | counter | `store`, `by`: `dispatch` (right after the commit) or `relay` |
//! | `idem_outbox_unroutable_total` | counter | `store`: outbox messages the broker could not route (parked, tried again later) |
//! | `idem_outbox_parked_total` | counter | `store`: outbox rows the broker refused (unroutable, not carriable, nacked, a channel closed over them), parked and tried again later |
//! | `idem_outbox_given_up_total` | counter | `store`: parked outbox rows the broker kept refusing, given up as outbox dead letters (`idem outbox parked` lists them) |
//! | `idem_outbox_lag_seconds` | gauge | `store`: how long the oldest row a relay pass took had waited (every pass sets it: zero when it took none) |
//! | `idem_outbox_relay_failures_total` | counter | `store`: relay passes that failed (the database or the broker) |
//! | `idem_handlers_running` | gauge | `consumer`: handler calls under way |
//! | `idem_outbox_staged_total` | counter | `consumer`: messages staged by handlers that committed (replies included) |
//! | `idem_outbox_dispatch_seconds` | histogram | `store`: from a commit that staged messages until the broker confirmed them |
//! | `idem_parked_keys` | gauge | `consumer` (an ordered handler that parks keys): keys parked behind a dead-lettered message, read from its store every 15 s |
//! | `idem_parked_key_age_seconds` | gauge | `consumer`: how long its oldest parked key has waited (0 when none is) |
//!
//! The delivery span carries the W3C trace context of a message's `traceparent` header as the
//! fields `trace_id` and `parent_span_id`. With the `opentelemetry` feature and a
//! `tracing-opentelemetry` layer, the span is also a child of that remote span, and messages
//! staged in the outbox carry this consumer's context (no exporter is built in).

mod metrics;
mod redact;

pub use crate::model::reasons::REASONS;
pub use metrics::*;
pub use redact::redact_url;

use crate::model::{Envelope, Outcome};
use tracing::field;

/// The span of one delivery: consumer, message id, correlation id, attempt and the W3C trace
/// context of its `traceparent` header now; key and outcome once known ([`record_outcome`]).
/// With the `opentelemetry` feature it continues the trace the message's headers carry.
pub fn delivery_span(consumer: &str, envelope: &Envelope) -> tracing::Span {
    let span = tracing::info_span!(
        "delivery",
        consumer,
        message_id = envelope.message_id.as_deref(),
        correlation_id = envelope.correlation_id.as_deref(),
        attempt = envelope.attempt,
        trace_id = field::Empty,
        parent_span_id = field::Empty,
        key = field::Empty,
        outcome = field::Empty,
    );
    let traceparent = envelope
        .headers
        .get("traceparent")
        .and_then(|v| v.as_text());
    if let Some((trace_id, parent_span_id)) = traceparent.as_deref().and_then(trace_context) {
        span.record("trace_id", trace_id);
        span.record("parent_span_id", parent_span_id);
    }
    crate::model::propagation::continue_trace(&span, &envelope.headers);
    span
}

/// The trace id and parent span id of a W3C `traceparent` value
/// (`00-<32 hex>-<16 hex>-<2 hex>`), when it is valid.
fn trace_context(traceparent: &str) -> Option<(&str, &str)> {
    let mut parts = traceparent.trim().split('-');
    let (version, trace_id, parent, flags) =
        (parts.next()?, parts.next()?, parts.next()?, parts.next()?);
    let hex = |s: &str, len: usize| {
        s.len() == len
            && s.bytes()
                .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
    };
    let valid = hex(version, 2)
        && version != "ff"
        && hex(trace_id, 32)
        && hex(parent, 16)
        && hex(flags, 2)
        && trace_id.bytes().any(|b| b != b'0')
        && parent.bytes().any(|b| b != b'0');
    valid.then_some((trace_id, parent))
}

/// Records the key and outcome on a delivery's span.
pub fn record_outcome(span: &tracing::Span, outcome: &Outcome) {
    if let Some(key) = outcome.key() {
        span.record("key", key);
    }
    span.record("outcome", outcome.label());
}

#[cfg(test)]
mod tests {
    #[test]
    fn trace_context_of_a_traceparent() {
        use super::trace_context;
        assert_eq!(
            trace_context("00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"),
            Some(("4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"))
        );
        for bad in [
            "00-00000000000000000000000000000000-00f067aa0ba902b7-01",
            "00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
            "ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
            "00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
            "00-4bf92f-00f067aa0ba902b7-01",
            "garbage",
        ] {
            assert_eq!(trace_context(bad), None, "{bad}");
        }
    }
}
