//! Where an inbox transaction begins: on a connection a worker keeps between its transactions
//! ([`InboxStore::begin_on`]), or on the pool. On a kept connection a transaction per message
//! costs its `BEGIN` and nothing else, where a transaction on a pooled connection also pays
//! the pool's acquire and, on every return, its ping (sqlx tests each connection given back
//! with a round trip).
//!
//! Workers keep at most a pool's size less a reserve (a quarter, at least two) at once,
//! whichever stores share the pool, and only while more than the reserve is idle or
//! unopened, so the
//! relay, the sweeper, dead-letter records and the handlers' own queries always find a
//! connection; a worker past that limit begins on the pool as before. A held connection is
//! given back after [`HOLD_FOR`] (the pool's lifetime and idle rules then apply to it), and
//! replaced when its `BEGIN` fails; [`crate::SqlInbox::hold_connections`] changes that time,
//! or turns keeping off.
//!
//! [`InboxStore::begin_on`]: idem_core::store::InboxStore::begin_on

use crate::dialect::Dialect;
use crate::error::store_error;
use idem_core::model::StoreError;
use sqlx::pool::PoolConnection;
use sqlx::{Connection, Pool, Transaction};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

/// How long a worker keeps one connection before it gives it back to the pool, by default.
pub const HOLD_FOR: Duration = Duration::from_secs(60);

/// A pooled connection one worker keeps ([`idem_core::store::InboxStore::Held`] of the SQL stores).
pub struct Held<DB: Dialect> {
    conn: PoolConnection<DB::Db>,
    since: Instant,
    /// Set when a `BEGIN` on it failed: it is replaced at the next transaction.
    broken: Arc<AtomicBool>,
    /// Counts it among its pool's kept connections while it lives.
    _count: HeldCount,
}

impl<DB: Dialect> std::fmt::Debug for Held<DB> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Held")
            .field("database", &DB::KIND.name())
            .field("since", &self.since)
            .finish_non_exhaustive()
    }
}

impl<DB: Dialect> Held<DB> {
    /// The kept connection, for a statement outside any transaction.
    pub(crate) fn connection(&mut self) -> &mut crate::dialect::Conn<DB> {
        &mut self.conn
    }
}

/// How many connections workers keep, per pool, whichever stores share it. A pool is known by
/// the address of its options, which live as long as it does (and a kept connection keeps its
/// pool alive, so no other pool takes that address while it counts).
static KEPT: Mutex<BTreeMap<usize, usize>> = Mutex::new(BTreeMap::new());

fn kept() -> MutexGuard<'static, BTreeMap<usize, usize>> {
    KEPT.lock().unwrap_or_else(PoisonError::into_inner)
}

/// One of a pool's kept connections; gives its place back when dropped.
struct HeldCount(usize);

impl HeldCount {
    /// A place among the connections of `pool` workers keep, if one is left: fewer than
    /// [`spare`] kept, and more than the reserve idle or not yet opened.
    fn take<DB: sqlx::Database>(pool: &Pool<DB>) -> Option<Self> {
        let id = std::ptr::from_ref(pool.options()) as usize;
        let max = pool.options().get_max_connections() as usize;
        let available = pool.num_idle() + max.saturating_sub(pool.size() as usize);
        let mut kept = kept();
        let count = kept.entry(id).or_default();
        if *count >= spare(pool) || available <= reserve(max) {
            if *count == 0 {
                kept.remove(&id);
            }
            return None;
        }
        *count += 1;
        Some(Self(id))
    }
}

impl Drop for HeldCount {
    fn drop(&mut self) {
        let mut kept = kept();
        if let Some(count) = kept.get_mut(&self.0) {
            *count = count.saturating_sub(1);
            if *count == 0 {
                kept.remove(&self.0);
            }
        }
    }
}

/// The connections of a pool of `max` left to everything but kept connections: a quarter,
/// and at least two.
fn reserve(max: usize) -> usize {
    (max / 4).max(2)
}

/// How many connections of `pool` workers may keep at once: its size less the reserve.
pub(crate) fn spare<DB: sqlx::Database>(pool: &Pool<DB>) -> usize {
    let max = pool.options().get_max_connections() as usize;
    max.saturating_sub(reserve(max))
}

/// Opens an inbox transaction on a connection of `pool`, the way the dialect starts them.
pub(crate) async fn begin_pooled<DB: Dialect>(
    pool: &Pool<DB::Db>,
) -> Result<Transaction<'static, DB::Db>, StoreError> {
    let begun = match DB::BEGIN {
        Some(begin) => pool.begin_with(begin).await,
        None => pool.begin().await,
    };
    begun.map_err(|e| store_error("begin", e))
}

/// Opens an inbox transaction on the connection in `held`: taking one from the pool first
/// when `held` is empty (and the pool has one to spare), replacing it once it is `hold_for`
/// old or broken. Without a connection to keep (`hold_for` zero, none to spare), or when
/// `BEGIN` fails on the kept one, the transaction is opened on the pool.
pub(crate) async fn begin_on<'c, DB: Dialect>(
    pool: &'c Pool<DB::Db>,
    hold_for: Duration,
    held: &'c mut Option<Held<DB>>,
) -> Result<Transaction<'c, DB::Db>, StoreError> {
    if held
        .as_ref()
        .is_some_and(|h| h.broken.load(Ordering::Acquire) || h.since.elapsed() >= hold_for)
    {
        *held = None;
    }
    if held.is_none() && !hold_for.is_zero() {
        *held = take(pool).await?;
    }
    let Some(kept) = held.as_mut() else {
        return begin_pooled::<DB>(pool).await;
    };
    let broken = kept.broken.clone();
    let begun = match DB::BEGIN {
        Some(begin) => kept.conn.begin_with(begin).await,
        None => kept.conn.begin().await,
    };
    match begun {
        Ok(tx) => Ok(tx),
        Err(e) => {
            tracing::debug!(error = %e, "a held connection failed to begin; using the pool");
            broken.store(true, Ordering::Release);
            begin_pooled::<DB>(pool).await
        }
    }
}

/// A connection for a worker to keep, when its pool has one to spare.
async fn take<DB: Dialect>(pool: &Pool<DB::Db>) -> Result<Option<Held<DB>>, StoreError> {
    let Some(place) = HeldCount::take(pool) else {
        return Ok(None);
    };
    let conn = pool.acquire().await.map_err(|e| store_error("begin", e))?;
    Ok(Some(Held {
        conn,
        since: Instant::now(),
        broken: Arc::default(),
        _count: place,
    }))
}

#[cfg(all(test, feature = "postgres"))]
mod tests {
    use super::spare;

    #[tokio::test]
    async fn workers_keep_the_pool_less_a_quarter_and_at_least_two() {
        let kept = |max| {
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(max)
                .connect_lazy("postgres://nobody@127.0.0.1:1/none")
                .unwrap();
            spare(&pool)
        };
        assert_eq!(
            [kept(1), kept(2), kept(3), kept(10), kept(12), kept(18)],
            [0, 0, 1, 8, 9, 14]
        );
    }
}
