//! The keys this process is executing right now: a second request with one of them is answered
//! 409 at once, without touching the database.

use crate::key::Scope;
use std::collections::HashSet;
use std::sync::{Arc, Mutex, PoisonError};

/// The scopes in flight in this process.
#[derive(Debug, Default, Clone)]
pub(crate) struct InFlight(Arc<Mutex<HashSet<Scope>>>);

impl InFlight {
    /// Marks `scope` in flight until the guard drops; `None` when it already is.
    pub(crate) fn enter(&self, scope: &Scope) -> Option<FlightGuard> {
        let mut set = self.0.lock().unwrap_or_else(PoisonError::into_inner);
        set.insert(scope.clone()).then(|| FlightGuard {
            set: self.0.clone(),
            scope: scope.clone(),
        })
    }
}

/// Holds one scope in flight; dropping it (the request ended, or its future was dropped)
/// frees the scope.
#[derive(Debug)]
pub(crate) struct FlightGuard {
    set: Arc<Mutex<HashSet<Scope>>>,
    scope: Scope,
}

impl Drop for FlightGuard {
    fn drop(&mut self) {
        self.set
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&self.scope);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_request_per_scope_at_a_time() {
        let flights = InFlight::default();
        let scope = Scope::new("op", None, "k");
        let first = flights.enter(&scope).unwrap();
        assert!(flights.enter(&scope).is_none());
        assert!(flights.enter(&Scope::new("op", None, "other")).is_some());
        drop(first);
        assert!(flights.enter(&scope).is_some());
    }
}
