use idem::{HandlerError, idempotent};

/// Not a store: it implements none of the store traits.
pub struct Ledger;

#[idempotent(store = crate::Ledger)]
async fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>, _m: serde_json::Value) -> Result<(), HandlerError> {
    Ok(())
}

fn main() {}
