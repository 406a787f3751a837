//! The book in `docs/`: every chapter is listed in its summary, every message the
//! troubleshooting chapter quotes occurs in the code, and the reference page names every
//! setting, reason code and metric the code has, so that they cannot drift apart.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

use std::path::{Path, PathBuf};

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`.
fn sources(dir: &Path, found: &mut Vec<PathBuf>) {
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        if path.is_dir() {
            sources(&path, found);
        } else if path.extension().is_some_and(|e| e == "rs") {
            found.push(path);
        }
    }
}

#[test]
fn every_troubleshooting_message_occurs_in_the_code() {
    let chapter = std::fs::read_to_string(root().join("docs/src/troubleshooting.md")).unwrap();
    let messages: Vec<&str> = chapter
        .lines()
        .filter_map(|line| line.strip_prefix("**Message** `"))
        .map(|rest| rest.strip_suffix('`').unwrap())
        .collect();
    assert!(messages.len() >= 10, "{messages:?}");
    let mut files = Vec::new();
    for dir in [
        "src",
        "examples",
        "tests/common",
        "idem-core/src",
        "idem-sqlx/src",
        "idem-rabbitmq/src",
        "idem-nats/src",
        "idem-http/src",
        "idem-cli/src",
    ] {
        sources(&root().join(dir), &mut files);
    }
    // Messages are sometimes split over lines with `\` continuations.
    let code: String = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect::<Vec<_>>()
        .join("\n")
        .replace("\\\n", "")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .replace("\\\"", "\"");
    for message in messages {
        assert!(
            code.contains(message),
            "not in the code any more: {message}"
        );
    }
}

#[test]
fn every_chapter_is_in_the_summary() {
    let summary = std::fs::read_to_string(root().join("docs/src/SUMMARY.md")).unwrap();
    for entry in std::fs::read_dir(root().join("docs/src")).unwrap() {
        let name = entry.unwrap().file_name().to_string_lossy().into_owned();
        if name.ends_with(".md") && name != "SUMMARY.md" {
            assert!(
                summary.contains(&format!("({name})")),
                "{name} is not in SUMMARY.md"
            );
        }
    }
}

/// Whether `code` defines the item `name` (a type, trait, function, constant or variant).
fn defines(code: &str, name: &str) -> bool {
    let kinds = [
        "struct", "enum", "trait", "type", "fn", "const", "static", "mod",
    ];
    kinds
        .iter()
        .any(|kind| code.contains(&format!("{kind} {name}")))
        || code.contains(&format!("    {name}(")) // a tuple variant
        || code.contains(&format!("    {name} {{")) // a struct variant
        || code.contains(&format!("    {name},")) // a unit variant
}

/// The transport kit the "Adding a transport" chapter walks through is the code's: every item it
/// names in code spans (`Session`, `Began::consuming`, `OutboundError::Unroutable`, …) is
/// defined in the library (or in the tests' fixture it names), so a rename or a removal fails
/// here.
#[test]
fn every_item_the_transport_chapter_names_is_in_the_code() {
    let chapter = std::fs::read_to_string(root().join("docs/src/adding-a-transport.md")).unwrap();
    let mut files = Vec::new();
    let dirs = [
        "src",
        "idem-core/src",
        "idem-rabbitmq/src",
        "idem-nats/src",
        "tests/common",
    ];
    for dir in dirs {
        sources(&root().join(dir), &mut files);
    }
    let code: String = files
        .iter()
        .map(|f| std::fs::read_to_string(f).unwrap())
        .collect::<Vec<_>>()
        .join("\n");
    let mut named = Vec::new();
    for (n, span) in chapter.split('`').enumerate() {
        // Odd pieces are inside code spans; items are CamelCase paths (`Type`, `Type::item`).
        let path = span.trim_start_matches("idem::transport::");
        let is_item = path.split("::").all(|segment| {
            !segment.is_empty()
                && segment
                    .chars()
                    .all(|c| c.is_ascii_alphanumeric() || c == '_')
        }) && path.starts_with(|c: char| c.is_ascii_uppercase());
        if n % 2 == 1 && is_item {
            named.push(path.to_owned());
        }
    }
    assert!(named.len() >= 20, "{named:?}");
    let missing: Vec<&String> = named
        .iter()
        .filter(|path| !path.split("::").all(|segment| defines(&code, segment)))
        .collect();
    assert!(
        missing.is_empty(),
        "named by the chapter, not in the code: {missing:?}"
    );
}

/// The public methods `file` defines (`pub fn name`), but `skip`.
fn public_methods(file: &str, skip: &[&str]) -> Vec<String> {
    std::fs::read_to_string(root().join(file))
        .unwrap()
        .lines()
        .filter_map(|line| line.trim_start().strip_prefix("pub fn "))
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect::<String>()
        })
        .filter(|name| !skip.contains(&name.as_str()))
        .collect()
}

/// The reference page has a row for every method of `RuntimeBuilder`, `RabbitConfig` and
/// `NatsConfig`, every metric idem exports and every dead-letter reason code idem writes.
#[test]
fn the_reference_names_every_setting_reason_and_metric() {
    let page = std::fs::read_to_string(root().join("docs/src/reference.md")).unwrap();
    let mut missing = Vec::new();
    for (file, skip) in [
        (
            "idem-core/src/runtime/builder.rs",
            &["builder", "build"][..],
        ),
        ("idem-rabbitmq/src/config.rs", &[][..]),
        ("idem-nats/src/config.rs", &["redacted_url"][..]),
        ("idem-sqlx/src/inbox.rs", &["config", "pool"][..]),
    ] {
        let methods = public_methods(file, skip);
        assert!(methods.len() >= 6, "{file}: {methods:?}");
        for method in methods {
            if !page.contains(&format!("`{method}(")) {
                missing.push(format!("{file}: {method}"));
            }
        }
    }
    for file in [
        "idem-core/src/telemetry/metrics.rs",
        "idem-http/src/telemetry.rs",
    ] {
        let code = std::fs::read_to_string(root().join(file)).unwrap();
        for line in code
            .lines()
            .filter(|l| l.starts_with("pub const ") && l.contains("\"idem_"))
        {
            let metric = line.split('"').nth(1).unwrap();
            if !page.contains(&format!("`{metric}`")) {
                missing.push(format!("metric {metric}"));
            }
        }
    }
    for reason in idem::telemetry::REASONS {
        if !page.contains(&format!("| `{reason}` |")) {
            missing.push(format!("reason {reason}"));
        }
    }
    assert!(
        missing.is_empty(),
        "not on the reference page: {missing:#?}"
    );
}
