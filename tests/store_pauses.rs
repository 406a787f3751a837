//! A database that cannot write for a while (a failover lands the connections on a read-only
//! replica) pauses the queue, not the messages: with the default settings, through `build()`,
//! on a real RabbitMQ and PostgreSQL, nothing is dead-lettered or retried, readiness is false
//! while the store cannot write, and once it writes again every order takes effect once.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;
#[path = "common/runtime_fixture.rs"]
mod runtime_fixture;

use common::broker;
use common::running::{DEADLINE, finish};
use common::{postgres, postgres_url, unique, wait_until};
use idem::RetryPolicy;
use idem::rabbitmq::QueueType;
use runtime_fixture::*;
use std::time::Duration;

/// A database of the test's own, which the test turns read-only and writable again as a
/// failover does: the setting changes for new sessions, and the sessions open are ended so
/// that the pool reconnects.
struct OwnDatabase {
    name: String,
}

impl OwnDatabase {
    async fn create(prefix: &str) -> (Self, sqlx::PgPool) {
        let name = unique(prefix).replace('-', "_");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {name}")))
            .execute(&postgres(1).await)
            .await
            .unwrap();
        let url = match postgres_url().rsplit_once('/') {
            Some((base, _)) => format!("{base}/{name}"),
            None => panic!("DATABASE_URL names no database"),
        };
        let pool = sqlx::postgres::PgPoolOptions::new()
            .max_connections(10)
            .connect(&url)
            .await
            .unwrap();
        (Self { name }, pool)
    }

    /// New sessions start read-only (`read_only`) or writable, and the open ones are ended.
    async fn set_read_only(&self, read_only: bool) {
        let admin = postgres(1).await;
        let name = &self.name;
        let setting = match read_only {
            true => format!("ALTER DATABASE {name} SET default_transaction_read_only = on"),
            false => format!("ALTER DATABASE {name} RESET default_transaction_read_only"),
        };
        sqlx::query(sqlx::AssertSqlSafe(setting))
            .execute(&admin)
            .await
            .unwrap();
        sqlx::query("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1")
            .bind(name)
            .execute(&admin)
            .await
            .unwrap();
    }

    async fn drop(self, pool: sqlx::PgPool) {
        pool.close().await;
        let admin = postgres(1).await;
        let name = &self.name;
        sqlx::query(sqlx::AssertSqlSafe(format!(
            "DROP DATABASE IF EXISTS {name} WITH (FORCE)"
        )))
        .execute(&admin)
        .await
        .unwrap();
    }
}

/// How the runtime runs its orders.
#[derive(Clone, Copy, Debug)]
enum Run {
    PerMessage,
    Batches,
    BatchHandler,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_database_pauses_the_queue_and_loses_nothing() {
    read_only_for_a_while(Run::PerMessage).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_database_pauses_batches_and_loses_nothing() {
    read_only_for_a_while(Run::Batches).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_only_database_pauses_a_batch_handler_and_loses_nothing() {
    read_only_for_a_while(Run::BatchHandler).await;
}

/// 200 orders published around a failover: 100 before, 100 while the database is read-only for
/// 8 s (the default retry policy would dead-letter nothing that fast, but a read-only error
/// that counts as permanent dead-letters at once, as it did).
async fn read_only_for_a_while(mode: Run) {
    const ORDERS: usize = 200;
    let (database, pool) = OwnDatabase::create("idem_ro").await;
    let name = format!("read-only-{mode:?}").to_lowercase();
    let f = fixture_on(
        &name,
        RetryPolicy::default(),
        QueueType::Classic,
        None,
        pool.clone(),
    )
    .await;
    let builder = match mode {
        Run::PerMessage => f.runtime_with_defaults(),
        Run::Batches => f.runtime_with_defaults().batch(50),
        Run::BatchHandler => f.batch_handler_runtime_with_defaults().batch(50),
    };
    let runtime = builder.build().unwrap();
    let (stats, health) = (runtime.stats(), runtime.health());
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let task = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));
    for n in 0..ORDERS / 2 {
        f.publish_order(n, 3).await;
    }
    wait_until("the first orders applied", DEADLINE, || async {
        stats.snapshot().processed >= 20
    })
    .await;
    database.set_read_only(true).await;
    for n in ORDERS / 2..ORDERS {
        f.publish_order(n, 3).await;
    }
    wait_until("the store paused", DEADLINE, || async {
        stats.snapshot().pauses >= 1
    })
    .await;
    let readiness = health.readiness().await;
    assert!(!readiness.ready, "ready while the store cannot write");
    assert!(
        readiness
            .problems
            .iter()
            .any(|p| p.contains("cannot write") && p.contains("paused")),
        "{:?}",
        readiness.problems
    );
    let during = stats.snapshot();
    tokio::time::sleep(Duration::from_secs(8)).await;
    let still = stats.snapshot();
    assert_eq!(
        still.processed, during.processed,
        "nothing commits while the database is read-only"
    );
    database.set_read_only(false).await;
    wait_until("every order applied", DEADLINE, || async {
        f.effects().await.len() == ORDERS
    })
    .await;
    wait_until("ready again", DEADLINE, || async {
        health.readiness().await.ready
    })
    .await;
    let _ = stop.send(());
    finish(task).await;
    let seen = stats.snapshot();
    assert_eq!(
        (seen.dead_lettered, seen.retried, seen.rejected),
        (0, 0, 0),
        "nothing dead-lettered or retried for the store's state: {seen:?}"
    );
    assert!(seen.unavailable >= 1, "{seen:?}");
    assert_eq!(
        seen.processed + seen.duplicates,
        ORDERS as u64,
        "every delivery settled once: {seen:?}"
    );
    f.assert_exactly_once(ORDERS, |_| 3).await;
    let dlq = idem::rabbitmq::dlq(&f.queue);
    assert!(broker::exists(&dlq).await, "{dlq} was declared");
    assert_eq!(broker::count(&dlq).await, 0, "nothing in {dlq}");
    assert_eq!(
        broker::count(&f.queue).await,
        0,
        "nothing left in {}",
        f.queue
    );
    assert!(f.dead_letters().await.is_empty());
    f.cleanup().await;
    database.drop(pool).await;
}

/// Every dialect says "cannot write for now" when its database is read-only, through the store's
/// own write probe (the one that resumes a paused store): PostgreSQL's read-only sessions
/// (25006, as on a hot standby), MariaDB's read-only transactions (1792) and its server-wide
/// `read_only` for a user without the privilege to pass it (1290), SQLite's `query_only`
/// (`SQLITE_READONLY`). On a writable database the probe commits and leaves no row.
#[tokio::test]
async fn each_dialect_calls_a_read_only_database_unavailable() {
    use idem::ErrorClass;
    use idem::sql::{MySqlInbox, PgInbox, SqliteInbox};
    use idem::store::{InboxStore, StoreError};
    use sqlx::Executor;

    fn read_only(probed: Result<(), StoreError>, what: &str) {
        let error = probed.expect_err(what);
        assert_eq!(error.class(), ErrorClass::Unavailable, "{what}: {error}");
    }

    let pg = postgres(2).await;
    let store = PgInbox::new(pg.clone());
    store.migrate().await.unwrap();
    store.probe().await.unwrap();
    let rows: i64 = sqlx::query_scalar("SELECT count(*) FROM idem_inbox WHERE consumer = $1")
        .bind(idem::store::PROBE_CONSUMER)
        .fetch_one(&pg)
        .await
        .unwrap();
    assert_eq!(rows, 0, "the probe leaves nothing behind");
    let read_only_pg = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET default_transaction_read_only = on")
                    .await?;
                Ok(())
            })
        })
        .connect(&postgres_url())
        .await
        .unwrap();
    read_only(PgInbox::new(read_only_pg).probe().await, "PostgreSQL");

    let maria = common::mysql(2).await;
    let store = MySqlInbox::new(maria.clone());
    store.migrate().await.unwrap();
    store.probe().await.unwrap();
    let read_only_maria = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(1)
        .after_connect(|conn, _| {
            Box::pin(async move {
                conn.execute("SET SESSION TRANSACTION READ ONLY").await?;
                Ok(())
            })
        })
        .connect(&common::mysql_url())
        .await
        .unwrap();
    read_only(
        MySqlInbox::new(read_only_maria).probe().await,
        "MariaDB, a read-only transaction",
    );

    let (sqlite, _dir) = common::sqlite(1).await;
    let store = SqliteInbox::new(sqlite.clone());
    store.migrate().await.unwrap();
    store.probe().await.unwrap();
    sqlx::query("PRAGMA query_only = ON")
        .execute(&sqlite)
        .await
        .unwrap();
    read_only(store.probe().await, "SQLite, query_only");
}
