//! The same work with idem: one `#[idempotent]` handler, the runtime per message or in batch
//! mode.

use crate::workload::{Order, apply, apply_set};
use anyhow::bail;
use idem::sql::PgInbox;
use idem::{Batch, BatchError, Context, HandlerError, Outgoing, Runtime, idempotent};
use sqlx::{PgPool, Postgres, Transaction};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

/// The consumer identity of the handler.
pub const CONSUMER: &str = "bench.orders";
/// The inbox table idem keeps its markers in during the benchmark.
pub const TABLE: &str = "bench_idem_inbox";

/// When the handler first ran: the start of the measured interval. Runtime state; clones share
/// it.
#[derive(Clone, Default)]
pub struct FirstCall(Arc<OnceLock<Instant>>);

#[idempotent(store = Postgres, consumer = "bench.orders", queue = "bench-orders")]
async fn place_order(
    tx: &mut Transaction<'_, Postgres>,
    order: Order,
    first: &FirstCall,
) -> Result<(), HandlerError> {
    first.0.get_or_init(Instant::now);
    apply(tx, &order).await?;
    Ok(())
}

/// The same work as a batch handler: the new orders of a batch written set-based. It shares
/// the consumer (and so the inbox) with `place_order`; the runtime runs the one it is given.
#[idempotent(store = Postgres, consumer = "bench.orders", queue = "bench-orders")]
async fn place_orders(
    tx: &mut Transaction<'_, Postgres>,
    orders: Batch<Order>,
    first: &FirstCall,
) -> Result<(), BatchError> {
    first.0.get_or_init(Instant::now);
    let orders: Vec<&Order> = orders.iter().collect();
    apply_set(tx, &orders).await?;
    Ok(())
}

/// The outbox beside [`TABLE`].
pub const OUTBOX: &str = "bench_idem_outbox";

/// The queue the outbox variants' events go to.
pub const BILLED: &str = "idem-bench-billed";

/// `place_order`, also staging one event per order in the outbox.
#[idempotent(store = Postgres, consumer = "bench.orders", queue = "bench-orders")]
async fn place_order_outbox(
    tx: &mut Transaction<'_, Postgres>,
    order: Order,
    ctx: &Context<'_>,
    first: &FirstCall,
) -> Result<(), HandlerError> {
    first.0.get_or_init(Instant::now);
    apply(tx, &order).await?;
    idem::outbox::stage(tx, ctx, Outgoing::to_queue(BILLED, &order)?).await?;
    Ok(())
}

/// `place_orders`, also staging one event per order, in one statement.
#[idempotent(store = Postgres, consumer = "bench.orders", queue = "bench-orders")]
async fn place_orders_outbox(
    tx: &mut Transaction<'_, Postgres>,
    orders: Batch<Order>,
    ctx: &Context<'_>,
    first: &FirstCall,
) -> Result<(), BatchError> {
    first.0.get_or_init(Instant::now);
    let events = orders
        .iter()
        .enumerate()
        .map(|(i, order)| Outgoing::to_queue(BILLED, order).map(|event| (i, event)))
        .collect::<Result<Vec<_>, _>>()?;
    let orders: Vec<&Order> = orders.iter().collect();
    apply_set(tx, &orders).await?;
    idem::outbox::stage_all(tx, ctx, events).await?;
    Ok(())
}

/// The inbox of the benchmark.
pub fn inbox(pool: PgPool) -> anyhow::Result<PgInbox> {
    Ok(PgInbox::new(pool).table(TABLE)?)
}

/// How idem runs.
#[derive(Debug, Clone, Copy)]
pub struct Mode {
    /// 0: one transaction per message; N: batch mode.
    pub batch: usize,
    /// Workers (per message) or batches in flight (batch mode).
    pub concurrency: usize,
    /// Prefetch (per message; batch mode uses its default, 3 × batch).
    pub prefetch: u16,
    /// Ordered over this many partitions (the queue is then their exchange).
    pub partitions: Option<usize>,
    /// An ordered handler retires a key whose message was dead-lettered instead of parking
    /// it ([`idem::KeyPolicy::Retire`]).
    pub retire_keys: bool,
    /// The batch handler (set-based writes) instead of the per-message one.
    pub batch_handler: bool,
    /// The handler also stages one event per order in the outbox.
    pub outbox: bool,
    /// Each worker keeps its connection (the default); `false`: every transaction acquires
    /// one from the pool.
    pub keep_connections: bool,
    /// The sweeper's pause after each batch ([`idem::RuntimeBuilder::sweep_pause`]).
    pub sweep_pause: u32,
}

/// Consumes until `expect` deliveries are settled. Returns the time from the first handler call
/// to the last settlement.
pub async fn run(
    transport: impl idem::transport::Transport,
    pool: PgPool,
    queue: &str,
    expect: usize,
    mode: Mode,
) -> anyhow::Result<Duration> {
    let first = FirstCall::default();
    let mut builder = Runtime::builder()
        .transport(transport)
        .store(match mode.keep_connections {
            true => inbox(pool.clone())?,
            false => inbox(pool.clone())?.hold_connections(Duration::ZERO),
        })
        .state(first.clone())
        .handlers([match (mode.batch_handler, mode.outbox) {
            (true, false) => "place_orders",
            (false, false) => "place_order",
            (true, true) => "place_orders_outbox",
            (false, true) => "place_order_outbox",
        }])
        .handler_queue(CONSUMER, queue)
        .concurrency(mode.concurrency)
        .batch(mode.batch)
        .sweep_pause(mode.sweep_pause);
    if mode.batch == 0 {
        builder = builder.prefetch(mode.prefetch);
    }
    if let Some(partitions) = mode.partitions {
        builder = builder.ordered(CONSUMER, partitions);
        if mode.retire_keys {
            builder = builder.key_policy(CONSUMER, idem::KeyPolicy::Retire);
        }
    }
    let runtime = builder.build()?;
    let stats = runtime.stats();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));
    loop {
        let settled = stats.snapshot().settled() as usize;
        if settled >= expect {
            break;
        }
        if task.is_finished() {
            bail!("the runtime stopped early: {:?}", task.await);
        }
        tokio::time::sleep(poll_wait(first.0.get(), settled, expect)).await;
    }
    let mut tick = tokio::time::interval(Duration::from_millis(1));
    if mode.outbox {
        // The work is done when every staged event is out: dispatched rows are deleted.
        let pending = format!("SELECT count(*) FROM \"{OUTBOX}\"");
        let deadline = Instant::now() + Duration::from_secs(120);
        while sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(pending.as_str()))
            .fetch_one(&pool)
            .await?
            > 0
        {
            if Instant::now() > deadline {
                bail!("staged events still unpublished after 120 s");
            }
            tick.tick().await;
        }
    }
    let elapsed = first.0.get().map(Instant::elapsed).unwrap_or_default();
    let seen = stats.snapshot();
    if seen.dead_lettered > 0 || seen.retried > 0 {
        bail!("unexpected outcomes: {seen:?}");
    }
    let _ = stop.send(());
    task.await??;
    Ok(elapsed)
}

/// How long to wait before looking at the runtime's counters again: about half the time the
/// `expect − settled` deliveries left should take at the rate since `first` (at least 1 ms, at
/// most 20 ms). The end is still seen within about a millisecond, without a timer waking the
/// process a thousand times a second through the run (a cost the handwritten consumers, which
/// count their own deliveries, do not pay: it took about 5% of the batch handler's CPU).
fn poll_wait(first: Option<&Instant>, settled: usize, expect: usize) -> Duration {
    const MIN: Duration = Duration::from_millis(1);
    const MAX: Duration = Duration::from_millis(20);
    let Some(first) = first.filter(|_| settled > 0) else {
        return MIN;
    };
    let per_delivery = first.elapsed().as_secs_f64() / settled as f64;
    let left = per_delivery * expect.saturating_sub(settled) as f64 / 2.0;
    Duration::from_secs_f64(left.min(MAX.as_secs_f64())).max(MIN)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_poll_waits_about_half_the_time_left_within_its_bounds() {
        let first = Instant::now() - Duration::from_secs(1);
        // 1,000 settled in a second: 9,000 left take 9 s, more than the ceiling.
        let far = poll_wait(Some(&first), 1_000, 10_000);
        assert_eq!(far, Duration::from_millis(20));
        // 20 left take about 20 ms: wait about 10.
        let near = poll_wait(Some(&first), 1_000, 1_020);
        assert!(
            near >= Duration::from_millis(9) && near <= Duration::from_millis(11),
            "{near:?}"
        );
        // One left, or nothing settled yet: the floor.
        assert_eq!(
            poll_wait(Some(&first), 1_000, 1_001),
            Duration::from_millis(1)
        );
        assert_eq!(poll_wait(None, 0, 10), Duration::from_millis(1));
    }
}
