//! The `#[idempotent]` attribute of idem: see [`idempotent`] for an example, and the `idem`
//! crate for the whole story. This crate is a thin shell over `expand`, which holds the
//! testable expansion code.

use proc_macro::TokenStream;

mod args;
mod duration;
mod expand;
mod key;
mod signature;

/// Turns an `async fn` into an idempotent message handler and registers it.
///
/// ```no_run
/// use idem::sqlx::{self, Postgres, Transaction};
///
/// #[derive(serde::Deserialize)]
/// struct OrderPlaced { order_id: String, amount_cents: i64 }
///
/// #[idem::idempotent(queue = "orders", key = "order.order_id", consumer = "billing", store = Postgres)]
/// async fn place_order(tx: &mut Transaction<'_, Postgres>, order: OrderPlaced)
///     -> Result<(), idem::HandlerError>
/// {
///     sqlx::query("INSERT INTO orders (order_id, amount_cents) VALUES ($1, $2)")
///         .bind(&order.order_id).bind(order.amount_cents)
///         .execute(&mut **tx).await?;
///     Ok(())
/// }
/// ```
///
/// Arguments: `store` (required: `Postgres`, `MySql` or `Sqlite`), `key` (`"message_id"` by default,
/// `"header:<name>"`, `"cloudevents"` or `"<payload>.<field>"`), `queue`, `consumer` (defaults to
/// the function's module path and name), `mode` (`"transactional"` by default, or `"external"`:
/// the function takes `(payload, ctx)` and no transaction), `lease` (external mode, `"30s"` by
/// default) and `retention` (how long the inbox keeps this consumer's rows, such as `"30d"`).
///
/// Parameters after the payload, in any order: `ctx: &idem::Context<'_>` (the delivery), and
/// state `name: &S` (the value given to the runtime with `.state(value)`; `build()` refuses a
/// runtime that lacks one).
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
