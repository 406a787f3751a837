//! Whether a commit idem acks after can still be lost: the database's settings under which a
//! crash or a failover undoes committed inbox rows (and the handler's writes with them) after
//! their messages were acked. The runtime's start asks the store ([`SqlInbox::check`]); each
//! dialect names what it can read without privileges ([`Dialect::DURABILITY`]).
//!
//! [`SqlInbox::check`]: idem_core::store::InboxStore::check

use crate::dialect::Dialect;
use crate::exec::Sql;
use idem_core::{model::ErrorClass, model::StoreError};
use std::fmt;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

/// What the start of a runtime does when the store's settings can lose acked commits
/// ([`crate::SqlInbox::durability`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Durability {
    /// Log each risk found once, at `warn`, naming the setting and its fix (the default).
    #[default]
    Warn,
    /// Refuse to start while a risk is found, or while the database will not say: the
    /// runtime's start fails naming the setting and its fix.
    Require,
    /// Do not look (the risk is known and accepted).
    Unchecked,
}

/// A setting under which a committed inbox row can be lost after its message was acked.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Risk {
    /// The setting, as the database names it.
    pub setting: String,
    /// Its value in idem's connections.
    pub found: String,
    /// What makes it safe, and what can happen until then.
    pub fix: String,
}

impl fmt::Display for Risk {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} is {}: set {}", self.setting, self.found, self.fix)
    }
}

/// Looks for settings of `pool`'s database that can lose acked commits and does what
/// `durability` says; `told` is set once they were logged, so that a start logs them once.
pub(crate) async fn check<DB: Dialect>(
    pool: &sqlx::Pool<DB::Db>,
    durability: Durability,
    told: &AtomicBool,
) -> Result<(), StoreError> {
    if durability == Durability::Unchecked {
        return Ok(());
    }
    let risks = match risks::<DB>(pool).await {
        Ok(risks) => risks,
        Err(e) if durability == Durability::Require => {
            return Err(StoreError::new(
                idem_core::store::DURABILITY,
                ErrorClass::Permanent,
                format!(
                    "could not read whether the database's settings can lose commits after idem acked their messages ({e}); grant the role access to them, or SqlInbox::durability(Durability::Warn) to start anyway"
                ),
            ));
        }
        Err(e) => {
            if !told.swap(true, Ordering::Relaxed) {
                tracing::warn!(store = %DB::KIND, error = %e, "could not read whether the database's settings can lose acked commits; see the book's production checklist");
            }
            return Ok(());
        }
    };
    if risks.is_empty() {
        return Ok(());
    }
    if durability == Durability::Require {
        let found: Vec<String> = risks.iter().map(ToString::to_string).collect();
        return Err(StoreError::new(
            idem_core::store::DURABILITY,
            ErrorClass::Permanent,
            format!(
                "the database can lose commits after idem acked their messages: {} (or SqlInbox::durability(Durability::Warn) to start anyway)",
                found.join("; ")
            ),
        ));
    }
    if !told.swap(true, Ordering::Relaxed) {
        for risk in &risks {
            tracing::warn!(store = %DB::KIND, setting = %risk.setting, found = %risk.found, "the database can lose commits after idem acked their messages: set {}", risk.fix);
        }
    }
    Ok(())
}

/// The risks `DB`'s settings hold, read on a connection of `pool`; `Err` when the database
/// would not say (a dialect that names nothing to read finds nothing).
async fn risks<DB: Dialect>(pool: &sqlx::Pool<DB::Db>) -> Result<Vec<Risk>, sqlx::Error> {
    if DB::DURABILITY.is_empty() {
        return Ok(Vec::new());
    }
    let mut conn = pool.acquire().await?;
    let rows = DB::Db::fetch_all(&mut conn, &Arc::from(DB::DURABILITY), &[]).await?;
    rows.iter()
        .map(|row| {
            Ok(Risk {
                setting: DB::Db::text(row, "setting")?,
                found: DB::Db::text(row, "found")?,
                fix: DB::Db::text(row, "fix")?,
            })
        })
        .collect()
}

/// PostgreSQL: commits that do not wait for the WAL flush, a physical standby streamed to
/// asynchronously (logical walsenders, such as change-data capture, do not count), and a
/// synchronous standby that commits do not wait for.
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: &str = r#"
SELECT 'synchronous_commit' AS setting, current_setting('synchronous_commit') AS found,
       'synchronous_commit = on (the default): with off, a crash of the server loses its last commits, after idem acked their messages' AS fix
WHERE current_setting('synchronous_commit') = 'off'
UNION ALL
SELECT 'synchronous_standby_names', 'empty while a standby streams from this server',
       'synchronous_standby_names to the standby that a failover promotes, with synchronous_commit = on or remote_apply: a failover to an asynchronous standby can lose commits after idem acked their messages'
WHERE current_setting('synchronous_standby_names') = ''
  AND EXISTS (
      SELECT 1 FROM pg_stat_replication r
      WHERE NOT EXISTS (
          SELECT 1 FROM pg_replication_slots s
          WHERE s.active_pid = r.pid AND s.slot_type = 'logical'))
UNION ALL
SELECT 'synchronous_commit', 'local',
       'synchronous_commit = on or remote_apply: with local, commits do not wait for the synchronous standby, so a failover can lose commits after idem acked their messages'
WHERE current_setting('synchronous_commit') = 'local'
  AND current_setting('synchronous_standby_names') <> ''
"#;

/// MariaDB: a redo log not flushed at each commit, replicas connected without
/// semi-synchronous replication, and semi-synchronous replication that waits after the commit.
#[cfg(feature = "mysql")]
pub(crate) const MARIADB: &str = r#"
SELECT 'innodb_flush_log_at_trx_commit' AS setting,
       CAST(@@innodb_flush_log_at_trx_commit AS CHAR) AS found,
       'innodb_flush_log_at_trx_commit = 1 (the default): otherwise a crash of the server loses its last commits, after idem acked their messages' AS fix
FROM DUAL WHERE @@innodb_flush_log_at_trx_commit <> 1
UNION ALL
SELECT 'rpl_semi_sync_master_enabled', 'OFF while replicas are connected',
       'rpl_semi_sync_master_enabled = ON with rpl_semi_sync_master_wait_point = AFTER_SYNC: a failover to an asynchronous replica can lose commits after idem acked their messages'
FROM information_schema.GLOBAL_STATUS
WHERE VARIABLE_NAME = 'SLAVES_CONNECTED' AND VARIABLE_VALUE > 0
  AND @@rpl_semi_sync_master_enabled = 0
UNION ALL
SELECT 'rpl_semi_sync_master_wait_point', 'AFTER_COMMIT',
       'rpl_semi_sync_master_wait_point = AFTER_SYNC: after the commit, a failover can lose commits that idem acked'
FROM DUAL
WHERE @@rpl_semi_sync_master_enabled = 1
  AND @@rpl_semi_sync_master_wait_point = 'AFTER_COMMIT'
"#;

/// SQLite: a connection that does not sync at each commit.
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: &str = r#"
SELECT 'synchronous' AS setting, 'OFF' AS found,
       'PRAGMA synchronous = FULL (the default) or NORMAL in WAL mode: with OFF, a crash of the machine can lose the last commits, after idem acked their messages' AS fix
FROM pragma_synchronous WHERE synchronous = 0
"#;
