//! Durations written in attribute arguments: `"500ms"`, `"30s"`, `"15m"`, `"12h"`, `"7d"`.

use syn::LitStr;

/// Parses `lit` as a whole number followed by a unit, into milliseconds, with an error spanned
/// at the literal.
pub(crate) fn parse_millis(lit: &LitStr) -> syn::Result<u64> {
    let text = lit.value();
    let text = text.trim();
    let digits = text
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(digits);
    let unit_ms: u64 = match unit.trim() {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        _ => 0,
    };
    let millis = number
        .parse::<u64>()
        .ok()
        .filter(|_| unit_ms > 0)
        .and_then(|n| n.checked_mul(unit_ms))
        .filter(|ms| *ms > 0);
    millis.ok_or_else(|| {
        syn::Error::new(
            lit.span(),
            format!(
                "invalid duration {:?}: write a positive whole number and a unit, such as \"500ms\", \"30s\", \"15m\", \"12h\" or \"7d\"",
                lit.value()
            ),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(text: &str) -> syn::Result<u64> {
        parse_millis(&LitStr::new(text, proc_macro2::Span::call_site()))
    }

    #[test]
    fn units() {
        assert_eq!(ms("500ms").unwrap(), 500);
        assert_eq!(ms("30s").unwrap(), 30_000);
        assert_eq!(ms("15m").unwrap(), 900_000);
        assert_eq!(ms("12h").unwrap(), 43_200_000);
        assert_eq!(ms("7d").unwrap(), 604_800_000);
        for bad in [
            "",
            "30",
            "s",
            "0s",
            "1.5s",
            "-1s",
            "3 weeks",
            "99999999999999999999d",
        ] {
            assert!(ms(bad).is_err(), "{bad}");
        }
    }
}
