//! Runs first (cargo runs test binaries in name order): the services the suite needs, checked
//! in seconds, each missing one named with the command that fixes it, so that `cargo test`
//! on an unprepared machine fails at once instead of after the tests that wait on them.

#![allow(clippy::unwrap_used)] // the shared helpers unwrap: a panic is a failure with its message

mod common;

#[tokio::test]
async fn the_machine_has_what_the_test_suite_needs() {
    common::preflight::require().await;
}
