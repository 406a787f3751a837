//! A publisher that writes AMQP 0-9-1 frames by hand, so that a test can send what RabbitMQ
//! accepts but client libraries refuse to build: a `message_id` that is not UTF-8, a header
//! table with a field type lapin does not know.

use std::io::{Read, Write};
use std::net::TcpStream;

/// A message's properties, as raw bytes where a library would insist on text.
#[derive(Debug, Default, Clone)]
pub struct RawProperties {
    /// The `message-id` short string, any bytes.
    pub message_id: Option<Vec<u8>>,
    /// The encoded `headers` field table (without its length prefix), any bytes.
    pub headers: Option<Vec<u8>>,
}

/// One open connection with channel 1 in confirm mode.
pub struct RawPublisher {
    stream: TcpStream,
}

fn short(out: &mut Vec<u8>, s: &[u8]) {
    out.push(u8::try_from(s.len()).expect("short string"));
    out.extend_from_slice(s);
}

fn long(out: &mut Vec<u8>, s: &[u8]) {
    out.extend_from_slice(&u32::try_from(s.len()).unwrap().to_be_bytes());
    out.extend_from_slice(s);
}

impl RawPublisher {
    /// Connects to `host:port` as `user`/`password` on vhost `/`.
    pub fn connect(address: &str, user: &str, password: &str) -> Self {
        let stream = TcpStream::connect(address).expect("connect to RabbitMQ");
        let mut this = Self { stream };
        this.stream.write_all(b"AMQP\x00\x00\x09\x01").unwrap();
        this.expect(10, 10); // connection.start
        let mut start_ok = Vec::new();
        long(&mut start_ok, b""); // client properties: an empty table
        short(&mut start_ok, b"PLAIN");
        long(&mut start_ok, format!("\0{user}\0{password}").as_bytes());
        short(&mut start_ok, b"en_US");
        this.method(0, 10, 11, &start_ok);
        let tune = this.expect(10, 30);
        let mut tune_ok = tune[..6].to_vec(); // channel-max, frame-max as offered
        tune_ok.extend_from_slice(&0u16.to_be_bytes()); // no heartbeats
        this.method(0, 10, 31, &tune_ok);
        let mut open = Vec::new();
        short(&mut open, b"/");
        short(&mut open, b"");
        open.push(0);
        this.method(0, 10, 40, &open);
        this.expect(10, 41);
        this.method(1, 20, 10, &[0]); // channel.open
        this.expect(20, 11);
        this.method(1, 85, 10, &[0]); // confirm.select
        this.expect(85, 11);
        this
    }

    fn frame(&mut self, kind: u8, channel: u16, payload: &[u8]) {
        let mut frame = vec![kind];
        frame.extend_from_slice(&channel.to_be_bytes());
        frame.extend_from_slice(&u32::try_from(payload.len()).unwrap().to_be_bytes());
        frame.extend_from_slice(payload);
        frame.push(0xCE);
        self.stream.write_all(&frame).unwrap();
    }

    fn method(&mut self, channel: u16, class: u16, method: u16, args: &[u8]) {
        let mut payload = class.to_be_bytes().to_vec();
        payload.extend_from_slice(&method.to_be_bytes());
        payload.extend_from_slice(args);
        self.frame(1, channel, &payload);
    }

    /// Reads frames until the method `class.method`; returns its arguments.
    fn expect(&mut self, class: u16, method: u16) -> Vec<u8> {
        loop {
            let mut head = [0u8; 7];
            self.stream.read_exact(&mut head).unwrap();
            let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
            let mut payload = vec![0u8; size + 1];
            self.stream.read_exact(&mut payload).unwrap();
            if head[0] != 1 {
                continue;
            }
            let got = (
                u16::from_be_bytes([payload[0], payload[1]]),
                u16::from_be_bytes([payload[2], payload[3]]),
            );
            assert_ne!(
                got,
                (10, 50),
                "the broker closed the connection: {payload:?}"
            );
            assert_ne!(got, (20, 40), "the broker closed the channel: {payload:?}");
            if got == (class, method) {
                return payload[4..size].to_vec();
            }
        }
    }

    /// Publishes `body` persistently to `queue` through the default exchange and waits for the
    /// broker's confirm.
    pub fn publish(&mut self, queue: &str, properties: &RawProperties, body: &[u8]) {
        let mut publish = 0u16.to_be_bytes().to_vec();
        short(&mut publish, b"");
        short(&mut publish, queue.as_bytes());
        publish.push(0);
        self.method(1, 60, 40, &publish);
        let mut flags = 1u16 << 12; // delivery-mode
        if properties.headers.is_some() {
            flags |= 1 << 13;
        }
        if properties.message_id.is_some() {
            flags |= 1 << 7;
        }
        let mut header = 60u16.to_be_bytes().to_vec();
        header.extend_from_slice(&0u16.to_be_bytes());
        header.extend_from_slice(&(body.len() as u64).to_be_bytes());
        header.extend_from_slice(&flags.to_be_bytes());
        // Property values in flag order: headers (bit 13), delivery-mode (12), message-id (7).
        if let Some(table) = &properties.headers {
            long(&mut header, table);
        }
        header.push(2);
        if let Some(id) = &properties.message_id {
            short(&mut header, id);
        }
        self.frame(2, 1, &header);
        self.frame(3, 1, body);
        self.expect(60, 80); // basic.ack: confirmed
    }
}

impl Drop for RawPublisher {
    fn drop(&mut self) {
        let mut close = 200u16.to_be_bytes().to_vec();
        short(&mut close, b"bye");
        close.extend_from_slice(&[0, 0, 0, 0]);
        self.method(0, 10, 50, &close);
    }
}
