//! The node relay's barrier state: which local ranks are connected, which barriers they wait
//! at, and what to answer. Pure and synchronous — no sockets, no clock of its own — so that
//! every rule is unit-tested with a recording [`Sink`]; `relay.rs` drives it from one thread.
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
//! - across a coordinator failover, the relay re-registers with [`Hub::released`] and
//!   [`Hub::resend`]s the global barriers in flight, exactly as they were first sent; the local
//!   ranks keep waiting and see nothing of it.
//!
//! Traces: a global barrier handed to the coordinator carries one W3C trace context in its
//! `GroupEnter` (see [`Hub::send_group`]), so that the coordinator's span of it joins a
//! worker's trace; nothing is carried (or allocated) when no local rank sent one and the agent
//! does not export traces.

use crate::env::NodeAssignment;
use muster_coordinator::telemetry;
use muster_core::model::{self, Scope, barrier_error as simple_error, list_ranks, scope_name};
use muster_proto::v1 as pb;
use pb::barrier_error::Kind as ErrKind;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::time::{Duration, Instant};

/// The longest barrier name (the coordinator's limit for call-site names).
const MAX_NAME: usize = 512;
/// The longest worker host name taken from a registration (it only appears in messages).
const MAX_HOST: usize = 255;
/// How many finished barrier records are kept for reuse.
const SPARE_BARRIERS: usize = 8;
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
    /// Last barrier seq entered, per scope.
    seq: [u64; 2],
    /// Last barrier seq answered with a result that uses the seq up, per scope.
    done: [u64; 2],
    /// Whether the rank waits for an answer, per scope.
    waiting: [bool; 2],
}

#[derive(Debug)]
struct Arrival {
    local: u32,
    /// Index into the barrier's names.
    name: usize,
    entered: Instant,
    /// When the wait gives up; cleared once answered.
    deadline: Option<Instant>,
    /// The rank's W3C trace context from its entry (moved, not copied; usually empty).
    trace_context: HashMap<String, String>,
}

#[derive(Debug)]
struct Barrier {
    scope: Scope,
    seq: u64,
    names: Vec<String>,
    arrivals: Vec<Arrival>,
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

impl Barrier {
    fn empty() -> Self {
        Self {
            scope: Scope::Node,
            seq: 0,
            names: Vec::new(),
            arrivals: Vec::new(),
            diverged: None,
            sent: false,
            enter: None,
            span: tracing::Span::none(),
        }
    }

    /// Drops a name no remaining arrival uses (after a withdrawal), so that a retry under
    /// another name is not taken for a divergence.
    fn prune_name(&mut self, name: usize) {
        if self.arrivals.iter().any(|a| a.name == name) {
            return;
        }
        self.names.remove(name);
        for a in &mut self.arrivals {
            if a.name > name {
                a.name -= 1;
            }
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
    /// Pending barriers of both scopes (a handful at most).
    barriers: Vec<Barrier>,
    spare: Vec<Barrier>,
    /// Set once the generation can make no progress: every later barrier fails with it.
    failed: Option<pb::BarrierError>,
    /// A local rank died: when to fail everything with this error if the coordinator has not
    /// confirmed the death by then.
    dying: Option<(Instant, pb::BarrierError)>,
    /// Set once the relay lost its coordinator stream: connections are refused with it.
    closed: Option<String>,
    /// Scratch list of local ranks to answer.
    to: Vec<u32>,
    /// The deadline the timer is armed for.
    armed: Option<Instant>,
    /// The last global seq the coordinator answered with a result that uses the seq up.
    released: u64,
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

/// Whether a result uses up its seq: a timeout and a rejected entry do not (the same seq may
/// be entered again); every other result does. The SDK applies the same rule.
fn consumes_seq(error: Option<&pb::BarrierError>) -> bool {
    match error.map(|e| ErrKind::try_from(e.kind)) {
        None => true,
        Some(Ok(ErrKind::Timeout | ErrKind::Unspecified) | Err(_)) => false,
        Some(Ok(_)) => true,
    }
}

/// The coordinator's rule for call-site names, checked without allocating on the good path.
fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME || name.chars().any(char::is_control) {
        return model::label("barrier name", name, MAX_NAME)
            .map(drop)
            .map_err(|e| e.0);
    }
    Ok(())
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

impl Hub {
    /// The state of a node that has just been assigned: no rank connected, nothing pending.
    pub fn new(node: &NodeAssignment) -> Self {
        let slot = || Slot {
            state: RankState::Absent,
            pid: 0,
            host: node.host.clone(),
            seq: [0; 2],
            done: [0; 2],
            waiting: [false; 2],
        };
        Self {
            job_id: node.job_id.clone(),
            generation: node.generation,
            node_rank: node.node_rank,
            num_nodes: node.num_nodes,
            world_size: node.world_size,
            offset: node.rank_offset,
            slots: (0..node.local_world_size).map(|_| slot()).collect(),
            barriers: Vec::new(),
            spare: Vec::new(),
            failed: None,
            dying: None,
            closed: None,
            to: Vec::with_capacity(node.local_world_size as usize),
            armed: None,
            released: 0,
        }
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
        let slot = &mut self.slots[local as usize];
        if slot.state != RankState::Absent {
            return Err(format!(
                "rank {} of job '{}' generation {} has already connected to this agent (pid {})",
                reg.rank, self.job_id, self.generation, slot.pid
            ));
        }
        slot.state = RankState::Live;
        slot.pid = reg.pid;
        if !reg.host.is_empty() && reg.host.len() <= MAX_HOST {
            slot.host.clone_from(&reg.host);
        }
        Ok(local)
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
        if let Err(why) = check_name(&name) {
            return reject(sink, local, wire_scope, seq, why);
        }
        let timeout = match model::wait("timeout_ms", timeout_ms) {
            Ok(timeout) => timeout,
            Err(e) => return reject(sink, local, wire_scope, seq, e.0),
        };
        let idx = scope.index();
        let rank = self.offset + local;
        let node_rank = self.node_rank;
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
        let fresh = slot.seq[idx].checked_add(1) == Some(seq);
        let retry = seq == slot.seq[idx] && slot.done[idx] < seq;
        if slot.waiting[idx] || !(fresh || retry) {
            let why = format!(
                "rank {rank} sent {} #{seq}, but its last was #{}{}: barrier calls must be numbered 1, 2, 3... per scope, one at a time",
                scope_name(scope, node_rank),
                slot.seq[idx],
                if slot.waiting[idx] {
                    " and is still waiting"
                } else {
                    ""
                }
            );
            return reject(sink, local, wire_scope, seq, why);
        }
        slot.seq[idx] = seq;
        if let Some(err) = self.failed.clone().or_else(|| self.left_error(scope, seq)) {
            self.slots[local as usize].done[idx] = seq;
            sink.workers(&[local], &result(scope.to_wire(), seq, Some(err)));
            return;
        }
        self.slots[local as usize].waiting[idx] = true;
        let deadline = timeout.map(|t| now + t);
        let bi = self.barrier_index(scope, seq);
        let b = &mut self.barriers[bi];
        let name = match b.names.iter().position(|n| *n == name) {
            Some(i) => i,
            None => {
                b.names.push(name);
                b.names.len() - 1
            }
        };
        b.arrivals.push(Arrival {
            local,
            name,
            entered: now,
            deadline,
            trace_context,
        });
        if let Some(d) = deadline
            && self.armed.is_none_or(|armed| d < armed)
        {
            self.armed = Some(d);
            sink.wake_timer();
        }
        self.settle(bi, now, sink);
    }

    /// Local rank `local` sent `leave`: it is done. Barriers it had not entered can never
    /// complete and fail with RANK_LEFT.
    pub fn leave(&mut self, local: u32, sink: &mut impl Sink) {
        let slot = &mut self.slots[local as usize];
        if slot.state != RankState::Live {
            return;
        }
        slot.state = RankState::Left;
        let mut i = 0;
        while i < self.barriers.len() {
            let b = &self.barriers[i];
            let entered = b.arrivals.iter().any(|a| a.local == local)
                || self.slots[local as usize].done[b.scope.index()] >= b.seq;
            if entered || b.sent {
                i += 1;
                continue;
            }
            let err = self.left_error_of(local, b.scope, b.seq);
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
            message: format!(
                "rank {rank} (node {}, host {host}) of job '{}' generation {} failed: {why}",
                self.node_rank, self.job_id, self.generation
            ),
            rank,
            node_rank: self.node_rank,
            host,
            missing: vec![],
        };
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
                if consumes_seq(r.error.as_ref()) {
                    self.released = self.released.max(r.seq);
                }
                let Some(bi) = self
                    .barriers
                    .iter()
                    .position(|b| b.sent && b.scope == Scope::Global && b.seq == r.seq)
                else {
                    // A barrier already failed here (a local death, a failure event).
                    return;
                };
                self.deliver(bi, r.error.as_ref(), sink);
                self.recycle(bi);
            }
            Some(pb::relay_event::Kind::Failed(err)) => self.fail_all(err, sink),
            Some(pb::relay_event::Kind::Registered(_)) | None => {}
        }
    }

    /// The last global barrier seq the coordinator released this node from (0 if none): what
    /// the relay tells the next leader when it registers again after a failover.
    pub fn released(&self) -> u64 {
        self.released
    }

    /// After a failover: sends the coordinator every global barrier handed to it and not yet
    /// answered, again, exactly as first sent (same seq, groups and timeout). The coordinator
    /// answers each once.
    pub fn resend(&mut self, sink: &mut impl Sink) {
        for b in &self.barriers {
            if let (true, Some(enter)) = (b.sent, &b.enter) {
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
        while !self.barriers.is_empty() {
            self.recycle(self.barriers.len() - 1);
        }
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
            return self.fail_all(err, sink);
        }
        let mut i = 0;
        while i < self.barriers.len() {
            if self.barriers[i].sent {
                i += 1;
                continue;
            }
            while let Some(pos) = self.barriers[i]
                .arrivals
                .iter()
                .position(|a| a.deadline.is_some_and(|d| d <= now))
            {
                let arrival = self.barriers[i].arrivals.remove(pos);
                let b = &self.barriers[i];
                let idx = b.scope.index();
                self.slots[arrival.local as usize].waiting[idx] = false;
                let err = self.timeout_error(b, &arrival, now);
                let (scope, seq) = (b.scope, b.seq);
                self.barriers[i].prune_name(arrival.name);
                sink.workers(&[arrival.local], &result(scope.to_wire(), seq, Some(err)));
            }
            if self.barriers[i].arrivals.is_empty() {
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
            .filter(|b| !b.sent)
            .filter_map(|b| {
                let first = b.arrivals.iter().map(|a| a.entered).min()?;
                let waited = now.saturating_duration_since(first);
                (waited >= older_than).then(|| pb::BarrierInfo {
                    scope: b.scope.to_wire(),
                    node_rank: self.node_rank,
                    seq: b.seq,
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
                                .map(|a| self.offset + a.local)
                                .collect(),
                        })
                        .collect(),
                    missing: self.missing(b, None),
                    waiting_ms: u64::try_from(waited.as_millis()).unwrap_or(u64::MAX),
                    // The coordinator fills it in from its view of the ranks.
                    missing_detail: vec![],
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
            .filter(|b| !b.sent)
            .flat_map(|b| b.arrivals.iter().filter_map(|a| a.deadline));
        self.armed = waits.chain(self.dying.as_ref().map(|(d, _)| *d)).min();
        self.armed
    }

    fn barrier_index(&mut self, scope: Scope, seq: u64) -> usize {
        if let Some(i) = self
            .barriers
            .iter()
            .position(|b| b.scope == scope && b.seq == seq && !b.sent)
        {
            return i;
        }
        let mut b = self.spare.pop().unwrap_or_else(Barrier::empty);
        b.scope = scope;
        b.seq = seq;
        self.barriers.push(b);
        self.barriers.len() - 1
    }

    /// Removes barrier `i` (the last one moves into its place) and keeps it for reuse.
    fn recycle(&mut self, i: usize) {
        let mut b = self.barriers.swap_remove(i);
        if self.spare.len() < SPARE_BARRIERS {
            b.names.clear();
            b.arrivals.clear();
            b.diverged = None;
            b.sent = false;
            b.enter = None;
            b.span = tracing::Span::none();
            self.spare.push(b);
        }
    }

    /// After an arrival at barrier `bi`: reports a divergence, completes a node barrier, or
    /// hands a complete global barrier to the coordinator.
    fn settle(&mut self, bi: usize, now: Instant, sink: &mut impl Sink) {
        let everyone = self.slots.len();
        let b = &self.barriers[bi];
        match b.scope {
            Scope::Global if !self.whole_world() => {
                if b.arrivals.len() >= everyone {
                    self.send_group(bi, now, sink);
                }
            }
            Scope::Node | Scope::Global => {
                if b.names.len() > 1 || b.diverged.is_some() {
                    if b.diverged.is_none() {
                        let message = self.divergence_message(b);
                        self.barriers[bi].diverged = Some(simple_error(ErrKind::Diverged, message));
                    }
                    let err = self.barriers[bi].diverged.clone();
                    self.deliver(bi, err.as_ref(), sink);
                    if self.barriers[bi].arrivals.len() >= everyone {
                        self.recycle(bi);
                    }
                } else if b.arrivals.len() >= everyone {
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
        let offset = self.offset;
        let (job_id, node_rank) = (&self.job_id, self.node_rank);
        let b = &mut self.barriers[bi];
        b.sent = true;
        let worker_context = b
            .arrivals
            .iter_mut()
            .find(|a| !a.trace_context.is_empty())
            .map(|a| std::mem::take(&mut a.trace_context))
            .unwrap_or_default();
        // Disabled (no work: no fields, no parent) unless the agent exports traces.
        b.span = tracing::debug_span!(
            "muster.relay.barrier",
            otel.kind = "client",
            job = %job_id,
            node_rank,
            seq = b.seq,
            ranks = b.arrivals.len(),
        );
        telemetry::set_parent(&b.span, &worker_context);
        let trace_context = telemetry::carrier(&b.span).unwrap_or(worker_context);
        let timeout_ms = b
            .arrivals
            .iter()
            .filter_map(|a| a.deadline)
            .min()
            .map_or(0, |d| ceil_ms(d.saturating_duration_since(now)).max(1));
        let arrivals = &b.arrivals;
        let groups = std::mem::take(&mut b.names)
            .into_iter()
            .enumerate()
            .map(|(i, name)| {
                let mut ranks: Vec<u32> = arrivals
                    .iter()
                    .filter(|a| a.name == i)
                    .map(|a| offset + a.local)
                    .collect();
                ranks.sort_unstable();
                pb::BarrierName { name, ranks }
            })
            .collect();
        let enter = pb::GroupEnter {
            seq: b.seq,
            groups,
            timeout_ms,
            trace_context,
        };
        b.enter = Some(enter.clone());
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
            ..
        } = self;
        let b = &mut barriers[bi];
        let idx = b.scope.index();
        let consumes = consumes_seq(error);
        if error.is_none()
            && let Some(first) = b.arrivals.iter().map(|a| a.entered).min()
        {
            crate::metrics::relay_barrier(b.scope == Scope::Global, first.elapsed());
        }
        to.clear();
        for a in &mut b.arrivals {
            let slot = &mut slots[a.local as usize];
            if slot.waiting[idx] && slot.seq[idx] == b.seq {
                slot.waiting[idx] = false;
                if consumes {
                    slot.done[idx] = b.seq;
                }
                a.deadline = None;
                to.push(a.local);
            }
        }
        if !to.is_empty() {
            sink.workers(to, &result(b.scope.to_wire(), b.seq, error.cloned()));
        }
    }

    /// Fails every pending wait, now and later, with the generation's first failure.
    fn fail_all(&mut self, err: pb::BarrierError, sink: &mut impl Sink) {
        self.dying = None;
        let err = self.failed.get_or_insert(err).clone();
        for i in 0..self.barriers.len() {
            self.deliver(i, Some(&err), sink);
        }
        while !self.barriers.is_empty() {
            self.recycle(self.barriers.len() - 1);
        }
    }

    fn location(&self, local: u32) -> pb::RankLocation {
        pb::RankLocation {
            rank: self.offset + local,
            node_rank: self.node_rank,
            host: self.slots[local as usize].host.clone(),
        }
    }

    /// The local ranks that have not arrived at `b` (other than `except`).
    fn missing(&self, b: &Barrier, except: Option<u32>) -> Vec<pb::RankLocation> {
        (0..self.slots.len() as u32)
            .filter(|l| Some(*l) != except && !b.arrivals.iter().any(|a| a.local == *l))
            .map(|l| self.location(l))
            .collect()
    }

    /// The RANK_LEFT error for a barrier that a departed local rank had not entered.
    fn left_error(&self, scope: Scope, seq: u64) -> Option<pb::BarrierError> {
        let local = self
            .slots
            .iter()
            .position(|s| s.state == RankState::Left && s.done[scope.index()] < seq)?;
        Some(self.left_error_of(local as u32, scope, seq))
    }

    fn left_error_of(&self, local: u32, scope: Scope, seq: u64) -> pb::BarrierError {
        let loc = self.location(local);
        pb::BarrierError {
            kind: ErrKind::RankLeft as i32,
            message: format!(
                "rank {} (node {}, host {}) has left job '{}' generation {} before reaching {} #{seq}; the barrier can never complete",
                loc.rank,
                loc.node_rank,
                loc.host,
                self.job_id,
                self.generation,
                scope_name(scope, self.node_rank),
            ),
            rank: loc.rank,
            node_rank: loc.node_rank,
            host: loc.host,
            missing: vec![],
        }
    }

    fn divergence_message(&self, b: &Barrier) -> String {
        let mut s = format!(
            "barrier divergence at {} #{}: ranks met under different names:",
            scope_name(b.scope, self.node_rank),
            b.seq
        );
        for (i, name) in b.names.iter().enumerate() {
            let ranks: Vec<String> = b
                .arrivals
                .iter()
                .filter(|a| a.name == i)
                .map(|a| (self.offset + a.local).to_string())
                .collect();
            let _ = write!(s, " [{name}: ranks {}]", ranks.join(","));
        }
        let missing = self.missing(b, None);
        if !missing.is_empty() {
            let _ = write!(s, "; not yet arrived: {}", list_ranks(&missing));
        }
        s
    }

    fn timeout_error(&self, b: &Barrier, a: &Arrival, now: Instant) -> pb::BarrierError {
        let missing = self.missing(b, Some(a.local));
        let rank = self.offset + a.local;
        let name = b.names.get(a.name).map_or("", String::as_str);
        let after = now.saturating_duration_since(a.entered).as_secs_f64();
        let message = match b.scope {
            Scope::Global if !self.whole_world() => format!(
                "global barrier #{} ({name}) timed out after {after:.3}s on rank {rank} of job '{}' generation {} while ranks of its own node (node {}) had not arrived; remote nodes were not consulted yet; missing ranks: {}",
                b.seq,
                self.job_id,
                self.generation,
                self.node_rank,
                list_ranks(&missing)
            ),
            Scope::Node | Scope::Global => format!(
                "{} #{} ({name}) timed out after {after:.3}s on rank {rank} of job '{}' generation {}; missing ranks: {}",
                scope_name(b.scope, self.node_rank),
                b.seq,
                self.job_id,
                self.generation,
                list_ranks(&missing)
            ),
        };
        pb::BarrierError {
            kind: ErrKind::Timeout as i32,
            message,
            missing,
            ..Default::default()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The node under test: node 1 of job 'j' generation 2, ranks 4, 5 and 6 on host-b.
    const OFFSET: u32 = 4;

    fn node() -> NodeAssignment {
        NodeAssignment {
            coordinator: "127.0.0.1:1".into(),
            failover_timeout: crate::failover::DEFAULT_BUDGET,
            job_id: "j".into(),
            generation: 2,
            node_rank: 1,
            num_nodes: 2,
            rank_offset: OFFSET,
            local_world_size: 3,
            world_size: 7,
            restart_count: 0,
            max_restarts: 0,
            host: "host-b".into(),
            master_addr: "host-a".into(),
            master_port: 1,
            agent_socket: None,
            error_dir: None,
        }
    }

    /// A single-node job: ranks 0, 1 and 2 are the whole generation.
    fn single_node() -> NodeAssignment {
        NodeAssignment {
            node_rank: 0,
            num_nodes: 1,
            rank_offset: 0,
            world_size: 3,
            host: "host-a".into(),
            ..node()
        }
    }

    /// Records what the hub sends, one line per call, naming ranks by global rank.
    struct Recorder {
        lines: Vec<String>,
        offset: u32,
    }

    fn describe(error: Option<&pb::BarrierError>) -> String {
        let Some(e) = error else {
            return "ok".into();
        };
        let kind = ErrKind::try_from(e.kind).map_or_else(
            |_| e.kind.to_string(),
            |k| k.as_str_name().trim_start_matches("KIND_").to_owned(),
        );
        let missing = if e.missing.is_empty() {
            String::new()
        } else {
            let ranks: Vec<String> = e.missing.iter().map(|m| m.rank.to_string()).collect();
            format!(" [missing {}]", ranks.join(","))
        };
        format!("{kind}{missing}: {}", e.message)
    }

    impl Sink for Recorder {
        fn workers(&mut self, to: &[u32], msg: &pb::CoordinatorMessage) {
            let mut ranks: Vec<u32> = to.iter().map(|l| l + self.offset).collect();
            ranks.sort_unstable();
            let ranks: Vec<String> = ranks.iter().map(u32::to_string).collect();
            let what = match &msg.kind {
                Some(pb::coordinator_message::Kind::Barrier(r)) => {
                    let scope = match Scope::from_wire(r.scope) {
                        Ok(Scope::Global) => "global",
                        Ok(Scope::Node) => "node",
                        Err(_) => "scope?",
                    };
                    format!("{scope} #{} {}", r.seq, describe(r.error.as_ref()))
                }
                other => format!("{other:?}"),
            };
            self.lines.push(format!("{} <- {what}", ranks.join(",")));
        }

        fn coordinator(&mut self, msg: pb::RelayMessage) {
            let Some(pb::relay_message::Kind::Enter(e)) = msg.kind else {
                return self.lines.push(format!("=> {msg:?}"));
            };
            let groups: Vec<String> = e
                .groups
                .iter()
                .map(|g| {
                    let ranks: Vec<String> = g.ranks.iter().map(u32::to_string).collect();
                    format!("[{}: {}]", g.name, ranks.join(","))
                })
                .collect();
            let trace = e
                .trace_context
                .get("traceparent")
                .map_or_else(String::new, |t| format!(" trace {t}"));
            self.lines.push(format!(
                "=> enter #{} {} timeout {}{trace}",
                e.seq,
                groups.join(" "),
                e.timeout_ms
            ));
        }

        fn close(&mut self, local: u32, why: &str) {
            self.lines
                .push(format!("{} closed: {why}", local + self.offset));
        }

        fn wake_timer(&mut self) {}
    }

    fn error(kind: ErrKind, message: &str) -> pb::BarrierError {
        simple_error(kind, message.to_owned())
    }

    /// Runs `script` (one command per line) against a fresh hub whose ranks 4, 5 and 6 have
    /// registered, and compares everything sent with `expected` (one line per send, in order;
    /// leading blanks ignored). Commands:
    /// - `enter R node|global SEQ NAME [TIMEOUT_MS] [trace=T]` (T: the entry's `traceparent`;
    ///   a group entry shows the one it carries as `trace T`), `leave R`, `lost R` (its
    ///   connection closed without `leave`)
    /// - `+MS`: the clock moves on and expired waits are answered
    /// - `result SEQ ok|timeout|failed`: the coordinator's answer to global barrier SEQ
    /// - `failed`, `dead`: the coordinator's failure event (superseded; rank 6 exited);
    ///   `closed`: the coordinator stream broke for good
    /// - `failover`: the relay registers again after a failover (recorded with the `released`
    ///   seq it sends) and re-sends the barriers in flight
    /// - `reg R [job=J] [gen=G]`: a further registration (refusals are recorded)
    fn check(script: &str, expected: &str) {
        check_on(&node(), script, expected);
    }

    /// [`check`] on another node.
    fn check_on(node: &NodeAssignment, script: &str, expected: &str) {
        let offset = node.rank_offset;
        let mut hub = Hub::new(node);
        let mut rec = Recorder {
            lines: Vec::new(),
            offset,
        };
        let register = |hub: &mut Hub, rank: u32, job: &str, generation: u64| {
            hub.register(&pb::Register {
                job_id: job.into(),
                generation,
                rank,
                pid: 100 + rank,
                host: String::new(),
                ..Default::default()
            })
        };
        for rank in offset..offset + node.local_world_size {
            assert_eq!(register(&mut hub, rank, "j", 2), Ok(rank - offset));
        }
        let mut now = Instant::now();
        for line in script.lines().map(str::trim).filter(|l| !l.is_empty()) {
            let words: Vec<&str> = line.split_whitespace().collect();
            let num = |i: usize| -> u64 { words[i].parse().unwrap_or_else(|_| panic!("{line}")) };
            let local = |i: usize| num(i) as u32 - offset;
            match words[0] {
                "enter" => {
                    let scope = match words[2] {
                        "node" => pb::BarrierScope::Node,
                        "global" => pb::BarrierScope::Global,
                        _ => pb::BarrierScope::Unspecified,
                    };
                    let mut entry = pb::BarrierEnter {
                        scope: scope as i32,
                        seq: num(3),
                        name: words[4].into(),
                        ..Default::default()
                    };
                    for (i, word) in words.iter().enumerate().skip(5) {
                        match word.strip_prefix("trace=") {
                            Some(t) => {
                                entry.trace_context.insert("traceparent".into(), t.into());
                            }
                            None => entry.timeout_ms = num(i),
                        }
                    }
                    hub.enter(local(1), entry, now, &mut rec);
                }
                "leave" => hub.leave(local(1), &mut rec),
                "lost" => hub.lost(local(1), "gone", now, &mut rec),
                "result" => {
                    let err = match words[2] {
                        "ok" => None,
                        "timeout" => Some(error(ErrKind::Timeout, "remote node 0 late")),
                        "failed" => Some(error(ErrKind::RankFailed, "rank 0 failed")),
                        other => panic!("result {other}"),
                    };
                    let event = pb::RelayEvent {
                        kind: Some(pb::relay_event::Kind::Barrier(pb::BarrierResult {
                            scope: Scope::Global.to_wire(),
                            seq: num(1),
                            error: err,
                        })),
                    };
                    hub.on_event(event, &mut rec);
                }
                "failed" | "dead" => {
                    let err = match words[0] {
                        "failed" => error(ErrKind::StaleGeneration, "superseded"),
                        _ => error(ErrKind::RankFailed, "rank 6 exited with status 3"),
                    };
                    let event = pb::RelayEvent {
                        kind: Some(pb::relay_event::Kind::Failed(err)),
                    };
                    hub.on_event(event, &mut rec);
                }
                "closed" => hub.coordinator_lost("no coordinator".into(), &mut rec),
                "failover" => {
                    rec.lines
                        .push(format!("re-register released={}", hub.released()));
                    hub.resend(&mut rec);
                }
                "reg" => {
                    let mut job = "j";
                    let mut generation = 2;
                    for w in &words[2..] {
                        match w.split_once('=') {
                            Some(("job", j)) => job = j,
                            Some(("gen", g)) => generation = g.parse().unwrap_or(0),
                            _ => panic!("{line}"),
                        }
                    }
                    if let Err(why) = register(&mut hub, num(1) as u32, job, generation) {
                        rec.lines.push(format!("refused: {why}"));
                    }
                }
                t if t.starts_with('+') => {
                    now += Duration::from_millis(t[1..].parse().unwrap_or(0));
                    hub.expire(now, &mut rec);
                }
                other => panic!("unknown command {other}"),
            }
        }
        let expected: Vec<&str> = expected
            .lines()
            .map(str::trim)
            .filter(|l| !l.is_empty())
            .collect();
        assert_eq!(rec.lines, expected, "script:\n{script}");
    }

    #[test]
    fn node_barriers_complete_when_every_local_rank_arrives() {
        check(
            "enter 4 node 1 a
             enter 5 node 1 a
             enter 6 node 1 a
             enter 6 node 2 b
             enter 4 node 2 b
             enter 5 node 2 b",
            "4,5,6 <- node #1 ok
             4,5,6 <- node #2 ok",
        );
    }

    #[test]
    fn scopes_are_numbered_apart_and_misnumbered_entries_are_rejected() {
        check(
            "enter 4 node 2 a
             enter 4 node 1 a
             enter 4 node 1 a
             enter 4 global 1 g
             enter 4 scope 1 g",
            "4 <- node #2 UNSPECIFIED: rank 4 sent node 1 barrier #2, but its last was #0: barrier calls must be numbered 1, 2, 3... per scope, one at a time
             4 <- node #1 UNSPECIFIED: rank 4 sent node 1 barrier #1, but its last was #1 and is still waiting: barrier calls must be numbered 1, 2, 3... per scope, one at a time
             4 <- scope? #1 UNSPECIFIED: barrier scope 0 is not valid; use GLOBAL (1) or NODE (2)",
        );
    }

    #[test]
    fn different_names_diverge_for_everyone_at_that_seq() {
        check(
            "enter 4 node 1 a.rs:1
             enter 5 node 1 b.rs:2
             enter 6 node 1 a.rs:1
             enter 4 node 2 c
             enter 5 node 2 c
             enter 6 node 2 c",
            "4,5 <- node #1 DIVERGED: barrier divergence at node 1 barrier #1: ranks met under different names: [a.rs:1: ranks 4] [b.rs:2: ranks 5]; not yet arrived: 6 (node 1, host host-b)
             6 <- node #1 DIVERGED: barrier divergence at node 1 barrier #1: ranks met under different names: [a.rs:1: ranks 4] [b.rs:2: ranks 5]; not yet arrived: 6 (node 1, host host-b)
             4,5,6 <- node #2 ok",
        );
    }

    #[test]
    fn a_local_timeout_withdraws_only_that_rank_which_may_retry() {
        check(
            "enter 4 node 1 a 100
             +50
             enter 5 node 1 a
             +60
             enter 4 node 1 a
             enter 6 node 1 a",
            "4 <- node #1 TIMEOUT [missing 6]: node 1 barrier #1 (a) timed out after 0.110s on rank 4 of job 'j' generation 2; missing ranks: 6 (node 1, host host-b)
             4,5,6 <- node #1 ok",
        );
        // A retry under another name is not a divergence with the withdrawn entry.
        check(
            "enter 4 node 1 a 100
             +100
             enter 4 node 1 b
             enter 5 node 1 b
             enter 6 node 1 b",
            "4 <- node #1 TIMEOUT [missing 5,6]: node 1 barrier #1 (a) timed out after 0.100s on rank 4 of job 'j' generation 2; missing ranks: 5 (node 1, host host-b), 6 (node 1, host host-b)
             4,5,6 <- node #1 ok",
        );
    }

    #[test]
    fn a_failover_resends_the_barriers_in_flight_and_the_ranks_see_nothing() {
        check(
            "failover
             enter 4 global 1 g
             enter 5 global 1 g
             enter 6 global 1 h 2000
             +100
             failover
             result 1 ok
             failover
             enter 4 global 2 g
             enter 5 global 2 g
             enter 6 global 2 g
             result 2 timeout
             failover
             enter 4 node 1 n
             enter 5 node 1 n
             failover
             enter 6 node 1 n
             +5000",
            "re-register released=0
             => enter #1 [g: 4,5] [h: 6] timeout 2000
             re-register released=0
             => enter #1 [g: 4,5] [h: 6] timeout 2000
             4,5,6 <- global #1 ok
             re-register released=1
             => enter #2 [g: 4,5,6] timeout 0
             4,5,6 <- global #2 TIMEOUT: remote node 0 late
             re-register released=1
             re-register released=1
             4,5,6 <- node #1 ok",
        );
    }

    #[test]
    fn global_barriers_go_to_the_coordinator_once_per_node() {
        check(
            "enter 4 global 1 g
             enter 5 global 1 g
             enter 6 global 1 g
             result 1 ok
             enter 4 global 2 g 1000
             +100
             enter 5 global 2 g
             enter 6 global 2 g 500
             +600
             result 2 timeout
             enter 5 global 2 g
             enter 4 global 2 g
             enter 6 global 2 g
             result 2 ok",
            "=> enter #1 [g: 4,5,6] timeout 0
             4,5,6 <- global #1 ok
             => enter #2 [g: 4,5,6] timeout 500
             4,5,6 <- global #2 TIMEOUT: remote node 0 late
             => enter #2 [g: 4,5,6] timeout 0
             4,5,6 <- global #2 ok",
        );
    }

    /// Without an exporter in the agent, a group entry passes on the trace context of the
    /// node's first arrival that sent one (the same after a failover); untraced, none.
    #[test]
    fn a_group_entry_carries_the_first_arriving_ranks_trace_context() {
        check(
            "enter 5 global 1 g
             enter 6 global 1 g trace=t6
             enter 4 global 1 g trace=t4
             failover
             result 1 ok
             enter 4 global 2 g 100 trace=t4-withdrawn
             +100
             enter 5 global 2 g trace=t5
             enter 4 global 2 g
             enter 6 global 2 g trace=t6
             result 2 ok
             enter 4 global 3 g
             enter 5 global 3 g
             enter 6 global 3 g",
            "=> enter #1 [g: 4,5,6] timeout 0 trace t6
             re-register released=0
             => enter #1 [g: 4,5,6] timeout 0 trace t6
             4,5,6 <- global #1 ok
             4 <- global #2 TIMEOUT [missing 5,6]: global barrier #2 (g) timed out after 0.100s on rank 4 of job 'j' generation 2 while ranks of its own node (node 1) had not arrived; remote nodes were not consulted yet; missing ranks: 5 (node 1, host host-b), 6 (node 1, host host-b)
             => enter #2 [g: 4,5,6] timeout 0 trace t5
             4,5,6 <- global #2 ok
             => enter #3 [g: 4,5,6] timeout 0",
        );
    }

    #[test]
    fn a_single_node_job_completes_global_barriers_here() {
        check_on(
            &single_node(),
            "enter 0 global 1 g
             enter 1 global 1 g
             enter 2 global 1 g
             enter 1 global 2 a 100
             +100
             enter 0 global 2 a
             enter 1 global 2 a
             enter 2 global 2 a
             enter 0 global 3 x
             enter 1 global 3 y",
            "0,1,2 <- global #1 ok
             1 <- global #2 TIMEOUT [missing 0,2]: global barrier #2 (a) timed out after 0.100s on rank 1 of job 'j' generation 2; missing ranks: 0 (node 0, host host-a), 2 (node 0, host host-a)
             0,1,2 <- global #2 ok
             0,1 <- global #3 DIVERGED: barrier divergence at global barrier #3: ranks met under different names: [x: ranks 0] [y: ranks 1]; not yet arrived: 2 (node 0, host host-a)",
        );
    }

    #[test]
    fn global_divergence_is_left_to_the_coordinator() {
        check(
            "enter 4 global 1 a
             enter 5 global 1 b
             enter 6 global 1 a
             result 1 failed",
            "=> enter #1 [a: 4,6] [b: 5] timeout 0
             4,5,6 <- global #1 RANK_FAILED: rank 0 failed",
        );
    }

    #[test]
    fn a_global_timeout_before_the_node_is_complete_is_answered_here() {
        check(
            "enter 4 global 1 g 100
             enter 5 global 1 g
             +100
             enter 4 global 1 g
             enter 6 global 1 g",
            "4 <- global #1 TIMEOUT [missing 6]: global barrier #1 (g) timed out after 0.100s on rank 4 of job 'j' generation 2 while ranks of its own node (node 1) had not arrived; remote nodes were not consulted yet; missing ranks: 6 (node 1, host host-b)
             => enter #1 [g: 4,5,6] timeout 0",
        );
    }

    #[test]
    fn a_dead_rank_fails_every_wait_once_the_coordinator_confirms() {
        let exited = "RANK_FAILED: rank 6 exited with status 3";
        check(
            "enter 4 node 1 a
             enter 4 global 1 g
             enter 5 global 1 g
             lost 6
             enter 5 node 1 a
             dead
             result 1 ok
             enter 4 node 2 a",
            &format!(
                "4,5 <- node #1 {exited}
                 4,5 <- global #1 {exited}
                 4 <- node #2 {exited}"
            ),
        );
        // Without a word from the coordinator, the relay fails them itself after a second.
        let gone = "RANK_FAILED: rank 6 (node 1, host host-b) of job 'j' generation 2 failed: gone";
        check(
            "enter 4 node 1 a
             lost 6
             +999
             enter 5 global 1 g
             +1
             enter 4 global 1 g
             dead",
            &format!(
                "4 <- node #1 {gone}
                 5 <- global #1 {gone}
                 4 <- global #1 {gone}"
            ),
        );
        // Waits already at the coordinator fail too.
        check(
            "enter 4 global 1 g
             enter 5 global 1 g
             enter 6 global 1 g
             lost 5
             dead",
            &format!(
                "=> enter #1 [g: 4,5,6] timeout 0
                 4,5,6 <- global #1 {exited}"
            ),
        );
    }

    #[test]
    fn a_rank_that_left_fails_the_barriers_it_never_entered() {
        let left =
            "RANK_LEFT: rank 6 (node 1, host host-b) has left job 'j' generation 2 before reaching";
        check(
            "enter 4 node 1 a
             enter 5 node 1 a
             enter 6 node 1 a
             enter 4 node 2 a
             enter 4 global 1 g
             leave 6
             enter 5 node 2 a
             enter 5 global 1 g",
            &format!(
                "4,5,6 <- node #1 ok
                 4 <- node #2 {left} node 1 barrier #2; the barrier can never complete
                 4 <- global #1 {left} global barrier #1; the barrier can never complete
                 5 <- node #2 {left} node 1 barrier #2; the barrier can never complete
                 5 <- global #1 {left} global barrier #1; the barrier can never complete"
            ),
        );
    }

    #[test]
    fn a_coordinator_failure_event_fails_every_wait_now_and_later() {
        check(
            "enter 4 node 1 a
             enter 5 global 1 g
             failed
             enter 6 node 1 a
             lost 4
             +2000",
            "4 <- node #1 STALE_GENERATION: superseded
             5 <- global #1 STALE_GENERATION: superseded
             6 <- node #1 STALE_GENERATION: superseded",
        );
    }

    #[test]
    fn a_lost_coordinator_stream_closes_every_connection() {
        check(
            "enter 4 node 1 a
             leave 6
             closed
             reg 6",
            "4 <- node #1 RANK_LEFT: rank 6 (node 1, host host-b) has left job 'j' generation 2 before reaching node 1 barrier #1; the barrier can never complete
             4 closed: no coordinator
             5 closed: no coordinator
             refused: no coordinator",
        );
    }

    #[test]
    fn registrations_of_other_jobs_generations_nodes_or_twice_are_refused() {
        check(
            "reg 5 job=k
             reg 5 gen=3
             reg 3
             reg 7
             reg 5",
            "refused: rank 5 registered for job 'k', but this agent runs job 'j'
             refused: rank 5 registered for generation 3, but this agent runs generation 2 of job 'j'
             refused: rank 3 does not run on node 1 of job 'j' (its ranks are 4..7)
             refused: rank 7 does not run on node 1 of job 'j' (its ranks are 4..7)
             refused: rank 5 of job 'j' generation 2 has already connected to this agent (pid 105)",
        );
    }

    #[test]
    fn malformed_entries_are_rejected_without_using_the_seq() {
        let long = "x".repeat(MAX_NAME + 1);
        check(
            &format!(
                "enter 4 node 1 {long}
                 enter 4 node 1 a 99999999999
                 enter 4 node 1 a"
            ),
            &format!(
                "4 <- node #1 UNSPECIFIED: barrier name is {} bytes long; the limit is {MAX_NAME}
                 4 <- node #1 UNSPECIFIED: timeout_ms is 99999999999 ms; the limit is 86400000 ms",
                MAX_NAME + 1
            ),
        );
    }

    /// A hub of [`node`] with its three local ranks registered, and a recorder for it.
    fn registered_hub() -> (Hub, Recorder) {
        let mut hub = Hub::new(&node());
        for rank in OFFSET..OFFSET + 3 {
            let reg = pb::Register {
                job_id: "j".into(),
                generation: 2,
                rank,
                pid: 1,
                host: String::new(),
                ..Default::default()
            };
            assert!(hub.register(&reg).is_ok());
        }
        let rec = Recorder {
            lines: Vec::new(),
            offset: OFFSET,
        };
        (hub, rec)
    }

    #[test]
    fn finished_barriers_are_reused() {
        let (mut hub, mut rec) = registered_hub();
        let now = Instant::now();
        for seq in 1..=50 {
            for local in 0..3 {
                let entry = pb::BarrierEnter {
                    scope: Scope::Node.to_wire(),
                    seq,
                    name: "n".into(),
                    timeout_ms: 0,
                    trace_context: Default::default(),
                };
                hub.enter(local, entry, now, &mut rec);
            }
            assert!(hub.barriers.is_empty());
        }
        assert_eq!(hub.spare.len(), 1);
        assert_eq!(rec.lines.len(), 50);
    }

    #[test]
    fn held_waits_are_reported_once_old_enough_and_sent_ones_are_not() {
        let (mut hub, mut rec) = registered_hub();
        let t0 = Instant::now();
        let enter = |scope: pb::BarrierScope, seq: u64| pb::BarrierEnter {
            scope: scope as i32,
            seq,
            name: "train.rs:9".into(),
            timeout_ms: 0,
            trace_context: Default::default(),
        };
        hub.enter(0, enter(pb::BarrierScope::Node, 1), t0, &mut rec);
        hub.enter(1, enter(pb::BarrierScope::Node, 1), t0, &mut rec);
        // A global barrier the whole node entered goes to the coordinator: not reported.
        for local in 0..3 {
            hub.enter(local, enter(pb::BarrierScope::Global, 1), t0, &mut rec);
        }
        assert!(
            hub.waiting_report(t0, Duration::from_secs(1)).is_empty(),
            "too young"
        );
        let report = hub.waiting_report(t0 + Duration::from_millis(1500), Duration::from_secs(1));
        assert_eq!(report.len(), 1, "{report:?}");
        let b = &report[0];
        assert_eq!(
            (b.scope, b.node_rank, b.seq),
            (pb::BarrierScope::Node as i32, 1, 1)
        );
        assert_eq!(b.names[0].name, "train.rs:9");
        assert_eq!(b.names[0].ranks, [OFFSET, OFFSET + 1]);
        assert_eq!(
            b.missing.iter().map(|m| m.rank).collect::<Vec<_>>(),
            [OFFSET + 2]
        );
        assert_eq!(b.waiting_ms, 1500);
    }
}
