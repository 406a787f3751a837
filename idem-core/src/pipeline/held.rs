//! The connection a worker keeps between its deliveries or batches ([`HeldConnection`]).

use crate::store::InboxStore;
use std::any::Any;

/// The connection one worker keeps between its deliveries or batches ([`InboxStore::begin_on`]), whatever
/// its store: a worker runs one handler, and so holds its store's [`InboxStore::Held`]. Empty
/// by default; dropped, it gives the connection back.
#[derive(Default)]
pub struct HeldConnection(Option<Box<dyn Any + Send>>);

impl std::fmt::Debug for HeldConnection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_tuple("HeldConnection")
            .field(&self.0.is_some())
            .finish()
    }
}

impl HeldConnection {
    /// The slot of store `S`'s connection (made empty if it held another store's).
    pub(super) fn of<S: InboxStore>(&mut self) -> &mut Option<S::Held> {
        let boxed = self.0.get_or_insert_with(|| Box::new(None::<S::Held>));
        if !boxed.is::<Option<S::Held>>() {
            *boxed = Box::new(None::<S::Held>);
        }
        match boxed.downcast_mut::<Option<S::Held>>() {
            Some(slot) => slot,
            None => unreachable!("the slot was just made of this type"),
        }
    }
}
