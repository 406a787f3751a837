//! Traces across the broker (feature `opentelemetry`), through `build()` with a
//! `tracing-opentelemetry` layer and the W3C propagator: a delivery's span is a child of the
//! span its `traceparent` names, and a message its handler stages in the outbox carries this
//! consumer's context, so the next consumer's delivery span is a child of this one's, in the
//! same trace. One test: it installs the process's subscriber and propagator.

#![allow(clippy::unwrap_used)] // tests unwrap: a panic is a failure with its message

mod common;

use common::running::start;
use common::wait_until;
use idem::sql::SqliteInbox;
use idem::transport::MemoryTransport;
use idem::{Context, Envelope, HandlerError, Outgoing, Runtime, idempotent};
use opentelemetry::trace::{SpanId, TraceId, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::{InMemorySpanExporter, SdkTracerProvider, SpanData};
use std::time::Duration;
use tracing_subscriber::layer::SubscriberExt as _;

#[derive(serde::Serialize, serde::Deserialize)]
struct Order {
    order_id: String,
}

/// Stages the order for the next consumer.
#[idempotent(store = Sqlite, queue = "otel-orders", consumer = "otel.orders", key = "order.order_id")]
async fn forward(
    tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    order: Order,
    ctx: &Context<'_>,
) -> Result<(), HandlerError> {
    idem::outbox::stage(tx, ctx, Outgoing::to_queue("otel-billed", &order)?).await?;
    Ok(())
}

/// The next consumer: writes nothing but its inbox row.
#[idempotent(store = Sqlite, queue = "otel-billed", consumer = "otel.billed", key = "order.order_id")]
async fn bill(
    _tx: &mut sqlx::Transaction<'_, sqlx::Sqlite>,
    order: Order,
) -> Result<(), HandlerError> {
    let _ = order;
    Ok(())
}

/// The finished `delivery` span of `consumer`, if exported yet.
fn delivery(spans: &[SpanData], consumer: &str) -> Option<SpanData> {
    spans
        .iter()
        .find(|s| {
            s.name == "delivery"
                && s.attributes
                    .iter()
                    .any(|kv| kv.key.as_str() == "consumer" && kv.value.as_str() == consumer)
        })
        .cloned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_trace_continues_through_the_consumer_and_its_outbox() {
    let exporter = InMemorySpanExporter::default();
    let provider = SdkTracerProvider::builder()
        .with_simple_exporter(exporter.clone())
        .build();
    let layer = tracing_opentelemetry::layer().with_tracer(provider.tracer("idem-test"));
    tracing::subscriber::set_global_default(tracing_subscriber::registry().with(layer)).unwrap();
    opentelemetry::global::set_text_map_propagator(TraceContextPropagator::new());

    let (pool, _dir) = common::sqlite(4).await;
    let inbox = SqliteInbox::new(pool.clone());
    inbox.migrate().await.unwrap();
    let transport = MemoryTransport::new();
    let running = start(
        Runtime::builder()
            .transport(transport.clone())
            .store(inbox)
            .handlers(["otel.orders", "otel.billed"]),
    );
    let producer_trace = "4bf92f3577b34da6a3ce929d0e0e4736";
    let producer_span = "00f067aa0ba902b7";
    transport.publish(
        "otel-orders",
        Envelope::new(r#"{"order_id":"t-1"}"#)
            .with_message_id("t-1")
            .with_header(
                "traceparent",
                format!("00-{producer_trace}-{producer_span}-01"),
            ),
    );
    let mut spans = Vec::new();
    wait_until("both deliveries traced", Duration::from_secs(20), || {
        spans = exporter.get_finished_spans().unwrap();
        let both =
            delivery(&spans, "otel.orders").is_some() && delivery(&spans, "otel.billed").is_some();
        async move { both }
    })
    .await;
    running.shut_down().await;

    let first = delivery(&spans, "otel.orders").unwrap();
    let next = delivery(&spans, "otel.billed").unwrap();
    let trace = TraceId::from_hex(producer_trace).unwrap();
    assert_eq!(first.span_context.trace_id(), trace);
    assert_eq!(
        first.parent_span_id,
        SpanId::from_hex(producer_span).unwrap()
    );
    assert!(first.parent_span_is_remote);
    // The staged message carried the first consumer's context, not the producer's: the next
    // delivery hangs under the first (directly, or under a span inside it).
    assert_eq!(next.span_context.trace_id(), trace);
    assert!(next.parent_span_is_remote);
    let mut parent = next.parent_span_id;
    while parent != first.span_context.span_id() {
        let Some(span) = spans.iter().find(|s| s.span_context.span_id() == parent) else {
            panic!(
                "the next delivery's parent {parent} is not inside the first delivery {}",
                first.span_context.span_id()
            );
        };
        parent = span.parent_span_id;
    }
}
