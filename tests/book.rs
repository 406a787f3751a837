//! The book in `docs/`: every chapter is listed in its summary, and every message the
//! troubleshooting chapter quotes occurs in the code, so the two cannot drift apart.

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
