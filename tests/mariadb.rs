//! The `mysql` store is a MariaDB store, honestly: on a MariaDB database created with a latin1
//! default (as many servers are configured), every text a message or a handler makes round-trips
//! whole (a dead letter's reason and detail, a handler's result, an outbox row's headers and
//! correlation id, a parked row's reason), because every such column says `utf8mb4`; and the
//! server check refuses what is not MariaDB 10.6 or later (unit-tested in `idem-sqlx`, since
//! no MySQL server can be installed on the machines the tests run on).

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use idem::sql::MySqlInbox;
use idem::store::DeadLetterRecord;
use idem::store::{
    ClaimRequest, DeadLetterStore, Fingerprint, InboxStore, OutboxSelect, OutboxStore, StoredOutput,
};
use idem::transport::DeadLetter;
use idem::transport::Transport;
use idem::{Destination, Envelope, Outgoing};
use std::time::Duration;

/// A database of the test's own whose default character set is latin1, and a pool on it.
async fn latin1_database() -> (String, sqlx::MySqlPool) {
    let name = common::unique("idem_latin1").replace('-', "_");
    let admin = common::mysql(1).await;
    sqlx::query(sqlx::AssertSqlSafe(format!(
        "CREATE DATABASE {name} CHARACTER SET latin1 COLLATE latin1_swedish_ci"
    )))
    .execute(&admin)
    .await
    .unwrap();
    let url = match common::mysql_url().rsplit_once('/') {
        Some((base, _)) => format!("{base}/{name}"),
        None => panic!("MYSQL_URL names no database"),
    };
    let pool = sqlx::mysql::MySqlPoolOptions::new()
        .max_connections(4)
        .connect(&url)
        .await
        .unwrap();
    (name, pool)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_latin1_database_holds_any_text_idem_writes() {
    let (name, pool) = latin1_database().await;
    let inbox = MySqlInbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    let text = "naïve 日本語 🚀";

    // A dead letter's reason, detail and message id.
    let letter = DeadLetter::new(
        "handler",
        format!("refused: {text}"),
        "c",
        Some("k".into()),
        1,
    );
    let envelope = Envelope::new(b"{}".to_vec()).with_message_id(format!("m-{text}"));
    let record = DeadLetterRecord::new(&letter, &envelope, "q");
    inbox.record_dead_letter(&record).await.unwrap();
    let rows = inbox.dead_letters("q").await.unwrap();
    assert_eq!(rows.len(), 1);
    assert_eq!(rows[0].detail, format!("refused: {text}"));
    assert_eq!(
        rows[0].message_id.as_deref(),
        Some(format!("m-{text}").as_str())
    );

    // A handler's result, stored with its key and read back by a duplicate.
    let fingerprint = Fingerprint::of(b"{}");
    let request = ClaimRequest {
        consumer: "c",
        key: "k",
        fingerprint: &fingerprint,
        attempt: 1,
        retention: Duration::from_secs(60),
    };
    let output = StoredOutput::encode(&text).unwrap();
    let mut tx = inbox.begin().await.unwrap();
    inbox.claim(&mut tx, &request).await.unwrap();
    inbox.complete(&mut tx, &request, &output).await.unwrap();
    inbox.commit(tx).await.unwrap();
    let mut tx = inbox.begin().await.unwrap();
    let again = inbox.claim(&mut tx, &request).await.unwrap();
    inbox.rollback(tx).await;
    assert_eq!(
        again,
        idem::store::Claim::Existing {
            fingerprint,
            output: Some(output)
        }
    );

    // An outbox row's headers and correlation id, and a parked row's reason: staged for a queue
    // that does not exist, refused by the broker, parked with the broker's words.
    let queue = common::unique("idem-test-latin1");
    let missing = format!("{queue}-{text}");
    let message = Outgoing::new(Destination::queue(&missing), b"{}".to_vec())
        .with_message_id(format!("{queue}-1"))
        .with_correlation_id(text)
        .with_header("note", text);
    let mut tx = pool.begin().await.unwrap();
    inbox.stage(&mut tx, message).await.unwrap();
    tx.commit().await.unwrap();
    let (headers, correlation): (String, String) =
        sqlx::query_as("SELECT headers, correlation_id FROM idem_outbox")
            .fetch_one(&pool)
            .await
            .unwrap();
    assert!(headers.contains(text), "{headers}");
    assert_eq!(correlation, text);
    let transport = idem::rabbitmq::RabbitTransport::new(idem::rabbitmq::RabbitConfig::new(
        common::broker::amqp_url(),
    ));
    let outbound = transport.outbound().unwrap();
    let select = OutboxSelect::Older {
        age: Duration::ZERO,
        limit: 10,
    };
    let report = inbox.relay(&select, outbound.as_ref()).await.unwrap();
    assert_eq!(report.parked, 1, "{report:?}");
    let parked = inbox.parked().await.unwrap();
    assert_eq!(parked.len(), 1);
    assert!(parked[0].failure.contains(text), "{}", parked[0].failure);
    assert_eq!(parked[0].routing_key, missing);

    pool.close().await;
    sqlx::query(sqlx::AssertSqlSafe(format!("DROP DATABASE {name}")))
        .execute(&common::mysql(1).await)
        .await
        .unwrap();
}
