//! The layer's own answers, as RFC 9457 problem details: a missing or malformed key (400), a
//! key still in use (409), a key reused for another request (422), and the failures of the
//! layer itself.

use axum_core::body::Body;
use http::{HeaderValue, Response, StatusCode, header};
use std::time::Duration;

/// One answer of the layer's own.
#[derive(Debug, Clone)]
pub(crate) struct Problem {
    status: StatusCode,
    title: &'static str,
    detail: String,
    retry_after: Option<Duration>,
}

impl Problem {
    /// A problem with `status`, a fixed `title` and a `detail` about this request.
    pub(crate) fn new(status: StatusCode, title: &'static str, detail: impl Into<String>) -> Self {
        Self {
            status,
            title,
            detail: detail.into(),
            retry_after: None,
        }
    }

    /// Tells the client when to try again (`Retry-After`, whole seconds, at least 1).
    pub(crate) fn retry_after(mut self, after: Duration) -> Self {
        self.retry_after = Some(after);
        self
    }

    /// The response: `application/problem+json`, with `Link: <policy>; rel="describedby"` when
    /// the layer was given a policy document, and the key's expiry in `key_expires_after`.
    pub(crate) fn into_response(self, policy: Option<&str>, expiry: Duration) -> Response<Body> {
        let body = serde_json::json!({
            "type": policy.unwrap_or("about:blank"),
            "title": self.title,
            "status": self.status.as_u16(),
            "detail": self.detail,
            "key_expires_after": expiry.as_secs(),
        });
        let mut response = Response::new(Body::from(body.to_string()));
        *response.status_mut() = self.status;
        let headers = response.headers_mut();
        headers.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/problem+json"),
        );
        if let Some(after) = self.retry_after {
            let seconds = after.as_secs() + u64::from(after.subsec_nanos() > 0);
            headers.insert(header::RETRY_AFTER, HeaderValue::from(seconds.max(1)));
        }
        if let Some(link) =
            policy.and_then(|p| HeaderValue::from_str(&format!("<{p}>; rel=\"describedby\"")).ok())
        {
            headers.insert(header::LINK, link);
        }
        response
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn carries_retry_after_and_the_policy() {
        let response = Problem::new(StatusCode::CONFLICT, "in progress", "wait")
            .retry_after(Duration::from_millis(1500))
            .into_response(
                Some("https://api.example/idempotency"),
                Duration::from_secs(86400),
            );
        assert_eq!(response.status(), 409);
        assert_eq!(response.headers()[header::RETRY_AFTER], "2");
        assert_eq!(
            response.headers()[header::LINK],
            "<https://api.example/idempotency>; rel=\"describedby\""
        );
        assert_eq!(
            response.headers()[header::CONTENT_TYPE],
            "application/problem+json"
        );
    }
}
