//! Settings under which a commit can be lost after idem acked its message, found at a
//! runtime's start (through `build()` and `run_until`): logged once by default, refused with
//! `Durability::Require` naming the setting and its fix. PostgreSQL commits not flushed
//! (`synchronous_commit = off`), a standby of the test's own streamed to asynchronously and
//! then synchronously, SQLite without sync, and MariaDB as its package installs it.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use idem::sql::{Durability, MySqlInbox, PgInbox, SqliteInbox};
use idem::transport::MemoryTransport;
use idem::{HandlerError, Runtime, RuntimeError, idempotent};
use std::io::Write;
use std::sync::{Arc, Mutex, OnceLock};

#[derive(serde::Deserialize)]
struct Message {
    id: String,
}

#[idempotent(store = Postgres, queue = "dur-pg", consumer = "dur.pg", key = "m.id")]
async fn on_postgres(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    m: Message,
) -> Result<(), HandlerError> {
    let _ = m.id;
    Ok(())
}

#[idempotent(store = Sqlite, queue = "dur-sqlite", consumer = "dur.sqlite", key = "m.id")]
async fn on_sqlite(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    m: Message,
) -> Result<(), HandlerError> {
    let _ = m.id;
    Ok(())
}

#[idempotent(store = MySql, queue = "dur-mysql", consumer = "dur.mysql", key = "m.id")]
async fn on_mysql(
    _tx: &mut sqlx::Transaction<'_, sqlx::MySql>,
    m: Message,
) -> Result<(), HandlerError> {
    let _ = m.id;
    Ok(())
}

/// What the process logged (one subscriber for the binary).
fn logs() -> &'static Arc<Mutex<Vec<u8>>> {
    static LOGS: OnceLock<Arc<Mutex<Vec<u8>>>> = OnceLock::new();
    LOGS.get_or_init(|| {
        let logs = Arc::new(Mutex::new(Vec::new()));
        let writer = Writer(logs.clone());
        tracing_subscriber::fmt()
            .with_env_filter("idem_sqlx=warn")
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        logs
    })
}

#[derive(Clone)]
struct Writer(Arc<Mutex<Vec<u8>>>);

impl Write for Writer {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// The logged lines that contain every one of `words`.
fn logged(words: &[&str]) -> Vec<String> {
    String::from_utf8_lossy(&logs().lock().unwrap())
        .lines()
        .filter(|line| words.iter().all(|w| line.contains(w)))
        .map(str::to_owned)
        .collect()
}

/// Starts a runtime of `handler` on `store` and stops it at once: what its start said.
async fn start<S: idem::store::RuntimeStore>(handler: &str, store: S) -> Result<(), RuntimeError> {
    logs();
    Runtime::builder()
        .transport(MemoryTransport::new())
        .store(store)
        .handlers([handler])
        .build()
        .unwrap()
        .run_until(async {})
        .await
}

/// The inbox table of these tests: a runtime's relay takes every row of its outbox, so none
/// shares `idem_outbox` with other tests.
const TABLE: &str = "idem_dur_inbox";

/// The PostgreSQL inbox of these tests on `pool`.
fn pg(pool: sqlx::PgPool) -> PgInbox {
    PgInbox::new(pool).table(TABLE).unwrap()
}

/// The MariaDB inbox of these tests on `pool`.
fn mariadb(pool: sqlx::MySqlPool) -> MySqlInbox {
    MySqlInbox::new(pool).table(TABLE).unwrap()
}

/// The message of a start the store's settings refused.
fn refusal(started: Result<(), RuntimeError>) -> String {
    let refused = started.expect_err("the start was refused");
    assert!(
        matches!(refused, RuntimeError::StoreSettings { .. }),
        "{refused:?}"
    );
    refused.to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_commits_that_are_not_flushed_are_named_at_the_start() {
    let pool = common::postgres(2).await;
    pg(pool.clone()).migrate().await.unwrap();
    // The package's settings lose nothing: even the strict check starts.
    start("dur.pg", pg(pool).durability(Durability::Require))
        .await
        .unwrap();

    let url = format!("{}?options[synchronous_commit]=off", common::postgres_url());
    let unflushed = sqlx::PgPool::connect(&url).await.unwrap();
    let refused = refusal(
        start(
            "dur.pg",
            pg(unflushed.clone()).durability(Durability::Require),
        )
        .await,
    );
    assert!(
        refused.contains("synchronous_commit is off: set synchronous_commit = on")
            && refused.contains("after idem acked their messages"),
        "{refused}"
    );
    // By default the start goes on, and says it once for the store, however many starts.
    let inbox = pg(unflushed.clone());
    start("dur.pg", inbox.clone()).await.unwrap();
    start("dur.pg", inbox).await.unwrap();
    let said = logged(&["WARN", "setting=synchronous_commit", "found=off"]);
    assert_eq!(said.len(), 1, "{said:?}");
    assert!(said[0].contains("set synchronous_commit = on"), "{said:?}");
    // Unchecked: not even looked at.
    start("dur.pg", pg(unflushed).durability(Durability::Unchecked))
        .await
        .unwrap();
    assert_eq!(
        logged(&["WARN", "setting=synchronous_commit"]).len(),
        1,
        "logged again"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_standby_streamed_to_asynchronously_is_named_and_a_synchronous_one_passes() {
    let Some(servers) = common::pg_standby::Replicated::start().await else {
        return;
    };
    let pool = sqlx::PgPool::connect(&servers.primary_url).await.unwrap();
    pg(pool.clone()).migrate().await.unwrap();
    let refused = refusal(start("dur.pg", pg(pool.clone()).durability(Durability::Require)).await);
    assert!(
        refused.contains("synchronous_standby_names is empty while a standby streams")
            && refused.contains("a failover to an asynchronous standby can lose commits"),
        "{refused}"
    );

    sqlx::query("ALTER SYSTEM SET synchronous_standby_names = '*'")
        .execute(&pool)
        .await
        .unwrap();
    sqlx::query("SELECT pg_reload_conf()")
        .execute(&pool)
        .await
        .unwrap();
    pool.close().await;
    // New connections see the reloaded setting.
    let pool = sqlx::PgPool::connect(&servers.primary_url).await.unwrap();
    common::wait_until("the setting reloaded", common::running::DEADLINE, || {
        let pool = pool.clone();
        async move {
            sqlx::query_scalar::<_, String>("SHOW synchronous_standby_names")
                .fetch_one(&pool)
                .await
                .unwrap()
                == "*"
        }
    })
    .await;
    start("dur.pg", pg(pool).durability(Durability::Require))
        .await
        .unwrap();

    // A role that may not read the replication view: the strict start is refused, saying so.
    let admin = sqlx::PgPool::connect(&servers.primary_url).await.unwrap();
    PgInbox::new(admin.clone())
        .table("idem_limited_inbox")
        .unwrap()
        .migrate()
        .await
        .unwrap();
    for statement in [
        "CREATE ROLE idem_limited LOGIN",
        "GRANT ALL ON ALL TABLES IN SCHEMA public TO idem_limited",
        "REVOKE SELECT ON pg_catalog.pg_stat_replication FROM PUBLIC",
    ] {
        sqlx::query(statement).execute(&admin).await.unwrap();
    }
    let limited_url = servers.primary_url.replace("postgres@", "idem_limited@");
    let limited = sqlx::PgPool::connect(&limited_url).await.unwrap();
    let inbox = PgInbox::new(limited).table("idem_limited_inbox").unwrap();
    let refused = refusal(start("dur.pg", inbox.durability(Durability::Require)).await);
    assert!(
        refused.contains("could not read whether the database's settings can lose commits")
            && refused.contains("permission denied"),
        "{refused}"
    );

    // Commits that do not wait for the synchronous standby.
    let local = format!("{}?options[synchronous_commit]=local", servers.primary_url);
    let local = sqlx::PgPool::connect(&local).await.unwrap();
    let refused = refusal(start("dur.pg", pg(local).durability(Durability::Require)).await);
    assert!(
        refused
            .contains("synchronous_commit is local: set synchronous_commit = on or remote_apply"),
        "{refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sqlite_without_sync_is_named_at_the_start() {
    let (pool, dir) = common::sqlite(2).await;
    SqliteInbox::new(pool.clone()).migrate().await.unwrap();
    start(
        "dur.sqlite",
        SqliteInbox::new(pool).durability(Durability::Require),
    )
    .await
    .unwrap();

    let options = sqlx::sqlite::SqliteConnectOptions::new()
        .filename(dir.path().join("idem.db"))
        .synchronous(sqlx::sqlite::SqliteSynchronous::Off);
    let unsynced = sqlx::SqlitePool::connect_with(options).await.unwrap();
    let refused = refusal(
        start(
            "dur.sqlite",
            SqliteInbox::new(unsynced).durability(Durability::Require),
        )
        .await,
    );
    assert!(
        refused.contains("synchronous is OFF: set PRAGMA synchronous = FULL"),
        "{refused}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn mariadb_as_its_package_installs_it_passes_the_strict_check() {
    // Strict: a query MariaDB refused would refuse the start too.
    let pool = common::mysql(2).await;
    mariadb(pool.clone()).migrate().await.unwrap();
    start("dur.mysql", mariadb(pool).durability(Durability::Require))
        .await
        .unwrap();
}
