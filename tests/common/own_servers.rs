//! Tests that start servers of their own (RabbitMQ nodes, the 3-node cluster, NATS servers)
//! need the server's program on the `PATH`. Without it such a test fails, naming the program;
//! the only way to skip them is to say so: `IDEM_TESTS_WITHOUT_OWN_SERVERS=1` (for a machine
//! whose brokers run in Docker, say). CI never sets it.
#![allow(dead_code)]

/// The variable that lets the tests needing servers of their own skip, said on stderr.
pub const OPT_OUT: &str = "IDEM_TESTS_WITHOUT_OWN_SERVERS";

/// Whether the test can start `what` with `program`: true when `program` is on the `PATH`.
/// When it is not, the test fails naming it, unless [`OPT_OUT`] is `1`: then it says it is
/// skipped and the answer is false.
pub fn can_start(program: &str, what: &str) -> bool {
    if on_path(program) {
        return true;
    }
    if std::env::var(OPT_OUT).is_ok_and(|v| v == "1") {
        eprintln!("skipped ({OPT_OUT}=1): {what} needs `{program}` on the PATH");
        return false;
    }
    panic!(
        "{what} needs `{program}` on the PATH, and it is not there: install it (the package \
         of the same name), or set {OPT_OUT}=1 to skip every test that starts servers of its own"
    );
}

/// Whether `program` is on the `PATH`.
pub fn on_path(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}
