//! `idem dlq …`: the dead letters of a queue, read through the transport's
//! [`DeadLetterReader`](idem::transport::DeadLetterReader) and joined to the records the
//! runtime wrote before it dead-lettered them (same body fingerprint and message id); and
//! replaying them (`crate::replay`).
//!
//! Reading leaves the queue as it was: every message read is held unacknowledged on the
//! reading channel and goes back when the channel closes. A replay clears the inbox's record
//! of the failure, publishes the copy (confirmed, mandatory) and only then acknowledges the
//! dead letter: interrupted at any point, it leaves the dead letter in place, and replaying it
//! again cannot process it twice (the first copy's inbox row makes the second a duplicate).

use crate::args::{Cli, Dlq};
use crate::broker::{Broker, Named};
use crate::error::CliError;
use crate::output::{age, cut, json, now_ms, span, table};
use crate::release;
use crate::replay;
use idem::sql::{DeadLetterRow, Dialect, ParkedKey, SqlInbox};
use idem::transport::HeldLetter;
use serde_json::{Value, json};

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
            let parked: Vec<ParkedKey> = inbox
                .parked_keys()
                .await?
                .into_iter()
                .filter(|k| k.queue == queue.queue)
                .collect();
            list(cli, &letters, &records, total, &parked);
            Ok(())
        }
        Dlq::Show { queue, id } => {
            let broker = Broker::open(cli, &queue.queue).await?;
            let name = broker.reader.name().to_owned();
            let read = broker.read(u64::MAX).await;
            broker.close().await;
            let (letters, _) = read?;
            let records = inbox.dead_letters(&queue.queue).await?;
            let found: Vec<&HeldLetter> = letters.iter().filter(|l| l.is(id)).collect();
            if found.is_empty() {
                return Err(CliError::NotFound(format!("no dead letter {id} in {name}")));
            }
            for letter in found {
                show(cli, letter, letter.record(&records));
            }
            Ok(())
        }
        Dlq::Replay {
            queue,
            key: Some(key),
            force,
            ..
        } => {
            let head = release::Head::Replay { force: *force };
            release::release(cli, inbox, &queue.queue, key, head).await
        }
        Dlq::Skip { queue, key, reason } => {
            let head = release::Head::Skip { reason };
            release::release(cli, inbox, &queue.queue, key, head).await
        }
        Dlq::Replay {
            queue,
            ids,
            all,
            to,
            keep,
            force,
            key: None,
        } => {
            let plan = replay::Replay {
                queue: &queue.queue,
                ids,
                all: *all,
                to: to.as_deref(),
                keep: *keep,
                force: *force,
            };
            replay::replay(cli, inbox, &plan).await
        }
    }
}

fn list(
    cli: &Cli,
    letters: &[HeldLetter],
    records: &[DeadLetterRow],
    total: u64,
    parked: &[ParkedKey],
) {
    if cli.json {
        let items: Vec<Value> = letters
            .iter()
            .map(|l| letter_json(l, l.record(records), false))
            .collect();
        let keys: Vec<Value> = parked.iter().map(release::parked_json).collect();
        json(&json!({"total": total, "dead_letters": items, "parked_keys": keys}));
        return;
    }
    let rows: Vec<Vec<String>> = letters
        .iter()
        .map(|l| {
            let record = l.record(records);
            let field = |f: fn(&DeadLetterRow) -> String| record.map_or("-".to_owned(), f);
            vec![
                l.id(),
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
    if !parked.is_empty() {
        println!();
        table(
            &[
                "PARKED KEY",
                "CONSUMER",
                "STATE",
                "WAITING",
                "PARKED",
                "BEHIND",
                "WHY",
            ],
            &release::parked_rows(parked),
        );
        println!(
            "{} keys parked: their later messages wait behind their dead letter; `idem dlq replay --key K` or `idem dlq skip --key K --reason ...` releases one",
            parked.len()
        );
    }
}

fn show(cli: &Cli, letter: &HeldLetter, record: Option<&DeadLetterRow>) {
    if cli.json {
        json(&letter_json(letter, record, true));
        return;
    }
    println!(
        "message id     {}",
        letter.message_id.as_deref().unwrap_or("(none)")
    );
    if let Some(id) = &letter.correlation_id {
        println!("correlation id {id}");
    }
    if let Some(t) = &letter.content_type {
        println!("content type   {t}");
    }
    if let Some(ms) = letter.published_at_ms {
        println!("published      {}", age(ms));
    }
    println!("fingerprint    sha256:{}", letter.fingerprint());
    println!("from queue     {}", letter.source.as_deref().unwrap_or("?"));
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
            if let Some(first) = r.first_failed_at_ms {
                println!("first failure  {}", age(first));
            }
            println!("dead-lettered  {}", age(r.dead_lettered_at_ms));
            match r.retention {
                Some(retention) => {
                    let (start, _) = crate::replay::window_start(r, letter.published_at_ms);
                    let retention = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
                    let end = start.saturating_add(retention);
                    let now = now_ms();
                    let window = match end < now {
                        true => format!("over {} ago: a replay needs --force", span(now - end)),
                        false => format!("ends in {}", span(end - now)),
                    };
                    println!("dedup window   {window} (retention {})", span(retention));
                }
                None => println!("dedup window   unknown (the record does not say the retention)"),
            }
        }
        None => println!("reason         (no record)"),
    }
    for (name, value) in &letter.headers {
        println!("header         {name} = {value}");
    }
    println!("body           {} bytes", letter.body.len());
    println!("{}", String::from_utf8_lossy(&letter.body));
}

/// A dead-letter record as JSON.
pub fn record_json(r: &DeadLetterRow) -> Value {
    json!({"consumer": r.consumer, "key": r.key, "keyed": r.keyed, "queue": r.queue,
           "reason": r.reason, "detail": r.detail, "attempts": r.attempts,
           "message_id": r.message_id, "dead_lettered_at_ms": r.dead_lettered_at_ms,
           "first_failed_at_ms": r.first_failed_at_ms,
           "retention_ms": r.retention.map(|d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
           "dedup_window_ends_ms": r.dedup_window_ends_ms()})
}

fn letter_json(letter: &HeldLetter, record: Option<&DeadLetterRow>, body: bool) -> Value {
    let mut value = json!({
        "message_id": letter.message_id,
        "correlation_id": letter.correlation_id,
        "fingerprint": letter.fingerprint().to_string(),
        "from_queue": letter.source,
        "published_at_ms": letter.published_at_ms,
        "dedup_window_ends_ms": record.and_then(|r| {
            let retention = i64::try_from(r.retention?.as_millis()).unwrap_or(i64::MAX);
            Some(crate::replay::window_start(r, letter.published_at_ms).0.saturating_add(retention))
        }),
        "record": record.map(record_json),
    });
    if body {
        value["headers"] = letter
            .headers
            .iter()
            .map(|(k, v)| (k.clone(), Value::String(v.clone())))
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
