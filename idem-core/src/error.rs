//! Error classification: transient failures are retried, permanent ones dead-lettered.

use std::fmt;

/// A boxed error that can cross threads.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Whether retrying the same message can succeed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ErrorClass {
    /// The message may succeed later: database unavailable, deadlock, serialization failure,
    /// pool timeout. The runtime retries it.
    Transient,
    /// The message will never succeed as it is: bad payload, constraint violation, a
    /// handler's own refusal. The runtime dead-letters it.
    Permanent,
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Transient => "transient",
            Self::Permanent => "permanent",
        })
    }
}

/// The error a handler returns: it says whether the message should be retried.
///
/// `?` on a [`sqlx::Error`] classifies it by SQLSTATE (PostgreSQL, MySQL) or result code
/// (SQLite); see [`classify_sqlx`]. Anything else is wrapped with
/// [`HandlerError::transient`] or [`HandlerError::permanent`].
#[derive(Debug, thiserror::Error)]
pub enum HandlerError {
    /// Retry the message later.
    #[error("transient failure: {0}")]
    Transient(#[source] BoxError),
    /// Do not retry: dead-letter the message with this reason.
    #[error("permanent failure: {0}")]
    Permanent(#[source] BoxError),
}

impl HandlerError {
    /// A failure that a later attempt may not meet.
    pub fn transient(error: impl Into<BoxError>) -> Self {
        Self::Transient(error.into())
    }

    /// A failure that every attempt would meet.
    pub fn permanent(error: impl Into<BoxError>) -> Self {
        Self::Permanent(error.into())
    }

    /// Whether this failure is worth a retry.
    pub fn class(&self) -> ErrorClass {
        match self {
            Self::Transient(_) => ErrorClass::Transient,
            Self::Permanent(_) => ErrorClass::Permanent,
        }
    }
}

impl From<sqlx::Error> for HandlerError {
    fn from(error: sqlx::Error) -> Self {
        match classify_sqlx(&error) {
            ErrorClass::Transient => Self::Transient(error.into()),
            ErrorClass::Permanent => Self::Permanent(error.into()),
        }
    }
}

impl From<serde_json::Error> for HandlerError {
    fn from(error: serde_json::Error) -> Self {
        Self::Permanent(error.into())
    }
}

/// A failure of the inbox store itself (begin, claim, complete, commit).
#[derive(Debug, thiserror::Error)]
#[error("inbox {operation} failed ({class}): {source}")]
pub struct StoreError {
    operation: &'static str,
    class: ErrorClass,
    #[source]
    source: BoxError,
}

impl StoreError {
    /// A store failure during `operation` (`"begin"`, `"claim"`, …).
    pub fn new(operation: &'static str, class: ErrorClass, source: impl Into<BoxError>) -> Self {
        Self {
            operation,
            class,
            source: source.into(),
        }
    }

    /// A sqlx failure during `operation`, classified by [`classify_sqlx`].
    pub fn sqlx(operation: &'static str, error: sqlx::Error) -> Self {
        Self::new(operation, classify_sqlx(&error), error)
    }

    /// Whether retrying can help.
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// The operation that failed.
    pub fn operation(&self) -> &'static str {
        self.operation
    }
}

/// Classifies a sqlx error.
///
/// Transient: I/O, TLS and protocol failures, pool timeouts and closure, and database errors
/// whose SQLSTATE says the connection, the server's resources, a lock or serialization
/// failed (classes `08`, `53`, `57`, `58`; `40001`, `40P01`, `40003`, `55P03`, `55006`), or,
/// on SQLite, `SQLITE_BUSY` and `SQLITE_LOCKED` with their extended codes. Error kinds sqlx may
/// add later are treated as transient: a retry costs little, a lost message a lot.
/// Everything else (constraint violations, bad SQL, decoding) is permanent.
pub fn classify_sqlx(error: &sqlx::Error) -> ErrorClass {
    use sqlx::Error as E;
    match error {
        E::Database(db) => {
            #[cfg(feature = "mysql")]
            if let Some(mysql) = db.try_downcast_ref::<sqlx::mysql::MySqlDatabaseError>() {
                return classify_mysql_number(mysql.number())
                    .unwrap_or_else(|| classify_database_code(mysql.code().unwrap_or("HY000")));
            }
            match db.code() {
                Some(code) => classify_database_code(&code),
                None => ErrorClass::Permanent,
            }
        }
        E::Io(_)
        | E::Tls(_)
        | E::Protocol(_)
        | E::PoolTimedOut
        | E::PoolClosed
        | E::WorkerCrashed
        | E::BeginFailed => ErrorClass::Transient,
        E::Configuration(_)
        | E::InvalidArgument(_)
        | E::RowNotFound
        | E::TypeNotFound { .. }
        | E::ColumnIndexOutOfBounds { .. }
        | E::ColumnNotFound(_)
        | E::ColumnDecode { .. }
        | E::Encode(_)
        | E::Decode(_)
        | E::AnyDriverError(_)
        | E::Migrate(_)
        | E::InvalidSavePointStatement => ErrorClass::Permanent,
        _ => ErrorClass::Transient,
    }
}

/// Classifies a database error code: a five-character SQLSTATE (PostgreSQL, MySQL), or an
/// SQLite (extended) result code, which is never five characters long.
pub fn classify_database_code(code: &str) -> ErrorClass {
    let transient = if code.len() == 5 {
        matches!(&code[..2], "08" | "53" | "57" | "58")
            || matches!(code, "40001" | "40P01" | "40003" | "55P03" | "55006")
    } else {
        // SQLITE_BUSY (5) and SQLITE_LOCKED (6), and their extended codes (low byte 5 or 6).
        code.parse::<i32>().is_ok_and(|c| matches!(c & 0xff, 5 | 6))
    };
    if transient {
        ErrorClass::Transient
    } else {
        ErrorClass::Permanent
    }
}

/// Classifies the MySQL/MariaDB error numbers whose SQLSTATE is the catch-all `HY000` but that
/// a retry can overcome: lock wait timeout (1205), deadlock (1213), query interrupted (1317),
/// connection killed (1927). `None`: the SQLSTATE decides.
pub fn classify_mysql_number(number: u16) -> Option<ErrorClass> {
    matches!(number, 1205 | 1213 | 1317 | 1927).then_some(ErrorClass::Transient)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mysql_numbers() {
        for number in [1205, 1213, 1317, 1927] {
            assert_eq!(classify_mysql_number(number), Some(ErrorClass::Transient));
        }
        // Duplicate entry, data too long: the SQLSTATE (23000, 22001) decides, permanent.
        assert_eq!(classify_mysql_number(1062), None);
        assert_eq!(classify_database_code("22001"), ErrorClass::Permanent);
    }

    #[test]
    fn sqlstate_and_sqlite_codes() {
        for code in [
            "40001", "40P01", "08006", "57P01", "53300", "55P03", "5", "6", "517", "261", "262",
        ] {
            assert_eq!(
                classify_database_code(code),
                ErrorClass::Transient,
                "{code}"
            );
        }
        for code in ["23505", "42P01", "22P02", "19", "2067", "1", "23301"] {
            assert_eq!(
                classify_database_code(code),
                ErrorClass::Permanent,
                "{code}"
            );
        }
    }

    #[test]
    fn sqlx_variants() {
        assert_eq!(
            classify_sqlx(&sqlx::Error::PoolTimedOut),
            ErrorClass::Transient
        );
        assert_eq!(
            classify_sqlx(&sqlx::Error::RowNotFound),
            ErrorClass::Permanent
        );
        let io = std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        assert_eq!(
            HandlerError::from(sqlx::Error::Io(io)).class(),
            ErrorClass::Transient
        );
    }
}
