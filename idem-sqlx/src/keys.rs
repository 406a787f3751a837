//! How keys, message ids and the other text a record is keyed or described by are written to a
//! database whose text type cannot hold every UTF-8 string as it is: PostgreSQL's `text` refuses
//! NUL. On such a database ([`Dialect::ESCAPES_NUL`]) a text that holds NUL, or that begins
//! with [`ESCAPE`], is written as `ESCAPE` followed by the text with `ESCAPE` written `ESCAPE 1`
//! and NUL written `ESCAPE 0`; every other text is written as it is. The encoding is injective
//! (a text written as it is never begins with `ESCAPE`, an escaped one always does, and its
//! escapes read back one way), so two keys that differ in any byte stay two keys; it is
//! lossless; and it leaves every row written before it as it was.

use crate::dialect::Dialect;
use std::borrow::Cow;

/// The character an escaped text begins with, and that begins each escape in it.
pub const ESCAPE: char = '\u{1}';

/// `text` as dialect `DB` stores it.
pub fn stored<DB: Dialect>(text: &str) -> Cow<'_, str> {
    if DB::ESCAPES_NUL {
        escape(text)
    } else {
        Cow::Borrowed(text)
    }
}

/// The text that dialect `DB` stored as `stored`.
pub fn shown<DB: Dialect>(stored: String) -> String {
    if !DB::ESCAPES_NUL || !stored.starts_with(ESCAPE) {
        return stored;
    }
    match unescape(&stored) {
        Some(text) => text.into_owned(),
        None => stored,
    }
}

/// `text`, escaped when it holds NUL or begins with [`ESCAPE`].
pub fn escape(text: &str) -> Cow<'_, str> {
    if !text.contains('\0') && !text.starts_with(ESCAPE) {
        return Cow::Borrowed(text);
    }
    let mut escaped = String::with_capacity(text.len() + 8);
    escaped.push(ESCAPE);
    for c in text.chars() {
        match c {
            '\0' => escaped.extend([ESCAPE, '0']),
            ESCAPE => escaped.extend([ESCAPE, '1']),
            c => escaped.push(c),
        }
    }
    Cow::Owned(escaped)
}

/// The text [`escape`] made `stored` from; `None` for an escaped text with an escape it never
/// writes (nothing idem stored).
pub fn unescape(stored: &str) -> Option<Cow<'_, str>> {
    let Some(escaped) = stored.strip_prefix(ESCAPE) else {
        return Some(Cow::Borrowed(stored));
    };
    let mut text = String::with_capacity(escaped.len());
    let mut chars = escaped.chars();
    while let Some(c) = chars.next() {
        if c != ESCAPE {
            text.push(c);
            continue;
        }
        match chars.next() {
            Some('0') => text.push('\0'),
            Some('1') => text.push(ESCAPE),
            _ => return None,
        }
    }
    Some(Cow::Owned(text))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn round_trip(text: &str) -> String {
        unescape(&escape(text))
            .expect("escaped by escape")
            .into_owned()
    }

    #[test]
    fn plain_text_is_written_as_it_is() {
        for text in ["k", "k ", "é", "a\u{2}b", "x\u{1}"] {
            assert!(matches!(escape(text), Cow::Borrowed(t) if t == text));
        }
    }

    #[test]
    fn nul_and_the_escape_round_trip_without_nul() {
        for text in [
            "a\0b",
            "\0",
            "\u{1}",
            "\u{1}0",
            "\u{1}1",
            "\0\u{1}\0",
            "\u{1}\u{1}x\0",
        ] {
            let escaped = escape(text);
            assert!(!escaped.contains('\0'), "{escaped:?}");
            assert!(escaped.starts_with(ESCAPE));
            assert_eq!(round_trip(text), text);
        }
    }

    #[test]
    fn distinct_texts_stay_distinct() {
        let texts = [
            "a\0b",
            "a\u{1}0b",
            "\u{1}a\u{1}0b",
            "\u{1}0",
            "\0",
            "\u{1}1",
            "\u{1}",
            "",
            "a",
            "\u{1}\u{1}",
            "\u{1}a",
            "\u{1}a\0",
        ];
        let escaped: std::collections::HashSet<String> =
            texts.iter().map(|t| escape(t).into_owned()).collect();
        assert_eq!(escaped.len(), texts.len());
    }

    #[test]
    fn a_stray_escape_is_not_read_as_idem_wrote_it() {
        assert!(unescape("\u{1}a\u{1}").is_none());
        assert!(unescape("\u{1}a\u{1}2").is_none());
    }
}
