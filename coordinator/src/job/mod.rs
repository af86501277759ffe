//! One job's live state: its rendezvous round, the running generation's ranks and sessions,
//! its barriers and its failure. Everything here is synchronous and runs under the job's lock,
//! which is held for microseconds and never across an `.await`; replies go out through
//! unbounded channels (session outboxes) or oneshots (joiners), so nothing blocks under it.
//!
//! This file holds the job's state and lock; each responsibility adds its own `impl Job`
//! block in a file of its own:
//! - `rendezvous.rs`: joins, rounds and their timers, and opening the next generation;
//! - `generation.rs`: a running generation's nodes, ranks and barrier waits, and how answers
//!   reach sessions, relays and watches;
//! - `barriers.rs`: sessions and relays registering, and entering barriers (their timeouts);
//! - `ending.rs`: how a generation or the job ends (failure, the restart budget, finish,
//!   cancel);
//! - `nodes.rs`: agents' watches (the node lease), recovery after a failover, drains;
//! - `persist.rs`: the job record, its writer task, and restoring a job from it;
//! - `recovery.rs`: in-place recovery (a dead rank replaced alone, and `Quorum`);
//! - `spares.rs`: spare agents standing by, and one taking a lost node's place;
//! - `push.rs`: the wire messages the job pushes (barrier results, failures, ends, join
//!   answers);
//! - `hangs.rs`: stack dumps across the nodes (`DumpStacks`) and hang detection;
//! - `views.rs`: the ops views (`DescribeJob`, the job list).

mod barriers;
mod ending;
mod generation;
mod hangs;
mod nodes;
mod persist;
mod push;
mod recovery;
mod rendezvous;
mod restarts;
mod spares;
#[cfg(test)]
mod spares_tests;
#[cfg(test)]
mod tests;
mod training;
mod views;

pub use barriers::Registration;
pub use hangs::{HangDue, StackDump};
pub use muster_core::error::DRAINED_METADATA;
pub use muster_core::failure::{Failure, FailureDetail};
pub use muster_core::requests::{Hang, JoinReq, NodeRef, OnHang, Recovery, RoundConfig};
pub use nodes::Drained;
pub use persist::{RECORDS_PREFIX, record_key};
pub use push::rank_event;
pub use recovery::QuorumAnswer;

use crate::store::Store;
use ending::*;
use generation::*;
use hangs::Progress;
use muster_core::barrier::{self, Place};
use muster_core::error::Error;
use muster_core::model::{JobId, Scope, barrier_error as simple_error, scope_name};
use muster_proto::v1 as pb;
use nodes::*;
use pb::barrier_error::Kind as ErrKind;
use persist::*;
use push::*;
use rendezvous::*;
use spares::*;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};
use tokio::sync::{mpsc, oneshot, watch};
use tokio_util::sync::CancellationToken;
use tonic::Status;

/// Where a rank's answers and pushes go: its own session stream, or, for a rank registered
/// through its node's relay (issue 29), that relay's stream, each message wrapped in a
/// `RankEvent` naming the rank.
#[derive(Debug, Clone)]
pub enum Outbox {
    /// The stream tonic sends to the worker's session.
    Session(mpsc::UnboundedSender<Result<pb::CoordinatorMessage, Status>>),
    /// The relay stream of the rank's node.
    Relayed {
        /// The rank the messages are for.
        rank: u32,
        /// The relay's stream.
        relay: RelayOutbox,
    },
}

impl From<mpsc::UnboundedSender<Result<pb::CoordinatorMessage, Status>>> for Outbox {
    fn from(session: mpsc::UnboundedSender<Result<pb::CoordinatorMessage, Status>>) -> Self {
        Self::Session(session)
    }
}

impl Outbox {
    /// Sends `message` to the rank: a message, or the status its session ends with (through a
    /// relay, a `refused` event: the relay's stream goes on for the node's other ranks).
    /// `Err` when the stream is gone.
    pub fn send(&self, message: Result<pb::CoordinatorMessage, Status>) -> Result<(), Closed> {
        match self {
            Self::Session(session) => session.send(message).map_err(|_| Closed),
            Self::Relayed { rank, relay } => relay
                .send(Ok(rank_event(*rank, message)))
                .map_err(|_| Closed),
        }
    }

    /// Whether the stream the messages go to has ended.
    pub fn is_closed(&self) -> bool {
        match self {
            Self::Session(session) => session.is_closed(),
            Self::Relayed { relay, .. } => relay.is_closed(),
        }
    }
}

/// The stream an [`Outbox`] sends to has ended.
#[derive(Debug)]
pub struct Closed;

/// Where a relaying agent's answers go.
pub type RelayOutbox = mpsc::UnboundedSender<Result<pb::RelayEvent, Status>>;

/// Where a node's watch events go (its agent's `Rendezvous.Watch` stream).
pub type NodeOutbox = mpsc::UnboundedSender<Result<pb::NodeEvent, Status>>;

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
    /// The failures of the job's generations, newest first, at most [`RECENT_FAILURES`].
    recent_failures: std::collections::VecDeque<pb::FailureInfo>,
    /// The hangs detected in this job, newest first, at most [`hangs::RECENT_HANGS`].
    hangs: std::collections::VecDeque<pb::HangReport>,
    /// The stack dumps in flight: where each node's answer goes.
    dumps: hangs::Dumps,
    /// Rank 0's step markers, for the effective training time (kept across generations).
    steps: training::Steps,
    /// The recent restarts' timeline (persisted).
    restart_timeline: restarts::RestartTimeline,
    /// Spare agents standing by (persisted).
    spares: Vec<Spare>,
    /// Nodes whose place a spare took (node id to why): their agents are refused (persisted).
    replaced: HashMap<String, String>,
}

/// How many generations' failures a job keeps for its view.
const RECENT_FAILURES: usize = 8;

/// A job: its lock-protected state plus a change signal for waiters of published values.
pub struct Job {
    /// The job's id.
    pub id: JobId,
    state: Mutex<JobState>,
    changed: watch::Sender<u64>,
    /// Wake-ups of waits for one published value (a unique id, a shared value), by store key:
    /// a publish wakes its key's waiters only, so that N ranks fetching K ids make about N + K
    /// wake-ups rather than N × K. An entry lives while a waiter holds it.
    values: Mutex<HashMap<String, watch::Sender<u64>>>,
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
    /// [`JobContext::heartbeat_timeout`].
    heartbeat_timeout: Duration,
    /// The job itself, for tasks that act on it once its record is stored.
    me: std::sync::Weak<Job>,
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
    /// The heartbeat timeout: a node that said it would hold a lease and has not attached its
    /// watch twice this long after the rendezvous is lost.
    pub heartbeat_timeout: Duration,
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
            recent_failures: Default::default(),
            hangs: Default::default(),
            dumps: Default::default(),
            steps: Default::default(),
            restart_timeline: Default::default(),
            spares: vec![],
            replaced: HashMap::new(),
            phase: Phase::Open(OpenRound {
                seq: 0,
                joiners: Joiners::default(),
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
        Arc::new_cyclic(|me| Self {
            persist: ctx.store.as_ref().map(|store| {
                let (pending, rx) = watch::channel(0);
                let written = watch::channel(0).0;
                // Task "job-record", one per job while a durable store is in use: writes the
                // job's latest record, in order, retrying until it lands or the job is
                // retired. It ends when the job is dropped (its weak handle and the sender
                // go) or retired.
                tokio::spawn(write_records(
                    record_key(&id),
                    Arc::clone(store),
                    me.clone(),
                    rx,
                    written.clone(),
                    retired.clone(),
                ));
                Persist { pending, written }
            }),
            id,
            me: me.clone(),
            state: Mutex::new(state),
            changed: watch::channel(0).0,
            values: Mutex::default(),
            kv_bytes: tokio::sync::Mutex::new(kv_bytes),
            incarnation: ctx.incarnation,
            retired,
            tenure: ctx.tenure.clone(),
            heartbeat_timeout: ctx.heartbeat_timeout,
        })
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
        let error = || Error::Unavailable(why.to_owned());
        let status = || Status::from(error());
        match &mut st.phase {
            Phase::Open(round) => {
                for j in round.joiners.drain() {
                    let _ = j.reply.send(Err(error()));
                }
            }
            Phase::Running(g) => {
                for slot in &mut g.ranks {
                    if let Some(outbox) = slot.outbox.take() {
                        let _ = outbox.send(Err(status()));
                    }
                }
                g.end_quorums(error);
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
        // Spares send their joins again to the new leader.
        for spare in &mut st.spares {
            if let Some(reply) = spare.reply.take() {
                let _ = reply.send(Err(error()));
            }
        }
        drop(st);
        self.notify();
    }

    /// The name of generation `generation`'s values in the store, while it runs.
    pub fn values_id(&self, generation: u64) -> Result<String, Error> {
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

    /// A receiver woken when the value under store key `key` is published
    /// ([`Job::published`]). Take it before looking for the value, so that a publish in
    /// between is not missed; call [`Job::forget_value`] once done waiting.
    pub fn watch_value(&self, key: &str) -> watch::Receiver<u64> {
        let mut values = self.values.lock().unwrap_or_else(|e| e.into_inner());
        match values.get(key) {
            Some(tx) => tx.subscribe(),
            None => {
                let (tx, rx) = watch::channel(0);
                values.insert(key.to_owned(), tx);
                rx
            }
        }
    }

    /// Wakes every wait for the value under store key `key`: it was published.
    pub fn published(&self, key: &str) {
        let woken = self
            .values
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(key);
        if let Some(tx) = woken {
            tx.send_modify(|v| *v = v.wrapping_add(1));
        }
    }

    /// Drops `key`'s wake-up once no wait holds it (a waiter that found its value or gave up,
    /// its receiver dropped).
    pub fn forget_value(&self, key: &str) {
        let mut values = self.values.lock().unwrap_or_else(|e| e.into_inner());
        if values.get(key).is_some_and(|tx| tx.receiver_count() == 0) {
            values.remove(key);
        }
    }

    /// The job's round configuration.
    pub fn config(&self) -> RoundConfig {
        self.lock().config
    }

    /// The running generation `generation`, or the FAILED_PRECONDITION status for any other.
    fn running<'a>(&self, st: &'a mut JobState, generation: u64) -> Result<&'a mut Gen, Error> {
        let current = st.generation;
        match &mut st.phase {
            Phase::Running(g) if g.generation == generation => Ok(g),
            Phase::Running(_) => Err(Error::WrongGeneration(stale(
                &self.id, generation, current, false,
            ))),
            Phase::Open(_) => Err(Error::WrongGeneration(stale(
                &self.id, generation, current, true,
            ))),
        }
    }

    /// Checks that `rank` belongs to the running generation `generation`.
    pub fn check_member(&self, generation: u64, rank: u32) -> Result<GenStatus, Error> {
        let mut st = self.lock();
        let g = self.running(&mut st, generation)?;
        if rank as usize >= g.ranks.len() {
            return Err(Error::InvalidArgument(format!(
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

    /// The world size of generation `generation`, once `rank` is checked to be in it.
    pub fn world_size(&self, generation: u64, rank: u32) -> Result<u32, Error> {
        self.check_member(generation, rank)?;
        let mut st = self.lock();
        Ok(self.running(&mut st, generation)?.ranks.len() as u32)
    }

    /// The running generation's state, for publishes and fetches: Ok when `rank` is a member
    /// of generation `generation`; the error is the status to return.
    pub fn alive_member(&self, generation: u64, rank: u32) -> Result<(), Error> {
        match self.check_member(generation, rank)? {
            GenStatus::Alive => Ok(()),
            GenStatus::Failed(msg) => Err(Error::Aborted(msg)),
        }
    }
}
