//! `idem dlq replay`: for each dead letter asked for, the inbox is asked first what it knows
//! of its key ([`judge`]):
//!
//! - applied, with the same payload: the dead letter is resolved (removed with its record,
//!   unless `--keep`) and not published;
//! - applied with another payload: refused (a replay would be a conflict again);
//! - the dedup window is over (its message was published, or its failures began, longer ago
//!   than its consumer's retention, so a copy applied meanwhile may have been swept), or its
//!   record does not say its retention: refused unless `--force`;
//! - else the failure's traces in the inbox are cleared, its copy published (confirmed,
//!   mandatory, without the broker's dead-lettering headers) to the queue idem consumed it from
//!   (its record's, else the queue whose dead letters these are; `--to` overrides), and only
//!   then the dead letter acknowledged and its record removed (unless a later failure wrote
//!   another meanwhile). Interrupted at any point, it leaves the dead letter in place; replayed
//!   again, the first copy's inbox row makes the second resolved, or a duplicate.

use crate::args::Cli;
use crate::broker::{Broker, Named};
use crate::error::CliError;
use crate::output::json;
use crate::output::{age, now_ms, span};
use idem::sql::{DeadLetterRow, Dialect, KeyReport, ParkedKey, SqlInbox};
use idem::transport::{HeldLetter, OutboundError, PublishTime};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

/// What `idem dlq replay` was asked to do.
pub(crate) struct Replay<'a> {
    pub(crate) queue: &'a str,
    pub(crate) ids: &'a [String],
    pub(crate) all: bool,
    pub(crate) to: Option<&'a str>,
    pub(crate) keep: bool,
    pub(crate) force: bool,
}

/// What the inbox says of one dead letter's replay.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Verdict {
    /// Publish it.
    Replay,
    /// Its key was applied with its payload: not published, and the dead letter goes.
    Resolved(String),
    /// Not published; it stays in the DLQ, for this reason.
    Refused(String),
}

/// What a replay of the dead letter with `record`, its message published at `published_ms`
/// where known, should do, given the inbox's `report` of its key (`None`: the key was never
/// read) at `now_ms`; `force` replays beyond the dedup window.
pub(crate) fn judge(
    record: &DeadLetterRow,
    published_ms: Option<i64>,
    report: Option<&KeyReport>,
    now_ms: i64,
    force: bool,
) -> Verdict {
    if let Some(row) = report.and_then(|r| r.row.as_ref())
        && row.status == "completed"
    {
        let when = row
            .completed_ms
            .map_or_else(String::new, |ms| format!(" {}", age(ms)));
        if row.fingerprint == record.fingerprint {
            return Verdict::Resolved(format!(
                "key {} of {} was applied{when}, with this payload: not replayed",
                record.key, record.consumer
            ));
        }
        return Verdict::Refused(format!(
            "key {} of {} was applied{when} with another payload: a replay would be dead-lettered as a conflict again (`idem inbox forget {} {}` first applies this one as new)",
            record.key, record.consumer, record.consumer, record.key
        ));
    }
    if force {
        return Verdict::Replay;
    }
    let Some(retention) = record.retention else {
        return Verdict::Refused(
            "its record does not say its consumer's retention (written by an earlier idem), so whether a copy applied since was swept cannot be told; --force replays it anyway".to_owned(),
        );
    };
    match window_start(record, published_ms) {
        (start, what) if now_ms > start.saturating_add(ms(retention)) => Verdict::Refused(format!(
            "beyond the dedup window: {what} {} and its consumer's inbox keeps a key's row for {}, so a copy applied meanwhile may have been swept and the replay would apply it again; --force replays it anyway",
            age(start),
            span(ms(retention))
        )),
        _ => Verdict::Replay,
    }
}

/// Where the dead letter's dedup window starts, and what: its message's publish time where
/// the letter says (its consumer counts the window from it), else when its failures began,
/// whichever is earlier.
pub(crate) fn window_start(
    record: &DeadLetterRow,
    published_ms: Option<i64>,
) -> (i64, &'static str) {
    let failed = record
        .first_failed_at_ms
        .unwrap_or(record.dead_lettered_at_ms);
    match published_ms {
        Some(published) if published < failed => (published, "its message was published"),
        _ => (failed, "its failures began"),
    }
}

fn ms(duration: std::time::Duration) -> i64 {
    i64::try_from(duration.as_millis()).unwrap_or(i64::MAX)
}

/// What a replay did.
#[derive(Default)]
struct Replayed {
    replayed: u64,
    cleared: u64,
    without_record: u64,
    /// Found applied: not published.
    resolved: Vec<String>,
    /// Left in the DLQ, with why.
    refused: Vec<String>,
    failed: Vec<String>,
}

/// What became of one dead letter asked for.
enum Done {
    /// Published; whether it had a record (whose failure was cleared).
    Replayed(bool),
    /// Not published, for this reason.
    Resolved(String),
    /// Left in the DLQ, for this reason.
    Refused(String),
}

/// Replays the dead letters `plan` names (see the module).
pub(crate) async fn replay<DB: Dialect>(
    cli: &Cli,
    inbox: &SqlInbox<DB>,
    plan: &Replay<'_>,
) -> Result<(), CliError> {
    let broker = Broker::open(cli, plan.queue).await?;
    let replayed = replay_letters(&broker, inbox, plan).await;
    // Closed whatever happened: the letters still held go back to the DLQ.
    broker.close().await;
    let (done, found) = replayed?;
    let missing: Vec<&str> = plan
        .ids
        .iter()
        .zip(&found)
        .filter(|(_, f)| !**f)
        .map(|(id, _)| id.as_str())
        .collect();
    summarize(cli, plan, &done, &missing);
    if !done.failed.is_empty() || !done.refused.is_empty() {
        return Err(CliError::Partial(format!(
            "{} dead letters were not replayed and stay in the DLQ ({} refused, {} failed)",
            done.failed.len() + done.refused.len(),
            done.refused.len(),
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

/// Reads the dead letters in the queue now (those arriving meanwhile are not read) and
/// replays those `plan` names; what was done, and which of `plan.ids` were found.
async fn replay_letters<DB: Dialect>(
    broker: &Broker,
    inbox: &SqlInbox<DB>,
    plan: &Replay<'_>,
) -> Result<(Replayed, Vec<bool>), CliError> {
    let records = inbox.dead_letters(plan.queue).await?;
    let parked = inbox.parked_keys().await?;
    let in_queue = broker.count().await?;
    let progress = ProgressBar::new(in_queue).with_style(
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
            match replay_one(broker, inbox, plan, &letter, &records, &parked).await {
                Ok(Done::Replayed(recorded)) => {
                    done.replayed += 1;
                    match recorded {
                        true => done.cleared += 1,
                        false => done.without_record += 1,
                    }
                }
                Ok(Done::Resolved(why)) => done.resolved.push(format!("{}: {why}", letter.id())),
                Ok(Done::Refused(why)) => done.refused.push(format!("{}: {why}", letter.id())),
                // A broker that does not answer would make every next letter wait as long.
                Err(CliError::NoAnswer(why)) => {
                    return Err(CliError::NoAnswer(format!(
                        "{why}; stopped after {} replayed, the rest stays in the DLQ",
                        done.replayed
                    )));
                }
                Err(e) => done.failed.push(format!("{}: {e}", letter.id())),
            }
            progress.set_message(format!("{} replayed", done.replayed));
        }
        Ok::<_, CliError>(())
    }
    .await;
    progress.finish_and_clear();
    result.map(|()| (done, found))
}

/// Asks the inbox about `letter`'s key ([`judge`]); then resolves it, leaves it, or clears
/// its failure, publishes its copy and removes it with its record (unless the replay keeps
/// dead letters).
async fn replay_one<DB: Dialect>(
    broker: &Broker,
    inbox: &SqlInbox<DB>,
    plan: &Replay<'_>,
    letter: &HeldLetter,
    records: &[DeadLetterRow],
    parked: &[ParkedKey],
) -> Result<Done, CliError> {
    // A key parked behind it is released with it, in order, or not at all.
    if let Some(key) = parked.iter().find(|k| {
        k.queue == plan.queue
            && !k.head_message_id.is_empty()
            && letter.message_id.as_deref() == Some(k.head_message_id.as_str())
    }) {
        return Ok(Done::Refused(format!(
            "key {:?} of {} is parked behind it: `idem dlq replay --queue {} --key {:?}` replays it and then the messages parked behind it, in order",
            key.order_key, key.consumer, plan.queue, key.order_key
        )));
    }
    // Where idem consumed it: its record says, else the queue whose dead letters these are;
    // never a header, which a producer may have written.
    let record = letter.record(records);
    let target = match (plan.to, record) {
        (Some(to), _) => to,
        (None, Some(record)) => record.queue.as_str(),
        (None, None) => plan.queue,
    };
    let verdict = match record {
        Some(r) => {
            let report = match r.keyed {
                true => Some(inbox.show(&r.consumer, &r.key).await?),
                false => None,
            };
            judge(
                r,
                letter.published_at_ms,
                report.as_ref(),
                now_ms(),
                plan.force,
            )
        }
        None => Verdict::Replay,
    };
    match verdict {
        Verdict::Refused(why) => return Ok(Done::Refused(why)),
        Verdict::Resolved(why) => {
            remove(broker, inbox, plan, letter, record).await?;
            return Ok(Done::Resolved(why));
        }
        Verdict::Replay => {
            if let Some(r) = record {
                inbox.clear_failure(&r.consumer, &r.key).await?;
            }
        }
    }
    // Forced: the copy starts a dedup window of its own, or its consumer would refuse it.
    let time = match plan.force {
        true => PublishTime::Now,
        false => PublishTime::Kept,
    };
    let published = broker.answer("publishing", async {
        match broker.reader.replay(letter, target, time).await {
            Err(OutboundError::Unroutable { .. }) => Err(format!("no queue {target} takes it")),
            Err(OutboundError::Refused) => {
                Err(format!("the broker refused the publish to {target}"))
            }
            other => other.map_err(|e| e.to_string()),
        }
    });
    published.await?;
    remove(broker, inbox, plan, letter, record).await?;
    Ok(Done::Replayed(record.is_some()))
}

/// Removes `letter` from the DLQ and then its record (if no later failure replaced it), unless
/// the replay keeps dead letters.
async fn remove<DB: Dialect>(
    broker: &Broker,
    inbox: &SqlInbox<DB>,
    plan: &Replay<'_>,
    letter: &HeldLetter,
    record: Option<&DeadLetterRow>,
) -> Result<(), CliError> {
    if plan.keep {
        return Ok(());
    }
    let removed = broker.reader.remove(letter);
    broker.answer("removing the dead letter", removed).await?;
    if let Some(record) = record {
        inbox.forget_dead_letter(record).await?;
    }
    Ok(())
}

fn summarize(cli: &Cli, plan: &Replay<'_>, done: &Replayed, missing: &[&str]) {
    if cli.json {
        json(
            &json!({"replayed": done.replayed, "failures_cleared": done.cleared,
                     "without_record": done.without_record, "kept": plan.keep,
                     "resolved": done.resolved, "refused": done.refused,
                     "failed": done.failed, "not_found": missing}),
        );
        return;
    }
    println!(
        "replayed {} dead letters{}; {} inbox failures cleared, {} without a record; {} resolved (applied already), {} refused",
        done.replayed,
        if plan.keep { " (kept in the DLQ)" } else { "" },
        done.cleared,
        done.without_record,
        done.resolved.len(),
        done.refused.len()
    );
    for resolved in &done.resolved {
        println!("resolved: {resolved}");
    }
    for refused in &done.refused {
        println!("refused: {refused}");
    }
    for failure in &done.failed {
        println!("not replayed: {failure}");
    }
    for id in missing {
        println!("not found: {id}");
    }
}
