//! What operators see: a Prometheus scrape of idem's metrics (every outcome, handler and claim
//! durations, rows swept, sweeper lag), a span per delivery with consumer, key, message id,
//! correlation id, attempt and outcome, and duplicate/conflict log lines carrying the key and
//! the correlation id, and how full batches are. One test: it installs the process's recorder
//! and subscriber.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::running::start;
use common::wait_until;
use idem::sql::SqliteInbox;
use idem::transport::MemoryTransport;
use idem::{Envelope, HandlerError, RetryPolicy, Runtime, idempotent};
use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
    fail: Option<String>,
}

/// The orders a handler failed once: runtime state, so a retry succeeds.
#[derive(Default)]
struct FailedOnce(Mutex<Vec<String>>);

impl FailedOnce {
    /// Whether this is the first failure asked of `key` (recording it).
    fn first(&self, key: &str) -> bool {
        let mut failed = self.0.lock().unwrap_or_else(|e| e.into_inner());
        let first = !failed.iter().any(|k| k == key);
        if first {
            failed.push(key.to_owned());
        }
        first
    }
}

/// Writes nothing but its inbox row, kept one second; fails as the order asks.
#[idempotent(store = Sqlite, queue = "obs-orders", consumer = "obs.orders", key = "order.order_id", retention = "3s")]
async fn observed(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    order: Order,
    failed: &FailedOnce,
) -> Result<u32, HandlerError> {
    match order.fail.as_deref() {
        Some("always") => Err(HandlerError::transient("the ledger is down")),
        Some("once") if failed.first(&order.order_id) => {
            Err(HandlerError::transient("the ledger blinked"))
        }
        _ => Ok(1),
    }
}

/// Panics, or finds its store unable to write, the first time it sees an order that asks for it.
#[idempotent(store = Sqlite, queue = "obs-extra", consumer = "obs.extra", key = "order.order_id")]
async fn extra(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    order: Order,
    panicked: &FailedOnce,
) -> Result<(), HandlerError> {
    match order.fail.as_deref() {
        Some("panic") if panicked.first(&order.order_id) => {
            panic!("scripted panic on {}", order.order_id)
        }
        Some("unavailable") if panicked.first(&order.order_id) => {
            Err(HandlerError::unavailable("the database is read-only"))
        }
        _ => Ok(()),
    }
}

/// Writes nothing but its inbox row; run in batch mode.
#[idempotent(store = Sqlite, queue = "obs-batched", consumer = "obs.batched", key = "order.order_id")]
async fn batched(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    order: Order,
) -> Result<(), HandlerError> {
    let _ = (order.order_id, order.fail);
    Ok(())
}

#[derive(serde::Deserialize)]
struct StatusUpdate {
    order_id: String,
    version: i64,
}

/// A versioned handler whose inbox rows expire after three seconds, as `observed`'s do.
#[idempotent(store = Sqlite, queue = "obs-status", consumer = "obs.status", retention = "3s", version = "update.version", entity = "update.order_id")]
async fn status(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    update: StatusUpdate,
) -> Result<(), HandlerError> {
    let _ = (update.order_id, update.version);
    Ok(())
}

fn status_update(version: i64, message_id: &str) -> Envelope {
    Envelope::new(serde_json::json!({"order_id": "s-1", "version": version}).to_string())
        .with_message_id(message_id)
}

#[derive(Clone, Default)]
struct Logs(Arc<Mutex<Vec<u8>>>);

impl Write for Logs {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl Logs {
    fn lines(&self) -> Vec<String> {
        String::from_utf8_lossy(&self.0.lock().unwrap())
            .lines()
            .map(str::to_owned)
            .collect()
    }
}

fn order(id: &str, fail: Option<&str>, correlation: &str) -> Envelope {
    Envelope::new(serde_json::json!({"order_id": id, "fail": fail}).to_string())
        .with_message_id(id)
        .with_correlation_id(correlation)
}

/// The value of the scraped sample whose line starts with `series`.
fn sample(scrape: &str, series: &str) -> Option<f64> {
    scrape
        .lines()
        .find(|l| l.starts_with(series))
        .and_then(|l| l.rsplit(' ').next()?.parse().ok())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_spans_and_log_lines() {
    let logs = Logs::default();
    let writer = logs.clone();
    tracing_subscriber::fmt()
        .with_env_filter("idem_core=debug")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();
    let prometheus = idem::telemetry::prometheus()
        .unwrap()
        .install_recorder()
        .unwrap();

    let (pool, _dir) = common::sqlite(4).await;
    // Rows kept three seconds: the relay gives a refused row up sooner, as start-up requires.
    let inbox = SqliteInbox::new(pool.clone()).outbox_give_up(Duration::from_millis(500));
    inbox.migrate().await.unwrap();
    let transport = MemoryTransport::new();
    let running = start(
        Runtime::builder()
            .transport(transport.clone())
            .store(inbox)
            .handlers(["obs.orders", "obs.status"])
            .state(FailedOnce::default())
            .retry(
                RetryPolicy::new(2, Duration::from_millis(20), 2, Duration::from_millis(50))
                    .unwrap(),
            )
            .sweep(Duration::from_millis(100), 10),
    );
    let stats = running.stats.clone();

    let q = "obs-orders";
    transport.publish(q, order("o-1", None, "corr-1"));
    wait_until("o-1", Duration::from_secs(10), || async {
        stats.snapshot().processed == 1
    })
    .await;
    transport.publish(q, order("o-1", None, "corr-dup")); // duplicate
    transport.publish(q, order("o-1", Some("other"), "corr-conflict")); // conflict
    transport.publish(
        q,
        Envelope::new("not json")
            .with_message_id("bad")
            .with_correlation_id("corr-bad"),
    ); // rejected
    transport.publish(q, order("o-2", Some("once"), "corr-2")); // retried, then processed
    transport.publish(q, order("o-3", Some("always"), "corr-3")); // retried, then dead-lettered
    wait_until("the orders settled", Duration::from_secs(20), || async {
        stats.snapshot().settled() == 6
    })
    .await;
    transport.publish("obs-status", status_update(2, "s-1:2"));
    wait_until("s-1:2", Duration::from_secs(10), || async {
        stats.snapshot().processed == 3
    })
    .await;
    transport.publish("obs-status", status_update(1, "s-1:1")); // stale
    wait_until(
        "every delivery settled",
        Duration::from_secs(20),
        || async { stats.snapshot().settled() == 8 },
    )
    .await;
    // Both processed rows expire after three seconds (long enough for the copies of o-1 above
    // to find its row on a busy machine); the sweeper, every 100 ms, deletes them.
    let rows = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM idem_inbox WHERE consumer = 'obs.orders'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    assert_eq!(rows().await, 2);
    let status_rows = || async {
        sqlx::query_scalar::<_, i64>(
            "SELECT count(*) FROM idem_inbox WHERE consumer = 'obs.status'",
        )
        .fetch_one(&pool)
        .await
        .unwrap()
    };
    wait_until(
        "the sweeper to delete the expired rows",
        Duration::from_secs(20),
        || async { rows().await == 0 && status_rows().await == 0 },
    )
    .await;
    // The sweeper leaves the entity versions: a late copy of version 1 is still stale.
    let applied: i64 = sqlx::query_scalar(
        "SELECT version FROM idem_inbox_versions WHERE consumer = 'obs.status' AND entity = 's-1'",
    )
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(applied, 2);
    transport.publish("obs-status", status_update(1, "s-1:1:late"));
    wait_until("the late copy settled", Duration::from_secs(10), || async {
        stats.snapshot().stale == 2
    })
    .await;
    let scrape = prometheus.render();
    wait_until(
        "the sweep to be counted",
        Duration::from_secs(5),
        || async {
            sample(
                &prometheus.render(),
                "idem_inbox_rows_swept_total{store=\"sqlite\"}",
            )
            .is_some_and(|n| n >= 2.0)
        },
    )
    .await;
    running.shut_down().await;

    let outcome = |o: &str| {
        sample(
            &scrape,
            &format!("idem_messages_total{{consumer=\"obs.orders\",outcome=\"{o}\"}}"),
        )
    };
    assert_eq!(outcome("processed"), Some(2.0), "{scrape}");
    assert_eq!(
        sample(
            &scrape,
            "idem_messages_total{consumer=\"obs.status\",outcome=\"stale\"}"
        ),
        Some(2.0),
        "{scrape}"
    );
    assert_eq!(outcome("duplicate"), Some(1.0));
    assert_eq!(outcome("conflict"), Some(1.0));
    assert_eq!(outcome("rejected"), Some(1.0));
    assert_eq!(outcome("retried"), Some(2.0));
    assert_eq!(outcome("dead_lettered"), Some(1.0));
    // Histograms are rendered as buckets (`idem::telemetry::prometheus()` sets them), which
    // the dashboard's `histogram_quantile` panels read.
    for histogram in [
        "idem_handler_duration_seconds_bucket{consumer=\"obs.orders\",le=\"0.005\"}",
        "idem_claim_duration_seconds_bucket{consumer=\"obs.orders\",le=\"+Inf\"}",
        "idem_commit_duration_seconds_bucket{consumer=\"obs.orders\",le=\"30\"}",
    ] {
        assert!(
            sample(&scrape, histogram).is_some(),
            "no {histogram}:\n{scrape}"
        );
    }
    for reason in ["conflict", "decode", "retries-exhausted"] {
        let series =
            format!("idem_dead_letters_total{{consumer=\"obs.orders\",reason=\"{reason}\"}}");
        assert_eq!(sample(&scrape, &series), Some(1.0), "{series}");
    }
    // Handler runs: o-1, o-2 twice, o-3 twice; claims: every decodable delivery.
    assert_eq!(
        sample(
            &scrape,
            "idem_handler_duration_seconds_count{consumer=\"obs.orders\"}"
        ),
        Some(5.0),
        "{scrape}"
    );
    assert_eq!(
        sample(
            &scrape,
            "idem_claim_duration_seconds_count{consumer=\"obs.orders\"}"
        ),
        Some(7.0)
    );
    // Commits: o-1 and o-2's second run; the other transactions were rolled back.
    assert_eq!(
        sample(
            &scrape,
            "idem_commit_duration_seconds_count{consumer=\"obs.orders\"}"
        ),
        Some(2.0),
        "{scrape}"
    );
    assert!(
        scrape.contains("idem_sweeper_lag_seconds{store=\"sqlite\"}"),
        "{scrape}"
    );
    // The inbox's size after the sweep: the rows it holds, none of them expired.
    let after_sweep = prometheus.render();
    assert!(
        sample(&after_sweep, "idem_inbox_rows{store=\"sqlite\"}").is_some(),
        "{after_sweep}"
    );
    assert_eq!(
        sample(&after_sweep, "idem_inbox_expired_rows{store=\"sqlite\"}"),
        Some(0.0)
    );
    assert!(after_sweep.contains("idem_inbox_oldest_row_age_seconds{store=\"sqlite\"}"));
    // The last sweep's duty cycle: time deleting, time paused.
    for gauge in [
        "idem_inbox_sweep_busy_seconds{store=\"sqlite\"}",
        "idem_inbox_sweep_paused_seconds{store=\"sqlite\"}",
    ] {
        assert!(sample(&after_sweep, gauge).is_some(), "{after_sweep}");
    }

    let lines = logs.lines();
    let find = |needle: &str| {
        lines
            .iter()
            .find(|l| l.contains(needle))
            .cloned()
            .unwrap_or_default()
    };
    let duplicate = find("duplicate skipped");
    assert!(
        duplicate.contains("key=o-1") && duplicate.contains("correlation_id=\"corr-dup\""),
        "{duplicate}"
    );
    let conflict = find("same key, different payload");
    assert!(
        conflict.contains("key=o-1") && conflict.contains("correlation_id=\"corr-conflict\""),
        "{conflict}"
    );
    // The delivery span: every event inside it names the delivery.
    let retried = lines
        .iter()
        .find(|l| l.contains("retrying later") && l.contains("corr-3"))
        .cloned()
        .unwrap_or_default();
    for field in [
        "delivery{consumer=\"obs.orders\"",
        "message_id=\"o-3\"",
        "correlation_id=\"corr-3\"",
        "attempt=1",
        "key=\"o-3\"",
        "outcome=\"retry\"",
    ] {
        assert!(retried.contains(field), "{field} missing from {retried}");
    }

    // Panics, the mailbox and the trace context, on a handler of its own.
    let transport = MemoryTransport::new();
    let running = start(
        Runtime::builder()
            .transport(transport.clone())
            .store(SqliteInbox::new(pool.clone()))
            .handlers(["obs.extra"])
            .state(FailedOnce::default())
            .retry(
                RetryPolicy::new(3, Duration::from_millis(20), 2, Duration::from_millis(50))
                    .unwrap(),
            ),
    );
    let stats = running.stats.clone();
    let traceparent = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";
    transport.publish(
        "obs-extra",
        order("x-1", Some("panic"), "corr-x1").with_header("traceparent", traceparent),
    );
    transport.publish("obs-extra", order("x-2", None, "corr-x2"));
    // The store cannot write once: the handler's consumption pauses, a probe write succeeds,
    // and the delivery runs again as the same attempt.
    transport.publish("obs-extra", order("x-3", Some("unavailable"), "corr-x3"));
    wait_until("the three processed", Duration::from_secs(20), || async {
        stats.snapshot().processed == 3
    })
    .await;
    let scrape = prometheus.render();
    running.shut_down().await;
    assert_eq!(
        sample(&scrape, "idem_handler_panics_total{consumer=\"obs.extra\"}"),
        Some(1.0),
        "{scrape}"
    );
    assert!(
        scrape.contains("idem_mailbox_depth{consumer=\"obs.extra\"}"),
        "{scrape}"
    );
    let panicked = logs
        .lines()
        .into_iter()
        .find(|l| l.contains("handler panicked"))
        .unwrap_or_default();
    for field in [
        "message_id=\"x-1\"",
        "trace_id=\"4bf92f3577b34da6a3ce929d0e0e4736\"",
        "parent_span_id=\"00f067aa0ba902b7\"",
    ] {
        assert!(panicked.contains(field), "{field} missing from {panicked}");
    }

    // Batch mode: five deliveries in batches of three make a full batch and one that waited
    // its whole linger for a third delivery that never came.
    let transport = MemoryTransport::new();
    for id in ["b-1", "b-2", "b-3", "b-4", "b-5"] {
        transport.publish("obs-batched", order(id, None, id));
    }
    let linger = Duration::from_millis(700);
    let running = start(
        Runtime::builder()
            .transport(transport.clone())
            .store(SqliteInbox::new(pool.clone()))
            .handlers(["obs.batched"])
            .batch(3)
            .linger(linger),
    );
    let stats = running.stats.clone();
    wait_until("the five processed", Duration::from_secs(20), || async {
        stats.snapshot().processed == 5
    })
    .await;
    // The worker now waits for its next batch; the sixth delivery comes after a pause, which
    // is what its batch's wait must show (the pause is the stimulus, not a synchronisation).
    let idle = Duration::from_millis(400);
    tokio::time::sleep(idle).await;
    transport.publish("obs-batched", order("b-6", None, "b-6"));
    wait_until("the sixth processed", Duration::from_secs(20), || async {
        stats.snapshot().processed == 6
    })
    .await;
    let scrape = prometheus.render();
    running.shut_down().await;
    let batched = |series: &str| sample(&scrape, &format!("{series}{{consumer=\"obs.batched\"}}"));
    assert_eq!(
        batched("idem_batch_deliveries_count"),
        Some(3.0),
        "{scrape}"
    );
    assert_eq!(batched("idem_batch_deliveries_sum"), Some(6.0), "{scrape}");
    assert_eq!(
        batched("idem_batch_fill_seconds_count"),
        Some(3.0),
        "{scrape}"
    );
    let filling = batched("idem_batch_fill_seconds_sum").unwrap_or_default();
    assert!(
        filling >= 2.0 * linger.as_secs_f64() && filling < 10.0,
        "the two partial batches waited their linger: {filling} s in all"
    );
    assert_eq!(
        batched("idem_batch_wait_seconds_count"),
        Some(3.0),
        "{scrape}"
    );
    let waiting = batched("idem_batch_wait_seconds_sum").unwrap_or_default();
    assert!(
        waiting >= idle.as_secs_f64() && waiting < 10.0,
        "the third batch waited out the pause for its first delivery: {waiting} s in all"
    );
    // One commit per batch.
    assert_eq!(
        batched("idem_commit_duration_seconds_count"),
        Some(3.0),
        "{scrape}"
    );

    // Every outcome the dashboard and the alerting rules select is one this scrape has.
    for file in ["deploy/grafana-idem.json", "deploy/idem-alerts.yml"] {
        let text =
            std::fs::read_to_string(std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join(file))
                .unwrap()
                .replace("\\\"", "\"");
        let selected: Vec<&str> = text
            .split("outcome=\"")
            .skip(1)
            .map(|rest| rest.split('"').next().unwrap())
            .collect();
        assert!(!selected.is_empty() || file.ends_with(".yml"), "{file}");
        for outcome in selected {
            assert!(
                scrape.contains(&format!("outcome=\"{outcome}\"")),
                "{file} selects outcome=\"{outcome}\", which idem never records:\n{scrape}"
            );
        }
    }
}

/// The response to `GET path` at `addr`, or nothing when nobody answers.
async fn get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let Ok(mut stream) = tokio::net::TcpStream::connect(addr).await else {
        return String::new();
    };
    let request = format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n");
    if stream.write_all(request.as_bytes()).await.is_err() {
        return String::new();
    }
    let mut response = String::new();
    let _ = stream.read_to_string(&mut response).await;
    response
}

/// A free local port for `--metrics-addr`.
fn free_addr() -> String {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    format!("127.0.0.1:{port}")
}

/// `orders consume --metrics-addr`: `/healthz` answers while the process is up; `/readyz` only
/// while it consumes and its database answers (the database is cut off through a proxy, then
/// given back).
#[tokio::test]
async fn orders_consume_answers_health_and_readiness() {
    let example = common::orders_example();
    let queue = common::unique("idem-test-ready");
    let addr = free_addr();
    let (proxy, proxied) = common::proxy::postgres().await;
    common::broker::declare_orders_queue(&queue).await;
    let child = std::process::Command::new(&example)
        .args(["consume", "--metrics-addr", &addr])
        .env("DATABASE_URL", &proxied)
        .env("ORDERS_QUEUE", &queue)
        .env("AMQP_URL", common::broker::amqp_url())
        .spawn()
        .unwrap();
    let _child = common::KillOnDrop(child);
    let status = |path: &'static str| {
        let addr = addr.clone();
        async move {
            get(&addr, path)
                .await
                .lines()
                .next()
                .unwrap_or("")
                .to_owned()
        }
    };
    wait_until(
        "the consumer to be ready",
        Duration::from_secs(60),
        || async { status("/readyz").await == "HTTP/1.1 200 OK" },
    )
    .await;
    assert_eq!(status("/healthz").await, "HTTP/1.1 200 OK");
    proxy.cut();
    wait_until(
        "readiness to fail without the database",
        Duration::from_secs(30),
        || async {
            let answer = get(&addr, "/readyz").await;
            answer.starts_with("HTTP/1.1 503") && answer.contains("store")
        },
    )
    .await;
    assert_eq!(
        status("/healthz").await,
        "HTTP/1.1 200 OK",
        "the process is still up"
    );
    proxy.restore();
    wait_until(
        "readiness back with the database",
        Duration::from_secs(30),
        || async { status("/readyz").await == "HTTP/1.1 200 OK" },
    )
    .await;
    common::broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
    let billed = format!("{queue}.billed");
    common::broker::delete_topology(&billed, &RetryPolicy::default().delays()).await;
}

/// `orders consume --metrics-addr`: the example consumer serves the scrape over HTTP.
#[tokio::test]
async fn orders_consume_serves_metrics_for_prometheus() {
    let example = common::orders_example();
    let dir = tempfile::tempdir().unwrap();
    let queue = common::unique("idem-test-obs");
    let addr = free_addr();
    // Declared up front, so that nothing published before the consumer starts is dropped.
    common::broker::declare_orders_queue(&queue).await;
    let child = std::process::Command::new(&example)
        .args(["consume", "--metrics-addr", &addr])
        .env("DATABASE_URL", dir.path().join("orders.db"))
        .env("ORDERS_QUEUE", &queue)
        .env("AMQP_URL", common::broker::amqp_url())
        .spawn()
        .unwrap();
    let _child = common::KillOnDrop(child);
    let scrape = || get(&addr, "/metrics");
    wait_until(
        "the consumer to serve /metrics",
        Duration::from_secs(60),
        || async { scrape().await.starts_with("HTTP/1.1 200") },
    )
    .await;
    let publisher = common::broker::publisher().await;
    let body =
        serde_json::json!({"order_id": queue, "customer": "c", "amount_cents": 5}).to_string();
    common::broker::publish(&publisher, &queue, Some(&queue), body.as_bytes()).await;
    common::broker::publish(&publisher, &queue, Some(&queue), body.as_bytes()).await;
    let processed = "idem_messages_total{consumer=\"orders\",outcome=\"processed\"} 1";
    let duplicate = "idem_messages_total{consumer=\"orders\",outcome=\"duplicate\"} 1";
    wait_until(
        "the scrape to count both copies",
        Duration::from_secs(30),
        || async {
            let text = scrape().await;
            text.contains(processed) && text.contains(duplicate)
        },
    )
    .await;
    // The order's `OrderBilled`, staged in its transaction, published right after the commit,
    // booked by shipping, and counted as published once its confirmed row is removed (which
    // may come after shipping booked it).
    let shipped = "idem_messages_total{consumer=\"shipping\",outcome=\"processed\"} 1";
    let published = "idem_outbox_published_total{store=\"sqlite\",by=\"dispatch\"} 1";
    wait_until(
        "the scrape to count the second hop and the published event",
        Duration::from_secs(30),
        || async {
            let text = scrape().await;
            text.contains(shipped) && text.contains(published)
        },
    )
    .await;
    let text = scrape().await;
    // Histograms with buckets (`idem::telemetry::prometheus()`), as the dashboard reads them.
    assert!(
        text.contains("# TYPE idem_handler_duration_seconds histogram")
            && text
                .contains("idem_handler_duration_seconds_bucket{consumer=\"orders\",le=\"0.01\"}"),
        "{text}"
    );
    assert!(
        text.contains("idem_outbox_staged_total{consumer=\"orders\"} 1"),
        "{text}"
    );
    assert!(
        text.contains("idem_outbox_dispatch_seconds_count{store=\"sqlite\"} 1"),
        "{text}"
    );
    // The consumer's connection, as the scrape shows it: connected; closed by the broker, it
    // is counted as a reconnect and comes back.
    let connected = format!("idem_broker_connected{{queue=\"{queue}\"}} 1");
    assert!(text.contains(&connected), "{text}");
    assert!(
        common::broker::close_connections(&format!("idem:{queue}")) >= 1,
        "no consumer connection to close"
    );
    let reconnects = format!("idem_reconnects_total{{queue=\"{queue}\"}}");
    wait_until(
        "the reconnect to be counted and the consumer back",
        Duration::from_secs(30),
        || async {
            let text = scrape().await;
            sample(&text, &reconnects).is_some_and(|n| n >= 1.0) && text.contains(&connected)
        },
    )
    .await;
    common::broker::delete_topology(&queue, &RetryPolicy::default().delays()).await;
    let billed = format!("{queue}.billed");
    common::broker::delete_topology(&billed, &RetryPolicy::default().delays()).await;
}
