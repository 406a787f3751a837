//! Entity versions (`{table}_versions`, one row per consumer and entity): the highest version
//! applied, raised in the handler's transaction so that a stale message is never applied.
//! Each dialect's statements are here; one row per entity is kept for good (a row swept would
//! let a late, older message apply).

use crate::error::store_error;
use crate::exec::{Param, Sql};
use crate::statements::{Prepared, VersionStatements};
use idem_core::model::StoreError;

/// PostgreSQL: one upsert that raises the version only upwards; the row it conflicts on is
/// locked, so the read after a stale answer sees the latest committed version.
#[cfg(feature = "postgres")]
pub(crate) const POSTGRES: VersionStatements = VersionStatements {
    advance: r#"INSERT INTO "{table}_versions" AS v (consumer, entity, version, updated_at)
    VALUES ($1, $2, $3, now())
    ON CONFLICT (consumer, entity) DO UPDATE SET version = excluded.version,
        updated_at = excluded.updated_at
    WHERE v.version < excluded.version"#,
    insert: None,
    read: r#"SELECT version FROM "{table}_versions" WHERE consumer = $1 AND entity = $2"#,
};

/// SQLite: the same upsert (the transaction holds the write lock since `BEGIN IMMEDIATE`).
#[cfg(feature = "sqlite")]
pub(crate) const SQLITE: VersionStatements = VersionStatements {
    advance: r#"INSERT INTO "{table}_versions" (consumer, entity, version, updated_at)
    VALUES (?1, ?2, ?3, {now})
    ON CONFLICT (consumer, entity) DO UPDATE SET version = excluded.version,
        updated_at = excluded.updated_at
    WHERE version < excluded.version"#,
    insert: None,
    read: r#"SELECT version FROM "{table}_versions" WHERE consumer = ?1 AND entity = ?2"#,
};

/// MySQL and MariaDB: sqlx reports matched rather than changed rows, so an upsert cannot tell
/// an insert from an unchanged row. A conditional update (a locking read of the latest row)
/// raises an existing version; when it matched nothing, an insert creates the first one; when
/// that inserted nothing either, the message is stale.
#[cfg(feature = "mysql")]
pub(crate) const MYSQL: VersionStatements = VersionStatements {
    advance: r#"UPDATE `{table}_versions` v
    JOIN (SELECT ? AS consumer, ? AS entity, ? AS version) m
        ON v.consumer = m.consumer AND v.entity = m.entity AND v.version < m.version
    SET v.version = m.version, v.updated_at = UTC_TIMESTAMP(6)"#,
    insert: Some(
        r#"INSERT IGNORE INTO `{table}_versions` (consumer, entity, version, updated_at)
    VALUES (?, ?, ?, UTC_TIMESTAMP(6))"#,
    ),
    read: r#"SELECT version FROM `{table}_versions` WHERE consumer = ? AND entity = ? FOR UPDATE"#,
};

/// Raises `entity`'s version for `consumer` to `version` in the transaction on `conn`, unless
/// it is at or above it already: `None` when raised (or first seen), else the applied version.
pub(crate) async fn advance<DB: Sql>(
    sql: &Prepared,
    conn: &mut DB::Connection,
    consumer: &str,
    entity: &str,
    version: i64,
) -> Result<Option<i64>, StoreError> {
    let fail = |e| store_error("advance version", e);
    let statements = &sql.versions;
    let params = [
        Param::Text(consumer),
        Param::Text(entity),
        Param::Int(version),
    ];
    if DB::execute(conn, &statements.advance, &params)
        .await
        .map_err(fail)?
        == 1
    {
        return Ok(None);
    }
    if let Some(insert) = &statements.insert
        && DB::execute(conn, insert, &params).await.map_err(fail)? == 1
    {
        return Ok(None);
    }
    let key = [Param::Text(consumer), Param::Text(entity)];
    let applied = DB::fetch_int(conn, &statements.read, &key)
        .await
        .map_err(fail)?;
    Ok(Some(applied))
}
