//! How consecutive batches of one handler overlap.

use tokio::sync::oneshot;

/// Lets consecutive batches overlap: the next batch begins and claims its keys while this one
/// commits, and runs its handlers only once this one has committed (so their writes never wait
/// on each other's locks). A dropped sender counts as fired.
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
}
