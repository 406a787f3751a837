//! No password reaches the output: the orders example, run with a password in both `AMQP_URL`
//! and `DATABASE_URL`, at debug level, and again with a wrong password and an unreachable
//! database, never prints either password.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use std::process::{Command, Output};

fn rabbitmqctl(args: &[&str]) -> bool {
    common::rabbitmqctl()
        .args(args)
        .output()
        .expect("rabbitmqctl")
        .status
        .success()
}

/// `url` with `user:password@` as its user part.
fn with_credentials(url: &str, user: &str, password: &str) -> String {
    let (scheme, rest) = url.split_once("://").unwrap();
    let host = rest.rsplit_once('@').map_or(rest, |(_, host)| host);
    format!("{scheme}://{user}:{password}@{host}")
}

/// Runs the example's demo with these URLs; its whole output.
fn demo(amqp_url: &str, database_url: &str, queue: &str) -> (Output, String) {
    let output = Command::new(common::orders_example())
        .args([
            "--transport",
            "rabbitmq",
            "demo",
            "--orders",
            "40",
            "--timeout-secs",
            "60",
        ])
        .env("AMQP_URL", amqp_url)
        .env("DATABASE_URL", database_url)
        .env("ORDERS_QUEUE", queue)
        .env("ORDERS_START_DEADLINE_SECS", "3")
        .env("RUST_LOG", "debug")
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    (output, text)
}

#[tokio::test]
async fn the_orders_example_never_prints_a_password() {
    let user = common::unique("idem-secret").replace('-', "_");
    let amqp_password = common::unique("amqp-pw");
    let database_password = common::unique("db-pw");
    assert!(
        rabbitmqctl(&["add_user", &user, &amqp_password])
            && rabbitmqctl(&["set_permissions", "-p", "/", &user, ".*", ".*", ".*"]),
        "cannot create the RabbitMQ user {user}"
    );
    let amqp_url = format!(
        "{}/%2f",
        with_credentials("amqp://127.0.0.1:5672", &user, &amqp_password)
    );
    // PostgreSQL here trusts local connections: the password is sent and ignored, which is
    // enough to see whether it is printed.
    let postgres = common::postgres_url();
    let user_part = postgres
        .split_once("://")
        .and_then(|(_, rest)| rest.split_once('@'))
        .map_or("postgres", |(user, _)| {
            user.split(':').next().unwrap_or(user)
        });
    let database_url = with_credentials(&postgres, user_part, &database_password);
    let queue = common::unique("idem-test-secrets");

    // The four runs at once; the unreachable database is given 3 s to come up (the example
    // waits 30 by default).
    let wrong_amqp_url = amqp_url.replace(&amqp_password, "wrong-amqp-pw");
    let unreachable = with_credentials("postgres://127.0.0.1:1/test", "app", &database_password);
    let unsupported = with_credentials("oracle://127.0.0.1/test", "app", &database_password);
    let ((ran, text), (refused, refused_text), (failed, failed_text), (odd, odd_text)) =
        std::thread::scope(|s| {
            let ran = s.spawn(|| demo(&amqp_url, &database_url, &queue));
            let refused = s.spawn(|| demo(&wrong_amqp_url, &database_url, &queue));
            let failed = s.spawn(|| demo(&amqp_url, &unreachable, &queue));
            let odd = s.spawn(|| demo(&amqp_url, &unsupported, &queue));
            (
                ran.join().unwrap(),
                refused.join().unwrap(),
                failed.join().unwrap(),
                odd.join().unwrap(),
            )
        });
    assert!(ran.status.success(), "the demo failed:\n{text}");
    assert!(text.contains("balances             exact"), "{text}");
    assert!(!refused.status.success(), "a wrong password was accepted");
    assert!(
        !failed.status.success(),
        "an unreachable database was reached"
    );
    assert!(failed_text.contains("app:***@127.0.0.1:1"), "{failed_text}");
    assert!(!odd.status.success(), "an oracle:// URL was accepted");
    assert!(odd_text.contains("oracle://app:***@"), "{odd_text}");

    rabbitmqctl(&["delete_user", &user]);
    common::broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
    for text in [&text, &refused_text, &failed_text, &odd_text] {
        for secret in [
            &amqp_password,
            &database_password,
            &"wrong-amqp-pw".to_owned(),
        ] {
            assert!(
                !text.contains(secret.as_str()),
                "the output shows {secret}:\n{text}"
            );
        }
    }
}

/// A NATS token in `NATS_URL` and an `sslpassword` in `DATABASE_URL` are never printed either:
/// the example, run at debug level against a NATS server that is not there and a database that
/// is not there, fails naming both URLs with their secrets hidden.
#[test]
fn a_nats_token_and_an_ssl_password_are_never_printed() {
    let token = common::unique("nats-token");
    let ssl_password = common::unique("ssl-pw");
    let run = |nats_url: &str, database_url: &str| {
        let output = Command::new(common::orders_example())
            .args(["demo", "--orders", "10", "--timeout-secs", "20"])
            .env("NATS_URL", nats_url)
            .env("DATABASE_URL", database_url)
            .env("ORDERS_QUEUE", common::unique("idem-test-secrets-nats"))
            .env("ORDERS_START_DEADLINE_SECS", "2")
            .env("RUST_LOG", "debug")
            .output()
            .unwrap();
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
        (output.status.success(), text)
    };
    let sqlite = tempfile::tempdir().unwrap();
    let sqlite_url = sqlite
        .path()
        .join("orders.db")
        .to_string_lossy()
        .into_owned();
    let (nats_ok, nats_text) = run(&format!("nats://{token}@127.0.0.1:1"), &sqlite_url);
    assert!(!nats_ok, "a NATS server on port 1 was reached");
    assert!(nats_text.contains("nats://***@127.0.0.1:1"), "{nats_text}");
    let database =
        format!("postgres://app@127.0.0.1:1/test?sslmode=prefer&sslpassword={ssl_password}");
    let (db_ok, db_text) = run(&common::bus::nats_url(), &database);
    assert!(!db_ok, "a database on port 1 was reached");
    assert!(db_text.contains("sslpassword=***"), "{db_text}");
    for (text, secret) in [(&nats_text, &token), (&db_text, &ssl_password)] {
        assert!(
            !text.contains(secret.as_str()),
            "the output shows {secret}:\n{text}"
        );
    }
}
