//! The shutdown signal a service's supervisor sends.

/// Completes when the process is asked to stop: SIGINT (Ctrl-C) or, on Unix, SIGTERM, which
/// Kubernetes, systemd and Docker send before they kill a process. Pass it to
/// [`Runtime::run_until`](crate::runtime::Runtime::run_until) so that a deploy stops consuming and
/// finishes the deliveries in flight instead of being killed in the middle of them.
pub async fn shutdown_signal() {
    let interrupt = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        use tokio::signal::unix::{SignalKind, signal};
        match signal(SignalKind::terminate()) {
            Ok(mut terminate) => {
                tokio::select! {
                    _ = interrupt => {}
                    _ = terminate.recv() => {}
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "cannot listen for SIGTERM; only Ctrl-C stops the process");
                let _ = interrupt.await;
            }
        }
    }
    #[cfg(not(unix))]
    let _ = interrupt.await;
}
