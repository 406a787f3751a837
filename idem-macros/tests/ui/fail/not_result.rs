use idem::idempotent;

#[idempotent(store = Postgres)]
async fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _m: serde_json::Value) -> u32 {
    1
}

fn main() {}
