//! Nodes: an agent's watch stream (its lease, and where the generation's end is pushed),
//! a node lost or finished, the grace after a failover in which nodes and sessions re-attach,
//! and an operator's drain of a node.

use super::*;

/// The answer to a join from a drained node: FAILED_PRECONDITION naming the node and the
/// reason, marked with the `muster-drained` metadata key so that an agent can tell a drain
/// from a job that is over.
pub(super) fn drained_refusal(job: &JobId, node_id: &str, reason: &str) -> Error {
    Error::Drained(format!(
        "node '{node_id}' was drained from job '{job}' by an operator ({reason}) and may not join it again; start the agent afresh (a new node id) to add this machine back"
    ))
}

/// What a drain did: the node it took out, the generation it ended, and how many nodes
/// remain to rejoin.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Drained {
    /// The drained node's id.
    pub node_id: String,
    /// The generation it was drained from (superseded, or still forming).
    pub generation: u64,
    /// The nodes left in the job.
    pub remaining_nodes: u32,
}

impl Job {
    /// A node's agent went away or went silent while its ranks ran: a spare takes its place
    /// (an in-place job with one standing by, `spares.rs`), or the generation fails naming
    /// the node (and its first live rank).
    pub fn node_lost(&self, generation: u64, node_rank: u32, watch_id: u64, why: &str) {
        let mut st = self.lock();
        if self.retired() {
            return;
        }
        // The agents of a cancelled job stop and go away: that is the cancel working, not
        // their ranks failing (the view keeps saying why they stopped).
        let cancelled = matches!(st.done, Some(Done::Cancelled(_)));
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
        if watch_id != 0 && watch_id < node.min_watch {
            // The watch of an agent a spare replaced: the place is the spare's now.
            return;
        }
        // Dropping the outbox ends the stream's answers.
        node.watch = None;
        if node.finished || cancelled {
            return;
        }
        let range = node.rank_offset..node.rank_offset + node.local_world_size;
        let Some(rank) = range.clone().find(|r| {
            matches!(
                g.ranks[*r as usize].state,
                RankState::Pending | RankState::Running | RankState::Replacing
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
        if g.failure.is_none() && self.take_over(&mut st, generation, node_rank, why) {
            return;
        }
        let spare_note = self.no_spare_note(&st, node_rank);
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let node = &g.nodes[node_rank as usize];
        let node_id = node.node_id.clone();
        let host = node.host.clone();
        for r in range {
            let slot = &mut g.ranks[r as usize];
            if matches!(
                slot.state,
                RankState::Pending | RankState::Running | RankState::Replacing
            ) {
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
            reason: format!(
                "node {node_rank} (host {host}, agent {node_id}) was lost: {why}{spare_note}"
            ),
            precise: true,
            detail: FailureDetail::default(),
            node_id,
            hang: None,
        };
        self.fail_generation(&mut st, generation, failure);
    }

    /// Attaches a node's watch stream (replacing an earlier one of the same node). Answers
    /// `attached`, then at once `ended` if the generation has already ended. Returns the
    /// attach's id, which [`Job::node_lost`] takes.
    ///
    /// `attempt` is the agent's number for this open (0: unnumbered). One lower than the
    /// node's registered watch is refused: the agent gave up on that open and opened another,
    /// which this leader registered first (it was busy, or frozen, when the first came), and
    /// the abandoned stream's end would otherwise fail the node (the fault suite's finding 7).
    pub fn watch(
        &self,
        generation: u64,
        node_rank: u32,
        node_id: &str,
        attempt: u64,
        outbox: NodeOutbox,
        attached: pb::NodeAttached,
    ) -> Result<u64, Error> {
        let mut st = self.lock();
        let watch_id = st.next_watch;
        st.next_watch += 1;
        let id = self.id.clone();
        let drained = st.drained.clone();
        let g = self.running(&mut st, generation)?;
        let Some(node) = g.nodes.get(node_rank as usize) else {
            return Err(Error::InvalidArgument(format!(
                "node rank {node_rank} is outside job '{id}' generation {generation} ({} nodes)",
                g.nodes.len()
            )));
        };
        if node.node_id != node_id {
            return Err(Error::WrongNode(format!(
                "node rank {node_rank} of job '{id}' generation {generation} is node '{}', not '{node_id}'",
                node.node_id
            )));
        }
        if attempt != 0 && attempt < node.attempt {
            return Err(Error::AlreadyExists(format!(
                "node rank {node_rank} of job '{id}' generation {generation} already has a newer watch (attach {} > {attempt}): this open is one its agent left",
                node.attempt
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
        } else {
            // In-place recovery: a replacement order the agent may have missed (its watch
            // was down, or a new leader took over) is sent again; the agent ignores one for a
            // rank it already respawned in that epoch. One not stored yet goes out when it is
            // (`Job::order_replacement`).
            for r in node.rank_offset..node.rank_offset + node.local_world_size {
                let slot = &g.ranks[r as usize];
                if let Some(replace) = slot
                    .replace
                    .as_ref()
                    .filter(|_| self.stored(slot.replace_version))
                {
                    let _ = outbox.send(Ok(pb::NodeEvent {
                        kind: Some(pb::node_event::Kind::Replace(replace.clone())),
                    }));
                }
            }
        }
        let node = &mut g.nodes[node_rank as usize];
        node.watch = Some((watch_id, outbox));
        node.attempt = node.attempt.max(attempt);
        node.last_seen = Some(Instant::now());
        if !std::mem::replace(&mut node.watched, true) {
            self.persist(&st);
        }
        Ok(watch_id)
    }

    /// Once twice the heartbeat timeout has passed (while this process ran) after
    /// `generation`'s rendezvous, a node that said it would hold a lease and never attached its
    /// watch is lost: its agent stopped or hung between its join's answer and its watch, and
    /// no lease of it would ever expire. Twice: the clock starts at the round's close, before
    /// the answers go out (with etcd, once the record is stored).
    pub(super) fn arm_watch_deadline(&self, generation: u64) {
        let Some(job) = self.me.upgrade() else {
            return;
        };
        let limit = self.heartbeat_timeout * 2;
        // Task "watch-deadline", one per generation: waits once, then checks.
        tokio::spawn(async move {
            crate::tenure::within(limit, std::future::pending::<()>()).await;
            job.check_watches_attached(generation, limit);
        });
    }

    pub(super) fn check_watches_attached(&self, generation: u64, limit: Duration) {
        let unattached: Vec<u32> = {
            let mut st = self.lock();
            let Ok(g) = self.running(&mut st, generation) else {
                return;
            };
            if g.recovered {
                // A new leader's generation: its re-attach grace decides.
                return;
            }
            g.nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| {
                    n.watched && n.watch.is_none() && n.last_seen.is_none() && !n.finished
                })
                .map(|(i, _)| i as u32)
                .collect()
        };
        let why = format!(
            "its agent never attached its watch within {:.1}s of the rendezvous (agent stopped, hung or partitioned)",
            limit.as_secs_f64()
        );
        for node_rank in unattached {
            // Watch ids start at 1: a watch that attached meanwhile makes this a no-op.
            self.node_lost(generation, node_rank, 0, &why);
        }
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

    pub(super) fn check_reattached(&self, grace: Duration) {
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
        let lost_ranks: Vec<u32> = (0..g.ranks.len() as u32)
            .filter(|&r| {
                let slot = &g.ranks[r as usize];
                slot.had_session
                    && slot.state == RankState::Pending
                    && !g.nodes[slot.node_rank as usize].finished
            })
            .collect();
        let rank_reason = format!(
            "its session did not re-attach within {:.1}s after the coordinator failover (process gone or cannot reach the new leader)",
            grace.as_secs_f64()
        );
        let mut lost_rank = None;
        if lost_node.is_none() {
            // In an in-place job with restarts left, such a rank is replaced like any dead
            // rank (its node's agent, which did re-attach, respawns it).
            for r in lost_ranks {
                if !self.fail_in_place(&mut st, generation, r, &rank_reason, false) {
                    lost_rank = Some(r as usize);
                    break;
                }
            }
        }
        if let Some(n) = lost_node {
            // A spare standing by (it joined this leader again) takes the node's place.
            let why = format!(
                "its agent did not re-attach within {:.1}s after the coordinator failover (stopped, or cannot reach the new leader)",
                grace.as_secs_f64()
            );
            if self.take_over(&mut st, generation, n as u32, &why) {
                return;
            }
        }
        let Phase::Running(g) = &mut st.phase else {
            return;
        };
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
                hang: None,
            }
        } else if let Some(r) = lost_rank {
            let loc = g.location(r as u32);
            g.ranks[r].state = RankState::Failed;
            Failure {
                rank: r as u32,
                node_rank: loc.node_rank(),
                host: loc.host,
                reason: rank_reason,
                precise: false,
                detail: FailureDetail::default(),
                node_id: String::new(),
                hang: None,
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

    pub(super) fn mark_node_finished(&self, generation: u64, node_rank: u32) {
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
            for key in g.barriers.keys() {
                if let Some(err) = g.left_error(&key, &id) {
                    let b = g.barriers.remove(&key).expect("key listed above");
                    g.fail_barrier(b, &err);
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

    /// Drains a node (`Ops.DrainNode`): marks it drained (persisted, so its joins stay
    /// refused after a failover) and supersedes the running generation, so that the other
    /// nodes rejoin without it while the drained node's agent hears CAUSE_DRAINED without
    /// rejoin. In an open round the node's pending join is refused instead. Not a restart:
    /// the restart count is unchanged. Refused when fewer than min_nodes would remain.
    pub fn drain(&self, node: &NodeRef, reason: &str) -> Result<Drained, Error> {
        let mut st = self.lock();
        let id = self.id.clone();
        match &st.done {
            Some(Done::Failed(why)) => {
                return Err(Error::FailedPrecondition(format!(
                    "job '{id}' is over ({why}); there is nothing to drain"
                )));
            }
            Some(Done::Cancelled(why)) => {
                return Err(Error::FailedPrecondition(format!(
                    "job '{id}' was cancelled ({why}); there is nothing to drain"
                )));
            }
            Some(Done::Finished(why)) => {
                return Err(Error::FailedPrecondition(format!(
                    "job '{id}' has finished ({why}); there is nothing to drain"
                )));
            }
            None => {}
        }
        if let NodeRef::Id(node_id) = node
            && let Some(why) = st.drained.get(node_id)
        {
            return Err(Error::FailedPrecondition(format!(
                "node '{node_id}' of job '{id}' is already drained ({why})"
            )));
        }
        let min = st.config.min_nodes;
        let max = st.config.max_nodes;
        let generation = st.generation;
        let too_few = |present: usize, node_id: &str| {
            Error::FailedPrecondition(format!(
                "draining node '{node_id}' would leave job '{id}' with {} of its {present} nodes, below its min_nodes {min} (nodes {min}:{max}); the drain was refused",
                present - 1
            ))
        };
        match &mut st.phase {
            Phase::Open(round) => {
                let node_id = match node {
                    NodeRef::Id(node_id) => node_id,
                    NodeRef::Rank(r) => {
                        return Err(Error::InvalidArgument(format!(
                            "node rank {r}: job '{id}' has no running generation (its round for generation {generation} is open, node ranks are given when it closes); name the node by node_id"
                        )));
                    }
                };
                if round.joiners.get(node_id).is_none() {
                    let known: Vec<&str> = round
                        .joiners
                        .iter()
                        .map(|j| j.req.node_id.as_str())
                        .collect();
                    return Err(Error::InvalidArgument(format!(
                        "node '{node_id}' has not joined job '{id}' (the open round of generation {generation} has [{}])",
                        known.join(", ")
                    )));
                }
                let present = round.joiners.len();
                if (present as u32) - 1 < min {
                    return Err(too_few(present, node_id));
                }
                let j = round.joiners.remove(node_id).expect("found above");
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
                Ok(Drained {
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
                    return Err(Error::InvalidArgument(format!(
                        "{node} is not part of job '{id}' generation {generation} (nodes {})",
                        known.join(", ")
                    )));
                };
                let n = &g.nodes[node_rank];
                let node_id = n.node_id.clone();
                if n.finished {
                    return Err(Error::FailedPrecondition(format!(
                        "node {node_rank} ('{node_id}') of job '{id}' has finished: every worker exited 0; there is nothing to drain"
                    )));
                }
                if let Some(ended) = &g.ended {
                    return Err(Error::FailedPrecondition(format!(
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
                Ok(Drained {
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
}
