//! A key parked behind its dead-lettered message (an ordered handler's default,
//! `KeyPolicy::Park`) and released by an operator, through `build()` and the `idem` binary:
//!
//! - On RabbitMQ with PostgreSQL, MariaDB and SQLite, and on NATS with PostgreSQL: key K gets
//!   versions 1–10 while other keys flow; version 3 does not decode and is dead-lettered;
//!   versions 4–10 are parked (acked, not applied) while the other keys apply theirs;
//!   `idem dlq list` shows K with 7 messages waiting; `idem dlq skip --key K` applies 4–10 in
//!   order, once each, keeps the head with the reason and frees the key; on MariaDB a skip
//!   interrupted after its commit is resumed by running it again.
//! - With consumers in processes of their own, SIGKILLed in the middle of the release and
//!   replaced: version 3 fails transiently until its retries run out and, once the fault is
//!   fixed, `idem dlq replay --key K` applies 3–10 in order, once each (RabbitMQ and NATS, with
//!   PostgreSQL); version 3 does not decode and `idem dlq skip --key K` applies 4–10 in order,
//!   once each (RabbitMQ with SQLite, NATS with MariaDB).
//! - Every store parks and releases the same way when called directly: a copy of a parked
//!   message is parked once, the head delivered again runs, a released copy runs only in its
//!   turn and with its own body, and the key is freed after its last message.
//! - The builder refuses a key policy for a handler that is not ordered.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker;
use common::bus::{jetstream_or_fail, nats_url};
use common::running::{DEADLINE, start};
use common::{KillOnDrop, unique, wait_until};
use idem::nats::{NatsConfig, NatsTransport};
use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use idem::sql::{MySqlInbox, ParkedKey, PgInbox, Release, SqlInbox, SqliteInbox, Started};
use idem::store::{DeadLetterRecord, DeadLetterStore, ParkKey, Parking, ParkingStore};
use idem::transport::{QueueSpec, Transport};
use idem::{
    Destination, Envelope, HandlerError, KeyPolicy, Outgoing, RetryPolicy, Runtime, RuntimeError,
    idempotent,
};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::time::Duration;

const CONSUMER: &str = "parking.steps";
const PARTITIONS: usize = 2;
const VERSIONS: i64 = 10;

/// One update of one key; `run` keeps concurrent tests apart in the shared log table.
#[derive(serde::Deserialize)]
struct Step {
    run: String,
    key: String,
    version: i64,
}

/// How long each update takes in this process (`IDEM_PARKING_SLOW_MS`): the consumer the
/// release test kills works slowly, so that the kill lands in the middle of the release.
async fn work() {
    let slow = std::env::var("IDEM_PARKING_SLOW_MS")
        .ok()
        .and_then(|ms| ms.parse().ok())
        .unwrap_or(0);
    if slow > 0 {
        tokio::time::sleep(Duration::from_millis(slow)).await; // the handler's work
    }
}

#[idempotent(store = Postgres, consumer = "parking.steps", queue = "parking-steps")]
async fn step_pg(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    step: Step,
    ctx: &idem::Context<'_>,
) -> Result<(), HandlerError> {
    let id = ctx.envelope().message_id.clone().unwrap_or_default();
    let failing: i64 =
        sqlx::query_scalar("SELECT count(*) FROM idem_parking_faults WHERE message_id = $1")
            .bind(&id)
            .fetch_one(&mut **tx)
            .await?;
    if failing > 0 {
        return Err(HandlerError::transient("the ledger does not answer"));
    }
    work().await;
    sqlx::query("INSERT INTO idem_parking_log (run, key, version) VALUES ($1, $2, $3)")
        .bind(&step.run)
        .bind(&step.key)
        .bind(step.version)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(store = MySql, consumer = "parking.steps", queue = "parking-steps")]
async fn step_mysql(
    tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    step: Step,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO idem_parking_log (run, `key`, version) VALUES (?, ?, ?)")
        .bind(&step.run)
        .bind(&step.key)
        .bind(step.version)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

#[idempotent(store = Sqlite, consumer = "parking.steps", queue = "parking-steps")]
async fn step_sqlite(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    step: Step,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO idem_parking_log (run, key, version) VALUES (?1, ?2, ?3)")
        .bind(&step.run)
        .bind(&step.key)
        .bind(step.version)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// The database of one test, with the handler's log table and a migrated inbox.
enum Db {
    Postgres(sqlx::PgPool),
    MySql(sqlx::MySqlPool),
    Sqlite(sqlx::SqlitePool, tempfile::TempDir),
}

impl Db {
    async fn postgres() -> Self {
        let pool = common::postgres(4).await;
        PgInbox::new(pool.clone()).migrate().await.unwrap();
        for ddl in [
            "CREATE TABLE IF NOT EXISTS idem_parking_log (id BIGSERIAL PRIMARY KEY, run TEXT NOT NULL, key TEXT NOT NULL, version BIGINT NOT NULL)",
            "CREATE TABLE IF NOT EXISTS idem_parking_faults (message_id TEXT NOT NULL)",
        ] {
            sqlx::query(ddl).execute(&pool).await.unwrap();
        }
        Self::Postgres(pool)
    }

    async fn mysql() -> Self {
        let pool = common::mysql(4).await;
        MySqlInbox::new(pool.clone()).migrate().await.unwrap();
        sqlx::query("CREATE TABLE IF NOT EXISTS idem_parking_log (id BIGINT AUTO_INCREMENT PRIMARY KEY, run VARCHAR(200) NOT NULL, `key` VARCHAR(200) NOT NULL, version BIGINT NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        Self::MySql(pool)
    }

    async fn sqlite() -> Self {
        let (pool, dir) = common::sqlite(4).await;
        SqliteInbox::new(pool.clone()).migrate().await.unwrap();
        sqlx::query("CREATE TABLE IF NOT EXISTS idem_parking_log (id INTEGER PRIMARY KEY AUTOINCREMENT, run TEXT NOT NULL, key TEXT NOT NULL, version INTEGER NOT NULL)")
            .execute(&pool)
            .await
            .unwrap();
        Self::Sqlite(pool, dir)
    }

    /// `DATABASE_URL` for the `idem` binary.
    fn url(&self) -> String {
        match self {
            Self::Postgres(_) => common::postgres_url(),
            Self::MySql(_) => common::mysql_url(),
            Self::Sqlite(_, dir) => format!("sqlite://{}", dir.path().join("idem.db").display()),
        }
    }

    fn with_store(&self, builder: idem::RuntimeBuilder) -> idem::RuntimeBuilder {
        match self {
            Self::Postgres(pool) => builder.store(PgInbox::new(pool.clone())),
            Self::MySql(pool) => builder.store(MySqlInbox::new(pool.clone())),
            Self::Sqlite(pool, _) => builder.store(SqliteInbox::new(pool.clone())),
        }
    }

    /// The versions of `key` applied, in the order they were.
    async fn applied(&self, run: &str, key: &str) -> Vec<i64> {
        let select = "SELECT version FROM idem_parking_log WHERE run = $1 AND key = $2 ORDER BY id";
        match self {
            Self::Postgres(pool) => sqlx::query_scalar(select)
                .bind(run)
                .bind(key)
                .fetch_all(pool)
                .await
                .unwrap(),
            Self::MySql(pool) => sqlx::query_scalar(
                "SELECT version FROM idem_parking_log WHERE run = ? AND `key` = ? ORDER BY id",
            )
            .bind(run)
            .bind(key)
            .fetch_all(pool)
            .await
            .unwrap(),
            Self::Sqlite(pool, _) => sqlx::query_scalar(select)
                .bind(run)
                .bind(key)
                .fetch_all(pool)
                .await
                .unwrap(),
        }
    }

    async fn parked(&self, key: &str) -> Option<ParkedKey> {
        let keys = match self {
            Self::Postgres(pool) => PgInbox::new(pool.clone()).parked_keys().await,
            Self::MySql(pool) => MySqlInbox::new(pool.clone()).parked_keys().await,
            Self::Sqlite(pool, _) => SqliteInbox::new(pool.clone()).parked_keys().await,
        };
        keys.unwrap().into_iter().find(|k| k.order_key == key)
    }

    /// Starts skipping `key`'s head, as `idem dlq skip` does first, and goes no further.
    async fn start_skip(&self, key: &ParkedKey, reason: &str) {
        let skip = Release::Skip {
            message_id: &key.head_message_id,
            reason,
            body: &[],
        };
        let started = match self {
            Self::Postgres(pool) => PgInbox::new(pool.clone()).start_release(key, skip).await,
            Self::MySql(pool) => MySqlInbox::new(pool.clone()).start_release(key, skip).await,
            Self::Sqlite(pool, _) => {
                SqliteInbox::new(pool.clone())
                    .start_release(key, skip)
                    .await
            }
        };
        assert!(matches!(started.unwrap(), Started::Releasing(Some(_))));
    }

    /// The reasons kept with `key`'s skipped heads.
    async fn skipped(&self, key: &str) -> Vec<String> {
        let select = "SELECT reason FROM idem_inbox_skipped WHERE order_key = $1";
        match self {
            Self::Postgres(pool) => sqlx::query_scalar(select).bind(key).fetch_all(pool).await,
            Self::MySql(pool) => {
                sqlx::query_scalar("SELECT reason FROM idem_inbox_skipped WHERE order_key = ?")
                    .bind(key)
                    .fetch_all(pool)
                    .await
            }
            Self::Sqlite(pool, _) => sqlx::query_scalar(select).bind(key).fetch_all(pool).await,
        }
        .unwrap()
    }
}

/// The broker of one test: RabbitMQ (a node with the consistent-hash plugin) or NATS.
#[derive(Clone, Copy)]
enum Broker {
    Rabbit,
    Nats,
}

impl Broker {
    async fn transport(self, name: &str) -> Box<dyn Transport> {
        match self {
            Self::Rabbit => {
                broker::with_the_plugin().await;
                let config = RabbitConfig::new(broker::amqp_url())
                    .connection_name(format!("idem-test:parking:{name}"));
                Box::new(RabbitTransport::new(config))
            }
            Self::Nats => {
                jetstream_or_fail().await;
                Box::new(NatsTransport::new(NatsConfig::new(nats_url())))
            }
        }
    }

    fn runtime(self, name: &str) -> idem::RuntimeBuilder {
        let builder = Runtime::builder();
        match self {
            Self::Rabbit => builder.transport(RabbitTransport::new(
                RabbitConfig::new(broker::amqp_url())
                    .connection_name(format!("idem-test:parking:{name}")),
            )),
            Self::Nats => builder.transport(NatsTransport::new(NatsConfig::new(nats_url()))),
        }
    }

    /// The broker's setting for the `idem` binary.
    fn cli_env(self) -> (&'static str, String) {
        match self {
            Self::Rabbit => ("AMQP_URL", broker::amqp_url()),
            Self::Nats => ("NATS_URL", nats_url()),
        }
    }
}

/// Versions 1–10 of each of `keys`, in order per key, the parked key's third not JSON.
fn steps(run: &str, source: &str, keys: &[String], parked: &str) -> Vec<Outgoing> {
    let mut messages = Vec::new();
    for version in 1..=VERSIONS {
        for key in keys {
            let id = format!("{key}:{version}");
            let body = match (key == parked, version) {
                (true, 3) => b"{not json".to_vec(),
                _ => serde_json::json!({"run": run, "key": key, "version": version})
                    .to_string()
                    .into_bytes(),
            };
            let mut message = Outgoing::new(Destination::topic(source, key), body);
            message.envelope = Envelope::new(message.envelope.body.clone())
                .with_message_id(id)
                .with_content_type("application/json");
            messages.push(message);
        }
    }
    messages
}

/// Declares the partitions of `source` and publishes `messages` in order, confirmed.
async fn publish(broker: Broker, source: &str, messages: &[Outgoing]) {
    let transport = broker.transport("publisher").await;
    transport
        .declare(&QueueSpec::partitions(source, CONSUMER, PARTITIONS))
        .await
        .unwrap();
    for sent in transport.outbound().unwrap().publish_all(messages).await {
        sent.unwrap();
    }
    transport.close().await;
}

/// Runs the `idem` binary (built beside the tests) with `args`, the database at `db_url` and
/// the broker's URL; its standard output, or a failure with what it said.
fn idem_cli(broker: Broker, db_url: &str, args: &[&str]) -> String {
    let (ok, said) = idem_cli_run(broker, db_url, args);
    assert!(ok, "idem {args:?} failed: {said}");
    said
}

/// [`idem_cli`], for a command that must fail: what it said.
fn idem_cli_fails(broker: Broker, db_url: &str, args: &[&str]) -> String {
    let (ok, said) = idem_cli_run(broker, db_url, args);
    assert!(!ok, "idem {args:?} succeeded: {said}");
    said
}

/// Runs the `idem` binary; whether it succeeded, and its standard output and error.
fn idem_cli_run(broker: Broker, db_url: &str, args: &[&str]) -> (bool, String) {
    let binary = std::env::current_exe()
        .unwrap()
        .parent()
        .and_then(std::path::Path::parent)
        .unwrap()
        .join("idem");
    assert!(
        binary.exists(),
        "{} is missing: `cargo test --workspace` builds it, or run `cargo build -p idem-cli`",
        binary.display()
    );
    let (name, url) = broker.cli_env();
    let output = Command::new(binary)
        .args(args)
        .env("DATABASE_URL", db_url)
        .env(name, url)
        .env_remove(if name == "AMQP_URL" {
            "NATS_URL"
        } else {
            "AMQP_URL"
        })
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output.status.success(), said)
}

/// Key K's version 3 is refused as undecodable and dead-lettered: versions 4–10 are parked
/// while the other keys apply all theirs; `idem dlq list` shows the key; `idem dlq skip
/// --key` applies 4–10 in order, once each, and keeps the head with the reason.
async fn a_skipped_head_releases_its_key_in_order(broker: Broker, db: Db, interrupted: bool) {
    let run = unique("idem-parking-skip");
    let source = run.clone();
    let keys: Vec<String> = (0..4).map(|i| format!("{run}-k{i}")).collect();
    let parked = keys[0].clone();
    let messages = steps(&run, &source, &keys, &parked);
    publish(broker, &source, &messages).await;
    let running = start(
        db.with_store(broker.runtime("skip"))
            .handlers([CONSUMER])
            .handler_queue(CONSUMER, &source)
            .ordered(CONSUMER, PARTITIONS),
    );
    wait_until("every message settled", DEADLINE, || async {
        running.now().settled() >= messages.len() as u64
    })
    .await;
    for key in &keys[1..] {
        assert_eq!(
            db.applied(&run, key).await,
            (1..=VERSIONS).collect::<Vec<_>>()
        );
    }
    assert_eq!(
        db.applied(&run, &parked).await,
        vec![1, 2],
        "its later versions wait"
    );
    let stats = running.now();
    assert_eq!((stats.dead_lettered, stats.parked), (1, 7), "{stats:?}");
    let key = db.parked(&parked).await.expect("the key is parked");
    assert_eq!((key.state.as_str(), key.depth), ("parked", 7), "{key:?}");
    assert!(key.reason.starts_with("decode"), "{key:?}");
    // The partition the key is consumed from, as the broker routed it.
    let queue = key.queue.clone();
    assert!(queue.starts_with(&format!("{source}.p")), "{key:?}");
    let listed = idem_cli(
        broker,
        &db.url(),
        &["--json", "dlq", "list", "--queue", &queue],
    );
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    let shown = &listed["parked_keys"][0];
    assert_eq!(shown["key"], parked.as_str(), "{listed}");
    assert_eq!(shown["depth"], 7, "{listed}");
    assert_eq!(listed["total"], 1, "the head is in the DLQ: {listed}");

    // The head alone is not replayed: its key is released with it, or not at all.
    let refused = idem_cli_fails(
        broker,
        &db.url(),
        &["dlq", "replay", "--queue", &queue, &format!("{parked}:3")],
    );
    assert!(refused.contains("is parked behind it"), "{refused}");
    if interrupted {
        // A skip that committed and stopped before it took the head out of the DLQ and
        // published anything: the key is releasing, and nothing moves yet.
        db.start_skip(&key, "a malformed update; version 4 supersedes it")
            .await;
        assert_eq!(db.parked(&parked).await.unwrap().state, "releasing");
    }
    let said = idem_cli(
        broker,
        &db.url(),
        &[
            "dlq",
            "skip",
            "--queue",
            &queue,
            "--key",
            &parked,
            "--reason",
            "a malformed update; version 4 supersedes it",
        ],
    );
    let done = if interrupted { "resumed" } else { "skipped" };
    assert!(said.contains(done), "{said}");
    wait_until("the key released", DEADLINE, || async {
        db.parked(&parked).await.is_none()
    })
    .await;
    assert_eq!(
        db.applied(&run, &parked).await,
        vec![1, 2, 4, 5, 6, 7, 8, 9, 10],
        "released in order, once each"
    );
    assert_eq!(
        db.skipped(&parked).await,
        vec!["a malformed update; version 4 supersedes it".to_owned()]
    );
    let listed = idem_cli(
        broker,
        &db.url(),
        &["--json", "dlq", "list", "--queue", &queue],
    );
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed["total"], 0, "the head left the DLQ: {listed}");
    assert_eq!(listed["parked_keys"], serde_json::json!([]), "{listed}");
    running.shut_down().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_head_releases_its_key_in_order_on_rabbitmq_and_postgres() {
    a_skipped_head_releases_its_key_in_order(Broker::Rabbit, Db::postgres().await, false).await;
}

/// On MariaDB the skip is interrupted first (committed, and stopped before it took the head
/// out of the DLQ and published anything): running it again resumes it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_skip_resumes_and_releases_its_key_in_order_on_rabbitmq_and_mariadb() {
    a_skipped_head_releases_its_key_in_order(Broker::Rabbit, Db::mysql().await, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_head_releases_its_key_in_order_on_rabbitmq_and_sqlite() {
    a_skipped_head_releases_its_key_in_order(Broker::Rabbit, Db::sqlite().await, false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skipped_head_releases_its_key_in_order_on_nats_and_postgres() {
    a_skipped_head_releases_its_key_in_order(Broker::Nats, Db::postgres().await, false).await;
}

/// On NATS, a released message that arrives before its turn (a consumer killed between
/// publishing it and taking its predecessor out; JetStream redelivers the predecessor only
/// after the ack wait) is set aside, and published again when its predecessor is applied:
/// under a copy id of its own, or JetStream's duplicate window would swallow it and the key
/// would wait for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_released_message_that_came_before_its_turn_is_released_again_on_nats() {
    let broker = Broker::Nats;
    let db = Db::postgres().await;
    let Db::Postgres(pool) = &db else {
        unreachable!()
    };
    let run = unique("idem-parking-turn");
    let source = run.clone();
    let parked = format!("{run}-k0");
    let mut messages = steps(&run, &source, std::slice::from_ref(&parked), &parked);
    messages.truncate(5);
    publish(broker, &source, &messages).await;
    let running = start(
        db.with_store(broker.runtime("turn"))
            .handlers([CONSUMER])
            .handler_queue(CONSUMER, &source)
            .ordered(CONSUMER, PARTITIONS),
    );
    wait_until("versions 4 and 5 parked", DEADLINE, || async {
        db.parked(&parked).await.is_some_and(|k| k.depth == 2)
    })
    .await;
    let key = db.parked(&parked).await.unwrap();
    let inbox = PgInbox::new(pool.clone());
    let skip = Release::Skip {
        message_id: &key.head_message_id,
        reason: "superseded",
        body: &[],
    };
    let Started::Releasing(Some(fourth)) = inbox.start_release(&key, skip).await.unwrap() else {
        panic!("released")
    };
    let fifth = inbox
        .next_parked(CONSUMER, &parked, fourth.seq)
        .await
        .unwrap()
        .unwrap();
    let transport = broker.transport("turn").await;
    let outbound = transport.outbound().unwrap();
    let before = running.now().parked;
    // Version 5 first: not its turn, set aside.
    outbound
        .publish(&idem::transport::release(
            &fifth, CONSUMER, &parked, &source,
        ))
        .await
        .unwrap();
    wait_until("version 5 set aside", DEADLINE, || async {
        running.now().parked > before
    })
    .await;
    assert_eq!(db.applied(&run, &parked).await, vec![1, 2]);
    // Version 4: applied, and version 5 published again after it.
    outbound
        .publish(&idem::transport::release(
            &fourth, CONSUMER, &parked, &source,
        ))
        .await
        .unwrap();
    wait_until("the key released", DEADLINE, || async {
        db.parked(&parked).await.is_none()
    })
    .await;
    assert_eq!(db.applied(&run, &parked).await, vec![1, 2, 4, 5]);
    transport.close().await;
    running.shut_down().await;
}

/// A consumer process of the release tests: the test binary itself, run with the broker, the
/// database and the source to consume in its environment, until it is killed.
fn spawn_child(broker: Broker, db: &Db, source: &str, slow_ms: u64) -> KillOnDrop {
    let (name, url) = broker.cli_env();
    let child = Command::new(std::env::current_exe().unwrap())
        .args(["--ignored", "--exact", "parking_child", "--nocapture"])
        .env("IDEM_PARKING_SOURCE", source)
        .env("IDEM_PARKING_SLOW_MS", slow_ms.to_string())
        .env("IDEM_PARKING_BROKER", name)
        .env("IDEM_PARKING_DATABASE", db.url())
        .env(name, url)
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    KillOnDrop(child)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "a consumer process of the release tests, run by them"]
async fn parking_child() {
    let source = std::env::var("IDEM_PARKING_SOURCE").unwrap();
    let database = std::env::var("IDEM_PARKING_DATABASE").unwrap();
    let builder = match std::env::var("IDEM_PARKING_BROKER").as_deref() {
        Ok("NATS_URL") => {
            Runtime::builder().transport(NatsTransport::new(NatsConfig::new(nats_url())))
        }
        _ => Runtime::builder()
            .transport(RabbitTransport::new(RabbitConfig::new(broker::amqp_url()))),
    };
    let builder = if let Some(path) = database.strip_prefix("sqlite://") {
        builder.store(SqliteInbox::new(
            common::sqlite_at(std::path::Path::new(path), 4).await,
        ))
    } else if database.starts_with("mysql") {
        builder.store(MySqlInbox::new(common::mysql(4).await))
    } else {
        builder.store(PgInbox::new(common::postgres(4).await))
    };
    builder
        .handlers([CONSUMER])
        .handler_queue(CONSUMER, &source)
        .ordered(CONSUMER, PARTITIONS)
        .retry(
            RetryPolicy::new(4, Duration::from_millis(100), 2, Duration::from_millis(400)).unwrap(),
        )
        .build()
        .unwrap()
        .run_until(std::future::pending::<()>())
        .await
        .unwrap();
}

/// Whether `queue` holds no message, delivered or not.
async fn drained(broker: Broker, queue: &str) -> bool {
    match broker {
        Broker::Rabbit => broker::count(queue).await == 0 && broker::unacked(queue) == 0,
        Broker::Nats => {
            let js = jetstream_or_fail().await;
            let name = format!("IDEM_{}", queue.replace('.', "_"));
            let mut stream = js.get_stream(name).await.unwrap();
            stream.info().await.unwrap().state.messages == 0
        }
    }
}

/// How the release tests' key K fails at its version 3, and how it is released.
#[derive(Clone, Copy, PartialEq)]
enum Head {
    /// It does not decode; `idem dlq skip --key`.
    Skipped,
    /// It fails transiently until its retries run out (PostgreSQL's handler), then the fault
    /// is fixed; `idem dlq replay --key`.
    Replayed,
}

/// Key K's version 3 fails; versions 4–10 are parked in a consumer process; `idem dlq skip
/// --key` (versions 4–10 applied) or, once the fault is fixed, `idem dlq replay --key`
/// (versions 3–10) releases the key, and the consumer is SIGKILLed in the middle of the
/// release: another process takes over, and every version is applied once, in order.
async fn a_release_goes_on_in_order_across_a_killed_consumer(broker: Broker, db: Db, head: Head) {
    let run = unique("idem-parking-kill");
    let source = run.clone();
    let keys: Vec<String> = (0..2).map(|i| format!("{run}-k{i}")).collect();
    let parked = keys[0].clone();
    let fault = format!("{parked}:3");
    let messages = match (head, &db) {
        (Head::Skipped, _) => steps(&run, &source, &keys, &parked),
        (Head::Replayed, Db::Postgres(pool)) => {
            sqlx::query("INSERT INTO idem_parking_faults (message_id) VALUES ($1)")
                .bind(&fault)
                .execute(pool)
                .await
                .unwrap();
            steps(&run, &source, &keys, "none")
        }
        (Head::Replayed, _) => unreachable!("the fault is PostgreSQL's handler's"),
    };
    publish(broker, &source, &messages).await;
    let first = spawn_child(broker, &db, &source, 300);
    wait_until("the key parked with 7 messages", DEADLINE, || async {
        db.parked(&parked).await.is_some_and(|k| k.depth == 7)
    })
    .await;
    wait_until("the other key applied", DEADLINE, || async {
        db.applied(&run, &keys[1]).await.len() == VERSIONS as usize
    })
    .await;
    assert_eq!(db.applied(&run, &parked).await, vec![1, 2]);
    let key = db.parked(&parked).await.unwrap();
    let queue = key.queue.clone();
    let (said, expected) = match head {
        Head::Skipped => {
            assert!(key.reason.starts_with("decode"), "{key:?}");
            let args = [
                "dlq", "skip", "--queue", &queue, "--key", &parked, "--reason", "bad",
            ];
            (
                idem_cli(broker, &db.url(), &args),
                vec![1, 2, 4, 5, 6, 7, 8, 9, 10],
            )
        }
        Head::Replayed => {
            assert!(key.reason.starts_with("retries-exhausted"), "{key:?}");
            let Db::Postgres(pool) = &db else {
                unreachable!()
            };
            sqlx::query("DELETE FROM idem_parking_faults WHERE message_id = $1")
                .bind(&fault)
                .execute(pool)
                .await
                .unwrap();
            let args = ["dlq", "replay", "--queue", &source, "--key", &parked];
            (idem_cli(broker, &db.url(), &args), (1..=VERSIONS).collect())
        }
    };
    assert!(
        said.contains("skipped") || said.contains("replayed"),
        "{said}"
    );
    wait_until("half the release applied", DEADLINE, || async {
        db.applied(&run, &parked).await.len() >= 5
    })
    .await;
    let mut first = first;
    first.0.kill().unwrap();
    let status = first.0.wait().unwrap();
    assert_eq!(status.signal(), Some(9), "the consumer was killed");
    let at_kill = db.applied(&run, &parked).await;
    assert!(
        at_kill.len() < expected.len(),
        "the kill came after the release: {at_kill:?}"
    );
    let _second = spawn_child(broker, &db, &source, 0);
    wait_until("the key released", DEADLINE, || async {
        db.parked(&parked).await.is_none()
    })
    .await;
    wait_until("the partition drained", DEADLINE, || async {
        drained(broker, &queue).await
    })
    .await;
    assert_eq!(
        db.applied(&run, &parked).await,
        expected,
        "in order after 1 and 2, once each (killed with {at_kill:?} applied)"
    );
    let listed = idem_cli(
        broker,
        &db.url(),
        &["--json", "dlq", "list", "--queue", &queue],
    );
    let listed: serde_json::Value = serde_json::from_str(&listed).unwrap();
    assert_eq!(listed["total"], 0, "the head left the DLQ: {listed}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_goes_on_in_order_across_a_killed_consumer_on_rabbitmq_and_postgres() {
    let db = Db::postgres().await;
    a_release_goes_on_in_order_across_a_killed_consumer(Broker::Rabbit, db, Head::Replayed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_replay_goes_on_in_order_across_a_killed_consumer_on_nats_and_postgres() {
    let db = Db::postgres().await;
    a_release_goes_on_in_order_across_a_killed_consumer(Broker::Nats, db, Head::Replayed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skip_goes_on_in_order_across_a_killed_consumer_on_rabbitmq_and_sqlite() {
    let db = Db::sqlite().await;
    a_release_goes_on_in_order_across_a_killed_consumer(Broker::Rabbit, db, Head::Skipped).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skip_goes_on_in_order_across_a_killed_consumer_on_nats_and_mariadb() {
    let db = Db::mysql().await;
    a_release_goes_on_in_order_across_a_killed_consumer(Broker::Nats, db, Head::Skipped).await;
}

/// A dead letter that parks `order_key` for `consumer`, the message `id` its head.
fn dead_letter(consumer: &str, order_key: &str, id: &str) -> DeadLetterRecord {
    released_dead_letter(consumer, order_key, id, None)
}

/// [`dead_letter`], of a message that says it is the released message at `released`.
fn released_dead_letter(
    consumer: &str,
    order_key: &str,
    id: &str,
    released: Option<i64>,
) -> DeadLetterRecord {
    let letter = idem::transport::DeadLetter::new("decode", "not JSON", consumer, None, 1);
    let envelope = Envelope::new(format!("{id} body")).with_message_id(id);
    DeadLetterRecord::new(&letter, &envelope, "parked.p0")
        .parking(ParkKey::new(order_key, "parked").released(released))
}

fn message(order_key: &str, id: &str) -> Envelope {
    Envelope::new(format!("{id} body"))
        .with_message_id(id)
        .with_routing_key(order_key)
}

/// Parks and releases a key on `inbox` by its store calls (see the module).
async fn the_store_parks_and_releases<DB: idem::sql::Dialect>(inbox: SqlInbox<DB>) {
    let consumer = unique("parking.store");
    let key = "k";
    let admit = |m: Envelope| {
        let (inbox, consumer) = (&inbox, consumer.clone());
        async move {
            let order_key = m.routing_key.clone().unwrap();
            inbox
                .admit_ordered(&consumer, &order_key, &m, &mut None)
                .await
                .unwrap()
        }
    };
    assert_eq!(
        admit(message(key, "m1")).await,
        Parking::Run,
        "nothing parked"
    );
    inbox
        .record_dead_letter(&dead_letter(&consumer, key, "m3"))
        .await
        .unwrap();
    let depth = || async {
        let keys = inbox.parked_keys().await.unwrap();
        keys.into_iter()
            .find(|k| k.consumer == consumer)
            .map(|k| (k.state, k.depth))
    };
    assert_eq!(depth().await, Some(("parked".to_owned(), 0)));
    assert_eq!(admit(message(key, "m4")).await, Parking::Parked);
    assert_eq!(admit(message(key, "m4")).await, Parking::Parked, "a copy");
    assert_eq!(admit(message(key, "m5")).await, Parking::Parked);
    assert_eq!(
        depth().await,
        Some(("parked".to_owned(), 2)),
        "the copy is one message"
    );
    assert_eq!(
        admit(message(key, "m3")).await,
        Parking::Run,
        "the head runs again"
    );
    assert_eq!(
        admit(message("other", "o1")).await,
        Parking::Run,
        "other keys flow"
    );

    // Another message of the key dead-lettered (it never ran) leaves the key's head as it is.
    inbox
        .record_dead_letter(&dead_letter(&consumer, key, "m9"))
        .await
        .unwrap();
    let seen = inbox
        .parked_keys()
        .await
        .unwrap()
        .into_iter()
        .find(|k| k.consumer == consumer)
        .unwrap();
    assert_eq!(seen.head_message_id, "m3", "{seen:?}");

    let skip = Release::Skip {
        message_id: "m3",
        reason: "superseded",
        body: b"m3 body",
    };
    let mut stale = seen.clone();
    stale.head_message_id = "m2".into();
    assert!(
        matches!(
            inbox.start_release(&stale, skip).await.unwrap(),
            Started::Changed
        ),
        "a key read with another head is left as it is"
    );
    let Started::Releasing(Some(first)) = inbox.start_release(&seen, skip).await.unwrap() else {
        panic!("released")
    };
    assert!(
        matches!(
            inbox.start_release(&seen, skip).await.unwrap(),
            Started::Changed
        ),
        "a key released already is not released again"
    );
    assert_eq!(first.envelope.message_id.as_deref(), Some("m4"));
    assert_eq!(depth().await, Some(("releasing".to_owned(), 2)));
    assert_eq!(
        admit(message(key, "m3")).await,
        Parking::Parked,
        "the skipped head, delivered again, does not run"
    );
    assert_eq!(
        depth().await,
        Some(("releasing".to_owned(), 2)),
        "nor is it parked behind the others"
    );
    // A dead letter claiming the place of a parked message it is not leaves the key as it is.
    let claimed = released_dead_letter(&consumer, key, "m10", Some(first.seq));
    inbox.record_dead_letter(&claimed).await.unwrap();
    assert_eq!(depth().await, Some(("releasing".to_owned(), 2)));
    let next = inbox
        .next_parked(&consumer, key, first.seq)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(next.envelope.message_id.as_deref(), Some("m5"));
    let copy = |parked: &idem::store::ParkedMessage| {
        let mut copy = idem::transport::released_copy(parked);
        copy.routing_key = Some(key.to_owned());
        copy
    };
    assert_eq!(
        admit(copy(&next)).await,
        Parking::Parked,
        "not its turn yet"
    );
    let mut forged = copy(&first);
    forged.body = b"another body".to_vec();
    forged.message_id = Some("m6".into());
    assert_eq!(
        admit(forged).await,
        Parking::Parked,
        "a forged mark is a new message"
    );
    assert_eq!(depth().await, Some(("releasing".to_owned(), 3)));
    assert_eq!(admit(copy(&first)).await, Parking::Released(first.seq));
    assert_eq!(
        admit(message(key, "m7")).await,
        Parking::Parked,
        "live ones wait"
    );

    let fingerprint =
        |m: &idem::store::ParkedMessage| idem::store::Fingerprint::of(&m.envelope.body);
    inbox
        .finish_release(&consumer, key, first.seq, &fingerprint(&first))
        .await
        .unwrap();
    assert_eq!(admit(copy(&next)).await, Parking::Released(next.seq));
    let mut done = next;
    // m5, then the forged m6 and m7, in the order they were parked.
    for expected in ["m6", "m7"] {
        inbox
            .finish_release(&consumer, key, done.seq, &fingerprint(&done))
            .await
            .unwrap();
        assert!(depth().await.is_some(), "not freed before its last message");
        let next = inbox
            .next_parked(&consumer, key, done.seq)
            .await
            .unwrap()
            .unwrap();
        assert_eq!(next.envelope.message_id.as_deref(), Some(expected));
        assert_eq!(admit(copy(&next)).await, Parking::Released(next.seq));
        done = next;
    }
    assert!(
        inbox
            .next_parked(&consumer, key, done.seq)
            .await
            .unwrap()
            .is_none()
    );
    inbox
        .finish_release(&consumer, key, done.seq, &fingerprint(&done))
        .await
        .unwrap();
    assert_eq!(depth().await, None, "freed after its last message");
    assert_eq!(admit(message(key, "m8")).await, Parking::Run);
    assert_eq!(inbox.parked_summary(&consumer).await.unwrap(), (0, None));
}

#[tokio::test]
async fn every_store_parks_and_releases_a_key_in_order() {
    let pg = common::postgres(2).await;
    let inbox = PgInbox::new(pg);
    inbox.migrate().await.unwrap();
    the_store_parks_and_releases(inbox).await;
    let my = common::mysql(2).await;
    let inbox = MySqlInbox::new(my);
    inbox.migrate().await.unwrap();
    the_store_parks_and_releases(inbox).await;
    let (lite, _dir) = common::sqlite(2).await;
    let inbox = SqliteInbox::new(lite);
    inbox.migrate().await.unwrap();
    the_store_parks_and_releases(inbox).await;
}

/// The gauges of parked keys, read from the handler's store by its runtime: how many keys are
/// parked, and how long the oldest has waited. (A current-thread test, so that a recorder of
/// its own sees the runtime's tasks.)
#[tokio::test]
async fn the_gauges_count_parked_keys_and_how_long_the_oldest_waited() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new().build_recorder();
    let handle = recorder.handle();
    let _recording = metrics::set_default_local_recorder(&recorder);
    let (pool, _dir) = common::sqlite(2).await;
    let inbox = SqliteInbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    for key in ["g1", "g2"] {
        let head = format!("{key}:3");
        inbox
            .record_dead_letter(&dead_letter(CONSUMER, key, &head))
            .await
            .unwrap();
    }
    // The second key has waited a minute.
    sqlx::query(
        "UPDATE idem_inbox_parked_keys SET parked_ms = parked_ms - 60000 WHERE order_key = 'g2'",
    )
    .execute(&pool)
    .await
    .unwrap();
    let source = unique("idem-parking-gauges");
    let running = start(
        Runtime::builder()
            .transport(idem::transport::MemoryTransport::new())
            .store(inbox)
            .handlers([CONSUMER])
            .handler_queue(CONSUMER, &source)
            .ordered(CONSUMER, PARTITIONS),
    );
    let gauge = |name: &str| {
        let prefix = format!("{name}{{consumer=\"{CONSUMER}\"}} ");
        handle
            .render()
            .lines()
            .find_map(|line| line.strip_prefix(&prefix).map(str::to_owned))
            .map(|value| value.parse::<f64>().unwrap())
    };
    wait_until("the gauges set", DEADLINE, || async {
        gauge("idem_parked_keys").is_some()
    })
    .await;
    assert_eq!(gauge("idem_parked_keys"), Some(2.0));
    let waited = gauge("idem_parked_key_age_seconds").unwrap();
    assert!(
        (60.0..120.0).contains(&waited),
        "the oldest waited {waited} s"
    );
    running.shut_down().await;
}

#[tokio::test]
async fn the_builder_refuses_a_key_policy_for_a_handler_that_is_not_ordered() {
    let (pool, _dir) = common::sqlite(1).await;
    let refused = Runtime::builder()
        .transport(idem::transport::MemoryTransport::new())
        .store(SqliteInbox::new(pool))
        .handlers([CONSUMER])
        .key_policy(CONSUMER, KeyPolicy::Retire)
        .build()
        .err()
        .expect("refused");
    let RuntimeError::Setting { setting, problem } = &refused else {
        panic!("{refused}")
    };
    assert_eq!(*setting, "key_policy");
    assert!(problem.contains("is not ordered"), "{problem}");
}
