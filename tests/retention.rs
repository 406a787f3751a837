//! The retention sweeper against real databases: expired rows go whatever their status, live
//! rows stay, deletes run in bounded batches, one sweeper works at a time across pools
//! (processes' worth of sessions), and a million expired rows are swept while claims go on.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::{unique, wait_until};
use idem::store::{
    ClaimRequest, DeadLetterStore, Fingerprint, InboxStore, LeaseEnd, LeaseStore, StoredOutput,
    SweepStore,
};
use idem::{HandlerError, idempotent};
use std::time::{Duration, Instant};

const SHORT: Duration = Duration::from_secs(1);
const LONG: Duration = Duration::from_secs(86_400);

/// A handler whose only write is its inbox row: the claims of the million-row test.
#[idempotent(store = Postgres, consumer = "sweep.claims")]
async fn claim_only(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    _m: serde_json::Value,
) -> Result<(), HandlerError> {
    Ok(())
}

/// Writes one row of each status for `prefix`, kept for `retention`: `completed` (a
/// committed claim), `failed` (a settled lease) and `in_progress` (a lease never settled).
async fn rows_of_every_status<S: InboxStore + LeaseStore>(
    store: &S,
    prefix: &str,
    retention: Duration,
) -> Vec<String> {
    let fingerprint = Fingerprint::of(prefix.as_bytes());
    let keys: Vec<String> = ["completed", "failed", "in-progress"]
        .iter()
        .map(|s| format!("{prefix}-{s}"))
        .collect();
    let request = |key| request(key, &fingerprint, retention);
    let mut tx = store.begin().await.unwrap();
    assert_eq!(
        store.claim(&mut tx, &request(&keys[0])).await.unwrap(),
        idem::store::Claim::Claimed
    );
    store.commit(tx).await.unwrap();
    store
        .lease(&request(&keys[1]), "owner", Duration::from_secs(60))
        .await
        .unwrap();
    let failure = StoredOutput::encode("declined").unwrap();
    assert!(
        store
            .settle(&request(&keys[1]), "owner", LeaseEnd::Failed, &failure)
            .await
            .unwrap()
    );
    store
        .lease(&request(&keys[2]), "owner", Duration::from_secs(60))
        .await
        .unwrap();
    keys
}

fn request<'a>(
    key: &'a str,
    fingerprint: &'a Fingerprint,
    retention: Duration,
) -> ClaimRequest<'a> {
    ClaimRequest {
        consumer: "sweep.test",
        key,
        fingerprint,
        attempt: 1,
        retention,
    }
}

macro_rules! sweep_suite {
    ($module:ident, $db:ty, $inbox:ty, $pool:expr, $count:expr) => {
        mod $module {
            use super::*;

            async fn inbox(table: &str) -> ($inbox, sqlx::Pool<$db>) {
                let pool = $pool;
                let inbox = <$inbox>::new(pool.clone()).table(table).unwrap();
                inbox.migrate().await.unwrap();
                (inbox, pool)
            }

            async fn present(pool: &sqlx::Pool<$db>, table: &str, key: &str) -> bool {
                let sql = format!($count, table = table);
                let n: i64 = sqlx::query_scalar(sqlx::AssertSqlSafe(sql))
                    .bind(key)
                    .fetch_one(pool)
                    .await
                    .unwrap();
                n == 1
            }

            /// The poison limit's delivery counts expire with the inbox rows and go with them.
            #[tokio::test]
            async fn expired_delivery_counts_go_and_live_ones_stay() {
                let table = concat!("idem_sweep_counts_", stringify!($module));
                let (inbox, _pool) = inbox(table).await;
                let fingerprint = Fingerprint::of(b"counted");
                let (old, live) = (unique("old"), unique("live"));
                let count = |key, retention| {
                    let request = request(key, &fingerprint, retention);
                    let inbox = &inbox;
                    async move { inbox.count_delivery(&request).await.unwrap() }
                };
                assert_eq!(count(&old, SHORT).await, 1);
                assert_eq!(count(&old, SHORT).await, 2);
                assert_eq!(count(&live, LONG).await, 1);
                let counted = Instant::now();
                let swept = std::sync::atomic::AtomicU64::new(0);
                // A sweep once the short count has expired removes it.
                wait_until(
                    "the short count to expire and be swept",
                    Duration::from_secs(10),
                    || async {
                        if counted.elapsed() <= SHORT + Duration::from_millis(100) {
                            return false;
                        }
                        let report = inbox.sweep(1_000, 10).await.unwrap();
                        let total = swept
                            .fetch_add(report.counts_deleted, std::sync::atomic::Ordering::Relaxed);
                        total + report.counts_deleted >= 1
                    },
                )
                .await;
                assert_eq!(count(&old, SHORT).await, 1, "the expired count was swept");
                assert_eq!(count(&live, LONG).await, 2, "the live count stayed");
            }

            #[tokio::test]
            async fn a_paced_sweep_pauses_in_proportion_to_its_work_unless_behind() {
                let table = concat!("idem_sweep_paced_", stringify!($module));
                let (inbox, _pool) = inbox(table).await;
                while inbox.sweep(10_000, 1_000).await.unwrap().deleted > 0 {}
                for round in 0..3 {
                    let prefix = unique(&format!("paced-{round}"));
                    rows_of_every_status(&inbox, &prefix, SHORT).await;
                    wait_until(
                        "the short rows to expire",
                        Duration::from_secs(10),
                        || async { inbox.sweep(1, 0).await.unwrap().lag >= SHORT },
                    )
                    .await;
                    if round == 0 {
                        // After each batch of one row, a pause four times as long as the
                        // batch. Three batches are not followed by one: the batch that takes
                        // the last expired row (no expired row is left to pace for), the one
                        // that finds none, and the delivery counts' batch, which finds none.
                        let pace = idem::store::Pace::new(4, Duration::from_secs(3600));
                        let report = inbox.sweep_paced(1, 100, pace).await.unwrap();
                        assert_eq!(report.deleted, 3, "{report:?}");
                        assert!(report.paused > Duration::ZERO, "{report:?}");
                        let unpaused = report.longest_batch * 3;
                        assert!(
                            report.paused >= report.busy.saturating_sub(unpaused) * 4
                                && report.paused <= report.busy * 4,
                            "{report:?}"
                        );
                    } else if round == 1 {
                        // Called directly (`idem inbox sweep`, a scheduled job): no pause.
                        let report = inbox.sweep(1, 100).await.unwrap();
                        assert_eq!((report.deleted, report.paused), (3, Duration::ZERO));
                        assert!(report.busy > Duration::ZERO, "{report:?}");
                    } else {
                        // Behind (the rows left expired longer ago than it allows): no pause
                        // either, until it has caught up.
                        let pace = idem::store::Pace::new(4, Duration::ZERO);
                        let report = inbox.sweep_paced(1, 100, pace).await.unwrap();
                        assert_eq!((report.deleted, report.paused), (3, Duration::ZERO));
                    }
                }
            }

            #[tokio::test]
            async fn expired_rows_go_in_bounded_batches_and_live_rows_stay() {
                let table = concat!("idem_sweep_", stringify!($module));
                let (inbox, pool) = inbox(table).await;
                // Whatever earlier runs left behind.
                while inbox.sweep(10_000, 1_000).await.unwrap().deleted > 0 {}
                let live = rows_of_every_status(&inbox, &unique("live"), LONG).await;
                let expired = rows_of_every_status(&inbox, &unique("old"), SHORT).await;
                // All three expired: the oldest a second ago, the others (written milliseconds
                // after it) since.
                wait_until(
                    "the short rows to expire",
                    Duration::from_secs(10),
                    || async { inbox.sweep(1, 0).await.unwrap().lag >= SHORT },
                )
                .await;

                // One batch of two: the oldest two go, the sweeper is behind by the third.
                let first = inbox.sweep(2, 1).await.unwrap();
                assert!(first.locked);
                assert_eq!((first.deleted, first.batches), (2, 1));
                assert!(first.lag > Duration::ZERO, "{first:?}");
                // What the operator's gauges show: the expired row left, the rows held (the
                // live ones at least; estimated on PostgreSQL and MySQL), the oldest's age.
                assert_eq!(first.expired, 1, "{first:?}");
                assert!(
                    first.rows >= 1 && first.oldest > Duration::ZERO,
                    "{first:?}"
                );
                let rest = inbox.sweep(2, 100).await.unwrap();
                assert_eq!(
                    (rest.deleted, rest.batches, rest.lag, rest.expired),
                    (1, 1, Duration::ZERO, 0),
                    "{rest:?}"
                );
                for key in &expired {
                    assert!(
                        !present(&pool, table, key).await,
                        "{key} outlived its retention"
                    );
                }
                for key in &live {
                    assert!(present(&pool, table, key).await, "{key} was swept early");
                }
            }
        }
    };
}

sweep_suite!(
    postgres,
    sqlx::Postgres,
    idem::sql::PgInbox,
    common::postgres(2).await,
    "SELECT count(*) FROM {table} WHERE consumer = 'sweep.test' AND key = $1"
);
sweep_suite!(
    mysql,
    sqlx::MySql,
    idem::sql::MySqlInbox,
    common::mysql(2).await,
    "SELECT count(*) FROM {table} WHERE consumer = 'sweep.test' AND `key` = ?"
);
sweep_suite!(
    sqlite,
    sqlx::Sqlite,
    idem::sql::SqliteInbox,
    common::sqlite_at(
        std::path::Path::new(concat!(env!("CARGO_TARGET_TMPDIR"), "/idem-sweep.db")),
        2
    )
    .await,
    "SELECT count(*) FROM {table} WHERE consumer = 'sweep.test' AND key = ?1"
);

/// Fills `table` with `rows` expired rows (PostgreSQL), after emptying it.
async fn pg_fill_expired(pool: &sqlx::PgPool, table: &str, rows: i64) {
    sqlx::query(sqlx::AssertSqlSafe(format!("TRUNCATE {table}")))
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at)
         SELECT 'sweep.fill', 'k' || g, decode(repeat('00', 32), 'hex'), 'completed', 1,
                now() - interval '8 days', now() - interval '8 days', now() - interval '1 day' + g * interval '1 millisecond'
         FROM generate_series(1, $1) AS g"
    )))
    .bind(rows)
    .execute(pool)
    .await
    .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!("ANALYZE {table}")))
        .execute(pool)
        .await
        .unwrap();
}

/// Fills `table` with `rows` expired rows (MariaDB's sequence engine), after emptying it.
async fn mysql_fill_expired(pool: &sqlx::MySqlPool, table: &str, rows: i64) {
    sqlx::query(sqlx::AssertSqlSafe(format!("TRUNCATE {table}")))
        .execute(pool)
        .await
        .unwrap();
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "INSERT INTO {table} (consumer, `key`, fingerprint, status, attempts, created_at, completed_at, expires_at)
         SELECT 'sweep.fill', CONCAT('k', seq), UNHEX(REPEAT('00', 32)), 'completed', 1,
                UTC_TIMESTAMP(6) - INTERVAL 8 DAY, UTC_TIMESTAMP(6) - INTERVAL 8 DAY,
                UTC_TIMESTAMP(6) - INTERVAL 1 DAY + INTERVAL seq MICROSECOND
         FROM seq_1_to_{rows}"
    )))
    .execute(pool)
    .await
    .unwrap();
}

macro_rules! exclusive_suite {
    ($module:ident, $db:ty, $inbox:ty, $pool:expr, $fill:ident) => {
        mod $module {
            use super::*;

            async fn count(pool: &sqlx::Pool<$db>, table: &str) -> i64 {
                sqlx::query_scalar::<_, i64>(sqlx::AssertSqlSafe(format!(
                    "SELECT count(*) FROM {table}"
                )))
                .fetch_one(pool)
                .await
                .unwrap()
            }

            /// Fills `table` with `rows` expired rows and starts sweeper A on it, `batch` rows
            /// at a time; returns once A deleted its first rows, with sweeper B on a pool of its
            /// own (as another process would be) and A's pool.
            async fn a_sweeping(
                table: &'static str,
                rows: i64,
                batch: u32,
            ) -> (
                tokio::task::JoinHandle<idem::store::SweepReport>,
                $inbox,
                sqlx::Pool<$db>,
            ) {
                let (pool_a, pool_b) = ($pool, $pool);
                let a = <$inbox>::new(pool_a.clone()).table(table).unwrap();
                let b = <$inbox>::new(pool_b).table(table).unwrap();
                a.migrate().await.unwrap();
                super::$fill(&pool_a, table, rows).await;
                let sweeping = tokio::spawn(async move { a.sweep(batch, u32::MAX).await.unwrap() });
                wait_until(
                    "sweeper A to start deleting",
                    Duration::from_secs(30),
                    || async { count(&pool_a, table).await < rows },
                )
                .await;
                (sweeping, b, pool_a)
            }

            /// Sweeper A works through 100 000 rows 100 at a time; sweeper B tries while A
            /// works and must do nothing.
            #[tokio::test]
            async fn two_sweepers_never_both_work() {
                const ROWS: i64 = 100_000;
                let table = concat!("idem_sweep_pair_", stringify!($module));
                let (sweeping, b, pool_a) = a_sweeping(table, ROWS, 100).await;
                let mut refused = 0;
                while !sweeping.is_finished() {
                    let tried = b.sweep(100, u32::MAX).await.unwrap();
                    if sweeping.is_finished() {
                        break; // B may have started after A released the lock
                    }
                    if tried.locked {
                        // A releases its lock before its task is seen finished: B may take
                        // it in between, and then finds nothing left to delete. Had A still
                        // held it, rows would be left and B would have deleted some.
                        assert_eq!(
                            tried.deleted, 0,
                            "B worked while A held the lock: {tried:?}"
                        );
                        break;
                    }
                    assert_eq!(tried.deleted, 0, "B deleted without the lock: {tried:?}");
                    refused += 1;
                }
                let done = sweeping.await.unwrap();
                assert!(done.locked);
                assert!(refused > 0, "B never tried while A worked");
                // B's refused tries deleted nothing; A deleted the rest and B the remainder, if any.
                let after = b.sweep(100, u32::MAX).await.unwrap();
                assert!(after.locked, "the lock outlived A's sweep");
                assert_eq!(done.deleted + after.deleted, ROWS as u64);
                assert_eq!(count(&pool_a, table).await, 0);
                println!(
                    "{}: B refused {refused} times while A swept {} rows in {} batches",
                    stringify!($module),
                    done.deleted,
                    done.batches
                );
            }

            /// A sweep whose future is dropped while it holds the lock (a runtime stopping
            /// mid-sweep) must not leave the lock with a pooled connection: sweeper B gets it
            /// while A's pool lives on.
            #[tokio::test]
            async fn a_cancelled_sweep_leaves_the_lock_free() {
                let table = concat!("idem_sweep_cancel_", stringify!($module));
                let (sweeping, b, pool_a) = a_sweeping(table, 20_000, 10).await;
                sweeping.abort();
                assert!(
                    sweeping.await.unwrap_err().is_cancelled(),
                    "A finished before it was cancelled; fill more rows"
                );
                wait_until(
                    "the cancelled sweeper's lock to be free",
                    Duration::from_secs(10),
                    || async { b.sweep(1, 0).await.unwrap().locked },
                )
                .await;
                drop(pool_a);
            }
        }
    };
}

exclusive_suite!(
    postgres_pair,
    sqlx::Postgres,
    idem::sql::PgInbox,
    common::postgres(2).await,
    pg_fill_expired
);
exclusive_suite!(
    mysql_pair,
    sqlx::MySql,
    idem::sql::MySqlInbox,
    common::mysql(2).await,
    mysql_fill_expired
);

/// A million expired rows are swept in batches of 10 000 while claims go on in the same table;
/// no claim waits longer than one batch takes (plus slack relative to what a claim takes on
/// this machine without a sweep).
#[tokio::test]
async fn a_million_rows_are_swept_without_blocking_claims_beyond_one_batch() {
    const ROWS: i64 = 1_000_000;
    let table = "idem_sweep_million";
    let pool = common::postgres(6).await;
    let inbox = idem::sql::PgInbox::new(pool.clone()).table(table).unwrap();
    inbox.migrate().await.unwrap();
    let filling = Instant::now();
    pg_fill_expired(&pool, table, ROWS).await;
    let filled = filling.elapsed();
    let stores = idem::store::Stores::new().with(inbox.clone());
    let registration = idem::registry::find("sweep.claims").unwrap();
    let claim = || async {
        let envelope = idem::Envelope::new("{}").with_message_id(unique("claim"));
        let t = Instant::now();
        let outcome = registration.invoke(&stores, &envelope).await.unwrap();
        assert_eq!(outcome.label(), "processed", "{outcome:?}");
        t.elapsed()
    };
    // What a claim takes on this machine, now, with no sweep: the slowest of a hundred.
    let mut alone = Duration::ZERO;
    for _ in 0..100 {
        alone = alone.max(claim().await);
    }

    let started = Instant::now();
    let sweeping = tokio::spawn({
        let inbox = inbox.clone();
        async move { inbox.sweep(10_000, u32::MAX).await.unwrap() }
    });
    let (mut claims, mut slowest) = (0u32, Duration::ZERO);
    while !sweeping.is_finished() {
        slowest = slowest.max(claim().await);
        claims += 1;
    }
    let report = sweeping.await.unwrap();
    let took = started.elapsed();
    assert!(report.locked);
    assert_eq!(report.deleted, ROWS as u64);
    assert!(report.batches >= 100, "{report:?}");
    assert!(claims > 0);
    // The slack beyond one batch is relative to the claims' own time on this machine (a busy
    // machine slows both alike): four times the slowest claim without a sweep. A claim that
    // waited for the sweep, not for a batch, waits about as long as the hundred batches take.
    let slack = alone * 4;
    assert!(
        slowest <= report.longest_batch + slack,
        "a claim waited {slowest:?}, longer than the longest batch ({:?}) plus four times the \
         slowest claim without a sweep ({alone:?}); the sweep took {took:?}",
        report.longest_batch
    );
    let left: i64 =
        sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT count(*) FROM {table}")))
            .fetch_one(&pool)
            .await
            .unwrap();
    assert_eq!(
        left,
        i64::from(claims) + 100,
        "only the new claims are left"
    );
    println!(
        "swept {} rows in {} batches in {took:?} ({:.0} rows/s; filled in {filled:?}); longest batch {:?}; \
         {claims} claims meanwhile, slowest {slowest:?} ({alone:?} without a sweep)",
        report.deleted,
        report.batches,
        report.deleted as f64 / took.as_secs_f64(),
        report.longest_batch
    );
}
