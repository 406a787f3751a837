//! The consumer's HTTP endpoints (`consume --metrics-addr`): `/metrics` for Prometheus,
//! `/healthz` (the process is up) and `/readyz` (the runtime consumes, the broker is connected,
//! the database answers and writes), as `idem::http::probes` makes them.

use idem::Health;
use metrics_exporter_prometheus::PrometheusHandle;
use std::net::SocketAddr;
use std::sync::Arc;

/// Serves the endpoints at `addr` until the process ends.
pub async fn serve(
    addr: SocketAddr,
    metrics: PrometheusHandle,
    health: Arc<Health>,
) -> std::io::Result<()> {
    let listener = tokio::net::TcpListener::bind(addr).await?;
    let app = idem::http::probes(health, move || metrics.render());
    tracing::info!(%addr, "serving /metrics, /healthz and /readyz");
    tokio::spawn(async move {
        if let Err(e) = axum::serve(listener, app).await {
            tracing::warn!(error = %e, "the HTTP endpoints stopped");
        }
    });
    Ok(())
}
