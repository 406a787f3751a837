//! A store's dispatch work under way: runs committed whose messages are not yet published
//! and, when published from memory, whose rows are not yet removed. Shutdown waits for it
//! before the transport closes, so a graceful stop leaves no row for the relay to publish
//! again.

use std::sync::atomic::{AtomicUsize, Ordering};
use tokio::sync::Notify;

/// Counts runs whose dispatch has not ended; see [`InFlight::idle`].
#[derive(Debug, Default)]
pub(crate) struct InFlight {
    runs: AtomicUsize,
    idle: Notify,
}

impl InFlight {
    /// `runs` more runs are on their way.
    pub(crate) fn start(&self, runs: usize) {
        self.runs.fetch_add(runs, Ordering::AcqRel);
    }

    /// `runs` runs are done with: published and removed, or left to the relay.
    pub(crate) fn end(&self, runs: usize) {
        if runs > 0 && self.runs.fetch_sub(runs, Ordering::AcqRel) == runs {
            self.idle.notify_waiters();
        }
    }

    /// Resolves once no run is under way.
    pub(crate) async fn idle(&self) {
        loop {
            let notified = self.idle.notified();
            let mut notified = std::pin::pin!(notified);
            notified.as_mut().enable(); // registered before the count is read: no wake-up lost
            if self.runs.load(Ordering::Acquire) == 0 {
                return;
            }
            notified.await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[tokio::test]
    async fn idle_waits_for_the_last_run_to_end() {
        let in_flight = Arc::new(InFlight::default());
        in_flight.idle().await; // nothing under way
        in_flight.start(2);
        let waiting = tokio::spawn({
            let in_flight = in_flight.clone();
            async move { in_flight.idle().await }
        });
        in_flight.end(1);
        tokio::task::yield_now().await;
        assert!(!waiting.is_finished(), "idle with a run still under way");
        in_flight.end(1);
        tokio::time::timeout(Duration::from_secs(5), waiting)
            .await
            .expect("idle once the last run ended")
            .expect("no panic");
    }
}
