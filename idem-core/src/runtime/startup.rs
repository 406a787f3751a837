//! Start-up: every handler's store checked and the topology declared, each waited for with
//! backoff while it fails in a way that passes (a database or broker that is restarting, or
//! one that does not answer yet), up to
//! the runtime's start deadline ([`crate::runtime::RuntimeBuilder::start_deadline`]). A failure that
//! waiting will not mend (a table never migrated, topology the broker refuses) ends the start at
//! once.

use super::error::RuntimeError;
use super::run::Runtime;
use crate::model::ErrorClass;
use crate::transport::{QueueSpec, TransportError};
use std::future::Future;
use std::time::Duration;
use tokio::time::Instant;

/// How long start-up waits, unless configured, for a store or broker that fails transiently.
pub const DEFAULT_START_DEADLINE: Duration = Duration::from_secs(30);

/// The first pause between two tries; it doubles up to [`LONGEST_PAUSE`].
const FIRST_PAUSE: Duration = Duration::from_millis(100);
const LONGEST_PAUSE: Duration = Duration::from_secs(5);

impl Runtime {
    /// Checks every handler's store, then declares the topology, as the module says.
    pub(super) async fn start(&self, specs: &[QueueSpec]) -> Result<(), RuntimeError> {
        let deadline = Instant::now() + self.start_deadline;
        for actor in &self.actors {
            let consumer = actor.registration.consumer();
            let checked = patiently(
                deadline,
                "the inbox",
                |e: &crate::model::StoreError| e.class() != ErrorClass::Permanent,
                || actor.registration.check_store(&self.stores),
            )
            .await;
            checked.map_err(|error| match error.class() {
                ErrorClass::Transient | ErrorClass::Unavailable => RuntimeError::StoreUnreachable {
                    consumer,
                    waited: self.start_deadline,
                    error,
                },
                ErrorClass::Permanent if error.operation() == crate::store::DURABILITY => {
                    RuntimeError::StoreSettings { consumer, error }
                }
                ErrorClass::Permanent => RuntimeError::Store { consumer, error },
            })?;
        }
        let connection = |e: &TransportError| {
            matches!(
                e,
                TransportError::Connection { .. } | TransportError::NotAnswering { .. }
            )
        };
        patiently(deadline, "the broker", connection, || {
            self.transport.declare(specs)
        })
        .await?;
        Ok(())
    }
}

/// Runs `attempt` until it succeeds, fails in a way `passes` does not call passing, or
/// `deadline` comes, pausing with backoff between tries; the last failure is returned.
async fn patiently<E: std::fmt::Display, F: Future<Output = Result<(), E>>>(
    deadline: Instant,
    what: &str,
    passes: impl Fn(&E) -> bool,
    mut attempt: impl FnMut() -> F,
) -> Result<(), E> {
    let mut pause = FIRST_PAUSE;
    loop {
        match attempt().await {
            Err(e) if passes(&e) && Instant::now() + pause < deadline => {
                tracing::warn!(error = %e, retry_in = ?pause, "{what} is not reachable yet; waiting for it");
                tokio::time::sleep(pause).await;
                pause = (pause * 2).min(LONGEST_PAUSE);
            }
            done => return done,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[tokio::test(start_paused = true)]
    async fn a_passing_failure_is_tried_again_until_it_succeeds() {
        let tries = Cell::new(0);
        let deadline = Instant::now() + Duration::from_secs(10);
        let done = patiently(
            deadline,
            "it",
            |_: &String| true,
            || {
                tries.set(tries.get() + 1);
                let ok = tries.get() == 4;
                async move { if ok { Ok(()) } else { Err("down".to_owned()) } }
            },
        )
        .await;
        assert_eq!((done, tries.get()), (Ok(()), 4));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lasting_failure_ends_at_once_and_a_passing_one_at_the_deadline() {
        let tries = Cell::new(0);
        let deadline = Instant::now() + Duration::from_secs(10);
        let attempt = || {
            tries.set(tries.get() + 1);
            async { Err::<(), _>("broken".to_owned()) }
        };
        assert!(patiently(deadline, "it", |_| false, attempt).await.is_err());
        assert_eq!(tries.get(), 1);
        let started = Instant::now();
        assert!(patiently(deadline, "it", |_| true, attempt).await.is_err());
        assert!(started.elapsed() <= Duration::from_secs(10));
        assert!(tries.get() > 4, "{}", tries.get());
    }
}
