//! A response as the inbox row keeps it, and the replay built from it.

use axum_core::body::Body;
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD as BASE64;
use bytes::Bytes;
use http::response::Parts;
use http::{HeaderName, HeaderValue, Response, StatusCode};
use serde::{Deserialize, Serialize};

/// The response header that marks a replay of a stored response.
pub const REPLAYED: &str = "idempotent-replayed";

/// Headers never stored: those that describe one connection or one transfer, not the response,
/// and `set-cookie`, which belongs to the session that got the response (replayed, it would
/// hand one client's cookie to another under `shared_key_space()`). More can be named with
/// [`crate::Idempotency::never_store_header`].
const NOT_STORED: [&str; 10] = [
    "set-cookie",
    "connection",
    "content-length",
    "date",
    "keep-alive",
    "proxy-connection",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

/// A response kept on its inbox row (as JSON in the row's `outcome`): status, the headers that
/// belong to the response, and the body, as text when it is UTF-8 and in base64 otherwise.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredResponse {
    /// The status code.
    pub status: u16,
    /// `(name, value)`; a value that is not UTF-8 is kept in base64 with `binary` set.
    pub headers: Vec<StoredHeader>,
    /// The body as text, when it is UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body: Option<String>,
    /// The body in base64, when it is not UTF-8.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub body_base64: Option<String>,
    /// The body was larger than the limit and is not kept (external mode, where the handler's
    /// effects cannot be undone; a replay answers the status and headers with an empty body).
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub body_omitted: bool,
}

/// One stored header.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StoredHeader {
    /// The name, lower case.
    pub name: String,
    /// The value (base64 when `binary`).
    pub value: String,
    /// The value is not UTF-8 and is kept in base64.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub binary: bool,
}

impl StoredResponse {
    /// Captures a response's status, headers (but those never stored, and `unstored`) and
    /// body.
    pub fn capture(parts: &Parts, body: &Bytes, unstored: &[HeaderName]) -> Self {
        let headers = parts
            .headers
            .iter()
            .filter(|(name, _)| {
                !NOT_STORED.contains(&name.as_str())
                    && name.as_str() != REPLAYED
                    && !unstored.contains(name)
            })
            .map(|(name, value)| match value.to_str() {
                Ok(text) => StoredHeader {
                    name: name.as_str().to_owned(),
                    value: text.to_owned(),
                    binary: false,
                },
                Err(_) => StoredHeader {
                    name: name.as_str().to_owned(),
                    value: BASE64.encode(value.as_bytes()),
                    binary: true,
                },
            })
            .collect();
        let (body, body_base64) = match std::str::from_utf8(body) {
            Ok(text) => (Some(text.to_owned()), None),
            Err(_) => (None, Some(BASE64.encode(body))),
        };
        Self {
            status: parts.status.as_u16(),
            headers,
            body,
            body_base64,
            body_omitted: false,
        }
    }

    /// Captures status and headers only: the body was too large to keep.
    pub fn without_body(parts: &Parts, unstored: &[HeaderName]) -> Self {
        Self {
            body: None,
            body_omitted: true,
            ..Self::capture(parts, &Bytes::new(), unstored)
        }
    }

    /// The replay: the stored status, headers and body, marked `Idempotent-Replayed: true`.
    /// `None` when the stored data is not a response (a status out of range, a bad header).
    pub fn replay(&self) -> Option<Response<Body>> {
        let body = match (&self.body, &self.body_base64) {
            (Some(text), _) => Bytes::from(text.clone()),
            (None, Some(encoded)) => Bytes::from(BASE64.decode(encoded).ok()?),
            (None, None) => Bytes::new(),
        };
        let mut response = Response::new(Body::from(body));
        *response.status_mut() = StatusCode::from_u16(self.status).ok()?;
        let headers = response.headers_mut();
        for header in &self.headers {
            let name = HeaderName::from_bytes(header.name.as_bytes()).ok()?;
            let value = match header.binary {
                false => HeaderValue::from_str(&header.value).ok()?,
                true => HeaderValue::from_bytes(&BASE64.decode(&header.value).ok()?).ok()?,
            };
            headers.append(name, value);
        }
        headers.insert(REPLAYED, HeaderValue::from_static("true"));
        Some(response)
    }

    /// Whether the status is a server error (5xx): external mode records it as `failed`.
    pub fn is_server_error(&self) -> bool {
        self.status >= 500
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parts(response: Response<()>) -> Parts {
        response.into_parts().0
    }

    #[test]
    fn keeps_what_belongs_to_the_response_and_never_a_cookie() {
        let response = Response::builder()
            .status(201)
            .header("content-type", "application/json")
            .header("location", "/payments/1")
            .header("set-cookie", "a=1")
            .header("set-cookie", "b=2")
            .header("x-session", "s-1")
            .header("date", "Tue, 01 Dec 2026 00:00:00 GMT")
            .header("content-length", "12")
            .header("x-binary", HeaderValue::from_bytes(b"\xff\xfe").unwrap())
            .body(())
            .unwrap();
        let unstored = [HeaderName::from_static("x-session")];
        let stored = StoredResponse::capture(
            &parts(response),
            &Bytes::from_static(b"{\"id\":\"1\"}"),
            &unstored,
        );
        let json = serde_json::to_string(&stored).unwrap();
        let back: StoredResponse = serde_json::from_str(&json).unwrap();
        assert_eq!(back, stored);
        let replay = back.replay().unwrap();
        assert_eq!(replay.status(), 201);
        let headers = replay.headers();
        assert_eq!(headers["content-type"], "application/json");
        assert!(
            headers.get("set-cookie").is_none(),
            "a cookie is never stored"
        );
        assert!(
            headers.get("x-session").is_none(),
            "nor a header named never to be"
        );
        assert_eq!(headers["x-binary"].as_bytes(), b"\xff\xfe");
        assert_eq!(headers[REPLAYED], "true");
        assert!(headers.get("date").is_none() && headers.get("content-length").is_none());
    }

    #[test]
    fn keeps_bodies_that_are_not_text() {
        let body = Bytes::from_static(b"\x00\xff\x10");
        let stored = StoredResponse::capture(&parts(Response::new(())), &body, &[]);
        assert!(stored.body.is_none());
        let replay = stored.replay().unwrap();
        let bytes = futures_bytes(replay.into_body());
        assert_eq!(bytes, body);
    }

    fn futures_bytes(body: Body) -> Bytes {
        use http_body_util::BodyExt as _;
        tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap()
            .block_on(body.collect())
            .unwrap()
            .to_bytes()
    }
}
