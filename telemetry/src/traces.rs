//! Logging and OpenTelemetry traces for the daemons (the coordinator and the agent): a `tracing` subscriber that always logs to
//! stderr and, when the standard `OTEL_EXPORTER_OTLP_ENDPOINT` (or
//! `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`) variable is set, also exports spans over OTLP/gRPC;
//! and where a caller's W3C trace context enters a daemon (gRPC headers of a call, the
//! `trace_context` map of a `BarrierEnter` on a session or on the agent's relay socket, and
//! that of a relay's `GroupEnter`) or leaves one (the agent's relay span, passed on in the
//! `GroupEnter` it sends).
//!
//! The coordinator's own spans are at DEBUG level, so that with plain logging at the default
//! `info` they are disabled at their call sites and cost nothing; the exporting layer has its
//! own filter that records DEBUG spans of muster's crates whatever the log filter says.

use opentelemetry::propagation::{Extractor, TextMapPropagator};
use opentelemetry::trace::{TraceContextExt as _, TracerProvider as _};
use opentelemetry_sdk::propagation::TraceContextPropagator;
use opentelemetry_sdk::trace::SdkTracerProvider;
use std::collections::HashMap;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::filter::{EnvFilter, LevelFilter, Targets};
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Keeps the exporter alive; dropping it flushes the spans not yet exported and stops the
/// exporter's runtime. Hold it in `main` (outside any async context) until the process ends.
#[must_use = "dropping the guard stops exporting traces"]
pub struct Telemetry {
    provider: Option<SdkTracerProvider>,
    runtime: Option<tokio::runtime::Runtime>,
}

impl Telemetry {
    /// Whether spans are exported (an OTLP endpoint was configured and the exporter started).
    pub fn exporting(&self) -> bool {
        self.provider.is_some()
    }
}

impl Drop for Telemetry {
    fn drop(&mut self) {
        if let Some(provider) = self.provider.take() {
            // Blocks until the batch processor exported what it holds (or its timeout).
            if let Err(e) = provider.shutdown() {
                eprintln!("traces: flushing the OTLP exporter failed: {e}");
            }
        }
        if let Some(runtime) = self.runtime.take() {
            runtime.shutdown_background();
        }
    }
}

/// Whether the environment asks for OTLP trace export: an endpoint is set, and neither
/// `OTEL_SDK_DISABLED=true` nor `OTEL_TRACES_EXPORTER=none` turns it off.
pub fn otlp_configured(env: impl Fn(&str) -> Option<String>) -> bool {
    let set = |k: &str| env(k).is_some_and(|v| !v.trim().is_empty());
    let endpoint = set("OTEL_EXPORTER_OTLP_ENDPOINT") || set("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT");
    let disabled = env("OTEL_SDK_DISABLED").is_some_and(|v| v.trim().eq_ignore_ascii_case("true"))
        || env("OTEL_TRACES_EXPORTER").is_some_and(|v| v.trim().eq_ignore_ascii_case("none"));
    endpoint && !disabled
}

/// Installs the process's global subscriber: stderr logging filtered by `log_filter`, plus
/// OTLP trace export when [`otlp_configured`]. The service name is `OTEL_SERVICE_NAME` or
/// `default_service` (`muster-coordinator`, `muster-agent`); the other standard variables
/// (`OTEL_EXPORTER_OTLP_HEADERS`, `OTEL_EXPORTER_OTLP_TIMEOUT`, `OTEL_BSP_*`,
/// `OTEL_RESOURCE_ATTRIBUTES`) are read by the OpenTelemetry SDK. A failure to start the
/// exporter is printed and logging goes on without it.
pub fn init(default_service: &str, log_filter: EnvFilter) -> Telemetry {
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_filter(log_filter);
    let exporter = if otlp_configured(|k| std::env::var(k).ok()) {
        match start_exporter(default_service) {
            Ok(started) => Some(started),
            Err(e) => {
                eprintln!("traces: cannot start the OTLP exporter, not exporting: {e}");
                None
            }
        }
    } else {
        None
    };
    let Some((provider, runtime)) = exporter else {
        tracing_subscriber::registry().with(fmt).init();
        return Telemetry {
            provider: None,
            runtime: None,
        };
    };
    let otel = tracing_opentelemetry::layer()
        .with_tracer(provider.tracer("muster"))
        .with_filter(span_filter());
    tracing_subscriber::registry().with(fmt).with(otel).init();
    Telemetry {
        provider: Some(provider),
        runtime: Some(runtime),
    }
}

/// What the exporting layer records: muster's spans from DEBUG up, everything else from INFO.
fn span_filter() -> Targets {
    Targets::new()
        .with_default(LevelFilter::INFO)
        .with_target("muster_coordinator", LevelFilter::DEBUG)
        .with_target("muster_agent", LevelFilter::DEBUG)
        .with_target("muster", LevelFilter::DEBUG)
}

/// The exporter and the small runtime its gRPC channel lives on: its own, so that it works
/// whatever runtime the daemon runs (a current-thread one included) and can still flush after
/// that runtime has ended.
fn start_exporter(
    default_service: &str,
) -> Result<(SdkTracerProvider, tokio::runtime::Runtime), Box<dyn std::error::Error>> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .thread_name("otlp-export")
        .enable_all()
        .build()?;
    let exporter = {
        let _entered = runtime.enter();
        opentelemetry_otlp::SpanExporter::builder()
            .with_tonic()
            .build()?
    };
    let mut resource = opentelemetry_sdk::Resource::builder();
    if std::env::var("OTEL_SERVICE_NAME").map_or(true, |v| v.trim().is_empty()) {
        resource = resource.with_service_name(default_service.to_owned());
    }
    let provider = SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(resource.build())
        .build();
    Ok((provider, runtime))
}

/// The span of one gRPC call, for tonic's `Server::trace_fn`: named after the method
/// (`muster.v1.KeyValue/Set`) and, when the caller sent a W3C `traceparent` header, a child
/// of the caller's span. Disabled (and free) unless DEBUG spans of this crate are recorded;
/// none for `grpc.*` services (health probes, reflection).
pub fn server_span(request: &http::Request<()>) -> tracing::Span {
    let method = request.uri().path().trim_start_matches('/');
    if method.starts_with("grpc.") {
        // Health probes and reflection: frequent, and nobody's trace.
        return tracing::Span::none();
    }
    let span = tracing::debug_span!(
        "grpc",
        otel.name = method,
        otel.kind = "server",
        rpc.system = "grpc",
        rpc.method = method,
    );
    if !span.is_disabled() {
        let parent = TraceContextPropagator::new().extract(&Headers(request.headers()));
        let _ = span.set_parent(parent);
    }
    span
}

/// Makes `span` a child of the W3C trace context in `carrier` (the `trace_context` of a
/// `BarrierEnter` or a relay's `GroupEnter`). Nothing happens for an empty carrier or a
/// disabled span.
pub fn set_parent(span: &tracing::Span, carrier: &HashMap<String, String>) {
    if carrier.is_empty() || span.is_disabled() {
        return;
    }
    let parent = TraceContextPropagator::new().extract(carrier);
    let _ = span.set_parent(parent);
}

/// `span`'s W3C trace context as a `trace_context` map, for a span of this process that a
/// message sent on should be a child of (the agent relay's span of a group entry); `None`
/// when the span is disabled or not recorded by an OpenTelemetry layer.
pub fn carrier(span: &tracing::Span) -> Option<HashMap<String, String>> {
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    if !cx.span().span_context().is_valid() {
        return None;
    }
    let mut carrier = HashMap::with_capacity(2);
    TraceContextPropagator::new().inject_context(&cx, &mut carrier);
    Some(carrier)
}

/// gRPC request headers as an OpenTelemetry [`Extractor`].
struct Headers<'a>(&'a http::HeaderMap);

impl Extractor for Headers<'_> {
    fn get(&self, key: &str) -> Option<&str> {
        self.0.get(key).and_then(|v| v.to_str().ok())
    }

    fn keys(&self) -> Vec<&str> {
        self.0.keys().map(http::HeaderName::as_str).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn export_needs_an_endpoint_and_no_opt_out() {
        let check = |vars: &[(&str, &str)]| {
            otlp_configured(|k| {
                vars.iter()
                    .find(|(name, _)| *name == k)
                    .map(|(_, v)| (*v).to_owned())
            })
        };
        assert!(!check(&[]));
        assert!(!check(&[("OTEL_EXPORTER_OTLP_ENDPOINT", " ")]));
        assert!(check(&[("OTEL_EXPORTER_OTLP_ENDPOINT", "http://h:4317")]));
        assert!(check(&[(
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
            "http://h:4317"
        )]));
        assert!(!check(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://h:4317"),
            ("OTEL_SDK_DISABLED", "true"),
        ]));
        assert!(!check(&[
            ("OTEL_EXPORTER_OTLP_ENDPOINT", "http://h:4317"),
            ("OTEL_TRACES_EXPORTER", "none"),
        ]));
    }
}
