//! The claim statements every dialect runs alike: the insert-then-read claim of dialects whose
//! insert cannot return the existing row (MySQL, SQLite), storing a result, removing a marker.
//!
//! Both dialects make the read see the committed row: SQLite holds the write lock since
//! `BEGIN IMMEDIATE`, MySQL reads with a locking read after the insert waited on the row's lock.

use crate::error::{existing_claim, store_error};
use crate::exec::{Param, Sql};
use crate::statements::Prepared;
use idem_core::{Claim, ClaimRequest, ErrorClass, StoreError, StoredOutput};

/// Inserts the marker; when that inserted nothing, reads the row that holds the key.
pub(crate) async fn insert_then_read<DB: Sql>(
    sql: &Prepared,
    conn: &mut DB::Connection,
    request: &ClaimRequest<'_>,
) -> Result<Claim, StoreError> {
    let fail = |e| store_error("claim", e);
    let insert = [
        Param::Text(request.consumer),
        Param::Text(request.key),
        Param::Bytes(request.fingerprint.as_bytes()),
        Param::Int(i64::from(request.attempt)),
        Param::Int(crate::config::secs(request.retention)),
    ];
    if DB::execute(conn, &sql.claim, &insert).await.map_err(fail)? == 1 {
        return Ok(Claim::Claimed);
    }
    let key = [Param::Text(request.consumer), Param::Text(request.key)];
    let Some(row) = DB::fetch_optional(conn, &sql.existing, &key)
        .await
        .map_err(fail)?
    else {
        // The row that blocked the insert was swept since; a retry claims.
        return Err(StoreError::new(
            "claim",
            ErrorClass::Transient,
            "the key's row vanished between the insert and the read",
        ));
    };
    let fingerprint = DB::bytes(&row, "fingerprint").map_err(fail)?;
    existing_claim(
        &fingerprint,
        DB::optional_text(&row, "outcome").map_err(fail)?,
    )
}

/// Stores the handler's result on the marker claimed in this transaction.
pub(crate) async fn complete<DB: Sql>(
    sql: &Prepared,
    conn: &mut DB::Connection,
    request: &ClaimRequest<'_>,
    output: &StoredOutput,
) -> Result<(), StoreError> {
    let params = [
        Param::Text(output.as_json()),
        Param::Text(request.consumer),
        Param::Text(request.key),
    ];
    DB::execute(conn, &sql.complete, &params)
        .await
        .map(drop)
        .map_err(|e| store_error("complete", e))
}

/// Removes the markers of `keys` claimed in this transaction, one statement per key (the
/// dialects without array parameters).
pub(crate) async fn unclaim_each<DB: Sql>(
    sql: &Prepared,
    conn: &mut DB::Connection,
    consumer: &str,
    keys: &[&str],
) -> Result<(), StoreError> {
    for key in keys {
        let params = [Param::Text(consumer), Param::Text(key)];
        DB::execute(conn, &sql.unclaim, &params)
            .await
            .map_err(|e| store_error("unclaim", e))?;
    }
    Ok(())
}
