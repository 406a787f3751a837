//! Odd keys through the user's path: `orders consume` (real processes, a real broker) on
//! PostgreSQL and MariaDB, one message at a time and in batches of 50, gets 100 good orders
//! around odd ones: an order id with a NUL byte, one of 250 characters, and two that differ
//! only in a trailing space. Every good order is applied once; every odd one is applied once,
//! or (where the example's own table refuses it: PostgreSQL's `text` holds no NUL) dead-lettered
//! once with its record; nothing goes round again, and the queue drains.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::{self, amqp_url};
use common::watched::{self, Watched};
use common::{orders_example, unique};
use std::process::Command;
use std::time::Duration;

const DEADLINE: Duration = Duration::from_secs(90);

/// The database of one probe, of the example's own.
enum Db {
    Postgres(common::OwnSchema),
    MariaDb {
        pool: sqlx::MySqlPool,
        name: String,
        url: String,
    },
}

impl Db {
    async fn postgres() -> Self {
        Self::Postgres(common::OwnSchema::create("idem_odd", 2).await)
    }

    async fn mariadb() -> Self {
        let name = unique("idem_odd").replace('-', "_");
        let server = common::mysql(1).await;
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&server)
            .await
            .unwrap();
        let base = common::mysql_url();
        let url = format!("{}/{name}", base.rsplit_once('/').unwrap().0);
        let pool = sqlx::mysql::MySqlPoolOptions::new()
            .max_connections(2)
            .connect(&url)
            .await
            .unwrap();
        Self::MariaDb { pool, name, url }
    }

    fn url(&self) -> &str {
        match self {
            Self::Postgres(schema) => &schema.url,
            Self::MariaDb { url, .. } => url,
        }
    }

    /// The orders stored with ids starting with `prefix`, and their customer's balance.
    async fn books(&self, prefix: &str, customer: &str) -> (i64, i64) {
        let like = format!("{prefix}%");
        match self {
            Self::Postgres(schema) => {
                let orders: i64 =
                    sqlx::query_scalar("SELECT count(*) FROM orders WHERE order_id LIKE $1")
                        .bind(&like)
                        .fetch_one(&schema.pool)
                        .await
                        .unwrap_or(0);
                let cents: Option<i64> =
                    sqlx::query_scalar("SELECT cents FROM balances WHERE customer = $1")
                        .bind(customer)
                        .fetch_optional(&schema.pool)
                        .await
                        .unwrap_or(None);
                (orders, cents.unwrap_or(0))
            }
            Self::MariaDb { pool, .. } => {
                let orders: i64 = sqlx::query_scalar(
                    "SELECT CAST(count(*) AS SIGNED) FROM orders WHERE order_id LIKE ?",
                )
                .bind(&like)
                .fetch_one(pool)
                .await
                .unwrap_or(0);
                let cents: Option<i64> =
                    sqlx::query_scalar("SELECT cents FROM balances WHERE customer = ?")
                        .bind(customer)
                        .fetch_optional(pool)
                        .await
                        .unwrap_or(None);
                (orders, cents.unwrap_or(0))
            }
        }
    }

    /// The store's dead-letter records of `queue`: message id and reason.
    async fn dead_letters(&self, queue: &str) -> Vec<(Option<String>, String)> {
        let records = match self {
            Self::Postgres(schema) => idem::sql::PgInbox::new(schema.pool.clone())
                .dead_letters(queue)
                .await
                .unwrap(),
            Self::MariaDb { pool, .. } => idem::sql::MySqlInbox::new(pool.clone())
                .dead_letters(queue)
                .await
                .unwrap(),
        };
        let mut records: Vec<_> = records
            .into_iter()
            .map(|r| (r.message_id, r.reason))
            .collect();
        records.sort();
        records
    }

    async fn drop(self) {
        match self {
            Self::Postgres(schema) => schema.drop().await,
            Self::MariaDb { pool, name, .. } => {
                pool.close().await;
                sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}")))
                    .execute(&common::mysql(1).await)
                    .await
                    .unwrap();
            }
        }
    }
}

/// One probe: 100 good orders of 1 cent around the odd orders (id, cents) `odd` makes from the
/// probe's queue name, consumed by `orders consume` on `db` (in batches of `batch` when given);
/// the first `dead` of the odd ones are expected in the dead-letter queue, each once, with its
/// record and `reason`; the others applied.
async fn probe(
    db: Db,
    batch: Option<&str>,
    odd: fn(&str) -> Vec<(String, i64)>,
    dead: usize,
    reason: &str,
) {
    let queue = unique("idem-odd");
    let odd = odd(&queue);
    let customer = format!("{queue}-c");
    broker::declare_orders_queue(&queue).await;
    let publisher = broker::publisher().await;
    let order = |id: &str, cents: i64| {
        serde_json::json!({"order_id": id, "customer": customer, "amount_cents": cents}).to_string()
    };
    for n in 0..100 {
        if n == 50 {
            for (id, cents) in &odd {
                broker::publish(&publisher, &queue, Some(id), order(id, *cents).as_bytes()).await;
            }
        }
        let id = format!("{queue}-{n}");
        broker::publish(&publisher, &queue, Some(&id), order(&id, 1).as_bytes()).await;
    }
    let mut command = Command::new(orders_example());
    command
        .arg("consume")
        .env("AMQP_URL", amqp_url())
        .env("DATABASE_URL", db.url())
        .env("ORDERS_QUEUE", &queue)
        .env("RUST_LOG", "error");
    if let Some(batch) = batch {
        command.env("ORDERS_BATCH", batch);
    }
    let mut consumer = Watched::spawn("orders consume", &mut command);
    let dlq = idem::rabbitmq::dlq(&queue);
    let queue_ref = &queue;
    watched::wait_until(
        "the queue drained",
        DEADLINE,
        &mut [&mut consumer],
        || async { broker::count(queue_ref).await == 0 && broker::unacked(queue_ref) == 0 },
    )
    .await;
    drop(consumer);
    let (orders, cents) = db.books(&queue, &customer).await;
    let mut dead_letters: Vec<Option<String>> = broker::drain(&dlq)
        .await
        .iter()
        .map(broker::Got::message_id)
        .collect();
    dead_letters.sort();
    let mut expected: Vec<Option<String>> = odd
        .iter()
        .take(dead)
        .map(|(id, _)| Some(id.clone()))
        .collect();
    expected.sort();
    assert_eq!(
        dead_letters, expected,
        "the odd ones dead-lettered, once each"
    );
    let records: Vec<(Option<String>, String)> = expected
        .iter()
        .map(|id| (id.clone(), reason.to_owned()))
        .collect();
    assert_eq!(db.dead_letters(&queue).await, records, "their records");
    let expected_cents = 100 + odd.iter().map(|(_, c)| c).sum::<i64>()
        - odd.iter().take(dead).map(|(_, c)| c).sum::<i64>();
    assert_eq!(orders as usize, 100 + odd.len() - dead, "applied once each");
    assert_eq!(cents, expected_cents, "every balance exact");
    broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
    db.drop().await;
}

/// The NUL order: its claim and its dead-letter record hold it on PostgreSQL; the example's own
/// `orders` table (`text`) refuses it, so it is dead-lettered alone.
fn nul_order(queue: &str) -> Vec<(String, i64)> {
    vec![(format!("{queue}-bad\0id"), 1000)]
}

/// A 250-character id, and two ids that differ only in a trailing space.
fn long_and_padded_orders(queue: &str) -> Vec<(String, i64)> {
    let long = format!("{queue}-{}", "x".repeat(249 - queue.len()));
    assert_eq!(long.chars().count(), 250);
    vec![
        (long, 1000),
        (format!("{queue}-ts-key"), 10),
        (format!("{queue}-ts-key "), 100),
    ]
}

/// The reason of a message the example's own table refuses: its handler failed for good.
const REFUSED: &str = "handler";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_nul_key_is_dead_lettered_alone() {
    probe(Db::postgres().await, None, nul_order, 1, REFUSED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_in_batches_a_nul_key_is_dead_lettered_alone() {
    probe(Db::postgres().await, Some("50"), nul_order, 1, REFUSED).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mariadb_long_and_padded_keys_are_applied() {
    probe(
        Db::mariadb().await,
        None,
        long_and_padded_orders,
        0,
        REFUSED,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_mariadb_in_batches_long_and_padded_keys_are_applied() {
    probe(
        Db::mariadb().await,
        Some("50"),
        long_and_padded_orders,
        0,
        REFUSED,
    )
    .await;
}
