//! A minimal AMQP 0-9-1 client of idem's own, over TCP or TLS (`amqps://`, see [`crate::tls`]): just enough to consume a queue
//! frame by frame and reject a delivery, for the messages lapin cannot parse (see
//! [`crate::quarantine`]). Frames are read as bytes and judged by the same parser lapin uses, so
//! a delivery lapin would fail on is seen here as such, and can still be rejected.
//!
//! The reader trusts nothing the broker sends: every read and write has a deadline
//! ([`IO_DEADLINE`]), and a frame larger than the negotiated `frame_max` is refused from its
//! header, before anything is allocated for it.

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

/// The longest any one read or write may take: a broker that takes the connection and then
/// stalls fails the reader instead of hanging it.
pub(crate) const IO_DEADLINE: Duration = Duration::from_secs(10);

/// The largest frame the reader accepts (header and end marker included) before `tune`, and
/// the most it negotiates after: RabbitMQ's default `frame_max`.
pub(crate) const MAX_FRAME: u32 = 128 * 1024;

/// The 7-byte header and the end marker around a frame's payload.
const FRAME_OVERHEAD: u32 = 8;

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
    /// The largest frame accepted: [`MAX_FRAME`] until `tune`, then what was negotiated.
    frame_max: u32,
}

fn protocol(message: impl Into<String>) -> io::Error {
    io::Error::new(io::ErrorKind::InvalidData, message.into())
}

/// `io` within [`IO_DEADLINE`].
async fn in_time<T>(what: &str, io: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::time::timeout(IO_DEADLINE, io).await.map_err(|_| {
        io::Error::new(
            io::ErrorKind::TimedOut,
            format!("the broker did not let the reader {what} within {IO_DEADLINE:?}"),
        )
    })?
}

/// The `frame_max` to answer `tune` with: the broker's, at most [`MAX_FRAME`] (0 is "no
/// limit").
pub(crate) fn negotiated_frame_max(offered: u32) -> u32 {
    match offered {
        0 => MAX_FRAME,
        offered => offered.min(MAX_FRAME),
    }
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
        let stream = in_time("connect", connect).await?;
        let user = &uri.authority.userinfo;
        Self::handshake(stream, &uri.vhost, &user.username, &user.password).await
    }

    /// Opens the AMQP connection on `stream` (as `username`, on `vhost`) and channel 1.
    pub(crate) async fn handshake(
        stream: Box<dyn Stream>,
        vhost: &str,
        username: &str,
        password: &str,
    ) -> io::Result<Self> {
        let mut this = Self {
            stream,
            frame_max: MAX_FRAME,
        };
        in_time("write", this.stream.write_all(b"AMQP\x00\x00\x09\x01")).await?;
        this.expect(10, 10).await?; // connection.start
        let mut start_ok = Vec::new();
        long(&mut start_ok, b""); // client properties: an empty table
        short(&mut start_ok, b"PLAIN");
        long(
            &mut start_ok,
            format!("\0{username}\0{password}").as_bytes(),
        );
        short(&mut start_ok, b"en_US");
        this.method(0, 10, 11, &start_ok).await?;
        let tune = this.expect(10, 30).await?;
        let (channel_max, offered) = match tune.get(..6) {
            Some(&[c0, c1, f0, f1, f2, f3]) => ([c0, c1], u32::from_be_bytes([f0, f1, f2, f3])),
            _ => return Err(protocol("short tune")),
        };
        let frame_max = negotiated_frame_max(offered);
        let mut tune_ok = channel_max.to_vec();
        tune_ok.extend_from_slice(&frame_max.to_be_bytes());
        tune_ok.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
        this.method(0, 10, 31, &tune_ok).await?;
        this.frame_max = frame_max;
        let mut open = Vec::new();
        short(&mut open, vhost.as_bytes());
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
        in_time("write", async {
            self.stream.write_all(&frame.bytes()).await?;
            self.stream.flush().await
        })
        .await
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

    /// Reads the next frame, whatever it is, within [`IO_DEADLINE`]; a frame announced larger
    /// than `frame_max` is refused before its payload is read.
    async fn next_frame(&mut self) -> io::Result<Frame> {
        let frame_max = self.frame_max;
        let stream = &mut self.stream;
        in_time("read a frame", async move {
            let mut head = [0u8; 7];
            stream.read_exact(&mut head).await?;
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]);
            if size > frame_max.saturating_sub(FRAME_OVERHEAD) {
                return Err(protocol(format!(
                    "a frame of {size} bytes announced, over the negotiated frame_max of {frame_max}"
                )));
            }
            // At most frame_max bytes: the size was checked.
            let mut payload = vec![0u8; size as usize + 1];
            stream.read_exact(&mut payload).await?;
            if payload.pop() != Some(FRAME_END) {
                return Err(protocol("a frame without its end marker"));
            }
            Ok(Frame {
                kind: head[0],
                channel: u16::from_be_bytes([head[1], head[2]]),
                payload,
            })
        })
        .await
    }

    /// Reads the next frame; the broker closing the connection or the channel is an error.
    pub(crate) async fn read(&mut self) -> io::Result<Frame> {
        let frame = self.next_frame().await?;
        match frame.method() {
            Some((10, 50)) => Err(protocol("the broker closed the connection")),
            Some((20, 40)) => Err(protocol("the broker closed the channel")),
            _ => Ok(frame),
        }
    }

    /// Reads frames until the method `class.method`, for at most [`IO_DEADLINE`]; its
    /// arguments.
    pub(crate) async fn expect(&mut self, class: u16, method: u16) -> io::Result<Vec<u8>> {
        in_time("read its answer", async {
            loop {
                let frame = self.read().await?;
                if frame.method() == Some((class, method)) {
                    return Ok(frame.payload[4..].to_vec());
                }
            }
        })
        .await
    }

    /// Closes the connection and waits for the broker to confirm: everything sent before has
    /// been processed, and every unsettled delivery is back in its queue.
    pub(crate) async fn close(mut self) -> io::Result<()> {
        let mut close = 200u16.to_be_bytes().to_vec();
        short(&mut close, b"quarantine done");
        close.extend_from_slice(&[0, 0, 0, 0]);
        self.method(0, 10, 50, &close).await?;
        in_time("close", async {
            loop {
                if self.next_frame().await?.method() == Some((10, 51)) {
                    return Ok(());
                }
            }
        })
        .await
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use tokio::io::{AsyncWriteExt, DuplexStream, duplex};

    /// A connection past its handshake, over an in-memory pipe; the other end is the broker.
    fn connected(frame_max: u32) -> (RawConnection, DuplexStream) {
        let (ours, broker) = duplex(1 << 16);
        let raw = RawConnection {
            stream: Box::new(ours),
            frame_max,
        };
        (raw, broker)
    }

    fn frame(kind: u8, payload: &[u8]) -> Vec<u8> {
        Frame {
            kind,
            channel: 1,
            payload: payload.to_vec(),
        }
        .bytes()
    }

    #[tokio::test(start_paused = true)]
    async fn a_broker_that_accepts_and_then_stalls_fails_the_handshake_in_time() {
        let (ours, _broker) = duplex(1024);
        let started = tokio::time::Instant::now();
        let error = RawConnection::handshake(Box::new(ours), "/", "guest", "guest")
            .await
            .err()
            .unwrap();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut, "{error}");
        assert!(
            started.elapsed() <= IO_DEADLINE * 2,
            "{:?}",
            started.elapsed()
        );
    }

    #[tokio::test(start_paused = true)]
    async fn a_frame_cut_short_fails_the_read_in_time() {
        let (mut raw, mut broker) = connected(MAX_FRAME);
        // A header announcing 100 bytes, then silence.
        broker
            .write_all(&[METHOD, 0, 1, 0, 0, 0, 100, 1, 2])
            .await
            .unwrap();
        let error = raw.read().await.err().unwrap();
        assert_eq!(error.kind(), io::ErrorKind::TimedOut, "{error}");
    }

    #[tokio::test]
    async fn a_frame_larger_than_frame_max_is_refused_from_its_header() {
        let (mut raw, mut broker) = connected(MAX_FRAME);
        // 4 GiB announced: refused before anything is allocated or read for it.
        broker
            .write_all(&[BODY, 0, 1, 0xff, 0xff, 0xff, 0xff])
            .await
            .unwrap();
        let error = raw.read().await.err().unwrap();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
        assert!(error.to_string().contains("frame_max"), "{error}");
        // The largest frame frame_max allows is read.
        let (mut raw, mut broker) = connected(4096);
        let payload = vec![7u8; 4096 - 8];
        broker.write_all(&frame(BODY, &payload)).await.unwrap();
        assert_eq!(raw.read().await.unwrap().payload, payload);
        broker
            .write_all(&frame(BODY, &[7u8; 4096 - 7]))
            .await
            .unwrap();
        let error = raw.read().await.err().unwrap();
        assert_eq!(error.kind(), io::ErrorKind::InvalidData);
        assert!(error.to_string().contains("frame_max"), "{error}");
    }

    #[test]
    fn the_frame_max_answered_is_the_brokers_at_most_the_readers() {
        assert_eq!(negotiated_frame_max(0), MAX_FRAME);
        assert_eq!(negotiated_frame_max(4096), 4096);
        assert_eq!(negotiated_frame_max(u32::MAX), MAX_FRAME);
    }

    /// How a valid frame is damaged before the broker sends it.
    #[derive(Debug, Clone)]
    enum Damage {
        None,
        /// Announced one byte longer than frame_max allows.
        JustOver,
        /// Announced as this many bytes, whatever it holds.
        Size(u32),
        /// Its end marker replaced by this byte.
        End(u8),
        /// Cut short by this many bytes, the stream ending there.
        Cut(usize),
    }

    /// A valid frame: its kind, channel, payload, and whether it is made `connection.close`.
    type Valid = (u8, u16, Vec<u8>, bool);

    fn valid_frame() -> impl proptest::strategy::Strategy<Value = Valid> {
        use proptest::prelude::*;
        (
            prop_oneof![Just(METHOD), Just(HEADER), Just(BODY), any::<u8>()],
            any::<u16>(),
            proptest::collection::vec(any::<u8>(), 0..4096),
            proptest::bool::weighted(0.05),
        )
    }

    fn damage() -> impl proptest::strategy::Strategy<Value = Damage> {
        use proptest::prelude::*;
        prop_oneof![
            6 => Just(Damage::None),
            1 => Just(Damage::JustOver),
            1 => any::<u32>().prop_map(Damage::Size),
            1 => (0u32..64).prop_map(Damage::Size),
            1 => any::<u8>()
                .prop_filter("not the end marker", |b| *b != FRAME_END)
                .prop_map(Damage::End),
            1 => (1usize..16).prop_map(Damage::Cut),
        ]
    }

    /// Valid frames of up to frame_max, some damaged (the announced size, the end marker, the
    /// stream cut short): each valid frame before the first damage is read as it was sent, the
    /// damage is refused for what it is, and every check of the reader is reached over the run
    /// (each kind of outcome counted and asserted, not left to random bytes).
    #[test]
    fn damaged_frames_are_refused_for_what_they_are_and_every_check_is_reached() {
        use proptest::test_runner::{Config, TestRunner};
        use std::collections::BTreeMap;
        use std::sync::Mutex;
        let seen: Mutex<BTreeMap<&str, u32>> = Mutex::default();
        let cases = proptest::collection::vec((valid_frame(), damage()), 1..5);
        let mut runner = TestRunner::new(Config::with_cases(512));
        runner
            .run(&(cases, 16u32..4096), |(frames, frame_max)| {
                let outcome = read_damaged(frames, frame_max);
                *seen.lock().unwrap().entry(outcome).or_default() += 1;
                Ok(())
            })
            .unwrap();
        let seen = seen.into_inner().unwrap();
        for outcome in [
            "whole",
            "connection.close",
            "one byte over frame_max",
            "announced over frame_max",
            "resized within frame_max",
            "end marker replaced",
            "cut short",
        ] {
            assert!(
                seen.get(outcome).copied().unwrap_or(0) >= 5,
                "{outcome} reached too rarely: {seen:?}"
            );
        }
        println!("{seen:?}");
    }

    /// Sends `frames`, damaged as each says, to a reader of `frame_max`; checks what it reads
    /// and says which outcome the first damage (or none) met.
    fn read_damaged(frames: Vec<(Valid, Damage)>, frame_max: u32) -> &'static str {
        let largest = (frame_max - FRAME_OVERHEAD) as usize;
        let mut sent = Vec::new();
        let mut originals = Vec::new();
        let mut first_damage = None;
        for (i, ((kind, channel, mut payload, closes), damage)) in frames.into_iter().enumerate() {
            payload.truncate(largest);
            let kind = if closes && payload.len() >= 4 {
                payload[..4].copy_from_slice(&[0, 10, 0, 50]);
                METHOD
            } else {
                kind
            };
            let original = Frame {
                kind,
                channel,
                payload,
            };
            let mut bytes = original.bytes();
            let mut cut = false;
            match &damage {
                Damage::None => {}
                Damage::JustOver => {
                    bytes[3..7].copy_from_slice(&(frame_max - FRAME_OVERHEAD + 1).to_be_bytes());
                }
                Damage::Size(size) => bytes[3..7].copy_from_slice(&size.to_be_bytes()),
                Damage::End(byte) => *bytes.last_mut().unwrap() = *byte,
                Damage::Cut(n) => {
                    bytes.truncate(bytes.len().saturating_sub(*n));
                    cut = true;
                }
            }
            let harmless = match damage {
                Damage::None => true,
                Damage::Size(size) => size as usize == original.payload.len(),
                _ => false,
            };
            if first_damage.is_none() && !harmless {
                first_damage = Some((i, damage));
            }
            sent.extend_from_slice(&bytes);
            originals.push(original);
            if cut {
                break;
            }
        }
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .start_paused(true)
            .build()
            .unwrap();
        runtime.block_on(async {
            let (mut raw, mut broker) = connected(frame_max);
            broker.write_all(&sent).await.unwrap();
            drop(broker);
            let intact = first_damage.as_ref().map_or(originals.len(), |(i, _)| *i);
            for original in &originals[..intact] {
                let read = raw.read().await;
                if original.method() == Some((10, 50)) {
                    let error = read.err().unwrap();
                    assert!(
                        error.to_string().contains("closed the connection"),
                        "{error}"
                    );
                    return "connection.close";
                }
                let frame = read.unwrap();
                assert_eq!(
                    (frame.kind, frame.channel, &frame.payload),
                    (original.kind, original.channel, &original.payload)
                );
            }
            let read = raw.read().await;
            if let Ok(frame) = &read {
                assert!(frame.payload.len() <= largest);
            }
            let Some((_, damage)) = first_damage else {
                let error = read.err().unwrap();
                assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof, "{error}");
                return "whole";
            };
            let oversized = |error: io::Error| {
                assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{error}");
                assert!(error.to_string().contains("frame_max"), "{error}");
            };
            match damage {
                Damage::None => unreachable!("a frame without damage is read"),
                Damage::JustOver => {
                    oversized(read.err().unwrap());
                    "one byte over frame_max"
                }
                Damage::Size(size) if size as usize > largest => {
                    oversized(read.err().unwrap());
                    "announced over frame_max"
                }
                // Another size within bounds reads other bytes as the frame: refused for its
                // end marker, cut short, or (by chance) read, but bounded.
                Damage::Size(_) => "resized within frame_max",
                Damage::End(_) => {
                    let error = read.err().unwrap();
                    assert_eq!(error.kind(), io::ErrorKind::InvalidData, "{error}");
                    assert!(error.to_string().contains("end marker"), "{error}");
                    "end marker replaced"
                }
                Damage::Cut(_) => {
                    let error = read.err().unwrap();
                    assert_eq!(error.kind(), io::ErrorKind::UnexpectedEof, "{error}");
                    "cut short"
                }
            }
        })
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig::with_cases(256))]

        /// Whatever bytes the broker sends, the reader returns frames no larger than
        /// frame_max, or an error; it never panics and never waits past its deadline.
        #[test]
        fn arbitrary_bytes_are_read_as_bounded_frames_or_refused(
            bytes in proptest::collection::vec(proptest::prelude::any::<u8>(), 0..8192),
            frame_max in 8u32..4096,
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .start_paused(true)
                .build()
                .unwrap();
            runtime.block_on(async {
                let (mut raw, mut broker) = connected(frame_max);
                broker.write_all(&bytes).await.unwrap();
                drop(broker);
                while let Ok(frame) = raw.read().await {
                    assert!(frame.payload.len() + 8 <= frame_max as usize);
                }
            });
        }
    }
}
