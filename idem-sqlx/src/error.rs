//! Classifying sqlx errors: transient ones are retried, permanent ones dead-lettered. This is
//! the one place that reads SQLSTATEs, SQLite result codes and MySQL error numbers; the
//! stores classify their handlers' database errors with it ([`idem_core::store::InboxStore::classify`]).

use idem_core::{
    model::ErrorClass, model::Fingerprint, model::StoreError, model::StoredOutput, store::Claim,
};

/// Classifies a sqlx error by what it means for the message.
///
/// - **Unavailable** (the store cannot write for now, whatever the message; the runtime pauses
///   the store's handlers until a probe write succeeds): I/O, TLS and protocol failures, pool
///   timeouts and closure, and database errors that say the server is read-only, full, out of
///   resources, shutting down or starting, or unreachable: see [`classify_database_code`] and
///   [`classify_mysql_number`].
/// - **Transient** (this message may succeed on a retry): a deadlock, a serialization failure,
///   a lock wait or statement timeout. Error kinds sqlx may add later are treated as transient:
///   a retry costs little, a lost message a lot.
/// - **Permanent**: everything else (constraint violations, bad SQL, decoding).
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
        | E::BeginFailed => ErrorClass::Unavailable,
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
///
/// SQLSTATEs: unavailable are class `08` (connection), `25006` (read-only transaction: a hot
/// standby, or a database set read-only, as after a failover), class `53` (insufficient
/// resources: disk full, out of memory, too many connections), `57P01`…`57P05` (shut down,
/// starting up, in recovery, dropped, idle-terminated) and class `58` (system, I/O); transient
/// are `40001`, `40P01`, `40003` (serialization, deadlock, completion unknown), `55P03`,
/// `55006` (lock not available, object in use) and the rest of class `57` (a cancelled
/// statement: a timeout). SQLite: unavailable are `NOMEM` (7), `READONLY` (8), `IOERR` (10),
/// `CORRUPT` (11), `FULL` (13) and `CANTOPEN` (14); transient `BUSY` (5) and `LOCKED` (6);
/// each with its extended codes.
pub fn classify_database_code(code: &str) -> ErrorClass {
    if code.len() == 5 {
        let class = &code[..2];
        if matches!(class, "08" | "53" | "58")
            || code == "25006"
            || (class == "57" && code.starts_with("57P"))
        {
            return ErrorClass::Unavailable;
        }
        if class == "57" || matches!(code, "40001" | "40P01" | "40003" | "55P03" | "55006") {
            return ErrorClass::Transient;
        }
        return ErrorClass::Permanent;
    }
    match code.parse::<i32>().map(|c| c & 0xff) {
        Ok(7 | 8 | 10 | 11 | 13 | 14) => ErrorClass::Unavailable,
        Ok(5 | 6) => ErrorClass::Transient,
        _ => ErrorClass::Permanent,
    }
}

/// Classifies the MySQL/MariaDB error numbers whose SQLSTATE is the catch-all `HY000` (or
/// says less than the number): unavailable are read-only (1290 `--read-only`, 1792 a read-only
/// transaction, 1836 read-only mode), disk or table full (1021, 1114), a table opened
/// read-only (1036), out of memory (1037, 1038, 1041), too many connections (1040, 1203), a
/// server shutting down (1053), a killed connection (1927) and a cluster node not ready
/// (1047); transient are a lock wait timeout (1205), a deadlock (1213) and an interrupted
/// query (1317). `None`: the SQLSTATE decides.
pub fn classify_mysql_number(number: u16) -> Option<ErrorClass> {
    match number {
        1021 | 1036 | 1037 | 1038 | 1040 | 1041 | 1047 | 1053 | 1114 | 1203 | 1290 | 1792
        | 1836 | 1927 => Some(ErrorClass::Unavailable),
        1205 | 1213 | 1317 => Some(ErrorClass::Transient),
        _ => None,
    }
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
    use idem_core::model::HandlerError;

    #[test]
    fn mysql_numbers() {
        for number in [1205, 1213, 1317] {
            assert_eq!(classify_mysql_number(number), Some(ErrorClass::Transient));
        }
        for number in [1021, 1040, 1053, 1114, 1290, 1792, 1836, 1927] {
            assert_eq!(
                classify_mysql_number(number),
                Some(ErrorClass::Unavailable),
                "{number}"
            );
        }
        // Duplicate entry, data too long: the SQLSTATE (23000, 22001) decides, permanent.
        assert_eq!(classify_mysql_number(1062), None);
        assert_eq!(classify_database_code("22001"), ErrorClass::Permanent);
    }

    #[test]
    fn sqlstate_and_sqlite_codes() {
        for code in [
            "40001", "40P01", "55P03", "57014", "5", "6", "517", "261", "262",
        ] {
            assert_eq!(
                classify_database_code(code),
                ErrorClass::Transient,
                "{code}"
            );
        }
        // Read-only (a standby, a database set read-only), full, shutting down or starting,
        // out of connections, unreachable; SQLite read-only, full, I/O.
        for code in [
            "25006", "53100", "53300", "57P01", "57P03", "08006", "58030", "8", "1032", "13", "10",
            "266",
        ] {
            assert_eq!(
                classify_database_code(code),
                ErrorClass::Unavailable,
                "{code}"
            );
        }
        for code in [
            "23505", "42P01", "22P02", "19", "2067", "1", "23301", "42501",
        ] {
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
            ErrorClass::Unavailable
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
            Some(ErrorClass::Unavailable)
        );
    }
}
