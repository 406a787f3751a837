//! Test your handlers without a broker (feature `testing`, for `[dev-dependencies]`).
//!
//! A [`Harness`] hands deliveries to the registered handlers through the same pipeline and the
//! same settlement decision as the runtime, against real inbox stores: an in-memory SQLite
//! database ([`sqlite`], feature `sqlite`) or the stores of your own pools
//! ([`Harness::new`]). Each delivery returns its [`Outcome`](crate::Outcome); copies, lost
//! acks, reordering, transient database errors and retries can be injected, and dead letters
//! are kept with their reason codes.
//!
//! ```
//! # #[cfg(feature = "sqlite")]
//! # mod demo {
//! use idem::prelude::*;
//!
//! #[derive(serde::Deserialize)]
//! struct OrderPlaced { order_id: String, amount_cents: i64 }
//!
//! #[idempotent(key = "order.order_id", consumer = "doc-billing", store = Sqlite)]
//! async fn bill(tx: &mut Transaction<'_, sqlx::Sqlite>, order: OrderPlaced) -> Result<(), HandlerError> {
//!     sqlx::query("INSERT INTO bills (order_id, cents) VALUES (?, ?)")
//!         .bind(&order.order_id).bind(order.amount_cents)
//!         .execute(&mut **tx).await?;
//!     Ok(())
//! }
//!
//! # pub async fn run() -> Result<(), Box<dyn std::error::Error>> {
//! let (harness, pool) = idem::testing::sqlite().await?;
//! sqlx::query("CREATE TABLE bills (order_id TEXT PRIMARY KEY, cents BIGINT)").execute(&pool).await?;
//!
//! let order = serde_json::json!({"order_id": "o-1", "amount_cents": 250});
//! let first = harness.send_json("doc-billing", "m-1", &order).await?;
//! assert_eq!(first.label(), "processed");
//! let copies = harness.send_copies("doc-billing", &idem::testing::json("m-1", &order)?, 3).await?;
//! assert!(copies.iter().all(|o| o.label() == "duplicate"));
//!
//! harness.inject_transient(1);                       // the next claim meets a deadlock
//! let attempts = harness.deliver("doc-billing", idem::testing::json("m-2",
//!     &serde_json::json!({"order_id": "o-2", "amount_cents": 5}))?).await?;
//! assert_eq!(attempts.iter().map(|o| o.label()).collect::<Vec<_>>(), ["retry", "processed"]);
//!
//! harness.send_json("doc-billing", "m-3", &serde_json::json!({"order_id": 7})).await?;
//! assert_eq!(harness.dead_letters()[0].dead_letter.reason, "decode");
//! # Ok(()) }
//! # }
//! # #[cfg(feature = "sqlite")]
//! # fn main() -> Result<(), Box<dyn std::error::Error>> {
//! #     tokio::runtime::Builder::new_current_thread().enable_all().build()?.block_on(demo::run())
//! # }
//! # #[cfg(not(feature = "sqlite"))]
//! # fn main() {}
//! ```

pub use idem_core::testing::{DeadLettered, Harness, HarnessError};

use crate::Envelope;

/// A JSON message with `message_id` and `content_type: application/json`, as a producer
/// would publish it.
pub fn json<T: serde::Serialize + ?Sized>(
    message_id: &str,
    payload: &T,
) -> Result<Envelope, serde_json::Error> {
    Ok(Envelope::new(serde_json::to_vec(payload)?)
        .with_message_id(message_id)
        .with_content_type("application/json"))
}

/// A harness over a fresh in-memory SQLite database with its inbox migrated, and the pool of
/// that database for the test's own tables and assertions (feature `sqlite`). The database
/// lives as long as the pool.
#[cfg(feature = "sqlite")]
#[cfg_attr(docsrs, doc(cfg(feature = "sqlite")))]
pub async fn sqlite() -> Result<(Harness, sqlx::SqlitePool), idem_sqlx::MigrateError> {
    use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
    use std::str::FromStr;

    let database = |source| idem_sqlx::MigrateError::Database {
        table: idem_sqlx::DEFAULT_TABLE.to_owned(),
        source,
    };
    // One connection that never closes: an in-memory database lives as long as it does.
    let pool = SqlitePoolOptions::new()
        .max_connections(1)
        .min_connections(1)
        .idle_timeout(None)
        .max_lifetime(None)
        .connect_with(SqliteConnectOptions::from_str("sqlite::memory:").map_err(database)?)
        .await
        .map_err(database)?;
    let inbox = idem_sqlx::SqliteInbox::new(pool.clone());
    inbox.migrate().await?;
    Ok((Harness::new(crate::store::Stores::new().with(inbox)), pool))
}
