//! Versioned handlers (`version = "...", entity = "..."`): a message at or below the version
//! applied to its entity is never applied. Against real databases (PostgreSQL, MariaDB, SQLite):
//! out-of-order and late messages one by one, sixteen versions of one entity at once on
//! separate connections, versions inside one batch, stale messages dead-lettered on request;
//! and through the runtime on RabbitMQ and PostgreSQL.
//!
//! The handler keeps its own `idem_test_status(entity, version)` and refuses (permanently) a
//! version at or below the one it finds there, so any stale message that reached it would show
//! as a rejection and a wrong final version.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use std::path::Path;

/// The test's statements, in each dialect's placeholders.
struct Sql {
    current: &'static str,
    upsert: &'static str,
    applied: &'static str,
}

const PORTABLE_SQL: Sql = Sql {
    current: "SELECT version FROM idem_test_status WHERE entity = $1",
    upsert: "INSERT INTO idem_test_status (entity, version, applied) VALUES ($1, $2, 1)
        ON CONFLICT (entity) DO UPDATE SET version = excluded.version,
            applied = idem_test_status.applied + 1",
    applied: "SELECT applied FROM idem_test_status WHERE entity = $1",
};

const MYSQL_SQL: Sql = Sql {
    current: "SELECT version FROM idem_test_status WHERE entity = ?",
    upsert: "INSERT INTO idem_test_status (entity, version, applied) VALUES (?, ?, 1)
        ON DUPLICATE KEY UPDATE version = VALUES(version), applied = applied + 1",
    applied: "SELECT applied FROM idem_test_status WHERE entity = ?",
};

const STATUS_TABLE: &str = "CREATE TABLE IF NOT EXISTS idem_test_status (
    entity VARCHAR(191) PRIMARY KEY, version BIGINT NOT NULL, applied BIGINT NOT NULL)";

async fn pg_setup(connections: u32, _: Option<&Path>) -> (sqlx::PgPool, Option<tempfile::TempDir>) {
    let pool = common::postgres(connections).await;
    let mut tx = pool.begin().await.unwrap();
    sqlx::query("SELECT pg_advisory_xact_lock(hashtext('idem.tests'))::text")
        .execute(&mut *tx)
        .await
        .unwrap();
    sqlx::query(STATUS_TABLE).execute(&mut *tx).await.unwrap();
    tx.commit().await.unwrap();
    (pool, None)
}

async fn mysql_setup(
    connections: u32,
    _: Option<&Path>,
) -> (sqlx::MySqlPool, Option<tempfile::TempDir>) {
    let pool = common::mysql(connections).await;
    sqlx::query(STATUS_TABLE).execute(&pool).await.unwrap();
    (pool, None)
}

async fn sqlite_setup(
    connections: u32,
    _: Option<&Path>,
) -> (sqlx::SqlitePool, Option<tempfile::TempDir>) {
    let (pool, dir) = common::sqlite(connections).await;
    sqlx::query(STATUS_TABLE).execute(&pool).await.unwrap();
    (pool, Some(dir))
}

macro_rules! versions_suite {
    ($module:ident, $store:ident, $db:ty, $inbox:ty, $setup:ident, $sql:ident) => {
        mod $module {
            use super::common::unique;
            use idem::store::Stores;
            use idem::{Envelope, HandlerError, Outcome, RejectReason, idempotent};
            use serde::Deserialize;
            use std::time::{Duration, Instant};

            type Pool = sqlx::Pool<$db>;
            type Tx<'a> = sqlx::Transaction<'a, $db>;

            #[derive(Debug, Deserialize)]
            struct Update {
                order_id: String,
                version: Option<u32>,
            }

            /// Applies an update, refusing one at or below the version its own table holds.
            #[idempotent(store = $store, version = "update.version", entity = "update.order_id")]
            async fn track(tx: &mut Tx<'_>, update: Update) -> Result<(), HandlerError> {
                let version = i64::from(update.version.unwrap_or_default());
                let current: Option<i64> = sqlx::query_scalar(super::$sql.current)
                    .bind(&update.order_id)
                    .fetch_optional(&mut **tx)
                    .await?;
                if current.is_some_and(|c| c >= version) {
                    return Err(HandlerError::permanent(format!(
                        "version {version} reached the handler after {current:?}"
                    )));
                }
                sqlx::query(super::$sql.upsert)
                    .bind(&update.order_id)
                    .bind(version)
                    .execute(&mut **tx)
                    .await?;
                Ok(())
            }

            async fn stores(connections: u32) -> (Stores, Pool, Option<tempfile::TempDir>) {
                let (pool, dir) = super::$setup(connections, None).await;
                let inbox = <$inbox>::new(pool.clone());
                inbox.migrate().await.unwrap();
                (Stores::new().with(inbox), pool, dir)
            }

            fn update(entity: &str, version: u32, message_id: &str) -> Envelope {
                let body = serde_json::json!({"order_id": entity, "version": version});
                Envelope::new(body.to_string()).with_message_id(message_id)
            }

            async fn run(stores: &Stores, envelope: &Envelope) -> Outcome {
                let registration = idem::registry::find(concat!(module_path!(), "::track")).unwrap();
                registration.invoke(stores, envelope).await.unwrap()
            }

            /// Runs a message until it settles (transient failures, such as a deadlock between
            /// first versions on MariaDB, are retried as the broker would).
            async fn settle(stores: &Stores, envelope: &Envelope) -> Outcome {
                let deadline = Instant::now() + Duration::from_secs(30);
                loop {
                    let outcome = run(stores, envelope).await;
                    if !matches!(outcome, Outcome::Retry(_)) {
                        return outcome;
                    }
                    assert!(Instant::now() < deadline, "never settled: {outcome:?}");
                }
            }

            async fn status(pool: &Pool, entity: &str) -> (Option<i64>, Option<i64>) {
                let version = sqlx::query_scalar(super::$sql.current).bind(entity).fetch_optional(pool).await.unwrap();
                let applied = sqlx::query_scalar(super::$sql.applied).bind(entity).fetch_optional(pool).await.unwrap();
                (version, applied)
            }

            #[tokio::test]
            async fn out_of_order_and_late_messages_are_stale_and_never_applied() {
                let (stores, pool, _dir) = stores(2).await;
                let entity = unique("order");
                let id = |v: u32| format!("{entity}:{v}");
                let mut labels = Vec::new();
                for (version, message) in [(2, id(2)), (1, id(1)), (4, id(4)), (3, id(3)), (4, id(4)), (2, id(2)), (5, id(5)), (3, format!("{entity}:3:again"))] {
                    labels.push(settle(&stores, &update(&entity, version, &message)).await);
                }
                let names: Vec<_> = labels.iter().map(Outcome::label).collect();
                assert_eq!(
                    names,
                    ["processed", "stale", "processed", "stale", "duplicate", "duplicate", "processed", "stale"]
                );
                let Outcome::Stale(stale) = &labels[3] else { unreachable!() };
                assert_eq!((stale.version, stale.applied, stale.entity.as_str()), (3, 4, entity.as_str()));
                assert_eq!(stale.key, id(3));
                assert_eq!(status(&pool, &entity).await, (Some(5), Some(3)), "versions 2, 4, 5 applied once each");
                // A stale message leaves no marker: delivered again, it is judged again.
                assert_eq!(settle(&stores, &update(&entity, 1, &id(1))).await.label(), "stale");

                // Another entity's versions are its own.
                let other = unique("order");
                assert_eq!(settle(&stores, &update(&other, 1, &format!("{other}:1"))).await.label(), "processed");

                // A message without its version is dead-lettered with reason `version`.
                let body = serde_json::json!({"order_id": entity, "version": null});
                let missing = settle(&stores, &Envelope::new(body.to_string()).with_message_id(unique("m"))).await;
                assert!(
                    matches!(&missing, Outcome::Rejected(r) if r.reason == RejectReason::Version && r.message.contains("version field `update.version` is absent")),
                    "{missing:?}"
                );
            }

            #[tokio::test]
            async fn stale_messages_can_be_dead_lettered_instead() {
                let (stores, _pool, _dir) = stores(1).await;
                let stores = stores.with_dead_letter_stale(true);
                let entity = unique("order");
                assert_eq!(settle(&stores, &update(&entity, 7, &format!("{entity}:7"))).await.label(), "processed");
                let stale = settle(&stores, &update(&entity, 6, &format!("{entity}:6"))).await;
                assert!(
                    matches!(&stale, Outcome::Rejected(r) if r.reason == RejectReason::Stale && r.message.contains("version 6") && r.message.contains("applied version 7")),
                    "{stale:?}"
                );
            }

            /// Sixteen versions of one entity at once, each on its own connection: the
            /// entity's row serializes them, and none applies after a higher one.
            #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
            async fn concurrent_versions_of_one_entity_never_apply_out_of_order() {
                let (stores, pool, _dir) = stores(8).await;
                let entity = unique("order");
                let mut versions: Vec<u32> = (1..=16).collect();
                versions.reverse();
                versions.swap(3, 12);
                let runs = versions.iter().map(|&v| {
                    let (stores, envelope) = (stores.clone(), update(&entity, v, &format!("{entity}:{v}")));
                    tokio::spawn(async move { settle(&stores, &envelope).await })
                });
                let outcomes: Vec<Outcome> = futures_util::future::join_all(runs)
                    .await
                    .into_iter()
                    .map(Result::unwrap)
                    .collect();
                let count = |label: &str| outcomes.iter().filter(|o| o.label() == label).count();
                assert_eq!(count("processed") + count("stale"), 16, "{outcomes:?}");
                let (version, applied) = status(&pool, &entity).await;
                assert_eq!(version, Some(16), "the highest version is the last applied");
                assert_eq!(applied, Some(count("processed") as i64));
            }

            /// Inside one batch: versions in delivery order, a copy of a message, a stale one
            /// after a higher version in the same transaction.
            #[tokio::test]
            async fn versions_inside_one_batch() {
                let (stores, pool, _dir) = stores(2).await;
                let entity = unique("order");
                let batch = vec![
                    update(&entity, 3, &format!("{entity}:3")),
                    update(&entity, 1, &format!("{entity}:1")),
                    update(&entity, 3, &format!("{entity}:3")),
                    update(&entity, 1, &format!("{entity}:1")),
                    update(&entity, 4, &format!("{entity}:4")),
                    update(&entity, 2, &format!("{entity}:2")),
                ];
                let registration = idem::registry::find(concat!(module_path!(), "::track")).unwrap();
                let outcomes = registration.invoke_batch(&stores, &batch).await.unwrap();
                let labels: Vec<_> = outcomes.iter().map(Outcome::label).collect();
                assert_eq!(labels, ["processed", "stale", "duplicate", "stale", "processed", "stale"]);
                assert_eq!(status(&pool, &entity).await, (Some(4), Some(2)));
                // The stale ones left no marker; the processed ones did.
                let again = registration.invoke_batch(&stores, &batch).await.unwrap();
                let labels: Vec<_> = again.iter().map(Outcome::label).collect();
                assert_eq!(labels, ["duplicate", "stale", "duplicate", "stale", "duplicate", "stale"]);
            }
        }
    };
}

versions_suite!(
    postgres,
    Postgres,
    sqlx::Postgres,
    idem::sql::PgInbox,
    pg_setup,
    PORTABLE_SQL
);
versions_suite!(
    mysql,
    MySql,
    sqlx::MySql,
    idem::sql::MySqlInbox,
    mysql_setup,
    MYSQL_SQL
);
versions_suite!(
    sqlite,
    Sqlite,
    sqlx::Sqlite,
    idem::sql::SqliteInbox,
    sqlite_setup,
    PORTABLE_SQL
);

/// Through the runtime on RabbitMQ and PostgreSQL: updates of 20 orders published in order,
/// consumed by 8 workers at once (some overtake others and are stale); then late copies with
/// new message ids (all stale) and exact copies (duplicates). Every order ends at its highest
/// version, and the stale count of the second round is exactly its stale messages.
mod runtime {
    use super::common::broker::{self, amqp_url};
    use super::common::running::{DEADLINE, start};
    use super::common::{unique, wait_until};
    use idem::rabbitmq::{RabbitConfig, RabbitTransport};
    use idem::sql::PgInbox;
    use idem::transport::{QueueSpec, Transport};
    use idem::{HandlerError, RetryPolicy, Runtime, idempotent};
    use std::time::Duration;

    #[derive(serde::Deserialize)]
    struct StatusUpdate {
        order_id: String,
        status: String,
        version: i64,
    }

    #[idempotent(store = Postgres, consumer = "versions.status", queue = "versions-status", version = "update.version", entity = "update.order_id")]
    async fn apply_status(
        tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
        update: StatusUpdate,
    ) -> Result<(), HandlerError> {
        let current: Option<i64> =
            sqlx::query_scalar("SELECT version FROM idem_test_status WHERE entity = $1")
                .bind(&update.order_id)
                .fetch_optional(&mut **tx)
                .await?;
        if current.is_some_and(|c| c >= update.version) {
            return Err(HandlerError::permanent(
                "a stale update reached the handler",
            ));
        }
        sqlx::query(super::PORTABLE_SQL.upsert)
            .bind(&update.order_id)
            .bind(update.version)
            .execute(&mut **tx)
            .await?;
        let _ = update.status;
        Ok(())
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn late_and_overtaken_updates_are_stale_through_the_runtime() {
        let (pool, _) = super::pg_setup(8, None).await;
        PgInbox::new(pool.clone()).migrate().await.unwrap();
        let queue = unique("idem-test-versions");
        // Retries from 100 ms (the default waits 1 s, then 4 s): a retried update comes back
        // while the test waits, not minutes later.
        let policy =
            RetryPolicy::new(5, Duration::from_millis(100), 2, Duration::from_secs(1)).unwrap();
        let rabbit = RabbitConfig::new(amqp_url()).connection_name(format!("idem-test:{queue}"));
        let mut spec = QueueSpec::new(queue.clone(), "versions.status");
        spec.retry_delays = policy.delays();
        RabbitTransport::new(rabbit.clone())
            .declare(&[spec])
            .await
            .unwrap();
        let running = start(
            Runtime::builder()
                .transport(RabbitTransport::new(rabbit))
                .store(PgInbox::new(pool.clone()))
                .handlers(["versions.status"])
                .handler_queue("versions.status", &queue)
                .retry(policy.clone())
                // Eight workers: versions of one entity run at once, so that the late and
                // overtaken ones really race the newer ones.
                .concurrency(8),
        );
        let publisher = broker::publisher().await;
        let orders: Vec<String> = (0..20).map(|_| unique("o")).collect();
        let publish = |order: &str, version: i64, id: String| {
            let body = serde_json::json!({"order_id": order, "status": format!("s{version}"), "version": version});
            (id, body.to_string())
        };
        let mut first = Vec::new();
        for version in 1..=5 {
            for order in &orders {
                first.push(publish(order, version, format!("{order}:{version}")));
            }
        }
        for (id, body) in &first {
            broker::publish(&publisher, &queue, Some(id), body.as_bytes()).await;
        }
        wait_until("the first round settled", DEADLINE, || async {
            running.now().settled() >= 100
        })
        .await;
        let round_one = running.now();
        assert_eq!(round_one.processed + round_one.stale, 100, "{round_one:?}");
        assert_eq!(round_one.dead_lettered, 0, "{round_one:?}");

        // Late copies under new ids (stale) and exact copies (duplicates).
        for order in &orders {
            for version in [1, 3, 5] {
                let (_, body) = publish(order, version, String::new());
                broker::publish(
                    &publisher,
                    &queue,
                    Some(&format!("{order}:{version}:late")),
                    body.as_bytes(),
                )
                .await;
            }
            let (id, body) = publish(order, 4, format!("{order}:4"));
            broker::publish(&publisher, &queue, Some(&id), body.as_bytes()).await;
        }
        wait_until("the second round settled", DEADLINE, || async {
            running.now().settled() >= 180
        })
        .await;
        let seen = running.shut_down().await;
        assert_eq!(seen.stale - round_one.stale, 60, "{seen:?}");
        assert_eq!(seen.duplicates - round_one.duplicates, 20, "{seen:?}");
        assert_eq!(
            seen.processed, round_one.processed,
            "nothing late was applied: {seen:?}"
        );
        assert_eq!(seen.dead_lettered, 0, "{seen:?}");
        for order in &orders {
            let version: i64 =
                sqlx::query_scalar("SELECT version FROM idem_test_status WHERE entity = $1")
                    .bind(order)
                    .fetch_one(&pool)
                    .await
                    .unwrap();
            assert_eq!(version, 5, "{order}");
        }
        broker::delete_topology(&queue, &policy.delays()).await;
    }
}
