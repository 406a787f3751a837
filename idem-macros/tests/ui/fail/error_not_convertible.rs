use idem::idempotent;

#[derive(Debug)]
struct MyError;

#[idempotent(store = Postgres)]
async fn handler(_tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, _m: serde_json::Value) -> Result<(), MyError> {
    Err(MyError)
}

fn main() {}
