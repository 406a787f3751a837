//! The parent process: at each inbox size, for each run, each consumer in its own child
//! process on a fresh queue, its effects checked afterwards.

use crate::prefill::{self, InboxTable};
use crate::report::Sample;
use crate::workload::{self, Workload};
use crate::{AutovacuumSetting, Bench, Broker, Variant, curve, nats, pool, with_idem};
use anyhow::{Context as _, bail};
use clap::ValueEnum as _;
use idem::RetryPolicy;
use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use idem::transport::Transport;
use idem::transport::{Partition, QueueSpec};
use lapin::options::{ExchangeDeleteOptions, QueueDeclareOptions, QueueDeleteOptions};
use lapin::types::{FieldTable, ShortString};
use std::process::Stdio;

/// The order of the consumers (indexes into `--variants`) in run `run` (from 1): as listed, or
/// with `alternate` in even runs the first and then the others in reverse.
pub(crate) fn run_order(variants: usize, run: usize, alternate: bool) -> Vec<usize> {
    if alternate && run.is_multiple_of(2) && variants > 0 {
        std::iter::once(0).chain((1..variants).rev()).collect()
    } else {
        (0..variants).collect()
    }
}

/// The parent: at each inbox size, for each run, each consumer in turn on a fresh queue and
/// empty business tables.
pub async fn bench(b: Bench) -> anyhow::Result<()> {
    let mut sizes = b.prefill.clone();
    sizes.sort_unstable();
    sizes.dedup();
    let prefilled = sizes.iter().any(|&size| size > 0);
    let keys = b.keys.unwrap_or(match prefilled {
        true => workload::Keys::Uuid4,
        false => workload::Keys::Sequential,
    });
    let workload = Workload::new(b.messages, b.dup_rate, keys);
    eprintln!(
        "workload: {} messages, {} distinct orders ({} duplicates), {keys:?} keys, {} runs of {:?}",
        b.messages,
        workload.unique,
        b.messages - workload.unique,
        b.runs,
        b.variants
    );
    if b.broker == Broker::Nats {
        nats::check_variants(&b.variants)?;
    }
    if b.latency_rate.is_some() && prefilled {
        bail!("--latency-rate runs on empty inboxes; leave out --prefill");
    }
    if b.latency_rate.is_some()
        && let Some(ordered) = b.variants.iter().find(|v| v.partitions().is_some())
    {
        bail!(
            "--latency-rate feeds one queue; {} consumes partitions: leave it out of --variants",
            ordered.name()
        );
    }
    let mut tables: Vec<InboxTable> = b.variants.iter().map(|v| v.inbox()).collect();
    tables.dedup();
    tables.sort_by_key(|t| t.name());
    tables.dedup();
    if b.sweep
        && let Some(bare) = b.variants.iter().find(|v| !v.inbox().retained())
    {
        bail!(
            "--sweep: {} keeps no arrival time, so nothing of its inbox can expire; leave it out of --variants",
            bare.name()
        );
    }
    let pool = pool(&b.database_url, 2).await?;
    with_idem::inbox(pool.clone())?.migrate().await?;
    workload::reset(&pool, with_idem::TABLE, prefilled.then_some(&workload)).await?;
    let (autovacuum, on) = prefill::Autovacuum::set(
        &pool,
        match b.autovacuum {
            AutovacuumSetting::On => Some(true),
            AutovacuumSetting::Off => Some(false),
            AutovacuumSetting::Server => None,
        },
    )
    .await?;
    eprintln!("PostgreSQL autovacuum: {}", if on { "on" } else { "off" });
    let mut measured = measure_sizes(&b, &pool, &workload, &tables, &sizes, prefilled).await;
    if let (Ok(curve), Some(rate)) = (&measured, b.latency_rate) {
        let rates = curve.first_rates();
        if let Err(e) = crate::latency::measure(&b, rate, &pool, &workload, &rates).await {
            measured = Err(e);
        }
    }
    autovacuum.restore().await?;
    let curve = measured?;
    if sizes.len() > 1 || b.sweep {
        println!("{}", curve.render());
        if let Some(path) = &b.plot {
            curve.plot(path)?;
            eprintln!("curve drawn into {}", path.display());
        }
    }
    Ok(())
}

/// Measures every consumer at each of `sizes` (filling the inbox tables up in between), then,
/// with `--sweep`, at the largest with the sweepers at work.
async fn measure_sizes(
    b: &Bench,
    pool: &sqlx::PgPool,
    workload: &Workload,
    tables: &[InboxTable],
    sizes: &[u64],
    prefilled: bool,
) -> anyhow::Result<curve::Curve> {
    let keys = workload.kind;
    let mut curve = curve::Curve::new(b.variants.iter().map(|v| v.name()).collect());
    // What an earlier run left is kept when it is no more than the first size (so that
    // measuring the largest size again does not fill it again).
    let mut held = vec![0; tables.len()];
    for (table, held) in tables.iter().zip(&mut held).filter(|_| prefilled) {
        *held = table.live_rows(pool).await?;
        if *held > sizes[0] {
            table.empty(pool).await?;
            *held = 0;
        }
        table.vacuum(pool).await?;
    }
    let mut filled = 0;
    for &size in sizes {
        for (table, held) in tables.iter().zip(&mut held) {
            if size > *held {
                table.fill(pool, keys, *held, size - *held).await?;
                table.vacuum(pool).await?;
                *held = size;
            }
        }
        filled = filled.max(size);
        eprintln!("inbox rows: {size}");
        // An empty inbox is emptied before each run (as without `--prefill`): a table that
        // autovacuum analysed while it was empty would be planned as empty.
        let point = measure(b, pool, workload, (size > 0).then_some(tables), None).await?;
        println!("{}", point.table.render(b.messages));
        curve.add(size, false, point, b.messages);
    }
    if b.sweep {
        // A day's worth of the retention window, expired.
        let day = filled / u64::from(prefill::RETENTION_DAYS);
        let expired = Expired { day, next: filled };
        eprintln!("inbox rows: {filled}, and {day} expired, the sweepers at work");
        let point = measure(b, pool, workload, Some(tables), Some(expired)).await?;
        println!("{}", point.table.render(b.messages));
        curve.add(filled, true, point, b.messages);
        curve.sweeper_alone = Some(sweep_alone(pool, keys, day, filled * 4, b.sweep_pause).await?);
    }
    Ok(curve)
}

/// The expired rows each run of a sweeping measurement starts with.
#[derive(Debug, Clone, Copy)]
struct Expired {
    /// How many (a day's worth).
    day: u64,
    /// The number of the next prefilled row (sequential keys stay distinct).
    next: u64,
}

/// idem's sweeper alone at the largest size: a day's worth of expired rows, deleted by one
/// `sweep` of idem's PostgreSQL inbox with the runtime's settings. Returns rows per second.
async fn sweep_alone(
    pool: &sqlx::PgPool,
    keys: workload::Keys,
    day: u64,
    next: u64,
    pause: u32,
) -> anyhow::Result<f64> {
    use idem::store::SweepStore as _;
    let table = InboxTable::Idem;
    let have = table.expired_rows(pool).await? as u64;
    table
        .fill_expired(pool, keys, next, day.saturating_sub(have))
        .await?;
    let inbox = with_idem::inbox(pool.clone())?;
    let started = std::time::Instant::now();
    let mut deleted = 0;
    loop {
        let pace = idem::store::Pace::new(pause, std::time::Duration::MAX);
        let report = inbox.sweep_paced(1_000, 1_000, pace).await?;
        deleted += report.deleted;
        if report.deleted < 1_000 * 1_000 {
            break;
        }
    }
    let rate = deleted as f64 / started.elapsed().as_secs_f64();
    eprintln!(
        "idem's sweeper alone (pause {pause}): {deleted} expired rows deleted, {rate:.0} rows/s"
    );
    Ok(rate)
}

/// Every consumer's runs at one inbox size.
async fn measure(
    b: &Bench,
    pool: &sqlx::PgPool,
    workload: &Workload,
    prefilled: Option<&[InboxTable]>,
    expired: Option<Expired>,
) -> anyhow::Result<curve::Point> {
    let mut point = curve::Point::new(b.variants.iter().map(|v| v.name()).collect());
    let mut next = expired.map(|e| e.next).unwrap_or(0);
    for run in 1..=b.runs {
        for column in run_order(b.variants.len(), run, b.alternate) {
            let variant = b.variants[column];
            workload::reset(pool, with_idem::TABLE, prefilled.map(|_| workload)).await?;
            let table = variant.inbox();
            let mut expired_before = 0;
            if let Some(expired) = expired {
                let have = table.expired_rows(pool).await? as u64;
                let add = expired.day.saturating_sub(have);
                table.fill_expired(pool, workload.kind, next, add).await?;
                next += add;
                expired_before = have + add;
            }
            let queue = variant.queue();
            match b.broker {
                Broker::Rabbitmq => {
                    fresh_queue(&b.amqp_url, &queue, variant).await?;
                    workload
                        .publish(
                            &RabbitConfig::new(&b.amqp_url),
                            &queue,
                            variant.partitions().is_some(),
                        )
                        .await?;
                }
                Broker::Nats => {
                    let consumer = variant.uses_idem().then_some(with_idem::CONSUMER);
                    nats::fresh_queue(&b.nats_url, &queue, consumer).await?;
                    nats::publish(&b.nats_url, &queue, workload).await?;
                }
            }
            let wal_before = wal_lsn(pool).await?;
            let sample = child(variant, &queue, b.messages, expired.is_some()).await?;
            let wal = wal_since(pool, &wal_before).await?;
            let swept = match expired {
                Some(_) => expired_before.saturating_sub(table.expired_rows(pool).await? as u64),
                None => 0,
            };
            workload::verify(pool, workload)
                .await
                .with_context(|| format!("{} left wrong effects", variant.name()))?;
            let mut left = 0;
            for queue in queues(&queue, variant) {
                left += match b.broker {
                    Broker::Rabbitmq => {
                        u64::from(workload::left_in_queue(&b.amqp_url, &queue).await?)
                    }
                    Broker::Nats => nats::left_in_queue(&b.nats_url, &queue).await?,
                };
            }
            if left > 0 {
                bail!("{} left {left} messages in the queue", variant.name());
            }
            if variant.stages_events() {
                let billed = workload::left_in_queue(&b.amqp_url, with_idem::BILLED).await?;
                if billed as usize != workload.unique {
                    bail!(
                        "{} published {billed} events for {} orders",
                        variant.name(),
                        workload.unique
                    );
                }
            }
            eprintln!(
                "run {run}: {:<26} {:>9.0} msgs/s  CPU {:>6.2} s  peak RSS {:>6.1} MiB  WAL {:>5.0} B/msg{}  (effects exact)",
                variant.name(),
                sample.rate(b.messages),
                sample.cpu.as_secs_f64(),
                sample.rss_kib as f64 / 1024.0,
                wal as f64 / b.messages as f64,
                match expired {
                    Some(_) => format!("  swept {swept} rows"),
                    None => String::new(),
                }
            );
            point.add(column, sample, wal, swept, b.messages);
        }
    }
    Ok(point)
}

/// The server's current write-ahead log position.
async fn wal_lsn(pool: &sqlx::PgPool) -> anyhow::Result<String> {
    Ok(sqlx::query_scalar("SELECT pg_current_wal_lsn()::text")
        .fetch_one(pool)
        .await?)
}

/// Bytes of write-ahead log written since `lsn`.
async fn wal_since(pool: &sqlx::PgPool, lsn: &str) -> anyhow::Result<u64> {
    let bytes: i64 =
        sqlx::query_scalar("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), $1::pg_lsn)::int8")
            .bind(lsn)
            .fetch_one(pool)
            .await?;
    Ok(bytes.max(0) as u64)
}

/// The queues a variant consumes: `queue`, or an ordered variant's partition queues.
fn queues(queue: &str, variant: Variant) -> Vec<String> {
    match variant.partitions() {
        Some(count) => (0..count)
            .map(|index| Partition::queue_name(queue, index))
            .collect(),
        None => vec![queue.to_owned()],
    }
}

/// Deletes `queue` (and idem's queues around it; for an ordered variant its partitions and
/// exchange) and declares it anew, empty.
pub(crate) async fn fresh_queue(url: &str, queue: &str, variant: Variant) -> anyhow::Result<()> {
    let delays = RetryPolicy::default().delays();
    let connection = lapin::Connection::connect(url, lapin::ConnectionProperties::default())
        .await
        .with_context(|| format!("cannot reach RabbitMQ at {url}"))?;
    let channel = connection.create_channel().await?;
    for queue in queues(queue, variant) {
        let mut names = vec![queue.clone(), idem::rabbitmq::dlq(&queue)];
        names.extend(
            delays
                .iter()
                .map(|d| idem::rabbitmq::retry_queue(&queue, *d)),
        );
        for name in names {
            channel
                .queue_delete(
                    ShortString::from(name.as_str()),
                    QueueDeleteOptions::default(),
                )
                .await?;
        }
    }
    if let Some(count) = variant.partitions() {
        channel
            .exchange_delete(ShortString::from(queue), ExchangeDeleteOptions::default())
            .await?;
        RabbitTransport::new(RabbitConfig::new(url))
            .declare(&QueueSpec::partitions(queue, with_idem::CONSUMER, count))
            .await?;
    } else if variant.uses_idem() {
        let mut spec = QueueSpec::new(queue, with_idem::CONSUMER);
        spec.retry_delays = delays;
        // Where the outbox variants' events go, emptied: nothing consumes it.
        let billed = QueueSpec::new(with_idem::BILLED, "bench.billed");
        RabbitTransport::new(RabbitConfig::new(url))
            .declare(&[spec, billed])
            .await?;
        channel
            .queue_purge(
                ShortString::from(with_idem::BILLED),
                lapin::options::QueuePurgeOptions::default(),
            )
            .await?;
    } else {
        let durable = QueueDeclareOptions {
            durable: true,
            ..Default::default()
        };
        channel
            .queue_declare(ShortString::from(queue), durable, FieldTable::default())
            .await?;
    }
    let _ = connection.close(200, ShortString::from("declared")).await;
    Ok(())
}

/// Runs one consumer in a child process and reads its result.
pub(crate) async fn child(
    variant: Variant,
    queue: &str,
    expect: usize,
    sweeping: bool,
) -> anyhow::Result<Sample> {
    let exe = std::env::current_exe()?;
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // The benchmark's own options first, then the subcommand.
    args.extend([
        "consume".to_owned(),
        "--variant".to_owned(),
        variant
            .to_possible_value()
            .map(|v| v.get_name().to_owned())
            .unwrap_or_default(),
        "--queue".to_owned(),
        queue.to_owned(),
        "--expect".to_owned(),
        expect.to_string(),
    ]);
    if sweeping {
        args.push("--sweeping".to_owned());
    }
    let output = tokio::process::Command::new(exe)
        .args(&args)
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()?
        .wait_with_output()
        .await?;
    if !output.status.success() {
        bail!("{} failed: {}", variant.name(), output.status);
    }
    let stdout = String::from_utf8_lossy(&output.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.strip_prefix("RESULT "))
        .context("the consumer printed no result")?;
    Sample::parse(line)
}

#[cfg(test)]
mod tests {
    use super::run_order;

    #[test]
    fn without_alternation_every_run_keeps_the_listed_order() {
        for run in 1..=4 {
            assert_eq!(run_order(3, run, false), vec![0, 1, 2]);
        }
    }

    #[test]
    fn alternated_runs_let_each_consumer_follow_each_other_equally_often() {
        assert_eq!(run_order(3, 1, true), vec![0, 1, 2]);
        assert_eq!(run_order(3, 2, true), vec![0, 2, 1]);
        assert_eq!(run_order(3, 3, true), vec![0, 1, 2]);
        assert_eq!(run_order(0, 2, true), Vec::<usize>::new());
        for variants in [2, 3] {
            // Six runs back to back: every ordered pair (predecessor, consumer) of two
            // different consumers occurs, each about as often as the others.
            let sequence: Vec<usize> = (1..=6)
                .flat_map(|run| run_order(variants, run, true))
                .collect();
            let mut pairs = std::collections::HashMap::new();
            for pair in sequence.windows(2) {
                *pairs.entry((pair[0], pair[1])).or_insert(0) += 1;
            }
            assert!(pairs.keys().all(|(a, b)| a != b), "{pairs:?}");
            assert_eq!(pairs.len(), variants * (variants - 1), "{pairs:?}");
            let counts: Vec<i32> = pairs.values().copied().collect();
            let spread = counts.iter().max().unwrap() - counts.iter().min().unwrap();
            assert!(spread <= 1, "{variants} consumers: {pairs:?}");
        }
    }
}
