//! Running idem's statements on any sqlx database: sqlx's per-type bounds (the executor, the
//! parameter and column types the inbox uses) are written once, on the blanket impl of
//! [`Sql`], so the code every dialect shares is plain generic code over `DB: Dialect`.

use sqlx::database::Database;
use sqlx::{AssertSqlSafe, ColumnIndex, Decode, Encode, Executor, IntoArguments, Row, Type};
use std::future::Future;
use std::sync::Arc;

/// One bind parameter of an inbox statement.
#[derive(Debug, Clone, Copy)]
pub enum Param<'a> {
    /// Text: a consumer, a key, a status, a stored result, a lease owner.
    Text(&'a str),
    /// Bytes: a fingerprint.
    Bytes(&'a [u8]),
    /// A 64-bit integer: seconds, milliseconds, a batch size.
    Int(i64),
    /// A 32-bit integer: an attempt count, a schema version.
    Int32(i32),
}

/// The number of rows a statement changed, which sqlx reports per driver.
pub trait RowsAffected {
    /// Rows inserted, updated or deleted.
    fn rows_affected(&self) -> u64;
}

/// A sqlx database that can run idem's statements. Implemented for every database whose
/// driver encodes and decodes the types the inbox uses; the dialects are in
/// [`crate::dialect::Dialect`].
pub trait Sql: Database {
    /// Runs `sql` with `params` on `conn`; the rows it changed.
    fn execute<'a>(
        conn: &'a mut Self::Connection,
        sql: &Arc<str>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a;

    /// Runs `sql`, which may hold several statements, without parameters.
    fn execute_raw<'a>(
        conn: &'a mut Self::Connection,
        sql: &'static str,
    ) -> impl Future<Output = Result<(), sqlx::Error>> + Send + 'a;

    /// Runs `sql` with `params` on `conn`; its first row, if any.
    fn fetch_optional<'a>(
        conn: &'a mut Self::Connection,
        sql: &Arc<str>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Option<Self::Row>, sqlx::Error>> + Send + 'a;

    /// Runs `sql` with `params` on `conn`; all its rows.
    fn fetch_all<'a>(
        conn: &'a mut Self::Connection,
        sql: &Arc<str>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Vec<Self::Row>, sqlx::Error>> + Send + 'a;

    /// Runs `sql` with `params` on `conn`; the integer in the first column of its one row.
    fn fetch_int<'a>(
        conn: &'a mut Self::Connection,
        sql: &Arc<str>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a;

    /// Column `column` of `row`, as text.
    fn text(row: &Self::Row, column: &str) -> Result<String, sqlx::Error>;

    /// Column `column` of `row`, as text or `NULL`.
    fn optional_text(row: &Self::Row, column: &str) -> Result<Option<String>, sqlx::Error>;

    /// Column `column` of `row`, as bytes.
    fn bytes(row: &Self::Row, column: &str) -> Result<Vec<u8>, sqlx::Error>;

    /// Column `column` of `row`, as a 64-bit integer.
    fn int(row: &Self::Row, column: &str) -> Result<i64, sqlx::Error>;

    /// Column `column` of `row`, as a 64-bit integer or `NULL`.
    fn int_opt(row: &Self::Row, column: &str) -> Result<Option<i64>, sqlx::Error>;

    /// Column `column` of `row`, as a 32-bit integer.
    fn int32(row: &Self::Row, column: &str) -> Result<i32, sqlx::Error>;
}

impl<DB> Sql for DB
where
    DB: Database,
    DB::QueryResult: RowsAffected,
    DB::Arguments: IntoArguments<DB>,
    for<'c> &'c mut DB::Connection: Executor<'c, Database = DB>,
    for<'q> &'q str: Encode<'q, DB> + Type<DB>,
    for<'q> &'q [u8]: Encode<'q, DB> + Type<DB>,
    i64: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    i32: for<'q> Encode<'q, DB> + for<'r> Decode<'r, DB> + Type<DB>,
    String: for<'r> Decode<'r, DB> + Type<DB>,
    Vec<u8>: for<'r> Decode<'r, DB> + Type<DB>,
    usize: ColumnIndex<DB::Row>,
    for<'s> &'s str: ColumnIndex<DB::Row>,
{
    fn execute<'a>(
        conn: &'a mut DB::Connection,
        sql: &Arc<str>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<u64, sqlx::Error>> + Send + 'a {
        let query = query::<DB>(sql, params);
        async move { Ok(query.execute(conn).await?.rows_affected()) }
    }

    async fn execute_raw(conn: &mut DB::Connection, sql: &'static str) -> Result<(), sqlx::Error> {
        sqlx::raw_sql(sql).execute(conn).await.map(drop)
    }

    fn fetch_optional<'a>(
        conn: &'a mut DB::Connection,
        sql: &Arc<str>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Option<DB::Row>, sqlx::Error>> + Send + 'a {
        let query = query::<DB>(sql, params);
        async move { query.fetch_optional(conn).await }
    }

    fn fetch_all<'a>(
        conn: &'a mut DB::Connection,
        sql: &Arc<str>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<Vec<DB::Row>, sqlx::Error>> + Send + 'a {
        let query = query::<DB>(sql, params);
        async move { query.fetch_all(conn).await }
    }

    fn fetch_int<'a>(
        conn: &'a mut DB::Connection,
        sql: &Arc<str>,
        params: &[Param<'_>],
    ) -> impl Future<Output = Result<i64, sqlx::Error>> + Send + 'a {
        let query = query::<DB>(sql, params);
        async move { query.fetch_one(conn).await?.try_get(0usize) }
    }

    fn text(row: &DB::Row, column: &str) -> Result<String, sqlx::Error> {
        row.try_get(column)
    }

    fn optional_text(row: &DB::Row, column: &str) -> Result<Option<String>, sqlx::Error> {
        row.try_get(column)
    }

    fn bytes(row: &DB::Row, column: &str) -> Result<Vec<u8>, sqlx::Error> {
        row.try_get(column)
    }

    fn int(row: &DB::Row, column: &str) -> Result<i64, sqlx::Error> {
        row.try_get(column)
    }

    fn int_opt(row: &DB::Row, column: &str) -> Result<Option<i64>, sqlx::Error> {
        row.try_get(column)
    }

    fn int32(row: &DB::Row, column: &str) -> Result<i32, sqlx::Error> {
        row.try_get(column)
    }
}

/// `sql` with `params` bound, in order.
fn query<'q, DB>(sql: &Arc<str>, params: &[Param<'_>]) -> sqlx::query::Query<'q, DB, DB::Arguments>
where
    DB: Database,
    for<'p> &'p str: Encode<'p, DB> + Type<DB>,
    for<'p> &'p [u8]: Encode<'p, DB> + Type<DB>,
    i64: for<'p> Encode<'p, DB> + Type<DB>,
    i32: for<'p> Encode<'p, DB> + Type<DB>,
{
    // The table name in the text is a validated identifier (see `TableName`).
    let query = sqlx::query(AssertSqlSafe(sql.clone()));
    params.iter().fold(query, |query, param| match *param {
        Param::Text(value) => query.bind(value),
        Param::Bytes(value) => query.bind(value),
        Param::Int(value) => query.bind(value),
        Param::Int32(value) => query.bind(value),
    })
}
