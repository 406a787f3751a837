use idem::prelude::*;
use idem::rabbitmq::{RabbitConfig, RabbitTransport};
use idem::sql::PgInbox;

#[derive(serde::Deserialize)]
struct OrderPlaced { order_id: String, customer: String, amount_cents: i64 }

#[idempotent(queue = "orders", key = "order.order_id", consumer = "billing", store = Postgres)]
async fn place_order(tx: &mut Transaction<'_, sqlx::Postgres>, order: OrderPlaced)
    -> Result<(), HandlerError>
{
    sqlx::query("INSERT INTO orders (order_id, customer, amount_cents) VALUES ($1, $2, $3)")
        .bind(&order.order_id).bind(&order.customer).bind(order.amount_cents)
        .execute(&mut **tx).await?;   // sqlx errors are classified: deadlock → retry, constraint → reject
    Ok(())
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let pool = sqlx::PgPool::connect("postgres://postgres@127.0.0.1:5432/test").await?;
    sqlx::query("CREATE TABLE IF NOT EXISTS orders (order_id TEXT PRIMARY KEY, customer TEXT, amount_cents BIGINT)")
        .execute(&pool).await?;
    let inbox = PgInbox::new(pool);
    inbox.migrate().await?;                                            // creates idem_inbox

    Runtime::builder()                                                 // every #[idempotent] fn, via inventory
        .transport(RabbitTransport::new(RabbitConfig::new("amqp://guest:guest@127.0.0.1:5672/%2f")))
        .store(inbox)
        .concurrency(8)
        .build()?                                                      // wrong configuration fails here
        .run_until(idem::shutdown_signal())                           // Ctrl-C or SIGTERM: finish what is in flight
        .await?;
    Ok(())
}
