//! A JetStream cluster of a test's own: three `nats-server` processes (on the PATH) on free
//! ports, routed to each other, each with a store directory of its own, which the test can
//! kill with SIGKILL one at a time and start again on the same ports and store. The servers
//! advertise no addresses to clients (`--no_advertise`): a client reaches them only through
//! the addresses it was given.
#![allow(dead_code)]

use super::tls_node::free_port;
use async_nats::jetstream;
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// One server of the cluster.
struct Member {
    port: u16,
    route_port: u16,
    store: tempfile::TempDir,
    server: Mutex<Option<Child>>,
}

pub struct NatsCluster {
    members: Vec<Member>,
}

impl NatsCluster {
    /// Three servers with JetStream, up once the cluster has a JetStream leader. Without
    /// `nats-server` on the PATH the test fails, or, with the opt-out of
    /// [`super::own_servers`], `None`.
    pub async fn start() -> Option<Self> {
        if !super::own_servers::can_start("nats-server", "a JetStream cluster of the test's own") {
            return None;
        }
        let members = (0..3)
            .map(|_| Member {
                port: free_port(),
                route_port: free_port(),
                store: tempfile::tempdir().unwrap(),
                server: Mutex::new(None),
            })
            .collect();
        let cluster = Self { members };
        for n in 0..3 {
            cluster.spawn(n);
        }
        cluster.wait_ready(None).await;
        Some(cluster)
    }

    /// The URL of server `n` (0, 1, 2).
    pub fn url(&self, n: usize) -> String {
        format!("nats://127.0.0.1:{}", self.members[n].port)
    }

    /// The client port of server `n`.
    pub fn port(&self, n: usize) -> u16 {
        self.members[n].port
    }

    /// Every server's URL, comma-separated, as a client is given them.
    pub fn urls(&self) -> String {
        (0..3).map(|n| self.url(n)).collect::<Vec<_>>().join(",")
    }

    /// The server name of server `n`, as stream and consumer infos name their leaders.
    pub fn name(n: usize) -> String {
        format!("idem-js-{n}")
    }

    fn spawn(&self, n: usize) {
        let member = &self.members[n];
        let routes: Vec<String> = self
            .members
            .iter()
            .enumerate()
            .filter(|(other, _)| *other != n)
            .map(|(_, m)| format!("nats://127.0.0.1:{}", m.route_port))
            .collect();
        let store = member.store.path().display().to_string();
        let server = Command::new("nats-server")
            .args(["-a", "127.0.0.1", "-p", &member.port.to_string()])
            .args(["-js", "-sd", &store])
            .args(["--server_name", &Self::name(n)])
            .args(["--cluster_name", "idem-js"])
            .args([
                "--cluster",
                &format!("nats://127.0.0.1:{}", member.route_port),
            ])
            .args(["--routes", &routes.join(",")])
            .arg("--no_advertise")
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        *member.server.lock().unwrap() = Some(server);
    }

    /// Kills server `n` with SIGKILL.
    pub fn kill(&self, n: usize) {
        let taken = self.members[n].server.lock().unwrap().take();
        if let Some(mut server) = taken {
            let _ = server.kill();
            let _ = server.wait();
        }
    }

    /// Starts server `n` again on its ports and store, and waits until it answers JetStream.
    pub async fn start_again(&self, n: usize) {
        self.spawn(n);
        self.wait_ready(Some(n)).await;
    }

    /// Waits until JetStream answers through server `only` (or each server) with an answer of
    /// its own, not "unavailable": the cluster has a JetStream leader.
    async fn wait_ready(&self, only: Option<usize>) {
        let deadline = Instant::now() + Duration::from_secs(60);
        let servers: Vec<usize> = only.map_or_else(|| (0..3).collect(), |n| vec![n]);
        for n in servers {
            loop {
                let url = self.url(n);
                let ready = async {
                    use async_nats::jetstream::context::GetStreamErrorKind;
                    let client = async_nats::connect(url).await.ok()?;
                    match jetstream::new(client).get_stream("READINESS_PROBE").await {
                        Ok(_) => Some(()),
                        Err(e) => match e.kind() {
                            GetStreamErrorKind::JetStream(e) if e.code() != 503 => Some(()),
                            _ => None,
                        },
                    }
                };
                if tokio::time::timeout(Duration::from_secs(3), ready)
                    .await
                    .ok()
                    .flatten()
                    .is_some()
                {
                    break;
                }
                assert!(
                    Instant::now() < deadline,
                    "the test's JetStream cluster did not answer through server {n} in 60 s"
                );
                tokio::time::sleep(Duration::from_millis(200)).await;
            }
        }
    }

    /// Which server leads `stream`, as the cluster says through `js`.
    pub async fn leader(js: &jetstream::Context, stream: &str) -> Option<usize> {
        let mut stream = js.get_stream(stream).await.ok()?;
        let info = stream.info().await.ok()?;
        let leader = info.cluster.as_ref()?.leader.clone()?;
        (0..3).find(|n| Self::name(*n) == leader)
    }
}

impl Drop for NatsCluster {
    fn drop(&mut self) {
        for n in 0..self.members.len() {
            self.kill(n);
        }
    }
}
