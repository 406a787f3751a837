//! placeholder
use proc_macro::TokenStream;
#[proc_macro_attribute]
/// x
pub fn idempotent(_a: TokenStream, i: TokenStream) -> TokenStream { let _ = (syn::parse_macro_input!(i as syn::ItemFn), quote::quote!(), proc_macro2::Span::call_site()); TokenStream::new() }
