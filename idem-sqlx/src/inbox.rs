//! The inbox store shared by every dialect: pool, configuration and prepared statement text.

use crate::config::{ConfigError, InboxConfig, TableName};
use idem_core::StoreError;
use sqlx::{Database, Pool, Transaction};
use std::fmt;
use std::sync::Arc;
use std::time::Duration;

/// A SQL dialect idem can keep an inbox in: the statement templates, with `{table}` standing for
/// the inbox table.
pub trait Dialect: Database {
    /// Inserts the marker, doing nothing if the key exists.
    const CLAIM: &'static str;
    /// Reads the fingerprint and stored result of a key.
    const EXISTING: &'static str;
    /// Stores the handler's result on a claimed row.
    const COMPLETE: &'static str;
}

/// Reads nothing, but fails unless the inbox table exists with the columns idem uses.
const PROBE: &str = r#"SELECT consumer, key, fingerprint, status, outcome, attempts, created_at, completed_at, expires_at
    FROM "{table}" WHERE 1 = 0"#;

/// An inbox in a database of dialect `DB`; see [`crate::PgInbox`] and [`crate::SqliteInbox`].
pub struct SqlInbox<DB: Dialect> {
    pub(crate) pool: Pool<DB>,
    pub(crate) config: InboxConfig,
    pub(crate) sql: Arc<Statements>,
}

/// The statements of one inbox, with its table name filled in once.
#[derive(Debug)]
pub(crate) struct Statements {
    pub(crate) claim: Arc<str>,
    pub(crate) existing: Arc<str>,
    pub(crate) complete: Arc<str>,
    pub(crate) probe: Arc<str>,
}

impl<DB: Dialect> SqlInbox<DB> {
    /// An inbox in table `idem_inbox` with the default retention.
    pub fn new(pool: Pool<DB>) -> Self {
        Self::with_config(pool, InboxConfig::default())
    }

    /// An inbox with `config`.
    pub fn with_config(pool: Pool<DB>, config: InboxConfig) -> Self {
        let sql = Arc::new(Statements {
            claim: statement(DB::CLAIM, &config.table),
            existing: statement(DB::EXISTING, &config.table),
            complete: statement(DB::COMPLETE, &config.table),
            probe: statement(PROBE, &config.table),
        });
        Self { pool, config, sql }
    }

    /// The same inbox in table `name`.
    pub fn table(self, name: &str) -> Result<Self, ConfigError> {
        let config = self.config.clone().table(name)?;
        Ok(Self::with_config(self.pool, config))
    }

    /// The same inbox keeping rows for `retention`.
    pub fn retention(self, retention: Duration) -> Result<Self, ConfigError> {
        let config = self.config.clone().retention(retention)?;
        Ok(Self::with_config(self.pool, config))
    }

    /// The configuration.
    pub fn config(&self) -> &InboxConfig {
        &self.config
    }

    /// The pool.
    pub fn pool(&self) -> &Pool<DB> {
        &self.pool
    }
}

impl<DB: Dialect> Clone for SqlInbox<DB> {
    fn clone(&self) -> Self {
        Self {
            pool: self.pool.clone(),
            config: self.config.clone(),
            sql: self.sql.clone(),
        }
    }
}

impl<DB: Dialect> fmt::Debug for SqlInbox<DB> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SqlInbox")
            .field("database", &DB::NAME)
            .field("config", &self.config)
            .finish()
    }
}

/// Fills the table name into a statement template. The name is a validated identifier (see
/// [`TableName`]), so the resulting text is safe to hand to `sqlx::AssertSqlSafe`.
pub(crate) fn statement(template: &str, table: &TableName) -> Arc<str> {
    template.replace("{table}", table.as_str()).into()
}

/// Commits an inbox transaction.
pub(crate) async fn commit<DB: Database>(tx: Transaction<'static, DB>) -> Result<(), StoreError> {
    tx.commit().await.map_err(|e| StoreError::sqlx("commit", e))
}

/// Rolls an inbox transaction back, logging a failure: a transaction that cannot be rolled back
/// is not committed either, and its connection is discarded.
pub(crate) async fn rollback<DB: Database>(tx: Transaction<'static, DB>) {
    if let Err(e) = tx.rollback().await {
        tracing::warn!(error = %e, "inbox rollback failed; the connection is discarded");
    }
}
