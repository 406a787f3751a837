//! Where an ordered handler's partition count lives: on the server, beside its partitions, so
//! that every producer routes a key to the same partition whatever it declared itself (two
//! producers counting 4 and 8 partitions would split one key over two partitions and break its
//! order). The count is the description of a stream that holds no messages,
//! `IDEM_<source>_PARTITIONS` on subject `idem.partitions.<source>`: written by the first
//! declaration of the source's partitions, checked by every later one, read by a producer that
//! declared none.

use async_nats::jetstream::context::GetStreamErrorKind;
use async_nats::jetstream::stream::{Config, DiscardPolicy, RetentionPolicy, StorageType};
use async_nats::jetstream::{Context, ErrorCode};
use idem_core::transport::TransportError;

/// What the record's description says before the count.
const PREFIX: &str = "idem partitions: ";

/// The name of the stream recording `source`'s count (what a stream name cannot hold as `_`).
fn record(source: &str) -> String {
    let safe: String = source
        .chars()
        .map(|c| match c {
            '.' | '/' | '\\' | '*' | '>' => '_',
            c if c.is_whitespace() || c.is_control() => '_',
            c => c,
        })
        .collect();
    format!("IDEM_{safe}_PARTITIONS")
}

fn topology(source: &str, action: &'static str, why: impl std::fmt::Display) -> TransportError {
    TransportError::Topology {
        queue: source.to_owned(),
        action,
        source: why.to_string().into(),
    }
}

/// The count a record's `description` states.
fn count_of(description: Option<&str>) -> Option<usize> {
    description?.strip_prefix(PREFIX)?.trim().parse().ok()
}

/// Records that `source` is spread over `count` partitions, or checks the count already
/// recorded: another count is refused, naming both.
pub(crate) async fn declare(
    js: &Context,
    source: &str,
    count: usize,
    replicas: usize,
) -> Result<(), TransportError> {
    let name = record(source);
    let config = Config {
        name: name.clone(),
        subjects: vec![format!("idem.partitions.{source}")],
        description: Some(format!("{PREFIX}{count}")),
        retention: RetentionPolicy::Limits,
        storage: StorageType::File,
        max_messages: 1,
        discard: DiscardPolicy::New,
        num_replicas: replicas,
        ..Config::default()
    };
    let stream = js
        .get_or_create_stream(config)
        .await
        .map_err(|e| topology(source, "recording its partition count", e))?;
    let description = stream.cached_info().config.description.as_deref();
    match count_of(description) {
        Some(recorded) if recorded == count => Ok(()),
        Some(recorded) => Err(topology(
            source,
            "checking its partition count",
            format!(
                "the server records {recorded} partitions for `{source}` and this process declares {count}: every process must use one count (to change it, drain the partitions, then delete the streams `{name}` and `IDEM_{source}_p*`)"
            ),
        )),
        None => Err(topology(
            source,
            "checking its partition count",
            format!(
                "stream `{name}` exists but records no partition count ({description:?}): delete it"
            ),
        )),
    }
}

/// The partition count the server records for `source`, or `None` when it records none (the
/// source is not an ordered handler's).
pub(crate) async fn read(js: &Context, source: &str) -> Result<Option<usize>, TransportError> {
    match js.get_stream(record(source)).await {
        Ok(stream) => Ok(count_of(stream.cached_info().config.description.as_deref())),
        Err(e) => match e.kind() {
            GetStreamErrorKind::JetStream(error)
                if error.error_code() == ErrorCode::STREAM_NOT_FOUND =>
            {
                Ok(None)
            }
            _ => Err(topology(source, "reading its partition count", e)),
        },
    }
}

/// Deletes `source`'s record; whether there was one.
pub(crate) async fn delete(js: &Context, source: &str) -> Result<bool, TransportError> {
    if read(js, source).await?.is_none() {
        return Ok(false);
    }
    js.delete_stream(record(source))
        .await
        .map_err(|e| topology(source, "deleting its partition count", e))?;
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_count_is_read_back_from_its_description() {
        assert_eq!(count_of(Some("idem partitions: 4")), Some(4));
        assert_eq!(count_of(Some("something else")), None);
        assert_eq!(count_of(None), None);
        assert_eq!(record("shop.status"), "IDEM_shop_status_PARTITIONS");
    }
}
