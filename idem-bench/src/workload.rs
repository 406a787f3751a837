//! The workload every consumer gets: orders with a share of exact duplicates, the tables they
//! write, and the check that their effects are exact.

use crate::prefill::InboxTable;
use anyhow::{Context as _, bail, ensure};
use idem::rabbitmq::{Publisher, RabbitConfig};
use lapin::types::ShortString;
use serde::{Deserialize, Serialize};
use sqlx::PgPool;
use std::collections::HashMap;

/// Customers the orders are spread over (each order adds to one balance row).
pub const CUSTOMERS: usize = 1000;

/// One message.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Order {
    /// The dedup key (also the AMQP message id).
    pub order_id: String,
    /// Whose balance it adds to.
    pub customer: String,
    /// How much.
    pub amount_cents: i64,
}

/// The messages, in publishing order, duplicates included.
pub struct Workload {
    /// Every message to publish.
    pub messages: Vec<Order>,
    /// The distinct keys, in the order they first appear.
    pub keys: Vec<String>,
    /// Their kind.
    pub kind: Keys,
    /// Distinct orders among them.
    pub unique: usize,
    /// The balance each customer must end with.
    pub balances: HashMap<String, i64>,
}

/// A small deterministic generator (xorshift64*): the same workload in every run.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }

    fn unit(&mut self) -> f64 {
        (self.next() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// The kind of dedup key the orders carry (and the prefilled inbox rows, `--prefill`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Keys {
    /// `order-00000000`, `order-00000001`, …: every claim lands at the end of the index.
    Sequential,
    /// Random UUIDs (version 4), as most producers set them: every claim lands at a random
    /// place in the inbox's unique index.
    Uuid4,
    /// Time-ordered UUIDs (version 7): new keys land near the end of the index.
    Uuid7,
}

impl Keys {
    /// The key of the `n`th distinct order.
    fn key(self, n: usize, rng: &mut Rng, unix_ms: u64) -> String {
        match self {
            Self::Sequential => format!("order-{n:08}"),
            Self::Uuid4 => uuid_text(
                (u128::from(rng.next()) << 64 | u128::from(rng.next())) & !(0xF << 76) | 4 << 76,
            ),
            Self::Uuid7 => {
                // 48 bits of milliseconds, then the order's number (the keys of one run stay
                // distinct and ascending), then random bits.
                let n = n as u128;
                let random = u128::from(rng.next()) & ((1 << 42) - 1);
                uuid_text(
                    u128::from(unix_ms & ((1 << 48) - 1)) << 80
                        | 7 << 76
                        | (n >> 20 & 0xFFF) << 64
                        | (n & 0xF_FFFF) << 42
                        | random,
                )
            }
        }
    }
}

/// A UUID's canonical text (the variant bits of version 4 set here).
fn uuid_text(value: u128) -> String {
    let value = value & !(0b11 << 62) | 0b10 << 62;
    let hex = format!("{value:032x}");
    format!(
        "{}-{}-{}-{}-{}",
        &hex[0..8],
        &hex[8..12],
        &hex[12..16],
        &hex[16..20],
        &hex[20..32]
    )
}

impl Workload {
    /// `messages` messages of which about `dup_rate` are exact copies of an earlier one, their
    /// keys of the kind `keys`.
    pub fn new(messages: usize, dup_rate: f64, kind: Keys) -> Self {
        let unix_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_millis() as u64)
            .unwrap_or(0);
        let mut rng = Rng(0x9E37_79B9_7F4A_7C15);
        let mut out: Vec<Order> = Vec::with_capacity(messages);
        let mut balances: HashMap<String, i64> = HashMap::new();
        let mut unique = 0;
        let mut keys = Vec::with_capacity(messages);
        for _ in 0..messages {
            if unique > 0 && rng.unit() < dup_rate {
                let copy = out[rng.below(out.len())].clone();
                out.push(copy);
                continue;
            }
            let order = Order {
                order_id: kind.key(unique, &mut rng, unix_ms),
                customer: format!("customer-{:04}", rng.below(CUSTOMERS)),
                amount_cents: 1 + rng.below(10_000) as i64,
            };
            *balances.entry(order.customer.clone()).or_default() += order.amount_cents;
            keys.push(order.order_id.clone());
            unique += 1;
            out.push(order);
        }
        Self {
            messages: out,
            keys,
            kind,
            unique,
            balances,
        }
    }

    /// Publishes every message to `queue` (persistent, message id = order id), confirmed;
    /// `routed`: to the exchange `queue`, with the order id as routing key.
    pub async fn publish(
        &self,
        rabbit: &RabbitConfig,
        queue: &str,
        routed: bool,
    ) -> anyhow::Result<()> {
        let publisher = Publisher::connect(rabbit).await?;
        for chunk in self.messages.chunks(2000) {
            for order in chunk {
                let body = serde_json::to_vec(order)?;
                let message = idem::Envelope::new(body)
                    .with_message_id(order.order_id.as_str())
                    .with_content_type("application/json");
                if routed {
                    publisher
                        .publish_unconfirmed_to(queue, &order.order_id, &message)
                        .await?;
                } else {
                    publisher.publish_unconfirmed(queue, &message).await?;
                }
            }
            publisher.wait_for_confirms().await?;
        }
        Ok(())
    }
}

/// The business tables and the handwritten consumers' inboxes (the lean consumer's with the
/// arrival time its cleanup would use, and that index).
const SCHEMA: [&str; 7] = [
    "CREATE TABLE IF NOT EXISTS bench_orders (order_id TEXT PRIMARY KEY, customer TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS bench_balances (customer TEXT PRIMARY KEY, cents BIGINT NOT NULL)",
    "CREATE TABLE IF NOT EXISTS bench_inbox (consumer TEXT NOT NULL, key TEXT NOT NULL, PRIMARY KEY (consumer, key))",
    "CREATE TABLE IF NOT EXISTS bench_lean_inbox (consumer TEXT NOT NULL, key TEXT NOT NULL, received_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (consumer, key))",
    "CREATE INDEX IF NOT EXISTS bench_lean_inbox_received_at ON bench_lean_inbox (received_at)",
    // idem's inbox table at schema version 8, for the consumer that writes its row by hand.
    "CREATE TABLE IF NOT EXISTS bench_full_inbox (consumer TEXT NOT NULL, key TEXT NOT NULL, fingerprint BYTEA NOT NULL, status TEXT NOT NULL, outcome TEXT, attempts INTEGER NOT NULL, created_at TIMESTAMPTZ NOT NULL, completed_at TIMESTAMPTZ, expires_at TIMESTAMPTZ NOT NULL, owner TEXT, locked_until TIMESTAMPTZ, PRIMARY KEY (consumer, key))",
    "CREATE INDEX IF NOT EXISTS bench_full_inbox_expires_at ON bench_full_inbox (expires_at)",
];

/// The business writes of one order, the same in every consumer: the order row, then the
/// customer's balance.
const INSERT_ORDER: &str =
    "INSERT INTO bench_orders (order_id, customer, amount_cents) VALUES ($1, $2, $3)";
/// Adds to a balance (not idempotent on its own: run twice, it adds twice).
const ADD_TO_BALANCE: &str = "UPDATE bench_balances SET cents = cents + $2 WHERE customer = $1";

/// The business writes of one order, the same in every consumer.
pub async fn apply(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order: &Order,
) -> Result<(), sqlx::Error> {
    sqlx::query(INSERT_ORDER)
        .bind(&order.order_id)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(ADD_TO_BALANCE)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The business writes of a batch of new orders, set-based: one multi-row insert of the orders
/// and one update of each customer's balance by its total in the batch.
pub async fn apply_set(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    orders: &[&Order],
) -> Result<(), sqlx::Error> {
    let ids: Vec<&str> = orders.iter().map(|o| o.order_id.as_str()).collect();
    let customers: Vec<&str> = orders.iter().map(|o| o.customer.as_str()).collect();
    let amounts: Vec<i64> = orders.iter().map(|o| o.amount_cents).collect();
    sqlx::query(
        "INSERT INTO bench_orders (order_id, customer, amount_cents)
         SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])",
    )
    .bind(&ids)
    .bind(&customers)
    .bind(&amounts)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "UPDATE bench_balances b SET cents = b.cents + t.cents
         FROM (SELECT customer, sum(cents)::bigint AS cents
               FROM unnest($1::text[], $2::bigint[]) AS u(customer, cents) GROUP BY customer) t
         WHERE b.customer = t.customer",
    )
    .bind(&customers)
    .bind(&amounts)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

/// Creates the tables and empties them, with every balance at 0. With `prefilled`, the inbox
/// tables keep their prefilled rows and lose only that workload's.
pub async fn reset(
    pool: &PgPool,
    idem_table: &str,
    prefilled: Option<&Workload>,
) -> anyhow::Result<()> {
    for statement in SCHEMA {
        sqlx::query(statement).execute(pool).await?;
    }
    // Left by a latency run that was interrupted: no other run pays for its notifications.
    sqlx::query(crate::latency::DROP_TRIGGER)
        .execute(pool)
        .await?;
    // The outbox beside idem's inbox (`bench_idem_inbox` → `bench_idem_outbox`) too.
    let outbox = idem_table.replace("_inbox", "_outbox");
    let inboxes = match prefilled {
        Some(workload) => {
            for table in [
                InboxTable::Bare,
                InboxTable::Lean,
                InboxTable::Full,
                InboxTable::Idem,
            ] {
                table.forget(pool, &workload.keys).await?;
            }
            format!("\"{idem_table}_deliveries\"")
        }
        None => format!("bench_inbox, bench_lean_inbox, bench_full_inbox, \"{idem_table}\""),
    };
    let truncate = format!("TRUNCATE bench_orders, bench_balances, {inboxes}, \"{outbox}\"");
    sqlx::raw_sql(sqlx::AssertSqlSafe(truncate))
        .execute(pool)
        .await?;
    sqlx::query(
        "INSERT INTO bench_balances (customer, cents)
         SELECT 'customer-' || lpad(n::text, 4, '0'), 0 FROM generate_series(0, $1 - 1) AS n",
    )
    .bind(CUSTOMERS as i32)
    .execute(pool)
    .await?;
    // Only the balances are analysed: an empty table analysed as empty would plan reads of
    // its key as sequential scans until autovacuum analyses it again (truncated, its size is
    // unknown and the primary key is used, as on a freshly created table).
    sqlx::raw_sql("VACUUM ANALYZE bench_balances")
        .execute(pool)
        .await?;
    Ok(())
}

/// Fails unless every distinct order took effect exactly once and every balance is exact.
pub async fn verify(pool: &PgPool, workload: &Workload) -> anyhow::Result<()> {
    let (orders, distinct): (i64, i64) =
        sqlx::query_as("SELECT count(*), count(DISTINCT order_id) FROM bench_orders")
            .fetch_one(pool)
            .await?;
    ensure!(
        orders as usize == workload.unique && distinct == orders,
        "{orders} order rows ({distinct} distinct) for {} distinct orders",
        workload.unique
    );
    let rows: Vec<(String, i64)> =
        sqlx::query_as("SELECT customer, cents FROM bench_balances WHERE cents <> 0")
            .fetch_all(pool)
            .await?;
    let found: HashMap<String, i64> = rows.into_iter().collect();
    if found != workload.balances {
        let wrong = workload
            .balances
            .iter()
            .filter(|(c, cents)| found.get(*c) != Some(cents))
            .count();
        bail!("{wrong} balances are wrong");
    }
    Ok(())
}

/// Messages still in `queue` (ready; the consumer has exited, so none are unacked).
pub async fn left_in_queue(url: &str, queue: &str) -> anyhow::Result<u32> {
    let connection =
        lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    let declared = channel
        .queue_declare(
            ShortString::from(queue),
            lapin::options::QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .context("the queue is gone")?;
    let _ = connection.close(200, ShortString::from("counted")).await;
    Ok(declared.message_count())
}

/// Empties `queue` (which must exist).
pub async fn purge(url: &str, queue: &str) -> anyhow::Result<()> {
    let connection =
        lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .queue_purge(ShortString::from(queue), Default::default())
        .await
        .context("the queue is gone")?;
    let _ = connection.close(200, ShortString::from("purged")).await;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuid_keys_carry_their_version_and_variant_and_v7_keys_ascend() {
        let mut rng = Rng(1);
        for n in 0..1_000 {
            for (kind, version) in [(Keys::Uuid4, '4'), (Keys::Uuid7, '7')] {
                let key = kind.key(n, &mut rng, 1_700_000_000_000);
                assert_eq!(key.len(), 36, "{key}");
                assert_eq!(key.chars().nth(14), Some(version), "{key}");
                assert!("89ab".contains(key.chars().nth(19).unwrap()), "{key}");
            }
        }
        let keys: Vec<String> = (0..5_000)
            .map(|n| Keys::Uuid7.key(n, &mut rng, 1_700_000_000_000))
            .collect();
        assert!(keys.windows(2).all(|pair| pair[0] < pair[1]));
        assert!(keys[0].starts_with("018bcfe5-6800-7"), "{}", keys[0]);
    }

    #[test]
    fn a_workload_lists_its_distinct_keys() {
        let workload = Workload::new(1_000, 0.1, Keys::Uuid4);
        assert_eq!(workload.keys.len(), workload.unique);
        let distinct: std::collections::HashSet<_> = workload.keys.iter().collect();
        assert_eq!(distinct.len(), workload.unique);
        assert!(workload.unique < 1_000);
    }
}
