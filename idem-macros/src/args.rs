//! Parsing the attribute's arguments, with a spanned error for each mistake.

use proc_macro2::{Span, TokenStream};
use syn::parse::Parser;
use syn::{Ident, LitStr};

/// The databases a handler can write to, as named in `store = ...`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Store {
    Postgres,
    Sqlite,
    MySql,
}

impl Store {
    pub(crate) const NAMES: &'static str = "`Postgres`, `MySql` or `Sqlite`";

    fn parse(ident: &Ident) -> syn::Result<Self> {
        match ident.to_string().as_str() {
            "Postgres" => Ok(Self::Postgres),
            "Sqlite" => Ok(Self::Sqlite),
            "MySql" => Ok(Self::MySql),
            other => Err(syn::Error::new(
                ident.span(),
                format!("unknown store `{other}`; expected {}", Self::NAMES),
            )),
        }
    }

    pub(crate) fn name(self) -> &'static str {
        match self {
            Self::Postgres => "Postgres",
            Self::Sqlite => "Sqlite",
            Self::MySql => "MySql",
        }
    }
}

/// The parsed arguments.
pub(crate) struct Args {
    pub(crate) store: (Store, Ident),
    pub(crate) key: Option<LitStr>,
    pub(crate) queue: Option<LitStr>,
    pub(crate) consumer: Option<LitStr>,
}

const EXPECTED: &str = "expected one of: `store`, `key`, `queue`, `consumer`";

impl Args {
    /// Parses `key = "...", store = Postgres, queue = "...", consumer = "..."`.
    pub(crate) fn parse(tokens: TokenStream) -> syn::Result<Self> {
        let mut store: Option<(Store, Ident)> = None;
        let mut key = None;
        let mut queue = None;
        let mut consumer = None;
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
                    let ident: Ident = meta.value()?.parse()?;
                    if let Some(e) = duplicate(store.is_some()) {
                        push(e);
                    } else {
                        match Store::parse(&ident) {
                            Ok(s) => store = Some((s, ident)),
                            Err(e) => push(e),
                        }
                    }
                }
                "key" | "queue" | "consumer" => {
                    let lit: LitStr = meta.value()?.parse()?;
                    let slot = match name.as_str() {
                        "key" => &mut key,
                        "queue" => &mut queue,
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
                    Store::NAMES
                ),
            ));
        }
        match (errors, store) {
            (Some(e), _) => Err(e),
            (None, Some(store)) => Ok(Self {
                store,
                key,
                queue,
                consumer,
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
    fn parses_all_arguments() {
        let args = Args::parse(quote!(
            key = "order.id",
            store = Postgres,
            queue = "orders",
            consumer = "billing"
        ))
        .unwrap();
        assert_eq!(args.store.0, Store::Postgres);
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
        assert!(err(quote!(store = Postgres, consumer = "")).contains("cannot be empty"));
        assert!(err(quote!(store = Postgres, key = 3)).contains("expected string literal"));
    }
}
