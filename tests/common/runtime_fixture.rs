//! The runtime fixture of the RabbitMQ tests: a scripted order handler on PostgreSQL, a fresh
//! queue per test, a runtime started in the background, checks of exactly-once effects.
#![allow(dead_code)]

use crate::common::broker::{self, amqp_url, publish};
use crate::common::raw_amqp::{RawProperties, RawPublisher};
use crate::common::unique;
use idem::rabbitmq::{Publisher, QueueType, RabbitConfig, RabbitTransport};
use idem::sql::PgInbox;
use idem::transport::{QueueSpec, Transport};
use idem::{
    Batch, BatchError, Context, HandlerError, RetryPolicy, Runtime, RuntimeBuilder, idempotent,
};
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, Mutex};
use std::time::Duration;

pub const CONSUMER: &str = "rt.orders";

#[derive(Debug, Deserialize)]
pub struct Order {
    pub order_id: String,
    pub customer: String,
    pub amount_cents: i64,
}

/// What the handler does for a key, per delivery, in order.
#[derive(Debug, Clone, Copy)]
pub enum Step {
    FailTransient,
    /// Fail for good: the message is dead-lettered (reason `handler`).
    FailPermanent,
    /// Block until `RELEASED` holds the key.
    WaitForRelease,
    /// Never finish.
    Hang,
    /// Block until `RELEASED` holds the key, then fail transiently (nothing commits).
    WaitThenFail,
}

/// One test's script for the handler, given to its runtime as state (`.state(script)`): what
/// the handler does per key, and what it saw. Clones share it.
#[derive(Clone, Default)]
pub struct Script(Arc<Mutex<Scripted>>);

#[derive(Default)]
struct Scripted {
    steps: BTreeMap<String, Vec<Step>>,
    /// The attempts each key was seen with.
    attempts: BTreeMap<String, Vec<u32>>,
    /// When the handler saw each key, attempt by attempt.
    seen_at: BTreeMap<String, Vec<std::time::Instant>>,
    started: Vec<String>,
    released: Vec<String>,
}

impl Script {
    /// Locks it; a panic in a handler must not poison it for the test.
    fn lock(&self) -> std::sync::MutexGuard<'_, Scripted> {
        self.0.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The handler does `steps` for `key`, one per delivery, then succeeds.
    pub fn set(&self, key: &str, steps: &[Step]) {
        self.lock().steps.insert(key.to_owned(), steps.to_vec());
    }

    /// The attempts the handler saw `key` with.
    pub fn attempts(&self, key: &str) -> Vec<u32> {
        self.lock().attempts.get(key).cloned().unwrap_or_default()
    }

    /// The time between the handler's consecutive runs of `key`: a retry delay is measured
    /// per attempt (each gap at least its delay), not as a total that start-up alone can fill.
    pub fn gaps(&self, key: &str) -> Vec<Duration> {
        let seen = self.lock().seen_at.get(key).cloned().unwrap_or_default();
        seen.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// Whether the handler started a waiting step for `key`.
    pub fn started(&self, key: &str) -> bool {
        self.lock().started.iter().any(|k| k == key)
    }

    /// Lets the waiting steps of `key` go on.
    pub fn release(&self, key: &str) {
        self.lock().released.push(key.to_owned());
    }

    fn released(&self, key: &str) -> bool {
        self.lock().released.iter().any(|k| k == key)
    }
}

#[idempotent(store = Postgres, queue = "idem-test-overridden", consumer = "rt.orders")]
async fn record(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order: Order,
    script: &Script,
    ctx: &Context<'_>,
) -> Result<(), HandlerError> {
    {
        let mut scripted = script.lock();
        scripted
            .attempts
            .entry(order.order_id.clone())
            .or_default()
            .push(ctx.attempt());
        scripted
            .seen_at
            .entry(order.order_id.clone())
            .or_default()
            .push(std::time::Instant::now());
    }
    sqlx::query("INSERT INTO idem_rt_effects (key, customer, amount_cents) VALUES ($1, $2, $3)")
        .bind(&order.order_id)
        .bind(&order.customer)
        .bind(order.amount_cents)
        .execute(&mut **tx)
        .await?;
    sqlx::query(
        "INSERT INTO idem_rt_balances (customer, cents) VALUES ($1, $2)
         ON CONFLICT (customer) DO UPDATE SET cents = idem_rt_balances.cents + excluded.cents",
    )
    .bind(&order.customer)
    .bind(order.amount_cents)
    .execute(&mut **tx)
    .await?;
    script.play(&order.order_id).await
}

/// The same work as a batch handler sharing the consumer (and its inbox rows): each order's
/// script played in order (a failure fails that order by its index), then the batch's effects
/// written set-based. Run by `Fixture::batch_handler_runtime`.
#[idempotent(store = Postgres, queue = "idem-test-overridden", consumer = "rt.orders")]
async fn record_batch(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    orders: Batch<Order>,
    script: &Script,
) -> Result<(), BatchError> {
    for (i, order) in orders.iter().enumerate() {
        script
            .play(&order.order_id)
            .await
            .map_err(|e| BatchError::item(i, e))?;
    }
    let keys: Vec<&str> = orders.iter().map(|o| o.order_id.as_str()).collect();
    let customers: Vec<&str> = orders.iter().map(|o| o.customer.as_str()).collect();
    let cents: Vec<i64> = orders.iter().map(|o| o.amount_cents).collect();
    sqlx::query(
        "INSERT INTO idem_rt_effects (key, customer, amount_cents)
         SELECT * FROM unnest($1::text[], $2::text[], $3::bigint[])",
    )
    .bind(&keys)
    .bind(&customers)
    .bind(&cents)
    .execute(&mut **tx)
    .await?;
    sqlx::query(
        "INSERT INTO idem_rt_balances (customer, cents)
         SELECT customer, sum(cents)::bigint FROM unnest($1::text[], $2::bigint[]) AS u(customer, cents)
         GROUP BY customer ORDER BY customer
         ON CONFLICT (customer) DO UPDATE SET cents = idem_rt_balances.cents + excluded.cents",
    )
    .bind(&customers)
    .bind(&cents)
    .execute(&mut **tx)
    .await?;
    Ok(())
}

impl Script {
    /// Plays the next step scripted for `key` (none: success).
    async fn play(&self, key: &str) -> Result<(), HandlerError> {
        let step = {
            let mut scripted = self.lock();
            let step = scripted
                .steps
                .get_mut(key)
                .and_then(|steps| (!steps.is_empty()).then(|| steps.remove(0)));
            if matches!(
                step,
                Some(Step::WaitForRelease | Step::WaitThenFail | Step::Hang)
            ) {
                scripted.started.push(key.to_owned());
            }
            step
        };
        match step {
            None => Ok(()),
            Some(Step::FailTransient) => Err(HandlerError::transient("scripted: database busy")),
            Some(Step::FailPermanent) => Err(HandlerError::permanent("scripted: refused")),
            Some(Step::WaitForRelease) => {
                while !self.released(key) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Ok(())
            }
            Some(Step::WaitThenFail) => {
                while !self.released(key) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                Err(HandlerError::transient("scripted: failed after waiting"))
            }
            Some(Step::Hang) => std::future::pending().await,
        }
    }
}

pub struct Fixture {
    pub pool: sqlx::PgPool,
    pub queue: String,
    pub publisher: Publisher,
    pub policy: RetryPolicy,
    pub rabbit: RabbitConfig,
    /// The handler's script, shared with the runtimes this fixture builds.
    pub script: Script,
}

/// Retries 200 ms, 400 ms, 800 ms, 1.6 s apart: the default policy (1 s, 4 s, 16 s, 60 s)
/// would make a test that meets a retry wait seconds to minutes for it.
pub fn fast_retries() -> RetryPolicy {
    RetryPolicy::new(5, Duration::from_millis(200), 2, Duration::from_secs(2)).unwrap()
}

pub async fn fixture(
    name: &str,
    policy: RetryPolicy,
    queue_type: QueueType,
    delivery_limit: Option<u32>,
) -> Fixture {
    let pool = crate::common::postgres(8).await;
    fixture_on(name, policy, queue_type, delivery_limit, pool).await
}

/// [`fixture`] with its tables, inbox and handlers' transactions in the database of `pool`.
pub async fn fixture_on(
    name: &str,
    policy: RetryPolicy,
    queue_type: QueueType,
    delivery_limit: Option<u32>,
    pool: sqlx::PgPool,
) -> Fixture {
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.tests'))::text")
        .execute(&mut *tx)
        .await
        .unwrap();
    for statement in [
        "CREATE TABLE IF NOT EXISTS idem_rt_effects (key TEXT NOT NULL, customer TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS idem_rt_balances (customer TEXT PRIMARY KEY, cents BIGINT NOT NULL)",
    ] {
        sqlx::query(statement).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    PgInbox::new(pool.clone()).migrate().await.unwrap();
    let queue = unique(&format!("idem-test-{name}"));
    let mut rabbit = RabbitConfig::new(amqp_url())
        .queue_type(queue_type)
        .connection_name(format!("idem-test:{queue}"));
    if let Some(limit) = delivery_limit {
        rabbit = rabbit.delivery_limit(limit);
    }
    let publisher = broker::publisher().await;
    let mut spec = QueueSpec::new(queue.clone(), CONSUMER);
    spec.retry_delays = policy.delays();
    RabbitTransport::new(rabbit.clone())
        .declare(&[spec])
        .await
        .unwrap();
    Fixture {
        pool,
        queue,
        publisher,
        policy,
        rabbit,
        script: Script::default(),
    }
}

impl Fixture {
    pub fn runtime_with(&self, pool: sqlx::PgPool) -> RuntimeBuilder {
        self.runtime_of("record", pool)
    }

    /// The runtime with the batch handler of the consumer (`record_batch`).
    pub fn batch_handler_runtime_with(&self, pool: sqlx::PgPool) -> RuntimeBuilder {
        self.runtime_of("record_batch", pool)
    }

    /// The runtime with the consumer's function `function`.
    fn runtime_of(&self, function: &str, pool: sqlx::PgPool) -> RuntimeBuilder {
        // Four workers and 16 deliveries ahead (not the defaults): enough in flight at once for
        // the tests' concurrency cases, few enough that a test's handful of orders and what it
        // holds back stay easy to follow.
        self.defaults_of(function, pool).concurrency(4).prefetch(16)
    }

    /// The runtime with the consumer's `record` handler, idem's default concurrency and
    /// prefetch.
    pub fn runtime_with_defaults(&self) -> RuntimeBuilder {
        self.defaults_of("record", self.pool.clone())
    }

    /// The runtime with the consumer's batch handler (`record_batch`), idem's default
    /// concurrency and prefetch.
    pub fn batch_handler_runtime_with_defaults(&self) -> RuntimeBuilder {
        self.defaults_of("record_batch", self.pool.clone())
    }

    fn defaults_of(&self, function: &str, pool: sqlx::PgPool) -> RuntimeBuilder {
        Runtime::builder()
            .transport(RabbitTransport::new(self.rabbit.clone()))
            .store(PgInbox::new(pool))
            .state(self.script.clone())
            .handlers([function])
            .handler_queue(CONSUMER, &self.queue)
            .retry(self.policy.clone())
    }

    pub fn runtime(&self) -> RuntimeBuilder {
        self.runtime_with(self.pool.clone())
    }

    pub fn key(&self, n: usize) -> String {
        format!("{}-{n}", self.queue)
    }

    pub fn customer(&self, n: usize) -> String {
        format!("{}-c{}", self.queue, n % 7)
    }

    /// Order `n`'s body.
    pub fn order(&self, n: usize, amount: i64) -> String {
        serde_json::json!({"order_id": self.key(n), "customer": self.customer(n), "amount_cents": amount})
            .to_string()
    }

    pub async fn publish_order(&self, n: usize, amount: i64) {
        let body = self.order(n, amount);
        publish(
            &self.publisher,
            &self.queue,
            Some(&self.key(n)),
            body.as_bytes(),
        )
        .await;
    }

    /// Publishes orders `range` (amount 7) as raw frames, each with its key as message id.
    pub fn publish_raw_orders(&self, raw: &mut RawPublisher, range: std::ops::Range<usize>) {
        for n in range {
            let properties = RawProperties {
                message_id: Some(self.key(n).into_bytes()),
                headers: None,
            };
            raw.publish(&self.queue, &properties, self.order(n, 7).as_bytes());
        }
    }

    /// Effects per key of this fixture's orders.
    pub async fn effects(&self) -> HashMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT key, count(*) FROM idem_rt_effects WHERE key LIKE $1 GROUP BY key",
        )
        .bind(format!("{}-%", self.queue))
        .fetch_all(&self.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
    }

    pub async fn balances(&self) -> HashMap<String, i64> {
        sqlx::query_as::<_, (String, i64)>(
            "SELECT customer, cents FROM idem_rt_balances WHERE customer LIKE $1",
        )
        .bind(format!("{}-c%", self.queue))
        .fetch_all(&self.pool)
        .await
        .unwrap()
        .into_iter()
        .collect()
    }

    /// Asserts that orders 0..n each took effect exactly once and the balances are exact.
    pub async fn assert_exactly_once(&self, n: usize, amount: impl Fn(usize) -> i64) {
        let effects = self.effects().await;
        let doubled: Vec<_> = effects.iter().filter(|(_, c)| **c != 1).collect();
        assert!(
            doubled.is_empty(),
            "keys not applied exactly once: {doubled:?}"
        );
        let mut applied: Vec<&String> = effects.keys().collect();
        applied.sort();
        let mut expected_keys: Vec<String> = (0..n).map(|i| self.key(i)).collect();
        expected_keys.sort();
        assert!(
            applied.iter().copied().eq(expected_keys.iter()),
            "the keys applied are not exactly the {n} orders sent: {applied:?}"
        );
        let mut expected: HashMap<String, i64> = HashMap::new();
        for i in 0..n {
            *expected.entry(self.customer(i)).or_default() += amount(i);
        }
        assert_eq!(self.balances().await, expected);
    }

    /// Waits until no message of this fixture's queue is left on the broker: none ready in
    /// the queue or its retry queues, none unacknowledged. A run is judged only then, so that
    /// late copies and redeliveries are judged too.
    pub async fn wait_drained(&self) {
        let hop = crate::common::drained::hop(&self.queue, &self.policy.delays());
        crate::common::drained::wait_drained("the queue's hop", &hop, Duration::from_secs(120))
            .await;
    }

    /// The dead-letter records of this fixture's queue, oldest first.
    pub async fn dead_letters(&self) -> Vec<idem::sql::DeadLetterRow> {
        PgInbox::new(self.pool.clone())
            .dead_letters(&self.queue)
            .await
            .unwrap()
    }

    pub async fn cleanup(self) {
        broker::delete_topology(&self.queue, &self.policy.delays()).await;
    }
}

/// A pool of four connections to PostgreSQL through a TCP proxy the test can cut and restore;
/// a connection waits at most a second for the pool.
pub async fn proxied_postgres() -> (crate::common::proxy::Proxy, sqlx::PgPool) {
    let (proxy, proxied_url) = crate::common::proxy::postgres().await;
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(1))
        .connect(&proxied_url)
        .await
        .expect("PostgreSQL through the proxy");
    (proxy, pool)
}
