//! [`Settings`]: what every request of a built layer reads, whatever its mode, and their
//! defaults.

use crate::key::DEFAULT_MAX_KEY_LEN;
use http::request::Parts;
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// How long a key and its stored response are kept unless
/// [`Idempotency::retention`](crate::Idempotency::retention) says otherwise: 24 hours,
/// Stripe's policy.
pub const DEFAULT_KEY_RETENTION: Duration = Duration::from_secs(24 * 3600);

/// The largest request body the layer reads (it fingerprints the body) unless
/// [`Idempotency::max_request_bytes`](crate::Idempotency::max_request_bytes) says otherwise:
/// 2 MiB.
pub const DEFAULT_MAX_REQUEST_BYTES: usize = 2 * 1024 * 1024;

/// The largest response body stored for replay unless
/// [`Idempotency::max_response_bytes`](crate::Idempotency::max_response_bytes) says
/// otherwise: 256 KiB.
pub const DEFAULT_MAX_RESPONSE_BYTES: usize = 256 * 1024;

/// Finds the client a request comes from (e.g. the authenticated principal that an
/// authentication layer put in the request's extensions); `None`: the request is answered 401.
pub type IdentityFn = dyn Fn(&Parts) -> Option<String> + Send + Sync;

/// One operation's settings, apart from its mode.
pub(crate) struct Settings<S> {
    pub(crate) store: S,
    pub(crate) operation: String,
    pub(crate) identity: Option<Arc<IdentityFn>>,
    pub(crate) shared: bool,
    pub(crate) required: bool,
    pub(crate) max_key_len: usize,
    pub(crate) max_request_bytes: usize,
    pub(crate) max_response_bytes: usize,
    pub(crate) retention: Duration,
    pub(crate) policy: Option<String>,
    /// Response headers never stored nor replayed, besides those idem never stores.
    pub(crate) unstored: Vec<http::HeaderName>,
}

impl<S> Settings<S> {
    /// The defaults, for `operation` with keys in `store`.
    pub(crate) fn new(store: S, operation: String) -> Self {
        Self {
            store,
            operation,
            identity: None,
            shared: false,
            required: true,
            max_key_len: DEFAULT_MAX_KEY_LEN,
            max_request_bytes: DEFAULT_MAX_REQUEST_BYTES,
            max_response_bytes: DEFAULT_MAX_RESPONSE_BYTES,
            retention: DEFAULT_KEY_RETENTION,
            policy: None,
            unstored: Vec::new(),
        }
    }
}

impl<S> fmt::Debug for Settings<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Settings")
            .field("operation", &self.operation)
            .field("scoped_by_identity", &self.identity.is_some())
            .field("required", &self.required)
            .field("retention", &self.retention)
            .finish_non_exhaustive()
    }
}
