//! Rendezvous rounds: joins (and retried joins), the last-call and join timers, closing a
//! round into a running generation, and ending a generation to open the next round.

use super::*;
use indexmap::IndexMap;

pub(super) struct Joiner {
    pub(super) req: JoinReq,
    pub(super) reply: JoinReply,
    /// Which call holds the place (a retry of the same join takes it over).
    pub(super) attempt: u64,
}

/// An open round's joiners, in the order they came, found by node id and by requested node
/// rank in constant time: a round of 12,500 nodes checks each join against every joiner
/// before it, and a scan made that quadratic (0.9 s of joins at 12,500 nodes).
#[derive(Default)]
pub(super) struct Joiners {
    by_id: IndexMap<String, Joiner>,
    /// Requested node rank -> the node id that asked for it.
    requested: HashMap<u32, String>,
}

impl Joiners {
    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    /// In the order they came.
    pub(super) fn iter(&self) -> impl Iterator<Item = &Joiner> {
        self.by_id.values()
    }

    pub(super) fn get(&self, node_id: &str) -> Option<&Joiner> {
        self.by_id.get(node_id)
    }

    pub(super) fn get_mut(&mut self, node_id: &str) -> Option<&mut Joiner> {
        self.by_id.get_mut(node_id)
    }

    /// The joiner that asked for node rank `r`.
    pub(super) fn requesting(&self, r: u32) -> Option<&Joiner> {
        self.requested.get(&r).and_then(|id| self.by_id.get(id))
    }

    /// Adds a joiner whose node id and requested rank no other joiner holds (`join` checks).
    pub(super) fn push(&mut self, j: Joiner) {
        if let Some(r) = j.req.requested {
            self.requested.insert(r, j.req.node_id.clone());
        }
        self.by_id.insert(j.req.node_id.clone(), j);
    }

    /// Takes `node_id`'s joiner out, keeping the others' order.
    pub(super) fn remove(&mut self, node_id: &str) -> Option<Joiner> {
        let j = self.by_id.shift_remove(node_id)?;
        if let Some(r) = j.req.requested {
            self.requested.remove(&r);
        }
        Some(j)
    }

    /// Takes every joiner out, in the order they came.
    pub(super) fn drain(&mut self) -> impl Iterator<Item = Joiner> {
        self.requested.clear();
        self.by_id.drain(..).map(|(_, j)| j)
    }
}

pub(super) struct OpenRound {
    /// Distinguishes rounds of the same generation (a timed-out round reopens empty).
    pub(super) seq: u64,
    pub(super) joiners: Joiners,
    pub(super) opened: Instant,
    pub(super) min_reached: Option<Instant>,
}

/// A join's reply channel, and its receiving end.
pub(super) type JoinReply = oneshot::Sender<Result<pb::JoinResponse, Error>>;

pub(super) type JoinAnswer = oneshot::Receiver<Result<pb::JoinResponse, Error>>;

impl Job {
    /// Adds a node to the open round (opening the next one if the job is running). Returns the
    /// round's generation, the call's attempt id (for [`Job::withdraw`]) and the receiver of
    /// the node's assignment.
    pub fn join(self: &Arc<Self>, req: JoinReq) -> Result<(u64, u64, JoinAnswer), Error> {
        let mut st = self.lock();
        let attempt = st.next_watch;
        st.next_watch += 1;
        let config = st.config;
        match &st.done {
            Some(Done::Failed(why)) => {
                return Err(Error::FailedPrecondition(format!(
                    "job '{}' is over: {why}; start it again under a new job id",
                    self.id
                )));
            }
            Some(Done::Cancelled(why)) => {
                return Err(Error::Cancelled(cancelled_refusal(&self.id, why)));
            }
            Some(Done::Finished(why)) => {
                return Err(Error::FailedPrecondition(format!(
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
            return Err(Error::InvalidArgument(format!(
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
                            &self.id, generation, &g.nodes, node_rank, restarts, config,
                        );
                        let (tx, rx) = oneshot::channel();
                        let version = self.queued_version();
                        drop(st);
                        self.answer_when_persisted(version, vec![(tx, answer)]);
                        return Ok((generation, attempt, rx));
                    }
                }
                Phase::Open(round) => {
                    if let Some(j) = round
                        .joiners
                        .get_mut(&req.node_id)
                        .filter(|j| j.req.request_id == req.request_id)
                    {
                        // The first call's connection is gone or going: answer this one.
                        let (tx, rx) = oneshot::channel();
                        j.reply = tx;
                        j.attempt = attempt;
                        return Ok((generation, attempt, rx));
                    }
                }
            }
        }
        if Job::joins_as_spare(&st, &req) {
            return self.join_spare(&mut st, req, attempt);
        }
        if let Some(e) = self.replaced_refusal(&st, &req.node_id) {
            return Err(e);
        }
        if let Phase::Open(round) = &st.phase {
            if let Some(j) = round.joiners.get(&req.node_id) {
                return Err(Error::AlreadyExists(format!(
                    "node '{}' has already joined the open round of job '{}' (host {})",
                    req.node_id, self.id, j.req.host
                )));
            }
            if let Some(r) = req.requested
                && let Some(j) = round.joiners.requesting(r)
            {
                return Err(Error::AlreadyExists(format!(
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
    pub(super) fn join_running(
        &self,
        st: &mut MutexGuard<'_, JobState>,
        req: &JoinReq,
    ) -> Result<bool, Error> {
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
            return Err(Error::FailedPrecondition(format!(
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
            hang: None,
        };
        self.fail_generation(st, generation, failure);
        let why = match &st.done {
            Some(Done::Failed(why)) => why.clone(),
            _ => format!("generation {generation} failed"),
        };
        Err(Error::FailedPrecondition(format!(
            "job '{}' is over: {why}; start it again under a new job id",
            self.id
        )))
    }

    pub(super) fn spawn_timer(self: &Arc<Self>, after: Duration, round_seq: u64, f: fn(&Job, u64)) {
        let job = Arc::clone(self);
        tokio::spawn(async move {
            tokio::time::sleep(after).await;
            // A deposed or lapsed leader decides nothing (see `Job::retired`).
            if !job.retired() {
                f(&job, round_seq);
            }
        });
    }

    /// Removes a joiner whose caller went away before its round closed (or a spare whose
    /// caller went away while it stood by).
    pub fn withdraw(&self, generation: u64, node_id: &str, attempt: u64) {
        let mut st = self.lock();
        if self.withdraw_spare(&mut st, node_id, attempt) || st.generation != generation {
            return;
        }
        let min = st.config.min_nodes;
        if let Phase::Open(round) = &mut st.phase {
            // A retry of the same join may have taken the place over: keep it.
            if round
                .joiners
                .get(node_id)
                .is_some_and(|j| j.attempt == attempt)
            {
                round.joiners.remove(node_id);
                tracing::info!(job = %self.id, node_id, "joiner went away before the round closed");
                if (round.joiners.len() as u32) < min {
                    round.min_reached = None;
                }
            }
        }
    }

    pub(super) fn on_last_call(&self, round_seq: u64) {
        let mut st = self.lock();
        if let Phase::Open(round) = &st.phase
            && round.seq == round_seq
            && round.joiners.len() as u32 >= st.config.min_nodes
        {
            self.close_round(&mut st);
        }
    }

    pub(super) fn on_join_timeout(&self, round_seq: u64) {
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
        for j in round.joiners.drain() {
            let _ = j.reply.send(Err(Error::DeadlineExceeded(msg.clone())));
        }
        round.seq = next_seq;
        round.min_reached = None;
        st.next_round_seq += 1;
    }

    /// Ends the running generation (superseded, for `why`) and opens the next round.
    /// `restart`: the supersession itself is a restart (a node of the generation joined
    /// again), counted like a failed generation's; a caller checks the budget first.
    pub(super) fn open_next_round(&self, st: &mut JobState, why: &str, restart: bool) {
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
            g.end_quorums(|| Error::FailedPrecondition(message.clone()));
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
            joiners: Joiners::default(),
            opened: Instant::now(),
            min_reached: None,
        });
        st.next_round_seq += 1;
        tracing::info!(job = %self.id, generation = st.generation, "new rendezvous round opened");
        self.persist(st);
        self.notify();
    }

    pub(super) fn close_round(&self, st: &mut JobState) {
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
        let joiners: Vec<Joiner> = round.joiners.drain().collect();
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
                attempt: 0,
                finished: false,
                watched: j.req.watches,
                last_seen: None,
                min_watch: 0,
                took_over: None,
            });
            for _ in 0..j.req.local_world_size {
                ranks.push(RankSlot::new(node_rank as u32));
            }
            offset += j.req.local_world_size;
        }
        let world_size = offset;
        let generation = st.generation;
        let restart_count = st.restarts;
        let config = st.config;
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
                    config,
                ),
            ));
        }
        tracing::info!(job = %self.id, generation, nodes = n, world_size, "rendezvous round closed");
        st.restart_timeline.formed(generation);
        st.phase = Phase::Running(Box::new(Gen {
            generation,
            values_id: format!("{}-{generation}", self.incarnation),
            recovered: false,
            nodes,
            ranks,
            barriers: barrier::Table::default(),
            failure: None,
            ended: None,
            left: 0,
            had_sessions: 0,
            next_token: 1,
            epoch: 0,
            quorum_epoch: 0,
            recoveries: Default::default(),
            quorum: HashMap::new(),
            progress: Progress::new(),
            straggler: None,
        }));
        let version = self.persist(st);
        self.answer_when_persisted(version, replies);
        self.notify();
        self.arm_watch_deadline(generation);
    }
}
