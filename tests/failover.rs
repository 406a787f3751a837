//! `RabbitConfig` with several broker addresses: the runtime connects to the first that takes a
//! connection and, when the broker it uses goes away under load, reconnects to the next one,
//! every message taking effect once.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;
#[path = "common/runtime_fixture.rs"]
mod runtime_fixture;

use common::broker::{amqp_address, amqp_url};
use common::proxy::Proxy;
use common::running::*;
use common::wait_until;
use idem::rabbitmq::{QueueType, RabbitConfig};
use runtime_fixture::*;
use std::time::Duration;

/// An address nothing listens on: a connection to it is refused at once.
const REFUSING: &str = "amqp://guest:guest@127.0.0.1:1/%2f";

/// `AMQP_URL` with its host:port replaced by the proxy's.
fn through(proxy: &Proxy) -> String {
    amqp_url().replace(&amqp_address(), &format!("127.0.0.1:{}", proxy.port()))
}

/// Three addresses: one that refuses, then two proxies in front of the node. The runtime
/// connects through the first proxy; when that proxy is cut under load (its connections broken,
/// new ones refused, as when a node dies), the runtime reconnects through the second within
/// seconds and every order takes effect once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_lost_under_load_fails_over_to_the_next_address() {
    let mut f = fixture("failover", fast_retries(), QueueType::Classic, None).await;
    let (first, second) = (
        Proxy::start(&amqp_address()).await,
        Proxy::start(&amqp_address()).await,
    );
    f.rabbit = RabbitConfig::new(format!(
        "{REFUSING}, {}, {}",
        through(&first),
        through(&second)
    ))
    .connection_name(format!("idem-test:{}", f.queue));
    const ORDERS: usize = 1500;
    for n in 0..ORDERS {
        for _ in 0..(n % 2 + 1) {
            f.publish_order(n, 4).await;
        }
    }
    let running = start(f.runtime().concurrency(2).prefetch(8));
    wait_until("some progress", DEADLINE, || async {
        running.now().processed >= 50
    })
    .await;
    assert!(
        first.accepted() >= 1,
        "nothing went through the first proxy"
    );
    assert_eq!(second.accepted(), 0, "the second proxy was used too early");
    first.cut();
    let before = running.now().processed;
    assert!(
        (before as usize) < ORDERS,
        "all work was done before the broker went away; the test proves nothing"
    );
    wait_until(
        "processing resumed through the next broker",
        Duration::from_secs(20),
        || async { running.now().processed > before + 50 },
    )
    .await;
    assert!(
        second.accepted() >= 1,
        "nothing went through the second proxy"
    );
    wait_until("every order applied", DEADLINE, || async {
        f.effects().await.len() == ORDERS
    })
    .await;
    f.wait_drained().await;
    let seen = running.shut_down().await;
    assert_eq!(seen.dead_lettered, 0);
    // Every copy settled; a delivery whose ack the cut lost came again, as a duplicate.
    let deliveries = (0..ORDERS).map(|n| n % 2 + 1).sum::<usize>() as u64;
    assert!(
        seen.processed + seen.duplicates >= deliveries,
        "{seen:?}: fewer settled than the {deliveries} copies sent"
    );
    f.assert_exactly_once(ORDERS, |_| 4).await;
    f.cleanup().await;
}

/// `call`'s result, or a panic if it does not return within 20 s: a hung call fails the test
/// instead of holding up the suite.
async fn bounded<T>(call: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(20), call)
        .await
        .expect("a publisher call did not return within 20 s")
}

/// Every address refuses: the start fails with an error that names them all, passwords hidden.
/// The start deadline is 2 s, not the default 30 s: what is checked is the error's text, which
/// the deadline does not change (the refusals come at once, and the start tries again until
/// its deadline).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn no_broker_answering_stops_the_start_naming_every_address() {
    let mut f = fixture("failover-none", fast_retries(), QueueType::Classic, None).await;
    f.rabbit = RabbitConfig::new(format!("{REFUSING},amqp://guest:secret@127.0.0.1:2/%2f"));
    let ran = f
        .runtime()
        .start_deadline(Duration::from_secs(2))
        .build()
        .unwrap()
        .run_until(async {})
        .await;
    let text = ran.expect_err("the start fails").to_string();
    assert!(
        text.contains("127.0.0.1:1") && text.contains("127.0.0.1:2") && !text.contains("secret"),
        "{text}"
    );
    f.cleanup().await;
}

/// A publisher given two brokers publishes batches (unconfirmed, then `wait_for_confirms`) and
/// single confirmed messages, retrying whatever is not confirmed; its broker goes away half-way
/// (a proxy cut). It carries on through the second broker, and every message it was told was
/// confirmed is in the queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_publisher_fails_over_and_every_confirmed_message_arrives() {
    use idem::rabbitmq::Publisher;
    let f = fixture(
        "publisher-failover",
        fast_retries(),
        QueueType::Classic,
        None,
    )
    .await;
    let (first, second) = (
        Proxy::start(&amqp_address()).await,
        Proxy::start(&amqp_address()).await,
    );
    let config = RabbitConfig::new(format!("{},{}", through(&first), through(&second)));
    let publisher = Publisher::connect(&config).await.unwrap();
    let message = |id: String| idem::Envelope::new("{}").with_message_id(id);
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let mut confirmed = Vec::new();
    for batch in 0..20 {
        if batch == 10 {
            first.cut();
        }
        let ids: Vec<String> = (0..10).map(|n| format!("batch-{batch}-{n}")).collect();
        loop {
            let mut sent = true;
            for id in &ids {
                let message = message(id.clone());
                sent &= bounded(publisher.publish_unconfirmed(&f.queue, &message))
                    .await
                    .is_ok();
            }
            if bounded(publisher.wait_for_confirms()).await.is_ok() && sent {
                break;
            }
            assert!(
                std::time::Instant::now() < deadline,
                "batch {batch} never confirmed"
            );
        }
        confirmed.extend(ids);
        let single = format!("single-{batch}");
        while bounded(publisher.publish("", &f.queue, &message(single.clone())))
            .await
            .is_err()
        {
            assert!(
                std::time::Instant::now() < deadline,
                "{single} never confirmed"
            );
        }
        confirmed.push(single);
    }
    assert!(
        second.accepted() >= 1,
        "nothing went through the second broker"
    );
    let arrived: std::collections::HashSet<String> = common::broker::drain(&f.queue)
        .await
        .iter()
        .filter_map(|m| m.message_id())
        .collect();
    let missing: Vec<&String> = confirmed
        .iter()
        .filter(|id| !arrived.contains(*id))
        .collect();
    assert!(
        missing.is_empty(),
        "confirmed but not in the queue: {missing:?}"
    );
    f.cleanup().await;
}

/// The first address accepts TCP connections and then never answers, as a hung node does: each
/// connection gives it up after its 10 s and goes to the next address, and every order is
/// processed.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_broker_that_never_answers_is_given_up_for_the_next() {
    let mut f = fixture("failover-hung", fast_retries(), QueueType::Classic, None).await;
    let silent = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = silent.local_addr().unwrap().port();
    let hold = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = silent.accept().await {
            held.push(socket); // open, and silent
        }
    });
    f.rabbit = RabbitConfig::new(format!(
        "amqp://guest:guest@127.0.0.1:{port}/%2f,{}",
        amqp_url()
    ))
    .connection_name(format!("idem-test:{}", f.queue));
    for n in 0..20 {
        f.publish_order(n, 2).await;
    }
    let running = start(f.runtime());
    wait_until("every order applied", Duration::from_secs(60), || async {
        f.effects().await.len() == 20
    })
    .await;
    f.wait_drained().await;
    let seen = running.shut_down().await;
    assert_eq!(
        (seen.processed, seen.duplicates, seen.dead_lettered),
        (20, 0, 0),
        "each of the 20 orders processed once, nothing else"
    );
    f.assert_exactly_once(20, |_| 2).await;
    hold.abort();
    f.cleanup().await;
}

/// Several tasks publish (batches awaited with `wait_for_confirms`, and single confirmed
/// messages) while the publisher's broker connection is cut again and again: every call
/// returns, confirmed or failed, within seconds. None waits forever for a confirm that the
/// lost connection can no longer bring.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn publishes_under_way_when_the_connection_is_cut_always_return() {
    use idem::rabbitmq::Publisher;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
    let f = fixture("publisher-cuts", fast_retries(), QueueType::Classic, None).await;
    let proxy = Proxy::start(&amqp_address()).await;
    let publisher = Publisher::connect(&RabbitConfig::new(through(&proxy)))
        .await
        .unwrap();
    let (stop, done) = (
        Arc::new(AtomicBool::new(false)),
        Arc::new(AtomicUsize::new(0)),
    );
    let tasks: Vec<_> = (0..6)
        .map(|task| {
            let (publisher, queue) = (publisher.clone(), f.queue.clone());
            let (stop, done) = (stop.clone(), done.clone());
            tokio::spawn(async move {
                let message = idem::Envelope::new("{}").with_message_id(format!("t{task}"));
                while !stop.load(Ordering::SeqCst) {
                    for _ in 0..5 {
                        let _ = bounded(publisher.publish_unconfirmed(&queue, &message)).await;
                    }
                    let _ = bounded(publisher.wait_for_confirms()).await;
                    if bounded(publisher.publish("", &queue, &message))
                        .await
                        .is_ok()
                    {
                        done.fetch_add(1, Ordering::SeqCst);
                    }
                }
            })
        })
        .collect();
    for _ in 0..40 {
        let before = done.load(Ordering::SeqCst);
        wait_until(
            "publishes confirmed again",
            Duration::from_secs(30),
            || async { done.load(Ordering::SeqCst) >= before + 6 },
        )
        .await;
        proxy.cut();
        proxy.restore();
    }
    stop.store(true, Ordering::SeqCst);
    for task in tasks {
        task.await.unwrap();
    }
    f.cleanup().await;
}

/// Two tasks share one publisher: one keeps publishing unconfirmed messages while the other
/// waits for its confirms again and again. Every wait returns. (lapin's own wait awaits only
/// the channel's last confirm, which never answers once another task published after it.)
/// The publishing task waits for its own confirms every 50 messages: unpaced, it outran the
/// broker's confirms on a loaded machine, and each of the other's waits grew with its backlog
/// (the test once took over 60 s instead of 10).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn waits_for_confirms_return_while_another_task_publishes() {
    use idem::rabbitmq::Publisher;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};
    let f = fixture("publisher-shared", fast_retries(), QueueType::Classic, None).await;
    let publisher = Publisher::connect(&f.rabbit).await.unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let other = {
        let (publisher, queue, stop) = (publisher.clone(), f.queue.clone(), stop.clone());
        tokio::spawn(async move {
            let message = idem::Envelope::new("{}").with_message_id("other");
            let mut sent = 0;
            while !stop.load(Ordering::SeqCst) {
                publisher
                    .publish_unconfirmed(&queue, &message)
                    .await
                    .unwrap();
                sent += 1;
                if sent % 50 == 0 {
                    bounded(publisher.wait_for_confirms()).await.unwrap();
                }
            }
            bounded(publisher.wait_for_confirms()).await.unwrap();
            sent
        })
    };
    let message = idem::Envelope::new("{}").with_message_id("waiter");
    for _ in 0..100 {
        for _ in 0..5 {
            publisher
                .publish_unconfirmed(&f.queue, &message)
                .await
                .unwrap();
        }
        bounded(publisher.wait_for_confirms()).await.unwrap();
    }
    stop.store(true, Ordering::SeqCst);
    let sent = bounded(other).await.unwrap();
    wait_until("every message in the queue", DEADLINE, || async {
        common::broker::count(&f.queue).await == 500 + sent
    })
    .await;
    f.cleanup().await;
}

/// AMQP `queue.declare-ok`: class and method ids.
const DECLARE_OK: (u16, u16) = (50, 11);
/// AMQP `basic.qos-ok`: class and method ids.
const QOS_OK: (u16, u16) = (60, 11);

/// A broker that takes the connection and answers everything else, but never the queue's
/// declaration: the start fails once the broker has had its 15 s, naming the queue and what
/// was awaited, instead of waiting for good.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_declaration_the_broker_never_answers_fails_the_start_in_time() {
    let mut f = fixture(
        "unanswered-declare",
        fast_retries(),
        QueueType::Classic,
        None,
    )
    .await;
    let proxy = Proxy::start_withholding(&amqp_address(), Some(DECLARE_OK)).await;
    f.rabbit = RabbitConfig::new(through(&proxy));
    let run = f.runtime().build().unwrap().run_until(async {});
    let ran = tokio::time::timeout(Duration::from_secs(60), run)
        .await
        .expect("the start still waited for the declaration after 60 s");
    let text = ran.expect_err("the start fails").to_string();
    assert!(
        text.contains(&f.queue) && text.contains("waiting for the broker to answer"),
        "{text}"
    );
    f.cleanup().await;
}

/// A broker that takes the consumer's connection but never answers its `basic.qos`: the
/// consumer gives that connection up after 15 s and tries again on a new one, and a shutdown
/// meanwhile ends at once, not after the grace period.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_subscription_the_broker_never_answers_is_tried_again_and_holds_up_no_shutdown() {
    let mut f = fixture("unanswered-qos", fast_retries(), QueueType::Classic, None).await;
    let proxy = Proxy::start_withholding(&amqp_address(), Some(QOS_OK)).await;
    f.rabbit = RabbitConfig::new(through(&proxy));
    f.publish_order(0, 4).await;
    let running = start(f.runtime().shutdown_grace(Duration::from_secs(50)));
    // The start's declarations, then the consumer's: its topology, its own connection.
    wait_until(
        "the consumer's connection",
        Duration::from_secs(20),
        || async { proxy.accepted() >= 3 },
    )
    .await;
    let stuck = proxy.accepted();
    wait_until(
        "the consumer trying again on a new connection",
        Duration::from_secs(40),
        || async { proxy.accepted() > stuck },
    )
    .await;
    assert_eq!(running.now().processed, 0, "a delivery came through");
    let stopping = std::time::Instant::now();
    running.shut_down().await;
    assert!(
        stopping.elapsed() < Duration::from_secs(10),
        "the shutdown took {:?}",
        stopping.elapsed()
    );
    f.cleanup().await;
}
