//! The demo workload: orders with duplicates, concurrent copies, malformed messages and a
//! reused id, processed through the inbox; then the books are checked.

use crate::Db;
use crate::handlers::OrderPlaced;
use idem::{Envelope, Outcome, Registration, Stores};
use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Instant, SystemTime, UNIX_EPOCH};
use tokio::sync::Semaphore;

/// The demo's parameters.
pub struct Config {
    pub orders: usize,
    pub dup_rate: f64,
    pub concurrency: usize,
}

/// What happened.
#[derive(Default)]
pub struct Report {
    delivered: usize,
    outcomes: BTreeMap<&'static str, usize>,
    expected_orders: i64,
    stored_orders: i64,
    expected_cents: i64,
    stored_cents: i64,
    wrong_balances: usize,
    seconds: f64,
}

impl Report {
    /// Whether every order was stored once and every balance is exact.
    pub fn exact(&self) -> bool {
        self.stored_orders == self.expected_orders
            && self.stored_cents == self.expected_cents
            && self.wrong_balances == 0
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let count = |label| self.outcomes.get(label).copied().unwrap_or(0);
        writeln!(
            f,
            "delivered            {:>7}  ({:.0} msgs/s)",
            self.delivered,
            self.delivered as f64 / self.seconds
        )?;
        writeln!(f, "processed            {:>7}", count("processed"))?;
        writeln!(f, "duplicates skipped   {:>7}", count("duplicate"))?;
        writeln!(
            f,
            "dead-lettered        {:>7}  (rejected {}, conflict {})",
            count("rejected") + count("conflict"),
            count("rejected"),
            count("conflict")
        )?;
        writeln!(f, "retried              {:>7}", count("retry"))?;
        writeln!(
            f,
            "orders stored        {:>7}  (expected {})",
            self.stored_orders, self.expected_orders
        )?;
        writeln!(
            f,
            "cents booked    {:>12}  (expected {})",
            self.stored_cents, self.expected_cents
        )?;
        write!(
            f,
            "balances             {}",
            if self.exact() {
                "exact".to_owned()
            } else {
                format!("WRONG ({} customers off)", self.wrong_balances)
            }
        )
    }
}

/// A small deterministic generator (xorshift), so a run is repeatable without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    fn chance(&mut self, p: f64) -> bool {
        (self.next() % 10_000) as f64 / 10_000.0 < p
    }
}

fn envelope(order: &OrderPlaced) -> Envelope {
    let body = serde_json::to_vec(order).unwrap_or_default();
    Envelope::new(body)
        .with_message_id(&order.order_id)
        .with_content_type("application/json")
}

/// Runs the workload through `handler` and checks the books.
pub async fn run(
    handler: &'static Registration,
    stores: &Stores,
    db: &Db,
    config: &Config,
) -> anyhow::Result<Report> {
    let run_id = SystemTime::now().duration_since(UNIX_EPOCH)?.as_millis();
    let mut rng = Rng(0x9E37_79B9_7F4A_7C15 ^ run_id as u64 | 1);
    let customers: Vec<String> = (0..50).map(|c| format!("customer-{run_id}-{c}")).collect();
    let mut expected: BTreeMap<String, i64> = BTreeMap::new();

    // A delivery list: each order once, plus duplicates, some of which go out at the same time
    // as their original (a "burst"); then malformed messages and a reused id.
    let mut deliveries: Vec<Vec<Envelope>> = Vec::new();
    for n in 0..config.orders {
        let customer = customers[(rng.next() % customers.len() as u64) as usize].clone();
        let order = OrderPlaced {
            order_id: format!("order-{run_id}-{n}"),
            customer,
            amount_cents: (rng.next() % 10_000) as i64 + 1,
        };
        *expected.entry(order.customer.clone()).or_default() += order.amount_cents;
        let mut burst = vec![envelope(&order)];
        while rng.chance(config.dup_rate) {
            burst.push(envelope(&order).with_attempt(2));
        }
        deliveries.push(burst);
    }
    let reused = OrderPlaced {
        order_id: format!("order-{run_id}-0"),
        customer: "mallory".into(),
        amount_cents: 1_000_000,
    };
    deliveries.push(vec![
        Envelope::new("this is not json").with_message_id(format!("bad-{run_id}-1")),
    ]);
    deliveries.push(vec![
        Envelope::new(r#"{"order_id":"x"}"#).with_message_id(format!("bad-{run_id}-2")),
    ]);
    deliveries.push(vec![Envelope::new(serde_json::to_vec(&reused)?)]); // no message id
    // Shuffle, so that some duplicates arrive long after their original.
    for i in (1..deliveries.len()).rev() {
        deliveries.swap(i, (rng.next() % (i as u64 + 1)) as usize);
    }

    let limit = Arc::new(Semaphore::new(config.concurrency));
    let stores = Arc::new(stores.clone());
    let started = Instant::now();
    let mut tasks = Vec::new();
    for burst in deliveries {
        for envelope in burst {
            let permit = limit.clone().acquire_owned().await?;
            let stores = stores.clone();
            tasks.push(tokio::spawn(async move {
                let outcome = handler.invoke(&stores, &envelope).await;
                drop(permit);
                outcome
            }));
        }
    }
    let mut report = Report {
        delivered: tasks.len() + 1,
        ..Report::default()
    };
    let mut outcomes = Vec::with_capacity(tasks.len() + 1);
    for task in tasks {
        outcomes.push(task.await??);
    }
    // Once order 0 is in, a producer reuses its id for different content: a conflict, which is
    // dead-lettered, never silently dropped nor applied.
    outcomes.push(handler.invoke(&stores, &envelope(&reused)).await?);
    for outcome in outcomes {
        if let Outcome::Rejected(r) = &outcome {
            tracing::info!(reason = %r, "dead-lettered");
        }
        *report.outcomes.entry(outcome.label()).or_default() += 1;
    }
    report.seconds = started.elapsed().as_secs_f64();

    let prefix = format!("customer-{run_id}-%");
    let stored: Vec<(String, i64)> = match db {
        Db::Sqlite(pool) => {
            sqlx::query_as("SELECT customer, cents FROM balances WHERE customer LIKE $1")
                .bind(&prefix)
                .fetch_all(pool)
                .await?
        }
        Db::Postgres(pool) => {
            sqlx::query_as("SELECT customer, cents FROM balances WHERE customer LIKE $1")
                .bind(&prefix)
                .fetch_all(pool)
                .await?
        }
    };
    let order_prefix = format!("order-{run_id}-%");
    report.stored_orders = match db {
        Db::Sqlite(pool) => {
            sqlx::query_scalar("SELECT count(*) FROM orders WHERE order_id LIKE $1")
                .bind(&order_prefix)
                .fetch_one(pool)
                .await?
        }
        Db::Postgres(pool) => {
            sqlx::query_scalar("SELECT count(*) FROM orders WHERE order_id LIKE $1")
                .bind(&order_prefix)
                .fetch_one(pool)
                .await?
        }
    };
    report.expected_orders = config.orders as i64;
    report.expected_cents = expected.values().sum();
    report.stored_cents = stored.iter().map(|(_, c)| c).sum();
    let stored: BTreeMap<String, i64> = stored.into_iter().collect();
    report.wrong_balances = expected
        .iter()
        .filter(|(c, cents)| stored.get(*c) != Some(cents))
        .count();
    Ok(report)
}
