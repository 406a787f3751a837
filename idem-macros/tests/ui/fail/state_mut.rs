use idem::{HandlerError, idempotent};

struct Counter(u64);

#[idempotent(store = Postgres)]
async fn count(
    _tx: &mut sqlx::Transaction<'_, sqlx::Postgres>,
    _m: serde_json::Value,
    counter: &mut Counter,
) -> Result<(), HandlerError> {
    counter.0 += 1;
    Ok(())
}

fn main() {}
