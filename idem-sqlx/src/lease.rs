//! External mode on every dialect: a claim inserts the row `in_progress` with a lease, or takes
//! an expired lease over, or reads what holds the key, in one short transaction of its own; the
//! handler's end then settles the row as completed or failed, or releases it for a retry.

use crate::dialect::Dialect;
use crate::error::{store_error, stored_fingerprint};
use crate::exec::Param;
use crate::exec::Sql;
use crate::inbox::SqlInbox;
use idem_core::{
    model::ErrorClass, model::StoreError, model::StoredOutput, store::ClaimRequest, store::Lease,
    store::LeaseEnd,
};
use std::time::Duration;

impl<DB: Dialect> SqlInbox<DB> {
    /// Claims `request`'s key with a lease for `owner` lasting `lease`, committed before this
    /// returns; or reports what holds the key.
    pub(crate) async fn lease_key(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
        lease: Duration,
    ) -> Result<Lease, StoreError> {
        let fail = |e| store_error("lease", e);
        let sql = &self.sql.lease;
        let lease_ms = millis(lease);
        let key = [Param::Text(request.consumer), Param::Text(request.key)];
        let fingerprint = Param::Bytes(request.fingerprint.as_bytes());
        let mut tx = self.begin_tx().await?;
        let insert = [
            key[0],
            key[1],
            fingerprint,
            Param::Int(crate::config::secs(request.retention)),
            Param::Text(owner),
            Param::Int(lease_ms),
        ];
        let inserted = DB::Db::execute(&mut *tx, &sql.insert, &insert)
            .await
            .map_err(fail)?;
        let taken = inserted == 1 || {
            let takeover = [
                Param::Text(owner),
                Param::Int(lease_ms),
                key[0],
                key[1],
                fingerprint,
            ];
            DB::Db::execute(&mut *tx, &sql.takeover, &takeover)
                .await
                .map_err(fail)?
                == 1
        };
        let row = DB::Db::fetch_optional(&mut *tx, &sql.read, &key)
            .await
            .map_err(fail)?;
        tx.commit().await.map_err(fail)?;
        let Some(row) = row else {
            // Swept between the insert and the read; a retry inserts afresh.
            return Err(StoreError::new(
                "lease",
                ErrorClass::Transient,
                "the key's row vanished while it was leased",
            ));
        };
        let attempts = DB::Db::int32(&row, "attempts").map_err(fail)?;
        if taken {
            return Ok(Lease::Acquired {
                attempts: u32::try_from(attempts).unwrap_or(0),
            });
        }
        found(
            &DB::Db::text(&row, "status").map_err(fail)?,
            &DB::Db::bytes(&row, "fingerprint").map_err(fail)?,
            DB::Db::optional_text(&row, "outcome").map_err(fail)?,
            DB::Db::int(&row, "remaining_ms").map_err(fail)?,
        )
    }

    /// Ends `owner`'s lease on `request`'s key as `end`, storing `output`; `false` when the
    /// lease was lost and nothing was written.
    pub(crate) async fn settle_key(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
        end: LeaseEnd,
        output: &StoredOutput,
    ) -> Result<bool, StoreError> {
        let fail = |e| store_error("settle", e);
        let params = [
            Param::Text(end.status()),
            Param::Text(output.as_json()),
            Param::Text(request.consumer),
            Param::Text(request.key),
            Param::Text(owner),
        ];
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        let settled = DB::Db::execute(&mut *conn, &self.sql.lease.settle, &params)
            .await
            .map_err(fail)?;
        Ok(settled == 1)
    }

    /// Gives `owner`'s lease on `request`'s key up, so that a retry takes it over at once.
    pub(crate) async fn release_key(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
    ) -> Result<(), StoreError> {
        let fail = |e| store_error("release", e);
        let params = [
            Param::Text(request.consumer),
            Param::Text(request.key),
            Param::Text(owner),
        ];
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        DB::Db::execute(&mut *conn, &self.sql.lease.release, &params)
            .await
            .map(drop)
            .map_err(fail)
    }
}

impl<DB: Dialect> SqlInbox<DB> {
    /// Removes `request`'s key while `owner` still holds it in progress; `false`: it no longer
    /// does (its lease was taken over), and nothing was removed.
    pub(crate) async fn abandon_key(
        &self,
        request: &ClaimRequest<'_>,
        owner: &str,
    ) -> Result<bool, StoreError> {
        let fail = |e| store_error("abandon", e);
        let params = [
            Param::Text(request.consumer),
            Param::Text(request.key),
            Param::Text(owner),
        ];
        let mut conn = self.pool.acquire().await.map_err(fail)?;
        DB::Db::execute(&mut *conn, &self.sql.lease.abandon, &params)
            .await
            .map(|removed| removed > 0)
            .map_err(fail)
    }
}

/// A lease length in whole milliseconds, as bound into the statements.
fn millis(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX)
}

/// What the read step found, as a [`Lease`] for a caller that holds none.
fn found(
    status: &str,
    fingerprint: &[u8],
    outcome: Option<String>,
    remaining_ms: i64,
) -> Result<Lease, StoreError> {
    let fingerprint = stored_fingerprint(fingerprint)?;
    let output = outcome.map(StoredOutput::from_json);
    Ok(match status {
        "completed" => Lease::Completed {
            fingerprint,
            output,
        },
        "failed" => Lease::Failed {
            fingerprint,
            output,
        },
        // In progress: live, or expired but for another payload (the caller reports a
        // conflict); in neither case may the caller run.
        _ => Lease::Held {
            fingerprint,
            remaining: Duration::from_millis(u64::try_from(remaining_ms).unwrap_or(0)),
        },
    })
}
