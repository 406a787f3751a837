//! The poison limit with real `orders consume` processes:
//! - a message that crashes its consumer every time (fault injection before the commit), on a
//!   classic queue and on NATS JetStream, is dead-lettered as `poison` once its handler started on redeliveries more
//!   often than the limit without settling (the first delivery's run is not recorded), and the
//!   queue moves on;
//! - deliveries that were never handed to a handler (waiting behind a stuck one in a killed
//!   process, or given back at a graceful stop) never count, however often that happens;
//! - a redelivered copy of a completed key is a duplicate, whatever its count;
//! - on NATS, a message whose consumer died after publishing its dead letter is in the
//!   dead-letter stream once, however late it comes back.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::{self, amqp_url};
use common::bus::Bus;
use idem::rabbitmq::QueueType;
use idem::{DEFAULT_POISON_LIMIT, RetryPolicy};
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_message_that_kills_its_consumer_ends_in_the_dlq_as_poison() {
    poison_ends_in_the_dlq(Bus::rabbit(&amqp_url(), QueueType::Classic).await, &[]).await;
}

/// The same on NATS JetStream, where a killed consumer's delivery comes back once its ack wait
/// has passed. The ack wait is 2 s instead of the default 10 s: what is checked is how many
/// redeliveries count, not how long JetStream waits before each, and six waits of 10 s made
/// this the suite's slowest test.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_nats_a_message_that_kills_its_consumer_ends_in_the_dlq_as_poison() {
    poison_ends_in_the_dlq(Bus::nats().await, &[("ORDERS_ACK_WAIT_SECS", "2")]).await;
}

/// On NATS, a message whose consumer died between publishing its dead letter and acking it,
/// delivered again after the duplicate window its dead-letter stream had, is in that stream
/// once. The window is set to 1 s before the run, standing for the server's default of 2
/// minutes having passed (the fleet was down, the server restarted): the consumer widens it
/// to a day, and the copy its successor publishes under the same `Nats-Msg-Id` is dropped.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_nats_a_dead_letter_delivered_again_late_lands_once() {
    let bus = Bus::nats().await;
    let binary = common::faulty_orders::build();
    let queue = common::unique("idem-late-dlq");
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("orders.db");
    bus.declare(&queue).await;
    let short = Duration::from_secs(1);
    assert_eq!(bus.dead_letter_window(&queue, Some(short)).await, short);
    let id = format!("{queue}-malformed");
    bus.publish(
        &queue,
        &idem::Envelope::new("not json").with_message_id(&id),
        0,
    )
    .await;
    let consume = |fault: &str| {
        consume_faulty(
            &binary,
            &bus,
            &queue,
            &database,
            fault,
            &[("ORDERS_ACK_WAIT_SECS", "2")],
        )
    };
    // The first consumer publishes the dead letter, then dies before its ack.
    let mut first = consume("in_dead_letter=1");
    exited(&mut first, Duration::from_secs(60)).await;
    assert_eq!(
        first.wait().unwrap().signal(),
        Some(6),
        "died in dead-lettering"
    );
    assert_eq!(bus.dead(&queue).await, 1, "the dead letter was published");
    assert_eq!(
        bus.dead_letter_window(&queue, None).await,
        idem::nats::DEAD_LETTER_DUPLICATE_WINDOW,
        "the consumer widened the window"
    );
    // Its successor gets the message again once the ack wait has passed, later than the 1 s
    // the window had, dead-letters it again and acks it.
    let second = common::KillOnDrop(consume(""));
    let bus_ref = &bus;
    let queue_ref = &queue;
    common::wait_until(
        "the message settled",
        Duration::from_secs(60),
        || async move { bus_ref.left(&[queue_ref]).await == 0 },
    )
    .await;
    drop(second);
    let letters = bus.dead_letters(&queue).await;
    assert_eq!(
        letters
            .iter()
            .map(|l| l.message_id.clone())
            .collect::<Vec<_>>(),
        [Some(id)],
        "dead-lettered once: {:?}",
        letters.iter().map(|l| &l.copy).collect::<Vec<_>>()
    );
    bus.delete(&queue).await;
}

async fn poison_ends_in_the_dlq(bus: Bus, env: &[(&str, &str)]) {
    let binary = common::faulty_orders::build();
    let queue = common::unique("idem-poison");
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("orders.db");
    bus.declare(&queue).await;
    let order = |id: &str| {
        let body =
            serde_json::json!({"order_id": id, "customer": "c", "amount_cents": 5}).to_string();
        idem::Envelope::new(body).with_message_id(id)
    };
    let poison = format!("{queue}-poison");
    bus.publish(&queue, &order(&poison), 0).await;
    bus.confirm().await;
    let consume = |fault: &str| consume_faulty(&binary, &bus, &queue, &database, fault, env);
    let started = Instant::now();
    let mut crashes = 0;
    // Every commit aborts the process: each run dies on the message, until it is refused.
    while bus.dead(&queue).await == 0 {
        assert!(
            started.elapsed() < Duration::from_secs(120),
            "never dead-lettered ({crashes} crashes)"
        );
        assert!(
            crashes <= DEFAULT_POISON_LIMIT + 1,
            "{crashes} crashes and still delivered"
        );
        let mut child = consume("before_commit=1");
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(status) = child.try_wait().unwrap() {
                assert_eq!(
                    status.signal(),
                    Some(6),
                    "the consumer aborts on the message"
                );
                crashes += 1;
                break;
            }
            if bus.dead(&queue).await > 0 || Instant::now() > deadline {
                child.kill().unwrap();
                child.wait().unwrap();
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
    assert_eq!(
        crashes,
        DEFAULT_POISON_LIMIT + 1,
        "the first delivery's crash, then one per counted redelivery up to the limit"
    );
    assert_eq!(bus.dead(&queue).await, 1, "dead-lettered once");
    let pool = idem::sql::sqlite::pool(&database.to_string_lossy())
        .await
        .unwrap();
    let records = idem::sql::SqliteInbox::new(pool.clone())
        .dead_letters(&queue)
        .await
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(
        (records[0].reason.as_str(), records[0].key.as_str()),
        ("poison", poison.as_str())
    );
    let dead = bus.dead_letters(&queue).await;
    assert!(records[0].describes(Some(&poison), &dead[0].body));

    // The queue moves on: the next order is processed by a healthy consumer.
    let next = format!("{queue}-next");
    bus.publish(&queue, &order(&next), 0).await;
    bus.confirm().await;
    let healthy = common::KillOnDrop(consume(""));
    let stored = |id: String| {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE order_id = $1")
                .bind(id)
                .fetch_one(&pool)
                .await
                .unwrap_or(0)
        }
    };
    common::wait_until("the next order stored", Duration::from_secs(30), || {
        let stored = stored(next.clone());
        async move { stored.await == 1 }
    })
    .await;
    drop(healthy);
    assert_eq!(
        stored(poison.clone()).await,
        0,
        "the poison message never committed"
    );
    bus.delete(&queue).await;
}

/// `binary` (the orders example with fault injection) consuming `queue` on `bus`, its tables and
/// inbox at `database`, with faults `fault` and the settings `env`.
fn consume_faulty(
    binary: &std::path::Path,
    bus: &Bus,
    queue: &str,
    database: &std::path::Path,
    fault: &str,
    env: &[(&str, &str)],
) -> Child {
    let mut command = Command::new(binary);
    bus.point(&mut command);
    command
        .arg("consume")
        .env("DATABASE_URL", database)
        .env("ORDERS_QUEUE", queue)
        .env("IDEM_FAULT", fault)
        .envs(env.iter().copied())
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// The orders example's `consume` on `queue`, its tables and inbox at `database`, one worker.
fn consume_one_at_a_time(queue: &str, database: &str) -> Child {
    Command::new(common::orders_example())
        .arg("consume")
        .env("AMQP_URL", amqp_url())
        .env("DATABASE_URL", database)
        .env("ORDERS_QUEUE", queue)
        .env("ORDERS_CONCURRENCY", "1")
        .env("RUST_LOG", "error")
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap()
}

/// Waits for `child` to exit, failing after `deadline`.
async fn exited(child: &mut Child, deadline: Duration) -> std::process::ExitStatus {
    let mut status = None;
    common::wait_until("the consumer to exit", deadline, || {
        status = child.try_wait().unwrap();
        let gone = status.is_some();
        async move { gone }
    })
    .await;
    status.unwrap()
}

/// Process churn: 20 orders of one customer whose balance row the test keeps locked, so that a
/// consumer (one worker) has one order stuck in its handler and its prefetch waiting behind it. The
/// consumer is stopped twelve times, more than twice the poison limit: with SIGKILL (the stuck
/// run dies unsettled, the waiting deliveries were never started), and with SIGTERM while the
/// lock is let go (the stuck order commits and the graceful stop gives the waiting ones back).
/// Every order is a redelivery many times over, none is refused, and every order is applied
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn deliveries_never_handed_to_a_handler_do_not_count() {
    const ORDERS: usize = 20;
    let schema = common::OwnSchema::create("idem_churn", 2).await;
    let queue = common::unique("idem-churn");
    let customer = format!("{queue}-c");
    for table in [
        "CREATE TABLE orders (order_id TEXT PRIMARY KEY, customer TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
        "CREATE TABLE balances (customer TEXT PRIMARY KEY, cents BIGINT NOT NULL)",
    ] {
        sqlx::query(table).execute(&schema.pool).await.unwrap();
    }
    sqlx::query("INSERT INTO balances (customer, cents) VALUES ($1, 0)")
        .bind(&customer)
        .execute(&schema.pool)
        .await
        .unwrap();
    broker::declare_orders_queue(&queue).await;
    let publisher = broker::publisher().await;
    for n in 0..ORDERS {
        let id = format!("{queue}-{n}");
        let body = serde_json::json!({"order_id": id, "customer": customer, "amount_cents": 1});
        broker::publish(&publisher, &queue, Some(&id), body.to_string().as_bytes()).await;
    }
    let observer = common::postgres(1).await;
    // Whether a session waits for the test's lock (other tests hold locks of their own).
    let stuck = |holder: i32| {
        let observer = observer.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(holder)
            .fetch_one(&observer)
            .await
            .unwrap()
                >= 1
        }
    };
    let dlq = idem::rabbitmq::dlq(&queue);
    let rounds = 2 * (DEFAULT_POISON_LIMIT as usize + 1);
    for round in 0..rounds {
        let mut lock = schema.pool.begin().await.unwrap();
        sqlx::query("SELECT cents FROM balances WHERE customer = $1 FOR UPDATE")
            .bind(&customer)
            .fetch_one(&mut *lock)
            .await
            .unwrap();
        let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *lock)
            .await
            .unwrap();
        let mut child = common::KillOnDrop(consume_one_at_a_time(&queue, &schema.url));
        let queue_ref = &queue;
        common::wait_until(
            "orders delivered to the consumer, one stuck in its handler and more waiting",
            Duration::from_secs(60),
            || async move { stuck(holder).await && broker::unacked(queue_ref) >= 2 },
        )
        .await;
        if round % 2 == 0 {
            child.0.kill().unwrap();
            lock.rollback().await.unwrap();
        } else {
            // A graceful stop: the stuck order finishes once the lock goes, the rest go back.
            let pid = i32::try_from(child.0.id()).unwrap();
            assert!(
                Command::new("kill")
                    .args(["-TERM", &pid.to_string()])
                    .status()
                    .unwrap()
                    .success()
            );
            lock.rollback().await.unwrap();
        }
        let status = exited(&mut child.0, Duration::from_secs(30)).await;
        // SIGTERM is a graceful stop (`idem::shutdown_signal`): the process ends by itself,
        // with success, not by the signal's default action.
        if round % 2 == 1 {
            assert!(
                status.success(),
                "round {round}: SIGTERM ended it with {status}"
            );
        }
        assert_eq!(
            broker::count(&dlq).await,
            0,
            "round {round}: an order was dead-lettered"
        );
    }

    let healthy = common::KillOnDrop(consume_one_at_a_time(&queue, &schema.url));
    let pool = schema.pool.clone();
    common::wait_until("every order applied", Duration::from_secs(60), || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders")
                .fetch_one(&pool)
                .await
                .unwrap()
                == ORDERS as i64
        }
    })
    .await;
    drop(healthy);
    let cents: i64 = sqlx::query_scalar("SELECT cents FROM balances WHERE customer = $1")
        .bind(&customer)
        .fetch_one(&schema.pool)
        .await
        .unwrap();
    assert_eq!(cents, ORDERS as i64, "every order applied once");
    assert_eq!(broker::count(&dlq).await, 0, "nothing dead-lettered");
    broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
    schema.drop().await;
}

/// A completed order whose poison-limit count is far past the limit (as churn, or an earlier
/// version of idem that never removed counts, can leave it): a redelivered copy of it is acked
/// as a duplicate, not refused as poison.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_redelivered_copy_of_a_completed_key_is_a_duplicate_whatever_its_count() {
    let queue = common::unique("idem-counted");
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("orders.db").to_string_lossy().into_owned();
    broker::declare_orders_queue(&queue).await;
    let publisher = broker::publisher().await;
    let id = format!("{queue}-order");
    let body = serde_json::json!({"order_id": id, "customer": "c", "amount_cents": 7}).to_string();
    broker::publish(&publisher, &queue, Some(&id), body.as_bytes()).await;
    let pool = idem::sql::sqlite::pool(&database).await.unwrap();
    let applied = |pool: sqlx::SqlitePool, id: String| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders WHERE order_id = $1")
            .bind(id)
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
    };
    let consumer = common::KillOnDrop(consume_one_at_a_time(&queue, &database));
    common::wait_until("the order applied", Duration::from_secs(30), || {
        let applied = applied(pool.clone(), id.clone());
        async move { applied.await == 1 }
    })
    .await;
    drop(consumer);
    // The example's order handler is the consumer `orders`.
    sqlx::query(
        "INSERT INTO idem_inbox_deliveries (consumer, key, deliveries, expires_at) VALUES ($1, $2, 100, $3)",
    )
    .bind("orders")
    .bind(&id)
    .bind(i64::MAX / 2)
    .execute(&pool)
    .await
    .unwrap();

    // A copy, given back once so that the broker flags it redelivered.
    broker::publish(&publisher, &queue, Some(&id), body.as_bytes()).await;
    assert!(broker::give_back(&queue, Duration::from_secs(10)).await);

    let consumer = common::KillOnDrop(consume_one_at_a_time(&queue, &database));
    let queue_ref = &queue;
    common::wait_until("the copy settled", Duration::from_secs(30), || async move {
        broker::count(queue_ref).await == 0 && broker::unacked(queue_ref) == 0
    })
    .await;
    drop(consumer);
    assert_eq!(
        broker::count(&idem::rabbitmq::dlq(&queue)).await,
        0,
        "refused"
    );
    assert_eq!(applied(pool.clone(), id.clone()).await, 1);
    let cents: i64 = sqlx::query_scalar("SELECT cents FROM balances WHERE customer = 'c'")
        .fetch_one(&pool)
        .await
        .unwrap();
    assert_eq!(cents, 7, "applied once");
    broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
}

/// Batch mode: a batch of 50 orders, one of which (the tenth) waits in its handler for a row the
/// test keeps locked. The consumer is killed while it waits, again and again. Only the handler
/// that started counts: the stuck order is refused as `poison` once it started on redeliveries
/// more often than the limit, and the 49 others (those before it and those behind it, which
/// never started) are each applied once and never dead-lettered.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn in_batch_mode_only_the_member_that_started_counts() {
    const ORDERS: usize = 50;
    let schema = common::OwnSchema::create("idem_batch_poison", 2).await;
    let queue = common::unique("idem-batch-poison");
    let (free, locked) = (format!("{queue}-free"), format!("{queue}-locked"));
    for table in [
        "CREATE TABLE orders (order_id TEXT PRIMARY KEY, customer TEXT NOT NULL, amount_cents BIGINT NOT NULL)",
        "CREATE TABLE balances (customer TEXT PRIMARY KEY, cents BIGINT NOT NULL)",
    ] {
        sqlx::query(table).execute(&schema.pool).await.unwrap();
    }
    for customer in [&free, &locked] {
        sqlx::query("INSERT INTO balances (customer, cents) VALUES ($1, 0)")
            .bind(customer)
            .execute(&schema.pool)
            .await
            .unwrap();
    }
    broker::declare_orders_queue(&queue).await;
    let publisher = broker::publisher().await;
    let stuck_id = format!("{queue}-9");
    for n in 0..ORDERS {
        let id = format!("{queue}-{n}");
        let customer = if id == stuck_id { &locked } else { &free };
        let body = serde_json::json!({"order_id": id, "customer": customer, "amount_cents": 1});
        broker::publish(&publisher, &queue, Some(&id), body.to_string().as_bytes()).await;
    }
    let observer = common::postgres(1).await;
    // The sessions that wait for the test's lock (other tests hold locks of their own).
    let waiting = |holder: i32| {
        let observer = observer.clone();
        async move {
            sqlx::query_scalar::<_, i32>(
                "SELECT pid FROM pg_stat_activity WHERE $1 = ANY(pg_blocking_pids(pid))",
            )
            .bind(holder)
            .fetch_all(&observer)
            .await
            .unwrap()
        }
    };
    // Whether any of these sessions is still open.
    let open = |pids: Vec<i32>| {
        let observer = observer.clone();
        async move {
            sqlx::query_scalar::<_, i64>(
                "SELECT count(*) FROM pg_stat_activity WHERE pid = ANY($1)",
            )
            .bind(pids)
            .fetch_one(&observer)
            .await
            .unwrap()
                > 0
        }
    };
    let dlq = idem::rabbitmq::dlq(&queue);
    let consume = || {
        Command::new(common::orders_example())
            .arg("consume")
            .env("AMQP_URL", amqp_url())
            .env("DATABASE_URL", &schema.url)
            .env("ORDERS_QUEUE", &queue)
            .env("ORDERS_BATCH", "50")
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let mut kills = 0;
    let (lock, consumer) = loop {
        assert!(
            kills <= DEFAULT_POISON_LIMIT as usize + 1,
            "{kills} kills and the stuck order is still delivered"
        );
        // Each round: the row locked, a consumer started, killed once the order waits for the
        // row in its handler; then the row let go.
        let mut lock = schema.pool.begin().await.unwrap();
        sqlx::query("SELECT cents FROM balances WHERE customer = $1 FOR UPDATE")
            .bind(&locked)
            .fetch_one(&mut *lock)
            .await
            .unwrap();
        let holder: i32 = sqlx::query_scalar("SELECT pg_backend_pid()")
            .fetch_one(&mut *lock)
            .await
            .unwrap();
        let mut child = common::KillOnDrop(consume());
        let dlq_ref = &dlq;
        common::wait_until(
            "the stuck order in its handler, or dead-lettered",
            Duration::from_secs(60),
            || async move { !waiting(holder).await.is_empty() || broker::count(dlq_ref).await > 0 },
        )
        .await;
        if broker::count(&dlq).await > 0 {
            break (lock, child);
        }
        let blocked = waiting(holder).await;
        child.0.kill().unwrap();
        exited(&mut child.0, Duration::from_secs(30)).await;
        // Let go: the killed session takes the row, finds its client gone and ends. Until it
        // has, the next round could take it for the next consumer's waiting session.
        lock.rollback().await.unwrap();
        common::wait_until(
            "the killed consumer's session ended",
            Duration::from_secs(30),
            || {
                let still = open(blocked.clone());
                async move { !still.await }
            },
        )
        .await;
        kills += 1;
    };
    assert_eq!(
        kills,
        DEFAULT_POISON_LIMIT as usize + 1,
        "the first delivery's run, then one per counted redelivery up to the limit"
    );
    let pool = schema.pool.clone();
    common::wait_until("the other orders applied", Duration::from_secs(60), || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders")
                .fetch_one(&pool)
                .await
                .unwrap()
                == ORDERS as i64 - 1
        }
    })
    .await;
    drop(consumer);
    lock.rollback().await.unwrap();
    let cents: i64 = sqlx::query_scalar("SELECT cents FROM balances WHERE customer = $1")
        .bind(&free)
        .fetch_one(&schema.pool)
        .await
        .unwrap();
    assert_eq!(cents, ORDERS as i64 - 1, "every other order applied once");
    let dead = broker::drain(&dlq).await;
    let ids: Vec<Option<String>> = dead.iter().map(|d| d.message_id()).collect();
    assert_eq!(
        ids,
        [Some(stuck_id.clone())],
        "only the stuck order is dead-lettered"
    );
    let reason = dead[0].header(idem::rabbitmq::REASON_HEADER);
    let records = idem::sql::PgInbox::new(schema.pool.clone())
        .dead_letters(&queue)
        .await
        .unwrap();
    assert_eq!(records.len(), 1, "{records:?} {reason:?}");
    assert_eq!(
        (records[0].reason.as_str(), records[0].key.as_str()),
        ("poison", stuck_id.as_str())
    );
    broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
    schema.drop().await;
}
