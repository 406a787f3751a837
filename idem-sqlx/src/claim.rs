//! The claim of dialects whose insert cannot return the existing row (MySQL, SQLite): insert,
//! and when that inserted nothing, read the row that holds the key. Both dialects make the read
//! see the committed row: SQLite holds the write lock since `BEGIN IMMEDIATE`, MySQL reads with
//! a locking read after the insert waited on the row's lock.

/// Implements `claim_insert_then_read` for `SqlInbox<$db>`.
macro_rules! insert_then_read {
    ($db:ty) => {
        impl $crate::inbox::SqlInbox<$db> {
            pub(crate) async fn claim_insert_then_read(
                &self,
                tx: &mut sqlx::Transaction<'static, $db>,
                request: &idem_core::ClaimRequest<'_>,
            ) -> Result<idem_core::Claim, idem_core::StoreError> {
                use sqlx::Row;
                let fail = |e| idem_core::StoreError::sqlx("claim", e);
                let inserted = sqlx::query(sqlx::AssertSqlSafe(self.sql.claim.clone()))
                    .bind(request.consumer)
                    .bind(request.key)
                    .bind(request.fingerprint.as_bytes().as_slice())
                    .bind(i64::from(request.attempt))
                    .bind($crate::config::secs(request.retention))
                    .execute(&mut **tx)
                    .await
                    .map_err(fail)?
                    .rows_affected();
                if inserted == 1 {
                    return Ok(idem_core::Claim::Claimed);
                }
                let row = sqlx::query(sqlx::AssertSqlSafe(self.sql.existing.clone()))
                    .bind(request.consumer)
                    .bind(request.key)
                    .fetch_optional(&mut **tx)
                    .await
                    .map_err(fail)?;
                let Some(row) = row else {
                    // The row that blocked the insert was swept since; a retry claims.
                    return Err(idem_core::StoreError::new(
                        "claim",
                        idem_core::ErrorClass::Transient,
                        "the key's row vanished between the insert and the read",
                    ));
                };
                let fingerprint: Vec<u8> = row.try_get("fingerprint").map_err(fail)?;
                $crate::existing_claim(&fingerprint, row.try_get("outcome").map_err(fail)?)
            }
        }
    };
}
pub(crate) use insert_then_read;
