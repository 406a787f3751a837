//! Where a published message goes ([`Destination`]), in terms every broker maps to its own.

use std::fmt;

/// Where a message published through the outbox (or as a reply) goes: a queue, or a topic and
/// the key that routes the message in it. Each transport maps it to its broker:
///
/// | | RabbitMQ | NATS JetStream |
/// |---|---|---|
/// | `Queue(q)` | the default exchange, routing key `q` | subject `q` |
/// | `Topic { topic, key }` | exchange `topic`, routing key `key` | an ordered handler's source `topic`: its partition for `key`; else subject `<topic>.<key>` |
///
/// A topic whose name is empty is the queue its key names, on every broker
/// ([`Destination::topic`] makes it one).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Destination {
    /// Straight to the queue of this name.
    Queue(String),
    /// To a topic (an exchange, a subject space, an ordered handler's source), routed by `key`.
    Topic {
        /// The topic.
        topic: String,
        /// The key that routes the message in the topic (its partition key, its routing key).
        key: String,
    },
}

impl Destination {
    /// The queue `name`.
    pub fn queue(name: impl Into<String>) -> Self {
        Self::Queue(name.into())
    }

    /// `topic`, routed by `key`; with an empty `topic`, the queue `key` names.
    pub fn topic(topic: impl Into<String>, key: impl Into<String>) -> Self {
        Self::from_parts(topic, key)
    }

    /// The destination as the two fields a store keeps: its topic (`""` for a queue) and its
    /// key (a queue's name). [`Destination::from_parts`] reads them back.
    pub fn parts(&self) -> (&str, &str) {
        match self {
            Self::Queue(name) => ("", name),
            Self::Topic { topic, key } => (topic, key),
        }
    }

    /// The destination [`Destination::parts`] gave: an empty topic is the queue `key` names.
    pub fn from_parts(topic: impl Into<String>, key: impl Into<String>) -> Self {
        let topic = topic.into();
        if topic.is_empty() {
            Self::Queue(key.into())
        } else {
            Self::Topic {
                topic,
                key: key.into(),
            }
        }
    }
}

impl fmt::Display for Destination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Queue(name) => write!(f, "queue `{name}`"),
            Self::Topic { topic, key } if topic.is_empty() => write!(f, "queue `{key}`"),
            Self::Topic { topic, key } => write!(f, "topic `{topic}` with key `{key}`"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_round_trips_through_its_stored_parts() {
        for destination in [
            Destination::queue("orders"),
            Destination::topic("events", "o-1"),
            Destination::topic("events", ""),
            Destination::topic("", "orders"),
        ] {
            let (topic, key) = destination.parts();
            assert_eq!(Destination::from_parts(topic, key), destination);
        }
        assert_eq!(
            Destination::from_parts("", "orders"),
            Destination::queue("orders")
        );
    }

    #[test]
    fn a_topic_without_a_name_is_the_queue_its_key_names() {
        assert_eq!(
            Destination::topic("", "orders"),
            Destination::queue("orders")
        );
        let nameless = Destination::Topic {
            topic: String::new(),
            key: "orders".to_owned(),
        };
        assert_eq!(nameless.parts(), Destination::queue("orders").parts());
        assert_eq!(nameless.to_string(), "queue `orders`");
        assert_eq!(
            Destination::topic("events", "o-1").to_string(),
            "topic `events` with key `o-1`"
        );
    }
}
