//! `muster-agent launch`: find or start the coordinator, join the job's rendezvous, spawn the
//! node's workers with the contract's environment, and supervise them, one generation after
//! another, until they all exit 0, the job fails with no restarts left, or the agent is told
//! to stop.
//!
//! One generation goes: join (the coordinator answers with this node's ranks), start the node
//! relay and the node's watch stream ([`crate::watch`], its lease), spawn the workers, and
//! supervise them. It ends when every worker exited 0 (the node tells the coordinator and the
//! agent exits 0), when a local worker fails (reported to the coordinator with its exit status,
//! stderr tail and error file), when the coordinator says the generation ended (a failure
//! elsewhere, a new round, a cancel), when the lease is lost, or on a signal. The coordinator
//! decides whether the job restarts (it counts restarts per job); on a restart every node joins
//! again and gets new ranks, a new generation and so a new NCCL unique id.
//!
//! Stopping workers always goes the same way: SIGTERM to each worker's process group, the
//! grace period, then SIGKILL to the groups still alive. After a failure, the others first get
//! [`FAILURE_SETTLE`] to end on their own: they learn of the failure from the coordinator and
//! can say why they stop before the agent signals them.
//!
//! With `--recovery in-place` (as the coordinator's join answer confirms), a worker's failure
//! does not end the generation here: the coordinator has the node respawn that worker alone
//! (`launch/supervisor.rs`), or ends the generation as above when no restart is left.

use crate::env::NodeAssignment;
use crate::failover::{self, Coordinators};
use crate::metrics;
use crate::relay::Relay;
use crate::spec::LaunchSpec;
use crate::store::{AgentStore, Kv};
use crate::watch::Watch;
use muster_proto::security::Credentials;
use muster_proto::v1 as pb;
use muster_proto::v1::ops_client::OpsClient;
use nix::sys::signal::Signal;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::{Duration, Instant};
use tokio::signal::unix::{SignalKind, signal};
use tokio_util::sync::CancellationToken;

mod join;
mod messages;
mod place;
mod supervisor;

use join::join;
use messages::{previous_end, rejoin_message, report_root_cause, state_lost_line};
use place::place_coordinator;
use supervisor::{End, PreviousEnd, Supervisor};

/// How long the agent keeps trying to reach a coordinator that is not up yet.
pub const CONNECT_WINDOW: Duration = Duration::from_secs(10);
/// After this long in the rendezvous the agent says what it is waiting for.
pub const WAITING_NOTICE: Duration = Duration::from_secs(1);
/// The most time one attempt of a failure report may take (it is retried across a failover).
pub const REPORT_TIMEOUT: Duration = Duration::from_secs(1);
/// After a failure, how long the workers get to end on their own before SIGTERM (capped by
/// the grace period).
pub const FAILURE_SETTLE: Duration = Duration::from_millis(500);

/// The exit status of an agent (and of `muster-agent submit --wait`) whose job an operator
/// cancelled: not 0 (the job did not finish), not 1 (nothing failed), so that a script or a
/// scheduler can tell a cancel from a failure. 2 is taken by usage errors.
pub const CANCELLED_EXIT: u8 = 3;

/// The exit status of an agent whose job hung and was ended by `--on-hang fail` (or
/// `restart` without restarts left): a scheduler can tell a hang from a crash.
pub const HUNG_EXIT: u8 = 4;

/// How a launch ended; [`Outcome::exit_code`] is the agent's exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every worker exited 0.
    Succeeded,
    /// A worker (or node) failed and no restart was left; the others were stopped.
    Failed,
    /// An operator cancelled the job.
    Cancelled,
    /// The job hung (no progress for its hang timeout) and `--on-hang` ended it.
    Hung,
    /// An operator drained this node (`Ops.DrainNode`): its workers were stopped and the job
    /// goes on without it. Exits 0: nothing failed here.
    Drained,
    /// The agent got this signal and stopped the workers.
    Interrupted(Signal),
}

impl Outcome {
    /// 0, 1, [`CANCELLED_EXIT`] (3), [`HUNG_EXIT`] (4), or 128 + the signal number (130 for SIGINT, 143 for
    /// SIGTERM).
    pub fn exit_code(self) -> u8 {
        match self {
            Self::Succeeded | Self::Drained => 0,
            Self::Failed => 1,
            Self::Cancelled => CANCELLED_EXIT,
            Self::Hung => HUNG_EXIT,
            Self::Interrupted(sig) => u8::try_from(128 + sig as i32).unwrap_or(1),
        }
    }
}

/// Why a launch could not get its workers going.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// Binding the embedded coordinator's listener failed.
    #[error("cannot start the embedded coordinator: {0}")]
    Embedded(#[source] std::io::Error),
    /// No coordinator (of the list) could be reached within [`CONNECT_WINDOW`], or an
    /// address is not usable as an endpoint.
    #[error(transparent)]
    Connect(#[from] failover::ConnectError),
    /// The coordinator refused or failed the rendezvous.
    #[error("rendezvous of job '{job}' failed: {}", crate::security::explain(.status))]
    Join {
        /// The job id.
        job: String,
        /// The coordinator's answer.
        status: tonic::Status,
    },
    /// The MASTER_PORT could not be found or shared.
    #[error("cannot settle MASTER_PORT for job '{job}': {why}")]
    MasterPort {
        /// The job id.
        job: String,
        /// Why.
        why: String,
    },
    /// The agent store could not start (`--no-agent-store` runs without it).
    #[error("job '{job}': cannot start the agent store for the workers: {why}")]
    AgentStore {
        /// The job id.
        job: String,
        /// Why.
        why: String,
    },
    /// The metrics endpoint (`--metrics-addr`) could not listen.
    #[error("{0}")]
    Metrics(String),
    /// Installing the SIGINT/SIGTERM handlers failed.
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
}

/// What stops a launch from outside: the process's signals (the command line), a
/// cancellation token (daemon mode), or both.
pub struct Stops {
    signals: Option<Signals>,
    cancel: Option<CancellationToken>,
}

impl Stops {
    /// SIGINT, SIGTERM, SIGHUP and SIGQUIT stop the launch.
    pub fn signals() -> std::io::Result<Self> {
        Ok(Self {
            signals: Some(Signals::new()?),
            cancel: None,
        })
    }

    /// Cancelling `token` stops the launch as SIGTERM would.
    pub fn token(token: CancellationToken) -> Self {
        Self {
            signals: None,
            cancel: Some(token),
        }
    }

    /// The next stop request. Cancel-safe. A token counts once: after it fired, only signals
    /// remain (so that a second request can still mean "kill now").
    async fn recv(&mut self) -> Signal {
        let cancelled = async {
            match &self.cancel {
                Some(t) => t.cancelled().await,
                None => std::future::pending().await,
            }
        };
        let signalled = async {
            match &mut self.signals {
                Some(s) => s.recv().await,
                None => std::future::pending().await,
            }
        };
        let sig = tokio::select! {
            () = cancelled => None,
            sig = signalled => Some(sig),
        };
        match sig {
            Some(sig) => sig,
            None => {
                self.cancel = None;
                Signal::SIGTERM
            }
        }
    }
}

/// Runs a launch to its end, stopped by the process's signals. Prints the agent's status
/// lines (`muster-agent: ...`) on stderr; the workers' output goes to stdout and stderr under
/// `[rank R] ` prefixes.
pub async fn run(spec: LaunchSpec) -> Result<Outcome, LaunchError> {
    let stops = Stops::signals().map_err(LaunchError::Signals)?;
    run_with(spec, stops).await
}

/// Runs a launch to its end, stopped by `stops`.
pub async fn run_with(spec: LaunchSpec, mut stops: Stops) -> Result<Outcome, LaunchError> {
    let place = place_coordinator(&spec)?;
    let Some(hosted) = place.hosted else {
        return run_at(spec, &mut stops, place.addr, place.embedded).await;
    };
    let coordinators = failover::from_list(&place.addr, spec.failover_timeout)
        .with_security(spec.security.client().clone())
        .waiting_out_outages();
    let (job, lease) = (spec.job_id.clone(), spec.lease);
    let outcome = run_at(spec, &mut stops, place.addr, false).await;
    let serve_on = matches!(
        outcome,
        Ok(Outcome::Succeeded | Outcome::Failed | Outcome::Drained)
    );
    hosted
        .finish(serve_on, &job, &coordinators, lease, &mut stops)
        .await;
    outcome
}

/// Runs a launch to its end with the coordinator at `coordinator` (`embedded`: the agent's
/// own on 127.0.0.1), stopped by `stops`.
async fn run_at(
    spec: LaunchSpec,
    stops: &mut Stops,
    coordinator: String,
    embedded: bool,
) -> Result<Outcome, LaunchError> {
    let started = Instant::now();
    // Served for as long as the launch runs.
    let _metrics = match spec.metrics_addr {
        Some(addr) => Some(
            metrics::Endpoint::start(addr)
                .await
                .map_err(LaunchError::Metrics)?,
        ),
        None => None,
    };
    // The embedded coordinator is plaintext without authentication (the spec's security is
    // plaintext then).
    let coordinators = failover::from_list(&coordinator, spec.failover_timeout)
        .with_security(spec.security.client().clone())
        .waiting_out_outages();
    let job = spec.job_id.clone();
    if embedded && !spec.quiet {
        // The embedded coordinator's port is picked at random: say where it is, so an operator
        // can ask it who is waiting where.
        eprintln!(
            "muster-agent: job {job}: coordinator at {coordinator} \
             (`muster-agent describe --coordinator {coordinator} {job}` shows who waits where)"
        );
    }
    let reached = match waiting(
        failover::connect(&coordinators, CONNECT_WINDOW),
        stops,
        || {
            // `-q`: no notice (an empty one is not printed).
            if spec.quiet {
                return String::new();
            }
            format!("muster-agent: waiting for the coordinator at {coordinator} (job {job})")
        },
    )
    .await
    {
        Waited::Done(reached) => reached?.0,
        Waited::Signal(sig) => return Ok(interrupted_early(&job, sig)),
    };
    let host = match (&spec.advertise_addr, embedded) {
        (Some(h), _) => h.clone(),
        (None, true) => "127.0.0.1".to_owned(),
        (None, false) => advertise_default(&reached).await,
    };
    let node_id = spec
        .node_id
        .clone()
        .unwrap_or_else(|| format!("{}-{}", sanitize(&hostname()), std::process::id()));
    // Before the first private folder: the guardian removes them if this process is killed.
    crate::guard::start_now();
    let scratch = Scratch::new(&job);
    // torch's Flight Recorder: one folder for the whole launch (the start-up hook, compiled
    // once by the first workers, and the ranks' sockets, which a later worker of the same rank
    // takes over).
    let flight = if spec.flight_recorder {
        match crate::flight::Flight::prepare() {
            Ok(f) => Some(f),
            Err(e) => {
                eprintln!(
                    "muster-agent: job {job}: cannot prepare torch's Flight Recorder ({e}); stack dumps on this node show no collectives"
                );
                None
            }
        }
    } else {
        None
    };
    // The last failure the coordinator (or this node) reported: the root cause to print if the
    // job ends without a restart.
    let mut last_failure: Option<pb::FailureInfo> = None;
    let mut previous: Option<PreviousEnd> = None;
    // The generation this node last ran: a coordinator that lost the job's state answers the
    // next join with a new job's first generation instead of a later one.
    let mut last_generation: Option<u64> = None;
    loop {
        let joined = waiting_join(&spec, &coordinators, &host, &node_id, stops).await;
        let mut node = match joined {
            Waited::Done(Ok(node)) => node,
            Waited::Done(Err(LaunchError::Join { status, .. }))
                if status.metadata().contains_key("muster-drained") =>
            {
                // Drained while this node waited in an open round.
                eprintln!(
                    "muster-agent: job {job}: {}; this node leaves the job (exit 0)",
                    status.message()
                );
                return Ok(Outcome::Drained);
            }
            Waited::Done(Err(LaunchError::Join { status, .. }))
                if status
                    .metadata()
                    .contains_key(muster_core::error::FINISHED_METADATA) =>
            {
                // A spare whose job finished without needing it.
                eprintln!("muster-agent: job {job}: {}; exiting 0", status.message());
                return Ok(Outcome::Succeeded);
            }
            Waited::Done(Err(LaunchError::Join { status, .. }))
                if status
                    .metadata()
                    .contains_key(muster_core::error::CANCELLED_METADATA) =>
            {
                // Cancelled while this node waited in an open round, or between generations.
                eprintln!(
                    "muster-agent: job {job}: {}; exiting with status {CANCELLED_EXIT}",
                    status.message()
                );
                return Ok(Outcome::Cancelled);
            }
            Waited::Done(Err(LaunchError::Join { status, .. }))
                if last_failure.is_some() && status.code() == tonic::Code::FailedPrecondition =>
            {
                // The job ended for good while this node was stopping its workers.
                if let Some(f) = &last_failure {
                    report_root_cause(&job, f);
                }
                eprintln!("muster-agent: job {job}: {}", status.message());
                return Ok(Outcome::Failed);
            }
            Waited::Done(Err(e)) => return Err(e),
            Waited::Signal(sig) => return Ok(interrupted_early(&job, sig)),
        };
        tracing::debug!(?node, "rendezvous closed");
        if let Some(previous) = last_generation
            && node.generation <= previous
        {
            eprintln!(
                "{}",
                state_lost_line(&job, &coordinators.leader_addr(), previous)
            );
            return Ok(Outcome::Failed);
        }
        let generation = node.generation;
        last_generation = Some(generation);
        node.error_dir = scratch.attempt(node.restart_count);
        // The relay and the watch live exactly as long as this generation's workers.
        let relay = if spec.relay {
            start_relay(&node, &coordinators).await
        } else {
            None
        };
        node.agent_socket = relay.as_ref().map(|r| r.socket().to_owned());
        // The agent store, like the relay, lives exactly as long as this generation's
        // workers: started before any of them (so torch's clients find it), dropped only
        // after the last one has exited (so rank 0 may finish first).
        let store = if spec.agent_store {
            match start_store(&spec, &node) {
                Ok(store) => {
                    node.master_addr = STORE_ADDR.to_owned();
                    node.master_port = store.port();
                    Some(store)
                }
                Err(why) => {
                    drop(relay);
                    return Err(LaunchError::AgentStore { job, why });
                }
            }
        } else {
            None
        };
        node.flight_dir = flight.as_ref().map(|f| f.dir().to_owned());
        // The stack sampler lives as long as the watch that answers the coordinator's dumps.
        let registry = crate::stacks::Workers::default();
        let sampler = match crate::stacks::Sampler::start(registry.clone(), spec.sample_hz) {
            Ok(s) => {
                let s = s.with_flight(node.flight_dir.clone());
                Some(match &relay {
                    Some(relay) => s.with_barriers(relay.completed()),
                    None => s,
                })
            }
            Err(e) => {
                eprintln!(
                    "muster-agent: job {job}: cannot start the stack sampler ({e}); stacks and hang detection are off on this node"
                );
                None
            }
        };
        let watch = Watch::start(
            coordinators.clone(),
            pb::NodeAttach {
                job_id: node.job_id.clone(),
                generation: node.generation,
                node_rank: node.node_rank,
                node_id: node_id.clone(),
                resume: false,
                attempt: 0,
            },
            spec.lease,
            sampler,
        );
        let end = Supervisor::new(
            &spec,
            coordinators.clone(),
            node,
            watch,
            stops,
            previous.take(),
        )
        .with_registry(registry)
        .run()
        .await;
        match &end {
            // Ending the relay (its thread joined, its folder removed) takes about 1 ms: off
            // the restart's path when this node joins again.
            End::Ended {
                verdict: Some(v), ..
            } if v.rejoin => drop(tokio::task::spawn_blocking(move || drop(relay))),
            _ => drop(relay),
        }
        drop(store);
        match end {
            End::Succeeded { spawned, watch } => {
                watch.finish().await;
                if !spec.quiet {
                    eprintln!(
                        "muster-agent: job {job}: {} exited 0 in {:.2}s",
                        workers(spawned),
                        started.elapsed().as_secs_f64()
                    );
                }
                return Ok(Outcome::Succeeded);
            }
            End::Interrupted { sig, spawned } => {
                eprintln!(
                    "muster-agent: job {job}: stopped {} after {}",
                    workers(spawned),
                    sig.as_str()
                );
                return Ok(Outcome::Interrupted(sig));
            }
            End::SpawnFailed(why) => {
                eprintln!("muster-agent: job {job} failed: {why}");
                return Ok(Outcome::Failed);
            }
            End::StateLost {
                coordinator,
                message,
            } => {
                tracing::debug!(%coordinator, %message, "the coordinator no longer knows the job");
                eprintln!("{}", state_lost_line(&job, &coordinator, generation));
                return Ok(Outcome::Failed);
            }
            End::LeaseLost(why) => {
                if let Some(f) = &last_failure {
                    report_root_cause(&job, f);
                }
                eprintln!(
                    "muster-agent: job {job} failed: this node lost the coordinator at {coordinator}: {why}; its workers were stopped"
                );
                return Ok(Outcome::Failed);
            }
            End::Ended { verdict, local, at } => {
                let failure = verdict
                    .as_ref()
                    .and_then(|v| v.failure.clone())
                    .or(local.map(|l| *l));
                if failure.is_some() {
                    last_failure = failure;
                }
                let Some(v) = verdict else {
                    // The coordinator did not answer: decide alone, the job failed.
                    if let Some(f) = &last_failure {
                        report_root_cause(&job, f);
                    }
                    eprintln!(
                        "muster-agent: job {job}: no word from the coordinator after the failure; not restarting"
                    );
                    return Ok(Outcome::Failed);
                };
                let cause = pb::generation_ended::Cause::try_from(v.cause)
                    .unwrap_or(pb::generation_ended::Cause::Unspecified);
                if v.rejoin {
                    if cause == pb::generation_ended::Cause::Failed {
                        metrics::restarted();
                    }
                    eprint!("{}", rejoin_message(&job, &v));
                    previous = Some(previous_end(&v, at));
                    continue;
                }
                if cause == pb::generation_ended::Cause::Cancelled {
                    eprintln!(
                        "muster-agent: job {job}: {}; workers stopped, exiting with status {CANCELLED_EXIT}",
                        v.message
                    );
                    return Ok(Outcome::Cancelled);
                }
                if cause == pb::generation_ended::Cause::Drained {
                    eprintln!(
                        "muster-agent: job {job}: {}; workers stopped, this node leaves the job (exit 0)",
                        v.message
                    );
                    return Ok(Outcome::Drained);
                }
                match &last_failure {
                    Some(f) => report_root_cause(&job, f),
                    None => eprintln!("muster-agent: job {job} failed: {}", v.message),
                }
                if v.max_restarts > 0 {
                    eprintln!(
                        "muster-agent: job {job}: no restarts left ({} of {} used)",
                        v.restart_count, v.max_restarts
                    );
                }
                if last_failure.as_ref().is_some_and(|f| f.hang) {
                    return Ok(Outcome::Hung);
                }
                return Ok(Outcome::Failed);
            }
        }
    }
}

/// Per-attempt folders for the workers' error files, under the system's temporary folder;
/// removed when the launch ends.
struct Scratch {
    root: Option<PathBuf>,
}

impl Scratch {
    fn new(job: &str) -> Self {
        let root = std::env::temp_dir().join(format!(
            "muster-agent-{}-{}",
            std::process::id(),
            sanitize(job)
        ));
        match std::fs::create_dir_all(&root) {
            Ok(()) => Self { root: Some(root) },
            Err(e) => {
                tracing::warn!(%e, dir = %root.display(), "no folder for worker error files; workers' structured errors will not be read");
                Self { root: None }
            }
        }
    }

    /// The folder for restart `n`'s error files (created), if there is a root.
    fn attempt(&self, n: u32) -> Option<PathBuf> {
        let dir = self.root.as_ref()?.join(format!("attempt_{n}"));
        std::fs::create_dir_all(&dir).ok().map(|()| dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        if let Some(root) = &self.root {
            let _ = std::fs::remove_dir_all(root);
        }
    }
}

/// The local address that routes to the coordinator: a UDP socket "connected" to it sends
/// nothing but makes the kernel pick the outgoing interface's address, which is the one the
/// coordinator and the other nodes can reach. Falls back to the host name.
pub async fn advertise_default(coordinator: &str) -> String {
    let route = async {
        let target = tokio::net::lookup_host(coordinator).await.ok()?.next()?;
        let bind: SocketAddr = if target.is_ipv6() {
            "[::]:0".parse().ok()?
        } else {
            "0.0.0.0:0".parse().ok()?
        };
        let socket = tokio::net::UdpSocket::bind(bind).await.ok()?;
        socket.connect(target).await.ok()?;
        Some(socket.local_addr().ok()?.ip().to_string())
    };
    match tokio::time::timeout(Duration::from_secs(2), route).await {
        Ok(Some(ip)) => ip,
        _ => hostname(),
    }
}

/// Starts the node relay; if it cannot start, says why and returns `None`: the workers then
/// send their barriers over their own coordinator sessions, which is slower but equivalent.
async fn start_relay(node: &NodeAssignment, coordinators: &Coordinators) -> Option<Relay> {
    match Relay::start_with(node, coordinators).await {
        Ok(relay) => {
            tracing::debug!(socket = relay.socket(), "node relay started");
            Some(relay)
        }
        Err(e) => {
            eprintln!(
                "muster-agent: job {}: node relay unavailable ({e}); workers send their barriers to the coordinator directly",
                node.job_id
            );
            None
        }
    }
}

/// `MASTER_ADDR` with the agent store: it listens on loopback only, so the only
/// control-plane socket a job exposes beyond the machine is the coordinator's.
const STORE_ADDR: &str = "127.0.0.1";

/// Starts this generation's agent store: torch's TCPStore protocol on a loopback port, served
/// from the job's key-value store through the SDK's client (its failover included), with the
/// job token (not the cluster token), so the store's calls can reach this job's keys only.
fn start_store(spec: &LaunchSpec, node: &NodeAssignment) -> Result<AgentStore, String> {
    let mut security = spec.security.client().clone();
    if let Some((_, token)) = spec
        .security
        .worker_env(&node.job_id)
        .into_iter()
        .find(|(name, _)| *name == muster_proto::security::env::TOKEN)
    {
        security = security.with_credentials(Credentials::bearer(&token)?);
    }
    let coordinator = muster::client::Coordinator::connect_lazy_with(&node.coordinator, security)
        .map_err(|e| e.to_string())?;
    // The launch's budget (`--failover-timeout-ms`), not the variable the SDK reads.
    coordinator.set_failover_timeout(node.failover_timeout);
    AgentStore::start(Kv::new(coordinator, &node.job_id), node.generation)
        .map_err(|e| format!("cannot listen on {STORE_ADDR}: {e}"))
}

/// How a wait before the workers start ended.
enum Waited<T> {
    Done(T),
    Signal(Signal),
}

/// Awaits `fut` unless a stop request comes first; prints `notice()` once if it takes longer
/// than [`WAITING_NOTICE`].
async fn waiting<T>(
    fut: impl Future<Output = T>,
    stops: &mut Stops,
    notice: impl FnOnce() -> String,
) -> Waited<T> {
    tokio::pin!(fut);
    let timer = tokio::time::sleep(WAITING_NOTICE);
    tokio::pin!(timer);
    let mut notice = Some(notice);
    loop {
        tokio::select! {
            out = &mut fut => return Waited::Done(out),
            sig = stops.recv() => return Waited::Signal(sig),
            () = &mut timer, if notice.is_some() => {
                if let Some(text) = notice.take().map(|text| text())
                    && !text.is_empty()
                {
                    eprintln!("{text}");
                }
            }
        }
    }
}

/// Joins the round unless a stop request comes first. While the round stays open past
/// [`WAITING_NOTICE`], prints one status line each time the number of joined nodes changes
/// ("waiting for nodes: 1/2 joined").
async fn waiting_join(
    spec: &LaunchSpec,
    coordinators: &Coordinators,
    host: &str,
    node_id: &str,
    stops: &mut Stops,
) -> Waited<Result<NodeAssignment, LaunchError>> {
    let fut = join(spec, coordinators, host, node_id);
    tokio::pin!(fut);
    let mut tick =
        tokio::time::interval_at(tokio::time::Instant::now() + WAITING_NOTICE, WAITING_NOTICE);
    let mut shown = None;
    let job = &spec.job_id;
    let mut standing = false;
    if spec.spare && !spec.quiet {
        eprintln!(
            "muster-agent: job {job}: standing by as a spare ({}) at coordinator {}, until a node is lost",
            workers(spec.nproc_per_node as usize),
            coordinators.leader_addr()
        );
        standing = true;
    }
    loop {
        tokio::select! {
            out = &mut fut => return Waited::Done(out),
            sig = stops.recv() => return Waited::Signal(sig),
            _ = tick.tick() => {
                // One attempt, on whichever replica leads now: this is only a status line.
                let view = OpsClient::new(coordinators.channel())
                    .describe_job(pb::DescribeJobRequest {
                        job_id: job.clone(),
                        ..Default::default()
                    })
                    .await
                    .ok()
                    .map(tonic::Response::into_inner);
                if view.as_ref().is_some_and(|v| v.spares.iter().any(|s| s.node_id == node_id)) {
                    // Parked as a spare (the running generation was full): said once.
                    if !standing && !spec.quiet {
                        eprintln!(
                            "muster-agent: job {job}: every node of the running generation is taken; standing by as a spare until one is lost"
                        );
                    }
                    standing = true;
                    continue;
                }
                let joined = view.and_then(|r| r.summary).map(|s| s.nodes_waiting);
                if joined != shown && !spec.quiet {
                    shown = joined;
                    let (min, max) = (spec.nodes.min, spec.nodes.max);
                    let wanted = if min == max { min.to_string() } else { format!("{min}:{max}") };
                    eprintln!(
                        "muster-agent: waiting for nodes: {}/{wanted} joined (job {job}, coordinator {})",
                        joined.map_or_else(|| "?".to_owned(), |n| n.to_string()),
                        coordinators.leader_addr()
                    );
                }
            }
        }
    }
}

fn interrupted_early(job: &str, sig: Signal) -> Outcome {
    eprintln!(
        "muster-agent: job {job}: got {} before any worker started",
        sig.as_str()
    );
    Outcome::Interrupted(sig)
}

/// The signals that stop a launch: SIGINT and SIGTERM, and (as torchrun does) SIGHUP and
/// SIGQUIT, so that a closed terminal does not leave the workers running. Installed before
/// any worker exists.
struct Signals {
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
    quit: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        Ok(Self {
            interrupt: signal(SignalKind::interrupt())?,
            terminate: signal(SignalKind::terminate())?,
            hangup: signal(SignalKind::hangup())?,
            quit: signal(SignalKind::quit())?,
        })
    }

    /// The next stopping signal. Cancel-safe.
    async fn recv(&mut self) -> Signal {
        tokio::select! {
            Some(()) = self.interrupt.recv() => Signal::SIGINT,
            Some(()) = self.terminate.recv() => Signal::SIGTERM,
            Some(()) = self.hangup.recv() => Signal::SIGHUP,
            Some(()) = self.quit.recv() => Signal::SIGQUIT,
            // Every stream ended: the signal driver is gone; nothing is left to wait for.
            else => std::future::pending().await,
        }
    }
}

/// "1 worker", "4 workers".
fn workers(n: usize) -> String {
    if n == 1 {
        "1 worker".to_owned()
    } else {
        format!("{n} workers")
    }
}

/// This machine's host name ("localhost" if it cannot be read).
fn hostname() -> String {
    nix::unistd::gethostname()
        .ok()
        .and_then(|h| h.into_string().ok())
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_owned())
}

/// Keeps the characters a node id may have; the others become `-`.
fn sanitize(s: &str) -> String {
    muster_core::model::name_chars(s)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes() {
        assert_eq!(Outcome::Succeeded.exit_code(), 0);
        assert_eq!(Outcome::Failed.exit_code(), 1);
        assert_eq!(Outcome::Cancelled.exit_code(), 3);
        assert_eq!(Outcome::Hung.exit_code(), 4);
        assert_eq!(Outcome::Interrupted(Signal::SIGINT).exit_code(), 130);
        assert_eq!(Outcome::Interrupted(Signal::SIGTERM).exit_code(), 143);
    }

    #[tokio::test]
    async fn advertise_address_routes_to_the_coordinator() {
        assert_eq!(advertise_default("127.0.0.1:29470").await, "127.0.0.1");
    }

    #[test]
    fn node_ids() {
        assert_eq!(sanitize("gpu-01.example.com"), "gpu-01.example.com");
        assert_eq!(sanitize("a b:c"), "a-b-c");
    }
}
