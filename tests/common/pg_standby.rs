//! A PostgreSQL primary with a physical standby streaming from it, both of the test's own
//! (`initdb`, `pg_basebackup -R`, `pg_ctl`, from the server package `pg_config --bindir`
//! names), in a temporary directory on free ports; stopped when dropped. Run as the `postgres`
//! user when the tests run as root, which PostgreSQL refuses.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

/// A primary and its standby.
pub struct Replicated {
    /// `postgres://` URL of the primary's database `postgres`.
    pub primary_url: String,
    bin: PathBuf,
    dir: tempfile::TempDir,
    as_postgres: bool,
}

impl Replicated {
    /// Starts both and waits until the primary streams to the standby; `None` when the run
    /// opted out of servers of its own.
    pub async fn start() -> Option<Self> {
        let what = "a PostgreSQL primary and standby of the test's own";
        if !super::own_servers::can_start("pg_config", what) {
            return None;
        }
        let bindir = Command::new("pg_config").arg("--bindir").output().unwrap();
        let bin = PathBuf::from(String::from_utf8(bindir.stdout).unwrap().trim());
        assert!(
            bin.join("initdb").is_file(),
            "{what} needs the PostgreSQL server's programs in {} (`pg_config --bindir`): install the server package",
            bin.display()
        );
        let uid = Command::new("id").arg("-u").output().unwrap();
        let as_postgres = String::from_utf8_lossy(&uid.stdout).trim() == "0";
        let dir = tempfile::tempdir().unwrap();
        let mut this = Self {
            primary_url: String::new(),
            bin,
            dir,
            as_postgres,
        };
        if as_postgres {
            this.run(
                "chown",
                &["-R", "postgres:postgres", this.path("").as_str()],
                false,
            );
        }
        let (primary, standby) = (free_port(), free_port());
        let primary_dir = this.path("primary");
        this.run(
            "initdb",
            &[
                "-D",
                &primary_dir,
                "-A",
                "trust",
                "-U",
                "postgres",
                "--no-sync",
            ],
            true,
        );
        this.pg_ctl_start(&primary_dir, primary);
        let standby_dir = this.path("standby");
        this.run(
            "pg_basebackup",
            &[
                "-h",
                "127.0.0.1",
                "-p",
                &primary.to_string(),
                "-U",
                "postgres",
                "-D",
                &standby_dir,
                "-R",
                "-X",
                "stream",
                "--no-sync",
            ],
            true,
        );
        this.pg_ctl_start(&standby_dir, standby);
        let primary_url = format!("postgres://postgres@127.0.0.1:{primary}/postgres");
        let pool = sqlx::PgPool::connect(&primary_url).await.unwrap();
        super::wait_until("the standby streams", Duration::from_secs(30), || {
            let pool = pool.clone();
            async move {
                sqlx::query_scalar::<_, i64>("SELECT count(*) FROM pg_stat_replication")
                    .fetch_one(&pool)
                    .await
                    .unwrap()
                    == 1
            }
        })
        .await;
        pool.close().await;
        this.primary_url = primary_url;
        Some(this)
    }

    fn path(&self, name: &str) -> String {
        self.dir.path().join(name).display().to_string()
    }

    /// Runs `program` (from the server's bin directory when `server`) as the user that owns
    /// the servers, and asserts it succeeded.
    fn run(&self, program: &str, args: &[&str], server: bool) {
        let program = match server {
            true => self.bin.join(program),
            false => PathBuf::from(program),
        };
        let mut command = match server {
            true => self.server_command(&program),
            false => Command::new(&program),
        };
        let output = command.args(args).output().unwrap();
        assert!(
            output.status.success(),
            "{} {args:?}: {}{}",
            program.display(),
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        );
    }

    /// `program` run as the user that owns the servers.
    fn server_command(&self, program: &Path) -> Command {
        if !self.as_postgres {
            return Command::new(program);
        }
        let mut command = Command::new("setpriv");
        command
            .args([
                "--reuid=postgres",
                "--regid=postgres",
                "--init-groups",
                "--",
            ])
            .arg(program);
        command
    }

    fn pg_ctl_start(&self, data: &str, port: u16) {
        let log = Path::new(data).join("server.log").display().to_string();
        let options = format!(
            "-p {port} -k {} -c listen_addresses=127.0.0.1",
            self.dir.path().display()
        );
        self.run(
            "pg_ctl",
            &["-D", data, "-l", &log, "-o", &options, "-w", "start"],
            true,
        );
    }
}

impl Drop for Replicated {
    fn drop(&mut self) {
        for data in ["standby", "primary"] {
            let data = self.path(data);
            let _ = self
                .server_command(&self.bin.join("pg_ctl"))
                .args(["-D", &data, "-m", "immediate", "-w", "stop"])
                .output();
        }
    }
}

/// A port nothing listens on now.
fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}
