//! The demo: orders with duplicates (some delivered concurrently), malformed messages and a
//! reused id, published to the broker, consumed by the runtime, then the books are checked.

use crate::handlers::OrderPlaced;
use crate::{Broker, Db, Settings};
use idem::rabbitmq::Publisher;
use idem::transport::{MemoryTransport, QueueSpec, Transport};
use idem::{Envelope, RetryPolicy, Snapshot};
use std::collections::BTreeMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Demo settings.
#[derive(Debug, Clone, clap::Args)]
pub struct Options {
    /// Distinct orders to send.
    #[arg(long, env = "ORDERS_COUNT", default_value_t = 2000)]
    orders: usize,
    /// Share of deliveries that are duplicates (0.0 to 0.9).
    #[arg(long, env = "ORDERS_DUP_RATE", default_value_t = 0.2)]
    dup_rate: f64,
    /// Give up waiting for the consumer after this many seconds.
    #[arg(long, default_value_t = 300)]
    timeout_secs: u64,
}

impl Default for Options {
    fn default() -> Self {
        Self {
            orders: 2000,
            dup_rate: 0.2,
            timeout_secs: 300,
        }
    }
}

/// A small deterministic generator (xorshift), so a run needs no dependency.
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

/// The messages of one run and what the books must show afterwards.
struct Workload {
    deliveries: Vec<Envelope>,
    reused_id: Envelope,
    expected: BTreeMap<String, i64>,
    orders: usize,
    customer_prefix: String,
    order_prefix: String,
}

fn order_message(order: &OrderPlaced) -> Envelope {
    let body = serde_json::to_vec(order).unwrap_or_default();
    Envelope::new(body)
        .with_message_id(&order.order_id)
        .with_content_type("application/json")
}

impl Workload {
    fn generate(options: &Options) -> Self {
        let run = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(1, |d| d.as_millis());
        let mut rng = Rng(run as u64 | 1);
        let (customer_prefix, order_prefix) = (format!("customer-{run}-"), format!("order-{run}-"));
        let mut expected = BTreeMap::new();
        let mut bursts = Vec::new();
        for n in 0..options.orders {
            let order = OrderPlaced {
                order_id: format!("{order_prefix}{n}"),
                customer: format!("{customer_prefix}{}", rng.next() % 50),
                amount_cents: (rng.next() % 10_000) as i64 + 1,
            };
            *expected.entry(order.customer.clone()).or_default() += order.amount_cents;
            // Copies published back to back reach different workers at the same time.
            let mut burst = vec![order_message(&order)];
            while rng.chance(options.dup_rate) {
                burst.push(order_message(&order));
            }
            bursts.push(burst);
        }
        bursts.push(vec![
            Envelope::new("this is not json").with_message_id(format!("bad-{run}-1")),
        ]);
        bursts.push(vec![
            Envelope::new(r#"{"order_id":"x"}"#).with_message_id(format!("bad-{run}-2")),
        ]);
        let reused = OrderPlaced {
            order_id: format!("{order_prefix}0"),
            customer: "mallory".into(),
            amount_cents: 1_000_000,
        };
        bursts.push(vec![Envelope::new(
            serde_json::to_vec(&reused).unwrap_or_default(),
        )]); // no message id
        // Shuffle the bursts, so that some duplicates come long after their original.
        for i in (1..bursts.len()).rev() {
            bursts.swap(i, (rng.next() % (i as u64 + 1)) as usize);
        }
        Self {
            deliveries: bursts.into_iter().flatten().collect(),
            reused_id: order_message(&reused),
            expected,
            orders: options.orders,
            customer_prefix,
            order_prefix,
        }
    }
}

/// Where the demo publishes.
enum Sink {
    Rabbit(Publisher),
    Memory(MemoryTransport),
}

impl Sink {
    async fn send_all(&self, queue: &str, messages: &[Envelope]) -> anyhow::Result<()> {
        match self {
            Self::Memory(transport) => messages
                .iter()
                .for_each(|m| transport.publish(queue, m.clone())),
            Self::Rabbit(publisher) => {
                for chunk in messages.chunks(500) {
                    for message in chunk {
                        publisher.publish_unconfirmed(queue, message).await?;
                    }
                    publisher.wait_for_confirms().await?;
                }
            }
        }
        Ok(())
    }
}

/// Runs the demo and prints the report; fails if the books are wrong.
pub async fn run(settings: &Settings, db: &Db, options: &Options) -> anyhow::Result<()> {
    anyhow::ensure!(
        (0.0..=0.9).contains(&options.dup_rate),
        "ORDERS_DUP_RATE must be between 0.0 and 0.9"
    );
    let workload = Workload::generate(options);
    let builder = crate::runtime(settings, db);
    let mut spec = QueueSpec::new(settings.queue.clone(), "orders");
    spec.retry_delays = RetryPolicy::default().delays();
    let (runtime, sink, transport_name) = match Broker::open(settings).await? {
        Broker::Rabbit(rabbit) => {
            let (transport, publisher) = *rabbit;
            transport.declare(std::slice::from_ref(&spec)).await?;
            (
                builder.transport(transport).build()?,
                Sink::Rabbit(publisher),
                "RabbitMQ",
            )
        }
        Broker::Memory(transport) => (
            builder.transport(transport.clone()).build()?,
            Sink::Memory(transport),
            "in-memory transport",
        ),
    };
    let stats = runtime.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));

    let started = Instant::now();
    let deadline = started + Duration::from_secs(options.timeout_secs);
    sink.send_all(&settings.queue, &workload.deliveries).await?;
    let total = workload.deliveries.len() as u64;
    wait_for(&stats, total, deadline).await?;
    // Once the original is in, a producer reuses its id for other content: a conflict, dead-lettered.
    sink.send_all(&settings.queue, std::slice::from_ref(&workload.reused_id))
        .await?;
    let seen = wait_for(&stats, total + 1, deadline).await?;
    let elapsed = started.elapsed();
    let _ = stop.send(());
    running.await??;

    let (balances, stored_orders) = db
        .books(&workload.customer_prefix, &workload.order_prefix)
        .await?;
    let stored: BTreeMap<String, i64> = balances.into_iter().collect();
    let wrong = workload
        .expected
        .iter()
        .filter(|(c, cents)| stored.get(*c) != Some(cents))
        .count();
    let expected_cents: i64 = workload.expected.values().sum();
    let stored_cents: i64 = stored.values().sum();
    let exact =
        wrong == 0 && stored_orders == workload.orders as i64 && stored_cents == expected_cents;

    println!(
        "transport            {transport_name}, queue {}",
        settings.queue
    );
    println!(
        "delivered            {:>7}  ({:.0} msgs/s)",
        total + 1,
        (total + 1) as f64 / elapsed.as_secs_f64()
    );
    println!("processed            {:>7}", seen.processed);
    println!("duplicates skipped   {:>7}", seen.duplicates);
    println!(
        "dead-lettered        {:>7}  (rejected {}, conflict {}; see {}.dlq)",
        seen.dead_lettered, seen.rejected, seen.conflicts, settings.queue
    );
    println!("retried              {:>7}", seen.retried);
    println!(
        "orders stored        {:>7}  (expected {})",
        stored_orders, workload.orders
    );
    println!("cents booked    {stored_cents:>12}  (expected {expected_cents})");
    println!(
        "balances             {}",
        if exact {
            "exact".to_owned()
        } else {
            format!("WRONG ({wrong} customers off)")
        }
    );
    anyhow::ensure!(exact, "the books do not add up");
    Ok(())
}

/// Waits until `count` deliveries are settled for good.
async fn wait_for(stats: &idem::Stats, count: u64, deadline: Instant) -> anyhow::Result<Snapshot> {
    loop {
        let now = stats.snapshot();
        if now.settled() >= count {
            return Ok(now);
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out: {} of {count} deliveries settled ({now:?})",
            now.settled()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
