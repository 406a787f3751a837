use idem::{Context, HandlerError, idempotent};
use sqlx::{Postgres, Sqlite, Transaction};

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
    line: (u64, Option<String>),
}

#[derive(serde::Serialize, serde::Deserialize)]
struct Receipt {
    id: u64,
}

#[derive(Debug)]
struct MyError;

impl From<MyError> for HandlerError {
    fn from(_: MyError) -> Self {
        HandlerError::permanent("mine")
    }
}

type MyResult<T> = Result<T, MyError>;

#[idempotent(queue = "orders", key = "order.order_id", store = Postgres, consumer = "billing")]
async fn by_field(tx: &mut Transaction<'_, Postgres>, order: Order) -> Result<(), HandlerError> {
    sqlx::query("SELECT 1").execute(&mut **tx).await?;
    let _ = order.line;
    Ok(())
}

#[idempotent(key = "order.line.0", store = Sqlite)]
async fn by_tuple_field(_tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>, order: Order) -> MyResult<Receipt> {
    Ok(Receipt { id: order.line.0 })
}

#[idempotent(key = "order.line.1", store = Sqlite)]
async fn by_optional_field(_tx: &mut Transaction<'_, Sqlite>, order: Order) -> Result<u8, HandlerError> {
    let _ = order.order_id;
    Ok(1)
}

#[idempotent(store = Postgres)]
async fn by_message_id(_tx: &mut Transaction<'_, Postgres>, _order: Order, ctx: &Context<'_>) -> Result<String, HandlerError> {
    Ok(ctx.idempotency_key().to_owned())
}

#[idempotent(key = "header:x-idempotency-key", store = Postgres)]
async fn by_header(_tx: &mut Transaction<'_, Postgres>, _event: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(key = "cloudevents", store = Sqlite)]
pub(crate) async fn by_cloudevent(_tx: &mut Transaction<'_, Sqlite>, _event: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

/// The handlers stay callable as written.
#[allow(dead_code)]
async fn call_directly(pool: sqlx::PgPool) -> Result<(), HandlerError> {
    let mut tx = pool.begin().await?;
    by_field(&mut tx, Order { order_id: "o-1".into(), line: (1, None) }).await?;
    tx.commit().await?;
    Ok(())
}

fn main() {
    let consumers: Vec<_> = idem::registry::handlers().iter().map(|r| r.consumer()).collect();
    assert!(consumers.contains(&"billing"));
    assert_eq!(consumers.len(), 6);
}
