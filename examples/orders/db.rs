//! The example's database: connecting (SQLite, PostgreSQL or MySQL/MariaDB), its tables, and
//! the queries the demo checks its results with.

use crate::{handlers, shipping, status};
use anyhow::Context as _;
use idem::sql::{MySqlInbox, PgInbox, SqliteInbox};
use idem::sqlx;
use idem::telemetry::redact_url;

/// The database holding the inbox and the orders.
pub enum Db {
    /// The embedded default.
    Sqlite(sqlx::SqlitePool),
    /// A PostgreSQL server.
    Postgres(sqlx::PgPool),
    /// A MySQL or MariaDB server.
    MySql(sqlx::MySqlPool),
}

impl Db {
    /// Connects, creates the example's tables and migrates the inbox.
    pub async fn connect(url: &str, concurrency: usize) -> anyhow::Result<Self> {
        if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let options = idem::sql::urls::postgres_options(url).with_context(|| {
                format!("DATABASE_URL ({}) is not a PostgreSQL URL", redact_url(url))
            })?;
            let pool = sqlx::postgres::PgPoolOptions::new()
                .max_connections(u32::try_from(2 * concurrency + 2).unwrap_or(u32::MAX))
                .connect_with(options)
                .await
                .with_context(|| {
                    format!(
                        "cannot connect to PostgreSQL at DATABASE_URL ({})",
                        redact_url(url)
                    )
                })?;
            let mut tx = pool.begin().await?;
            sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.orders.schema'))::text")
                .execute(&mut *tx)
                .await?;
            for statement in handlers::SCHEMA
                .iter()
                .chain(&shipping::SCHEMA)
                .chain(&status::POSTGRES_SCHEMA)
            {
                sqlx::query(*statement).execute(&mut *tx).await?;
            }
            tx.commit().await?;
            PgInbox::new(pool.clone()).migrate().await?;
            Ok(Self::Postgres(pool))
        } else if url.starts_with("mysql://") || url.starts_with("mariadb://") {
            let url = url.replacen("mariadb://", "mysql://", 1);
            let pool = sqlx::mysql::MySqlPoolOptions::new()
                .max_connections(u32::try_from(2 * concurrency + 2).unwrap_or(u32::MAX))
                .connect(&url)
                .await
                .with_context(|| {
                    format!(
                        "cannot connect to MySQL/MariaDB at DATABASE_URL ({})",
                        redact_url(&url)
                    )
                })?;
            // MySQL runs DDL outside transactions; IF NOT EXISTS makes concurrent starts safe.
            for statement in handlers::MYSQL_SCHEMA
                .iter()
                .chain(&shipping::MYSQL_SCHEMA)
                .chain(&status::MYSQL_SCHEMA)
            {
                sqlx::query(*statement).execute(&pool).await?;
            }
            MySqlInbox::new(pool.clone()).migrate().await?;
            Ok(Self::MySql(pool))
        } else if url.starts_with("sqlite:") || !url.contains("://") {
            let pool = idem::sql::sqlite::pool(url)
                .await
                .with_context(|| format!("cannot open SQLite database DATABASE_URL ({url})"))?;
            SqliteInbox::new(pool.clone()).migrate().await?;
            for statement in handlers::SCHEMA
                .iter()
                .chain(&shipping::SCHEMA)
                .chain(&status::SQLITE_SCHEMA)
            {
                sqlx::query(*statement).execute(&pool).await?;
            }
            Ok(Self::Sqlite(pool))
        } else {
            anyhow::bail!(
                "DATABASE_URL must be a sqlite: URL, a file path, a postgres:// or a mysql:// URL, got {}",
                redact_url(url)
            )
        }
    }

    /// Per order whose id starts with `prefix`: its status row (status, version) and the
    /// versions its status handler applied, in the order applied.
    pub async fn statuses(&self, prefix: &str) -> anyhow::Result<Statuses> {
        const CURRENT: &str =
            "SELECT order_id, status, version FROM order_status WHERE order_id LIKE $1";
        const LOG: &str =
            "SELECT order_id, version FROM status_log WHERE order_id LIKE $1 ORDER BY id";
        const MYSQL_CURRENT: &str =
            "SELECT order_id, status, version FROM order_status WHERE order_id LIKE ?";
        const MYSQL_LOG: &str =
            "SELECT order_id, version FROM status_log WHERE order_id LIKE ? ORDER BY id";
        let like = format!("{prefix}%");
        type Current = Vec<(String, String, i64)>;
        type Log = Vec<(String, i64)>;
        let (current, log): (Current, Log) = match self {
            Self::Sqlite(pool) => (
                sqlx::query_as(CURRENT).bind(&like).fetch_all(pool).await?,
                sqlx::query_as(LOG).bind(&like).fetch_all(pool).await?,
            ),
            Self::Postgres(pool) => (
                sqlx::query_as(CURRENT).bind(&like).fetch_all(pool).await?,
                sqlx::query_as(LOG).bind(&like).fetch_all(pool).await?,
            ),
            Self::MySql(pool) => (
                sqlx::query_as(MYSQL_CURRENT)
                    .bind(&like)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_as(MYSQL_LOG)
                    .bind(&like)
                    .fetch_all(pool)
                    .await?,
            ),
        };
        let mut statuses = Statuses::default();
        for (order, status, version) in current {
            statuses.current.insert(order, (status, version));
        }
        for (order, version) in log {
            statuses.applied.entry(order).or_default().push(version);
        }
        Ok(statuses)
    }

    /// Each balance whose customer starts with `prefix`, and the number of orders whose id does.
    pub async fn books(
        &self,
        customer_prefix: &str,
        order_prefix: &str,
    ) -> anyhow::Result<(Vec<(String, i64)>, i64)> {
        const BALANCES: &str = "SELECT customer, cents FROM balances WHERE customer LIKE $1";
        const ORDERS: &str = "SELECT count(*) FROM orders WHERE order_id LIKE $1";
        const MYSQL_BALANCES: &str = "SELECT customer, cents FROM balances WHERE customer LIKE ?";
        const MYSQL_ORDERS: &str = "SELECT count(*) FROM orders WHERE order_id LIKE ?";
        let (customers, orders) = (format!("{customer_prefix}%"), format!("{order_prefix}%"));
        Ok(match self {
            Self::Sqlite(pool) => (
                sqlx::query_as(BALANCES)
                    .bind(&customers)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_scalar(ORDERS)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
            ),
            Self::Postgres(pool) => (
                sqlx::query_as(BALANCES)
                    .bind(&customers)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_scalar(ORDERS)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
            ),
            Self::MySql(pool) => (
                sqlx::query_as(MYSQL_BALANCES)
                    .bind(&customers)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_scalar(MYSQL_ORDERS)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
            ),
        })
    }
}

impl Db {
    /// The ledger's rows of the orders whose id starts with `order_prefix`, as (order id,
    /// cents), sorted: one per booking of an order, so an order booked twice is there twice.
    pub async fn ledger(&self, order_prefix: &str) -> anyhow::Result<Vec<(String, i64)>> {
        const LEDGER: &str = "SELECT order_id, cents FROM ledger WHERE order_id LIKE $1";
        const MYSQL_LEDGER: &str = "SELECT order_id, cents FROM ledger WHERE order_id LIKE ?";
        let orders = format!("{order_prefix}%");
        let mut rows: Vec<(String, i64)> = match self {
            Self::Sqlite(pool) => sqlx::query_as(LEDGER).bind(&orders).fetch_all(pool).await?,
            Self::Postgres(pool) => sqlx::query_as(LEDGER).bind(&orders).fetch_all(pool).await?,
            Self::MySql(pool) => {
                sqlx::query_as(MYSQL_LEDGER)
                    .bind(&orders)
                    .fetch_all(pool)
                    .await?
            }
        };
        rows.sort_unstable();
        Ok(rows)
    }
}

/// The second hop's books: shipments, parcels per customer, outbox rows not yet published.
#[derive(Debug, Default)]
pub struct Shipping {
    /// Shipments of orders whose id starts with the prefix.
    pub shipments: i64,
    /// The shipment log's order ids starting with the prefix, sorted: one per shipment made,
    /// so an order shipped twice is there twice.
    pub log: Vec<String>,
    /// Per customer starting with the prefix: parcels counted.
    pub parcels: std::collections::BTreeMap<String, i64>,
    /// Outbox rows whose run key starts with the order prefix, not yet published.
    pub unpublished: i64,
}

impl Db {
    /// The second hop's books for orders starting with `order_prefix` and customers starting
    /// with `customer_prefix`.
    pub async fn shipping(
        &self,
        customer_prefix: &str,
        order_prefix: &str,
    ) -> anyhow::Result<Shipping> {
        const SHIPMENTS: &str = "SELECT count(*) FROM shipments WHERE order_id LIKE $1";
        const PARCELS: &str = "SELECT customer, n FROM parcels WHERE customer LIKE $1";
        const OUTBOX: &str = "SELECT count(*) FROM idem_outbox WHERE key LIKE $1";
        const MYSQL_SHIPMENTS: &str = "SELECT count(*) FROM shipments WHERE order_id LIKE ?";
        const MYSQL_PARCELS: &str = "SELECT customer, n FROM parcels WHERE customer LIKE ?";
        const MYSQL_OUTBOX: &str = "SELECT count(*) FROM idem_outbox WHERE `key` LIKE ?";
        const LOG: &str = "SELECT order_id FROM shipment_log WHERE order_id LIKE $1";
        const MYSQL_LOG: &str = "SELECT order_id FROM shipment_log WHERE order_id LIKE ?";
        let (customers, orders) = (format!("{customer_prefix}%"), format!("{order_prefix}%"));
        let (shipments, parcels, unpublished): (i64, Vec<(String, i64)>, i64) = match self {
            Self::Sqlite(pool) => (
                sqlx::query_scalar(SHIPMENTS)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
                sqlx::query_as(PARCELS)
                    .bind(&customers)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_scalar(OUTBOX)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
            ),
            Self::Postgres(pool) => (
                sqlx::query_scalar(SHIPMENTS)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
                sqlx::query_as(PARCELS)
                    .bind(&customers)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_scalar(OUTBOX)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
            ),
            Self::MySql(pool) => (
                sqlx::query_scalar(MYSQL_SHIPMENTS)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
                sqlx::query_as(MYSQL_PARCELS)
                    .bind(&customers)
                    .fetch_all(pool)
                    .await?,
                sqlx::query_scalar(MYSQL_OUTBOX)
                    .bind(&orders)
                    .fetch_one(pool)
                    .await?,
            ),
        };
        let mut log: Vec<String> = match self {
            Self::Sqlite(pool) => {
                sqlx::query_scalar(LOG)
                    .bind(&orders)
                    .fetch_all(pool)
                    .await?
            }
            Self::Postgres(pool) => {
                sqlx::query_scalar(LOG)
                    .bind(&orders)
                    .fetch_all(pool)
                    .await?
            }
            Self::MySql(pool) => {
                sqlx::query_scalar(MYSQL_LOG)
                    .bind(&orders)
                    .fetch_all(pool)
                    .await?
            }
        };
        log.sort_unstable();
        Ok(Shipping {
            shipments,
            log,
            parcels: parcels.into_iter().collect(),
            unpublished,
        })
    }
}

/// The orders' status rows and the versions applied to them, in the order applied.
#[derive(Debug, Default)]
pub struct Statuses {
    /// Per order: its status and version.
    pub current: std::collections::HashMap<String, (String, i64)>,
    /// Per order: the versions applied, in the order applied.
    pub applied: std::collections::HashMap<String, Vec<i64>>,
}
