//! A NATS server with JetStream of a test's own (`nats-server` on the PATH), on a free port
//! with a store directory of its own, which the test can kill with SIGKILL and start again on
//! the same port and store: the machine's server is shared with every other test.
#![allow(dead_code)]

use super::tls_node::free_port;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

pub struct NatsNode {
    pub port: u16,
    store: tempfile::TempDir,
    server: std::sync::Mutex<Option<Child>>,
    /// Whether it runs with JetStream.
    jetstream: std::sync::atomic::AtomicBool,
}

impl NatsNode {
    /// A server of the test's own, listening with JetStream ready. Without `nats-server` on
    /// the PATH the test fails, or, with the opt-out of [`super::own_servers`], `None`.
    pub async fn start() -> Option<Self> {
        Self::start_with(true).await
    }

    /// As [`NatsNode::start`], without JetStream: nobody answers its API until
    /// [`NatsNode::restart_with_jetstream`].
    pub async fn start_without_jetstream() -> Option<Self> {
        Self::start_with(false).await
    }

    async fn start_with(jetstream: bool) -> Option<Self> {
        if !super::own_servers::can_start("nats-server", "a NATS server of the test's own") {
            return None;
        }
        let node = Self {
            port: free_port(),
            store: tempfile::tempdir().unwrap(),
            server: std::sync::Mutex::new(None),
            jetstream: std::sync::atomic::AtomicBool::new(jetstream),
        };
        node.spawn().await;
        Some(node)
    }

    /// Stops the server (SIGKILL) and starts it again on the same port and store, with
    /// JetStream.
    pub async fn restart_with_jetstream(&self) {
        self.kill();
        self.jetstream
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.spawn().await;
    }

    /// Its URL.
    pub fn url(&self) -> String {
        format!("nats://127.0.0.1:{}", self.port)
    }

    /// Kills the server with SIGKILL, starts it again on the same port and store, and waits
    /// until JetStream answers.
    pub async fn restart(&self) {
        self.kill();
        self.spawn().await;
    }

    fn kill(&self) {
        let taken = self.server.lock().unwrap().take();
        if let Some(mut server) = taken {
            let _ = server.kill();
            let _ = server.wait();
        }
    }

    async fn spawn(&self) {
        let store = self.store.path().display().to_string();
        let jetstream = self.jetstream.load(std::sync::atomic::Ordering::SeqCst);
        let mut command = Command::new("nats-server");
        command.args(["-a", "127.0.0.1", "-p", &self.port.to_string()]);
        if jetstream {
            command.args(["-js", "-sd", &store]);
        }
        let server = command
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        *self.server.lock().unwrap() = Some(server);
        // Up when a client's JetStream request is answered (JetStream recovers its streams
        // from the store before it answers).
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = async {
                use async_nats::jetstream::context::GetStreamErrorKind;
                let client = async_nats::connect(self.url()).await.ok()?;
                if !jetstream {
                    return Some(());
                }
                // JetStream's own answer, even "no such stream", says it is up.
                match async_nats::jetstream::new(client)
                    .get_stream("READINESS_PROBE")
                    .await
                {
                    Ok(_) => Some(()),
                    Err(e) if matches!(e.kind(), GetStreamErrorKind::JetStream(_)) => Some(()),
                    Err(_) => None,
                }
            };
            if tokio::time::timeout(Duration::from_secs(2), ready)
                .await
                .ok()
                .flatten()
                .is_some()
            {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the test's NATS server on port {} did not come up in 30 s",
                self.port
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for NatsNode {
    fn drop(&mut self) {
        self.kill();
    }
}
