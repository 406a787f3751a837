//! `?` on a `sqlx::Error` in a handler (feature `sqlx`).
//!
//! This impl lives in idem-core only because of the orphan rule: `From` is std's, `sqlx::Error`
//! is sqlx's, so the impl must sit with [`HandlerError`]. It does not classify: the error
//! becomes [`HandlerError::Database`], and the handler's inbox store, which knows its
//! database's error codes, classifies it (idem-sqlx's `classify_sqlx`).

use crate::model::HandlerError;

impl From<::sqlx::Error> for HandlerError {
    fn from(error: ::sqlx::Error) -> Self {
        Self::Database(error.into())
    }
}
