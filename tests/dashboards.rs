//! The Grafana dashboard (`deploy/grafana-idem.json`) and the Prometheus alerting rules
//! (`deploy/idem-alerts.yml`) query only metrics idem exports, so that a renamed metric cannot
//! leave a panel empty or an alert silent. `.ci/run` checks the rules with `promtool`.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

use std::collections::BTreeSet;
use std::path::Path;

fn read(path: &str) -> String {
    std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join(path)).unwrap()
}

/// The metric names idem declares (`pub const …: &str = "idem_…"`).
fn exported() -> BTreeSet<String> {
    [
        "idem-core/src/telemetry/metrics.rs",
        "idem-http/src/telemetry.rs",
    ]
    .iter()
    .flat_map(|file| {
        read(file)
            .lines()
            .filter(|l| l.starts_with("pub const ") && l.contains(": &str = \"idem_"))
            .map(|l| l.split('"').nth(1).unwrap().to_owned())
            .collect::<Vec<_>>()
    })
    .collect()
}

/// Every `idem_…` name `text` queries, a histogram's series named by their metric.
fn queried(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    let mut rest = text;
    while let Some(at) = rest.find("idem_") {
        let name: String = rest[at..]
            .chars()
            .take_while(|c| c.is_ascii_lowercase() || *c == '_')
            .collect();
        rest = &rest[at + name.len()..];
        let base = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|suffix| name.strip_suffix(suffix))
            .unwrap_or(&name);
        names.insert(base.to_owned());
    }
    names
}

#[test]
fn the_dashboard_and_the_alerts_query_only_metrics_idem_exports() {
    let exported = exported();
    assert!(exported.len() >= 20, "{exported:?}");
    for file in ["deploy/grafana-idem.json", "deploy/idem-alerts.yml"] {
        let queried = queried(&read(file));
        assert!(queried.len() >= 5, "{file}: {queried:?}");
        let unknown: Vec<_> = queried.difference(&exported).collect();
        assert!(
            unknown.is_empty(),
            "{file} queries metrics idem does not export: {unknown:?}"
        );
    }
}

#[test]
fn the_dashboard_is_valid_json_with_a_panel_per_concern() {
    let dashboard: serde_json::Value =
        serde_json::from_str(&read("deploy/grafana-idem.json")).unwrap();
    let titles: Vec<&str> = dashboard["panels"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["title"].as_str().unwrap())
        .collect();
    for concern in [
        "Throughput",
        "Dead letters",
        "Retries",
        "latency",
        "Outbox",
        "Mailbox",
        "Broker",
        "HTTP",
    ] {
        assert!(
            titles.iter().any(|t| t.contains(concern)),
            "no panel for {concern}: {titles:?}"
        );
    }
}

/// Each metric is queried as its type allows: `rate` and `increase` only over counters
/// (`…_total`) and histogram buckets, `histogram_quantile` only over the buckets of a histogram
/// idem records with bucket bounds (`idem::telemetry::HISTOGRAMS`), and counters never read
/// as they stand.
#[test]
fn the_dashboard_and_the_alerts_query_each_metric_as_its_type_allows() {
    let histograms: Vec<&str> = idem::telemetry::HISTOGRAMS
        .iter()
        .map(|(n, _)| *n)
        .collect();
    for file in ["deploy/grafana-idem.json", "deploy/idem-alerts.yml"] {
        let text = read(file);
        let mut rest = text.as_str();
        let mut checked = 0;
        while let Some(at) = rest.find("idem_") {
            let name: String = rest[at..]
                .chars()
                .take_while(|c| c.is_ascii_lowercase() || *c == '_')
                .collect();
            let before = rest[..at].trim_end_matches(|c: char| c == '(' || c.is_whitespace());
            rest = &rest[at + name.len()..];
            let over_time = before.ends_with("rate") || before.ends_with("increase");
            if let Some(base) = name.strip_suffix("_bucket") {
                assert!(
                    histograms.contains(&base),
                    "{file}: {name} is not the buckets of a histogram idem sets bounds for"
                );
                assert!(over_time, "{file}: {name} read without rate()");
            } else if before.ends_with("label_values") {
                // A dashboard variable's values, read from the series' labels.
            } else if name.ends_with("_total") {
                assert!(
                    over_time,
                    "{file}: the counter {name} read as it stands, not with rate() or increase()"
                );
            } else {
                assert!(
                    !over_time,
                    "{file}: {name} is a gauge; rate() and increase() are for counters"
                );
            }
            checked += 1;
        }
        assert!(checked >= 10, "{file}: {checked}");
    }
}
