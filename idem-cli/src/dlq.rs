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
use crate::error::CliError;
use crate::output::{age, cut, json, table};
use idem::sql::{DeadLetterRow, Dialect, SqlInbox};
use idem::store::Fingerprint;
use idem::telemetry::redact_url;
use indicatif::{ProgressBar, ProgressStyle};
use lapin::options::{
    BasicAckOptions, BasicGetOptions, BasicPublishOptions, ConfirmSelectOptions,
    QueueDeclareOptions,
};
use lapin::tcp::OwnedTLSConfig;
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
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

/// One dead letter, held unacknowledged on the reading channel.
struct Letter {
    tag: u64,
    properties: BasicProperties,
    body: Vec<u8>,
}

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

/// The broker connection and the reading channel.
struct Broker {
    connection: Connection,
    channel: Channel,
    dlq: String,
}

/// A connection to the first broker of `urls` (comma-separated, in failover order) that takes
/// one.
async fn connect_first(urls: &str, tls: OwnedTLSConfig) -> Result<Connection, CliError> {
    let mut failed = None;
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let runtime = lapin::runtime::default_runtime()
            .map_err(|e| CliError::Broker(format!("cannot start a connection: {e}")))?;
        let properties = ConnectionProperties::default();
        match Connection::connect_with_config(url, properties, tls.clone(), runtime).await {
            Ok(connection) => return Ok(connection),
            Err(e) => failed = Some(format!("{}: {e}", redact_url(url))),
        }
    }
    Err(CliError::Broker(format!(
        "cannot reach {}",
        failed.unwrap_or_else(|| "any broker: AMQP_URL is empty".to_owned())
    )))
}

impl Broker {
    async fn open(cli: &Cli, queue: &str) -> Result<Self, CliError> {
        let cert_chain = match &cli.amqp_tls_ca {
            Some(path) => Some(
                std::fs::read_to_string(path)
                    .map_err(|e| CliError::Usage(format!("AMQP_TLS_CA {}: {e}", path.display())))?,
            ),
            None => None,
        };
        let tls = OwnedTLSConfig {
            identity: None,
            cert_chain,
        };
        let connection = connect_first(&cli.amqp_url, tls).await?;
        let channel = connection
            .create_channel()
            .await
            .map_err(CliError::broker("opening a channel"))?;
        Ok(Self {
            connection,
            channel,
            dlq: idem::rabbitmq::dlq(queue),
        })
    }

    /// How many messages the DLQ holds now (it must exist).
    async fn count(&self) -> Result<u32, CliError> {
        let passive = QueueDeclareOptions {
            passive: true,
            ..QueueDeclareOptions::default()
        };
        let declared = self
            .channel
            .queue_declare(
                ShortString::from(self.dlq.as_str()),
                passive,
                FieldTable::default(),
            )
            .await
            .map_err(|e| CliError::NotFound(format!("queue {}: {e}", self.dlq)))?;
        Ok(declared.message_count())
    }

    /// The next dead letter, held unacknowledged; `None` when the queue is empty.
    async fn next(&self) -> Result<Option<Letter>, CliError> {
        let got = self
            .channel
            .basic_get(
                ShortString::from(self.dlq.as_str()),
                BasicGetOptions { no_ack: false },
            )
            .await
            .map_err(CliError::broker("reading the dead-letter queue"))?;
        Ok(got.map(|message| Letter {
            tag: message.delivery.delivery_tag,
            properties: message.delivery.properties,
            body: message.delivery.data,
        }))
    }

    /// Up to `limit` dead letters, oldest first, all held; and how many the queue held.
    async fn read(&self, limit: u64) -> Result<(Vec<Letter>, u32), CliError> {
        let total = self.count().await?;
        let mut letters = Vec::new();
        while (letters.len() as u64) < u64::from(total).min(limit) {
            match self.next().await? {
                Some(letter) => letters.push(letter),
                None => break,
            }
        }
        Ok((letters, total))
    }

    /// Closes; every message still held goes back to the DLQ.
    async fn close(self) {
        let _ = self.channel.close(200, ShortString::from("done")).await;
        let _ = self.connection.close(200, ShortString::from("done")).await;
    }
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
    let publisher = broker
        .connection
        .create_channel()
        .await
        .map_err(CliError::broker("opening the publishing channel"))?;
    publisher
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(CliError::broker("confirm mode"))?;
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
    let _ = publisher.close(200, ShortString::from("done")).await;
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
    let confirm = publisher
        .basic_publish(
            ShortString::from(""),
            ShortString::from(target.as_str()),
            BasicPublishOptions {
                mandatory: true,
                immediate: false,
            },
            &letter.body,
            without_death(&letter.properties),
        )
        .await
        .map_err(CliError::broker("publishing"))?
        .await
        .map_err(CliError::broker("publishing"))?;
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
        broker
            .channel
            .basic_ack(letter.tag, BasicAckOptions { multiple: false })
            .await
            .map_err(CliError::broker("removing the dead letter"))?;
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
