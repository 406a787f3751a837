//! The retention sweeper: deletes expired inbox rows in bounded batches through the index on
//! `expires_at`, under a lock that lets one sweeper work at a time across processes
//! (`pg_try_advisory_lock` on PostgreSQL, `GET_LOCK` on MySQL; on SQLite a lock of this
//! process, and every batch takes the database's write lock).

use crate::dialect::{Conn, Dialect};
use crate::error::store_error;
use crate::exec::Param;
use crate::exec::Sql;
use crate::inbox::SqlInbox;
use crate::session::LockedSession;
use idem_core::store::Pace;
use idem_core::{model::StoreError, store::SweepReport};
use std::time::{Duration, Instant};

impl<DB: Dialect> SqlInbox<DB> {
    /// Deletes expired rows in batches of at most `batch`, until none is left or `max_batches`
    /// ran, holding the sweeper lock; a sweeper that finds the lock taken does nothing. After
    /// each full batch it pauses `pace.pause` times as long as the batch took, unless the oldest
    /// expired row left expired more than `pace.behind_after` ago (it is behind).
    pub(crate) async fn sweep_expired(
        &self,
        batch: u32,
        max_batches: u32,
        pace: Pace,
    ) -> Result<SweepReport, StoreError> {
        let fail = |e| store_error("sweep", e);
        let sql = &self.sql.sweep;
        let mut report = SweepReport::default();
        let Some(_local) = self.sweep_guard() else {
            return Ok(report);
        };
        // The lock belongs to this connection's session: all the work runs on it.
        let conn = self.pool.acquire().await.map_err(fail)?;
        let mut session = LockedSession::new(conn);
        let conn = &mut *session.conn;
        if DB::Db::fetch_int(conn, &sql.lock, &[])
            .await
            .map_err(fail)?
            != 1
        {
            session.released = true;
            return Ok(report);
        }
        report.locked = true;
        let swept = async {
            while report.batches < max_batches {
                let started = Instant::now();
                let deleted = DB::Db::execute(conn, &sql.delete, &[Param::Int(i64::from(batch))])
                    .await
                    .map_err(fail)?;
                report.batches += 1;
                report.deleted += deleted;
                let took = started.elapsed();
                report.busy += took;
                report.longest_batch = report.longest_batch.max(took);
                if deleted < u64::from(batch) {
                    break;
                }
                if pace.pause > 0 && paced::<DB>(conn, &sql.lag, pace.behind_after).await? {
                    pause_for(&mut report, took, pace.pause).await;
                }
            }
            // The poison limit's delivery counts, in batches of their own.
            for _ in 0..max_batches {
                let started = Instant::now();
                let delete = &sql.delete_deliveries;
                let deleted = DB::Db::execute(conn, delete, &[Param::Int(i64::from(batch))])
                    .await
                    .map_err(fail)?;
                report.counts_deleted += deleted;
                let took = started.elapsed();
                report.busy += took;
                report.longest_batch = report.longest_batch.max(took);
                if deleted < u64::from(batch) {
                    break;
                }
                if pace.pause > 0 && paced::<DB>(conn, &sql.lag, pace.behind_after).await? {
                    pause_for(&mut report, took, pace.pause).await;
                }
            }
            let lag_ms = DB::Db::fetch_int(conn, &sql.lag, &[]).await.map_err(fail)?;
            report.lag = Duration::from_millis(u64::try_from(lag_ms).unwrap_or(0));
            // What the inbox holds after the sweep, for the operator's gauges.
            let rows = DB::Db::fetch_int(conn, &sql.rows, &[])
                .await
                .map_err(fail)?;
            report.rows = u64::try_from(rows).unwrap_or(0);
            let oldest_ms = DB::Db::fetch_int(conn, &sql.oldest, &[])
                .await
                .map_err(fail)?;
            report.oldest = Duration::from_millis(u64::try_from(oldest_ms).unwrap_or(0));
            let expired = DB::Db::fetch_int(conn, &sql.expired, &[])
                .await
                .map_err(fail)?;
            report.expired = u64::try_from(expired).unwrap_or(0);
            Ok::<_, StoreError>(())
        }
        .await;
        match DB::Db::execute(conn, &sql.unlock, &[]).await {
            Ok(_) => session.released = true,
            // The session closes on drop, which releases the lock.
            Err(e) => {
                tracing::warn!(error = %e, "releasing the sweeper lock failed; closing its connection")
            }
        }
        swept.map(|()| report)
    }
}

/// Whether to pause before the next statement: some expired rows are left (`lag`: the age of
/// the oldest, in milliseconds), and none expired more than `behind_after` ago (the sweeper has
/// caught up). Behind, it deletes back to back; with none left, the next statement ends it.
async fn paced<DB: Dialect>(
    conn: &mut Conn<DB>,
    lag: &std::sync::Arc<str>,
    behind_after: Duration,
) -> Result<bool, StoreError> {
    let lag_ms = DB::Db::fetch_int(conn, lag, &[])
        .await
        .map_err(|e| store_error("sweep", e))?;
    let lag = Duration::from_millis(u64::try_from(lag_ms).unwrap_or(0));
    Ok(!lag.is_zero() && lag <= behind_after)
}

/// Pauses `pause` times as long as the statement that `took` (the sweeper's duty cycle), and
/// counts the pause in `report`.
async fn pause_for(report: &mut SweepReport, took: Duration, pause: u32) {
    if pause == 0 {
        return;
    }
    let wait = took.saturating_mul(pause);
    tokio::time::sleep(wait).await;
    report.paused += wait;
}
