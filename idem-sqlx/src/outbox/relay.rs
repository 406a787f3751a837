//! Relay passes over the outbox: the rows a pass takes (`FOR UPDATE SKIP LOCKED` where the
//! dialect has it), sent all at once on one channel, their confirms judged in the order staged,
//! the confirmed rows deleted; and the wake-ups that start a pass for rows staged outside any
//! handler.

use crate::dialect::{Conn, Dialect, Row};
use crate::error::store_error;
use crate::exec::Param;
use crate::exec::Sql;
use crate::inbox::SqlInbox;
use idem_core::model::outgoing::headers_from_json;
use idem_core::transport::{Outbound, OutboundError};
use idem_core::{
    model::Destination, model::Envelope, model::Outgoing, model::StoreError, outbox::OutboxSelect,
    outbox::RelayReport,
};
use std::time::Duration;

impl<DB: Dialect> SqlInbox<DB> {
    /// Resolves when this inbox's database says rows were staged outside any handler and
    /// committed ([`Dialect::listen`]); never, where it cannot tell.
    pub(crate) async fn staged_elsewhere(&self) {
        if !self.wake.start() {
            self.wake.notify.notified().await;
            return;
        }
        let listening = DB::listen(self.pool.clone(), self.outbox.clone(), self.wake.clone());
        if !listening {
            std::future::pending::<()>().await;
        }
        self.wake.notify.notified().await;
    }

    /// One relay pass: takes the rows `select` names (skipping rows another pass holds),
    /// publishes them in the order staged, and removes those confirmed, in one transaction. A
    /// row the broker refuses (cannot route or carry, nacks, closes the channel over) is
    /// parked; a row that failed for the broker's state stays; every row is judged.
    pub(crate) async fn relay_rows(
        &self,
        select: &OutboxSelect,
        publish: &dyn Outbound,
    ) -> Result<RelayReport, StoreError> {
        let fail = |e| store_error("relay", e);
        let mut report = RelayReport::default();
        if let OutboxSelect::Older { limit, .. } = select {
            report.given_up = self.release_parked_due(*limit).await?;
        }
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        if let Some(prelude) = DB::STATEMENTS.outbox.prelude {
            DB::Db::execute_raw(&mut *conn, prelude)
                .await
                .map_err(fail)?;
        }
        let mut tx = crate::migrate::begin::<DB>(&mut *conn)
            .await
            .map_err(fail)?;
        let rows = self.take_rows(&mut tx, select).await.map_err(fail)?;
        let mut runs = Vec::with_capacity(rows.len());
        let mut messages = Vec::with_capacity(rows.len());
        for row in &rows {
            let age =
                Duration::from_millis(DB::Db::int(row, "age_ms").map_err(fail)?.max(0) as u64);
            report.oldest = report.oldest.max(Some(age));
            runs.push(Run {
                seq: DB::Db::int(row, "seq").map_err(fail)?,
                consumer: DB::Db::text(row, "consumer").map_err(fail)?,
                key: DB::Db::text(row, "key").map_err(fail)?,
            });
            let mut message = message::<DB>(row).map_err(fail)?;
            // Published as of when it was staged: every copy of the row carries the same
            // time, and its consumer judges its dedup window from it.
            let staged = idem_core::transport::headers::epoch_ms()
                .saturating_sub(i64::try_from(age.as_millis()).unwrap_or(i64::MAX));
            message.envelope.published_at_ms = Some(staged);
            messages.push(message);
        }
        // All sent before any confirm is awaited, then judged row by row: every confirmed row
        // goes, and is never sent again; a row the broker refused is parked out of the way of
        // the rows behind it (`parked.rs`); a row that failed for the broker's state (a lost
        // connection, a timeout) stays for a later pass; and the pass goes on to the end.
        let mut results = publish.publish_all(&messages).await;
        isolate(publish, &messages, &mut results).await;
        let (mut done, parked) = judge(&runs, results, &mut report);
        for (seq, failure) in &parked {
            crate::outbox::parked::park::<DB>(&self.sql.parked, &mut *tx, *seq, failure)
                .await
                .map_err(fail)?;
            done.push(*seq);
        }
        report.parked = parked.len() as u64;
        // After the publishes, so that its round trip is not theirs to wait for.
        if let Some(lazy) = DB::STATEMENTS.outbox.lazy_commit {
            DB::Db::execute_raw(&mut *tx, lazy).await.map_err(fail)?;
        }
        if !done.is_empty() {
            // Integers written into the text: a primary-key lookup per row, in every dialect.
            let seqs: Vec<String> = done.iter().map(i64::to_string).collect();
            let delete: std::sync::Arc<str> = self
                .sql
                .outbox
                .delete
                .replace("{seqs}", &seqs.join(","))
                .into();
            DB::Db::execute(&mut *tx, &delete, &[])
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)?;
        report.published = done.len() as u64 - report.parked;
        Ok(report)
    }

    /// Puts rows parked long enough back behind the rows staged since, and gives up those
    /// refused too long; how many it gave up.
    async fn release_parked_due(&self, limit: u32) -> Result<u64, StoreError> {
        let (given_up, released) = self
            .release_due(crate::outbox::parked::PARK_RETRY, limit)
            .await?;
        if released > 0 {
            tracing::info!(
                released,
                "parked outbox rows put back for the relay to try again"
            );
        }
        if given_up > 0 {
            tracing::error!(given_up, after = ?self.give_up, "outbox rows the broker kept refusing were given up: they are outbox dead letters (`idem outbox parked`)");
        }
        Ok(given_up)
    }

    /// The rows `select` names, taken in `tx` (in the order staged where a scan takes them).
    async fn take_rows(
        &self,
        tx: &mut Conn<DB>,
        select: &OutboxSelect,
    ) -> Result<Vec<Row<DB>>, sqlx::Error> {
        let sql = &self.sql.outbox;
        let scan = matches!(
            select,
            OutboxSelect::Older { .. } | OutboxSelect::Unowned { .. }
        );
        if scan && let Some(in_order) = DB::STATEMENTS.outbox.in_order {
            DB::Db::execute_raw(&mut *tx, in_order).await?;
        }
        match select {
            OutboxSelect::Runs { runs } if runs.is_empty() => Ok(Vec::new()),
            OutboxSelect::Runs { runs } => {
                let matches: Vec<String> = (0..runs.len())
                    .map(|i| {
                        sql.run_match
                            .replace("{c}", &DB::placeholder(2 * i + 1))
                            .replace("{k}", &DB::placeholder(2 * i + 2))
                    })
                    .collect();
                let statement: std::sync::Arc<str> =
                    sql.run.replace("{runs}", &matches.join(" OR ")).into();
                let params: Vec<Param<'_>> = runs
                    .iter()
                    .flat_map(|(consumer, key)| [Param::Text(consumer), Param::Text(key)])
                    .collect();
                DB::Db::fetch_all(tx, &statement, &params).await
            }
            OutboxSelect::Older { age, limit } => {
                let age = i64::try_from(age.as_millis()).unwrap_or(i64::MAX);
                let params = [Param::Int(age), Param::Int(i64::from(*limit))];
                DB::Db::fetch_all(tx, &sql.older, &params).await
            }
            OutboxSelect::Unowned { limit } => {
                let params = [Param::Int(i64::from(*limit))];
                DB::Db::fetch_all(tx, &sql.unowned, &params).await
            }
            _ => Ok(Vec::new()),
        }
    }
}

/// One row a pass took: its sequence number and the run that staged it.
struct Run {
    seq: i64,
    consumer: String,
    key: String,
}

/// The rows of `runs` to remove (confirmed) and to park (refused, with why), judged by their
/// publishes' `results`; a row that failed for the broker's state is neither, and the first
/// such failure is the pass's.
fn judge(
    runs: &[Run],
    results: Vec<Result<(), OutboundError>>,
    report: &mut RelayReport,
) -> (Vec<i64>, Vec<(i64, String)>) {
    let mut done = Vec::with_capacity(runs.len());
    let mut parked = Vec::new();
    for (Run { seq, consumer, key }, result) in runs.iter().zip(results) {
        match result {
            Ok(()) => done.push(*seq),
            Err(e) if refused(&e) => {
                tracing::warn!(seq, consumer, key, error = %e, "the broker refused an outbox row; parking it (`idem outbox parked`)");
                report.unroutable += u64::from(matches!(
                    e,
                    OutboundError::Unroutable { .. } | OutboundError::Invalid(_)
                ));
                parked.push((*seq, e.to_string()));
            }
            Err(e) => {
                report.failure.get_or_insert_with(|| e.to_string());
            }
        }
    }
    (done, parked)
}

impl<DB: Dialect> SqlInbox<DB> {
    /// Removes the rows of `message_ids` (published from memory and confirmed), in one
    /// statement, committed without waiting for the disk where the dialect can (a database
    /// crash that undoes it only sends them again, with their ids); returns how many it
    /// removed (a relay pass may have taken some first).
    pub(crate) async fn remove_published(&self, message_ids: &[String]) -> Result<u64, StoreError> {
        if message_ids.is_empty() {
            return Ok(0);
        }
        let fail = |e| store_error("remove", e);
        let placeholders: Vec<String> = (1..=message_ids.len()).map(DB::placeholder).collect();
        let statement: std::sync::Arc<str> = self
            .sql
            .outbox
            .remove
            .replace("{ids}", &placeholders.join(", "))
            .into();
        let stored: Vec<_> = message_ids
            .iter()
            .map(|id| crate::keys::stored::<DB>(id))
            .collect();
        let params: Vec<Param<'_>> = stored.iter().map(|id| Param::Text(id)).collect();
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let Some(lazy) = DB::STATEMENTS.outbox.lazy_commit else {
            return DB::Db::execute(&mut *conn, &statement, &params)
                .await
                .map_err(fail);
        };
        // As a relay pass's delete: its commit need not wait for the disk.
        let mut tx = crate::migrate::begin::<DB>(&mut *conn)
            .await
            .map_err(fail)?;
        DB::Db::execute_raw(&mut *tx, lazy).await.map_err(fail)?;
        let removed = DB::Db::execute(&mut *tx, &statement, &params)
            .await
            .map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        Ok(removed)
    }
}

/// Whether the broker refused a message for what it is (no queue for it, a body it will not
/// carry, a missing exchange, a nack): parked, so that it never holds up the rows behind it.
fn refused(error: &OutboundError) -> bool {
    matches!(
        error,
        OutboundError::Unroutable { .. }
            | OutboundError::Invalid(_)
            | OutboundError::Refused
            | OutboundError::Rejected(_)
    )
}

/// After a pass whose publishes the broker rejected without naming the message at fault (it
/// closed the channel, and every message sent beside it failed too, this pass's or another's):
/// each of those messages is sent again alone, so that only the one at fault is refused (and
/// parked) and the others go.
async fn isolate(
    publish: &dyn Outbound,
    messages: &[Outgoing],
    results: &mut [Result<(), OutboundError>],
) {
    // One alone is sent again too: the channel is shared with the dispatch and the relay's
    // next pass, whose message may be the one that closed it.
    if !results
        .iter()
        .any(|r| matches!(r, Err(OutboundError::Rejected(_))))
    {
        return;
    }
    // Those that failed as the channel closed under them, too.
    let rejected: Vec<usize> = (0..results.len())
        .filter(|&i| {
            matches!(
                results[i],
                Err(OutboundError::Rejected(_) | OutboundError::Broker(_))
            )
        })
        .collect();
    tracing::info!(
        rejected = rejected.len(),
        "the broker closed the channel over one of a pass's publishes; sending each alone"
    );
    for i in rejected {
        // One sent just after the broker closed the channel may go on it while it closes, and
        // fail with it: sent again, on the channel the publisher opens next.
        let mut pause = std::time::Duration::from_millis(20);
        for _ in 0..4 {
            results[i] = publish.publish(&messages[i]).await;
            if !matches!(results[i], Err(OutboundError::Broker(_))) {
                break;
            }
            tokio::time::sleep(pause).await;
            pause *= 2;
        }
    }
}

/// The message of an outbox row.
fn message<DB: Dialect>(row: &Row<DB>) -> Result<Outgoing, sqlx::Error> {
    let text = |column| DB::Db::text(row, column).map(crate::keys::shown::<DB>);
    let mut envelope = Envelope::new(DB::Db::bytes(row, "body")?);
    envelope.message_id = Some(text("message_id")?);
    envelope.correlation_id = Some(text("correlation_id")?).filter(|c| !c.is_empty());
    envelope.content_type = Some(text("content_type")?).filter(|c| !c.is_empty());
    envelope.headers = headers_from_json(&DB::Db::text(row, "headers")?)
        .map_err(|e| sqlx::Error::Decode(Box::new(e)))?;
    let destination = Destination::from_parts(text("exchange")?, text("routing_key")?);
    let mut message = Outgoing::new(destination, Vec::new());
    message.envelope = envelope;
    Ok(message)
}
