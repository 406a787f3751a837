//! What the test suite needs from the machine, checked in seconds before anything waits on
//! it: PostgreSQL, MariaDB and RabbitMQ answering, `rabbitmqctl` usable, no resource alarm in
//! effect, and the programs of the servers some tests start of their own on the `PATH`. Each missing piece is reported with the command that fixes
//! it.
#![allow(dead_code)]

use std::time::Duration;

/// How long each check may take.
const CHECK: Duration = Duration::from_secs(10);

/// What is missing, each with its fix; empty when the machine has everything.
pub async fn missing() -> Vec<String> {
    let (postgres_url, mysql_url) = (super::postgres_url(), super::mysql_url());
    let (postgres, mariadb, rabbitmq) = tokio::join!(
        database::<sqlx::Postgres>(
            "PostgreSQL",
            &postgres_url,
            "start it (`docker compose up -d` starts one, or `pg_ctlcluster <version> main start`), or point DATABASE_URL at one",
        ),
        database::<sqlx::MySql>(
            "MariaDB",
            &mysql_url,
            "start it (`docker compose up -d` starts one, or `mariadbd`), or point MYSQL_URL at one",
        ),
        broker(),
    );
    let mut missing: Vec<String> = [postgres, mariadb].into_iter().flatten().collect();
    missing.extend(rabbitmq);
    missing.extend(programs());
    missing
}

/// The programs of the servers some tests start of their own, unless the run says it skips
/// those tests ([`super::own_servers::OPT_OUT`]).
fn programs() -> Vec<String> {
    use super::own_servers::{OPT_OUT, on_path};
    if std::env::var(OPT_OUT).is_ok_and(|v| v == "1") {
        return Vec::new();
    }
    [
        ("rabbitmq-server", "rabbitmq-server", "the TLS node and the 3-node cluster"),
        ("nats-server", "nats-server", "the NATS servers of the chaos runs, the TLS and the replicas tests"),
        ("prometheus", "prometheus", "the Prometheus the dashboard and the alerting rules are tested in"),
        ("pg_config", "postgresql", "the PostgreSQL primary and standby of the durability test"),
    ]
    .into_iter()
    .filter(|(program, _, _)| !on_path(program))
    .map(|(program, package, what)| {
        format!(
            "`{program}` is not on the PATH ({what}): install the package `{package}`, or set {OPT_OUT}=1 to skip the tests that start servers of their own"
        )
    })
    .collect()
}

/// Panics with every missing piece and its fix.
pub async fn require() {
    let missing = missing().await;
    assert!(
        missing.is_empty(),
        "this machine cannot run the test suite yet:\n- {}",
        missing.join("\n- ")
    );
}

async fn database<DB: sqlx::Database>(name: &str, url: &str, fix: &str) -> Option<String> {
    let connecting = sqlx::pool::PoolOptions::<DB>::new()
        .max_connections(1)
        .acquire_timeout(CHECK)
        .connect(url);
    match tokio::time::timeout(CHECK, connecting).await {
        Ok(Ok(pool)) => {
            pool.close().await;
            None
        }
        Ok(Err(e)) => Some(format!("{name} is not reachable at {url} ({e}): {fix}")),
        Err(_) => Some(format!(
            "{name} did not answer at {url} within {CHECK:?}: {fix}"
        )),
    }
}

async fn broker() -> Vec<String> {
    let url = super::broker::amqp_url();
    let config = idem::rabbitmq::RabbitConfig::new(&url);
    let plugin = tokio::time::timeout(CHECK, idem::rabbitmq::consistent_hash_available(&config));
    let mut missing = Vec::new();
    match plugin.await {
        // Without the plugin the ordered tests run on a node that has it (`broker::with_the_plugin`).
        Ok(Ok(_)) => {}
        Ok(Err(e)) => {
            return vec![format!(
                "RabbitMQ is not reachable at {url} ({e}): start it (`rabbitmq-server -detached`, or `docker compose up -d`), or point AMQP_URL at one"
            )];
        }
        Err(_) => {
            return vec![format!(
                "RabbitMQ did not answer at {url} within {CHECK:?}: start it, or point AMQP_URL at one"
            )];
        }
    }
    let status = tokio::task::spawn_blocking(|| super::rabbitmqctl().arg("status").output()).await;
    match status {
        // A resource alarm blocks every publisher: the tests would wait on it, one by one.
        Ok(Ok(out)) if out.status.success() => {
            let alarms = tokio::task::spawn_blocking(|| {
                super::rabbitmqctl()
                    .args(["eval", "rabbit_alarm:get_alarms()."])
                    .output()
            })
            .await;
            if let Ok(Ok(alarms)) = alarms {
                let listed = String::from_utf8_lossy(&alarms.stdout).trim().to_owned();
                if alarms.status.success() && listed != "[]" {
                    missing.push(format!(
                        "RabbitMQ has a resource alarm in effect ({listed}), which blocks every publisher: free memory or disk, or restore the watermark (`rabbitmqctl set_vm_memory_high_watermark 0.4`)"
                    ));
                }
            }
        }
        Ok(Ok(out)) => missing.push(format!(
            "`rabbitmqctl status` failed ({}): run the tests as a user that may control the broker (root, or the rabbitmq group), or set RABBITMQCTL to a command that can",
            String::from_utf8_lossy(&out.stderr).trim()
        )),
        _ => missing.push(
            "`rabbitmqctl` cannot be run: put it on the PATH, or set RABBITMQCTL (for example `docker compose exec -T rabbitmq rabbitmqctl`)".to_owned(),
        ),
    }
    missing
}
