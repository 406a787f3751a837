//! When a handler's workers want deliveries. Batch workers want them only while a batch
//! gathers; a transport that honours [`Demand`] reads the broker only then, so deliveries that
//! arrive while every batch is in its transaction wait in the broker client's buffer (within
//! the prefetch) instead of waking the consumer one by one.

use tokio::sync::watch;

/// The transport's side: waits until deliveries are wanted. The default is always wanted (per
/// message workers, and transports that ignore it).
#[derive(Debug, Clone, Default)]
pub struct Demand(Option<watch::Receiver<usize>>);

impl Demand {
    /// A demand raised only while a [`Wants`] guard is held, with the handle that raises it.
    pub fn gated() -> (Wants, Self) {
        let (wants, demand) = watch::channel(0);
        (Wants(wants), Self(Some(demand)))
    }

    /// Whether the demand is gated (batch mode) rather than always raised.
    pub fn is_gated(&self) -> bool {
        self.0.is_some()
    }

    /// Whether deliveries are wanted now (always, for an ungated demand).
    pub fn is_wanted(&self) -> bool {
        self.0
            .as_ref()
            .is_none_or(|gathering| *gathering.borrow() > 0)
    }

    /// Returns once deliveries are wanted: at once for an ungated demand, or when the
    /// [`Wants`] side is gone (nothing will ever lower it again).
    pub async fn wanted(&mut self) {
        if let Some(gathering) = &mut self.0 {
            let _ = gathering.wait_for(|n| *n > 0).await;
        }
    }
}

/// The runtime's side of a gated [`Demand`]: deliveries are wanted while any guard from
/// [`Wants::gathering`] is alive.
#[derive(Debug)]
pub struct Wants(watch::Sender<usize>);

impl Wants {
    /// Wants deliveries until the returned guard is dropped.
    pub fn gathering(&self) -> Gathering<'_> {
        self.0.send_modify(|n| *n += 1);
        Gathering(self)
    }
}

/// Deliveries are wanted while this lives (see [`Wants::gathering`]).
#[derive(Debug)]
pub struct Gathering<'a>(&'a Wants);

impl Drop for Gathering<'_> {
    fn drop(&mut self) {
        self.0.0.send_modify(|n| *n = n.saturating_sub(1));
    }
}

#[cfg(test)]
mod tests {
    use crate::transport::demand::Demand;
    use std::time::Duration;
    use tokio::time::timeout;

    #[tokio::test]
    async fn wanted_only_while_a_batch_gathers() {
        let short = Duration::from_millis(50);
        assert!(timeout(short, Demand::default().wanted()).await.is_ok());
        assert!(!Demand::default().is_gated());
        let (wants, mut demand) = Demand::gated();
        assert!(demand.is_gated());
        assert!(!demand.is_wanted());
        assert!(timeout(short, demand.wanted()).await.is_err());
        let first = wants.gathering();
        assert!(demand.is_wanted());
        let second = wants.gathering();
        assert!(timeout(short, demand.wanted()).await.is_ok());
        drop(first);
        assert!(timeout(short, demand.wanted()).await.is_ok());
        drop(second);
        assert!(timeout(short, demand.wanted()).await.is_err());
        drop(wants);
        assert!(timeout(short, demand.wanted()).await.is_ok());
    }
}
