//! The demo: orders with duplicates (some delivered concurrently), malformed messages and a
//! reused id, and the status updates of every fourth order (with copies and late copies),
//! published to the broker, consumed by the runtime, then the books and the statuses are
//! checked.

use crate::handlers::OrderPlaced;
use crate::status::{self, StatusUpdate};
use crate::{Broker, Db, Settings};
use anyhow::Context as _;
use idem::nats::NatsTransport;
use idem::rabbitmq::Publisher;
use idem::transport::{MemoryTransport, QueueSpec, Transport};
use idem::{Destination, Envelope, Outgoing, RetryPolicy, Snapshot};
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
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

impl Options {
    /// The options of `orders` run without a subcommand (the README's quick start): their
    /// defaults, as `ORDERS_COUNT` and `ORDERS_DUP_RATE` change them.
    pub fn from_env() -> Result<Self, clap::Error> {
        #[derive(clap::Parser)]
        struct Only {
            #[command(flatten)]
            options: Options,
        }
        <Only as clap::Parser>::try_parse_from(["orders"]).map(|only| only.options)
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

/// The statuses an order goes through, as versions 1, 2, …
const STATUSES: [&str; 4] = ["placed", "paid", "packed", "shipped"];

/// The messages of one run and what the books must show afterwards.
struct Workload {
    deliveries: Vec<Envelope>,
    /// Status updates, routing key = order id, in publish order.
    statuses: Vec<Envelope>,
    /// The orders that get status updates.
    status_orders: Vec<String>,
    reused_id: Envelope,
    expected: BTreeMap<String, i64>,
    /// Orders per customer: the parcels shipping must count.
    expected_parcels: BTreeMap<String, i64>,
    /// Every order once, with its amount, sorted: the ledger's rows.
    expected_ledger: Vec<(String, i64)>,
    orders: usize,
    customer_prefix: String,
    order_prefix: String,
}

fn status_message(update: &StatusUpdate) -> Envelope {
    let body = serde_json::to_vec(update).unwrap_or_default();
    Envelope::new(body)
        .with_message_id(format!("{}:{}", update.order_id, update.version))
        .with_content_type("application/json")
        .with_routing_key(update.order_id.as_str())
}

/// Every fourth order's updates, each version of every order before the next version of any,
/// some copied back to back; then late copies of some early versions (duplicates, never
/// applied over a later version).
fn status_updates(orders: &[String], rng: &mut Rng, dup_rate: f64) -> Vec<Envelope> {
    let mut messages = Vec::new();
    let mut late = Vec::new();
    for (version, status) in (1..).zip(STATUSES) {
        for order_id in orders {
            let update = status_message(&StatusUpdate {
                order_id: order_id.clone(),
                status: status.to_owned(),
                version,
            });
            while rng.chance(dup_rate) {
                messages.push(update.clone());
            }
            if version < 3 && rng.chance(dup_rate / 2.0) {
                late.push(update.clone());
            }
            messages.push(update);
        }
    }
    messages.extend(late);
    messages
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
        let mut expected_parcels = BTreeMap::new();
        let mut expected_ledger = Vec::new();
        let mut bursts = Vec::new();
        let status_orders: Vec<String> = (0..options.orders)
            .step_by(4)
            .map(|n| format!("{order_prefix}{n}"))
            .collect();
        let statuses = status_updates(&status_orders, &mut rng, options.dup_rate);
        for n in 0..options.orders {
            let order = OrderPlaced {
                order_id: format!("{order_prefix}{n}"),
                customer: format!("{customer_prefix}{}", rng.next() % 50),
                amount_cents: (rng.next() % 10_000) as i64 + 1,
            };
            *expected.entry(order.customer.clone()).or_default() += order.amount_cents;
            *expected_parcels.entry(order.customer.clone()).or_default() += 1;
            expected_ledger.push((order.order_id.clone(), order.amount_cents));
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
            statuses,
            status_orders,
            reused_id: order_message(&reused),
            expected,
            expected_parcels,
            expected_ledger: {
                expected_ledger.sort_unstable();
                expected_ledger
            },
            orders: options.orders,
            customer_prefix,
            order_prefix,
        }
    }
}

/// Where the demo publishes.
enum Sink {
    /// Each copy of a message gets its own JetStream id (`<message id>#<n>`): JetStream would
    /// drop a second publish of one id itself, and the demo's copies are for the inbox.
    Nats(Box<NatsTransport>, Mutex<HashMap<String, u32>>),
    Rabbit(Publisher),
    Memory(MemoryTransport),
}

/// Publishes `messages` to NATS, each to the subject of the topic `exchange` and its routing
/// key (or of the queue its routing key names, when `exchange` is empty), each copy with its own JetStream id, counted in `copies`.
async fn publish_to_nats(
    transport: &NatsTransport,
    copies: &Mutex<HashMap<String, u32>>,
    exchange: &str,
    messages: &[Envelope],
) -> anyhow::Result<()> {
    for message in messages {
        let key = message.routing_key.as_deref().unwrap_or_default();
        let subject = transport.subject(&Destination::from_parts(exchange, key));
        let msg_id = message.message_id.as_ref().map(|id| {
            let mut seen = copies.lock().unwrap_or_else(|e| e.into_inner());
            let n = seen.entry(id.clone()).or_default();
            *n += 1;
            format!("{id}#{n}")
        });
        let duplicate = transport
            .publish(&subject, message, msg_id.as_deref())
            .await?;
        anyhow::ensure!(!duplicate, "JetStream dropped a copy the demo counts on");
    }
    Ok(())
}

impl Sink {
    async fn send_all(&self, queue: &str, messages: &[Envelope]) -> anyhow::Result<()> {
        match self {
            Self::Memory(transport) => messages
                .iter()
                .for_each(|m| transport.publish(queue, m.clone())),
            Self::Nats(transport, copies) => {
                let routed: Vec<Envelope> = messages
                    .iter()
                    .map(|m| m.clone().with_routing_key(queue))
                    .collect();
                publish_to_nats(transport, copies, "", &routed).await?;
            }
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

    /// Publishes a parked message's release (`idem::transport::release`), with its
    /// copy id where the broker has a duplicate window.
    async fn release(&self, message: Outgoing) -> anyhow::Result<()> {
        let outbound = match self {
            Self::Memory(transport) => transport.outbound(),
            Self::Nats(transport, _) => transport.outbound(),
            Self::Rabbit(publisher) => {
                let (exchange, key) = message.destination.parts();
                publisher
                    .publish_unconfirmed_to(exchange, key, &message.envelope)
                    .await?;
                publisher.wait_for_confirms().await?;
                return Ok(());
            }
        };
        let outbound = outbound.context("the transport cannot publish")?;
        outbound.publish(&message).await?;
        Ok(())
    }

    /// Publishes `messages` to `exchange`, each with its own routing key.
    async fn send_routed(&self, exchange: &str, messages: &[Envelope]) -> anyhow::Result<()> {
        match self {
            Self::Memory(transport) => messages
                .iter()
                .for_each(|m| transport.publish(exchange, m.clone())),
            Self::Nats(transport, copies) => {
                publish_to_nats(transport, copies, exchange, messages).await?;
            }
            Self::Rabbit(publisher) => {
                for chunk in messages.chunks(500) {
                    for message in chunk {
                        let key = message.routing_key.as_deref().unwrap_or_default();
                        publisher
                            .publish_unconfirmed_to(exchange, key, message)
                            .await?;
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
    let exchange = status::exchange(&settings.queue);
    let mut specs = QueueSpec::partitions(&exchange, status::CONSUMER, settings.status_partitions);
    specs.push(spec);
    // The second hop's queue exists before the first order is billed: an event staged for a
    // queue nobody declared would be unroutable (kept in the outbox and retried).
    let billed = crate::handlers::Billing::of(&settings.queue).queue;
    let mut billed_spec = QueueSpec::new(billed.clone(), crate::shipping::CONSUMER);
    billed_spec.retry_delays = RetryPolicy::default().delays();
    specs.push(billed_spec);
    let (runtime, sink, transport_name) = match Broker::open(settings).await? {
        Broker::Nats(transport) => {
            clear_streams(&transport, settings, &exchange, &billed).await?;
            transport.declare(&specs).await?;
            (
                builder.transport(transport.clone()).build()?,
                Sink::Nats(Box::new(transport), Mutex::default()),
                "NATS JetStream",
            )
        }
        Broker::Rabbit(rabbit) => {
            let (transport, publisher) = *rabbit;
            clear_queues(settings, &exchange, &billed).await?;
            transport.declare(&specs).await?;
            (
                builder.transport(transport).build()?,
                Sink::Rabbit(publisher),
                "RabbitMQ",
            )
        }
        Broker::Memory(transport) => {
            transport.declare(&specs).await?;
            (
                builder.transport(transport.clone()).build()?,
                Sink::Memory(transport),
                "in-memory transport",
            )
        }
    };
    let stats = runtime.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let running = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));

    let started = Instant::now();
    let deadline = started + Duration::from_secs(options.timeout_secs);
    sink.send_all(&settings.queue, &workload.deliveries).await?;
    sink.send_routed(&exchange, &workload.statuses).await?;
    // Every order delivered, every status update, and one `OrderBilled` per order.
    let total = (workload.deliveries.len() + workload.statuses.len() + workload.orders) as u64;
    wait_for(&stats, total, deadline).await?;
    // The counts may include what an earlier run left in the outbox; the books are this run's.
    wait_for_books(db, &workload, deadline).await?;
    // Once the original is in, a producer reuses its id for other content: a conflict, dead-lettered.
    sink.send_all(&settings.queue, std::slice::from_ref(&workload.reused_id))
        .await?;
    let seen = wait_for(&stats, total + 1, deadline).await?;
    let shipping = loop {
        let shipping = db
            .shipping(&workload.customer_prefix, &workload.order_prefix)
            .await?;
        if shipping.unpublished == 0 || Instant::now() >= deadline {
            break shipping;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let elapsed = started.elapsed();
    // Last, an order whose update 2 is malformed: its key parks, and is released.
    let parked_order = format!("{}parked", workload.order_prefix);
    sink.send_routed(&exchange, &crate::parked::updates(&parked_order))
        .await?;
    let parked =
        crate::parked::park_and_release(db, &stats, &parked_order, deadline, |m| sink.release(m))
            .await?;
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
    let statuses_wrong = statuses_off(&workload, &db.statuses(&workload.order_prefix).await?);
    // The ledger and the shipment log have no unique key: an order booked or shipped twice
    // would be there twice, one never booked or shipped missing.
    let ledger = Off::of(
        &workload.expected_ledger,
        &db.ledger(&workload.order_prefix).await?,
    );
    let expected_shipped: Vec<String> = workload
        .expected_ledger
        .iter()
        .map(|(order, _)| order.clone())
        .collect();
    let shipment_log = Off::of(&expected_shipped, &shipping.log);

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
        "status updates       {:>7}  (orders {}, {} partitions of {exchange}; each order's versions applied once, in order: {})",
        workload.statuses.len(),
        workload.status_orders.len(),
        settings.status_partitions,
        if statuses_wrong == 0 {
            "exact".to_owned()
        } else {
            format!("WRONG ({statuses_wrong} orders off)")
        }
    );
    println!(
        "balances             {}",
        if exact {
            "exact".to_owned()
        } else {
            format!("WRONG ({wrong} customers off)")
        }
    );
    println!(
        "ledger               {ledger}  ({} rows: one per order booked)",
        ledger.rows
    );
    let parcels_wrong = workload
        .expected_parcels
        .iter()
        .filter(|(c, n)| shipping.parcels.get(*c) != Some(n))
        .count();
    let shipped = shipping.shipments == workload.orders as i64
        && parcels_wrong == 0
        && shipping.unpublished == 0;
    println!(
        "shipments stored     {:>7}  (expected {}; billed through the outbox to {billed})",
        shipping.shipments, workload.orders
    );
    println!(
        "parcels              {}",
        if parcels_wrong == 0 {
            "exact".to_owned()
        } else {
            format!("WRONG ({parcels_wrong} customers off)")
        }
    );
    println!(
        "shipment log         {shipment_log}  ({} rows: one per order shipped)",
        shipment_log.rows
    );
    println!("outbox unpublished   {:>7}", shipping.unpublished);
    let key = &parked.key;
    println!(
        "parked key           {}: update 2 dead-lettered ({}), {} later updates parked behind it, not applied (applied: {:?})",
        key.order_key,
        key.reason.split(':').next().unwrap_or_default(),
        key.depth,
        parked.while_parked
    );
    println!(
        "                     an operator releases it: idem dlq skip --queue {} --key {} --reason \"...\" (or, once fixed, idem dlq replay --queue {} --key {})",
        key.source, key.order_key, key.source, key.order_key
    );
    println!(
        "released             {:?}  (skipped update 2 as that command does; 3 and 4 applied after 1, in order, once each)",
        parked.released
    );
    anyhow::ensure!(exact, "the books do not add up");
    anyhow::ensure!(
        ledger.exact(),
        "the ledger is not every order once: {ledger}"
    );
    anyhow::ensure!(shipped, "the shipping books do not add up");
    anyhow::ensure!(
        shipment_log.exact(),
        "the shipment log is not every order once: {shipment_log}"
    );
    anyhow::ensure!(
        statuses_wrong == 0,
        "the status updates were not applied once each in order"
    );
    anyhow::ensure!(
        parked.while_parked == [1] && parked.released == [1, 3, 4],
        "the parked key was not held and released in order: {:?}, then {:?}",
        parked.while_parked,
        parked.released
    );
    Ok(())
}

/// How a log without a unique key differs from what it must hold: every expected row once.
struct Off {
    /// Rows found.
    rows: usize,
    /// Expected rows found more than once (each counted once).
    doubled: usize,
    /// Expected rows not found.
    missing: usize,
    /// Rows found that were not expected.
    strange: usize,
}

impl Off {
    /// Compares `found` with `expected` (each row once) as multisets.
    fn of<T: Ord>(expected: &[T], found: &[T]) -> Self {
        let mut seen: BTreeMap<&T, usize> = BTreeMap::new();
        for row in found {
            *seen.entry(row).or_default() += 1;
        }
        let mut off = Self {
            rows: found.len(),
            doubled: 0,
            missing: 0,
            strange: 0,
        };
        for row in expected {
            match seen.remove(row) {
                None => off.missing += 1,
                Some(1) => {}
                Some(_) => off.doubled += 1,
            }
        }
        off.strange = seen.len();
        off
    }

    fn exact(&self) -> bool {
        self.doubled == 0 && self.missing == 0 && self.strange == 0
    }
}

impl std::fmt::Display for Off {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.exact() {
            f.write_str("exact")
        } else {
            write!(
                f,
                "WRONG ({} twice or more, {} missing, {} unexpected)",
                self.doubled, self.missing, self.strange
            )
        }
    }
}

/// The orders of `workload` whose status updates are not all applied once, in order.
fn statuses_off(workload: &Workload, statuses: &crate::db::Statuses) -> usize {
    let all_versions: Vec<i64> = (1..=STATUSES.len() as i64).collect();
    let last = (
        STATUSES[STATUSES.len() - 1].to_owned(),
        all_versions.len() as i64,
    );
    workload
        .status_orders
        .iter()
        .filter(|order| {
            statuses.current.get(*order) != Some(&last)
                || statuses.applied.get(*order) != Some(&all_versions)
        })
        .count()
}

/// Waits until this run's own orders, status updates and shipments are all stored.
async fn wait_for_books(db: &Db, workload: &Workload, deadline: Instant) -> anyhow::Result<()> {
    let (customers, orders) = (&workload.customer_prefix, &workload.order_prefix);
    loop {
        let (_, stored) = db.books(customers, orders).await?;
        let statuses_off = statuses_off(workload, &db.statuses(orders).await?);
        let shipped = db.shipping(customers, orders).await?.shipments;
        let expected = workload.orders as i64;
        if stored == expected && statuses_off == 0 && shipped == expected {
            return Ok(());
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out: {stored} of {expected} orders stored, {shipped} shipped, the statuses of {statuses_off} orders incomplete"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Deletes the demo's queues (orders, billed, every status partition, with their retry and
/// dead-letter queues) and the status exchange, so that nothing an earlier run left (an
/// interrupted run's deliveries, another partition count) counts in this one; says how many
/// messages it removed.
async fn clear_queues(settings: &Settings, exchange: &str, billed: &str) -> anyhow::Result<()> {
    use lapin::options::{ExchangeDeleteOptions, QueueDeleteOptions};
    use lapin::types::ShortString;
    let connection =
        lapin::Connection::connect(&settings.amqp_url, lapin::ConnectionProperties::default())
            .await?;
    let channel = connection.create_channel().await?;
    let mut queues = vec![settings.queue.clone(), billed.to_owned()];
    queues.extend(
        (0..idem::MAX_PARTITIONS).map(|i| idem::transport::Partition::queue_name(exchange, i)),
    );
    let mut names = Vec::new();
    for queue in &queues {
        names.push(idem::rabbitmq::dlq(queue));
        for delay in RetryPolicy::default().delays() {
            names.push(idem::rabbitmq::retry_queue(queue, delay));
        }
        names.push(queue.clone());
    }
    let mut removed = 0;
    for name in &names {
        let deleting = channel.queue_delete(
            ShortString::from(name.as_str()),
            QueueDeleteOptions::default(),
        );
        removed += deleting.await?;
    }
    let deleting = channel.exchange_delete(
        ShortString::from(exchange),
        ExchangeDeleteOptions::default(),
    );
    deleting.await?;
    let _ = connection.close(200, ShortString::from("cleared")).await;
    if removed > 0 {
        println!(
            "cleared the demo's queues first: {removed} messages an earlier run left in `{}`, `{billed}` and `{exchange}.p*` (and their retry and dead-letter queues)",
            settings.queue
        );
    }
    Ok(())
}

/// As [`clear_queues`], on NATS: deletes the streams of the demo's queues and status
/// partitions (with their retry and dead-letter streams), and the partition count the server
/// recorded.
async fn clear_streams(
    transport: &NatsTransport,
    settings: &Settings,
    exchange: &str,
    billed: &str,
) -> anyhow::Result<()> {
    let mut queues = vec![settings.queue.clone(), billed.to_owned()];
    queues.extend(
        (0..idem::MAX_PARTITIONS).map(|i| idem::transport::Partition::queue_name(exchange, i)),
    );
    let mut removed = 0;
    for queue in &queues {
        removed += transport.delete_queue(queue).await?;
    }
    // The status partitions' count the server recorded: this run may use another.
    transport.delete_source(exchange).await?;
    if removed > 0 {
        println!(
            "cleared the demo's streams first: {removed} messages an earlier run left in `{}`, `{billed}` and `{exchange}.p*` (and their retry and dead-letter streams)",
            settings.queue
        );
    }
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
