//! How consecutive batches of one handler overlap.

use crate::model::Outcome;
use tokio::sync::oneshot;

/// Lets consecutive batches overlap: the next batch begins and claims its keys while this one
/// commits, and runs its handlers only once this one has committed (so their writes never wait
/// on each other's locks). A dropped sender counts as fired.
///
/// A batch whose store could not write waits for it and runs again: it keeps what it has not
/// fired (and the previous batch's signal, if it had not waited for it yet) for that run, so
/// the next batch does not overtake it.
#[derive(Debug, Default)]
pub struct Stages {
    /// Resolves when the previous batch has committed (or given up).
    pub after: Option<oneshot::Receiver<()>>,
    /// Fired when this batch's handlers are done and it is about to commit.
    pub committing: Option<oneshot::Sender<()>>,
    /// Fired when this batch has committed (or given up).
    pub committed: Option<oneshot::Sender<()>>,
}

impl Stages {
    /// Waits until the previous batch has committed (at once if there is none).
    pub(crate) async fn wait_for_previous(&mut self) {
        if let Some(after) = self.after.take() {
            let _ = after.await;
        }
    }

    /// Tells the next batch that this one is about to commit.
    pub(crate) fn fire_committing(&mut self) {
        if let Some(committing) = self.committing.take() {
            let _ = committing.send(());
        }
    }

    /// Tells the next batch that this one has committed (or given up).
    pub(crate) fn fire_committed(&mut self) {
        if let Some(committed) = self.committed.take() {
            let _ = committed.send(());
        }
    }

    /// Lets the next batch go, unless one of this batch's `outcomes` waits for its store: then
    /// the batch runs again, and the next one waits for that run.
    pub(crate) fn fire_unless_waiting(&mut self, outcomes: &[Outcome]) {
        if outcomes
            .iter()
            .any(|outcome| matches!(outcome, Outcome::Unavailable(_)))
        {
            return;
        }
        self.after = None;
        self.fire_committing();
        self.fire_committed();
    }
}
