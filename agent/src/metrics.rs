//! The agent's Prometheus metrics (`--metrics-addr` on `launch` and `serve`): its workers by
//! state, the generations it restarted after failures, its workers' failures by cause, the
//! coordinator failovers its streams went through, and the node relay's barrier latency.
//!
//! Process-wide, like the coordinator's (both use `muster_telemetry::metrics`'s atomic
//! [`DurationHistogram`], [`Labeled`] series and HTTP server): hooks are
//! one-line calls on the paths they count, and none of them takes a lock or allocates, since
//! the relay's barrier path records too. Counters and gauges are atomics, every labelled series
//! exists from the start, and each hook reaches its series directly (no label lookup). In
//! daemon mode the numbers add up over the jobs the agent runs.

use crate::worker::Exit;
use muster_telemetry::metrics::{DurationHistogram, LATENCY_BUCKETS, Labeled, serve_http};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;
use std::net::SocketAddr;
use std::sync::LazyLock;
use std::time::Duration;
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// Where a worker of a running generation stands, as `muster_agent_workers{state}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WorkerState {
    /// Its generation's ranks are assigned and it is about to be spawned.
    Starting,
    /// Spawned and not exited.
    Running,
    /// Exited with status 0.
    Exited,
    /// Ended on its own with a non-zero status or a signal.
    Failed,
    /// Ended after the agent signalled it (a failure elsewhere, a restart, a cancel, a stop).
    Stopped,
}

impl WorkerState {
    const ALL: [WorkerState; 5] = [
        WorkerState::Starting,
        WorkerState::Running,
        WorkerState::Exited,
        WorkerState::Failed,
        WorkerState::Stopped,
    ];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            WorkerState::Starting => "starting",
            WorkerState::Running => "running",
            WorkerState::Exited => "exited",
            WorkerState::Failed => "failed",
            WorkerState::Stopped => "stopped",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// Why this node's generation failed, as `muster_agent_worker_failures_total{cause}` counts it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FailureCause {
    /// A worker exited with a non-zero status.
    ExitCode,
    /// A signal the agent did not send ended a worker.
    Signal,
    /// The node lost the coordinator for its lease: every worker was stopped.
    Lost,
    /// A worker could not be started.
    Spawn,
}

impl FailureCause {
    const ALL: [FailureCause; 4] = [
        FailureCause::ExitCode,
        FailureCause::Signal,
        FailureCause::Lost,
        FailureCause::Spawn,
    ];

    /// The cause of a failed worker's exit.
    pub fn of(exit: &Exit) -> Self {
        if exit.signal().is_some() {
            FailureCause::Signal
        } else {
            FailureCause::ExitCode
        }
    }

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            FailureCause::ExitCode => "exit_code",
            FailureCause::Signal => "signal",
            FailureCause::Lost => "lost",
            FailureCause::Spawn => "spawn",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The agent's streams to the coordinator that follow the leader across a failover, as
/// `muster_agent_coordinator_failovers_total{stream}` labels them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stream {
    /// A generation's node watch (its lease; [`crate::watch`]).
    Watch,
    /// The node relay's stream ([`crate::relay`]).
    Relay,
    /// The daemon agent's registration (`Agents.Serve`, [`crate::daemon`]).
    Registration,
}

impl Stream {
    const ALL: [Stream; 3] = [Stream::Watch, Stream::Relay, Stream::Registration];

    /// The label value.
    pub fn as_str(self) -> &'static str {
        match self {
            Stream::Watch => "watch",
            Stream::Relay => "relay",
            Stream::Registration => "registration",
        }
    }

    fn index(self) -> usize {
        self as usize
    }
}

/// The relay's barrier scopes, as `muster_agent_relay_barrier_seconds{scope}` labels them.
const SCOPES: [&str; 2] = ["node", "global"];

/// The registry and, for the hooks, each series it holds (clones share their values).
struct Metrics {
    registry: Registry,
    workers: [Gauge<i64>; 5],
    restarts: Counter,
    failures: [Counter; 4],
    failovers: [Counter; 3],
    /// Node and global scope.
    barriers: [DurationHistogram; 2],
}

static METRICS: LazyLock<Metrics> = LazyLock::new(|| {
    let mut registry = Registry::with_prefix("muster_agent");
    let workers = Labeled::new(
        "state",
        WorkerState::ALL.map(WorkerState::as_str),
        Gauge::<i64>::default,
    );
    registry.register(
        "workers",
        "Workers of the generations this agent runs now, by state (starting, running, exited: status 0, failed: on their own, stopped: by the agent)",
        workers.clone(),
    );
    let restarts = Counter::default();
    registry.register(
        "restarts",
        "Generations this agent started again after a failed one, and workers it respawned in place (--recovery in-place)",
        restarts.clone(),
    );
    let failures = Labeled::new(
        "cause",
        FailureCause::ALL.map(FailureCause::as_str),
        Counter::default,
    );
    registry.register(
        "worker_failures",
        "Failures of this node's generations, by cause (exit_code: a worker exited non-zero, signal: a signal ended one, lost: the node lost the coordinator, spawn: a worker could not start)",
        failures.clone(),
    );
    let failovers = Labeled::new("stream", Stream::ALL.map(Stream::as_str), Counter::default);
    registry.register(
        "coordinator_failovers",
        "Times a stream to the coordinator re-attached to a leader after breaking (watch, relay, registration)",
        failovers.clone(),
    );
    let barriers = Labeled::new("scope", SCOPES, || DurationHistogram::new(LATENCY_BUCKETS));
    registry.register(
        "relay_barrier_seconds",
        "Barriers completed by the node relay, from the first local arrival to the release, by scope (node; global: including the coordinator's round)",
        barriers.clone(),
    );
    Metrics {
        registry,
        workers: WorkerState::ALL.map(|s| workers.get(s.as_str()).cloned().unwrap_or_default()),
        restarts,
        failures: FailureCause::ALL.map(|c| failures.get(c.as_str()).cloned().unwrap_or_default()),
        failovers: Stream::ALL.map(|s| failovers.get(s.as_str()).cloned().unwrap_or_default()),
        barriers: SCOPES.map(|s| {
            barriers
                .get(s)
                .cloned()
                .unwrap_or_else(|| DurationHistogram::new(LATENCY_BUCKETS))
        }),
    }
});

/// One generation's workers as `muster_agent_workers{state}` counts them: made with every
/// worker starting, moved as they start and end, and taken out of the gauge when dropped
/// (the generation is over here).
#[derive(Debug)]
pub struct WorkerStates {
    counts: [i64; 5],
}

impl WorkerStates {
    /// `n` workers about to start.
    pub fn starting(n: u32) -> Self {
        let mut states = Self { counts: [0; 5] };
        states.add(WorkerState::Starting, i64::from(n));
        states
    }

    /// One worker went from `from` to `to` (nothing if none is in `from`).
    pub fn moved(&mut self, from: WorkerState, to: WorkerState) {
        if self.counts[from.index()] > 0 {
            self.add(from, -1);
            self.add(to, 1);
        }
    }

    fn add(&mut self, state: WorkerState, n: i64) {
        self.counts[state.index()] += n;
        METRICS.workers[state.index()].inc_by(n);
    }
}

impl Drop for WorkerStates {
    fn drop(&mut self) {
        for state in WorkerState::ALL {
            METRICS.workers[state.index()].dec_by(self.counts[state.index()]);
        }
    }
}

/// Hook: a generation of this node failed and the job starts a new one, or (in place) a
/// worker of this node was respawned.
pub fn restarted() {
    METRICS.restarts.inc();
}

/// Hook: this node's generation failed for `cause` (once per generation: the failure the
/// agent acts on, not the workers it stops because of it).
pub fn failed(cause: FailureCause) {
    METRICS.failures[cause.index()].inc();
}

/// Hook: `stream` re-attached to the coordinator's leader after it broke.
pub fn failover(stream: Stream) {
    METRICS.failovers[stream.index()].inc();
}

/// Hook: the relay completed a barrier (`global`: a global one) `waited` after its first
/// local arrival.
pub fn relay_barrier(global: bool, waited: Duration) {
    METRICS.barriers[usize::from(global)].observe(waited);
}

/// The agent's metrics in the OpenMetrics text format.
pub fn render() -> String {
    let mut out = String::new();
    // Writing into a String cannot fail.
    let _ = prometheus_client::encoding::text::encode(&mut out, &METRICS.registry);
    out
}

/// The metrics endpoint while it runs; dropping it stops it.
#[derive(Debug)]
pub struct Endpoint {
    addr: SocketAddr,
    task: JoinHandle<()>,
}

impl Endpoint {
    /// Binds `addr` and serves `GET /metrics` there. Bound before anything else starts, so
    /// that a taken port fails the command; the error names the address.
    pub async fn start(addr: SocketAddr) -> Result<Self, String> {
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on --metrics-addr {addr}: {e}"))?;
        let addr = listener.local_addr().unwrap_or(addr);
        // Task "agent-metrics": answers scrapes; a connection's error ends only that
        // connection; aborted when the Endpoint is dropped (the command ends).
        let task = tokio::spawn(serve_http(listener, || async { render() }));
        tracing::info!(%addr, "metrics endpoint serving");
        Ok(Self { addr, task })
    }

    /// The address it listens on.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }
}

impl Drop for Endpoint {
    fn drop(&mut self) {
        self.task.abort();
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The series in `text` whose line starts with `series ` (as `name{labels}`).
    fn value(text: &str, series: &str) -> f64 {
        text.lines()
            .find_map(|l| l.strip_prefix(series)?.strip_prefix(' '))
            .unwrap_or_else(|| panic!("no {series} in\n{text}"))
            .parse()
            .unwrap()
    }

    #[test]
    fn every_series_exists_from_the_start() {
        let text = render();
        for state in WorkerState::ALL {
            value(
                &text,
                &format!("muster_agent_workers{{state=\"{}\"}}", state.as_str()),
            );
        }
        for cause in FailureCause::ALL {
            value(
                &text,
                &format!(
                    "muster_agent_worker_failures_total{{cause=\"{}\"}}",
                    cause.as_str()
                ),
            );
        }
        for stream in Stream::ALL {
            value(
                &text,
                &format!(
                    "muster_agent_coordinator_failovers_total{{stream=\"{}\"}}",
                    stream.as_str()
                ),
            );
        }
        value(&text, "muster_agent_restarts_total");
        value(
            &text,
            "muster_agent_relay_barrier_seconds_count{scope=\"node\"}",
        );
        assert!(text.ends_with("# EOF\n"), "{text}");
    }

    #[test]
    fn worker_states_move_and_leave_with_their_generation() {
        // Other tests of this process may hold workers too: compare differences.
        let running = || value(&render(), "muster_agent_workers{state=\"running\"}");
        let stopped = || value(&render(), "muster_agent_workers{state=\"stopped\"}");
        let (r0, s0) = (running(), stopped());
        let mut states = WorkerStates::starting(3);
        for _ in 0..4 {
            states.moved(WorkerState::Starting, WorkerState::Running);
        }
        assert_eq!(running() - r0, 3.0);
        states.moved(WorkerState::Running, WorkerState::Stopped);
        assert_eq!((running() - r0, stopped() - s0), (2.0, 1.0));
        drop(states);
        assert_eq!((running() - r0, stopped() - s0), (0.0, 0.0));
    }

    #[test]
    fn relay_barriers_are_timed_by_scope() {
        let count = |scope: &str| {
            value(
                &render(),
                &format!("muster_agent_relay_barrier_seconds_count{{scope=\"{scope}\"}}"),
            )
        };
        let (node, global) = (count("node"), count("global"));
        relay_barrier(false, Duration::from_micros(300));
        relay_barrier(true, Duration::from_millis(3));
        relay_barrier(true, Duration::from_millis(4));
        assert_eq!(count("node") - node, 1.0);
        assert_eq!(count("global") - global, 2.0);
    }
}
