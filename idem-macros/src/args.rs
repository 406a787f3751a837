//! Parsing the attribute's arguments, with a spanned error for each mistake.

use proc_macro2::{Span, TokenStream};
use syn::meta::ParseNestedMeta;
use syn::parse::Parser;
use syn::{Ident, LitStr};

/// The databases a handler can write to, as `store = ...` and sqlx's database types name them.
/// The one list to extend when idem-sqlx gains a dialect (its `stores` module holds the types).
pub(crate) const STORES: [&str; 3] = ["Postgres", "MySql", "Sqlite"];

/// A database named in `store = ...`, one of [`STORES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Store(&'static str);

impl Store {
    /// The store named `name`, if it is one of [`STORES`].
    pub(crate) fn named(name: &str) -> Option<Self> {
        STORES
            .iter()
            .find(|known| **known == name)
            .map(|known| Self(known))
    }

    /// The list of stores for messages: "`Postgres`, `MySql` or `Sqlite`".
    pub(crate) fn names() -> String {
        let quoted: Vec<String> = STORES.iter().map(|name| format!("`{name}`")).collect();
        match quoted.split_last() {
            Some((last, [])) => last.clone(),
            Some((last, rest)) => format!("{} or {last}", rest.join(", ")),
            None => String::new(),
        }
    }

    fn parse(ident: &Ident) -> syn::Result<Self> {
        let name = ident.to_string();
        Self::named(&name).ok_or_else(|| {
            syn::Error::new(
                ident.span(),
                format!(
                    "unknown store `{name}`; expected {}, or the path of a type implementing `idem::store::RuntimeStore` (`crate::{name}`)",
                    Self::names()
                ),
            )
        })
    }

    pub(crate) fn name(self) -> &'static str {
        self.0
    }
}

/// What `store = ...` names: a built-in database by name (`Postgres`), or a store of the user's
/// own by its path (`crate::Ledger`, two segments or more, so that a misspelt name is still an
/// error).
#[derive(Clone)]
pub(crate) enum StoreArg {
    /// One of [`STORES`], and the name as written.
    Builtin(Store, Ident),
    /// The path of a type implementing `RuntimeStore`; the compiler checks that it does.
    Custom(syn::Path),
}

impl StoreArg {
    fn parse(path: syn::Path) -> syn::Result<Self> {
        match path.get_ident() {
            Some(ident) => Store::parse(ident).map(|store| Self::Builtin(store, ident.clone())),
            None => Ok(Self::Custom(path)),
        }
    }

    /// The built-in database, for the signature's check of the transaction type.
    pub(crate) fn builtin(&self) -> Option<Store> {
        match self {
            Self::Builtin(store, _) => Some(*store),
            Self::Custom(_) => None,
        }
    }
}

/// `mode = "..."`: where the handler's work goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Mode {
    /// In the inbox transaction (the default).
    Transactional,
    /// Outside any transaction, under a lease.
    External,
}

/// The parsed arguments.
pub(crate) struct Args {
    pub(crate) store: StoreArg,
    pub(crate) key: Option<LitStr>,
    pub(crate) queue: Option<LitStr>,
    pub(crate) consumer: Option<LitStr>,
    pub(crate) mode: Mode,
    /// The lease in milliseconds (external mode).
    pub(crate) lease_ms: Option<u64>,
    /// The retention in milliseconds.
    pub(crate) retention_ms: Option<u64>,
    /// `version = "..."` and `entity = "..."`: the payload fields of a versioned handler.
    pub(crate) versioned: Option<(LitStr, LitStr)>,
    /// `batch = N`: the deliveries per batch.
    pub(crate) batch: Option<usize>,
    /// `crate = "path"`: where the expansion finds idem, for a renamed or re-exported
    /// dependency (default `::idem`).
    pub(crate) krate: Option<syn::Path>,
}

const EXPECTED: &str = "expected one of: `store`, `key`, `queue`, `consumer`, `mode`, `lease`, `retention`, `version`, `entity`, `batch`, `crate`";

impl Args {
    /// The mode the arguments ask for, read even when they do not parse, so that the signature
    /// is checked against the right shape.
    pub(crate) fn mode_hint(tokens: &TokenStream) -> Mode {
        let tokens: Vec<_> = tokens.clone().into_iter().collect();
        let external = tokens.windows(3).any(|w| {
            matches!(&w[0], proc_macro2::TokenTree::Ident(i) if i == "mode")
                && matches!(&w[2], proc_macro2::TokenTree::Literal(l) if l.to_string() == "\"external\"")
        });
        if external {
            Mode::External
        } else {
            Mode::Transactional
        }
    }

    /// Parses `key = "...", store = Postgres, queue = "...", consumer = "..."`: each argument
    /// by its own type, every mistake reported at its token; then the arguments checked
    /// against each other.
    pub(crate) fn parse(tokens: TokenStream) -> syn::Result<Self> {
        let mut written = Written::default();
        let mut errors = Errors::default();
        syn::meta::parser(|meta| written.take(&meta, &mut errors)).parse2(tokens)?;
        written.check(errors)
    }
}

/// Every mistake found, reported together.
#[derive(Default)]
struct Errors(Option<syn::Error>);

impl Errors {
    fn push(&mut self, error: syn::Error) {
        match self.0.as_mut() {
            Some(all) => all.combine(error),
            None => self.0 = Some(error),
        }
    }
}

/// An argument given at most once: the second is an error at its name.
struct Slot<T>(Option<T>);

impl<T> Default for Slot<T> {
    fn default() -> Self {
        Self(None)
    }
}

impl<T> Slot<T> {
    /// Keeps `value`, or reports why it cannot: a duplicate, or what the value's type said.
    fn fill(&mut self, path: &syn::Path, value: syn::Result<T>, errors: &mut Errors) {
        if self.0.is_some() {
            let name = path.get_ident().map(Ident::to_string).unwrap_or_default();
            errors.push(syn::Error::new_spanned(
                path,
                format!("duplicate argument `{name}`"),
            ));
            return;
        }
        match value {
            Ok(value) => self.0 = Some(value),
            Err(e) => errors.push(e),
        }
    }
}

/// The value of one argument: read from `name = value`, where a value of the wrong kind of
/// token ends the parse (`Err` outside) and a value that is wrong for the argument is one
/// mistake among others (`Err` inside).
trait Argument: Sized {
    fn read(meta: &ParseNestedMeta<'_>) -> syn::Result<syn::Result<Self>>;
}

/// `key`, `queue`, `consumer`, `version`, `entity`: a string that is not blank.
struct Text(LitStr);

impl Argument for Text {
    fn read(meta: &ParseNestedMeta<'_>) -> syn::Result<syn::Result<Self>> {
        let lit: LitStr = meta.value()?.parse()?;
        let name = meta
            .path
            .get_ident()
            .map(Ident::to_string)
            .unwrap_or_default();
        Ok(match lit.value().trim().is_empty() {
            true => Err(syn::Error::new(
                lit.span(),
                format!("`{name}` cannot be empty"),
            )),
            false => Ok(Self(lit)),
        })
    }
}

impl Argument for StoreArg {
    fn read(meta: &ParseNestedMeta<'_>) -> syn::Result<syn::Result<Self>> {
        let path: syn::Path = meta.value()?.parse()?;
        Ok(Self::parse(path))
    }
}

/// `crate = "path"`.
struct Krate(syn::Path);

impl Argument for Krate {
    fn read(meta: &ParseNestedMeta<'_>) -> syn::Result<syn::Result<Self>> {
        let lit: LitStr = meta.value()?.parse()?;
        Ok(lit.parse::<syn::Path>().map(Self).map_err(|_| {
            syn::Error::new(
                lit.span(),
                "`crate` is the path idem is reachable at, such as \"::my_idem\" or \"crate::reexported::idem\"",
            )
        }))
    }
}

/// `batch = N`.
struct Batch(usize);

impl Argument for Batch {
    fn read(meta: &ParseNestedMeta<'_>) -> syn::Result<syn::Result<Self>> {
        let lit: syn::LitInt = meta.value()?.parse()?;
        Ok(match lit.base10_parse::<usize>() {
            Ok(size @ 1..=32_767) => Ok(Self(size)),
            _ => Err(syn::Error::new(
                lit.span(),
                "`batch` is the deliveries per batch: 1 to 32767 (twice it must fit in a prefetch)",
            )),
        })
    }
}

impl Argument for Mode {
    fn read(meta: &ParseNestedMeta<'_>) -> syn::Result<syn::Result<Self>> {
        let lit: LitStr = meta.value()?.parse()?;
        Ok(match lit.value().as_str() {
            "transactional" => Ok(Mode::Transactional),
            "external" => Ok(Mode::External),
            other => Err(syn::Error::new(
                lit.span(),
                format!("unknown mode {other:?}; expected \"transactional\" or \"external\""),
            )),
        })
    }
}

/// `lease = "..."`: a duration, in milliseconds, and where it was written.
struct Lease(u64, LitStr);

impl Argument for Lease {
    fn read(meta: &ParseNestedMeta<'_>) -> syn::Result<syn::Result<Self>> {
        let lit: LitStr = meta.value()?.parse()?;
        Ok(crate::duration::parse_millis(&lit).map(|ms| Self(ms, lit)))
    }
}

/// `retention = "..."`: a duration of a second or more, in milliseconds.
struct Retention(u64);

impl Argument for Retention {
    fn read(meta: &ParseNestedMeta<'_>) -> syn::Result<syn::Result<Self>> {
        let lit: LitStr = meta.value()?.parse()?;
        Ok(match crate::duration::parse_millis(&lit) {
            Ok(ms) if ms < 1_000 => Err(syn::Error::new(
                lit.span(),
                "the retention must be at least one second",
            )),
            Ok(ms) => Ok(Self(ms)),
            Err(e) => Err(e),
        })
    }
}

/// The arguments as written, each checked on its own.
#[derive(Default)]
struct Written {
    store: Slot<StoreArg>,
    /// Whether `store` was written at all (a store it could not name is still mentioned).
    store_mentioned: bool,
    key: Slot<Text>,
    queue: Slot<Text>,
    consumer: Slot<Text>,
    version: Slot<Text>,
    entity: Slot<Text>,
    mode: Slot<Mode>,
    lease: Slot<Lease>,
    retention: Slot<Retention>,
    batch: Slot<Batch>,
    krate: Slot<Krate>,
}

impl Written {
    /// Takes one `name = value`.
    fn take(&mut self, meta: &ParseNestedMeta<'_>, errors: &mut Errors) -> syn::Result<()> {
        let Some(name) = meta.path.get_ident().map(Ident::to_string) else {
            return Err(meta.error(format!("unknown argument; {EXPECTED}")));
        };
        let path = &meta.path;
        match name.as_str() {
            "store" => {
                self.store_mentioned = true;
                self.store.fill(path, StoreArg::read(meta)?, errors);
            }
            "key" => self.key.fill(path, Text::read(meta)?, errors),
            "queue" => self.queue.fill(path, Text::read(meta)?, errors),
            "consumer" => self.consumer.fill(path, Text::read(meta)?, errors),
            "version" => self.version.fill(path, Text::read(meta)?, errors),
            "entity" => self.entity.fill(path, Text::read(meta)?, errors),
            "mode" => self.mode.fill(path, Mode::read(meta)?, errors),
            "lease" => self.lease.fill(path, Lease::read(meta)?, errors),
            "retention" => self.retention.fill(path, Retention::read(meta)?, errors),
            "batch" => self.batch.fill(path, Batch::read(meta)?, errors),
            "crate" => self.krate.fill(path, Krate::read(meta)?, errors),
            _ => {
                // Skip the value so the next argument still parses.
                if meta.input.peek(syn::Token![=]) {
                    let _: syn::Expr = meta.value()?.parse()?;
                }
                errors.push(syn::Error::new_spanned(
                    path,
                    format!("unknown argument `{name}`; {EXPECTED}"),
                ));
            }
        }
        Ok(())
    }

    /// The arguments, checked against each other; every mistake when there is any.
    fn check(self, mut errors: Errors) -> syn::Result<Args> {
        if !self.store_mentioned {
            errors.push(syn::Error::new(
                Span::call_site(),
                format!(
                    "missing `store = ...`: which database holds the inbox, {}",
                    Store::names()
                ),
            ));
        }
        let mode = self.mode.0.unwrap_or(Mode::Transactional);
        if let (Some(Lease(_, lit)), Mode::Transactional) = (&self.lease.0, mode) {
            errors.push(syn::Error::new(
                lit.span(),
                "`lease` applies to `mode = \"external\"` only: a transactional handler's claim lasts as long as its transaction",
            ));
        }
        let versioned = versioned(self.version.0, self.entity.0, mode, &mut errors);
        match (errors.0, self.store.0) {
            (Some(e), _) => Err(e),
            (None, Some(store)) => Ok(Args {
                store,
                key: self.key.0.map(|t| t.0),
                queue: self.queue.0.map(|t| t.0),
                consumer: self.consumer.0.map(|t| t.0),
                mode,
                lease_ms: self.lease.0.map(|Lease(ms, _)| ms),
                retention_ms: self.retention.0.map(|Retention(ms)| ms),
                versioned,
                batch: self.batch.0.map(|Batch(size)| size),
                krate: self.krate.0.map(|Krate(path)| path),
            }),
            (None, None) => Err(syn::Error::new(Span::call_site(), "missing `store`")),
        }
    }
}

/// `version` and `entity`, which go together, and only in a transactional handler.
fn versioned(
    version: Option<Text>,
    entity: Option<Text>,
    mode: Mode,
    errors: &mut Errors,
) -> Option<(LitStr, LitStr)> {
    match (version, entity) {
        (Some(Text(version)), Some(Text(entity))) => {
            if mode == Mode::External {
                errors.push(syn::Error::new(
                    version.span(),
                    "`version` needs the handler's transaction, where the applied version is raised with its writes: use mode = \"transactional\"",
                ));
            }
            Some((version, entity))
        }
        (Some(Text(version)), None) => {
            errors.push(syn::Error::new(
                version.span(),
                "`version` needs `entity = \"<payload>.<field>\"`: the entity whose versions it counts (such as \"update.order_id\")",
            ));
            None
        }
        (None, Some(Text(entity))) => {
            errors.push(syn::Error::new(
                entity.span(),
                "`entity` goes with `version = \"<payload>.<field>\"`: the version the message carries",
            ));
            None
        }
        (None, None) => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use quote::quote;

    fn err(tokens: TokenStream) -> String {
        match Args::parse(tokens) {
            Ok(_) => panic!("expected an error"),
            Err(e) => e.to_string(),
        }
    }

    #[test]
    fn crate_is_a_path_where_idem_is_reached() {
        let args = Args::parse(quote!(store = Postgres, crate = "::my_idem")).unwrap();
        let path = args.krate.unwrap();
        assert_eq!(quote!(#path).to_string(), quote!(::my_idem).to_string());
        assert!(
            err(quote!(store = Postgres, crate = "not a path")).contains("`crate` is the path")
        );
        assert!(
            err(quote!(store = Postgres, crate = "::a", crate = "::b"))
                .contains("duplicate argument `crate`")
        );
    }

    #[test]
    fn parses_all_arguments() {
        let args = Args::parse(quote!(
            key = "order.id",
            store = Postgres,
            queue = "orders",
            consumer = "billing"
        ))
        .unwrap();
        assert_eq!(args.store.builtin(), Store::named("Postgres"));
        assert_eq!(args.key.unwrap().value(), "order.id");
        assert_eq!(args.queue.unwrap().value(), "orders");
        assert_eq!(args.consumer.unwrap().value(), "billing");
        assert!(Args::parse(quote!(store = Sqlite)).unwrap().key.is_none());
    }

    #[test]
    fn reports_each_mistake() {
        let all = |t: TokenStream| match Args::parse(t) {
            Ok(_) => panic!("expected errors"),
            Err(e) => e.into_iter().map(|e| e.to_string()).collect::<Vec<_>>(),
        };
        assert_eq!(all(quote!(colour = 1, store = Oracle)).len(), 2);
        assert!(
            err(quote!(store = Postgres, colour = "red")).contains("unknown argument `colour`")
        );
        assert!(
            err(quote!(store = Postgres, key = "a.b", key = "a.c"))
                .contains("duplicate argument `key`")
        );
        assert!(err(quote!(key = "a.b")).contains("missing `store"));
        assert!(err(quote!(store = Oracle)).contains("unknown store `Oracle`"));
        assert!(err(quote!(store = Oracle)).contains("`crate::Oracle`"));
        let custom = Args::parse(quote!(store = crate::stores::Ledger)).unwrap();
        assert!(matches!(&custom.store, StoreArg::Custom(p) if p.segments.len() == 3));
        assert_eq!(custom.store.builtin(), None);
        assert!(err(quote!(store = Postgres, consumer = "")).contains("cannot be empty"));
        assert!(err(quote!(store = Postgres, key = 3)).contains("expected string literal"));
        assert!(err(quote!(store = Postgres, version = "u.v")).contains("needs `entity"));
        assert!(err(quote!(store = Postgres, entity = "u.id")).contains("goes with `version"));
        assert!(
            err(quote!(
                store = Postgres,
                mode = "external",
                version = "u.v",
                entity = "u.id"
            ))
            .contains("needs the handler's transaction")
        );
        assert!(err(quote!(store = Postgres, batch = 0)).contains("1 to 32767"));
        assert!(err(quote!(store = Postgres, batch = "9")).contains("expected integer literal"));
        assert_eq!(
            Args::parse(quote!(store = Postgres, batch = 500))
                .unwrap()
                .batch,
            Some(500)
        );
        let versioned = Args::parse(quote!(store = Sqlite, version = "u.v", entity = "u.id"));
        let (version, entity) = versioned.unwrap().versioned.unwrap();
        assert_eq!(
            (version.value(), entity.value()),
            ("u.v".into(), "u.id".into())
        );
    }
}
