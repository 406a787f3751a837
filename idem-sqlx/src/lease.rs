//! External mode's lease statements, the same steps on every dialect: a claim inserts the row
//! `in_progress` with a lease, or takes an expired lease over, or reads what holds the key, in
//! one short transaction of its own; the handler's end then settles the row.

use crate::stored_fingerprint;
use idem_core::{Lease, StoreError, StoredOutput};
use std::time::Duration;

/// The lease statements of one dialect, in this order (bind order in brackets):
/// insert (consumer, key, fingerprint, retention s, owner, lease ms),
/// takeover (owner, lease ms, consumer, key, fingerprint),
/// read (consumer, key) → status, attempts, fingerprint, outcome, remaining_ms,
/// settle (status, outcome, consumer, key, owner),
/// release (consumer, key, owner).
pub(crate) type LeaseStatements = [&'static str; 5];

/// A lease length in whole milliseconds, as bound into the statements.
pub(crate) fn millis(lease: Duration) -> i64 {
    i64::try_from(lease.as_millis()).unwrap_or(i64::MAX)
}

/// What the read step found, as a [`Lease`] for a caller that holds none.
pub(crate) fn found(
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

/// Implements the lease operations for `SqlInbox<$db>`, whose `InboxStore` methods delegate to
/// them. (A macro rather than a generic function: sqlx's per-type bounds for five statements
/// would outweigh the code.)
macro_rules! lease_ops {
    ($db:ty) => {
        impl $crate::inbox::SqlInbox<$db> {
            pub(crate) async fn lease_key(
                &self,
                request: &idem_core::ClaimRequest<'_>,
                owner: &str,
                lease: std::time::Duration,
            ) -> Result<idem_core::Lease, idem_core::StoreError> {
                use sqlx::Row;
                let fail = |e| idem_core::StoreError::sqlx("lease", e);
                let [insert, takeover, read, _, _] = &self.sql.lease;
                let lease_ms = $crate::lease::millis(lease);
                let mut tx = idem_core::InboxStore::begin(self).await?;
                let inserted = sqlx::query(sqlx::AssertSqlSafe(insert.clone()))
                    .bind(request.consumer)
                    .bind(request.key)
                    .bind(request.fingerprint.as_bytes().as_slice())
                    .bind(crate::config::secs(request.retention))
                    .bind(owner)
                    .bind(lease_ms)
                    .execute(&mut *tx)
                    .await
                    .map_err(fail)?
                    .rows_affected();
                let taken = inserted == 1
                    || sqlx::query(sqlx::AssertSqlSafe(takeover.clone()))
                        .bind(owner)
                        .bind(lease_ms)
                        .bind(request.consumer)
                        .bind(request.key)
                        .bind(request.fingerprint.as_bytes().as_slice())
                        .execute(&mut *tx)
                        .await
                        .map_err(fail)?
                        .rows_affected()
                        == 1;
                let row = sqlx::query(sqlx::AssertSqlSafe(read.clone()))
                    .bind(request.consumer)
                    .bind(request.key)
                    .fetch_optional(&mut *tx)
                    .await
                    .map_err(fail)?;
                tx.commit().await.map_err(fail)?;
                let Some(row) = row else {
                    // Swept between the insert and the read; a retry inserts afresh.
                    return Err(idem_core::StoreError::new(
                        "lease",
                        idem_core::ErrorClass::Transient,
                        "the key's row vanished while it was leased",
                    ));
                };
                let attempts: i32 = row.try_get("attempts").map_err(fail)?;
                if taken {
                    return Ok(idem_core::Lease::Acquired {
                        attempts: u32::try_from(attempts).unwrap_or(0),
                    });
                }
                let status: String = row.try_get("status").map_err(fail)?;
                let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(fail)?;
                let outcome: Option<String> = row.try_get("outcome").map_err(fail)?;
                let remaining: i64 = row.try_get("remaining_ms").map_err(fail)?;
                $crate::lease::found(&status, &fingerprint, outcome, remaining)
            }

            pub(crate) async fn settle_key(
                &self,
                request: &idem_core::ClaimRequest<'_>,
                owner: &str,
                end: idem_core::LeaseEnd,
                output: &idem_core::StoredOutput,
            ) -> Result<bool, idem_core::StoreError> {
                let settled = sqlx::query(sqlx::AssertSqlSafe(self.sql.lease[3].clone()))
                    .bind(end.status())
                    .bind(output.as_json())
                    .bind(request.consumer)
                    .bind(request.key)
                    .bind(owner)
                    .execute(&self.pool)
                    .await
                    .map_err(|e| idem_core::StoreError::sqlx("settle", e))?;
                Ok(settled.rows_affected() == 1)
            }

            pub(crate) async fn release_key(
                &self,
                request: &idem_core::ClaimRequest<'_>,
                owner: &str,
            ) -> Result<(), idem_core::StoreError> {
                sqlx::query(sqlx::AssertSqlSafe(self.sql.lease[4].clone()))
                    .bind(request.consumer)
                    .bind(request.key)
                    .bind(owner)
                    .execute(&self.pool)
                    .await
                    .map(drop)
                    .map_err(|e| idem_core::StoreError::sqlx("release", e))
            }
        }
    };
}
pub(crate) use lease_ops;

/// The `InboxStore` methods of external mode, delegating to [`lease_ops`]' functions.
macro_rules! lease_methods {
    () => {
        async fn lease(
            &self,
            request: &idem_core::ClaimRequest<'_>,
            owner: &str,
            lease: std::time::Duration,
        ) -> Result<idem_core::Lease, idem_core::StoreError> {
            self.lease_key(request, owner, lease).await
        }

        async fn settle(
            &self,
            request: &idem_core::ClaimRequest<'_>,
            owner: &str,
            end: idem_core::LeaseEnd,
            output: &idem_core::StoredOutput,
        ) -> Result<bool, idem_core::StoreError> {
            self.settle_key(request, owner, end, output).await
        }

        async fn release(
            &self,
            request: &idem_core::ClaimRequest<'_>,
            owner: &str,
        ) -> Result<(), idem_core::StoreError> {
            self.release_key(request, owner).await
        }
    };
}
pub(crate) use lease_methods;
