//! Checking the annotated function's signature, with a spanned error for each mistake.

use crate::args::{Mode, Store};
use syn::spanned::Spanned;
use syn::{
    FnArg, GenericArgument, GenericParam, Ident, Pat, PathArguments, ReturnType, Signature, Type,
};

/// The parts of a valid handler signature the expansion needs.
pub(crate) struct HandlerSig<'a> {
    pub(crate) name: &'a Ident,
    /// The transaction parameter's type (transactional mode only).
    pub(crate) tx_ty: Option<&'a Type>,
    pub(crate) payload: &'a Ident,
    /// One message's type: `T` of a payload `T`, or of a batch payload `idem::Batch<T>`.
    pub(crate) payload_ty: &'a Type,
    /// Whether the payload parameter is a batch (`idem::Batch<T>`).
    pub(crate) batch: bool,
    /// The parameters after the payload, in order.
    pub(crate) extras: Vec<Extra<'a>>,
    /// The success type `T` of the `Result<T, E>` (or alias) the function returns.
    pub(crate) output: &'a Type,
    /// The whole return type.
    pub(crate) returns: &'a Type,
}

/// A parameter after the payload.
pub(crate) enum Extra<'a> {
    /// `ctx: &idem::Context<'_>`: the delivery.
    Context,
    /// `name: &T`: the runtime's state of type `T` (the referent type).
    State(&'a Type),
}

const SHAPE: &str = "expected `(tx: &mut sqlx::Transaction<'_, DB>, payload: T)`, optionally followed by `ctx: &idem::Context<'_>` and state parameters `name: &S`";
const EXTERNAL_SHAPE: &str = "expected `(payload: T, ctx: &idem::Context<'_>)` (or just `(payload: T)`, plus state parameters `name: &S`): an external handler runs outside any transaction, and passes `ctx.idempotency_key()` downstream";
const EXTRA: &str = "parameters after the payload are `ctx: &idem::Context<'_>` or shared state `name: &S` (a value given with `.state(value)` on the runtime builder)";

/// Checks `sig`; `store` is the parsed store, when the arguments parsed.
pub(crate) fn check(
    sig: &Signature,
    store: Option<Store>,
    mode: Mode,
) -> syn::Result<HandlerSig<'_>> {
    let external = mode == Mode::External;
    let shape = if external { EXTERNAL_SHAPE } else { SHAPE };
    let mut errors = Errors::default();
    check_function(sig, &mut errors);
    let typed = typed_inputs(sig, &mut errors);
    let first = usize::from(!external);
    if external
        && let Some(t) = typed.first()
        && matches!(&*t.ty, Type::Reference(r) if r.mutability.is_some())
    {
        errors.push(
            t.span(),
            "an external handler takes no transaction: its work cannot join the inbox transaction; remove this parameter (or use mode = \"transactional\" for database writes)",
        );
        return Err(errors
            .finish()
            .err()
            .unwrap_or_else(|| syn::Error::new(sig.span(), EXTERNAL_SHAPE)));
    }
    if typed.len() < first + 1 {
        errors.push(sig.paren_token.span.join(), shape);
    }
    let tx_ty = if external {
        None
    } else {
        typed.first().map(|t| &*t.ty)
    };
    if let Some(ty) = tx_ty {
        check_tx(ty, store, &mut errors);
    }
    let (payload, batch) = payload(typed.get(first).copied(), external, &mut errors);
    let extras = extras(typed.get(first + 1..).unwrap_or_default(), &mut errors);
    let output = output(sig, &mut errors);
    errors.finish()?;
    match (tx_ty.is_some() || external, payload, output) {
        (true, Some((payload, payload_ty)), Some((output, returns))) => Ok(HandlerSig {
            name: &sig.ident,
            tx_ty,
            payload,
            payload_ty,
            batch,
            extras,
            output,
            returns,
        }),
        _ => Err(syn::Error::new(sig.span(), shape)),
    }
}

/// What the function itself must be: `async`, not `const`, no ABI, not variadic, not generic
/// over types, no `where` clause.
fn check_function(sig: &Signature, errors: &mut Errors) {
    if sig.asyncness.is_none() {
        errors.push(
            sig.fn_token.span(),
            "#[idempotent] handlers must be `async fn`",
        );
    }
    if let Some(constness) = &sig.constness {
        errors.push(
            constness.span(),
            "#[idempotent] handlers cannot be `const fn`",
        );
    }
    if let Some(abi) = &sig.abi {
        errors.push(
            abi.span(),
            "#[idempotent] handlers cannot have an `extern` ABI",
        );
    }
    if let Some(variadic) = &sig.variadic {
        errors.push(variadic.span(), "#[idempotent] handlers cannot be variadic");
    }
    if let Some(param) = sig
        .generics
        .params
        .iter()
        .find(|p| !matches!(p, GenericParam::Lifetime(_)))
    {
        errors.push(
            param.span(),
            "#[idempotent] handlers cannot be generic: the registry needs one concrete handler per function",
        );
    }
    if let Some(clause) = &sig.generics.where_clause {
        errors.push(
            clause.span(),
            "#[idempotent] handlers cannot have a `where` clause",
        );
    }
}

/// The typed parameters; a `self` parameter is an error.
fn typed_inputs<'a>(sig: &'a Signature, errors: &mut Errors) -> Vec<&'a syn::PatType> {
    let mut typed = Vec::new();
    for arg in &sig.inputs {
        match arg {
            FnArg::Receiver(r) => errors.push(
                r.span(),
                "#[idempotent] handlers are free functions, not methods",
            ),
            FnArg::Typed(t) => typed.push(t),
        }
    }
    typed
}

/// The payload parameter's name and one message's type (the `T` of a batch payload
/// `Batch<T>`), and whether it is a batch.
fn payload<'a>(
    param: Option<&'a syn::PatType>,
    external: bool,
    errors: &mut Errors,
) -> (Option<(&'a Ident, &'a Type)>, bool) {
    let Some(t) = param else {
        return (None, false);
    };
    let mut payload = None;
    match &*t.pat {
        Pat::Ident(p) if p.by_ref.is_none() && p.subpat.is_none() => {
            payload = Some((&p.ident, &*t.ty))
        }
        other => errors.push(
            other.span(),
            "the payload parameter must be a plain name, such as `order: OrderPlaced`",
        ),
    }
    if let Type::Reference(r) = &*t.ty {
        errors.push(r.span(), "the payload must be an owned type: it is decoded from the message body (serde `DeserializeOwned`)");
    }
    let batch = payload.and_then(|(_, ty)| batch_item(ty));
    if let (Some(_), Some((_, ty))) = (batch, payload)
        && external
    {
        errors.push(
            ty.span(),
            "a batch handler writes its messages' effects in the inbox transaction: it cannot be `mode = \"external\"`",
        );
    }
    // A batch handler's `Payload` is one message: the `T` of `Batch<T>`.
    let payload = payload.map(|(name, ty)| (name, batch.unwrap_or(ty)));
    (payload, batch.is_some())
}

/// The success type of the `Result` the function returns, and the whole return type.
fn output<'a>(sig: &'a Signature, errors: &mut Errors) -> Option<(&'a Type, &'a Type)> {
    match &sig.output {
        ReturnType::Type(_, ty) => match result_ok_type(ty) {
            Some(ok) => Some((ok, &**ty)),
            None => {
                errors.push(ty.span(), "#[idempotent] handlers must return `Result<T, E>` (or an alias named `...Result<T>`) with `E: Into<idem::HandlerError>`");
                None
            }
        },
        ReturnType::Default => {
            errors.push(sig.ident.span(), "#[idempotent] handlers must return `Result<T, E>` with `E: Into<idem::HandlerError>`; add `-> Result<(), idem::HandlerError>`");
            None
        }
    }
}

/// `T` when `ty` is `Batch<T>`, however qualified (`idem::Batch<T>`): a batch handler's
/// payload.
fn batch_item(ty: &Type) -> Option<&Type> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    if path.qself.is_some() || last.ident != "Batch" {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    match args.args.iter().collect::<Vec<_>>()[..] {
        [GenericArgument::Type(item)] => Some(item),
        _ => None,
    }
}

/// Sorts the parameters after the payload into the context (at most once; a batch handler's
/// holds each message's, `ctx.item(i)`) and state.
fn extras<'a>(params: &[&'a syn::PatType], errors: &mut Errors) -> Vec<Extra<'a>> {
    let mut extras = Vec::with_capacity(params.len());
    let mut has_ctx = false;
    for param in params {
        match &*param.ty {
            Type::Reference(syn::TypeReference {
                mutability: Some(mutability),
                ..
            }) => errors.push(
                mutability.span(),
                "state is shared by every delivery in flight: ask for `&S`, not `&mut S` (put a Mutex inside `S` for state that changes)",
            ),
            Type::Reference(r) if is_context(&r.elem) => {
                if has_ctx {
                    errors.push(r.span(), "a handler takes `&idem::Context<'_>` once");
                }
                has_ctx = true;
                extras.push(Extra::Context);
            }
            Type::Reference(r) if matches!(&*r.elem, Type::ImplTrait(_)) => errors.push(
                r.elem.span(),
                "state is found by its type: name a concrete type, not `impl Trait`",
            ),
            Type::Reference(r) => extras.push(Extra::State(&r.elem)),
            other => errors.push(other.span(), EXTRA),
        }
    }
    extras
}

/// Whether `ty` is `Context<..>`, however qualified (`idem::Context<'_>`, `Context<'_>`).
fn is_context(ty: &Type) -> bool {
    matches!(ty, Type::Path(p) if p.qself.is_none()
        && p.path.segments.last().is_some_and(|s| s.ident == "Context"))
}

/// The transaction parameter must be `&mut` something; when its last generic argument names a
/// known database, that database must be the `store`.
fn check_tx(ty: &Type, store: Option<Store>, errors: &mut Errors) {
    let Type::Reference(reference) = ty else {
        errors.push(
            ty.span(),
            "the first parameter must be the transaction: `tx: &mut sqlx::Transaction<'_, DB>`",
        );
        return;
    };
    if reference.mutability.is_none() {
        errors.push(
            ty.span(),
            "the transaction must be borrowed mutably: `tx: &mut sqlx::Transaction<'_, DB>`",
        );
        return;
    }
    let (Some(store), Type::Path(path)) = (store, &*reference.elem) else {
        return;
    };
    let Some(PathArguments::AngleBracketed(args)) = path.path.segments.last().map(|s| &s.arguments)
    else {
        return;
    };
    let Some(GenericArgument::Type(Type::Path(db))) = args.args.iter().last() else {
        return;
    };
    let Some(db_name) = db.path.segments.last().map(|s| s.ident.to_string()) else {
        return;
    };
    if Store::named(&db_name).is_some() && db_name != store.name() {
        errors.push(
            db.span(),
            format!("this transaction is on `{db_name}`, but the handler says `store = {}`; make them match", store.name()),
        );
    }
}

/// `T` in `Result<T, E>`, `io::Result<T>`, `MyResult<T>`: the first type argument of a path
/// whose last segment is named `Result` or ends in `Result`.
fn result_ok_type(ty: &Type) -> Option<&Type> {
    let Type::Path(path) = ty else { return None };
    let last = path.path.segments.last()?;
    if path.qself.is_some() || !last.ident.to_string().ends_with("Result") {
        return None;
    }
    let PathArguments::AngleBracketed(args) = &last.arguments else {
        return None;
    };
    args.args.iter().find_map(|arg| match arg {
        GenericArgument::Type(ty) => Some(ty),
        _ => None,
    })
}

#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, span: proc_macro2::Span, message: impl std::fmt::Display) {
        let error = syn::Error::new(span, message);
        match self.0.as_mut() {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }

    fn finish(self) -> syn::Result<()> {
        self.0.map_or(Ok(()), Err)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check_str(src: &str, store: Store) -> Result<(), String> {
        let f: syn::ItemFn = syn::parse_str(src).unwrap();
        check(&f.sig, Some(store), Mode::Transactional)
            .map(drop)
            .map_err(|e| e.to_string())
    }

    #[test]
    fn accepts_handlers() {
        check_str(
            "async fn h(tx: &mut sqlx::Transaction<'_, sqlx::Postgres>, o: O) -> Result<(), E> {}",
            Store::named("Postgres").unwrap(),
        )
        .unwrap();
        check_str(
            "async fn h(tx: &mut Tx, o: O, ctx: &idem::Context<'_>) -> anyhow::Result<u8> {}",
            Store::named("Sqlite").unwrap(),
        )
        .unwrap();
        check_str(
            "async fn h(tx: &mut Tx, o: O) -> MyResult<u8> {}",
            Store::named("Sqlite").unwrap(),
        )
        .unwrap();
    }

    #[test]
    fn rejects_bad_signatures() {
        let err = |src: &str| check_str(src, Store::named("Postgres").unwrap()).unwrap_err();
        assert!(err("fn h(tx: &mut T, o: O) -> Result<(), E> {}").contains("must be `async fn`"));
        assert!(
            err("async fn h<T>(tx: &mut T, o: O) -> Result<(), E> {}")
                .contains("cannot be generic")
        );
        assert!(err("async fn h(tx: &mut T) -> Result<(), E> {}").contains("expected `(tx"));
        assert!(err("async fn h(tx: &T, o: O) -> Result<(), E> {}").contains("borrowed mutably"));
        assert!(
            err("async fn h(tx: &mut Transaction<'_, Sqlite>, o: O) -> Result<(), E> {}")
                .contains("on `Sqlite`")
        );
        assert!(err("async fn h(tx: &mut T, o: &O) -> Result<(), E> {}").contains("owned type"));
        assert!(
            err("async fn h(tx: &mut T, (a, b): O) -> Result<(), E> {}").contains("plain name")
        );
        assert!(err("async fn h(tx: &mut T, o: O) -> u32 {}").contains("must return `Result"));
        assert!(err("async fn h(tx: &mut T, o: O) {}").contains("must return `Result"));
        assert!(err("async fn h(tx: &mut T, o: O) -> Result {}").contains("must return `Result"));
    }

    #[test]
    fn parameters_after_the_payload() {
        let extras = |src: &str| {
            let f: syn::ItemFn = syn::parse_str(src).unwrap();
            check(&f.sig, Store::named("Postgres"), Mode::Transactional)
                .map(|s| {
                    s.extras
                        .iter()
                        .map(|e| match e {
                            Extra::Context => "ctx".to_owned(),
                            Extra::State(ty) => quote::quote!(#ty).to_string(),
                        })
                        .collect::<Vec<_>>()
                })
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            extras(
                "async fn h(tx: &mut T, o: O, a: &App, ctx: &idem::Context<'_>, m: &m::Mailer) -> Result<(), E> {}"
            ),
            Ok(vec![
                "App".to_owned(),
                "ctx".to_owned(),
                "m :: Mailer".to_owned()
            ])
        );
        let err = |src: &str| extras(src).unwrap_err();
        assert!(
            err("async fn h(tx: &mut T, o: O, a: &mut App) -> Result<(), E> {}")
                .contains("not `&mut S`")
        );
        assert!(
            err("async fn h(tx: &mut T, o: O, a: App) -> Result<(), E> {}")
                .contains("shared state `name: &S`")
        );
        assert!(
            err(
                "async fn h(tx: &mut T, o: O, c: &Context<'_>, d: &Context<'_>) -> Result<(), E> {}"
            )
            .contains("once")
        );
        assert!(
            err("async fn h(tx: &mut T, o: O, a: &impl Send) -> Result<(), E> {}")
                .contains("concrete type")
        );
    }

    #[test]
    fn batch_payloads() {
        let check_batch = |src: &str, mode: Mode| {
            let f: syn::ItemFn = syn::parse_str(src).unwrap();
            check(&f.sig, Store::named("Postgres"), mode)
                .map(|s| {
                    let ty = s.payload_ty;
                    (s.batch, quote::quote!(#ty).to_string())
                })
                .map_err(|e| e.to_string())
        };
        let transactional = Mode::Transactional;
        assert_eq!(
            check_batch(
                "async fn h(tx: &mut T, o: idem::Batch<Order>) -> Result<(), E> {}",
                transactional
            ),
            Ok((true, "Order".to_owned()))
        );
        assert_eq!(
            check_batch(
                "async fn h(tx: &mut T, o: Order) -> Result<(), E> {}",
                transactional
            ),
            Ok((false, "Order".to_owned()))
        );
        assert_eq!(
            check_batch(
                "async fn h(tx: &mut T, o: Batch<O>, c: &Context<'_>) -> Result<(), E> {}",
                transactional,
            ),
            Ok((true, "O".to_owned())),
            "a batch handler may take the batch's context"
        );
        let err = check_batch(
            "async fn h(o: Batch<O>) -> Result<(), E> {}",
            Mode::External,
        )
        .unwrap_err();
        assert!(err.contains("cannot be `mode = \"external\"`"), "{err}");
    }

    #[test]
    fn external_handlers_take_no_transaction() {
        let check_external = |src: &str| {
            let f: syn::ItemFn = syn::parse_str(src).unwrap();
            check(&f.sig, Store::named("Postgres"), Mode::External)
                .map(|s| (s.tx_ty.is_none(), matches!(s.extras[..], [Extra::Context])))
                .map_err(|e| e.to_string())
        };
        assert_eq!(
            check_external("async fn h(p: P, ctx: &Context<'_>) -> Result<(), E> {}"),
            Ok((true, true))
        );
        assert_eq!(
            check_external("async fn h(p: P) -> Result<(), E> {}"),
            Ok((true, false))
        );
        let err =
            check_external("async fn h(tx: &mut Tx, p: P, ctx: &Context<'_>) -> Result<(), E> {}")
                .unwrap_err();
        assert!(err.contains("external handler"), "{err}");
    }
}
