//! A minimal AMQP 0-9-1 client of idem's own, over TCP or TLS (`amqps://`, see [`crate::tls`]): just enough to consume a queue
//! frame by frame and reject a delivery, for the messages lapin cannot parse (see
//! [`crate::quarantine`]). Frames are read as bytes and judged by the same parser lapin uses, so
//! a delivery lapin would fail on is seen here as such, and can still be rejected.

use crate::tls::Stream;
use lapin::uri::{AMQPScheme, AMQPUri};
use std::io;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// AMQP frame types.
pub(crate) const METHOD: u8 = 1;
pub(crate) const HEADER: u8 = 2;
pub(crate) const BODY: u8 = 3;
const FRAME_END: u8 = 0xCE;

/// One frame, as read.
#[derive(Debug)]
pub(crate) struct Frame {
    pub(crate) kind: u8,
    pub(crate) channel: u16,
    pub(crate) payload: Vec<u8>,
}

impl Frame {
    /// The frame's bytes as they travelled, for a parser that takes whole frames.
    pub(crate) fn bytes(&self) -> Vec<u8> {
        let mut bytes = Vec::with_capacity(self.payload.len() + 8);
        bytes.push(self.kind);
        bytes.extend_from_slice(&self.channel.to_be_bytes());
        bytes.extend_from_slice(&(self.payload.len() as u32).to_be_bytes());
        bytes.extend_from_slice(&self.payload);
        bytes.push(FRAME_END);
        bytes
    }

    /// `(class, method)` of a method frame.
    pub(crate) fn method(&self) -> Option<(u16, u16)> {
        (self.kind == METHOD && self.payload.len() >= 4).then(|| {
            (
                u16::from_be_bytes([self.payload[0], self.payload[1]]),
                u16::from_be_bytes([self.payload[2], self.payload[3]]),
            )
        })
    }
}

/// Appends an AMQP short string.
pub(crate) fn short(out: &mut Vec<u8>, s: &[u8]) {
    out.push(u8::try_from(s.len()).unwrap_or(u8::MAX));
    out.extend_from_slice(&s[..s.len().min(255)]);
}

/// Appends an AMQP long string.
pub(crate) fn long(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&(s.len() as u32).to_be_bytes());
    out.extend_from_slice(s);
}

/// A connection with channel 1 open.
pub(crate) struct RawConnection {
    stream: Box<dyn Stream>,
}

fn protocol(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

impl RawConnection {
    /// Connects to the broker of `url` (`amqp://`, or `amqps://` trusting the system's roots
    /// and the PEM certificates `tls_ca`) and opens channel 1.
    pub(crate) async fn open(url: &str, tls_ca: Option<&str>) -> io::Result<Self> {
        let uri: AMQPUri = url.parse().map_err(protocol)?;
        let host = uri.authority.host.as_str();
        let connect = async {
            let tcp = TcpStream::connect((host, uri.authority.port)).await?;
            let stream: Box<dyn Stream> = match uri.scheme {
                AMQPScheme::AMQP => Box::new(tcp),
                AMQPScheme::AMQPS => crate::tls::wrap(host, tls_ca, tcp).await?,
            };
            Ok::<_, io::Error>(stream)
        };
        let stream = tokio::time::timeout(Duration::from_secs(10), connect)
            .await
            .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "connecting timed out"))??;
        let mut this = Self { stream };
        this.stream.write_all(b"AMQP\x00\x00\x09\x01").await?;
        this.expect(10, 10).await?; // connection.start
        let user = &uri.authority.userinfo;
        let mut start_ok = Vec::new();
        long(&mut start_ok, b""); // client properties: an empty table
        short(&mut start_ok, b"PLAIN");
        long(
            &mut start_ok,
            format!("\0{}\0{}", user.username, user.password).as_bytes(),
        );
        short(&mut start_ok, b"en_US");
        this.method(0, 10, 11, &start_ok).await?;
        let tune = this.expect(10, 30).await?;
        let mut tune_ok = tune
            .get(..6)
            .ok_or_else(|| protocol("short tune"))?
            .to_vec();
        tune_ok.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
        this.method(0, 10, 31, &tune_ok).await?;
        let mut open = Vec::new();
        short(&mut open, uri.vhost.as_bytes());
        short(&mut open, b"");
        open.push(0);
        this.method(0, 10, 40, &open).await?;
        this.expect(10, 41).await?;
        this.method(1, 20, 10, &[0]).await?; // channel.open
        this.expect(20, 11).await?;
        Ok(this)
    }

    async fn frame(&mut self, kind: u8, channel: u16, payload: &[u8]) -> io::Result<()> {
        let frame = Frame {
            kind,
            channel,
            payload: payload.to_vec(),
        };
        self.stream.write_all(&frame.bytes()).await?;
        self.stream.flush().await
    }

    /// Sends method `class.method` with `args` on `channel`.
    pub(crate) async fn method(
        &mut self,
        channel: u16,
        class: u16,
        method: u16,
        args: &[u8],
    ) -> io::Result<()> {
        let mut payload = class.to_be_bytes().to_vec();
        payload.extend_from_slice(&method.to_be_bytes());
        payload.extend_from_slice(args);
        self.frame(METHOD, channel, &payload).await
    }

    /// Reads the next frame.
    pub(crate) async fn read(&mut self) -> io::Result<Frame> {
        let mut head = [0u8; 7];
        self.stream.read_exact(&mut head).await?;
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        let mut payload = vec![0u8; size + 1];
        self.stream.read_exact(&mut payload).await?;
        if payload.pop() != Some(FRAME_END) {
            return Err(protocol("a frame without its end marker"));
        }
        let frame = Frame {
            kind: head[0],
            channel: u16::from_be_bytes([head[1], head[2]]),
            payload,
        };
        match frame.method() {
            Some((10, 50)) => Err(protocol("the broker closed the connection")),
            Some((20, 40)) => Err(protocol("the broker closed the channel")),
            _ => Ok(frame),
        }
    }

    /// Reads frames until the method `class.method`; its arguments.
    pub(crate) async fn expect(&mut self, class: u16, method: u16) -> io::Result<Vec<u8>> {
        loop {
            let frame = self.read().await?;
            if frame.method() == Some((class, method)) {
                return Ok(frame.payload[4..].to_vec());
            }
        }
    }

    /// Closes the connection and waits for the broker to confirm: everything sent before has
    /// been processed, and every unsettled delivery is back in its queue.
    pub(crate) async fn close(mut self) -> io::Result<()> {
        let mut close = 200u16.to_be_bytes().to_vec();
        short(&mut close, b"quarantine done");
        close.extend_from_slice(&[0, 0, 0, 0]);
        self.method(0, 10, 50, &close).await?;
        loop {
            let mut head = [0u8; 7];
            self.stream.read_exact(&mut head).await?;
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            let mut payload = vec![0u8; size + 1];
            self.stream.read_exact(&mut payload).await?;
            if head[0] == METHOD && payload.get(..4) == Some(&[0, 10, 0, 51]) {
                return Ok(());
            }
        }
    }
}
