//! The claim statements every dialect runs alike: the insert-then-read claim of dialects whose
//! insert cannot return the existing row (MySQL, SQLite), storing a result, removing a marker.
//!
//! Both dialects make the read see the committed row: SQLite holds the write lock since
//! `BEGIN IMMEDIATE`, MySQL reads with a locking read after the insert waited on the row's lock.

use crate::error::{existing_claim, store_error};
use crate::exec::{Param, Sql};
use crate::statements::{Prepared, RowStatements};
use idem_core::store::owner_token;
use idem_core::{
    model::ErrorClass, model::StoreError, model::StoredOutput, store::Claim, store::ClaimRequest,
};
use std::collections::HashMap;
use std::sync::Arc;

/// The most rows one multi-row statement of a batch's claim holds (six placeholders a row:
/// well under MySQL's 65,535 and SQLite's 32,766).
const ROWS_PER_STATEMENT: usize = 512;

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

/// A batch's claims in key order (by bytes): the order every store's batch claim locks its
/// keys in, so that two batches sharing keys wait for each other instead of deadlocking.
pub(crate) fn in_key_order<'r, 'a>(requests: &'r [ClaimRequest<'a>]) -> Vec<&'r ClaimRequest<'a>> {
    let mut sorted: Vec<&ClaimRequest<'a>> = requests.iter().collect();
    sorted.sort_unstable_by_key(|r| r.key);
    sorted
}

/// Claims a batch's distinct keys with two statements per [`ROWS_PER_STATEMENT`] keys (see
/// [`RowStatements`]): the markers inserted in key order (two batches sharing keys lock them
/// in the same order), each naming this claim's token; then every key read, the rows with
/// the token being the ones this claim inserted. Answers in `requests`' order.
///
/// A statement's row count is rounded up to a power of two by repeating its last row (a
/// repeated key is skipped like any existing one), so a dialect's statement cache holds a
/// handful of texts whatever the batch sizes.
pub(crate) async fn claim_rows<DB: Sql>(
    rows: &RowStatements<Arc<str>>,
    conn: &mut DB::Connection,
    requests: &[ClaimRequest<'_>],
) -> Result<Vec<Claim>, StoreError> {
    let fail = |e| store_error("claim", e);
    let token = owner_token();
    let sorted = in_key_order(requests);
    let retention: Vec<i64> = sorted
        .iter()
        .map(|r| crate::config::secs(r.retention))
        .collect();
    for (chunk, retention) in sorted
        .chunks(ROWS_PER_STATEMENT)
        .zip(retention.chunks(ROWS_PER_STATEMENT))
    {
        let count = chunk.len().next_power_of_two();
        let mut params = Vec::with_capacity(count * 6);
        for n in 0..count {
            let last = chunk.len() - 1;
            let (request, retention) = (chunk[n.min(last)], retention[n.min(last)]);
            params.extend([
                Param::Text(request.consumer),
                Param::Text(request.key),
                Param::Bytes(request.fingerprint.as_bytes()),
                Param::Int(i64::from(request.attempt)),
                Param::Int(retention),
                Param::Text(&token),
            ]);
        }
        let text = statement(&rows.insert, &rows.row, ", ", count, &rows.insert_end);
        DB::execute(conn, &text, &params).await.map_err(fail)?;
    }
    let mut found: HashMap<String, Claim> = HashMap::with_capacity(requests.len());
    for chunk in sorted.chunks(ROWS_PER_STATEMENT) {
        let count = chunk.len().next_power_of_two();
        let consumer = chunk.first().map_or("", |r| r.consumer);
        let mut params = vec![Param::Text(&token), Param::Text(consumer)];
        params.extend((0..count).map(|n| Param::Text(chunk[n.min(chunk.len() - 1)].key)));
        let text = statement(&rows.read, "?", ", ", count, &rows.read_end);
        for row in DB::fetch_all(conn, &text, &params).await.map_err(fail)? {
            let key = DB::text(&row, "key").map_err(fail)?;
            let claim = if DB::int(&row, "ours").map_err(fail)? == 1 {
                Claim::Claimed
            } else {
                let fingerprint = DB::bytes(&row, "fingerprint").map_err(fail)?;
                existing_claim(
                    &fingerprint,
                    DB::optional_text(&row, "outcome").map_err(fail)?,
                )?
            };
            found.insert(key, claim);
        }
    }
    requests
        .iter()
        .map(|request| {
            found.remove(request.key).ok_or_else(|| {
                // Swept between the insert and the read, or a key given twice; a retry claims.
                StoreError::new(
                    "claim",
                    ErrorClass::Transient,
                    "a key's row was not found after the batch's claim",
                )
            })
        })
        .collect()
}

/// `head`, then `count` times `item` separated by `separator`, then `tail`.
fn statement(head: &str, item: &str, separator: &str, count: usize, tail: &str) -> Arc<str> {
    let mut text = String::with_capacity(head.len() + count * (item.len() + 2) + tail.len());
    text.push_str(head);
    for n in 0..count {
        if n > 0 {
            text.push_str(separator);
        }
        text.push_str(item);
    }
    text.push_str(tail);
    text.into()
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
