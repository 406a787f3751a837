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
                let pipe = tokio::spawn(async move {
                    if let Ok(mut server) = TcpStream::connect(&target).await {
                        match withheld {
                            None => {
                                let _ =
                                    tokio::io::copy_bidirectional(&mut client, &mut server).await;
                            }
                            Some(method) => {
                                let (mut from_client, to_client) = client.into_split();
                                let (from_server, mut to_server) = server.into_split();
                                // Each direction until its end, as `copy_bidirectional`.
                                let to_broker = async {
                                    let _ = tokio::io::copy(&mut from_client, &mut to_server).await;
                                    let _ =
                                        tokio::io::AsyncWriteExt::shutdown(&mut to_server).await;
                                };
                                let _ = tokio::join!(
                                    to_broker,
                                    withhold(from_server, to_client, method)
                                );
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
