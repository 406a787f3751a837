//! The dashboard and the alerting rules of `deploy/` against a real Prometheus: the
//! distribution's `prometheus` (on the `PATH`), started by the test with a store of its own,
//! scraping `orders consume --metrics-addr` every second as a job named `idem`, the consumer
//! reaching PostgreSQL through a proxy the test can cut.
//!
//! - While the consumer books orders (with a duplicate, a conflicting payload and a malformed
//!   message), Prometheus evaluates every query of the dashboard: each must be valid, and the
//!   panels such a consumer feeds must show data (a number, not an empty result and not NaN):
//!   throughput, duplicates and conflicts, dead letters, latency quantiles read from the
//!   histograms' buckets, the outbox, the mailbox, the broker connection, the sweeper and the
//!   inbox's size. No alert fires meanwhile.
//! - Then the database goes away: `IdemStorePaused` reaches `firing` through Prometheus's API,
//!   and no other critical alert does; once the database is back, the order published during
//!   the outage is booked and the alert is no longer firing.
//!
//! The rules are the repository's, with each `for:` shortened to 5 s so that the test does not
//! wait out the real durations, which `promtool test rules deploy/idem-alerts.test.yml` checks
//! (`.ci/run`).

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::wait_until;
use serde_json::Value;
use std::path::Path;
use std::process::Command;
use std::time::Duration;

fn repository_file(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

/// A free port on 127.0.0.1.
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A Prometheus server of the test's own, stopped when dropped.
struct Prometheus {
    url: String,
    http: reqwest::Client,
    _server: common::KillOnDrop,
    _dir: tempfile::TempDir,
}

impl Prometheus {
    /// Starts one that scrapes `target` (host:port) every second as job `idem` and evaluates
    /// `rules` every second.
    async fn start(target: &str, rules: &str) -> Prometheus {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("rules.yml"), rules).unwrap();
        std::fs::write(
            dir.path().join("prometheus.yml"),
            format!(
                "global: {{scrape_interval: 1s, evaluation_interval: 1s}}\n\
                 rule_files: [rules.yml]\n\
                 scrape_configs:\n  - job_name: idem\n    static_configs: [{{targets: ['{target}']}}]\n"
            ),
        )
        .unwrap();
        let address = format!("127.0.0.1:{}", free_port());
        let server = Command::new("prometheus")
            .current_dir(dir.path())
            .arg(format!(
                "--config.file={}",
                dir.path().join("prometheus.yml").display()
            ))
            .arg(format!(
                "--storage.tsdb.path={}",
                dir.path().join("data").display()
            ))
            .arg(format!("--web.listen-address={address}"))
            .stdout(std::process::Stdio::null())
            .stderr(std::fs::File::create(dir.path().join("log")).unwrap())
            .spawn()
            .unwrap();
        let prometheus = Prometheus {
            url: format!("http://{address}"),
            http: reqwest::Client::new(),
            _server: common::KillOnDrop(server),
            _dir: dir,
        };
        wait_until(
            "Prometheus to be ready",
            Duration::from_secs(60),
            || async {
                let ready = prometheus
                    .http
                    .get(format!("{}/-/ready", prometheus.url))
                    .send();
                ready.await.is_ok_and(|r| r.status().is_success())
            },
        )
        .await;
        prometheus
    }

    /// The JSON answer of the API at `path` (with `params`).
    async fn api(&self, path: &str, params: &[(&str, &str)]) -> Value {
        let url = reqwest::Url::parse_with_params(&format!("{}{path}", self.url), params).unwrap();
        let answer = self.http.get(url).send().await.unwrap();
        answer.json().await.unwrap()
    }

    /// The result of an instant query; panics when Prometheus refuses the query.
    async fn query(&self, promql: &str) -> Vec<Value> {
        let answer = self.api("/api/v1/query", &[("query", promql)]).await;
        assert_eq!(answer["status"], "success", "{promql}: {answer}");
        answer["data"]["result"].as_array().unwrap().clone()
    }

    /// Whether `promql` answers at least one number at least `least` (NaN is no number).
    async fn answers_at_least(&self, promql: &str, least: f64) -> bool {
        self.query(promql).await.iter().any(|series| {
            series["value"][1]
                .as_str()
                .and_then(|v| v.parse::<f64>().ok())
                .is_some_and(|v| v >= least)
        })
    }

    /// Whether `promql` answers at least one number (not NaN).
    async fn shows_data(&self, promql: &str) -> bool {
        self.answers_at_least(promql, f64::NEG_INFINITY).await
    }

    /// The alerts in state `firing`, each as its name and severity.
    async fn firing(&self) -> Vec<(String, String)> {
        let answer = self.api("/api/v1/alerts", &[]).await;
        answer["data"]["alerts"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|a| a["state"] == "firing")
            .map(|a| {
                let name = a["labels"]["alertname"].as_str().unwrap_or("").to_owned();
                let severity = a["labels"]["severity"].as_str().unwrap_or("").to_owned();
                (name, severity)
            })
            .collect()
    }
}

/// The repository's rules with every `for:` shortened to 5 s.
fn rules_for_the_test() -> String {
    let rules = repository_file("deploy/idem-alerts.yml");
    let shortened: Vec<String> = rules
        .lines()
        .map(|line| match line.trim_start().strip_prefix("for: ") {
            Some(_) => format!("{}for: 5s", &line[..line.len() - line.trim_start().len()]),
            None => line.to_owned(),
        })
        .collect();
    assert!(shortened.iter().filter(|l| l.ends_with("for: 5s")).count() >= 5);
    shortened.join("\n")
}

/// Every dashboard query with the `$consumer` variable set to all consumers, with its panel's
/// title and its legend.
fn dashboard_queries() -> Vec<(String, String, String)> {
    let dashboard: Value =
        serde_json::from_str(&repository_file("deploy/grafana-idem.json")).unwrap();
    let mut queries = Vec::new();
    for panel in dashboard["panels"].as_array().unwrap() {
        for target in panel["targets"].as_array().into_iter().flatten() {
            let title = panel["title"].as_str().unwrap().to_owned();
            let legend = target["legendFormat"].as_str().unwrap_or("").to_owned();
            let expr = target["expr"].as_str().unwrap().replace("$consumer", ".*");
            queries.push((title, legend, expr));
        }
    }
    queries
}

/// The panels a consumer that books orders (a duplicate, a conflict and a malformed message
/// among them) feeds, each as a title's start and a legend: the others wait for a retry, a
/// panic, a refused or failed outbox row, a reconnect, an HTTP request or a store that cannot
/// write.
const FED: &[(&str, &str)] = &[
    ("Throughput by outcome", "{{outcome}}"),
    ("Duplicates and conflicts", "duplicates"),
    ("Duplicates and conflicts", "conflicts"),
    ("Dead letters by reason", "{{reason}}"),
    ("Claim, handler and commit latency", "p99 claim"),
    ("Claim, handler and commit latency", "p99 handler"),
    ("Claim, handler and commit latency", "p99 commit"),
    ("Claim, handler and commit latency", "p50 handler"),
    ("Outbox: dispatch", "dispatch p99"),
    ("Outbox: dispatch", "relay lag"),
    ("Outbox: staged", "staged"),
    ("Outbox: staged", "published"),
    ("Mailbox depth", "waiting"),
    ("Mailbox depth", "running"),
    ("Broker connection", "consumers"),
    ("Inbox sweeper", "lag"),
    ("Inbox sweeper", "rows swept"),
    ("Inbox sweeper", "deleting"),
    ("Inbox sweeper", "pausing"),
    ("Inbox size", "rows"),
    ("Inbox size", "expired"),
    ("Inbox size", "oldest"),
];

/// Evaluates every dashboard query (each must be valid) and returns those of the `expected`
/// panels that show no data.
async fn without_data(prometheus: &Prometheus, expected: &[(&str, &str)]) -> Vec<String> {
    let queries = dashboard_queries();
    for (title, legend) in expected {
        assert!(
            queries
                .iter()
                .any(|(t, l, _)| t.starts_with(title) && l.contains(legend)),
            "the dashboard has no query {title:?} / {legend:?}"
        );
    }
    let mut empty = Vec::new();
    for (title, legend, expr) in queries {
        let shows = prometheus.shows_data(&expr).await;
        let wanted = expected
            .iter()
            .any(|(t, l)| title.starts_with(t) && legend.contains(l));
        if wanted && !shows {
            empty.push(format!("{title} / {legend}: {expr}"));
        }
    }
    empty
}

fn order(id: &str, cents: u32) -> Vec<u8> {
    serde_json::json!({"order_id": id, "customer": "c-1", "amount_cents": cents})
        .to_string()
        .into_bytes()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_dashboard_shows_a_running_consumer_and_a_database_outage_fires_its_alert() {
    if !common::own_servers::can_start("prometheus", "the Prometheus the dashboard is read by") {
        return;
    }
    let example = common::orders_example();
    let queue = common::unique("idem-test-prom");
    let metrics_port = free_port();
    let (proxy, proxied) = common::proxy::postgres().await;
    common::broker::declare_orders_queue(&queue).await;
    let consumer = Command::new(&example)
        .args([
            "consume",
            "--metrics-addr",
            &format!("127.0.0.1:{metrics_port}"),
        ])
        .env("DATABASE_URL", &proxied)
        .env("ORDERS_QUEUE", &queue)
        .env("AMQP_URL", common::broker::amqp_url())
        .env("RUST_LOG", "error")
        .spawn()
        .unwrap();
    let _consumer = common::KillOnDrop(consumer);
    let prometheus =
        Prometheus::start(&format!("127.0.0.1:{metrics_port}"), &rules_for_the_test()).await;
    let publisher = common::broker::publisher().await;
    let publish = |id: String, body: Vec<u8>| {
        let publisher = &publisher;
        let queue = &queue;
        async move { common::broker::publish(publisher, queue, Some(&id), &body).await }
    };
    let booked = |n: usize| {
        let prometheus = &prometheus;
        async move {
            let query = r#"sum(idem_messages_total{consumer="orders",outcome="processed"})"#;
            prometheus.answers_at_least(query, n as f64).await
        }
    };

    // A first order, so that Prometheus has seen every series of a booking before the others
    // come: rates and quantiles need a rise between two scrapes.
    publish(format!("{queue}-0"), order(&format!("{queue}-0"), 100)).await;
    wait_until(
        "Prometheus to see the first order",
        Duration::from_secs(60),
        || booked(1),
    )
    .await;
    wait_until("two scrapes of the first order", Duration::from_secs(30), || async {
        prometheus
            .shows_data(r#"count_over_time(idem_messages_total{consumer="orders",outcome="processed"}[1m]) >= 2"#)
            .await
    })
    .await;
    for n in 1..=20 {
        let id = format!("{queue}-{n}");
        publish(id.clone(), order(&id, 100 + n)).await;
    }
    let first = format!("{queue}-1");
    publish(first.clone(), order(&first, 101)).await; // a duplicate
    publish(first.clone(), order(&first, 999)).await; // the same id, another payload
    publish(format!("{queue}-bad"), b"{not json".to_vec()).await; // malformed
    wait_until(
        "Prometheus to see the orders booked",
        Duration::from_secs(60),
        || booked(21),
    )
    .await;
    let empty = std::sync::Mutex::new(Vec::new());
    let waited = tokio::time::timeout(Duration::from_secs(30), async {
        loop {
            let now = without_data(&prometheus, FED).await;
            if now.is_empty() {
                break;
            }
            *empty.lock().unwrap() = now;
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    })
    .await;
    assert!(
        waited.is_ok(),
        "panels without data after 30 s: {:#?}",
        empty.lock().unwrap()
    );
    assert_eq!(
        prometheus.firing().await,
        vec![],
        "alerts fired on a healthy run"
    );

    // The database goes away while an order waits.
    proxy.cut();
    let during = format!("{queue}-during");
    publish(during.clone(), order(&during, 7)).await;
    wait_until(
        "IdemStorePaused to fire",
        Duration::from_secs(90),
        || async {
            prometheus
                .firing()
                .await
                .iter()
                .any(|(name, _)| name == "IdemStorePaused")
        },
    )
    .await;
    let critical: Vec<String> = prometheus
        .firing()
        .await
        .into_iter()
        .filter(|(_, severity)| severity == "critical")
        .map(|(name, _)| name)
        .collect();
    assert_eq!(critical, ["IdemStorePaused"]);
    let outage = [
        ("Store paused", "{{store}} paused"),
        ("Store paused", "waiting for its store"),
    ];
    assert_eq!(
        without_data(&prometheus, &outage).await,
        Vec::<String>::new()
    );

    proxy.restore();
    wait_until(
        "the order of the outage booked",
        Duration::from_secs(90),
        || booked(22),
    )
    .await;
    wait_until(
        "IdemStorePaused to end",
        Duration::from_secs(60),
        || async {
            !prometheus
                .firing()
                .await
                .iter()
                .any(|(name, _)| name == "IdemStorePaused")
        },
    )
    .await;
    common::broker::delete_topology(&queue, &idem::RetryPolicy::default().delays()).await;
    let billed = format!("{queue}.billed");
    common::broker::delete_topology(&billed, &idem::RetryPolicy::default().delays()).await;
}
