//! A relay draining a backlog: rows staged outside any handler, taken by the runtime's own
//! relay (woken by the staging transaction's NOTIFY), against a raw publish-with-confirms loop
//! of the same messages (pipelined, confirms awaited per 500), run alternately.

use super::{BILLED, OutboxBench, billing, check_queue, median, outbox_rows, reset};
use crate::workload::Order;
use anyhow::bail;
use idem::Outgoing;
use idem::rabbitmq::{Publisher, RabbitConfig};
use idem::sql::PgInbox;
use metrics_exporter_prometheus::PrometheusHandle;
use std::time::{Duration, Instant};

/// Drains a backlog of `b.backlog` rows, staged outside any handler, with the runtime's own
/// relay, against a raw loop publishing the same messages with confirms, alternately; prints
/// msgs/s of each and their ratio.
pub(super) async fn backlog(
    b: &OutboxBench,
    pool: &sqlx::PgPool,
    inbox: &PgInbox,
    rabbit: &RabbitConfig,
    metrics: &PrometheusHandle,
) -> anyhow::Result<()> {
    let messages: Vec<Outgoing> = (0..b.backlog)
        .map(|n| {
            let order = Order {
                order_id: format!("o-{n}"),
                customer: format!("c{}", n % 50),
                amount_cents: 1,
            };
            Outgoing::to_queue(BILLED, &order).map(|m| m.with_message_id(format!("o-{n}")))
        })
        .collect::<Result<_, _>>()?;
    let (mut relayed, mut raw) = (Vec::new(), Vec::new());
    for run in 1..=b.runs {
        reset(pool, &b.amqp_url).await?;
        let runtime = billing(inbox, rabbit)
            .relay(Duration::from_millis(500), Duration::ZERO)
            .build()?;
        let health = runtime.health();
        let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
        let task = tokio::spawn(runtime.run_until(async {
            let _ = stopped.await;
        }));
        let deadline = Instant::now() + Duration::from_secs(30);
        while !health.is_consuming() {
            if Instant::now() > deadline {
                bail!("the runtime did not start");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let before = relay_published(metrics);
        let depth = QueueDepth::open(&b.amqp_url, BILLED).await?;
        // Staged in one transaction: its commit wakes the relay (LISTEN/NOTIFY).
        let mut tx = pool.begin().await?;
        for message in &messages {
            inbox.stage(&mut tx, message.clone()).await?;
        }
        tx.commit().await?;
        let started = Instant::now();
        // Done when the last message is confirmed, as for the raw loop: the queue holds them
        // all (a confirm follows the enqueue).
        let deadline = started + Duration::from_secs(300);
        while (depth.count().await? as usize) < b.backlog {
            if Instant::now() > deadline {
                bail!("the relay did not drain the backlog");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        let elapsed = started.elapsed();
        // And every row removed.
        while relay_published(metrics) - before < b.backlog as u64 {
            if Instant::now() > deadline {
                bail!("the relay did not remove the rows it published");
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let _ = stop.send(());
        task.await??;
        let left = outbox_rows(pool).await?;
        if left > 0 {
            bail!("the relay left {left} rows");
        }
        check_queue(&b.amqp_url, b.backlog).await?;
        relayed.push(b.backlog as f64 / elapsed.as_secs_f64());

        reset(pool, &b.amqp_url).await?;
        let publisher = Publisher::connect(rabbit).await?;
        let started = Instant::now();
        for chunk in messages.chunks(500) {
            for message in chunk {
                let (exchange, routing_key) = message.destination.parts();
                publisher
                    .publish_unconfirmed_to(exchange, routing_key, &message.envelope)
                    .await?;
            }
            publisher.wait_for_confirms().await?;
        }
        let elapsed = started.elapsed();
        check_queue(&b.amqp_url, b.backlog).await?;
        raw.push(b.backlog as f64 / elapsed.as_secs_f64());
        eprintln!(
            "run {run}: relay {:.0} msgs/s, raw publish-with-confirms loop {:.0} msgs/s",
            relayed[run - 1],
            raw[run - 1]
        );
    }
    // Leaves no backlog behind: a queue kept full of persistent messages between invocations
    // is a broker state the next invocation would measure too.
    reset(pool, &b.amqp_url).await?;
    let (relay, raw) = (median(relayed), median(raw));
    println!(
        "outbox relay draining {} rows: {relay:.0} msgs/s; raw publish-with-confirms loop of the same messages: {raw:.0} msgs/s; ratio {:.2} (medians of {})",
        b.backlog,
        relay / raw,
        b.runs
    );
    Ok(())
}

/// A queue's message count, asked on one channel held open.
struct QueueDepth {
    _connection: lapin::Connection,
    channel: lapin::Channel,
    queue: &'static str,
}

impl QueueDepth {
    async fn open(amqp_url: &str, queue: &'static str) -> anyhow::Result<Self> {
        let connection =
            lapin::Connection::connect(amqp_url, lapin::ConnectionProperties::default()).await?;
        let channel = connection.create_channel().await?;
        Ok(Self {
            _connection: connection,
            channel,
            queue,
        })
    }

    async fn count(&self) -> anyhow::Result<u32> {
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let declared = self
            .channel
            .queue_declare(self.queue.into(), passive, Default::default())
            .await?;
        Ok(declared.message_count())
    }
}

/// Rows the runtime's relays published and removed so far (`idem_outbox_published_total`).
fn relay_published(metrics: &PrometheusHandle) -> u64 {
    let series = "idem_outbox_published_total{store=\"postgres\",by=\"relay\"} ";
    metrics
        .render()
        .lines()
        .find_map(|l| l.strip_prefix(series))
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(0)
}
