//! Connection and topology settings.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// The RabbitMQ queue type of the handler queues (and their DLQ and retry queues).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
#[non_exhaustive]
pub enum QueueType {
    /// Classic queues (single node).
    #[default]
    Classic,
    /// Quorum queues: replicated across a cluster, with a delivery limit and at-least-once
    /// dead-lettering.
    Quorum,
}

impl QueueType {
    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Classic => "classic",
            Self::Quorum => "quorum",
        }
    }
}

/// The type of an exchange [`RabbitConfig::bind`] declares.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum ExchangeKind {
    /// Routes to the queues bound with the message's routing key.
    Direct,
    /// Routes to every bound queue.
    Fanout,
    /// Routes by pattern (`orders.*`, `#.eu`) on the routing key.
    Topic,
    /// Routes by header values.
    Headers,
}

impl ExchangeKind {
    pub(crate) fn lapin(self) -> lapin::ExchangeKind {
        match self {
            Self::Direct => lapin::ExchangeKind::Direct,
            Self::Fanout => lapin::ExchangeKind::Fanout,
            Self::Topic => lapin::ExchangeKind::Topic,
            Self::Headers => lapin::ExchangeKind::Headers,
        }
    }
}

/// A binding of a handler queue to an exchange, declared with the queue.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Binding {
    pub(crate) queue: String,
    pub(crate) exchange: String,
    pub(crate) kind: ExchangeKind,
    pub(crate) routing_key: String,
}

/// Settings of a [`crate::RabbitTransport`]. Its `Debug` shows the URL without its password.
#[derive(Clone)]
pub struct RabbitConfig {
    /// The brokers, in failover order.
    pub(crate) urls: Vec<String>,
    /// The broker that last took a connection: tried first next time. Clones share it.
    pub(crate) preferred: Arc<AtomicUsize>,
    pub(crate) queue_type: QueueType,
    pub(crate) delivery_limit: Option<u32>,
    pub(crate) name: String,
    pub(crate) reconnect_min: Duration,
    pub(crate) reconnect_max: Duration,
    pub(crate) bindings: Vec<Binding>,
    pub(crate) message_ttl: Option<Duration>,
    pub(crate) max_body: usize,
    pub(crate) max_headers: usize,
    pub(crate) publish_timeout: Duration,
    /// PEM certificates trusted for `amqps://` besides the system's roots.
    pub(crate) tls_ca: Option<std::sync::Arc<str>>,
}

/// The largest body handed to a handler unless configured: 16 MiB.
pub const DEFAULT_MAX_BODY: usize = 16 << 20;

/// How long a publish may wait for the broker unless configured: 30 s.
pub const DEFAULT_PUBLISH_TIMEOUT: Duration = Duration::from_secs(30);

/// The largest header table handed to a handler unless configured: 64 KiB.
pub const DEFAULT_MAX_HEADERS: usize = 64 << 10;

impl RabbitConfig {
    /// Settings for the broker at `url` (`amqp://` or `amqps://`), or for several brokers (the
    /// nodes of a cluster) listed in `url` separated by commas, in failover order: a connection
    /// goes to the broker that last took one, else to the next in the list that answers
    /// (each given 10 s to connect). A comma inside a URL is written `%2C`.
    pub fn new(url: impl Into<String>) -> Self {
        let url = url.into();
        let mut urls: Vec<String> = url
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect();
        if urls.is_empty() {
            urls.push(url);
        }
        Self {
            urls,
            preferred: Arc::default(),
            queue_type: QueueType::Classic,
            delivery_limit: None,
            name: "idem".to_owned(),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(10),
            bindings: Vec::new(),
            message_ttl: None,
            max_body: DEFAULT_MAX_BODY,
            max_headers: DEFAULT_MAX_HEADERS,
            publish_timeout: DEFAULT_PUBLISH_TIMEOUT,
            tls_ca: None,
        }
    }

    /// For `amqps://`: also trust the CA certificates in `pem` (PEM text), beside the system's
    /// roots; for a broker whose certificate a private CA signed. Both lapin's connections and
    /// idem's own reader (the quarantine of unparsable messages) use it.
    pub fn tls_ca_pem(mut self, pem: impl Into<String>) -> Self {
        self.tls_ca = Some(pem.into().into());
        self
    }

    /// The largest body handed to a handler (default [`DEFAULT_MAX_BODY`], 16 MiB): a larger
    /// one is dead-lettered with reason `too-large` before it is decoded.
    pub fn max_body(mut self, bytes: usize) -> Self {
        self.max_body = bytes;
        self
    }

    /// How long one publish (or one call of `publish_many`, or `wait_for_confirms`) may wait
    /// for the broker, a blocked connection included (default [`DEFAULT_PUBLISH_TIMEOUT`],
    /// 30 s). Past it the publish fails as the broker's failure, its connection is dropped and
    /// the next publish connects again; the outbox keeps the rows and relays them later.
    /// Nothing is sent while the broker blocks the connection (a resource alarm), so waiting
    /// holds no message in memory beyond those of the calls under way.
    pub fn publish_timeout(mut self, timeout: Duration) -> Self {
        self.publish_timeout = timeout;
        self
    }

    /// The largest header table handed to a handler, in bytes as it travels (default
    /// [`DEFAULT_MAX_HEADERS`], 64 KiB): a message with a larger one is dead-lettered with
    /// reason `too-large` before it is decoded.
    pub fn max_headers(mut self, bytes: usize) -> Self {
        self.max_headers = bytes;
        self
    }

    /// Declares the handler queues with a message TTL (`x-message-ttl`): a message waiting
    /// longer is dead-lettered into `<queue>.dlq`. The runtime refuses to start when a
    /// handler's inbox retention is shorter than this.
    pub fn message_ttl(mut self, ttl: Duration) -> Self {
        self.message_ttl = Some(ttl);
        self
    }

    /// The queue type (default classic).
    pub fn queue_type(mut self, queue_type: QueueType) -> Self {
        self.queue_type = queue_type;
        self
    }

    /// Quorum queues only: after this many deliveries of one message without a settlement
    /// (consumers crashing on it), the broker dead-letters it.
    pub fn delivery_limit(mut self, limit: u32) -> Self {
        self.delivery_limit = Some(limit);
        self
    }

    /// The connection name shown by the broker (`idem` by default; the queue is appended).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// Binds `queue` to `exchange` (declared durable, of `kind`) with `routing_key`. Several
    /// handler queues bound to one fanout or topic exchange each get their own copy of a
    /// message (publish/subscribe), and each processes it once.
    pub fn bind(
        mut self,
        queue: impl Into<String>,
        exchange: impl Into<String>,
        kind: ExchangeKind,
        routing_key: impl Into<String>,
    ) -> Self {
        self.bindings.push(Binding {
            queue: queue.into(),
            exchange: exchange.into(),
            kind,
            routing_key: routing_key.into(),
        });
        self
    }

    /// Reconnect backoff bounds (default 100 ms doubling up to 10 s).
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.reconnect_min = min;
        self.reconnect_max = max.max(min);
        self
    }

    /// The broker URLs with any password hidden, for logs and errors.
    pub(crate) fn redacted_url(&self) -> String {
        self.urls
            .iter()
            .map(|u| idem_core::telemetry::redact_url(u))
            .collect::<Vec<_>>()
            .join(",")
    }

    /// The brokers in the order to try them: the one that last took a connection first, then
    /// the others in list order after it. Each comes with its index, for [`Self::worked`].
    pub(crate) fn brokers(&self) -> impl Iterator<Item = (usize, &str)> {
        let count = self.urls.len();
        let first = self.preferred.load(Ordering::Relaxed) % count.max(1);
        (0..count).map(move |k| {
            let index = (first + k) % count;
            (index, self.urls[index].as_str())
        })
    }

    /// Records that broker `index` took a connection.
    pub(crate) fn worked(&self, index: usize) {
        self.preferred.store(index, Ordering::Relaxed);
    }
}

impl std::fmt::Debug for RabbitConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RabbitConfig")
            .field("url", &self.redacted_url())
            .field("queue_type", &self.queue_type)
            .field("delivery_limit", &self.delivery_limit)
            .field("name", &self.name)
            .field("reconnect_min", &self.reconnect_min)
            .field("reconnect_max", &self.reconnect_max)
            .field("bindings", &self.bindings)
            .field("message_ttl", &self.message_ttl)
            .field("max_body", &self.max_body)
            .field("max_headers", &self.max_headers)
            .field("publish_timeout", &self.publish_timeout)
            .field("tls_ca", &self.tls_ca.as_ref().map(|_| "PEM"))
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn passwords_stay_out_of_logs() {
        let config = RabbitConfig::new("amqp://guest:s3cret@h:5672/%2f");
        for shown in [
            format!("{config:?}"),
            format!("{:?}", crate::RabbitTransport::new(config.clone())),
        ] {
            assert!(!shown.contains("s3cret"), "{shown}");
            assert!(shown.contains("amqp://guest:***@h:5672/%2f"), "{shown}");
        }
        assert_eq!(
            RabbitConfig::new("amqp://guest:secret@h:5672/%2f").redacted_url(),
            "amqp://guest:***@h:5672/%2f"
        );
        assert_eq!(
            RabbitConfig::new("amqp://h:5672").redacted_url(),
            "amqp://h:5672"
        );
        assert_eq!(
            RabbitConfig::new("amqp://u:p1@a:5672, amqp://u:p2@b:5673,").redacted_url(),
            "amqp://u:***@a:5672,amqp://u:***@b:5673"
        );
    }

    #[test]
    fn brokers_are_tried_from_the_one_that_last_worked() {
        let config = RabbitConfig::new("amqp://a,amqp://b,amqp://c");
        let order = |c: &RabbitConfig| c.brokers().map(|(_, u)| u.to_owned()).collect::<Vec<_>>();
        assert_eq!(order(&config), ["amqp://a", "amqp://b", "amqp://c"]);
        config.clone().worked(1);
        assert_eq!(order(&config), ["amqp://b", "amqp://c", "amqp://a"]);
    }
}
