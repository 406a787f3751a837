//! Dead-letter records: why each dead-lettered message was refused, one row per (consumer,
//! key) in `{table}_dead_letters`, written before the message is moved to the dead-letter
//! queue and removed when an operator replays or forgets it.

use crate::dialect::{Dialect, Row};
use crate::error::store_error;
use crate::exec::Param;
use crate::exec::Sql;
use crate::inbox::SqlInbox;
use crate::keys;
use idem_core::{
    model::DeadLetterRecord, model::Fingerprint, model::StoreError, store::ClaimRequest,
};
use std::time::Duration;

/// One dead-letter record, as read back.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct DeadLetterRow {
    /// The consumer that refused the message.
    pub consumer: String,
    /// Its dedup key, or a stand-in (`message-id:…`, `sha256:…`) when `keyed` is false.
    pub key: String,
    /// Whether `key` is the message's dedup key.
    pub keyed: bool,
    /// The queue it was consumed from.
    pub queue: String,
    /// The reason code (`decode`, `conflict`, `poison`, …).
    pub reason: String,
    /// The explanation.
    pub detail: String,
    /// Delivery attempts made.
    pub attempts: u32,
    /// Its message id, when it had one.
    pub message_id: Option<String>,
    /// The SHA-256 of its body.
    pub fingerprint: Option<Fingerprint>,
    /// When it was dead-lettered (its last failure), in milliseconds since the Unix epoch.
    pub dead_lettered_at_ms: i64,
    /// When its failures began (its first attempt failed), in milliseconds since the Unix
    /// epoch; `None` for a record written before idem kept it.
    pub first_failed_at_ms: Option<i64>,
    /// Its consumer's inbox retention when it was written; `None` where it was not known.
    pub retention: Option<Duration>,
}

impl DeadLetterRow {
    /// Whether this is the record of the dead-lettered message with `message_id` and `body`:
    /// same body fingerprint, same message id.
    pub fn describes(&self, message_id: Option<&str>, body: &[u8]) -> bool {
        self.fingerprint == Some(Fingerprint::of(body)) && self.message_id.as_deref() == message_id
    }

    /// Until when, in milliseconds since the Unix epoch, its consumer's inbox still holds the
    /// row of any copy of its message applied since its failures began: the first failure
    /// plus the retention. Past it, a copy applied meanwhile may have been swept, and a
    /// replay could apply the message again. `None` where the record does not know.
    pub fn dedup_window_ends_ms(&self) -> Option<i64> {
        let retention = i64::try_from(self.retention?.as_millis()).unwrap_or(i64::MAX);
        let first = self.first_failed_at_ms.unwrap_or(self.dead_lettered_at_ms);
        Some(first.saturating_add(retention))
    }
}

impl<DB: Dialect> SqlInbox<DB> {
    /// Writes `record`, replacing the record of its key, in a transaction of its own (with the
    /// key it parks, [`DeadLetterRecord::park`]). A key
    /// this database cannot hold (too long for MySQL's key column) is recorded under
    /// `sha256:<its fingerprint>` instead.
    pub(crate) async fn record(&self, record: &DeadLetterRecord) -> Result<(), StoreError> {
        let fingerprint = Fingerprint::of(record.key.as_bytes());
        let request = ClaimRequest {
            consumer: &record.consumer,
            key: &record.key,
            fingerprint: &fingerprint,
            attempt: record.attempts,
            retention: Duration::ZERO,
        };
        let substitute;
        let (key, keyed) = match DB::check_request(&request) {
            Ok(()) => (record.key.as_str(), record.keyed),
            Err(_) => {
                substitute = format!("sha256:{fingerprint}");
                (substitute.as_str(), false)
            }
        };
        let stored = keys::stored::<DB>;
        let (key, queue, detail) = (stored(key), stored(&record.queue), stored(&record.detail));
        let message_id = stored(record.message_id.as_deref().unwrap_or(""));
        let params = [
            Param::Text(&record.consumer),
            Param::Text(&key),
            Param::Int32(i32::from(keyed)),
            Param::Text(&queue),
            Param::Text(&record.reason),
            Param::Text(&detail),
            Param::Int32(i32::try_from(record.attempts).unwrap_or(i32::MAX)),
            Param::Text(&message_id),
            Param::Bytes(record.fingerprint.as_bytes()),
            Param::Int(record.first_failed_at_ms.unwrap_or(0)),
            Param::Int(
                record
                    .retention
                    .map_or(0, |r| i64::try_from(r.as_millis()).unwrap_or(i64::MAX)),
            ),
        ];
        let fail = |e| store_error("record dead letter", e);
        let mut tx = self.begin_tx().await?;
        DB::Db::execute(&mut *tx, &self.sql.admin.record, &params)
            .await
            .map_err(fail)?;
        if let Some(park) = &record.park {
            crate::parking::park_key::<DB>(&self.sql.parking, &mut tx, record, park)
                .await
                .map_err(fail)?;
        }
        tx.commit().await.map_err(fail)
    }

    /// The dead-letter records of `queue`, oldest first.
    pub async fn dead_letters(&self, queue: &str) -> Result<Vec<DeadLetterRow>, StoreError> {
        let fail = |e| store_error("read dead letters", e);
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let rows = DB::Db::fetch_all(
            &mut *conn,
            &self.sql.admin.dead_letters,
            &[Param::Text(&keys::stored::<DB>(queue))],
        )
        .await
        .map_err(fail)?;
        rows.iter()
            .map(read_row::<DB>)
            .collect::<Result<_, _>>()
            .map_err(fail)
    }

    /// The dead-letter record of `key` for `consumer`, if there is one.
    pub async fn dead_letter(
        &self,
        consumer: &str,
        key: &str,
    ) -> Result<Option<DeadLetterRow>, StoreError> {
        let fail = |e| store_error("read dead letter", e);
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let key = keys::stored::<DB>(key);
        let params = [Param::Text(consumer), Param::Text(&key)];
        let row = DB::Db::fetch_optional(&mut *conn, &self.sql.admin.dead_letter_of, &params)
            .await
            .map_err(fail)?;
        row.as_ref().map(read_row::<DB>).transpose().map_err(fail)
    }

    /// Removes `record` if it is still the record of its key (no later failure wrote another
    /// since it was read); whether it did.
    pub async fn forget_dead_letter(&self, record: &DeadLetterRow) -> Result<bool, StoreError> {
        let fail = |e| store_error("forget dead letter", e);
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let key = keys::stored::<DB>(&record.key);
        let params = [
            Param::Text(&record.consumer),
            Param::Text(&key),
            Param::Int(record.dead_lettered_at_ms),
        ];
        let removed = DB::Db::execute(&mut *conn, &self.sql.admin.forget_dead_letter_at, &params)
            .await
            .map_err(fail)?;
        Ok(removed > 0)
    }
}

/// A record as stored, its texts read back as they were given ([`keys::shown`]).
fn read_row<DB: Dialect>(row: &Row<DB>) -> Result<DeadLetterRow, sqlx::Error> {
    let text = |column| DB::Db::text(row, column).map(keys::shown::<DB>);
    let message_id = text("message_id")?;
    Ok(DeadLetterRow {
        consumer: DB::Db::text(row, "consumer")?,
        key: text("key")?,
        keyed: DB::Db::int32(row, "keyed")? != 0,
        queue: text("queue")?,
        reason: DB::Db::text(row, "reason")?,
        detail: text("detail")?,
        attempts: u32::try_from(DB::Db::int32(row, "attempts")?).unwrap_or(0),
        message_id: (!message_id.is_empty()).then_some(message_id),
        fingerprint: Fingerprint::from_slice(&DB::Db::bytes(row, "fingerprint")?),
        dead_lettered_at_ms: DB::Db::int(row, "at_ms")?,
        first_failed_at_ms: Some(DB::Db::int(row, "first_ms")?).filter(|ms| *ms != 0),
        retention: Some(DB::Db::int(row, "retention_ms")?)
            .filter(|ms| *ms > 0)
            .map(|ms| Duration::from_millis(u64::try_from(ms).unwrap_or(0))),
    })
}
