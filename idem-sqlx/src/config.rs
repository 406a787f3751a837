//! Inbox configuration shared by every dialect: the table name and the retention.

use std::time::Duration;

/// The default inbox table.
pub const DEFAULT_TABLE: &str = "idem_inbox";

pub use idem_core::store::DEFAULT_RETENTION;

/// How long after it was staged an outbox row the broker keeps refusing is given up, unless the
/// store says otherwise (`SqlInbox::outbox_give_up`): one day.
pub const DEFAULT_GIVE_UP: Duration = Duration::from_secs(24 * 3600);

/// The longest give-up time a store takes (`SqlInbox::outbox_give_up`): 100 years; a longer
/// one is taken as this (the databases' interval arithmetic has bounds).
pub const MAX_GIVE_UP: Duration = Duration::from_secs(100 * 366 * 86_400);

/// A wrong inbox configuration, reported when the store is built.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ConfigError {
    /// The table name is not a plain identifier.
    #[error(
        "invalid inbox table name {0:?}: use 1 to 48 lowercase ASCII letters, digits or underscores, starting with a letter or underscore"
    )]
    TableName(String),
    /// The retention is zero or too long to express.
    #[error("invalid inbox retention {0:?}: use at least one second and at most 100 years")]
    Retention(Duration),
}

/// A validated inbox table name. Table names are spliced into SQL text, so only plain
/// lowercase identifiers are accepted: nothing a configuration file holds can inject SQL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TableName(String);

impl TableName {
    /// Validates `name`.
    pub fn new(name: &str) -> Result<Self, ConfigError> {
        let mut chars = name.chars();
        let valid_start = chars
            .next()
            .is_some_and(|c| c.is_ascii_lowercase() || c == '_');
        let valid_rest = chars.all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_');
        if valid_start && valid_rest && name.len() <= 48 {
            Ok(Self(name.to_owned()))
        } else {
            Err(ConfigError::TableName(name.to_owned()))
        }
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name of the outbox beside this inbox: `_inbox` at the end becomes `_outbox`
    /// (`idem_inbox` → `idem_outbox`), any other name gets `_outbox` appended.
    pub fn outbox(&self) -> String {
        match self.0.strip_suffix("_inbox") {
            Some(stem) => format!("{stem}_outbox"),
            None => format!("{}_outbox", self.0),
        }
    }
}

impl Default for TableName {
    fn default() -> Self {
        Self(DEFAULT_TABLE.to_owned())
    }
}

/// Table name and retention of one inbox.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InboxConfig {
    pub(crate) table: TableName,
    pub(crate) retention: Duration,
}

impl Default for InboxConfig {
    fn default() -> Self {
        Self {
            table: TableName::default(),
            retention: DEFAULT_RETENTION,
        }
    }
}

impl InboxConfig {
    /// Sets the table name.
    pub fn table(mut self, name: &str) -> Result<Self, ConfigError> {
        self.table = TableName::new(name)?;
        Ok(self)
    }

    /// Sets the retention.
    pub fn retention(mut self, retention: Duration) -> Result<Self, ConfigError> {
        if retention < Duration::from_secs(1) || retention > Duration::from_secs(100 * 366 * 86_400)
        {
            return Err(ConfigError::Retention(retention));
        }
        self.retention = retention;
        Ok(self)
    }

    /// The table name.
    pub fn table_name(&self) -> &str {
        self.table.as_str()
    }

    /// The retention.
    pub fn retention_period(&self) -> Duration {
        self.retention
    }
}

/// A retention in whole seconds, as bound into claims.
pub(crate) fn secs(retention: Duration) -> i64 {
    i64::try_from(retention.as_secs()).unwrap_or(i64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_names_are_plain_identifiers() {
        for ok in ["idem_inbox", "_x", "inbox2", &"a".repeat(48)] {
            assert!(TableName::new(ok).is_ok(), "{ok}");
        }
        for bad in [
            "",
            "2inbox",
            "Inbox",
            "inbox; DROP TABLE orders",
            "a.b",
            "in\"box",
            &"a".repeat(49),
        ] {
            assert_eq!(
                TableName::new(bad),
                Err(ConfigError::TableName(bad.to_owned()))
            );
        }
        let err = InboxConfig::default().table("x y").unwrap_err().to_string();
        assert!(err.contains("lowercase ASCII letters"), "{err}");
    }

    #[test]
    fn retention_bounds() {
        assert!(InboxConfig::default().retention(Duration::ZERO).is_err());
        let c = InboxConfig::default()
            .retention(Duration::from_secs(60))
            .unwrap();
        assert_eq!(secs(c.retention_period()), 60);
    }
}
