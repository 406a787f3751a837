//! The endpoints an orchestrator and Prometheus read, as an axum router: mount it on your
//! server, or serve it on a port of its own.

use axum::Router;
use axum::http::StatusCode;
use axum::routing::get;
use idem_core::runtime::Health;
use std::sync::Arc;

/// `GET /healthz`: 200 while the process answers (a liveness probe). `GET /readyz`: 200 while
/// the runtime is ready (it consumes, every queue's consumer is connected, every store answers
/// and can write), else 503 with the reasons, one per line (a readiness probe: a replica that
/// cannot work gets no traffic and shows why). `GET /metrics`: what `render` returns, in
/// Prometheus's text format (for example `PrometheusHandle::render` of the recorder
/// `idem::telemetry::prometheus()` installed).
///
/// ```no_run
/// # fn app(runtime: &idem_core::runtime::Runtime, handle: fn() -> String) -> axum::Router {
/// // Beside your own routes, or on a port of its own with `axum::serve`.
/// axum::Router::new().merge(idem_http::probes(runtime.health(), move || handle()))
/// # }
/// ```
pub fn probes<F>(health: Arc<Health>, render: F) -> Router
where
    F: Fn() -> String + Clone + Send + Sync + 'static,
{
    Router::new()
        .route("/healthz", get(|| async { "ok\n" }))
        .route(
            "/readyz",
            get(move || {
                let health = health.clone();
                async move {
                    let readiness = health.readiness().await;
                    if readiness.ready {
                        (StatusCode::OK, "ready\n".to_owned())
                    } else {
                        let problems = readiness.problems.join("\n");
                        (
                            StatusCode::SERVICE_UNAVAILABLE,
                            format!("not ready:\n{problems}\n"),
                        )
                    }
                }
            }),
        )
        .route(
            "/metrics",
            get(move || {
                let render = render.clone();
                async move { ([("content-type", "text/plain; version=0.0.4")], render()) }
            }),
        )
}
