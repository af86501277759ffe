//! A running generation's state: its nodes, ranks and barrier waits, and how answers reach
//! the sessions, relays and watches attached to it. No lock or timer here: [`Job`] holds the
//! generation under its lock and calls in.

use super::*;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum RankState {
    Pending,
    Running,
    Failed,
    Left,
    /// In-place recovery: it died and its replacement has not registered yet.
    Replacing,
}

pub(super) struct NodeSlot {
    pub(super) node_id: String,
    /// The request id of the join that placed the node.
    pub(super) request_id: String,
    pub(super) host: String,
    pub(super) local_world_size: u32,
    pub(super) rank_offset: u32,
    /// The node's agent, when it relays the node's global barriers.
    pub(super) relay: Option<RelayOutbox>,
    /// The relay's latest report of the waits it holds, and when it came.
    pub(super) report: Option<(Instant, Vec<pb::BarrierInfo>)>,
    /// The agent's watch stream (its lease), and which attach it was (a reconnect replaces it).
    pub(super) watch: Option<(u64, NodeOutbox)>,
    /// The highest attach number its agent registered a watch with (not persisted: a new
    /// leader takes the first open it reads).
    pub(super) attempt: u64,
    /// Every worker of the node exited 0.
    pub(super) finished: bool,
    /// Its agent said at its join that it would watch the node, or has attached a watch in
    /// this generation (persisted).
    pub(super) watched: bool,
    /// When its agent was last heard on its watch (attach or heartbeat).
    pub(super) last_seen: Option<Instant>,
    /// Watch ids below this one are a replaced agent's: their end loses nothing.
    pub(super) min_watch: u64,
    /// The spare that took this place over, and whose place it was (persisted).
    pub(super) took_over: Option<pb::SpareTakeover>,
}

pub(super) struct RankSlot {
    pub(super) node_rank: u32,
    pub(super) state: RankState,
    pub(super) pid: u32,
    pub(super) host: String,
    pub(super) last_seen: Instant,
    /// Its place in the barrier sequence of each scope (the shared rule for what it may
    /// enter next).
    pub(super) place: Place,
    pub(super) outbox: Option<Outbox>,
    /// The rank has opened a session in this generation (persisted).
    pub(super) had_session: bool,
    /// The name of the last barrier entered, per scope.
    pub(super) names: [String; 2],
    /// The scope of the last barrier entered (an index into `seq`), if any.
    pub(super) last_scope: Option<usize>,
    /// Which session holds the slot (a replacement's is newer than the dead worker's, whose
    /// late end must not fail it).
    pub(super) session: u64,
    /// In-place recovery: the replacement order for it while it is REPLACING (sent again
    /// when its node's agent re-attaches its watch).
    pub(super) replace: Option<pb::RankReplace>,
    /// The version of the job record that holds `replace` (0: one a new leader restored).
    /// The order goes to the agent only once that record is in the store: a process started
    /// for a decision the next leader would not know breaks the rule that a membership epoch
    /// names one decision.
    pub(super) replace_version: u64,
    /// Its agent's latest summary of its stack samples.
    pub(super) sampled: Option<pb::RankSample>,
}

/// What the coordinator keeps per arrival in the shared barrier table.
#[derive(Debug, Clone, Copy)]
pub(super) struct Wait {
    /// Identifies one wait (a group's ranks share it): timeouts withdraw by token.
    pub(super) token: u64,
    /// Arrived through its node's relay: answered once per node, not per rank.
    pub(super) relayed: bool,
}

pub(super) type BarrierKey = barrier::Key;
pub(super) type Barrier = barrier::Barrier<Wait>;
pub(super) type Arrival = barrier::Arrival<Wait>;

pub(super) struct Gen {
    pub(super) generation: u64,
    /// Names the generation's published values in the store (see `pb::GenerationRecord`).
    pub(super) values_id: String,
    /// Loaded from the store by a new leader (or a restarted coordinator): its ranks
    /// re-attach with `resume` and may enter barriers before their sessions are back.
    pub(super) recovered: bool,
    pub(super) nodes: Vec<NodeSlot>,
    pub(super) ranks: Vec<RankSlot>,
    /// The pending barriers, and the highest seq known complete per scope: a rank
    /// re-entering a barrier at or below it after a failover is released at once (its peers
    /// already passed it under the previous leader).
    pub(super) barriers: barrier::Table<Wait>,
    pub(super) failure: Option<Failure>,
    /// The event sent to watchers when the generation ended (and to those who attach later).
    pub(super) ended: Option<Box<pb::GenerationEnded>>,
    pub(super) left: u32,
    /// How many ranks have had a session (registered at least once): the restart timeline's
    /// "every rank registered" is when it reaches the world size.
    pub(super) had_sessions: u32,
    pub(super) next_token: u64,
    /// In-place recovery: the membership epoch (bumped by every death and by a quorum that
    /// nobody's death called for), and the epoch of the last quorum formed. A death opens a
    /// membership change (`epoch != quorum_epoch`) that the next quorum closes.
    pub(super) epoch: u64,
    pub(super) quorum_epoch: u64,
    /// The generation's in-place recoveries, newest first.
    pub(super) recoveries: std::collections::VecDeque<Recovered>,
    /// The parked `Quorum` calls, one per rank.
    pub(super) quorum: HashMap<u32, QuorumWait>,
    /// Hang detection: when the generation last made progress.
    pub(super) progress: super::hangs::Progress,
    /// The rank the others wait for, from the agents' samples.
    pub(super) straggler: Option<super::hangs::Straggler>,
}

/// One in-place recovery of the running generation, for the ops view.
pub(super) struct Recovered {
    pub(super) info: pb::RecoveryInfo,
    /// When the rank died (for the time to quorum).
    pub(super) died: Instant,
    /// Its reason is the agent's report (exit status), not only "session lost".
    pub(super) precise: bool,
}

impl Recovered {
    /// Its form in the job's record.
    pub(super) fn to_record(&self) -> pb::RecoveryRecord {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        pb::RecoveryRecord {
            info: Some(self.info.clone()),
            died_unix_ms: now.saturating_sub(self.died.elapsed()).as_millis() as u64,
            precise: self.precise,
        }
    }

    /// Rebuilt from the job's record by a new leader (the death's instant from its wall-clock
    /// time; now if that lies in the future).
    pub(super) fn restore(r: &pb::RecoveryRecord) -> Self {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        let ago = now.saturating_sub(Duration::from_millis(r.died_unix_ms));
        Self {
            info: r.info.clone().unwrap_or_default(),
            died: Instant::now().checked_sub(ago).unwrap_or_else(Instant::now),
            precise: r.precise,
        }
    }
}

/// A parked `Quorum` call.
pub(super) struct QuorumWait {
    /// Identifies the call (a dropped call withdraws by token).
    pub(super) token: u64,
    pub(super) step: Option<u64>,
    pub(super) released: [u64; 2],
    pub(super) reply: QuorumReply,
}

/// A parked `Quorum` call's answer channel.
pub type QuorumReply = oneshot::Sender<Result<pb::QuorumResponse, Error>>;

/// A rank state as messages name it.
pub(super) fn state_name(state: RankState) -> &'static str {
    match state {
        RankState::Pending => "pending (not registered)",
        RankState::Running => "running",
        RankState::Failed => "failed",
        RankState::Left => "gone (it left)",
        RankState::Replacing => "being replaced",
    }
}

impl RankSlot {
    pub(super) fn new(node_rank: u32) -> Self {
        Self {
            node_rank,
            state: RankState::Pending,
            pid: 0,
            host: String::new(),
            last_seen: Instant::now(),
            place: Place::default(),
            outbox: None,
            had_session: false,
            names: [String::new(), String::new()],
            last_scope: None,
            session: 0,
            replace: None,
            replace_version: 0,
            sampled: None,
        }
    }

    /// Records the barrier it just entered, for the ops view.
    pub(super) fn entered(&mut self, idx: usize, name: &str) {
        if self.names[idx] != name {
            self.names[idx] = name.to_owned();
        }
        self.last_scope = Some(idx);
    }
}

impl Gen {
    pub(super) fn scope_ranks(&self, scope: Scope, node_rank: u32) -> std::ops::Range<u32> {
        match scope {
            Scope::Global => 0..self.ranks.len() as u32,
            Scope::Node => {
                let n = &self.nodes[node_rank as usize];
                n.rank_offset..n.rank_offset + n.local_world_size
            }
        }
    }

    pub(super) fn location(&self, rank: u32) -> pb::RankLocation {
        let slot = &self.ranks[rank as usize];
        let host = if slot.host.is_empty() {
            self.nodes[slot.node_rank as usize].host.clone()
        } else {
            slot.host.clone()
        };
        pb::RankLocation {
            rank: Some(rank),
            node_rank: Some(slot.node_rank),
            host,
        }
    }

    /// Ends a barrier with the same error for every rank that arrived.
    pub(super) fn fail_barrier(&mut self, b: Barrier, error: &pb::BarrierError) {
        self.deliver(b.key(), b.arrivals().iter(), Some(error));
        self.barriers.recycle(b);
    }

    pub(super) fn fail_all_barriers(&mut self, error: &pb::BarrierError) {
        for b in self.barriers.drain() {
            self.fail_barrier(b, error);
        }
    }

    /// A rank that left can never reach a barrier it had not entered: fail such barriers.
    pub(super) fn left_error(&self, key: &BarrierKey, job: &JobId) -> Option<pb::BarrierError> {
        if self.left == 0 {
            return None;
        }
        let r = self.scope_ranks(key.scope, key.node_rank).find(|r| {
            let s = &self.ranks[*r as usize];
            s.state == RankState::Left && s.place.seq[key.scope.index()] < key.seq
        })?;
        Some(barrier::left_error(
            self.location(r),
            job,
            self.generation,
            *key,
        ))
    }

    /// Records that barrier `seq` of `scope` (node `node_rank` for node scope) completed,
    /// and releases every pending barrier of that scope at or below it.
    pub(super) fn mark_released(&mut self, scope: Scope, node_rank: u32, seq: u64) {
        for b in self
            .barriers
            .release_through(BarrierKey::new(scope, node_rank, seq))
        {
            self.deliver(b.key(), b.arrivals().iter(), None);
            self.barriers.recycle(b);
        }
    }

    /// The highest barrier seq of `scope` known complete.
    pub(super) fn released(&self, scope: Scope, node_rank: u32) -> u64 {
        self.barriers.released(scope, node_rank)
    }
}
