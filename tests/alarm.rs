//! A RabbitMQ resource alarm, raised for real (`rabbitmqctl set_vm_memory_high_watermark 0`)
//! while a runtime consumes and stages messages through the outbox: the broker stops taking
//! publishes, so consumption pauses (the dispatch queue is bounded and a full one holds the
//! commit path), nothing is lost or dead-lettered, and once the alarm is lifted everything
//! flows again on its own, each message applied once and each staged event published.
//!
//! Its own test binary: the alarm blocks every publisher on the broker, and cargo runs test
//! binaries one after another, so no other test publishes meanwhile; its tests take turns
//! ([`ONE_ALARM_AT_A_TIME`]).

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::{self, amqp_url};
use common::running::start;
use idem::rabbitmq::{PublishError, Publisher, RabbitConfig, RabbitTransport};
use idem::{Envelope, HandlerError, Outgoing, idempotent};
use std::collections::HashSet;
use std::time::{Duration, Instant};

const TABLE: &str = "idem_alarm_inbox";

/// Held by each test for as long as it raises the alarm: one alarm at a time.
static ONE_ALARM_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
const ORDERS: usize = 8_000;

#[derive(serde::Serialize, serde::Deserialize)]
struct Order {
    order_id: String,
}

/// Where the handler sends what it stages.
struct Target(String);

#[idempotent(store = Postgres, key = "order.order_id", queue = "idem-test-alarm-unset")]
async fn bill(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order: Order,
    ctx: &idem::Context<'_>,
    target: &Target,
) -> Result<(), HandlerError> {
    idem::outbox::stage(tx, ctx, Outgoing::to_queue(&target.0, &order)?).await?;
    Ok(())
}

/// The broker's memory alarm, raised for as long as it lives; dropping it (also when the test
/// panics) restores the watermark the broker had.
struct Alarm {
    restore: Vec<String>,
}

impl Alarm {
    fn raise() -> Self {
        let read = common::rabbitmqctl()
            .args(["eval", "vm_memory_monitor:get_vm_memory_high_watermark()."])
            .output()
            .expect("rabbitmqctl");
        assert!(read.status.success(), "rabbitmqctl eval: {read:?}");
        let current = String::from_utf8_lossy(&read.stdout).trim().to_owned();
        // `0.4`, or `{absolute,1073741824}`.
        let restore = match current.strip_prefix("{absolute,") {
            Some(bytes) => vec![
                "absolute".to_owned(),
                bytes.trim_end_matches('}').to_owned(),
            ],
            None => vec![current],
        };
        let alarm = Self { restore };
        let set = common::rabbitmqctl()
            .args(["set_vm_memory_high_watermark", "0"])
            .output()
            .expect("rabbitmqctl");
        assert!(
            set.status.success(),
            "set_vm_memory_high_watermark 0: {set:?}"
        );
        alarm
    }

    /// The broker's state of each connection whose name contains `name` (`running`,
    /// `blocking`: an alarm is in effect and it has not published since; `blocked`: it tried
    /// to publish under the alarm and the broker holds it).
    fn states_of(name: &str) -> Vec<String> {
        let listed = common::rabbitmqctl()
            .args(["list_connections", "-q", "-s", "client_properties", "state"])
            .output()
            .expect("rabbitmqctl");
        assert!(
            listed.status.success(),
            "rabbitmqctl list_connections: {listed:?}"
        );
        String::from_utf8_lossy(&listed.stdout)
            .lines()
            .filter(|l| l.contains(name))
            .filter_map(|l| l.rsplit('\t').next())
            .map(|state| state.trim().to_owned())
            .collect()
    }

    fn in_effect() -> bool {
        let alarms = common::rabbitmqctl()
            .args(["eval", "rabbit_alarm:get_alarms()."])
            .output()
            .expect("rabbitmqctl");
        String::from_utf8_lossy(&alarms.stdout).contains("memory")
    }
}

impl Drop for Alarm {
    fn drop(&mut self) {
        let lifted = common::rabbitmqctl()
            .arg("set_vm_memory_high_watermark")
            .args(&self.restore)
            .status();
        if !matches!(lifted, Ok(status) if status.success()) {
            eprintln!(
                "could not restore the broker's memory watermark ({:?}); run `rabbitmqctl set_vm_memory_high_watermark {}`",
                lifted,
                self.restore.join(" ")
            );
        }
    }
}

async fn applied(pool: &sqlx::PgPool) -> i64 {
    sqlx::query_scalar("SELECT count(*) FROM idem_alarm_inbox")
        .fetch_one(pool)
        .await
        .unwrap()
}

/// Through `build()` with the defaults: orders consumed while the broker refuses publishes
/// pause short of the end (bounded dispatch), none is dead-lettered and none of their events
/// gets out; once the alarm is lifted, every order is applied once and every event arrives.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_a_memory_alarm_consumption_pauses_and_resumes_with_nothing_lost() {
    let _turn = ONE_ALARM_AT_A_TIME.lock().await;
    let pool = common::postgres(2).await;
    let inbox = idem::sql::PgInbox::new(common::postgres(8).await)
        .table(TABLE)
        .unwrap();
    inbox.migrate().await.unwrap();
    sqlx::query("TRUNCATE idem_alarm_inbox, idem_alarm_outbox")
        .execute(&pool)
        .await
        .unwrap();
    let queue = common::unique("idem-test-alarm");
    let billed = format!("{queue}.billed");
    broker::declare_orders_queue(&queue).await;
    broker::declare_orders_queue(&billed).await;
    let publisher = broker::publisher().await;
    for n in 0..ORDERS {
        let order = Order {
            order_id: format!("{queue}-{n}"),
        };
        let message = Envelope::new(serde_json::to_vec(&order).unwrap())
            .with_message_id(order.order_id.clone());
        publisher
            .publish_unconfirmed(&queue, &message)
            .await
            .unwrap();
    }
    publisher.wait_for_confirms().await.unwrap();
    drop(publisher);

    let alarm = Alarm::raise();
    common::wait_until("the memory alarm", Duration::from_secs(20), || async {
        Alarm::in_effect()
    })
    .await;
    // A publish has a deadline: under the alarm it fails in time instead of waiting for ever.
    let probe = format!("{queue}.probe");
    broker::declare_orders_queue(&probe).await;
    let config = RabbitConfig::new(amqp_url()).publish_timeout(Duration::from_secs(2));
    let hurried = Publisher::connect(&config).await.unwrap();
    let started = Instant::now();
    let refused = hurried
        .publish(
            "",
            &probe,
            &Envelope::new(b"{}".to_vec()).with_message_id("probe"),
        )
        .await;
    assert!(
        matches!(
            refused,
            Err(PublishError::TimedOut(_) | PublishError::Blocked(_))
        ),
        "{refused:?}"
    );
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );

    let consumer = idem::registry::find("alarm::bill").unwrap().consumer();
    // Its connections are named after the queue: `{queue}:publisher` is the one its relay
    // publishes on.
    let runtime_config = RabbitConfig::new(amqp_url()).connection_name(&queue);
    let publishing = format!("{queue}:publisher");
    let running = start(
        idem::Runtime::builder()
            .transport(RabbitTransport::new(runtime_config))
            .store(inbox.clone())
            .state(Target(billed.clone()))
            .handlers([consumer])
            .handler_queue(consumer, &queue),
    );

    // The runtime's relay tried to publish and the broker holds its connection: the alarm, as
    // the broker reports it, is what stands in the runtime's way (a slow machine leaves it
    // `running`).
    common::wait_until(
        "the broker to block the runtime's publisher",
        Duration::from_secs(60),
        || async { Alarm::states_of(&publishing) == ["blocked"] },
    )
    .await;
    // Consumption pauses: the count of applied orders stops moving, short of the end, while
    // the broker blocks the publisher.
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut last, mut still) = (-1, 0);
    while still < 3 {
        assert!(Instant::now() < deadline, "consumption never paused");
        tokio::time::sleep(Duration::from_secs(1)).await;
        let now = applied(&pool).await;
        (last, still) = if now == last && now > 0 {
            (now, still + 1)
        } else {
            (now, 0)
        };
    }
    assert_eq!(
        Alarm::states_of(&publishing),
        ["blocked"],
        "the publisher was not blocked throughout the pause"
    );
    // Every applied order staged its event, and every one of them waits in the outbox: none
    // got out, none was lost. The queue still holds orders: the runtime stopped taking them,
    // they did not run out.
    let staged: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_alarm_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(
        staged, last,
        "the paused runtime's events are not all in its outbox"
    );
    let waiting = broker::count(&queue).await;
    assert!(waiting > 0, "no order left in the queue, {last} applied");
    // The bounds of the dispatch: 1,024 runs publishing from memory, 1,024 queued, four
    // passes of up to 256 runs, and what the workers and the prefetch hold.
    assert!(
        last < 4_000,
        "{last} of {ORDERS} orders were consumed while no event could be published: the dispatch is not bounded"
    );
    assert_eq!(
        broker::count(&billed).await,
        0,
        "an event got out during the alarm"
    );
    assert_eq!(broker::count(&format!("{queue}.dlq")).await, 0);
    assert!(
        !running.task.is_finished(),
        "the runtime stopped under the alarm"
    );
    eprintln!("paused at {last} of {ORDERS} orders applied");

    drop(alarm);
    // Once the alarm is lifted the broker lets the publisher go, and consumption resumes.
    common::wait_until(
        "the broker to unblock the runtime's publisher",
        Duration::from_secs(60),
        || async { Alarm::states_of(&publishing) == ["running"] },
    )
    .await;
    common::wait_until("every order applied", Duration::from_secs(120), || async {
        applied(&pool).await == ORDERS as i64
    })
    .await;
    common::wait_until(
        "every event published",
        Duration::from_secs(120),
        || async { broker::count(&billed).await >= ORDERS },
    )
    .await;
    running.shut_down().await;
    let events = broker::drain(&billed).await;
    let ids: HashSet<_> = events
        .iter()
        .map(|e| e.properties.message_id().as_ref().unwrap().to_string())
        .collect();
    assert_eq!(
        ids.len(),
        ORDERS,
        "every order's event, each id once at least"
    );
    assert_eq!(broker::count(&queue).await, 0);
    assert_eq!(broker::count(&format!("{queue}.dlq")).await, 0);
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_alarm_outbox")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(left, 0, "outbox rows left behind");
    broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
    broker::delete_topology(&billed, &[]).await;
    broker::delete_topology(&probe, &[]).await;
}

/// Fails the first time it sees a key (transiently), then succeeds.
#[idempotent(store = Postgres, key = "order.order_id", queue = "idem-test-alarm-unset")]
async fn flaky(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order: Order,
    seen: &Seen,
) -> Result<(), HandlerError> {
    match seen.0.lock().unwrap().insert(order.order_id) {
        true => Err(HandlerError::transient("the first run fails")),
        false => Ok(()),
    }
}

/// The keys `flaky` has seen.
#[derive(Default)]
struct Seen(std::sync::Mutex<HashSet<String>>);

/// A retry copy published while the broker's memory alarm blocks publishes has the deadline of
/// every publish (the publish timeout): its settlement fails in time (counted), the delivery
/// goes back to the queue, and the worker moves on instead of waiting for ever. The second run
/// succeeds and is acked (acks are not publishes), all while the alarm lasts.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_under_a_memory_alarm_has_a_deadline() {
    let _turn = ONE_ALARM_AT_A_TIME.lock().await;
    let inbox = idem::sql::PgInbox::new(common::postgres(4).await)
        .table(TABLE)
        .unwrap();
    inbox.migrate().await.unwrap();
    let queue = common::unique("idem-test-alarm-retry");
    broker::declare_orders_queue(&queue).await;
    let id = format!("{queue}-0");
    let order = serde_json::to_vec(&Order {
        order_id: id.clone(),
    })
    .unwrap();
    broker::publish(&broker::publisher().await, &queue, Some(&id), &order).await;

    let alarm = Alarm::raise();
    common::wait_until("the memory alarm", Duration::from_secs(20), || async {
        Alarm::in_effect()
    })
    .await;
    let consumer = idem::registry::find("alarm::flaky").unwrap().consumer();
    let timeout = Duration::from_secs(2);
    let config = RabbitConfig::new(amqp_url()).publish_timeout(timeout);
    let started = Instant::now();
    let running = start(
        idem::Runtime::builder()
            .transport(RabbitTransport::new(config))
            .store(inbox)
            .state(Seen::default())
            .handlers([consumer])
            .handler_queue(consumer, &queue),
    );
    common::wait_until(
        "the retry's settlement failing in time",
        Duration::from_secs(30),
        || async { running.now().settle_failures >= 1 },
    )
    .await;
    common::wait_until("the second run acked", Duration::from_secs(30), || async {
        running.now().processed == 1
    })
    .await;
    assert!(Alarm::in_effect(), "the alarm lasted");
    assert!(
        started.elapsed() < timeout * 10,
        "{:?} for a {timeout:?} deadline",
        started.elapsed()
    );
    drop(alarm);
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.retried, seen.settle_failures, seen.dead_lettered),
        (1, 1, 0),
        "{seen:?}"
    );
    assert_eq!(broker::count(&queue).await, 0);
    broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
}
