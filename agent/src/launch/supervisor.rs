//! One generation on this node: spawn its workers, watch their exits, the coordinator's word
//! and the stop requests, stop the workers as the module doc of [`super`] says, and decide
//! how the generation ended ([`End`]).
//!
//! In-place recovery ([`Recovery::InPlace`]): a worker's failure is reported as always, but
//! the other workers are not stopped and the generation does not end here. The coordinator
//! answers on the watch: `replace` ([`WatchEvent::Replace`]) when it has restarts left (the
//! rank is killed if it is still there, a rank that stopped answering, then respawned alone
//! with `MUSTER_EPOCH`, counted as a restart), or `ended` when it has none (everything goes
//! as in restart mode). A repeat of a `replace` (a failover re-sends it) is ignored.

use super::{FAILURE_SETTLE, REPORT_TIMEOUT, Stops, workers};
use crate::env::{NodeAssignment, Recovery, worker_env};
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
use std::collections::HashMap;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;

/// After a local failure and the workers' end, how long the agent waits for the
/// coordinator's verdict (restart or not) before deciding alone that the job failed.
const VERDICT_WAIT: Duration = Duration::from_secs(3);
/// In place: how long a dead worker waits for the coordinator's `replace` (or the
/// generation's end) before the agent decides alone that the job failed (extended while the
/// watch is re-attaching across a failover).
const REPLACE_WAIT: Duration = Duration::from_secs(30);

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
    /// The failure reports in flight (in place, one per failure).
    reports: Vec<JoinHandle<()>>,
    /// In place: this node's failed ranks awaiting the coordinator's `replace`, with when
    /// their death was seen and the gauge state their exit left them in.
    dead: HashMap<u32, Death>,
    /// In place: ranks told to be replaced while their process was still there (or its exit
    /// not yet seen): killed, and respawned once their exit comes.
    killing: HashMap<u32, (pb::RankReplace, Instant)>,
    /// In place: the last epoch each rank was respawned for (a repeated `replace` is a no-op).
    respawned: HashMap<u32, u64>,
    /// Each local rank's error file folder (a respawn's is its restart's attempt folder).
    error_dirs: Vec<Option<PathBuf>>,
    /// How the previous generation ended here, if this one replaces it (to report how long
    /// the restart or membership change took).
    previous: Option<PreviousEnd>,
    /// This generation's workers in `muster_agent_workers{state}`.
    states: WorkerStates,
    /// The running workers' pids, for the stack sampler.
    registry: crate::stacks::Workers,
}

/// In place: a failed worker awaiting its replacement.
#[derive(Debug, Clone, Copy)]
struct Death {
    at: Instant,
    /// `muster_agent_workers{state}` as its exit left it (failed, or stopped if killed).
    state: WorkerState,
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
        let error_dirs = vec![node.error_dir.clone(); spec.nproc_per_node as usize];
        // A spare's workers are replacements already: an order for this epoch repeats.
        let respawned = (0..node.local_world_size)
            .filter(|_| node.epoch > 0)
            .map(|l| (node.rank_offset + l, node.epoch))
            .collect();
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
            reports: Vec::new(),
            dead: HashMap::new(),
            killing: HashMap::new(),
            respawned,
            error_dirs,
            previous,
            states: WorkerStates::starting(spec.nproc_per_node),
            registry: crate::stacks::Workers::default(),
        }
    }

    /// Keeps `registry` up to date with the running workers' pids (the stack sampler's list).
    pub(super) fn with_registry(mut self, registry: crate::stacks::Workers) -> Self {
        self.registry = registry;
        self
    }

    fn registered(&self, worker: &Worker) {
        self.registry.started(
            worker.rank,
            crate::stacks::WorkerRef {
                local_rank: worker.local_rank,
                pid: worker.pid.as_raw().cast_unsigned(),
            },
        );
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
        while !self.exits.is_empty() || self.awaiting_replacement() {
            let deadline = self.stop.deadline();
            let replace_by = self.replace_deadline();
            tokio::select! {
                Some(exit) = self.exits.next() => self.on_exit(exit),
                sig = self.stops.recv() => self.on_signal(sig),
                event = self.watch.next() => self.on_watch(event),
                () = sleep_until(deadline), if deadline.is_some() => self.on_deadline(),
                () = sleep_until(replace_by), if replace_by.is_some() => self.on_replace_timeout(),
            }
        }
        for report in self.reports.drain(..) {
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
                    // The generation is over here: too late to replace anything.
                    WatchEvent::Replace(_) => {}
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

    /// Whether the agent's environment or the program's own sets `name` (the "unless already
    /// set" variables of [`worker_env`]).
    fn inherited(&self, name: &str) -> bool {
        std::env::var_os(name).is_some() || self.spec.program.env.iter().any(|(k, _)| k == name)
    }

    /// What every worker's environment gets from the launch.
    fn options(&self) -> crate::env::WorkerOptions<'a> {
        let mut options = self.spec.worker_options();
        // On a machine without GPUs, Accelerate must be told to use the CPU, or each process
        // runs alone (world size 1): do what `accelerate launch --cpu` would.
        if !options.use_cpu
            && !self.inherited(muster_core::contract::env::ACCELERATE_USE_CPU)
            && crate::gpu::discover().is_empty()
        {
            options.use_cpu = true;
        }
        options
    }

    fn spawn_all(&mut self) {
        let options = self.options();
        for local_rank in 0..self.spec.nproc_per_node {
            let rank = self.node.rank_offset + local_rank;
            let env = worker_env(&self.node, local_rank, &options, |n| self.inherited(n));
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
                    self.registered(&worker);
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
        if let Some(w) = self.workers.get(exit.local_rank as usize) {
            self.registry
                .ended(exit.rank, w.pid.as_raw().cast_unsigned());
        }
        if let Some((replace, at)) = self.killing.remove(&exit.rank) {
            // A rank the coordinator replaces, killed here (or whose exit was still on its
            // way): its replacement starts now, unless the generation ended meanwhile.
            let state = if exit.success() {
                WorkerState::Exited
            } else {
                WorkerState::Stopped
            };
            self.states.moved(WorkerState::Running, state);
            if !exit.success() && exit.signal() != Some(Signal::SIGKILL as i32) {
                // It ended on its own before the kill: the coordinator gets the precise reason.
                let info = self.failure_info(&exit);
                self.reports.push(self.report_failure(&exit, &info));
            }
            let at = self.dead.remove(&exit.rank).map_or(at, |d| d.at);
            if matches!(self.stop, Stop::No)
                && self.interrupted.is_none()
                && self.ended_at.is_none()
            {
                self.respawn(&replace, at, state);
            }
            return;
        }
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
        let in_place = self.in_place() && self.verdict.is_none() && self.ended_at.is_none();
        if stopping || self.interrupted.is_some() || (self.local.is_some() && !in_place) {
            // A consequence of the first failure or of our own signals.
            tracing::debug!(rank = exit.rank, reason = %exit.reason(), "worker ended while stopping");
            return;
        }
        let running = self.workers.iter().filter(|w| !w.exited()).count();
        let info = self.failure_info(&exit);
        if in_place {
            // Reported, and nothing else: the coordinator replaces the rank (`replace`) or
            // ends the generation (`ended`, no restarts left).
            eprintln!(
                "muster-agent: job {}: rank {} (local rank {}) {}; in-place recovery: {} of this node still running",
                self.spec.job_id,
                exit.rank,
                exit.local_rank,
                exit.reason(),
                workers(running)
            );
            metrics::failed(FailureCause::of(&exit));
            self.reports.push(self.report_failure(&exit, &info));
            self.local = Some(info);
            self.dead.insert(
                exit.rank,
                Death {
                    at: Instant::now(),
                    state,
                },
            );
            return;
        }
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
        self.reports.push(self.report_failure(&exit, &info));
        self.local = Some(info);
        self.ended_at.get_or_insert_with(Instant::now);
        self.settle();
    }

    /// Whether this generation recovers in place (the coordinator's answer to the join).
    fn in_place(&self) -> bool {
        self.node.recovery == Recovery::InPlace
    }

    /// In place: a worker failed and the coordinator's word on it (`replace` or `ended`) has
    /// not come; the generation goes on here even if no other worker runs.
    fn awaiting_replacement(&self) -> bool {
        !self.dead.is_empty()
            && matches!(self.stop, Stop::No)
            && self.ended_at.is_none()
            && self.interrupted.is_none()
            && self.lease_lost.is_none()
            && self.state_lost.is_none()
            && self.spawn_error.is_none()
    }

    /// When to stop waiting for the coordinator's word on the oldest death.
    fn replace_deadline(&self) -> Option<tokio::time::Instant> {
        if !self.awaiting_replacement() {
            return None;
        }
        let oldest = self.dead.values().map(|d| d.at).min()?;
        Some(tokio::time::Instant::from_std(oldest + REPLACE_WAIT))
    }

    /// No word from the coordinator for [`REPLACE_WAIT`] after a death: unless a failover is
    /// under way (the next leader re-sends its word), the job is taken as failed here.
    fn on_replace_timeout(&mut self) {
        if self.watch.reattaching() {
            for death in self.dead.values_mut() {
                death.at = Instant::now();
            }
            return;
        }
        let ranks: Vec<String> = self.dead.keys().map(u32::to_string).collect();
        eprintln!(
            "muster-agent: job {}: no replacement for rank(s) {} from the coordinator within {} s; stopping the workers",
            self.spec.job_id,
            ranks.join(", "),
            REPLACE_WAIT.as_secs()
        );
        self.ended_at.get_or_insert_with(Instant::now);
        self.stop_all();
    }

    /// In place: the coordinator replaces `replace.rank`. A rank that is not this node's, of
    /// another generation, already respawned for this epoch (a repeat after a failover) or
    /// being killed for it is ignored; a rank whose process is still there is killed first
    /// (it stopped answering) and respawned when its exit comes ([`Self::on_exit`]).
    fn on_replace(&mut self, replace: pb::RankReplace) {
        let Some(rank) = replace.rank else {
            tracing::warn!(?replace, "a replace without a rank; ignored");
            return;
        };
        let local = rank
            .checked_sub(self.node.rank_offset)
            .filter(|l| *l < self.node.local_world_size);
        let stopping = !matches!(self.stop, Stop::No) || self.interrupted.is_some();
        let Some(local) = local.filter(|_| {
            self.in_place()
                && replace.generation == self.node.generation
                && !stopping
                && self.ended_at.is_none()
        }) else {
            tracing::debug!(?replace, "a replace this node does not act on; ignored");
            return;
        };
        if self
            .respawned
            .get(&rank)
            .is_some_and(|e| *e >= replace.epoch)
            || self.killing.contains_key(&rank)
        {
            tracing::debug!(rank, epoch = replace.epoch, "a repeated replace; ignored");
            return;
        }
        let Some(worker) = self.workers.get(local as usize) else {
            return;
        };
        if !replace.message.is_empty() {
            eprintln!(
                "muster-agent: job {}: {}",
                self.spec.job_id, replace.message
            );
        }
        match self.dead.get(&rank).copied() {
            Some(death) => {
                self.dead.remove(&rank);
                self.respawn(&replace, death.at, death.state);
            }
            None => {
                // Still there (or its exit is on its way): SIGKILL its group; its exit
                // brings the respawn.
                worker.signal(Signal::SIGKILL);
                self.killing.insert(rank, (replace, Instant::now()));
            }
        }
    }

    /// Starts the replacement of `replace.rank` (whose worker ended in gauge state `was`,
    /// having died at `died`): the same environment plus its epoch and restart count, its
    /// output where that restart's goes. A failure to start it fails the node as a spawn
    /// failure does.
    fn respawn(&mut self, replace: &pb::RankReplace, died: Instant, was: WorkerState) {
        let rank = replace.rank.unwrap_or_default();
        let local_rank = rank - self.node.rank_offset;
        let error_dir = attempt_dir(self.node.error_dir.as_deref(), replace.restart_count);
        let node = NodeAssignment {
            restart_count: replace.restart_count,
            epoch: replace.epoch,
            error_dir: error_dir.clone(),
            ..self.node.clone()
        };
        let options = self.options();
        let env = worker_env(&node, local_rank, &options, |n| self.inherited(n));
        let output = self
            .spec
            .output
            .for_attempt(&self.node.job_id, replace.restart_count);
        self.states.moved(was, WorkerState::Starting);
        match Worker::spawn(&self.spec.program, &env, rank, local_rank, &output) {
            Ok((worker, exit)) => {
                self.states
                    .moved(WorkerState::Starting, WorkerState::Running);
                let pid = worker.pid;
                self.registered(&worker);
                self.workers[local_rank as usize] = worker;
                self.error_dirs[local_rank as usize] = error_dir;
                self.exits.push(Box::pin(exit));
                self.respawned.insert(rank, replace.epoch);
                metrics::restarted();
                eprintln!(
                    "muster-agent: job {}: rank {rank} respawned in place (pid {pid}, epoch {}) {:.0} ms after its death",
                    self.spec.job_id,
                    replace.epoch,
                    died.elapsed().as_secs_f64() * 1000.0
                );
            }
            Err(e) => {
                self.states
                    .moved(WorkerState::Starting, WorkerState::Failed);
                metrics::failed(FailureCause::Spawn);
                self.spawn_error = Some(format!(
                    "cannot respawn rank {rank} (local rank {local_rank}) in place, {}: {e}",
                    self.spec.program.path.display()
                ));
                self.ended_at.get_or_insert_with(Instant::now);
                self.stop_all();
            }
        }
    }

    /// This node's view of a worker's failure, with its error file when it left one.
    fn failure_info(&self, exit: &Exit) -> pb::FailureInfo {
        let dir = self
            .error_dirs
            .get(exit.local_rank as usize)
            .cloned()
            .flatten();
        let error = dir.as_deref().and_then(|dir| {
            crate::error_file::read(&crate::error_file::error_path(dir, exit.rank))
        });
        let (error_message, error_traceback) = match error {
            Some(e) => (e.message, e.traceback.unwrap_or_default()),
            None => (String::new(), String::new()),
        };
        pb::FailureInfo {
            hang: false,
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
            WatchEvent::Replace(replace) => self.on_replace(replace),
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
            node_id: self.node.node_id.clone(),
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

/// The error file folder of restart `restart_count` beside `first` (the generation's,
/// `<scratch>/attempt_<n>`), created; `None` without a folder or if it cannot be made.
fn attempt_dir(first: Option<&std::path::Path>, restart_count: u32) -> Option<PathBuf> {
    let dir = first?.parent()?.join(format!("attempt_{restart_count}"));
    std::fs::create_dir_all(&dir).ok().map(|()| dir)
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use crate::cli::{Parsed, parse_in};
    use tokio::sync::mpsc::UnboundedSender;

    /// Each worker appends `rank pid epoch restart_count torchelastic_restart_count recovery`
    /// to `$OUT` and exits 0; rank 0 first waits (up to 10 s) for a line of rank 1's replacement,
    /// so that it outlives the replacement. Rank 1's first worker runs `first` instead.
    fn script(first: &str) -> String {
        format!(
            r#"if [ "$MUSTER_RANK" = 1 ] && [ -z "$MUSTER_EPOCH" ]; then {first}; fi
echo "$MUSTER_RANK $$ ${{MUSTER_EPOCH:-0}} $MUSTER_RESTART_COUNT $TORCHELASTIC_RESTART_COUNT $MUSTER_RECOVERY" >> "$OUT"
if [ "$MUSTER_RANK" = 0 ]; then
  i=0
  while ! grep -q '^1 [0-9]* [1-9]' "$OUT" && [ $i -lt 200 ]; do sleep 0.05; i=$((i+1)); done
fi
exit 0"#
        )
    }

    fn spec(script: &str) -> LaunchSpec {
        let argv = [
            "muster-agent",
            "launch",
            "--recovery=in-place",
            "--max-restarts=3",
            "--nproc-per-node=2",
            "--coordinator=127.0.0.1:1",
            "--failover-timeout-ms=100",
            "--grace-period-ms=500",
            "-q",
            "--",
            "sh",
            "-c",
            script,
        ];
        match parse_in(argv, &crate::cli::tests::machine(None)).unwrap().0 {
            Parsed::Launch(spec) => spec,
            other => panic!("not a launch: {other:?}"),
        }
    }

    fn node(dir: &std::path::Path) -> NodeAssignment {
        NodeAssignment {
            coordinator: "127.0.0.1:1".into(),
            failover_timeout: Duration::from_millis(100),
            job_id: "inplace".into(),
            node_id: String::new(),
            generation: 1,
            node_rank: 0,
            num_nodes: 1,
            rank_offset: 0,
            local_world_size: 2,
            world_size: 2,
            restart_count: 0,
            max_restarts: 3,
            recovery: Recovery::InPlace,
            epoch: 0,
            host: "127.0.0.1".into(),
            master_addr: "127.0.0.1".into(),
            master_port: 1,
            agent_socket: None,
            error_dir: Some(dir.join("attempt_0")),
            flight_dir: None,
        }
    }

    fn replace(epoch: u64) -> WatchEvent {
        WatchEvent::Replace(pb::RankReplace {
            generation: 1,
            rank: Some(1),
            epoch,
            restart_count: 1,
            max_restarts: 3,
            message: "rank 1 (node 0, host 127.0.0.1) failed; replacing it in place".into(),
        })
    }

    /// Runs a generation of `script(first)` with `OUT` in a fresh folder, `events` sent on
    /// its watch (each after its delay), and returns how it ended and the lines written.
    async fn run(
        name: &str,
        first: &str,
        events: Vec<(Duration, WatchEvent)>,
    ) -> (End, Vec<String>) {
        let dir =
            std::env::temp_dir().join(format!("muster-supervisor-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("attempt_0")).unwrap();
        let out = dir.join("out");
        let mut spec = spec(&script(first));
        spec.program
            .env
            .push(("OUT".into(), out.to_string_lossy().into_owned()));
        let coordinators = failover::from_list("127.0.0.1:1", Duration::from_millis(100));
        let (watch, tx) = Watch::scripted();
        let mut stops = Stops::token(tokio_util::sync::CancellationToken::new());
        let send = async move |tx: UnboundedSender<WatchEvent>| {
            for (after, event) in events {
                tokio::time::sleep(after).await;
                tx.send(event).unwrap();
            }
            // Keep the watch open until the generation ends.
            std::future::pending::<()>().await;
        };
        let supervisor = Supervisor::new(&spec, coordinators, node(&dir), watch, &mut stops, None);
        let end = tokio::select! {
            end = supervisor.run() => end,
            () = send(tx) => unreachable!(),
        };
        let lines = std::fs::read_to_string(&out)
            .unwrap_or_default()
            .lines()
            .map(str::to_owned)
            .collect();
        let _ = std::fs::remove_dir_all(&dir);
        (end, lines)
    }

    /// The lines of `rank`, without the pid (the second word).
    fn of(lines: &[String], rank: &str) -> Vec<String> {
        lines
            .iter()
            .filter(|l| l.split(' ').next() == Some(rank))
            .map(|l| {
                let mut w: Vec<&str> = l.split(' ').collect();
                w.remove(1);
                w.join(" ")
            })
            .collect()
    }

    /// Rank 1 exits 3; the coordinator's `replace` (sent twice, as after a failover) respawns
    /// it once with its epoch and restart count, rank 0 is never stopped, and the generation
    /// ends well.
    #[tokio::test]
    async fn a_dead_rank_is_respawned_in_place_once() {
        let restarts = || {
            crate::metrics::render()
                .lines()
                .find_map(|l| {
                    l.strip_prefix("muster_agent_restarts_total ")?
                        .parse::<u64>()
                        .ok()
                })
                .unwrap()
        };
        let before = restarts();
        let (end, lines) = run(
            "dead",
            "exit 3",
            vec![
                (Duration::from_millis(400), replace(1)),
                (Duration::from_millis(10), replace(1)),
            ],
        )
        .await;
        assert!(
            matches!(end, End::Succeeded { spawned: 2, .. }),
            "{lines:?}"
        );
        assert_eq!(of(&lines, "0"), ["0 0 0 0 in-place"], "{lines:?}");
        assert_eq!(of(&lines, "1"), ["1 1 1 1 in-place"], "{lines:?}");
        // Other tests of this process may count restarts too.
        assert!(restarts() > before, "a respawn counts as a restart");
    }

    /// A rank that hangs (the coordinator failed it by heartbeat) is killed, then respawned.
    #[tokio::test]
    async fn a_hung_rank_is_killed_and_respawned() {
        let (end, lines) = run(
            "hung",
            "sleep 30",
            vec![(Duration::from_millis(200), replace(2))],
        )
        .await;
        assert!(matches!(end, End::Succeeded { .. }), "{lines:?}");
        assert_eq!(of(&lines, "0"), ["0 0 0 0 in-place"], "{lines:?}");
        assert_eq!(of(&lines, "1"), ["1 2 1 1 in-place"], "{lines:?}");
    }

    /// No restarts left: the coordinator ends the generation instead, and the node stops
    /// its workers as in restart mode.
    #[tokio::test]
    async fn without_a_replacement_the_generation_ends_as_today() {
        let ended = WatchEvent::Ended(pb::GenerationEnded {
            generation: 1,
            cause: pb::generation_ended::Cause::Failed as i32,
            rejoin: false,
            message: "rank 1 failed; no restarts left".into(),
            failure: Some(pb::FailureInfo {
                rank: Some(1),
                reason: "exited with status 3".into(),
                ..Default::default()
            }),
            ..Default::default()
        });
        let (end, lines) = run("ended", "exit 3", vec![(Duration::from_millis(400), ended)]).await;
        let End::Ended { verdict, local, .. } = end else {
            panic!("not ended: {lines:?}")
        };
        assert_eq!(
            verdict.map(|v| v.message),
            Some("rank 1 failed; no restarts left".into())
        );
        assert_eq!(local.map(|l| l.rank), Some(Some(1)));
        assert!(of(&lines, "1").is_empty(), "{lines:?}");
    }
}
