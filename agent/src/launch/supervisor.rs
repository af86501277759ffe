//! One generation on this node: spawn its workers, watch their exits, the coordinator's word
//! and the stop requests, stop the workers as the module doc of [`super`] says, and decide
//! how the generation ended ([`End`]).

use super::{FAILURE_SETTLE, REPORT_TIMEOUT, Stops, workers};
use crate::env::{NodeAssignment, worker_env};
use crate::failover::{self, Coordinators};
use crate::metrics::{self, FailureCause, WorkerState, WorkerStates};
use crate::spec::LaunchSpec;
use crate::watch::{Watch, WatchEvent};
use crate::worker::{Exit, Worker};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use muster_proto::v1 as pb;
use muster_proto::v1::rendezvous_client::RendezvousClient;
use nix::sys::signal::Signal;
use std::pin::Pin;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// After a local failure and the workers' end, how long the agent waits for the
/// coordinator's verdict (restart or not) before deciding alone that the job failed.
const VERDICT_WAIT: Duration = Duration::from_secs(3);

/// Where stopping the workers stands.
#[derive(Debug, Clone, Copy)]
enum Stop {
    /// Not stopping.
    No,
    /// A worker failed; SIGTERM the others at this time unless they end first.
    Settling(tokio::time::Instant),
    /// SIGTERM sent; SIGKILL at this time.
    Terminating(tokio::time::Instant),
    /// SIGKILL sent.
    Killed,
}

impl Stop {
    fn deadline(self) -> Option<tokio::time::Instant> {
        match self {
            Self::Settling(t) | Self::Terminating(t) => Some(t),
            Self::No | Self::Killed => None,
        }
    }
}

type ExitFuture = Pin<Box<dyn Future<Output = Exit> + Send>>;

/// How the generation before this one ended, as this node saw it.
pub(super) struct PreviousEnd {
    /// When this node first saw it end.
    pub(super) at: Instant,
    /// Whether it failed (a restart), rather than ended for a membership change.
    pub(super) failed: bool,
    /// What ended, for the log line: "generation 1 failed (...)", "generation 1 ended: ...".
    pub(super) what: String,
}

/// How one generation ended for this node.
pub(super) enum End {
    /// Every worker exited 0.
    Succeeded { spawned: usize, watch: Watch },
    /// A stop request; the workers were stopped.
    Interrupted { sig: Signal, spawned: usize },
    /// A worker could not be started.
    SpawnFailed(String),
    /// The coordinator was not heard for the lease; the workers were stopped.
    LeaseLost(String),
    /// The coordinator no longer knows the job (it lost its state); the workers were stopped
    /// and must not run again.
    StateLost {
        /// The coordinator's address.
        coordinator: String,
        /// Its answer.
        message: String,
    },
    /// The generation ended (a failure here or elsewhere, a new round, a cancel) and the
    /// workers were stopped. `verdict` is the coordinator's last word (None if it never
    /// came), `local` this node's own failure, `at` when the end was first seen here.
    Ended {
        verdict: Option<Box<pb::GenerationEnded>>,
        local: Option<Box<pb::FailureInfo>>,
        at: Instant,
    },
}

/// Runs one generation's workers on this node and decides how it ended.
pub(super) struct Supervisor<'a> {
    spec: &'a LaunchSpec,
    node: NodeAssignment,
    coordinators: Coordinators,
    stops: &'a mut Stops,
    watch: Watch,
    workers: Vec<Worker>,
    exits: FuturesUnordered<ExitFuture>,
    stop: Stop,
    /// This node's first failure, as reported to the coordinator.
    local: Option<pb::FailureInfo>,
    /// The coordinator's word on how the generation ended.
    verdict: Option<pb::GenerationEnded>,
    /// When the end was first seen here.
    ended_at: Option<Instant>,
    spawn_error: Option<String>,
    interrupted: Option<Signal>,
    lease_lost: Option<String>,
    /// The coordinator (address, answer) that no longer knows the job.
    state_lost: Option<(String, String)>,
    report: Option<JoinHandle<()>>,
    /// How the previous generation ended here, if this one replaces it (to report how long
    /// the restart or membership change took).
    previous: Option<PreviousEnd>,
    /// This generation's workers in `muster_agent_workers{state}`.
    states: WorkerStates,
}

impl<'a> Supervisor<'a> {
    pub(super) fn new(
        spec: &'a LaunchSpec,
        coordinators: Coordinators,
        node: NodeAssignment,
        watch: Watch,
        stops: &'a mut Stops,
        previous: Option<PreviousEnd>,
    ) -> Self {
        Self {
            spec,
            node,
            coordinators,
            stops,
            watch,
            workers: Vec::with_capacity(spec.nproc_per_node as usize),
            exits: FuturesUnordered::new(),
            stop: Stop::No,
            local: None,
            verdict: None,
            ended_at: None,
            spawn_error: None,
            interrupted: None,
            lease_lost: None,
            state_lost: None,
            report: None,
            previous,
            states: WorkerStates::starting(spec.nproc_per_node),
        }
    }

    pub(super) async fn run(mut self) -> End {
        self.spawn_all();
        let spawned = self.workers.len();
        if let Some(previous) = &self.previous
            && self.spawn_error.is_none()
        {
            let generation = if previous.failed {
                format!(
                    "generation {} (restart {})",
                    self.node.generation, self.node.restart_count
                )
            } else {
                format!("generation {}", self.node.generation)
            };
            eprintln!(
                "muster-agent: job {}: {generation} running {} on node {}, {:.0} ms after {}",
                self.spec.job_id,
                workers(spawned),
                self.node.node_rank,
                previous.at.elapsed().as_secs_f64() * 1000.0,
                previous.what
            );
        }
        while !self.exits.is_empty() {
            let deadline = self.stop.deadline();
            tokio::select! {
                Some(exit) = self.exits.next() => self.on_exit(exit),
                sig = self.stops.recv() => self.on_signal(sig),
                event = self.watch.next() => self.on_watch(event),
                () = sleep_until(deadline), if deadline.is_some() => self.on_deadline(),
            }
        }
        if let Some(report) = self.report.take() {
            // The task bounds itself by the failover budget.
            let _ = report.await;
        }
        if let Some(sig) = self.interrupted {
            return End::Interrupted { sig, spawned };
        }
        if let Some((coordinator, message)) = self.state_lost.take() {
            return End::StateLost {
                coordinator,
                message,
            };
        }
        if let Some(why) = self.lease_lost.take() {
            return End::LeaseLost(why);
        }
        if let Some(why) = self.spawn_error.take() {
            return End::SpawnFailed(why);
        }
        let Some(at) = self.ended_at else {
            return End::Succeeded {
                spawned,
                watch: self.watch,
            };
        };
        // A local failure: the coordinator's verdict (restart or not) follows the report.
        let want_precise = self.local.is_some();
        let mut deadline = tokio::time::Instant::now() + VERDICT_WAIT;
        while self.verdict.is_none()
            || (want_precise
                && self.verdict.as_ref().is_some_and(|v| {
                    v.cause == pb::generation_ended::Cause::Failed as i32 && v.failure.is_none()
                }))
        {
            tokio::select! {
                event = self.watch.next() => match event {
                    WatchEvent::Ended(v) => self.verdict = Some(v),
                    WatchEvent::Lost(_) => break,
                    WatchEvent::StateLost { coordinator, message } => {
                        return End::StateLost { coordinator, message };
                    }
                },
                sig = self.stops.recv() => return End::Interrupted { sig, spawned },
                () = tokio::time::sleep_until(deadline) => {
                    if !self.watch.reattaching() {
                        break;
                    }
                    // A failover is under way: the verdict comes from the next leader, or
                    // the watch gives up (`Lost`) when its budget is spent.
                    deadline = tokio::time::Instant::now() + Duration::from_millis(100);
                }
            }
        }
        End::Ended {
            verdict: self.verdict.map(Box::new),
            local: self.local.map(Box::new),
            at,
        }
    }

    fn spawn_all(&mut self) {
        let program_env = &self.spec.program.env;
        let inherited = |name: &str| {
            std::env::var_os(name).is_some() || program_env.iter().any(|(k, _)| k == name)
        };
        let mut options = self.spec.worker_options();
        // On a machine without GPUs, Accelerate must be told to use the CPU, or each process
        // runs alone (world size 1): do what `accelerate launch --cpu` would.
        if !options.use_cpu
            && !inherited(muster_core::contract::env::ACCELERATE_USE_CPU)
            && crate::gpu::discover().is_empty()
        {
            options.use_cpu = true;
        }
        for local_rank in 0..self.spec.nproc_per_node {
            let rank = self.node.rank_offset + local_rank;
            let env = worker_env(&self.node, local_rank, &options, inherited);
            let output = self
                .spec
                .output
                .for_attempt(&self.node.job_id, self.node.restart_count);
            if local_rank == 0
                && !self.spec.quiet
                && let Some(dir) = self
                    .spec
                    .output
                    .attempt_dir(&self.node.job_id, self.node.restart_count)
            {
                eprintln!(
                    "muster-agent: job {}: worker logs in {}",
                    self.spec.job_id,
                    dir.display()
                );
            }
            match Worker::spawn(&self.spec.program, &env, rank, local_rank, &output) {
                Ok((worker, exit)) => {
                    self.states
                        .moved(WorkerState::Starting, WorkerState::Running);
                    self.workers.push(worker);
                    self.exits.push(Box::pin(exit));
                }
                Err(e) => {
                    metrics::failed(FailureCause::Spawn);
                    self.spawn_error = Some(format!(
                        "cannot start rank {rank} (local rank {local_rank}), {}: {e}",
                        self.spec.program.path.display()
                    ));
                    self.stop_all();
                    return;
                }
            }
        }
    }

    fn on_exit(&mut self, exit: Exit) {
        let signalled = matches!(self.stop, Stop::Terminating(_) | Stop::Killed);
        let state = if exit.success() {
            WorkerState::Exited
        } else if signalled || self.interrupted.is_some() {
            WorkerState::Stopped
        } else {
            WorkerState::Failed
        };
        self.states.moved(WorkerState::Running, state);
        if exit.success() {
            return;
        }
        let stopping = !matches!(self.stop, Stop::No);
        if stopping || self.interrupted.is_some() || self.local.is_some() {
            // A consequence of the first failure or of our own signals.
            tracing::debug!(rank = exit.rank, reason = %exit.reason(), "worker ended while stopping");
            return;
        }
        let running = self.workers.iter().filter(|w| !w.exited()).count();
        let info = self.failure_info(&exit);
        if running > 0 {
            eprintln!(
                "muster-agent: rank {} (local rank {}) {}; stopping the other {}",
                exit.rank,
                exit.local_rank,
                exit.reason(),
                workers(running)
            );
        }
        metrics::failed(FailureCause::of(&exit));
        self.report = Some(self.report_failure(&exit, &info));
        self.local = Some(info);
        self.ended_at.get_or_insert_with(Instant::now);
        self.settle();
    }

    /// This node's view of a worker's failure, with its error file when it left one.
    fn failure_info(&self, exit: &Exit) -> pb::FailureInfo {
        let error = self.node.error_dir.as_deref().and_then(|dir| {
            crate::error_file::read(&crate::error_file::error_path(dir, exit.rank))
        });
        let (error_message, error_traceback) = match error {
            Some(e) => (e.message, e.traceback.unwrap_or_default()),
            None => (String::new(), String::new()),
        };
        pb::FailureInfo {
            rank: Some(exit.rank),
            node_rank: Some(self.node.node_rank),
            host: self.node.host.clone(),
            reason: exit.reason(),
            generation: self.node.generation,
            exit_code: exit.code(),
            signal: exit.signal(),
            error_message,
            error_traceback,
            stderr_tail: exit.stderr_tail.join("\n"),
            node_id: String::new(),
        }
    }

    fn on_watch(&mut self, event: WatchEvent) {
        match event {
            WatchEvent::Ended(v) => {
                let first = self.verdict.is_none();
                let cause = pb::generation_ended::Cause::try_from(v.cause)
                    .unwrap_or(pb::generation_ended::Cause::Unspecified);
                if first && self.local.is_none() {
                    let running = self.workers.iter().filter(|w| !w.exited()).count();
                    eprintln!(
                        "muster-agent: job {}: {}; stopping {} on this node",
                        self.spec.job_id,
                        v.message,
                        workers(running)
                    );
                }
                let rejoin = v.rejoin;
                self.verdict = Some(v);
                self.ended_at.get_or_insert_with(Instant::now);
                match (cause, rejoin, self.stop) {
                    // A final failure: the workers hear of it from the coordinator and may end
                    // on their own, saying why, before they are signalled.
                    (pb::generation_ended::Cause::Failed, false, Stop::No) => self.settle(),
                    (pb::generation_ended::Cause::Failed, false, _) => {}
                    // A restart (or a new round, or a cancel): every millisecond until the
                    // new generation runs counts, so stop at once.
                    (_, _, Stop::No | Stop::Settling(_)) => self.stop_all(),
                    (_, _, Stop::Terminating(_) | Stop::Killed) => {}
                }
            }
            WatchEvent::StateLost {
                coordinator,
                message,
            } => {
                // Said once, by `run_at`, when the workers are gone.
                if self.state_lost.is_none() && self.interrupted.is_none() {
                    metrics::failed(FailureCause::Lost);
                    self.state_lost = Some((coordinator, message));
                    self.ended_at.get_or_insert_with(Instant::now);
                    if matches!(self.stop, Stop::No | Stop::Settling(_)) {
                        self.stop_all();
                    }
                }
            }
            WatchEvent::Lost(why) => {
                if self.lease_lost.is_none() && self.interrupted.is_none() {
                    eprintln!(
                        "muster-agent: job {}: {why}; stopping the workers",
                        self.spec.job_id
                    );
                    metrics::failed(FailureCause::Lost);
                    self.lease_lost = Some(why);
                    if matches!(self.stop, Stop::No | Stop::Settling(_)) {
                        self.stop_all();
                    }
                }
            }
        }
    }

    /// Gives the workers [`FAILURE_SETTLE`] (capped by the grace period) to end on their own.
    fn settle(&mut self) {
        let settle = FAILURE_SETTLE.min(self.spec.grace_period);
        self.stop = Stop::Settling(tokio::time::Instant::now() + settle);
    }

    fn on_signal(&mut self, sig: Signal) {
        if self.interrupted.is_none() && !matches!(self.stop, Stop::Killed) {
            eprintln!(
                "muster-agent: job {}: got {}; stopping the workers (SIGKILL after {} ms; signal again to kill now)",
                self.spec.job_id,
                sig.as_str(),
                self.spec.grace_period.as_millis()
            );
            self.interrupted = Some(sig);
            self.stop_all();
        } else {
            self.interrupted.get_or_insert(sig);
            self.kill_all();
        }
    }

    fn on_deadline(&mut self) {
        match self.stop {
            Stop::Settling(_) => self.stop_all(),
            Stop::Terminating(_) => {
                let ranks: Vec<String> = self
                    .workers
                    .iter()
                    .filter(|w| !w.exited())
                    .map(|w| w.rank.to_string())
                    .collect();
                if !ranks.is_empty() {
                    eprintln!(
                        "muster-agent: rank(s) {} still running {} ms after SIGTERM; sending SIGKILL",
                        ranks.join(", "),
                        self.spec.grace_period.as_millis()
                    );
                }
                self.kill_all();
            }
            Stop::No | Stop::Killed => {}
        }
    }

    /// SIGTERM to every live worker group; SIGKILL after the grace period.
    fn stop_all(&mut self) {
        for w in &self.workers {
            w.signal(Signal::SIGTERM);
        }
        self.stop = Stop::Terminating(tokio::time::Instant::now() + self.spec.grace_period);
    }

    fn kill_all(&mut self) {
        for w in &self.workers {
            w.signal(Signal::SIGKILL);
        }
        self.stop = Stop::Killed;
    }

    /// Tells the coordinator (best effort: each attempt bounded by [`REPORT_TIMEOUT`], and
    /// retried across a failover within the budget; a report is idempotent).
    fn report_failure(&self, exit: &Exit, info: &pb::FailureInfo) -> JoinHandle<()> {
        let coordinators = self.coordinators.clone();
        let request = pb::ReportFailureRequest {
            job_id: self.node.job_id.clone(),
            generation: self.node.generation,
            rank: exit.rank,
            reason: info.reason.clone(),
            exit_code: info.exit_code,
            signal: info.signal,
            stderr_tail: info.stderr_tail.clone(),
            error_message: info.error_message.clone(),
            error_traceback: info.error_traceback.clone(),
        };
        // Task "report-failure": on error, log and continue (the coordinator also learns of
        // the failure from the worker's session); awaited, bounded, before the agent exits.
        // After a failover the report is how the new leader learns of the exit (a dead worker
        // never re-attaches), so it is retried; an attempt that takes REPORT_TIMEOUT counts as
        // a coordinator that does not answer.
        tokio::spawn(async move {
            let sent = failover::call(&coordinators, "Rendezvous.ReportFailure", |channel| {
                let request = request.clone();
                async move {
                    let mut client = RendezvousClient::new(channel);
                    match tokio::time::timeout(REPORT_TIMEOUT, client.report_failure(request)).await
                    {
                        Ok(answer) => answer,
                        Err(_) => Err(tonic::Status::unavailable(format!(
                            "no answer within {} ms",
                            REPORT_TIMEOUT.as_millis()
                        ))),
                    }
                }
            })
            .await;
            if let Err(status) = sent {
                tracing::debug!(%status, "failure report not taken");
            }
        })
    }
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}
