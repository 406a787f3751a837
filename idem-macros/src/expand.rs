//! The expansion of `#[idempotent]`: the user's function, unchanged, plus a hidden `Handler`
//! implementation and its registration.

use crate::args::{Args, StoreArg};
use crate::key::{self, KeySpec};
use crate::signature::{self, Extra, HandlerSig};
use proc_macro2::TokenStream;
use quote::{quote, quote_spanned};
use syn::spanned::Spanned;
use syn::{ItemFn, LitStr};

/// Expands the attribute. On any error the function is re-emitted unchanged beside the
/// errors, so the rest of the crate (and the IDE) still sees it.
pub(crate) fn idempotent(args: TokenStream, item: TokenStream) -> TokenStream {
    let func: ItemFn = match syn::parse2(item.clone()) {
        Ok(func) => func,
        Err(e) => {
            let e = syn::Error::new(e.span(), "#[idempotent] goes on an `async fn` handler");
            let e = e.to_compile_error();
            return quote!(#e #item);
        }
    };
    match generate(args, &func) {
        Ok(tokens) => tokens,
        Err(e) => {
            let e = e.to_compile_error();
            quote!(#func #e)
        }
    }
}

fn generate(args: TokenStream, func: &ItemFn) -> syn::Result<TokenStream> {
    let hint = Args::mode_hint(&args);
    let args = Args::parse(args);
    let (store, mode) = match &args {
        Ok(a) => (a.store.builtin(), a.mode),
        Err(_) => (None, hint),
    };
    let sig = signature::check(&func.sig, store, mode);
    let (args, sig) = match (args, sig) {
        (Ok(args), Ok(sig)) => (args, sig),
        (Err(mut a), Err(s)) => {
            a.combine(s);
            return Err(a);
        }
        (Err(e), _) | (_, Err(e)) => return Err(e),
    };
    let key = match &args.key {
        Some(lit) => KeySpec::parse(lit, sig.payload)?,
        None => KeySpec::MessageId,
    };
    let versioned = match &args.versioned {
        Some((version, entity)) => {
            let paths = (
                key::field_path(version, sig.payload, "version", ""),
                key::field_path(entity, sig.payload, "entity", ""),
            );
            match paths {
                (Ok(v), Ok(e)) => Some((v, e)),
                (Err(mut a), Err(b)) => {
                    a.combine(b);
                    return Err(a);
                }
                (Err(e), _) | (_, Err(e)) => return Err(e),
            }
        }
        None => None,
    };
    let versioned = versioned_fn(&args, &sig, versioned);
    Ok(emit(func, &args, &sig, &key, versioned))
}

/// Where the expansion finds idem's items: `::idem::__private`, or under the path of
/// `crate = "..."`.
fn private(args: &Args) -> TokenStream {
    match &args.krate {
        Some(path) => quote!(#path::__private),
        None => quote!(::idem::__private),
    }
}

/// The `versioned` function of a versioned handler (`version` and `entity` field paths): the
/// fields read through real field accesses spanned at their literals, so a typo or a version
/// that is not an integer is a compile error there.
fn versioned_fn(
    args: &Args,
    sig: &HandlerSig<'_>,
    fields: Option<(Vec<String>, Vec<String>)>,
) -> TokenStream {
    let krate = private(args);
    let (Some((version_lit, entity_lit)), Some((version, entity))) = (&args.versioned, fields)
    else {
        return TokenStream::new();
    };
    let payload = sig.payload;
    let version_access = key::field_access(payload, &version, version_lit);
    let entity_access = key::field_access(payload, &entity, entity_lit);
    let version_value = quote_spanned!(version_lit.span()=>
        #krate::version_value(#version_access)
    );
    quote! {
        fn versioned(
            #payload: &Self::Payload,
        ) -> ::core::option::Option<
            ::core::result::Result<#krate::Versioned, #krate::VersionError>,
        > {
            ::core::option::Option::Some(#krate::versioned(
                #entity_access,
                #version_value,
                #entity_lit,
                #version_lit,
            ))
        }
    }
}

/// The user's function and, hidden beside it, its `Handler` implementation and registration.
fn emit(
    func: &ItemFn,
    args: &Args,
    sig: &HandlerSig<'_>,
    key: &KeySpec,
    versioned: TokenStream,
) -> TokenStream {
    let krate = private(args);
    let associated = associated(&krate, args, sig, key);
    let key_fn = key_fn(&krate, args, sig, key);
    let (_, _, state_types) = extras(&krate, sig);
    let kind_impl = match sig.tx_ty {
        Some(tx_ty) if sig.batch => batch_impl(&krate, func, sig, tx_ty),
        Some(tx_ty) => transactional_impl(&krate, func, sig, tx_ty),
        None => external_impl(&krate, func, args, sig),
    };
    quote! {
        #func

        #[doc(hidden)]
        const _: () = {
            struct __IdemHandler;

            impl #krate::Handler for __IdemHandler {
                #associated

                #state_types

                #versioned

                #key_fn
            }

            #kind_impl

            #krate::inventory::submit! { #krate::Registration::new(&__IdemHandler) }
        };
    }
}

/// The handler's types and constants: its store, payload, output and kind, name, consumer,
/// queue, key source, retention and batch size.
fn associated(
    krate: &TokenStream,
    args: &Args,
    sig: &HandlerSig<'_>,
    key: &KeySpec,
) -> TokenStream {
    let name_str = sig.name.to_string();
    let store = match &args.store {
        StoreArg::Builtin(_, ident) => quote!(#krate::stores::#ident),
        StoreArg::Custom(path) => quote!(#path),
    };
    let payload_ty = sig.payload_ty;
    let ok = sig.output;
    let output = match sig.batch {
        true => quote_spanned!(ok.span()=> <#ok as #krate::BatchOutput>::Item),
        false => quote!(#ok),
    };
    let consumer = match &args.consumer {
        Some(lit) => quote!(#lit),
        None => quote!(::core::concat!(::core::module_path!(), "::", #name_str)),
    };
    let queue = match &args.queue {
        Some(lit) => quote!(::core::option::Option::Some(#lit)),
        None => quote!(::core::option::Option::None),
    };
    let source = key.source(krate, args.key.as_ref());
    let millis = |ms: u64| quote!(::core::time::Duration::from_millis(#ms));
    let kind = match (sig.tx_ty, sig.batch) {
        (None, _) => quote!(#krate::kind::External),
        (Some(_), true) => quote!(#krate::kind::Batch),
        (Some(_), false) => quote!(#krate::kind::Transactional),
    };
    let retention = match args.retention_ms.map(millis) {
        Some(duration) => quote!(::core::option::Option::Some(#duration)),
        None => quote!(::core::option::Option::None),
    };
    let batch_size = args.batch.map(|size| {
        quote!(const BATCH_SIZE: ::core::option::Option<usize> = ::core::option::Option::Some(#size);)
    });
    quote! {
        type Store = #store;
        type Payload = #payload_ty;
        type Output = #output;
        type Kind = #kind;
        const NAME: &'static str = #name_str;
        const CONSUMER: &'static str = #consumer;
        const QUEUE: ::core::option::Option<&'static str> = #queue;
        const KEY: #krate::KeySource = #source;
        const RETENTION: ::core::option::Option<::core::time::Duration> = #retention;
        #batch_size
    }
}

/// The `key` function: the dedup key of a message, read from the payload's field (spanned at
/// the `key` literal, so a wrong field is an error there) or from the envelope.
fn key_fn(krate: &TokenStream, args: &Args, sig: &HandlerSig<'_>, key: &KeySpec) -> TokenStream {
    let extract = key.extract(krate, sig.payload, args.key.as_ref());
    let payload_binding = match key {
        KeySpec::Field(_) => {
            let payload = sig.payload;
            let span = args
                .key
                .as_ref()
                .map_or_else(|| payload.span(), LitStr::span);
            let payload = syn::Ident::new(&payload.to_string(), span);
            quote!(#payload)
        }
        _ => quote!(_),
    };
    quote! {
        fn key(
            __idem_envelope: &#krate::Envelope,
            #payload_binding: &Self::Payload,
        ) -> ::core::result::Result<::std::string::String, #krate::KeyError> {
            #extract
        }
    }
}

/// The future a per-message call returns; a handler whose future is not `Send` gets its error
/// at the function's name.
fn call_future(krate: &TokenStream, sig: &HandlerSig<'_>) -> TokenStream {
    quote_spanned!(sig.name.span()=>
        impl ::core::future::Future<
            Output = ::core::result::Result<Self::Output, #krate::HandlerError>,
        > + ::core::marker::Send + '__idem
    )
}

/// How the call converts the handler's return value.
fn into_result(krate: &TokenStream, sig: &HandlerSig<'_>) -> TokenStream {
    let returns = sig.returns;
    quote_spanned!(returns.span()=> <#returns as #krate::HandlerResult>::into_handler_result)
}

/// A transactional handler's kind trait: `call` runs the function with the inbox transaction
/// (the argument spanned at the user's tokens, so type errors point at the parameter at fault).
fn transactional_impl(
    krate: &TokenStream,
    func: &ItemFn,
    sig: &HandlerSig<'_>,
    tx_ty: &syn::Type,
) -> TokenStream {
    let name = sig.name;
    let (extract_state, extra_args, _) = extras(krate, sig);
    let into_result = into_result(krate, sig);
    let call_future = call_future(krate, sig);
    let tx_arg = quote_spanned!(tx_ty.span()=> __idem_tx);
    let future = quote_spanned!(func.sig.span()=>
        async move {
            #extract_state
            #into_result(#name(#tx_arg, __idem_payload #(, #extra_args)*).await)
        }
    );
    quote! {
        impl #krate::TransactionalHandler for __IdemHandler {
            fn call<'__idem, '__idem_c: '__idem>(
                __idem_tx: &'__idem mut <Self::Store as #krate::InboxStore>::Tx<'__idem_c>,
                __idem_payload: Self::Payload,
                __idem_ctx: &'__idem #krate::Context<'__idem>,
            ) -> #call_future {
                #future
            }
        }
    }
}

/// A batch handler's kind trait: `call` runs the function on the new messages of a batch.
fn batch_impl(
    krate: &TokenStream,
    func: &ItemFn,
    sig: &HandlerSig<'_>,
    tx_ty: &syn::Type,
) -> TokenStream {
    let (name, returns) = (sig.name, sig.returns);
    let (extract_state, extra_args, _) = extras(krate, sig);
    let tx_arg = quote_spanned!(tx_ty.span()=> __idem_tx);
    let into_batch = quote_spanned!(returns.span()=>
        <#returns as #krate::BatchResult>::into_batch_result
    );
    let batch_future = quote_spanned!(name.span()=>
        impl ::core::future::Future<
            Output = ::core::result::Result<
                ::std::vec::Vec<Self::Output>,
                #krate::BatchError,
            >,
        > + ::core::marker::Send + '__idem
    );
    let future = quote_spanned!(func.sig.span()=>
        async move {
            #extract_state
            let __idem_len = __idem_payload.len();
            #into_batch(#name(#tx_arg, __idem_payload #(, #extra_args)*).await, __idem_len)
        }
    );
    quote! {
        impl #krate::BatchHandler for __IdemHandler {
            fn call<'__idem, '__idem_c: '__idem>(
                __idem_tx: &'__idem mut <Self::Store as #krate::InboxStore>::Tx<'__idem_c>,
                __idem_payload: #krate::Batch<Self::Payload>,
                __idem_ctx: &'__idem #krate::Context<'__idem>,
            ) -> #batch_future {
                #future
            }
        }
    }
}

/// An external handler's kind trait: its lease, and `call` running the function outside the
/// inbox transaction.
fn external_impl(
    krate: &TokenStream,
    func: &ItemFn,
    args: &Args,
    sig: &HandlerSig<'_>,
) -> TokenStream {
    let name = sig.name;
    let (extract_state, extra_args, _) = extras(krate, sig);
    let into_result = into_result(krate, sig);
    let call_future = call_future(krate, sig);
    let lease = args.lease_ms.map(|ms| {
        quote!(const LEASE: ::core::time::Duration = ::core::time::Duration::from_millis(#ms);)
    });
    let future = quote_spanned!(func.sig.span()=>
        async move {
            #extract_state
            #into_result(#name(__idem_payload #(, #extra_args)*).await)
        }
    );
    quote! {
        impl #krate::ExternalHandler for __IdemHandler {
            #lease

            fn call<'__idem>(
                __idem_payload: Self::Payload,
                __idem_ctx: &'__idem #krate::Context<'__idem>,
            ) -> #call_future {
                #future
            }
        }
    }
}

/// For the parameters after the payload: the statements that read each state value from the
/// context, the arguments in order, and the `state_types` function listing the types (none
/// when no parameter asks for state).
fn extras(
    krate: &TokenStream,
    sig: &HandlerSig<'_>,
) -> (TokenStream, Vec<TokenStream>, TokenStream) {
    let mut reads = Vec::new();
    let mut args = Vec::new();
    let mut types = Vec::new();
    for (i, extra) in sig.extras.iter().enumerate() {
        match extra {
            Extra::Context => args.push(quote!(__idem_ctx)),
            Extra::State(ty) => {
                let binding = quote::format_ident!("__idem_state_{i}");
                // Spanned at the type, so a type that cannot be state is reported there.
                reads.push(quote_spanned!(ty.span()=>
                    let #binding: &#ty = match #krate::extract_state::<#ty>(__idem_ctx) {
                        ::core::result::Result::Ok(value) => value,
                        ::core::result::Result::Err(e) => {
                            return ::core::result::Result::Err(::core::convert::Into::into(e));
                        }
                    };
                ));
                args.push(quote!(#binding));
                types.push(quote_spanned!(ty.span()=> #krate::StateType::of::<#ty>()));
            }
        }
    }
    let state_types = (!types.is_empty()).then(|| {
        quote! {
            fn state_types() -> ::std::vec::Vec<#krate::StateType> {
                ::std::vec![#(#types),*]
            }
        }
    });
    (quote!(#(#reads)*), args, quote!(#state_types))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn expand(args: TokenStream, item: TokenStream) -> String {
        idempotent(args, item).to_string()
    }

    #[test]
    fn generates_handler_and_registration() {
        let out = expand(
            quote!(key = "order.id", store = Postgres, queue = "orders"),
            quote!(
                async fn place(tx: &mut Tx, order: Order) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(out.contains("async fn place"), "{out}");
        assert!(
            out.contains("impl :: idem :: __private :: Handler for __IdemHandler"),
            "{out}"
        );
        assert!(
            out.contains("field_key (& order . id , Self :: KEY)"),
            "{out}"
        );
        assert!(out.contains("module_path"), "{out}");
        assert!(out.contains("inventory :: submit !"), "{out}");
    }

    #[test]
    fn reads_state_from_the_context() {
        let out = expand(
            quote!(store = Postgres, queue = "orders"),
            quote!(
                async fn place(
                    tx: &mut Tx,
                    order: Order,
                    app: &App,
                    ctx: &Context<'_>,
                ) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(
            out.contains("extract_state :: < App > (__idem_ctx)"),
            "{out}"
        );
        assert!(out.contains("fn state_types ()"), "{out}");
        assert!(out.contains("StateType :: of :: < App > ()"), "{out}");
        assert!(
            out.contains("place (__idem_tx , __idem_payload , __idem_state_0 , __idem_ctx)"),
            "{out}"
        );
        let plain = expand(
            quote!(store = Postgres),
            quote!(
                async fn place(tx: &mut Tx, order: Order) -> Result<(), E> {
                    Ok(())
                }
            ),
        );
        assert!(!plain.contains("state_types"), "{plain}");
    }

    #[test]
    fn reemits_the_function_on_errors() {
        let out = expand(
            quote!(store = Oracle),
            quote!(
                fn place(tx: &mut Tx, o: O) -> u8 {
                    1
                }
            ),
        );
        assert!(out.contains("fn place"), "{out}");
        assert!(out.contains("unknown store"), "{out}");
        assert!(out.contains("must be `async fn`"), "{out}");
        assert!(!out.contains("__IdemHandler"), "{out}");
    }

    #[test]
    fn not_a_function() {
        let out = expand(
            quote!(store = Postgres),
            quote!(
                struct S;
            ),
        );
        assert!(out.contains("goes on an `async fn`"), "{out}");
        assert!(out.contains("struct S"), "{out}");
    }
}
