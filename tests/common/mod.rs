//! Shared set-up for the integration tests: real PostgreSQL and SQLite, unique names per run.
#![allow(dead_code)]

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The command that controls the broker: `RABBITMQCTL` (split on spaces, for example
/// `docker compose exec -T rabbitmq rabbitmqctl`); else `rabbitmqctl` when it is on the `PATH`;
/// else, when `docker` is, the broker of this repository's `compose.yaml`.
pub fn rabbitmqctl() -> std::process::Command {
    broker_tool("RABBITMQCTL", "rabbitmqctl")
}

/// The command that manages the broker's plugins, found as [`rabbitmqctl`] is:
/// `RABBITMQ_PLUGINS`, else `rabbitmq-plugins`, else the broker of `compose.yaml`.
pub fn rabbitmq_plugins() -> std::process::Command {
    broker_tool("RABBITMQ_PLUGINS", "rabbitmq-plugins")
}

/// One of RabbitMQ's command-line tools: the command in `variable` (split on spaces); else
/// `program` when it is on the `PATH`; else, when `docker` is, `program` in the broker of
/// this repository's `compose.yaml`.
fn broker_tool(variable: &str, program: &str) -> std::process::Command {
    if program == "rabbitmqctl" && broker::on_the_cluster_node() {
        // The broker `broker::with_the_plugin` chose: node 1 of the cluster, through its script.
        let mut command = std::process::Command::new(cluster::SCRIPT);
        command.args(["ctl", "1"]);
        return command;
    }
    let configured = std::env::var(variable).unwrap_or_default();
    let words: Vec<&str> = match configured.split_whitespace().collect::<Vec<_>>() {
        words if !words.is_empty() => words,
        _ if !on_path(program) && on_path("docker") => {
            vec!["docker", "compose", "exec", "-T", "rabbitmq", program]
        }
        _ => vec![program],
    };
    let mut command = std::process::Command::new(words[0]);
    command
        .args(&words[1..])
        .current_dir(env!("CARGO_MANIFEST_DIR"));
    command
}

pub use own_servers::on_path;

/// The PostgreSQL the tests use: `DATABASE_URL`, or the development machine's server.
pub fn postgres_url() -> String {
    std::env::var("DATABASE_URL")
        .ok()
        .filter(|u| u.starts_with("postgres"))
        .unwrap_or_else(|| "postgres://postgres@127.0.0.1:5432/test".to_owned())
}

/// Connects to PostgreSQL with `connections` connections, all opened up front, or fails
/// saying how to start the server.
pub async fn postgres(connections: u32) -> sqlx::PgPool {
    connect(
        &postgres_url(),
        connections,
        "PostgreSQL",
        "start it (`docker compose up -d` starts one), or point DATABASE_URL at one",
    )
    .await
}

/// A PostgreSQL schema of a test's own, for tables whose names other tests use too (the
/// example's tables, `idem_inbox`, `idem_outbox`): a relay publishes whatever rows its outbox
/// table holds, so a process sharing the public one would also publish the rows other tests
/// left there.
pub struct OwnSchema {
    /// The schema's name.
    pub name: String,
    /// `DATABASE_URL` for a process whose tables live in the schema (it is its search path).
    pub url: String,
    /// A pool of connections whose search path is the schema.
    pub pool: sqlx::PgPool,
}

impl OwnSchema {
    /// Creates a schema named from `prefix`, the process id and a counter, and a pool of
    /// `connections` on it.
    pub async fn create(prefix: &str, connections: u32) -> Self {
        let name = unique(prefix).replace('-', "_");
        // The name is made here from a prefix, the process id and a counter.
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE SCHEMA {name}")))
            .execute(&postgres(1).await)
            .await
            .unwrap();
        let base = postgres_url();
        let separator = if base.contains('?') { '&' } else { '?' };
        let url = format!("{base}{separator}options[search_path]={name}");
        let pool = connect(&url, connections, "PostgreSQL", "").await;
        Self { name, url, pool }
    }

    /// Closes the pool and drops the schema with everything in it.
    pub async fn drop(self) {
        self.pool.close().await;
        let name = self.name;
        sqlx::query(sqlx::AssertSqlSafe(format!("DROP SCHEMA {name} CASCADE")))
            .execute(&postgres(1).await)
            .await
            .unwrap();
    }
}

/// Connects to `url` with `connections` connections, all opened up front, or fails naming the
/// server and how to start it.
async fn connect<DB: sqlx::Database>(
    url: &str,
    connections: u32,
    server: &str,
    hint: &str,
) -> sqlx::Pool<DB> {
    sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(connections)
        .min_connections(connections)
        .acquire_timeout(Duration::from_secs(30))
        .connect(url)
        .await
        .unwrap_or_else(|e| panic!("{server} is not reachable at {url}: {e}\n{hint}"))
}

/// The MariaDB/MySQL the tests use: `MYSQL_URL`, a `mysql://` `DATABASE_URL`, or the
/// development machine's server.
pub fn mysql_url() -> String {
    std::env::var("MYSQL_URL")
        .ok()
        .or_else(|| {
            std::env::var("DATABASE_URL")
                .ok()
                .filter(|u| u.starts_with("mysql"))
        })
        .unwrap_or_else(|| "mysql://root@127.0.0.1:3306/test".to_owned())
}

/// Connects to MariaDB/MySQL with `connections` connections, all opened up front, or fails
/// saying how to start the server.
pub async fn mysql(connections: u32) -> sqlx::MySqlPool {
    connect(
        &mysql_url(),
        connections,
        "MariaDB",
        "start it (`docker compose up -d` starts one), or point MYSQL_URL at one",
    )
    .await
}

/// A SQLite database in a fresh temporary directory, opened as idem sets it up.
pub async fn sqlite(connections: u32) -> (sqlx::SqlitePool, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temporary directory");
    let pool = sqlite_at(&dir.path().join("idem.db"), connections).await;
    (pool, dir)
}

/// Opens (creating if needed) the SQLite database at `path`.
pub async fn sqlite_at(path: &std::path::Path, connections: u32) -> sqlx::SqlitePool {
    let options =
        idem::sql::sqlite::connect_options(&path.to_string_lossy()).expect("sqlite options");
    sqlx::sqlite::SqlitePoolOptions::new()
        .max_connections(connections)
        .min_connections(connections)
        .connect_with(options)
        .await
        .expect("open sqlite")
}

/// The orders example `cargo test` builds beside the tests.
pub fn orders_example() -> std::path::PathBuf {
    example("orders")
}

/// The example `name`, which `cargo test` builds beside the tests.
pub fn example(name: &str) -> std::path::PathBuf {
    let example = std::env::current_exe()
        .expect("the test binary")
        .parent()
        .and_then(std::path::Path::parent)
        .expect("target/<profile>")
        .join("examples")
        .join(name);
    assert!(
        example.exists(),
        "{} is missing: `cargo test` builds it, or run `cargo build --example {name}`",
        example.display()
    );
    example
}

/// Kills (SIGKILL) and reaps a child process when the test ends, passed or failed.
pub struct KillOnDrop(pub std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// A name no other test or run uses.
pub fn unique(prefix: &str) -> String {
    static NEXT: AtomicU64 = AtomicU64::new(0);
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    format!(
        "{prefix}-{}-{nanos}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

/// Polls `condition` until it holds, failing after `deadline` with `what`.
pub async fn wait_until<F, Fut>(what: &str, deadline: Duration, mut condition: F)
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    while !condition().await {
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
}

pub mod broker;
pub mod bus;
pub mod charges;
pub mod cluster;
pub mod drained;
pub mod faulty_orders;
pub mod nats_cluster;
pub mod nats_node;
pub mod own_servers;
pub mod pg_standby;
pub mod preflight;
pub mod proxy;
pub mod raw_amqp;
pub mod raw_nats;
pub mod refusing;
pub mod running;
pub mod tls_node;
pub mod watched;
pub mod whereabouts;
