//! The consumers a user would write by hand with lapin + sqlx: insert-first inbox row and the
//! business writes in one transaction, ack after the commit. Kept honest and reasonably tuned:
//! prepared statements, a pool per worker, concurrent workers or batches with one multiple ack,
//! and a lean per-message consumer whose workers each hold their own connection.

use crate::full_row;
use crate::workload::{Order, apply, apply_set};
use anyhow::Context as _;
use futures_util::StreamExt;
use lapin::message::Delivery;
use lapin::options::{BasicAckOptions, BasicConsumeOptions, BasicQosOptions};
use lapin::types::{FieldTable, ShortString};
use lapin::{Channel, Connection, ConnectionProperties};
use sqlx::PgPool;
use sqlx::{Connection as _, PgConnection};
use std::collections::HashSet;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

pub(crate) const CONSUMER: &str = "handwritten";

async fn channel(
    url: &str,
    queue: &str,
    prefetch: u16,
) -> anyhow::Result<(Connection, Channel, lapin::Consumer)> {
    let connection = Connection::connect(url, ConnectionProperties::default()).await?;
    let channel = connection.create_channel().await?;
    channel
        .basic_qos(prefetch, BasicQosOptions::default())
        .await?;
    let consumer = channel
        .basic_consume(
            ShortString::from(queue),
            ShortString::from(CONSUMER),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
    Ok((connection, channel, consumer))
}

/// A delivery as the handwritten consumers read it, from either broker: its dedup key (the
/// message id) and its body.
pub(crate) trait Incoming {
    /// The message id.
    fn key(&self) -> Option<&str>;
    /// The body.
    fn body(&self) -> &[u8];
}

impl Incoming for Delivery {
    fn key(&self) -> Option<&str> {
        self.properties.message_id().as_ref().map(|id| id.as_str())
    }

    fn body(&self) -> &[u8] {
        &self.data
    }
}

/// A delivery the handwritten per-message consumers ack after their commit.
pub(crate) trait Acked: Incoming + Send + Sync + 'static {
    /// Acks it.
    fn ack_after_commit(&self) -> impl std::future::Future<Output = anyhow::Result<()>> + Send;
}

impl Acked for Delivery {
    async fn ack_after_commit(&self) -> anyhow::Result<()> {
        self.ack(BasicAckOptions::default()).await?;
        Ok(())
    }
}

fn parse(delivery: &impl Incoming) -> anyhow::Result<(String, Order)> {
    let key = delivery.key().context("no message id")?.to_owned();
    Ok((key, serde_json::from_slice(delivery.body())?))
}

/// One transaction per message, `workers` at once, each delivery acked after its commit.
/// Returns the time from the first delivery to the last ack.
pub async fn per_message(
    url: &str,
    pool: PgPool,
    queue: &str,
    expect: usize,
    workers: usize,
    prefetch: u16,
) -> anyhow::Result<Duration> {
    let (connection, _channel, consumer) = channel(url, queue, prefetch).await?;
    let first = OnceLock::new();
    consumer
        .take(expect)
        .for_each_concurrent(workers, |delivery| {
            let (pool, first) = (&pool, &first);
            async move {
                let Ok(delivery) = delivery else {
                    panic!("the consumer failed")
                };
                first.get_or_init(Instant::now);
                while let Err(e) = process_one(pool, &delivery).await {
                    tracing::warn!(error = %e, "retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                if let Err(e) = delivery.ack(BasicAckOptions::default()).await {
                    panic!("ack failed: {e}");
                }
            }
        })
        .await;
    let elapsed = first.get().map(Instant::elapsed).unwrap_or_default();
    let _ = connection.close(200, ShortString::from("done")).await;
    Ok(elapsed)
}

async fn process_one(pool: &PgPool, delivery: &Delivery) -> anyhow::Result<()> {
    let mut tx = pool.begin().await?;
    claim_and_apply(&mut tx, CLAIM, delivery).await?;
    tx.commit().await?;
    Ok(())
}

/// The pooled consumer's claim: its inbox holds the key alone.
const CLAIM: &str =
    "INSERT INTO bench_inbox (consumer, key) VALUES ($1, $2) ON CONFLICT DO NOTHING";
/// The lean consumer's claim: its inbox row also gets the arrival time (a column default).
const CLAIM_LEAN: &str =
    "INSERT INTO bench_lean_inbox (consumer, key) VALUES ($1, $2) ON CONFLICT DO NOTHING";

/// Claims the delivery's key with `claim` and, when it is new, applies the order, in `tx`.
async fn claim_and_apply(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    claim: &'static str,
    delivery: &impl Incoming,
) -> anyhow::Result<()> {
    let (key, order) = parse(delivery)?;
    let claimed = sqlx::query(claim)
        .bind(CONSUMER)
        .bind(&key)
        .execute(&mut **tx)
        .await?
        .rows_affected()
        == 1;
    if claimed {
        apply(tx, &order).await?;
    }
    Ok(())
}

/// How a batched consumer writes the new orders of a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Writes {
    /// Each order's two statements.
    PerOrder,
    /// One multi-row insert and one aggregated balance update for the batch.
    SetBased,
}

/// The inbox a batched consumer claims its keys in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Inbox {
    /// `(consumer, key)` and nothing else: no way to remove old rows but a full scan.
    Bare,
    /// The lean consumer's inbox: an arrival time with an index on it, so old rows can be
    /// removed in bounded batches (what idem's `expires_at` index is for).
    Retained,
    /// idem's own inbox row, written by hand: the body's SHA-256, status, attempts, three
    /// timestamps and the `expires_at` index; the claim answers with the stored fingerprint of
    /// each key it did not insert, which the consumer compares (payload-conflict detection).
    /// What idem's guarantees cost in SQL, without idem's runtime.
    Full,
}

impl Inbox {
    /// The batch's claim: one multi-row insert returning the keys it inserted.
    fn claim(self) -> &'static str {
        match self {
            Self::Bare => {
                "INSERT INTO bench_inbox (consumer, key) SELECT $1, unnest($2::text[])
                 ON CONFLICT DO NOTHING RETURNING key"
            }
            Self::Retained => {
                "INSERT INTO bench_lean_inbox (consumer, key) SELECT $1, unnest($2::text[])
                 ON CONFLICT DO NOTHING RETURNING key"
            }
            Self::Full => full_row::CLAIM_BATCH,
        }
    }
}

/// How a batched consumer gathers and writes its batches.
#[derive(Debug, Clone, Copy)]
pub struct Batching {
    /// Messages per transaction at most.
    pub size: usize,
    /// How long a batch waits for more after its first delivery.
    pub linger: Duration,
    /// How the new orders are written.
    pub writes: Writes,
    /// Where the keys are claimed.
    pub inbox: Inbox,
}

/// Up to `batching.size` messages per transaction (or what arrives within its linger), keys
/// claimed in its inbox with one multi-row insert, the new orders written as it says, then one
/// `basic.ack(multiple)` after the commit. One batch at a time, three batches of prefetch.
pub async fn batched(
    url: &str,
    pool: PgPool,
    queue: &str,
    expect: usize,
    batching: Batching,
) -> anyhow::Result<Duration> {
    let Batching {
        size: batch,
        linger,
        writes,
        inbox,
    } = batching;
    // Three batches, as idem's default: at batch 200 it drained faster than two (BENCHMARKS.md).
    let prefetch = u16::try_from(batch * 3).unwrap_or(u16::MAX);
    let (connection, channel, mut consumer) = channel(url, queue, prefetch).await?;
    let mut first = None;
    let mut settled = 0;
    while settled < expect {
        let deliveries = gather(&mut consumer, batch, linger, &mut first).await?;
        while let Err(e) = process_batch(&pool, &deliveries, writes, inbox).await {
            tracing::warn!(error = %e, "retrying the batch");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let last = deliveries
            .last()
            .map(|d| d.delivery_tag)
            .unwrap_or_default();
        channel
            .basic_ack(last, BasicAckOptions { multiple: true })
            .await?;
        settled += deliveries.len();
    }
    let elapsed = first.map(|t| t.elapsed()).unwrap_or_default();
    let _ = connection.close(200, ShortString::from("done")).await;
    Ok(elapsed)
}

/// Up to `size` deliveries of `stream`: the first as it comes (the start of the measured
/// interval when `first` is still empty), then what arrives within `linger` after it.
pub(crate) async fn gather<T, E>(
    stream: &mut (impl futures_util::Stream<Item = Result<T, E>> + Unpin),
    size: usize,
    linger: Duration,
    first: &mut Option<Instant>,
) -> anyhow::Result<Vec<T>>
where
    E: std::error::Error + Send + Sync + 'static,
{
    let mut batch = Vec::with_capacity(size);
    batch.push(stream.next().await.context("the consumer ended")??);
    first.get_or_insert_with(Instant::now);
    let deadline = tokio::time::Instant::now() + linger;
    while batch.len() < size {
        match tokio::time::timeout_at(deadline, stream.next()).await {
            Ok(Some(delivery)) => batch.push(delivery?),
            Ok(None) | Err(_) => break,
        }
    }
    Ok(batch)
}

/// One batch's transaction: its keys claimed in `inbox`, its new orders written as `writes`
/// says, committed.
pub(crate) async fn process_batch(
    pool: &PgPool,
    deliveries: &[impl Incoming],
    writes: Writes,
    inbox: Inbox,
) -> anyhow::Result<()> {
    let parsed = deliveries
        .iter()
        .map(parse)
        .collect::<anyhow::Result<Vec<_>>>()?;
    let mut tx = pool.begin().await?;
    let fresh = if inbox == Inbox::Full {
        let bodies: Vec<&[u8]> = deliveries.iter().map(Incoming::body).collect();
        full_row::claim_batch(&mut tx, CONSUMER, &bodies, &parsed).await?
    } else {
        let keys: Vec<&str> = parsed.iter().map(|(key, _)| key.as_str()).collect();
        let claimed: Vec<String> = sqlx::query_scalar(inbox.claim())
            .bind(CONSUMER)
            .bind(&keys)
            .fetch_all(&mut *tx)
            .await?;
        let mut new: HashSet<String> = claimed.into_iter().collect();
        // A key twice in the batch: only its first copy was claimed.
        parsed
            .iter()
            .filter(|(key, _)| new.remove(key))
            .map(|(_, order)| order)
            .collect()
    };
    match writes {
        Writes::PerOrder => {
            for order in fresh {
                apply(&mut tx, order).await?;
            }
        }
        Writes::SetBased if fresh.is_empty() => {}
        Writes::SetBased => apply_set(&mut tx, &fresh).await?,
    }
    tx.commit().await?;
    Ok(())
}

/// The lean per-message consumer: `workers` tasks, each holding its own PostgreSQL connection
/// for the whole run and taking deliveries from one shared consumer; a narrow inbox row
/// (consumer, key, received_at; an index on received_at for cleanup), one transaction per
/// message, the ack awaited after the commit. With `Inbox::Full` it claims in idem's own inbox
/// row instead, with idem's claim statement.
pub async fn lean_per_message(
    url: &str,
    database_url: &str,
    queue: &str,
    expect: usize,
    workers: usize,
    prefetch: u16,
    inbox: Inbox,
) -> anyhow::Result<Duration> {
    let (connection, _channel, consumer) = channel(url, queue, prefetch).await?;
    let elapsed = lean_workers(consumer, database_url, expect, workers, inbox).await?;
    let _ = connection.close(200, ShortString::from("done")).await;
    Ok(elapsed)
}

/// The lean consumer's workers, on either broker: `workers` tasks, each holding its own
/// PostgreSQL connection and taking deliveries from the shared `stream` until `expect` are
/// taken, one transaction per delivery, acked after its commit. Returns the time from the
/// first delivery to the last ack.
pub(crate) async fn lean_workers<M, E>(
    stream: impl futures_util::Stream<Item = Result<M, E>> + Send + Unpin + 'static,
    database_url: &str,
    expect: usize,
    workers: usize,
    inbox: Inbox,
) -> anyhow::Result<Duration>
where
    M: Acked,
    E: std::error::Error + Send + Sync + 'static,
{
    let stream = Arc::new(tokio::sync::Mutex::new(stream.take(expect)));
    let first = Arc::new(OnceLock::new());
    let mut tasks = tokio::task::JoinSet::new();
    for _ in 0..workers {
        let mut db = PgConnection::connect(database_url).await?;
        let (stream, first) = (stream.clone(), first.clone());
        tasks.spawn(async move {
            loop {
                let next = stream.lock().await.next().await;
                let Some(delivery) = next else {
                    return anyhow::Ok(());
                };
                let delivery = delivery?;
                first.get_or_init(Instant::now);
                while let Err(e) = process_lean(&mut db, &delivery, inbox).await {
                    tracing::warn!(error = %e, "retrying");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                delivery.ack_after_commit().await?;
            }
        });
    }
    while let Some(done) = tasks.join_next().await {
        done??;
    }
    Ok(first.get().map(Instant::elapsed).unwrap_or_default())
}

/// One message's transaction on the worker's own connection: its key claimed in `inbox` and,
/// when new, its order applied, committed.
pub(crate) async fn process_lean(
    db: &mut PgConnection,
    delivery: &impl Incoming,
    inbox: Inbox,
) -> anyhow::Result<()> {
    let mut tx = db.begin().await?;
    if inbox == Inbox::Full {
        let (key, order) = parse(delivery)?;
        full_row::claim_and_apply(&mut tx, CONSUMER, &key, &order, delivery.body()).await?;
    } else {
        claim_and_apply(&mut tx, CLAIM_LEAN, delivery).await?;
    }
    tx.commit().await?;
    Ok(())
}
