//! The `#[idempotent]` attribute of idem. See the `idem` crate for its documentation; this
//! crate is a thin shell over [`expand`], which holds the testable expansion code.

use proc_macro::TokenStream;

mod args;
mod duration;
mod expand;
mod key;
mod signature;

/// Turns an `async fn` into an idempotent message handler and registers it.
///
/// ```text
/// #[idem::idempotent(queue = "orders", key = "order.order_id", store = Postgres)]
/// async fn place_order(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, order: OrderPlaced)
///     -> Result<(), idem::HandlerError> { … }
/// ```
///
/// Arguments: `store` (required: `Postgres`, `MySql` or `Sqlite`), `key` (`"message_id"` by default,
/// `"header:<name>"`, `"cloudevents"` or `"<payload>.<field>"`), `queue`, `consumer` (defaults to
/// the function's module path and name), `mode` (`"transactional"` by default, or `"external"`:
/// the function takes `(payload, ctx)` and no transaction), `lease` (external mode, `"30s"` by
/// default) and `retention` (how long the inbox keeps this consumer's rows, such as `"30d"`).
#[proc_macro_attribute]
pub fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    expand::idempotent(args.into(), item.into()).into()
}
