//! Printing: aligned text for people, JSON for scripts, and how times read.

use serde_json::Value;
use std::time::{SystemTime, UNIX_EPOCH};

/// Prints `value` as one JSON document.
pub fn json(value: &Value) {
    println!("{value:#}");
}

/// Prints `rows` under `header`, each column as wide as its widest cell.
pub fn table(header: &[&str], rows: &[Vec<String>]) {
    let mut widths: Vec<usize> = header.iter().map(|h| h.chars().count()).collect();
    for row in rows {
        for (width, cell) in widths.iter_mut().zip(row) {
            *width = (*width).max(cell.chars().count());
        }
    }
    let line = |cells: Vec<&str>| {
        let padded: Vec<String> = cells
            .iter()
            .zip(&widths)
            .map(|(cell, width)| format!("{cell:<width$}"))
            .collect();
        println!("{}", padded.join("  ").trim_end());
    };
    line(header.to_vec());
    for row in rows {
        line(row.iter().map(String::as_str).collect());
    }
}

/// How long ago `ms` (milliseconds since the Unix epoch) was, as `3d 4h`, `12m 5s`, `800ms`.
pub fn age(ms: i64) -> String {
    let elapsed = now_ms().saturating_sub(ms);
    if elapsed < 0 {
        return format!("in {}", span(-elapsed));
    }
    format!("{} ago", span(elapsed))
}

/// Now, in milliseconds since the Unix epoch.
pub fn now_ms() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_millis()).unwrap_or(i64::MAX))
}

/// `ms` milliseconds, in the two largest units.
pub fn span(ms: i64) -> String {
    let s = ms / 1000;
    match s {
        _ if ms < 1000 => format!("{ms}ms"),
        0..60 => format!("{s}s"),
        60..3600 => format!("{}m {}s", s / 60, s % 60),
        3600..86400 => format!("{}h {}m", s / 3600, s % 3600 / 60),
        _ => format!("{}d {}h", s / 86400, s % 86400 / 3600),
    }
}

/// `text`, cut to `max` characters with an ellipsis.
pub fn cut(text: &str, max: usize) -> String {
    if text.chars().count() <= max {
        return text.to_owned();
    }
    let mut cut: String = text.chars().take(max.saturating_sub(1)).collect();
    cut.push('…');
    cut
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spans_read_in_two_units() {
        assert_eq!(span(999), "999ms");
        assert_eq!(span(59_000), "59s");
        assert_eq!(span(61_000), "1m 1s");
        assert_eq!(span(3_600_000 * 26), "1d 2h");
        assert_eq!(cut("abcdef", 4), "abc…");
        assert_eq!(cut("abc", 4), "abc");
    }
}
