//! W3C trace context from the worker to the coordinator: the caller's current span (as an
//! OpenTelemetry span, when the application installed `tracing-opentelemetry`) goes out as a
//! `traceparent` (and `tracestate`) in the metadata of unary calls and in the `trace_context`
//! map of barrier entries (on the session, and on the agent's relay socket, whence the agent
//! passes it on with the node's group entry), so that the coordinator's spans join the
//! worker's trace.
//!
//! The SDK never exports spans itself: the application chooses its subscriber and exporter.
//! Without an OpenTelemetry layer the current span has no valid span context and nothing is
//! sent (nor allocated).

use opentelemetry::trace::{SpanContext, TraceContextExt as _};
use std::collections::HashMap;
use std::fmt::Write as _;
use tracing_opentelemetry::OpenTelemetrySpanExt as _;

/// The current span's OpenTelemetry context, if it is recorded by an OpenTelemetry layer.
fn current() -> Option<SpanContext> {
    let span = tracing::Span::current();
    if span.is_disabled() {
        return None;
    }
    let cx = span.context();
    let sc = cx.span().span_context().clone();
    sc.is_valid().then_some(sc)
}

/// The W3C `traceparent` value of `sc`: version 00, trace id, parent span id, flags.
fn traceparent(sc: &SpanContext) -> String {
    let mut value = String::with_capacity(55);
    write_traceparent(&mut value, sc);
    value
}

/// Appends the `traceparent` value of `sc` to `out`.
fn write_traceparent(out: &mut String, sc: &SpanContext) {
    let _ = write!(
        out,
        "00-{}-{}-{:02x}",
        sc.trace_id(),
        sc.span_id(),
        sc.trace_flags().to_u8()
    );
}

/// The current trace context as a `BarrierEnter.trace_context` map; empty (no allocation)
/// when the caller is not traced.
pub(crate) fn carrier() -> HashMap<String, String> {
    let Some(sc) = current() else {
        return HashMap::new();
    };
    let mut map = HashMap::with_capacity(2);
    map.insert("traceparent".to_owned(), traceparent(&sc));
    let state = sc.trace_state().header();
    if !state.is_empty() {
        map.insert("tracestate".to_owned(), state);
    }
    map
}

/// Sets `map`, the `trace_context` of a barrier entry that is reused from one barrier to the
/// next (the relay connection's), to the current trace context, reusing its strings. When the
/// caller is not traced the map ends up empty, which for the usual already-empty map is a
/// check and nothing else: no allocation, and nothing extra on the wire.
pub(crate) fn fill(map: &mut HashMap<String, String>) {
    let Some(sc) = current() else {
        if !map.is_empty() {
            map.clear();
        }
        return;
    };
    match map.get_mut("traceparent") {
        Some(value) => {
            value.clear();
            write_traceparent(value, &sc);
        }
        None => {
            map.insert("traceparent".to_owned(), traceparent(&sc));
        }
    }
    let state = sc.trace_state().header();
    if state.is_empty() {
        map.remove("tracestate");
    } else {
        map.insert("tracestate".to_owned(), state);
    }
}

/// `message` as a request carrying the current trace context in its metadata.
pub(crate) fn request<T>(message: T) -> tonic::Request<T> {
    let mut request = tonic::Request::new(message);
    if let Some(sc) = current() {
        let metadata = request.metadata_mut();
        if let Ok(value) = traceparent(&sc).parse() {
            metadata.insert("traceparent", value);
        }
        let state = sc.trace_state().header();
        if !state.is_empty()
            && let Ok(value) = state.parse()
        {
            metadata.insert("tracestate", value);
        }
    }
    request
}

#[cfg(test)]
mod tests {
    use super::*;
    use opentelemetry::trace::{SpanId, TraceFlags, TraceId, TraceState};

    #[test]
    fn traceparent_is_w3c_formatted() {
        let sc = SpanContext::new(
            TraceId::from_hex("4bf92f3577b34da6a3ce929d0e0e4736").expect("trace id"),
            SpanId::from_hex("00f067aa0ba902b7").expect("span id"),
            TraceFlags::SAMPLED,
            true,
            TraceState::default(),
        );
        assert_eq!(
            traceparent(&sc),
            "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
        );
    }

    #[test]
    fn untraced_callers_send_nothing() {
        assert!(carrier().is_empty());
        let request = request(());
        assert!(request.metadata().get("traceparent").is_none());
        // A reused map is emptied, and an empty one stays unallocated.
        let mut map = HashMap::from([("traceparent".to_owned(), "00-x".to_owned())]);
        fill(&mut map);
        assert!(map.is_empty());
        let mut map = HashMap::new();
        fill(&mut map);
        assert_eq!(map.capacity(), 0);
    }
}
