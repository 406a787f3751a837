//! The trace context a message carries across the broker. With the `opentelemetry` feature a
//! delivery's span continues the trace its headers carry, read with OpenTelemetry's global
//! propagator (`opentelemetry::global::set_text_map_propagator`), and a message a handler
//! stages carries the context of the span it was staged in. Without the feature, or without a
//! `tracing-opentelemetry` layer, the incoming `traceparent` is passed on as it came.

use crate::model::Headers;

/// Makes `span` a child of the remote span `headers` carry, when they carry a valid one and a
/// `tracing-opentelemetry` layer records spans (a no-op otherwise). Call it before the span is
/// first entered.
pub(crate) fn continue_trace(span: &tracing::Span, headers: &Headers) {
    #[cfg(feature = "opentelemetry")]
    otel::continue_trace(span, headers);
    #[cfg(not(feature = "opentelemetry"))]
    let _ = (span, headers);
}

/// Writes the context of the current span into `headers` (`traceparent` and whatever else the
/// global propagator writes); `false` when there is no valid context to write, so the caller
/// passes the incoming one on instead.
pub(crate) fn inject_current(headers: &mut Headers) -> bool {
    #[cfg(feature = "opentelemetry")]
    return otel::inject_current(headers);
    #[cfg(not(feature = "opentelemetry"))]
    {
        let _ = headers;
        false
    }
}

#[cfg(feature = "opentelemetry")]
mod otel {
    use crate::model::{HeaderValue, Headers};
    use opentelemetry::global;
    use opentelemetry::propagation::{Extractor, Injector};
    use opentelemetry::trace::TraceContextExt as _;
    use tracing_opentelemetry::OpenTelemetrySpanExt as _;

    /// Headers read by a propagator: text values, by exact name, else ignoring ASCII case.
    struct Reading<'a>(&'a Headers);

    impl Extractor for Reading<'_> {
        fn get(&self, key: &str) -> Option<&str> {
            let value = self.0.get(key).or_else(|| {
                self.0
                    .iter()
                    .find(|(name, _)| name.eq_ignore_ascii_case(key))
                    .map(|(_, value)| value)
            })?;
            match value {
                HeaderValue::Str(text) => Some(text),
                HeaderValue::Bytes(bytes) => std::str::from_utf8(bytes).ok(),
                _ => None,
            }
        }

        fn keys(&self) -> Vec<&str> {
            self.0.iter().map(|(name, _)| name).collect()
        }
    }

    /// Headers written by a propagator, and whether it wrote any.
    struct Writing<'a>(&'a mut Headers, bool);

    impl Injector for Writing<'_> {
        fn set(&mut self, key: &str, value: String) {
            self.0.insert(key, value);
            self.1 = true;
        }
    }

    pub(super) fn continue_trace(span: &tracing::Span, headers: &Headers) {
        let remote =
            global::get_text_map_propagator(|propagator| propagator.extract(&Reading(headers)));
        if remote.span().span_context().is_valid() {
            // Without a tracing-opentelemetry layer there is nothing to parent: that is fine.
            let _ = span.set_parent(remote);
        }
    }

    pub(super) fn inject_current(headers: &mut Headers) -> bool {
        let current = tracing::Span::current().context();
        if !current.span().span_context().is_valid() {
            return false;
        }
        let mut writing = Writing(headers, false);
        global::get_text_map_propagator(|propagator| {
            propagator.inject_context(&current, &mut writing)
        });
        writing.1
    }
}
