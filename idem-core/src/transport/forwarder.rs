//! The due-copy forwarder ([`forward_due`]), for a broker that cannot deliver a message later
//! by itself. A retry copy waits outside its queue (NATS: in the queue's retry stream) with the
//! time it is due. The forwarder takes each copy as it comes. A copy not yet due is given back
//! until it is. A due one is published into its queue and then removed. A copy whose removal
//! is not confirmed is forwarded again later under the same copy id, so the broker's duplicate
//! window or the inbox drops it: that is logged, and the forwarder goes on. A transport writes
//! only the broker calls ([`DueCopies`]).

use crate::future::BoxFuture;
use std::fmt;
use std::time::Duration;

/// How long a copy whose publish failed waits before it is tried again.
pub const FORWARD_RETRY: Duration = Duration::from_secs(1);

/// The broker calls of a due-copy forwarder.
pub trait DueCopies: Send {
    /// A copy, as the broker hands it over.
    type Copy: Send;
    /// A broker call that failed.
    type Error: fmt::Display + Send;

    /// The next copy, waiting until there is one. An error ends the forwarder.
    fn next(&mut self) -> BoxFuture<'_, Result<Self::Copy, Self::Error>>;

    /// When `copy` is due, in milliseconds since the Unix epoch (0: now).
    fn due(&self, copy: &Self::Copy) -> u64;

    /// Gives `copy` back, to be handed over again after `delay`. An error ends the forwarder.
    fn postpone(
        &mut self,
        copy: Self::Copy,
        delay: Duration,
    ) -> BoxFuture<'_, Result<(), Self::Error>>;

    /// Publishes `copy` into its queue and waits for the broker's confirm.
    fn forward<'a>(&'a mut self, copy: &'a Self::Copy) -> BoxFuture<'a, Result<(), Self::Error>>;

    /// Removes `copy`, forwarded, from where it waited, and waits for the broker's confirm.
    fn remove(&mut self, copy: Self::Copy) -> BoxFuture<'_, Result<(), Self::Error>>;
}

/// Forwards `copies` into `queue` as they fall due, until taking or giving back a copy fails;
/// returns that failure. `now` is the time in milliseconds since the Unix epoch.
pub async fn forward_due<C: DueCopies>(
    mut copies: C,
    queue: &str,
    now: impl Fn() -> u64 + Send,
) -> C::Error {
    loop {
        let copy = match copies.next().await {
            Ok(copy) => copy,
            Err(e) => return e,
        };
        let (due, now) = (copies.due(&copy), now());
        if due > now {
            if let Err(e) = copies
                .postpone(copy, Duration::from_millis(due - now))
                .await
            {
                return e;
            }
            continue;
        }
        match copies.forward(&copy).await {
            Ok(()) => {
                if let Err(e) = copies.remove(copy).await {
                    tracing::warn!(queue, error = %e, "a forwarded retry copy's removal was not confirmed; it may be forwarded again, under the same id");
                }
            }
            Err(e) => {
                tracing::warn!(queue, error = %e, "a due retry copy was not published; it is tried again");
                if let Err(e) = copies.postpone(copy, FORWARD_RETRY).await {
                    return e;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Copies `(id, due)`, with the calls made on them, and the calls that fail.
    #[derive(Default)]
    struct Script {
        waiting: VecDeque<(&'static str, u64)>,
        calls: Vec<String>,
        fail_forward: Vec<&'static str>,
        fail_remove: Vec<&'static str>,
    }

    impl DueCopies for &mut Script {
        type Copy = (&'static str, u64);
        type Error = String;

        fn next(&mut self) -> BoxFuture<'_, Result<Self::Copy, String>> {
            let next = self.waiting.pop_front().ok_or_else(|| "ended".to_owned());
            Box::pin(std::future::ready(next))
        }

        fn due(&self, copy: &Self::Copy) -> u64 {
            copy.1
        }

        fn postpone(
            &mut self,
            copy: Self::Copy,
            delay: Duration,
        ) -> BoxFuture<'_, Result<(), String>> {
            self.calls
                .push(format!("postpone {} {}ms", copy.0, delay.as_millis()));
            // Handed over again, due now.
            self.waiting.push_back((copy.0, 0));
            Box::pin(std::future::ready(Ok(())))
        }

        fn forward<'a>(&'a mut self, copy: &'a Self::Copy) -> BoxFuture<'a, Result<(), String>> {
            self.calls.push(format!("forward {}", copy.0));
            let failed = match self.fail_forward.iter().position(|id| *id == copy.0) {
                Some(at) => {
                    self.fail_forward.remove(at);
                    Err("no stream".to_owned())
                }
                None => Ok(()),
            };
            Box::pin(std::future::ready(failed))
        }

        fn remove(&mut self, copy: Self::Copy) -> BoxFuture<'_, Result<(), String>> {
            self.calls.push(format!("remove {}", copy.0));
            let failed = match self.fail_remove.contains(&copy.0) {
                true => Err("the ack went unanswered".to_owned()),
                false => Ok(()),
            };
            Box::pin(std::future::ready(failed))
        }
    }

    #[tokio::test]
    async fn copies_wait_until_due_a_failed_publish_waits_and_an_unanswered_removal_goes_on() {
        let mut script = Script {
            waiting: [
                ("early", 1_500),
                ("unanswered", 0),
                ("refused", 0),
                ("last", 0),
            ]
            .into(),
            fail_forward: vec!["refused"],
            fail_remove: vec!["unanswered"],
            ..Script::default()
        };
        let ended = forward_due(&mut script, "q", || 1_000).await;
        assert_eq!(ended, "ended", "only taking a copy ends the forwarder");
        assert_eq!(
            script.calls,
            [
                "postpone early 500ms",
                // Its removal goes unanswered: logged, and the next copy is taken.
                "forward unanswered",
                "remove unanswered",
                // Its publish fails: tried again a second later.
                "forward refused",
                "postpone refused 1000ms",
                "forward last",
                "remove last",
                "forward early",
                "remove early",
                "forward refused",
                "remove refused",
            ]
        );
    }
}
