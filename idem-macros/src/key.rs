//! Parsing `key = "..."` into a key source, checked against the handler's parameters.

use proc_macro2::{Span, TokenStream};
use quote::{format_ident, quote, quote_spanned};
use syn::{Ident, LitStr};

/// Where the key comes from.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum KeySpec {
    MessageId,
    Header(String),
    CloudEvents,
    /// `payload.field.sub`: the segments after the payload parameter.
    Field(Vec<String>),
}

const FORMS: &str = "`message_id`, `header:<name>`, `cloudevents` or `<payload>.<field>`";

impl KeySpec {
    /// Parses the key literal; `payload` is the name of the handler's payload parameter.
    pub(crate) fn parse(lit: &LitStr, payload: &Ident) -> syn::Result<Self> {
        let text = lit.value();
        let err = |msg: String| syn::Error::new(lit.span(), msg);
        match text.as_str() {
            "message_id" => return Ok(Self::MessageId),
            "cloudevents" => return Ok(Self::CloudEvents),
            _ => {}
        }
        if let Some(name) = text.strip_prefix("header:") {
            return if name.is_empty() || name.chars().any(char::is_whitespace) {
                Err(err(format!(
                    "invalid header name {name:?} in `key`; write `header:<name>`, for example `header:x-idempotency-key`"
                )))
            } else {
                Ok(Self::Header(name.to_owned()))
            };
        }
        let root = text.split('.').next().unwrap_or_default();
        if *payload != root && !is_ident(root) {
            return Err(err(format!(
                "unknown key source {text:?}; expected {FORMS}"
            )));
        }
        field_path(lit, payload, "key", &format!(", or use {FORMS}")).map(Self::Field)
    }

    /// The `idem::KeySource` value.
    pub(crate) fn source(&self, krate: &TokenStream, lit: Option<&LitStr>) -> TokenStream {
        match self {
            Self::MessageId => quote!(#krate::KeySource::MessageId),
            Self::CloudEvents => quote!(#krate::KeySource::CloudEvents),
            Self::Header(name) => quote!(#krate::KeySource::Header(#name)),
            Self::Field(_) => {
                let text = lit.map(LitStr::value).unwrap_or_default();
                quote!(#krate::KeySource::Field(#text))
            }
        }
    }

    /// The body of the generated `key` function. Field paths become real field accesses,
    /// spanned at the key literal, so a typo is a compile error pointing at it.
    pub(crate) fn extract(
        &self,
        krate: &TokenStream,
        payload: &Ident,
        lit: Option<&LitStr>,
    ) -> TokenStream {
        match self {
            Self::Field(fields) => {
                let span = lit.map_or_else(Span::call_site, LitStr::span);
                let fallback = LitStr::new("", span);
                let access = field_access(payload, fields, lit.unwrap_or(&fallback));
                quote_spanned!(span=> #krate::field_key(#access, Self::KEY))
            }
            _ => quote!(Self::KEY.from_envelope(__idem_envelope)),
        }
    }
}

/// The fields of `<payload>.<field>...` in the literal of argument `arg`; `also` ends the
/// message when the root is not the payload.
pub(crate) fn field_path(
    lit: &LitStr,
    payload: &Ident,
    arg: &str,
    also: &str,
) -> syn::Result<Vec<String>> {
    let text = lit.value();
    let err = |msg: String| syn::Error::new(lit.span(), msg);
    let mut segments = text.split('.');
    let root = segments.next().unwrap_or_default();
    if *payload != root {
        return Err(err(format!(
            "`{root}` in `{arg}` is not the payload parameter: write `{payload}.<field>`{also}"
        )));
    }
    let fields: Vec<String> = segments.map(str::to_owned).collect();
    if fields.is_empty() && arg != "key" {
        return Err(err(format!(
            "`{arg}` names a field of the payload: write `{payload}.<field>`"
        )));
    }
    if let Some(bad) = fields
        .iter()
        .find(|f| !is_ident(f) && f.parse::<u32>().is_err())
    {
        return Err(err(format!(
            "invalid field {bad:?} in `{arg}`: expected `{payload}.<field>`"
        )));
    }
    Ok(fields)
}

/// `&payload.a.b`, spanned at `lit` so a typo is a compile error pointing at it.
pub(crate) fn field_access(payload: &Ident, fields: &[String], lit: &LitStr) -> TokenStream {
    let span = lit.span();
    let root = Ident::new(&payload.to_string(), span);
    let path = fields.iter().map(|f| match f.parse::<u32>() {
        Ok(index) => {
            let index = syn::Index { index, span };
            quote_spanned!(span=> .#index)
        }
        Err(_) => {
            let field = format_ident!("{}", f, span = span);
            quote_spanned!(span=> .#field)
        }
    });
    quote_spanned!(span=> &#root #(#path)*)
}

fn is_ident(s: &str) -> bool {
    syn::parse_str::<Ident>(s).is_ok()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proc_macro2::Span;

    fn parse(text: &str) -> syn::Result<KeySpec> {
        KeySpec::parse(
            &LitStr::new(text, Span::call_site()),
            &Ident::new("order", Span::call_site()),
        )
    }

    #[test]
    fn key_forms() {
        assert_eq!(parse("message_id").unwrap(), KeySpec::MessageId);
        assert_eq!(parse("cloudevents").unwrap(), KeySpec::CloudEvents);
        assert_eq!(
            parse("header:x-key").unwrap(),
            KeySpec::Header("x-key".into())
        );
        assert_eq!(
            parse("order.id").unwrap(),
            KeySpec::Field(vec!["id".into()])
        );
        assert_eq!(
            parse("order.meta.0").unwrap(),
            KeySpec::Field(vec!["meta".into(), "0".into()])
        );
        assert_eq!(parse("order").unwrap(), KeySpec::Field(vec![]));
    }

    #[test]
    fn key_mistakes() {
        let msg = |t: &str| parse(t).unwrap_err().to_string();
        assert!(msg("ordr.id").contains("`ordr` in `key` is not the payload parameter"));
        assert!(msg("header:").contains("invalid header name"));
        assert!(msg("message-id").contains("unknown key source"));
        assert!(msg("order.").contains("invalid field"));
    }
}
