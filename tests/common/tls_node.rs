//! A RabbitMQ node of the test's own with a TLS listener (and a plain one beside it, for a
//! publisher that sends raw frames), its certificate signed by a CA made for the test with
//! `openssl`. It runs beside the machine's node (own name, ports, data directory; the same
//! Erlang cookie, so as the `rabbitmq` user when the tests run as root) and stops when dropped.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

pub struct TlsNode {
    pub name: String,
    /// `amqps://guest:guest@localhost:<port>/%2f`
    pub amqps_url: String,
    /// `amqp://guest:guest@127.0.0.1:<port>/%2f`, the same node without TLS.
    pub plain_url: String,
    /// `127.0.0.1:<port>` of the plain listener.
    pub plain_address: String,
    /// The CA that signed the node's certificate, PEM.
    pub ca_pem: String,
    dir: tempfile::TempDir,
}

/// A port nothing listens on now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .expect("a free port")
        .local_addr()
        .expect("its address")
        .port()
}

fn run(dir: &Path, program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("cannot run {program}: {e}"))
}

fn is_root() -> bool {
    run(Path::new("/"), "id", &["-u"]).stdout.trim_ascii() == b"0"
}

/// `command` in a shell, as the `rabbitmq` user when the tests run as root.
fn as_broker_user(command: &str) -> Command {
    if is_root() {
        let mut su = Command::new("su");
        su.args(["rabbitmq", "-s", "/bin/sh", "-c", command]);
        su.current_dir("/var/lib/rabbitmq");
        su
    } else {
        let mut sh = Command::new("sh");
        sh.args(["-c", command]);
        sh
    }
}

/// A CA (`ca.pem`) and a server certificate it signed for `localhost` and 127.0.0.1
/// (`server.pem`, `server.key`), made with `openssl` in `d`.
pub fn certificates(d: &Path) {
    let openssl = |args: &[&str]| {
        let out = run(d, "openssl", args);
        assert!(
            out.status.success(),
            "openssl {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    };
    openssl(&[
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "ca.key",
        "-out",
        "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=idem test CA",
    ]);
    openssl(&[
        "req",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        "server.key",
        "-out",
        "server.csr",
        "-subj",
        "/CN=localhost",
    ]);
    std::fs::write(
        d.join("ext.cnf"),
        "subjectAltName=DNS:localhost,IP:127.0.0.1\nbasicConstraints=CA:FALSE\nextendedKeyUsage=serverAuth\n",
    )
    .unwrap();
    openssl(&[
        "x509",
        "-req",
        "-in",
        "server.csr",
        "-CA",
        "ca.pem",
        "-CAkey",
        "ca.key",
        "-CAcreateserial",
        "-out",
        "server.pem",
        "-days",
        "2",
        "-extfile",
        "ext.cnf",
    ]);
}

impl TlsNode {
    pub fn start() -> Self {
        let dir = tempfile::tempdir().expect("a temporary directory");
        let d = dir.path();
        certificates(d);
        let (tls, plain, dist) = (free_port(), free_port(), free_port());
        let path = |f: &str| d.join(f).display().to_string();
        std::fs::write(
            d.join("rabbitmq.conf"),
            format!(
                "listeners.tcp.default = 127.0.0.1:{plain}\nlisteners.ssl.default = 127.0.0.1:{tls}\n\
                 ssl_options.cacertfile = {}\nssl_options.certfile = {}\nssl_options.keyfile = {}\n\
                 ssl_options.verify = verify_none\nssl_options.fail_if_no_peer_cert = false\n\
                 loopback_users = none\n",
                path("ca.pem"),
                path("server.pem"),
                path("server.key")
            ),
        )
        .unwrap();
        std::fs::write(d.join("plugins"), "[].\n").unwrap();
        if is_root() {
            let out = run(
                d,
                "chown",
                &["-R", "rabbitmq:rabbitmq", &d.display().to_string()],
            );
            assert!(out.status.success());
        }
        // Unique per node: tests of one binary may run nodes at the same time.
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let nth = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let name = format!("idem-tls-{}-{nth}@localhost", std::process::id());
        let env = format!(
            "RABBITMQ_NODENAME={name} RABBITMQ_CONFIG_FILE={cfg} RABBITMQ_NODE_PORT={plain} \
             RABBITMQ_DIST_PORT={dist} RABBITMQ_MNESIA_BASE={mnesia} RABBITMQ_LOG_BASE={log} \
             RABBITMQ_PID_FILE={pid} RABBITMQ_ENABLED_PLUGINS_FILE={plugins}",
            cfg = path("rabbitmq"),
            mnesia = path("mnesia"),
            log = path("log"),
            pid = path("pid"),
            plugins = path("plugins"),
        );
        let started = as_broker_user(&format!("{env} rabbitmq-server -detached"))
            .output()
            .expect("run rabbitmq-server");
        assert!(
            started.status.success(),
            "rabbitmq-server: {}",
            String::from_utf8_lossy(&started.stderr)
        );
        let node = TlsNode {
            amqps_url: format!("amqps://guest:guest@localhost:{tls}/%2f"),
            plain_url: format!("amqp://guest:guest@127.0.0.1:{plain}/%2f"),
            plain_address: format!("127.0.0.1:{plain}"),
            ca_pem: std::fs::read_to_string(d.join("ca.pem")).unwrap(),
            name,
            dir,
        };
        let deadline = Instant::now() + Duration::from_secs(90);
        loop {
            let ready = as_broker_user(&format!(
                "rabbitmqctl -n {} await_startup --timeout 5",
                node.name
            ))
            .output()
            .expect("run rabbitmqctl");
            if ready.status.success() {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "the TLS node did not start: {}; log in {}",
                String::from_utf8_lossy(&ready.stderr),
                node.log_dir().display()
            );
            std::thread::sleep(Duration::from_millis(500));
        }
        node
    }

    /// Runs `rabbitmqctl -n <this node> <args>` (as the broker's user), which must succeed.
    pub fn ctl(&self, args: &str) -> Output {
        let out = as_broker_user(&format!("rabbitmqctl -n {} {args}", self.name))
            .output()
            .expect("run rabbitmqctl");
        assert!(
            out.status.success(),
            "rabbitmqctl {args}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    pub fn log_dir(&self) -> PathBuf {
        self.dir.path().join("log")
    }
}

impl Drop for TlsNode {
    fn drop(&mut self) {
        let _ = as_broker_user(&format!("rabbitmqctl -n {} stop", self.name)).output();
    }
}
