//! [`Idempotency`]: what a route's idempotency layer is configured with, checked when the layer
//! is built.

use crate::mode::{External, Mode, Transactional};
use crate::settings::Settings;
use http::request::Parts;
use idem_core::{handler::DEFAULT_LEASE, store::RuntimeStore};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A wrong idempotency configuration, found when the layer is built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// Neither [`Idempotency::identity`] nor [`Idempotency::shared_key_space`] was called.
    #[error(
        "idempotency layer `{0}`: say whose keys are whose: call .identity(|parts| ...) with the \
         authenticated client (so that no client can be answered another client's stored \
         response), or .shared_key_space() if every client shares one key space"
    )]
    NoIdentity(String),
    /// The operation name is empty or too long.
    #[error("idempotency layer: the operation name must be 1 to 100 characters, got {0:?}")]
    Operation(String),
    /// A limit or a duration is zero.
    #[error("idempotency layer `{operation}`: {setting} must be more than zero")]
    Zero {
        /// The layer's operation.
        operation: String,
        /// The setting.
        setting: &'static str,
    },
    /// External mode: the retention is not longer than the lease, so the sweeper could delete a
    /// key still `in_progress`, and a retry would run the handler (its calls to other services)
    /// again.
    #[error(
        "idempotency layer `{operation}`: the retention ({retention:?}) must be longer than the lease ({lease:?}): a key still in progress could be swept and its handler run again; raise .retention(…) or shorten .lease(…)"
    )]
    RetentionWithinLease {
        /// The layer's operation.
        operation: String,
        /// The retention.
        retention: Duration,
        /// The lease.
        lease: Duration,
    },
    /// The key length limit exceeds what the inbox stores.
    #[error(
        "idempotency layer `{operation}`: max_key_len {len} exceeds {max}, the longest key the inbox stores with its client prefix"
    )]
    KeyTooLong {
        /// The layer's operation.
        operation: String,
        /// The limit asked for.
        len: usize,
        /// The largest allowed.
        max: usize,
    },
}

/// The idempotency of one operation (a route, or several routes that are one operation):
/// where keys are stored, whose keys they are, and how the handler commits (`M`:
/// [`Transactional`] or [`External`]). Build the layer with [`Idempotency::layer`].
///
/// ```no_run
/// # #[derive(Clone)] struct Principal(String);
/// # async fn f(pool: sqlx::SqlitePool) -> Result<(), Box<dyn std::error::Error>> {
/// use idem_http::Idempotency;
/// let layer = Idempotency::transactional(idem_sqlx::SqliteInbox::new(pool), "payments.create")
///     // The verified subject of the client's credential (here a request extension that the
///     // authentication middleware set), never the raw token.
///     .identity(|parts| parts.extensions.get::<Principal>().map(|p| p.0.clone()))
///     .layer()?;
/// # let _ = layer; Ok(()) }
/// ```
pub struct Idempotency<S, M> {
    pub(crate) settings: Settings<S>,
    pub(crate) mode: M,
}

impl<S: RuntimeStore> Idempotency<S, Transactional> {
    /// Transactional mode ([`Transactional`]) for `operation`, keys in `store`.
    pub fn transactional(store: S, operation: impl Into<String>) -> Self {
        Self::new(store, operation, Transactional)
    }
}

impl<S: RuntimeStore> Idempotency<S, External> {
    /// External mode ([`External`]) for `operation`, keys in `store`, with the default lease
    /// (30 s).
    pub fn external(store: S, operation: impl Into<String>) -> Self {
        Self::new(store, operation, External::new(DEFAULT_LEASE))
    }

    /// How long the lease of a key lasts while its handler runs: it must outlast the
    /// handler's longest run.
    pub fn lease(mut self, lease: Duration) -> Self {
        self.mode = External::new(lease);
        self
    }
}

impl<S: RuntimeStore, M> Idempotency<S, M> {
    fn new(store: S, operation: impl Into<String>, mode: M) -> Self {
        Self {
            settings: Settings::new(store, operation.into()),
            mode,
        }
    }

    /// Scopes keys by client: `identity` names the client of a request (the authenticated
    /// principal; the layer stores a digest of it, never the value); a request it names no
    /// client for is answered 401. Two clients using the same key are two requests.
    pub fn identity(
        mut self,
        identity: impl Fn(&Parts) -> Option<String> + Send + Sync + 'static,
    ) -> Self {
        self.settings.identity = Some(Arc::new(identity));
        self.settings.shared = false;
        self
    }

    /// One key space for every client: for services without client identities, where a key
    /// is a global name (a webhook's delivery id).
    pub fn shared_key_space(mut self) -> Self {
        self.settings.identity = None;
        self.settings.shared = true;
        self
    }

    /// Requests without an `Idempotency-Key` pass through unguarded, instead of being answered
    /// 400.
    pub fn optional(mut self) -> Self {
        self.settings.required = false;
        self
    }

    /// Never stores nor replays the response header `name` (beside `set-cookie` and the
    /// headers of one connection or transfer, which are never stored): for headers that belong
    /// to the session that got the response, not to the operation.
    pub fn never_store_header(mut self, name: http::HeaderName) -> Self {
        self.settings.unstored.push(name);
        self
    }

    /// The longest key accepted ([`DEFAULT_MAX_KEY_LEN`](crate::key::DEFAULT_MAX_KEY_LEN)); a longer one is answered 400.
    pub fn max_key_len(mut self, len: usize) -> Self {
        self.settings.max_key_len = len;
        self
    }

    /// The largest request body read ([`DEFAULT_MAX_REQUEST_BYTES`](crate::DEFAULT_MAX_REQUEST_BYTES)); a larger one is
    /// answered 413.
    pub fn max_request_bytes(mut self, bytes: usize) -> Self {
        self.settings.max_request_bytes = bytes;
        self
    }

    /// The largest response body stored ([`DEFAULT_MAX_RESPONSE_BYTES`](crate::DEFAULT_MAX_RESPONSE_BYTES)). In transactional
    /// mode a larger response is rolled back and answered 500; in external mode its status
    /// and headers are stored without the body.
    pub fn max_response_bytes(mut self, bytes: usize) -> Self {
        self.settings.max_response_bytes = bytes;
        self
    }

    /// How long a key and its response are kept ([`DEFAULT_KEY_RETENTION`](crate::DEFAULT_KEY_RETENTION)): the expiry
    /// policy. A key sent again after it expired is a new request. The rows are deleted by the
    /// inbox's retention sweeper (a `Runtime` on the same store, or [`crate::sweep_every`]).
    pub fn retention(mut self, retention: Duration) -> Self {
        self.settings.retention = retention;
        self
    }

    /// A document describing the operation's idempotency (the expiry policy, how to retry):
    /// the `type` of the layer's problem answers and their `Link: rel="describedby"`.
    pub fn policy(mut self, url: impl Into<String>) -> Self {
        self.settings.policy = Some(url.into());
        self
    }
}

impl<S, M: Mode> Idempotency<S, M> {
    /// Checks the configuration ([`Idempotency::layer`] calls it).
    pub(crate) fn check(&self) -> Result<(), ConfigError> {
        let settings = &self.settings;
        let operation = settings.operation.clone();
        if operation.is_empty() || operation.len() > 100 {
            return Err(ConfigError::Operation(operation));
        }
        if settings.identity.is_none() && !settings.shared {
            return Err(ConfigError::NoIdentity(operation));
        }
        let lease = self.mode.lease();
        for (setting, zero) in [
            ("max_key_len", settings.max_key_len == 0),
            ("max_request_bytes", settings.max_request_bytes == 0),
            ("max_response_bytes", settings.max_response_bytes == 0),
            ("retention", settings.retention.is_zero()),
            ("lease", lease.is_some_and(|lease| lease.is_zero())),
        ] {
            if zero {
                return Err(ConfigError::Zero { operation, setting });
            }
        }
        if let Some(lease) = lease
            && settings.retention <= lease
        {
            return Err(ConfigError::RetentionWithinLease {
                operation,
                retention: settings.retention,
                lease,
            });
        }
        // The stored key is `<22 base64url characters>:<key>`.
        let max = idem_core::model::MAX_KEY_LEN - 23;
        if settings.max_key_len > max {
            return Err(ConfigError::KeyTooLong {
                operation,
                len: settings.max_key_len,
                max,
            });
        }
        Ok(())
    }
}

impl<S, M: fmt::Debug> fmt::Debug for Idempotency<S, M> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Idempotency")
            .field("mode", &self.mode)
            .field("settings", &self.settings)
            .finish()
    }
}
