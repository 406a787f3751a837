//! Queue depths read strictly from the broker, for runs that judge exactly-once only once every
//! hop is drained: a queue that is missing, or a `rabbitmqctl` that fails, is an error, never 0.

#![allow(dead_code)] // each test binary uses part of the helpers

use std::time::{Duration, Instant};

/// A queue's messages: ready, and delivered but not acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Depth {
    pub ready: usize,
    pub unacked: usize,
}

/// The queues of one hop: `queue` and its retry queues, one per delay of `delays`. Its
/// dead-letter queue is not among them: a dead letter stays there, and is judged by reading it.
pub fn hop(queue: &str, delays: &[Duration]) -> Vec<String> {
    std::iter::once(queue.to_owned())
        .chain(
            delays
                .iter()
                .map(|delay| idem::rabbitmq::retry_queue(queue, *delay)),
        )
        .collect()
}

/// The depth of each of `queues`, from `rabbitmqctl list_queues`: an error if it fails or if a
/// queue is not listed.
pub fn depths(queues: &[String]) -> Result<Vec<Depth>, String> {
    let listed = crate::common::rabbitmqctl()
        .args([
            "list_queues",
            "-q",
            "--no-table-headers",
            "name",
            "messages_ready",
            "messages_unacknowledged",
        ])
        .output()
        .map_err(|e| format!("cannot run rabbitmqctl: {e}"))?;
    if !listed.status.success() {
        return Err(format!(
            "rabbitmqctl list_queues failed ({}): {}",
            listed.status,
            String::from_utf8_lossy(&listed.stderr)
        ));
    }
    let stdout = String::from_utf8_lossy(&listed.stdout);
    let mut found = std::collections::HashMap::new();
    for line in stdout.lines() {
        let fields: Vec<&str> = line.split('\t').collect();
        if let [name, ready, unacked] = fields[..] {
            let parse = |n: &str| {
                n.trim()
                    .parse::<usize>()
                    .map_err(|e| format!("rabbitmqctl listed {name} with {n:?}: {e}"))
            };
            found.insert(
                name.to_owned(),
                Depth {
                    ready: parse(ready)?,
                    unacked: parse(unacked)?,
                },
            );
        }
    }
    queues
        .iter()
        .map(|queue| {
            found
                .get(queue)
                .copied()
                .ok_or_else(|| format!("the queue {queue} does not exist"))
        })
        .collect()
}

/// Waits until every one of `queues` exists and holds nothing, ready or unacknowledged;
/// panics, naming the queues that still hold messages (or the error), after `deadline`.
pub async fn wait_drained(what: &str, queues: &[String], deadline: Duration) {
    let started = Instant::now();
    loop {
        let now = depths(queues);
        if let Ok(depths) = &now
            && depths.iter().all(|d| d.ready == 0 && d.unacked == 0)
        {
            return;
        }
        if started.elapsed() >= deadline {
            let report = match now {
                Ok(depths) => queues
                    .iter()
                    .zip(depths)
                    .filter(|(_, d)| d.ready + d.unacked > 0)
                    .map(|(q, d)| format!("{q}: {} ready, {} unacked", d.ready, d.unacked))
                    .collect::<Vec<_>>()
                    .join("; "),
                Err(e) => e,
            };
            panic!("{what}: not drained after {deadline:?}: {report}");
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}
