//! The quick start on a RabbitMQ as distributions ship it, with no plugin enabled: `orders`
//! (the README's first command) runs its status updates in order on one partition and says so
//! in one line, with exact books. A demo killed mid-run leaves nothing that makes the next run
//! wrong, even when the plugin is enabled in between (the next run goes back to four
//! partitions of the consistent-hash exchange).
//!
//! Its own test binary: it disables the consistent-hash plugin on the broker, enables it for
//! the last run, and puts back the state it found when it ends (also when it fails), while
//! cargo runs no other test binary.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::broker::amqp_url;
use common::watched::{self, Watched};
use common::{orders_example, unique};
use idem::rabbitmq::RabbitConfig;
use std::process::{Command, Output};
use std::time::Duration;

const PLUGIN: &str = "rabbitmq_consistent_hash_exchange";

/// Enables or disables the plugin on the broker: whether `rabbitmq-plugins` did.
fn set_plugin(enabled: bool) -> bool {
    let verb = if enabled { "enable" } else { "disable" };
    common::rabbitmq_plugins()
        .args([verb, "--quiet", PLUGIN])
        .status()
        .is_ok_and(|status| status.success())
}

/// The plugin's state when the test began, put back when dropped.
struct FoundState {
    enabled: bool,
}

impl FoundState {
    async fn record() -> Self {
        let config = RabbitConfig::new(amqp_url());
        let enabled = idem::rabbitmq::consistent_hash_available(&config)
            .await
            .unwrap();
        Self { enabled }
    }
}

impl Drop for FoundState {
    fn drop(&mut self) {
        if !set_plugin(self.enabled) {
            let verb = if self.enabled { "enable" } else { "disable" };
            eprintln!("could not {verb} {PLUGIN} again: run `rabbitmq-plugins {verb} {PLUGIN}`");
        }
    }
}

async fn available_is(expected: bool) {
    let config = RabbitConfig::new(amqp_url());
    common::wait_until("the plugin's new state", Duration::from_secs(30), || {
        let config = config.clone();
        async move {
            idem::rabbitmq::consistent_hash_available(&config)
                .await
                .unwrap()
                == expected
        }
    })
    .await;
}

/// The demo as the README runs it (`orders`, no subcommand), on `queue` and `database`, with
/// 500 orders (`ORDERS_COUNT`) instead of 2,000: what is tested here is the routing the broker
/// offers, the partitions line and the books after a killed run, not the volume (CI's quick
/// start and `tests/orders_example.rs` run the default count).
fn demo(queue: &str, database: &str) -> Command {
    let mut command = Command::new(orders_example());
    command
        .env("AMQP_URL", amqp_url())
        .env("DATABASE_URL", database)
        .env("ORDERS_QUEUE", queue)
        .env("ORDERS_COUNT", "500")
        .env_remove("ORDERS_STATUS_PARTITIONS")
        .env("RUST_LOG", "error");
    command
}

fn text(output: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&output.stdout).into_owned(),
        String::from_utf8_lossy(&output.stderr).into_owned(),
    )
}

/// The report's status line, checked exact with `partitions` partitions, and the books.
fn assert_exact(output: &Output, partitions: usize) {
    let (stdout, stderr) = text(output);
    assert!(
        output.status.success(),
        "the demo failed:\n{stdout}{stderr}"
    );
    let status = stdout
        .lines()
        .find(|l| l.starts_with("status updates"))
        .unwrap_or_else(|| panic!("no status line in {stdout}"));
    assert!(
        status.contains(&format!("{partitions} partitions of"))
            && status.ends_with("in order: exact)"),
        "{status}"
    );
    for line in [
        "orders stored            500  (expected 500)",
        "balances             exact",
        "parcels              exact",
    ] {
        assert!(stdout.contains(line), "{stdout}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_quick_start_runs_on_a_stock_broker_and_a_killed_run_never_spoils_the_next() {
    let dir = tempfile::tempdir().unwrap();
    let database = dir.path().join("orders.db");
    let database = database.to_str().unwrap();
    let queue = unique("idem-stock");
    let _found = FoundState::record().await;
    assert!(set_plugin(false), "rabbitmq-plugins disable {PLUGIN}");
    available_is(false).await;

    // No plugin: one ordered partition, said in one line.
    let output = demo(&queue, database).output().unwrap();
    assert_exact(&output, 1);
    let (_, stderr) = text(&output);
    let notices: Vec<_> = stderr
        .lines()
        .filter(|l| l.contains("consistent-hash plugin"))
        .collect();
    assert_eq!(notices.len(), 1, "{stderr}");
    assert!(notices[0].contains("rabbitmq-plugins enable rabbitmq_consistent_hash_exchange"));
    // More partitions than the broker can route is refused at once, naming both fixes.
    let refused = demo(&queue, database)
        .env("ORDERS_STATUS_PARTITIONS", "4")
        .output()
        .unwrap();
    let (_, stderr) = text(&refused);
    assert!(!refused.status.success());
    assert!(
        stderr.contains("rabbitmq-plugins enable") && stderr.contains("ORDERS_STATUS_PARTITIONS=1"),
        "{stderr}"
    );

    // A run killed mid-way, with its deliveries in the queues and its outbox rows unsent.
    let pool = idem::sql::sqlite::pool(database).await.unwrap();
    let mut killed = Watched::spawn("orders", &mut demo(&queue, database));
    let stored = || async {
        sqlx::query_scalar::<_, i64>("SELECT count(*) FROM orders")
            .fetch_one(&pool)
            .await
            .unwrap_or(0)
    };
    let before = stored().await;
    watched::wait_until(
        "the run under way",
        Duration::from_secs(60),
        &mut [&mut killed],
        || async { stored().await > before },
    )
    .await;
    drop(killed); // SIGKILL

    // The next run, with the plugin enabled meanwhile: four partitions, exact books.
    assert!(set_plugin(true), "rabbitmq-plugins enable {PLUGIN}");
    available_is(true).await;
    let output = demo(&queue, database).output().unwrap();
    assert_exact(&output, 4);
    let (stdout, _) = text(&output);
    eprintln!("{stdout}");
    common::broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
}
