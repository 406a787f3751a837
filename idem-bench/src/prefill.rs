//! A full inbox before the runs (`--prefill N`): N rows of realistic keys in the inbox table
//! of every consumer measured, written set-based in chunks, their arrival times spread over
//! the retention window; and, for `--sweep`, a day's worth of expired rows for the sweepers to
//! delete while the consumers run.

use crate::with_idem;
use crate::workload::Keys;
use anyhow::Context as _;
use sqlx::PgPool;
use std::time::Instant;

/// The retention window of every inbox (idem's default): prefilled rows expire within it.
pub const RETENTION_DAYS: u32 = 7;

/// Rows written per statement.
const CHUNK: u64 = 1_000_000;

/// Where a consumer keeps its dedup markers, and what a row of it holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InboxTable {
    /// `bench_inbox`: the key alone (no retention is possible).
    Bare,
    /// `bench_lean_inbox`: the key and its arrival time (indexed, for removing old rows).
    Lean,
    /// `bench_full_inbox`: idem's own row, written by hand.
    Full,
    /// idem's inbox ([`with_idem::TABLE`]).
    Idem,
}

impl InboxTable {
    /// The table's name.
    pub fn name(self) -> &'static str {
        match self {
            Self::Bare => "bench_inbox",
            Self::Lean => "bench_lean_inbox",
            Self::Full => "bench_full_inbox",
            Self::Idem => with_idem::TABLE,
        }
    }

    /// The consumer the table's rows are claimed for.
    pub fn consumer(self) -> &'static str {
        match self {
            Self::Idem => with_idem::CONSUMER,
            _ => crate::handwritten::CONSUMER,
        }
    }

    /// Whether its rows expire (a sweeper can delete old ones).
    pub fn retained(self) -> bool {
        self != Self::Bare
    }

    /// The condition of an expired row.
    fn expired(self) -> String {
        match self {
            Self::Lean => format!("received_at < now() - interval '{RETENTION_DAYS} days'"),
            _ => "expires_at < now()".to_owned(),
        }
    }

    /// The column expired rows are deleted in the order of.
    fn age_column(self) -> &'static str {
        match self {
            Self::Lean => "received_at",
            _ => "expires_at",
        }
    }

    /// The sweeper's statement: at most `$1` expired rows, oldest first, by physical address
    /// (idem's own PostgreSQL sweep statement, on this table).
    pub fn sweep_statement(self) -> String {
        let (table, expired, age) = (self.name(), self.expired(), self.age_column());
        format!(
            r#"DELETE FROM "{table}" WHERE ctid = ANY(ARRAY(
            SELECT ctid FROM "{table}" WHERE {expired}
            ORDER BY {age} LIMIT $1 FOR UPDATE SKIP LOCKED))"#
        )
    }

    /// Inserts `$2` rows for consumer `$1`, numbered from `$3` (the sequential keys' numbers),
    /// created at `created` (an SQL expression of a row's arrival time), in the order of their
    /// arrival: the table's pages hold rows that arrived together, as an inbox's do.
    fn insert(self, keys: Keys, created: &str) -> String {
        let key = match keys {
            Keys::Sequential => "'prefill-' || lpad(c.n::text, 10, '0')",
            Keys::Uuid4 => "gen_random_uuid()::text",
            // 48 bits of the arrival's milliseconds, version 7, the variant, random bits.
            Keys::Uuid7 => {
                "substr(u.h, 1, 8) || '-' || substr(u.h, 9, 4) || '-7' || substr(u.r, 1, 3) || '-'
                 || substr('89ab', 1 + (get_byte(decode(substr(u.r, 4, 2), 'hex'), 0) % 4), 1)
                 || substr(u.r, 6, 3) || '-' || substr(u.r, 9, 12)"
            }
        };
        let rows = format!(
            "SELECT c.n, c.created, {key} AS key
             FROM (SELECT n, {created} AS created FROM generate_series($3::int8, $3::int8 + $2 - 1) AS n
                   ORDER BY created) c
             CROSS JOIN LATERAL (SELECT lpad(to_hex((extract(epoch FROM c.created) * 1000)::int8), 12, '0') AS h,
                                        md5(random()::text || c.n::text) AS r) u"
        );
        let table = self.name();
        match self {
            Self::Bare => format!(
                r#"INSERT INTO "{table}" (consumer, key) SELECT $1, k.key FROM ({rows}) k ON CONFLICT DO NOTHING"#
            ),
            Self::Lean => format!(
                r#"INSERT INTO "{table}" (consumer, key, received_at) SELECT $1, k.key, k.created FROM ({rows}) k ON CONFLICT DO NOTHING"#
            ),
            Self::Full | Self::Idem => format!(
                r#"INSERT INTO "{table}" (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at)
                SELECT $1, k.key, sha256(convert_to(k.key, 'UTF8')), 'completed', 1, k.created, k.created,
                       k.created + interval '{RETENTION_DAYS} days'
                FROM ({rows}) k ON CONFLICT DO NOTHING"#
            ),
        }
    }

    /// Adds `rows` live rows (arrived within the retention window, spread evenly at random),
    /// the first numbered `from`. Returns the rows written.
    pub async fn fill(
        self,
        pool: &PgPool,
        keys: Keys,
        from: u64,
        rows: u64,
    ) -> anyhow::Result<u64> {
        let live = format!("now() - random() * interval '{RETENTION_DAYS} days'");
        self.write(pool, &self.insert(keys, &live), from, rows)
            .await
    }

    /// Adds `rows` rows that expired within the last day, the first numbered `from`.
    pub async fn fill_expired(
        self,
        pool: &PgPool,
        keys: Keys,
        from: u64,
        rows: u64,
    ) -> anyhow::Result<u64> {
        let expired = format!(
            "now() - interval '{RETENTION_DAYS} days' - interval '1 second' - random() * interval '1 day'"
        );
        self.write(pool, &self.insert(keys, &expired), from, rows)
            .await
    }

    async fn write(self, pool: &PgPool, insert: &str, from: u64, rows: u64) -> anyhow::Result<u64> {
        let started = Instant::now();
        let mut written = 0;
        while written < rows {
            let chunk = CHUNK.min(rows - written);
            sqlx::query(sqlx::AssertSqlSafe(insert))
                .bind(self.consumer())
                .bind(chunk as i64)
                .bind((from + written) as i64)
                .execute(pool)
                .await
                .with_context(|| format!("filling {}", self.name()))?;
            written += chunk;
            eprintln!(
                "  {}: {written} of {rows} rows written ({:.0} s)",
                self.name(),
                started.elapsed().as_secs_f64()
            );
        }
        Ok(written)
    }

    /// The expired rows the table holds.
    pub async fn expired_rows(self, pool: &PgPool) -> anyhow::Result<i64> {
        let count = format!(
            r#"SELECT count(*) FROM "{}" WHERE {}"#,
            self.name(),
            self.expired()
        );
        Ok(sqlx::query_scalar(sqlx::AssertSqlSafe(count))
            .fetch_one(pool)
            .await?)
    }

    /// Deletes the rows of `keys` (what a run claimed), leaving the prefilled ones.
    pub async fn forget(self, pool: &PgPool, keys: &[String]) -> anyhow::Result<()> {
        let delete = format!(
            r#"DELETE FROM "{}" WHERE consumer = $1 AND key = ANY($2::text[])"#,
            self.name()
        );
        sqlx::query(sqlx::AssertSqlSafe(delete))
            .bind(self.consumer())
            .bind(keys)
            .execute(pool)
            .await?;
        Ok(())
    }

    /// The consumer's rows in the table, and the expired ones among them deleted first (what
    /// an earlier `--sweep` left).
    pub async fn live_rows(self, pool: &PgPool) -> anyhow::Result<u64> {
        let statement = self.sweep_statement();
        while sqlx::query(sqlx::AssertSqlSafe(statement.as_str()))
            .bind(100_000_i64)
            .execute(pool)
            .await?
            .rows_affected()
            > 0
        {}
        let count = format!(
            r#"SELECT count(*) FROM "{}" WHERE consumer = $1"#,
            self.name()
        );
        let rows: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(count))
            .bind(self.consumer())
            .fetch_one(pool)
            .await?;
        Ok(rows as u64)
    }

    /// Empties the table.
    pub async fn empty(self, pool: &PgPool) -> anyhow::Result<()> {
        let truncate = format!(r#"TRUNCATE "{}""#, self.name());
        sqlx::raw_sql(sqlx::AssertSqlSafe(truncate))
            .execute(pool)
            .await?;
        Ok(())
    }

    /// `VACUUM ANALYZE`: the state autovacuum leaves a table in after a bulk load.
    pub async fn vacuum(self, pool: &PgPool) -> anyhow::Result<()> {
        let vacuum = format!(r#"VACUUM ANALYZE "{}""#, self.name());
        sqlx::raw_sql(sqlx::AssertSqlSafe(vacuum))
            .execute(pool)
            .await?;
        Ok(())
    }
}

/// Deletes expired rows of `table` with its sweep statement as idem's sweeper does (passes of
/// at most 1,000 batches of 1,000 rows, a pass a minute, after each full batch a pause of
/// `pause` times its time), until the process exits.
pub async fn sweep_forever(pool: PgPool, table: InboxTable, pause: u32) {
    let statement = table.sweep_statement();
    loop {
        for _ in 0..1_000 {
            let started = Instant::now();
            match sqlx::query(sqlx::AssertSqlSafe(statement.as_str()))
                .bind(1_000_i64)
                .execute(&pool)
                .await
            {
                Ok(done) if done.rows_affected() == 1_000 => {
                    tokio::time::sleep(started.elapsed() * pause).await;
                }
                Ok(_) => break,
                Err(e) => {
                    tracing::warn!(error = %e, "sweeping failed");
                    break;
                }
            }
        }
        tokio::time::sleep(std::time::Duration::from_secs(60)).await;
    }
}

/// The server's `autovacuum` while the benchmark runs, restored afterwards.
pub struct Autovacuum {
    pool: PgPool,
    /// The `ALTER SYSTEM` statement that restores the setting.
    restore: Option<String>,
}

impl Autovacuum {
    /// Turns autovacuum `on` or `off` for the benchmark's duration (`None`: as configured).
    /// Returns the guard and the setting the runs see.
    pub async fn set(pool: &PgPool, on: Option<bool>) -> anyhow::Result<(Self, bool)> {
        let (value, file): (String, Option<String>) =
            sqlx::query_as("SELECT setting, sourcefile FROM pg_settings WHERE name = 'autovacuum'")
                .fetch_one(pool)
                .await?;
        let current = value == "on";
        let mut guard = Self {
            pool: pool.clone(),
            restore: None,
        };
        let Some(wanted) = on.filter(|wanted| *wanted != current) else {
            return Ok((guard, current));
        };
        let set = format!(
            "ALTER SYSTEM SET autovacuum = {}",
            if wanted { "on" } else { "off" }
        );
        sqlx::raw_sql(sqlx::AssertSqlSafe(set))
            .execute(pool)
            .await
            .context("setting autovacuum needs a superuser; or run with --autovacuum server")?;
        sqlx::raw_sql("SELECT pg_reload_conf()")
            .execute(pool)
            .await?;
        guard.restore = Some(
            match file.is_some_and(|file| file.ends_with("postgresql.auto.conf")) {
                true => format!("ALTER SYSTEM SET autovacuum = {value}"),
                false => "ALTER SYSTEM RESET autovacuum".to_owned(),
            },
        );
        Ok((guard, wanted))
    }

    /// Restores the server's setting.
    pub async fn restore(mut self) -> anyhow::Result<()> {
        if let Some(restore) = self.restore.take() {
            sqlx::raw_sql(sqlx::AssertSqlSafe(restore))
                .execute(&self.pool)
                .await?;
            sqlx::raw_sql("SELECT pg_reload_conf()")
                .execute(&self.pool)
                .await?;
        }
        Ok(())
    }
}
