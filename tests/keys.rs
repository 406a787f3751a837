//! The key contract, the same on every store: a key is any UTF-8 string of 1–512 bytes (NUL,
//! control characters, leading and trailing spaces included), and two keys that differ in any
//! byte are two keys. Each store claims, completes, counts and records keys that PostgreSQL's
//! `text` (NUL) and MySQL's former key columns (191 characters, space-padded comparison) could
//! not hold as given, one by one and in one batch, and reads them back as they were given. On
//! MariaDB, a table of schema version 8 is migrated without losing a row.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use idem::store::{
    Claim, ClaimRequest, DeadLetterRecord, DeadLetterStore, Fingerprint, InboxStore, OutboxStore,
    StoredOutput,
};
use idem::transport::DeadLetter;
use std::collections::BTreeSet;
use std::time::Duration;

/// Keys that differ from one another only where a store might blur them.
fn odd_keys() -> Vec<String> {
    let mut keys: Vec<String> = [
        "a\0b",
        "a\0c",
        "a",
        "\0",
        "\u{1}",
        "\u{1}0",
        "\u{1}1",
        "\u{1}\u{1}",
        "k",
        "k ",
        "k  ",
        " k",
        "k\t",
        "k\n",
        "K",
        "é",
        "e\u{301}",
        "\u{7f}",
        "ts-key",
        "ts-key ",
    ]
    .map(str::to_owned)
    .to_vec();
    keys.push("x".repeat(512));
    keys.push(format!("{}y", "x".repeat(511)));
    keys.push("é".repeat(256));
    keys.push("\u{1F600}".repeat(128));
    keys.push(format!("{}\0", "\u{1F600}".repeat(127)));
    keys
}

fn request<'a>(consumer: &'a str, key: &'a str, fingerprint: &'a Fingerprint) -> ClaimRequest<'a> {
    ClaimRequest {
        consumer,
        key,
        fingerprint,
        attempt: 1,
        retention: Duration::from_secs(600),
    }
}

/// Runs the contract against `inbox`, whose tables are migrated and empty.
async fn holds_every_key<S: InboxStore + DeadLetterStore>(inbox: &S, name: &str) {
    let keys = odd_keys();
    let fingerprints: Vec<Fingerprint> =
        keys.iter().map(|k| Fingerprint::of(k.as_bytes())).collect();
    let output = StoredOutput::encode(&"done").unwrap();

    // One by one: every key is new, then every key is found with its own fingerprint.
    for (key, fingerprint) in keys.iter().zip(&fingerprints) {
        let request = request("one", key, fingerprint);
        let mut tx = inbox.begin().await.unwrap();
        let claim = inbox.claim(&mut tx, &request).await.unwrap();
        assert_eq!(
            claim,
            Claim::Claimed,
            "{name}: {key:?} was taken by another key"
        );
        inbox.complete(&mut tx, &request, &output).await.unwrap();
        inbox.commit(tx).await.unwrap();
    }
    for (key, fingerprint) in keys.iter().zip(&fingerprints) {
        let mut tx = inbox.begin().await.unwrap();
        let claim = inbox
            .claim(&mut tx, &request("one", key, fingerprint))
            .await
            .unwrap();
        inbox.rollback(tx).await;
        let Claim::Existing {
            fingerprint: stored,
            output: Some(stored_output),
        } = claim
        else {
            panic!("{name}: {key:?} was not found: {claim:?}");
        };
        assert_eq!(
            &stored, fingerprint,
            "{name}: {key:?} found another key's row"
        );
        assert_eq!(stored_output, output);
    }

    // In one batch, and again.
    let requests: Vec<ClaimRequest<'_>> = keys
        .iter()
        .zip(&fingerprints)
        .map(|(k, f)| request("batch", k, f))
        .collect();
    let mut tx = inbox.begin().await.unwrap();
    let claims = inbox.claim_batch(&mut tx, &requests).await.unwrap();
    assert!(
        claims.iter().all(|c| *c == Claim::Claimed),
        "{name}: {claims:?}"
    );
    let completed: Vec<_> = requests.iter().map(|r| (*r, &output)).collect();
    inbox.complete_batch(&mut tx, &completed).await.unwrap();
    inbox.commit(tx).await.unwrap();
    let mut tx = inbox.begin().await.unwrap();
    let claims = inbox.claim_batch(&mut tx, &requests).await.unwrap();
    inbox.rollback(tx).await;
    for ((claim, key), fingerprint) in claims.iter().zip(&keys).zip(&fingerprints) {
        assert!(
            matches!(claim, Claim::Existing { fingerprint: f, .. } if f == fingerprint),
            "{name}: {key:?} in a batch: {claim:?}"
        );
    }

    // A batch whose claims fail are taken back: every key can be claimed again.
    let requests: Vec<ClaimRequest<'_>> = keys
        .iter()
        .zip(&fingerprints)
        .map(|(k, f)| request("unclaimed", k, f))
        .collect();
    let mut tx = inbox.begin().await.unwrap();
    inbox.claim_batch(&mut tx, &requests).await.unwrap();
    let all: Vec<&str> = keys.iter().map(String::as_str).collect();
    inbox.unclaim(&mut tx, "unclaimed", &all).await.unwrap();
    inbox.commit(tx).await.unwrap();
    let mut tx = inbox.begin().await.unwrap();
    let claims = inbox.claim_batch(&mut tx, &requests).await.unwrap();
    inbox.rollback(tx).await;
    assert!(
        claims.iter().all(|c| *c == Claim::Claimed),
        "{name}: unclaimed {claims:?}"
    );

    // The poison limit's counts: each key its own, removed when settled.
    for (key, fingerprint) in keys.iter().zip(&fingerprints) {
        assert_eq!(
            inbox
                .count_delivery(&request("count", key, fingerprint))
                .await
                .unwrap(),
            1,
            "{name}: {key:?}"
        );
    }
    inbox.settle_deliveries("count", &all).await.unwrap();
    for (key, fingerprint) in keys.iter().zip(&fingerprints) {
        assert_eq!(
            inbox
                .count_delivery(&request("count", key, fingerprint))
                .await
                .unwrap(),
            1,
            "{name}: {key:?}"
        );
    }
}

/// Dead-letter records keep every key, message id and detail as given.
async fn records_every_key(inbox: &idem::sql::SqlInbox<impl idem::sql::Dialect>, name: &str) {
    let queue = common::unique("keys-dlq");
    for key in odd_keys() {
        let envelope = idem::Envelope::new(key.clone()).with_message_id(key.clone());
        let letter = DeadLetter::new(
            "handler",
            format!("refused {key}"),
            "records",
            Some(key.clone()),
            1,
        );
        inbox
            .record_dead_letter(&DeadLetterRecord::new(&letter, &envelope, &queue))
            .await
            .unwrap();
    }
    let records = inbox.dead_letters(&queue).await.unwrap();
    let recorded: BTreeSet<&str> = records.iter().map(|r| r.key.as_str()).collect();
    let keys = odd_keys();
    let expected: BTreeSet<&str> = keys.iter().map(String::as_str).collect();
    assert_eq!(recorded, expected, "{name}");
    for record in &records {
        assert!(record.keyed);
        assert_eq!(record.detail, format!("refused {}", record.key));
        assert!(
            record.describes(Some(&record.key), record.key.as_bytes()),
            "{name}: {record:?}"
        );
        let again = inbox.dead_letter("records", &record.key).await.unwrap();
        assert_eq!(again.as_ref(), Some(record));
    }
}

#[tokio::test]
async fn postgres_holds_every_key() {
    let schema = common::OwnSchema::create("idem_keys", 2).await;
    let inbox = idem::sql::PgInbox::new(schema.pool.clone());
    inbox.migrate().await.unwrap();
    holds_every_key(&inbox, "PostgreSQL").await;
    records_every_key(&inbox, "PostgreSQL").await;
    schema.drop().await;
}

#[tokio::test]
async fn sqlite_holds_every_key() {
    let (pool, _dir) = common::sqlite(2).await;
    let inbox = idem::sql::SqliteInbox::new(pool);
    inbox.migrate().await.unwrap();
    holds_every_key(&inbox, "SQLite").await;
    records_every_key(&inbox, "SQLite").await;
}

/// A MariaDB inbox under a table name of this test's own; its tables are dropped at the end.
struct OwnTables {
    pool: sqlx::MySqlPool,
    table: String,
}

impl OwnTables {
    async fn new(tag: &str) -> Self {
        let pool = common::mysql(2).await;
        let table = format!("keys_{tag}_{}", std::process::id());
        let own = Self { pool, table };
        own.drop().await;
        own
    }

    fn inbox(&self) -> idem::sql::MySqlInbox {
        idem::sql::MySqlInbox::new(self.pool.clone())
            .table(&self.table)
            .unwrap()
    }

    async fn drop(&self) {
        let table = &self.table;
        for suffix in ["", "_deliveries", "_dead_letters", "_versions"] {
            let drop = format!("DROP TABLE IF EXISTS `{table}{suffix}`");
            sqlx::query(sqlx::AssertSqlSafe(drop))
                .execute(&self.pool)
                .await
                .unwrap();
        }
        for outbox in [self.outbox(), format!("{}_parked", self.outbox())] {
            let drop = format!("DROP TABLE IF EXISTS `{outbox}`");
            sqlx::query(sqlx::AssertSqlSafe(drop))
                .execute(&self.pool)
                .await
                .unwrap();
        }
        sqlx::query("DELETE FROM idem_schema_version WHERE inbox_table = ?")
            .bind(table)
            .execute(&self.pool)
            .await
            .ok();
    }

    fn outbox(&self) -> String {
        self.inbox().outbox_table().unwrap().to_owned()
    }
}

#[tokio::test]
async fn mariadb_holds_every_key() {
    let own = OwnTables::new("all").await;
    let inbox = own.inbox();
    inbox.migrate().await.unwrap();
    holds_every_key(&inbox, "MariaDB").await;
    records_every_key(&inbox, "MariaDB").await;
    own.drop().await;
}

/// A table of schema version 8 (keys of at most 191 characters, compared with trailing spaces
/// ignored) with rows in it is migrated to the current version: the rows stay, and the keys it
/// could not hold apart are two keys.
#[tokio::test]
async fn a_mariadb_table_of_version_8_is_migrated_to_9_without_losing_a_row() {
    let own = OwnTables::new("v8").await;
    let inbox = own.inbox();
    inbox.migrate().await.unwrap();
    let table = &own.table;
    let outbox = own.outbox();
    for statement in [
        format!(
            "ALTER TABLE `{table}` MODIFY `key` VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        ),
        format!(
            "ALTER TABLE `{table}_deliveries` MODIFY `key` VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        ),
        format!(
            "ALTER TABLE `{table}_dead_letters` MODIFY `key` VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        ),
        format!(
            "ALTER TABLE `{outbox}` MODIFY `key` VARCHAR(191) CHARACTER SET utf8mb4 COLLATE utf8mb4_bin NOT NULL"
        ),
        format!("UPDATE idem_schema_version SET version = 8 WHERE inbox_table = '{table}'"),
    ] {
        sqlx::query(sqlx::AssertSqlSafe(statement))
            .execute(&own.pool)
            .await
            .unwrap();
    }
    let old = Fingerprint::of(b"old");
    let mut tx = inbox.begin().await.unwrap();
    assert_eq!(
        inbox
            .claim(&mut tx, &request("c", "k", &old))
            .await
            .unwrap(),
        Claim::Claimed
    );
    inbox.commit(tx).await.unwrap();
    // Version 8 cannot tell 'k ' from 'k'.
    let padded = Fingerprint::of(b"padded");
    let mut tx = inbox.begin().await.unwrap();
    let claim = inbox
        .claim(&mut tx, &request("c", "k ", &padded))
        .await
        .unwrap();
    inbox.rollback(tx).await;
    assert!(matches!(claim, Claim::Existing { .. }), "{claim:?}");
    // A row under the same key in each of the other tables version 9 alters: the poison
    // limit's count, a dead-letter record (with text beyond ASCII) and a staged message.
    assert_eq!(
        inbox
            .count_delivery(&request("c", "k", &old))
            .await
            .unwrap(),
        1
    );
    let envelope = idem::Envelope::new("refusé ✓").with_message_id("k");
    let letter = DeadLetter::new("handler", "refusé ✓", "c", Some("k".to_owned()), 1);
    inbox
        .record_dead_letter(&DeadLetterRecord::new(&letter, &envelope, "keys-v8-dlq"))
        .await
        .unwrap();
    let recorded = inbox.dead_letter("c", "k").await.unwrap();
    assert!(recorded.is_some());
    let staged = idem::Outgoing::to_queue("keys-v8-billed", "billé ✓")
        .unwrap()
        .with_message_id("k-billed");
    let mut tx = inbox.begin().await.unwrap();
    inbox
        .stage_rows(&mut tx, "c", "k", std::slice::from_ref(&staged))
        .await
        .unwrap();
    inbox.commit(tx).await.unwrap();
    let outbox_rows = || async {
        sqlx::query_as::<_, (String, String, String, Vec<u8>, String)>(sqlx::AssertSqlSafe(
            format!(
                "SELECT message_id, consumer, `key`, body, headers FROM `{outbox}` ORDER BY seq"
            ),
        ))
        .fetch_all(&own.pool)
        .await
        .unwrap()
    };
    let outbox_before = outbox_rows().await;
    assert_eq!(outbox_before.len(), 1, "{outbox_before:?}");

    inbox.migrate().await.unwrap();
    let version: i32 =
        sqlx::query_scalar("SELECT version FROM idem_schema_version WHERE inbox_table = ?")
            .bind(table)
            .fetch_one(&own.pool)
            .await
            .unwrap();
    assert_eq!(version, idem::sql::SCHEMA_VERSION);
    let mut tx = inbox.begin().await.unwrap();
    let kept = inbox
        .claim(&mut tx, &request("c", "k", &old))
        .await
        .unwrap();
    assert!(
        matches!(kept, Claim::Existing { fingerprint, .. } if fingerprint == old),
        "{kept:?}"
    );
    let apart = inbox
        .claim(&mut tx, &request("c", "k ", &padded))
        .await
        .unwrap();
    assert_eq!(apart, Claim::Claimed);
    let long = "x".repeat(512);
    assert_eq!(
        inbox
            .claim(&mut tx, &request("c", &long, &padded))
            .await
            .unwrap(),
        Claim::Claimed
    );
    inbox.rollback(tx).await;
    // The other tables' rows stayed, each whole and still found by its key.
    assert_eq!(
        inbox
            .count_delivery(&request("c", "k", &old))
            .await
            .unwrap(),
        2,
        "the delivery count was lost"
    );
    assert_eq!(
        inbox
            .count_delivery(&request("c", "k ", &padded))
            .await
            .unwrap(),
        1,
        "'k ' counted as 'k'"
    );
    assert_eq!(
        inbox.dead_letter("c", "k").await.unwrap(),
        recorded,
        "the dead-letter record"
    );
    assert_eq!(outbox_rows().await, outbox_before, "the staged message");
    own.drop().await;
}
