use idem::{HandlerError, idempotent};
use std::cell::Cell;

struct Hits {
    count: Cell<u64>,
}

#[idempotent(store = Postgres)]
async fn hit(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    _m: serde_json::Value,
    hits: &Hits,
) -> Result<(), HandlerError> {
    hits.count.set(hits.count.get() + 1);
    Ok(())
}

fn main() {}
