//! The `idem` binary against real RabbitMQ and PostgreSQL: a runtime dead-letters messages,
//! the CLI reads them with their reasons, replays them (twice: each takes effect once), and
//! reads, forgets and sweeps inbox rows.
#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use idem::sql::PgInbox;
use idem::transport::Transport;
use idem::{HandlerError, Runtime, RuntimeError, Stats, idempotent};
use lapin::options::{BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, ShortString};
use lapin::{BasicProperties, Channel, Connection, ConnectionProperties};
use serde_json::Value;
use std::future::Future;
use std::process::Command;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

#[path = "../../tests/common/own_servers.rs"]
mod own_servers;
#[path = "../../tests/common/tls_node.rs"]
mod tls_node;

const CONSUMER: &str = "cli.orders";
const DEADLINE: Duration = Duration::from_secs(90);

#[derive(serde::Deserialize)]
struct Order {
    id: String,
    /// Refused while a gate of this name exists.
    gate: String,
}

#[idempotent(store = Postgres, queue = "idem-cli-overridden", key = "order.id", consumer = "cli.orders")]
async fn apply(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order: Order,
) -> Result<u32, HandlerError> {
    let closed: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_cli_gates WHERE name = $1")
        .bind(&order.gate)
        .fetch_one(&mut **tx)
        .await?;
    if closed > 0 {
        return Err(HandlerError::permanent("the gate is closed"));
    }
    let stuck: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_cli_gates WHERE name = $1")
        .bind(format!("{}:stuck", order.gate))
        .fetch_one(&mut **tx)
        .await?;
    if stuck > 0 {
        return Err(HandlerError::transient("the gate is stuck"));
    }
    sqlx::query("INSERT INTO idem_cli_effects (key) VALUES ($1)")
        .bind(&order.id)
        .execute(&mut **tx)
        .await?;
    Ok(7)
}

fn amqp_url() -> String {
    std::env::var("AMQP_URL").unwrap_or_else(|_| "amqp://guest:guest@127.0.0.1:5672/%2f".into())
}

fn postgres_url() -> String {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| u.starts_with("postgres"))
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

fn unique(prefix: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!("{prefix}-{}-{nanos}", std::process::id())
}

async fn wait_until<F: Future<Output = bool>>(what: &str, mut check: impl FnMut() -> F) {
    let deadline = Instant::now() + DEADLINE;
    while !check().await {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The tests' PostgreSQL, with the handler's tables and a migrated inbox.
async fn database() -> sqlx::PgPool {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&postgres_url())
        .await
        .expect("PostgreSQL at DATABASE_URL");
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.tests'))::text")
        .execute(&mut *tx)
        .await
        .unwrap();
    for statement in [
        "CREATE TABLE IF NOT EXISTS idem_cli_effects (key TEXT NOT NULL)",
        "CREATE TABLE IF NOT EXISTS idem_cli_gates (name TEXT NOT NULL)",
    ] {
        sqlx::query(statement).execute(&mut *tx).await.unwrap();
    }
    tx.commit().await.unwrap();
    PgInbox::new(pool.clone()).migrate().await.unwrap();
    pool
}

/// One test's queue, tables, publisher and running runtime.
struct Fixture {
    queue: String,
    /// The inbox table of its runtime and of the `idem` it runs, when not `idem_inbox`.
    table: Option<&'static str>,
    pool: sqlx::PgPool,
    channel: Channel,
    _connection: Connection,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<Result<(), RuntimeError>>>,
    stats: Arc<Stats>,
}

impl Fixture {
    async fn new(name: &str) -> Self {
        Self::with_table(name, None).await
    }

    /// A fixture whose runtime and `idem` use the inbox table `table`: its rows are swept by
    /// no other test's runtime.
    async fn with_table(name: &str, table: Option<&'static str>) -> Self {
        Self::with_settings(name, table, None, idem::RetryPolicy::default()).await
    }

    /// A fixture whose runtime keeps inbox rows for `retention` (else the store's default) and
    /// retries as `retry` says.
    async fn with_settings(
        name: &str,
        table: Option<&'static str>,
        retention: Option<Duration>,
        retry: idem::RetryPolicy,
    ) -> Self {
        let pool = database().await;
        let mut inbox = PgInbox::new(pool.clone());
        if let Some(retention) = retention {
            // The relay gives up sooner than the rows go, as start-up requires.
            inbox = inbox.outbox_give_up(retention / 2);
        }
        if let Some(table) = table {
            inbox = inbox.table(table).unwrap();
            inbox.migrate().await.unwrap();
        }
        let queue = unique(&format!("idem-cli-{name}"));
        let rabbit = RabbitConfig::new(amqp_url());
        let mut spec = idem::transport::QueueSpec::new(queue.clone(), CONSUMER);
        spec.retry_delays = retry.delays();
        RabbitTransport::new(rabbit.clone())
            .declare(&[spec])
            .await
            .unwrap();
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .expect("RabbitMQ at AMQP_URL");
        let channel = connection.create_channel().await.unwrap();
        channel
            .confirm_select(ConfirmSelectOptions::default())
            .await
            .unwrap();
        let mut builder = Runtime::builder()
            .transport(RabbitTransport::new(rabbit))
            .store(inbox)
            .handlers([CONSUMER])
            .handler_queue(CONSUMER, &queue)
            .retry(retry)
            .concurrency(8);
        if let Some(retention) = retention {
            builder = builder.retention(retention);
        }
        let runtime = builder.build().unwrap();
        let stats = runtime.stats();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(runtime.run_until(async {
            let _ = stopped.await;
        }));
        Self {
            queue,
            table,
            pool,
            channel,
            _connection: connection,
            stop: Some(stop),
            task: Some(task),
            stats,
        }
    }

    fn key(&self, n: usize) -> String {
        format!("{}-{n}", self.queue)
    }

    async fn close_gate(&self) {
        sqlx::query("INSERT INTO idem_cli_gates (name) VALUES ($1)")
            .bind(&self.queue)
            .execute(&self.pool)
            .await
            .unwrap();
    }

    async fn open_gate(&self) {
        sqlx::query("DELETE FROM idem_cli_gates WHERE name = $1")
            .bind(&self.queue)
            .execute(&self.pool)
            .await
            .unwrap();
    }

    async fn publish(&self, id: Option<&str>, body: &[u8]) {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("tenant"),
            AMQPValue::LongString(b"acme".to_vec().into()),
        );
        let mut properties = BasicProperties::default().with_headers(headers);
        if let Some(id) = id {
            properties = properties.with_message_id(ShortString::from(id));
        }
        self.channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from(self.queue.as_str()),
                BasicPublishOptions::default(),
                body,
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }

    async fn publish_order(&self, n: usize) {
        let body = serde_json::json!({"id": self.key(n), "gate": self.queue}).to_string();
        self.publish(Some(&self.key(n)), body.as_bytes()).await;
    }

    /// (effects, distinct keys) of this fixture's orders.
    async fn effects(&self) -> (i64, i64) {
        sqlx::query_as(
            "SELECT count(*), count(DISTINCT key) FROM idem_cli_effects WHERE key LIKE $1",
        )
        .bind(format!("{}-%", self.queue))
        .fetch_one(&self.pool)
        .await
        .unwrap()
    }

    async fn dlq_count(&self) -> u32 {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let count = channel
            .queue_declare(
                ShortString::from(idem::rabbitmq::dlq(&self.queue).as_str()),
                passive,
                Default::default(),
            )
            .await
            .unwrap()
            .message_count();
        let _ = connection.close(200, ShortString::from("counted")).await;
        count
    }

    /// Runs `idem args…` against this fixture's broker and database; (exit ok, stdout, stderr).
    fn idem(&self, args: &[&str]) -> (bool, String, String) {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
        if let Some(table) = self.table {
            command.env("IDEM_INBOX_TABLE", table);
        } else {
            command.env_remove("IDEM_INBOX_TABLE");
        }
        let out = command
            .args(args)
            // A broker that refuses first: the tool tries the next one, as a cluster's list.
            .env(
                "AMQP_URL",
                format!("amqp://guest:guest@127.0.0.1:1/%2f,{}", amqp_url()),
            )
            .env("DATABASE_URL", postgres_url())
            .env("IDEM_QUEUE", &self.queue)
            .output()
            .expect("run idem");
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    }

    /// Runs `idem --json args…`, which must succeed, and parses its output.
    fn idem_json(&self, args: &[&str]) -> Value {
        let mut all = vec!["--json"];
        all.extend_from_slice(args);
        let (ok, out, err) = self.idem(&all);
        assert!(ok, "idem {args:?} failed: {err}");
        serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"))
    }

    async fn shut_down(mut self) -> idem::Snapshot {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            tokio::time::timeout(DEADLINE, task)
                .await
                .expect("the runtime stops")
                .unwrap()
                .unwrap();
        }
        self.stats.snapshot()
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dlq_of_1000_replayed_twice_takes_effect_once() {
    let f = Fixture::new("replay").await;
    f.close_gate().await;
    for n in 0..1000 {
        f.publish_order(n).await;
    }
    wait_until("1000 dead letters", || async {
        f.dlq_count().await == 1000
    })
    .await;
    assert_eq!(f.effects().await, (0, 0));

    let listed = f.idem_json(&["dlq", "list", "--limit", "5"]);
    assert_eq!(listed["total"], 1000);
    let first = &listed["dead_letters"][0];
    assert_eq!(first["record"]["reason"], "handler");
    assert_eq!(first["record"]["consumer"], CONSUMER);
    assert_eq!(first["record"]["key"], first["message_id"]);
    assert!(
        first["record"]["detail"]
            .as_str()
            .unwrap()
            .contains("the gate is closed")
    );
    assert_eq!(
        f.dlq_count().await,
        1000,
        "listing leaves the DLQ as it was"
    );

    // The fix is deployed; replay, keeping the dead letters: every order applied once.
    f.open_gate().await;
    let first = f.idem_json(&["dlq", "replay", "--all", "--keep"]);
    assert_eq!(first["replayed"], 1000, "{first}");
    assert_eq!(first["failures_cleared"], 1000, "{first}");
    wait_until("1000 orders applied", || async {
        f.effects().await.0 == 1000
    })
    .await;
    assert_eq!(f.dlq_count().await, 1000, "--keep leaves them");
    let inbox = PgInbox::new(f.pool.clone());
    let records = inbox.dead_letters(&f.queue).await.unwrap();
    assert_eq!(records.len(), 1000, "--keep leaves their records too");

    // The same dead letters replayed again: the inbox says each was applied with its payload,
    // so none is published again; each is resolved, and the DLQ and the records empty.
    let second = f.idem_json(&["dlq", "replay", "--all"]);
    assert_eq!(second["replayed"], 0, "{second}");
    let resolved = second["resolved"].as_array().unwrap();
    assert_eq!(resolved.len(), 1000, "{second}");
    assert!(
        resolved[0].as_str().unwrap().contains("was applied"),
        "{second}"
    );
    assert_eq!(f.dlq_count().await, 0);
    assert!(inbox.dead_letters(&f.queue).await.unwrap().is_empty());
    assert_eq!(f.effects().await, (1000, 1000), "each order applied once");
    let seen = f.shut_down().await;
    assert_eq!(
        (seen.processed, seen.dead_lettered, seen.duplicates),
        (1000, 1000, 0),
        "nothing was published again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn dead_letters_are_listed_shown_and_replayed_one_by_one() {
    let f = Fixture::new("show").await;
    f.close_gate().await;
    f.publish_order(0).await;
    f.publish(Some(&f.key(1)), b"this is not json").await;
    f.publish_order(2).await;
    wait_until("3 dead letters", || async { f.dlq_count().await == 3 }).await;

    let (ok, text, err) = f.idem(&["dlq", "list"]);
    assert!(ok, "{err}");
    for expected in [
        "REASON",
        "handler",
        "decode",
        &f.key(1),
        "3 of 3 dead letters shown",
    ] {
        assert!(text.contains(expected), "{expected:?} not in:\n{text}");
    }
    let shown = f.idem_json(&["dlq", "show", &f.key(1)]);
    assert_eq!(shown["record"]["reason"], "decode");
    assert_eq!(shown["record"]["keyed"], false);
    assert_eq!(shown["body"], "this is not json");
    assert_eq!(shown["from_queue"], f.queue.as_str());
    let (ok, _, err) = f.idem(&["dlq", "show", "no-such-id"]);
    assert!(!ok && err.contains("no dead letter no-such-id"), "{err}");

    // One by one: only the one named is replayed; an unknown id is reported.
    f.open_gate().await;
    let replayed = f.idem_json(&["dlq", "replay", &f.key(0)]);
    assert_eq!(replayed["replayed"], 1);
    wait_until("order 0 applied", || async { f.effects().await.0 == 1 }).await;
    assert_eq!(f.dlq_count().await, 2);
    let (ok, out, err) = f.idem(&["dlq", "replay", &f.key(2), "missing-id"]);
    assert!(
        !ok && err.contains("not in the DLQ: missing-id"),
        "{out}{err}"
    );
    wait_until("order 2 applied", || async { f.effects().await.0 == 2 }).await;

    // --to: the malformed one goes to another queue, untouched but for x-death.
    let parking = format!("{}.parking", f.queue);
    let declare = lapin::options::QueueDeclareOptions::default();
    f.channel
        .queue_declare(
            ShortString::from(parking.as_str()),
            declare,
            Default::default(),
        )
        .await
        .unwrap();
    let moved = f.idem_json(&["dlq", "replay", "--all", "--to", &parking]);
    assert_eq!(moved["replayed"], 1);
    let got = f
        .channel
        .basic_get(ShortString::from(parking.as_str()), Default::default())
        .await
        .unwrap()
        .expect("the replayed message");
    assert_eq!(got.delivery.data, b"this is not json");
    assert_eq!(
        got.delivery
            .properties
            .message_id()
            .as_ref()
            .map(ShortString::as_str),
        Some(f.key(1).as_str())
    );
    let headers = got
        .delivery
        .properties
        .headers()
        .clone()
        .unwrap_or_default();
    assert!(!headers.inner().contains_key("x-death"), "{headers:?}");
    assert!(
        !headers.inner().contains_key("x-first-death-queue"),
        "{headers:?}"
    );
    assert_eq!(
        headers.inner().get("tenant"),
        Some(&AMQPValue::LongString(b"acme".to_vec().into())),
        "the user's headers are kept"
    );
    let _ = f
        .channel
        .queue_delete(ShortString::from(parking.as_str()), Default::default())
        .await;
    let seen = f.shut_down().await;
    assert_eq!(seen.processed, 2);
}

/// A dead letter's `x-first-death-queue` header, as a copy moved without its record by an
/// earlier idem kept it from its producer (RabbitMQ's own dead-lettering writes the queue it
/// died in), never decides where a replay goes, and one of 300 bytes never panics the tool:
/// both letters go back to the queue whose dead letters they are, and are applied.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_producers_death_header_never_decides_where_a_replay_goes() {
    let f = Fixture::new("forged").await;
    let dlq = idem::rabbitmq::dlq(&f.queue);
    for (n, forged) in [
        (0, "a-queue-of-the-producers".to_owned()),
        (1, "q".repeat(300)),
    ] {
        let mut headers = FieldTable::default();
        headers.insert(
            ShortString::from("x-first-death-queue"),
            AMQPValue::LongString(forged.into_bytes().into()),
        );
        let body = serde_json::json!({"id": f.key(n), "gate": f.queue}).to_string();
        f.channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from(dlq.as_str()),
                BasicPublishOptions::default(),
                body.as_bytes(),
                BasicProperties::default()
                    .with_message_id(ShortString::from(f.key(n)))
                    .with_headers(headers),
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    wait_until("2 dead letters", || async { f.dlq_count().await == 2 }).await;
    let shown = f.idem_json(&["dlq", "show", &f.key(1)]);
    assert!(shown["record"].is_null(), "{shown}");
    let replayed = f.idem_json(&["dlq", "replay", "--all"]);
    assert_eq!(replayed["replayed"], 2, "{replayed}");
    wait_until("both applied", || async { f.effects().await == (2, 2) }).await;
    assert_eq!(f.dlq_count().await, 0);
    f.shut_down().await;
}

/// The dedup window, through `build()` on RabbitMQ and PostgreSQL: an order is dead-lettered
/// (its gate closed), then a copy of it is applied (the gate open). Replayed while the inbox
/// holds that copy's row, the dead letter is resolved without publishing. Once the row is swept
/// (retention 2 s), the inbox cannot tell, and the replay is refused, naming the risk;
/// `--force` replays it, and the order is applied a second time: the risk it named.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_knows_what_the_inbox_knows_and_refuses_beyond_the_dedup_window() {
    let table = "idem_cli_window_inbox";
    let retention = Duration::from_secs(2);
    let quick =
        idem::RetryPolicy::new(2, Duration::from_millis(100), 1, Duration::from_millis(100))
            .unwrap();
    let f = Fixture::with_settings("window", Some(table), Some(retention), quick).await;
    f.close_gate().await;
    f.publish_order(0).await;
    wait_until("the dead letter", || async { f.dlq_count().await == 1 }).await;
    let shown = f.idem_json(&["dlq", "show", &f.key(0)]);
    let record = &shown["record"];
    assert_eq!(record["retention_ms"], 2000, "{shown}");
    let first = record["first_failed_at_ms"].as_i64().unwrap();
    assert_eq!(
        record["dedup_window_ends_ms"].as_i64().unwrap(),
        first + 2000,
        "{shown}"
    );

    // A copy of the same order, published again by its producer, is applied.
    f.open_gate().await;
    f.publish_order(0).await;
    wait_until("the copy applied", || async { f.effects().await.0 == 1 }).await;
    let resolved = f.idem_json(&["dlq", "replay", "--all", "--keep"]);
    assert_eq!(resolved["replayed"], 0, "{resolved}");
    assert_eq!(
        resolved["resolved"].as_array().unwrap().len(),
        1,
        "{resolved}"
    );

    // The copy's row expires and is swept: the inbox no longer knows the key.
    let inbox = PgInbox::new(f.pool.clone()).table(table).unwrap();
    wait_until("the copy's row swept", || async {
        f.idem(&["inbox", "sweep"]);
        inbox.show(CONSUMER, &f.key(0)).await.unwrap().row.is_none()
    })
    .await;
    let (ok, out, err) = f.idem(&["--json", "dlq", "replay", "--all"]);
    assert!(!ok && err.contains("1 refused"), "{out}{err}");
    let refused: Value = serde_json::from_str(&out).unwrap();
    let why = refused["refused"][0].as_str().unwrap();
    assert!(
        why.contains("beyond the dedup window") && why.contains("--force"),
        "{why}"
    );
    assert_eq!(refused["replayed"], 0);
    assert_eq!(f.dlq_count().await, 1, "a refused dead letter stays");
    assert_eq!(f.effects().await.0, 1, "nothing applied again");

    let forced = f.idem_json(&["dlq", "replay", "--all", "--force"]);
    assert_eq!(forced["replayed"], 1, "{forced}");
    wait_until("the forced replay applied", || async {
        f.effects().await.0 == 2
    })
    .await;
    assert_eq!(f.dlq_count().await, 0);
    f.shut_down().await;
}

/// The dedup window counts from the message's publish time where the letter has one (AMQP
/// `timestamp`), as its consumer does: a message published 4 s before it failed, under a 10 s
/// retention, is refused 10 s after its publish, though its failure is younger. `--force`
/// publishes it as new (its timestamp now), so that its consumer applies it instead of
/// refusing it as `beyond-dedup-window`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dedup_window_counts_from_the_publish_time_and_force_publishes_as_new() {
    let quick =
        idem::RetryPolicy::new(2, Duration::from_millis(100), 1, Duration::from_millis(100))
            .unwrap();
    let retention = Duration::from_secs(10);
    let f = Fixture::with_settings("published", None, Some(retention), quick).await;
    f.close_gate().await;
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    // Old enough to tell the two starts apart, young enough to fail for its handler (not its
    // age) on a busy machine.
    let published = now - 4;
    let body = serde_json::json!({"id": f.key(0), "gate": f.queue}).to_string();
    f.channel
        .basic_publish(
            ShortString::from(""),
            ShortString::from(f.queue.as_str()),
            BasicPublishOptions::default(),
            body.as_bytes(),
            BasicProperties::default()
                .with_message_id(ShortString::from(f.key(0)))
                .with_timestamp(published),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    wait_until("the dead letter", || async { f.dlq_count().await == 1 }).await;
    let shown = f.idem_json(&["dlq", "show", &f.key(0)]);
    let published_ms = published as i64 * 1000;
    assert_eq!(shown["published_at_ms"], published_ms, "{shown}");
    assert_eq!(
        shown["dedup_window_ends_ms"],
        published_ms + 10_000,
        "{shown}"
    );
    assert_eq!(shown["record"]["reason"], "handler", "{shown}");

    f.open_gate().await;
    wait_until("the window counted from the publish over", || async {
        let now_ms = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_millis() as i64;
        now_ms > published_ms + 10_500
    })
    .await;
    let (ok, out, err) = f.idem(&["--json", "dlq", "replay", "--all"]);
    assert!(!ok && err.contains("1 refused"), "{out}{err}");
    assert!(out.contains("its message was published"), "{out}");
    assert_eq!(f.effects().await.0, 0);

    let forced = f.idem_json(&["dlq", "replay", "--all", "--force"]);
    assert_eq!(forced["replayed"], 1, "{forced}");
    wait_until("the forced copy applied", || async {
        f.effects().await.0 == 1
    })
    .await;
    let seen = f.shut_down().await;
    assert_eq!((seen.processed, seen.dead_lettered), (1, 1), "{seen:?}");
}

/// A dead letter whose key was applied since with another payload (its producer reused the
/// id) is refused: a replay would be dead-lettered as a conflict again. Forgetting the key
/// lets the replay apply this one as new.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replay_of_a_key_applied_with_another_payload_is_refused() {
    let f = Fixture::new("other").await;
    f.close_gate().await;
    f.publish_order(0).await;
    wait_until("the dead letter", || async { f.dlq_count().await == 1 }).await;
    f.open_gate().await;
    let other = serde_json::json!({"id": f.key(0), "gate": f.queue, "note": "v2"}).to_string();
    f.publish(Some(&f.key(0)), other.as_bytes()).await;
    wait_until("the other payload applied", || async {
        f.effects().await.0 == 1
    })
    .await;
    let (ok, out, err) = f.idem(&["--json", "dlq", "replay", "--all", "--force"]);
    assert!(!ok && err.contains("1 refused"), "{out}{err}");
    let refused: Value = serde_json::from_str(&out).unwrap();
    let why = refused["refused"][0].as_str().unwrap();
    assert!(
        why.contains("another payload") && why.contains("inbox forget"),
        "{why}"
    );
    assert_eq!(f.dlq_count().await, 1);

    let (ok, _, err) = f.idem(&["inbox", "forget", CONSUMER, &f.key(0)]);
    assert!(ok, "{err}");
    let replayed = f.idem_json(&["dlq", "replay", "--all"]);
    assert_eq!(replayed["replayed"], 1, "{replayed}");
    wait_until("this payload applied as new", || async {
        f.effects().await.0 == 2
    })
    .await;
    assert_eq!(f.dlq_count().await, 0);
    f.shut_down().await;
}

/// A record that does not say its consumer's retention (as an idem before schema version 13
/// wrote them) cannot tell whether the dedup window is over: its replay is refused unless
/// `--force`.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_record_without_a_retention_is_replayed_only_when_forced() {
    use idem::store::DeadLetterStore;
    let f = Fixture::new("unknown").await;
    let body = serde_json::json!({"id": f.key(0), "gate": f.queue}).to_string();
    let envelope = idem::Envelope::new(body.clone()).with_message_id(f.key(0));
    let letter = idem::transport::DeadLetter::new(
        "handler",
        "the gate is closed",
        CONSUMER,
        Some(f.key(0)),
        1,
    );
    let record = idem::store::DeadLetterRecord::new(&letter, &envelope, &f.queue);
    PgInbox::new(f.pool.clone())
        .record_dead_letter(&record)
        .await
        .unwrap();
    f.channel
        .basic_publish(
            ShortString::from(""),
            ShortString::from(idem::rabbitmq::dlq(&f.queue).as_str()),
            BasicPublishOptions::default(),
            body.as_bytes(),
            BasicProperties::default().with_message_id(ShortString::from(f.key(0))),
        )
        .await
        .unwrap()
        .await
        .unwrap();
    wait_until("the dead letter", || async { f.dlq_count().await == 1 }).await;
    let shown = f.idem_json(&["dlq", "show", &f.key(0)]);
    assert!(shown["record"]["retention_ms"].is_null(), "{shown}");
    let (ok, out, err) = f.idem(&["--json", "dlq", "replay", "--all"]);
    assert!(!ok && err.contains("1 refused"), "{out}{err}");
    assert!(
        out.contains("does not say its consumer's retention"),
        "{out}"
    );
    let forced = f.idem_json(&["dlq", "replay", "--all", "--force"]);
    assert_eq!(forced["replayed"], 1, "{forced}");
    wait_until("applied", || async { f.effects().await.0 == 1 }).await;
    f.shut_down().await;
}

/// A dead letter's record keeps its attempt history: after a transient failure retried twice
/// through the delay queues, the first failure is the first attempt's (carried by the retry
/// copies), before the last, with 3 attempts counted.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_dead_letter_record_keeps_its_first_and_last_failure() {
    let retry =
        idem::RetryPolicy::new(3, Duration::from_millis(500), 2, Duration::from_secs(1)).unwrap();
    let f = Fixture::with_settings("history", None, None, retry).await;
    sqlx::query("INSERT INTO idem_cli_gates (name) VALUES ($1)")
        .bind(format!("{}:stuck", f.queue))
        .execute(&f.pool)
        .await
        .unwrap();
    f.publish_order(0).await;
    wait_until("the dead letter", || async { f.dlq_count().await == 1 }).await;
    let shown = f.idem_json(&["dlq", "show", &f.key(0)]);
    let record = &shown["record"];
    assert_eq!(record["reason"], "retries-exhausted", "{shown}");
    assert_eq!(record["attempts"], 3, "{shown}");
    let first = record["first_failed_at_ms"].as_i64().unwrap();
    let last = record["dead_lettered_at_ms"].as_i64().unwrap();
    assert!(
        last - first >= 1000,
        "two retries of at least 500 ms lie between the first failure and the last: {shown}"
    );
    let (ok, text, err) = f.idem(&["dlq", "show", &f.key(0)]);
    assert!(ok, "{err}");
    for line in ["first failure", "dedup window   ends in"] {
        assert!(text.contains(line), "{line:?} not in:\n{text}");
    }
    sqlx::query("DELETE FROM idem_cli_gates WHERE name = $1")
        .bind(format!("{}:stuck", f.queue))
        .execute(&f.pool)
        .await
        .unwrap();
    f.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn inbox_rows_are_counted_shown_forgotten_and_swept() {
    // An inbox table of its own: the expired row below is swept by `idem inbox sweep`, not by
    // the sweeper of another test's runtime on `idem_inbox` (its own runtime swept once, at
    // its start).
    let table = "idem_cli_sweep_inbox";
    let f = Fixture::with_table("inbox", Some(table)).await;
    f.publish_order(0).await;
    f.publish_order(1).await;
    wait_until("2 orders applied", || async { f.effects().await.0 == 2 }).await;

    let stats = f.idem_json(&["inbox", "stats"]);
    let completed = stats["rows"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["consumer"] == CONSUMER && r["status"] == "completed")
        .expect("a completed row count");
    assert!(completed["rows"].as_u64().unwrap() >= 2, "{stats}");

    let shown = f.idem_json(&["inbox", "show", CONSUMER, &f.key(0)]);
    assert_eq!(shown["row"]["status"], "completed");
    assert_eq!(shown["row"]["outcome"], "7");
    let forgot = f.idem_json(&["inbox", "forget", CONSUMER, &f.key(0)]);
    assert_eq!(forgot["removed"]["row"], true);
    let shown = f.idem_json(&["inbox", "show", CONSUMER, &f.key(0)]);
    assert!(shown["row"].is_null(), "{shown}");
    // Forgotten: the same message is now processed as new.
    f.publish_order(0).await;
    wait_until("order 0 applied again", || async {
        f.effects().await.0 == 3
    })
    .await;

    // An expired row is swept (retried while another test's sweeper holds the lock).
    sqlx::query(sqlx::AssertSqlSafe(format!("UPDATE {table} SET expires_at = now() - interval '1 minute' WHERE consumer = $1 AND key = $2")))
        .bind(CONSUMER)
        .bind(f.key(1))
        .execute(&f.pool)
        .await
        .unwrap();
    let deadline = Instant::now() + DEADLINE;
    loop {
        let (ok, out, err) = f.idem(&["--json", "inbox", "sweep"]);
        if ok {
            let swept: Value = serde_json::from_str(&out).unwrap();
            assert!(swept["rows_deleted"].as_u64().unwrap() >= 1, "{swept}");
            break;
        }
        assert!(
            err.contains("sweeper lock") && Instant::now() < deadline,
            "{err}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let shown = f.idem_json(&["inbox", "show", CONSUMER, &f.key(1)]);
    assert!(shown["row"].is_null(), "{shown}");
    f.shut_down().await;
}

#[test]
fn a_wrong_database_url_says_what_to_change() {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["inbox", "stats"])
        .env("DATABASE_URL", "oracle://scott:tiger@db/orders")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    // The table of dialects says which URLs it takes.
    for known in [
        "postgres (postgres://, postgresql://)",
        "mysql (mysql://, mariadb://)",
        "sqlite (sqlite:)",
    ] {
        assert!(err.contains(known), "{err}");
    }
    assert!(!err.contains("tiger"), "the password is hidden: {err}");
    // A database whose inbox was never migrated: said so, with what to check.
    let empty = tempfile::tempdir().unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["inbox", "stats"])
        .env("DATABASE_URL", empty.path().join("none.db"))
        .env_remove("IDEM_INBOX_TABLE")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("idem_inbox") && err.contains("`migrate()`"),
        "{err}"
    );
}

#[test]
fn a_url_that_names_no_broker_says_which_schemes_do() {
    let out = Command::new(env!("CARGO_BIN_EXE_idem"))
        .args(["dlq", "list", "--queue", "orders"])
        .env("AMQP_URL", "kafka://user:s3cret@h:9092")
        .env_remove("NATS_URL")
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.contains("`kafka://` names no broker")
            && err.contains("amqp:// (RabbitMQ)")
            && err.contains("nats:// (NATS JetStream)")
            && err.contains("AMQP_URL"),
        "{err}"
    );
    assert!(!err.contains("s3cret"), "the password is hidden: {err}");
}

#[test]
fn a_wrong_broker_timeout_says_what_to_change() {
    for wrong in ["0", "inf"] {
        let out = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args([
                "dlq",
                "list",
                "--queue",
                "orders",
                "--broker-timeout",
                wrong,
            ])
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success());
        assert!(
            err.contains("--broker-timeout") && err.contains("above 0 and at most 86400"),
            "{err}"
        );
    }
}

/// A RabbitMQ node of the test's own (stopped when dropped); a machine that cannot start one
/// fails the test, or, with the opt-out of [`own_servers`], skips it: `None`.
async fn own_node() -> Option<tls_node::TlsNode> {
    if !own_servers::can_start("rabbitmq-server", "a RabbitMQ node of the test's own") {
        return None;
    }
    let node = tokio::task::spawn_blocking(tls_node::TlsNode::start).await;
    Some(node.unwrap())
}

/// Declares `queues` and `dlq` on the broker at `url` and puts one message (`{}`) per id of
/// `message_ids` in `dlq`, confirmed; the connection and its channel stay open.
async fn dead_letters(
    url: &str,
    queues: &[&str],
    dlq: &str,
    message_ids: &[&str],
) -> (Connection, Channel) {
    let connection = Connection::connect(url, ConnectionProperties::default())
        .await
        .unwrap();
    let channel = connection.create_channel().await.unwrap();
    for name in queues.iter().chain([&dlq]) {
        let declare = channel.queue_declare(
            ShortString::from(*name),
            Default::default(),
            Default::default(),
        );
        declare.await.unwrap();
    }
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .unwrap();
    for &id in message_ids {
        let properties = BasicProperties::default().with_message_id(ShortString::from(id));
        channel
            .basic_publish(
                ShortString::from(""),
                ShortString::from(dlq),
                BasicPublishOptions::default(),
                b"{}",
                properties,
            )
            .await
            .unwrap()
            .await
            .unwrap();
    }
    (connection, channel)
}

/// Against an `amqps://` broker whose certificate a private CA signed: with `AMQP_TLS_CA` the
/// CLI reads the DLQ; without it, it refuses the certificate and says it cannot reach the broker.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dlq_of_a_tls_broker_is_read_with_its_ca() {
    let Some(node) = own_node().await else {
        return;
    };
    let queue = unique("idem-cli-tls");
    let dlq = idem::rabbitmq::dlq(&queue);
    let (connection, _channel) = dead_letters(&node.plain_url, &[], &dlq, &["tls-1"]).await;
    let ca = tempfile::NamedTempFile::new().unwrap();
    std::fs::write(ca.path(), &node.ca_pem).unwrap();
    let database = tempfile::tempdir().unwrap();
    let inbox = database.path().join("inbox.db");
    let pool = idem::sql::sqlite::pool(&inbox.display().to_string())
        .await
        .unwrap();
    idem::sql::SqliteInbox::new(pool).migrate().await.unwrap();
    let idem = |with_ca: bool| {
        let mut command = Command::new(env!("CARGO_BIN_EXE_idem"));
        command
            .args(["--json", "dlq", "list", "--queue", &queue])
            .env("AMQP_URL", &node.amqps_url)
            .env("DATABASE_URL", &inbox)
            .env_remove("AMQP_TLS_CA");
        if with_ca {
            command.env("AMQP_TLS_CA", ca.path());
        }
        command.output().unwrap()
    };
    let out = idem(true);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let listed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(listed["total"], 1);
    assert_eq!(listed["dead_letters"][0]["message_id"], "tls-1");
    let out = idem(false);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success()
            && err.contains("cannot reach the broker at amqps://guest:***@localhost")
            && err.contains("UnknownIssuer"),
        "{err}"
    );
    let _ = connection.close(200, ShortString::from("done")).await;
}

/// A peer that accepts the connection and then says nothing (a broker wedged, or a port that
/// is not RabbitMQ's): every `dlq` command fails within `--broker-timeout`, saying so, instead
/// of waiting forever. (The process is killed, and the test fails, if it is still running after
/// 60 s.)
#[tokio::test]
async fn a_broker_that_never_answers_fails_the_command_within_the_timeout() {
    let pool = sqlx::PgPool::connect(&postgres_url()).await.unwrap();
    PgInbox::new(pool.clone()).migrate().await.unwrap();
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = silent.local_addr().unwrap().port();
    // Accepts and holds every connection, reading nothing and writing nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for stream in silent.incoming() {
            held.push(stream);
        }
    });
    for command in [
        &["dlq", "list", "--queue", "idem-cli-silent"][..],
        &["dlq", "replay", "--queue", "idem-cli-silent", "--all"][..],
    ] {
        let started = Instant::now();
        let mut child = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(command)
            .args(["--broker-timeout", "1"])
            .env(
                "AMQP_URL",
                format!("amqp://guest:guest@127.0.0.1:{port}/%2f"),
            )
            .env("DATABASE_URL", postgres_url())
            .env_remove("IDEM_INBOX_TABLE")
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if started.elapsed() > Duration::from_secs(60) {
                child.kill().unwrap();
                panic!("idem {command:?} still waited on a silent broker after 60 s");
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        let output = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(!status.success(), "{command:?}: {err}");
        assert!(
            err.contains("no answer within 1s") && err.contains(&format!("127.0.0.1:{port}")),
            "{command:?}: {err}"
        );
        assert!(
            started.elapsed() < Duration::from_secs(30),
            "{command:?} took {:?}",
            started.elapsed()
        );
    }
}

/// A broker under a memory alarm blocks publishers: `dlq replay` reads the first dead letter,
/// its publish gets no confirm, and the command stops there within `--broker-timeout`, saying
/// so (the next letters would wait as long), with every dead letter still in the DLQ. (On a node of the test's own: the alarm would block
/// every other test's publishers.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_to_a_blocked_broker_stops_within_the_timeout_and_keeps_the_dead_letters() {
    let Some(node) = own_node().await else {
        return;
    };
    let queue = unique("idem-cli-blocked");
    let ids = ["blocked-1", "blocked-2", "blocked-3"];
    let dlq = idem::rabbitmq::dlq(&queue);
    let (connection, channel) = dead_letters(&node.plain_url, &[&queue], &dlq, &ids).await;
    let database = tempfile::tempdir().unwrap();
    let inbox = database.path().join("inbox.db");
    let pool = idem::sql::sqlite::pool(&inbox.display().to_string())
        .await
        .unwrap();
    idem::sql::SqliteInbox::new(pool).migrate().await.unwrap();
    node.ctl("set_vm_memory_high_watermark 0");

    let started = Instant::now();
    let out = tokio::task::spawn_blocking({
        let (queue, url, inbox) = (queue.clone(), node.plain_url.clone(), inbox.clone());
        move || {
            Command::new(env!("CARGO_BIN_EXE_idem"))
                .args(["dlq", "replay", "--queue", &queue, "--all"])
                .args(["--broker-timeout", "2"])
                .env("AMQP_URL", url)
                .env("DATABASE_URL", inbox)
                .output()
                .unwrap()
        }
    });
    let out = tokio::time::timeout(Duration::from_secs(60), out)
        .await
        .expect("idem dlq replay still waited on the blocked broker after 60 s")
        .unwrap();
    let took = started.elapsed();
    node.ctl("set_vm_memory_high_watermark 0.4");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(!out.status.success(), "{said}");
    assert!(
        said.contains("publishing: no answer within 2s")
            && said.contains("stopped after 0 replayed, the rest stays in the DLQ"),
        "{said}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}");
    // Held unacknowledged by the tool's connection, they go back once the broker, reading
    // again, sees that connection gone.
    wait_until("the dead letters back in the DLQ", || async {
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let name = ShortString::from(dlq.as_str());
        let declared = channel.queue_declare(name, passive, Default::default());
        declared.await.unwrap().message_count() == 3
    })
    .await;
    let _ = connection.close(200, ShortString::from("done")).await;
}

/// A relay that is fair and finite: 600 rows staged for a queue that does not exist, then 10
/// for one that does. The relay parks the 600 out of its way (each with the broker's reason)
/// and publishes the 10, each once; `idem outbox parked` lists the 600, and once their queue
/// exists `idem outbox release --all` puts them back and the relay publishes them, once each.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn unroutable_outbox_rows_are_parked_listed_and_released() {
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(8)
        .connect(&postgres_url())
        .await
        .expect("PostgreSQL at DATABASE_URL");
    let table = format!("cli_relay_{}_inbox", std::process::id());
    let inbox = PgInbox::new(pool.clone()).table(&table).unwrap();
    inbox.migrate().await.unwrap();
    let queue = unique("idem-cli-relay");
    let (missing, routable) = (format!("{queue}.missing"), format!("{queue}.routable"));
    let rabbit = RabbitConfig::new(amqp_url());
    let transport = RabbitTransport::new(rabbit.clone());
    let specs = [
        idem::transport::QueueSpec::new(queue.clone(), CONSUMER),
        idem::transport::QueueSpec::new(routable.clone(), "routable"),
    ];
    transport.declare(&specs).await.unwrap();
    let mut tx = pool.begin().await.unwrap();
    for (target, n) in (0..600)
        .map(|n| (&missing, n))
        .chain((600..610).map(|n| (&routable, n)))
    {
        let message = idem::Outgoing::to_queue(target.as_str(), &n)
            .unwrap()
            .with_message_id(format!("{queue}-{n}"));
        inbox.stage(&mut tx, message).await.unwrap();
    }
    tx.commit().await.unwrap();
    let started = Instant::now();
    let runtime = Runtime::builder()
        .transport(transport)
        .store(PgInbox::new(pool.clone()).table(&table).unwrap())
        .handlers([CONSUMER])
        .handler_queue(CONSUMER, &queue)
        .build()
        .unwrap();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));
    let count = |queue: String| async move {
        let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
            .await
            .unwrap();
        let channel = connection.create_channel().await.unwrap();
        let passive = lapin::options::QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let count = channel
            .queue_declare(
                ShortString::from(queue.as_str()),
                passive,
                Default::default(),
            )
            .await
            .map_or(0, |q| q.message_count());
        let _ = connection.close(200, ShortString::from("counted")).await;
        count
    };
    wait_until("the 10 routable rows published", || {
        count(routable.clone()).map_eq(10)
    })
    .await;
    let waited = started.elapsed();
    wait_until("the 600 parked", || async {
        inbox.parked().await.unwrap().len() == 600
    })
    .await;
    eprintln!("the 10 routable rows arrived {waited:?} after the runtime started");
    let idem = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_idem"))
            .arg("--json")
            .args(args)
            .env("DATABASE_URL", postgres_url())
            .env("IDEM_INBOX_TABLE", &table)
            .output()
            .expect("run idem");
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        serde_json::from_slice::<Value>(&out.stdout).unwrap()
    };
    let parked = idem(&["outbox", "parked"]);
    let rows = parked["parked"].as_array().unwrap();
    assert_eq!(rows.len(), 600);
    assert!(
        rows.iter().all(|r| r["routing_key"] == missing.as_str()
            && r["failure"].as_str().unwrap().contains("no queue takes it")
            && r["given_up_at_ms"].is_null()),
        "{}",
        rows[0]
    );

    // Refused past the give-up time, they are given up: listed so, no longer tried, and only
    // an operator releases or drops them. One more, for a queue that will never exist, is
    // dropped.
    let never = idem::Outgoing::to_queue(format!("{queue}.never"), &0)
        .unwrap()
        .with_message_id(format!("{queue}-never"));
    let mut tx = pool.begin().await.unwrap();
    inbox.stage(&mut tx, never).await.unwrap();
    tx.commit().await.unwrap();
    wait_until("the row for no queue parked", || async {
        inbox.parked().await.unwrap().len() == 601
    })
    .await;
    let impatient = inbox.clone().outbox_give_up(Duration::ZERO);
    let select = idem::store::OutboxSelect::Older {
        age: Duration::from_secs(3600),
        limit: 1,
    };
    let outbound = RabbitTransport::new(rabbit.clone()).outbound().unwrap();
    use idem::store::OutboxStore;
    let report = impatient.relay(&select, outbound.as_ref()).await.unwrap();
    assert_eq!(report.given_up, 601, "{report:?}");
    let parked = idem(&["outbox", "parked"]);
    let rows = parked["parked"].as_array().unwrap();
    assert!(
        rows.iter().all(|r| r["given_up_at_ms"].is_i64()),
        "{}",
        rows[0]
    );
    let never_seq = rows
        .iter()
        .find(|r| r["message_id"] == format!("{queue}-never").as_str())
        .unwrap()["seq"]
        .to_string();
    assert_eq!(idem(&["outbox", "drop", &never_seq])["dropped"], 1);

    // The queue exists now: released, the 600 go out, once each.
    RabbitTransport::new(rabbit)
        .declare(&[idem::transport::QueueSpec::new(missing.clone(), "missing")])
        .await
        .unwrap();
    assert_eq!(idem(&["outbox", "release", "--all"])["released"], 600);
    wait_until("the 600 released rows published", || {
        count(missing.clone()).map_eq(600)
    })
    .await;
    assert!(inbox.parked().await.unwrap().is_empty());
    let left: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
        "SELECT count(*) FROM {}",
        table.replace("_inbox", "_outbox")
    )))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(left, 0, "every row published and removed");
    assert_eq!(
        count(routable.clone()).await,
        10,
        "the routable rows went out once"
    );
    let _ = stop.send(());
    tokio::time::timeout(DEADLINE, task)
        .await
        .unwrap()
        .unwrap()
        .unwrap();
    for name in [&queue, &missing, &routable] {
        for q in [name.clone(), idem::rabbitmq::dlq(name)] {
            let connection = Connection::connect(&amqp_url(), ConnectionProperties::default())
                .await
                .unwrap();
            let channel = connection.create_channel().await.unwrap();
            let _ = channel
                .queue_delete(ShortString::from(q.as_str()), Default::default())
                .await;
            let _ = connection.close(200, ShortString::from("done")).await;
        }
    }
    for suffix in ["", "_deliveries", "_dead_letters", "_versions"] {
        let drop = format!("DROP TABLE IF EXISTS {table}{suffix}");
        sqlx::query(sqlx::AssertSqlSafe(drop))
            .execute(&pool)
            .await
            .unwrap();
    }
    let outbox = table.replace("_inbox", "_outbox");
    for drop in [
        format!("DROP TABLE IF EXISTS {outbox}_parked"),
        format!("DROP TABLE IF EXISTS {outbox}"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(drop))
            .execute(&pool)
            .await
            .unwrap();
    }
    sqlx::query("DELETE FROM idem_schema_version WHERE inbox_table = $1")
        .bind(&table)
        .execute(&pool)
        .await
        .unwrap();
}

/// `future == n`, as a future.
trait MapEq: Future<Output = u32> + Sized {
    fn map_eq(self, n: u32) -> impl Future<Output = bool> {
        async move { self.await == n }
    }
}

impl<F: Future<Output = u32>> MapEq for F {}

/// `idem dlq` on NATS JetStream (`NATS_URL`): the dead letters of a queue's dead-letter stream
/// are listed with their records, one is shown, all are replayed once the handler accepts
/// them (each taking effect once) and removed from the stream; a second replay finds none.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_dead_letters_of_a_nats_queue_are_listed_shown_and_replayed() {
    use idem::nats::{NatsConfig, NatsTransport};
    let nats_url = std::env::var("NATS_URL").unwrap_or_else(|_| "nats://127.0.0.1:4222".to_owned());
    let pool = database().await;
    let queue = unique("idem-cli-nats");
    let transport = NatsTransport::new(NatsConfig::new(nats_url.as_str()));
    transport
        .declare(&[idem::transport::QueueSpec::new(queue.clone(), CONSUMER)])
        .await
        .unwrap_or_else(|e| {
            panic!("NATS with JetStream at {nats_url}: {e}; start it (`nats-server -js`)")
        });
    sqlx::query("INSERT INTO idem_cli_gates (name) VALUES ($1)")
        .bind(&queue)
        .execute(&pool)
        .await
        .unwrap();
    let runtime = Runtime::builder()
        .transport(transport.clone())
        .store(PgInbox::new(pool.clone()))
        .handlers([CONSUMER])
        .handler_queue(CONSUMER, &queue)
        .build()
        .unwrap();
    let stats = runtime.stats();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));
    for n in 0..5 {
        let id = format!("{queue}-{n}");
        let body = serde_json::json!({"id": id, "gate": queue}).to_string();
        let message = idem::Envelope::new(body)
            .with_message_id(id.as_str())
            .with_header("tenant", "acme");
        transport.publish(&queue, &message, None).await.unwrap();
    }
    wait_until("5 dead letters", || async {
        stats.snapshot().dead_lettered == 5
    })
    .await;
    let idem = |args: &[&str]| {
        let out = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(args)
            .env("NATS_URL", &nats_url)
            .env("DATABASE_URL", postgres_url())
            .env("IDEM_QUEUE", &queue)
            .env_remove("IDEM_INBOX_TABLE")
            .output()
            .expect("run idem");
        let (out, err) = (
            String::from_utf8_lossy(&out.stdout).into_owned(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        );
        assert!(
            err.is_empty() || !err.contains("error"),
            "idem {args:?}: {err}"
        );
        out
    };
    let listed: Value = serde_json::from_str(&idem(&["--json", "dlq", "list"])).unwrap();
    assert_eq!(listed["total"], 5, "{listed}");
    let first = &listed["dead_letters"][0];
    assert_eq!(first["record"]["reason"], "handler", "{first}");
    assert_eq!(first["from_queue"], queue.as_str());
    assert_eq!(first["record"]["key"], first["message_id"]);
    // Its publish time, the stream's, travels with the dead letter.
    let published = first["published_at_ms"].as_i64().unwrap_or_default();
    assert!(published > 0, "{first}");
    assert!(
        published <= first["record"]["dead_lettered_at_ms"].as_i64().unwrap(),
        "{first}"
    );
    let shown = idem(&["dlq", "show", &format!("{queue}-0")]);
    assert!(
        shown.contains("the gate is closed") && shown.contains("tenant = acme"),
        "{shown}"
    );

    sqlx::query("DELETE FROM idem_cli_gates WHERE name = $1")
        .bind(&queue)
        .execute(&pool)
        .await
        .unwrap();
    let replayed: Value =
        serde_json::from_str(&idem(&["--json", "dlq", "replay", "--all", "--keep"])).unwrap();
    assert_eq!(replayed["replayed"], 5, "{replayed}");
    assert_eq!(replayed["failures_cleared"], 5, "{replayed}");
    wait_until("the replayed orders applied", || async {
        stats.snapshot().processed == 5
    })
    .await;
    // Replayed again: the inbox says each was applied; none is published, each is resolved.
    let again: Value = serde_json::from_str(&idem(&["--json", "dlq", "replay", "--all"])).unwrap();
    assert_eq!(again["replayed"], 0, "{again}");
    assert_eq!(again["resolved"].as_array().unwrap().len(), 5, "{again}");
    let effects: (i64, i64) = sqlx::query_as(
        "SELECT count(*), count(DISTINCT key) FROM idem_cli_effects WHERE key LIKE $1",
    )
    .bind(format!("{queue}-%"))
    .fetch_one(&pool)
    .await
    .unwrap();
    assert_eq!(effects, (5, 5));
    assert_eq!(
        stats.snapshot().duplicates,
        0,
        "nothing was published again"
    );
    let again: Value = serde_json::from_str(&idem(&["--json", "dlq", "list"])).unwrap();
    assert_eq!(again["total"], 0, "{again}");

    let _ = stop.send(());
    tokio::time::timeout(DEADLINE, task)
        .await
        .expect("the runtime stops")
        .unwrap()
        .unwrap();
    transport.delete_queue(&queue).await.unwrap();
}

/// `idem schema`'s statements, run in a database of their own, make the tables `migrate()`
/// makes, recorded as current: `migrate()` afterwards changes nothing. On PostgreSQL (two
/// schemas of the test's own), MariaDB (two databases of its own) and SQLite (two files),
/// compared column by column and index by index.
#[tokio::test]
async fn the_printed_schema_is_what_migrate_creates() {
    let printed = |dialect: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_idem"))
            .args(["schema", "--dialect", dialect])
            .env_remove("IDEM_INBOX_TABLE")
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let text = String::from_utf8(out.stdout).unwrap();
        let statements: Vec<String> = text
            .split(";\n\n")
            .map(|s| {
                s.lines()
                    .filter(|l| !l.starts_with("--"))
                    .collect::<Vec<_>>()
                    .join("\n")
            })
            .filter(|s| !s.trim().is_empty())
            .collect();
        assert!(statements.len() >= 5, "{text}");
        statements
    };

    // PostgreSQL: one schema made by the printed statements, one by migrate().
    let admin = database().await;
    let id = std::process::id();
    let (by_sql, by_migrate) = (format!("idem_cli_sql_{id}"), format!("idem_cli_mig_{id}"));
    let in_schema = |schema: &str| {
        let options = postgres_url()
            .parse::<sqlx::postgres::PgConnectOptions>()
            .unwrap()
            .options([("search_path", schema)]);
        sqlx::postgres::PgPoolOptions::new()
            .max_connections(2)
            .connect_with(options)
    };
    for schema in [&by_sql, &by_migrate] {
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP SCHEMA IF EXISTS {schema} CASCADE"
        )))
        .execute(&admin)
        .await
        .unwrap();
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {schema}")))
            .execute(&admin)
            .await
            .unwrap();
    }
    let (sql_pool, migrate_pool) = (
        in_schema(&by_sql).await.unwrap(),
        in_schema(&by_migrate).await.unwrap(),
    );
    let mut tx = sql_pool.begin().await.unwrap();
    for statement in printed("postgres") {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    PgInbox::new(migrate_pool.clone()).migrate().await.unwrap();
    let shape = |schema: String| {
        let admin = admin.clone();
        async move {
            let columns: Vec<(String, String, String, String, Option<String>)> = sqlx::query_as(
                "SELECT table_name::text, column_name::text, data_type::text, is_nullable::text,
                        replace(column_default::text, $1, 's')
                 FROM information_schema.columns WHERE table_schema = $1 ORDER BY 1, 2",
            )
            .bind(&schema)
            .fetch_all(&admin)
            .await
            .unwrap();
            let indexes: Vec<(String,)> = sqlx::query_as(
                "SELECT replace(indexdef, $1, 's') FROM pg_indexes WHERE schemaname = $1 ORDER BY 1",
            )
            .bind(&schema)
            .fetch_all(&admin)
            .await
            .unwrap();
            let versions: Vec<(String, i32)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT inbox_table, version FROM {schema}.idem_schema_version ORDER BY 1"
            )))
            .fetch_all(&admin)
            .await
            .unwrap();
            (columns, indexes, versions)
        }
    };
    let made = shape(by_migrate.clone()).await;
    assert!(made.0.len() >= 10, "{made:?}");
    assert_eq!(shape(by_sql.clone()).await, made);
    PgInbox::new(sql_pool.clone()).migrate().await.unwrap();
    assert_eq!(
        shape(by_sql.clone()).await,
        made,
        "migrate() found it current"
    );
    for schema in [&by_sql, &by_migrate] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {schema} CASCADE")))
            .execute(&admin)
            .await
            .unwrap();
    }

    // MariaDB: one database made by the printed statements, one by migrate().
    let mysql_url = std::env::var("MYSQL_URL")
        .unwrap_or_else(|_| "mysql://root@127.0.0.1:3306/test".to_owned());
    let server = mysql_url
        .parse::<sqlx::mysql::MySqlConnectOptions>()
        .unwrap();
    let admin = sqlx::MySqlPool::connect_with(server.clone()).await.unwrap();
    let (by_sql, by_migrate) = (format!("idem_cli_sql_{id}"), format!("idem_cli_mig_{id}"));
    for database in [&by_sql, &by_migrate] {
        for statement in [
            format!("DROP DATABASE IF EXISTS {database}"),
            format!("CREATE DATABASE {database}"),
        ] {
            sqlx::query(sqlx::AssertSqlSafe(statement))
                .execute(&admin)
                .await
                .unwrap();
        }
    }
    let in_database =
        |database: &str| sqlx::MySqlPool::connect_with(server.clone().database(database));
    let (sql_pool, migrate_pool) = (
        in_database(&by_sql).await.unwrap(),
        in_database(&by_migrate).await.unwrap(),
    );
    // MariaDB commits each DDL statement by itself: no transaction around them.
    for statement in printed("mysql") {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&sql_pool)
            .await
            .unwrap();
    }
    idem::sql::MySqlInbox::new(migrate_pool.clone())
        .migrate()
        .await
        .unwrap();
    let shape = |database: String| {
        let admin = admin.clone();
        async move {
            let columns: Vec<(String, String, String, String, Option<String>)> = sqlx::query_as(
                "SELECT CAST(table_name AS CHAR), CAST(column_name AS CHAR), CAST(column_type AS CHAR),
                        CAST(is_nullable AS CHAR), CAST(column_default AS CHAR)
                 FROM information_schema.columns WHERE table_schema = ? ORDER BY 1, 2",
            )
            .bind(&database)
            .fetch_all(&admin)
            .await
            .unwrap();
            let indexes: Vec<(String, String, i64, String, i64)> = sqlx::query_as(
                "SELECT CAST(table_name AS CHAR), CAST(index_name AS CHAR), CAST(seq_in_index AS SIGNED),
                        CAST(column_name AS CHAR), CAST(non_unique AS SIGNED)
                 FROM information_schema.statistics WHERE table_schema = ? ORDER BY 1, 2, 3",
            )
            .bind(&database)
            .fetch_all(&admin)
            .await
            .unwrap();
            let versions: Vec<(String, i32)> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
                "SELECT inbox_table, version FROM {database}.idem_schema_version ORDER BY 1"
            )))
            .fetch_all(&admin)
            .await
            .unwrap();
            (columns, indexes, versions)
        }
    };
    let made = shape(by_migrate.clone()).await;
    assert!(made.0.len() >= 10, "{made:?}");
    assert_eq!(shape(by_sql.clone()).await, made);
    idem::sql::MySqlInbox::new(sql_pool.clone())
        .migrate()
        .await
        .unwrap();
    assert_eq!(
        shape(by_sql.clone()).await,
        made,
        "migrate() found it current"
    );
    sql_pool.close().await;
    migrate_pool.close().await;
    for database in [&by_sql, &by_migrate] {
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {database}")))
            .execute(&admin)
            .await
            .unwrap();
    }

    // SQLite: one file made by the printed statements, one by migrate().
    let dir = tempfile::tempdir().unwrap();
    let by_sql = idem::sql::sqlite::pool(&dir.path().join("sql.db").display().to_string())
        .await
        .unwrap();
    let by_migrate = idem::sql::sqlite::pool(&dir.path().join("migrate.db").display().to_string())
        .await
        .unwrap();
    let mut tx = by_sql.begin().await.unwrap();
    for statement in printed("sqlite") {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&mut *tx)
            .await
            .unwrap();
    }
    tx.commit().await.unwrap();
    idem::sql::SqliteInbox::new(by_migrate.clone())
        .migrate()
        .await
        .unwrap();
    let shape = |pool: sqlx::SqlitePool| async move {
        let objects: Vec<(String, String, Option<String>)> =
            sqlx::query_as("SELECT type, name, sql FROM sqlite_master ORDER BY type, name")
                .fetch_all(&pool)
                .await
                .unwrap();
        let versions: Vec<(String, i64)> =
            sqlx::query_as("SELECT inbox_table, version FROM idem_schema_version ORDER BY 1")
                .fetch_all(&pool)
                .await
                .unwrap();
        (objects, versions)
    };
    let made = shape(by_migrate.clone()).await;
    assert_eq!(shape(by_sql.clone()).await, made);
    idem::sql::SqliteInbox::new(by_sql.clone())
        .migrate()
        .await
        .unwrap();
    assert_eq!(shape(by_sql).await, made, "migrate() found it current");
}
