//! The transactional outbox, against real RabbitMQ and PostgreSQL, MariaDB, SQLite: a handler
//! stages a message in its transaction (`idem::outbox::stage`); it is published once the
//! transaction commits (through `build()`), never when it rolls back, with an id derived from
//! the consumer, the key and its ordinal, and the incoming message's correlation, causation
//! and trace context. Rows a crash left are published by the relay; several relays at once
//! publish each row once (counted by confirms).
//!
//! Each suite uses an inbox table of its own (`idem_ob_inbox`, so the outbox `idem_ob_outbox`):
//! the relays of other tests' runtimes never see these rows.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use idem::transport::{Outbound, OutboundError};
use idem::{BoxError, Destination, Outgoing, idempotent};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};

#[derive(Debug, serde::Serialize, serde::Deserialize)]
struct Order {
    order_id: String,
    customer: String,
    amount_cents: i64,
}

/// Where the handlers send what they stage.
struct Target(String);

/// The inbox tables of these tests, one per test that relays: a relay takes every row of its
/// outbox, so no test's rows are another test's.
const TABLE: &str = "idem_ob_inbox";
const QUOTE: &str = "idem_ob_quote_inbox";
const RELAY: &str = "idem_ob_relay_inbox";
const RELAYS: &str = "idem_ob_relays_inbox";
const UNROUTABLE: &str = "idem_ob_unroutable_inbox";
const NOTIFY: &str = "idem_ob_notify_inbox";
const STOP: &str = "idem_ob_stop_inbox";
const BATCH: &str = "idem_ob_batch_inbox";
const LONG: &str = "idem_ob_long_inbox";
const SCHEDULED: &str = "idem_ob_scheduled_inbox";
const REFUSED: &str = "idem_ob_refused_inbox";

/// Publishes through a confirmed publisher and counts, per message id, the confirms it got.
struct Counting {
    publisher: idem::rabbitmq::Publisher,
    confirmed: Mutex<HashMap<String, u32>>,
}

impl Outbound for Counting {
    fn publish<'a>(
        &'a self,
        message: &'a Outgoing,
    ) -> idem::transport::BoxFuture<'a, Result<(), OutboundError>> {
        Box::pin(async move {
            let (exchange, routing_key) = message.destination.parts();
            let published = self
                .publisher
                .publish(exchange, routing_key, &message.envelope)
                .await;
            match published {
                Ok(()) => {}
                Err(idem::rabbitmq::PublishError::Unroutable {
                    exchange,
                    routing_key,
                }) => {
                    return Err(OutboundError::Unroutable {
                        destination: Destination::from_parts(exchange, routing_key),
                    });
                }
                Err(e) => return Err(OutboundError::Broker(BoxError::from(e))),
            }
            let id = message.message_id().unwrap_or_default().to_owned();
            *self.confirmed.lock().unwrap().entry(id).or_default() += 1;
            Ok(())
        })
    }
}

macro_rules! outbox_suite {
    ($module:ident, $store:ident, $db:ty, $inbox:ty, $pool:expr, $count:literal) => {
        mod $module {
            use super::*;
            use crate::common::broker::{self, amqp_url};
            use crate::common::running::{DEADLINE, start};
            use crate::common::{unique, wait_until};
            use idem::rabbitmq::{RabbitConfig, RabbitTransport};
            use idem::store::OutboxSelect;
            use idem::transport::{QueueSpec, Transport};
            use idem::{Context, Envelope, HandlerError, RetryPolicy, Runtime, idempotent};
            use std::time::Duration;

            /// Bills an order: stages `Billed` to the target queue, twice for a customer
            /// named `…-twice`; for a customer named `…-savepoint`, stages another in a
            /// savepoint it rolls back; refuses an order named `…-refused` after staging.
            #[idempotent(store = $store, key = "order.order_id", queue = "idem-test-outbox-unset")]
            async fn bill(
                tx: &mut sqlx::Transaction<'_, $db>,
                order: Order,
                ctx: &Context<'_>,
                target: &Target,
            ) -> Result<(), HandlerError> {
                let copies = if order.customer.ends_with("-twice") {
                    2
                } else {
                    1
                };
                for _ in 0..copies {
                    let billed = Outgoing::to_queue(&target.0, &order)?;
                    idem::outbox::stage(tx, ctx, billed).await?;
                }
                if order.customer.ends_with("-savepoint") {
                    let mut savepoint = sqlx::Connection::begin(&mut **tx).await?;
                    let billed = Outgoing::to_queue(&target.0, &order)?;
                    idem::outbox::stage(&mut savepoint, ctx, billed).await?;
                    savepoint.rollback().await?;
                }
                if order.order_id.ends_with("-refused") {
                    return Err(HandlerError::permanent("refused after staging"));
                }
                Ok(())
            }

            /// Quotes an order: ten times its amount, the result a request with `reply_to`
            /// gets back.
            #[idempotent(store = $store, key = "order.order_id", queue = "idem-test-outbox-quote")]
            async fn quote(
                _tx: &mut sqlx::Transaction<'_, $db>,
                order: Order,
            ) -> Result<i64, HandlerError> {
                Ok(order.amount_cents * 10)
            }

            /// Through `build()`: a request naming `reply_to` gets the handler's result there
            /// once, through the outbox; its duplicate gets the stored result, with the same
            /// reply id and correlation; a request without `reply_to` gets nothing.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_request_gets_its_reply_once_and_a_duplicate_gets_the_stored_one() {
                replies(false).await;
            }

            /// The same in batch mode.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn in_batch_mode_a_request_gets_its_reply_and_a_duplicate_the_stored_one() {
                replies(true).await;
            }

            async fn replies(batch: bool) {
                let (pool, _dir) = $pool;
                let queue = unique("idem-test-ob-quote");
                let replies = format!("{queue}.replies");
                let quoting = idem::registry::find(concat!(module_path!(), "::quote"))
                    .unwrap()
                    .consumer();
                let transport = RabbitTransport::new(RabbitConfig::new(amqp_url()));
                let specs = [
                    QueueSpec::new(queue.clone(), quoting),
                    QueueSpec::new(replies.clone(), "replies"),
                ];
                transport.declare(&specs).await.unwrap();
                let publisher = broker::publisher().await;
                let request = |n: i64| {
                    let order = Order {
                        order_id: format!("{queue}-{n}"),
                        customer: "c".into(),
                        amount_cents: n,
                    };
                    Envelope::new(serde_json::to_vec(&order).unwrap())
                        .with_message_id(format!("{queue}-{n}"))
                };
                let asked = request(7)
                    .with_reply_to(&replies)
                    .with_correlation_id("c-7");
                publisher.publish("", &queue, &asked).await.unwrap();
                publisher.publish("", &queue, &request(8)).await.unwrap();
                let builder = Runtime::builder()
                    .transport(transport)
                    .store(inbox(&pool, QUOTE).await)
                    .state(Target(String::new()))
                    .handlers([quoting])
                    .handler_queue(quoting, &queue);
                let running = start(match batch {
                    true => builder.handler_batch(quoting, 10),
                    false => builder,
                });
                wait_until("the first reply", DEADLINE, || async {
                    broker::count(&replies).await == 1
                })
                .await;
                publisher.publish("", &queue, &asked).await.unwrap(); // a duplicate, after the reply
                wait_until("every request settled", DEADLINE, || async {
                    let now = running.now();
                    now.processed == 2 && now.duplicates == 1
                })
                .await;
                wait_until("the second reply", DEADLINE, || async {
                    broker::count(&replies).await == 2
                })
                .await;
                running.shut_down().await;
                let got = broker::drain(&replies).await;
                let id = idem::outbox::reply_message_id(quoting, &format!("{queue}-7"));
                for reply in &got {
                    assert_eq!(
                        reply.body, b"70",
                        "the handler's result, stored and replayed"
                    );
                    assert_eq!(reply.message_id().as_deref(), Some(id.as_str()));
                    assert_eq!(
                        reply
                            .properties
                            .correlation_id()
                            .as_ref()
                            .map(|c| c.to_string())
                            .as_deref(),
                        Some("c-7")
                    );
                }
                assert_eq!(
                    got.len(),
                    2,
                    "one reply per request, none for the request without reply_to"
                );
                assert_eq!(outbox_rows(&pool, QUOTE, &queue).await, 0);
                broker::delete_topology(&queue, &[]).await;
                broker::delete_topology(&replies, &[]).await;
            }

            /// Through `build()`, with no relay: the runtime is stopped while it processes a
            /// backlog. Shutdown waits for the dispatch of what the finished deliveries staged
            /// before it closes the publisher, so the event of every order processed is in the
            /// queue, once, and no outbox row is left for a relay to publish again.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_graceful_stop_publishes_what_was_staged_and_leaves_no_row() {
                const ORDERS: usize = 300;
                let (pool, _dir) = $pool;
                let queue = unique("idem-test-ob-stop");
                let billed = format!("{queue}.billed");
                let transport = RabbitTransport::new(RabbitConfig::new(amqp_url()));
                let specs = [
                    QueueSpec::new(queue.clone(), consumer()),
                    QueueSpec::new(billed.clone(), "billed"),
                ];
                transport.declare(&specs).await.unwrap();
                let publisher = broker::publisher().await;
                for n in 0..ORDERS {
                    let order = Order {
                        order_id: format!("{queue}-{n}"),
                        customer: format!("{queue}-c"),
                        amount_cents: 1,
                    };
                    let envelope = Envelope::new(serde_json::to_vec(&order).unwrap())
                        .with_message_id(format!("m-{queue}-{n}"));
                    publisher
                        .publish_unconfirmed(&queue, &envelope)
                        .await
                        .unwrap();
                }
                publisher.wait_for_confirms().await.unwrap();
                let running = start(
                    Runtime::builder()
                        .transport(transport)
                        .store(inbox(&pool, STOP).await)
                        .state(Target(billed.clone()))
                        .handlers([consumer()])
                        .handler_queue(consumer(), &queue)
                        .without_relay(),
                );
                wait_until("a third of the orders processed", DEADLINE, || async {
                    running.now().processed >= ORDERS as u64 / 3
                })
                .await;
                let processed = running.shut_down().await.processed as usize;
                assert_eq!(
                    outbox_rows(&pool, STOP, &queue).await,
                    0,
                    "outbox rows left behind by a graceful stop"
                );
                wait_until(
                    "every processed order's event in the queue",
                    DEADLINE,
                    || async { broker::count(&billed).await >= processed },
                )
                .await;
                let got = broker::drain(&billed).await;
                let ids: std::collections::HashSet<_> =
                    got.iter().filter_map(|m| m.message_id()).collect();
                assert_eq!(
                    (got.len(), ids.len()),
                    (processed, processed),
                    "one event per order processed"
                );
                broker::delete_topology(&queue, &[]).await;
                broker::delete_topology(&billed, &[]).await;
            }

            /// Through `build()`: a handler that stages a message no broker can carry (the
            /// queue it names is 300 bytes; AMQP's short strings hold 255) is refused at `stage()`:
            /// its transaction rolls back, the order is dead-lettered with reason `handler`
            /// saying why, nothing is left in the outbox, and the runtime goes on (before, the
            /// message committed and the dispatch panicked on it).
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_message_no_broker_can_carry_is_refused_where_it_is_staged() {
                let (pool, _dir) = $pool;
                let queue = unique("idem-test-ob-long");
                let transport = RabbitTransport::new(RabbitConfig::new(amqp_url()));
                transport
                    .declare(&[QueueSpec::new(queue.clone(), consumer())])
                    .await
                    .unwrap();
                let publisher = broker::publisher().await;
                for n in 0..2 {
                    let order = Order {
                        order_id: format!("{queue}-{n}"),
                        customer: format!("{queue}-c"),
                        amount_cents: 1,
                    };
                    let envelope = Envelope::new(serde_json::to_vec(&order).unwrap())
                        .with_message_id(format!("{queue}-{n}"));
                    publisher.publish("", &queue, &envelope).await.unwrap();
                }
                let store = inbox(&pool, LONG).await;
                let running = start(
                    Runtime::builder()
                        .transport(transport)
                        .store(store.clone())
                        .state(Target("q".repeat(300)))
                        .handlers([consumer()])
                        .handler_queue(consumer(), &queue),
                );
                wait_until("both orders dead-lettered", DEADLINE, || async {
                    running.now().dead_lettered == 2
                })
                .await;
                assert!(!running.task.is_finished(), "the runtime goes on");
                let seen = running.shut_down().await;
                assert_eq!((seen.processed, seen.rejected), (0, 2), "{seen:?}");
                let records = store.dead_letters(&queue).await.unwrap();
                assert_eq!(records.len(), 2, "{records:?}");
                for record in &records {
                    assert_eq!(record.reason, "handler");
                    assert!(
                        record.detail.contains("queue is 300 bytes"),
                        "{}",
                        record.detail
                    );
                }
                assert_eq!(outbox_rows(&pool, LONG, &queue).await, 0);
                broker::delete_topology(&queue, &[]).await;
            }

            fn consumer() -> &'static str {
                idem::registry::find(concat!(module_path!(), "::bill"))
                    .unwrap()
                    .consumer()
            }

            /// The inbox in `table`, migrated.
            async fn inbox(pool: &sqlx::Pool<$db>, table: &str) -> $inbox {
                let inbox = <$inbox>::new(pool.clone()).table(table).unwrap();
                inbox.migrate().await.unwrap();
                inbox
            }

            /// The rows of the outbox beside `table` whose run key starts with `like`.
            async fn outbox_rows(pool: &sqlx::Pool<$db>, table: &str, like: &str) -> i64 {
                let outbox = table.replace("_inbox", "_outbox");
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(
                    $count.replace("{outbox}", &outbox),
                ))
                .bind(format!("{like}%"))
                .fetch_one(pool)
                .await
                .unwrap()
            }

            /// Through `build()` on RabbitMQ: every committed order publishes its `Billed`
            /// (two for one customer, in the order staged), a refused order publishes
            /// nothing, nor does a savepoint rolled back, a duplicate publishes nothing again; each message carries the id
            /// derived from (consumer, key, ordinal), the incoming correlation (else its
            /// message id), the causation id and the incoming `traceparent`.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn staged_messages_go_out_after_the_commit_and_never_after_a_rollback() {
                let (pool, _dir) = $pool;
                let queue = unique("idem-test-ob");
                let billed = format!("{queue}.billed");
                let rabbit =
                    RabbitConfig::new(amqp_url()).connection_name(format!("idem-test:{queue}"));
                let policy =
                    RetryPolicy::new(3, Duration::from_millis(50), 2, Duration::from_millis(200))
                        .unwrap();
                let mut spec = QueueSpec::new(queue.clone(), consumer());
                spec.retry_delays = policy.delays();
                let transport = RabbitTransport::new(rabbit.clone());
                transport
                    .declare(&[spec, QueueSpec::new(billed.clone(), "billed")])
                    .await
                    .unwrap();
                let publisher = broker::publisher().await;
                let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
                let order = |n: usize| Order {
                    order_id: match n {
                        7 => format!("{queue}-{n}-refused"),
                        n => format!("{queue}-{n}"),
                    },
                    customer: match n {
                        3 => format!("{queue}-c-twice"),
                        9 => format!("{queue}-c-savepoint"),
                        _ => format!("{queue}-c"),
                    },
                    amount_cents: n as i64,
                };
                for n in (0..20).chain([4, 5]) {
                    let order = order(n);
                    let mut envelope = Envelope::new(serde_json::to_vec(&order).unwrap())
                        .with_message_id(format!("m-{}", order.order_id));
                    if n == 1 {
                        envelope = envelope.with_correlation_id("corr-1");
                    }
                    // Ids with NUL, which PostgreSQL's text refuses: staged all the same.
                    if n == 10 {
                        envelope = envelope
                            .with_correlation_id("corr\0nul")
                            .with_message_id(format!("m-\0-{}", order.order_id));
                    }
                    if n == 2 {
                        envelope = envelope.with_header("traceparent", traceparent);
                    }
                    publisher.publish("", &queue, &envelope).await.unwrap();
                }
                let running = start(
                    Runtime::builder()
                        .transport(transport)
                        .store(inbox(&pool, TABLE).await)
                        .state(Target(billed.clone()))
                        .handlers([consumer()])
                        .handler_queue(consumer(), &queue)
                        .retry(policy.clone()),
                );
                wait_until("every delivery settled", DEADLINE, || async {
                    let now = running.now();
                    now.processed + now.duplicates + now.dead_lettered >= 22
                })
                .await;
                wait_until("the outbox drained", DEADLINE, || async {
                    outbox_rows(&pool, TABLE, &queue).await == 0
                })
                .await;
                let stats = running.shut_down().await;
                assert_eq!(
                    (stats.processed, stats.duplicates, stats.dead_lettered),
                    (19, 2, 1),
                    "{stats:?}"
                );
                let got = broker::drain(&billed).await;
                // 18 orders once, order 3 twice; nothing of the refused order 7, nor what order
                // 9 staged in the savepoint it rolled back.
                let got_ids: Vec<_> = got.iter().map(|m| m.message_id()).collect();
                assert_eq!(got.len(), 20, "{got_ids:?}");
                let mut ids: HashMap<String, Vec<String>> = HashMap::new();
                for message in &got {
                    let body: Order = serde_json::from_slice(&message.body).unwrap();
                    ids.entry(body.order_id)
                        .or_default()
                        .push(message.message_id().unwrap());
                }
                assert!(
                    !ids.contains_key(&order(7).order_id),
                    "the refused order's message was published"
                );
                for n in (0..20).filter(|n| *n != 7) {
                    let key = order(n).order_id;
                    let expected: Vec<String> = (0..if n == 3 { 2 } else { 1 })
                        .map(|i| idem::outbox::outbox_message_id(consumer(), &key, i))
                        .collect();
                    assert_eq!(
                        ids[&key], expected,
                        "order {n}: one message per staging, in order, with derived ids"
                    );
                }
                let of = |n: usize| {
                    let id = idem::outbox::outbox_message_id(consumer(), &order(n).order_id, 0);
                    got.iter()
                        .find(|m| m.message_id().as_deref() == Some(id.as_str()))
                        .unwrap()
                };
                let causation = |n: usize| format!("m-{}", order(n).order_id);
                assert_eq!(
                    of(0)
                        .properties
                        .correlation_id()
                        .as_ref()
                        .map(|c| c.to_string()),
                    Some(causation(0))
                );
                assert_eq!(
                    of(1)
                        .properties
                        .correlation_id()
                        .as_ref()
                        .map(|c| c.to_string())
                        .as_deref(),
                    Some("corr-1")
                );
                assert_eq!(of(0).header("causation_id"), Some(causation(0)));
                assert_eq!(
                    of(10)
                        .properties
                        .correlation_id()
                        .as_ref()
                        .map(|c| c.to_string())
                        .as_deref(),
                    Some("corr\0nul")
                );
                assert_eq!(
                    of(10).header("causation_id"),
                    Some(format!("m-\0-{}", order(10).order_id))
                );
                assert_eq!(of(2).header("traceparent").as_deref(), Some(traceparent));
                assert_eq!(of(0).header("traceparent"), None);
                broker::delete_topology(&queue, &policy.delays()).await;
                broker::delete_topology(&billed, &[]).await;
            }

            /// Rows staged in a transaction of the caller's own (no consumer): a rollback
            /// leaves none; committed rows, which no dispatch takes (as after a crash between
            /// commit and dispatch), are published by a runtime's relay, with their ids.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn the_relay_publishes_what_no_dispatch_took() {
                let (pool, _dir) = $pool;
                let queue = unique("idem-test-ob-relay");
                let billed = format!("{queue}.billed");
                let transport = RabbitTransport::new(RabbitConfig::new(amqp_url()));
                let spec = QueueSpec::new(queue.clone(), consumer());
                transport
                    .declare(&[spec, QueueSpec::new(billed.clone(), "billed")])
                    .await
                    .unwrap();
                let inbox = inbox(&pool, RELAY).await;
                let message = |n: usize| {
                    let order = Order {
                        order_id: format!("{queue}-{n}"),
                        customer: "c".into(),
                        amount_cents: 1,
                    };
                    Outgoing::to_queue(&billed, &order)
                        .unwrap()
                        .with_message_id(format!("{queue}-{n}"))
                };
                let mut tx = pool.begin().await.unwrap();
                inbox.stage(&mut tx, message(0)).await.unwrap();
                tx.rollback().await.unwrap();
                let mut tx = pool.begin().await.unwrap();
                for n in 1..=5 {
                    inbox.stage(&mut tx, message(n)).await.unwrap();
                }
                let again = inbox.stage(&mut tx, message(1)).await;
                let again = again.expect_err("a message id is staged once");
                // Refused for good by the table's unique message id, on every dialect.
                assert_eq!(again.class(), idem::ErrorClass::Permanent, "{again}");
                assert!(again.to_string().contains("message_id"), "{again}");
                drop(tx); // that failed statement aborted the transaction on PostgreSQL
                // More than two of the relay's passes (500 rows each), which overlap.
                let backlog = 1_205;
                let mut tx = pool.begin().await.unwrap();
                for n in 1..=backlog {
                    inbox.stage(&mut tx, message(n)).await.unwrap();
                }
                tx.commit().await.unwrap();
                assert_eq!(outbox_rows(&pool, RELAY, &queue).await, backlog as i64);
                let running = start(
                    Runtime::builder()
                        .transport(transport)
                        .store(inbox.clone())
                        .state(Target(billed.clone()))
                        .handlers([consumer()])
                        .handler_queue(consumer(), &queue)
                        .relay(Duration::from_millis(50), Duration::ZERO),
                );
                wait_until("the relay drained the outbox", DEADLINE, || async {
                    outbox_rows(&pool, RELAY, &queue).await == 0
                })
                .await;
                running.shut_down().await;
                let ids: Vec<String> = broker::drain(&billed)
                    .await
                    .iter()
                    .filter_map(|m| m.message_id())
                    .collect();
                let expected: Vec<String> = (1..=backlog).map(|n| format!("{queue}-{n}")).collect();
                assert_eq!(ids, expected, "published once each, in the order staged");
                broker::delete_topology(&queue, &[]).await;
                broker::delete_topology(&billed, &[]).await;
            }

            /// A message no queue takes is returned by the broker: the relay parks its row, with
            /// the broker's reason, out of the way of the rows behind it, and removes the row of
            /// its run sent behind it that the broker confirmed (it is never sent again); released
            /// once the queue exists, the parked row goes out, once.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn an_unroutable_message_is_parked_and_goes_out_once_released() {
                use idem::store::{InboxStore, OutboxStore};
                let (pool, _dir) = $pool;
                let queue = unique("idem-test-ob-unroutable");
                let missing = format!("{queue}.missing");
                broker::declare_orders_queue(&queue).await;
                let inbox = inbox(&pool, UNROUTABLE).await;
                let message = |to: &str, id: String| {
                    Outgoing::new(Destination::queue(to), id.clone()).with_message_id(id)
                };
                let run = [
                    message(&missing, format!("{queue}-1")),
                    message(&queue, format!("{queue}-2")),
                ];
                let mut tx = inbox.begin().await.unwrap();
                inbox
                    .stage_rows(&mut tx, "c", &format!("{queue}-run"), &run)
                    .await
                    .unwrap();
                inbox.commit(tx).await.unwrap();
                let counting = Counting {
                    publisher: broker::publisher().await,
                    confirmed: Mutex::default(),
                };
                let select = OutboxSelect::Older {
                    age: Duration::ZERO,
                    limit: 1000,
                };
                let report = inbox.relay(&select, &counting).await.unwrap();
                assert!(report.parked >= 1 && report.failure.is_none(), "{report:?}");
                assert_eq!(
                    outbox_rows(&pool, UNROUTABLE, &queue).await,
                    0,
                    "both rows gone"
                );
                assert_eq!(broker::count(&queue).await, 1, "the routable row went out");
                // Another pass sends nothing of the run again.
                inbox.relay(&select, &counting).await.unwrap();
                assert_eq!(broker::count(&queue).await, 1, "never sent again");
                let parked: Vec<_> = inbox
                    .parked()
                    .await
                    .unwrap()
                    .into_iter()
                    .filter(|p| p.routing_key == missing)
                    .collect();
                assert_eq!(parked.len(), 1, "{parked:?}");
                assert_eq!(parked[0].message_id, format!("{queue}-1"));
                assert!(
                    parked[0].failure.contains(&missing),
                    "{}",
                    parked[0].failure
                );
                broker::declare_orders_queue(&missing).await;
                assert_eq!(inbox.release_parked(&[parked[0].seq]).await.unwrap(), 1);
                let report = inbox.relay(&select, &counting).await.unwrap();
                assert_eq!(report.parked, 0, "{report:?}");
                assert_eq!(outbox_rows(&pool, UNROUTABLE, &queue).await, 0);
                let got = broker::drain(&missing).await;
                assert_eq!(
                    got.iter()
                        .filter_map(|m| m.message_id())
                        .collect::<Vec<_>>(),
                    [format!("{queue}-1")]
                );
                assert!(
                    inbox
                        .parked()
                        .await
                        .unwrap()
                        .iter()
                        .all(|p| p.routing_key != missing)
                );
                broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
                broker::delete_topology(&missing, &RetryPolicy::default().delays()).await;
            }

            /// Through the transport's own publisher, one pass over rows to a queue that takes
            /// them, a full queue that refuses publishes (`x-overflow = reject-publish`: a
            /// nack) and an exchange that does not exist (the broker closes the channel, and
            /// every publish sent beside it fails): the refused rows are parked with their
            /// reasons, the others are published (those sent beside the channel's closing, each
            /// again alone, with its id) and removed, and the pass ends without a failure. The same id staged again while its row is parked is one message: the
            /// release merges the two, the relay goes on, and it is published once. A row the
            /// broker keeps refusing for the give-up time is given up (an outbox dead letter,
            /// no longer tried) until an operator drops it.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_row_the_broker_refuses_never_stops_the_relay() {
                use idem::store::{InboxStore, OutboxStore};
                use lapin::options::QueueDeclareOptions;
                use lapin::types::{AMQPValue, FieldTable, ShortString};
                let (pool, _dir) = $pool;
                let queue = unique("idem-test-ob-refused");
                let full = format!("{queue}.full");
                broker::declare_orders_queue(&queue).await;
                let connection = broker::connect().await;
                let channel = connection.create_channel().await.unwrap();
                let mut arguments = FieldTable::default();
                arguments.insert(ShortString::from("x-max-length"), AMQPValue::LongInt(1));
                arguments.insert(
                    ShortString::from("x-overflow"),
                    AMQPValue::LongString("reject-publish".into()),
                );
                channel
                    .queue_declare(
                        ShortString::from(full.as_str()),
                        QueueDeclareOptions::default(),
                        arguments,
                    )
                    .await
                    .unwrap();
                broker::close(connection).await;
                let publisher = broker::publisher().await;
                broker::publish(&publisher, &full, Some("filler"), b"{}").await;
                let inbox = inbox(&pool, REFUSED).await;
                // What an earlier run of this test may have left parked.
                let left: Vec<i64> = inbox
                    .parked()
                    .await
                    .unwrap()
                    .iter()
                    .map(|p| p.seq)
                    .collect();
                inbox.drop_parked(&left).await.unwrap();
                let id = |n: usize| format!("{queue}-{n}");
                let message = |exchange: &str, to: &str, n: usize| {
                    Outgoing::new(Destination::from_parts(exchange, to), id(n))
                        .with_message_id(id(n))
                };
                let missing_exchange = format!("{queue}.no-such-exchange");
                let run = [
                    message("", &queue, 1),
                    message("", &full, 2),
                    message(&missing_exchange, "x", 3),
                    message("", &queue, 4),
                    message("", &queue, 5),
                ];
                let mut tx = inbox.begin().await.unwrap();
                inbox
                    .stage_rows(&mut tx, "c", &format!("{queue}-run"), &run)
                    .await
                    .unwrap();
                inbox.commit(tx).await.unwrap();
                let transport = RabbitTransport::new(RabbitConfig::new(amqp_url()));
                let outbound = transport.outbound().unwrap();
                let select = OutboxSelect::Older {
                    age: Duration::ZERO,
                    limit: 1000,
                };
                // Older than zero at the database's clock, which counts milliseconds (SQLite).
                tokio::time::sleep(Duration::from_millis(2)).await;
                let report = inbox.relay(&select, outbound.as_ref()).await.unwrap();
                assert_eq!(
                    (report.published, report.parked, report.failure.clone()),
                    (3, 2, None),
                    "{report:?}"
                );
                assert_eq!(outbox_rows(&pool, REFUSED, &queue).await, 0);
                let published = |got: Vec<broker::Got>| -> Vec<String> {
                    got.iter().filter_map(|m| m.message_id()).collect()
                };
                // Row 1 may have reached the queue before the channel closed, its confirm lost
                // with it: sent again alone, it can arrive twice, with its id.
                let mut ids = published(broker::drain(&queue).await);
                ids.dedup();
                assert_eq!(ids, [id(1), id(4), id(5)], "each published, in order");
                let parked: Vec<_> = inbox
                    .parked()
                    .await
                    .unwrap()
                    .into_iter()
                    .filter(|p| p.message_id.starts_with(&queue))
                    .collect();
                let reasons: Vec<(String, bool)> = parked
                    .iter()
                    .map(|p| (p.message_id.clone(), p.given_up_at_ms.is_some()))
                    .collect();
                assert_eq!(reasons, [(id(2), false), (id(3), false)]);
                assert!(
                    parked[0].failure.contains("refused"),
                    "{}",
                    parked[0].failure
                );
                assert!(
                    parked[1].failure.contains("NOT_FOUND"),
                    "{}",
                    parked[1].failure
                );

                // The id of the full queue's row staged again while its row is parked.
                let mut tx = inbox.begin().await.unwrap();
                let again = [message("", &full, 2)];
                inbox
                    .stage_rows(&mut tx, "c", &format!("{queue}-again"), &again)
                    .await
                    .unwrap();
                inbox.commit(tx).await.unwrap();
                assert_eq!(broker::drain(&full).await.len(), 1, "the filler");
                assert_eq!(inbox.release_parked(&[parked[0].seq]).await.unwrap(), 1);
                assert_eq!(outbox_rows(&pool, REFUSED, &queue).await, 1, "merged");
                let report = inbox.relay(&select, outbound.as_ref()).await.unwrap();
                assert_eq!((report.published, report.failure), (1, None));
                assert_eq!(published(broker::drain(&full).await), [id(2)], "once");

                // Kept refusing past the give-up time: given up, no longer tried.
                let impatient = inbox.clone().outbox_give_up(Duration::ZERO);
                let report = impatient.relay(&select, outbound.as_ref()).await.unwrap();
                assert_eq!(report.given_up, 1, "{report:?}");
                let given_up: Vec<_> = inbox
                    .parked()
                    .await
                    .unwrap()
                    .into_iter()
                    .filter(|p| p.message_id.starts_with(&queue))
                    .collect();
                assert_eq!(given_up.len(), 1);
                assert_eq!(given_up[0].message_id, id(3));
                assert!(given_up[0].given_up_at_ms.is_some());
                assert_eq!(inbox.drop_parked(&[given_up[0].seq]).await.unwrap(), 1);
                assert!(
                    inbox
                        .parked()
                        .await
                        .unwrap()
                        .iter()
                        .all(|p| !p.message_id.starts_with(&queue))
                );
                broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
                broker::delete_topology(&full, &[]).await;
            }

            /// A row staged to go 4 s later, beside one to go now: the relay's passes (by
            /// age, outside any handler, by its run) publish the first and hold it back until
            /// it is due; then it goes once, published as of its time.
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn a_scheduled_row_goes_out_once_it_is_due_and_not_before() {
                let (pool, _dir) = $pool;
                let queue = unique("idem-test-ob-later");
                broker::declare_orders_queue(&queue).await;
                let inbox = inbox(&pool, SCHEDULED).await;
                let counting = Counting {
                    publisher: broker::publisher().await,
                    confirmed: Mutex::default(),
                };
                // Due once the connections are made, with room for a busy machine's passes.
                let due = std::time::SystemTime::now() + Duration::from_secs(4);
                let due_ms = due
                    .duration_since(std::time::UNIX_EPOCH)
                    .unwrap()
                    .as_millis() as i64;
                let mut tx = pool.begin().await.unwrap();
                let now = Outgoing::new(Destination::queue(&queue), "now")
                    .with_message_id(format!("{queue}-now"));
                let later = Outgoing::new(Destination::queue(&queue), "later")
                    .with_message_id(format!("{queue}-later"))
                    .deliver_at(due);
                inbox.stage(&mut tx, later).await.unwrap();
                inbox.stage(&mut tx, now).await.unwrap();
                tx.commit().await.unwrap();
                let passes = [
                    OutboxSelect::Older {
                        age: Duration::ZERO,
                        limit: 100,
                    },
                    OutboxSelect::Unowned { limit: 100 },
                    OutboxSelect::Runs {
                        runs: vec![(String::new(), format!("{queue}-later"))],
                    },
                ];
                use idem::store::OutboxStore;
                for select in &passes {
                    inbox.relay(select, &counting).await.unwrap();
                }
                assert!(
                    std::time::SystemTime::now() < due,
                    "the first passes ran past the row's time: the test cannot tell"
                );
                let published = |id: &str| counting.confirmed.lock().unwrap().get(id).copied();
                assert_eq!(published(&format!("{queue}-now")), Some(1));
                assert_eq!(
                    published(&format!("{queue}-later")),
                    None,
                    "not before its time"
                );
                assert_eq!(outbox_rows(&pool, SCHEDULED, &queue).await, 1);
                wait_until("the scheduled row published", DEADLINE, || async {
                    for select in &passes {
                        inbox.relay(select, &counting).await.unwrap();
                    }
                    published(&format!("{queue}-later")).is_some()
                })
                .await;
                let went = idem::transport::headers::epoch_ms();
                assert!(went >= due_ms, "published {} ms early", due_ms - went);
                for select in &passes {
                    inbox.relay(select, &counting).await.unwrap();
                }
                assert_eq!(published(&format!("{queue}-later")), Some(1), "once");
                assert_eq!(outbox_rows(&pool, SCHEDULED, &queue).await, 0);
                let got = broker::drain(&queue).await;
                assert_eq!(got.len(), 2);
                let later = got.iter().find(|m| m.body == b"later").unwrap();
                // Published as of its time (AMQP's timestamp is in seconds).
                assert_eq!(*later.properties.timestamp(), Some((due_ms / 1000) as u64));
                broker::delete_topology(&queue, &[]).await;
            }

            /// Three relays on connections of their own take passes over 600 rows at once:
            /// each row is published and confirmed once, and the queue holds 600 messages.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn several_relays_publish_each_row_once() {
                let (pool, _dir) = $pool;
                let queue = unique("idem-test-ob-relays");
                broker::declare_orders_queue(&queue).await;
                let inbox = inbox(&pool, RELAYS).await;
                let mut tx = pool.begin().await.unwrap();
                for n in 0..600 {
                    let message = Outgoing::new(Destination::queue(&queue), format!("{n}"))
                        .with_message_id(format!("{queue}-{n}"));
                    inbox.stage(&mut tx, message).await.unwrap();
                }
                tx.commit().await.unwrap();
                let counting = Arc::new(Counting {
                    publisher: broker::publisher().await,
                    confirmed: Mutex::default(),
                });
                let mut relays = Vec::new();
                for _ in 0..3 {
                    let (own, _own_dir) = $pool;
                    let relay = <$inbox>::new(own).table(RELAYS).unwrap();
                    let counting = counting.clone();
                    let pool = pool.clone();
                    let like = queue.clone();
                    relays.push(tokio::spawn(async move {
                        let select = OutboxSelect::Older {
                            age: Duration::ZERO,
                            limit: 50,
                        };
                        let mut passes = 0;
                        while outbox_rows(&pool, RELAYS, &like).await > 0 {
                            use idem::store::OutboxStore;
                            relay.relay(&select, counting.as_ref()).await.unwrap();
                            passes += 1;
                            assert!(passes < 10_000, "the relays made no progress");
                        }
                        drop(_own_dir);
                    }));
                }
                for relay in relays {
                    relay.await.unwrap();
                }
                let confirmed = counting.confirmed.lock().unwrap().clone();
                let ours: Vec<_> = confirmed
                    .iter()
                    .filter(|(id, _)| id.starts_with(&queue))
                    .collect();
                assert_eq!(ours.len(), 600);
                assert!(ours.iter().all(|(_, n)| **n == 1), "a row published twice");
                wait_until("600 messages in the queue", DEADLINE, || async {
                    broker::count(&queue).await == 600
                })
                .await;
                broker::delete_topology(&queue, &[]).await;
            }
        }
    };
}

async fn postgres() -> (sqlx::PgPool, Option<tempfile::TempDir>) {
    let pool = common::postgres(8).await;
    let inbox = idem::sql::PgInbox::new(pool.clone()).table(TABLE).unwrap();
    inbox.migrate().await.unwrap();
    (pool, None)
}

async fn mysql() -> (sqlx::MySqlPool, Option<tempfile::TempDir>) {
    let pool = common::mysql(8).await;
    let inbox = idem::sql::MySqlInbox::new(pool.clone())
        .table(TABLE)
        .unwrap();
    inbox.migrate().await.unwrap();
    (pool, None)
}

/// One SQLite file per suite run: the relays of one test share it through pools of their own.
async fn sqlite() -> (sqlx::SqlitePool, Option<tempfile::TempDir>) {
    static FILE: std::sync::OnceLock<tempfile::TempDir> = std::sync::OnceLock::new();
    let dir = FILE.get_or_init(|| tempfile::tempdir().unwrap());
    let pool = common::sqlite_at(&dir.path().join("outbox.db"), 4).await;
    let inbox = idem::sql::SqliteInbox::new(pool.clone())
        .table(TABLE)
        .unwrap();
    inbox.migrate().await.unwrap();
    (pool, None)
}

outbox_suite!(
    postgres,
    Postgres,
    sqlx::Postgres,
    idem::sql::PgInbox,
    postgres().await,
    "SELECT count(*) FROM {outbox} WHERE key LIKE $1"
);
outbox_suite!(
    mysql,
    MySql,
    sqlx::MySql,
    idem::sql::MySqlInbox,
    mysql().await,
    "SELECT CAST(count(*) AS SIGNED) FROM {outbox} WHERE `key` LIKE ?"
);
outbox_suite!(
    sqlite,
    Sqlite,
    sqlx::Sqlite,
    idem::sql::SqliteInbox,
    sqlite().await,
    "SELECT count(*) FROM {outbox} WHERE key LIKE ?1"
);

/// A process of the orders example that commits an order and dies (SIGABRT, fault injection)
/// right after the commit, before its outbox dispatch: the committed row stays, unpublished;
/// another process's relay publishes it with the id derived from the order, and shipping books
/// every order once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_dying_between_commit_and_dispatch_leaves_its_event_to_another_relay() {
    crash_between_hops("after_commit_before_dispatch").await;
}

/// The same with the process dying after the broker confirmed the event, before its row was
/// removed: another relay publishes it again, with the same id, and shipping skips the copy
/// (counted as a duplicate; a copy under a new id would be shipped again, or dead-lettered).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_process_dying_between_publish_and_mark_has_its_event_published_again_with_its_id() {
    crash_between_hops("after_publish_before_mark").await;
}

/// Shipping's outcomes (`idem_messages_total{consumer="shipping"}`) from the metrics that a
/// process serves at `addr`; fails if it does not answer.
async fn shipping_outcomes(addr: &str) -> HashMap<String, f64> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut stream = tokio::net::TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("the metrics at {addr}: {e}"));
    let request = format!("GET /metrics HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut response = String::new();
    stream.read_to_string(&mut response).await.unwrap();
    assert!(response.starts_with("HTTP/1.1 200"), "{response}");
    let mut outcomes = HashMap::new();
    for line in response.lines() {
        let Some(labels) = line.strip_prefix("idem_messages_total{") else {
            continue;
        };
        let Some((labels, value)) = labels.split_once("} ") else {
            continue;
        };
        if !labels.contains(r#"consumer="shipping""#) {
            continue;
        }
        let outcome = labels
            .split(',')
            .find_map(|l| l.strip_prefix(r#"outcome=""#))
            .and_then(|o| o.strip_suffix('"'))
            .unwrap_or_else(|| panic!("no outcome in {line}"));
        outcomes.insert(outcome.to_owned(), value.trim().parse().unwrap());
    }
    outcomes
}

async fn crash_between_hops(point: &str) {
    use common::broker;
    use common::running::DEADLINE;
    use std::os::unix::process::ExitStatusExt;
    use std::process::{Command, Stdio};

    let binary = common::faulty_orders::build();
    // The processes' tables live in a schema of the test's own: a relay publishes whatever its
    // outbox table holds, and a row another test left in the public one would crash the first
    // process before it published an event of its own.
    let schema = common::OwnSchema::create("idem_test_ob_crash", 2).await;
    let pool = schema.pool.clone();
    let queue = common::unique("idem-test-ob-crash");
    let billed = format!("{queue}.billed");
    broker::declare_orders_queue(&queue).await;
    let publisher = broker::publisher().await;
    let ids: Vec<String> = (0..20).map(|n| format!("{queue}-{n}")).collect();
    for (n, id) in ids.iter().enumerate() {
        let order = Order {
            order_id: id.clone(),
            customer: format!("{queue}-c{}", n % 3),
            amount_cents: 1,
        };
        broker::publish(
            &publisher,
            &queue,
            Some(id),
            &serde_json::to_vec(&order).unwrap(),
        )
        .await;
    }
    let consume = |fault: &str| {
        Command::new(&binary)
            .arg("consume")
            .env("AMQP_URL", broker::amqp_url())
            .env("DATABASE_URL", &schema.url)
            .env("ORDERS_QUEUE", &queue)
            .env("ORDERS_CONCURRENCY", "1")
            .env("IDEM_FAULT", fault)
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap()
    };
    let outbox = |pool: sqlx::PgPool, like: String| async move {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM idem_outbox WHERE key LIKE $1")
            .bind(format!("{like}-%"))
            .fetch_one(&pool)
            .await
            .unwrap()
    };
    let mut first = consume(&format!("{point}=1"));
    let started = std::time::Instant::now();
    let status = loop {
        if let Some(status) = first.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < DEADLINE,
            "the process did not reach {point}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
    };
    assert_eq!(status.signal(), Some(6), "aborted at {point}: {status:?}");
    let left = outbox(pool.clone(), queue.clone()).await;
    if point == "after_commit_before_dispatch" {
        assert_eq!(left, 1, "the committed order's event is left in the outbox");
        assert_eq!(broker::count(&billed).await, 0, "nothing was published");
    } else {
        // The dispatch runs beside the next orders: some may have committed meanwhile.
        assert!(left >= 1, "the published event's row is left in the outbox");
    }

    // The second process serves its metrics: shipping's outcomes are counted there.
    let metrics = format!("127.0.0.1:{}", common::tls_node::free_port());
    let mut second = common::KillOnDrop(
        Command::new(&binary)
            .args(["consume", "--metrics-addr", &metrics])
            .env("AMQP_URL", broker::amqp_url())
            .env("DATABASE_URL", &schema.url)
            .env("ORDERS_QUEUE", &queue)
            .env("ORDERS_CONCURRENCY", "1")
            .env("RUST_LOG", "error")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    common::wait_until(
        "every order shipped and the outbox drained",
        DEADLINE,
        || async {
            let shipped: i64 =
                sqlx::query_scalar("SELECT count(*) FROM shipments WHERE order_id LIKE $1")
                    .bind(format!("{queue}-%"))
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            shipped == 20 && outbox(pool.clone(), queue.clone()).await == 0
        },
    )
    .await;
    // The copies a relay published again arrive after the shipment they repeat: the judgement
    // waits for both hops to hold nothing, ready or unacknowledged, retry queues included.
    let delays = idem::RetryPolicy::default().delays();
    let hops = [
        common::drained::hop(&queue, &delays),
        common::drained::hop(&billed, &delays),
    ]
    .concat();
    common::drained::wait_drained("both hops", &hops, DEADLINE).await;
    let outcomes = shipping_outcomes(&metrics).await;
    let _ = Command::new("kill")
        .args(["-TERM", &second.0.id().to_string()])
        .status();
    let _ = second.0.wait();

    // Nothing dead-lettered on either hop: a copy under a new id would have been shipped again
    // or refused there (`drain` fails on a queue that does not exist).
    for dlq in [idem::rabbitmq::dlq(&queue), idem::rabbitmq::dlq(&billed)] {
        let dead: Vec<_> = broker::drain(&dlq)
            .await
            .iter()
            .map(|d| (d.message_id(), d.header(idem::rabbitmq::REASON_HEADER)))
            .collect();
        assert!(dead.is_empty(), "dead letters in {dlq}: {dead:?}");
    }
    // Shipping's dedup keys are the events' message ids: each derived from its order's key,
    // and no other (the schema is this test's own: every shipping key is this run's).
    let mut keys: Vec<String> =
        sqlx::query_scalar("SELECT key FROM idem_inbox WHERE consumer = 'shipping'")
            .fetch_all(&pool)
            .await
            .unwrap();
    keys.sort_unstable();
    let mut derived: Vec<String> = ids
        .iter()
        .map(|id| idem::outbox::outbox_message_id("orders", id, 0))
        .collect();
    derived.sort_unstable();
    assert_eq!(
        keys, derived,
        "every event carried its derived id, and only it"
    );
    // The logs have no unique key: an order booked or shipped twice would be there twice.
    let mut expected = ids.clone();
    expected.sort_unstable();
    for (log, query) in [
        ("ledger", "SELECT order_id FROM ledger"),
        ("shipment_log", "SELECT order_id FROM shipment_log"),
    ] {
        let mut logged: Vec<String> = sqlx::query_scalar(query).fetch_all(&pool).await.unwrap();
        logged.sort_unstable();
        assert_eq!(logged, expected, "{log}: every order once");
    }
    let parcels: Vec<(String, i64)> =
        sqlx::query_as("SELECT customer, n FROM parcels WHERE customer LIKE $1 ORDER BY customer")
            .bind(format!("{queue}-c%"))
            .fetch_all(&pool)
            .await
            .unwrap();
    let expected: Vec<(String, i64)> = (0..3)
        .map(|c| (format!("{queue}-c{c}"), if c < 2 { 7 } else { 6 }))
        .collect();
    assert_eq!(parcels, expected, "each order shipped once");
    // Shipping refused nothing in the second process (a copy under a new id that reached a
    // stored shipment would have been a conflict or a rejection).
    for refused in ["conflict", "rejected", "dead_lettered", "stale"] {
        assert_eq!(
            outcomes.get(refused).copied().unwrap_or(0.0),
            0.0,
            "shipping's outcomes in the second process: {outcomes:?}"
        );
    }
    if point == "after_publish_before_mark" {
        // The event was published twice with one id (by the process that died, then by the
        // second one's relay): whichever copy came second was skipped.
        assert!(
            outcomes.get("duplicate").copied().unwrap_or(0.0) >= 1.0,
            "shipping skipped the copy: {outcomes:?}"
        );
    }
    broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
    broker::delete_topology(&billed, &idem::RetryPolicy::default().delays()).await;
    schema.drop().await;
}

/// On PostgreSQL a row staged outside any handler is published at once: its transaction
/// notifies the relays (`LISTEN`/`NOTIFY`) at the commit. The relay here polls only every
/// minute, for rows a minute old: the message arrives long before that.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_notification_wakes_the_relay() {
    use common::broker::{self, amqp_url};
    use common::running::start;
    use idem::rabbitmq::{RabbitConfig, RabbitTransport};
    use std::time::Duration;

    let (pool, _) = postgres().await;
    let inbox = idem::sql::PgInbox::new(pool.clone()).table(NOTIFY).unwrap();
    inbox.migrate().await.unwrap();
    let queue = common::unique("idem-test-ob-notify");
    let consumed = format!("{queue}.in");
    broker::declare_orders_queue(&queue).await;
    broker::declare_orders_queue(&consumed).await;
    let consumer = idem::registry::find("outbox::postgres::bill")
        .unwrap()
        .consumer();
    let running = start(
        idem::Runtime::builder()
            .transport(RabbitTransport::new(RabbitConfig::new(amqp_url())))
            .store(inbox.clone())
            .state(Target(String::new()))
            .handlers([consumer])
            .handler_queue(consumer, &consumed)
            .relay(Duration::from_secs(60), Duration::from_secs(60)),
    );
    // The first row goes out once the relay listens (it takes what was staged meanwhile);
    // the second only through its notification, or the next poll, a minute later.
    for n in 1..=2 {
        let mut tx = pool.begin().await.unwrap();
        let message = Outgoing::new(Destination::queue(&queue), "hello")
            .with_message_id(format!("{queue}-{n}"));
        inbox.stage(&mut tx, message).await.unwrap();
        tx.commit().await.unwrap();
        common::wait_until("the relay to publish", Duration::from_secs(20), || async {
            broker::count(&queue).await == n
        })
        .await;
    }
    running.shut_down().await;
    broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
    broker::delete_topology(&consumed, &idem::RetryPolicy::default().delays()).await;
}

/// A batch handler staging one `Billed` per order. A batch holding an order of customer
/// `…-item` stages that order's event through its item's context (`ctx.item(i)`), the others
/// with one `stage_all` on the batch's context. Then it overwrites the body of every row it
/// staged in its outbox, in the same transaction: a message published from memory carries the
/// body it was staged with, one read back after the commit carries the overwritten one.
#[idempotent(store = Postgres, key = "orders.order_id", queue = "idem-test-ob-batch-unset", batch = 10)]
async fn bill_all(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    orders: idem::Batch<Order>,
    ctx: &idem::Context<'_>,
    target: &Target,
) -> Result<(), idem::BatchError> {
    let mut events = Vec::new();
    for (i, order) in orders.iter().enumerate() {
        let billed = Outgoing::to_queue(&target.0, order)?;
        match order.customer.ends_with("-item") {
            true => {
                let item = ctx.item(i).expect("an item of the batch");
                idem::outbox::stage(tx, item, billed).await?;
            }
            false => events.push((i, billed)),
        }
    }
    idem::outbox::stage_all(tx, ctx, events).await?;
    sqlx::query("UPDATE idem_ob_batch_outbox SET body = $1 WHERE key = $2")
        .bind(br#"{"read":"back"}"#.as_slice())
        .bind(ctx.run_key())
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Through `build()` on RabbitMQ and PostgreSQL, batches of 10: the events of batches that
/// staged everything on the batch's context go out from memory (the body as staged), those of
/// the batch that staged one through an item's context are read back after the commit (the
/// body as committed); every order's event goes out once, with its derived id, and no outbox
/// row is left.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_handlers_events_go_out_from_memory_unless_staged_through_an_item() {
    use common::broker::{self, amqp_url};
    use common::running::{DEADLINE, start};
    use idem::rabbitmq::{RabbitConfig, RabbitTransport};
    use idem::transport::{QueueSpec, Transport};

    const ORDERS: usize = 30;
    let (pool, _) = postgres().await;
    let inbox = idem::sql::PgInbox::new(pool.clone()).table(BATCH).unwrap();
    inbox.migrate().await.unwrap();
    let consumer = idem::registry::find("outbox::bill_all").unwrap().consumer();
    let queue = common::unique("idem-test-ob-batch");
    let billed = format!("{queue}.billed");
    let transport = RabbitTransport::new(RabbitConfig::new(amqp_url()));
    let specs = [
        QueueSpec::new(queue.clone(), consumer),
        QueueSpec::new(billed.clone(), "billed"),
    ];
    transport.declare(&specs).await.unwrap();
    let publisher = broker::publisher().await;
    // The orders go out before the runtime starts: each batch takes 10 of them, in order.
    let customer = |n: usize| match n {
        25 => format!("{queue}-item"),
        _ => format!("{queue}-c"),
    };
    for n in 0..ORDERS {
        let order = Order {
            order_id: format!("{queue}-{n:02}"),
            customer: customer(n),
            amount_cents: 1,
        };
        let body = serde_json::to_vec(&order).unwrap();
        broker::publish(&publisher, &queue, None, &body).await;
    }
    let running = start(
        idem::Runtime::builder()
            .transport(transport)
            .store(inbox)
            .state(Target(billed.clone()))
            .handlers([consumer])
            .handler_queue(consumer, &queue)
            .handler_batch(consumer, 10)
            .linger(std::time::Duration::from_millis(200))
            .without_relay(),
    );
    common::wait_until("every order processed", DEADLINE, || async {
        running.now().processed == ORDERS as u64
    })
    .await;
    common::wait_until("every event in the queue", DEADLINE, || async {
        broker::count(&billed).await >= ORDERS
    })
    .await;
    let stats = running.shut_down().await;
    let got = broker::drain(&billed).await;
    assert_eq!(got.len(), ORDERS, "one event per order: {stats:?}");
    let mut ids = std::collections::HashSet::new();
    let (mut from_memory, mut read_back) = (0, Vec::new());
    for message in &got {
        let id = message.message_id().unwrap_or_default();
        ids.insert(id.clone());
        let body: serde_json::Value = serde_json::from_slice(&message.body).unwrap();
        if body == serde_json::json!({"read": "back"}) {
            read_back.push(id);
            continue;
        }
        let order: Order = serde_json::from_value(body).unwrap();
        let derived = idem::outbox::outbox_message_id(consumer, &order.order_id, 0);
        assert_eq!(id, derived, "the derived id of {}", order.order_id);
        from_memory += 1;
    }
    let derived =
        |n: usize| idem::outbox::outbox_message_id(consumer, &format!("{queue}-{n:02}"), 0);
    assert_eq!(
        ids,
        (0..ORDERS).map(derived).collect(),
        "one event per order, with its id"
    );
    assert!(
        read_back.contains(&derived(25)),
        "the batch that staged through an item's context read back: {read_back:?}"
    );
    assert!(
        read_back.len() <= 10,
        "only that batch read back: {read_back:?}"
    );
    assert_eq!(from_memory + read_back.len(), ORDERS);
    assert!(
        from_memory >= 10,
        "the other batches from memory: {from_memory}"
    );
    let left: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_ob_batch_outbox WHERE key LIKE $1")
            .bind(format!("{queue}%"))
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(left, 0, "outbox rows left");
    broker::delete_topology(&queue, &[]).await;
    broker::delete_topology(&billed, &[]).await;
}
