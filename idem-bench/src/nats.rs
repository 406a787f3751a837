//! The benchmark on NATS JetStream (`--broker nats`): each consumer's queue made afresh, the
//! workload published, the queue found empty afterwards, and the consumers a good engineer
//! would write by hand with async-nats + sqlx.
//!
//! A handwritten consumer's queue is a work-queue stream of its own (`BENCH_<queue>`) with a
//! durable pull consumer as idem's (explicit acks, 10,000 unacknowledged at most), pulled
//! `prefetch` messages at a time. Its ack is JetStream's plain ack, sent after the commit and
//! not confirmed: a lost ack redelivers a message the inbox then skips, so the strongest
//! handwritten consumer needs no more. idem's ack is a double ack, confirmed by the server,
//! so that a settlement is known; what that costs is in the ratio.

use crate::handwritten::{self, Inbox, Incoming};
use crate::workload::{Order, Workload};
use anyhow::{Context as _, bail};
use async_nats::HeaderMap;
use async_nats::jetstream::consumer::{AckPolicy, DeliverPolicy, pull};
use async_nats::jetstream::stream::{Config, RetentionPolicy, StorageType};
use async_nats::jetstream::{self, Context, Message};
use futures_util::StreamExt as _;
use idem::nats::{MESSAGE_ID_HEADER, NatsConfig, NatsTransport};
use idem::transport::{QueueSpec, Transport as _};
use sqlx::PgPool;
use std::time::{Duration, Instant};

/// The durable consumer of the handwritten consumers.
const DURABLE: &str = "handwritten";

impl Incoming for Message {
    fn key(&self) -> Option<&str> {
        self.headers
            .as_ref()
            .and_then(|h| h.get(MESSAGE_ID_HEADER))
            .map(|id| id.as_str())
    }

    fn body(&self) -> &[u8] {
        &self.payload
    }
}

async fn connect(url: &str) -> anyhow::Result<(async_nats::Client, Context)> {
    let client = async_nats::connect(url).await.with_context(|| {
        format!("NATS is not reachable at {url}; start it with `nats-server -js`")
    })?;
    let js = jetstream::new(client.clone());
    Ok((client, js))
}

/// How the handwritten consumers ack: plain (JetStream's ack, not confirmed), or confirmed
/// (a request the server answers once it took the ack, as idem's double ack).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ack {
    Plain,
    Confirmed,
}

impl Ack {
    async fn send(self, client: &async_nats::Client, message: &Message) -> anyhow::Result<()> {
        match self {
            Self::Plain => message.ack().await.map_err(|e| anyhow::anyhow!("ack: {e}")),
            Self::Confirmed => {
                let reply = message.reply.clone().context("no reply subject")?;
                let request = async_nats::Request::new().payload("+ACK".into());
                client.send_request(reply, request).await?;
                Ok(())
            }
        }
    }
}

/// A JetStream message with what acks it, for the handwritten per-message workers.
struct Acking {
    message: Message,
    client: async_nats::Client,
    ack: Ack,
}

impl Incoming for Acking {
    fn key(&self) -> Option<&str> {
        self.message.key()
    }

    fn body(&self) -> &[u8] {
        self.message.body()
    }
}

impl handwritten::Acked for Acking {
    async fn ack_after_commit(&self) -> anyhow::Result<()> {
        self.ack.send(&self.client, &self.message).await
    }
}

/// The stream of a handwritten consumer's queue.
fn own_stream(queue: &str) -> String {
    format!("BENCH_{}", queue.replace('.', "_"))
}

/// Deletes `queue`'s streams and declares them anew, empty: idem's (through its transport,
/// with the default retry delays) for idem's consumers, else the handwritten consumer's own.
pub async fn fresh_queue(
    url: &str,
    queue: &str,
    idem_consumer: Option<&str>,
) -> anyhow::Result<()> {
    let (client, js) = connect(url).await?;
    // Whatever holds the subject now (an earlier run's streams of either kind).
    while let Ok(stream) = js.stream_by_subject(queue).await {
        js.delete_stream(&stream).await?;
    }
    let transport = NatsTransport::new(NatsConfig::new(url).connection_name("idem-bench"));
    transport.delete_queue(queue).await?;
    match idem_consumer {
        Some(consumer) => {
            let mut spec = QueueSpec::new(queue, consumer);
            spec.retry_delays = idem::RetryPolicy::default().delays();
            transport.declare(&[spec]).await?;
        }
        None => {
            js.create_stream(Config {
                name: own_stream(queue),
                subjects: vec![queue.to_owned()],
                retention: RetentionPolicy::WorkQueue,
                storage: StorageType::File,
                ..Config::default()
            })
            .await?;
        }
    }
    transport.close().await;
    client.flush().await?;
    Ok(())
}

/// Publishes every message to `queue` with its order id in `Idem-Message-Id` and no
/// `Nats-Msg-Id` (the workload's copies must reach the consumers), each confirmed.
pub async fn publish(url: &str, queue: &str, workload: &Workload) -> anyhow::Result<()> {
    let (_client, js) = connect(url).await?;
    for chunk in workload.messages.chunks(2000) {
        publish_orders(&js, queue, chunk).await?;
    }
    Ok(())
}

/// A JetStream context to publish orders through ([`publish_orders`]).
pub async fn feeder(url: &str) -> anyhow::Result<Context> {
    Ok(connect(url).await?.1)
}

/// Publishes `orders` to `queue`, then waits for JetStream to take them all.
pub async fn publish_orders(js: &Context, queue: &str, orders: &[Order]) -> anyhow::Result<()> {
    let mut confirms = Vec::with_capacity(orders.len());
    for order in orders {
        let mut headers = HeaderMap::new();
        headers.insert(MESSAGE_ID_HEADER, order.order_id.as_str());
        headers.insert("Content-Type", "application/json");
        let body = serde_json::to_vec(order)?;
        confirms.push(
            js.publish_with_headers(queue.to_owned(), headers, body.into())
                .await?,
        );
    }
    for confirm in confirms {
        confirm.await.context("JetStream did not take a message")?;
    }
    Ok(())
}

/// Messages left in `queue`'s stream once the consumer has exited. Its last plain acks may
/// still be on their way: waits up to 5 s for the count to reach 0.
pub async fn left_in_queue(url: &str, queue: &str) -> anyhow::Result<u64> {
    let (_client, js) = connect(url).await?;
    let name = js
        .stream_by_subject(queue)
        .await
        .context("the queue's stream is gone")?;
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let left = js.get_stream(&name).await?.info().await?.state.messages;
        if left == 0 || Instant::now() > deadline {
            return Ok(left);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// The handwritten consumer's pull stream on `queue`: its durable consumer (explicit acks, as
/// idem's), `prefetch` messages per pull.
async fn messages(js: &Context, queue: &str, prefetch: usize) -> anyhow::Result<pull::Stream> {
    let stream = js.get_stream(own_stream(queue)).await?;
    let consumer = stream
        .get_or_create_consumer(
            DURABLE,
            pull::Config {
                durable_name: Some(DURABLE.to_owned()),
                ack_policy: AckPolicy::Explicit,
                deliver_policy: DeliverPolicy::All,
                ack_wait: Duration::from_secs(30),
                max_ack_pending: 10_000,
                ..pull::Config::default()
            },
        )
        .await?;
    Ok(consumer
        .stream()
        .max_messages_per_batch(prefetch.max(1))
        .messages()
        .await?)
}

/// How the per-message consumer works.
#[derive(Debug, Clone, Copy)]
pub struct Workers {
    /// Tasks, each with its own database connection.
    pub count: usize,
    /// Messages per pull.
    pub prefetch: u16,
    /// Where the keys are claimed.
    pub inbox: Inbox,
    /// How messages are acked.
    pub ack: Ack,
}

/// `hand-lean` on JetStream: `workers` tasks, each holding its own PostgreSQL connection and
/// taking messages from one shared pull stream, one transaction per message, acked after the
/// commit. Returns the time from the first message to the last ack.
pub async fn lean_per_message(
    url: &str,
    database_url: &str,
    queue: &str,
    expect: usize,
    workers: Workers,
) -> anyhow::Result<Duration> {
    let Workers {
        count: workers,
        prefetch,
        inbox,
        ack,
    } = workers;
    let (client, js) = connect(url).await?;
    let stream = messages(&js, queue, usize::from(prefetch)).await?;
    let client_for_acks = client.clone();
    let stream = stream.map(move |message| {
        message.map(|message| Acking {
            message,
            client: client_for_acks.clone(),
            ack,
        })
    });
    let elapsed = handwritten::lean_workers(stream, database_url, expect, workers, inbox).await?;
    client.flush().await?;
    Ok(elapsed)
}

/// `hand-set` on JetStream: up to `size` messages per transaction (or what arrives within
/// `linger`), claimed and written as `writes` and `inbox` say, each acked after the commit
/// (a work-queue stream takes explicit acks only, so there is no multiple ack); three batches
/// pulled at a time. Returns the time from the first message to the last ack.
pub async fn batched(
    url: &str,
    pool: PgPool,
    queue: &str,
    expect: usize,
    batching: handwritten::Batching,
    ack: Ack,
) -> anyhow::Result<Duration> {
    let handwritten::Batching {
        size,
        linger,
        writes,
        inbox,
    } = batching;
    let (client, js) = connect(url).await?;
    let mut stream = messages(&js, queue, size * 3).await?;
    let mut first = None;
    let mut settled = 0;
    while settled < expect {
        let batch = handwritten::gather(&mut stream, size, linger, &mut first).await?;
        while let Err(e) = handwritten::process_batch(&pool, &batch, writes, inbox).await {
            tracing::warn!(error = %e, "retrying the batch");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        match ack {
            Ack::Plain => {
                for message in &batch {
                    ack.send(&client, message).await?;
                }
            }
            // Every confirm awaited together.
            Ack::Confirmed => {
                futures_util::future::try_join_all(batch.iter().map(|m| ack.send(&client, m)))
                    .await?;
            }
        }
        settled += batch.len();
    }
    let elapsed = first.map(|t| t.elapsed()).unwrap_or_default();
    client.flush().await?;
    Ok(elapsed)
}

/// Fails unless every consumer in `variants` runs on NATS.
pub fn check_variants(variants: &[crate::Variant]) -> anyhow::Result<()> {
    use crate::Variant::*;
    if let Some(other) = variants.iter().find(|v| {
        !matches!(
            v,
            HandLean | HandLeanFull | HandSet | HandSetFull | Idem | IdemBatch | IdemSet
        )
    }) {
        bail!(
            "--broker nats: {} has no NATS run; use hand-lean, hand-lean-full, hand-set, hand-set-full, idem, idem-batch or idem-set",
            other.name()
        );
    }
    Ok(())
}
