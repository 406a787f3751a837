//! `crate = "..."`: the expansion finds idem where the user's code reaches it (here a
//! re-export, as a renamed dependency or a company's wrapper crate would be), not at `::idem`.
mod platform {
    pub mod messaging {
        pub use idem::*;
    }
}

use platform::messaging::{HandlerError, idempotent};

#[derive(serde::Deserialize)]
struct Order {
    order_id: String,
    version: u32,
}

#[idempotent(store = Postgres, queue = "orders", key = "order.order_id", version = "order.version",
    entity = "order.order_id", crate = "crate::platform::messaging")]
async fn book(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    order: Order,
) -> Result<(), HandlerError> {
    let _ = order.order_id;
    Ok(())
}

fn main() {
    let registered = platform::messaging::registry::handlers()
        .iter()
        .any(|h| h.name() == "book" && h.queue() == Some("orders"));
    assert!(registered, "the handler registered through the re-exported path");
}
