//! The transport-neutral message envelope.

use std::borrow::Cow;
use std::collections::BTreeMap;

/// One delivery of a message, as a transport hands it to the runtime.
///
/// Transports (RabbitMQ, the in-memory transport) build envelopes; nothing in `idem-core` knows
/// where one came from. Fields that vary between deliveries of the same message
/// (`attempt`, `redelivered`) are never used as a dedup key.
#[derive(Debug, Clone, Default, PartialEq)]
#[non_exhaustive]
pub struct Envelope {
    /// The producer-assigned message id (AMQP `message_id`), the default dedup key.
    pub message_id: Option<String>,
    /// The correlation id, carried into logs; never a dedup key.
    pub correlation_id: Option<String>,
    /// Application headers.
    pub headers: Headers,
    /// The MIME content type, when the producer set one.
    pub content_type: Option<String>,
    /// The message body.
    pub body: Vec<u8>,
    /// Which attempt this is: 1, plus one for each transient failure before it (each retry
    /// copy). A redelivery of the same copy (its consumer died, lost its connection or gave it
    /// back) is the same attempt: the retry policy's attempts count failures, and the poison
    /// limit counts handler runs that never settled.
    pub attempt: u32,
    /// Whether the broker flagged this delivery as a redelivery.
    pub redelivered: bool,
    /// The routing key the message was published with, when the transport has one: an ordered
    /// handler's partition key.
    pub routing_key: Option<String>,
    /// Where the sender wants the handler's result (AMQP `reply_to`: a queue on the default
    /// exchange).
    pub reply_to: Option<String>,
    /// When the message was first published, in milliseconds since the Unix epoch, where the
    /// broker or its producer says (AMQP's `timestamp`, NATS's `Idem-Published` or the
    /// stream's time); its retry copies, dead letter and replays keep it. A message older than
    /// its consumer's retention whose key the inbox does not hold is refused
    /// (`beyond-dedup-window`).
    pub published_at_ms: Option<i64>,
}

impl Envelope {
    /// An envelope holding `body`, first attempt, no properties.
    pub fn new(body: impl Into<Vec<u8>>) -> Self {
        Self {
            body: body.into(),
            attempt: 1,
            ..Self::default()
        }
    }

    /// Sets the message id.
    pub fn with_message_id(mut self, id: impl Into<String>) -> Self {
        self.message_id = Some(id.into());
        self
    }

    /// Sets the correlation id.
    pub fn with_correlation_id(mut self, id: impl Into<String>) -> Self {
        self.correlation_id = Some(id.into());
        self
    }

    /// Adds a header.
    pub fn with_header(mut self, name: impl Into<String>, value: impl Into<HeaderValue>) -> Self {
        self.headers.insert(name, value);
        self
    }

    /// Sets the content type.
    pub fn with_content_type(mut self, content_type: impl Into<String>) -> Self {
        self.content_type = Some(content_type.into());
        self
    }

    /// Sets the queue the handler's result is sent to.
    pub fn with_reply_to(mut self, queue: impl Into<String>) -> Self {
        self.reply_to = Some(queue.into());
        self
    }

    /// Sets the routing key (an ordered handler's partition key).
    pub fn with_routing_key(mut self, key: impl Into<String>) -> Self {
        self.routing_key = Some(key.into());
        self
    }

    /// Sets when the message was first published ([`Envelope::published_at_ms`]).
    pub fn with_published_at_ms(mut self, ms: i64) -> Self {
        self.published_at_ms = Some(ms);
        self
    }

    /// Sets the attempt (1 for the first; see [`Envelope::attempt`]).
    pub fn with_attempt(mut self, attempt: u32) -> Self {
        self.attempt = attempt;
        self
    }
}

/// Application headers of a message, by exact (case-sensitive) name, as AMQP has them.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Headers(BTreeMap<String, HeaderValue>);

impl Headers {
    /// Looks a header up by its exact name.
    pub fn get(&self, name: &str) -> Option<&HeaderValue> {
        self.0.get(name)
    }

    /// Inserts or replaces a header.
    pub fn insert(&mut self, name: impl Into<String>, value: impl Into<HeaderValue>) {
        self.0.insert(name.into(), value.into());
    }

    /// Iterates over the headers in name order.
    pub fn iter(&self) -> impl Iterator<Item = (&str, &HeaderValue)> {
        self.0.iter().map(|(k, v)| (k.as_str(), v))
    }

    /// The number of headers.
    pub fn len(&self) -> usize {
        self.0.len()
    }

    /// Whether there are no headers.
    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }
}

/// The value of one header. AMQP field tables carry more types; transports map those they
/// cannot represent to [`HeaderValue::Bytes`] or leave them out.
#[derive(Debug, Clone, PartialEq)]
#[non_exhaustive]
pub enum HeaderValue {
    /// A text value.
    Str(String),
    /// A signed integer.
    Int(i64),
    /// A boolean.
    Bool(bool),
    /// A floating-point number.
    Float(f64),
    /// Raw bytes.
    Bytes(Vec<u8>),
}

impl HeaderValue {
    /// The value as key text: text as is, integers in decimal, bytes when they are UTF-8.
    /// Booleans and floats are not usable as keys and give `None`.
    pub fn as_text(&self) -> Option<Cow<'_, str>> {
        match self {
            Self::Str(s) => Some(Cow::Borrowed(s)),
            Self::Int(i) => Some(Cow::Owned(i.to_string())),
            Self::Bytes(b) => std::str::from_utf8(b).ok().map(Cow::Borrowed),
            Self::Bool(_) | Self::Float(_) => None,
        }
    }
}

impl From<&str> for HeaderValue {
    fn from(s: &str) -> Self {
        Self::Str(s.to_owned())
    }
}

impl From<String> for HeaderValue {
    fn from(s: String) -> Self {
        Self::Str(s)
    }
}

impl From<i64> for HeaderValue {
    fn from(i: i64) -> Self {
        Self::Int(i)
    }
}

impl From<bool> for HeaderValue {
    fn from(b: bool) -> Self {
        Self::Bool(b)
    }
}

impl From<Vec<u8>> for HeaderValue {
    fn from(b: Vec<u8>) -> Self {
        Self::Bytes(b)
    }
}
