//! The node relay's barrier state: which local ranks are connected, which barriers they wait
//! at, and what to answer. Pure and synchronous — no sockets, no clock of its own — so that
//! every rule is unit-tested with a recording [`Sink`]; `relay.rs` drives it from one thread.
//! The barriers themselves (arrivals, completion, missing ranks, the messages) are a
//! [`muster_core::barrier::Table`] over the local ranks, the same table the coordinator keeps;
//! this file adds what only a relay does: registrations, handing global barriers on, deaths,
//! failovers and the trace context.
//!
//! Rules (the coordinator's, restricted to one node; see `docs/contract.md`):
//! - a rank's n-th barrier of a scope has seq n; it may enter seq `last + 1`, or `last` again
//!   after a timeout (a retry);
//! - node barriers complete here once every local rank has entered the same seq under the same
//!   name; different names are a divergence, reported to every rank that arrived and to every
//!   later arrival at that seq;
//! - a global barrier goes to the coordinator as one `GroupEnter` once every local rank has
//!   entered it, and the coordinator's one answer is fanned out to every local rank of it —
//!   unless this node's ranks are the whole generation (a single-node job): then no other node
//!   takes part, and it completes here exactly like a node barrier. Like node barriers, such
//!   barriers do not appear in the coordinator's ops view (`DescribeJob`);
//! - a timeout that expires before a barrier is handed to the coordinator withdraws that rank
//!   only (it may retry the same seq), answering TIMEOUT with the local ranks still missing;
//! - a rank whose connection closes without `leave` is dead: every pending and later barrier
//!   fails with RANK_FAILED once the coordinator confirms the death (its `failed` event, with
//!   the agent's exit report), or after [`DEATH_CONFIRM`] with an error naming the rank;
//! - a rank that left makes every barrier it had not entered fail with RANK_LEFT;
//! - the coordinator's `failed` event fails every pending and later barrier with its error;
//! - in-place recovery ([`Recovery::InPlace`]): a local death does not fail the node for good.
//!   The waits pending when it is confirmed (the coordinator's MEMBERSHIP_CHANGED, as a
//!   `failed` event or as the answer to a global barrier, or [`DEATH_CONFIRM`] without word)
//!   are withdrawn with KIND_MEMBERSHIP_CHANGED, node barriers included (a rank held at one
//!   would miss the quorum the others call; the same for a death on another node), as are
//!   later entries until the rank's
//!   replacement registers (`Register.replacement`); the replacement takes the dead rank's
//!   slot and continues the barrier sequences from the seqs its `resume` carries (or from 0
//!   without it);
//! - across a coordinator failover, the relay re-registers with [`Hub::released`] and
//!   [`Hub::resend`]s the global barriers in flight, exactly as they were first sent; the local
//!   ranks keep waiting and see nothing of it.
//!
//! Traces: a global barrier handed to the coordinator carries one W3C trace context in its
//! `GroupEnter` (see [`Hub::send_group`]), so that the coordinator's span of it joins a
//! worker's trace; nothing is carried (or allocated) when no local rank sent one and the agent
//! does not export traces.

use crate::env::{NodeAssignment, Recovery};
use muster_core::barrier::{self, Key, Place, Table, Waiter, consumes_seq};
use muster_core::model::{self, Scope, barrier_error as simple_error};
use muster_proto::v1 as pb;
use muster_telemetry::traces as telemetry;
use pb::barrier_error::Kind as ErrKind;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// The longest worker host name taken from a registration (it only appears in messages).
const MAX_HOST: usize = 255;
/// How long the relay waits for the coordinator to confirm a local rank's death (its `failed`
/// event) before failing the node's waits itself.
pub const DEATH_CONFIRM: Duration = Duration::from_secs(1);

/// Where the hub's answers go. The relay writes them to sockets; tests record them.
pub trait Sink {
    /// Sends `msg` to the worker of each local rank in `to` (indices `0..local_world_size`).
    /// The same encoded message goes to all of them.
    fn workers(&mut self, to: &[u32], msg: &pb::CoordinatorMessage);
    /// Sends `msg` on the relay stream to the coordinator.
    fn coordinator(&mut self, msg: pb::RelayMessage);
    /// Sends the worker of `local` a farewell saying `why`, then closes its connection.
    fn close(&mut self, local: u32, why: &str);
    /// A wait with an earlier deadline than any before was added: re-arm the timer.
    fn wake_timer(&mut self);
}

/// The frame that ends a worker connection: a barrier result with scope and seq 0, whose
/// error message says why. Sent when the agent refuses a registration or can no longer relay.
pub fn farewell(why: &str) -> pb::CoordinatorMessage {
    result(
        pb::BarrierScope::Unspecified as i32,
        0,
        Some(simple_error(ErrKind::Unspecified, why.to_owned())),
    )
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum RankState {
    /// Not connected yet.
    Absent,
    /// Connected and registered.
    Live,
    /// Sent `leave`: done, not failed.
    Left,
    /// Its connection closed without `leave`.
    Dead,
}

#[derive(Debug)]
struct Slot {
    state: RankState,
    pid: u32,
    host: String,
    /// Where the rank is in each scope's barrier sequence.
    place: Place,
    /// In place: the worker registered as a replacement (it may send its seqs again).
    replacement: bool,
}

/// What the relay keeps per wait, beside the table's rank, name and arrival time.
#[derive(Debug)]
struct Wait {
    /// When the wait gives up; cleared once answered.
    deadline: Option<Instant>,
    /// The rank's W3C trace context from its entry (moved, not copied; usually empty).
    trace_context: HashMap<String, String>,
}

/// What the relay keeps per barrier; reset when the table recycles it.
#[derive(Debug)]
struct Relayed {
    /// Set once ranks met under different names (node scope): every arrival gets it.
    diverged: Option<pb::BarrierError>,
    /// Handed to the coordinator (global scope): its answer ends the barrier.
    sent: bool,
    /// What was handed to the coordinator, to send again after a failover.
    enter: Option<pb::GroupEnter>,
    /// The agent's `muster.relay.barrier` span while the coordinator holds the barrier
    /// (disabled unless the agent exports traces); it ends when the barrier is recycled.
    span: tracing::Span,
}

impl Default for Relayed {
    fn default() -> Self {
        Self {
            diverged: None,
            sent: false,
            enter: None,
            span: tracing::Span::none(),
        }
    }
}

/// One node's barrier state. Only the relay thread touches it.
#[derive(Debug)]
pub struct Hub {
    job_id: String,
    generation: u64,
    node_rank: u32,
    num_nodes: u32,
    world_size: u32,
    offset: u32,
    slots: Vec<Slot>,
    /// Pending barriers of both scopes (a handful at most), over the node's ranks; it also
    /// keeps the last global seq the coordinator answered with a result that uses it up.
    barriers: Table<Wait, Relayed>,
    /// Set once the generation can make no progress: every later barrier fails with it.
    failed: Option<pb::BarrierError>,
    /// A local rank died: when to fail everything with this error if the coordinator has not
    /// confirmed the death by then.
    dying: Option<(Instant, pb::BarrierError)>,
    /// The job's recovery mode: in place, a local death withdraws waits instead of failing
    /// the node for good, and the dead rank's replacement may register.
    recovery: Recovery,
    /// In place: the membership changed and a local rank awaits its replacement: entries are
    /// answered at once with this error (the worker goes to its step boundary, `Quorum`).
    withdrawn: Option<pb::BarrierError>,
    /// Set once the relay lost its coordinator stream: connections are refused with it.
    closed: Option<String>,
    /// Scratch list of local ranks to answer.
    to: Vec<u32>,
    /// The deadline the timer is armed for.
    armed: Option<Instant>,
    /// Barriers completed for this node's ranks (with a result, not an error), shared with
    /// the stack sampler: progress for hang detection ([`crate::stacks::Sampler::with_barriers`]).
    completed: Arc<AtomicU64>,
}

fn result(scope: i32, seq: u64, error: Option<pb::BarrierError>) -> pb::CoordinatorMessage {
    pb::CoordinatorMessage {
        kind: Some(pb::coordinator_message::Kind::Barrier(pb::BarrierResult {
            scope,
            seq,
            error,
        })),
    }
}

/// Answers an entry that was not recorded (malformed, misnumbered): the seq stays usable.
fn reject(sink: &mut impl Sink, local: u32, wire_scope: i32, seq: u64, why: String) {
    sink.workers(
        &[local],
        &result(
            wire_scope,
            seq,
            Some(simple_error(ErrKind::Unspecified, why)),
        ),
    );
}

/// Whole milliseconds, rounded up (a wait of 0.4 ms is 1 ms, never "no limit").
fn ceil_ms(d: Duration) -> u64 {
    u64::try_from(d.as_nanos().div_ceil(1_000_000)).unwrap_or(u64::MAX)
}

/// Whether `err` is in-place recovery's withdrawal (KIND_MEMBERSHIP_CHANGED).
fn is_membership_change(err: &pb::BarrierError) -> bool {
    err.kind == ErrKind::MembershipChanged as i32
}

/// `death` (a RANK_FAILED error naming a local rank) as in-place recovery's withdrawal.
fn membership_changed(death: pb::BarrierError) -> pb::BarrierError {
    pb::BarrierError {
        kind: ErrKind::MembershipChanged as i32,
        message: muster_core::failure::replacing_in_place(&death.message, ""),
        ..death
    }
}

/// The key of the coordinator's global barrier `seq`.
fn global(seq: u64) -> Key {
    Key::new(Scope::Global, 0, seq)
}

impl Hub {
    /// The state of a node that has just been assigned: no rank connected, nothing pending.
    pub fn new(node: &NodeAssignment) -> Self {
        let slot = || Slot {
            state: RankState::Absent,
            pid: 0,
            host: node.host.clone(),
            place: Place::default(),
            replacement: false,
        };
        Self {
            job_id: node.job_id.clone(),
            generation: node.generation,
            node_rank: node.node_rank,
            num_nodes: node.num_nodes,
            world_size: node.world_size,
            offset: node.rank_offset,
            slots: (0..node.local_world_size).map(|_| slot()).collect(),
            barriers: Table::default(),
            failed: None,
            dying: None,
            recovery: node.recovery,
            withdrawn: None,
            closed: None,
            to: Vec::with_capacity(node.local_world_size as usize),
            armed: None,
            completed: Arc::default(),
        }
    }

    /// Counts the barriers this hub completes in `completed`.
    #[must_use]
    pub fn counting(mut self, completed: Arc<AtomicU64>) -> Self {
        self.completed = completed;
        self
    }

    /// The answer to a successful registration.
    pub fn registered(&self) -> pb::CoordinatorMessage {
        pb::CoordinatorMessage {
            kind: Some(pb::coordinator_message::Kind::Registered(pb::Registered {
                heartbeat_interval_ms: 0,
                world_size: self.world_size,
                node_rank: self.node_rank,
                num_nodes: self.num_nodes,
            })),
        }
    }

    /// Accepts a worker's `register`: returns its local rank, or why it is refused (wrong job
    /// or generation, a rank of another node, a rank that already connected, a relay that can
    /// no longer reach the coordinator).
    pub fn register(&mut self, reg: &pb::Register) -> Result<u32, String> {
        if let Some(why) = &self.closed {
            return Err(why.clone());
        }
        if reg.job_id != self.job_id {
            return Err(format!(
                "rank {} registered for job '{}', but this agent runs job '{}'",
                reg.rank, reg.job_id, self.job_id
            ));
        }
        if reg.generation != self.generation {
            return Err(format!(
                "rank {} registered for generation {}, but this agent runs generation {} of job '{}'",
                reg.rank, reg.generation, self.generation, self.job_id
            ));
        }
        let local = reg
            .rank
            .checked_sub(self.offset)
            .filter(|l| (*l as usize) < self.slots.len())
            .ok_or_else(|| {
                format!(
                    "rank {} does not run on node {} of job '{}' (its ranks are {}..{})",
                    reg.rank,
                    self.node_rank,
                    self.job_id,
                    self.offset,
                    self.offset as usize + self.slots.len()
                )
            })?;
        let in_place = self.recovery == Recovery::InPlace;
        let slot = &mut self.slots[local as usize];
        let replaces = in_place && reg.replacement && slot.state == RankState::Dead;
        if slot.state != RankState::Absent && !replaces {
            let why = if reg.replacement && slot.state == RankState::Live {
                " and is still connected: a replacement registers once the rank's previous worker is gone"
            } else if reg.replacement && !in_place {
                ": the job does not recover in place"
            } else {
                ""
            };
            return Err(format!(
                "rank {} of job '{}' generation {} has already connected to this agent (pid {}){why}",
                reg.rank, self.job_id, self.generation, slot.pid
            ));
        }
        if replaces {
            // The dead worker's place is forgotten: the replacement numbers its barriers from
            // the seqs the quorum gave it (the membership's released ones).
            slot.place = Place::default();
            if reg.resume {
                slot.place.resume(Scope::Global, reg.released_global);
                slot.place.resume(Scope::Node, reg.released_node);
            }
        }
        slot.state = RankState::Live;
        slot.replacement = replaces;
        slot.pid = reg.pid;
        if !reg.host.is_empty() && reg.host.len() <= MAX_HOST {
            slot.host.clone_from(&reg.host);
        }
        if self.slots.iter().all(|s| s.state != RankState::Dead) {
            // Every dead local rank is replaced: barriers can complete again.
            self.withdrawn = None;
        }
        Ok(local)
    }

    /// A second `register` on local rank `local`'s connection: allowed only in place, for a
    /// worker that registered as a replacement and now sends the seqs the quorum gave it
    /// (`resume`), while it waits for no barrier. Returns why it is refused otherwise.
    pub fn reregister(&mut self, local: u32, reg: &pb::Register) -> Result<(), String> {
        let rank = self.offset + local;
        let slot = &mut self.slots[local as usize];
        if self.recovery != Recovery::InPlace
            || !slot.replacement
            || !reg.replacement
            || !reg.resume
            || reg.rank != rank
            || reg.generation != self.generation
            || reg.job_id != self.job_id
        {
            return Err("sent `register` twice to the agent".into());
        }
        if slot.place.waiting.iter().any(|w| *w) {
            return Err(format!(
                "rank {rank} sent `register` again while it waits for a barrier"
            ));
        }
        slot.place = Place::default();
        slot.place.resume(Scope::Global, reg.released_global);
        slot.place.resume(Scope::Node, reg.released_node);
        Ok(())
    }

    /// A barrier entry from local rank `local` (registered) at time `now`.
    pub fn enter(
        &mut self,
        local: u32,
        entry: pb::BarrierEnter,
        now: Instant,
        sink: &mut impl Sink,
    ) {
        let pb::BarrierEnter {
            scope: wire_scope,
            seq,
            name,
            timeout_ms,
            trace_context,
        } = entry;
        let scope = match Scope::from_wire(wire_scope) {
            Ok(scope) => scope,
            Err(e) => return reject(sink, local, wire_scope, seq, e.0),
        };
        if let Err(why) = barrier::check_name(&name) {
            return reject(sink, local, wire_scope, seq, why);
        }
        let timeout = match model::wait("timeout_ms", timeout_ms) {
            Ok(timeout) => timeout,
            Err(e) => return reject(sink, local, wire_scope, seq, e.0),
        };
        let idx = scope.index();
        let rank = self.offset + local;
        let key = Key::new(scope, self.node_rank, seq);
        let slot = &mut self.slots[local as usize];
        if slot.state != RankState::Live {
            return reject(
                sink,
                local,
                wire_scope,
                seq,
                format!("rank {rank} has left the job; it cannot enter barriers"),
            );
        }
        if let Err(why) = slot.place.check_entry(rank, scope, self.node_rank, seq) {
            return reject(sink, local, wire_scope, seq, why);
        }
        slot.place.seq[idx] = seq;
        if let Some(err) = self
            .failed
            .clone()
            .or_else(|| self.withdrawn.clone())
            .or_else(|| self.left_error(key))
        {
            self.slots[local as usize].place.done[idx] = seq;
            sink.workers(&[local], &result(scope.to_wire(), seq, Some(err)));
            return;
        }
        self.slots[local as usize].place.enter(scope, seq);
        let deadline = timeout.map(|t| now + t);
        let ranks = self.offset..self.offset + self.slots.len() as u32;
        let wait = Wait {
            deadline,
            trace_context,
        };
        self.barriers
            .open(key, ranks, now)
            .arrive(rank, name, now, wait);
        if let Some(d) = deadline
            && self.armed.is_none_or(|armed| d < armed)
        {
            self.armed = Some(d);
            sink.wake_timer();
        }
        self.settle(key, now, sink);
    }

    /// Local rank `local` sent `leave`: it is done. Barriers it had not entered can never
    /// complete and fail with RANK_LEFT.
    pub fn leave(&mut self, local: u32, sink: &mut impl Sink) {
        let slot = &mut self.slots[local as usize];
        if slot.state != RankState::Live {
            return;
        }
        slot.state = RankState::Left;
        let rank = self.offset + local;
        let mut i = 0;
        while i < self.barriers.len() {
            let b = self.barriers.at(i);
            let key = b.key();
            let entered = b.has_arrived(rank)
                || self.slots[local as usize].place.done[key.scope.index()] >= key.seq;
            if entered || b.extra.sent {
                i += 1;
                continue;
            }
            let err = self.left_error_of(local, key);
            self.deliver(i, Some(&err), sink);
            self.recycle(i);
        }
    }

    /// Local rank `local`'s connection ended without `leave` at `now` (`why` says how): the
    /// rank is dead, and the generation with it. The node's waits fail when the coordinator's
    /// `failed` event comes (normally within milliseconds, once the agent has reported the
    /// worker's exit status and stderr) or, if it does not come within [`DEATH_CONFIRM`], with
    /// an error naming `why`. Telling the local ranks first would be faster but wrong: a local
    /// rank could then leave cleanly before the coordinator knows of the death, and the other
    /// nodes would hear of that departure instead of the death.
    pub fn lost(&mut self, local: u32, why: &str, now: Instant, sink: &mut impl Sink) {
        let slot = &mut self.slots[local as usize];
        if slot.state != RankState::Live {
            return;
        }
        slot.state = RankState::Dead;
        if self.failed.is_some() || self.dying.is_some() {
            return;
        }
        let rank = self.offset + local;
        let host = slot.host.clone();
        let err = pb::BarrierError {
            kind: ErrKind::RankFailed as i32,
            message: muster_core::failure::rank_failed(
                rank,
                self.node_rank,
                &host,
                &self.job_id,
                self.generation,
                why,
            ),
            rank,
            node_rank: self.node_rank,
            host,
            missing: vec![],
        };
        if self.recovery == Recovery::InPlace && self.withdrawn.is_some() {
            // The membership already changed (another local death): this one withdraws
            // nothing new, and entries are answered at once until both are replaced.
            self.withdrawn = Some(membership_changed(err));
            return;
        }
        let deadline = now + DEATH_CONFIRM;
        self.dying = Some((deadline, err));
        if self.armed.is_none_or(|armed| deadline < armed) {
            self.armed = Some(deadline);
            sink.wake_timer();
        }
    }

    /// An event from the coordinator's relay stream.
    pub fn on_event(&mut self, event: pb::RelayEvent, sink: &mut impl Sink) {
        match event.kind {
            Some(pb::relay_event::Kind::Barrier(r)) => {
                if self.recovery == Recovery::InPlace
                    && let Some(err) = r.error.as_ref().filter(|e| is_membership_change(e))
                {
                    // The coordinator withdrew the generation's waits: the node's own end
                    // with them, or a rank held here would miss the quorum the others call.
                    self.withdraw(err.clone(), sink);
                }
                if consumes_seq(r.error.as_ref()) {
                    self.barriers.release(global(r.seq));
                }
                let Some(bi) = self
                    .barriers
                    .index_of(&global(r.seq))
                    .filter(|&i| self.barriers.at(i).extra.sent)
                else {
                    // A barrier already failed here (a local death, a failure event).
                    return;
                };
                self.deliver(bi, r.error.as_ref(), sink);
                self.recycle(bi);
            }
            Some(pb::relay_event::Kind::Failed(err))
                if self.recovery == Recovery::InPlace && is_membership_change(&err) =>
            {
                self.withdraw(err, sink);
            }
            Some(pb::relay_event::Kind::Failed(err)) => self.fail_all(err, sink),
            // Rank events are the gateway's (`State::on_event`).
            Some(pb::relay_event::Kind::Registered(_) | pb::relay_event::Kind::Rank(_)) | None => {}
        }
    }

    /// The last global barrier seq the coordinator released this node from (0 if none): what
    /// the relay tells the next leader when it registers again after a failover.
    pub fn released(&self) -> u64 {
        self.barriers.released(Scope::Global, 0)
    }

    /// The last global and node barrier seqs this node was released from: what its ranks
    /// tell the next leader when they register again after a failover.
    pub fn released_seqs(&self) -> (u64, u64) {
        (
            self.released(),
            self.barriers.released(Scope::Node, self.node_rank),
        )
    }

    /// After a failover: sends the coordinator every global barrier handed to it and not yet
    /// answered, again, exactly as first sent (same seq, groups and timeout). The coordinator
    /// answers each once.
    pub fn resend(&mut self, sink: &mut impl Sink) {
        for b in self.barriers.iter() {
            if let (true, Some(enter)) = (b.extra.sent, &b.extra.enter) {
                sink.coordinator(pb::RelayMessage {
                    kind: Some(pb::relay_message::Kind::Enter(enter.clone())),
                });
            }
        }
    }

    /// The relay stream to the coordinator is gone (`why`): every worker connection is closed
    /// with a farewell saying so, and new ones are refused.
    pub fn coordinator_lost(&mut self, why: String, sink: &mut impl Sink) {
        if self.closed.is_some() {
            return;
        }
        for (local, slot) in self.slots.iter().enumerate() {
            if slot.state == RankState::Live {
                sink.close(local as u32, &why);
            }
        }
        self.closed = Some(why);
        self.recycle_all();
    }

    /// Answers every wait whose deadline is at or before `now` and that the coordinator does
    /// not hold: the rank is withdrawn (it may retry the same seq) and told who was missing.
    pub fn expire(&mut self, now: Instant, sink: &mut impl Sink) {
        if let Some((deadline, _)) = &self.dying
            && *deadline <= now
            && let Some((_, err)) = self.dying.take()
        {
            tracing::warn!(
                "the coordinator did not confirm the death of a local rank within {:.1}s: {}",
                DEATH_CONFIRM.as_secs_f64(),
                err.message
            );
            if self.recovery == Recovery::InPlace {
                // The coordinator replaces the rank or fails the generation; either way the
                // workers learn it at their step boundary (`Quorum`).
                return self.withdraw(membership_changed(err), sink);
            }
            return self.fail_all(err, sink);
        }
        let mut i = 0;
        while i < self.barriers.len() {
            if self.barriers.at(i).extra.sent {
                i += 1;
                continue;
            }
            while let Some(pos) = self
                .barriers
                .at(i)
                .arrivals()
                .iter()
                .position(|a| a.data.deadline.is_some_and(|d| d <= now))
            {
                let arrival = self.barriers.at_mut(i).remove_arrival(pos);
                let local = arrival.rank() - self.offset;
                let key = self.barriers.at(i).key();
                self.slots[local as usize].place.waiting[key.scope.index()] = false;
                let err = self.timeout_error(i, &arrival, now);
                self.barriers.at_mut(i).prune_names();
                sink.workers(&[local], &result(key.scope.to_wire(), key.seq, Some(err)));
            }
            if self.barriers.at(i).arrivals().is_empty() {
                self.recycle(i);
            } else {
                i += 1;
            }
        }
    }

    /// The waits this hub holds (not handed to the coordinator) whose first rank arrived at
    /// least `older_than` before `now`: what the coordinator's ops view cannot see otherwise.
    pub fn waiting_report(&self, now: Instant, older_than: Duration) -> Vec<pb::BarrierInfo> {
        self.barriers
            .iter()
            .filter(|b| !b.extra.sent)
            .filter_map(|b| {
                let first = b.first_entered()?;
                let waited = now.saturating_duration_since(first);
                (waited >= older_than).then(|| pb::BarrierInfo {
                    // A global barrier is reported as this node's part of it.
                    node_rank: Some(self.node_rank),
                    ..b.info(waited, |r| self.location(r))
                })
            })
            .collect()
    }

    /// The earliest deadline that [`Hub::expire`] would act on (a wait's timeout, an
    /// unconfirmed death); also what the timer is now armed for.
    pub fn arm(&mut self) -> Option<Instant> {
        let waits = self
            .barriers
            .iter()
            .filter(|b| !b.extra.sent)
            .flat_map(|b| b.arrivals().iter().filter_map(|a| a.data.deadline));
        self.armed = waits.chain(self.dying.as_ref().map(|(d, _)| *d)).min();
        self.armed
    }

    /// Removes barrier `i` (the last one moves into its place) and keeps it for reuse.
    fn recycle(&mut self, i: usize) {
        let b = self.barriers.remove_at(i);
        self.barriers.recycle(b);
    }

    /// Removes every barrier, keeping a few for reuse.
    fn recycle_all(&mut self) {
        for b in self.barriers.drain() {
            self.barriers.recycle(b);
        }
    }

    /// After an arrival at barrier `key`: reports a divergence, completes a node barrier, or
    /// hands a complete global barrier to the coordinator.
    fn settle(&mut self, key: Key, now: Instant, sink: &mut impl Sink) {
        let Some(bi) = self.barriers.index_of(&key) else {
            return;
        };
        let b = self.barriers.at(bi);
        let complete = b.complete();
        match key.scope {
            Scope::Global if !self.whole_world() => {
                if complete {
                    self.send_group(bi, now, sink);
                }
            }
            Scope::Node | Scope::Global => {
                if b.diverged() || b.extra.diverged.is_some() {
                    if b.extra.diverged.is_none() {
                        let err = b.divergence_error(|r| self.location(r));
                        self.barriers.at_mut(bi).extra.diverged = Some(err);
                    }
                    let err = self.barriers.at(bi).extra.diverged.clone();
                    self.deliver(bi, err.as_ref(), sink);
                    if complete {
                        self.recycle(bi);
                    }
                } else if complete {
                    self.deliver(bi, None, sink);
                    self.recycle(bi);
                }
            }
        }
    }

    /// Whether this node's ranks are the whole generation (a single-node job): then a global
    /// barrier involves no other node and completes here like a node barrier.
    fn whole_world(&self) -> bool {
        self.slots.len() as u32 == self.world_size
    }

    /// Hands global barrier `bi` to the coordinator: one group per name, the shortest
    /// remaining local timeout, and one trace context for the coordinator's span.
    ///
    /// That context is the one of the node's *first arriving* rank that sent one (its wait
    /// covers the node's whole barrier, so its trace shows all of it). When the agent exports
    /// traces, a `muster.relay.barrier` span (from here until the coordinator's answer) is made
    /// a child of it and its own context goes instead, giving worker → agent → coordinator;
    /// otherwise the worker's context is passed through as it came, moved rather than copied.
    fn send_group(&mut self, bi: usize, now: Instant, sink: &mut impl Sink) {
        let (job_id, node_rank) = (&self.job_id, self.node_rank);
        let b = self.barriers.at_mut(bi);
        let seq = b.key().seq;
        b.extra.sent = true;
        let worker_context = b
            .arrivals_mut()
            .iter_mut()
            .find(|a| !a.data.trace_context.is_empty())
            .map(|a| std::mem::take(&mut a.data.trace_context))
            .unwrap_or_default();
        // Disabled (no work: no fields, no parent) unless the agent exports traces.
        b.extra.span = tracing::debug_span!(
            "muster.relay.barrier",
            otel.kind = "client",
            job = %job_id,
            node_rank,
            seq,
            ranks = b.arrivals().len(),
        );
        telemetry::set_parent(&b.extra.span, &worker_context);
        let trace_context = telemetry::carrier(&b.extra.span).unwrap_or(worker_context);
        let timeout_ms = b
            .arrivals()
            .iter()
            .filter_map(|a| a.data.deadline)
            .min()
            .map_or(0, |d| ceil_ms(d.saturating_duration_since(now)).max(1));
        let mut groups = b.groups();
        for g in &mut groups {
            g.ranks.sort_unstable();
        }
        let enter = pb::GroupEnter {
            seq,
            groups,
            timeout_ms,
            trace_context,
        };
        b.extra.enter = Some(enter.clone());
        sink.coordinator(pb::RelayMessage {
            kind: Some(pb::relay_message::Kind::Enter(enter)),
        });
    }

    /// Answers every rank of barrier `bi` still waiting for it with the same result.
    fn deliver(&mut self, bi: usize, error: Option<&pb::BarrierError>, sink: &mut impl Sink) {
        let Self {
            barriers,
            slots,
            to,
            offset,
            completed,
            ..
        } = self;
        let b = barriers.at_mut(bi);
        let key = b.key();
        let consumes = consumes_seq(error);
        if error.is_none()
            && let Some(first) = b.first_entered()
        {
            crate::metrics::relay_barrier(key.scope == Scope::Global, first.elapsed());
        }
        to.clear();
        for a in b.arrivals_mut() {
            let local = a.rank() - *offset;
            if slots[local as usize]
                .place
                .answer(key.scope, key.seq, consumes)
            {
                a.data.deadline = None;
                to.push(local);
            }
        }
        if !to.is_empty() {
            if error.is_none() {
                completed.fetch_add(1, Ordering::Relaxed);
            }
            sink.workers(to, &result(key.scope.to_wire(), key.seq, error.cloned()));
        }
    }

    /// Fails every pending wait, now and later, with the generation's first failure.
    fn fail_all(&mut self, err: pb::BarrierError, sink: &mut impl Sink) {
        self.dying = None;
        let err = self.failed.get_or_insert(err).clone();
        for i in 0..self.barriers.len() {
            self.deliver(i, Some(&err), sink);
        }
        self.recycle_all();
    }

    /// In place: the membership changed. Every pending wait of the node is answered with
    /// `err` (KIND_MEMBERSHIP_CHANGED), and so is every entry until the dead local ranks'
    /// replacements register; nothing fails for good.
    fn withdraw(&mut self, err: pb::BarrierError, sink: &mut impl Sink) {
        self.dying = None;
        for i in 0..self.barriers.len() {
            self.deliver(i, Some(&err), sink);
        }
        self.recycle_all();
        if self.slots.iter().any(|s| s.state == RankState::Dead) {
            self.withdrawn = Some(err);
        }
    }

    /// Where (global) rank `rank` of this node runs.
    fn location(&self, rank: u32) -> pb::RankLocation {
        pb::RankLocation {
            rank: Some(rank),
            node_rank: Some(self.node_rank),
            host: self.slots[(rank - self.offset) as usize].host.clone(),
        }
    }

    /// The RANK_LEFT error for barrier `key` if a departed local rank had not entered it.
    fn left_error(&self, key: Key) -> Option<pb::BarrierError> {
        let local = self.slots.iter().position(|s| {
            s.state == RankState::Left && s.place.done[key.scope.index()] < key.seq
        })?;
        Some(self.left_error_of(local as u32, key))
    }

    fn left_error_of(&self, local: u32, key: Key) -> pb::BarrierError {
        let loc = self.location(self.offset + local);
        barrier::left_error(loc, &self.job_id, self.generation, key)
    }

    /// The TIMEOUT answer to `a`, just withdrawn from barrier `bi` at `now`.
    fn timeout_error(
        &self,
        bi: usize,
        a: &barrier::Arrival<Wait>,
        now: Instant,
    ) -> pb::BarrierError {
        let b = self.barriers.at(bi);
        let key = b.key();
        let missing = b.missing_except(|r| r == a.rank(), |r| self.location(r));
        let name = b.name_of(a);
        let after = now.saturating_duration_since(a.entered());
        match key.scope {
            Scope::Global if !self.whole_world() => barrier::node_incomplete_timeout_error(
                key.seq,
                name,
                after,
                a.rank(),
                &self.job_id,
                self.generation,
                self.node_rank,
                missing,
            ),
            Scope::Node | Scope::Global => barrier::timeout_error(
                key,
                name,
                after,
                Waiter::Rank(a.rank()),
                &self.job_id,
                self.generation,
                missing,
            ),
        }
    }
}

#[cfg(test)]
mod tests;
