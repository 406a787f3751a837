//! Whether a delivery whose key was just claimed (the key is new) may run: not when its
//! message is older than the inbox can vouch for (the dedup window), nor when its consumers
//! died on it too often (the poison limit).

use super::steps::{Keyed, Limits};
use crate::handler::Handler;
use crate::model::epoch_ms;
use crate::model::{Outcome, RejectReason, Rejection};
use std::time::Duration;

/// The verdict on a delivery whose key was just claimed (the key is new): refused as beyond
/// the dedup window ([`window_verdict`]), else as the poison limit says. `None`: it may run.
pub(crate) fn admit<H: Handler>(keyed: &Keyed, limits: &Limits<'_>) -> Option<Outcome> {
    window_verdict(H::CONSUMER, keyed, limits.retention, epoch_ms())
        .or_else(|| poison_verdict::<H>(keyed, limits.poison))
}

/// `consumer`'s delivery refused when its message was published longer ago than `retention`
/// (at `now_ms`): the
/// inbox holds no row of its key, and a copy applied then may have been swept since, so
/// applying it as new could apply it twice.
fn window_verdict(
    consumer: &str,
    keyed: &Keyed,
    retention: Duration,
    now_ms: i64,
) -> Option<Outcome> {
    let published = keyed.published_at_ms?;
    let age = now_ms.saturating_sub(published);
    let window = i64::try_from(retention.as_millis()).unwrap_or(i64::MAX);
    if age <= window {
        return None;
    }
    tracing::warn!(
        consumer,
        key = keyed.key,
        age_ms = age,
        retention_ms = window,
        "a message older than the dedup window; refusing it"
    );
    Some(Outcome::Rejected(Rejection::new(
        RejectReason::BeyondDedupWindow,
        format!(
            "published {:.1}s ago, longer than the {:.1}s its consumer's inbox keeps a key's row: a copy applied then may have been swept, so it is not applied as new (replay it with `idem dlq replay --force` if it must be)",
            age as f64 / 1000.0,
            retention.as_secs_f64()
        ),
        Some(keyed.key.clone()),
    )))
}

/// The poison limit's verdict on a delivery whose key it has just claimed (the key is new):
/// refused when more than `limit` runs of its handler on redeliveries did not settle before
/// this one (its consumers died or lost their connection while it ran), or held as its count's
/// failure says when the count failed. `None`: it may run.
fn poison_verdict<H: Handler>(keyed: &Keyed, limit: Option<u32>) -> Option<Outcome> {
    if let Some(uncounted) = &keyed.uncounted {
        tracing::info!(
            consumer = H::CONSUMER,
            key = keyed.key,
            outcome = uncounted.label(),
            "the run of a redelivered message could not be counted for the poison limit; not running it now"
        );
        return Some(uncounted.clone());
    }
    let (Some(limit), Some(unsettled)) = (limit, keyed.unsettled) else {
        return None;
    };
    let before = unsettled.saturating_sub(1);
    if before < limit {
        return None;
    }
    tracing::warn!(
        consumer = H::CONSUMER,
        key = keyed.key,
        unsettled = before,
        limit,
        "a message its consumers died on; refusing it as poison"
    );
    Some(Outcome::Rejected(Rejection::new(
        RejectReason::Poison,
        format!(
            "its handler started {before} times on redeliveries and never settled: its consumers died or lost their connection while it ran (poison limit {limit})"
        ),
        Some(keyed.key.clone()),
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Fingerprint;

    fn keyed(published_at_ms: Option<i64>) -> Keyed {
        Keyed {
            key: "k".into(),
            fingerprint: Fingerprint::of(b"x"),
            versioned: None,
            unsettled: None,
            uncounted: None,
            published_at_ms,
        }
    }

    #[test]
    fn a_message_older_than_the_retention_is_refused_and_one_within_it_runs() {
        let day = Duration::from_secs(86_400);
        let now = 10 * 86_400_000;
        let verdict = |published| window_verdict("c", &keyed(published), day, now);
        assert!(verdict(None).is_none(), "no publish time: nothing to judge");
        assert!(
            verdict(Some(now - 86_400_000)).is_none(),
            "exactly the window"
        );
        assert!(verdict(Some(now + 5_000)).is_none(), "a clock ahead");
        let Some(Outcome::Rejected(r)) = verdict(Some(now - 86_400_001)) else {
            panic!("not refused");
        };
        assert_eq!(r.reason, RejectReason::BeyondDedupWindow);
        assert!(r.message.contains("86400.0s"), "{r}");
    }
}
