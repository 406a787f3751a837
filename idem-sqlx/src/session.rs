//! A pooled connection whose session may hold a lock (the sweeper's, MySQL's migration lock).

use sqlx::Database;
use sqlx::pool::PoolConnection;

/// A pooled connection whose session holds a session-level lock until [`released`] is set.
/// Dropped before that — its future cancelled mid-way, a runtime stopping, a failed unlock —
/// it closes the connection, which releases the lock, instead of handing a locked session back
/// to the pool, where it would keep every other holder out for as long as the pool lives.
///
/// [`released`]: LockedSession::released
pub(crate) struct LockedSession<DB: Database> {
    /// The connection the lock belongs to.
    pub(crate) conn: PoolConnection<DB>,
    /// Whether the session holds no lock (never taken, or released).
    pub(crate) released: bool,
}

impl<DB: Database> LockedSession<DB> {
    /// Wraps `conn`, which is about to take a lock.
    pub(crate) fn new(conn: PoolConnection<DB>) -> Self {
        Self {
            conn,
            released: false,
        }
    }
}

impl<DB: Database> Drop for LockedSession<DB> {
    fn drop(&mut self) {
        if !self.released {
            self.conn.close_on_drop();
        }
    }
}
