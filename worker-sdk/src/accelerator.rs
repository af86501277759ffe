//! The synchronous, Accelerate-shaped API that training scripts use: ranks, barriers,
//! main-process-first, compute-once-and-share, NCCL unique ids and the key-value store.
//!
//! It owns a small tokio runtime (one worker thread) that runs the session's background task;
//! each method blocks the calling thread on that runtime. It is therefore meant for
//! synchronous code: calling it from inside an async runtime panics (as `block_on` does).
//! Barriers are the exception under `muster-agent`: with `MUSTER_AGENT_SOCKET` set they go to
//! the agent's relay with blocking socket I/O on the calling thread ([`crate::relay`]) and
//! never touch the runtime.
//! Async code uses [`crate::client`] directly.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    future::Future,
    panic::Location,
    path::PathBuf,
    sync::{
        Mutex, MutexGuard, OnceLock, PoisonError,
        atomic::{AtomicBool, AtomicU64},
    },
    time::Duration,
};

use muster_proto::NCCL_UNIQUE_ID_BYTES;
use serde::{Serialize, de::DeserializeOwned};

use crate::{
    Error, RankInfo,
    client::{
        CasOutcome, ClientSecurity, Coordinator, Kv, KvLane, QUORUM_POLL, Quorum, QuorumAsk, Scope,
        Session, SessionConfig, SharedValues, UniqueIds,
    },
    env::{Recovery, RecoveryEnv},
    membership::Membership,
    relay::RelayConn,
};

/// The longest shared-value name the coordinator accepts.
const MAX_SHARED_NAME: usize = 256;
/// How long dropping an `Accelerator` waits for `leave` to go through.
const DROP_LEAVE_GRACE: Duration = Duration::from_secs(2);

/// A training process's handle on the job, modelled on Hugging Face Accelerate's
/// `Accelerator`: who am I, wait for the others, let the main process go first, share a value,
/// distribute an NCCL unique id.
///
/// Without a coordinator (single-process mode, `MUSTER_COORDINATOR` unset) every call succeeds
/// locally without any network: barriers return at once, `*_share` runs the closure, the
/// key-value store is an in-memory map of this process, and fetching a unique id that was never
/// published, or waiting for a key that is not set, fails with [`Error::NotFound`] instead of
/// hanging (nothing else could ever publish it).
///
/// Dropping it sends `leave` (best effort), so other ranks learn that this one finished;
/// [`Accelerator::finish`] does the same and reports errors. A drop during a panic skips
/// `leave`, so the coordinator sees the rank fail at once.
pub struct Accelerator {
    info: RankInfo,
    /// The job's recovery mode and, for a replacement, the epoch it was spawned for.
    recovery: RecoveryEnv,
    /// Where this process stands in the job's membership (in-place recovery).
    pub(crate) membership: MembershipState,
    backend: Backend,
    /// Per-name call counters for shared values, so that calls from one line in a loop get
    /// distinct names.
    share_calls: Mutex<HashMap<String, u64>>,
}

/// What [`Membership`] reads and updates: atomics only, so that its per-step check takes no
/// lock.
#[derive(Debug)]
pub(crate) struct MembershipState {
    /// The epoch of the last quorum this process took part in (a replacement: the epoch it
    /// was spawned for, until its first quorum).
    pub(crate) current: AtomicU64,
    /// Set in a replacement until its first quorum: it has no state and no place in the
    /// barrier sequences yet.
    pub(crate) awaiting_first: AtomicBool,
}

enum Backend {
    Local(Mutex<LocalStore>),
    Remote(Box<Remote>),
}

/// What single-process mode keeps instead of a coordinator.
#[derive(Default)]
struct LocalStore {
    kv: BTreeMap<String, Vec<u8>>,
    unique_ids: HashMap<String, [u8; NCCL_UNIQUE_ID_BYTES]>,
}

struct Remote {
    /// `None` once finished.
    session: Option<Session>,
    /// The agent's relay, which carries every barrier when present. Empty without
    /// `MUSTER_AGENT_SOCKET`, once finished, and in a replacement until its first quorum
    /// (`relay_pending`).
    pub(crate) relay: OnceLock<RelayConn>,
    /// A replacement's relay socket: it registers there after its first quorum, resuming the
    /// node's barrier sequence from the quorum's released seqs.
    pub(crate) relay_pending: Option<PathBuf>,
    kv: Kv,
    /// The process's lane for key-value mutations that are not safe to repeat (a non-zero
    /// add, a compare-and-set): retried across a leader failover and applied once. One lane
    /// per process, so its calls take turns.
    kv_lane: Mutex<KvLane>,
    unique_ids: UniqueIds,
    shared: SharedValues,
    /// `None` only while dropping. Declared last so the clients above drop first.
    runtime: Option<tokio::runtime::Runtime>,
}

impl fmt::Debug for Accelerator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Accelerator")
            .field("info", &self.info)
            .finish_non_exhaustive()
    }
}

impl Accelerator {
    /// Reads the `MUSTER_*` environment, connects to the coordinator (with TLS and the
    /// credentials of `MUSTER_TLS_*` and `MUSTER_TOKEN`, see [`crate::env`]) and registers
    /// this rank (or runs as a single process when there is no `MUSTER_COORDINATOR`). Installs
    /// the panic hook that writes the worker's error file ([`crate::install_error_hook`])
    /// first.
    pub fn from_env() -> Result<Self, Error> {
        crate::install_error_hook();
        Self::new(RankInfo::from_env()?)
    }

    /// Builds an accelerator for `info` (a coordinator address means connect and register).
    /// Checks that the coordinator's view of the generation matches `info`. With a
    /// coordinator, TLS and credentials come from the environment (`MUSTER_TLS_*`,
    /// `MUSTER_TOKEN`: [`crate::env::security_from_env`]).
    pub fn new(info: RankInfo) -> Result<Self, Error> {
        let security = if info.is_distributed() {
            crate::env::security_from_env()?
        } else {
            ClientSecurity::plaintext()
        };
        Self::with_security(info, security)
    }

    /// Like [`Accelerator::new`], with explicit TLS settings and credentials instead of the
    /// environment's (unused in single-process mode).
    pub fn with_security(info: RankInfo, security: ClientSecurity) -> Result<Self, Error> {
        let recovery = if info.is_distributed() {
            RecoveryEnv::from_env()?
        } else {
            RecoveryEnv::default()
        };
        Self::with_recovery(info, security, recovery)
    }

    /// Like [`Accelerator::with_security`], with the recovery settings given instead of read
    /// from `MUSTER_RECOVERY` and `MUSTER_EPOCH` (tests run ranks as threads of one process).
    /// A nonzero `recovery.epoch` registers this process as the replacement of its rank, which
    /// the coordinator accepts only while that rank awaits one.
    pub fn with_recovery(
        info: RankInfo,
        security: ClientSecurity,
        recovery: RecoveryEnv,
    ) -> Result<Self, Error> {
        info.validate()?;
        let Some(addr) = info.coordinator.clone() else {
            return Ok(Self::with_backend(
                info,
                RecoveryEnv::default(),
                Backend::Local(Mutex::default()),
            ));
        };
        if tokio::runtime::Handle::try_current().is_ok() {
            return Err(Error::Usage(
                "Accelerator blocks on its own runtime and cannot be created inside an async \
                 runtime; use muster::client::Session from async code"
                    .to_owned(),
            ));
        }
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .thread_name("muster-sdk")
            .enable_all()
            .build()
            .map_err(|e| Error::Config(format!("cannot start the muster SDK runtime: {e}")))?;
        let config = SessionConfig {
            job_id: info.job_id.clone(),
            generation: info.generation,
            rank: info.rank,
            pid: std::process::id(),
            host: info.host.clone(),
        };
        let session = runtime.block_on(async {
            let coordinator = Coordinator::connect_with(&addr, security).await?;
            Session::attach_replacement(&coordinator, config, recovery.epoch).await
        })?;
        let registration = *session.registration();
        let expected = (info.world_size, info.node_rank, info.num_nodes);
        let got = (
            registration.world_size,
            registration.node_rank,
            registration.num_nodes,
        );
        // A coordinator that leaves these at zero has no opinion.
        if registration.world_size != 0 && expected != got {
            return Err(Error::Config(format!(
                "the environment says rank {} is on node {} of {} with {} ranks in all, but the \
                 coordinator at {addr} says node {} of {} with {} ranks",
                info.rank, info.node_rank, info.num_nodes, info.world_size, got.1, got.2, got.0
            )));
        }
        // After the session: the coordinator accepts relayed entries only of registered ranks.
        // A replacement registers with the relay after its first quorum, which says where
        // the node's barrier sequence is.
        let relay = OnceLock::new();
        let mut relay_pending = None;
        match &info.agent_socket {
            Some(path) if recovery.is_replacement() => relay_pending = Some(path.clone()),
            Some(path) => {
                let _ = relay.set(RelayConn::connect(path, session.config())?);
            }
            None => {}
        }
        let kv = session.kv();
        let remote = Remote {
            kv_lane: Mutex::new(kv.lane()),
            kv,
            unique_ids: session.unique_ids(),
            shared: session.shared_values(),
            session: Some(session),
            relay,
            relay_pending,
            runtime: Some(runtime),
        };
        Ok(Self::with_backend(
            info,
            recovery,
            Backend::Remote(Box::new(remote)),
        ))
    }

    fn with_backend(info: RankInfo, recovery: RecoveryEnv, backend: Backend) -> Self {
        Self {
            info,
            membership: MembershipState {
                current: AtomicU64::new(recovery.epoch),
                awaiting_first: AtomicBool::new(recovery.is_replacement()),
            },
            recovery,
            backend,
            share_calls: Mutex::default(),
        }
    }

    /// The job's recovery mode (`MUSTER_RECOVERY`): what a rank's death does.
    pub fn recovery(&self) -> Recovery {
        self.recovery.mode
    }

    /// The membership epoch this process was spawned for (`MUSTER_EPOCH`): 0 for a worker of
    /// the generation's first membership, more for a replacement of a rank that died in
    /// place.
    pub fn spawn_epoch(&self) -> u64 {
        self.recovery.epoch
    }

    /// Whether this process replaces a rank that died (a nonzero [`Accelerator::spawn_epoch`]):
    /// it calls [`Membership::quorum`] with no step before anything else, and heals.
    pub fn is_replacement(&self) -> bool {
        self.recovery.is_replacement()
    }

    /// The membership epoch of the last quorum this process took part in (0 before any; a
    /// replacement's spawn epoch before its first): the epoch new communicators are built for.
    pub fn epoch(&self) -> u64 {
        self.membership().epoch()
    }

    /// In-place recovery's step-boundary handle: [`Membership::changed`] (the per-step check,
    /// atomic loads only) and [`Membership::quorum`].
    pub fn membership(&self) -> Membership<'_> {
        Membership::new(self)
    }

    /// Where this process sits in the job.
    pub fn info(&self) -> &RankInfo {
        &self.info
    }

    /// Whether there is a coordinator (several processes) rather than single-process mode.
    pub fn is_distributed(&self) -> bool {
        self.info.is_distributed()
    }

    /// This process's global rank (Accelerate's `process_index`).
    pub fn process_index(&self) -> usize {
        self.info.rank as usize
    }

    /// This process's rank on its node (Accelerate's `local_process_index`).
    pub fn local_process_index(&self) -> usize {
        self.info.local_rank as usize
    }

    /// The number of processes in the job (Accelerate's `num_processes`).
    pub fn num_processes(&self) -> usize {
        self.info.world_size as usize
    }

    /// The number of processes on this node (the local world size).
    pub fn local_num_processes(&self) -> usize {
        self.info.local_world_size as usize
    }

    /// This node's rank (Accelerate's `machine_rank`).
    pub fn node_rank(&self) -> usize {
        self.info.node_rank as usize
    }

    /// The number of nodes (Accelerate's `num_machines`).
    pub fn num_nodes(&self) -> usize {
        self.info.num_nodes as usize
    }

    /// Whether this is global rank 0, the one process that saves checkpoints and logs.
    pub fn is_main_process(&self) -> bool {
        self.info.rank == 0
    }

    /// Whether this is local rank 0, the one process per machine for machine-local work
    /// (downloads into a local cache, printing).
    pub fn is_local_main_process(&self) -> bool {
        self.info.local_rank == 0
    }

    /// Whether this is the last global rank.
    pub fn is_last_process(&self) -> bool {
        self.info.rank + 1 == self.info.world_size
    }

    /// The restart round this process belongs to (from 1).
    pub fn generation(&self) -> u64 {
        self.info.generation
    }

    /// The job id.
    pub fn job_id(&self) -> &str {
        &self.info.job_id
    }

    /// How many times the job has been restarted (0 in the first generation); a script can
    /// use it to resume from its last checkpoint.
    pub fn restart_count(&self) -> u32 {
        self.info.restart_count
    }

    /// Marks the start of training step `step`, for the job's effective training time (ETTR,
    /// in `describe` and the metrics): rank 0's markers are sent to the coordinator (a message
    /// on its session, no wait); other ranks' and a single process's cost nothing. A step
    /// counts when the next marker names a higher step than any before; a step begun again
    /// (after an in-place recovery) or redone (after a restart from a checkpoint) is time lost.
    pub fn begin_step(&self, step: u64) {
        if self.info.rank == 0
            && let Some(session) = self.session()
        {
            session.step_begun(step);
        }
    }

    /// Says that this rank finished healing for the quorum of membership epoch `epoch`, for
    /// the recovery's timeline (`describe`): [`crate::comm::Communicator::heal`] says it itself;
    /// a loop that heals by other means (`muster.torch.heal` over `torch.distributed`) calls
    /// this once the state is received. No answer and no wait.
    pub fn healed(&self, epoch: u64) {
        if let Some(session) = self.session() {
            session.reports().healed(epoch);
        }
    }

    /// The async session underneath (`None` in single-process mode), for code that mixes this
    /// API with [`crate::client`]. Under an agent relay (`MUSTER_AGENT_SOCKET`) this
    /// accelerator's barriers go through the relay; do not also call
    /// [`Session::barrier`] on this session, since the ranks of a node must all use one path.
    pub fn session(&self) -> Option<&Session> {
        match &self.backend {
            Backend::Remote(remote) => remote.session.as_ref(),
            Backend::Local(_) => None,
        }
    }

    /// Blocks until every process reaches this call (Accelerate's `wait_for_everyone`). The
    /// barrier is named after the caller's `file:line`, so ranks arriving from different lines
    /// get [`Error::Diverged`] instead of a silent mismatch.
    #[track_caller]
    pub fn wait_for_everyone(&self) -> Result<(), Error> {
        let name = call_site(Location::caller());
        self.barrier(Scope::Global, &name, None)
    }

    /// [`Accelerator::wait_for_everyone`] under an explicit name (for barriers reached from
    /// different lines on purpose).
    pub fn wait_for_everyone_named(&self, name: &str) -> Result<(), Error> {
        self.barrier(Scope::Global, name, None)
    }

    /// [`Accelerator::wait_for_everyone`] that gives up after `timeout` with an
    /// [`Error::Timeout`] listing the ranks (and hosts) that had not arrived. Calling it again
    /// from the same line retries the same barrier.
    #[track_caller]
    pub fn wait_for_everyone_timeout(&self, timeout: Duration) -> Result<(), Error> {
        let name = call_site(Location::caller());
        self.barrier(Scope::Global, &name, Some(timeout))
    }

    /// Blocks until every process of this node reaches this call.
    #[track_caller]
    pub fn wait_for_local(&self) -> Result<(), Error> {
        let name = call_site(Location::caller());
        self.barrier(Scope::Node, &name, None)
    }

    /// A barrier of `scope` under an explicit name, with an optional deadline: what
    /// [`Accelerator::wait_for_everyone`] and [`Accelerator::wait_for_local`] do with the
    /// caller's `file:line`, for callers that name their own call sites (the Python SDK names
    /// them after the Python caller's file and line).
    pub fn barrier_named(
        &self,
        scope: Scope,
        name: &str,
        timeout: Option<Duration>,
    ) -> Result<(), Error> {
        self.barrier(scope, name, timeout)
    }

    fn barrier(&self, scope: Scope, name: &str, timeout: Option<Duration>) -> Result<(), Error> {
        match &self.backend {
            Backend::Local(_) => Ok(()),
            Backend::Remote(remote) => {
                let session = remote.session()?;
                if let Some(path) = &remote.relay_pending
                    && remote.relay.get().is_none()
                {
                    return Err(Error::Usage(format!(
                        "this process replaces rank {} and has no place in the barrier sequence \
                         yet: call membership().quorum(None) before its first barrier (it then \
                         registers with the agent relay at {})",
                        self.info.rank,
                        path.display()
                    )));
                }
                match remote.relay.get() {
                    // The same `muster.barrier` span as a session barrier's; its trace
                    // context goes with the entry to the agent, which passes it on to the
                    // coordinator.
                    Some(relay) => tracing::info_span!(
                        "muster.barrier",
                        otel.kind = "client",
                        scope = ?scope,
                        name,
                        relayed = true,
                    )
                    .in_scope(|| relay.barrier(scope, name, timeout)),
                    None => remote.block_on(
                        || format!("barrier '{name}'"),
                        session.barrier(scope, name, timeout),
                    ),
                }
            }
        }
    }

    /// Runs `f` on the main process first, then on every other process (Accelerate's
    /// `main_process_first`): the others wait at a barrier while the main process runs `f`, and
    /// run `f` themselves once it is done — typically to load what the main process cached.
    /// Every process runs `f`; if the main process fails inside `f`, the others get its
    /// failure instead of running `f`.
    #[track_caller]
    pub fn main_process_first<T>(&self, f: impl FnOnce() -> T) -> Result<T, Error> {
        let name = call_site(Location::caller());
        self.goes_first(Scope::Global, self.is_main_process(), &name, f)
    }

    /// Like [`Accelerator::main_process_first`] per node: the local main process of each node
    /// runs `f` first, then the other processes of that node.
    #[track_caller]
    pub fn local_main_process_first<T>(&self, f: impl FnOnce() -> T) -> Result<T, Error> {
        let name = call_site(Location::caller());
        self.goes_first(Scope::Node, self.is_local_main_process(), &name, f)
    }

    fn goes_first<T>(
        &self,
        scope: Scope,
        first: bool,
        name: &str,
        f: impl FnOnce() -> T,
    ) -> Result<T, Error> {
        if first {
            let value = f();
            self.barrier(scope, name, None)?;
            Ok(value)
        } else {
            self.barrier(scope, name, None)?;
            Ok(f())
        }
    }

    /// Computes `f` once on the main process and hands its result to every process: the others
    /// never call `f`, they receive the main process's value (as JSON, through the
    /// coordinator) — for results that are cheap to send but expensive to compute. The others
    /// wait as long as it takes, unless the generation fails, in which case they get the
    /// failure. Calls are told apart by call site and by a per-call-site counter, so every
    /// process must make the same calls in the same order.
    #[track_caller]
    pub fn main_process_first_share<T>(&self, f: impl FnOnce() -> T) -> Result<T, Error>
    where
        T: Serialize + DeserializeOwned,
    {
        let site = call_site(Location::caller());
        self.share(Scope::Global, &site, self.is_main_process(), f)
    }

    /// Like [`Accelerator::main_process_first_share`] per node: each node's local main
    /// process computes `f` and shares it with the processes of its node.
    #[track_caller]
    pub fn local_main_process_first_share<T>(&self, f: impl FnOnce() -> T) -> Result<T, Error>
    where
        T: Serialize + DeserializeOwned,
    {
        let site = call_site(Location::caller());
        self.share(Scope::Node, &site, self.is_local_main_process(), f)
    }

    fn share<T>(
        &self,
        scope: Scope,
        site: &str,
        publisher: bool,
        f: impl FnOnce() -> T,
    ) -> Result<T, Error>
    where
        T: Serialize + DeserializeOwned,
    {
        let Backend::Remote(remote) = &self.backend else {
            return Ok(f());
        };
        let name = self.shared_name(scope, site);
        let what = || format!("shared value '{name}'");
        if publisher {
            let value = f();
            let bytes = serde_json::to_vec(&value).map_err(|source| Error::Serialization {
                what: what(),
                source,
            })?;
            remote.block_on(what, remote.shared.publish(&name, bytes))?;
            Ok(value)
        } else {
            let bytes = remote.block_on(what, remote.shared.fetch(&name, None))?;
            serde_json::from_slice(&bytes).map_err(|source| Error::Serialization {
                what: what(),
                source,
            })
        }
    }

    /// The publishing half of [`Accelerator::main_process_first_share`] (scope `Global`) or
    /// [`Accelerator::local_main_process_first_share`] (`Node`) for callers that name their
    /// call site and encode the value themselves (the Python SDK pickles it): called by the
    /// process that computed `bytes`. Calls are counted per call site, as the typed ones are.
    pub fn share_publish(
        &self,
        scope: Scope,
        call_site: &str,
        bytes: Vec<u8>,
    ) -> Result<(), Error> {
        let Backend::Remote(remote) = &self.backend else {
            // Single-process mode: the publisher is the only process.
            return Ok(());
        };
        let name = self.shared_name(scope, call_site);
        remote.block_on(
            || format!("shared value '{name}'"),
            remote.shared.publish(&name, bytes),
        )
    }

    /// The receiving half of [`Accelerator::share_publish`]: waits for the bytes the main
    /// process (`Global`) or this node's local main process (`Node`) published from the same
    /// call site, or for the generation's failure.
    pub fn share_fetch(&self, scope: Scope, call_site: &str) -> Result<Vec<u8>, Error> {
        let Backend::Remote(remote) = &self.backend else {
            return Err(Error::NotFound {
                what: format!(
                    "shared value from '{call_site}' (single-process mode: this process is the \
                     main process and publishes it)"
                ),
            });
        };
        let name = self.shared_name(scope, call_site);
        remote.block_on(
            || format!("shared value '{name}'"),
            remote.shared.fetch(&name, None),
        )
    }

    /// The name of the next shared value of `call_site` in `scope`.
    fn shared_name(&self, scope: Scope, call_site: &str) -> String {
        let name = match scope {
            Scope::Global => format!("global/{call_site}"),
            Scope::Node => format!("node{}/{call_site}", self.info.node_rank),
        };
        shared_value_name(&name, self.next_share_call(&name))
    }

    fn next_share_call(&self, name: &str) -> u64 {
        let mut calls = lock(&self.share_calls);
        let count = calls.entry(name.to_owned()).or_insert(0);
        *count += 1;
        *count
    }

    /// Runs `f` only on the main process (Accelerate's `on_main_process`).
    pub fn on_main_process<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        self.is_main_process().then(f)
    }

    /// Runs `f` only on each node's local main process.
    pub fn on_local_main_process<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        self.is_local_main_process().then(f)
    }

    /// Runs `f` only on the last process.
    pub fn on_last_process<T>(&self, f: impl FnOnce() -> T) -> Option<T> {
        self.is_last_process().then(f)
    }

    /// Runs `f` only on global rank `index`.
    pub fn on_process<T>(&self, index: usize, f: impl FnOnce() -> T) -> Option<T> {
        (self.process_index() == index).then(f)
    }

    /// Runs `f` only on local rank `index` of each node.
    pub fn on_local_process<T>(&self, index: usize, f: impl FnOnce() -> T) -> Option<T> {
        (self.local_process_index() == index).then(f)
    }

    /// Prints a line once per machine (on the local main process), like Accelerate's
    /// `accelerator.print`; see also [`crate::print!`].
    pub fn print(&self, args: fmt::Arguments<'_>) {
        if self.is_local_main_process() {
            println!("{args}");
        }
    }

    /// Publishes the NCCL unique id of `communicator` (from its root rank) for this generation.
    pub fn publish_nccl_unique_id(
        &self,
        communicator: &str,
        id: &[u8; NCCL_UNIQUE_ID_BYTES],
    ) -> Result<(), Error> {
        match &self.backend {
            Backend::Local(store) => {
                let mut store = lock(store);
                match store.unique_ids.get(communicator) {
                    Some(existing) if existing != id => {
                        Err(Error::Rpc(tonic::Status::already_exists(format!(
                            "unique id '{communicator}' was already published with other bytes"
                        ))))
                    }
                    _ => {
                        store.unique_ids.insert(communicator.to_owned(), *id);
                        Ok(())
                    }
                }
            }
            Backend::Remote(remote) => remote.block_on(
                || unique_id(communicator),
                remote.unique_ids.publish(communicator, id),
            ),
        }
    }

    /// Fetches the NCCL unique id of `communicator`, waiting until its root publishes it (or
    /// the generation fails).
    pub fn fetch_nccl_unique_id(
        &self,
        communicator: &str,
    ) -> Result<[u8; NCCL_UNIQUE_ID_BYTES], Error> {
        match &self.backend {
            Backend::Local(store) => lock(store).unique_ids.get(communicator).copied().ok_or_else(|| {
                Error::NotFound {
                    what: format!(
                        "NCCL unique id '{communicator}' (single-process mode: nothing else can publish it)"
                    ),
                }
            }),
            Backend::Remote(remote) => remote.block_on(
                || unique_id(communicator),
                remote.unique_ids.fetch(communicator, None),
            ),
        }
    }

    /// The unique ids of NCCL communicator `communicator` of this generation, in root order,
    /// for `ncclCommInitRank` (one id) or `ncclCommInitRankScalable` (several). The
    /// coordinator plans the bootstrap roots (one per `nccl_ranks_per_root` ranks, see
    /// `muster_core::nccl`); each root rank makes its id with `make` (`ncclGetUniqueId`) and
    /// publishes it, and every rank fetches what it did not make. A world that fits one root
    /// gets one id, made by rank 0, exactly as [`Accelerator::publish_nccl_unique_id`] and
    /// [`Accelerator::fetch_nccl_unique_id`] share it.
    pub fn nccl_unique_ids(
        &self,
        communicator: &str,
        make: impl FnOnce() -> Result<[u8; NCCL_UNIQUE_ID_BYTES], Error>,
    ) -> Result<Vec<[u8; NCCL_UNIQUE_ID_BYTES]>, Error> {
        let Backend::Remote(remote) = &self.backend else {
            // A world of one is its own root.
            let id = make()?;
            self.publish_nccl_unique_id(communicator, &id)?;
            return Ok(vec![id]);
        };
        let ids = &remote.unique_ids;
        let what = || unique_id(communicator);
        let roots = remote.block_on(what, ids.roots(communicator))?;
        let rank = self.info().rank;
        let mine = match roots.iter().position(|&root| root == rank) {
            Some(root) => {
                let id = make()?;
                remote.block_on(what, ids.publish_root(communicator, root as u32, &id))?;
                Some(id)
            }
            None => None,
        };
        match (roots.len(), mine) {
            (1, Some(id)) => Ok(vec![id]),
            (1, None) => Ok(vec![remote.block_on(what, ids.fetch(communicator, None))?]),
            _ => remote.block_on(what, ids.fetch_all(communicator, None)),
        }
    }

    /// Fires when the coordinator reports that a rank of this generation failed, so that work
    /// outside barriers (a collective blocked on a dead peer) can abort and name it. Never
    /// fires in single-process mode.
    ///
    /// In an in-place job it also fires when the membership changes past this process's
    /// current epoch ([`Accelerator::epoch`]): a rank died and is being replaced.
    pub fn failure_watch(&self) -> crate::client::FailureWatch {
        self.failure_watch_at(self.epoch())
    }

    /// [`Accelerator::failure_watch`] for a communicator of membership `epoch`: fires for the
    /// generation's failure and for membership changes above `epoch`.
    pub fn failure_watch_at(&self, epoch: u64) -> crate::client::FailureWatch {
        let watch = match &self.backend {
            Backend::Remote(remote) => remote
                .session
                .as_ref()
                .map(Session::failure_watch)
                .unwrap_or_default(),
            Backend::Local(_) => crate::client::FailureWatch::default(),
        };
        watch.at_epoch(epoch)
    }

    /// Calls `Rendezvous.Quorum` for [`Membership::quorum`]: sends this process's epoch,
    /// `step` and released barrier seqs, waits for the quorum, and moves to its epoch. A
    /// replacement's first quorum also moves its barrier sequences to the quorum's released
    /// seqs (the session's, and the relay's, with which it registers now). In single-process
    /// mode the quorum is this process alone.
    pub(crate) fn take_quorum(&self, step: Option<u64>) -> Result<Quorum, Error> {
        use std::sync::atomic::Ordering;
        let state = &self.membership;
        let epoch = state.current.load(Ordering::Acquire);
        let remote = match &self.backend {
            Backend::Local(_) => {
                state.awaiting_first.store(false, Ordering::Release);
                return Ok(Quorum {
                    epoch,
                    world_size: 1,
                    step,
                    heal: Vec::new(),
                    released: (0, 0),
                    members: Vec::new(),
                });
            }
            Backend::Remote(remote) => remote,
        };
        let session = remote.session()?;
        let released = match remote.relay.get() {
            Some(relay) => relay.released(),
            None => session.released(),
        };
        let ask = QuorumAsk {
            epoch,
            step,
            released,
        };
        let quorum = remote.block_on(
            || format!("the quorum of epoch {epoch}"),
            session
                .coordinator()
                .quorum(session.config(), ask, QUORUM_POLL),
        )?;
        if quorum.world_size != self.info.world_size {
            return Err(Error::Protocol(format!(
                "the quorum of epoch {} has {} ranks, but this job has {} (in-place recovery \
                 keeps the world size)",
                quorum.epoch, quorum.world_size, self.info.world_size
            )));
        }
        if state.awaiting_first.load(Ordering::Acquire) {
            session.continue_from(quorum.released);
            if let Some(path) = &remote.relay_pending
                && remote.relay.get().is_none()
            {
                let relay = RelayConn::connect_replacement(
                    path,
                    session.config(),
                    quorum.released,
                    self.recovery.epoch,
                )?;
                let _ = remote.relay.set(relay);
            }
            state.awaiting_first.store(false, Ordering::Release);
        }
        state.current.store(quorum.epoch, Ordering::Release);
        Ok(quorum)
    }

    /// The job's key-value store, with blocking methods.
    pub fn kv(&self) -> KvStore<'_> {
        KvStore { accelerator: self }
    }

    /// Ends this process's part in the job cleanly (sends `leave`), so that ranks still waiting
    /// on it get a clear error rather than waiting; reports a failure to do so.
    pub fn finish(mut self) -> Result<(), Error> {
        match &mut self.backend {
            Backend::Local(_) => Ok(()),
            Backend::Remote(remote) => {
                remote.leave_relay();
                match remote.session.take() {
                    Some(session) => {
                        remote.block_on(|| "the coordinator's leave".to_owned(), session.leave())
                    }
                    None => Ok(()),
                }
            }
        }
    }
}

impl Drop for Accelerator {
    fn drop(&mut self) {
        let Backend::Remote(remote) = &mut self.backend else {
            return;
        };
        // During a panic, skip `leave` on both: the connections just end, and the agent and
        // the coordinator mark this rank failed at once. Skip the session's `leave` too when
        // the agent is gone: a rank whose agent died did not finish, and a clean `leave` would
        // tell the other ranks it had.
        let agent_lost = remote.relay.get().is_some_and(RelayConn::is_lost);
        if !std::thread::panicking() {
            remote.leave_relay();
        }
        remote.relay.take();
        let session = remote.session.take().filter(|_| !agent_lost);
        let Some(runtime) = remote.runtime.take() else {
            return;
        };
        let in_async_context = tokio::runtime::Handle::try_current().is_ok();
        match session {
            Some(session) if !std::thread::panicking() && !in_async_context => {
                let left = runtime.block_on(async {
                    tokio::time::timeout(DROP_LEAVE_GRACE, session.leave()).await
                });
                if let Ok(Err(e)) = left {
                    tracing::debug!(error = %e, "leave on drop failed");
                }
            }
            session => drop(session),
        }
        if in_async_context {
            // Blocking on the runtime's shutdown is not allowed here.
            runtime.shutdown_background();
        }
    }
}

impl Remote {
    /// Runs a call to the coordinator to its end, or until this thread's interrupt check
    /// stops it ([`crate::interrupt`]; `what` names what it waited for, made only then).
    fn block_on<T>(
        &self,
        what: impl FnOnce() -> String,
        call: impl Future<Output = Result<T, Error>>,
    ) -> Result<T, Error> {
        match &self.runtime {
            Some(runtime) => crate::interrupt::block_on(runtime, what, call),
            // Only `Drop` takes the runtime, after which no method runs.
            None => unreachable!("the muster runtime is gone only while dropping"),
        }
    }

    /// Tells the agent's relay (if any) that this rank leaves, and closes it. Best effort: the
    /// coordinator session's `leave` is what ends the rank, and a relay that is already gone
    /// has nobody left to tell.
    fn leave_relay(&mut self) {
        if let Some(relay) = self.relay.take()
            && let Err(e) = relay.leave()
        {
            tracing::debug!(error = %e, "leave on the agent relay failed");
        }
    }

    fn session(&self) -> Result<&Session, Error> {
        self.session
            .as_ref()
            .ok_or_else(|| Error::Usage("this process already finished its session".to_owned()))
    }
}

/// What a key-value call waits for, for [`Error::Interrupted`].
fn key_what(key: &str) -> String {
    format!("key '{key}'")
}

/// What a batch of key-value reads waits for.
fn keys_what(keys: &[String]) -> String {
    match keys {
        [key] => key_what(key),
        _ => format!("{} keys", keys.len()),
    }
}

/// What a unique-id call waits for.
fn unique_id(communicator: &str) -> String {
    format!("the NCCL unique id of communicator '{communicator}'")
}

/// Blocking access to the job's key-value store (TCPStore parity). In single-process mode it is
/// an in-memory map of this process.
#[derive(Debug, Clone, Copy)]
pub struct KvStore<'a> {
    accelerator: &'a Accelerator,
}

/// Where a key-value call goes.
enum Target<'a> {
    Local(MutexGuard<'a, LocalStore>),
    Remote(&'a Remote),
}

impl KvStore<'_> {
    fn target(&self) -> Target<'_> {
        match &self.accelerator.backend {
            Backend::Local(store) => Target::Local(lock(store)),
            Backend::Remote(remote) => Target::Remote(remote),
        }
    }

    /// Sets `key`, replacing any value; applied at most once across a leader failover, as
    /// [`KvStore::add`].
    pub fn set(&self, key: &str, value: impl Into<Vec<u8>>) -> Result<(), Error> {
        match self.target() {
            Target::Local(mut store) => {
                store.kv.insert(key.to_owned(), value.into());
                Ok(())
            }
            Target::Remote(remote) => {
                let mut lane = lock(&remote.kv_lane);
                remote.block_on(|| key_what(key), lane.set(key, value))
            }
        }
    }

    /// The value of `key`, or `None` if it is not set.
    pub fn get(&self, key: &str) -> Result<Option<Vec<u8>>, Error> {
        match self.target() {
            Target::Local(store) => Ok(store.kv.get(key).cloned()),
            Target::Remote(remote) => remote.block_on(|| key_what(key), remote.kv.get(key)),
        }
    }

    /// The value of `key`, waiting up to `wait` for another process to set it. In
    /// single-process mode a missing key fails at once with [`Error::NotFound`].
    pub fn get_wait(&self, key: &str, wait: Duration) -> Result<Vec<u8>, Error> {
        match self.target() {
            Target::Local(store) => local_wait(&store, key),
            Target::Remote(remote) => {
                remote.block_on(|| key_what(key), remote.kv.get_wait(key, wait))
            }
        }
    }

    /// The values of `keys`, in their order, waiting up to `wait` for each (torch's
    /// `multi_get`): one concurrent batch of gets, about one round trip in all. In
    /// single-process mode a missing key fails at once, as [`KvStore::get_wait`].
    pub fn get_wait_many(&self, keys: &[String], wait: Duration) -> Result<Vec<Vec<u8>>, Error> {
        match self.target() {
            Target::Local(store) => keys.iter().map(|key| local_wait(&store, key)).collect(),
            Target::Remote(remote) => {
                remote.block_on(|| keys_what(keys), remote.kv.get_wait_many(keys, wait))
            }
        }
    }

    /// Adds `delta` to the counter at `key` (absent counts as 0) and returns the new value.
    /// Applied exactly once, even when a coordinator leader dies with it in flight (the
    /// process's [`KvLane`]).
    pub fn add(&self, key: &str, delta: i64) -> Result<i64, Error> {
        let mut store = match self.target() {
            Target::Local(store) => store,
            // An add of 0 is a read, retried as one; any other goes through the lane.
            Target::Remote(remote) if delta == 0 => {
                return remote.block_on(|| key_what(key), remote.kv.add(key, delta));
            }
            Target::Remote(remote) => {
                let mut lane = lock(&remote.kv_lane);
                return remote.block_on(|| key_what(key), lane.add(key, delta));
            }
        };
        let current = match store.kv.get(key) {
            None => 0,
            Some(bytes) => std::str::from_utf8(bytes)
                .ok()
                .and_then(|text| text.parse::<i64>().ok())
                .ok_or_else(|| {
                    Error::Rpc(tonic::Status::invalid_argument(format!(
                        "key '{key}' does not hold a decimal integer"
                    )))
                })?,
        };
        let value = current.checked_add(delta).ok_or_else(|| {
            Error::Rpc(tonic::Status::out_of_range(format!(
                "counter '{key}' overflows"
            )))
        })?;
        store
            .kv
            .insert(key.to_owned(), value.to_string().into_bytes());
        Ok(value)
    }

    /// Sets `key` to `desired` only if its value is `expected` (`None`: only if the key does
    /// not exist), atomically; applied at most once across a leader failover, as
    /// [`KvStore::add`].
    pub fn compare_and_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: impl Into<Vec<u8>>,
    ) -> Result<CasOutcome, Error> {
        match self.target() {
            Target::Local(mut store) => {
                let swapped = store.kv.get(key).map(Vec::as_slice) == expected;
                if swapped {
                    store.kv.insert(key.to_owned(), desired.into());
                }
                Ok(CasOutcome {
                    swapped,
                    current: store.kv.get(key).cloned(),
                })
            }
            Target::Remote(remote) => {
                let mut lane = lock(&remote.kv_lane);
                remote.block_on(
                    || key_what(key),
                    lane.compare_and_set(key, expected, desired),
                )
            }
        }
    }

    /// Deletes `key`; says whether it existed. Applied at most once across a leader
    /// failover, as [`KvStore::add`].
    pub fn delete(&self, key: &str) -> Result<bool, Error> {
        match self.target() {
            Target::Local(mut store) => Ok(store.kv.remove(key).is_some()),
            Target::Remote(remote) => {
                let mut lane = lock(&remote.kv_lane);
                remote.block_on(|| key_what(key), lane.delete(key))
            }
        }
    }

    /// The keys and values under `prefix`, in key order.
    pub fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, Error> {
        match self.target() {
            Target::Local(store) => Ok(store
                .kv
                .range(prefix.to_owned()..)
                .take_while(|(key, _)| key.starts_with(prefix))
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect()),
            Target::Remote(remote) => remote.block_on(
                || format!("the keys under '{prefix}'"),
                remote.kv.list(prefix),
            ),
        }
    }
}

/// A wait for `key` in single-process mode: its value, or at once [`Error::NotFound`] (nothing
/// else can set it).
fn local_wait(store: &LocalStore, key: &str) -> Result<Vec<u8>, Error> {
    store.kv.get(key).cloned().ok_or_else(|| Error::NotFound {
        what: format!("key '{key}' (single-process mode: nothing else can set it)"),
    })
}

fn lock<T>(mutex: &Mutex<T>) -> MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

/// The barrier and shared-value name of a call site. Every rank runs the same binary, so the
/// same line gives the same name everywhere.
fn call_site(location: &Location<'_>) -> String {
    format!("{}:{}", location.file(), location.line())
}

/// `<scope>/<file:line>#<n>`, shortened from the left (keeping the scope) when it would exceed
/// what the coordinator accepts.
fn shared_value_name(name: &str, call: u64) -> String {
    let full = format!("{name}#{call}");
    if full.len() <= MAX_SHARED_NAME {
        return full;
    }
    let (scope, _) = full.split_once('/').unwrap_or(("", ""));
    let keep = MAX_SHARED_NAME - scope.len() - "/...".len();
    let mut start = full.len() - keep;
    while !full.is_char_boundary(start) {
        start += 1;
    }
    format!("{scope}/...{}", &full[start..])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_shared_names_keep_scope_and_tail() {
        assert_eq!(
            shared_value_name("global/src/a.rs:3", 2),
            "global/src/a.rs:3#2"
        );
        let long = format!("node12/{}/train.rs:77", "deep/".repeat(80));
        let short = shared_value_name(&long, 1);
        assert!(short.len() <= MAX_SHARED_NAME, "{}", short.len());
        assert!(short.starts_with("node12/..."), "{short}");
        assert!(short.ends_with("/train.rs:77#1"), "{short}");
        let wide = format!("global/{}:1", "é".repeat(200));
        assert!(shared_value_name(&wide, 3).len() <= MAX_SHARED_NAME);
    }
}
