//! Prometheus metrics (`--metrics-addr`): process-wide counters and histograms fed by one-line
//! hooks on the paths they measure, gauges of jobs, nodes and ranks computed at scrape time
//! from the coordinator's state, and the small HTTP server that answers `GET /metrics`.
//!
//! The hooks run on the barrier path, so nothing here takes a lock or allocates when it
//! records: histograms are fixed arrays of atomics ([`DurationHistogram`]) and labelled
//! series are created once, up front ([`Labeled`]). The text is produced with
//! `prometheus-client`'s OpenMetrics encoder.

use crate::service::{Coordinator, OpsService};
use http_body_util::Full;
use hyper::body::Bytes;
use muster_proto::v1 as pb;
use pb::ops_server::Ops as _;
use prometheus_client::encoding::{EncodeMetric, MetricEncoder, NoLabelSet};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::{MetricType, TypedMetric};
use prometheus_client::registry::Registry;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, LazyLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};
use tokio::net::TcpListener;

/// Upper bounds (seconds) for RPC, store and barrier latencies: 100 µs to 5 min.
pub const LATENCY_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0, 30.0, 60.0, 300.0,
];

/// Upper bounds (seconds) for rendezvous rounds, which wait for nodes: 10 ms to 1 h.
pub const ROUND_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
    3600.0,
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

/// Why a generation ended early, as `muster_generation_failures_total` labels it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// A worker exited with a non-zero status (reported by its agent).
    WorkerExited,
    /// A signal ended a worker (reported by its agent).
    WorkerSignaled,
    /// A worker's session dropped or went silent past the heartbeat timeout.
    SessionLost,
    /// A node's agent was lost (its watch stream ended or its lease expired).
    NodeLost,
    /// An operator cancelled the job while a generation ran.
    Cancelled,
}

impl Cause {
    const ALL: [Cause; 5] = [
        Cause::WorkerExited,
        Cause::WorkerSignaled,
        Cause::SessionLost,
        Cause::NodeLost,
        Cause::Cancelled,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::WorkerExited => "worker_exited",
            Cause::WorkerSignaled => "worker_signaled",
            Cause::SessionLost => "session_lost",
            Cause::NodeLost => "node_lost",
            Cause::Cancelled => "cancelled",
        }
    }
}

/// The store operations timed by `muster_store_operation_seconds`.
pub const STORE_OPS: &[&str] = &["get", "put", "create", "delete", "list", "delete_prefix"];

/// The label value for gRPC paths that are not a known method (kept out of the label set so
/// that arbitrary paths cannot grow it).
const OTHER_METHOD: &str = "other";

/// The coordinator's process-wide metrics (one coordinator per process is the norm; tests
/// running several share these, which is why their assertions are lower bounds).
struct Metrics {
    registry: Registry,
    barrier_wait: DurationHistogram,
    rendezvous: DurationHistogram,
    restarts: Counter,
    failures: Labeled<Counter>,
    rpc: Labeled<DurationHistogram>,
    store: Labeled<DurationHistogram>,
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    let mut registry = Registry::with_prefix("muster");
    let barrier_wait = DurationHistogram::new(LATENCY_BUCKETS);
    registry.register(
        "barrier_wait_seconds",
        "Time from a barrier's first arrival to its completion (all ranks arrived)",
        barrier_wait.clone(),
    );
    let rendezvous = DurationHistogram::new(ROUND_BUCKETS);
    registry.register(
        "rendezvous_duration_seconds",
        "Time from a rendezvous round's opening to its closing (ranks assigned)",
        rendezvous.clone(),
    );
    let restarts = Counter::default();
    registry.register(
        "restarts",
        "Generations started again after a failed one (restarts spent from jobs' budgets)",
        restarts.clone(),
    );
    let failures = Labeled::new("cause", Cause::ALL.map(Cause::as_str), Counter::default);
    registry.register(
        "generation_failures",
        "Generations ended early, by cause (worker_exited, worker_signaled, session_lost, node_lost, cancelled)",
        failures.clone(),
    );
    let rpc = Labeled::new(
        "method",
        grpc_methods().into_iter().chain([OTHER_METHOD.to_owned()]),
        || DurationHistogram::new(LATENCY_BUCKETS),
    );
    registry.register(
        "rpc_duration_seconds",
        "gRPC call latency by method, until the response headers (a stream's opening)",
        rpc.clone(),
    );
    let store = Labeled::new("op", STORE_OPS.iter().copied(), || {
        DurationHistogram::new(LATENCY_BUCKETS)
    });
    registry.register(
        "store_operation_seconds",
        "State store operation latency by operation",
        store.clone(),
    );
    Metrics {
        registry,
        barrier_wait,
        rendezvous,
        restarts,
        failures,
        rpc,
        store,
    }
});

/// Every gRPC method the coordinator serves, as `/package.Service/Method`, read from the
/// descriptor sets it serves reflection from.
fn grpc_methods() -> Vec<String> {
    use prost::Message as _;
    let mut out = vec![];
    for set in [
        muster_proto::FILE_DESCRIPTOR_SET,
        tonic_health::pb::FILE_DESCRIPTOR_SET,
    ] {
        let Ok(set) = prost_types::FileDescriptorSet::decode(set) else {
            continue;
        };
        for file in &set.file {
            for service in &file.service {
                for method in &service.method {
                    out.push(format!(
                        "/{}.{}/{}",
                        file.package(),
                        service.name(),
                        method.name()
                    ));
                }
            }
        }
    }
    out
}

/// Hook: a barrier completed `waited` after its first arrival.
pub fn barrier_completed(waited: Duration) {
    METRICS.barrier_wait.observe(waited);
}

/// Hook: a rendezvous round closed `open_for` after it opened.
pub fn rendezvous_closed(open_for: Duration) {
    METRICS.rendezvous.observe(open_for);
}

/// Hook: a job starts a generation again after a failed one.
pub fn restarted() {
    METRICS.restarts.inc();
}

/// Hook: a generation failed with `failure`.
pub fn generation_failed(failure: &muster_core::failure::Failure) {
    let cause = if !failure.node_id.is_empty() {
        Cause::NodeLost
    } else if failure.detail.signal.is_some() {
        Cause::WorkerSignaled
    } else if failure.detail.exit_code.is_some() {
        Cause::WorkerExited
    } else {
        Cause::SessionLost
    };
    generation_ended(cause);
}

/// Hook: a generation ended early for `cause`.
pub fn generation_ended(cause: Cause) {
    if let Some(c) = METRICS.failures.get(cause.as_str()) {
        c.inc();
    }
}

/// Hook: store operation `op` (one of [`STORE_OPS`]) took `took`.
pub fn store_op(op: &'static str, took: Duration) {
    if let Some(h) = METRICS.store.get(op) {
        h.observe(took);
    }
}

/// The state gauges, computed from the coordinator at scrape time through the ops API's own
/// handlers (so they show what `muster-agent status` shows).
async fn state_registry(coordinator: &Arc<Coordinator>) -> Registry {
    const JOB_STATES: [&str; 5] = ["open", "running", "failed", "finished", "cancelled"];
    const NODE_STATES: [&str; 5] = ["joining", "running", "failed", "finished", "cancelled"];
    const RANK_STATES: [&str; 5] = ["pending", "running", "waiting", "failed", "left"];
    let gauges = |states: &[&'static str]| {
        Labeled::new("state", states.iter().copied(), Gauge::<i64>::default)
    };
    let (jobs, nodes, ranks) = (
        gauges(&JOB_STATES),
        gauges(&NODE_STATES),
        gauges(&RANK_STATES),
    );
    let agents = Gauge::<i64>::default();
    let ops = OpsService(Arc::clone(coordinator));
    let summaries = ops
        .list_jobs(tonic::Request::new(pb::ListJobsRequest {}))
        .await
        .map(|r| r.into_inner().jobs)
        .unwrap_or_default();
    let add = |l: &Labeled<Gauge<i64>>, state: &str, n: u32| {
        if let Some(g) = l.get(state) {
            g.inc_by(i64::from(n));
        }
    };
    for s in &summaries {
        let state = match pb::RoundState::try_from(s.state) {
            Ok(pb::RoundState::Open) => "open",
            Ok(pb::RoundState::Running) => "running",
            Ok(pb::RoundState::Failed) => "failed",
            Ok(pb::RoundState::Finished) => "finished",
            Ok(pb::RoundState::Cancelled) => "cancelled",
            _ => continue,
        };
        add(&jobs, state, 1);
        if state == "open" {
            add(&nodes, "joining", s.nodes_waiting);
        } else {
            add(&nodes, state, s.num_nodes);
        }
        if s.world_size == 0 {
            continue;
        }
        let request = tonic::Request::new(pb::DescribeJobRequest {
            job_id: s.job_id.clone(),
            ..Default::default()
        });
        let Ok(d) = ops.describe_job(request).await else {
            continue;
        };
        for r in &d.get_ref().ranks {
            let state = match pb::RankState::try_from(r.state) {
                Ok(pb::RankState::Pending) => "pending",
                Ok(pb::RankState::Running) => "running",
                Ok(pb::RankState::Waiting) => "waiting",
                Ok(pb::RankState::Failed) => "failed",
                Ok(pb::RankState::Left) => "left",
                _ => continue,
            };
            add(&ranks, state, 1);
        }
    }
    if let Ok(a) = ops
        .list_agents(tonic::Request::new(pb::ListAgentsRequest {}))
        .await
    {
        agents.set(a.get_ref().agents.len() as i64);
    }
    let mut registry = Registry::with_prefix("muster");
    registry.register("jobs", "Jobs known to the coordinator, by state", jobs);
    registry.register(
        "nodes",
        "Nodes of jobs, by state: joining an open round, or their generation's state",
        nodes,
    );
    registry.register(
        "ranks",
        "Ranks of running generations, by state (waiting: at a barrier)",
        ranks,
    );
    registry.register(
        "agents",
        "Daemon agents registered with the coordinator",
        agents,
    );
    registry
}

/// The coordinator's metrics in the OpenMetrics text format.
pub async fn render(coordinator: &Arc<Coordinator>) -> String {
    let state = state_registry(coordinator).await;
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode_registry(&mut out, &METRICS.registry);
    let _ = prometheus_client::encoding::text::encode_registry(&mut out, &state);
    let _ = prometheus_client::encoding::text::encode_eof(&mut out);
    out
}

/// The content type of [`render`]'s text.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Serves `GET /metrics` on `listener` over HTTP/1 with the text `render` produces (any
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

/// A tower layer that records every gRPC call's latency, until its response headers, into
/// `muster_rpc_duration_seconds{method}` (for a stream, until the stream opens).
#[derive(Debug, Clone, Copy, Default)]
pub struct RpcLatencyLayer;

impl<S> tower_layer::Layer<S> for RpcLatencyLayer {
    type Service = RpcLatency<S>;

    fn layer(&self, inner: S) -> RpcLatency<S> {
        RpcLatency(inner)
    }
}

/// The service [`RpcLatencyLayer`] wraps around the gRPC router.
#[derive(Debug, Clone)]
pub struct RpcLatency<S>(S);

impl<S, B, R> tower_service::Service<http::Request<B>> for RpcLatency<S>
where
    S: tower_service::Service<http::Request<B>, Response = http::Response<R>>,
    S::Future: Send + 'static,
{
    type Response = S::Response;
    type Error = S::Error;
    type Future = Pin<Box<dyn Future<Output = Result<S::Response, S::Error>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.0.poll_ready(cx)
    }

    fn call(&mut self, request: http::Request<B>) -> Self::Future {
        let metrics: &'static Metrics = &METRICS;
        let histogram = metrics
            .rpc
            .get(request.uri().path())
            .or_else(|| metrics.rpc.get(OTHER_METHOD));
        let start = Instant::now();
        let call = self.0.call(request);
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

    #[test]
    fn every_muster_method_is_a_label() {
        let methods = grpc_methods();
        assert!(methods.iter().any(|m| m == "/muster.v1.Rendezvous/Join"));
        assert!(methods.iter().any(|m| m == "/grpc.health.v1.Health/Check"));
    }
}
