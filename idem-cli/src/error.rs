//! What can go wrong, said so that the operator knows what to change.

/// A failed command.
#[derive(Debug, thiserror::Error)]
pub enum CliError {
    /// The database could not be reached or refused a statement.
    #[error("database {url}: {message}")]
    Database {
        /// The database URL, its password hidden.
        url: String,
        /// What went wrong.
        message: String,
    },
    /// The inbox could not be read or changed.
    #[error("inbox: {0}")]
    Store(#[from] idem::store::StoreError),
    /// The broker could not be reached or refused an operation.
    #[error("broker: {0}")]
    Broker(String),
    /// The broker did not answer within `--broker-timeout`.
    #[error("broker: {0}")]
    NoAnswer(String),
    /// A setting is wrong.
    #[error("{0}")]
    Usage(String),
    /// Nothing matched.
    #[error("{0}")]
    NotFound(String),
    /// Some of the work failed; the rest was done.
    #[error("{0}")]
    Partial(String),
}
