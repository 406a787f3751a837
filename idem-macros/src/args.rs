//! Parsing the attribute's arguments, with a spanned error for each mistake.

use proc_macro2::{Span, TokenStream};
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

    /// Parses `key = "...", store = Postgres, queue = "...", consumer = "..."`.
    pub(crate) fn parse(tokens: TokenStream) -> syn::Result<Self> {
        let mut store: Option<StoreArg> = None;
        let mut key = None;
        let mut queue = None;
        let mut consumer = None;
        let mut mode: Option<Mode> = None;
        let mut lease: Option<(u64, LitStr)> = None;
        let mut retention: Option<u64> = None;
        let mut version: Option<LitStr> = None;
        let mut entity: Option<LitStr> = None;
        let mut batch: Option<usize> = None;
        let mut krate: Option<syn::Path> = None;
        let mut store_mentioned = false;
        let mut errors: Option<syn::Error> = None;
        let mut push = |e: syn::Error| match errors.as_mut() {
            Some(all) => all.combine(e),
            None => errors = Some(e),
        };

        let parser = syn::meta::parser(|meta| {
            let Some(name) = meta.path.get_ident().map(Ident::to_string) else {
                return Err(meta.error(format!("unknown argument; {EXPECTED}")));
            };
            let path = meta.path.clone();
            let duplicate = |set: bool| {
                set.then(|| syn::Error::new_spanned(&path, format!("duplicate argument `{name}`")))
            };
            match name.as_str() {
                "store" => {
                    store_mentioned = true;
                    let path: syn::Path = meta.value()?.parse()?;
                    if let Some(e) = duplicate(store.is_some()) {
                        push(e);
                    } else {
                        match StoreArg::parse(path) {
                            Ok(s) => store = Some(s),
                            Err(e) => push(e),
                        }
                    }
                }
                "key" | "queue" | "consumer" | "version" | "entity" => {
                    let lit: LitStr = meta.value()?.parse()?;
                    let slot = match name.as_str() {
                        "key" => &mut key,
                        "queue" => &mut queue,
                        "version" => &mut version,
                        "entity" => &mut entity,
                        _ => &mut consumer,
                    };
                    if let Some(e) = duplicate(slot.is_some()) {
                        push(e);
                    } else if lit.value().trim().is_empty() {
                        push(syn::Error::new(
                            lit.span(),
                            format!("`{name}` cannot be empty"),
                        ));
                    } else {
                        *slot = Some(lit);
                    }
                }
                "crate" => {
                    let lit: LitStr = meta.value()?.parse()?;
                    if let Some(e) = duplicate(krate.is_some()) {
                        push(e);
                    } else {
                        match lit.parse::<syn::Path>() {
                            Ok(path) => krate = Some(path),
                            Err(_) => push(syn::Error::new(
                                lit.span(),
                                "`crate` is the path idem is reachable at, such as \"::my_idem\" or \"crate::reexported::idem\"",
                            )),
                        }
                    }
                }
                "batch" => {
                    let lit: syn::LitInt = meta.value()?.parse()?;
                    if let Some(e) = duplicate(batch.is_some()) {
                        push(e);
                    } else {
                        match lit.base10_parse::<usize>() {
                            Ok(size @ 1..=32_767) => batch = Some(size),
                            _ => push(syn::Error::new(
                                lit.span(),
                                "`batch` is the deliveries per batch: 1 to 32767 (twice it must fit in a prefetch)",
                            )),
                        }
                    }
                }
                "mode" => {
                    let lit: LitStr = meta.value()?.parse()?;
                    if let Some(e) = duplicate(mode.is_some()) {
                        push(e);
                    } else {
                        match lit.value().as_str() {
                            "transactional" => mode = Some(Mode::Transactional),
                            "external" => mode = Some(Mode::External),
                            other => push(syn::Error::new(
                                lit.span(),
                                format!(
                                    "unknown mode {other:?}; expected \"transactional\" or \"external\""
                                ),
                            )),
                        }
                    }
                }
                "lease" | "retention" => {
                    let lit: LitStr = meta.value()?.parse()?;
                    let set = if name == "lease" {
                        lease.is_some()
                    } else {
                        retention.is_some()
                    };
                    if let Some(e) = duplicate(set) {
                        push(e);
                    } else {
                        match crate::duration::parse_millis(&lit) {
                            Ok(ms) if name == "lease" => lease = Some((ms, lit)),
                            Ok(ms) if ms < 1_000 => push(syn::Error::new(
                                lit.span(),
                                "the retention must be at least one second",
                            )),
                            Ok(ms) => retention = Some(ms),
                            Err(e) => push(e),
                        }
                    }
                }
                _ => {
                    // Skip the value so the next argument still parses.
                    if meta.input.peek(syn::Token![=]) {
                        let _: syn::Expr = meta.value()?.parse()?;
                    }
                    push(syn::Error::new_spanned(
                        &meta.path,
                        format!("unknown argument `{name}`; {EXPECTED}"),
                    ));
                }
            }
            Ok(())
        });
        parser.parse2(tokens)?;

        if !store_mentioned {
            push(syn::Error::new(
                Span::call_site(),
                format!(
                    "missing `store = ...`: which database holds the inbox, {}",
                    Store::names()
                ),
            ));
        }
        let mode = mode.unwrap_or(Mode::Transactional);
        if let (Some((_, lit)), Mode::Transactional) = (&lease, mode) {
            push(syn::Error::new(
                lit.span(),
                "`lease` applies to `mode = \"external\"` only: a transactional handler's claim lasts as long as its transaction",
            ));
        }
        let versioned = match (version, entity) {
            (Some(version), Some(entity)) => Some((version, entity)),
            (Some(version), None) => {
                push(syn::Error::new(
                    version.span(),
                    "`version` needs `entity = \"<payload>.<field>\"`: the entity whose versions it counts (such as \"update.order_id\")",
                ));
                None
            }
            (None, Some(entity)) => {
                push(syn::Error::new(
                    entity.span(),
                    "`entity` goes with `version = \"<payload>.<field>\"`: the version the message carries",
                ));
                None
            }
            (None, None) => None,
        };
        if let (Some((version, _)), Mode::External) = (&versioned, mode) {
            push(syn::Error::new(
                version.span(),
                "`version` needs the handler's transaction, where the applied version is raised with its writes: use mode = \"transactional\"",
            ));
        }
        match (errors, store) {
            (Some(e), _) => Err(e),
            (None, Some(store)) => Ok(Self {
                store,
                key,
                queue,
                consumer,
                mode,
                lease_ms: lease.map(|(ms, _)| ms),
                retention_ms: retention,
                versioned,
                batch,
                krate,
            }),
            (None, None) => Err(syn::Error::new(Span::call_site(), "missing `store`")),
        }
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
