//! `idem dlq replay --key` and `idem dlq skip --key`: releasing an ordered handler's key that
//! is parked behind its dead-lettered message (its head).
//!
//! - Replay: the inbox is asked about the head first, as for any replay ([`judge`]): refused,
//!   it stays as it is; applied already, it is resolved (dropped); else its failure is
//!   cleared and it goes back before the parked messages.
//! - Skip: the head is dropped, kept with the reason in the inbox's `_skipped` table.
//!
//! Either way the key turns `releasing` in the same transaction, then the head leaves the DLQ
//! (with its record), and the key's first message is published to the handler's source with
//! its order key, marked as released. From there the consumers hand the release on, one
//! message at a time, and free the key after the last one: the command does not wait, and a
//! key already releasing is resumed (its first message published again; a copy that arrives
//! twice runs once).

use crate::args::Cli;
use crate::broker::{Broker, Named};
use crate::error::CliError;
use crate::output::{age, json, now_ms};
use crate::replay::{Verdict, judge};
use idem::sql::{DeadLetterRow, Dialect, ParkedKey, Release, SqlInbox, Started};
use idem::transport::HeldLetter;
use idem::{Envelope, HeaderValue};
use serde_json::json;

/// What becomes of the parked key's head.
pub(crate) enum Head<'a> {
    /// Replayed (beyond its dedup window only with `force`).
    Replay { force: bool },
    /// Skipped, for this reason.
    Skip { reason: &'a str },
}

/// Releases the parked `order_key` of the ordered handler consuming `queue`: one of its
/// partition queues, or its own queue (the partitions' source) (see the module).
pub(crate) async fn release<DB: Dialect>(
    cli: &Cli,
    inbox: &SqlInbox<DB>,
    queue: &str,
    order_key: &str,
    head: Head<'_>,
) -> Result<(), CliError> {
    let parked = inbox.parked_keys().await?;
    let Some(key) = parked
        .into_iter()
        .find(|k| (k.queue == queue || k.source == queue) && k.order_key == order_key)
    else {
        return Err(CliError::NotFound(format!(
            "key {order_key:?} is not parked on {queue} (`idem dlq list --queue <partition>` lists the parked keys of a partition queue)"
        )));
    };
    let queue = key.queue.as_str();
    let broker = Broker::open(cli, queue).await?;
    let released = release_key(&broker, inbox, &key, head).await;
    broker.close().await;
    let (what, first) = released?;
    let depth = key.depth + i64::from(what == "replayed");
    if cli.json {
        json(
            &json!({"consumer": key.consumer, "key": key.order_key, "head": what,
                     "releasing": depth, "first_published": first}),
        );
    } else {
        println!(
            "key {:?} of {}: head {what}; {depth} messages go back in their order, one at a time, each once the one before it is applied; `idem dlq list --queue {queue}` shows the key until the last one is",
            key.order_key, key.consumer
        );
    }
    Ok(())
}

/// Starts (or resumes) the release of `key` with `broker`'s DLQ and publisher: what became of
/// the head, and whether a first message was published.
async fn release_key<DB: Dialect>(
    broker: &Broker,
    inbox: &SqlInbox<DB>,
    key: &ParkedKey,
    head: Head<'_>,
) -> Result<(&'static str, bool), CliError> {
    let records = inbox.dead_letters(&key.queue).await?;
    // The head's record: the dead letter of the key's consumer the key waits behind.
    let record = records.iter().rev().find(|r| {
        !key.head_message_id.is_empty()
            && r.consumer == key.consumer
            && r.message_id.as_deref() == Some(&key.head_message_id)
    });
    // Every copy of the head in the DLQ (moving a dead letter is at least once): the first
    // is the head, the others go with it.
    let letters = find_heads(broker, key).await?;
    let letter = letters.first();
    let (what, release) = if key.state == idem::sql::parking::RELEASING {
        // Released before, and interrupted: a head left in the DLQ goes now.
        ("released before; resumed", Owned::Other(Release::Resume))
    } else {
        match (head, letter) {
            (Head::Replay { .. }, None) => match applied(inbox, record).await? {
                true => (
                    "resolved (applied already)",
                    Owned::Other(Release::Resolved),
                ),
                false => {
                    return Err(CliError::NotFound(format!(
                        "the dead letter key {:?} waits behind ({}) is not in the DLQ of {}: `idem dlq skip --queue {} --key {:?} --reason ...` releases the key without it",
                        key.order_key,
                        shown_id(&key.head_message_id),
                        key.queue,
                        key.queue,
                        key.order_key
                    )));
                }
            },
            (Head::Replay { force }, Some(letter)) => {
                let record = letter.record(&records);
                match verdict(inbox, letter, record, force).await? {
                    Verdict::Refused(why) => {
                        return Err(CliError::Partial(format!(
                            "the key stays parked: its dead letter is not replayed: {why}"
                        )));
                    }
                    Verdict::Resolved(_) => (
                        "resolved (applied already)",
                        Owned::Other(Release::Resolved),
                    ),
                    Verdict::Replay => {
                        let envelope = envelope_of(letter, &key.order_key, force);
                        ("replayed", Owned::Replay(envelope))
                    }
                }
            }
            (Head::Skip { reason }, letter) => {
                let skip = match letter {
                    Some(letter) => skipped(letter, reason),
                    None => Release::Skip {
                        message_id: &key.head_message_id,
                        reason,
                        body: &[],
                    },
                };
                ("skipped", Owned::Other(skip))
            }
        }
    };
    let first = match inbox.start_release(key, release.as_release()).await? {
        Started::Releasing(first) => first.map(|first| *first),
        _ => {
            return Err(CliError::Partial(format!(
                "key {:?} changed while this command read it (released, or parked again behind another message): nothing was done; run it again",
                key.order_key
            )));
        }
    };
    // The key is releasing: a replayed head's failure is cleared (it runs again as new), the
    // head leaves the DLQ with its record, and the release starts.
    let record = match letter {
        Some(letter) => letter.record(&records),
        None => record,
    };
    if let (Some(r), "replayed") = (record, what) {
        inbox.clear_failure(&r.consumer, &r.key).await?;
    }
    for letter in &letters {
        broker
            .answer("removing the dead letter", broker.reader.remove(letter))
            .await?;
    }
    if let Some(record) = record {
        inbox.forget_dead_letter(record).await?;
    }
    let published = publish_first(broker, key, first).await?;
    Ok((what, published))
}

/// Whether the inbox applied the key of `record` with its payload (a head that ran and went
/// through after its dead letter was recorded).
async fn applied<DB: Dialect>(
    inbox: &SqlInbox<DB>,
    record: Option<&DeadLetterRow>,
) -> Result<bool, CliError> {
    let Some(record) = record.filter(|r| r.keyed) else {
        return Ok(false);
    };
    let report = inbox.show(&record.consumer, &record.key).await?;
    Ok(report
        .row
        .is_some_and(|row| row.status == "completed" && row.fingerprint == record.fingerprint))
}

/// A release as [`SqlInbox::start_release`] takes it, the replayed head owned.
enum Owned<'a> {
    Replay(Envelope),
    Other(Release<'a>),
}

impl<'a> Owned<'a> {
    fn as_release(&self) -> Release<'_> {
        match self {
            Self::Replay(envelope) => Release::Replay(envelope),
            Self::Other(release) => *release,
        }
    }
}

/// The inbox's verdict on replaying the head `letter` (see `crate::replay`).
async fn verdict<DB: Dialect>(
    inbox: &SqlInbox<DB>,
    letter: &HeldLetter,
    record: Option<&DeadLetterRow>,
    force: bool,
) -> Result<Verdict, CliError> {
    let Some(record) = record else {
        return Ok(Verdict::Replay);
    };
    let report = match record.keyed {
        true => Some(inbox.show(&record.consumer, &record.key).await?),
        false => None,
    };
    Ok(judge(
        record,
        letter.published_at_ms,
        report.as_ref(),
        now_ms(),
        force,
    ))
}

/// The head `letter` skipped for `reason`.
fn skipped<'a>(letter: &'a HeldLetter, reason: &'a str) -> Release<'a> {
    Release::Skip {
        message_id: letter.message_id.as_deref().unwrap_or(""),
        reason,
        body: &letter.body,
    }
}

/// Reads the DLQ for the dead letter `key` waits behind (its message id): every copy of it
/// there, oldest first.
async fn find_heads(broker: &Broker, key: &ParkedKey) -> Result<Vec<HeldLetter>, CliError> {
    let mut found = Vec::new();
    if key.head_message_id.is_empty() {
        return Ok(found);
    }
    let total = broker.count().await?;
    for _ in 0..total {
        let Some(letter) = broker.next().await? else {
            break;
        };
        if letter.message_id.as_deref() == Some(key.head_message_id.as_str()) {
            found.push(letter);
        }
    }
    Ok(found)
}

/// The head as the message it was, to run again before the parked ones: its publish time is
/// kept, or is now with `force` (a copy beyond its dedup window starts a window of its own).
fn envelope_of(letter: &HeldLetter, order_key: &str, force: bool) -> Envelope {
    let mut envelope = Envelope::new(letter.body.clone()).with_routing_key(order_key);
    envelope.message_id = letter.message_id.clone();
    envelope.correlation_id = letter.correlation_id.clone();
    envelope.content_type = letter.content_type.clone();
    for (name, value) in &letter.headers {
        envelope
            .headers
            .insert(name.as_str(), HeaderValue::Str(value.clone()));
    }
    envelope.published_at_ms = match force {
        true => Some(now_ms()),
        false => letter.published_at_ms,
    };
    envelope
}

/// Publishes the key's first message, marked as released, to the handler's source with its
/// order key; whether there was one.
async fn publish_first(
    broker: &Broker,
    key: &ParkedKey,
    first: Option<idem::store::ParkedMessage>,
) -> Result<bool, CliError> {
    let Some(first) = first else {
        return Ok(false);
    };
    let message = idem::transport::release(&first, &key.consumer, &key.order_key, &key.source);
    broker.publish(&message).await?;
    Ok(true)
}

fn shown_id(id: &str) -> String {
    match id.is_empty() {
        true => "no message id".to_owned(),
        false => format!("message id {id}"),
    }
}

/// The parked keys of `queue`, for `idem dlq list`: as rows of a table, and as JSON.
pub(crate) fn parked_rows(keys: &[ParkedKey]) -> Vec<Vec<String>> {
    keys.iter()
        .map(|k| {
            vec![
                k.order_key.clone(),
                k.consumer.clone(),
                k.state.clone(),
                k.depth.to_string(),
                age(k.parked_at_ms),
                shown_id(&k.head_message_id),
                crate::output::cut(&k.reason, 60),
            ]
        })
        .collect()
}

/// A parked key as JSON.
pub(crate) fn parked_json(k: &ParkedKey) -> serde_json::Value {
    json!({"key": k.order_key, "consumer": k.consumer, "state": k.state, "depth": k.depth,
           "parked_at_ms": k.parked_at_ms, "age_ms": now_ms() - k.parked_at_ms,
           "head_message_id": k.head_message_id, "reason": k.reason, "source": k.source})
}
