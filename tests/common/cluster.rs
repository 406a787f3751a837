//! The 3-node RabbitMQ cluster of `scripts/rabbitmq-cluster`, started if it is down, for the
//! tests that stop and restart its nodes.
#![allow(dead_code)]

use std::process::Command;

/// The repository's cluster script.
pub const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/scripts/rabbitmq-cluster");

/// Only one test at a time may stop nodes of the cluster.
static IN_USE: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// The cluster, held by one test at a time.
pub struct Cluster {
    /// The three nodes' AMQP URLs, comma-separated, node 1 first.
    pub urls: String,
    _held: tokio::sync::MutexGuard<'static, ()>,
}

/// Runs the cluster script with `args` and returns what it printed; a failure panics with it.
pub fn script_output(args: &[&str]) -> String {
    let out = Command::new(SCRIPT)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {SCRIPT}: {e}"));
    assert!(
        out.status.success(),
        "{SCRIPT} {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

impl Cluster {
    /// The cluster with all three nodes running (started and joined if they are not). A
    /// machine that cannot start RabbitMQ nodes fails the test, or, with the opt-out of
    /// [`super::own_servers`], skips it: `None`.
    pub async fn up() -> Option<Cluster> {
        if !super::own_servers::can_start("rabbitmq-server", "the 3-node RabbitMQ cluster") {
            return None;
        }
        let held = IN_USE.lock().await;
        let urls = tokio::task::spawn_blocking(|| script_output(&["start"]))
            .await
            .unwrap()
            .trim()
            .to_owned();
        let cluster = Cluster { urls, _held: held };
        cluster.purge(left_by_a_gone_process).await;
        Some(cluster)
    }

    /// Deletes the queues and exchanges whose names `matches` says. A whole-cluster restart
    /// recovers every quorum queue the cluster holds, so queues a test leaves behind make every
    /// later restart slower and more fragile (RabbitMQ 3.10.8 was seen to lose a node's
    /// quorum-queue dead-letter supervisor while recovering about a hundred of them).
    pub async fn purge(&self, matches: impl Fn(&str) -> bool) {
        let names = |listed: String| -> Vec<String> {
            listed
                .lines()
                .map(str::trim)
                .filter(|name| matches(name))
                .map(str::to_owned)
                .collect()
        };
        let queues = names(self.ctl(1, &["list_queues", "name"]));
        let exchanges = names(self.ctl(1, &["list_exchanges", "name"]));
        super::broker::delete_on(&self.urls, &queues, &exchanges).await;
    }

    /// Node `n`'s AMQP URL.
    pub fn url(&self, n: usize) -> &str {
        self.urls.split(',').nth(n - 1).expect("nodes 1 to 3")
    }

    /// `rabbitmqctl` against node `n`, its output.
    pub fn ctl(&self, n: usize, args: &[&str]) -> String {
        let mut all = vec!["ctl", ["1", "2", "3"][n - 1]];
        all.extend_from_slice(args);
        script_output(&all)
    }

    /// The node (1 to 3) that leads quorum queue `queue`, as node `asked` sees it.
    pub fn leader(&self, queue: &str, asked: usize) -> Option<usize> {
        let listed = self.ctl(asked, &["list_queues", "name", "leader"]);
        let leader = listed
            .lines()
            .filter_map(|l| l.split_once('\t'))
            .find(|(name, _)| *name == queue)?
            .1
            .trim()
            .to_owned();
        (1..=3).find(|n| leader == format!("idem-cluster-{n}@localhost"))
    }

    /// How many messages, ready and unacknowledged, the queues whose names `matches` says
    /// hold, as node `asked` lists them; a line it cannot read fails the test.
    pub fn held(&self, asked: usize, matches: impl Fn(&str) -> bool) -> usize {
        let listed = self.ctl(
            asked,
            &[
                "list_queues",
                "-q",
                "--no-table-headers",
                "name",
                "messages",
            ],
        );
        listed
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| {
                let (name, n) = l
                    .split_once('\t')
                    .unwrap_or_else(|| panic!("rabbitmqctl list_queues printed `{l}`"));
                let n: usize = n
                    .trim()
                    .parse()
                    .unwrap_or_else(|e| panic!("rabbitmqctl list_queues printed `{l}`: {e}"));
                (name.to_owned(), n)
            })
            .filter(|(name, _)| matches(name))
            .map(|(_, n)| n)
            .sum()
    }

    /// The nodes (1 to 3) that hold a replica of quorum queue `queue`.
    pub fn members(&self, queue: &str) -> Vec<usize> {
        let listed = self.ctl(1, &["list_queues", "name", "members"]);
        let members = listed
            .lines()
            .filter_map(|l| l.split_once('\t'))
            .find(|(name, _)| *name == queue)
            .map(|(_, m)| m.to_owned())
            .unwrap_or_default();
        (1..=3)
            .filter(|n| members.contains(&format!("idem-cluster-{n}@localhost")))
            .collect()
    }

    /// Stops the RabbitMQ application on node `n` (the Erlang node stays; its clients are
    /// disconnected and its port refuses connections).
    pub async fn stop_app(&self, n: usize) {
        let node = ["1", "2", "3"][n - 1];
        tokio::task::spawn_blocking(move || script_output(&["ctl", node, "stop_app"]))
            .await
            .unwrap();
    }

    /// Starts node `n`'s application again and waits for it.
    pub async fn start_app(&self, n: usize) {
        let node = ["1", "2", "3"][n - 1];
        tokio::task::spawn_blocking(move || {
            script_output(&["ctl", node, "start_app"]);
            script_output(&["ctl", node, "await_startup"]);
        })
        .await
        .unwrap();
    }

    /// Stops every node at once (the Erlang nodes exit; no node of the cluster is left to
    /// connect to) and returns when all three are down.
    pub async fn stop_all(&self) {
        let stops: Vec<_> = ["1", "2", "3"]
            .into_iter()
            .map(|node| tokio::task::spawn_blocking(move || script_output(&["stop", node])))
            .collect();
        for stop in stops {
            stop.await.unwrap();
        }
    }

    /// Starts every node again and waits for them (after [`Cluster::stop_all`]).
    pub async fn start_all(&self) {
        tokio::task::spawn_blocking(|| script_output(&["start"]))
            .await
            .unwrap();
    }
}

/// Whether `name` is a queue or exchange of a cluster test (`idem-cluster-<pid>-…`, or
/// `idem-chaos-<pid>-…`) whose process has ended: left behind by a run that failed or was
/// killed before it cleaned up.
fn left_by_a_gone_process(name: &str) -> bool {
    ["idem-cluster-", "idem-chaos-"].iter().any(|prefix| {
        name.strip_prefix(prefix)
            .and_then(|rest| rest.split('-').next())
            .and_then(|pid| pid.parse::<u32>().ok())
            .is_some_and(|pid| {
                pid != std::process::id() && !std::path::Path::new(&format!("/proc/{pid}")).exists()
            })
    })
}

impl Drop for Cluster {
    /// Leaves every node running for the next test, whatever this one did.
    fn drop(&mut self) {
        let _ = Command::new(SCRIPT).arg("start").output();
    }
}
