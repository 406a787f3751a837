//! The handwritten consumers of the latency benchmark: lapin + sqlx, publishing their event
//! after the commit, with no outbox or with one.

use super::latency::{Quantiles, Sent, feed, quantiles};
use super::next_hop::Events;
use super::{BILLED, ORDERS, OutboxBench, reset};
use crate::workload::Order;
use anyhow::bail;
use futures_util::StreamExt;
use idem::Envelope;
use idem::rabbitmq::{Publisher, RabbitConfig};
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use sqlx::{Connection as _, PgConnection};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// Creates the handwritten consumers' inbox, `bench_outbox_hand` (the narrow row a lean
/// consumer writes per message), and the outbox of the one that keeps one,
/// `bench_outbox_hand_outbox` (the event's id and body).
pub(super) async fn create_hand_tables(pool: &sqlx::PgPool) -> anyhow::Result<()> {
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_outbox_hand (consumer TEXT NOT NULL, key TEXT NOT NULL, \
         received_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (consumer, key))",
    )
    .execute(pool)
    .await?;
    sqlx::query(
        "CREATE TABLE IF NOT EXISTS bench_outbox_hand_outbox (message_id TEXT PRIMARY KEY, \
         body BYTEA NOT NULL, created_at TIMESTAMPTZ NOT NULL DEFAULT now())",
    )
    .execute(pool)
    .await?;
    Ok(())
}

/// What the handwritten consumer does with its event.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum HandEvent {
    /// Published after the commit, with no outbox: a crash in between loses it.
    AfterCommit,
    /// Staged as an outbox row in the order's transaction, published after the commit, and its
    /// row deleted once confirmed (on a second connection with `synchronous_commit = off`: a
    /// delete lost in a crash only sends the event again): the same work as idem's outbox.
    Outbox,
}

/// The handwritten consumer's workers (the runtime's default concurrency) and prefetch (its
/// default prefetch).
const WORKERS: usize = 8;
const PREFETCH: u16 = 32;

/// One run of a handwritten consumer: `WORKERS` tasks, each holding its own connection,
/// taking deliveries from one consumer; per order an inbox row (and with [`HandEvent::Outbox`]
/// the event's outbox row) in its own transaction, then, after the commit, the event published
/// and its confirm awaited (then its row deleted), then the ack.
pub(super) async fn handwritten_run(
    b: &OutboxBench,
    pool: &sqlx::PgPool,
    rabbit: &RabbitConfig,
    event: HandEvent,
) -> anyhow::Result<(Quantiles, Option<Quantiles>)> {
    reset(pool, &b.amqp_url).await?;
    let sent = Sent::default();
    let events = Events::start(b, sent.clone()).await?;
    let total = (b.rate * b.seconds) as usize;
    let connection =
        lapin::Connection::connect(&b.amqp_url, lapin::ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(PREFETCH, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            ORDERS.into(),
            "handwritten".into(),
            BasicConsumeOptions::default(),
            Default::default(),
        )
        .await?;
    let consumer = Arc::new(tokio::sync::Mutex::new(consumer.take(total)));
    let publisher = Arc::new(Publisher::connect(rabbit).await?);
    let took = Arc::new(Mutex::new(Vec::with_capacity(total)));
    let mut workers = tokio::task::JoinSet::new();
    for _ in 0..WORKERS {
        let mut db = PgConnection::connect(&b.database_url).await?;
        // The outbox variant's deletes, on a connection of their own; none without the outbox.
        let mut deletes = match event {
            HandEvent::Outbox => {
                let mut deletes = PgConnection::connect(&b.database_url).await?;
                sqlx::query("SET synchronous_commit = off")
                    .execute(&mut deletes)
                    .await?;
                Some(deletes)
            }
            HandEvent::AfterCommit => None,
        };
        let (consumer, publisher, took) = (consumer.clone(), publisher.clone(), took.clone());
        workers.spawn(async move {
            loop {
                let next = consumer.lock().await.next().await;
                let Some(delivery) = next else {
                    return anyhow::Ok(());
                };
                let delivery = delivery?;
                let order: Order = serde_json::from_slice(&delivery.data)?;
                let mut tx = db.begin().await?;
                let claimed = sqlx::query(
                    "INSERT INTO bench_outbox_hand (consumer, key) VALUES ('handwritten', $1) \
                     ON CONFLICT DO NOTHING",
                )
                .bind(&order.order_id)
                .execute(&mut *tx)
                .await?
                .rows_affected();
                let id = format!("billed-{}", order.order_id);
                let body = serde_json::to_vec(&order)?;
                if claimed == 1 && event == HandEvent::Outbox {
                    sqlx::query(
                        "INSERT INTO bench_outbox_hand_outbox (message_id, body) VALUES ($1, $2)",
                    )
                    .bind(&id)
                    .bind(&body)
                    .execute(&mut *tx)
                    .await?;
                }
                tx.commit().await?;
                if claimed == 1 {
                    let committed = Instant::now();
                    let message = Envelope::new(body).with_message_id(&id);
                    publisher.publish("", BILLED, &message).await?;
                    let elapsed = committed.elapsed();
                    if let Some(deletes) = &mut deletes {
                        sqlx::query("DELETE FROM bench_outbox_hand_outbox WHERE message_id = $1")
                            .bind(&id)
                            .execute(&mut *deletes)
                            .await?;
                    }
                    took.lock()
                        .map_err(|_| anyhow::anyhow!("poisoned"))?
                        .push(elapsed);
                }
                delivery.ack(BasicAckOptions::default()).await?;
            }
        });
    }
    let fed = feed(b, &sent).await?;
    while let Some(done) = workers.join_next().await {
        done??;
    }
    let _ = connection.close(200, "done".into()).await;
    let end_to_end = super::check_events(b, events, fed).await?;
    let left: i64 = sqlx::query_scalar("SELECT count(*) FROM bench_outbox_hand_outbox")
        .fetch_one(pool)
        .await?;
    if left > 0 {
        bail!("the handwritten outbox kept {left} rows of confirmed events");
    }
    let took = std::mem::take(&mut *took.lock().map_err(|_| anyhow::anyhow!("poisoned"))?);
    Ok((quantiles(took), end_to_end))
}
