//! Which broker a URL names, by its scheme: one table for every tool that is given a broker's
//! URL (the `idem` command, the examples, the tests' broker fixture), in the way sqlx picks a
//! driver by URL, instead of a chain of prefix checks in each.

/// A broker idem has a transport for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum Broker {
    /// RabbitMQ, through idem-rabbitmq.
    RabbitMq,
    /// NATS JetStream, through idem-nats.
    Nats,
}

/// One row of [`BROKERS`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub struct BrokerScheme {
    /// The broker.
    pub broker: Broker,
    /// Its name, for messages.
    pub name: &'static str,
    /// The URL schemes that name it.
    pub schemes: &'static [&'static str],
    /// The environment variable the tools and examples read its URL from.
    pub url_variable: &'static str,
}

/// Every broker idem has a transport for, with the URL schemes that name it.
pub const BROKERS: &[BrokerScheme] = &[
    BrokerScheme {
        broker: Broker::RabbitMq,
        name: "RabbitMQ",
        schemes: &["amqp", "amqps"],
        url_variable: "AMQP_URL",
    },
    BrokerScheme {
        broker: Broker::Nats,
        name: "NATS JetStream",
        schemes: &["nats", "tls"],
        url_variable: "NATS_URL",
    },
];

/// A URL whose scheme names no broker of [`BROKERS`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("`{scheme}` names no broker idem has a transport for: use {known}")]
pub struct UnknownBroker {
    /// The scheme found (`(none)` for a URL without one).
    pub scheme: String,
    /// The schemes that name a broker, for the message.
    pub known: String,
}

impl Broker {
    /// The broker `url` names by its scheme (`amqp://…`, `nats://…`); of a comma-separated
    /// list, the first URL's.
    pub fn of_url(url: &str) -> Result<Self, UnknownBroker> {
        let first = url.split(',').map(str::trim).next().unwrap_or_default();
        let scheme = first
            .split_once("://")
            .map(|(scheme, _)| scheme.to_ascii_lowercase());
        if let Some(scheme) = &scheme
            && let Some(row) = BROKERS
                .iter()
                .find(|row| row.schemes.contains(&scheme.as_str()))
        {
            return Ok(row.broker);
        }
        let known: Vec<String> = BROKERS
            .iter()
            .flat_map(|row| {
                row.schemes
                    .iter()
                    .map(move |scheme| format!("{scheme}:// ({})", row.name))
            })
            .collect();
        Err(UnknownBroker {
            scheme: scheme.map_or_else(|| "(none)".to_owned(), |s| format!("{s}://")),
            known: known.join(", "),
        })
    }

    /// Its row of [`BROKERS`].
    pub fn scheme(self) -> &'static BrokerScheme {
        BROKERS
            .iter()
            .find(|row| row.broker == self)
            .unwrap_or(&BROKERS[0])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_url_names_its_broker_by_scheme() {
        assert_eq!(
            Broker::of_url("amqp://guest@h:5672/%2f"),
            Ok(Broker::RabbitMq)
        );
        assert_eq!(Broker::of_url("AMQPS://h"), Ok(Broker::RabbitMq));
        assert_eq!(
            Broker::of_url("nats://a:4222, nats://b:4222"),
            Ok(Broker::Nats)
        );
        assert_eq!(Broker::of_url("tls://h:4222"), Ok(Broker::Nats));
        let unknown = Broker::of_url("kafka://h:9092").unwrap_err().to_string();
        assert!(unknown.contains("`kafka://`"), "{unknown}");
        assert!(unknown.contains("amqp:// (RabbitMQ)"), "{unknown}");
        assert!(unknown.contains("nats:// (NATS JetStream)"), "{unknown}");
        let none = Broker::of_url("localhost:5672").unwrap_err();
        assert_eq!(none.scheme, "(none)");
        assert_eq!(Broker::Nats.scheme().url_variable, "NATS_URL");
    }
}
