//! Sessions and relays: registering them in the running generation, and their barrier
//! entries (one rank through its session, or a node's ranks at once through its relay), with
//! divergence, completion and timeouts.

use super::*;

/// What a registered session needs to know.
#[derive(Debug, Clone)]
pub struct Registration {
    /// The worker's node rank.
    pub node_rank: u32,
    /// Nodes in the generation.
    pub num_nodes: u32,
    /// Ranks in the generation.
    pub world_size: u32,
    /// Which session of the rank this is: its end is reported with it
    /// ([`Job::session_lost`]), so that a dead worker's late end does not fail its
    /// replacement.
    pub session: u64,
}

impl Job {
    /// Registers a worker session for `rank`. `resume` carries the last barrier seq the
    /// worker was released from per scope (global, node) when it re-attaches after a failover:
    /// those barriers count as complete here, releasing any peer still waiting at them.
    /// `replacement` (in-place recovery) carries the epoch a replacement was spawned for: it
    /// is accepted only for a REPLACING rank (or, with `resume`, for the pending rank of a
    /// generation a new leader restored: the replacement re-attaching), and a REPLACING rank
    /// takes nothing else but, in a restored generation, a re-attach with `resume` (the
    /// replacement registered just before the failover).
    #[allow(clippy::too_many_arguments)]
    pub fn register(
        &self,
        generation: u64,
        rank: u32,
        pid: u32,
        host: String,
        outbox: impl Into<Outbox>,
        resume: Option<[u64; 2]>,
        replacement: Option<u64>,
    ) -> Result<Registration, Error> {
        let outbox = outbox.into();
        let mut st = self.lock();
        let id = self.id.clone();
        let g = self.running(&mut st, generation)?;
        let world = g.ranks.len();
        if let Some(f) = &g.failure {
            return Err(Error::FailedPrecondition(f.describe(&id, generation)));
        }
        let Some(slot) = g.ranks.get_mut(rank as usize) else {
            return Err(Error::InvalidArgument(format!(
                "rank {rank} is outside job '{id}' generation {generation} (world size {world})"
            )));
        };
        match (slot.state, replacement) {
            (RankState::Replacing, Some(epoch)) if epoch > g.epoch => {
                return Err(Error::FailedPrecondition(format!(
                    "rank {rank} of job '{id}' generation {generation}: a replacement for membership epoch {epoch} registered, but the generation is at epoch {}",
                    g.epoch
                )));
            }
            (RankState::Replacing, Some(epoch)) => {
                // A fresh process: its place in the barrier sequences is the table's (it
                // continues from what completed), whatever the dead worker had entered.
                let node_rank = slot.node_rank;
                let released = [
                    g.barriers.released(Scope::Global, 0),
                    g.barriers.released(Scope::Node, node_rank),
                ];
                let slot = &mut g.ranks[rank as usize];
                slot.place = Place::default();
                slot.place.resume(Scope::Global, released[0]);
                slot.place.resume(Scope::Node, released[1]);
                slot.replace = None;
                if let Some(rec) = g
                    .recoveries
                    .iter_mut()
                    .find(|r| r.info.rank == Some(rank) && r.info.replacement_pid == 0)
                {
                    rec.info.replacement_pid = pid;
                    rec.info.respawn_ms = rec.died.elapsed().as_millis() as u64;
                }
                tracing::info!(job = %id, generation, rank, pid, epoch, "replacement registered");
            }
            (RankState::Replacing, None) if resume.is_some() && g.recovered => {
                // After a failover the record may still show the rank awaiting its
                // replacement (the replacement registered just before the old leader's last
                // write): the replacement re-attaching says `resume`, not `replacement`.
                g.ranks[rank as usize].replace = None;
                tracing::info!(job = %id, generation, rank, pid, "replacement re-attached after a failover");
            }
            (RankState::Replacing, None) => {
                return Err(Error::FailedPrecondition(format!(
                    "rank {rank} of job '{id}' generation {generation} is being replaced in place (membership epoch {}); only its replacement (register with replacement and MUSTER_EPOCH) may register: this worker is stale",
                    g.epoch
                )));
            }
            (RankState::Pending, Some(_)) if resume.is_some() && g.recovered => {
                // A replacement re-attaching after a failover (the new leader restored its
                // rank as pending, its replacement already registered): a re-attach.
            }
            (state, Some(_)) => {
                return Err(Error::FailedPrecondition(format!(
                    "rank {rank} of job '{id}' generation {generation} is not awaiting a replacement (it is {})",
                    state_name(state)
                )));
            }
            (RankState::Pending, None) => {}
            (RankState::Running, None)
                if resume.is_some()
                    && matches!(
                        (&slot.outbox, &outbox),
                        (Some(Outbox::Relayed { .. }), Outbox::Relayed { .. })
                    ) =>
            {
                // Its node's relay came back to this same leader (a broken stream, not a
                // failover): the rank's messages go to the new stream.
            }
            (_, None) => {
                return Err(Error::AlreadyExists(format!(
                    "rank {rank} of job '{id}' generation {generation} is already registered (pid {} on host {})",
                    slot.pid, slot.host
                )));
            }
        }
        let session = g.next_token;
        g.next_token += 1;
        let slot = &mut g.ranks[rank as usize];
        slot.session = session;
        slot.state = RankState::Running;
        slot.pid = pid;
        slot.host = host;
        slot.last_seen = Instant::now();
        slot.outbox = Some(outbox);
        let node_rank = slot.node_rank;
        let first_session = !std::mem::replace(&mut slot.had_session, true);
        if first_session {
            g.had_sessions += 1;
        }
        let all_registered = first_session && g.had_sessions as usize == world;
        if let Some(released) = resume {
            // The rank's place in each scope's sequence, as it was under the last leader.
            for scope in [Scope::Global, Scope::Node] {
                let idx = scope.index();
                g.ranks[rank as usize].place.resume(scope, released[idx]);
                g.mark_released(scope, node_rank, released[idx]);
            }
            tracing::info!(job = %id, generation, rank, released_global = released[0], released_node = released[1], "session resumed");
        }
        // The last session back after a failover may complete a quorum already asked for.
        let formed = !g.quorum.is_empty() && g.try_form_quorum();
        let registration = Registration {
            node_rank,
            num_nodes: g.nodes.len() as u32,
            world_size: world as u32,
            session,
        };
        if all_registered {
            st.restart_timeline.registered(generation);
        }
        if first_session || replacement.is_some() || formed {
            // Coalesced with the other ranks' registrations by the record writer.
            self.persist(&st);
        }
        Ok(registration)
    }

    /// Registers `rank` through node `node_rank`'s relay (issue 29): [`Job::register`], once
    /// the rank is checked to be that node's, its answers and pushes going out on the relay.
    #[allow(clippy::too_many_arguments)]
    pub fn register_relayed(
        &self,
        generation: u64,
        node_rank: u32,
        relay: &RelayOutbox,
        rank: u32,
        pid: u32,
        host: String,
        resume: Option<[u64; 2]>,
        replacement: Option<u64>,
    ) -> Result<Registration, Error> {
        self.check_on_node(generation, node_rank, rank, relay)?;
        self.register(
            generation,
            rank,
            pid,
            host,
            Outbox::Relayed {
                rank,
                relay: relay.clone(),
            },
            resume,
            replacement,
        )
    }

    /// Whether `rank` is one of node `node_rank`'s in `generation`, and `relay` (the stream
    /// the call came on) is still that node's relay.
    pub fn check_on_node(
        &self,
        generation: u64,
        node_rank: u32,
        rank: u32,
        relay: &RelayOutbox,
    ) -> Result<(), Error> {
        let mut st = self.lock();
        let id = self.id.clone();
        let g = self.running(&mut st, generation)?;
        if let Some(e) = g.stale_relay(&id, node_rank, relay) {
            return Err(e);
        }
        let world = g.ranks.len();
        match g.ranks.get(rank as usize) {
            Some(slot) if slot.node_rank == node_rank => Ok(()),
            Some(slot) => Err(Error::InvalidArgument(format!(
                "rank {rank} of job '{id}' generation {generation} is on node {}, not on node {node_rank} whose relay this is",
                slot.node_rank
            ))),
            None => Err(Error::InvalidArgument(format!(
                "rank {rank} is outside job '{id}' generation {generation} (world size {world})"
            ))),
        }
    }

    /// Session `session` of `rank` ended without leave (or went silent): fails the rank,
    /// unless a newer session (an in-place replacement) holds the rank by now.
    pub fn session_lost(&self, generation: u64, rank: u32, session: u64, reason: String) {
        {
            let mut st = self.lock();
            if let Ok(g) = self.running(&mut st, generation)
                && g.ranks
                    .get(rank as usize)
                    .is_some_and(|s| s.session != session)
            {
                return;
            }
        }
        self.fail_rank(generation, rank, reason, None);
    }

    /// Rank `rank` began training step `step` (its step marker). Rank 0's count toward the
    /// effective training time; the first after a quorum also says when the running
    /// generation's recoveries resumed (and the next one when their first full step ended),
    /// and the first of a generation when the restart that made it resumed.
    pub fn step_begun(&self, generation: u64, rank: u32, step: u64) {
        if rank != 0 {
            return;
        }
        let mut st = self.lock();
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        // One recovery per epoch (a lost node's ranks share theirs): its latest times.
        let mut resumed: Vec<(u64, [Duration; 3])> = vec![];
        for rec in g.recoveries.iter_mut() {
            let i = &mut rec.info;
            if i.resumed_ms > 0 && i.full_step_ms == 0 {
                i.full_step_ms = rec.died.elapsed().as_millis() as u64;
            } else if i.quorum_epoch != 0 && i.resumed_ms == 0 {
                let took = rec.died.elapsed();
                i.resumed_ms = took.as_millis() as u64;
                let ms = Duration::from_millis;
                let times = [ms(i.detect_ms), ms(i.respawn_ms), took];
                match resumed.iter_mut().find(|(e, _)| *e == i.epoch) {
                    Some((_, t)) => *t = [0, 1, 2].map(|k| t[k].max(times[k])),
                    None => resumed.push((i.epoch, times)),
                }
            }
        }
        for (_, [detected, registered, took]) in resumed {
            st.steps.recovered(detected, registered, took);
        }
        if let Some(took) = st.restart_timeline.marker(generation) {
            st.steps.restarted(took);
        }
        if st.steps.begun(step, Instant::now()) {
            // The counts, for a new leader (at most once a minute from markers).
            self.persist(&st);
        }
    }

    /// Rank `rank` healed for the quorum of `epoch` (its SDK's report): its recovery's
    /// timeline records when.
    pub fn healed(&self, generation: u64, rank: u32, epoch: u64) {
        let mut st = self.lock();
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        if let Some(rec) = g.recoveries.iter_mut().find(|r| {
            r.info.rank == Some(rank) && r.info.quorum_epoch == epoch && r.info.healed_ms == 0
        }) {
            rec.info.healed_ms = rec.died.elapsed().as_millis() as u64;
        }
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
        if g.membership_open() {
            return reply_now(g.membership_error(&self.id));
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
            if !slot.place.waiting[idx] {
                slot.place.resume(scope, seq);
                let _ = outbox.send(Ok(result(scope, seq, None)));
                return;
            }
        }
        let slot = &mut g.ranks[rank as usize];
        slot.last_seen = Instant::now();
        if let Err(message) = slot.place.check_entry(rank, scope, slot.node_rank, seq) {
            return reply_now(simple_error(ErrKind::Unspecified, message));
        }
        let key = BarrierKey::new(scope, node_rank, seq);
        if let Some(err) = g.left_error(&key, &self.id) {
            return reply_now(err);
        }
        let token = g.next_token;
        g.next_token += 1;
        let ranks = g.scope_ranks(scope, key.node_rank);
        let slot = &mut g.ranks[rank as usize];
        slot.place.enter(scope, seq);
        slot.entered(idx, &name);
        let now = Instant::now();
        let wait = Wait {
            token,
            relayed: false,
        };
        g.barriers
            .open(key, ranks, now)
            .arrive(rank, name, now, wait);
        self.settle(g, key, timeout, token);
    }

    /// After arrivals were added to barrier `key`: reports divergence, releases a complete
    /// barrier, or arms the timeout of the wait `token`.
    pub(super) fn settle(
        self: &Arc<Self>,
        g: &mut Gen,
        key: BarrierKey,
        timeout: Option<Duration>,
        token: u64,
    ) {
        let generation = g.generation;
        let b = g.barriers.get(&key).expect("settle follows an arrival");
        let complete = b.complete();
        if b.diverged() {
            // Divergence: everyone at this barrier, now and later, gets the same error.
            let msg = b.divergence_message(|r| g.location(r));
            tracing::warn!(job = %self.id, generation, "{msg}");
            let err = simple_error(ErrKind::Diverged, msg);
            let b = g.barriers.remove(&key).expect("present above");
            g.deliver(key, b.arrivals().iter(), Some(&err));
            if complete {
                g.barriers.recycle(b);
            } else {
                g.barriers.insert(b);
            }
            return;
        }
        if complete {
            let b = g.barriers.remove(&key).expect("present above");
            g.deliver(key, b.arrivals().iter(), None);
            crate::metrics::barrier_completed(b.opened().elapsed());
            g.barriers.release(key);
            g.barriers.recycle(b);
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

    pub(super) fn barrier_timeout(
        &self,
        generation: u64,
        key: BarrierKey,
        token: u64,
        after: Duration,
    ) {
        let mut st = self.lock();
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let Some(b) = g.barriers.get_mut(&key) else {
            return;
        };
        let withdrawn = b.withdraw(|a| a.data.token == token);
        let Some(first) = withdrawn.first() else {
            return;
        };
        let name = b.name_of(first).to_owned();
        let (rank, relayed) = (first.rank(), first.data.relayed);
        let b = g.barriers.get(&key).expect("present above");
        let missing = b.missing_except(
            |r| withdrawn.iter().any(|w| w.rank() == r),
            |r| g.location(r),
        );
        if b.arrivals().is_empty()
            && let Some(b) = g.barriers.remove(&key)
        {
            g.barriers.recycle(b);
        }
        for w in &withdrawn {
            // The rank's sequence number stays: it may retry the same barrier.
            g.ranks[w.rank() as usize].place.waiting[key.scope.index()] = false;
        }
        let who = if relayed {
            barrier::Waiter::Node {
                first: rank,
                last: withdrawn[withdrawn.len() - 1].rank(),
                node_rank: g.ranks[rank as usize].node_rank,
            }
        } else {
            barrier::Waiter::Rank(rank)
        };
        let err = barrier::timeout_error(key, &name, after, who, &self.id, generation, missing);
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
        node_id: &str,
        outbox: RelayOutbox,
        heartbeat_interval: Duration,
        resume: Option<u64>,
    ) -> Result<(), Error> {
        let mut st = self.lock();
        let id = self.id.clone();
        // An agent whose place a spare took (`spares.rs`) is told so.
        let replaced = self.replaced_refusal(&st, node_id);
        let g = self.running(&mut st, generation)?;
        let num_nodes = g.nodes.len() as u32;
        let world_size = g.ranks.len() as u32;
        let Some(node) = g.nodes.get_mut(node_rank as usize) else {
            return Err(Error::InvalidArgument(format!(
                "node rank {node_rank} is outside job '{id}' generation {generation} ({num_nodes} nodes)"
            )));
        };
        if !node_id.is_empty() && node.node_id != node_id {
            return Err(replaced.unwrap_or_else(|| {
                Error::WrongNode(format!(
                    "node rank {node_rank} of job '{id}' generation {generation} is node '{}', not '{node_id}'",
                    node.node_id
                ))
            }));
        }
        if node.relay.as_ref().is_some_and(|r| !r.is_closed()) {
            return Err(Error::AlreadyExists(format!(
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
                g.ranks[r as usize].place.resume(Scope::Global, released);
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
            b.node_rank = Some(node_rank);
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
        if let Some(e) = g.stale_relay(&id, node_rank, outbox) {
            return reply_now(simple_error(
                ErrKind::StaleGeneration,
                e.message().to_owned(),
            ));
        }
        if g.membership_open() {
            return reply_now(g.membership_error(&id));
        }
        let idx = Scope::Global.index();
        if seq <= g.released(Scope::Global, 0) {
            // Completed under the previous leader; the node's answer was lost in the failover.
            for (_, ranks) in &groups {
                for &rank in ranks {
                    if let Some(slot) = g.ranks.get_mut(rank as usize)
                        && slot.node_rank == node_rank
                        && !slot.place.waiting[idx]
                    {
                        slot.place.resume(Scope::Global, seq);
                    }
                }
            }
            let _ = outbox.send(Ok(relay_result(seq, None)));
            return;
        }
        let recovered = g.recovered;
        let twice = named_twice(&groups);
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
                    Some(slot) if !slot.place.may_enter(Scope::Global, seq) => Some(format!(
                        "rank {rank} is at global barrier #{} and cannot enter #{seq}",
                        slot.place.seq[idx]
                    )),
                    Some(_) if twice == Some(rank) => Some(format!("rank {rank} is named twice")),
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
        let key = BarrierKey::new(Scope::Global, 0, seq);
        if let Some(err) = g.left_error(&key, &id) {
            return reply_now(err);
        }
        let token = g.next_token;
        g.next_token += 1;
        let ranks = g.scope_ranks(Scope::Global, 0);
        let now = Instant::now();
        for (name, ranks) in &groups {
            for &rank in ranks {
                let slot = &mut g.ranks[rank as usize];
                slot.place.enter(Scope::Global, seq);
                slot.last_seen = now;
                slot.entered(idx, name);
            }
        }
        let b = g.barriers.open(key, ranks, now);
        let wait = Wait {
            token,
            relayed: true,
        };
        for (name, ranks) in groups {
            b.arrive_group(ranks, name, now, wait);
        }
        self.settle(g, key, timeout, token);
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
        if let Some(why) = g.left_quorum_error(&id) {
            g.end_quorums(|| Error::FailedPrecondition(why.clone()));
        }
        for key in g.barriers.keys() {
            if let Some(err) = g.left_error(&key, &id) {
                let b = g.barriers.remove(&key).expect("key listed above");
                g.fail_barrier(b, &err);
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
}

/// A rank that `groups` name more than once, if any. A node's groups list its ranks in order,
/// so the usual answer costs one pass and no allocation (this runs at every node's arrival).
fn named_twice(groups: &[(String, Vec<u32>)]) -> Option<u32> {
    let all = || groups.iter().flat_map(|(_, ranks)| ranks.iter().copied());
    let mut prev = None;
    let increasing = all().all(|r| {
        let ok = prev.is_none_or(|p| p < r);
        prev = Some(r);
        ok
    });
    if increasing {
        return None;
    }
    let mut sorted: Vec<u32> = all().collect();
    sorted.sort_unstable();
    sorted.windows(2).find(|w| w[0] == w[1]).map(|w| w[0])
}
