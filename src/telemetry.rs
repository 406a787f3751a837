//! The delivery span and the metrics idem records (names, help texts, histogram buckets), and,
//! with the `prometheus` feature, a Prometheus recorder that renders idem's histograms as the
//! bucketed series the dashboard in `deploy/` queries.

pub use idem_core::telemetry::*;

/// A Prometheus recorder builder with bucket bounds set for every histogram idem records
/// ([`HISTOGRAMS`]). Without them `metrics-exporter-prometheus` renders histograms as
/// summaries, which `histogram_quantile` cannot read and which cannot be summed across
/// replicas. Add your own settings, then install it:
///
/// ```no_run
/// let handle = idem::telemetry::prometheus()?.install_recorder()?;
/// // Serve `handle.render()` at `/metrics`.
/// # Ok::<(), metrics_exporter_prometheus::BuildError>(())
/// ```
#[cfg(feature = "prometheus")]
#[cfg_attr(docsrs, doc(cfg(feature = "prometheus")))]
pub fn prometheus()
-> Result<metrics_exporter_prometheus::PrometheusBuilder, metrics_exporter_prometheus::BuildError> {
    use metrics_exporter_prometheus::{Matcher, PrometheusBuilder};
    HISTOGRAMS
        .iter()
        .try_fold(PrometheusBuilder::new(), |builder, (name, buckets)| {
            builder.set_buckets_for_metric(Matcher::Full((*name).to_owned()), buckets)
        })
}
