//! Spare agents (issue 30): nodes that join a job without taking ranks and stand by, their
//! `Join` call held open, until a node of the running generation is lost. In an in-place job
//! with restarts left, a spare of the lost node's size then takes its place: the node's ranks
//! become REPLACING under one new membership epoch (as for a worker's death), the spare is
//! answered with the node's place and spawns the replacements, which heal from their peers.
//! Without a spare the job restarts the generation, as before, and says so.

use super::*;
use muster_core::requests::Recovery;

/// A spare standing by.
pub(super) struct Spare {
    pub(super) req: JoinReq,
    /// Its open `Join` call's answer; `None` when restored from the job record after a
    /// failover, until its agent sends the join again.
    pub(super) reply: Option<JoinReply>,
    /// Which call holds the place (see [`Joiner::attempt`]).
    pub(super) attempt: u64,
    /// When it joined (or this leader restored it).
    pub(super) since: Instant,
}

/// Why a node id may not stand by or join: it is in the running generation, the open
/// round, or already a spare.
fn taken(st: &JobState, job: &JobId, node_id: &str) -> Option<Error> {
    if st.spares.iter().any(|s| s.req.node_id == node_id) {
        return Some(Error::AlreadyExists(format!(
            "node '{node_id}' already stands by as a spare of job '{job}'"
        )));
    }
    match &st.phase {
        Phase::Running(g) => g.nodes.iter().position(|n| n.node_id == node_id).map(|r| {
            Error::AlreadyExists(format!(
                "node '{node_id}' is node {r} of job '{job}' generation {}; a spare must be another agent",
                g.generation
            ))
        }),
        Phase::Open(round) => round
            .joiners
            .get(node_id)
            .is_some()
            .then(|| {
                Error::AlreadyExists(format!(
                    "node '{node_id}' has already joined the open round of job '{job}'"
                ))
            }),
    }
}

impl Job {
    /// Whether a join from a node that did not ask to be a spare stands by as one: it would
    /// otherwise be refused because the healthy running generation is full, and the job
    /// admits another spare (in place, with room). "Spares come back": a machine that
    /// returns under a new agent becomes a spare.
    pub(super) fn joins_as_spare(st: &JobState, req: &JoinReq) -> bool {
        let c = st.config;
        if req.spare || c.recovery != Recovery::InPlace || c.max_spares == 0 {
            return req.spare;
        }
        // The same join sent again (a failover cut the call): it stands by still, whatever
        // room is left (it is the spare that fills it).
        if !req.request_id.is_empty()
            && st
                .spares
                .iter()
                .any(|s| s.req.request_id == req.request_id && s.req.node_id == req.node_id)
        {
            return true;
        }
        let Phase::Running(g) = &st.phase else {
            return false;
        };
        g.failure.is_none()
            && g.ended.is_none()
            && g.nodes.len() as u32 >= c.max_nodes
            && !g.nodes.iter().any(|n| n.node_id == req.node_id)
            && !st.replaced.contains_key(&req.node_id)
            && (st.spares.len() as u32) < c.max_spares
            && req.requested.is_none()
    }

    /// A spare's join: checked, then parked until the spare takes a lost node's place or the
    /// job is over. A retried join (same request id) takes its place over, or gets the place
    /// its spare already took.
    pub(super) fn join_spare(
        &self,
        st: &mut JobState,
        req: JoinReq,
        attempt: u64,
    ) -> Result<(u64, u64, JoinAnswer), Error> {
        let c = st.config;
        let generation = st.generation;
        if !req.request_id.is_empty()
            && let Some(s) = st
                .spares
                .iter_mut()
                .find(|s| s.req.request_id == req.request_id && s.req.node_id == req.node_id)
        {
            let (tx, rx) = oneshot::channel();
            s.reply = Some(tx);
            s.attempt = attempt;
            return Ok((generation, attempt, rx));
        }
        if c.recovery != Recovery::InPlace {
            return Err(Error::FailedPrecondition(format!(
                "job '{}' recovers by {}: a spare stands by only for a job launched with --recovery in-place",
                self.id, c.recovery
            )));
        }
        if c.max_spares == 0 {
            return Err(Error::FailedPrecondition(format!(
                "job '{}' admits no spares (max_spares 0); launch its nodes with --max-spares N",
                self.id
            )));
        }
        if let Some(r) = req.requested {
            return Err(Error::InvalidArgument(format!(
                "a spare takes no node rank, but node '{}' asked for node rank {r} of job '{}'",
                req.node_id, self.id
            )));
        }
        if let Some(e) = taken(st, &self.id, &req.node_id) {
            return Err(e);
        }
        if st.spares.len() as u32 >= c.max_spares {
            return Err(Error::FailedPrecondition(format!(
                "job '{}' already has {} spares standing by (max_spares {}); node '{}' (host {}) is not admitted",
                self.id,
                st.spares.len(),
                c.max_spares,
                req.node_id,
                req.host
            )));
        }
        tracing::info!(job = %self.id, node_id = %req.node_id, host = %req.host, slots = req.local_world_size, "spare standing by");
        let (tx, rx) = oneshot::channel();
        st.spares.push(Spare {
            req,
            reply: Some(tx),
            attempt,
            since: Instant::now(),
        });
        self.persist(st);
        self.notify();
        Ok((generation, attempt, rx))
    }

    /// Removes a spare whose caller went away (its `Join` call ended unanswered). Returns
    /// whether `node_id`'s call `attempt` was a spare's.
    pub(super) fn withdraw_spare(&self, st: &mut JobState, node_id: &str, attempt: u64) -> bool {
        let before = st.spares.len();
        st.spares
            .retain(|s| s.req.node_id != node_id || s.attempt != attempt);
        if st.spares.len() == before {
            return false;
        }
        tracing::info!(job = %self.id, node_id, "spare went away");
        self.persist(st);
        self.notify();
        true
    }

    /// Node `node_rank` of the running generation `generation` was lost (`why`): in an
    /// in-place job with restarts left, the first connected spare of the node's size takes
    /// its place. Returns whether one did; the caller otherwise fails the generation.
    pub(super) fn take_over(
        &self,
        st: &mut JobState,
        generation: u64,
        node_rank: u32,
        why: &str,
    ) -> bool {
        let c = st.config;
        if c.recovery != Recovery::InPlace || st.done.is_some() || st.restarts >= c.max_restarts {
            return false;
        }
        let (restarts, next_watch) = (st.restarts, st.next_watch);
        let Phase::Running(g) = &mut st.phase else {
            return false;
        };
        if g.generation != generation || g.failure.is_some() || g.ended.is_some() {
            return false;
        }
        let Some(node) = g.nodes.get(node_rank as usize) else {
            return false;
        };
        let range = node.rank_offset..node.rank_offset + node.local_world_size;
        // A node with a rank that left cleanly is finishing: its place is not taken.
        if node.finished
            || range.clone().any(|r| {
                matches!(
                    g.ranks[r as usize].state,
                    RankState::Left | RankState::Failed
                )
            })
        {
            return false;
        }
        let Some(i) = st
            .spares
            .iter()
            .position(|s| s.reply.is_some() && s.req.local_world_size == node.local_world_size)
        else {
            return false;
        };
        let spare = st.spares.remove(i);
        st.restarts += 1;
        let Phase::Running(g) = &mut st.phase else {
            return false;
        };
        let node = &g.nodes[node_rank as usize];
        let (old_id, old_host) = (node.node_id.clone(), node.host.clone());
        // Detection: since its agent was last heard (a lease's silence; a broken stream is
        // seen within one heartbeat interval of it).
        let detected = node.last_seen.map_or(Duration::ZERO, |t| t.elapsed());
        let reason = format!("node {node_rank} (host {old_host}, agent {old_id}) was lost: {why}");
        let ranks: Vec<u32> = range.collect();
        g.replace_ranks(
            &self.id,
            &ranks,
            reason.clone(),
            true,
            restarts + 1,
            c.max_restarts,
            Some((&spare.req.node_id, &spare.req.host)),
            detected,
        );
        let epoch = g.epoch;
        let node = &mut g.nodes[node_rank as usize];
        node.node_id.clone_from(&spare.req.node_id);
        node.request_id.clone_from(&spare.req.request_id);
        node.host.clone_from(&spare.req.host);
        // The lost agent's streams are dropped: its relay's and watch's later messages are
        // refused (`Job::check_relay`), and its watch's end no longer counts (`min_watch`).
        node.relay = None;
        node.report = None;
        node.watch = None;
        node.min_watch = next_watch;
        node.attempt = 0;
        node.watched = spare.req.watches;
        node.last_seen = None;
        node.took_over = Some(pb::SpareTakeover {
            node_id: old_id.clone(),
            host: old_host.clone(),
            reason: why.to_owned(),
            epoch,
        });
        let answer = join_answer(
            &self.id,
            generation,
            &g.nodes,
            node_rank as usize,
            restarts + 1,
            c,
        );
        st.replaced.insert(
            old_id.clone(),
            format!(
                "replaced by spare '{}' (host {}) in generation {generation}, membership epoch {epoch}, after it was lost: {why}",
                spare.req.node_id, spare.req.host
            ),
        );
        tracing::warn!(job = %self.id, generation, node_rank, lost = %old_id, spare = %spare.req.node_id, epoch, "a spare takes a lost node's place");
        crate::metrics::recovered_in_place();
        let version = self.persist(st);
        if let Some(reply) = spare.reply {
            self.answer_when_persisted(version, vec![(reply, answer)]);
        }
        self.notify();
        // The spare must attach its watch like any node of a new round.
        self.arm_watch_deadline(generation);
        true
    }

    /// What a lost node's failure adds in an in-place job with restarts left: that no spare
    /// could take its place, so the generation restarts (empty otherwise).
    pub(super) fn no_spare_note(&self, st: &JobState, node_rank: u32) -> String {
        let c = st.config;
        if c.recovery != Recovery::InPlace || st.restarts >= c.max_restarts || st.done.is_some() {
            return String::new();
        }
        let Phase::Running(g) = &st.phase else {
            return String::new();
        };
        let slots = g
            .nodes
            .get(node_rank as usize)
            .map_or(0, |n| n.local_world_size);
        if c.max_spares == 0 {
            return "; the job admits no spares (--max-spares), so the generation restarts"
                .to_owned();
        }
        format!(
            "; no spare of {slots} slots stands by ({} standing by), so the generation restarts",
            st.spares.len()
        )
    }

    /// Makes the job final with `done` (the one place a job becomes finished, failed or
    /// cancelled): every spare standing by is sent away, with why.
    pub(super) fn conclude(&self, st: &mut JobState, done: Done) {
        let done = &*st.done.insert(done);
        let error = |id: &str| match done {
            Done::Finished(why) => Error::Finished(format!(
                "job '{}' has finished ({why}); spare '{id}' was not needed",
                self.id
            )),
            Done::Cancelled(why) => Error::Cancelled(cancelled_refusal(&self.id, why)),
            Done::Failed(why) => Error::FailedPrecondition(format!(
                "job '{}' is over: {why}; spare '{id}' stands by no more",
                self.id
            )),
        };
        for s in st.spares.drain(..) {
            if let Some(reply) = s.reply {
                let _ = reply.send(Err(error(&s.req.node_id)));
            }
        }
    }

    /// Whether agent `node_id` may report rank `rank`'s failure: the rank must be on its node
    /// now (an agent whose place a spare took is refused). An empty id is not checked.
    pub fn check_reporter(&self, generation: u64, rank: u32, node_id: &str) -> Result<(), Error> {
        if node_id.is_empty() {
            return Ok(());
        }
        let mut st = self.lock();
        let replaced = self.replaced_refusal(&st, node_id);
        let id = self.id.clone();
        let g = self.running(&mut st, generation)?;
        let Some(slot) = g.ranks.get(rank as usize) else {
            return Ok(());
        };
        let node = &g.nodes[slot.node_rank as usize];
        if node.node_id == node_id {
            return Ok(());
        }
        Err(replaced.unwrap_or_else(|| {
            Error::WrongNode(format!(
                "rank {rank} of job '{id}' generation {generation} is on node {} ('{}'), not on node '{node_id}', which reported it",
                slot.node_rank, node.node_id
            ))
        }))
    }

    /// The refusal of a node an in-place recovery replaced by a spare, if `node_id` is one.
    pub(super) fn replaced_refusal(&self, st: &JobState, node_id: &str) -> Option<Error> {
        st.replaced.get(node_id).map(|why| {
            Error::WrongNode(format!(
                "node '{node_id}' of job '{}' was {why}; its agent may not come back in that place (start it with --spare to stand by again)",
                self.id
            ))
        })
    }
}

impl Gen {
    /// Why `relay` may no longer speak for node `node_rank`: it is not the node's relay (a
    /// spare took the node's place, or a newer relay of the node replaced it).
    pub(super) fn stale_relay(
        &self,
        job: &JobId,
        node_rank: u32,
        relay: &RelayOutbox,
    ) -> Option<Error> {
        let node = self.nodes.get(node_rank as usize)?;
        if node.relay.as_ref().is_some_and(|r| r.same_channel(relay)) {
            return None;
        }
        let taken = node.took_over.as_ref().map_or_else(String::new, |t| {
            format!(
                " (spare '{}' took the place of node '{}', which was lost)",
                node.node_id, t.node_id
            )
        });
        Some(Error::WrongNode(format!(
            "this relay no longer speaks for node {node_rank} of job '{job}' generation {}{taken}",
            self.generation
        )))
    }
}

impl Spare {
    /// The ops view's entry.
    pub(super) fn info(&self) -> pb::SpareInfo {
        pb::SpareInfo {
            node_id: self.req.node_id.clone(),
            host: self.req.host.clone(),
            local_world_size: self.req.local_world_size,
            standing_ms: self.since.elapsed().as_millis() as u64,
            connected: self.reply.as_ref().is_some_and(|r| !r.is_closed()),
        }
    }

    /// The job record's entry.
    pub(super) fn to_record(&self) -> pb::SpareRecord {
        pb::SpareRecord {
            node_id: self.req.node_id.clone(),
            host: self.req.host.clone(),
            local_world_size: self.req.local_world_size,
            request_id: self.req.request_id.clone(),
        }
    }

    /// A spare restored from the job record: standing by, its agent's join awaited.
    pub(super) fn restore(r: &pb::SpareRecord) -> Self {
        Self {
            req: JoinReq {
                node_id: r.node_id.clone(),
                host: r.host.clone(),
                local_world_size: r.local_world_size,
                requested: None,
                request_id: r.request_id.clone(),
                watches: true,
                spare: true,
            },
            reply: None,
            attempt: 0,
            since: Instant::now(),
        }
    }
}
