//! State parameters after the payload, in both modes, beside the context.
use idem::{Context, HandlerError, idempotent};
use std::sync::Mutex;

struct Tariff {
    cents_per_unit: i64,
}

struct Mailer {
    sent: Mutex<Vec<String>>,
}

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
    units: i64,
}

#[idempotent(store = Sqlite, queue = "orders", key = "order.order_id")]
async fn price(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    order: Order,
    tariff: &Tariff,
    ctx: &Context<'_>,
) -> Result<i64, HandlerError> {
    let _ = ctx.idempotency_key();
    Ok(order.units * tariff.cents_per_unit)
}

#[idempotent(store = Sqlite, queue = "mails", key = "order.order_id", mode = "external")]
async fn mail(order: Order, mailer: &Mailer, tariff: &Tariff) -> Result<(), HandlerError> {
    let mut sent = mailer.sent.lock().map_err(|_| HandlerError::permanent("poisoned"))?;
    sent.push(format!("{} at {}", order.order_id, tariff.cents_per_unit));
    Ok(())
}

fn main() {
    let found = idem::registry::handlers();
    let mail = found.iter().find(|r| r.name() == "mail").unwrap();
    let names: Vec<_> = mail.state_types().iter().map(|t| t.name()).collect();
    assert_eq!(names.len(), 2);
    assert!(names[0].ends_with("Mailer") && names[1].ends_with("Tariff"), "{names:?}");
    let price = found.iter().find(|r| r.name() == "price").unwrap();
    assert_eq!(price.state_types().len(), 1);
}
