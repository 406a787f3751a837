//! A NATS client that sends header blocks as given, bytes async-nats would refuse included, as
//! a producer in another language may: the server stores them unchecked.

use std::time::Duration;
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;

/// Publishes `body` to `subject` with the header block `header` (`NATS/1.0\r\n…\r\n\r\n`) at the
/// server of `url` (`nats://host:port`), and waits for JetStream's PubAck; panics on an error
/// answer.
pub async fn publish(url: &str, subject: &str, header: &[u8], body: &[u8]) {
    let address = url.trim_start_matches("nats://");
    let stream = TcpStream::connect(address).await.expect("connect to NATS");
    let mut stream = BufReader::new(stream);
    let mut info = String::new();
    stream.read_line(&mut info).await.unwrap();
    assert!(info.starts_with("INFO"), "{info}");
    let mut out = Vec::new();
    out.extend_from_slice(b"CONNECT {\"headers\":true,\"verbose\":false,\"protocol\":1}\r\n");
    out.extend_from_slice(b"SUB _INBOX.raw 1\r\n");
    out.extend_from_slice(
        format!(
            "HPUB {subject} _INBOX.raw {} {}\r\n",
            header.len(),
            header.len() + body.len()
        )
        .as_bytes(),
    );
    out.extend_from_slice(header);
    out.extend_from_slice(body);
    out.extend_from_slice(b"\r\n");
    stream.get_mut().write_all(&out).await.unwrap();
    let answer = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            let mut line = String::new();
            assert!(
                stream.read_line(&mut line).await.unwrap() > 0,
                "NATS closed"
            );
            if line.starts_with("PING") {
                stream.get_mut().write_all(b"PONG\r\n").await.unwrap();
            }
            assert!(!line.starts_with("-ERR"), "{line}");
            if let Some(args) = line.strip_prefix("MSG ") {
                let size: usize = args.split_whitespace().last().unwrap().parse().unwrap();
                let mut payload = vec![0; size + 2];
                stream.read_exact(&mut payload).await.unwrap();
                payload.truncate(size);
                return String::from_utf8(payload).unwrap();
            }
        }
    })
    .await
    .expect("a PubAck within 10 s");
    assert!(
        answer.contains("\"seq\"") && !answer.contains("\"error\""),
        "{answer}"
    );
}
