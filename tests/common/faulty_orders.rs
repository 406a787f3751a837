//! The orders example built with fault injection (`IDEM_FAULT`), for tests that crash it.
//!
//! It is built in the tests' own target directory, so that only idem's crates are compiled
//! again with the feature (a directory of its own would compile every dependency a second
//! time). Cargo links the last build of an example to `examples/orders`; the build with the
//! feature keeps its own hashed file, which is what the tests run, and `examples/orders` is
//! linked back to the build it was before, the one the other tests run.
//!
//! The build runs without the variables cargo sets for a test process (`CARGO_MANIFEST_DIR`,
//! `CARGO_PKG_*`, …): build scripts that track one of them (ring's tracks
//! `CARGO_MANIFEST_DIR`) would otherwise see it change between this build and the next
//! `cargo test`, and each would compile ring, rustls, sqlx and idem's crates again for the
//! other.

#![allow(dead_code)] // each test binary uses part of the helpers

use std::os::unix::fs::MetadataExt as _;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

/// Builds the orders example with fault injection (once per test binary) and returns the
/// binary.
pub fn build() -> PathBuf {
    static BUILT: OnceLock<PathBuf> = OnceLock::new();
    BUILT.get_or_init(build_once).clone()
}

/// The hashed file of `examples/` that `linked` is a link of.
fn hashed_twin(linked: &Path) -> Option<PathBuf> {
    let inode = std::fs::metadata(linked).ok()?.ino();
    let prefix = format!("{}-", linked.file_name()?.to_str()?);
    std::fs::read_dir(linked.parent()?)
        .ok()?
        .filter_map(Result::ok)
        .map(|entry| entry.path())
        .find(|path| {
            path.file_name()
                .and_then(|name| name.to_str())
                .is_some_and(|name| name.starts_with(&prefix) && !name.ends_with(".d"))
                && std::fs::metadata(path).is_ok_and(|m| m.ino() == inode)
        })
}

/// Whether cargo sets the variable `name` for the test binaries it runs (as opposed to the
/// user's own cargo settings, such as `CARGO_TARGET_DIR` or `CARGO_HOME`, which the build keeps).
fn set_for_tests(name: &str) -> bool {
    matches!(
        name,
        "CARGO_MANIFEST_DIR"
            | "CARGO_MANIFEST_PATH"
            | "CARGO_CRATE_NAME"
            | "CARGO_PRIMARY_PACKAGE"
            | "CARGO_TARGET_TMPDIR"
            | "OUT_DIR"
    ) || name.starts_with("CARGO_PKG_")
        || name.starts_with("CARGO_BIN_EXE_")
}

fn build_once() -> PathBuf {
    let root = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    let linked = super::orders_example();
    let before = hashed_twin(&linked);
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_owned());
    let mut build = Command::new(cargo);
    // The workspace's features, as `cargo test --workspace` unifies them: only idem's crates
    // are compiled again.
    build.current_dir(&root).args([
        "build",
        "--workspace",
        "--example",
        "orders",
        "--features",
        "idem/fault-injection",
    ]);
    for (name, _) in std::env::vars_os() {
        if name.to_str().is_some_and(set_for_tests) {
            build.env_remove(&name);
        }
    }
    if !cfg!(debug_assertions) {
        build.arg("--release");
    }
    let status = build.status().expect("run cargo");
    assert!(
        status.success(),
        "building the orders example with fault-injection failed"
    );
    let faulty = hashed_twin(&linked).expect("the build with fault-injection in examples/");
    if let Some(before) = before.filter(|before| *before != faulty) {
        let relink = linked.with_extension("relink");
        let _ = std::fs::remove_file(&relink);
        std::fs::hard_link(&before, &relink).expect("link examples/orders back");
        std::fs::rename(&relink, &linked).expect("link examples/orders back");
    }
    faulty
}
