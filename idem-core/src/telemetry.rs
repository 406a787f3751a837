//! What idem reports: one `delivery` span per delivery ([`delivery_span`]), and metrics
//! through the `metrics` facade: install any recorder (for example
//! `metrics-exporter-prometheus`) to collect them; without one they cost next to nothing.
//!
//! | name | kind | labels |
//! |---|---|---|
//! | `idem_messages_total` | counter | `consumer`, `outcome`: `processed`, `duplicate`, `conflict`, `rejected`, `retried`, `dead_lettered` (retries exhausted) |
//! | `idem_dead_letters_total` | counter | `consumer`, `reason` (the `x-idem-reason` header) |
//! | `idem_handler_duration_seconds` | histogram | `consumer` |
//! | `idem_claim_duration_seconds` | histogram | `consumer` (a claim, a lease, or a batch's claim) |
//! | `idem_inbox_rows_swept_total` | counter | `store` |
//! | `idem_sweeper_lag_seconds` | gauge | `store`: age of the oldest expired row left after a sweep |

use crate::model::{Envelope, Outcome};
use std::time::Duration;
use tracing::field;

/// `url` with its password replaced by `***`, fit for logs and error messages: the password of
/// the user part (`scheme://user:password@host`) and a `password=` query parameter.
pub fn redact_url(url: &str) -> String {
    let mut redacted = match (url.find("://"), url.rfind('@')) {
        (Some(scheme), Some(at)) if at > scheme => {
            let userinfo = &url[scheme + 3..at];
            match userinfo.split_once(':') {
                Some((user, _)) => format!("{}{user}:***{}", &url[..scheme + 3], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    };
    if let Some(query) = redacted.find('?') {
        let (base, params) = redacted.split_at(query + 1);
        let params: Vec<String> = params
            .split('&')
            .map(|param| match param.split_once('=') {
                Some((name, _)) if name.eq_ignore_ascii_case("password") => format!("{name}=***"),
                _ => param.to_owned(),
            })
            .collect();
        redacted = format!("{base}{}", params.join("&"));
    }
    redacted
}

/// The span of one delivery: consumer, message id, correlation id and attempt now; key and
/// outcome once known ([`record_outcome`]).
pub fn delivery_span(consumer: &str, envelope: &Envelope) -> tracing::Span {
    tracing::info_span!(
        "delivery",
        consumer,
        message_id = envelope.message_id.as_deref(),
        correlation_id = envelope.correlation_id.as_deref(),
        attempt = envelope.attempt,
        key = field::Empty,
        outcome = field::Empty,
    )
}

/// Records the key and outcome on a delivery's span.
pub fn record_outcome(span: &tracing::Span, outcome: &Outcome) {
    if let Some(key) = outcome.key() {
        span.record("key", key);
    }
    span.record("outcome", outcome.label());
}

/// Deliveries settled, by consumer and outcome.
pub const MESSAGES: &str = "idem_messages_total";
/// Dead letters, by consumer and reason.
pub const DEAD_LETTERS: &str = "idem_dead_letters_total";
/// Time in the user's handler.
pub const HANDLER_DURATION: &str = "idem_handler_duration_seconds";
/// Time claiming keys.
pub const CLAIM_DURATION: &str = "idem_claim_duration_seconds";
/// Expired inbox rows deleted.
pub const ROWS_SWEPT: &str = "idem_inbox_rows_swept_total";
/// How far the sweeper is behind.
pub const SWEEPER_LAG: &str = "idem_sweeper_lag_seconds";

/// Describes every metric to the installed recorder (units and help texts).
pub fn describe() {
    use metrics::{Unit, describe_counter, describe_gauge, describe_histogram};
    describe_counter!(MESSAGES, "Deliveries settled, by consumer and outcome");
    describe_counter!(
        DEAD_LETTERS,
        "Deliveries dead-lettered, by consumer and reason"
    );
    describe_histogram!(HANDLER_DURATION, Unit::Seconds, "Time spent in the handler");
    describe_histogram!(
        CLAIM_DURATION,
        Unit::Seconds,
        "Time spent claiming dedup keys"
    );
    describe_counter!(ROWS_SWEPT, "Expired inbox rows deleted by the sweeper");
    describe_gauge!(
        SWEEPER_LAG,
        Unit::Seconds,
        "Age of the oldest expired inbox row left after a sweep"
    );
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

pub(crate) fn handler_duration(consumer: &'static str, elapsed: Duration) {
    metrics::histogram!(HANDLER_DURATION, "consumer" => consumer).record(elapsed.as_secs_f64());
}

pub(crate) fn claim_duration(consumer: &'static str, elapsed: Duration) {
    metrics::histogram!(CLAIM_DURATION, "consumer" => consumer).record(elapsed.as_secs_f64());
}

pub(crate) fn swept(store: &'static str, rows: u64, lag: Duration) {
    metrics::counter!(ROWS_SWEPT, "store" => store).increment(rows);
    metrics::gauge!(SWEEPER_LAG, "store" => store).set(lag.as_secs_f64());
}

#[cfg(test)]
mod tests {
    use super::redact_url;

    #[test]
    fn passwords_are_redacted() {
        for (url, redacted) in [
            (
                "amqp://guest:secret@h:5672/%2f",
                "amqp://guest:***@h:5672/%2f",
            ),
            ("amqp://h:5672", "amqp://h:5672"),
            ("postgres://app@db/x", "postgres://app@db/x"),
            (
                "postgres://app:p%40ss@db/x?sslmode=require",
                "postgres://app:***@db/x?sslmode=require",
            ),
            (
                "postgres://db/x?user=app&password=secret&x=1",
                "postgres://db/x?user=app&password=***&x=1",
            ),
            ("sqlite://orders.db", "sqlite://orders.db"),
        ] {
            assert_eq!(redact_url(url), redacted);
        }
    }
}
