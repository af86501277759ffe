//! The coordinator's Prometheus metrics (`--metrics-addr`): process-wide counters and
//! histograms fed by one-line hooks on the paths they measure, and gauges of jobs, nodes and
//! ranks rendered at scrape time from a [`StateSnapshot`] the server hands in.
//!
//! The hooks run on the barrier path, so nothing here takes a lock or allocates when it
//! records: the metric types and the HTTP endpoint are `muster_telemetry::metrics`'s (shared
//! with the agent). This module imports nothing of the service or the store: `lib.rs` reads
//! the snapshot and gives the store its timing hook ([`store_op`]).

use muster_core::requests::OnHang;
use muster_proto::v1 as pb;
use muster_telemetry::metrics::{
    DurationHistogram, LATENCY_BUCKETS, Labeled, OTHER_METHOD, RpcLatencyLayer,
};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::sync::LazyLock;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

/// Upper bounds (seconds) for rendezvous rounds, which wait for nodes: 10 ms to 1 h.
pub const ROUND_BUCKETS: &[f64] = &[
    0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0,
    3600.0,
];

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
    /// The generation made no progress for the job's hang timeout (`--on-hang fail` or
    /// `restart`).
    Hung,
}

impl Cause {
    const ALL: [Cause; 6] = [
        Cause::WorkerExited,
        Cause::WorkerSignaled,
        Cause::SessionLost,
        Cause::NodeLost,
        Cause::Cancelled,
        Cause::Hung,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Cause::WorkerExited => "worker_exited",
            Cause::WorkerSignaled => "worker_signaled",
            Cause::SessionLost => "session_lost",
            Cause::NodeLost => "node_lost",
            Cause::Cancelled => "cancelled",
            Cause::Hung => "hung",
        }
    }
}

/// The coordinator's process-wide metrics (one coordinator per process is the norm; tests
/// running several share these, which is why their assertions are lower bounds).
struct Metrics {
    registry: Registry,
    barrier_wait: DurationHistogram,
    rendezvous: DurationHistogram,
    restarts: Counter,
    recoveries: Counter,
    quorum: DurationHistogram,
    cancelled: Counter,
    hangs: Labeled<Counter>,
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
    let recoveries = Counter::default();
    registry.register(
        "recoveries",
        "Ranks replaced in place (in-place recovery: a restart that kept the other ranks running)",
        recoveries.clone(),
    );
    let quorum = DurationHistogram::new(ROUND_BUCKETS);
    registry.register(
        "recovery_quorum_seconds",
        "In-place recovery: time from a rank's death to the quorum that closed its recovery",
        quorum.clone(),
    );
    // A counter as well as the `muster_jobs{state="cancelled"}` gauge: cancelled jobs expire
    // (`--finished-job-ttl-ms`), and a rate of cancels outlives them.
    let cancelled = Counter::default();
    registry.register(
        "jobs_cancelled",
        "Jobs an operator cancelled (Ops.CancelJob, muster-agent cancel), whatever phase they were in",
        cancelled.clone(),
    );
    let hangs = Labeled::new(
        "action",
        [OnHang::Report, OnHang::Fail, OnHang::Restart].map(OnHang::name),
        Counter::default,
    );
    registry.register(
        "hangs",
        "Hangs detected (a generation without progress for its job's hang timeout), by what followed (report, fail, restart)",
        hangs.clone(),
    );
    let failures = Labeled::new("cause", Cause::ALL.map(Cause::as_str), Counter::default);
    registry.register(
        "generation_failures",
        "Generations ended early, by cause (worker_exited, worker_signaled, session_lost, node_lost, cancelled, hung)",
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
    let store = Labeled::new("op", crate::store::OPS.iter().copied(), || {
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
        recoveries,
        quorum,
        cancelled,
        hangs,
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

/// Hook: a rank of an in-place job died and is replaced in place (a restart too).
pub fn recovered_in_place() {
    METRICS.restarts.inc();
    METRICS.recoveries.inc();
}

/// Hook: a quorum closed an in-place recovery `took` after the rank's death.
pub fn quorum_formed(took: Duration) {
    METRICS.quorum.observe(took);
}

/// Hook: an operator cancelled a job that was not over yet.
pub fn job_cancelled() {
    METRICS.cancelled.inc();
}

/// Hook: a generation failed with `failure`.
pub fn generation_failed(failure: &muster_core::failure::Failure) {
    let cause = if failure.hang.is_some() {
        Cause::Hung
    } else if !failure.node_id.is_empty() {
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

/// Hook: a hang was detected in a job whose hang action is `action`.
pub fn hang_detected(action: OnHang) {
    if let Some(c) = METRICS.hangs.get(action.name()) {
        c.inc();
    }
}

/// Hook: a generation ended early for `cause`.
pub fn generation_ended(cause: Cause) {
    if let Some(c) = METRICS.failures.get(cause.as_str()) {
        c.inc();
    }
}

/// Hook: store operation `op` (one of [`crate::store::OPS`]) took `took`; `lib.rs` hands it to the
/// store's timing wrapper (`store::timed`), so that the store does not import this module.
pub fn store_op(op: &'static str, took: Duration) {
    if let Some(h) = METRICS.store.get(op) {
        h.observe(took);
    }
}

/// What the state gauges show, read from the coordinator at scrape time by whoever serves the
/// endpoint (`lib.rs`, through the ops API's own handlers, so that they show what
/// `muster-agent status` shows). Plain data, so that this module needs nothing of the service.
#[derive(Debug, Default)]
pub struct StateSnapshot {
    /// Every job's summary.
    pub jobs: Vec<pb::JobSummary>,
    /// The ranks of every job that has a generation (a world size above zero).
    pub ranks: Vec<pb::RankInfo>,
    /// How many daemon agents are registered; `None` when they could not be listed.
    pub agents: Option<usize>,
    /// Each job's effective training time ratio, for the jobs that marked steps.
    pub training: Vec<(String, f64)>,
}

/// The state gauges of `snapshot`.
fn state_registry(snapshot: &StateSnapshot) -> Registry {
    const JOB_STATES: [&str; 5] = ["open", "running", "failed", "finished", "cancelled"];
    const NODE_STATES: [&str; 5] = ["joining", "running", "failed", "finished", "cancelled"];
    const RANK_STATES: [&str; 6] = [
        "pending",
        "running",
        "waiting",
        "failed",
        "left",
        "cancelled",
    ];
    let gauges = |states: &[&'static str]| {
        Labeled::new("state", states.iter().copied(), Gauge::<i64>::default)
    };
    let (jobs, nodes, ranks) = (
        gauges(&JOB_STATES),
        gauges(&NODE_STATES),
        gauges(&RANK_STATES),
    );
    let agents = Gauge::<i64>::default();
    let add = |l: &Labeled<Gauge<i64>>, state: &str, n: u32| {
        if let Some(g) = l.get(state) {
            g.inc_by(i64::from(n));
        }
    };
    for s in &snapshot.jobs {
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
    }
    for r in &snapshot.ranks {
        let state = match pb::RankState::try_from(r.state) {
            Ok(pb::RankState::Pending) => "pending",
            Ok(pb::RankState::Running) => "running",
            Ok(pb::RankState::Waiting) => "waiting",
            Ok(pb::RankState::Failed) => "failed",
            Ok(pb::RankState::Left) => "left",
            Ok(pb::RankState::Cancelled) => "cancelled",
            _ => continue,
        };
        add(&ranks, state, 1);
    }
    if let Some(n) = snapshot.agents {
        agents.set(i64::try_from(n).unwrap_or(i64::MAX));
    }
    let ettr = Family::<Vec<(&'static str, String)>, Gauge<f64, AtomicU64>>::default();
    for (job, ratio) in &snapshot.training {
        ettr.get_or_create(&vec![("job", job.clone())]).set(*ratio);
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
    registry.register(
        "job_effective_training_ratio",
        "A job's effective training time ratio (ETTR): the share of the wall-clock since rank \
         0's first step marker spent in steps that moved the job forward",
        ettr,
    );
    registry
}

/// The coordinator's metrics, with the state gauges of `snapshot`, in the OpenMetrics text
/// format (served as [`muster_telemetry::metrics::CONTENT_TYPE`]).
pub fn render(snapshot: &StateSnapshot) -> String {
    let state = state_registry(snapshot);
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode_registry(&mut out, &METRICS.registry);
    let _ = prometheus_client::encoding::text::encode_registry(&mut out, &state);
    let _ = prometheus_client::encoding::text::encode_eof(&mut out);
    out
}

/// The layer that records every gRPC call's latency into `muster_rpc_duration_seconds{method}`
/// (until its response headers; for a stream, until the stream opens).
pub fn rpc_latency_layer() -> RpcLatencyLayer {
    RpcLatencyLayer::new(METRICS.rpc.clone())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn every_muster_method_is_a_label() {
        let methods = grpc_methods();
        assert!(methods.iter().any(|m| m == "/muster.v1.Rendezvous/Join"));
        assert!(methods.iter().any(|m| m == "/grpc.health.v1.Health/Check"));
    }
}
