//! The orders example's handlers under the test harness: `examples/orders/tests.rs`, compiled
//! beside the example's `handlers.rs` as a test of their own.

#![allow(clippy::unwrap_used, clippy::expect_used)] // tests unwrap: a panic is a failure with its message

#[path = "../examples/orders/handlers.rs"]
#[allow(dead_code)]
mod handlers;
#[path = "../examples/orders/tests.rs"]
mod tests;
