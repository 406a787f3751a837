//! Compile-time behaviour of the transactional layer: the handlers it wraps, and the error a
//! handler gets when its `Tx` is not of the layer's store.

#[test]
fn ui() {
    let t = trybuild::TestCases::new();
    t.pass("tests/ui/pass/*.rs");
    t.compile_fail("tests/ui/fail/*.rs");
}
