//! Prometheus metric types for hooks on hot paths, and the HTTP endpoint that serves them.
//!
//! The hooks of both daemons run on the barrier path, so nothing here takes a lock or
//! allocates when it records: histograms are fixed arrays of atomics ([`DurationHistogram`])
//! and labelled series are created once, up front ([`Labeled`]). The text is produced with
//! `prometheus-client`'s OpenMetrics encoder; which metrics exist is each daemon's business.

use http_body_util::Full;
use hyper::body::Bytes;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::{MetricType, TypedMetric};
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// Upper bounds (seconds) for RPC, store and barrier latencies: 100 µs to 5 min.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 300.0,
];

/// A histogram of durations made of atomics only, so that recording on the barrier path
/// never waits on a lock (`prometheus-client`'s own histogram holds a mutex). Clones share
/// their counts.
#[derive(Debug, Clone)]
pub struct DurationHistogram(Arc<HistogramCells>);

#[derive(Debug)]
struct HistogramCells {
    bounds: &'static [f64],
    /// One count per bound plus the `+Inf` bucket, not cumulative.
    buckets: Box<[AtomicU64]>,
    sum_nanos: AtomicU64,
}

impl DurationHistogram {
    /// An empty histogram over `bounds` (seconds, ascending).
    pub fn new(bounds: &'static [f64]) -> Self {
        Self(Arc::new(HistogramCells {
            bounds,
            buckets: (0..=bounds.len()).map(|_| AtomicU64::new(0)).collect(),
            sum_nanos: AtomicU64::new(0),
        }))
    }

    /// Records one duration.
    pub fn observe(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let i = self
            .0
            .bounds
            .iter()
            .position(|b| secs <= *b)
            .unwrap_or(self.0.bounds.len());
        self.0.buckets[i].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.0.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// How many durations were recorded.
    pub fn count(&self) -> u64 {
        self.0
            .buckets
            .iter()
            .map(|b| b.load(Ordering::Relaxed))
            .sum()
    }
}

impl TypedMetric for DurationHistogram {
    const TYPE: MetricType = MetricType::Histogram;
}

impl EncodeMetric for DurationHistogram {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        let buckets: Vec<(f64, u64)> = self
            .0
            .bounds
            .iter()
            .copied()
            .chain(std::iter::once(f64::INFINITY))
            .zip(self.0.buckets.iter().map(|b| b.load(Ordering::Relaxed)))
            .collect();
        // The count is the buckets' total, so a scrape racing a record stays consistent.
        let count = buckets.iter().map(|(_, n)| n).sum();
        let sum = self.0.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9;
        encoder.encode_histogram::<NoLabelSet>(sum, count, &buckets, None)
    }

    fn metric_type(&self) -> MetricType {
        Self::TYPE
    }
}

/// A metric with one label whose values are all known when it is made (gRPC methods, store
/// operations, causes, states): every series exists from the start (at zero), and looking one
/// up neither locks nor allocates. Clones share their series.
#[derive(Debug, Clone)]
pub struct Labeled<M>(Arc<LabeledSeries<M>>);

#[derive(Debug)]
struct LabeledSeries<M> {
    label: &'static str,
    series: Vec<(String, M)>,
    index: HashMap<String, usize>,
}

impl<M> Labeled<M> {
    /// One series per value of `label`, each made by `make`.
    pub fn new(
        label: &'static str,
        values: impl IntoIterator<Item = impl Into<String>>,
        make: impl Fn() -> M,
    ) -> Self {
        let mut series: Vec<(String, M)> = vec![];
        let mut index = HashMap::new();
        for v in values {
            let v = v.into();
            if !index.contains_key(&v) {
                index.insert(v.clone(), series.len());
                series.push((v, make()));
            }
        }
        Self(Arc::new(LabeledSeries {
            label,
            series,
            index,
        }))
    }

    /// The series of `value`, if it is one of the known values.
    pub fn get(&self, value: &str) -> Option<&M> {
        self.0.index.get(value).map(|&i| &self.0.series[i].1)
    }
}

impl<M: TypedMetric> TypedMetric for Labeled<M> {
    const TYPE: MetricType = M::TYPE;
}

impl<M: EncodeMetric + TypedMetric> EncodeMetric for Labeled<M> {
    fn encode(&self, mut encoder: MetricEncoder<'_>) -> Result<(), std::fmt::Error> {
        for (value, metric) in &self.0.series {
            let labels = [(self.0.label, value.as_str())];
            metric.encode(encoder.encode_family(&labels)?)?;
        }
        Ok(())
    }

    fn metric_type(&self) -> MetricType {
        M::TYPE
    }
}

/// The content type of the OpenMetrics text the endpoint serves.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `GET /metrics` on `listener` over HTTP/1 with the text `render` produces (the
/// daemon's registries, encoded as [`CONTENT_TYPE`]) (any
/// other request gets 404) until the task is dropped or aborted. A connection's error ends
/// only that connection. Cancel-safe: dropping it stops accepting; open connections finish
/// their request.
pub async fn serve_http<R, F>(listener: TcpListener, render: R)
where
    R: Fn() -> F + Clone + Send + Sync + 'static,
    F: Future<Output = String> + Send + 'static,
{
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(e) => {
                tracing::warn!("metrics endpoint: accept failed: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let render = render.clone();
        // Task "metrics connection": one scrape connection; on error, logs at debug and ends.
        tokio::spawn(async move {
            let service = hyper::service::service_fn(move |request: http::Request<_>| {
                let render = render.clone();
                async move {
                    let found =
                        request.method() == http::Method::GET && request.uri().path() == "/metrics";
                    let response = if found {
                        http::Response::builder()
                            .header(http::header::CONTENT_TYPE, CONTENT_TYPE)
                            .body(Full::new(Bytes::from(render().await)))
                    } else {
                        http::Response::builder()
                            .status(http::StatusCode::NOT_FOUND)
                            .body(Full::new(Bytes::from_static(b"not found; try /metrics\n")))
                    };
                    response.map_err(|e| e.to_string())
                }
            });
            let io = hyper_util::rt::TokioIo::new(stream);
            if let Err(e) = hyper::server::conn::http1::Builder::new()
                .serve_connection(io, service)
                .await
            {
                tracing::debug!("metrics endpoint: connection ended: {e}");
            }
        });
    }
}

/// The label value for gRPC paths that are not among a [`RpcLatencyLayer`]'s methods (kept
/// out of the label set so that arbitrary paths cannot grow it).
pub const OTHER_METHOD: &str = "other";

/// A tower layer that records every gRPC call's latency, until its response headers, into
/// the series of its method (`/package.Service/Method`) in a [`Labeled`] histogram, or the
/// [`OTHER_METHOD`] series (for a stream, until the stream opens).
#[derive(Debug, Clone)]
pub struct RpcLatencyLayer(Labeled<DurationHistogram>);

impl RpcLatencyLayer {
    /// A layer recording into `methods`, whose label values are the served methods and
    /// [`OTHER_METHOD`].
    pub fn new(methods: Labeled<DurationHistogram>) -> Self {
        Self(methods)
    }
}

impl<S> tower_layer::Layer<S> for RpcLatencyLayer {
    type Service = RpcLatency<S>;

    fn layer(&self, inner: S) -> RpcLatency<S> {
        RpcLatency {
            inner,
            methods: self.0.clone(),
        }
    }
}

/// The service [`RpcLatencyLayer`] wraps around the gRPC router.
#[derive(Debug, Clone)]
pub struct RpcLatency<S> {
    inner: S,
    methods: Labeled<DurationHistogram>,
}

impl<S, B, R> tower_service::Service<http::Request<B>> for RpcLatency<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        // A clone of one series' handle (an Arc), taken before the call moves the request.
        let histogram = self
            .methods
            .get(request.uri().path())
            .or_else(|| self.methods.get(OTHER_METHOD))
            .cloned();
        let start = Instant::now();
        let call = self.inner.call(request);
        Box::pin(async move {
            let response = call.await;
            if let Some(h) = histogram {
                h.observe(start.elapsed());
            }
            response
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use prometheus_client::metrics::counter::Counter;
    use prometheus_client::registry::Registry;

    #[test]
    fn histogram_buckets_and_encodes() {
        let h = DurationHistogram::new(&[0.001, 0.01]);
        h.observe(Duration::from_micros(500));
        h.observe(Duration::from_millis(5));
        h.observe(Duration::from_secs(1));
        assert_eq!(h.count(), 3);
        let mut registry = Registry::with_prefix("t");
        registry.register("wait_seconds", "help", h);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(
            text.contains("t_wait_seconds_bucket{le=\"0.001\"} 1\n"),
            "{text}"
        );
        assert!(
            text.contains("t_wait_seconds_bucket{le=\"0.01\"} 2\n"),
            "{text}"
        );
        assert!(
            text.contains("t_wait_seconds_bucket{le=\"+Inf\"} 3\n"),
            "{text}"
        );
        assert!(text.contains("t_wait_seconds_count 3\n"), "{text}");
    }

    #[test]
    fn labeled_series_exist_from_the_start() {
        let l = Labeled::new("op", ["get", "put"], Counter::<u64>::default);
        l.get("put").unwrap().inc();
        assert!(l.get("other").is_none());
        let mut registry = Registry::default();
        registry.register("ops", "help", l);
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &registry).unwrap();
        assert!(text.contains("ops_total{op=\"get\"} 0\n"), "{text}");
        assert!(text.contains("ops_total{op=\"put\"} 1\n"), "{text}");
    }
}
