//! Error classification: transient failures are retried, permanent ones dead-lettered, and a
//! store that cannot write for now pauses its handlers' consumption.
//!
//! Nothing here knows a database's error codes. A handler's database error (`?` on a
//! `sqlx::Error`, see the `sqlx` feature) stays unclassified until the pipeline asks the
//! handler's inbox store, which knows its database ([`crate::store::InboxStore::classify`]).

use std::fmt;

/// A boxed error that can cross threads.
pub type BoxError = Box<dyn std::error::Error + Send + Sync + 'static>;

/// Whether retrying the same message can succeed, or the store as a whole cannot write.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum ErrorClass {
    /// This message may succeed later: a deadlock, a serialization failure, a lock wait or
    /// statement timeout. The runtime retries it, spending an attempt.
    Transient,
    /// The message will never succeed as it is: bad payload, constraint violation, a
    /// handler's own refusal. The runtime dead-letters it.
    Permanent,
    /// The store cannot write for now, whatever the message: read-only (a failover), disk or
    /// table full, shutting down or restarting, out of connections. The message is not at
    /// fault: the runtime pauses the consumption of the store's handlers until a probe write
    /// succeeds, then tries it again, spending none of its attempts.
    Unavailable,
}

impl fmt::Display for ErrorClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Transient => "transient",
            Self::Permanent => "permanent",
            Self::Unavailable => "unavailable",
        })
    }
}

/// The error a handler returns: it says whether the message should be retried.
///
/// `?` on a `sqlx::Error` gives [`HandlerError::Database`], which the handler's inbox store
/// classifies by SQLSTATE, error number or result code (`idem::sql::classify_sqlx`). Anything
/// else is wrapped with [`HandlerError::transient`] or [`HandlerError::permanent`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HandlerError {
    /// Retry the message later.
    #[error("transient failure: {0}")]
    Transient(#[source] BoxError),
    /// Do not retry: dead-letter the message with this reason.
    #[error("permanent failure: {0}")]
    Permanent(#[source] BoxError),
    /// A database error, classified by the handler's inbox store, which knows the database's
    /// error codes.
    #[error("database failure: {0}")]
    Database(#[source] BoxError),
    /// The database cannot write for now (read-only, full, restarting): pause, and try the
    /// message again once it can, spending no attempt ([`ErrorClass::Unavailable`]).
    #[error("the store cannot write for now: {0}")]
    Unavailable(#[source] BoxError),
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

    /// A failure of the database that no message can get past for now: the handler's
    /// consumption pauses until the store writes again ([`ErrorClass::Unavailable`]).
    pub fn unavailable(error: impl Into<BoxError>) -> Self {
        Self::Unavailable(error.into())
    }

    /// A database error for the handler's store to classify.
    pub fn database(error: impl Into<BoxError>) -> Self {
        Self::Database(error.into())
    }

    /// Whether this failure is worth a retry; `None` for a [`HandlerError::Database`] error,
    /// which only the store can tell (see [`HandlerError::classify`]).
    pub fn class(&self) -> Option<ErrorClass> {
        match self {
            Self::Transient(_) => Some(ErrorClass::Transient),
            Self::Permanent(_) => Some(ErrorClass::Permanent),
            Self::Unavailable(_) => Some(ErrorClass::Unavailable),
            Self::Database(_) => None,
        }
    }

    /// This failure as transient or permanent: a database error gets the class `classify`
    /// gives it; the others keep theirs.
    pub fn classify(
        self,
        classify: impl FnOnce(&(dyn std::error::Error + 'static)) -> ErrorClass,
    ) -> Self {
        match self {
            Self::Database(error) => match classify(error.as_ref()) {
                ErrorClass::Transient => Self::Transient(error),
                ErrorClass::Permanent => Self::Permanent(error),
                ErrorClass::Unavailable => Self::Unavailable(error),
            },
            classified => classified,
        }
    }
}

impl From<serde_json::Error> for HandlerError {
    fn from(error: serde_json::Error) -> Self {
        Self::Permanent(error.into())
    }
}

/// A store failure in a handler (staging an outbox message), of the class the store gave it.
impl From<StoreError> for HandlerError {
    fn from(error: StoreError) -> Self {
        match error.class() {
            ErrorClass::Transient => Self::Transient(error.into()),
            ErrorClass::Permanent => Self::Permanent(error.into()),
            ErrorClass::Unavailable => Self::Unavailable(error.into()),
        }
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

    /// Whether retrying can help, and whether the store as a whole cannot write for now.
    pub fn class(&self) -> ErrorClass {
        self.class
    }

    /// Whether the store cannot write for now ([`ErrorClass::Unavailable`]).
    pub fn is_unavailable(&self) -> bool {
        self.class == ErrorClass::Unavailable
    }

    /// The operation that failed.
    pub fn operation(&self) -> &'static str {
        self.operation
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn database_errors_take_the_class_the_store_gives() {
        let io = || std::io::Error::new(std::io::ErrorKind::ConnectionReset, "reset");
        let error = HandlerError::database(io());
        assert_eq!(error.class(), None);
        let classified = error.classify(|_| ErrorClass::Transient);
        assert_eq!(classified.class(), Some(ErrorClass::Transient));
        assert_eq!(classified.to_string(), "transient failure: reset");
        let kept = HandlerError::permanent(io()).classify(|_| ErrorClass::Transient);
        assert_eq!(kept.class(), Some(ErrorClass::Permanent));
    }
}
