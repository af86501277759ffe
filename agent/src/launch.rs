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

use crate::env::{NodeAssignment, worker_env};
use crate::failover::{self, Coordinators};
use crate::metrics::{self, FailureCause, WorkerState, WorkerStates};
use crate::relay::Relay;
use crate::spec::LaunchSpec;
use crate::watch::{Watch, WatchEvent};
use crate::worker::{Exit, Worker};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use muster_proto::v1 as pb;
use muster_proto::v1::key_value_client::KeyValueClient;
use muster_proto::v1::ops_client::OpsClient;
use muster_proto::v1::rendezvous_client::RendezvousClient;
use nix::sys::signal::Signal;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpSocket};
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// How long the agent keeps trying to reach a coordinator that is not up yet.
pub const CONNECT_WINDOW: Duration = Duration::from_secs(10);
/// After this long in the rendezvous the agent says what it is waiting for.
pub const WAITING_NOTICE: Duration = Duration::from_secs(1);
/// The most time one attempt of a failure report may take (it is retried across a failover).
pub const REPORT_TIMEOUT: Duration = Duration::from_secs(1);
/// After a failure, how long the workers get to end on their own before SIGTERM (capped by
/// the grace period).
pub const FAILURE_SETTLE: Duration = Duration::from_millis(500);
/// After a local failure and the workers' end, how long the agent waits for the
/// coordinator's verdict (restart or not) before deciding alone that the job failed.
const VERDICT_WAIT: Duration = Duration::from_secs(3);
/// How long a node other than node 0 waits for node 0's MASTER_PORT.
const MASTER_PORT_WAIT: Duration = Duration::from_secs(60);

/// How a launch ended; [`Outcome::exit_code`] is the agent's exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every worker exited 0.
    Succeeded,
    /// A worker (or node) failed and no restart was left; the others were stopped.
    Failed,
    /// An operator cancelled the job.
    Cancelled,
    /// An operator drained this node (`Ops.DrainNode`): its workers were stopped and the job
    /// goes on without it. Exits 0: nothing failed here.
    Drained,
    /// The agent got this signal and stopped the workers.
    Interrupted(Signal),
}

impl Outcome {
    /// 0, 1, or 128 + the signal number (130 for SIGINT, 143 for SIGTERM). A cancelled job
    /// exits 1 too: it did not finish.
    pub fn exit_code(self) -> u8 {
        match self {
            Self::Succeeded | Self::Drained => 0,
            Self::Failed | Self::Cancelled => 1,
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
    /// The metrics endpoint (`--metrics-addr`) could not listen.
    #[error("{0}")]
    Metrics(String),
    /// Installing the SIGINT/SIGTERM handlers failed.
    #[error("cannot install signal handlers: {0}")]
    Signals(#[source] std::io::Error),
}

/// An error and its sources, `: `-separated (tonic's transport errors say little alone).
pub(crate) fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.ends_with(&more) {
            text = format!("{text}: {more}");
        }
        source = s.source();
    }
    text
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
    let coordinators = Coordinators::from_list(&place.addr, spec.failover_timeout)
        .with_security(spec.security.client().clone());
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
    let coordinators = Coordinators::from_list(&coordinator, spec.failover_timeout)
        .with_security(spec.security.client().clone());
    let job = spec.job_id.clone();
    let reached = match waiting(coordinators.connect(CONNECT_WINDOW), stops, || {
        // `-q`: no notice (an empty one is not printed).
        if spec.quiet {
            return String::new();
        }
        format!("muster-agent: waiting for the coordinator at {coordinator} (job {job})")
    })
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
    let node_id = format!("{}-{}", sanitize(&hostname()), std::process::id());
    // Before the first private folder: the guardian removes them if this process is killed.
    crate::guard::start_now();
    let scratch = Scratch::new(&job);
    // The last failure the coordinator (or this node) reported: the root cause to print if the
    // job ends without a restart.
    let mut last_failure: Option<pb::FailureInfo> = None;
    let mut failed_at: Option<Instant> = None;
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
                state_lost_line(&job, &coordinators.current(), previous)
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
        let watch = Watch::start(
            coordinators.clone(),
            pb::NodeAttach {
                job_id: node.job_id.clone(),
                generation: node.generation,
                node_rank: node.node_rank,
                node_id: node_id.clone(),
                resume: false,
            },
            spec.lease,
        );
        let end = Supervisor::new(&spec, coordinators.clone(), node, watch, stops, failed_at)
            .run()
            .await;
        drop(relay);
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
                    failed_at = Some(at);
                    continue;
                }
                if cause == pb::generation_ended::Cause::Cancelled {
                    eprintln!("muster-agent: job {job}: {}; workers stopped", v.message);
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
    loop {
        tokio::select! {
            out = &mut fut => return Waited::Done(out),
            sig = stops.recv() => return Waited::Signal(sig),
            _ = tick.tick() => {
                // One attempt, on whichever replica leads now: this is only a status line.
                let joined = match coordinators.channel() {
                    Ok((_, channel)) => OpsClient::new(channel)
                        .describe_job(pb::DescribeJobRequest {
            job_id: job.clone(),
            ..Default::default()
        })
                        .await
                        .ok()
                        .and_then(|r| r.into_inner().summary)
                        .map(|s| s.nodes_waiting),
                    Err(_) => None,
                };
                if joined != shown && !spec.quiet {
                    shown = joined;
                    let (min, max) = (spec.nodes.min, spec.nodes.max);
                    let wanted = if min == max { min.to_string() } else { format!("{min}:{max}") };
                    eprintln!(
                        "muster-agent: waiting for nodes: {}/{wanted} joined (job {job}, coordinator {})",
                        joined.map_or_else(|| "?".to_owned(), |n| n.to_string()),
                        coordinators.current()
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

/// Where the launch's coordinator is, and the one this agent serves, if any.
struct Place {
    /// The address (or replica list) the agent and its workers dial.
    addr: String,
    /// The agent's own coordinator on 127.0.0.1 (single-node jobs).
    embedded: bool,
    /// Set when this agent hosts the job's coordinator at the rendezvous endpoint.
    hosted: Option<Hosted>,
}

/// Finds or starts the coordinator: `--coordinator`'s; else, with a rendezvous endpoint
/// (`--rdzv-endpoint`, or the main machine's address, port 29470), the one this agent serves
/// there when its machine can bind it (torchrun's c10d: the agent that binds hosts), else the
/// one another agent serves there; else the agent's own on 127.0.0.1.
///
/// Two agents racing for the endpoint cannot both bind it: the loser (address in use), and
/// every agent whose machine does not own the address (not available), dials.
fn place_coordinator(spec: &LaunchSpec) -> Result<Place, LaunchError> {
    let Some(addr) = &spec.coordinator else {
        return Ok(Place {
            addr: start_embedded()?,
            embedded: true,
            hosted: None,
        });
    };
    let dial = || Place {
        addr: addr.clone(),
        embedded: false,
        hosted: None,
    };
    let Some(host) = &spec.self_host else {
        return Ok(dial());
    };
    let listener = match bind_endpoint(addr) {
        Ok(Some(listener)) => listener,
        Ok(None) if !host.must => return Ok(dial()),
        Ok(None) => {
            return Err(LaunchError::Embedded(std::io::Error::new(
                std::io::ErrorKind::AddrNotAvailable,
                format!("--rdzv-conf is_host=1, but this machine cannot bind {addr}"),
            )));
        }
        Err(e) => return Err(LaunchError::Embedded(e)),
    };
    let bound = listener.local_addr().map_err(LaunchError::Embedded)?;
    let mut config = muster_coordinator::Config::default();
    match &host.secured {
        Some(s) => {
            config.tls = muster_coordinator::config::TlsConfig {
                cert: Some(s.cert.clone()),
                key: Some(s.key.clone()),
                client_ca: Some(s.client_ca.clone()),
            };
            config.auth_token_file = Some(s.token_file.clone());
        }
        None => {
            // torchrun's TCPStore has no authentication either; say so once, loudly.
            config.insecure = true;
            if !bound.ip().is_loopback() {
                eprintln!(
                    "muster-agent: warning: this agent serves job {}'s rendezvous at {addr} without TLS or authentication: anyone who can reach {addr} can join the job and read its NCCL unique ids; give every node --tls-ca, --tls-cert, --tls-key (a certificate for the endpoint's host) and --auth-token-file to secure it",
                    spec.job_id
                );
            }
        }
    }
    if !spec.quiet {
        eprintln!(
            "muster-agent: job {}: this agent hosts the rendezvous at {addr}",
            spec.job_id
        );
    }
    let stop = CancellationToken::new();
    let task = serve_here(listener, config, stop.clone());
    Ok(Place {
        addr: addr.clone(),
        embedded: false,
        hosted: Some(Hosted {
            addr: addr.clone(),
            stop,
            task,
        }),
    })
}

/// Binds `addr` (`HOST:PORT`) if this machine can: `Ok(None)` when none of HOST's addresses
/// is this machine's, when another process holds the port (another agent won the race), or
/// when HOST does not resolve (dialing then says why).
fn bind_endpoint(addr: &str) -> std::io::Result<Option<TcpListener>> {
    use std::net::ToSocketAddrs as _;
    let Ok(candidates) = addr.to_socket_addrs() else {
        return Ok(None);
    };
    for candidate in candidates.filter(|a| !a.ip().is_unspecified()) {
        match nodelay_listener(candidate) {
            Ok(listener) => return Ok(Some(listener)),
            Err(e)
                if matches!(
                    e.kind(),
                    std::io::ErrorKind::AddrNotAvailable | std::io::ErrorKind::AddrInUse
                ) =>
            {
                tracing::debug!(%candidate, %e, "not hosting the rendezvous here");
            }
            Err(e) => {
                return Err(std::io::Error::new(
                    e.kind(),
                    format!("cannot bind the rendezvous endpoint {candidate}: {e}"),
                ));
            }
        }
    }
    Ok(None)
}

/// The coordinator this agent serves for the whole job at the rendezvous endpoint.
struct Hosted {
    addr: String,
    stop: CancellationToken,
    task: JoinHandle<()>,
}

impl Hosted {
    /// With `serve_on`, keeps serving after this node's end until the job is over on every
    /// node (finished, failed for good or cancelled; a node whose agent falls silent is failed
    /// by the coordinator after its lease, so this ends), then stops accepting and lets the
    /// other agents' in-flight calls end (they hear the job's end and hang up), for at most
    /// `lease`. Without `serve_on` (this agent was stopped, or failed to run) or on a stop
    /// request while serving, the coordinator ends at once.
    async fn finish(
        self,
        serve_on: bool,
        job: &str,
        coordinators: &Coordinators,
        lease: Duration,
        stops: &mut Stops,
    ) {
        let mut drain = false;
        if serve_on {
            let over = job_over(coordinators, job);
            let addr = &self.addr;
            let waited = waiting(over, stops, || {
                format!(
                    "muster-agent: job {job}: this node is done; serving the rendezvous at {addr} until every node is"
                )
            })
            .await;
            drain = matches!(waited, Waited::Done(()));
        }
        self.stop.cancel();
        if !drain {
            self.task.abort();
        } else if tokio::time::timeout(lease, self.task).await.is_err() {
            tracing::warn!(
                job,
                "the hosted coordinator's calls did not end within the lease"
            );
        }
    }
}

/// Returns once the coordinator says `job` is over on every node, or cannot say (the job is
/// gone, the coordinator unreachable). Long polls: no timer.
async fn job_over(coordinators: &Coordinators, job: &str) {
    let mut seen: Option<pb::JobSummary> = None;
    loop {
        let request = pb::DescribeJobRequest {
            job_id: job.to_owned(),
            wait_ms: if seen.is_some() { 30_000 } else { 0 },
            unless: seen.clone(),
        };
        let answer = failover::call(coordinators, "Ops.DescribeJob", |channel| {
            let request = request.clone();
            async move { OpsClient::new(channel).describe_job(request).await }
        })
        .await;
        let Ok(answer) = answer else {
            return;
        };
        let summary = answer.into_inner().summary.unwrap_or_default();
        let state = pb::RoundState::try_from(summary.state).unwrap_or_default();
        if summary.done || matches!(state, pb::RoundState::Finished | pb::RoundState::Cancelled) {
            return;
        }
        seen = Some(summary);
    }
}

/// Binds 127.0.0.1:0 and serves a coordinator there for as long as the agent runs; returns
/// its address.
fn start_embedded() -> Result<String, LaunchError> {
    let listener =
        nodelay_listener(SocketAddr::from(([127, 0, 0, 1], 0))).map_err(LaunchError::Embedded)?;
    let addr = listener.local_addr().map_err(LaunchError::Embedded)?;
    // Every client of a loopback coordinator is this agent or one of its workers, all from
    // one address: the per-peer cap (which keeps one host from taking every slot of a shared
    // coordinator) would only cap the workers this node can run.
    let config = muster_coordinator::Config {
        max_connections_per_peer: muster_coordinator::Config::default().max_connections,
        ..muster_coordinator::Config::default()
    };
    // Never stopped: dropped with the runtime when the agent exits (its only clients are this
    // agent and its workers, which are gone by then).
    serve_here(listener, config, CancellationToken::new());
    Ok(addr.to_string())
}

/// Serves a coordinator on `listener` in this process until `stop` is cancelled.
fn serve_here(
    listener: TcpListener,
    config: muster_coordinator::Config,
    stop: CancellationToken,
) -> JoinHandle<()> {
    // Task "embedded-coordinator": on error, log and print it (the rendezvous then fails and
    // says so); on shutdown, in-flight calls drain (see `Hosted::finish`), or the task is
    // dropped with the runtime.
    tokio::spawn(async move {
        let addr = listener.local_addr().ok();
        if let Err(e) = muster_coordinator::serve(listener, config, stop.cancelled_owned()).await {
            tracing::error!(%e, "embedded coordinator failed");
            if let Some(addr) = addr {
                eprintln!("muster-agent: the coordinator this agent serves at {addr} failed: {e}");
            }
        }
    })
}

/// A listener on `addr` with TCP_NODELAY set, which Linux passes on to every accepted
/// connection. `muster_coordinator::serve` does not set it on the connections it accepts, and
/// without it each answer of more than one write waits ~40 ms for a delayed ACK. A fixed port
/// (a rendezvous endpoint) is bound with SO_REUSEADDR, so that the last job's connections in
/// TIME_WAIT do not keep it; two listeners still cannot share it.
fn nodelay_listener(addr: SocketAddr) -> std::io::Result<TcpListener> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()?
    } else {
        TcpSocket::new_v6()?
    };
    socket.set_nodelay(true)?;
    socket.set_reuseaddr(addr.port() != 0)?;
    socket.bind(addr)?;
    socket.listen(1024)
}

/// Joins the round and settles MASTER_PORT. Cancel-safe: dropping it withdraws the join
/// (the coordinator sees the call go away).
///
/// The join carries a request id of its own; when it fails retryably (a follower's refusal,
/// a coordinator that died during the long poll) the same request, with the same id, goes to
/// the leader again within the failover budget, and a round that closed meanwhile gives this
/// node the place it already had.
async fn join(
    spec: &LaunchSpec,
    coordinators: &Coordinators,
    host: &str,
    node_id: &str,
) -> Result<NodeAssignment, LaunchError> {
    // 0 on the wire means "the coordinator's default": an explicit zero is sent as 1 ms.
    let millis = |d: Option<Duration>| {
        d.map_or(0, |d| {
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
        })
    };
    let request = pb::JoinRequest {
        job_id: spec.job_id.clone(),
        node_id: node_id.to_owned(),
        host: host.to_owned(),
        local_world_size: spec.nproc_per_node,
        requested_node_rank: spec.node_rank,
        config: Some(pb::RendezvousConfig {
            min_nodes: spec.nodes.min,
            max_nodes: spec.nodes.max,
            last_call_ms: millis(spec.last_call),
            join_timeout_ms: millis(spec.join_timeout),
            max_restarts: Some(spec.max_restarts),
        }),
        request_id: failover::request_id(),
    };
    let join_error = |status| LaunchError::Join {
        job: spec.job_id.clone(),
        status,
    };
    // A running generation with every node it can take refuses the join. Wait as a spare for
    // a while: an agent restarted after a crash its coordinator has not noticed yet (a host
    // that lost power, a cut link) replaces its old node once the coordinator declares that
    // node lost (the heartbeat timeout) and opens the next round. A second agent started on
    // a job id that is in use gets the refusal after the wait.
    let spare_until = Instant::now() + FULL_JOB_WAIT;
    let mut said = false;
    let answer = loop {
        let answer = failover::call(coordinators, "Rendezvous.Join", |channel| {
            let request = request.clone();
            async move { RendezvousClient::new(channel).join(request).await }
        })
        .await;
        match answer {
            Err(status)
                if status.code() == tonic::Code::FailedPrecondition
                    && status.message().contains("the job is full")
                    && Instant::now() < spare_until =>
            {
                if !said && !spec.quiet {
                    eprintln!(
                        "muster-agent: job {}: every node of the running generation is taken; waiting up to {} s as a spare, in case one of them is lost (a restarted agent replaces its old node)",
                        spec.job_id,
                        FULL_JOB_WAIT.as_secs()
                    );
                }
                said = true;
                tokio::time::sleep(FULL_JOB_RETRY).await;
            }
            answer => break answer.map_err(join_error)?.into_inner(),
        }
    };
    if answer.local_world_size != spec.nproc_per_node {
        return Err(join_error(tonic::Status::internal(format!(
            "the coordinator assigned {} workers to this node, which runs {}",
            answer.local_world_size, spec.nproc_per_node
        ))));
    }
    let master_port = match spec.master_port {
        Some(port) => port,
        None => {
            master_port(coordinators, &answer)
                .await
                .map_err(|why| LaunchError::MasterPort {
                    job: spec.job_id.clone(),
                    why,
                })?
        }
    };
    let node = NodeAssignment {
        coordinator: coordinators.list(),
        failover_timeout: coordinators.budget(),
        job_id: answer.job_id,
        generation: answer.generation,
        node_rank: answer.node_rank,
        num_nodes: answer.num_nodes,
        rank_offset: answer.rank_offset,
        local_world_size: answer.local_world_size,
        world_size: answer.world_size,
        restart_count: answer.restart_count,
        max_restarts: answer.max_restarts,
        host: host.to_owned(),
        master_addr: spec.master_addr.clone().unwrap_or(answer.master_host),
        master_port,
        agent_socket: None,
        error_dir: None,
    };
    Ok(node)
}

/// How long a join refused because the running generation is full is retried (the
/// coordinator's default heartbeat timeout, 10 s, plus a restart round).
const FULL_JOB_WAIT: Duration = Duration::from_secs(15);
/// How often it is retried meanwhile.
const FULL_JOB_RETRY: Duration = Duration::from_secs(1);

/// MASTER_PORT: node 0 finds a free port (bind :0, close) and, in a multi-node job, shares it
/// through the job's key-value store; the other nodes read it from there.
async fn master_port(
    coordinators: &Coordinators,
    answer: &pb::JoinResponse,
) -> Result<u16, String> {
    let key = format!("muster/master_port/gen{}", answer.generation);
    if answer.node_rank == 0 {
        let port = std::net::TcpListener::bind(("0.0.0.0", 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        if answer.num_nodes > 1 {
            let request = pb::SetRequest {
                job_id: answer.job_id.clone(),
                key,
                value: port.to_string().into_bytes(),
            };
            failover::call(coordinators, "KeyValue.Set", |channel| {
                let request = request.clone();
                async move { KeyValueClient::new(channel).set(request).await }
            })
            .await
            .map_err(|s| crate::security::explain(&s))?;
        }
        return Ok(port);
    }
    let request = pb::GetRequest {
        job_id: answer.job_id.clone(),
        key: key.clone(),
        wait_ms: u64::try_from(MASTER_PORT_WAIT.as_millis()).unwrap_or(u64::MAX),
    };
    let value = failover::call(coordinators, "KeyValue.Get", |channel| {
        let request = request.clone();
        async move { KeyValueClient::new(channel).get(request).await }
    })
    .await
    .map_err(|s| {
        format!(
            "node 0 did not publish it: {}",
            crate::security::explain(&s)
        )
    })?
    .into_inner()
    .value;
    std::str::from_utf8(&value)
        .ok()
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("node 0 published a malformed port under '{key}'"))
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

/// How one generation ended for this node.
enum End {
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
struct Supervisor<'a> {
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
    /// When the previous generation failed (to report how long the restart took).
    failed_at: Option<Instant>,
    /// This generation's workers in `muster_agent_workers{state}`.
    states: WorkerStates,
}

impl<'a> Supervisor<'a> {
    fn new(
        spec: &'a LaunchSpec,
        coordinators: Coordinators,
        node: NodeAssignment,
        watch: Watch,
        stops: &'a mut Stops,
        failed_at: Option<Instant>,
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
            failed_at,
            states: WorkerStates::starting(spec.nproc_per_node),
        }
    }

    async fn run(mut self) -> End {
        self.spawn_all();
        let spawned = self.workers.len();
        if let Some(at) = self.failed_at
            && self.spawn_error.is_none()
        {
            eprintln!(
                "muster-agent: job {}: generation {} (restart {}) running {} on node {}, {:.0} ms after the failure",
                self.spec.job_id,
                self.node.generation,
                self.node.restart_count,
                workers(spawned),
                self.node.node_rank,
                at.elapsed().as_secs_f64() * 1000.0
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
        if !options.use_cpu && !inherited("ACCELERATE_USE_CPU") && crate::gpu::discover().is_empty()
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
            rank: exit.rank,
            node_rank: self.node.node_rank,
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

/// The one line an agent prints when the coordinator lost the state of a job whose
/// `generation` ran on this node (see `docs/contract.md`, "A coordinator that lost the job").
fn state_lost_line(job: &str, coordinator: &str, generation: u64) -> String {
    format!(
        "muster-agent: job {job} failed: the coordinator at {coordinator} lost the job's state (it no longer knows the job, whose generation {generation} ran here: restarted without a persistent store?); the workers were stopped and are not started again; run the coordinator with --store etcd to keep job state across its restarts"
    )
}

/// Prints the root cause and, as torchrun does, copies it to the agent's own
/// `TORCHELASTIC_ERROR_FILE` when it has one (a scheduler that launched the agent reads it
/// there), unless that file already exists.
fn report_root_cause(job: &str, f: &pb::FailureInfo) {
    eprint!("{}", root_cause(job, f));
    let Some(path) = std::env::var_os("TORCHELASTIC_ERROR_FILE") else {
        return;
    };
    let message = if f.error_message.is_empty() {
        format!(
            "rank {} (node {}, host {}) {}",
            f.rank, f.node_rank, f.host, f.reason
        )
    } else {
        f.error_message.clone()
    };
    let timestamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": f.error_traceback,
                "timestamp": timestamp.to_string(),
            }
        }
    });
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .and_then(|mut file| {
            use std::io::Write as _;
            file.write_all(body.to_string().as_bytes())
        });
    if let Err(e) = written {
        tracing::debug!(%e, path = %std::path::Path::new(&path).display(), "root cause not written to the agent's error file");
    }
}

/// The lines printed when a job fails for good: the root cause (the generation's first
/// failure, wherever it happened), its error, and its last stderr lines.
fn root_cause(job: &str, f: &pb::FailureInfo) -> String {
    let mut text = if f.node_id.is_empty() {
        format!(
            "muster-agent: job {job} failed: rank {} (node {}, host {}) {}\n",
            f.rank, f.node_rank, f.host, f.reason
        )
    } else {
        format!("muster-agent: job {job} failed: {}\n", f.reason)
    };
    if !f.error_message.is_empty() {
        let _ = writeln!(text, "muster-agent: error: {}", f.error_message.trim_end());
    }
    if !f.error_traceback.is_empty() {
        let _ = writeln!(text, "muster-agent: traceback of rank {}:", f.rank);
        for line in f.error_traceback.lines() {
            let _ = writeln!(text, "    {line}");
        }
    }
    if f.node_id.is_empty() {
        if f.stderr_tail.is_empty() {
            let _ = writeln!(
                text,
                "muster-agent: rank {} wrote nothing to stderr",
                f.rank
            );
        } else {
            let _ = writeln!(text, "muster-agent: last stderr lines of rank {}:", f.rank);
            for line in f.stderr_tail.lines() {
                let _ = writeln!(text, "    {line}");
            }
        }
    }
    text
}

/// The lines printed when the job goes on in a new generation: what ended the last one and
/// the restart budget on one line, then the failed rank's error and last stderr lines, each
/// on a line of its own (indented), not folded into the first.
fn rejoin_message(job: &str, v: &pb::GenerationEnded) -> String {
    let failure = v
        .failure
        .as_ref()
        .filter(|_| v.cause == pb::generation_ended::Cause::Failed as i32);
    let Some(f) = failure else {
        let mut lines = v.message.lines();
        let mut text = format!(
            "muster-agent: job {job}: {}; joining again\n",
            lines.next().unwrap_or_default()
        );
        for line in lines {
            let _ = writeln!(text, "    {line}");
        }
        return text;
    };
    let what = if f.node_id.is_empty() {
        format!(
            "rank {} (node {}, host {}) of generation {} {}",
            f.rank, f.node_rank, f.host, f.generation, f.reason
        )
    } else {
        f.reason.clone()
    };
    let mut text = format!(
        "muster-agent: job {job}: {what}; restarting (restart {} of {}); joining again\n",
        v.restart_count + 1,
        v.max_restarts
    );
    let mut error = f.error_message.trim_end().lines();
    if let Some(first) = error.next() {
        let _ = writeln!(text, "muster-agent: error: {first}");
        for line in error {
            let _ = writeln!(text, "    {line}");
        }
    }
    if f.node_id.is_empty() && !f.stderr_tail.is_empty() {
        let _ = writeln!(text, "muster-agent: last stderr lines of rank {}:", f.rank);
        for line in f.stderr_tail.lines() {
            let _ = writeln!(text, "    {line}");
        }
    }
    text
}

async fn sleep_until(deadline: Option<tokio::time::Instant>) {
    match deadline {
        Some(t) => tokio::time::sleep_until(t).await,
        None => std::future::pending().await,
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
    s.chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                c
            } else {
                '-'
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes() {
        assert_eq!(Outcome::Succeeded.exit_code(), 0);
        assert_eq!(Outcome::Failed.exit_code(), 1);
        assert_eq!(Outcome::Interrupted(Signal::SIGINT).exit_code(), 130);
        assert_eq!(Outcome::Interrupted(Signal::SIGTERM).exit_code(), 143);
    }

    #[test]
    fn summaries() {
        let info = |tail: &str, err: &str| pb::FailureInfo {
            rank: 5,
            node_rank: 1,
            host: "h1".into(),
            reason: "exited with status 3".into(),
            stderr_tail: tail.into(),
            error_message: err.into(),
            ..Default::default()
        };
        assert_eq!(
            root_cause("j", &info("Traceback\nboom", "ValueError: boom")),
            "muster-agent: job j failed: rank 5 (node 1, host h1) exited with status 3\n\
             muster-agent: error: ValueError: boom\n\
             muster-agent: last stderr lines of rank 5:\n    Traceback\n    boom\n"
        );
        assert_eq!(
            root_cause("j", &info("", "")),
            "muster-agent: job j failed: rank 5 (node 1, host h1) exited with status 3\n\
             muster-agent: rank 5 wrote nothing to stderr\n"
        );
        let lost = pb::FailureInfo {
            node_id: "n1".into(),
            reason: "node 1 (host h1, agent n1) was lost: its agent disconnected".into(),
            ..Default::default()
        };
        assert_eq!(
            root_cause("j", &lost),
            "muster-agent: job j failed: node 1 (host h1, agent n1) was lost: its agent disconnected\n"
        );
    }

    #[test]
    fn rejoin_messages_keep_lines_apart() {
        let ended = |failure: Option<pb::FailureInfo>, cause: pb::generation_ended::Cause| {
            pb::GenerationEnded {
                generation: 2,
                cause: cause as i32,
                rejoin: true,
                failure,
                message: "node 1 joined\nsecond line".into(),
                restart_count: 1,
                max_restarts: 3,
            }
        };
        let failed = pb::FailureInfo {
            rank: 3,
            node_rank: 1,
            host: "h1".into(),
            reason: "exited with status 3".into(),
            generation: 2,
            stderr_tail: "Traceback (most recent call last):\n  File \"t.py\"\nValueError: boom"
                .into(),
            error_message: "ValueError: boom\nmore".into(),
            ..Default::default()
        };
        let lost = pb::FailureInfo {
            reason: "node 1 (host h1, agent n1) was lost".into(),
            node_id: "n1".into(),
            stderr_tail: "not ours".into(),
            ..Default::default()
        };
        use pb::generation_ended::Cause;
        for (v, expected) in [
            (
                ended(Some(failed.clone()), Cause::Failed),
                "muster-agent: job j: rank 3 (node 1, host h1) of generation 2 exited with status 3; restarting (restart 2 of 3); joining again\n\
                 muster-agent: error: ValueError: boom\n\
                 \x20   more\n\
                 muster-agent: last stderr lines of rank 3:\n\
                 \x20   Traceback (most recent call last):\n\
                 \x20     File \"t.py\"\n\
                 \x20   ValueError: boom\n",
            ),
            (
                ended(Some(lost), Cause::Failed),
                "muster-agent: job j: node 1 (host h1, agent n1) was lost; restarting (restart 2 of 3); joining again\n",
            ),
            (
                ended(Some(failed), Cause::Superseded),
                "muster-agent: job j: node 1 joined; joining again\n    second line\n",
            ),
        ] {
            assert_eq!(rejoin_message("j", &v), expected);
        }
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
