//! A TCP proxy the tests can cut and restore, to take a real service away from a client.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::AbortHandle;

/// Forwards 127.0.0.1:<port> to a target address.
pub struct Proxy {
    addr: SocketAddr,
    open: Arc<AtomicBool>,
    accepted: Arc<AtomicUsize>,
    refused: Arc<AtomicUsize>,
    pipes: Arc<Mutex<Vec<AbortHandle>>>,
    accept: AbortHandle,
}

impl Proxy {
    /// Starts forwarding to `target` (host:port).
    pub async fn start(target: &str) -> Proxy {
        Proxy::start_withholding(target, None).await
    }

    /// Starts forwarding to `target`, an AMQP broker, dropping every method frame it sends
    /// of `withheld` (class id, method id): a broker that takes the connection and answers
    /// everything else, heartbeats included, but never that.
    pub async fn start_withholding(target: &str, withheld: Option<(u16, u16)>) -> Proxy {
        Proxy::start_filtered(target, withheld.map(Filter::Amqp)).await
    }

    /// Starts forwarding to `target`, a NATS server, dropping while `dropping` is set every
    /// empty message it sends to a `_INBOX.` subject: the answers to confirmed acks (JetStream
    /// answers a double ack with an empty message), which the client then waits for in vain.
    /// `dropped` counts them.
    pub async fn start_dropping_nats_answers(
        target: &str,
        dropping: Arc<AtomicBool>,
        dropped: Arc<AtomicUsize>,
    ) -> Proxy {
        Proxy::start_filtered(target, Some(Filter::NatsAnswers(dropping, dropped))).await
    }

    async fn start_filtered(target: &str, filter: Option<Filter>) -> Proxy {
        let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind proxy");
        let addr = listener.local_addr().expect("proxy address");
        let open = Arc::new(AtomicBool::new(true));
        let pipes: Arc<Mutex<Vec<AbortHandle>>> = Arc::default();
        let target = target.to_owned();
        let accepted = Arc::new(AtomicUsize::new(0));
        let refused = Arc::new(AtomicUsize::new(0));
        let (o, p, a, r) = (
            open.clone(),
            pipes.clone(),
            accepted.clone(),
            refused.clone(),
        );
        let accept = tokio::spawn(async move {
            while let Ok((mut client, _)) = listener.accept().await {
                if !o.load(Ordering::SeqCst) {
                    r.fetch_add(1, Ordering::SeqCst);
                    continue; // dropped: the client sees the connection closed
                }
                a.fetch_add(1, Ordering::SeqCst);
                let target = target.clone();
                let filter = filter.clone();
                let pipe = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(&target).await {
                        match filter {
                            None => {
                                let _ =
                                    tokio::io::copy_bidirectional(&mut client, &mut server).await;
                            }
                            Some(filter) => {
                                let (mut from_client, to_client) = client.into_split();
                                let (from_server, mut to_server) = server.into_split();
                                // Each direction until its end, as `copy_bidirectional`.
                                let to_broker = async {
                                    let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                                    let _ =
                                        tokio::io::AsyncWriteExt::shutdown(&mut to_server).await;
                                };
                                let from_broker = async {
                                    let _ = match filter {
                                        Filter::Amqp(method) => {
                                            withhold(from_server, to_client, method).await
                                        }
                                        Filter::NatsAnswers(dropping, dropped) => {
                                            drop_answers(from_server, to_client, dropping, dropped)
                                                .await
                                        }
                                    };
                                };
                                let _ = tokio::join!(to_broker, from_broker);
                            }
                        }
                    }
                });
                p.lock().unwrap().push(pipe.abort_handle());
            }
        })
        .abort_handle();
        Proxy {
            addr,
            open,
            accepted,
            refused,
            pipes,
            accept,
        }
    }

    /// The port clients connect to.
    pub fn port(&self) -> u16 {
        self.addr.port()
    }

    /// How many connections it has forwarded (not counting those refused while cut).
    pub fn accepted(&self) -> usize {
        self.accepted.load(Ordering::SeqCst)
    }

    /// How many connections it refused while cut.
    #[allow(dead_code)]
    pub fn refused(&self) -> usize {
        self.refused.load(Ordering::SeqCst)
    }

    /// Breaks every open connection and refuses new ones; how many it broke.
    pub fn cut(&self) -> usize {
        self.open.store(false, Ordering::SeqCst);
        let mut broken = 0;
        for pipe in self.pipes.lock().unwrap().drain(..) {
            broken += usize::from(!pipe.is_finished());
            pipe.abort();
        }
        broken
    }

    /// Accepts connections again.
    pub fn restore(&self) {
        self.open.store(true, Ordering::SeqCst);
    }
}

/// What a filtering proxy leaves out of what the server sends.
#[derive(Clone)]
enum Filter {
    /// AMQP method frames of (class id, method id).
    Amqp((u16, u16)),
    /// While the flag is set, empty NATS messages to `_INBOX.` subjects, counted.
    NatsAnswers(Arc<AtomicBool>, Arc<AtomicUsize>),
}

/// Copies the NATS protocol from `from` to `to`, leaving out, while `dropping` is set, every
/// `MSG` to a `_INBOX.` subject with an empty payload (counted in `dropped`).
async fn drop_answers(
    from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    dropping: Arc<AtomicBool>,
    dropped: Arc<AtomicUsize>,
) -> std::io::Result<()> {
    use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};
    let mut from = tokio::io::BufReader::new(from);
    let mut line = Vec::new();
    loop {
        line.clear();
        if from.read_until(b'\n', &mut line).await? == 0 {
            return Ok(());
        }
        let text = String::from_utf8_lossy(&line).into_owned();
        let words: Vec<&str> = text.split_whitespace().collect();
        // `MSG <subject> <sid> [reply] <bytes>`, `HMSG <subject> <sid> [reply] <header bytes>
        // <bytes>`: the payload and its CRLF follow; every other operation is one line.
        let op = words.first().map(|w| w.to_ascii_uppercase());
        let payload = match op.as_deref() {
            Some("MSG" | "HMSG") => words.last().and_then(|n| n.parse::<usize>().ok()),
            _ => None,
        };
        let Some(payload) = payload else {
            to.write_all(&line).await?;
            continue;
        };
        let mut rest = vec![0u8; payload + 2];
        from.read_exact(&mut rest).await?;
        let answer = op.as_deref() == Some("MSG")
            && payload == 0
            && words
                .get(1)
                .is_some_and(|subject| subject.starts_with("_INBOX."));
        if answer && dropping.load(Ordering::SeqCst) {
            dropped.fetch_add(1, Ordering::SeqCst);
            continue;
        }
        to.write_all(&line).await?;
        to.write_all(&rest).await?;
    }
}

/// Copies AMQP frames from `from` to `to`, leaving out the method frames of `method`.
async fn withhold(
    mut from: tokio::net::tcp::OwnedReadHalf,
    mut to: tokio::net::tcp::OwnedWriteHalf,
    method: (u16, u16),
) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    const METHOD_FRAME: u8 = 1;
    loop {
        // type (1), channel (2), size (4); then the payload and the frame-end octet.
        let mut header = [0u8; 7];
        from.read_exact(&mut header).await?;
        let size = u32::from_be_bytes([header[3], header[4], header[5], header[6]]) as usize;
        let mut rest = vec![0u8; size + 1];
        from.read_exact(&mut rest).await?;
        let is_withheld = header[0] == METHOD_FRAME
            && size >= 4
            && (
                u16::from_be_bytes([rest[0], rest[1]]),
                u16::from_be_bytes([rest[2], rest[3]]),
            ) == method;
        if !is_withheld {
            to.write_all(&header).await?;
            to.write_all(&rest).await?;
        }
    }
}

/// A proxy in front of the tests' PostgreSQL (`DATABASE_URL`), and the URL that goes through it.
pub async fn postgres() -> (Proxy, String) {
    in_front_of(crate::common::postgres_url()).await
}

/// A proxy in front of the tests' MariaDB (`MYSQL_URL`), and the URL that goes through it.
#[allow(dead_code)]
pub async fn mysql() -> (Proxy, String) {
    in_front_of(crate::common::mysql_url()).await
}

/// A proxy in front of the server of `url` (`scheme://user@host:port/db`), and the URL that
/// goes through it.
async fn in_front_of(url: String) -> (Proxy, String) {
    let target = url
        .split('@')
        .nth(1)
        .and_then(|h| h.split('/').next())
        .expect("host:port in the database URL")
        .to_owned();
    let proxy = Proxy::start(&target).await;
    let proxied_url = url.replace(&target, &format!("127.0.0.1:{}", proxy.port()));
    (proxy, proxied_url)
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.cut();
    }
}
