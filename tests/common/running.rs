//! A runtime started in the background of a test, stopped and awaited with a deadline.
#![allow(dead_code)]

use idem::{RuntimeBuilder, RuntimeError, Snapshot, Stats};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

pub struct Running {
    pub stop: oneshot::Sender<()>,
    pub task: JoinHandle<Result<(), RuntimeError>>,
    pub stats: Arc<Stats>,
}

pub fn start(builder: RuntimeBuilder) -> Running {
    start_watched(builder).0
}

/// [`start`], with the runtime's health, which tells when it consumes.
pub fn start_watched(builder: RuntimeBuilder) -> (Running, Arc<idem::Health>) {
    let runtime = builder.build().unwrap();
    let health = runtime.health();
    let stats = runtime.stats();
    let (stop, stopped) = oneshot::channel::<()>();
    let task = tokio::spawn(runtime.run_until(async {
        let _ = stopped.await;
    }));
    (Running { stop, task, stats }, health)
}

impl Running {
    pub fn now(&self) -> Snapshot {
        self.stats.snapshot()
    }

    pub async fn shut_down(self) -> Snapshot {
        let _ = self.stop.send(());
        finish(self.task).await;
        self.stats.snapshot()
    }
}

pub const DEADLINE: Duration = Duration::from_secs(60);

/// Waits for a runtime to stop; a shutdown that hangs fails the test instead of the CI run.
pub async fn finish(task: JoinHandle<Result<(), RuntimeError>>) {
    match tokio::time::timeout(DEADLINE, task).await {
        Ok(result) => result.unwrap().unwrap(),
        Err(_) => panic!("the runtime did not shut down within {DEADLINE:?}"),
    }
}
