//! [`NatsConfig`]: where the server is and how long JetStream may wait for idem.

use std::time::Duration;

/// Settings of a [`crate::NatsTransport`]. Its `Debug` shows the URL without its password.
#[derive(Clone)]
pub struct NatsConfig {
    pub(crate) url: String,
    pub(crate) name: String,
    pub(crate) ack_wait: Duration,
    pub(crate) connect_timeout: Duration,
    pub(crate) reconnect_min: Duration,
    pub(crate) reconnect_max: Duration,
    /// PEM files of CA certificates trusted for TLS besides the system's roots.
    pub(crate) tls_roots: Vec<std::path::PathBuf>,
    pub(crate) replicas: usize,
}

/// How long JetStream waits for a delivery's settlement before it redelivers it, unless
/// configured: 10 s. While a delivery is in progress its consumer tells JetStream so every
/// third of it, so a long handler is not redelivered; a delivery whose consumer died is
/// redelivered this long after its last word.
pub const DEFAULT_ACK_WAIT: Duration = Duration::from_secs(10);

impl NatsConfig {
    /// Settings for the server at `url` (`nats://host:4222`, or several separated by commas,
    /// which the client tries in turn and reconnects to).
    pub fn new(url: impl Into<String>) -> Self {
        Self {
            url: url.into(),
            name: "idem".to_owned(),
            ack_wait: DEFAULT_ACK_WAIT,
            connect_timeout: Duration::from_secs(5),
            reconnect_min: Duration::from_millis(100),
            reconnect_max: Duration::from_secs(10),
            tls_roots: Vec::new(),
            replicas: 1,
        }
    }

    /// The client name the server shows for this process's connection (default `idem`).
    pub fn connection_name(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// How long JetStream waits for a settlement before it redelivers (default
    /// [`DEFAULT_ACK_WAIT`]; at least 1 s).
    pub fn ack_wait(mut self, ack_wait: Duration) -> Self {
        self.ack_wait = ack_wait.max(Duration::from_secs(1));
        self
    }

    /// On a JetStream cluster: how many servers hold each stream idem declares, with its
    /// durable consumers (default 1; at most 5). With 3, a queue keeps its messages, and
    /// goes on being consumed, when one server of three is lost. An existing stream with
    /// another count is scaled to it at start-up; a server that is not clustered refuses a
    /// count over 1, and the start fails saying so.
    pub fn replicas(mut self, replicas: usize) -> Self {
        self.replicas = replicas.clamp(1, 5);
        self
    }

    /// How long one connection attempt may take (default 5 s).
    pub fn connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    /// The backoff between a consumer's attempts to consume again after an error (default
    /// 100 ms, doubling to 10 s).
    pub fn reconnect_backoff(mut self, min: Duration, max: Duration) -> Self {
        self.reconnect_min = min;
        self.reconnect_max = max.max(min);
        self
    }

    /// For a server whose certificate a private CA signed (`tls://host:4222`, or a server
    /// that requires TLS): also trust the CA certificates in the PEM file at `path`.
    pub fn tls_ca_pem_file(mut self, path: impl Into<std::path::PathBuf>) -> Self {
        self.tls_roots.push(path.into());
        self
    }

    /// The URL without its password.
    pub fn redacted_url(&self) -> String {
        idem_core::telemetry::redact_url(&self.url)
    }
}

impl std::fmt::Debug for NatsConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NatsConfig")
            .field("url", &self.redacted_url())
            .field("name", &self.name)
            .field("ack_wait", &self.ack_wait)
            .field("replicas", &self.replicas)
            .finish_non_exhaustive()
    }
}
