//! `muster-agent launch`: find or start the coordinator, join the job's rendezvous, spawn the
//! node's workers with the contract's environment, and supervise them until they all exit,
//! one fails, or the agent is told to stop.
//!
//! Stopping workers always goes the same way: SIGTERM to each worker's process group, the
//! grace period, then SIGKILL to the groups still alive. After a worker fails, the others
//! first get [`FAILURE_SETTLE`] to end on their own: they learn of the failure from the
//! coordinator and can say why they stop before the agent signals them.

use crate::cli::LaunchSpec;
use crate::env::{NodeAssignment, worker_env};
use crate::relay::Relay;
use crate::worker::{Exit, Worker};
use futures::StreamExt;
use futures::stream::FuturesUnordered;
use muster_proto::v1 as pb;
use muster_proto::v1::key_value_client::KeyValueClient;
use muster_proto::v1::rendezvous_client::RendezvousClient;
use nix::sys::signal::Signal;
use std::fmt::Write as _;
use std::net::SocketAddr;
use std::pin::Pin;
use std::time::{Duration, Instant};
use tokio::net::{TcpListener, TcpSocket};
use tokio::signal::unix::{SignalKind, signal};
use tokio::task::JoinHandle;
use tonic::transport::{Channel, Endpoint};

/// How long the agent keeps trying to reach a coordinator that is not up yet.
pub const CONNECT_WINDOW: Duration = Duration::from_secs(10);
/// After this long in the rendezvous the agent says what it is waiting for.
pub const WAITING_NOTICE: Duration = Duration::from_secs(1);
/// The most time a failure report may take; it is best effort.
pub const REPORT_TIMEOUT: Duration = Duration::from_secs(1);
/// After a worker fails, how long the others get to end on their own before SIGTERM (capped
/// by the grace period).
pub const FAILURE_SETTLE: Duration = Duration::from_millis(500);
/// How long a node other than node 0 waits for node 0's MASTER_PORT.
const MASTER_PORT_WAIT: Duration = Duration::from_secs(60);

/// How a launch ended; [`Outcome::exit_code`] is the agent's exit status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// Every worker exited 0.
    Succeeded,
    /// A worker failed; the others were stopped.
    Failed,
    /// The agent got this signal and stopped the workers.
    Interrupted(Signal),
}

impl Outcome {
    /// 0, 1, or 128 + the signal number (130 for SIGINT, 143 for SIGTERM).
    pub fn exit_code(self) -> u8 {
        match self {
            Self::Succeeded => 0,
            Self::Failed => 1,
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
    /// The coordinator address is not usable as an endpoint.
    #[error("bad coordinator address '{addr}': {}", chain(source))]
    Address {
        /// The address.
        addr: String,
        /// Why.
        #[source]
        source: tonic::transport::Error,
    },
    /// The coordinator could not be reached within [`CONNECT_WINDOW`].
    #[error("cannot reach the coordinator at {addr}: {}", chain(source))]
    Connect {
        /// The address.
        addr: String,
        /// The last connection error.
        #[source]
        source: tonic::transport::Error,
    },
    /// The coordinator refused or failed the rendezvous.
    #[error("rendezvous of job '{job}' failed: {}", .status.message())]
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

/// Runs a launch to its end. Prints the agent's status lines (`muster-agent: ...`) on stderr;
/// the workers' output goes to stdout and stderr under `[rank R] ` prefixes.
pub async fn run(spec: LaunchSpec) -> Result<Outcome, LaunchError> {
    let started = Instant::now();
    let mut signals = Signals::new().map_err(LaunchError::Signals)?;

    let (coordinator, default_host) = match &spec.coordinator {
        Some(addr) => (addr.clone(), hostname()),
        None => (start_embedded()?, "127.0.0.1".to_owned()),
    };
    let host = spec.host.clone().unwrap_or(default_host);

    let job = &spec.job_id;
    let channel = match waiting(connect(&coordinator), &mut signals, || {
        format!("muster-agent: waiting for the coordinator at {coordinator} (job {job})")
    })
    .await
    {
        Waited::Done(channel) => channel?,
        Waited::Signal(sig) => return Ok(interrupted_early(job, sig)),
    };
    let node = match waiting(join(&spec, channel.clone(), &coordinator, &host), &mut signals, || {
        format!(
            "muster-agent: waiting for nodes (job {job}, --nnodes {}:{}, coordinator {coordinator})",
            spec.nodes.min, spec.nodes.max
        )
    })
    .await
    {
        Waited::Done(node) => node?,
        Waited::Signal(sig) => return Ok(interrupted_early(job, sig)),
    };
    tracing::debug!(?node, "rendezvous closed");

    // The relay lives exactly as long as this generation's workers: dropping it (below, or
    // on any early return) stops its thread and removes its socket directory.
    let mut node = node;
    let relay = if spec.relay {
        start_relay(&node).await
    } else {
        None
    };
    node.agent_socket = relay.as_ref().map(|r| r.socket().to_owned());
    let outcome = Supervisor::new(&spec, channel, node, signals)
        .run(started)
        .await;
    drop(relay);
    Ok(outcome)
}

/// Starts the node relay; if it cannot start, says why and returns `None`: the workers then
/// send their barriers over their own coordinator sessions, which is slower but equivalent.
async fn start_relay(node: &NodeAssignment) -> Option<Relay> {
    match Relay::start(node).await {
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

/// Awaits `fut` unless a stopping signal comes first; prints `notice()` once if it takes
/// longer than [`WAITING_NOTICE`].
async fn waiting<T>(
    fut: impl Future<Output = T>,
    signals: &mut Signals,
    notice: impl FnOnce() -> String,
) -> Waited<T> {
    tokio::pin!(fut);
    let timer = tokio::time::sleep(WAITING_NOTICE);
    tokio::pin!(timer);
    let mut notice = Some(notice);
    loop {
        tokio::select! {
            out = &mut fut => return Waited::Done(out),
            sig = signals.recv() => return Waited::Signal(sig),
            () = &mut timer, if notice.is_some() => {
                if let Some(text) = notice.take() {
                    eprintln!("{}", text());
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

/// Binds 127.0.0.1:0 and serves a coordinator there for as long as the agent runs; returns
/// its address.
fn start_embedded() -> Result<String, LaunchError> {
    let listener = nodelay_listener().map_err(LaunchError::Embedded)?;
    let addr = listener.local_addr().map_err(LaunchError::Embedded)?;
    // Task "embedded-coordinator": on error, log it (the rendezvous then fails and says so);
    // on shutdown, dropped with the runtime when the agent exits (its only clients are this
    // agent and its workers, which are gone by then).
    tokio::spawn(async move {
        let config = muster_coordinator::Config::default();
        if let Err(e) = muster_coordinator::serve(listener, config, std::future::pending()).await {
            tracing::error!(%e, "embedded coordinator failed");
        }
    });
    Ok(addr.to_string())
}

/// A listener on 127.0.0.1:0 with TCP_NODELAY set, which Linux passes on to every accepted
/// connection. `muster_coordinator::serve` does not set it on the connections it accepts, and
/// without it each answer of more than one write waits ~40 ms for a delayed ACK.
fn nodelay_listener() -> std::io::Result<TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_nodelay(true)?;
    socket.bind(SocketAddr::from(([127, 0, 0, 1], 0)))?;
    socket.listen(1024)
}

/// Joins the round and settles MASTER_PORT. Cancel-safe: dropping it withdraws the join
/// (the coordinator sees the call go away).
async fn join(
    spec: &LaunchSpec,
    channel: Channel,
    coordinator: &str,
    host: &str,
) -> Result<NodeAssignment, LaunchError> {
    let request = pb::JoinRequest {
        job_id: spec.job_id.clone(),
        node_id: format!("{}-{}", sanitize(&hostname()), std::process::id()),
        host: host.to_owned(),
        local_world_size: spec.nproc_per_node,
        requested_node_rank: spec.node_rank,
        config: Some(pb::RendezvousConfig {
            min_nodes: spec.nodes.min,
            max_nodes: spec.nodes.max,
            last_call_ms: 0,
            join_timeout_ms: 0,
        }),
    };
    let join_error = |status| LaunchError::Join {
        job: spec.job_id.clone(),
        status,
    };
    let answer = RendezvousClient::new(channel.clone())
        .join(request)
        .await
        .map_err(join_error)?
        .into_inner();
    if answer.local_world_size != spec.nproc_per_node {
        return Err(join_error(tonic::Status::internal(format!(
            "the coordinator assigned {} workers to this node, which runs {}",
            answer.local_world_size, spec.nproc_per_node
        ))));
    }
    let master_port =
        master_port(&channel, &answer)
            .await
            .map_err(|why| LaunchError::MasterPort {
                job: spec.job_id.clone(),
                why,
            })?;
    let node = NodeAssignment {
        coordinator: coordinator.to_owned(),
        job_id: answer.job_id,
        generation: answer.generation,
        node_rank: answer.node_rank,
        num_nodes: answer.num_nodes,
        rank_offset: answer.rank_offset,
        local_world_size: answer.local_world_size,
        world_size: answer.world_size,
        restart_count: answer.restart_count,
        max_restarts: spec.max_restarts,
        host: host.to_owned(),
        master_addr: answer.master_host,
        master_port,
        agent_socket: None,
    };
    Ok(node)
}

/// Connects to the coordinator, retrying for [`CONNECT_WINDOW`] while it is not up.
async fn connect(addr: &str) -> Result<Channel, LaunchError> {
    let endpoint = Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|source| LaunchError::Address {
            addr: addr.to_owned(),
            source,
        })?
        .connect_timeout(Duration::from_secs(2))
        .tcp_nodelay(true);
    let deadline = tokio::time::Instant::now() + CONNECT_WINDOW;
    let mut backoff = Duration::from_millis(20);
    loop {
        match endpoint.connect().await {
            Ok(channel) => return Ok(channel),
            Err(source) if tokio::time::Instant::now() + backoff >= deadline => {
                return Err(LaunchError::Connect {
                    addr: addr.to_owned(),
                    source,
                });
            }
            Err(e) => {
                tracing::debug!(%e, addr, "coordinator not reachable yet; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_millis(500));
            }
        }
    }
}

/// MASTER_PORT: node 0 finds a free port (bind :0, close) and, in a multi-node job, shares it
/// through the job's key-value store; the other nodes read it from there.
async fn master_port(channel: &Channel, answer: &pb::JoinResponse) -> Result<u16, String> {
    let key = format!("muster/master_port/gen{}", answer.generation);
    if answer.node_rank == 0 {
        let port = std::net::TcpListener::bind(("0.0.0.0", 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        if answer.num_nodes > 1 {
            KeyValueClient::new(channel.clone())
                .set(pb::SetRequest {
                    job_id: answer.job_id.clone(),
                    key,
                    value: port.to_string().into_bytes(),
                })
                .await
                .map_err(|s| s.message().to_owned())?;
        }
        return Ok(port);
    }
    let value = KeyValueClient::new(channel.clone())
        .get(pb::GetRequest {
            job_id: answer.job_id.clone(),
            key: key.clone(),
            wait_ms: u64::try_from(MASTER_PORT_WAIT.as_millis()).unwrap_or(u64::MAX),
        })
        .await
        .map_err(|s| format!("node 0 did not publish it: {}", s.message()))?
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

/// Runs the node's workers and decides the outcome.
struct Supervisor<'a> {
    spec: &'a LaunchSpec,
    node: NodeAssignment,
    client: RendezvousClient<Channel>,
    signals: Signals,
    workers: Vec<Worker>,
    exits: FuturesUnordered<ExitFuture>,
    stop: Stop,
    /// The first failure: the job's root cause.
    failure: Option<Exit>,
    /// Set when a worker could not even be started.
    spawn_error: Option<String>,
    interrupted: Option<Signal>,
    report: Option<JoinHandle<()>>,
}

impl<'a> Supervisor<'a> {
    fn new(spec: &'a LaunchSpec, channel: Channel, node: NodeAssignment, signals: Signals) -> Self {
        Self {
            spec,
            node,
            client: RendezvousClient::new(channel),
            signals,
            workers: Vec::with_capacity(spec.nproc_per_node as usize),
            exits: FuturesUnordered::new(),
            stop: Stop::No,
            failure: None,
            spawn_error: None,
            interrupted: None,
            report: None,
        }
    }

    async fn run(mut self, started: Instant) -> Outcome {
        self.spawn_all();
        let spawned = self.workers.len();
        while !self.exits.is_empty() {
            let deadline = self.stop.deadline();
            tokio::select! {
                Some(exit) = self.exits.next() => self.on_exit(exit),
                sig = self.signals.recv() => self.on_signal(sig),
                () = sleep_until(deadline), if deadline.is_some() => self.on_deadline(),
            }
        }
        if let Some(report) = self.report.take() {
            // The task bounds itself by REPORT_TIMEOUT.
            let _ = report.await;
        }
        let job = &self.spec.job_id;
        if let Some(sig) = self.interrupted {
            eprintln!(
                "muster-agent: job {job}: stopped {} after {}",
                workers(spawned),
                sig.as_str()
            );
            return Outcome::Interrupted(sig);
        }
        if let Some(failure) = &self.failure {
            eprint!("{}", failure_summary(job, failure));
            return Outcome::Failed;
        }
        if let Some(why) = &self.spawn_error {
            eprintln!("muster-agent: job {job} failed: {why}");
            return Outcome::Failed;
        }
        eprintln!(
            "muster-agent: job {job}: {} exited 0 in {:.2}s",
            workers(spawned),
            started.elapsed().as_secs_f64()
        );
        Outcome::Succeeded
    }

    fn spawn_all(&mut self) {
        let inherited = |name: &str| std::env::var_os(name).is_some();
        for local_rank in 0..self.spec.nproc_per_node {
            let rank = self.node.rank_offset + local_rank;
            let env = worker_env(&self.node, local_rank, inherited);
            match Worker::spawn(&self.spec.program, &env, rank, local_rank) {
                Ok((worker, exit)) => {
                    self.workers.push(worker);
                    self.exits.push(Box::pin(exit));
                }
                Err(e) => {
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
        if exit.success() {
            return;
        }
        let stopping = !matches!(self.stop, Stop::No);
        if stopping || self.interrupted.is_some() || self.failure.is_some() {
            // A consequence of the first failure or of our own signals.
            tracing::debug!(rank = exit.rank, reason = %exit.reason(), "worker ended while stopping");
            return;
        }
        let running = self.workers.iter().filter(|w| !w.exited()).count();
        if running > 0 {
            eprintln!(
                "muster-agent: rank {} (local rank {}) {}; stopping the other {}",
                exit.rank,
                exit.local_rank,
                exit.reason(),
                workers(running)
            );
        }
        self.report = Some(self.report_failure(&exit));
        self.failure = Some(exit);
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

    /// Tells the coordinator (best effort, bounded by [`REPORT_TIMEOUT`]).
    fn report_failure(&self, exit: &Exit) -> JoinHandle<()> {
        let mut client = self.client.clone();
        let request = pb::ReportFailureRequest {
            job_id: self.node.job_id.clone(),
            generation: self.node.generation,
            rank: exit.rank,
            reason: exit.reason(),
            exit_code: exit.code(),
            signal: exit.signal(),
            stderr_tail: exit.stderr_tail.join("\n"),
        };
        // Task "report-failure": on error, log and continue (the coordinator also learns of
        // the failure from the worker's session); awaited, bounded, before the agent exits.
        tokio::spawn(async move {
            match tokio::time::timeout(REPORT_TIMEOUT, client.report_failure(request)).await {
                Ok(Ok(_)) => {}
                Ok(Err(status)) => tracing::debug!(%status, "failure report refused"),
                Err(_) => tracing::debug!("failure report timed out"),
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

/// "1 worker", "4 workers".
fn workers(n: usize) -> String {
    if n == 1 {
        "1 worker".to_owned()
    } else {
        format!("{n} workers")
    }
}

/// The lines printed when a job fails: the root cause, then its last stderr lines.
fn failure_summary(job: &str, failure: &Exit) -> String {
    let mut text = format!(
        "muster-agent: job {job} failed: rank {} (local rank {}) {}\n",
        failure.rank,
        failure.local_rank,
        failure.reason()
    );
    if failure.stderr_tail.is_empty() {
        let _ = writeln!(
            text,
            "muster-agent: rank {} wrote nothing to stderr",
            failure.rank
        );
    } else {
        let _ = writeln!(
            text,
            "muster-agent: last stderr lines of rank {}:",
            failure.rank
        );
        for line in &failure.stderr_tail {
            let _ = writeln!(text, "    {line}");
        }
    }
    text
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
    use std::os::unix::process::ExitStatusExt;
    use std::process::ExitStatus;

    #[test]
    fn exit_codes() {
        assert_eq!(Outcome::Succeeded.exit_code(), 0);
        assert_eq!(Outcome::Failed.exit_code(), 1);
        assert_eq!(Outcome::Interrupted(Signal::SIGINT).exit_code(), 130);
        assert_eq!(Outcome::Interrupted(Signal::SIGTERM).exit_code(), 143);
    }

    #[test]
    fn summaries() {
        let exit = |raw, tail: &[&str]| Exit {
            rank: 5,
            local_rank: 1,
            status: Ok(ExitStatus::from_raw(raw)),
            stderr_tail: tail.iter().map(|s| (*s).to_owned()).collect(),
        };
        assert_eq!(
            failure_summary("j", &exit(3 << 8, &["Traceback", "boom"])),
            "muster-agent: job j failed: rank 5 (local rank 1) exited with status 3\n\
             muster-agent: last stderr lines of rank 5:\n    Traceback\n    boom\n"
        );
        assert_eq!(
            failure_summary("j", &exit(9, &[])),
            "muster-agent: job j failed: rank 5 (local rank 1) killed by signal 9 (SIGKILL)\n\
             muster-agent: rank 5 wrote nothing to stderr\n"
        );
    }

    #[test]
    fn node_ids() {
        assert_eq!(sanitize("gpu-01.example.com"), "gpu-01.example.com");
        assert_eq!(sanitize("a b:c"), "a-b-c");
    }
}
