//! External mode: no transaction, the key passed downstream; lease and retention set.
use idem::{Context, HandlerError, idempotent};

#[derive(serde::Deserialize)]
struct Payment {
    payment_id: String,
}

#[idempotent(store = Postgres, key = "payment.payment_id", mode = "external", lease = "45s", retention = "30d")]
async fn charge(payment: Payment, ctx: &Context<'_>) -> Result<String, HandlerError> {
    Ok(format!("{}:{}", payment.payment_id, ctx.idempotency_key()))
}

#[idempotent(store = MySql, mode = "external")]
async fn notify(_payment: Payment) -> Result<(), HandlerError> {
    Ok(())
}

#[idempotent(store = Sqlite, retention = "12h")]
async fn record(_tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>, _payment: Payment) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {
    let found = idem::registry::handlers();
    let charge = found.iter().find(|r| r.name() == "charge").unwrap();
    assert_eq!(charge.mode(), idem::handler::Mode::External { lease: std::time::Duration::from_secs(45) });
    let notify = found.iter().find(|r| r.name() == "notify").unwrap();
    assert_eq!(notify.mode(), idem::handler::Mode::External { lease: idem::handler::DEFAULT_LEASE });
    let record = found.iter().find(|r| r.name() == "record").unwrap();
    assert_eq!(record.mode(), idem::handler::Mode::Transactional);
    assert_eq!(
        record.retention(&idem::store::Stores::new()),
        Some(std::time::Duration::from_secs(12 * 3600))
    );
}
