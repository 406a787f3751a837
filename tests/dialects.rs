//! A dialect is a type of its own over a sqlx driver, so two dialects can share one: here a
//! second dialect on PostgreSQL's driver, for a PostgreSQL-wire database without
//! data-modifying common table expressions (its claim inserts, then reads, instead of
//! PostgreSQL's one-statement claim, and its batches claim key by key). A handler on its
//! inbox runs through `build()` against the real PostgreSQL, beside the table of dialects the
//! tools choose from, which it is not in.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::running::start;
use common::{OwnSchema, wait_until};
use idem::sql::dialect::{DIALECTS, Entry};
use idem::sql::statements::{MigrationStatements, Statements};
use idem::sql::{Dialect, PgDialect, SqlInbox};
use idem::store::{Claim, StoreKind};
use idem::transport::MemoryTransport;
use idem::{Envelope, HandlerError, Runtime, idempotent};
use std::time::Duration;

/// PostgreSQL's rules without a claim in one statement.
struct PlainPg;

/// The claim of a database without data-modifying CTEs: insert, and nothing when the key is
/// held (the read that follows is `existing`'s).
const PLAIN_CLAIM: &str = r#"INSERT INTO "{table}" (consumer, key, fingerprint, status, attempts, created_at, completed_at, expires_at)
VALUES ($1, $2, $3, 'completed', $4, now(), now(), now() + $5 * interval '1 second')
ON CONFLICT (consumer, key) DO NOTHING"#;

impl Dialect for PlainPg {
    type Db = sqlx::Postgres;
    const ENTRY: Entry = Entry {
        name: "plainpg",
        schemes: &["plainpg://"],
        bare_path: false,
        transactional_ddl: true,
    };
    const KIND: StoreKind = StoreKind::new("PlainPg", "plainpg", "SqlInbox::<PlainPg>");
    const STATEMENTS: Statements = Statements {
        claim: PLAIN_CLAIM,
        try_claim: None,
        batch: None,
        rows: None,
        ..<PgDialect as Dialect>::STATEMENTS
    };
    const MIGRATION: MigrationStatements = <PgDialect as Dialect>::MIGRATION;
    const BEGIN: Option<&'static str> = <PgDialect as Dialect>::BEGIN;
    const ESCAPES_NUL: bool = true;
    const DURABILITY: &'static str = <PgDialect as Dialect>::DURABILITY;

    fn placeholder(n: usize) -> String {
        format!("${n}")
    }

    async fn connect(url: &str, max: u32) -> Result<sqlx::PgPool, sqlx::Error> {
        PgDialect::connect(url, max).await
    }
}

/// The inbox of the second dialect, as `store = ...` names it.
type PlainInbox = SqlInbox<PlainPg>;

#[derive(serde::Deserialize)]
struct Order {
    id: String,
}

#[idempotent(store = crate::PlainInbox, queue = "plain-orders", consumer = "plain.orders", key = "order.id")]
async fn record(
    tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order: Order,
) -> Result<(), HandlerError> {
    sqlx::query("INSERT INTO plain_effects (id) VALUES ($1)")
        .bind(&order.id)
        .execute(&mut **tx)
        .await?;
    Ok(())
}

/// Claims `key` once in `inbox` and commits.
async fn claim_once(inbox: &PlainInbox, key: &str) -> Claim {
    use idem::store::{ClaimRequest, Fingerprint, InboxStore};
    let fingerprint = Fingerprint::of(key.as_bytes());
    let request = ClaimRequest {
        consumer: "direct",
        key,
        fingerprint: &fingerprint,
        attempt: 1,
        retention: Duration::from_secs(60),
    };
    let mut tx = inbox.begin().await.unwrap();
    let claimed = inbox.claim(&mut tx, &request).await.unwrap();
    inbox.commit(tx).await.unwrap();
    claimed
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_dialect_on_postgres_driver_keeps_an_inbox_of_its_own() {
    let schema = OwnSchema::create("dialects", 4).await;
    let pool = schema.pool.clone();
    let inbox = PlainInbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    sqlx::query("CREATE TABLE plain_effects (id TEXT NOT NULL)")
        .execute(&pool)
        .await
        .unwrap();
    assert_eq!(claim_once(&inbox, "k").await, Claim::Claimed);
    assert!(
        matches!(claim_once(&inbox, "k").await, Claim::Existing { .. }),
        "the second claim finds the first"
    );
    assert_eq!(
        idem::sql::schema::<PlainPg>(&idem::sql::TableName::default()),
        idem::sql::schema::<PgDialect>(&idem::sql::TableName::default()),
    );

    // A handler on it, through build(): copies and a batch take effect once.
    let transport = MemoryTransport::new();
    let running = start(
        Runtime::builder()
            .transport(transport.clone())
            .store(inbox)
            .handlers(["plain.orders"]),
    );
    let stats = running.stats.clone();
    let order =
        |id: &str| Envelope::new(serde_json::json!({ "id": id }).to_string()).with_message_id(id);
    transport.publish_copies("plain-orders", &order("a"), 5);
    for id in ["b", "c", "d"] {
        transport.publish("plain-orders", order(id));
    }
    wait_until(
        "every delivery settled",
        Duration::from_secs(30),
        || async { stats.snapshot().settled() == 8 },
    )
    .await;
    let seen = running.shut_down().await;
    assert_eq!((seen.processed, seen.duplicates), (4, 4));
    let effects: Vec<(String, i64)> =
        sqlx::query_as("SELECT id, count(*) FROM plain_effects GROUP BY id ORDER BY id")
            .fetch_all(&pool)
            .await
            .unwrap();
    let once = |id: &str| (id.to_owned(), 1);
    assert_eq!(effects, vec![once("a"), once("b"), once("c"), once("d")]);

    // The tools' table lists the dialects of this build, not this one.
    assert!(DIALECTS.iter().all(|entry| entry.name != "plainpg"));
    pool.close().await;
    schema.drop().await;
}
