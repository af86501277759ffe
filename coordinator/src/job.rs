//! One job's live state: its rendezvous round, the running generation's ranks and sessions,
//! its barriers and its failure. Everything here is synchronous and runs under the job's lock,
//! which is held for microseconds and never across an `.await`; replies go out through
//! unbounded channels (session outboxes) or oneshots (joiners), so nothing blocks under it.

use muster_core::model::{JobId, Scope, barrier_error as simple_error, list_ranks, scope_name};
use crate::store::Store;
use muster_proto::v1 as pb;
use pb::barrier_error::Kind as ErrKind;
use prost::Message as _;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// Where a session's answers go: the stream tonic sends to the worker.
pub type Outbox = mpsc::UnboundedSender<Result<pb::CoordinatorMessage, Status>>;

/// Where a relaying agent's answers go.
pub type RelayOutbox = mpsc::UnboundedSender<Result<pb::RelayEvent, Status>>;

/// Where a node's watch events go (its agent's `Rendezvous.Watch` stream).
pub type NodeOutbox = mpsc::UnboundedSender<Result<pb::NodeEvent, Status>>;

/// How a job's rounds are formed (validated `RendezvousConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundConfig {
    /// Fewest nodes a round closes with.
    pub min_nodes: u32,
    /// Most nodes a round takes.
    pub max_nodes: u32,
    /// How long to wait for more nodes once `min_nodes` have joined.
    pub last_call: Duration,
    /// How long a round may stay open.
    pub join_timeout: Duration,
    /// Restarts allowed after failed generations.
    pub max_restarts: u32,
}

/// A validated join.
#[derive(Debug, Clone)]
pub struct JoinReq {
    /// The node's self-chosen name.
    pub node_id: String,
    /// The node's advertised host.
    pub host: String,
    /// Workers on the node.
    pub local_world_size: u32,
    /// The node rank asked for, if any.
    pub requested: Option<u32>,
    /// The caller's id of this join attempt (empty: none), so that a retried join whose
    /// round already closed gets the same place.
    pub request_id: String,
}

/// The first failure of a generation: which rank, where, and why.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The failed global rank.
    pub rank: u32,
    /// Its node rank.
    pub node_rank: u32,
    /// Its host.
    pub host: String,
    /// Why it failed.
    pub reason: String,
    /// Whether the reason came from the agent (exit status) rather than a dropped session.
    precise: bool,
    /// What the agent reported beyond the reason.
    pub detail: FailureDetail,
    /// The failed node's id, for a node-level failure (a lost agent).
    pub node_id: String,
}

/// What an agent reports about a worker's end beyond the one-line reason.
#[derive(Debug, Clone, Default)]
pub struct FailureDetail {
    /// The exit code, when the worker exited.
    pub exit_code: Option<i32>,
    /// The signal number, when a signal ended it.
    pub signal: Option<i32>,
    /// Its structured error (error file) message and traceback.
    pub error_message: String,
    /// The traceback of that error.
    pub error_traceback: String,
    /// Its last stderr lines.
    pub stderr_tail: String,
}

/// Why a job is over for good. Every variant is final: once set, no later event (a late
/// failure report, a lost node, a cancel, a drain, a join, a failover) changes it.
#[derive(Debug, Clone)]
enum Done {
    /// A generation failed with no restarts left.
    Failed(String),
    /// An operator cancelled it.
    Cancelled(String),
    /// Every rank of the running generation left cleanly (and every node whose agent
    /// watched it said its workers exited 0).
    Finished(String),
}

impl Failure {
    fn describe(&self, job: &JobId, generation: u64) -> String {
        let mut text = format!(
            "rank {} (node {}, host {}) of job '{job}' generation {generation} failed: {}",
            self.rank, self.node_rank, self.host, self.reason
        );
        let d = &self.detail;
        if !d.error_message.is_empty() {
            let _ = write!(text, "; error: {}", d.error_message.trim_end());
        }
        if !d.stderr_tail.is_empty() {
            let n = d.stderr_tail.chars().count();
            let tail: String = d.stderr_tail.chars().skip(n.saturating_sub(2048)).collect();
            let _ = write!(text, "; last stderr: {}", tail.trim_end());
        }
        text
    }

    fn to_info(&self, generation: u64) -> pb::FailureInfo {
        pb::FailureInfo {
            rank: self.rank,
            node_rank: self.node_rank,
            host: self.host.clone(),
            reason: self.reason.clone(),
            generation,
            exit_code: self.detail.exit_code,
            signal: self.detail.signal,
            error_message: self.detail.error_message.clone(),
            error_traceback: self.detail.error_traceback.clone(),
            stderr_tail: self.detail.stderr_tail.clone(),
            node_id: self.node_id.clone(),
        }
    }

    fn to_error(&self, job: &JobId, generation: u64) -> pb::BarrierError {
        pb::BarrierError {
            kind: ErrKind::RankFailed as i32,
            message: self.describe(job, generation),
            rank: self.rank,
            node_rank: self.node_rank,
            host: self.host.clone(),
            missing: vec![],
        }
    }
}

struct Joiner {
    req: JoinReq,
    reply: JoinReply,
    /// Which call holds the place (a retry of the same join takes it over).
    attempt: u64,
}

struct OpenRound {
    /// Distinguishes rounds of the same generation (a timed-out round reopens empty).
    seq: u64,
    joiners: Vec<Joiner>,
    opened: Instant,
    min_reached: Option<Instant>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RankState {
    Pending,
    Running,
    Failed,
    Left,
}

struct NodeSlot {
    node_id: String,
    /// The request id of the join that placed the node.
    request_id: String,
    host: String,
    local_world_size: u32,
    rank_offset: u32,
    /// The node's agent, when it relays the node's global barriers.
    relay: Option<RelayOutbox>,
    /// The relay's latest report of the waits it holds, and when it came.
    report: Option<(Instant, Vec<pb::BarrierInfo>)>,
    /// The agent's watch stream (its lease), and which attach it was (a reconnect replaces it).
    watch: Option<(u64, NodeOutbox)>,
    /// Every worker of the node exited 0.
    finished: bool,
    /// Its agent has attached a watch in this generation (persisted).
    watched: bool,
    /// When its agent was last heard on its watch (attach or heartbeat).
    last_seen: Option<Instant>,
}

struct RankSlot {
    node_rank: u32,
    state: RankState,
    pid: u32,
    host: String,
    last_seen: Instant,
    /// Last barrier sequence number entered, per scope.
    seq: [u64; 2],
    /// Last barrier sequence number released, per scope.
    done: [u64; 2],
    waiting: [bool; 2],
    outbox: Option<Outbox>,
    /// The rank has opened a session in this generation (persisted).
    had_session: bool,
    /// The name of the last barrier entered, per scope.
    names: [String; 2],
    /// The scope of the last barrier entered (an index into `seq`), if any.
    last_scope: Option<usize>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct BarrierKey {
    scope: Scope,
    node_rank: u32,
    seq: u64,
}

struct Arrival {
    rank: u32,
    name: usize,
    /// Identifies one wait (a group's ranks share it): timeouts withdraw by token.
    token: u64,
    /// Arrived through its node's relay: answered once per node, not per rank.
    relayed: bool,
}

struct Barrier {
    expected: u32,
    names: Vec<String>,
    arrivals: Vec<Arrival>,
    first_at: Instant,
    diverged: bool,
}

struct Gen {
    generation: u64,
    /// Names the generation's published values in the store (see `pb::GenerationRecord`).
    values_id: String,
    /// Loaded from the store by a new leader (or a restarted coordinator): its ranks
    /// re-attach with `resume` and may enter barriers before their sessions are back.
    recovered: bool,
    /// The highest barrier seq known complete, per scope key (scope, node rank; 0 for
    /// global). A rank re-entering a barrier at or below it after a failover is released at
    /// once: its peers already passed it under the previous leader.
    released: HashMap<(Scope, u32), u64>,
    nodes: Vec<NodeSlot>,
    ranks: Vec<RankSlot>,
    barriers: HashMap<BarrierKey, Barrier>,
    failure: Option<Failure>,
    /// The event sent to watchers when the generation ended (and to those who attach later).
    ended: Option<Box<pb::GenerationEnded>>,
    left: u32,
    next_token: u64,
}

enum Phase {
    Open(OpenRound),
    Running(Box<Gen>),
}

struct JobState {
    config: RoundConfig,
    generation: u64,
    /// Restarts after failed generations so far.
    restarts: u32,
    next_round_seq: u64,
    phase: Phase,
    /// Set when the job is over for good; joins are refused with this.
    done: Option<Done>,
    /// Ids of watch attaches and join calls.
    next_watch: u64,
    /// Nodes an operator drained (node id to reason): their joins are refused (persisted).
    drained: HashMap<String, String>,
}

/// A job: its lock-protected state plus a change signal for waiters of published values.
pub struct Job {
    /// The job's id.
    pub id: JobId,
    state: Mutex<JobState>,
    changed: watch::Sender<u64>,
    /// Serialises key-value writes of this job and holds its byte total.
    pub kv_bytes: tokio::sync::Mutex<usize>,
    /// Names new generations' values (`<incarnation>-<generation>`).
    incarnation: u64,
    /// Writes the job's record to a durable store (etcd), when there is one.
    persist: Option<Persist>,
    /// Set when this coordinator stops leading: the job's in-memory state is dropped, its
    /// streams were ended with UNAVAILABLE, and nothing may fail ranks or write any more.
    retired: CancellationToken,
    /// Whether this coordinator leads now (its lease deadline has not passed): without it,
    /// the job decides nothing, as if retired (`ha.rs`, "A leader that did not run").
    tenure: crate::tenure::Tenure,
}

/// What every job of one coordinator shares: how new generations are named and where job
/// records are persisted.
#[derive(Clone)]
pub struct JobContext {
    /// The coordinator's start time in nanoseconds since the epoch.
    pub incarnation: u64,
    /// The durable store job records go to; `None` with the memory store.
    pub store: Option<Arc<dyn Store>>,
    /// Whether this coordinator may act as the leader now.
    pub tenure: crate::tenure::Tenure,
}

/// The record writer's queue: the latest record and its version.
type RecordQueue = (u64, Option<Arc<pb::JobRecord>>);

/// A join's reply channel, and its receiving end.
type JoinReply = oneshot::Sender<Result<pb::JoinResponse, Status>>;
type JoinAnswer = oneshot::Receiver<Result<pb::JoinResponse, Status>>;

/// The job's record writer: the latest record to write (with its version), and the version
/// last written. Writes are ordered and only the latest matters, so a record superseded while
/// an earlier write is in flight is skipped.
struct Persist {
    pending: watch::Sender<RecordQueue>,
    written: watch::Sender<u64>,
}

/// The store key of a job's record.
pub fn record_key(job: &JobId) -> String {
    format!("records/{job}")
}

/// The store prefix of every job record.
pub const RECORDS_PREFIX: &str = "records/";

/// What a registered session needs to know.
#[derive(Debug, Clone)]
pub struct Registration {
    /// The worker's node rank.
    pub node_rank: u32,
    /// Nodes in the generation.
    pub num_nodes: u32,
    /// Ranks in the generation.
    pub world_size: u32,
}

/// Where a generation stands, for callers outside barriers (value fetches, publishes).
pub enum GenStatus {
    /// Running and healthy.
    Alive,
    /// A rank failed.
    Failed(String),
}

fn stale(job: &JobId, asked: u64, current: u64, open: bool) -> String {
    if asked > current {
        format!(
            "generation {asked} of job '{job}' does not exist; the job is at generation {current}"
        )
    } else if asked == current && open {
        format!(
            "generation {asked} of job '{job}' is still forming (rendezvous open); wait for the rendezvous answer"
        )
    } else {
        format!(
            "generation {asked} of job '{job}' is stale; the job is at generation {current}{}",
            if open { " (rendezvous open)" } else { "" }
        )
    }
}

/// Node `node_rank`'s answer to its join of the round that formed `nodes`.
fn join_answer(
    job: &JobId,
    generation: u64,
    nodes: &[NodeSlot],
    node_rank: usize,
    restart_count: u32,
    max_restarts: u32,
) -> pb::JoinResponse {
    let node = &nodes[node_rank];
    let world_size = nodes
        .last()
        .map_or(0, |n| n.rank_offset + n.local_world_size);
    pb::JoinResponse {
        job_id: job.to_string(),
        generation,
        node_rank: node_rank as u32,
        num_nodes: nodes.len() as u32,
        rank_offset: node.rank_offset,
        local_world_size: node.local_world_size,
        world_size,
        master_host: nodes.first().map(|n| n.host.clone()).unwrap_or_default(),
        restart_count,
        max_restarts,
    }
}

/// The ending `node_id` hears: `ended` itself, unless the generation was superseded and the
/// node is drained: then CAUSE_DRAINED without rejoin, so that its agent stops for good.
fn drained_end(
    ended: &pb::GenerationEnded,
    node_id: &str,
    drained: &HashMap<String, String>,
) -> pb::GenerationEnded {
    match drained.get(node_id) {
        Some(reason) if ended.cause == pb::generation_ended::Cause::Superseded as i32 => {
            pb::GenerationEnded {
                cause: pb::generation_ended::Cause::Drained as i32,
                rejoin: false,
                message: format!(
                    "node '{node_id}' was drained from generation {} by an operator ({reason}); the job continues on the other nodes",
                    ended.generation
                ),
                ..ended.clone()
            }
        }
        _ => ended.clone(),
    }
}

/// The answer to a join from a drained node: FAILED_PRECONDITION naming the node and the
/// reason, marked with the `muster-drained` metadata key so that an agent can tell a drain
/// from a job that is over.
fn drained_refusal(job: &JobId, node_id: &str, reason: &str) -> Status {
    let mut status = Status::failed_precondition(format!(
        "node '{node_id}' was drained from job '{job}' by an operator ({reason}) and may not join it again; start the agent afresh (a new node id) to add this machine back"
    ));
    status.metadata_mut().insert(
        DRAINED_METADATA,
        tonic::metadata::MetadataValue::from_static("1"),
    );
    status
}

/// The metadata key set on a join refused because its node was drained.
pub const DRAINED_METADATA: &str = "muster-drained";

/// A node named by an operator: by its id or by its rank in the running generation.
#[derive(Debug, Clone)]
pub enum NodeRef {
    /// The node id it joined with.
    Id(String),
    /// Its node rank in the running generation.
    Rank(u32),
}

impl std::fmt::Display for NodeRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Id(id) => write!(f, "node '{id}'"),
            Self::Rank(r) => write!(f, "node rank {r}"),
        }
    }
}

/// One bit per rank (bit r of byte r / 8), set where `set` holds: the record's rank sets.
fn rank_bits(ranks: &[RankSlot], set: impl Fn(&RankSlot) -> bool) -> Vec<u8> {
    let mut bits = vec![0u8; ranks.len().div_ceil(8)];
    for (r, slot) in ranks.iter().enumerate() {
        if set(slot) {
            bits[r / 8] |= 1 << (r % 8);
        }
    }
    bits
}

/// How long ago `at` was, in whole milliseconds.
fn ms_since(now: Instant, at: Instant) -> u64 {
    u64::try_from(now.saturating_duration_since(at).as_millis()).unwrap_or(u64::MAX)
}

/// A rank's state on the wire (waiting when it waits at one of the coordinator's barriers).
fn rank_state(s: &RankSlot) -> pb::RankState {
    match s.state {
        RankState::Pending => pb::RankState::Pending,
        RankState::Running if s.waiting.contains(&true) => pb::RankState::Waiting,
        RankState::Running => pb::RankState::Running,
        RankState::Failed => pb::RankState::Failed,
        RankState::Left => pb::RankState::Left,
    }
}

fn result(scope: Scope, seq: u64, error: Option<pb::BarrierError>) -> pb::CoordinatorMessage {
    pb::CoordinatorMessage {
        kind: Some(pb::coordinator_message::Kind::Barrier(pb::BarrierResult {
            scope: scope.to_wire(),
            seq,
            error,
        })),
    }
}

fn relay_result(seq: u64, error: Option<pb::BarrierError>) -> pb::RelayEvent {
    pb::RelayEvent {
        kind: Some(pb::relay_event::Kind::Barrier(pb::BarrierResult {
            scope: Scope::Global.to_wire(),
            seq,
            error,
        })),
    }
}

impl Gen {
    fn scope_ranks(&self, scope: Scope, node_rank: u32) -> std::ops::Range<u32> {
        match scope {
            Scope::Global => 0..self.ranks.len() as u32,
            Scope::Node => {
                let n = &self.nodes[node_rank as usize];
                n.rank_offset..n.rank_offset + n.local_world_size
            }
        }
    }

    fn location(&self, rank: u32) -> pb::RankLocation {
        let slot = &self.ranks[rank as usize];
        let host = if slot.host.is_empty() {
            self.nodes[slot.node_rank as usize].host.clone()
        } else {
            slot.host.clone()
        };
        pb::RankLocation {
            rank,
            node_rank: slot.node_rank,
            host,
        }
    }

    fn missing(&self, key: &BarrierKey, b: &Barrier) -> Vec<pb::RankLocation> {
        let mut arrived = vec![false; self.ranks.len()];
        for a in &b.arrivals {
            arrived[a.rank as usize] = true;
        }
        self.scope_ranks(key.scope, key.node_rank)
            .filter(|r| !arrived[*r as usize])
            .map(|r| self.location(r))
            .collect()
    }

    fn send(&self, rank: u32, msg: pb::CoordinatorMessage) {
        if let Some(outbox) = &self.ranks[rank as usize].outbox {
            // A closed outbox means the session is gone; its own end handles that.
            let _ = outbox.send(Ok(msg));
        }
    }

    /// Answers every arrival of a barrier with the same result: each session-arrived rank
    /// through its session, each relaying node once. Marks the ranks done with `seq`.
    fn deliver<'a>(
        &mut self,
        key: BarrierKey,
        arrivals: impl Iterator<Item = &'a Arrival>,
        error: Option<&pb::BarrierError>,
    ) {
        let idx = key.scope.index();
        let mut nodes_told: Vec<u32> = vec![];
        for a in arrivals {
            let slot = &mut self.ranks[a.rank as usize];
            if !slot.waiting[idx] || slot.seq[idx] != key.seq {
                continue;
            }
            slot.waiting[idx] = false;
            slot.done[idx] = key.seq;
            if a.relayed {
                let node = slot.node_rank;
                if !nodes_told.contains(&node) {
                    nodes_told.push(node);
                    self.relay_send(node, relay_result(key.seq, error.cloned()));
                }
            } else {
                self.send(a.rank, result(key.scope, key.seq, error.cloned()));
            }
        }
    }

    fn relay_send(&self, node_rank: u32, event: pb::RelayEvent) {
        if let Some(relay) = &self.nodes[node_rank as usize].relay {
            let _ = relay.send(Ok(event));
        }
    }

    /// Sends `ended` to every node's watcher and keeps it for watchers that attach later. A
    /// drained node (in `drained`) hears its own ending instead (see [`drained_end`]).
    fn end(&mut self, ended: pb::GenerationEnded, drained: &HashMap<String, String>) {
        for node in &self.nodes {
            if let Some((_, w)) = &node.watch {
                let _ = w.send(Ok(pb::NodeEvent {
                    kind: Some(pb::node_event::Kind::Ended(drained_end(
                        &ended,
                        &node.node_id,
                        drained,
                    ))),
                }));
            }
        }
        self.ended = Some(Box::new(ended));
    }

    /// Tells every live session of the generation that it failed, with `error`, so that
    /// ranks outside barriers (inside a collective) learn of it too.
    fn sessions_failed(&self, error: &pb::BarrierError) {
        for rank in 0..self.ranks.len() {
            self.send(
                rank as u32,
                pb::CoordinatorMessage {
                    kind: Some(pb::coordinator_message::Kind::GenerationFailed(
                        error.clone(),
                    )),
                },
            );
        }
    }

    /// Tells every relaying agent that the generation is over, with `error`.
    fn relays_failed(&self, error: &pb::BarrierError) {
        for n in 0..self.nodes.len() {
            self.relay_send(
                n as u32,
                pb::RelayEvent {
                    kind: Some(pb::relay_event::Kind::Failed(error.clone())),
                },
            );
        }
    }

    /// Ends a barrier with the same error for every rank that arrived.
    fn fail_barrier(&mut self, key: BarrierKey, b: Barrier, error: &pb::BarrierError) {
        self.deliver(key, b.arrivals.iter(), Some(error));
    }

    fn fail_all_barriers(&mut self, error: &pb::BarrierError) {
        let barriers: Vec<_> = self.barriers.drain().collect();
        for (key, b) in barriers {
            self.fail_barrier(key, b, error);
        }
    }

    fn divergence_message(&self, key: &BarrierKey, b: &Barrier) -> String {
        let mut s = format!(
            "barrier divergence at {} #{}: ranks met under different names:",
            scope_name(key.scope, key.node_rank),
            key.seq
        );
        for (i, name) in b.names.iter().enumerate() {
            let ranks: Vec<String> = b
                .arrivals
                .iter()
                .filter(|a| a.name == i)
                .map(|a| a.rank.to_string())
                .collect();
            let _ = write!(s, " [{name}: ranks {}]", ranks.join(","));
        }
        let missing = self.missing(key, b);
        if !missing.is_empty() {
            let _ = write!(s, "; not yet arrived: {}", list_ranks(&missing));
        }
        s
    }

    /// A rank that left can never reach a barrier it had not entered: fail such barriers.
    fn left_error(&self, key: &BarrierKey, job: &JobId) -> Option<pb::BarrierError> {
        if self.left == 0 {
            return None;
        }
        let r = self.scope_ranks(key.scope, key.node_rank).find(|r| {
            let s = &self.ranks[*r as usize];
            s.state == RankState::Left && s.seq[key.scope.index()] < key.seq
        })?;
        let loc = self.location(r);
        Some(pb::BarrierError {
            kind: ErrKind::RankLeft as i32,
            message: format!(
                "rank {r} (node {}, host {}) has left job '{job}' generation {} before reaching {} #{}; the barrier can never complete",
                loc.node_rank,
                loc.host,
                self.generation,
                scope_name(key.scope, key.node_rank),
                key.seq
            ),
            rank: r,
            node_rank: loc.node_rank,
            host: loc.host,
            missing: vec![],
        })
    }
}

/// The body of a job's "job-record" task (see [`Job::with_state`]).
async fn write_records(
    key: String,
    store: Arc<dyn Store>,
    mut pending: watch::Receiver<RecordQueue>,
    written: watch::Sender<u64>,
    retired: CancellationToken,
) {
    loop {
        tokio::select! {
            changed = pending.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = retired.cancelled() => return,
        }
        let (version, record) = pending.borrow_and_update().clone();
        let Some(record) = record else { continue };
        let bytes = record.encode_to_vec();
        let mut backoff = Duration::from_millis(50);
        loop {
            match store.put(&key, bytes.clone()).await {
                Ok(()) => {
                    written.send_replace(version);
                    break;
                }
                Err(e) => {
                    if retired.is_cancelled() {
                        return;
                    }
                    tracing::warn!(key, "job record not written, retrying: {e}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    if pending.has_changed().unwrap_or(true) {
                        // A newer record replaces this one.
                        break;
                    }
                }
            }
        }
    }
}

impl Gen {
    /// A running generation from its record: every rank pending (re-attaching).
    fn restore(
        r: &pb::GenerationRecord,
        ended: Option<pb::GenerationEnded>,
    ) -> Result<Self, String> {
        let mut nodes = Vec::with_capacity(r.nodes.len());
        let mut ranks = vec![];
        let mut left = 0;
        for (node_rank, n) in r.nodes.iter().enumerate() {
            if n.rank_offset as usize != ranks.len() {
                return Err(format!(
                    "stored generation {} has node {node_rank} at rank offset {}, expected {}",
                    r.generation,
                    n.rank_offset,
                    ranks.len()
                ));
            }
            nodes.push(NodeSlot {
                node_id: n.node_id.clone(),
                request_id: n.request_id.clone(),
                host: n.host.clone(),
                local_world_size: n.local_world_size,
                rank_offset: n.rank_offset,
                relay: None,
                report: None,
                watch: None,
                finished: n.finished,
                watched: n.watched,
                last_seen: None,
            });
            let bit = |bits: &[u8], rank: usize| {
                bits.get(rank / 8)
                    .is_some_and(|b| b & (1 << (rank % 8)) != 0)
            };
            for _ in 0..n.local_world_size {
                let mut slot = RankSlot::new(node_rank as u32);
                let rank = ranks.len();
                slot.had_session = bit(&r.sessions, rank);
                if n.finished || bit(&r.left, rank) {
                    // It left cleanly under the previous leader: not expected back.
                    slot.state = RankState::Left;
                    left += 1;
                }
                ranks.push(slot);
            }
        }
        let failure = r.failure.as_ref().map(|f| Failure {
            rank: f.rank,
            node_rank: f.node_rank,
            host: f.host.clone(),
            reason: f.reason.clone(),
            precise: true,
            detail: FailureDetail {
                exit_code: f.exit_code,
                signal: f.signal,
                error_message: f.error_message.clone(),
                error_traceback: f.error_traceback.clone(),
                stderr_tail: f.stderr_tail.clone(),
            },
            node_id: f.node_id.clone(),
        });
        Ok(Self {
            generation: r.generation,
            values_id: r.values_id.clone(),
            recovered: true,
            released: HashMap::new(),
            nodes,
            ranks,
            barriers: HashMap::new(),
            failure,
            ended: ended.map(Box::new),
            left,
            next_token: 1,
        })
    }

    /// Records that barrier `seq` of `scope` (node `node_rank` for node scope) completed,
    /// and releases every pending barrier of that scope at or below it.
    fn mark_released(&mut self, scope: Scope, node_rank: u32, seq: u64) {
        let node_rank = if scope == Scope::Node { node_rank } else { 0 };
        let known = self.released.entry((scope, node_rank)).or_insert(0);
        if seq <= *known {
            return;
        }
        *known = seq;
        let done: Vec<BarrierKey> = self
            .barriers
            .keys()
            .filter(|k| k.scope == scope && k.node_rank == node_rank && k.seq <= seq)
            .copied()
            .collect();
        for key in done {
            let b = self.barriers.remove(&key).expect("key listed above");
            self.deliver(key, b.arrivals.iter(), None);
        }
    }

    /// One line saying what `rank` is doing, for the ops view. `held` is the wait its relay
    /// reported, if any: (scope index, seq, name, milliseconds waited).
    fn activity(
        &self,
        rank: u32,
        now: Instant,
        held: Option<&(usize, u64, String, u64)>,
    ) -> String {
        let s = &self.ranks[rank as usize];
        let scope_of = |idx: usize| {
            if idx == Scope::Node.index() {
                scope_name(Scope::Node, s.node_rank)
            } else {
                scope_name(Scope::Global, s.node_rank)
            }
        };
        let heard = ms_since(now, s.last_seen);
        let last = match s.last_scope {
            Some(i) => format!(
                "last barrier: {} #{} '{}'",
                scope_of(i),
                s.seq[i],
                s.names[i]
            ),
            None => "no barrier entered yet".to_owned(),
        };
        match s.state {
            RankState::Pending if s.had_session => {
                format!("re-attaching after a coordinator failover ({last})")
            }
            RankState::Pending => format!(
                "no session yet (the worker has not connected; {}s since the generation started or it was last heard)",
                heard / 1000
            ),
            RankState::Failed => match &self.failure {
                Some(f) if f.rank == rank => format!("failed: {} ({last})", f.reason),
                _ => format!("stopped: its node or generation failed ({last})"),
            },
            RankState::Left => format!("left cleanly ({last})"),
            RankState::Running => {
                for idx in [Scope::Global.index(), Scope::Node.index()] {
                    if s.waiting[idx] {
                        let node_rank = if idx == Scope::Node.index() {
                            s.node_rank
                        } else {
                            0
                        };
                        let key = BarrierKey {
                            scope: if idx == Scope::Node.index() {
                                Scope::Node
                            } else {
                                Scope::Global
                            },
                            node_rank,
                            seq: s.seq[idx],
                        };
                        let waited = self
                            .barriers
                            .get(&key)
                            .map_or(0, |b| ms_since(now, b.first_at));
                        return format!(
                            "waiting at {} #{} '{}' for {waited} ms (heard {heard} ms ago)",
                            scope_of(idx),
                            s.seq[idx],
                            s.names[idx]
                        );
                    }
                }
                if let Some((idx, seq, name, waited)) = held {
                    return format!(
                        "waiting at its node's relay in {} #{seq} '{name}' for {waited} ms (heard {heard} ms ago)",
                        scope_of(*idx)
                    );
                }
                format!("running outside barriers ({last}; heard {heard} ms ago)")
            }
        }
    }

    /// The highest barrier seq of `scope` known complete.
    fn released(&self, scope: Scope, node_rank: u32) -> u64 {
        let node_rank = if scope == Scope::Node { node_rank } else { 0 };
        self.released.get(&(scope, node_rank)).copied().unwrap_or(0)
    }
}

impl RankSlot {
    fn new(node_rank: u32) -> Self {
        Self {
            node_rank,
            state: RankState::Pending,
            pid: 0,
            host: String::new(),
            last_seen: Instant::now(),
            seq: [0; 2],
            done: [0; 2],
            waiting: [false; 2],
            outbox: None,
            had_session: false,
            names: [String::new(), String::new()],
            last_scope: None,
        }
    }

    /// Records the barrier it just entered, for the ops view.
    fn entered(&mut self, idx: usize, name: &str) {
        if self.names[idx] != name {
            self.names[idx] = name.to_owned();
        }
        self.last_scope = Some(idx);
    }
}

impl Job {
    /// Creates a job with its first round open at generation 1 (and persists its record).
    pub fn new(id: JobId, config: RoundConfig, ctx: &JobContext) -> Arc<Self> {
        let state = JobState {
            config,
            generation: 1,
            restarts: 0,
            next_round_seq: 1,
            done: None,
            next_watch: 1,
            drained: HashMap::new(),
            phase: Phase::Open(OpenRound {
                seq: 0,
                joiners: vec![],
                opened: Instant::now(),
                min_reached: None,
            }),
        };
        let job = Self::with_state(id, state, 0, ctx);
        job.persist(&job.lock());
        job
    }

    fn with_state(id: JobId, state: JobState, kv_bytes: usize, ctx: &JobContext) -> Arc<Self> {
        let retired = CancellationToken::new();
        let persist = ctx.store.as_ref().map(|store| {
            let (pending, rx) = watch::channel((0, None));
            let written = watch::channel(0).0;
            // Task "job-record", one per job while a durable store is in use: writes the
            // job's latest record, in order, retrying until it lands or the job is retired.
            // It ends when the job is dropped (the sender goes) or retired.
            tokio::spawn(write_records(
                record_key(&id),
                Arc::clone(store),
                rx,
                written.clone(),
                retired.clone(),
            ));
            Persist { pending, written }
        });
        Arc::new(Self {
            id,
            state: Mutex::new(state),
            changed: watch::channel(0).0,
            kv_bytes: tokio::sync::Mutex::new(kv_bytes),
            incarnation: ctx.incarnation,
            persist,
            retired,
            tenure: ctx.tenure.clone(),
        })
    }

    /// Rebuilds a job from its stored record (a new leader or a restarted coordinator):
    /// the same generation, nodes, ranks and restart count; sessions, relays and watches
    /// re-attach with `resume`. `kv_bytes` is the size of its stored key-value data.
    pub fn restore(
        record: &pb::JobRecord,
        kv_bytes: usize,
        ctx: &JobContext,
    ) -> Result<Arc<Self>, String> {
        let id = JobId::parse(&record.job_id).map_err(|e| e.0)?;
        let config = RoundConfig {
            min_nodes: record.min_nodes.max(1),
            max_nodes: record.max_nodes.max(record.min_nodes).max(1),
            last_call: Duration::from_millis(record.last_call_ms),
            join_timeout: Duration::from_millis(record.join_timeout_ms),
            max_restarts: record.max_restarts,
        };
        let done = if !record.cancelled.is_empty() {
            Some(Done::Cancelled(record.cancelled.clone()))
        } else if !record.failed.is_empty() {
            Some(Done::Failed(record.failed.clone()))
        } else if !record.finished.is_empty() {
            Some(Done::Finished(record.finished.clone()))
        } else {
            None
        };
        let phase = match &record.running {
            Some(r) if r.generation == record.generation => {
                let mut g = Gen::restore(r, record.ended.clone())?;
                if matches!(done, Some(Done::Finished(_))) {
                    // Final: every rank left, whatever bits an older record lacks.
                    for slot in &mut g.ranks {
                        slot.state = RankState::Left;
                    }
                    for node in &mut g.nodes {
                        node.finished = true;
                    }
                    g.left = g.ranks.len() as u32;
                }
                Phase::Running(Box::new(g))
            }
            _ => Phase::Open(OpenRound {
                seq: 0,
                joiners: vec![],
                opened: Instant::now(),
                min_reached: None,
            }),
        };
        let state = JobState {
            config,
            generation: record.generation.max(1),
            restarts: record.restarts,
            next_round_seq: 1,
            phase,
            done,
            next_watch: 1,
            drained: record.drained.clone(),
        };
        Ok(Self::with_state(id, state, kv_bytes, ctx))
    }

    /// The job's record as it stands.
    fn record(&self, st: &JobState) -> pb::JobRecord {
        let c = st.config;
        let (mut failed, mut cancelled, mut finished) =
            (String::new(), String::new(), String::new());
        match &st.done {
            Some(Done::Failed(why)) => failed.clone_from(why),
            Some(Done::Cancelled(why)) => cancelled.clone_from(why),
            Some(Done::Finished(why)) => finished.clone_from(why),
            None => {}
        }
        let (running, ended) = match &st.phase {
            Phase::Running(g) => (
                Some(pb::GenerationRecord {
                    generation: g.generation,
                    values_id: g.values_id.clone(),
                    nodes: g
                        .nodes
                        .iter()
                        .map(|n| pb::NodeRecord {
                            node_id: n.node_id.clone(),
                            host: n.host.clone(),
                            local_world_size: n.local_world_size,
                            rank_offset: n.rank_offset,
                            request_id: n.request_id.clone(),
                            watched: n.watched,
                            finished: n.finished,
                        })
                        .collect(),
                    failure: g.failure.as_ref().map(|f| f.to_info(g.generation)),
                    sessions: rank_bits(&g.ranks, |slot| slot.had_session),
                    left: rank_bits(&g.ranks, |slot| slot.state == RankState::Left),
                }),
                g.ended.as_deref().cloned(),
            ),
            Phase::Open(_) => (None, None),
        };
        pb::JobRecord {
            job_id: self.id.to_string(),
            min_nodes: c.min_nodes,
            max_nodes: c.max_nodes,
            last_call_ms: c.last_call.as_millis() as u64,
            join_timeout_ms: c.join_timeout.as_millis() as u64,
            max_restarts: c.max_restarts,
            generation: st.generation,
            restarts: st.restarts,
            running,
            failed,
            cancelled,
            ended,
            drained: st.drained.clone(),
            finished,
        }
    }

    /// Queues the job's current record for writing; returns its version (0 without a
    /// durable store).
    fn persist(&self, st: &JobState) -> u64 {
        let Some(p) = &self.persist else {
            return 0;
        };
        let record = Arc::new(self.record(st));
        let mut version = 0;
        p.pending.send_modify(|(v, r)| {
            *v += 1;
            version = *v;
            *r = Some(record);
        });
        version
    }

    /// Sends each join answer once the record of version `version` is in the store (at once
    /// without a durable store), so that no node learns a place a new leader would not know.
    fn answer_when_persisted(
        &self,
        version: u64,
        replies: Vec<(
            oneshot::Sender<Result<pb::JoinResponse, Status>>,
            pb::JoinResponse,
        )>,
    ) {
        let Some(p) = &self.persist else {
            for (tx, answer) in replies {
                let _ = tx.send(Ok(answer));
            }
            return;
        };
        let mut written = p.written.subscribe();
        let retired = self.retired.clone();
        let job = self.id.clone();
        // Task "join-answer", one per closed round with a durable store: ends when the
        // record is written or the job is retired.
        tokio::spawn(async move {
            tokio::select! {
                ok = written.wait_for(|w| *w >= version) => {
                    if ok.is_ok() {
                        for (tx, answer) in replies {
                            let _ = tx.send(Ok(answer));
                        }
                    }
                }
                () = retired.cancelled() => {
                    for (tx, _) in replies {
                        let _ = tx.send(Err(Status::unavailable(format!(
                            "the coordinator stopped leading before job '{job}''s new generation was stored; join again"
                        ))));
                    }
                }
            }
        });
    }

    /// Whether this coordinator dropped the job (it stopped leading).
    ///
    /// A coordinator whose lease deadline passed (it did not run, or could not reach etcd)
    /// counts as having dropped it already, before its leadership task has run: it must take
    /// no decision for the job (fail a rank or node, fire a timer's verdict) until it has
    /// stepped down.
    pub fn retired(&self) -> bool {
        self.retired.is_cancelled() || !self.tenure.current()
    }

    /// Drops the job from this coordinator (it no longer leads): every joiner, session,
    /// relay and watch gets UNAVAILABLE with `why` (clients re-attach to the new leader), and
    /// nothing the streams' ends would do (fail ranks, fail nodes) happens any more.
    pub fn retire(&self, why: &str) {
        let mut st = self.lock();
        self.retired.cancel();
        let status = || Status::unavailable(why.to_owned());
        match &mut st.phase {
            Phase::Open(round) => {
                for j in round.joiners.drain(..) {
                    let _ = j.reply.send(Err(status()));
                }
            }
            Phase::Running(g) => {
                for slot in &mut g.ranks {
                    if let Some(outbox) = slot.outbox.take() {
                        let _ = outbox.send(Err(status()));
                    }
                }
                for node in &mut g.nodes {
                    if let Some(relay) = node.relay.take() {
                        let _ = relay.send(Err(status()));
                    }
                    if let Some((_, watch)) = node.watch.take() {
                        let _ = watch.send(Err(status()));
                    }
                }
            }
        }
        drop(st);
        self.notify();
    }

    /// The name of generation `generation`'s values in the store, while it runs.
    pub fn values_id(&self, generation: u64) -> Result<String, Status> {
        let mut st = self.lock();
        Ok(self.running(&mut st, generation)?.values_id.clone())
    }

    fn lock(&self) -> MutexGuard<'_, JobState> {
        // Every mutation below leaves the state consistent before anything that could panic,
        // so a poisoned lock is still usable.
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Wakes every waiter of a published value, key or generation change of this job.
    pub fn notify(&self) {
        self.changed.send_modify(|v| *v = v.wrapping_add(1));
    }

    /// A receiver that sees the next [`Job::notify`].
    pub fn subscribe(&self) -> watch::Receiver<u64> {
        self.changed.subscribe()
    }

    /// The job's round configuration.
    pub fn config(&self) -> RoundConfig {
        self.lock().config
    }

    /// Adds a node to the open round (opening the next one if the job is running). Returns the
    /// round's generation, the call's attempt id (for [`Job::withdraw`]) and the receiver of
    /// the node's assignment.
    pub fn join(self: &Arc<Self>, req: JoinReq) -> Result<(u64, u64, JoinAnswer), Status> {
        let mut st = self.lock();
        let attempt = st.next_watch;
        st.next_watch += 1;
        let config = st.config;
        match &st.done {
            Some(Done::Failed(why)) => {
                return Err(Status::failed_precondition(format!(
                    "job '{}' is over: {why}; start it again under a new job id",
                    self.id
                )));
            }
            Some(Done::Cancelled(why)) => {
                return Err(Status::failed_precondition(format!(
                    "job '{}' was cancelled: {why}",
                    self.id
                )));
            }
            Some(Done::Finished(why)) => {
                return Err(Status::failed_precondition(format!(
                    "job '{}' has finished ({why}); start it again under a new job id",
                    self.id
                )));
            }
            None => {}
        }
        if let Some(reason) = st.drained.get(&req.node_id) {
            return Err(drained_refusal(&self.id, &req.node_id, reason));
        }
        if let Some(r) = req.requested
            && r >= config.max_nodes
        {
            return Err(Status::invalid_argument(format!(
                "requested node rank {r} is out of range for job '{}' (max_nodes {}: ranks 0..{})",
                self.id,
                config.max_nodes,
                config.max_nodes - 1
            )));
        }
        if !req.request_id.is_empty() {
            // A retried join (its answer was lost in a failover): the same place again.
            let (restarts, generation) = (st.restarts, st.generation);
            match &mut st.phase {
                Phase::Running(g) => {
                    if let Some(node_rank) = g
                        .nodes
                        .iter()
                        .position(|n| n.request_id == req.request_id && n.node_id == req.node_id)
                    {
                        let answer = join_answer(
                            &self.id,
                            generation,
                            &g.nodes,
                            node_rank,
                            restarts,
                            config.max_restarts,
                        );
                        let (tx, rx) = oneshot::channel();
                        let version = self.persist.as_ref().map_or(0, |p| p.pending.borrow().0);
                        drop(st);
                        self.answer_when_persisted(version, vec![(tx, answer)]);
                        return Ok((generation, attempt, rx));
                    }
                }
                Phase::Open(round) => {
                    if let Some(j) = round.joiners.iter_mut().find(|j| {
                        j.req.request_id == req.request_id && j.req.node_id == req.node_id
                    }) {
                        // The first call's connection is gone or going: answer this one.
                        let (tx, rx) = oneshot::channel();
                        j.reply = tx;
                        j.attempt = attempt;
                        return Ok((generation, attempt, rx));
                    }
                }
            }
        }
        if let Phase::Open(round) = &st.phase {
            if let Some(j) = round.joiners.iter().find(|j| j.req.node_id == req.node_id) {
                return Err(Status::already_exists(format!(
                    "node '{}' has already joined the open round of job '{}' (host {})",
                    req.node_id, self.id, j.req.host
                )));
            }
            if let Some(r) = req.requested
                && let Some(j) = round.joiners.iter().find(|j| j.req.requested == Some(r))
            {
                return Err(Status::already_exists(format!(
                    "node rank {r} of job '{}' is already requested by node '{}' (host {})",
                    self.id, j.req.node_id, j.req.host
                )));
            }
        } else {
            let restart = self.join_running(&mut st, &req)?;
            let why = if restart {
                format!(
                    "node '{}' (host {}) of generation {} joined again (its agent lost the generation): a restart",
                    req.node_id, req.host, st.generation
                )
            } else {
                format!(
                    "node '{}' (host {}) joined a new rendezvous round",
                    req.node_id, req.host
                )
            };
            self.open_next_round(&mut st, &why, restart);
        }
        let generation = st.generation;
        let (tx, rx) = oneshot::channel();
        let Phase::Open(round) = &mut st.phase else {
            unreachable!("a round was opened above")
        };
        let first = round.joiners.is_empty();
        round.joiners.push(Joiner {
            req,
            reply: tx,
            attempt,
        });
        let joined = round.joiners.len() as u32;
        let round_seq = round.seq;
        tracing::info!(job = %self.id, generation, joined, min = config.min_nodes, max = config.max_nodes, "node joined");
        if first {
            round.opened = Instant::now();
            self.spawn_timer(config.join_timeout, round_seq, Job::on_join_timeout);
        }
        if joined >= config.max_nodes {
            self.close_round(&mut st);
        } else if joined >= config.min_nodes && round.min_reached.is_none() {
            round.min_reached = Some(Instant::now());
            self.spawn_timer(config.last_call, round_seq, Job::on_last_call);
        }
        Ok((generation, attempt, rx))
    }

    /// Whether a join may end the running generation, and whether that is a restart: a join
    /// into a healthy running generation that is full is refused (it must not disturb the
    /// generation: it is usually a second agent given the same job id); one from a node of
    /// the generation itself is a restart (its agent lost the generation), counted against
    /// `max_restarts` and, without budget, the end of the job; one from a new node below
    /// `max_nodes` is a membership change (elastic scale-up), not a restart. After a failure
    /// the generation is already over and any join opens the next round (the failure counts
    /// the restart).
    fn join_running(
        &self,
        st: &mut MutexGuard<'_, JobState>,
        req: &JoinReq,
    ) -> Result<bool, Status> {
        let (config, restarts) = (st.config, st.restarts);
        let Phase::Running(g) = &st.phase else {
            return Ok(false);
        };
        if g.failure.is_some() || g.ended.is_some() {
            return Ok(false);
        }
        let generation = g.generation;
        let Some(node_rank) = g.nodes.iter().position(|n| n.node_id == req.node_id) else {
            let present = g.nodes.len() as u32;
            if present < config.max_nodes {
                return Ok(false);
            }
            tracing::warn!(job = %self.id, generation, node_id = %req.node_id, host = %req.host, "join refused: the running generation is full");
            return Err(Status::failed_precondition(format!(
                "job '{}' is running (generation {generation}, {present} of at most {} nodes, {} ranks); node '{}' (host {}) cannot join it: the job is full, and another join would stop its workers. Is another agent running job id '{}'? Use a new job id, or allow more nodes (--nnodes MIN:MAX)",
                self.id,
                config.max_nodes,
                g.ranks.len(),
                req.node_id,
                req.host,
                self.id
            )));
        };
        if restarts < config.max_restarts {
            return Ok(true);
        }
        let node = &g.nodes[node_rank];
        let failure = Failure {
            rank: node.rank_offset,
            node_rank: node_rank as u32,
            host: node.host.clone(),
            reason: format!(
                "node {node_rank} (host {}, agent {}) joined the job again while generation {generation} ran: its agent lost the generation (restarted, or another agent uses its node id)",
                node.host, node.node_id
            ),
            precise: true,
            detail: FailureDetail::default(),
            node_id: node.node_id.clone(),
        };
        self.fail_generation(st, generation, failure);
        let why = match &st.done {
            Some(Done::Failed(why)) => why.clone(),
            _ => format!("generation {generation} failed"),
        };
        Err(Status::failed_precondition(format!(
            "job '{}' is over: {why}; start it again under a new job id",
            self.id
        )))
    }

    fn spawn_timer(self: &Arc<Self>, after: Duration, round_seq: u64, f: fn(&Job, u64)) {
        let job = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            // A deposed or lapsed leader decides nothing (see `Job::retired`).
            if !job.retired() {
                f(&job, round_seq);
            }
        });
    }

    /// Removes a joiner whose caller went away before its round closed.
    pub fn withdraw(&self, generation: u64, node_id: &str, attempt: u64) {
        let mut st = self.lock();
        if st.generation != generation {
            return;
        }
        let min = st.config.min_nodes;
        if let Phase::Open(round) = &mut st.phase {
            let before = round.joiners.len();
            // A retry of the same join may have taken the place over: keep it.
            round
                .joiners
                .retain(|j| j.req.node_id != node_id || j.attempt != attempt);
            if round.joiners.len() < before {
                tracing::info!(job = %self.id, node_id, "joiner went away before the round closed");
                if (round.joiners.len() as u32) < min {
                    round.min_reached = None;
                }
            }
        }
    }

    fn on_last_call(&self, round_seq: u64) {
        let mut st = self.lock();
        if let Phase::Open(round) = &st.phase
            && round.seq == round_seq
            && round.joiners.len() as u32 >= st.config.min_nodes
        {
            self.close_round(&mut st);
        }
    }

    fn on_join_timeout(&self, round_seq: u64) {
        let mut st = self.lock();
        let (min, timeout) = (st.config.min_nodes, st.config.join_timeout);
        let next_seq = st.next_round_seq;
        let Phase::Open(round) = &mut st.phase else {
            return;
        };
        if round.seq != round_seq || round.joiners.is_empty() {
            return;
        }
        let names: Vec<String> = round
            .joiners
            .iter()
            .map(|j| format!("{} ({})", j.req.node_id, j.req.host))
            .collect();
        let msg = format!(
            "rendezvous of job '{}' timed out after {:.1}s: {} of at least {min} nodes joined [{}]",
            self.id,
            timeout.as_secs_f64(),
            names.len(),
            names.join(", ")
        );
        tracing::warn!(job = %self.id, "{msg}");
        for j in round.joiners.drain(..) {
            let _ = j.reply.send(Err(Status::deadline_exceeded(msg.clone())));
        }
        round.seq = next_seq;
        round.min_reached = None;
        st.next_round_seq += 1;
    }

    /// Ends the running generation (superseded, for `why`) and opens the next round.
    /// `restart`: the supersession itself is a restart (a node of the generation joined
    /// again), counted like a failed generation's; a caller checks the budget first.
    fn open_next_round(&self, st: &mut JobState, why: &str, restart: bool) {
        let old = st.generation;
        let (restarts, max_restarts) = (st.restarts, st.config.max_restarts);
        let mut restart = restart;
        if let Phase::Running(g) = &mut st.phase {
            let mut message = format!(
                "generation {old} of job '{}' was superseded by generation {}: {why}",
                self.id,
                old + 1
            );
            if restart {
                let _ = write!(message, " (restart {} of {max_restarts})", restarts + 1);
            }
            let err = simple_error(ErrKind::StaleGeneration, message.clone());
            g.fail_all_barriers(&err);
            g.relays_failed(&err);
            restart |= g.failure.is_some();
            if g.ended.is_none() {
                g.end(
                    pb::GenerationEnded {
                        generation: old,
                        cause: pb::generation_ended::Cause::Superseded as i32,
                        rejoin: true,
                        failure: None,
                        message,
                        restart_count: restarts,
                        max_restarts,
                    },
                    &st.drained,
                );
            }
        }
        if restart {
            st.restarts += 1;
            crate::metrics::restarted();
        }
        st.generation += 1;
        st.phase = Phase::Open(OpenRound {
            seq: st.next_round_seq,
            joiners: vec![],
            opened: Instant::now(),
            min_reached: None,
        });
        st.next_round_seq += 1;
        tracing::info!(job = %self.id, generation = st.generation, "new rendezvous round opened");
        self.persist(st);
        self.notify();
    }

    fn close_round(&self, st: &mut JobState) {
        let Phase::Open(round) = &mut st.phase else {
            return;
        };
        let n = round.joiners.len();
        if round
            .joiners
            .iter()
            .any(|j| j.req.requested.is_some_and(|r| r as usize >= n))
        {
            // A requested rank beyond the nodes present cannot be dense yet: wait for more
            // nodes (or the join timeout).
            tracing::info!(job = %self.id, joined = n, "round not closed: a requested node rank is beyond the nodes present");
            return;
        }
        let joiners = std::mem::take(&mut round.joiners);
        crate::metrics::rendezvous_closed(round.opened.elapsed());
        let mut order: Vec<Option<Joiner>> = (0..n).map(|_| None).collect();
        let mut rest = vec![];
        for j in joiners {
            match j.req.requested {
                Some(r) => order[r as usize] = Some(j),
                None => rest.push(j),
            }
        }
        let mut rest = rest.into_iter();
        let joiners: Vec<Joiner> = order
            .into_iter()
            .map(|slot| slot.or_else(|| rest.next()))
            .collect::<Option<Vec<_>>>()
            .unwrap_or_default();
        let mut nodes = Vec::with_capacity(n);
        let mut ranks = vec![];
        let mut offset = 0u32;
        for (node_rank, j) in joiners.iter().enumerate() {
            nodes.push(NodeSlot {
                node_id: j.req.node_id.clone(),
                request_id: j.req.request_id.clone(),
                host: j.req.host.clone(),
                local_world_size: j.req.local_world_size,
                rank_offset: offset,
                relay: None,
                report: None,
                watch: None,
                finished: false,
                watched: false,
                last_seen: None,
            });
            for _ in 0..j.req.local_world_size {
                ranks.push(RankSlot::new(node_rank as u32));
            }
            offset += j.req.local_world_size;
        }
        let world_size = offset;
        let generation = st.generation;
        let restart_count = st.restarts;
        let max_restarts = st.config.max_restarts;
        let mut replies = Vec::with_capacity(n);
        for (node_rank, j) in joiners.into_iter().enumerate() {
            replies.push((
                j.reply,
                join_answer(
                    &self.id,
                    generation,
                    &nodes,
                    node_rank,
                    restart_count,
                    max_restarts,
                ),
            ));
        }
        tracing::info!(job = %self.id, generation, nodes = n, world_size, "rendezvous round closed");
        st.phase = Phase::Running(Box::new(Gen {
            generation,
            values_id: format!("{}-{generation}", self.incarnation),
            recovered: false,
            released: HashMap::new(),
            nodes,
            ranks,
            barriers: HashMap::new(),
            failure: None,
            ended: None,
            left: 0,
            next_token: 1,
        }));
        let version = self.persist(st);
        self.answer_when_persisted(version, replies);
        self.notify();
    }

    /// The running generation `generation`, or the FAILED_PRECONDITION status for any other.
    fn running<'a>(&self, st: &'a mut JobState, generation: u64) -> Result<&'a mut Gen, Status> {
        let current = st.generation;
        match &mut st.phase {
            Phase::Running(g) if g.generation == generation => Ok(g),
            Phase::Running(_) => Err(Status::failed_precondition(stale(
                &self.id, generation, current, false,
            ))),
            Phase::Open(_) => Err(Status::failed_precondition(stale(
                &self.id, generation, current, true,
            ))),
        }
    }

    /// Checks that `rank` belongs to the running generation `generation`.
    pub fn check_member(&self, generation: u64, rank: u32) -> Result<GenStatus, Status> {
        let mut st = self.lock();
        let g = self.running(&mut st, generation)?;
        if rank as usize >= g.ranks.len() {
            return Err(Status::invalid_argument(format!(
                "rank {rank} is outside job '{}' generation {generation} (world size {})",
                self.id,
                g.ranks.len()
            )));
        }
        Ok(match &g.failure {
            Some(f) => GenStatus::Failed(f.describe(&self.id, generation)),
            None => GenStatus::Alive,
        })
    }

    /// Registers a worker session for `rank`. `resume` carries the last barrier seq the
    /// worker was released from per scope (global, node) when it re-attaches after a failover:
    /// those barriers count as complete here, releasing any peer still waiting at them.
    pub fn register(
        &self,
        generation: u64,
        rank: u32,
        pid: u32,
        host: String,
        outbox: Outbox,
        resume: Option<[u64; 2]>,
    ) -> Result<Registration, Status> {
        let mut st = self.lock();
        let id = self.id.clone();
        let g = self.running(&mut st, generation)?;
        let world = g.ranks.len();
        if let Some(f) = &g.failure {
            return Err(Status::failed_precondition(f.describe(&id, generation)));
        }
        let Some(slot) = g.ranks.get_mut(rank as usize) else {
            return Err(Status::invalid_argument(format!(
                "rank {rank} is outside job '{id}' generation {generation} (world size {world})"
            )));
        };
        if slot.state != RankState::Pending {
            return Err(Status::already_exists(format!(
                "rank {rank} of job '{id}' generation {generation} is already registered (pid {} on host {})",
                slot.pid, slot.host
            )));
        }
        slot.state = RankState::Running;
        slot.pid = pid;
        slot.host = host;
        slot.last_seen = Instant::now();
        slot.outbox = Some(outbox);
        let node_rank = slot.node_rank;
        let first_session = !std::mem::replace(&mut slot.had_session, true);
        if let Some(released) = resume {
            // The rank's place in each scope's sequence, as it was under the last leader.
            for scope in [Scope::Global, Scope::Node] {
                let idx = scope.index();
                let slot = &mut g.ranks[rank as usize];
                slot.seq[idx] = slot.seq[idx].max(released[idx]);
                slot.done[idx] = slot.done[idx].max(released[idx]);
                g.mark_released(scope, node_rank, released[idx]);
            }
            tracing::info!(job = %id, generation, rank, released_global = released[0], released_node = released[1], "session resumed");
        }
        let registration = Registration {
            node_rank,
            num_nodes: g.nodes.len() as u32,
            world_size: world as u32,
        };
        if first_session {
            // Coalesced with the other ranks' registrations by the record writer.
            self.persist(&st);
        }
        Ok(registration)
    }

    /// Records a heartbeat.
    pub fn touch(&self, generation: u64, rank: u32) {
        let mut st = self.lock();
        if let Ok(g) = self.running(&mut st, generation)
            && let Some(slot) = g.ranks.get_mut(rank as usize)
        {
            slot.last_seen = Instant::now();
        }
    }

    /// A barrier entry from `rank`'s session. The answer goes out through the session's outbox
    /// (now, or when the barrier completes or fails).
    #[allow(clippy::too_many_arguments)]
    pub fn barrier(
        self: &Arc<Self>,
        generation: u64,
        rank: u32,
        scope: Scope,
        seq: u64,
        name: String,
        timeout: Option<Duration>,
        outbox: &Outbox,
    ) {
        let mut st = self.lock();
        let g = match self.running(&mut st, generation) {
            Ok(g) => g,
            Err(status) => {
                let err = simple_error(ErrKind::StaleGeneration, status.message().to_owned());
                let _ = outbox.send(Ok(result(scope, seq, Some(err))));
                return;
            }
        };
        let reply_now = |err: pb::BarrierError| {
            let _ = outbox.send(Ok(result(scope, seq, Some(err))));
        };
        if let Some(f) = &g.failure {
            return reply_now(f.to_error(&self.id, generation));
        }
        let idx = scope.index();
        // Sessions only pass ranks `register` checked; the check keeps that assumption from
        // ever becoming a panic (found by the job_ops fuzz target).
        let Some(node_rank) = g.ranks.get(rank as usize).map(|s| s.node_rank) else {
            return reply_now(simple_error(
                ErrKind::Unspecified,
                format!(
                    "rank {rank} is outside job '{}' generation {generation} (world size {})",
                    self.id,
                    g.ranks.len()
                ),
            ));
        };
        if seq <= g.released(scope, node_rank) {
            // Completed under the previous leader; this rank's answer was lost in the failover.
            let slot = &mut g.ranks[rank as usize];
            if !slot.waiting[idx] {
                slot.seq[idx] = slot.seq[idx].max(seq);
                slot.done[idx] = slot.done[idx].max(seq);
                let _ = outbox.send(Ok(result(scope, seq, None)));
                return;
            }
        }
        let slot = &mut g.ranks[rank as usize];
        slot.last_seen = Instant::now();
        let fresh = seq == slot.seq[idx] + 1;
        let retry = seq == slot.seq[idx] && slot.done[idx] < seq;
        if slot.waiting[idx] || !(fresh || retry) {
            return reply_now(simple_error(
                ErrKind::Unspecified,
                format!(
                    "rank {rank} sent {} #{seq}, but its last was #{}{}: barrier calls must be numbered 1, 2, 3... per scope, one at a time",
                    scope_name(scope, slot.node_rank),
                    slot.seq[idx],
                    if slot.waiting[idx] {
                        " and is still waiting"
                    } else {
                        ""
                    }
                ),
            ));
        }
        let node_rank = slot.node_rank;
        let key = BarrierKey {
            scope,
            node_rank: if scope == Scope::Node { node_rank } else { 0 },
            seq,
        };
        if let Some(err) = g.left_error(&key, &self.id) {
            return reply_now(err);
        }
        let token = g.next_token;
        g.next_token += 1;
        let expected = g.scope_ranks(scope, key.node_rank).len() as u32;
        let slot = &mut g.ranks[rank as usize];
        slot.seq[idx] = seq;
        slot.waiting[idx] = true;
        slot.entered(idx, &name);
        let b = g.barriers.entry(key).or_insert_with(|| Barrier {
            expected,
            names: vec![],
            arrivals: vec![],
            first_at: Instant::now(),
            diverged: false,
        });
        let name_idx = match b.names.iter().position(|n| *n == name) {
            Some(i) => i,
            None => {
                b.names.push(name);
                b.names.len() - 1
            }
        };
        b.arrivals.push(Arrival {
            rank,
            name: name_idx,
            token,
            relayed: false,
        });
        self.settle(g, key, timeout, token);
    }

    /// After arrivals were added to barrier `key`: reports divergence, releases a complete
    /// barrier, or arms the timeout of the wait `token`.
    fn settle(
        self: &Arc<Self>,
        g: &mut Gen,
        key: BarrierKey,
        timeout: Option<Duration>,
        token: u64,
    ) {
        let generation = g.generation;
        let b = g.barriers.get(&key).expect("settle follows an arrival");
        let complete = b.arrivals.len() as u32 >= b.expected;
        if b.names.len() > 1 {
            // Divergence: everyone at this barrier, now and later, gets the same error.
            let msg = g.divergence_message(&key, b);
            tracing::warn!(job = %self.id, generation, "{msg}");
            let err = simple_error(ErrKind::Diverged, msg);
            let mut b = g.barriers.remove(&key).expect("present above");
            b.diverged = true;
            g.deliver(key, b.arrivals.iter(), Some(&err));
            if !complete {
                g.barriers.insert(key, b);
            }
            return;
        }
        if complete {
            let b = g.barriers.remove(&key).expect("present above");
            g.deliver(key, b.arrivals.iter(), None);
            crate::metrics::barrier_completed(b.first_at.elapsed());
            let known = g.released.entry((key.scope, key.node_rank)).or_insert(0);
            *known = (*known).max(key.seq);
            return;
        }
        if let Some(t) = timeout {
            let job = Arc::clone(self);
            tokio::spawn(async move {
                tokio::time::sleep(t).await;
                if !job.retired() {
                    job.barrier_timeout(generation, key, token, t);
                }
            });
        }
    }

    fn barrier_timeout(&self, generation: u64, key: BarrierKey, token: u64, after: Duration) {
        let mut st = self.lock();
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let Some(b) = g.barriers.get_mut(&key) else {
            return;
        };
        let (withdrawn, kept): (Vec<Arrival>, Vec<Arrival>) = std::mem::take(&mut b.arrivals)
            .into_iter()
            .partition(|a| a.token == token);
        b.arrivals = kept;
        let Some(first) = withdrawn.first() else {
            return;
        };
        let name = b.names[first.name].clone();
        let (rank, relayed) = (first.rank, first.relayed);
        let b = g.barriers.get(&key).expect("present above");
        let mut missing = g.missing(&key, b);
        missing.retain(|m| !withdrawn.iter().any(|w| w.rank == m.rank));
        if b.arrivals.is_empty() {
            g.barriers.remove(&key);
        }
        for w in &withdrawn {
            // The rank's sequence number stays: it may retry the same barrier.
            g.ranks[w.rank as usize].waiting[key.scope.index()] = false;
        }
        let who = if relayed {
            format!(
                "ranks {}..={} (node {})",
                rank,
                withdrawn[withdrawn.len() - 1].rank,
                g.ranks[rank as usize].node_rank
            )
        } else {
            format!("rank {rank}")
        };
        let err = pb::BarrierError {
            kind: ErrKind::Timeout as i32,
            message: format!(
                "{} #{} ({name}) timed out after {:.3}s on {who} of job '{}' generation {generation}; missing ranks: {}",
                scope_name(key.scope, key.node_rank),
                key.seq,
                after.as_secs_f64(),
                self.id,
                list_ranks(&missing)
            ),
            missing,
            ..Default::default()
        };
        tracing::warn!(job = %self.id, generation, "{}", err.message);
        if relayed {
            g.relay_send(
                g.ranks[rank as usize].node_rank,
                relay_result(key.seq, Some(err)),
            );
        } else {
            g.send(rank, result(key.scope, key.seq, Some(err)));
        }
    }

    /// Registers the relay of node `node_rank`: from now on its agent may enter global
    /// barriers for the node's ranks, and hears of the generation's failure.
    /// Sends `registered` (then `failed`, if the generation already failed) under the lock,
    /// so no event can overtake them.
    pub fn relay_register(
        &self,
        generation: u64,
        node_rank: u32,
        outbox: RelayOutbox,
        heartbeat_interval: Duration,
        resume: Option<u64>,
    ) -> Result<(), Status> {
        let mut st = self.lock();
        let id = self.id.clone();
        let g = self.running(&mut st, generation)?;
        let num_nodes = g.nodes.len() as u32;
        let world_size = g.ranks.len() as u32;
        let Some(node) = g.nodes.get_mut(node_rank as usize) else {
            return Err(Status::invalid_argument(format!(
                "node rank {node_rank} is outside job '{id}' generation {generation} ({num_nodes} nodes)"
            )));
        };
        if node.relay.as_ref().is_some_and(|r| !r.is_closed()) {
            return Err(Status::already_exists(format!(
                "node {node_rank} of job '{id}' generation {generation} already has a relay"
            )));
        }
        let _ = outbox.send(Ok(pb::RelayEvent {
            kind: Some(pb::relay_event::Kind::Registered(pb::Registered {
                heartbeat_interval_ms: heartbeat_interval.as_millis() as u64,
                world_size,
                node_rank,
                num_nodes,
            })),
        }));
        if let Some(f) = &g.failure {
            let _ = outbox.send(Ok(pb::RelayEvent {
                kind: Some(pb::relay_event::Kind::Failed(f.to_error(&id, generation))),
            }));
        }
        g.nodes[node_rank as usize].relay = Some(outbox);
        if let Some(released) = resume {
            let node = &g.nodes[node_rank as usize];
            for r in node.rank_offset..node.rank_offset + node.local_world_size {
                let slot = &mut g.ranks[r as usize];
                let idx = Scope::Global.index();
                slot.seq[idx] = slot.seq[idx].max(released);
                slot.done[idx] = slot.done[idx].max(released);
            }
            g.mark_released(Scope::Global, 0, released);
            tracing::info!(job = %id, generation, node_rank, released, "relay resumed");
        }
        Ok(())
    }

    /// Keeps node `node_rank`'s report of the waits its relay holds (replacing the last one),
    /// for the ops view. Ranks outside the node are dropped from it.
    pub fn relay_report(
        &self,
        generation: u64,
        node_rank: u32,
        mut barriers: Vec<pb::BarrierInfo>,
    ) {
        let mut st = self.lock();
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let Some(node) = g.nodes.get(node_rank as usize) else {
            return;
        };
        let local = node.rank_offset..node.rank_offset + node.local_world_size;
        for b in &mut barriers {
            b.node_rank = node_rank;
            for n in &mut b.names {
                n.ranks.retain(|r| local.contains(r));
            }
        }
        g.nodes[node_rank as usize].report =
            (!barriers.is_empty()).then(|| (Instant::now(), barriers));
    }

    /// A relay's aggregated entry: every rank in `groups` enters global barrier `seq`. All
    /// ranks are checked before any is recorded; the answer goes to the relay (once for the
    /// node).
    pub fn barrier_group(
        self: &Arc<Self>,
        generation: u64,
        node_rank: u32,
        seq: u64,
        groups: Vec<(String, Vec<u32>)>,
        timeout: Option<Duration>,
        outbox: &RelayOutbox,
    ) {
        let mut st = self.lock();
        let id = self.id.clone();
        let reply_now = |err: pb::BarrierError| {
            let _ = outbox.send(Ok(relay_result(seq, Some(err))));
        };
        let g = match self.running(&mut st, generation) {
            Ok(g) => g,
            Err(status) => {
                return reply_now(simple_error(
                    ErrKind::StaleGeneration,
                    status.message().to_owned(),
                ));
            }
        };
        if let Some(f) = &g.failure {
            return reply_now(f.to_error(&id, generation));
        }
        let idx = Scope::Global.index();
        if seq <= g.released(Scope::Global, 0) {
            // Completed under the previous leader; the node's answer was lost in the failover.
            for (_, ranks) in &groups {
                for &rank in ranks {
                    if let Some(slot) = g.ranks.get_mut(rank as usize)
                        && slot.node_rank == node_rank
                        && !slot.waiting[idx]
                    {
                        slot.seq[idx] = slot.seq[idx].max(seq);
                        slot.done[idx] = slot.done[idx].max(seq);
                    }
                }
            }
            let _ = outbox.send(Ok(relay_result(seq, None)));
            return;
        }
        let recovered = g.recovered;
        let mut seen = std::collections::HashSet::new();
        for (_, ranks) in &groups {
            for &rank in ranks {
                let problem = match g.ranks.get(rank as usize) {
                    None => Some(format!(
                        "rank {rank} is outside the world ({})",
                        g.ranks.len()
                    )),
                    Some(slot) if slot.node_rank != node_rank => Some(format!(
                        "rank {rank} is on node {}, not on the relay's node {node_rank}",
                        slot.node_rank
                    )),
                    Some(slot)
                        if slot.state != RankState::Running
                            && !(recovered && slot.state == RankState::Pending) =>
                    {
                        Some(format!(
                            "rank {rank} has no live session ({:?})",
                            slot.state
                        ))
                    }
                    Some(slot)
                        if slot.waiting[idx]
                            || !(seq == slot.seq[idx] + 1
                                || (seq == slot.seq[idx] && slot.done[idx] < seq)) =>
                    {
                        Some(format!(
                            "rank {rank} is at global barrier #{} and cannot enter #{seq}",
                            slot.seq[idx]
                        ))
                    }
                    Some(_) if !seen.insert(rank) => Some(format!("rank {rank} is named twice")),
                    Some(_) => None,
                };
                if let Some(problem) = problem {
                    return reply_now(simple_error(
                        ErrKind::Unspecified,
                        format!(
                            "relay of node {node_rank} entered global barrier #{seq} for job '{id}' generation {generation}: {problem}"
                        ),
                    ));
                }
            }
        }
        let key = BarrierKey {
            scope: Scope::Global,
            node_rank: 0,
            seq,
        };
        if let Some(err) = g.left_error(&key, &id) {
            return reply_now(err);
        }
        let token = g.next_token;
        g.next_token += 1;
        let expected = g.ranks.len() as u32;
        let now = Instant::now();
        for (name, ranks) in &groups {
            for &rank in ranks {
                let slot = &mut g.ranks[rank as usize];
                slot.seq[idx] = seq;
                slot.waiting[idx] = true;
                slot.last_seen = now;
                slot.entered(idx, name);
            }
        }
        let b = g.barriers.entry(key).or_insert_with(|| Barrier {
            expected,
            names: vec![],
            arrivals: vec![],
            first_at: now,
            diverged: false,
        });
        for (name, ranks) in groups {
            let name_idx = match b.names.iter().position(|n| *n == name) {
                Some(i) => i,
                None => {
                    b.names.push(name);
                    b.names.len() - 1
                }
            };
            b.arrivals.extend(ranks.into_iter().map(|rank| Arrival {
                rank,
                name: name_idx,
                token,
                relayed: true,
            }));
        }
        self.settle(g, key, timeout, token);
    }

    /// Marks `rank` failed and fails its generation (if it is the first failure): every
    /// pending barrier of the generation gets an error naming the rank, and every node's agent
    /// learns whether to restart. A `detail` (from the agent: exit status, signal, error file)
    /// replaces a first reason that was only "session lost".
    pub fn fail_rank(
        &self,
        generation: u64,
        rank: u32,
        reason: String,
        detail: Option<FailureDetail>,
    ) {
        let mut st = self.lock();
        if self.retired() || matches!(st.done, Some(Done::Finished(_) | Done::Cancelled(_))) {
            // A finished or cancelled job is final; a failed one only learns the precise
            // reason of its first failure below.
            return;
        }
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let Some(slot) = g.ranks.get_mut(rank as usize) else {
            return;
        };
        let precise = detail.is_some();
        if slot.state == RankState::Left && !precise {
            return;
        }
        slot.state = RankState::Failed;
        slot.outbox = None;
        if let Some(f) = &mut g.failure {
            if f.rank == rank && precise && !f.precise {
                f.reason = reason;
                f.precise = true;
                f.detail = detail.unwrap_or_default();
                // Tell the agents again: they print the most precise reason they heard.
                if let Some(ended) = &g.ended
                    && ended.cause == pb::generation_ended::Cause::Failed as i32
                {
                    let mut ended = (**ended).clone();
                    ended.failure = Some(f.to_info(generation));
                    g.end(ended, &HashMap::new());
                }
                self.persist(&st);
            }
            return;
        }
        let loc = g.location(rank);
        let failure = Failure {
            rank,
            node_rank: loc.node_rank,
            host: loc.host,
            reason,
            precise,
            detail: detail.unwrap_or_default(),
            node_id: String::new(),
        };
        self.fail_generation(&mut st, generation, failure);
    }

    /// A node's agent went away or went silent while its ranks ran: fails the generation
    /// naming the node (and its first live rank).
    pub fn node_lost(&self, generation: u64, node_rank: u32, watch_id: u64, why: &str) {
        let mut st = self.lock();
        if self.retired() {
            return;
        }
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let Some(node) = g.nodes.get_mut(node_rank as usize) else {
            return;
        };
        if node.watch.as_ref().is_some_and(|(id, _)| *id != watch_id) {
            // A newer stream of the same agent replaced this one.
            return;
        }
        // Dropping the outbox ends the stream's answers.
        node.watch = None;
        if node.finished {
            return;
        }
        let range = node.rank_offset..node.rank_offset + node.local_world_size;
        let Some(rank) = range.clone().find(|r| {
            matches!(
                g.ranks[*r as usize].state,
                RankState::Pending | RankState::Running
            )
        }) else {
            // Its ranks all left: it may have been the last thing the job waited for.
            if self.check_finished(&mut st) {
                self.persist(&st);
                drop(st);
                self.notify();
            }
            return;
        };
        let node_id = node.node_id.clone();
        let host = node.host.clone();
        for r in range {
            let slot = &mut g.ranks[r as usize];
            if matches!(slot.state, RankState::Pending | RankState::Running) {
                slot.state = RankState::Failed;
                slot.outbox = None;
            }
        }
        if g.failure.is_some() {
            return;
        }
        let failure = Failure {
            rank,
            node_rank,
            host: host.clone(),
            reason: format!("node {node_rank} (host {host}, agent {node_id}) was lost: {why}"),
            precise: true,
            detail: FailureDetail::default(),
            node_id,
        };
        self.fail_generation(&mut st, generation, failure);
    }

    /// Records the generation's first failure, fails its waits, tells the agents whether to
    /// restart, and marks the job over when no restart is left. Takes the lock's guard and
    /// releases it.
    fn fail_generation(&self, st: &mut MutexGuard<'_, JobState>, generation: u64, f: Failure) {
        if st.done.is_some() {
            // Final (finished, failed or cancelled): nothing changes it any more.
            return;
        }
        let (restarts, max_restarts) = (st.restarts, st.config.max_restarts);
        let rejoin = restarts < max_restarts;
        let id = self.id.clone();
        let text = f.describe(&id, generation);
        if !rejoin {
            st.done = Some(Done::Failed(if max_restarts == 0 {
                text.clone()
            } else {
                format!("{text} (no restarts left: {restarts} of {max_restarts} used)")
            }));
        }
        let Ok(g) = self.running(st, generation) else {
            return;
        };
        tracing::warn!(job = %id, generation, rejoin, "{text}");
        crate::metrics::generation_failed(&f);
        let err = f.to_error(&id, generation);
        let info = f.to_info(generation);
        g.failure = Some(f);
        g.fail_all_barriers(&err);
        g.relays_failed(&err);
        g.sessions_failed(&err);
        let message = if rejoin {
            format!(
                "{text}; restarting (restart {} of {max_restarts})",
                restarts + 1
            )
        } else if max_restarts == 0 {
            text
        } else {
            format!("{text}; no restarts left ({restarts} of {max_restarts} used)")
        };
        g.end(
            pb::GenerationEnded {
                generation,
                cause: pb::generation_ended::Cause::Failed as i32,
                rejoin,
                failure: Some(info),
                message,
                restart_count: restarts,
                max_restarts,
            },
            &HashMap::new(),
        );
        self.persist(st);
        self.notify();
    }

    /// Attaches a node's watch stream (replacing an earlier one of the same node). Answers
    /// `attached`, then at once `ended` if the generation has already ended. Returns the
    /// attach's id, which [`Job::node_lost`] takes.
    pub fn watch(
        &self,
        generation: u64,
        node_rank: u32,
        node_id: &str,
        outbox: NodeOutbox,
        attached: pb::NodeAttached,
    ) -> Result<u64, Status> {
        let mut st = self.lock();
        let watch_id = st.next_watch;
        st.next_watch += 1;
        let id = self.id.clone();
        let drained = st.drained.clone();
        let g = self.running(&mut st, generation)?;
        let Some(node) = g.nodes.get_mut(node_rank as usize) else {
            return Err(Status::invalid_argument(format!(
                "node rank {node_rank} is outside job '{id}' generation {generation} ({} nodes)",
                g.nodes.len()
            )));
        };
        if node.node_id != node_id {
            return Err(Status::permission_denied(format!(
                "node rank {node_rank} of job '{id}' generation {generation} is node '{}', not '{node_id}'",
                node.node_id
            )));
        }
        let _ = outbox.send(Ok(pb::NodeEvent {
            kind: Some(pb::node_event::Kind::Attached(attached)),
        }));
        if let Some(ended) = &g.ended {
            let _ = outbox.send(Ok(pb::NodeEvent {
                kind: Some(pb::node_event::Kind::Ended(drained_end(
                    ended, node_id, &drained,
                ))),
            }));
        }
        node.watch = Some((watch_id, outbox));
        node.last_seen = Some(Instant::now());
        if !std::mem::replace(&mut node.watched, true) {
            self.persist(&st);
        }
        Ok(watch_id)
    }

    /// After a failover: once `grace` has passed, fails the recovered generation if a node
    /// whose agent had a watch, or a rank that had a session, has not re-attached (it died
    /// while no coordinator led, so no one saw it go).
    /// A job restored in a final state (finished, failed, cancelled) expects no re-attach.
    pub fn arm_recovery_grace(self: &Arc<Self>, grace: Duration) {
        if self.lock().done.is_some() {
            return;
        }
        let job = Arc::clone(self);
        // Task "recovery-grace", one per recovered job: sleeps once, then checks.
        tokio::spawn(async move {
            tokio::time::sleep(grace).await;
            job.check_reattached(grace);
        });
    }

    fn check_reattached(&self, grace: Duration) {
        let mut st = self.lock();
        if self.retired() || st.done.is_some() {
            return;
        }
        let Phase::Running(g) = &mut st.phase else {
            return;
        };
        if !g.recovered || g.failure.is_some() || g.ended.is_some() {
            return;
        }
        let generation = g.generation;
        // A node whose ranks all left cleanly is not awaited either (its agent may have
        // exited before it could say the node finished).
        let lost_node = g.nodes.iter().position(|n| {
            n.watched
                && n.watch.is_none()
                && !n.finished
                && (n.rank_offset..n.rank_offset + n.local_world_size)
                    .any(|r| g.ranks[r as usize].state != RankState::Left)
        });
        // A rank that left cleanly (restored as Left) or whose node finished is not awaited.
        let lost_rank = g.ranks.iter().position(|r| {
            r.had_session
                && r.state == RankState::Pending
                && !g.nodes[r.node_rank as usize].finished
        });
        let failure = if let Some(n) = lost_node {
            let node = &g.nodes[n];
            Failure {
                rank: node.rank_offset,
                node_rank: n as u32,
                host: node.host.clone(),
                reason: format!(
                    "node {n} (host {}, agent {}) did not re-attach within {:.1}s after the coordinator failover (its agent stopped or cannot reach the new leader)",
                    node.host,
                    node.node_id,
                    grace.as_secs_f64()
                ),
                precise: true,
                detail: FailureDetail::default(),
                node_id: node.node_id.clone(),
            }
        } else if let Some(r) = lost_rank {
            let loc = g.location(r as u32);
            g.ranks[r].state = RankState::Failed;
            Failure {
                rank: r as u32,
                node_rank: loc.node_rank,
                host: loc.host,
                reason: format!(
                    "its session did not re-attach within {:.1}s after the coordinator failover (process gone or cannot reach the new leader)",
                    grace.as_secs_f64()
                ),
                precise: false,
                detail: FailureDetail::default(),
                node_id: String::new(),
            }
        } else {
            if self.check_finished(&mut st) {
                self.persist(&st);
                drop(st);
                self.notify();
            }
            return;
        };
        self.fail_generation(&mut st, generation, failure);
    }

    /// A node's workers all exited 0: its ranks count as left (workers that never opened a
    /// session included), and its watch stream may end without failing anything; the last
    /// node to finish finishes the job. Returns once that is in the store (at once without
    /// one, or when this coordinator stops leading): the agent exits when its stream ends,
    /// and a new leader must not read a finished node as one that vanished. Cancel-safe: the
    /// state changes before the first `.await`.
    pub async fn node_finished(&self, generation: u64, node_rank: u32) {
        self.mark_node_finished(generation, node_rank);
        self.persisted().await;
    }

    fn mark_node_finished(&self, generation: u64, node_rank: u32) {
        let mut st = self.lock();
        let id = self.id.clone();
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let Some(node) = g.nodes.get_mut(node_rank as usize) else {
            return;
        };
        let newly_finished = !std::mem::replace(&mut node.finished, true);
        let range = node.rank_offset..node.rank_offset + node.local_world_size;
        let mut newly_left = false;
        for r in range {
            let slot = &mut g.ranks[r as usize];
            if matches!(slot.state, RankState::Pending | RankState::Running) {
                slot.state = RankState::Left;
                slot.outbox = None;
                g.left += 1;
                newly_left = true;
            }
        }
        if newly_left {
            let keys: Vec<BarrierKey> = g.barriers.keys().copied().collect();
            for key in keys {
                if let Some(err) = g.left_error(&key, &id) {
                    let b = g.barriers.remove(&key).expect("key listed above");
                    g.fail_barrier(key, b, &err);
                }
            }
        }
        if newly_finished || newly_left {
            self.check_finished(&mut st);
            self.persist(&st);
        }
        drop(st);
        self.notify();
    }

    /// Marks the job finished (final) once every rank of its healthy running generation has
    /// left and every node whose agent watched it has finished (or went away after its ranks
    /// left). Returns whether it did; the caller persists.
    fn check_finished(&self, st: &mut JobState) -> bool {
        if st.done.is_some() {
            return false;
        }
        let Phase::Running(g) = &st.phase else {
            return false;
        };
        if g.failure.is_some()
            || g.ended.is_some()
            || (g.left as usize) < g.ranks.len()
            || g.nodes.iter().any(|n| !n.finished && n.watch.is_some())
        {
            return false;
        }
        let why = format!(
            "every rank of generation {} ({} ranks on {} nodes) left cleanly",
            g.generation,
            g.ranks.len(),
            g.nodes.len()
        );
        tracing::info!(job = %self.id, generation = g.generation, "job finished: {why}");
        st.done = Some(Done::Finished(why));
        true
    }

    /// Waits until the record queued last is in the store (at once without a durable store;
    /// gives up when the job is retired).
    async fn persisted(&self) {
        let Some(p) = &self.persist else {
            return;
        };
        let version = p.pending.borrow().0;
        let mut written = p.written.subscribe();
        tokio::select! {
            _ = written.wait_for(|w| *w >= version) => {}
            () = self.retired.cancelled() => {}
        }
    }

    /// Cancels the job: joiners of an open round and every wait of the running generation
    /// get an error, the agents are told to stop, and later joins are refused. A job already
    /// over (finished, failed or cancelled) stays as it is: returns false.
    pub fn cancel(&self, why: &str) -> bool {
        let mut st = self.lock();
        if st.done.is_some() {
            return false;
        }
        st.done = Some(Done::Cancelled(why.to_owned()));
        let (generation, restarts, max_restarts) =
            (st.generation, st.restarts, st.config.max_restarts);
        let message = format!("job '{}' was cancelled: {why}", self.id);
        match &mut st.phase {
            Phase::Open(round) => {
                for j in round.joiners.drain(..) {
                    let _ = j.reply.send(Err(Status::aborted(message.clone())));
                }
            }
            Phase::Running(g) => {
                let err = simple_error(ErrKind::Cancelled, message.clone());
                crate::metrics::generation_ended(crate::metrics::Cause::Cancelled);
                g.fail_all_barriers(&err);
                g.relays_failed(&err);
                g.end(
                    pb::GenerationEnded {
                        generation,
                        cause: pb::generation_ended::Cause::Cancelled as i32,
                        rejoin: false,
                        failure: None,
                        message,
                        restart_count: restarts,
                        max_restarts,
                    },
                    &HashMap::new(),
                );
            }
        }
        self.persist(&st);
        drop(st);
        self.notify();
        true
    }

    /// Drains a node (`Ops.DrainNode`): marks it drained (persisted, so its joins stay
    /// refused after a failover) and supersedes the running generation, so that the other
    /// nodes rejoin without it while the drained node's agent hears CAUSE_DRAINED without
    /// rejoin. In an open round the node's pending join is refused instead. Not a restart:
    /// the restart count is unchanged. Refused when fewer than min_nodes would remain.
    pub fn drain(&self, node: &NodeRef, reason: &str) -> Result<pb::DrainNodeResponse, Status> {
        let mut st = self.lock();
        let id = self.id.clone();
        match &st.done {
            Some(Done::Failed(why)) => {
                return Err(Status::failed_precondition(format!(
                    "job '{id}' is over ({why}); there is nothing to drain"
                )));
            }
            Some(Done::Cancelled(why)) => {
                return Err(Status::failed_precondition(format!(
                    "job '{id}' was cancelled ({why}); there is nothing to drain"
                )));
            }
            Some(Done::Finished(why)) => {
                return Err(Status::failed_precondition(format!(
                    "job '{id}' has finished ({why}); there is nothing to drain"
                )));
            }
            None => {}
        }
        if let NodeRef::Id(node_id) = node
            && let Some(why) = st.drained.get(node_id)
        {
            return Err(Status::failed_precondition(format!(
                "node '{node_id}' of job '{id}' is already drained ({why})"
            )));
        }
        let min = st.config.min_nodes;
        let max = st.config.max_nodes;
        let generation = st.generation;
        let too_few = |present: usize, node_id: &str| {
            Status::failed_precondition(format!(
                "draining node '{node_id}' would leave job '{id}' with {} of its {present} nodes, below its min_nodes {min} (nodes {min}:{max}); the drain was refused",
                present - 1
            ))
        };
        match &mut st.phase {
            Phase::Open(round) => {
                let node_id = match node {
                    NodeRef::Id(node_id) => node_id,
                    NodeRef::Rank(r) => {
                        return Err(Status::invalid_argument(format!(
                            "node rank {r}: job '{id}' has no running generation (its round for generation {generation} is open, node ranks are given when it closes); name the node by node_id"
                        )));
                    }
                };
                let Some(pos) = round.joiners.iter().position(|j| j.req.node_id == *node_id) else {
                    let known: Vec<&str> = round
                        .joiners
                        .iter()
                        .map(|j| j.req.node_id.as_str())
                        .collect();
                    return Err(Status::invalid_argument(format!(
                        "node '{node_id}' has not joined job '{id}' (the open round of generation {generation} has [{}])",
                        known.join(", ")
                    )));
                };
                let present = round.joiners.len();
                if (present as u32) - 1 < min {
                    return Err(too_few(present, node_id));
                }
                let j = round.joiners.remove(pos);
                if (round.joiners.len() as u32) < min {
                    round.min_reached = None;
                }
                let remaining = round.joiners.len() as u32;
                tracing::info!(job = %id, node_id = %node_id, reason, "joiner drained from the open round");
                let _ = j.reply.send(Err(drained_refusal(&id, node_id, reason)));
                st.drained.insert(node_id.clone(), reason.to_owned());
                self.persist(&st);
                drop(st);
                self.notify();
                Ok(pb::DrainNodeResponse {
                    node_id: node_id.clone(),
                    generation,
                    remaining_nodes: remaining,
                })
            }
            Phase::Running(g) => {
                let found = match node {
                    NodeRef::Id(node_id) => g.nodes.iter().position(|n| n.node_id == *node_id),
                    NodeRef::Rank(r) => ((*r as usize) < g.nodes.len()).then_some(*r as usize),
                };
                let Some(node_rank) = found else {
                    let known: Vec<String> = g
                        .nodes
                        .iter()
                        .enumerate()
                        .map(|(i, n)| format!("{i}: '{}'", n.node_id))
                        .collect();
                    return Err(Status::invalid_argument(format!(
                        "{node} is not part of job '{id}' generation {generation} (nodes {})",
                        known.join(", ")
                    )));
                };
                let n = &g.nodes[node_rank];
                let node_id = n.node_id.clone();
                if n.finished {
                    return Err(Status::failed_precondition(format!(
                        "node {node_rank} ('{node_id}') of job '{id}' has finished: every worker exited 0; there is nothing to drain"
                    )));
                }
                if let Some(ended) = &g.ended {
                    return Err(Status::failed_precondition(format!(
                        "generation {generation} of job '{id}' is already ending ({}); drain once the next generation runs",
                        ended.message
                    )));
                }
                let present = g.nodes.len();
                if (present as u32) - 1 < min {
                    return Err(too_few(present, &node_id));
                }
                let host = n.host.clone();
                st.drained.insert(node_id.clone(), reason.to_owned());
                tracing::info!(job = %id, generation, node_rank, node_id = %node_id, reason, "node drained");
                self.open_next_round(
                    &mut st,
                    &format!(
                        "node {node_rank} ('{node_id}', host {host}) was drained by an operator ({reason})"
                    ),
                    false,
                );
                Ok(pb::DrainNodeResponse {
                    node_id,
                    generation,
                    remaining_nodes: present as u32 - 1,
                })
            }
        }
    }

    /// The node's agent was heard on its watch `watch_id` (a heartbeat).
    pub fn node_heartbeat(&self, generation: u64, node_rank: u32, watch_id: u64) {
        let mut st = self.lock();
        if let Ok(g) = self.running(&mut st, generation)
            && let Some(node) = g.nodes.get_mut(node_rank as usize)
            && node.watch.as_ref().is_some_and(|(id, _)| *id == watch_id)
        {
            node.last_seen = Some(Instant::now());
        }
    }

    /// `rank` ends its session cleanly.
    pub fn leave(&self, generation: u64, rank: u32) {
        let mut st = self.lock();
        let id = self.id.clone();
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let Some(slot) = g.ranks.get_mut(rank as usize) else {
            return;
        };
        if slot.state != RankState::Running {
            return;
        }
        slot.state = RankState::Left;
        slot.outbox = None;
        g.left += 1;
        let keys: Vec<BarrierKey> = g.barriers.keys().copied().collect();
        for key in keys {
            if let Some(err) = g.left_error(&key, &id) {
                let b = g.barriers.remove(&key).expect("key listed above");
                g.fail_barrier(key, b, &err);
            }
        }
        // The record's left ranks: a new leader does not wait for them.
        let finished = self.check_finished(&mut st);
        self.persist(&st);
        if finished {
            drop(st);
            self.notify();
        }
    }

    /// The running generation's state, for publishes and fetches: Ok when `rank` is a member
    /// of generation `generation`; the error is the status to return.
    pub fn alive_member(&self, generation: u64, rank: u32) -> Result<(), Status> {
        match self.check_member(generation, rank)? {
            GenStatus::Alive => Ok(()),
            GenStatus::Failed(msg) => Err(Status::aborted(msg)),
        }
    }

    /// The ops view of this job: its nodes, ranks, pending barriers (the coordinator's and
    /// those its relays reported) and, for every rank a barrier waits for, what that rank is
    /// doing instead.
    pub fn describe(&self) -> pb::DescribeJobResponse {
        let st = self.lock();
        let config = pb::RendezvousConfig {
            min_nodes: st.config.min_nodes,
            max_nodes: st.config.max_nodes,
            last_call_ms: st.config.last_call.as_millis() as u64,
            join_timeout_ms: st.config.join_timeout.as_millis() as u64,
            max_restarts: Some(st.config.max_restarts),
        };
        let mut resp = pb::DescribeJobResponse {
            summary: Some(self.summary_locked(&st)),
            config: Some(config),
            restart_count: st.restarts,
            drained: st.drained.clone(),
            ..Default::default()
        };
        let now = Instant::now();
        match &st.phase {
            Phase::Open(round) => {
                resp.nodes = round
                    .joiners
                    .iter()
                    .map(|j| pb::NodeInfo {
                        node_id: j.req.node_id.clone(),
                        node_rank: j.req.requested.unwrap_or(u32::MAX),
                        host: j.req.host.clone(),
                        local_world_size: j.req.local_world_size,
                        rank_offset: 0,
                        state: pb::NodeState::Joining as i32,
                        ..Default::default()
                    })
                    .collect();
            }
            Phase::Running(g) => {
                resp.nodes = g
                    .nodes
                    .iter()
                    .enumerate()
                    .map(|(i, n)| {
                        let ranks = n.rank_offset..n.rank_offset + n.local_world_size;
                        let failed = ranks
                            .clone()
                            .any(|r| g.ranks[r as usize].state == RankState::Failed);
                        let state = if st.drained.contains_key(&n.node_id) {
                            pb::NodeState::Drained
                        } else if n.finished {
                            pb::NodeState::Finished
                        } else if failed {
                            pb::NodeState::Failed
                        } else if n.watch.is_some() {
                            pb::NodeState::Running
                        } else {
                            pb::NodeState::Starting
                        };
                        pb::NodeInfo {
                            node_id: n.node_id.clone(),
                            node_rank: i as u32,
                            host: n.host.clone(),
                            local_world_size: n.local_world_size,
                            rank_offset: n.rank_offset,
                            state: state as i32,
                            last_seen_ms_ago: n.last_seen.map(|at| ms_since(now, at)),
                            ..Default::default()
                        }
                    })
                    .collect();
                // Waits held by relays, by rank: (scope index, seq, name, reported age).
                let mut held: HashMap<u32, (usize, u64, String, u64)> = HashMap::new();
                for node in &g.nodes {
                    let Some((at, barriers)) = &node.report else {
                        continue;
                    };
                    let age = ms_since(now, *at);
                    for b in barriers {
                        let idx = if b.scope == pb::BarrierScope::Node as i32 {
                            Scope::Node.index()
                        } else {
                            Scope::Global.index()
                        };
                        for n in &b.names {
                            for r in &n.ranks {
                                held.insert(*r, (idx, b.seq, n.name.clone(), b.waiting_ms + age));
                            }
                        }
                    }
                }
                let restarts = st.restarts;
                resp.ranks = g
                    .ranks
                    .iter()
                    .enumerate()
                    .map(|(r, s)| {
                        let r = r as u32;
                        let node = &g.nodes[s.node_rank as usize];
                        let mut state = rank_state(s);
                        if state == pb::RankState::Running && held.contains_key(&r) {
                            state = pb::RankState::Waiting;
                        }
                        pb::RankInfo {
                            rank: r,
                            node_rank: s.node_rank,
                            host: g.location(r).host,
                            pid: s.pid,
                            state: state as i32,
                            last_seen_ms_ago: ms_since(now, s.last_seen),
                            global_seq: s.seq[0],
                            node_seq: s.seq[1],
                            local_rank: r - node.rank_offset,
                            restart_count: restarts,
                            last_barrier: s
                                .last_scope
                                .map_or_else(String::new, |i| s.names[i].clone()),
                            activity: g.activity(r, now, held.get(&r)),
                        }
                    })
                    .collect();
                let mut barriers: Vec<_> = g.barriers.iter().collect();
                barriers.sort_by_key(|(k, _)| (k.scope.index(), k.node_rank, k.seq));
                resp.barriers = barriers
                    .into_iter()
                    .map(|(k, b)| pb::BarrierInfo {
                        scope: k.scope.to_wire(),
                        node_rank: k.node_rank,
                        seq: k.seq,
                        names: b
                            .names
                            .iter()
                            .enumerate()
                            .map(|(i, name)| pb::BarrierName {
                                name: name.clone(),
                                ranks: b
                                    .arrivals
                                    .iter()
                                    .filter(|a| a.name == i)
                                    .map(|a| a.rank)
                                    .collect(),
                            })
                            .collect(),
                        missing: g.missing(k, b),
                        waiting_ms: ms_since(now, b.first_at),
                        missing_detail: vec![],
                    })
                    .collect();
                // Waits held by relays: shown as reported, aged to now.
                for node in &g.nodes {
                    let Some((at, barriers)) = &node.report else {
                        continue;
                    };
                    let age = ms_since(now, *at);
                    for b in barriers {
                        resp.barriers.push(pb::BarrierInfo {
                            waiting_ms: b.waiting_ms + age,
                            ..b.clone()
                        });
                    }
                }
                // What each missing rank does instead.
                for b in &mut resp.barriers {
                    let idx = if b.scope == pb::BarrierScope::Node as i32 {
                        Scope::Node.index()
                    } else {
                        Scope::Global.index()
                    };
                    b.missing_detail = b
                        .missing
                        .iter()
                        .filter_map(|m| {
                            let s = g.ranks.get(m.rank as usize)?;
                            let info = &resp.ranks[m.rank as usize];
                            Some(pb::MissingRank {
                                rank: m.rank,
                                node_rank: m.node_rank,
                                host: m.host.clone(),
                                state: info.state,
                                last_seen_ms_ago: info.last_seen_ms_ago,
                                last_seq: s.seq[idx],
                                last_barrier: s.names[idx].clone(),
                                activity: info.activity.clone(),
                            })
                        })
                        .collect();
                }
                resp.failure = g.failure.as_ref().map(|f| f.to_info(g.generation));
            }
        }
        resp
    }

    /// One line of the job list.
    pub fn summary(&self) -> pb::JobSummary {
        let st = self.lock();
        self.summary_locked(&st)
    }

    fn summary_locked(&self, st: &JobState) -> pb::JobSummary {
        let mut s = pb::JobSummary {
            job_id: self.id.to_string(),
            generation: st.generation,
            restart_count: st.restarts,
            max_restarts: st.config.max_restarts,
            done: st.done.is_some(),
            ..Default::default()
        };
        match &st.phase {
            Phase::Open(round) => {
                s.state = if matches!(st.done, Some(Done::Cancelled(_))) {
                    pb::RoundState::Cancelled
                } else {
                    pb::RoundState::Open
                } as i32;
                s.nodes_waiting = round.joiners.len() as u32;
            }
            Phase::Running(g) => {
                s.num_nodes = g.nodes.len() as u32;
                s.world_size = g.ranks.len() as u32;
                s.state = if matches!(st.done, Some(Done::Cancelled(_))) {
                    pb::RoundState::Cancelled
                } else if g.failure.is_some() {
                    pb::RoundState::Failed
                } else if matches!(st.done, Some(Done::Finished(_))) {
                    pb::RoundState::Finished
                } else {
                    pb::RoundState::Running
                } as i32;
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn req(node_id: &str) -> JoinReq {
        JoinReq {
            node_id: node_id.into(),
            host: format!("host-{node_id}"),
            local_world_size: 1,
            requested: None,
            request_id: String::new(),
        }
    }

    #[tokio::test]
    async fn the_drained_set_is_in_the_record_and_a_restored_job_still_refuses_the_node() {
        let ctx = JobContext {
            incarnation: 1,
            store: None,
            tenure: crate::tenure::Tenure::always(),
        };
        let config = RoundConfig {
            min_nodes: 1,
            max_nodes: 2,
            last_call: Duration::from_secs(60),
            join_timeout: Duration::from_secs(60),
            max_restarts: 2,
        };
        let job = Job::new(JobId::parse("j").unwrap(), config, &ctx);
        let (_, _, a) = job.join(req("a")).unwrap();
        let (_, _, b) = job.join(req("b")).unwrap();
        a.await.unwrap().unwrap();
        b.await.unwrap().unwrap();
        let resp = job.drain(&NodeRef::Id("b".into()), "maintenance").unwrap();
        assert_eq!((resp.generation, resp.remaining_nodes), (1, 1));
        let record = job.record(&job.lock());
        assert_eq!(
            record.drained.get("b").map(String::as_str),
            Some("maintenance")
        );
        assert_eq!((record.generation, record.restarts), (2, 0));
        let restored = Job::restore(&record, 0, &ctx).unwrap();
        let err = restored.join(req("b")).unwrap_err();
        assert_eq!(err.code(), tonic::Code::FailedPrecondition);
        assert!(err.message().contains("was drained"), "{err:?}");
        assert!(err.metadata().contains_key(DRAINED_METADATA));
        assert!(restored.join(req("a")).is_ok());
    }

    fn ctx() -> JobContext {
        JobContext {
            incarnation: 1,
            store: None,
            tenure: crate::tenure::Tenure::always(),
        }
    }

    fn config(nodes: u32, max_restarts: u32) -> RoundConfig {
        RoundConfig {
            min_nodes: nodes,
            max_nodes: nodes,
            last_call: Duration::from_secs(60),
            join_timeout: Duration::from_secs(60),
            max_restarts,
        }
    }

    /// A job of `nodes` single-rank nodes n0.. whose round closed (generation 1).
    async fn formed(nodes: u32, max_restarts: u32) -> Arc<Job> {
        let job = Job::new(
            JobId::parse("j").unwrap(),
            config(nodes, max_restarts),
            &ctx(),
        );
        let mut answers = vec![];
        for n in 0..nodes {
            answers.push(job.join(req(&format!("n{n}"))).unwrap().2);
        }
        for a in answers {
            a.await.unwrap().unwrap();
        }
        job
    }

    /// The job's state, restart count and final message, as DescribeJob and the record show
    /// them.
    fn outcome(job: &Job) -> (i32, u32, String) {
        let summary = job.summary();
        let record = job.record(&job.lock());
        let why = [record.finished, record.failed, record.cancelled].concat();
        (summary.state, summary.restart_count, why)
    }

    /// Every late event a final job can meet; none may change it.
    async fn every_late_event(job: &Arc<Job>) {
        job.fail_rank(
            1,
            0,
            "exited with status 9".into(),
            Some(FailureDetail {
                exit_code: Some(9),
                ..FailureDetail::default()
            }),
        );
        job.fail_rank(1, 1, "its session was lost".into(), None);
        job.node_lost(1, 0, 0, "its agent disconnected");
        job.node_lost(1, 1, 0, "no heartbeat from its agent for 10.0s");
        job.check_reattached(Duration::from_secs(10));
        job.cancel("too late");
        let _ = job.drain(&NodeRef::Rank(0), "too late");
        let _ = job.join(req("stranger"));
        let _ = job.join(req("n0"));
        job.node_finished(1, 0).await;
    }

    #[tokio::test]
    async fn a_final_state_never_changes() {
        // Finished: every node's workers exited 0.
        let finished = formed(2, 3).await;
        finished.node_finished(1, 0).await;
        assert_eq!(finished.summary().state, pb::RoundState::Running as i32);
        finished.node_finished(1, 1).await;
        let before = outcome(&finished);
        assert_eq!(before.0, pb::RoundState::Finished as i32, "{before:?}");
        assert!(before.2.contains("left cleanly"), "{before:?}");
        every_late_event(&finished).await;
        assert_eq!(outcome(&finished), before);
        assert!(finished.summary().done);
        let e = finished.join(req("n0")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.message().contains("job 'j' has finished"),
            "{}",
            e.message()
        );

        // Cancelled: a worker stopped by the cancel exits by a signal afterwards.
        let cancelled = formed(2, 3).await;
        assert!(cancelled.cancel("operator"));
        let before = outcome(&cancelled);
        assert_eq!(before.0, pb::RoundState::Cancelled as i32, "{before:?}");
        every_late_event(&cancelled).await;
        assert_eq!(outcome(&cancelled), before);

        // Failed with no restarts left.
        let failed = formed(2, 0).await;
        failed.fail_rank(1, 1, "exited with status 3".into(), None);
        let before = outcome(&failed);
        assert_eq!(before.0, pb::RoundState::Failed as i32, "{before:?}");
        every_late_event(&failed).await;
        let after = outcome(&failed);
        assert_eq!((after.0, after.1), (before.0, before.1));
        // Only the first failure's reason may become more precise (the agent's report).
        assert!(after.2.contains("rank 1"), "{after:?}");
    }

    #[tokio::test]
    async fn a_job_restored_finished_expects_no_reattach() {
        let job = formed(2, 0).await;
        for node_rank in 0..2 {
            // As if both agents had watched: a failover must wait for neither.
            let mut st = job.lock();
            let Phase::Running(g) = &mut st.phase else {
                unreachable!()
            };
            g.nodes[node_rank].watched = true;
            g.ranks[node_rank].had_session = true;
        }
        job.node_finished(1, 0).await;
        // Half finished: node 0 is not awaited after a failover, node 1 is.
        let half = Job::restore(&job.record(&job.lock()), 0, &ctx()).unwrap();
        half.check_reattached(Duration::from_secs(10));
        let f = half.describe().failure.unwrap();
        assert_eq!(f.node_rank, 1, "{f:?}");
        assert!(f.reason.contains("did not re-attach"), "{f:?}");

        job.node_finished(1, 1).await;
        let record = job.record(&job.lock());
        assert!(record.finished.contains("left cleanly"), "{record:?}");
        let restored = Job::restore(&record, 0, &ctx()).unwrap();
        restored.check_reattached(Duration::from_secs(10));
        let d = restored.describe();
        assert!(d.failure.is_none(), "{:?}", d.failure);
        let summary = d.summary.unwrap();
        assert_eq!(summary.state, pb::RoundState::Finished as i32);
        assert!(summary.done);
        assert_eq!(outcome(&restored), outcome(&job));
    }

    #[tokio::test]
    async fn a_join_into_a_full_running_generation_is_refused_and_changes_nothing() {
        let job = formed(1, 0).await;
        let e = job.join(req("stranger")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        for part in ["job 'j' is running", "1 of at most 1 nodes", "'stranger'"] {
            assert!(e.message().contains(part), "{part}: {}", e.message());
        }
        let s = job.summary();
        assert_eq!(
            (s.state, s.generation, s.restart_count),
            (pb::RoundState::Running as i32, 1, 0)
        );
    }

    #[tokio::test]
    async fn a_known_node_joining_again_is_a_restart_within_the_budget() {
        let job = formed(1, 1).await;
        let (generation, _, answer) = job.join(req("n0")).unwrap();
        assert_eq!(generation, 2);
        let answer = answer.await.unwrap().unwrap();
        assert_eq!((answer.generation, answer.restart_count), (2, 1));
        // The budget is spent: the next one ends the job, naming the node.
        let e = job.join(req("n0")).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.message().contains("is over") && e.message().contains("joined the job again"),
            "{}",
            e.message()
        );
        let s = job.summary();
        assert_eq!(
            (s.state, s.restart_count, s.done),
            (pb::RoundState::Failed as i32, 1, true)
        );
    }
}
