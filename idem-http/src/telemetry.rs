//! The layer's metrics: `idem_http_requests_total{operation, result}`.

/// Requests seen by an idempotency layer, by operation and result.
pub const REQUESTS: &str = "idem_http_requests_total";

/// What the layer did with a request, as the `result` label says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Result {
    /// The handler ran and its response was stored.
    Executed,
    /// The handler ran; its response was not stored (not executed, or not recorded).
    NotStored,
    /// A stored response was replayed.
    Replayed,
    /// The key was in use by a request still running: 409.
    InProgress,
    /// The key was used for another request: 422.
    Mismatch,
    /// No key, or a malformed one: 400.
    BadKey,
    /// The body was too large to fingerprint: 413.
    TooLarge,
    /// The store failed: 503.
    Unavailable,
    /// No key on a route where keys are optional: passed through.
    Unkeyed,
    /// The identity function named no client: 401.
    Anonymous,
}

impl Result {
    fn label(self) -> &'static str {
        match self {
            Self::Executed => "executed",
            Self::NotStored => "not_stored",
            Self::Replayed => "replayed",
            Self::InProgress => "in_progress",
            Self::Mismatch => "mismatch",
            Self::BadKey => "bad_key",
            Self::TooLarge => "too_large",
            Self::Unavailable => "unavailable",
            Self::Unkeyed => "unkeyed",
            Self::Anonymous => "anonymous",
        }
    }
}

/// Counts one request of `operation`.
pub(crate) fn request(operation: &str, result: Result) {
    metrics::counter!(REQUESTS, "operation" => operation.to_owned(), "result" => result.label())
        .increment(1);
    tracing::Span::current().record("result", result.label());
}
