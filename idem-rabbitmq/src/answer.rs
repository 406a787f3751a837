//! Waiting for the broker's answer (a publish sent, a confirm, an RPC reply) only while the
//! connection it must come on is alive.
//!
//! lapin rejects what is pending when a connection is lost, but a publish registered just as the
//! loss is handled can be left neither confirmed nor rejected, and an await on it never ends
//! (reproduced by `tests/failover.rs`, cutting a publisher's connection under load). Every
//! await on the broker in publishing, settling and subscribing goes through [`unless_lost`].

use futures_util::FutureExt;
use std::future::Future;
use std::time::Duration;

/// How often a pending answer looks at its connection.
const LOOK_EVERY: Duration = Duration::from_millis(100);

/// Why an answer will never come.
const LOST: &str =
    "the connection was lost before the broker answered; nothing is known to have arrived";

/// The error of an answer that will never come.
pub(crate) fn lost() -> lapin::Error {
    std::io::Error::new(std::io::ErrorKind::ConnectionAborted, LOST).into()
}

/// `answer` on `channel`, or [`lost`] once the channel's connection is gone.
pub(crate) async fn on_channel<T>(
    channel: &lapin::Channel,
    answer: impl Future<Output = lapin::Result<T>>,
) -> lapin::Result<T> {
    unless_lost(|| channel.status().connected(), answer, lost).await
}

/// `answer`, or `Err(lost())` as soon as `alive` says the connection is gone while it is
/// still pending (it is polled first, so an answer that came is never thrown away).
pub(crate) async fn unless_lost<T, E>(
    alive: impl Fn() -> bool,
    answer: impl Future<Output = Result<T, E>>,
    lost: impl FnOnce() -> E,
) -> Result<T, E> {
    let mut answer = std::pin::pin!(answer);
    if let Some(answered) = (&mut answer).now_or_never() {
        return answered; // no timer for an answer already there
    }
    let mut look = tokio::time::interval(LOOK_EVERY);
    look.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            biased;
            result = &mut answer => return result,
            _ = look.tick() => {
                if !alive() {
                    return Err(lost());
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn an_answer_that_came_wins_over_a_lost_connection() {
        let got = unless_lost(|| false, async { Ok::<_, &str>(7) }, || "lost").await;
        assert_eq!(got, Ok(7));
    }

    #[tokio::test]
    async fn a_pending_answer_ends_when_the_connection_is_gone() {
        use std::sync::atomic::{AtomicUsize, Ordering};
        let looks = AtomicUsize::new(0);
        // Alive for three looks, then gone.
        let alive = || looks.fetch_add(1, Ordering::SeqCst) < 3;
        let ended = unless_lost(alive, std::future::pending::<Result<(), &str>>(), || "lost");
        assert_eq!(ended.await, Err("lost"));
        assert_eq!(
            looks.load(Ordering::SeqCst),
            4,
            "it ended before the connection was gone"
        );
    }
}
