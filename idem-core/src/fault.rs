//! Fault injection for crash tests (feature `fault-injection`): `IDEM_FAULT` names crash points
//! and probabilities, `IDEM_FAULT="before_commit=0.02,after_commit=0.02,in_dead_letter=0.1"`,
//! and the process aborts there. Without the feature none of this is compiled.
//!
//! A run that must prove its faults fired names a file in `IDEM_FAULT_REPORT`: each abort
//! appends its point's name there first (one line), and a configured point that no process has
//! aborted at yet (none listed in the file) aborts at its first chance, whatever its
//! probability. The processes of a run share the file, so each point fires at least once per
//! run.

use std::cell::Cell;
use std::sync::OnceLock;
use std::time::{SystemTime, UNIX_EPOCH};

/// Where the process may be made to crash.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Point {
    /// After the handler ran, before the COMMIT.
    BeforeCommit,
    /// After the COMMIT, before the ack.
    AfterCommit,
    /// After a COMMIT that staged outbox messages, before they are dispatched.
    AfterCommitBeforeDispatch,
    /// After an outbox message was published and confirmed, before its row is removed.
    AfterPublishBeforeMark,
    /// Half-way through dead-lettering: after the reason is recorded, before the message is
    /// moved to the dead-letter queue.
    InDeadLetter,
}

#[derive(Debug, Default)]
struct Faults {
    before_commit: f64,
    after_commit: f64,
    in_dead_letter: f64,
    after_commit_before_dispatch: f64,
    after_publish_before_mark: f64,
}

fn faults() -> &'static Faults {
    static FAULTS: OnceLock<Faults> = OnceLock::new();
    FAULTS.get_or_init(|| {
        let mut faults = Faults::default();
        for part in std::env::var("IDEM_FAULT")
            .unwrap_or_default()
            .split(',')
            .filter(|p| !p.is_empty())
        {
            let parsed = part
                .split_once('=')
                .and_then(|(k, v)| Some((k.trim(), v.trim().parse::<f64>().ok()?)));
            match parsed {
                Some(("before_commit", p)) => faults.before_commit = p,
                Some(("after_commit", p)) => faults.after_commit = p,
                Some(("in_dead_letter", p)) => faults.in_dead_letter = p,
                Some(("after_commit_before_dispatch", p)) => {
                    faults.after_commit_before_dispatch = p;
                }
                Some(("after_publish_before_mark", p)) => faults.after_publish_before_mark = p,
                _ => tracing::error!(
                    part,
                    "IDEM_FAULT: expected before_commit=<p>, after_commit=<p>, in_dead_letter=<p>, after_commit_before_dispatch=<p> or after_publish_before_mark=<p>"
                ),
            }
        }
        faults
    })
}

impl Point {
    /// Its name in `IDEM_FAULT` and in the report.
    pub fn name(self) -> &'static str {
        match self {
            Point::BeforeCommit => "before_commit",
            Point::AfterCommit => "after_commit",
            Point::InDeadLetter => "in_dead_letter",
            Point::AfterCommitBeforeDispatch => "after_commit_before_dispatch",
            Point::AfterPublishBeforeMark => "after_publish_before_mark",
        }
    }
}

/// Aborts the process at `point` with the configured probability (or at once, the first time
/// the run reaches it, with `IDEM_FAULT_REPORT`).
pub fn maybe_crash(point: Point) {
    let p = match point {
        Point::BeforeCommit => faults().before_commit,
        Point::AfterCommit => faults().after_commit,
        Point::InDeadLetter => faults().in_dead_letter,
        Point::AfterCommitBeforeDispatch => faults().after_commit_before_dispatch,
        Point::AfterPublishBeforeMark => faults().after_publish_before_mark,
    };
    if p <= 0.0 {
        return;
    }
    let report = std::env::var_os("IDEM_FAULT_REPORT");
    let first = report.as_ref().is_some_and(|file| {
        std::fs::read_to_string(file).map_or(true, |seen| !seen.lines().any(|l| l == point.name()))
    });
    if first || random() < p {
        tracing::error!(?point, "fault injection: aborting the process");
        if let Some(file) = report {
            use std::io::Write as _;
            let appended = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(file)
                .and_then(|mut f| f.write_all(format!("{}\n", point.name()).as_bytes()));
            if let Err(e) = appended {
                tracing::error!(error = %e, "fault injection: the report cannot be written");
            }
        }
        std::process::abort();
    }
}

/// A uniform number in [0, 1) from a per-thread xorshift generator.
fn random() -> f64 {
    thread_local! {
        static STATE: Cell<u64> = Cell::new(
            SystemTime::now().duration_since(UNIX_EPOCH).map_or(1, |d| d.as_nanos() as u64)
                ^ (u64::from(std::process::id()) << 32)
                | 1,
        );
    }
    STATE.with(|s| {
        let mut x = s.get();
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        s.set(x);
        (x >> 11) as f64 / (1u64 << 53) as f64
    })
}

/// A publisher that may crash after a confirmed publish, before the outbox row is removed
/// ([`Point::AfterPublishBeforeMark`]).
pub(crate) struct Crashing(pub(crate) std::sync::Arc<dyn crate::transport::Outbound>);

impl crate::transport::Outbound for Crashing {
    fn publish<'a>(
        &'a self,
        message: &'a crate::model::Outgoing,
    ) -> crate::future::BoxFuture<'a, Result<(), crate::transport::OutboundError>> {
        Box::pin(async move {
            self.0.publish(message).await?;
            maybe_crash(Point::AfterPublishBeforeMark);
            Ok(())
        })
    }

    fn publish_all<'a>(
        &'a self,
        messages: &'a [crate::model::Outgoing],
    ) -> crate::future::BoxFuture<'a, Vec<Result<(), crate::transport::OutboundError>>> {
        self.publish_all_then(messages, Box::new(|| {}))
    }

    fn publish_all_then<'a>(
        &'a self,
        messages: &'a [crate::model::Outgoing],
        sent: Box<dyn FnOnce() + Send + 'a>,
    ) -> crate::future::BoxFuture<'a, Vec<Result<(), crate::transport::OutboundError>>> {
        Box::pin(async move {
            let results = self.0.publish_all_then(messages, sent).await;
            if results.iter().any(Result::is_ok) {
                maybe_crash(Point::AfterPublishBeforeMark);
            }
            results
        })
    }
}
