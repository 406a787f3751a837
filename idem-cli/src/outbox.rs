//! `idem outbox …`: the outbox rows the broker refused, parked out of the relay's way, and those
//! it gave up (outbox dead letters); releasing them once their queue exists, or dropping them.

use crate::args::{Cli, Outbox};
use crate::error::CliError;
use crate::output::{cut, json, table};
use idem::sql::{Dialect, SqlInbox};
use serde_json::json;

/// Runs one outbox command.
pub async fn run<DB: Dialect>(
    cli: &Cli,
    inbox: &SqlInbox<DB>,
    command: &Outbox,
) -> Result<(), CliError> {
    match command {
        Outbox::Parked => {
            let parked = inbox.parked().await?;
            if cli.json {
                let rows: Vec<_> = parked
                    .iter()
                    .map(|p| {
                        json!({"seq": p.seq, "message_id": p.message_id, "consumer": p.consumer,
                               "key": p.key, "exchange": p.exchange, "routing_key": p.routing_key,
                               "failure": p.failure, "parked_at_ms": p.parked_at_ms,
                               "given_up_at_ms": p.given_up_at_ms})
                    })
                    .collect();
                json(&json!({"parked": rows}));
            } else if parked.is_empty() {
                println!("no parked outbox rows");
            } else {
                let rows: Vec<Vec<String>> = parked
                    .iter()
                    .map(|p| {
                        vec![
                            p.seq.to_string(),
                            cut(&p.message_id, 36),
                            cut(&format!("{}/{}", p.exchange, p.routing_key), 40),
                            match p.given_up_at_ms {
                                Some(_) => "given up".to_owned(),
                                None => "parked".to_owned(),
                            },
                            cut(&p.failure, 60),
                        ]
                    })
                    .collect();
                table(
                    &["seq", "message id", "exchange/routing key", "state", "why"],
                    &rows,
                );
            }
            Ok(())
        }
        Outbox::Release { seqs, all } => {
            let seqs: Vec<i64> = match all {
                true => inbox.parked().await?.iter().map(|p| p.seq).collect(),
                false => seqs.clone(),
            };
            let released = inbox.release_parked(&seqs).await?;
            if cli.json {
                json(&json!({"released": released}));
            } else {
                println!(
                    "released {released} parked outbox row(s); the relay publishes them at its next pass"
                );
            }
            Ok(())
        }
        Outbox::Drop { seqs, given_up } => {
            let seqs: Vec<i64> = match given_up {
                true => inbox
                    .parked()
                    .await?
                    .iter()
                    .filter(|p| p.given_up_at_ms.is_some())
                    .map(|p| p.seq)
                    .collect(),
                false => seqs.clone(),
            };
            let dropped = inbox.drop_parked(&seqs).await?;
            if cli.json {
                json(&json!({"dropped": dropped}));
            } else {
                println!("dropped {dropped} parked outbox row(s); they are never published");
            }
            Ok(())
        }
    }
}
