//! The orders example built with fault injection (`IDEM_FAULT`), for tests that crash it.

use std::path::PathBuf;
use std::process::Command;

/// Builds the orders example with fault injection into its own target directory (so the
/// regular build of the example stays without it) and returns the binary.
pub fn build() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let target = root.join("target").join("chaos");
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut build = Command::new(cargo);
    build
        .current_dir(&root)
        .args([
            "build",
            "--example",
            "orders",
            "--features",
            "fault-injection",
            "--target-dir",
        ])
        .arg(&target);
    if !cfg!(debug_assertions) {
        build.arg("--release");
    }
    let status = build.status().expect("run cargo");
    assert!(
        status.success(),
        "building the orders example with fault-injection failed"
    );
    target
        .join(if cfg!(debug_assertions) {
            "debug"
        } else {
            "release"
        })
        .join("examples")
        .join("orders")
}
