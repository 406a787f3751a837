//! How a handler queue maps onto JetStream: its subject, the streams that hold its messages,
//! retry copies and dead letters, and the durable consumer of a handler.

/// The names of one queue's subjects and streams.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Names {
    /// The subject producers publish the queue's messages to: the queue's name.
    pub(crate) subject: String,
    /// The stream holding them (work-queue retention).
    pub(crate) stream: String,
    /// Where retry copies wait out their delay.
    pub(crate) retry_subject: String,
    pub(crate) retry_stream: String,
    /// Where dead letters are kept.
    pub(crate) dlq_subject: String,
    pub(crate) dlq_stream: String,
}

impl Names {
    /// The names of `queue`, or why it cannot be a subject.
    pub(crate) fn of(queue: &str) -> Result<Self, String> {
        let bad = |c: char| c.is_whitespace() || c == '*' || c == '>' || c.is_control();
        if queue.is_empty()
            || queue.chars().any(bad)
            || queue.starts_with('.')
            || queue.ends_with('.')
            || queue.contains("..")
        {
            return Err(format!(
                "`{queue}` cannot be a NATS subject: use letters, digits, `-`, `_` and `.` between tokens"
            ));
        }
        let stream = stream_name(queue);
        Ok(Self {
            subject: queue.to_owned(),
            retry_subject: format!("{queue}.retry"),
            retry_stream: format!("{stream}_RETRY"),
            dlq_subject: format!("{queue}.dlq"),
            dlq_stream: format!("{stream}_DLQ"),
            stream,
        })
    }
}

/// The names of `queue`, or a topology error saying why it cannot be a subject.
pub(crate) fn of(queue: &str) -> Result<Names, idem_core::transport::TransportError> {
    Names::of(queue).map_err(|why| idem_core::transport::TransportError::Topology {
        queue: queue.to_owned(),
        action: "naming its subject",
        source: why.into(),
    })
}

/// `IDEM_` and the queue, with what a stream name cannot hold (`.`, `/`, `\`) as `_`.
fn stream_name(queue: &str) -> String {
    let safe: String = queue
        .chars()
        .map(|c| match c {
            '.' | '/' | '\\' => '_',
            c => c,
        })
        .collect();
    format!("IDEM_{safe}")
}

/// The durable consumer name of consumer identity `consumer` (`billing`, `orders::bill`):
/// what a consumer name cannot hold as `_`.
pub(crate) fn durable(consumer: &str) -> String {
    consumer
        .chars()
        .map(|c| match c {
            '.' | '*' | '>' | '/' | '\\' | ':' => '_',
            c if c.is_whitespace() || c.is_control() => '_',
            c => c,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_queue_is_its_subject_and_names_three_streams() {
        let names = Names::of("demo.orders").unwrap();
        assert_eq!(names.subject, "demo.orders");
        assert_eq!(names.stream, "IDEM_demo_orders");
        assert_eq!(names.retry_subject, "demo.orders.retry");
        assert_eq!(names.dlq_stream, "IDEM_demo_orders_DLQ");
        assert_eq!(durable("orders::bill"), "orders__bill");
    }

    #[test]
    fn a_queue_that_cannot_be_a_subject_is_refused() {
        for bad in ["", "a b", "a.*", "a.>", ".a", "a.", "a..b"] {
            assert!(Names::of(bad).is_err(), "{bad:?}");
        }
    }
}
