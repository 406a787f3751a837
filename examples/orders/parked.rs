//! The demo's last act: a key parked behind its dead letter, and its release. An order gets
//! status updates 1–4, update 2 malformed: it is dead-lettered, and the order's later updates
//! wait behind it, stored, not applied (the status handler is ordered, and parks a key by
//! default). The demo shows the parked key, then releases it through the store's API, as
//! `idem dlq skip --key` does (the head is skipped with a reason, and the updates parked behind
//! it go back one at a time; the command also takes the dead letter out of the DLQ, which the
//! demo leaves there for you to read), and checks that updates 3 and 4 were applied after 1,
//! in order.

use crate::db::Db;
use crate::status::{self, StatusUpdate};
use idem::sql::{ParkedKey, Release, SqlInbox, Started};
use idem::{Envelope, Outgoing, Stats};
use std::time::{Duration, Instant};

/// Why the demo skips the malformed update.
const REASON: &str = "the demo's malformed update; updates 3 and 4 supersede it";

/// The order's four updates, the second one not a version (it cannot be decoded).
pub fn updates(order_id: &str) -> Vec<Envelope> {
    (1..=4)
        .map(|version| {
            let body = match version {
                2 => serde_json::json!({"order_id": order_id, "status": "paid", "version": "two"}),
                _ => serde_json::to_value(StatusUpdate {
                    order_id: order_id.to_owned(),
                    status: format!("status {version}"),
                    version,
                })
                .unwrap_or_default(),
            };
            Envelope::new(body.to_string())
                .with_message_id(format!("{order_id}:{version}"))
                .with_content_type("application/json")
                .with_routing_key(order_id)
        })
        .collect()
}

/// What the act saw, for the report.
pub struct Parked {
    /// The key as it was parked.
    pub key: ParkedKey,
    /// The versions applied while it was parked.
    pub while_parked: Vec<i64>,
    /// The versions applied once it was released.
    pub released: Vec<i64>,
}

/// Waits until `order_id`'s updates 3 and 4 are parked behind its dead-lettered update 2, then
/// releases the key, publishing through `publish`, and waits until they are applied.
pub async fn park_and_release<F, Fut>(
    db: &Db,
    stats: &Stats,
    order_id: &str,
    deadline: Instant,
    publish: F,
) -> anyhow::Result<Parked>
where
    F: FnOnce(Outgoing) -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<()>>,
{
    let key = loop {
        let parked = parked_key(db, order_id).await?;
        if let Some(key) = parked.filter(|k| k.depth == 2) {
            break key;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out waiting for the order's updates to park: {:?}",
            stats.snapshot()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    let while_parked = applied(db, order_id).await?;
    let skip = Release::Skip {
        message_id: &key.head_message_id,
        reason: REASON,
        body: &[],
    };
    let first = match db {
        Db::Sqlite(pool) => start(&idem::sql::SqliteInbox::new(pool.clone()), &key, skip).await,
        Db::Postgres(pool) => start(&idem::sql::PgInbox::new(pool.clone()), &key, skip).await,
        Db::MySql(pool) => start(&idem::sql::MySqlInbox::new(pool.clone()), &key, skip).await,
    }?;
    if let Some(first) = first {
        publish(idem::transport::release(
            &first,
            status::CONSUMER,
            order_id,
            &key.source,
        ))
        .await?;
    }
    loop {
        if parked_key(db, order_id).await?.is_none() {
            break;
        }
        anyhow::ensure!(
            Instant::now() < deadline,
            "timed out waiting for the release"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let released = applied(db, order_id).await?;
    Ok(Parked {
        key,
        while_parked,
        released,
    })
}

/// Starts the release of `key` on `inbox` (as `idem dlq skip --key` does): its first parked
/// message, to publish.
async fn start<DB: idem::sql::Dialect>(
    inbox: &SqlInbox<DB>,
    key: &ParkedKey,
    skip: Release<'_>,
) -> anyhow::Result<Option<idem::store::ParkedMessage>> {
    match inbox.start_release(key, skip).await? {
        Started::Releasing(first) => Ok(first.map(|first| *first)),
        _ => anyhow::bail!("the parked key changed while the demo read it"),
    }
}

/// The parked key of `order_id`'s status updates, if it is parked.
async fn parked_key(db: &Db, order_id: &str) -> anyhow::Result<Option<ParkedKey>> {
    let keys = match db {
        Db::Sqlite(pool) => {
            idem::sql::SqliteInbox::new(pool.clone())
                .parked_keys()
                .await
        }
        Db::Postgres(pool) => idem::sql::PgInbox::new(pool.clone()).parked_keys().await,
        Db::MySql(pool) => idem::sql::MySqlInbox::new(pool.clone()).parked_keys().await,
    }?;
    Ok(keys
        .into_iter()
        .find(|k| k.consumer == status::CONSUMER && k.order_key == order_id))
}

/// The versions of `order_id` the status handler applied, in order.
async fn applied(db: &Db, order_id: &str) -> anyhow::Result<Vec<i64>> {
    let statuses = db.statuses(order_id).await?;
    Ok(statuses.applied.get(order_id).cloned().unwrap_or_default())
}
