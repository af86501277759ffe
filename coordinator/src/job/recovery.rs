//! In-place recovery (`RECOVERY_MODE_IN_PLACE`): a rank's death with restarts left replaces
//! that rank alone (its slot REPLACING, the membership epoch bumped, waits withdrawn, the
//! survivors told, its node's agent told to respawn it) instead of failing the generation;
//! its replacement registers; and the survivors and the replacement agree on the new
//! membership in `Quorum`, a long poll answered once every rank is alive and has called.

use super::*;
use muster_core::failure::{rank_failed, replacing_in_place};
use muster_core::requests::{QuorumAsk, Recovery};

/// How many recoveries the ops view lists (newest first).
pub(super) const RECOVERIES_SHOWN: usize = 8;

/// How many recoveries a generation keeps (closed ones beyond the view are dropped; an open
/// one is always far younger than this many deaths).
const RECOVERIES_KEPT: usize = 64;

/// A parked `Quorum` call: its answer, and the token that withdraws it (see
/// [`Job::quorum_withdraw`]).
pub type QuorumAnswer = oneshot::Receiver<Result<pb::QuorumResponse, Error>>;

impl Gen {
    /// Withdraws every pending barrier wait with `error` (KIND_MEMBERSHIP_CHANGED), leaving
    /// each rank's seq unused (it enters the same barrier again after the quorum): each
    /// session-arrived rank hears it through its session, each relaying node once.
    pub(super) fn withdraw_all_barriers(&mut self, error: &pb::BarrierError) {
        for b in self.barriers.drain() {
            let key = b.key();
            let mut nodes_told: Vec<u32> = vec![];
            for a in b.arrivals() {
                let slot = &mut self.ranks[a.rank() as usize];
                if !slot.place.answer(key.scope, key.seq, false) {
                    continue;
                }
                if a.data.relayed {
                    let node = slot.node_rank;
                    if !nodes_told.contains(&node) {
                        nodes_told.push(node);
                        self.relay_send(node, relay_result(key.seq, Some(error.clone())));
                    }
                } else {
                    self.send(a.rank(), result(key.scope, key.seq, Some(error.clone())));
                }
            }
            self.barriers.recycle(b);
        }
    }

    /// Answers every parked `Quorum` call with the error `why` makes (the generation ended).
    pub(super) fn end_quorums(&mut self, why: impl Fn() -> Error) {
        for (_, w) in self.quorum.drain() {
            let _ = w.reply.send(Err(why()));
        }
    }

    /// Whether a membership change is open: a rank died and no quorum has closed it yet.
    /// Barrier entries are then answered KIND_MEMBERSHIP_CHANGED at once, so that no rank
    /// waits in a barrier for a peer that waits in `Quorum`.
    pub(super) fn membership_open(&self) -> bool {
        self.epoch != self.quorum_epoch
    }

    /// The error a barrier entry gets while a membership change is open.
    pub(super) fn membership_error(&self, job: &JobId) -> pb::BarrierError {
        let death = self
            .recoveries
            .iter()
            .find(|r| r.info.quorum_epoch == 0)
            .map_or_else(
                || {
                    format!(
                        "job '{job}' generation {} is changing its membership",
                        self.generation
                    )
                },
                |r| {
                    rank_failed(
                        r.info.rank(),
                        r.info.node_rank(),
                        &r.info.host,
                        job.as_str(),
                        self.generation,
                        &r.info.reason,
                    )
                },
            );
        simple_error(
            ErrKind::MembershipChanged,
            replacing_in_place(&death, &format!(" (membership epoch {})", self.epoch)),
        )
    }

    /// Forms the quorum if every rank is RUNNING and has a parked call: answers them all with
    /// the same response and closes the open recoveries. Returns whether it formed.
    pub(super) fn try_form_quorum(&mut self) -> bool {
        if self.quorum.len() < self.ranks.len()
            || self.ranks.iter().any(|s| s.state != RankState::Running)
        {
            return false;
        }
        if self.epoch == self.quorum_epoch {
            // Everyone asked but nobody died (a transient collective error): a new epoch all
            // the same, so that no communicator is built twice under one.
            self.epoch += 1;
        }
        self.quorum_epoch = self.epoch;
        let step = self.quorum.values().filter_map(|w| w.step).max();
        let source = step.and_then(|max| {
            (0..self.ranks.len() as u32).find(|r| self.quorum[r].step == Some(max))
        });
        let mut heal = vec![];
        if let (Some(max), Some(src)) = (step, source) {
            for r in 0..self.ranks.len() as u32 {
                if self.quorum[&r].step.is_none_or(|s| s < max) {
                    heal.push(pb::Heal {
                        rank: Some(r),
                        source: Some(src),
                    });
                }
            }
        }
        let released = self.quorum[&source.unwrap_or(0)].released;
        let response = pb::QuorumResponse {
            epoch: self.epoch,
            world_size: self.ranks.len() as u32,
            step,
            heal: heal.clone(),
            released_global: released[0],
            released_node: released[1],
            members: (0..self.ranks.len() as u32)
                .map(|r| self.location(r))
                .collect(),
        };
        for (_, w) in self.quorum.drain() {
            let _ = w.reply.send(Ok(response.clone()));
        }
        for rec in self.recoveries.iter_mut() {
            if rec.info.quorum_epoch != 0 {
                continue;
            }
            rec.info.quorum_epoch = self.epoch;
            rec.info.healed_from = heal
                .iter()
                .find(|h| h.rank == rec.info.rank)
                .and_then(|h| h.source);
            let took = rec.died.elapsed();
            rec.info.quorum_ms = took.as_millis() as u64;
            crate::metrics::quorum_formed(took);
        }
        true
    }

    /// The death of `ranks` (one rank, or a lost node's) with restarts left: each REPLACING,
    /// one new epoch, a recovery recorded per rank, waits withdrawn, sessions told, and each
    /// rank's replacement order kept (sent by [`Job::order_replacement`], or, for a lost
    /// node, answered to the spare that takes its place: `spare` is its node id and host).
    /// `restart_count` counts this restart; `detected` is how long after the death it was
    /// seen (a lost node's silence), from which the recovery's times count.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn replace_ranks(
        &mut self,
        job: &JobId,
        ranks: &[u32],
        reason: String,
        precise: bool,
        restart_count: u32,
        max_restarts: u32,
        spare: Option<(&str, &str)>,
        detected: Duration,
    ) {
        let Some(&first) = ranks.first() else {
            return;
        };
        let generation = self.generation;
        let loc = self.location(first);
        self.epoch += 1;
        let epoch = self.epoch;
        let who = rank_failed(
            first,
            loc.node_rank(),
            &loc.host,
            job.as_str(),
            generation,
            &reason,
        );
        let taken = spare.map_or_else(String::new, |(id, host)| {
            format!(", its node's ranks taken by spare '{id}' (host {host})")
        });
        let message = replacing_in_place(
            &who,
            &format!(
                " (restart {restart_count} of {max_restarts}, membership epoch {epoch}{taken})"
            ),
        );
        tracing::warn!(job = %job, generation, rank = first, ranks = ranks.len(), epoch, "{message}");
        for &rank in ranks {
            let loc = self.location(rank);
            let slot = &mut self.ranks[rank as usize];
            slot.state = RankState::Replacing;
            slot.outbox = None;
            if let Some(w) = self.quorum.remove(&rank) {
                let _ = w.reply.send(Err(Error::FailedPrecondition(format!(
                    "rank {rank} of job '{job}' generation {generation} died while it waited for the quorum; its replacement asks again"
                ))));
            }
            self.recoveries.push_front(Recovered {
                info: pb::RecoveryInfo {
                    epoch,
                    rank: Some(rank),
                    node_rank: loc.node_rank,
                    host: loc.host.clone(),
                    reason: reason.clone(),
                    spare_node_id: spare.map(|s| s.0.to_owned()).unwrap_or_default(),
                    spare_host: spare.map(|s| s.1.to_owned()).unwrap_or_default(),
                    detect_ms: detected.as_millis() as u64,
                    ..Default::default()
                },
                died: Instant::now()
                    .checked_sub(detected)
                    .unwrap_or_else(Instant::now),
                precise,
            });
            // The order goes out once the record holding it is stored.
            self.ranks[rank as usize].replace = Some(pb::RankReplace {
                generation,
                rank: Some(rank),
                epoch,
                restart_count,
                max_restarts,
                message: message.clone(),
            });
        }
        self.recoveries.truncate(RECOVERIES_KEPT);
        let withdrawn = pb::BarrierError {
            kind: ErrKind::MembershipChanged as i32,
            message,
            rank: first,
            node_rank: loc.node_rank(),
            host: loc.host.clone(),
            missing: vec![],
        };
        self.withdraw_all_barriers(&withdrawn);
        // Relays withdraw the waits they hold themselves (a node's ranks that have not all
        // arrived yet): `failed` with KIND_MEMBERSHIP_CHANGED ends those waits, not the
        // generation.
        self.relays_failed(&withdrawn);
        let cause = pb::BarrierError {
            kind: ErrKind::RankFailed as i32,
            ..withdrawn
        };
        for r in 0..self.ranks.len() as u32 {
            self.send(
                r,
                pb::CoordinatorMessage {
                    kind: Some(pb::coordinator_message::Kind::MembershipChanged(
                        pb::MembershipChanged {
                            epoch,
                            cause: Some(cause.clone()),
                        },
                    )),
                },
            );
        }
    }

    /// Sends `rank`'s replacement order to its node's watch (if the agent is attached).
    fn send_replace(&self, rank: u32) {
        let slot = &self.ranks[rank as usize];
        if let (Some(replace), Some((_, w))) =
            (&slot.replace, &self.nodes[slot.node_rank as usize].watch)
        {
            let _ = w.send(Ok(pb::NodeEvent {
                kind: Some(pb::node_event::Kind::Replace(replace.clone())),
            }));
        }
    }

    /// Why no quorum can form any more, if a rank has left the job cleanly (it never calls).
    pub(super) fn left_quorum_error(&self, job: &JobId) -> Option<String> {
        if self.left == 0 {
            return None;
        }
        let r = self.ranks.iter().position(|s| s.state == RankState::Left)?;
        Some(format!(
            "rank {r} of job '{job}' generation {} has left the job cleanly: it takes part in no quorum any more, so none can form",
            self.generation
        ))
    }

    /// The ops view's recoveries: newest first, at most [`RECOVERIES_SHOWN`].
    pub(super) fn recoveries_view(&self) -> Vec<pb::RecoveryInfo> {
        self.recoveries
            .iter()
            .take(RECOVERIES_SHOWN)
            .map(|r| r.info.clone())
            .collect()
    }
}

impl Job {
    /// A rank's failure in an in-place job: replaces the rank (returns true) when the job has
    /// restarts left and the generation still runs; refines the reason of a death already
    /// being handled (the agent's report after the session drop); ignores the end of a dead
    /// worker's session while its rank is being replaced. Returns false where the failure
    /// takes today's path (restart mode, no budget left, a generation already failed).
    pub(super) fn fail_in_place(
        &self,
        st: &mut JobState,
        generation: u64,
        rank: u32,
        reason: &str,
        precise: bool,
    ) -> bool {
        if st.config.recovery != Recovery::InPlace || st.done.is_some() {
            return false;
        }
        let (restarts, max_restarts) = (st.restarts, st.config.max_restarts);
        let Phase::Running(g) = &mut st.phase else {
            return false;
        };
        if g.generation != generation || g.failure.is_some() || g.ended.is_some() {
            return false;
        }
        let Some(slot) = g.ranks.get(rank as usize) else {
            return false;
        };
        match slot.state {
            RankState::Failed | RankState::Left => return false,
            RankState::Replacing if !precise => return true,
            _ => {}
        }
        if precise
            && let Some(rec) = g
                .recoveries
                .iter_mut()
                .find(|r| r.info.rank == Some(rank) && r.info.quorum_epoch == 0)
            && !rec.precise
        {
            // The agent's account of the death its session's end already reported.
            rec.precise = true;
            reason.clone_into(&mut rec.info.reason);
            self.persist(st);
            return true;
        }
        if restarts >= max_restarts {
            return false;
        }
        st.restarts += 1;
        let Phase::Running(g) = &mut st.phase else {
            return false;
        };
        g.replace_ranks(
            &self.id,
            &[rank],
            reason.to_owned(),
            precise,
            restarts + 1,
            max_restarts,
            None,
            Duration::ZERO,
        );
        crate::metrics::recovered_in_place();
        let version = self.persist(st);
        self.order_replacement(st, rank, version);
        self.notify();
        true
    }

    /// Sends `rank`'s replacement order once the record of `version` (which holds it) is in
    /// the store: at once without a durable store, else from a task. A leader that dies
    /// before the write leaves no process started for a decision its successor never saw
    /// (the successor replaces the rank itself, under the same epoch).
    fn order_replacement(&self, st: &mut JobState, rank: u32, version: u64) {
        let Phase::Running(g) = &mut st.phase else {
            return;
        };
        g.ranks[rank as usize].replace_version = version;
        if self.persist.is_none() {
            g.send_replace(rank);
            return;
        }
        let generation = g.generation;
        let stored = self.stored_then(version);
        let job = self.me.clone();
        // Task "replace-order", one per in-place replacement with a durable store: ends
        // once the record is written (sending the order if it still stands) or the job is
        // retired.
        tokio::spawn(async move {
            if !stored.await {
                return;
            }
            let Some(job) = job.upgrade() else { return };
            let mut st = job.lock();
            if job.retired() {
                return;
            }
            if let Ok(g) = job.running(&mut st, generation)
                && g.ranks[rank as usize].replace_version == version
            {
                g.send_replace(rank);
            }
        });
    }

    /// `Rendezvous.Quorum`: checks the call and parks it; the answer comes through the
    /// receiver once the quorum forms (at once if this call completes it). The returned token
    /// withdraws the call when its caller goes away.
    pub fn quorum(&self, ask: &QuorumAsk) -> Result<(u64, QuorumAnswer), Error> {
        let mut st = self.lock();
        let id = self.id.clone();
        let generation = ask.generation;
        if st.config.recovery != Recovery::InPlace {
            return Err(Error::FailedPrecondition(format!(
                "job '{id}' recovers by {}, not in place: Quorum is only for jobs launched with --recovery in-place",
                st.config.recovery
            )));
        }
        match &st.done {
            Some(Done::Failed(why) | Done::Finished(why)) => {
                return Err(Error::FailedPrecondition(format!(
                    "job '{id}' is over ({why}); there is no quorum to form"
                )));
            }
            Some(Done::Cancelled(why)) => {
                return Err(Error::FailedPrecondition(cancelled_refusal(&id, why)));
            }
            None => {}
        }
        let g = self.running(&mut st, generation)?;
        if let Some(f) = &g.failure {
            return Err(Error::FailedPrecondition(f.describe(&id, generation)));
        }
        if let Some(ended) = &g.ended {
            return Err(Error::FailedPrecondition(ended.message.clone()));
        }
        if let Some(why) = g.left_quorum_error(&id) {
            return Err(Error::FailedPrecondition(why));
        }
        let rank = ask.rank;
        let Some(slot) = g.ranks.get(rank as usize) else {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is outside job '{id}' generation {generation} (world size {})",
                g.ranks.len()
            )));
        };
        // After a failover a rank's Quorum call may reach the new leader before its session
        // re-attaches: it is parked, and the quorum forms once the session is back.
        let reattaching = g.recovered && slot.state == RankState::Pending && slot.had_session;
        if slot.state != RankState::Running && !reattaching {
            let state = match slot.state {
                RankState::Replacing => "being replaced (its replacement has not registered)",
                RankState::Pending => "not registered",
                RankState::Failed => "failed",
                RankState::Left => "gone (it left)",
                RankState::Running => "running",
            };
            return Err(Error::FailedPrecondition(format!(
                "rank {rank} of job '{id}' generation {generation} is {state}; only a running rank's session may ask for the quorum"
            )));
        }
        if ask.epoch > g.epoch {
            return Err(Error::InvalidArgument(format!(
                "epoch {} is ahead of job '{id}' generation {generation}, whose membership epoch is {}",
                ask.epoch, g.epoch
            )));
        }
        let token = g.next_token;
        g.next_token += 1;
        let (tx, rx) = oneshot::channel();
        let wait = QuorumWait {
            token,
            step: ask.step,
            released: ask.released,
            reply: tx,
        };
        if let Some(old) = g.quorum.insert(rank, wait) {
            let _ = old.reply.send(Err(Error::Aborted(format!(
                "a newer Quorum call of rank {rank} (job '{id}' generation {generation}) replaced this one"
            ))));
        }
        let before = g.epoch;
        if g.try_form_quorum() {
            tracing::info!(job = %id, generation, epoch = g.epoch, before, "quorum formed");
            // The epoch, and the recoveries it closed (the ops view of a new leader).
            self.persist(&st);
        }
        Ok((token, rx))
    }

    /// Withdraws rank `rank`'s parked `Quorum` call `token` (its caller went away or its
    /// wait ran out). Cancel-safe by construction: it only removes.
    pub fn quorum_withdraw(&self, generation: u64, rank: u32, token: u64) {
        let mut st = self.lock();
        if let Ok(g) = self.running(&mut st, generation)
            && g.quorum.get(&rank).is_some_and(|w| w.token == token)
        {
            g.quorum.remove(&rank);
        }
    }
}
