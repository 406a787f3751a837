//! The retention sweeper: deletes expired inbox rows in bounded batches through the index on
//! `expires_at`, under a lock that lets one sweeper work at a time across processes
//! (`pg_try_advisory_lock` on PostgreSQL, `GET_LOCK` on MySQL; on SQLite a lock of this
//! process, and every batch takes the database's write lock).

/// The sweeper statements of one dialect: try-lock (one `BIGINT`, 1 when taken), unlock,
/// delete one batch (the batch size bound), and the lag (one `BIGINT`: milliseconds since the
/// oldest expired row left expired, 0 when none is).
pub(crate) type SweepStatements = [&'static str; 4];

/// Implements `InboxStore::sweep` for `SqlInbox<$db>` as `sweep_expired`.
macro_rules! sweep_ops {
    ($db:ty) => {
        impl $crate::inbox::SqlInbox<$db> {
            pub(crate) async fn sweep_expired(
                &self,
                batch: u32,
                max_batches: u32,
            ) -> Result<idem_core::SweepReport, idem_core::StoreError> {
                let fail = |e| idem_core::StoreError::sqlx("sweep", e);
                let [lock, unlock, delete, lag] = &self.sql.sweep;
                let mut report = idem_core::SweepReport::default();
                let _local = match self.sweep_guard() {
                    Some(guard) => guard,
                    None => return Ok(report),
                };
                // The lock belongs to this connection's session: all the work runs on it.
                let conn = self.pool.acquire().await.map_err(fail)?;
                let mut session = $crate::session::LockedSession::new(conn);
                let conn = &mut *session.conn;
                let taken: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(lock.clone()))
                    .fetch_one(&mut *conn)
                    .await
                    .map_err(fail)?;
                if taken != 1 {
                    session.released = true;
                    return Ok(report);
                }
                report.locked = true;
                let swept = async {
                    while report.batches < max_batches {
                        let started = std::time::Instant::now();
                        let deleted = sqlx::query(sqlx::AssertSqlSafe(delete.clone()))
                            .bind(i64::from(batch))
                            .execute(&mut *conn)
                            .await
                            .map_err(fail)?
                            .rows_affected();
                        report.batches += 1;
                        report.deleted += deleted;
                        report.longest_batch = report.longest_batch.max(started.elapsed());
                        if deleted < u64::from(batch) {
                            break;
                        }
                    }
                    let lag_ms: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(lag.clone()))
                        .fetch_one(&mut *conn)
                        .await
                        .map_err(fail)?;
                    report.lag =
                        std::time::Duration::from_millis(u64::try_from(lag_ms).unwrap_or(0));
                    Ok::<_, idem_core::StoreError>(())
                }
                .await;
                match sqlx::query(sqlx::AssertSqlSafe(unlock.clone()))
                    .execute(&mut *conn)
                    .await
                {
                    Ok(_) => session.released = true,
                    // The session closes on drop, which releases the lock.
                    Err(e) => tracing::warn!(error = %e, "releasing the sweeper lock failed; closing its connection"),
                }
                swept.map(|()| report)
            }
        }
    };
}
pub(crate) use sweep_ops;
