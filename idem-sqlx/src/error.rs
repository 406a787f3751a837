//! Classifying sqlx errors: transient ones are retried, permanent ones dead-lettered. This is
//! the one place that reads SQLSTATEs, SQLite result codes and MySQL error numbers; the
//! stores classify their handlers' database errors with it ([`idem_core::InboxStore::classify`]).

use idem_core::{Claim, ErrorClass, Fingerprint, StoreError, StoredOutput};

/// Classifies a sqlx error.
///
/// Transient: I/O, TLS and protocol failures, pool timeouts and closure, and database errors
/// whose SQLSTATE says the connection, the server's resources, a lock or serialization
/// failed (classes `08`, `53`, `57`, `58`; `40001`, `40P01`, `40003`, `55P03`, `55006`), on
/// SQLite `SQLITE_BUSY` and `SQLITE_LOCKED` with their extended codes, and on MySQL the error
/// numbers of [`classify_mysql_number`]. Error kinds sqlx may add later are treated as
/// transient: a retry costs little, a lost message a lot. Everything else (constraint
/// violations, bad SQL, decoding) is permanent.
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

/// Classifies an error a handler returned: a `sqlx::Error` by [`classify_sqlx`], anything
/// else as transient.
pub fn classify_error(error: &(dyn std::error::Error + 'static)) -> ErrorClass {
    error
        .downcast_ref::<sqlx::Error>()
        .map_or(ErrorClass::Transient, classify_sqlx)
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

/// A sqlx failure of the store during `operation`, classified.
pub(crate) fn store_error(operation: &'static str, error: sqlx::Error) -> StoreError {
    StoreError::new(operation, classify_sqlx(&error), error)
}

/// The claim of a key whose row exists: its stored fingerprint and result.
pub(crate) fn existing_claim(
    fingerprint: &[u8],
    outcome: Option<String>,
) -> Result<Claim, StoreError> {
    Ok(Claim::Existing {
        fingerprint: stored_fingerprint(fingerprint)?,
        output: outcome.map(StoredOutput::from_json),
    })
}

/// Decodes a stored fingerprint.
pub(crate) fn stored_fingerprint(bytes: &[u8]) -> Result<Fingerprint, StoreError> {
    Fingerprint::from_slice(bytes).ok_or_else(|| {
        StoreError::new(
            "claim",
            ErrorClass::Permanent,
            format!("stored fingerprint has {} bytes, expected 32", bytes.len()),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use idem_core::HandlerError;

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
            HandlerError::from(sqlx::Error::Io(io))
                .classify(classify_error)
                .class(),
            Some(ErrorClass::Transient)
        );
    }
}
