//! [`Health`]: whether a runtime is alive and ready, for health endpoints (`/healthz`,
//! `/readyz`) and orchestrators.

use super::pause::Pauses;
use crate::registry::Registration;
use crate::store::Stores;
use crate::transport::Transport;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// How long a readiness check waits for a store before calling it unreachable.
const STORE_CHECK_TIMEOUT: Duration = Duration::from_secs(2);

/// A runtime's health, readable while it runs ([`crate::runtime::Runtime::health`]).
#[non_exhaustive]
pub struct Health {
    transport: Arc<dyn Transport>,
    stores: Arc<Stores>,
    /// Each handler and the queue it consumes.
    handlers: Vec<(&'static Registration, String)>,
    consuming: AtomicBool,
    pauses: Arc<Pauses>,
}

/// The answer of [`Health::readiness`].
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub struct Readiness {
    /// Whether the runtime consumes, every queue's consumer is connected to the broker, and
    /// every handler's store answers and writes (a store that cannot write for now pauses its
    /// handlers' consumption, and the runtime is not ready while it does).
    pub ready: bool,
    /// What is not ready, one line each.
    pub problems: Vec<String>,
}

impl Health {
    pub(crate) fn new(
        transport: Arc<dyn Transport>,
        stores: Arc<Stores>,
        handlers: Vec<(&'static Registration, String)>,
        pauses: Arc<Pauses>,
    ) -> Self {
        Self {
            transport,
            stores,
            handlers,
            consuming: AtomicBool::new(false),
            pauses,
        }
    }

    /// Records whether the runtime consumes (from its start to its shutdown).
    pub(crate) fn set_consuming(&self, consuming: bool) {
        self.consuming.store(consuming, Ordering::Release);
    }

    /// Whether the runtime consumes: it started and is not shutting down.
    pub fn is_consuming(&self) -> bool {
        self.consuming.load(Ordering::Acquire)
    }

    /// Checks readiness: the runtime consumes, no store has paused its handlers (it could not
    /// write, and no probe write has succeeded since), the transport reports every handler's
    /// queue connected, and every handler's store answers its check within two seconds.
    pub async fn readiness(&self) -> Readiness {
        let mut problems = Vec::new();
        if !self.is_consuming() {
            problems.push("the runtime is not consuming".to_owned());
        }
        for (store, since, reason) in self.pauses.paused() {
            problems.push(format!(
                "the {store} store cannot write (for {} s; last: {reason}): its handlers' consumption is paused until a probe write succeeds",
                since.as_secs()
            ));
        }
        for (registration, queue) in &self.handlers {
            if !self.transport.connected(queue) {
                problems.push(format!("queue `{queue}`: not connected to the broker"));
            }
            let consumer = registration.consumer();
            let check = registration.check_store(&self.stores);
            match tokio::time::timeout(STORE_CHECK_TIMEOUT, check).await {
                Ok(Ok(())) => {}
                Ok(Err(e)) => problems.push(format!("`{consumer}`'s store: {e}")),
                Err(_) => problems.push(format!(
                    "`{consumer}`'s store did not answer within {STORE_CHECK_TIMEOUT:?}"
                )),
            }
        }
        Readiness {
            ready: problems.is_empty(),
            problems,
        }
    }
}
