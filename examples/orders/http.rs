//! The consumer's HTTP endpoints (`consume --metrics-addr`): `/metrics` for Prometheus,
//! `/healthz` (the process is up) and `/readyz` (the runtime consumes, the broker is connected,
//! the database answers). A few lines of HTTP/1.1 over tokio: one request per connection.

use idem::Health;
use metrics_exporter_prometheus::PrometheusHandle;
use std::net::SocketAddr;
use std::sync::Arc;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Serves the endpoints at `addr` until the process ends.
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    health: Arc<Health>,
) -> std::io::Result<()> {
    let listener = TcpListener::bind(addr).await?;
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let (metrics, health) = (metrics.clone(), health.clone());
            tokio::spawn(async move {
                if let Err(e) = answer(stream, &metrics, &health).await {
                    tracing::debug!(error = %e, "an HTTP request failed");
                }
            });
        }
    });
    Ok(())
}

/// Reads one request and answers it.
async fn answer(
    mut stream: TcpStream,
    metrics: &PrometheusHandle,
    health: &Health,
) -> std::io::Result<()> {
    let mut request = Vec::new();
    let mut buf = [0u8; 1024];
    while !request.windows(4).any(|w| w == b"\r\n\r\n") && request.len() < 8192 {
        let n = stream.read(&mut buf).await?;
        if n == 0 {
            break;
        }
        request.extend_from_slice(&buf[..n]);
    }
    let line = String::from_utf8_lossy(&request);
    let path = line.split_whitespace().nth(1).unwrap_or("");
    let (status, body) = match path {
        "/metrics" => ("200 OK", metrics.render()),
        "/healthz" => ("200 OK", "ok\n".to_owned()),
        "/readyz" => {
            let readiness = health.readiness().await;
            if readiness.ready {
                ("200 OK", "ready\n".to_owned())
            } else {
                let problems = readiness.problems.join("\n");
                (
                    "503 Service Unavailable",
                    format!("not ready:\n{problems}\n"),
                )
            }
        }
        _ => (
            "404 Not Found",
            "try /metrics, /healthz or /readyz\n".to_owned(),
        ),
    };
    let response = format!(
        "HTTP/1.1 {status}\r\ncontent-type: text/plain; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
        body.len()
    );
    stream.write_all(response.as_bytes()).await?;
    stream.shutdown().await
}
