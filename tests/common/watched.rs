//! Consumer processes a test starts and watches: each one's stderr goes to a file of its own,
//! and a process that exits while the test still waits on it fails the test at once, with its
//! exit status and its last stderr lines, instead of the test waiting out its deadline.
#![allow(dead_code)]

use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

/// A child process whose stderr is kept; killed (SIGKILL) and reaped when dropped.
pub struct Watched {
    pub child: Child,
    name: String,
    stderr: PathBuf,
    started: Instant,
    _dir: tempfile::TempDir,
}

impl Watched {
    /// Starts `command` (stdout discarded, stderr kept), called `name` in failures.
    pub fn spawn(name: &str, command: &mut Command) -> Self {
        Self::spawn_logging(name, command, None)
    }

    /// As [`Watched::spawn`], appending stdout and stderr to `log` when given.
    pub fn spawn_logging(name: &str, command: &mut Command, log: Option<&std::path::Path>) -> Self {
        let dir = tempfile::tempdir().expect("a directory for the child's stderr");
        let stderr = log.map_or_else(|| dir.path().join("stderr"), std::path::Path::to_path_buf);
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&stderr)
            .expect("the child's stderr file");
        let stdout = match log {
            Some(_) => Stdio::from(file.try_clone().expect("the log file")),
            None => Stdio::null(),
        };
        let child = command
            .stdout(stdout)
            .stderr(Stdio::from(file))
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Self {
            child,
            name: name.to_owned(),
            stderr,
            started: Instant::now(),
            _dir: dir,
        }
    }

    /// How long ago it was started.
    pub fn age(&self) -> Duration {
        self.started.elapsed()
    }

    /// The process id.
    pub fn id(&self) -> u32 {
        self.child.id()
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().ok().flatten()
    }

    /// The last `lines` lines it wrote to stderr, a backtrace's frames left out.
    pub fn stderr_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.stderr).unwrap_or_default();
        let frame = |line: &&str| {
            let line = line.trim_start();
            line.starts_with("at ")
                || line
                    .split_once(": ")
                    .is_some_and(|(n, _)| n.parse::<u32>().is_ok())
        };
        let all: Vec<&str> = text.lines().filter(|l| !frame(l)).collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Fails the test if the process has exited.
    pub fn assert_running(&mut self) {
        if let Some(status) = self.exited() {
            panic!(
                "{} exited unexpectedly ({status}); its last stderr lines:\n{}",
                self.name,
                self.stderr_tail(20)
            );
        }
    }
}

impl Drop for Watched {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Polls `condition` until it holds, failing after `deadline` with `what`, and at once when
/// one of `children` exits.
pub async fn wait_until<F, Fut>(
    what: &str,
    deadline: Duration,
    children: &mut [&mut Watched],
    mut condition: F,
) where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let start = Instant::now();
    loop {
        for child in children.iter_mut() {
            child.assert_running();
        }
        if condition().await {
            return;
        }
        assert!(
            start.elapsed() < deadline,
            "timed out after {deadline:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}
