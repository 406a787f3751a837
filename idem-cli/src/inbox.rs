//! `idem inbox …`: what the inbox holds, per consumer and per key; forgetting a key; sweeping.

use crate::args::{Cli, Inbox};
use crate::error::CliError;
use crate::output::{age, cut, json, table};
use idem::sql::{Dialect, KeyReport, Removed, SqlInbox};
use idem::store::SweepStore;
use indicatif::ProgressBar;
use serde_json::{Value, json};
use std::time::Duration;

/// Runs one inbox command.
pub async fn run<DB: Dialect>(
    cli: &Cli,
    inbox: &SqlInbox<DB>,
    command: &Inbox,
) -> Result<(), CliError> {
    match command {
        Inbox::Stats => stats(cli, inbox).await,
        Inbox::Show { consumer, key } => {
            let report = inbox.show(consumer, key).await?;
            if cli.json {
                json(&report_json(consumer, key, &report));
            } else {
                print_report(consumer, key, &report);
            }
            Ok(())
        }
        Inbox::Forget { consumer, key } => {
            let removed = inbox.forget(consumer, key).await?;
            if cli.json {
                json(&json!({"consumer": consumer, "key": key, "removed": removed_json(&removed)}));
            } else if removed == Removed::default() {
                println!("nothing held for {consumer} / {key}");
            } else {
                println!("forgot {consumer} / {key}: {}", describe(&removed));
            }
            Ok(())
        }
        Inbox::Sweep { batch } => sweep(cli, inbox, *batch).await,
    }
}

async fn stats<DB: Dialect>(cli: &Cli, inbox: &SqlInbox<DB>) -> Result<(), CliError> {
    let stats = inbox.stats().await?;
    if cli.json {
        let statuses: Vec<Value> = stats
            .statuses
            .iter()
            .map(|s| {
                json!({"consumer": s.consumer, "status": s.status, "rows": s.rows,
                       "oldest_ms": s.oldest_ms, "expired": s.expired})
            })
            .collect();
        let dead: Vec<Value> = stats
            .dead_letters
            .iter()
            .map(|d| json!({"consumer": d.consumer, "records": d.rows, "oldest_ms": d.oldest_ms}))
            .collect();
        json(&json!({"table": cli.table, "rows": statuses, "dead_letters": dead}));
        return Ok(());
    }
    if stats.statuses.is_empty() {
        println!("inbox {} is empty", cli.table);
    } else {
        let rows: Vec<Vec<String>> = stats
            .statuses
            .iter()
            .map(|s| {
                vec![
                    s.consumer.clone(),
                    s.status.clone(),
                    s.rows.to_string(),
                    age(s.oldest_ms),
                    s.expired.to_string(),
                ]
            })
            .collect();
        table(
            &[
                "CONSUMER",
                "STATUS",
                "ROWS",
                "OLDEST",
                "EXPIRED (not swept)",
            ],
            &rows,
        );
    }
    if !stats.dead_letters.is_empty() {
        println!();
        let rows: Vec<Vec<String>> = stats
            .dead_letters
            .iter()
            .map(|d| vec![d.consumer.clone(), d.rows.to_string(), age(d.oldest_ms)])
            .collect();
        table(&["CONSUMER", "DEAD-LETTER RECORDS", "OLDEST"], &rows);
    }
    Ok(())
}

async fn sweep<DB: Dialect>(cli: &Cli, inbox: &SqlInbox<DB>, batch: u32) -> Result<(), CliError> {
    let progress = ProgressBar::new_spinner().with_message("sweeping expired rows");
    progress.enable_steady_tick(Duration::from_millis(120));
    let (mut rows, mut deliveries, mut statements) = (0u64, 0u64, 0u64);
    loop {
        let report = inbox.sweep(batch.max(1), 10).await?;
        if !report.locked {
            progress.finish_and_clear();
            return Err(CliError::Partial(
                "another sweeper holds this inbox's sweeper lock; nothing was deleted".to_owned(),
            ));
        }
        rows += report.deleted;
        deliveries += report.counts_deleted;
        statements += u64::from(report.batches);
        progress.set_message(format!("{rows} rows deleted"));
        if report.lag.is_zero() || report.deleted == 0 {
            break;
        }
    }
    progress.finish_and_clear();
    if cli.json {
        json(
            &json!({"rows_deleted": rows, "delivery_counts_deleted": deliveries,
                     "statements": statements}),
        );
    } else {
        println!(
            "swept {rows} expired rows and {deliveries} expired delivery counts in {statements} statements"
        );
    }
    Ok(())
}

fn print_report(consumer: &str, key: &str, report: &KeyReport) {
    println!("consumer     {consumer}");
    println!("key          {key}");
    match &report.row {
        None => println!("row          none (a message with this key is processed as new)"),
        Some(row) => {
            println!("status       {}", row.status);
            println!("attempts     {}", row.attempts);
            println!("created      {}", age(row.created_ms));
            if let Some(at) = row.completed_ms {
                println!("completed    {}", age(at));
            }
            println!("expires      {}", age(row.expires_ms));
            if let Some(fp) = &row.fingerprint {
                println!("fingerprint  sha256:{fp}");
            }
            if let Some(outcome) = &row.outcome {
                println!("result       {}", cut(outcome, 200));
            }
            if let Some(owner) = &row.owner {
                println!("lease owner  {owner}");
            }
            if let Some(until) = row.locked_until_ms {
                println!("lease until  {}", age(until));
            }
        }
    }
    if let Some(n) = report.deliveries {
        println!("redeliveries {n} without a settlement (the poison limit's count)");
    }
    if let Some(dl) = &report.dead_letter {
        println!(
            "dead letter  {} ({}), {} attempts, {} from {}",
            dl.reason,
            dl.detail,
            dl.attempts,
            age(dl.dead_lettered_at_ms),
            dl.queue
        );
    }
}

fn report_json(consumer: &str, key: &str, report: &KeyReport) -> Value {
    let row = report.row.as_ref().map(|row| {
        json!({"status": row.status, "attempts": row.attempts, "outcome": row.outcome,
               "fingerprint": row.fingerprint.map(|f| f.to_string()),
               "created_ms": row.created_ms, "completed_ms": row.completed_ms,
               "expires_ms": row.expires_ms, "owner": row.owner,
               "locked_until_ms": row.locked_until_ms})
    });
    json!({"consumer": consumer, "key": key, "row": row, "deliveries": report.deliveries,
           "dead_letter": report.dead_letter.as_ref().map(crate::dlq::record_json)})
}

pub(crate) fn removed_json(removed: &Removed) -> Value {
    json!({"row": removed.row, "deliveries": removed.deliveries,
           "dead_letter": removed.dead_letter})
}

fn describe(removed: &Removed) -> String {
    let parts: Vec<&str> = [
        (removed.row, "its row"),
        (removed.deliveries, "its redelivery count"),
        (removed.dead_letter, "its dead-letter record"),
    ]
    .iter()
    .filter(|(done, _)| *done)
    .map(|(_, what)| *what)
    .collect();
    parts.join(", ")
}
