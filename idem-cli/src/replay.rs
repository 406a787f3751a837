//! `idem dlq replay`: for each dead letter asked for, the inbox's record of its failure is
//! cleared, its copy published (confirmed, mandatory, without the broker's dead-lettering
//! headers) to the queue idem consumed it from (its record's, else the queue whose dead letters
//! these are; `--to` overrides) and only then the dead letter acknowledged. Interrupted at any point, it leaves
//! the dead letter in place; replayed again, the first copy's inbox row makes the second a
//! duplicate.

use crate::args::Cli;
use crate::broker::{Broker, Named};
use crate::error::CliError;
use crate::output::json;
use idem::sql::{DeadLetterRow, Dialect, SqlInbox};
use idem::transport::{HeldLetter, OutboundError};
use indicatif::{ProgressBar, ProgressStyle};
use serde_json::json;

/// What `idem dlq replay` was asked to do.
pub(crate) struct Replay<'a> {
    pub(crate) queue: &'a str,
    pub(crate) ids: &'a [String],
    pub(crate) all: bool,
    pub(crate) to: Option<&'a str>,
    pub(crate) keep: bool,
}

/// What a replay did.
#[derive(Default)]
struct Replayed {
    replayed: u64,
    cleared: u64,
    without_record: u64,
    failed: Vec<String>,
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

/// Reads the dead letters in the queue now (those arriving meanwhile are not read) and
/// replays those `plan` names; what was done, and which of `plan.ids` were found.
async fn replay_letters<DB: Dialect>(
    broker: &Broker,
    inbox: &SqlInbox<DB>,
    plan: &Replay<'_>,
) -> Result<(Replayed, Vec<bool>), CliError> {
    let records = inbox.dead_letters(plan.queue).await?;
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
            match replay_one(broker, inbox, plan, &letter, &records).await {
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

/// Clears the failure of `letter`'s key, publishes its copy and acknowledges it (unless the
/// replay keeps dead letters). `Some(cleared)` when it had a record, `None` when not.
async fn replay_one<DB: Dialect>(
    broker: &Broker,
    inbox: &SqlInbox<DB>,
    plan: &Replay<'_>,
    letter: &HeldLetter,
    records: &[DeadLetterRow],
) -> Result<Option<bool>, CliError> {
    // Where idem consumed it: its record says, else the queue whose dead letters these are;
    // never a header, which a producer may have written.
    let record = letter.record(records);
    let target = match (plan.to, record) {
        (Some(to), _) => to,
        (None, Some(record)) => record.queue.as_str(),
        (None, None) => plan.queue,
    };
    let cleared = match record {
        Some(r) => {
            let removed = inbox.clear_failure(&r.consumer, &r.key).await?;
            Some(removed.row || removed.deliveries || removed.dead_letter)
        }
        None => None,
    };
    let published = broker.answer("publishing", async {
        match broker.reader.replay(letter, target).await {
            Err(OutboundError::Unroutable { .. }) => Err(format!("no queue {target} takes it")),
            Err(OutboundError::Refused) => {
                Err(format!("the broker refused the publish to {target}"))
            }
            other => other.map_err(|e| e.to_string()),
        }
    });
    published.await?;
    if !plan.keep {
        let removed = broker.reader.remove(letter);
        broker.answer("removing the dead letter", removed).await?;
    }
    Ok(cleared)
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
