//! A real HTTP payment service for the external-mode tests: it charges at most once per
//! `Idempotency-Key` (a repeated key gets the first charge back) and counts every call, so a
//! test can tell calls (retries, takeovers) from charges made. Charges are also counted per
//! payment (the `reference` of the request's body), whatever key they came with: a caller
//! that sent one payment under two keys shows two charges.
//!
//! The server runs on a thread of its own, so it outlives any one test's runtime; the tests of
//! one binary share it (their keys are unique), and a child process reaches it through
//! `IDEM_CHARGES_ADDR`.
#![allow(dead_code)]

use std::collections::HashMap;
use std::net::SocketAddr;
use std::sync::{Mutex, OnceLock};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpListener, TcpStream};

#[derive(Default)]
struct Ledger {
    /// Calls per key, whatever their answer.
    calls: HashMap<String, u32>,
    /// The charge made per key.
    charges: HashMap<String, String>,
    /// Charges made per payment reference, under whichever keys.
    charged: HashMap<String, u32>,
    /// Charges made in all (a second charge for one key would show here).
    made: u32,
}

static LEDGER: Mutex<Option<Ledger>> = Mutex::new(None);
static ADDR: OnceLock<SocketAddr> = OnceLock::new();

fn ledger<T>(f: impl FnOnce(&mut Ledger) -> T) -> T {
    let mut guard = LEDGER.lock().unwrap_or_else(|e| e.into_inner());
    f(guard.get_or_insert_default())
}

/// The service's address: `IDEM_CHARGES_ADDR` in a child process, else the server this
/// process starts on first use.
pub fn addr() -> SocketAddr {
    if let Ok(addr) = std::env::var("IDEM_CHARGES_ADDR") {
        return addr.parse().expect("IDEM_CHARGES_ADDR");
    }
    *ADDR.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("charge service runtime");
            runtime.block_on(async move {
                let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
                tx.send(listener.local_addr().expect("addr"))
                    .expect("report addr");
                loop {
                    let Ok((stream, _)) = listener.accept().await else {
                        continue;
                    };
                    tokio::spawn(serve(stream));
                }
            });
        });
        rx.recv().expect("charge service started")
    })
}

/// Calls made with `key`.
pub fn calls(key: &str) -> u32 {
    ledger(|l| l.calls.get(key).copied().unwrap_or(0))
}

/// Charges made for the payment `reference`, under any key: more than 1 is a double charge
/// (the caller sent one payment under two keys).
pub fn charges(reference: &str) -> u32 {
    ledger(|l| l.charged.get(reference).copied().unwrap_or(0))
}

/// Charges made in all.
pub fn made() -> u32 {
    ledger(|l| l.made)
}

/// One request: `POST /charges` with `Idempotency-Key`, `{"amount_cents": n}`. Headers
/// `X-Fail-First: 1` (answer the key's first call 503, charging nothing) and `X-Delay-Ms`
/// (answer that much later: a slow provider) shape the answer.
async fn serve(stream: TcpStream) {
    let mut reader = BufReader::new(stream);
    let mut headers = HashMap::new();
    let mut line = String::new();
    loop {
        line.clear();
        if reader.read_line(&mut line).await.unwrap_or(0) == 0 {
            return;
        }
        let trimmed = line.trim_end();
        if trimmed.is_empty() {
            break;
        }
        if let Some((name, value)) = trimmed.split_once(':') {
            headers.insert(name.trim().to_ascii_lowercase(), value.trim().to_owned());
        }
    }
    let length: usize = headers
        .get("content-length")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0);
    let mut body = vec![0; length];
    if reader.read_exact(&mut body).await.is_err() {
        return;
    }
    let key = headers.get("idempotency-key").cloned().unwrap_or_default();
    let body = serde_json::from_slice::<serde_json::Value>(&body).unwrap_or_default();
    let amount = body["amount_cents"].as_i64();
    let reference = body["reference"].as_str().unwrap_or_default().to_owned();
    if let Some(ms) = headers.get("x-delay-ms").and_then(|v| v.parse().ok()) {
        tokio::time::sleep(std::time::Duration::from_millis(ms)).await;
    }
    let (status, answer) = ledger(|l| {
        let calls = l.calls.entry(key.clone()).or_insert(0);
        *calls += 1;
        if key.is_empty() {
            return (400, "missing Idempotency-Key".to_owned());
        }
        if headers.contains_key("x-fail-first") && *calls == 1 {
            return (503, "try again".to_owned());
        }
        match amount {
            Some(amount) if amount > 0 => {}
            _ => return (402, "declined".to_owned()),
        }
        if let Some(id) = l.charges.get(&key) {
            return (200, id.clone());
        }
        l.made += 1;
        *l.charged.entry(reference).or_insert(0) += 1;
        let id = format!("ch_{}", l.made);
        l.charges.insert(key.clone(), id.clone());
        (201, id)
    });
    let response = format!(
        "HTTP/1.1 {status} X\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{answer}",
        answer.len()
    );
    let mut stream = reader.into_inner();
    let _ = stream.write_all(response.as_bytes()).await;
    let _ = stream.shutdown().await;
}

/// What the client got: the status and the body (the charge id on success).
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: String,
}

/// Asks the service at `addr` to charge `amount_cents` for the payment `reference` under
/// `key`, with extra request headers.
pub async fn charge(
    addr: SocketAddr,
    key: &str,
    reference: &str,
    amount_cents: i64,
    extra: &[(&str, String)],
) -> std::io::Result<Answer> {
    let body =
        serde_json::json!({ "amount_cents": amount_cents, "reference": reference }).to_string();
    let mut request = format!(
        "POST /charges HTTP/1.1\r\nHost: charges\r\nIdempotency-Key: {key}\r\nContent-Type: application/json\r\nContent-Length: {}\r\n",
        body.len()
    );
    for (name, value) in extra {
        request.push_str(&format!("{name}: {value}\r\n"));
    }
    request.push_str("Connection: close\r\n\r\n");
    request.push_str(&body);
    let mut stream = TcpStream::connect(addr).await?;
    stream.write_all(request.as_bytes()).await?;
    let mut response = String::new();
    stream.read_to_string(&mut response).await?;
    let status = response
        .split(' ')
        .nth(1)
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("not HTTP: {response:?}")))?;
    let body = response
        .split_once("\r\n\r\n")
        .map(|(_, b)| b.to_owned())
        .unwrap_or_default();
    Ok(Answer { status, body })
}
