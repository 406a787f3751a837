//! Compile-time behaviour of `#[idempotent]`: what compiles, and the error each misuse gets.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
