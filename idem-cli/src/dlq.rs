//! `idem dlq …`: the dead letters of a queue, read with `basic.get` and joined to the records
//! the runtime wrote before it dead-lettered them (same body fingerprint and message id); and
//! replaying them.
//!
//! Reading leaves the queue as it was: every message read is held unacknowledged on the
//! reading channel and goes back when the channel closes. A replay clears the inbox's record
//! of the failure, publishes the copy (confirmed, mandatory) and only then acknowledges the
//! dead letter: interrupted at any point, it leaves the dead letter in place, and replaying it
//! again cannot process it twice (the first copy's inbox row makes the second a duplicate).

use crate::args::{Cli, Dlq};
use crate::broker::{Broker, Letter};
use crate::error::CliError;
use crate::output::{age, cut, json, table};
use idem::sql::{DeadLetterRow, Dialect, SqlInbox};
use idem::store::Fingerprint;
use indicatif::{ProgressBar, ProgressStyle};
use lapin::options::{BasicAckOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation};
use serde_json::{Value, json};

/// Headers the broker adds when it dead-letters a message, and idem's attempt count: a replayed
/// message starts afresh without them.
const DROPPED_HEADERS: &[&str] = &[
    "x-death",
    "x-first-death-exchange",
    "x-first-death-queue",
    "x-first-death-reason",
    "x-last-death-exchange",
    "x-last-death-queue",
    "x-last-death-reason",
    idem::rabbitmq::ATTEMPT_HEADER,
];

impl Letter {
    fn message_id(&self) -> Option<&str> {
        self.properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str)
    }

    fn fingerprint(&self) -> Fingerprint {
        Fingerprint::of(&self.body)
    }

    /// Whether `id` names this letter: its message id, or `sha256:<prefix>` of its body.
    fn is(&self, id: &str) -> bool {
        match id.strip_prefix("sha256:") {
            Some(prefix) if !prefix.is_empty() => {
                self.fingerprint().to_string().starts_with(prefix)
            }
            _ => self.message_id() == Some(id),
        }
    }

    /// The queue it was dead-lettered from, as the broker recorded it.
    fn source(&self) -> Option<String> {
        match header(&self.properties, "x-first-death-queue")? {
            AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
            AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
            _ => None,
        }
    }

    /// Its record among `records`: the one with its fingerprint and message id.
    fn record<'r>(&self, records: &'r [DeadLetterRow]) -> Option<&'r DeadLetterRow> {
        records
            .iter()
            .rev()
            .find(|r| r.describes(self.message_id(), &self.body))
    }
}

fn header<'p>(properties: &'p BasicProperties, name: &str) -> Option<&'p AMQPValue> {
    properties.headers().as_ref()?.inner().get(name)
}

/// Runs one `dlq` command.
pub async fn run<DB: Dialect>(
    cli: &Cli,
    inbox: &SqlInbox<DB>,
    command: &Dlq,
) -> Result<(), CliError> {
    match command {
        Dlq::List { queue, limit } => {
            let broker = Broker::open(cli, &queue.queue).await?;
            let read = broker.read(*limit).await;
            broker.close().await;
            let (letters, total) = read?;
            let records = inbox.dead_letters(&queue.queue).await?;
            list(cli, &letters, &records, total);
            Ok(())
        }
        Dlq::Show { queue, id } => {
            let broker = Broker::open(cli, &queue.queue).await?;
            let read = broker.read(u64::MAX).await;
            broker.close().await;
            let (letters, _) = read?;
            let records = inbox.dead_letters(&queue.queue).await?;
            let found: Vec<&Letter> = letters.iter().filter(|l| l.is(id)).collect();
            if found.is_empty() {
                return Err(CliError::NotFound(format!(
                    "no dead letter {id} in {}",
                    idem::rabbitmq::dlq(&queue.queue)
                )));
            }
            for letter in found {
                show(cli, letter, letter.record(&records));
            }
            Ok(())
        }
        Dlq::Replay {
            queue,
            ids,
            all,
            to,
            keep,
        } => {
            let plan = Replay {
                queue: &queue.queue,
                ids,
                all: *all,
                to: to.as_deref(),
                keep: *keep,
            };
            replay(cli, inbox, &plan).await
        }
    }
}

fn list(cli: &Cli, letters: &[Letter], records: &[DeadLetterRow], total: u32) {
    if cli.json {
        let items: Vec<Value> = letters
            .iter()
            .map(|l| letter_json(l, l.record(records), false))
            .collect();
        json(&json!({"total": total, "dead_letters": items}));
        return;
    }
    let rows: Vec<Vec<String>> = letters
        .iter()
        .map(|l| {
            let record = l.record(records);
            let field = |f: fn(&DeadLetterRow) -> String| record.map_or("-".to_owned(), f);
            vec![
                l.message_id()
                    .map_or_else(|| short_fingerprint(l), str::to_owned),
                field(|r| r.reason.clone()),
                field(|r| r.consumer.clone()),
                field(|r| r.key.clone()),
                field(|r| r.attempts.to_string()),
                field(|r| age(r.dead_lettered_at_ms)),
                field(|r| cut(&r.detail, 60)),
            ]
        })
        .collect();
    table(
        &[
            "ID",
            "REASON",
            "CONSUMER",
            "KEY",
            "ATTEMPTS",
            "DEAD-LETTERED",
            "DETAIL",
        ],
        &rows,
    );
    println!(
        "{} of {total} dead letters shown{}",
        letters.len(),
        if letters.iter().any(|l| l.record(records).is_none()) {
            "; `-`: no record (dead-lettered by the broker, or before idem recorded reasons)"
        } else {
            ""
        }
    );
}

fn show(cli: &Cli, letter: &Letter, record: Option<&DeadLetterRow>) {
    if cli.json {
        json(&letter_json(letter, record, true));
        return;
    }
    let p = &letter.properties;
    println!("message id     {}", letter.message_id().unwrap_or("(none)"));
    if let Some(id) = p.correlation_id() {
        println!("correlation id {id}");
    }
    if let Some(t) = p.content_type() {
        println!("content type   {t}");
    }
    println!("fingerprint    sha256:{}", letter.fingerprint());
    println!(
        "from queue     {}",
        letter.source().as_deref().unwrap_or("?")
    );
    match record {
        Some(r) => {
            println!("reason         {}", r.reason);
            println!("detail         {}", r.detail);
            println!("consumer       {}", r.consumer);
            println!(
                "key            {}{}",
                r.key,
                if r.keyed {
                    ""
                } else {
                    " (stand-in: no key was read)"
                }
            );
            println!("attempts       {}", r.attempts);
            println!("dead-lettered  {}", age(r.dead_lettered_at_ms));
        }
        None => println!("reason         (no record)"),
    }
    for (name, value) in headers(p) {
        println!("header         {name} = {value}");
    }
    println!("body           {} bytes", letter.body.len());
    println!("{}", String::from_utf8_lossy(&letter.body));
}

fn short_fingerprint(letter: &Letter) -> String {
    format!("sha256:{}", &letter.fingerprint().to_string()[..12])
}

/// The user's headers, as text.
fn headers(properties: &BasicProperties) -> Vec<(String, String)> {
    let Some(table) = properties.headers() else {
        return Vec::new();
    };
    table
        .inner()
        .iter()
        .filter(|(name, _)| name.as_str() != "x-death")
        .map(|(name, value)| {
            let text = match value {
                AMQPValue::LongString(s) => String::from_utf8_lossy(s.as_bytes()).into_owned(),
                AMQPValue::ShortString(s) => s.as_str().to_owned(),
                other => format!("{other:?}"),
            };
            (name.as_str().to_owned(), text)
        })
        .collect()
}

/// A dead-letter record as JSON.
pub fn record_json(r: &DeadLetterRow) -> Value {
    json!({"consumer": r.consumer, "key": r.key, "keyed": r.keyed, "queue": r.queue,
           "reason": r.reason, "detail": r.detail, "attempts": r.attempts,
           "message_id": r.message_id, "dead_lettered_at_ms": r.dead_lettered_at_ms})
}

fn letter_json(letter: &Letter, record: Option<&DeadLetterRow>, body: bool) -> Value {
    let mut value = json!({
        "message_id": letter.message_id(),
        "correlation_id": letter.properties.correlation_id().as_ref().map(ShortString::as_str),
        "fingerprint": letter.fingerprint().to_string(),
        "from_queue": letter.source(),
        "record": record.map(record_json),
    });
    if body {
        value["headers"] = headers(&letter.properties)
            .into_iter()
            .map(|(k, v)| (k, Value::String(v)))
            .collect::<serde_json::Map<_, _>>()
            .into();
        value["body"] = match std::str::from_utf8(&letter.body) {
            Ok(text) => Value::String(text.to_owned()),
            Err(_) => Value::Null,
        };
        value["body_bytes"] = letter.body.len().into();
    }
    value
}

/// What `idem dlq replay` was asked to do.
struct Replay<'a> {
    queue: &'a str,
    ids: &'a [String],
    all: bool,
    to: Option<&'a str>,
    keep: bool,
}

/// What a replay did.
#[derive(Default)]
struct Replayed {
    replayed: u64,
    cleared: u64,
    without_record: u64,
    failed: Vec<String>,
}

async fn replay<DB: Dialect>(
    cli: &Cli,
    inbox: &SqlInbox<DB>,
    plan: &Replay<'_>,
) -> Result<(), CliError> {
    let broker = Broker::open(cli, plan.queue).await?;
    let opening = broker.connection.create_channel();
    let publisher = match broker
        .answer("opening the publishing channel", opening)
        .await
    {
        Ok(publisher) => publisher,
        Err(e) => {
            broker.close().await;
            return Err(e);
        }
    };
    let confirms = publisher.confirm_select(ConfirmSelectOptions::default());
    if let Err(e) = broker.answer("confirm mode", confirms).await {
        broker.close().await;
        return Err(e);
    }
    let records = inbox.dead_letters(plan.queue).await?;
    // Only the messages in the queue now: dead letters arriving meanwhile are not read.
    let in_queue = broker.count().await?;
    let progress = ProgressBar::new(u64::from(in_queue)).with_style(
        ProgressStyle::with_template("{bar:40} {pos}/{len} read, {msg} ({eta} left)")
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    let mut done = Replayed::default();
    let mut found = vec![false; plan.ids.len()];
    let result = async {
        for _ in 0..in_queue {
            let Some(letter) = broker.next().await? else {
                break;
            };
            progress.inc(1);
            let wanted = plan.all || {
                let hits: Vec<usize> = (0..plan.ids.len())
                    .filter(|&i| letter.is(&plan.ids[i]))
                    .collect();
                hits.iter().for_each(|&i| found[i] = true);
                !hits.is_empty()
            };
            if !wanted {
                continue;
            }
            match replay_one(&broker, &publisher, inbox, plan, &letter, &records).await {
                Ok(cleared) => {
                    done.replayed += 1;
                    match cleared {
                        Some(true) => done.cleared += 1,
                        Some(false) => {}
                        None => done.without_record += 1,
                    }
                }
                // A broker that does not answer would make every next letter wait as long.
                Err(CliError::NoAnswer(why)) => {
                    return Err(CliError::NoAnswer(format!(
                        "{why}; stopped after {} replayed, the rest stays in the DLQ",
                        done.replayed
                    )));
                }
                Err(e) => {
                    let id = letter
                        .message_id()
                        .map_or_else(|| short_fingerprint(&letter), str::to_owned);
                    done.failed.push(format!("{id}: {e}"));
                }
            }
            progress.set_message(format!("{} replayed", done.replayed));
        }
        Ok::<_, CliError>(())
    }
    .await;
    progress.finish_and_clear();
    let closing = publisher.close(200, ShortString::from("done"));
    let _ = tokio::time::timeout(broker.timeout, closing).await;
    broker.close().await;
    result?;
    let missing: Vec<&str> = plan
        .ids
        .iter()
        .zip(&found)
        .filter(|(_, f)| !**f)
        .map(|(id, _)| id.as_str())
        .collect();
    summarize(cli, plan, &done, &missing);
    if !done.failed.is_empty() {
        return Err(CliError::Partial(format!(
            "{} dead letters were not replayed and stay in the DLQ",
            done.failed.len()
        )));
    }
    if !missing.is_empty() {
        return Err(CliError::NotFound(format!(
            "not in the DLQ: {}",
            missing.join(", ")
        )));
    }
    Ok(())
}

/// Clears the failure of `letter`'s key, publishes its copy and acknowledges it (unless the
/// replay keeps dead letters). `Some(cleared)` when it had a record, `None` when not.
async fn replay_one<DB: Dialect>(
    broker: &Broker,
    publisher: &Channel,
    inbox: &SqlInbox<DB>,
    plan: &Replay<'_>,
    letter: &Letter,
    records: &[DeadLetterRow],
) -> Result<Option<bool>, CliError> {
    let target = match (plan.to, letter.source()) {
        (Some(to), _) => to.to_owned(),
        (None, Some(source)) => source,
        (None, None) => plan.queue.to_owned(),
    };
    let record = letter.record(records);
    let cleared = match record {
        Some(r) => {
            let removed = inbox.clear_failure(&r.consumer, &r.key).await?;
            Some(removed.row || removed.deliveries || removed.dead_letter)
        }
        None => None,
    };
    let publish = publisher.basic_publish(
        ShortString::from(""),
        ShortString::from(target.as_str()),
        BasicPublishOptions {
            mandatory: true,
            immediate: false,
        },
        &letter.body,
        without_death(&letter.properties),
    );
    let confirm = broker.answer("publishing", publish).await?;
    let confirm = broker.answer("publishing", confirm).await?;
    match confirm {
        Confirmation::Ack(None) => {}
        Confirmation::Ack(Some(_)) => {
            return Err(CliError::Broker(format!("no queue {target} takes it")));
        }
        Confirmation::Nack(_) | Confirmation::NotRequested => {
            return Err(CliError::Broker(format!(
                "the broker refused the publish to {target}"
            )));
        }
    }
    if !plan.keep {
        let ack = broker
            .channel
            .basic_ack(letter.tag, BasicAckOptions { multiple: false });
        broker.answer("removing the dead letter", ack).await?;
    }
    Ok(cleared)
}

/// `properties` without the broker's dead-lettering headers and idem's attempt count.
fn without_death(properties: &BasicProperties) -> BasicProperties {
    let Some(headers) = properties.headers() else {
        return properties.clone();
    };
    let mut kept = FieldTable::default();
    for (name, value) in headers.inner() {
        if !DROPPED_HEADERS.contains(&name.as_str()) {
            kept.insert(name.clone(), value.clone());
        }
    }
    properties.clone().with_headers(kept)
}

fn summarize(cli: &Cli, plan: &Replay<'_>, done: &Replayed, missing: &[&str]) {
    if cli.json {
        json(
            &json!({"replayed": done.replayed, "failures_cleared": done.cleared,
                     "without_record": done.without_record, "kept": plan.keep,
                     "failed": done.failed, "not_found": missing}),
        );
        return;
    }
    println!(
        "replayed {} dead letters{}; {} inbox failures cleared, {} without a record",
        done.replayed,
        if plan.keep { " (kept in the DLQ)" } else { "" },
        done.cleared,
        done.without_record
    );
    for failure in &done.failed {
        println!("not replayed: {failure}");
    }
    for id in missing {
        println!("not found: {id}");
    }
}
