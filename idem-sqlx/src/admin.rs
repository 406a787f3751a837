//! What an operator reads and changes in an inbox (the `idem` CLI): rows per consumer and
//! status, one key's row, forgetting a key, and clearing a key's recorded failure before its
//! message is replayed.

use crate::dead_letters::DeadLetterRow;
use crate::dialect::Dialect;
use crate::error::store_error;
use crate::exec::Param;
use crate::exec::Sql;
use crate::inbox::SqlInbox;
use idem_core::{model::Fingerprint, model::StoreError};

/// Rows of one consumer in one status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StatusCount {
    /// The consumer.
    pub consumer: String,
    /// `completed`, `in_progress` or `failed`.
    pub status: String,
    /// How many rows.
    pub rows: u64,
    /// When the oldest of them was created, in milliseconds since the Unix epoch.
    pub oldest_ms: i64,
    /// How many of them expired and wait for the sweeper.
    pub expired: u64,
}

/// Dead-letter records of one consumer.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeadLetterCount {
    /// The consumer.
    pub consumer: String,
    /// How many records.
    pub rows: u64,
    /// When the oldest was written, in milliseconds since the Unix epoch.
    pub oldest_ms: i64,
}

/// What an inbox holds.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxStats {
    /// Rows per consumer and status.
    pub statuses: Vec<StatusCount>,
    /// Dead-letter records per consumer.
    pub dead_letters: Vec<DeadLetterCount>,
}

/// One key's inbox row.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct InboxRow {
    /// `completed`, `in_progress` or `failed`.
    pub status: String,
    /// The attempt that wrote it (external mode: the attempts made).
    pub attempts: u32,
    /// The stored result (JSON), if any.
    pub outcome: Option<String>,
    /// The payload's fingerprint.
    pub fingerprint: Option<Fingerprint>,
    /// Created, in milliseconds since the Unix epoch.
    pub created_ms: i64,
    /// Completed, if it is.
    pub completed_ms: Option<i64>,
    /// When the sweeper may delete it.
    pub expires_ms: i64,
    /// External mode: the lease's owner.
    pub owner: Option<String>,
    /// External mode: until when the lease holds.
    pub locked_until_ms: Option<i64>,
}

/// All an inbox knows of one key.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
#[non_exhaustive]
pub struct KeyReport {
    /// Its row, if it has one.
    pub row: Option<InboxRow>,
    /// Its count of deliveries without a settlement (the poison limit), if any.
    pub deliveries: Option<u64>,
    /// Its dead-letter record, if any.
    pub dead_letter: Option<DeadLetterRow>,
}

/// What [`SqlInbox::forget`] or [`SqlInbox::clear_failure`] removed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Removed {
    /// The inbox row.
    pub row: bool,
    /// The count of deliveries.
    pub deliveries: bool,
    /// The dead-letter record.
    pub dead_letter: bool,
}

impl<DB: Dialect> SqlInbox<DB> {
    /// Rows per consumer and status (with the oldest and the expired ones), and dead-letter
    /// records per consumer.
    pub async fn stats(&self) -> Result<InboxStats, StoreError> {
        let fail = |e| store_error("inbox stats", e);
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let admin = &self.sql.admin;
        let rows = DB::Db::fetch_all(&mut *conn, &admin.stats, &[])
            .await
            .map_err(fail)?;
        let statuses = rows
            .iter()
            .map(|row| {
                Ok(StatusCount {
                    consumer: DB::Db::text(row, "consumer")?,
                    status: DB::Db::text(row, "status")?,
                    rows: count(DB::Db::int(row, "row_count")?),
                    oldest_ms: DB::Db::int(row, "oldest_ms")?,
                    expired: count(DB::Db::int(row, "expired")?),
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(fail)?;
        let rows = DB::Db::fetch_all(&mut *conn, &admin.dead_letter_stats, &[])
            .await
            .map_err(fail)?;
        let dead_letters = rows
            .iter()
            .map(|row| {
                Ok(DeadLetterCount {
                    consumer: DB::Db::text(row, "consumer")?,
                    rows: count(DB::Db::int(row, "row_count")?),
                    oldest_ms: DB::Db::int(row, "oldest_ms")?,
                })
            })
            .collect::<Result<_, sqlx::Error>>()
            .map_err(fail)?;
        Ok(InboxStats {
            statuses,
            dead_letters,
        })
    }

    /// What the inbox holds for `key` of `consumer`.
    pub async fn show(&self, consumer: &str, key: &str) -> Result<KeyReport, StoreError> {
        let key = &*crate::keys::stored::<DB>(key);
        let fail = |e| store_error("inbox show", e);
        let params = [Param::Text(consumer), Param::Text(key)];
        let admin = &self.sql.admin;
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let row = DB::Db::fetch_optional(&mut *conn, &admin.show, &params)
            .await
            .map_err(fail)?;
        let row = row
            .map(|row| {
                let nonzero = |ms: i64| (ms != 0).then_some(ms);
                Ok(InboxRow {
                    status: DB::Db::text(&row, "status")?,
                    attempts: u32::try_from(DB::Db::int32(&row, "attempts")?).unwrap_or(0),
                    outcome: DB::Db::optional_text(&row, "outcome")?,
                    fingerprint: Fingerprint::from_slice(&DB::Db::bytes(&row, "fingerprint")?),
                    created_ms: DB::Db::int(&row, "created_ms")?,
                    completed_ms: nonzero(DB::Db::int(&row, "completed_ms")?),
                    expires_ms: DB::Db::int(&row, "expires_ms")?,
                    owner: DB::Db::optional_text(&row, "owner")?,
                    locked_until_ms: nonzero(DB::Db::int(&row, "locked_ms")?),
                })
            })
            .transpose()
            .map_err(fail)?;
        let deliveries = DB::Db::fetch_optional(&mut *conn, &admin.deliveries_of, &params)
            .await
            .map_err(fail)?
            .map(|row| DB::Db::int(&row, "deliveries"))
            .transpose()
            .map_err(fail)?
            .map(count);
        drop(conn);
        Ok(KeyReport {
            row,
            deliveries,
            dead_letter: self.dead_letter(consumer, key).await?,
        })
    }

    /// Removes everything the inbox holds for `key` of `consumer` (its row, its count of
    /// deliveries, its dead-letter record), in one transaction: the next message with this key
    /// is processed as new.
    pub async fn forget(&self, consumer: &str, key: &str) -> Result<Removed, StoreError> {
        let admin = &self.sql.admin;
        self.remove(consumer, key, &admin.forget, true).await
    }

    /// Removes what stands in the way of a replayed copy of `key`'s message being processed
    /// again: a `failed` row (external mode) and its count of deliveries, in one transaction.
    /// A completed row stays (a replayed message that was processed after all is a
    /// duplicate), and so does the dead-letter record, which a replay removes with its dead
    /// letter ([`SqlInbox::forget_dead_letter`]).
    pub async fn clear_failure(&self, consumer: &str, key: &str) -> Result<Removed, StoreError> {
        let admin = &self.sql.admin;
        self.remove(consumer, key, &admin.forget_failed, false)
            .await
    }

    async fn remove(
        &self,
        consumer: &str,
        key: &str,
        row_statement: &std::sync::Arc<str>,
        record: bool,
    ) -> Result<Removed, StoreError> {
        let fail = |e| store_error("inbox forget", e);
        let key = crate::keys::stored::<DB>(key);
        let params = [Param::Text(consumer), Param::Text(&key)];
        let admin = &self.sql.admin;
        let mut tx = self.begin_tx().await?;
        let mut removed = Removed::default();
        let mut statements = vec![
            (row_statement, &mut removed.row),
            (&admin.forget_deliveries, &mut removed.deliveries),
        ];
        if record {
            statements.push((&admin.forget_dead_letter, &mut removed.dead_letter));
        }
        for (statement, flag) in statements {
            *flag = DB::Db::execute(&mut *tx, statement, &params)
                .await
                .map_err(fail)?
                > 0;
        }
        tx.commit().await.map_err(fail)?;
        Ok(removed)
    }
}

fn count(n: i64) -> u64 {
    u64::try_from(n).unwrap_or(0)
}
