//! The runtime against real RabbitMQ and PostgreSQL: duplicates, competing consumers, dead
//! letters, retries, a broker connection closed under load, a database outage, graceful
//! shutdown, quorum queues.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;
#[path = "common/runtime_fixture.rs"]
mod runtime_fixture;

use common::broker::{self, Got, amqp_url, publish};
use common::running::*;
use common::wait_until;
use idem::rabbitmq::{QueueType, RabbitConfig, RabbitTransport};
use idem::sql::PgInbox;
use idem::transport::{QueueSpec, Transport};
use idem::{HandlerError, RetryPolicy, Runtime, idempotent};
use runtime_fixture::*;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn duplicates_published_on_purpose_take_effect_once() {
    let f = fixture("duplicates", fast_retries(), QueueType::Classic, None).await;
    let mut published = 0;
    for n in 0..150 {
        for _ in 0..(n % 3 + 1) {
            f.publish_order(n, 10 + n as i64).await;
            published += 1;
        }
    }
    let running = start(f.runtime());
    wait_until("every delivery settled", DEADLINE, || async {
        running.now().settled() >= published
    })
    .await;
    f.wait_drained().await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.processed, seen.duplicates, seen.dead_lettered),
        (150, published - 150, 0),
        "processed + duplicates + dead-lettered = deliveries"
    );
    f.assert_exactly_once(150, |n| 10 + n as i64).await;
    assert!(
        broker::drain(&idem::rabbitmq::dlq(&f.queue))
            .await
            .is_empty()
    );
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn three_competing_runtimes_take_effect_once() {
    let f = fixture("competing", fast_retries(), QueueType::Classic, None).await;
    let (runtimes, health): (Vec<_>, Vec<_>) = (0..3).map(|_| start_watched(f.runtime())).unzip();
    // All three consume before the first publish: one that started late would find nothing
    // left to do.
    wait_until("the three runtimes consuming", DEADLINE, || async {
        health.iter().all(|h| h.is_consuming())
    })
    .await;
    let mut published = 0;
    for n in 0..200 {
        for _ in 0..(n % 4 + 1) {
            f.publish_order(n, 1).await;
            published += 1;
        }
    }
    wait_until("every delivery settled", DEADLINE, || async {
        runtimes.iter().map(|r| r.now().settled()).sum::<u64>() >= published
    })
    .await;
    // Judged once the queue and its retry queues hold nothing, ready or unacknowledged.
    f.wait_drained().await;
    let mut busy = 0;
    let (mut processed, mut duplicates, mut dead) = (0, 0, 0);
    for running in runtimes {
        let seen = running.shut_down().await;
        busy += u32::from(seen.processed > 0);
        (processed, duplicates, dead) = (
            processed + seen.processed,
            duplicates + seen.duplicates,
            dead + seen.dead_lettered,
        );
    }
    assert!(
        busy >= 2,
        "the work was not shared: only {busy} runtime(s) processed anything"
    );
    assert_eq!(
        (processed, duplicates, dead),
        (200, published - 200, 0),
        "every delivery settled once: processed + duplicates + dead-lettered = deliveries"
    );
    f.assert_exactly_once(200, |_| 1).await;
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_and_conflicting_messages_are_dead_lettered_with_reasons() {
    let f = fixture("dead-letters", fast_retries(), QueueType::Classic, None).await;
    let running = start(f.runtime());
    publish(
        &f.publisher,
        &f.queue,
        Some(&f.key(100)),
        b"this is not json",
    )
    .await;
    publish(
        &f.publisher,
        &f.queue,
        Some(&f.key(101)),
        br#"{"order_id": "x"}"#,
    )
    .await;
    publish(
        &f.publisher,
        &f.queue,
        None,
        br#"{"order_id": "y", "customer": "c", "amount_cents": 1}"#,
    )
    .await;
    f.publish_order(0, 500).await;
    wait_until("the good order", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    let reused = serde_json::json!({"order_id": f.key(0), "customer": f.customer(0), "amount_cents": 999_999});
    publish(
        &f.publisher,
        &f.queue,
        Some(&f.key(0)),
        reused.to_string().as_bytes(),
    )
    .await;
    f.publish_order(1, 7).await; // the consumer keeps going
    wait_until("all settled", DEADLINE, || async {
        running.now().settled() == 6
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (
            seen.processed,
            seen.rejected,
            seen.conflicts,
            seen.dead_lettered
        ),
        (2, 3, 1, 4)
    );
    f.assert_exactly_once(2, |n| if n == 0 { 500 } else { 7 })
        .await;

    let dlq = broker::drain(&idem::rabbitmq::dlq(&f.queue)).await;
    assert_eq!(dlq.len(), 4, "each dead letter lands once");
    let mut ids: Vec<_> = dlq.iter().map(Got::message_id).collect();
    ids.sort();
    assert_eq!(
        ids,
        [None, Some(f.key(0)), Some(f.key(100)), Some(f.key(101))]
    );
    let not_json = dlq
        .iter()
        .find(|m| m.message_id() == Some(f.key(100)))
        .unwrap();
    assert_eq!(not_json.body, b"this is not json", "the body is kept");
    assert!(dlq.iter().all(|m| {
        m.properties
            .headers()
            .as_ref()
            .is_some_and(|h| h.contains_key("x-death"))
    }));
    // Each dead letter's record is in the store, found from the message itself.
    let records = f.dead_letters().await;
    assert_eq!(records.len(), 4, "{records:?}");
    let record_of = |m: &Got| {
        let found: Vec<_> = records
            .iter()
            .filter(|r| r.describes(m.message_id().as_deref(), &m.body))
            .collect();
        assert_eq!(found.len(), 1, "one record describes {:?}", m.message_id());
        found[0]
    };
    let mut summary: Vec<_> = dlq
        .iter()
        .map(|m| (m.message_id(), record_of(m).reason.clone()))
        .collect();
    summary.sort();
    assert_eq!(
        summary,
        [
            (None, "missing-key".to_owned()),
            (Some(f.key(0)), "conflict".to_owned()),
            (Some(f.key(100)), "decode".to_owned()),
            (Some(f.key(101)), "decode".to_owned()),
        ]
    );
    assert!(records.iter().all(|r| r.consumer == CONSUMER));
    let conflict = record_of(
        dlq.iter()
            .find(|m| m.message_id() == Some(f.key(0)))
            .unwrap(),
    );
    assert_eq!(
        (conflict.key.as_str(), conflict.keyed),
        (f.key(0).as_str(), true)
    );
    let detail = &record_of(not_json).detail;
    assert!(detail.contains("does not decode"), "{detail}");
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_transient_failure_is_retried_with_delay_and_processed_once() {
    let f = fixture("retry", fast_retries(), QueueType::Classic, None).await;
    f.script
        .set(&f.key(0), &[Step::FailTransient, Step::FailTransient]);
    let running = start(f.runtime());
    f.publish_order(0, 42).await;
    wait_until("the third attempt", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.retried, seen.processed, seen.dead_lettered),
        (2, 1, 0)
    );
    assert_eq!(f.script.attempts(&f.key(0)), [1, 2, 3]);
    // Each retry waited out its own delay: measured between the attempts, not from the
    // publish (start-up alone can take longer than both delays).
    let gaps = f.script.gaps(&f.key(0));
    assert!(
        gaps.len() == 2
            && gaps[0] >= Duration::from_millis(200)
            && gaps[1] >= Duration::from_millis(400),
        "retries wait 200 ms then 400 ms, but the attempts came {gaps:?} apart"
    );
    f.assert_exactly_once(1, |_| 42).await;
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn retries_exhausted_end_in_the_dead_letter_queue() {
    let policy = RetryPolicy::new(3, Duration::from_millis(50), 2, Duration::from_secs(1)).unwrap();
    let f = fixture("exhausted", policy, QueueType::Classic, None).await;
    f.script.set(&f.key(0), &[Step::FailTransient; 3]);
    let running = start(f.runtime());
    f.publish_order(0, 1).await;
    wait_until("dead-lettered", DEADLINE, || async {
        running.now().dead_lettered == 1
    })
    .await;
    running.shut_down().await;
    assert!(f.effects().await.is_empty());
    let records = f.dead_letters().await;
    assert_eq!(records.len(), 1);
    assert_eq!(
        (records[0].reason.as_str(), records[0].attempts),
        ("retries-exhausted", 3)
    );
    assert_eq!(records[0].key, f.key(0));
    // The retry copies carried when the first attempt failed: the record keeps it before the
    // last failure, at least the two delays (50 and 100 ms) apart.
    let first = records[0].first_failed_at_ms.unwrap();
    assert!(
        records[0].dead_lettered_at_ms - first >= 150,
        "{:?}",
        records[0]
    );
    let dlq = broker::drain(&idem::rabbitmq::dlq(&f.queue)).await;
    assert_eq!(dlq.len(), 1);
    assert_eq!(dlq[0].message_id(), Some(f.key(0)));
    f.cleanup().await;
}

/// A delivery lost with its connection (a crash, a connection closed by the broker) is not a
/// failed attempt: its redelivery comes back as the same attempt, so the message still gets
/// every attempt of its retry policy. (Counting redeliveries as attempts let random kills and a
/// few transient failures dead-letter a message as `retries-exhausted`; deliveries that never
/// settle are the poison limit's to count.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_delivery_lost_with_its_connection_is_not_a_failed_attempt() {
    let policy = RetryPolicy::new(3, Duration::from_millis(50), 2, Duration::from_secs(1)).unwrap();
    let f = fixture("lost-attempt", policy, QueueType::Classic, None).await;
    // The first delivery waits in its transaction while its connection is closed, then fails:
    // its settlement cannot be sent. The redelivery and the first retry copy fail too; the
    // policy's third attempt succeeds.
    f.script.set(
        &f.key(0),
        &[Step::WaitThenFail, Step::FailTransient, Step::FailTransient],
    );
    let running = start(f.runtime());
    f.publish_order(0, 7).await;
    wait_until(
        "the first delivery in its transaction",
        DEADLINE,
        || async { f.script.started(&f.key(0)) },
    )
    .await;
    assert!(broker::close_connections(&format!("idem-test:{}", f.queue)) >= 1);
    f.script.release(&f.key(0));
    wait_until("the order settled", DEADLINE, || async {
        let seen = running.now();
        seen.processed + seen.dead_lettered >= 1
    })
    .await;
    // A copy left behind (a retry copy the lost settlement sent after all) comes later: judged
    // once the queue and its retry queues hold nothing.
    f.wait_drained().await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.processed, seen.dead_lettered),
        (1, 0),
        "the lost delivery used up an attempt: {:?}",
        f.script.attempts(&f.key(0))
    );
    assert_eq!(f.script.attempts(&f.key(0)), [1, 1, 2, 3]);
    assert!(f.dead_letters().await.is_empty());
    f.assert_exactly_once(1, |_| 7).await;
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_connection_closed_under_load_loses_and_doubles_nothing() {
    let f = fixture("reconnect", fast_retries(), QueueType::Classic, None).await;
    const ORDERS: usize = 1500;
    for n in 0..ORDERS {
        for _ in 0..(n % 2 + 1) {
            f.publish_order(n, 3).await;
        }
    }
    // One order in the middle holds its transaction open until the connection is closed, so
    // the close always finds work in flight, however fast the rest goes meanwhile.
    let held = f.key(ORDERS / 2);
    f.script.set(&held, &[Step::WaitForRelease]);
    let running = start(f.runtime().concurrency(2).prefetch(8));
    wait_until("the held order started", DEADLINE, || async {
        f.script.started(&held)
    })
    .await;
    let closed = broker::close_connections(&format!("idem-test:{}", f.queue));
    assert!(closed >= 1, "no consumer connection to close");
    let before = f.effects().await.len();
    assert!(
        before < ORDERS,
        "all work was done before the connection was closed; the test proves nothing"
    );
    f.script.release(&held);
    wait_until("every order applied", DEADLINE, || async {
        f.effects().await.len() == ORDERS
    })
    .await;
    // The deliveries the close gave back come again after their orders were applied: judged
    // once the queue and its retry queues hold nothing, ready or unacknowledged.
    f.wait_drained().await;
    let seen = running.shut_down().await;
    f.assert_exactly_once(ORDERS, |_| 3).await;
    // Every copy settled (those whose ack the close lost came back, as duplicates); none
    // dead-lettered.
    let published = (0..ORDERS).map(|n| n as u64 % 2 + 1).sum::<u64>();
    assert_eq!(
        (seen.processed, seen.dead_lettered),
        (ORDERS as u64, 0),
        "{seen:?}"
    );
    assert!(
        seen.settled() >= published,
        "{seen:?}: {published} published"
    );
    assert!(
        broker::drain(&idem::rabbitmq::dlq(&f.queue))
            .await
            .is_empty()
    );
    f.cleanup().await;
}

/// An operator (or a lost node) deletes the queue and everything idem declared beside it under
/// a running consumer: the broker cancels the consumer, which reconnects and declares the
/// topology again; later orders are processed and dead letters still reach the DLQ.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_queue_deleted_under_the_consumer_is_declared_again() {
    let f = fixture("redeclare", fast_retries(), QueueType::Classic, None).await;
    f.publish_order(0, 5).await;
    let running = start(f.runtime());
    wait_until("the first order applied", DEADLINE, || async {
        f.effects().await.len() == 1
    })
    .await;
    broker::delete_topology(&f.queue, &f.policy.delays()).await;
    let dlq = idem::rabbitmq::dlq(&f.queue);
    let retry = idem::rabbitmq::retry_queue(&f.queue, f.policy.delays()[0]);
    wait_until(
        "the topology declared again",
        Duration::from_secs(15),
        || async {
            broker::exists(&f.queue).await
                && broker::exists(&dlq).await
                && broker::exists(&retry).await
        },
    )
    .await;
    for n in 1..20 {
        f.publish_order(n, 5).await;
    }
    publish(&f.publisher, &f.queue, Some("not-json"), b"{not json").await;
    wait_until("every order applied", DEADLINE, || async {
        f.effects().await.len() == 20
    })
    .await;
    wait_until("the malformed message dead-lettered", DEADLINE, || async {
        running.now().dead_lettered == 1
    })
    .await;
    running.shut_down().await;
    f.assert_exactly_once(20, |_| 5).await;
    let dead = broker::drain(&dlq).await;
    assert_eq!(dead.len(), 1, "{dead:?}");
    assert_eq!(dead[0].message_id().as_deref(), Some("not-json"));
    f.cleanup().await;
}

/// Messages RabbitMQ accepts but lapin cannot parse (a `message_id`, and a header name, that are
/// not UTF-8, sent as raw frames) between good ones: each is dead-lettered once with its reason
/// recorded, and the orders behind them are processed within seconds.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_message_the_client_cannot_parse_is_dead_lettered_and_the_queue_moves_on() {
    use common::raw_amqp::{RawProperties, RawPublisher};
    let f = fixture("unparsable", fast_retries(), QueueType::Classic, None).await;
    let address = broker::amqp_address();
    let mut raw = RawPublisher::connect(&address, "guest", "guest");
    f.publish_raw_orders(&mut raw, 0..10);
    let bad_id = vec![0xff, 0xfe, b'b', b'a', b'd'];
    let bad = RawProperties {
        message_id: Some(bad_id.clone()),
        headers: None,
    };
    raw.publish(&f.queue, &bad, f.order(1000, 7).as_bytes());
    f.publish_raw_orders(&mut raw, 10..20);
    // A header table whose one name is not UTF-8: `\xff\xfek` = longstr "v".
    let odd_header = RawProperties {
        message_id: Some(b"odd-header".to_vec()),
        headers: Some(vec![3, 0xff, 0xfe, b'k', b'S', 0, 0, 0, 1, b'v']),
    };
    raw.publish(&f.queue, &odd_header, f.order(1001, 7).as_bytes());
    f.publish_raw_orders(&mut raw, 20..30);
    drop(raw);
    let running = start(f.runtime());
    wait_until(
        "every good order applied",
        Duration::from_secs(30),
        || async { f.effects().await.len() == 30 },
    )
    .await;
    let dlq = idem::rabbitmq::dlq(&f.queue);
    wait_until("the unparsable messages in the DLQ", DEADLINE, || async {
        broker::count(&dlq).await == 2
    })
    .await;
    running.shut_down().await;
    f.assert_exactly_once(30, |_| 7).await;
    assert_eq!(broker::count(&dlq).await, 2, "each dead-lettered once");
    let records = f.dead_letters().await;
    assert_eq!(records.len(), 2, "{records:?}");
    assert!(records.iter().all(|r| r.reason == "unparsable" && !r.keyed));
    // The ids as far as they read; the fingerprints are those of the bodies published.
    let mut ids: Vec<Option<String>> = records.iter().map(|r| r.message_id.clone()).collect();
    ids.sort();
    let mut expected = vec![
        Some(String::from_utf8_lossy(&bad_id).into_owned()),
        Some("odd-header".to_owned()),
    ];
    expected.sort();
    let fingerprints: Vec<_> = [1000, 1001]
        .map(|n| Some(idem::store::Fingerprint::of(f.order(n, 7).as_bytes())))
        .into();
    assert!(
        records
            .iter()
            .all(|r| fingerprints.contains(&r.fingerprint))
    );
    assert_eq!(ids, expected);
    f.cleanup().await;
}

/// The same over `amqps://`: a RabbitMQ node of the test's own with a TLS listener whose
/// certificate a private CA signed (`RabbitConfig::tls_ca_pem`). lapin and idem's own reader
/// both connect over TLS; the unparsable message is dead-lettered once, the orders applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn over_tls_a_message_the_client_cannot_parse_is_dead_lettered_too() {
    use common::raw_amqp::{RawProperties, RawPublisher};
    use common::tls_node::TlsNode;
    if !common::own_servers::can_start("rabbitmq-server", "a TLS node of the test's own") {
        return;
    }
    let node = tokio::task::spawn_blocking(TlsNode::start).await.unwrap();
    let mut f = fixture("tls", fast_retries(), QueueType::Classic, None).await;
    f.rabbit = RabbitConfig::new(&node.amqps_url)
        .tls_ca_pem(&node.ca_pem)
        .connection_name(format!("idem-test:{}", f.queue));
    let mut spec = QueueSpec::new(f.queue.clone(), CONSUMER);
    spec.retry_delays = f.policy.delays();
    RabbitTransport::new(f.rabbit.clone())
        .declare(&[spec])
        .await
        .expect("declared over TLS");
    let mut raw = RawPublisher::connect(&node.plain_address, "guest", "guest");
    f.publish_raw_orders(&mut raw, 0..10);
    let bad = RawProperties {
        message_id: Some(vec![0xff, 0xfe, b't', b'l', b's']),
        headers: None,
    };
    raw.publish(&f.queue, &bad, f.order(1000, 7).as_bytes());
    f.publish_raw_orders(&mut raw, 10..20);
    drop(raw);
    let running = start(f.runtime());
    wait_until(
        "every good order applied",
        Duration::from_secs(30),
        || async { f.effects().await.len() == 20 },
    )
    .await;
    wait_until("the unparsable message recorded", DEADLINE, || async {
        f.dead_letters().await.len() == 1
    })
    .await;
    running.shut_down().await;
    f.assert_exactly_once(20, |_| 7).await;
    let records = f.dead_letters().await;
    assert_eq!(records[0].reason, "unparsable");
    assert_eq!(
        records[0].fingerprint,
        Some(idem::store::Fingerprint::of(f.order(1000, 7).as_bytes()))
    );
    let dlq = idem::rabbitmq::dlq(&f.queue);
    let on_node = lapin::Connection::connect(&node.plain_url, Default::default())
        .await
        .unwrap();
    let passive = lapin::options::QueueDeclareOptions {
        passive: true,
        ..Default::default()
    };
    let dead = on_node
        .create_channel()
        .await
        .unwrap()
        .queue_declare(dlq.as_str().into(), passive, Default::default())
        .await
        .unwrap()
        .message_count();
    assert_eq!(dead, 1, "dead-lettered once");
    let _ = on_node.close(200, "done".into()).await;
    f.cleanup().await;
}

/// A body over `RabbitConfig::max_body` is dead-lettered as `too-large` before it is decoded;
/// the messages around it are processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_body_over_the_limit_is_dead_lettered() {
    let f = fixture("too-large", fast_retries(), QueueType::Classic, None).await;
    f.publish_order(0, 4).await;
    let huge = format!(
        r#"{{"order_id": "{}", "customer": "c", "amount_cents": 1, "pad": "{}"}}"#,
        f.key(99),
        "x".repeat(2 << 20)
    );
    publish(&f.publisher, &f.queue, Some(&f.key(99)), huge.as_bytes()).await;
    // A small body under a header table of 8 KiB.
    let small = format!(
        r#"{{"order_id": "{}", "customer": "c", "amount_cents": 1}}"#,
        f.key(98)
    );
    let padded = idem::Envelope::new(small)
        .with_message_id(f.key(98))
        .with_header("x-padding", "h".repeat(8 << 10));
    f.publisher.publish("", &f.queue, &padded).await.unwrap();
    f.publish_order(1, 4).await;
    let rabbit = f.rabbit.clone().max_body(1 << 20).max_headers(4 << 10);
    let running = start(f.runtime().transport(RabbitTransport::new(rabbit)));
    let dlq = idem::rabbitmq::dlq(&f.queue);
    wait_until("the huge messages dead-lettered", DEADLINE, || async {
        broker::count(&dlq).await == 2
    })
    .await;
    wait_until("the orders around them applied", DEADLINE, || async {
        f.effects().await.len() == 2
    })
    .await;
    running.shut_down().await;
    f.assert_exactly_once(2, |_| 4).await;
    let records = f.dead_letters().await;
    assert_eq!(records.len(), 2, "{records:?}");
    assert!(records.iter().all(|r| r.reason == "too-large"));
    let dead = broker::drain(&dlq).await;
    let body = dead
        .iter()
        .find(|m| m.body.len() == huge.len())
        .expect("kept whole");
    let record = |id: &str| {
        records
            .iter()
            .find(|r| r.message_id.as_deref() == Some(id))
            .unwrap()
    };
    assert!(record(&f.key(99)).describes(Some(&f.key(99)), &body.body));
    assert!(record(&f.key(99)).detail.contains("max_body"));
    assert!(
        record(&f.key(98))
            .detail
            .contains("RabbitConfig::max_headers")
    );
    f.cleanup().await;
}

/// A publish that no queue takes is an error, never a silent drop: confirmed or in bulk.
#[tokio::test]
async fn an_unroutable_publish_is_an_error() {
    use idem::rabbitmq::PublishError;
    let publisher = broker::publisher().await;
    let nowhere = common::unique("idem-test-nowhere");
    let err = publisher
        .publish_json(&nowhere, "m-1", &serde_json::json!({}))
        .await
        .unwrap_err();
    assert!(
        matches!(&err, PublishError::Unroutable { routing_key, .. } if *routing_key == nowhere),
        "{err}"
    );
    publisher
        .publish_unconfirmed(&nowhere, &idem::Envelope::new("{}"))
        .await
        .unwrap();
    let bulk = publisher.wait_for_confirms().await;
    assert!(
        matches!(bulk, Err(PublishError::Unroutable { .. })),
        "{bulk:?}"
    );
}

/// The database cut off under load (its connections broken, new ones refused): with the
/// default retry policy the queue pauses, spending no attempt, and resumes by itself once the
/// database is back; every order takes effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_database_outage_pauses_the_queue_without_losing_messages() {
    let f = fixture(
        "db-outage",
        RetryPolicy::default(),
        QueueType::Classic,
        None,
    )
    .await;
    let (proxy, proxied) = proxied_postgres().await;
    const ORDERS: usize = 300;
    for n in 0..ORDERS {
        f.publish_order(n, 5).await;
    }
    let running = start(f.runtime_with(proxied));
    wait_until("some progress", DEADLINE, || async {
        running.now().processed >= 30
    })
    .await;
    proxy.cut();
    wait_until("the store paused", DEADLINE, || async {
        running.now().pauses >= 1
    })
    .await;
    proxy.restore();
    wait_until("every order applied", DEADLINE, || async {
        f.effects().await.len() == ORDERS
    })
    .await;
    // Judged once the queue and its retry queues hold nothing, ready or unacknowledged.
    f.wait_drained().await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.dead_lettered, seen.retried),
        (0, 0),
        "no attempt spent on the outage: {seen:?}"
    );
    assert_eq!(
        seen.processed + seen.duplicates + seen.dead_lettered,
        ORDERS as u64,
        "each delivery settled once: {seen:?}"
    );
    assert!(seen.unavailable >= 1, "{seen:?}");
    f.assert_exactly_once(ORDERS, |_| 5).await;
    f.cleanup().await;
}

/// A dead letter whose record cannot be written (the database is cut off) is not moved without
/// it: it waits, unsettled, while the store pauses, and lands in the DLQ with its record once
/// the database is back.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_is_not_moved_without_its_record() {
    let f = fixture("unrecorded", fast_retries(), QueueType::Classic, None).await;
    let (proxy, proxied) = proxied_postgres().await;
    let running = start(f.runtime_with(proxied));
    f.publish_order(1, 3).await;
    wait_until("the runtime consuming", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    proxy.cut();
    publish(&f.publisher, &f.queue, Some(&f.key(0)), b"not json").await;
    wait_until("the record waiting for the store", DEADLINE, || async {
        running.now().pauses >= 1
    })
    .await;
    let dlq = idem::rabbitmq::dlq(&f.queue);
    assert!(broker::exists(&dlq).await);
    assert_eq!(broker::count(&dlq).await, 0, "not moved without its record");
    assert_eq!(broker::unacked(&f.queue), 1, "held, unsettled");
    assert_eq!(running.now().dead_lettered, 0);
    proxy.restore();
    wait_until(
        "dead-lettered once the record is written",
        DEADLINE,
        || async { broker::count(&dlq).await == 1 },
    )
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.dead_lettered, seen.rejected, seen.retried),
        (1, 1, 0),
        "counted once, when moved, and never sent round: {seen:?}"
    );
    let records = f.dead_letters().await;
    assert_eq!(records.len(), 1, "{records:?}");
    assert_eq!(records[0].reason, "decode");
    assert!(records[0].describes(Some(&f.key(0)), b"not json"));
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn graceful_shutdown_finishes_in_flight_work_and_acks_nothing_uncommitted() {
    let f = fixture("shutdown", fast_retries(), QueueType::Classic, None).await;
    f.script.set(&f.key(0), &[Step::WaitForRelease]);
    f.script.set(&f.key(1), &[Step::WaitForRelease]);
    let (running, health) = start_watched(f.runtime().concurrency(2).prefetch(4));
    for n in 0..8 {
        f.publish_order(n, 1).await;
    }
    wait_until("both slow orders in flight", DEADLINE, || async {
        f.script.started(&f.key(0)) && f.script.started(&f.key(1))
    })
    .await;
    let _ = running.stop.send(());
    // The consumers stop (the runtime has raised its stop once it no longer consumes); the
    // two in-flight orders may then finish.
    wait_until("the runtime stopping", DEADLINE, || async {
        !health.is_consuming()
    })
    .await;
    f.script.release(&f.key(0));
    f.script.release(&f.key(1));
    finish(running.task).await;
    let seen = running.stats.snapshot();
    assert_eq!(
        seen.processed, 2,
        "only the in-flight orders were processed"
    );
    let effects = f.effects().await;
    assert_eq!(
        (effects.get(&f.key(0)), effects.get(&f.key(1))),
        (Some(&1), Some(&1))
    );
    // The six not started went back to the queue, unacked and unprocessed.
    let left: Vec<_> = broker::drain(&f.queue)
        .await
        .into_iter()
        .filter_map(|m| m.message_id())
        .collect();
    assert_eq!(left.len(), 6, "{left:?}");

    // A handler that does not finish within the grace period is abandoned: nothing commits and
    // the message goes back to the broker.
    f.script.set(&f.key(9), &[Step::Hang]);
    let running = start(f.runtime().shutdown_grace(Duration::from_millis(300)));
    f.publish_order(9, 1).await;
    wait_until("the hanging order in flight", DEADLINE, || async {
        f.script.started(&f.key(9))
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(seen.processed, 0);
    assert!(!f.effects().await.contains_key(&f.key(9)));
    let back: Vec<_> = broker::drain(&f.queue)
        .await
        .into_iter()
        .filter_map(|m| m.message_id())
        .collect();
    assert_eq!(back, [f.key(9)]);
    f.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn quorum_queues_deduplicate_and_enforce_the_delivery_limit() {
    let f = fixture("quorum", fast_retries(), QueueType::Quorum, Some(2)).await;
    // A consumer that keeps giving one message back (as a crashing consumer would): after the
    // delivery limit, the broker dead-letters it.
    f.publish_order(0, 1).await;
    for _ in 0..3 {
        assert!(
            broker::give_back(&f.queue, DEADLINE).await,
            "the message was not redelivered"
        );
    }
    let dlq = idem::rabbitmq::dlq(&f.queue);
    wait_until(
        "the over-delivered message in the DLQ",
        DEADLINE,
        || async { broker::count(&dlq).await > 0 },
    )
    .await;
    // The broker dead-lettered it for its delivery limit (it carries no reason of idem's: idem
    // never saw it), and nothing else.
    let dead: Vec<_> = broker::drain(&dlq)
        .await
        .iter()
        .map(|d| {
            let reason = d.header("x-first-death-reason");
            (
                d.message_id(),
                reason,
                d.header(idem::rabbitmq::REASON_HEADER),
            )
        })
        .collect();
    assert_eq!(
        dead,
        [(Some(f.key(0)), Some("delivery_limit".to_owned()), None)],
        "the over-delivered message, once, for its delivery limit"
    );

    // A message given back once arrives flagged redelivered but as attempt 1 still (nothing
    // failed: x-delivery-count does not use up the retry policy); duplicates take effect once.
    f.publish_order(1, 5).await;
    assert!(broker::give_back(&f.queue, DEADLINE).await);
    f.publish_order(2, 6).await;
    f.publish_order(2, 6).await;
    let running = start(f.runtime());
    wait_until("all settled", DEADLINE, || async {
        running.now().settled() >= 3
    })
    .await;
    f.wait_drained().await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.processed, seen.duplicates, seen.dead_lettered),
        (2, 1, 0),
        "three deliveries: processed + duplicates + dead-lettered"
    );
    let dead: Vec<_> = broker::drain(&dlq)
        .await
        .iter()
        .map(Got::message_id)
        .collect();
    assert!(dead.is_empty(), "dead-lettered: {dead:?}");
    assert_eq!(
        f.script.attempts(&f.key(1)),
        [1],
        "a give-back is not a failed attempt"
    );
    let effects = f.effects().await;
    assert_eq!(
        (
            effects.get(&f.key(0)),
            effects.get(&f.key(1)),
            effects.get(&f.key(2))
        ),
        (None, Some(&1), Some(&1))
    );
    f.cleanup().await;
}

#[idempotent(store = Postgres, queue = "idem-test-audit", consumer = "rt.audit")]
async fn audit(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order: Order,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO idem_rt_audit (key) VALUES ($1)")
        .bind(&order.order_id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn two_subscribers_of_one_exchange_each_process_every_message_once() {
    use idem::rabbitmq::ExchangeKind;
    let f = fixture("pubsub", fast_retries(), QueueType::Classic, None).await;
    sqlx::query("CREATE TABLE IF NOT EXISTS idem_rt_audit (key TEXT NOT NULL)")
        .execute(&f.pool)
        .await
        .unwrap();
    let (exchange, audit_queue) = (format!("{}-events", f.queue), format!("{}-audit", f.queue));
    let rabbit = f
        .rabbit
        .clone()
        .bind(&f.queue, &exchange, ExchangeKind::Fanout, "")
        .bind(&audit_queue, &exchange, ExchangeKind::Fanout, "");
    let specs: Vec<_> = [(&f.queue, CONSUMER), (&audit_queue, "rt.audit")]
        .map(|(queue, consumer)| {
            let mut spec = QueueSpec::new(queue.clone(), consumer);
            spec.retry_delays = f.policy.delays();
            spec
        })
        .into();
    RabbitTransport::new(rabbit.clone())
        .declare(&specs)
        .await
        .unwrap();
    let running = start(
        Runtime::builder()
            .transport(RabbitTransport::new(rabbit))
            .store(PgInbox::new(f.pool.clone()))
            .state(f.script.clone())
            .handlers(["record", "rt.audit"])
            .handler_queue(CONSUMER, &f.queue)
            .handler_queue("rt.audit", &audit_queue)
            .retry(f.policy.clone()),
    );
    let mut published = 0;
    for n in 0..100 {
        let body =
            serde_json::json!({"order_id": f.key(n), "customer": f.customer(n), "amount_cents": 2})
                .to_string();
        let message = idem::Envelope::new(body).with_message_id(f.key(n));
        for _ in 0..(n % 2 + 1) {
            f.publisher.publish(&exchange, "", &message).await.unwrap();
            published += 2; // one copy per subscriber queue
        }
    }
    wait_until("both subscribers settled everything", DEADLINE, || async {
        running.now().settled() >= published
    })
    .await;
    running.shut_down().await;
    f.assert_exactly_once(100, |_| 2).await;
    let audited: Vec<(String, i64)> =
        sqlx::query_as("SELECT key, count(*) FROM idem_rt_audit WHERE key LIKE $1 GROUP BY key")
            .bind(format!("{}-%", f.queue))
            .fetch_all(&f.pool)
            .await
            .unwrap();
    assert_eq!(audited.len(), 100);
    assert!(audited.iter().all(|(_, n)| *n == 1), "an audit ran twice");
    broker::delete_topology(&audit_queue, &f.policy.delays()).await;
    f.cleanup().await;
}

#[tokio::test]
async fn existing_topology_with_other_arguments_stops_the_start() {
    let f = fixture("mismatch", fast_retries(), QueueType::Classic, None).await;
    let quorum = RabbitConfig::new(amqp_url()).queue_type(QueueType::Quorum);
    let runtime = Runtime::builder()
        .transport(RabbitTransport::new(quorum))
        .store(PgInbox::new(f.pool.clone()))
        .state(f.script.clone())
        .handlers(["record"])
        .handler_queue(CONSUMER, &f.queue)
        .retry(f.policy.clone())
        .build()
        .unwrap();
    let error = runtime.run_until(async {}).await.unwrap_err().to_string();
    assert!(error.contains("x-queue-type"), "{error}");
    f.cleanup().await;
}

/// A dead letter whose record can never be written (the store refuses it with an error that
/// retrying will not fix: here a trigger on the records' table) is moved all the same, once,
/// counted as dead-lettered, with its reason in its headers: it does not go round for ever. As
/// the broker's own dead-lettering does, its copy drops the message's `expiration` (it must not
/// expire in the DLQ with no record anywhere), and names the queue it came from, whatever the
/// producer wrote in `x-first-death-queue`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_whose_record_can_never_be_written_is_moved_all_the_same() {
    let f = fixture("unrecordable", fast_retries(), QueueType::Classic, None).await;
    let schema = common::OwnSchema::create("idem_unrecordable", 4).await;
    PgInbox::new(schema.pool.clone()).migrate().await.unwrap();
    for statement in [
        "CREATE FUNCTION refuse_records() RETURNS trigger LANGUAGE plpgsql AS $$
         BEGIN RAISE EXCEPTION 'records refused by the test' USING ERRCODE = '22023'; END $$",
        "CREATE TRIGGER refuse BEFORE INSERT OR UPDATE ON idem_inbox_dead_letters
         FOR EACH ROW EXECUTE FUNCTION refuse_records()",
    ] {
        sqlx::query(statement).execute(&schema.pool).await.unwrap();
    }
    let running = start(f.runtime_with(schema.pool.clone()));
    {
        use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
        use lapin::types::{AMQPValue, FieldTable, ShortString};
        let connection = broker::connect().await;
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let mut forged = FieldTable::default();
        forged.insert(
            ShortString::from("x-first-death-queue"),
            AMQPValue::LongString("a-queue-of-the-producers".into()),
        );
        let properties = lapin::BasicProperties::default()
            .with_message_id(ShortString::from(f.key(0)))
            .with_expiration(ShortString::from("60000"))
            .with_headers(forged);
        channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from(f.queue.as_str()),
                BasicPublishOptions::default(),
                b"not json",
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
        broker::close(connection).await;
    }
    let dlq = idem::rabbitmq::dlq(&f.queue);
    wait_until("moved to the DLQ without its record", DEADLINE, || async {
        broker::count(&dlq).await == 1
    })
    .await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.dead_lettered, seen.rejected, seen.retried),
        (1, 1, 0),
        "moved at once, counted once"
    );
    let dead = broker::drain(&dlq).await;
    assert_eq!(dead.len(), 1);
    assert_eq!(dead[0].message_id(), Some(f.key(0)));
    // No record holds its reason: its headers do.
    let headers = dead[0].properties.headers().clone().unwrap_or_default();
    let header = |name: &str| match headers.inner().get(name) {
        Some(lapin::types::AMQPValue::LongString(text)) => text.to_string(),
        other => panic!("{name}: {other:?}"),
    };
    assert_eq!(header(idem::rabbitmq::REASON_HEADER), "decode");
    assert!(header(idem::rabbitmq::REASON_DETAIL_HEADER).contains("JSON"));
    assert_eq!(
        header("x-first-death-queue"),
        f.queue,
        "idem's own knowledge"
    );
    assert_eq!(
        dead[0].properties.expiration(),
        &None,
        "no expiration in the DLQ"
    );
    assert!(
        broker::drain(&f.queue).await.is_empty(),
        "nothing left behind"
    );
    f.cleanup().await;
    schema.drop().await;
}

/// Started while its database cannot be reached (a proxy in front of PostgreSQL drops every
/// connection, as a server that is restarting does), the runtime waits for it with backoff
/// instead of exiting, and consumes once it is back. (An inbox never migrated still ends the
/// start at once: `tests/runtime_memory.rs`.)
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_runtime_started_while_its_database_is_away_waits_for_it() {
    let f = fixture("late-db", fast_retries(), QueueType::Classic, None).await;
    let (proxy, url) = common::proxy::postgres().await;
    proxy.cut();
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(4)
        .acquire_timeout(Duration::from_secs(1))
        .connect_lazy(&url)
        .unwrap();
    let running = start(f.runtime_with(pool));
    wait_until(
        "the runtime trying the database, or exiting",
        DEADLINE,
        || async { proxy.refused() >= 3 || running.task.is_finished() },
    )
    .await;
    assert!(!running.task.is_finished(), "it waits instead of exiting");
    proxy.restore();
    f.publish_order(0, 5).await;
    wait_until("the order processed", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    running.shut_down().await;
    f.assert_exactly_once(1, |_| 5).await;
    f.cleanup().await;
}

/// The same with the broker away: the runtime waits for it with backoff, then declares its
/// topology and consumes.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_runtime_started_while_its_broker_is_away_waits_for_it() {
    let f = fixture("late-broker", fast_retries(), QueueType::Classic, None).await;
    let proxy = common::proxy::Proxy::start(&broker::amqp_address()).await;
    proxy.cut();
    let url = amqp_url().replace(
        &broker::amqp_address(),
        &format!("127.0.0.1:{}", proxy.port()),
    );
    let rabbit = RabbitConfig::new(url).connection_name(format!("idem-test:{}", f.queue));
    let running = start(f.runtime().transport(RabbitTransport::new(rabbit)));
    wait_until(
        "the runtime trying the broker, or exiting",
        DEADLINE,
        || async { proxy.refused() >= 3 || running.task.is_finished() },
    )
    .await;
    assert!(!running.task.is_finished(), "it waits instead of exiting");
    proxy.restore();
    f.publish_order(0, 5).await;
    wait_until("the order processed", DEADLINE, || async {
        running.now().processed == 1
    })
    .await;
    running.shut_down().await;
    f.assert_exactly_once(1, |_| 5).await;
    f.cleanup().await;
}

/// A publish no broker can carry (a routing key or message id over AMQP's 255 bytes) is an
/// error, never a panic, through every publishing call; in a run of messages the ones before it
/// go out and the ones behind it do not.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_publish_no_broker_can_carry_is_an_error_not_a_panic() {
    use idem::rabbitmq::PublishError;
    let queue = common::unique("idem-test-long-publish");
    broker::declare_orders_queue(&queue).await;
    let publisher = broker::publisher().await;
    let long = "x".repeat(256);
    let plain = idem::Envelope::new("{}");
    let long_id = idem::Envelope::new("{}").with_message_id(long.as_str());
    let refused = |r: Result<(), PublishError>| matches!(r, Err(PublishError::Invalid(_)));
    assert!(refused(publisher.publish("", &long, &plain).await));
    assert!(refused(publisher.publish("", &queue, &long_id).await));
    assert!(refused(
        publisher.publish_unconfirmed_to("", &long, &plain).await
    ));
    let first = idem::Envelope::new("1").with_message_id("first");
    let last = idem::Envelope::new("3").with_message_id("last");
    let results = publisher
        .publish_many(&[
            ("", &queue, &first),
            ("", &queue, &long_id),
            ("", &queue, &last),
        ])
        .await;
    assert!(results[0].is_ok(), "{results:?}");
    assert!(
        matches!(results[1], Err(PublishError::Invalid(_))),
        "{results:?}"
    );
    assert!(
        matches!(&results[2], Err(PublishError::Broker(e))
            if e.to_string().contains("not sent: an earlier publish failed")),
        "not sent behind it: {results:?}"
    );
    let got = broker::drain(&queue).await;
    let ids: Vec<_> = got.iter().filter_map(Got::message_id).collect();
    assert_eq!(ids, ["first"]);
    broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
}
