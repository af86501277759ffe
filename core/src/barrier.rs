//! The barrier table: who arrived at which barrier under which call-site name, when a barrier
//! is complete, who is missing, and the exact texts of its errors. The coordinator and the
//! agent's node relay both keep one, so that a barrier answered by either says the same thing.
//!
//! There is no I/O, no task and no clock here: every time is an `Instant` or a `Duration`
//! argument, and answers are returned for the caller to send.
//!
//! How the two users drive it:
//! - the **coordinator** keeps one [`Table`] per generation, keyed by [`Key`] over the
//!   generation's ranks (`open` with the scope's ranks, `arrive` per rank, or per rank of a
//!   relay's group entry); it answers through session and relay outboxes, arms a timer per
//!   wait and [`Barrier::withdraw`]s its token when it fires, and records each completed seq
//!   with [`Table::release`] so that a rank re-entering it after a failover is let through;
//! - the **node relay** (`agent/src/relay/hub.rs`) keeps one over its local ranks only: a
//!   node barrier completes in it, a global one is handed on to the coordinator once
//!   [`Barrier::complete`] (then the coordinator's answer ends it); a timed-out rank is taken
//!   out with [`Barrier::remove_arrival`] and [`Barrier::prune_names`].
//!
//! Each rank's place in the sequence of both scopes is a [`Place`]; its rule (seq n+1, or n
//! again after an answer that does not use the seq up) is [`Place::check_entry`] for both.

use crate::model::{Scope, list_ranks, scope_name};
use indexmap::IndexMap;
use muster_proto::v1 as pb;
use pb::barrier_error::Kind as ErrKind;
use std::collections::HashMap;
use std::fmt;
use std::fmt::Write as _;
use std::ops::Range;
use std::time::{Duration, Instant};

/// The longest barrier name (call site) a rank may send.
pub const MAX_NAME: usize = 512;

/// The coordinator's rule for call-site names, checked without allocating on the good path.
pub fn check_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > MAX_NAME || name.chars().any(char::is_control) {
        return crate::model::label("barrier name", name, MAX_NAME)
            .map(drop)
            .map_err(|e| e.0);
    }
    Ok(())
}

/// Whether a result uses up its seq: a timeout, a rejected entry (unspecified kind: a
/// malformed or misnumbered entry the coordinator did not record) and a wait withdrawn by an
/// in-place recovery (KIND_MEMBERSHIP_CHANGED: every rank, the replacement included, enters
/// the barrier again after the quorum, whose `released_*` are the last seqs completed) do not
/// (the same seq may be entered again); every other result does. The SDK's sessions and relay
/// client use this function too.
pub fn consumes_seq(error: Option<&pb::BarrierError>) -> bool {
    match error.map(|e| ErrKind::try_from(e.kind)) {
        None => true,
        Some(Ok(ErrKind::Timeout | ErrKind::Unspecified | ErrKind::MembershipChanged) | Err(_)) => {
            false
        }
        Some(Ok(_)) => true,
    }
}

/// Which barrier: its scope, the node of a node barrier, and its seq.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Key {
    /// Global or node.
    pub scope: Scope,
    /// The node of a node barrier; always 0 for a global one, so keys compare by meaning.
    pub node_rank: u32,
    /// The barrier's number in its scope (1, 2, 3...).
    pub seq: u64,
}

impl Key {
    /// The key of barrier `seq` of `scope`; `node_rank` counts for node barriers only.
    pub fn new(scope: Scope, node_rank: u32, seq: u64) -> Self {
        let node_rank = if scope == Scope::Node { node_rank } else { 0 };
        Self {
            scope,
            node_rank,
            seq,
        }
    }

    /// "global barrier #3" or "node 1 barrier #3", as every message names it.
    pub fn describe(&self) -> String {
        format!("{} #{}", scope_name(self.scope, self.node_rank), self.seq)
    }
}

/// A rank's place in the barrier sequences of both scopes (indexed by [`Scope::index`]).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Place {
    /// Last barrier seq entered, per scope.
    pub seq: [u64; 2],
    /// Last barrier seq answered with a result that uses the seq up, per scope.
    pub done: [u64; 2],
    /// Whether the rank waits for an answer, per scope.
    pub waiting: [bool; 2],
}

impl Place {
    /// Whether the rank may enter `seq` of `scope` now: the next seq, or the last one again
    /// when its answer did not use it up (a timeout), and never while it waits.
    pub fn may_enter(&self, scope: Scope, seq: u64) -> bool {
        let i = scope.index();
        let fresh = self.seq[i].checked_add(1) == Some(seq);
        let retry = seq == self.seq[i] && self.done[i] < seq;
        !self.waiting[i] && (fresh || retry)
    }

    /// [`Place::may_enter`], with the refusal `rank` (of node `node_rank`) is sent otherwise.
    pub fn check_entry(
        &self,
        rank: u32,
        scope: Scope,
        node_rank: u32,
        seq: u64,
    ) -> Result<(), String> {
        if self.may_enter(scope, seq) {
            return Ok(());
        }
        let i = scope.index();
        Err(format!(
            "rank {rank} sent {} #{seq}, but its last was #{}{}: barrier calls must be numbered 1, 2, 3... per scope, one at a time",
            scope_name(scope, node_rank),
            self.seq[i],
            if self.waiting[i] {
                " and is still waiting"
            } else {
                ""
            }
        ))
    }

    /// Records that the rank entered `seq` of `scope` and now waits.
    pub fn enter(&mut self, scope: Scope, seq: u64) {
        let i = scope.index();
        self.seq[i] = seq;
        self.waiting[i] = true;
    }

    /// Answers the rank's wait at `seq` of `scope`, if it still waits there: it stops waiting
    /// and, if `consumes` (see [`consumes_seq`]), the seq is used up. Returns whether it was
    /// waiting there (only then is it sent the answer).
    pub fn answer(&mut self, scope: Scope, seq: u64, consumes: bool) -> bool {
        let i = scope.index();
        if !self.waiting[i] || self.seq[i] != seq {
            return false;
        }
        self.waiting[i] = false;
        if consumes {
            self.done[i] = seq;
        }
        true
    }

    /// Takes the rank's place forward to `released` (a seq that completed under a previous
    /// leader), never back.
    pub fn resume(&mut self, scope: Scope, released: u64) {
        let i = scope.index();
        self.seq[i] = self.seq[i].max(released);
        self.done[i] = self.done[i].max(released);
    }
}

/// One rank's entry into a barrier.
#[derive(Debug)]
pub struct Arrival<A> {
    rank: u32,
    name: usize,
    entered: Instant,
    /// What the user keeps per wait (the coordinator: its timeout token and whether a relay
    /// sent it; the relay: its deadline and trace context).
    pub data: A,
}

impl<A> Arrival<A> {
    /// The rank that arrived.
    pub fn rank(&self) -> u32 {
        self.rank
    }

    /// Its name's index in [`Barrier::names`].
    pub fn name(&self) -> usize {
        self.name
    }

    /// When it arrived.
    pub fn entered(&self) -> Instant {
        self.entered
    }
}

/// One pending barrier: its expected ranks, the call-site names it was entered under and the
/// arrivals. `B` is what the user keeps per barrier (the relay: whether the coordinator holds
/// it; the coordinator: nothing).
#[derive(Debug)]
pub struct Barrier<A, B = ()> {
    key: Key,
    ranks: Range<u32>,
    names: Vec<String>,
    arrivals: Vec<Arrival<A>>,
    opened: Instant,
    /// The user's per-barrier state; reset to its default when the barrier is recycled.
    pub extra: B,
}

impl<A, B: Default> Barrier<A, B> {
    fn new(key: Key, ranks: Range<u32>, now: Instant) -> Self {
        Self {
            key,
            ranks,
            names: Vec::new(),
            arrivals: Vec::new(),
            opened: now,
            extra: B::default(),
        }
    }
}

impl<A, B> Barrier<A, B> {
    /// Which barrier this is.
    pub fn key(&self) -> Key {
        self.key
    }

    /// The ranks that must arrive for it to complete.
    pub fn ranks(&self) -> Range<u32> {
        self.ranks.clone()
    }

    /// When it was opened (its first arrival, unless that one was withdrawn since).
    pub fn opened(&self) -> Instant {
        self.opened
    }

    /// The earliest arrival still waiting, if any.
    pub fn first_entered(&self) -> Option<Instant> {
        self.arrivals.iter().map(|a| a.entered).min()
    }

    /// The call-site names ranks entered it under, in order of first use.
    pub fn names(&self) -> &[String] {
        &self.names
    }

    /// The name of `arrival` (empty if it is not one of this barrier's).
    pub fn name_of(&self, arrival: &Arrival<A>) -> &str {
        self.names.get(arrival.name).map_or("", String::as_str)
    }

    /// The arrivals, in order.
    pub fn arrivals(&self) -> &[Arrival<A>] {
        &self.arrivals
    }

    /// The arrivals, for changing their data.
    pub fn arrivals_mut(&mut self) -> &mut [Arrival<A>] {
        &mut self.arrivals
    }

    /// Records that `rank` entered under `name` at `now`.
    pub fn arrive(&mut self, rank: u32, name: String, now: Instant, data: A) {
        let name = self.name_index(name);
        self.arrivals.push(Arrival {
            rank,
            name,
            entered: now,
            data,
        });
    }

    /// Records that every rank of `ranks` entered under `name` at `now` (a relay's group),
    /// each with a copy of `data`.
    pub fn arrive_group(
        &mut self,
        ranks: impl IntoIterator<Item = u32>,
        name: String,
        now: Instant,
        data: A,
    ) where
        A: Clone,
    {
        let name = self.name_index(name);
        self.arrivals.extend(ranks.into_iter().map(|rank| Arrival {
            rank,
            name,
            entered: now,
            data: data.clone(),
        }));
    }

    fn name_index(&mut self, name: String) -> usize {
        match self.names.iter().position(|n| *n == name) {
            Some(i) => i,
            None => {
                self.names.push(name);
                self.names.len() - 1
            }
        }
    }

    /// Whether every expected rank has arrived (whatever names they used).
    pub fn complete(&self) -> bool {
        self.arrivals.len() >= self.ranks.len()
    }

    /// Whether ranks met under different names: a divergence.
    pub fn diverged(&self) -> bool {
        self.names.len() > 1
    }

    /// Whether `rank` has arrived.
    pub fn has_arrived(&self, rank: u32) -> bool {
        self.arrivals.iter().any(|a| a.rank == rank)
    }

    /// Takes out every arrival `which` selects (a timed-out wait), keeping the others' order.
    /// Their names stay (see [`Barrier::prune_names`]).
    pub fn withdraw(&mut self, mut which: impl FnMut(&Arrival<A>) -> bool) -> Vec<Arrival<A>> {
        let (out, kept) = std::mem::take(&mut self.arrivals)
            .into_iter()
            .partition(|a| which(a));
        self.arrivals = kept;
        out
    }

    /// Takes out arrival `pos` (of [`Barrier::arrivals`]).
    pub fn remove_arrival(&mut self, pos: usize) -> Arrival<A> {
        self.arrivals.remove(pos)
    }

    /// Drops the names no remaining arrival uses, so that a retry under another name after a
    /// withdrawal is not taken for a divergence.
    pub fn prune_names(&mut self) {
        let mut i = 0;
        while i < self.names.len() {
            if self.arrivals.iter().any(|a| a.name == i) {
                i += 1;
                continue;
            }
            self.names.remove(i);
            for a in &mut self.arrivals {
                if a.name > i {
                    a.name -= 1;
                }
            }
        }
    }

    /// The expected ranks that have not arrived, other than those `skip` names, located by
    /// `locate`, in rank order.
    pub fn missing_except(
        &self,
        skip: impl Fn(u32) -> bool,
        locate: impl Fn(u32) -> pb::RankLocation,
    ) -> Vec<pb::RankLocation> {
        let mut arrived = vec![false; self.ranks.len()];
        for a in &self.arrivals {
            if let Some(i) = a.rank.checked_sub(self.ranks.start)
                && let Some(seen) = arrived.get_mut(i as usize)
            {
                *seen = true;
            }
        }
        self.ranks
            .clone()
            .zip(arrived)
            .filter(|(r, seen)| !seen && !skip(*r))
            .map(|(r, _)| locate(r))
            .collect()
    }

    /// The expected ranks that have not arrived, located by `locate`, in rank order.
    pub fn missing(&self, locate: impl Fn(u32) -> pb::RankLocation) -> Vec<pb::RankLocation> {
        self.missing_except(|_| false, locate)
    }

    /// Each name with the ranks that arrived under it (in arrival order), for the ops view and
    /// for a relay's group entry.
    pub fn groups(&self) -> Vec<pb::BarrierName> {
        self.names
            .iter()
            .enumerate()
            .map(|(i, name)| pb::BarrierName {
                name: name.clone(),
                ranks: self
                    .arrivals
                    .iter()
                    .filter(|a| a.name == i)
                    .map(|a| a.rank)
                    .collect(),
            })
            .collect()
    }

    /// The ops view of this wait (`missing_detail` is left for the coordinator to fill in).
    pub fn info(
        &self,
        waiting: Duration,
        locate: impl Fn(u32) -> pb::RankLocation,
    ) -> pb::BarrierInfo {
        pb::BarrierInfo {
            scope: self.key.scope.to_wire(),
            node_rank: (self.key.scope == Scope::Node).then_some(self.key.node_rank),
            seq: self.key.seq,
            names: self.groups(),
            missing: self.missing(locate),
            waiting_ms: u64::try_from(waiting.as_millis()).unwrap_or(u64::MAX),
            missing_detail: vec![],
        }
    }

    /// The text of a divergence: each name with its ranks, then who has not arrived yet.
    pub fn divergence_message(&self, locate: impl Fn(u32) -> pb::RankLocation) -> String {
        let mut s = format!(
            "barrier divergence at {}: ranks met under different names:",
            self.key.describe()
        );
        for (i, name) in self.names.iter().enumerate() {
            let ranks: Vec<String> = self
                .arrivals
                .iter()
                .filter(|a| a.name == i)
                .map(|a| a.rank.to_string())
                .collect();
            let _ = write!(s, " [{name}: ranks {}]", ranks.join(","));
        }
        let missing = self.missing(locate);
        if !missing.is_empty() {
            let _ = write!(s, "; not yet arrived: {}", list_ranks(&missing));
        }
        s
    }

    /// The DIVERGED error of [`Barrier::divergence_message`].
    pub fn divergence_error(&self, locate: impl Fn(u32) -> pb::RankLocation) -> pb::BarrierError {
        crate::model::barrier_error(ErrKind::Diverged, self.divergence_message(locate))
    }
}

/// Who gave up waiting, as a timeout message names it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Waiter {
    /// One rank's own wait.
    Rank(u32),
    /// A relay's wait for its node's ranks `first..=last`.
    Node {
        /// The node's first rank in the wait.
        first: u32,
        /// Its last rank in the wait.
        last: u32,
        /// The node.
        node_rank: u32,
    },
}

impl fmt::Display for Waiter {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Rank(r) => write!(f, "rank {r}"),
            Self::Node {
                first,
                last,
                node_rank,
            } => write!(f, "ranks {first}..={last} (node {node_rank})"),
        }
    }
}

/// The TIMEOUT error of a wait at `key` (entered under `name`) that gave up after `after`.
pub fn timeout_error(
    key: Key,
    name: &str,
    after: Duration,
    who: Waiter,
    job: impl fmt::Display,
    generation: u64,
    missing: Vec<pb::RankLocation>,
) -> pb::BarrierError {
    pb::BarrierError {
        kind: ErrKind::Timeout as i32,
        message: format!(
            "{} ({name}) timed out after {:.3}s on {who} of job '{job}' generation {generation}; missing ranks: {}",
            key.describe(),
            after.as_secs_f64(),
            list_ranks(&missing)
        ),
        missing,
        ..Default::default()
    }
}

/// The TIMEOUT error of a relay's wait at global barrier `seq` that gave up before its own
/// node was complete, so that no other node was asked.
#[allow(clippy::too_many_arguments)]
pub fn node_incomplete_timeout_error(
    seq: u64,
    name: &str,
    after: Duration,
    rank: u32,
    job: impl fmt::Display,
    generation: u64,
    node_rank: u32,
    missing: Vec<pb::RankLocation>,
) -> pb::BarrierError {
    pb::BarrierError {
        kind: ErrKind::Timeout as i32,
        message: format!(
            "global barrier #{seq} ({name}) timed out after {:.3}s on rank {rank} of job '{job}' generation {generation} while ranks of its own node (node {node_rank}) had not arrived; remote nodes were not consulted yet; missing ranks: {}",
            after.as_secs_f64(),
            list_ranks(&missing)
        ),
        missing,
        ..Default::default()
    }
}

/// The RANK_LEFT error of barrier `key`, which the rank at `loc` left the job before reaching.
pub fn left_error(
    loc: pb::RankLocation,
    job: impl fmt::Display,
    generation: u64,
    key: Key,
) -> pb::BarrierError {
    pb::BarrierError {
        kind: ErrKind::RankLeft as i32,
        message: format!(
            "rank {} (node {}, host {}) has left job '{job}' generation {generation} before reaching {}; the barrier can never complete",
            loc.rank(),
            loc.node_rank(),
            loc.host,
            key.describe()
        ),
        rank: loc.rank(),
        node_rank: loc.node_rank(),
        host: loc.host,
        missing: vec![],
    }
}

/// How many finished barrier records a table keeps for reuse.
const SPARE_BARRIERS: usize = 8;

/// The pending barriers of one generation (the coordinator) or one node (the relay), in the
/// order they were opened (a removal moves the last one into its place), and the highest seq
/// known complete per scope.
#[derive(Debug)]
pub struct Table<A, B = ()> {
    // Ordered, so that failing every barrier answers them in a fixed order; keyed, so that
    // the coordinator's thousands of node barriers are found without a scan.
    barriers: IndexMap<Key, Barrier<A, B>>,
    spare: Vec<Barrier<A, B>>,
    released: HashMap<(Scope, u32), u64>,
}

impl<A, B> Default for Table<A, B> {
    fn default() -> Self {
        Self {
            barriers: IndexMap::new(),
            spare: Vec::new(),
            released: HashMap::new(),
        }
    }
}

impl<A, B: Default> Table<A, B> {
    /// The barrier at `key`, opened at `now` for `ranks` if it is not pending yet.
    pub fn open(&mut self, key: Key, ranks: Range<u32>, now: Instant) -> &mut Barrier<A, B> {
        let spare = &mut self.spare;
        self.barriers
            .entry(key)
            .or_insert_with(|| match spare.pop() {
                Some(mut b) => {
                    b.key = key;
                    b.ranks = ranks;
                    b.opened = now;
                    b
                }
                None => Barrier::new(key, ranks, now),
            })
    }

    /// Keeps a finished barrier's memory for the next one.
    pub fn recycle(&mut self, mut b: Barrier<A, B>) {
        if self.spare.len() < SPARE_BARRIERS {
            b.names.clear();
            b.arrivals.clear();
            b.extra = B::default();
            self.spare.push(b);
        }
    }
}

impl<A, B> Table<A, B> {
    /// How many barriers are pending.
    pub fn len(&self) -> usize {
        self.barriers.len()
    }

    /// Whether none is pending.
    pub fn is_empty(&self) -> bool {
        self.barriers.is_empty()
    }

    /// How many finished barriers are kept for reuse.
    pub fn spare(&self) -> usize {
        self.spare.len()
    }

    /// The pending barrier at `key`.
    pub fn get(&self, key: &Key) -> Option<&Barrier<A, B>> {
        self.barriers.get(key)
    }

    /// The pending barrier at `key`, to change.
    pub fn get_mut(&mut self, key: &Key) -> Option<&mut Barrier<A, B>> {
        self.barriers.get_mut(key)
    }

    /// The `i`-th pending barrier (`0..len()`).
    pub fn at(&self, i: usize) -> &Barrier<A, B> {
        &self.barriers[i]
    }

    /// The `i`-th pending barrier, to change.
    pub fn at_mut(&mut self, i: usize) -> &mut Barrier<A, B> {
        &mut self.barriers[i]
    }

    /// Where the barrier at `key` is in the order.
    pub fn index_of(&self, key: &Key) -> Option<usize> {
        self.barriers.get_index_of(key)
    }

    /// Takes out the barrier at `key` (the last one takes its place in the order).
    pub fn remove(&mut self, key: &Key) -> Option<Barrier<A, B>> {
        self.barriers.swap_remove(key)
    }

    /// Takes out the `i`-th barrier (the last one takes its place in the order).
    pub fn remove_at(&mut self, i: usize) -> Barrier<A, B> {
        self.barriers
            .swap_remove_index(i)
            .map(|(_, b)| b)
            .expect("index within the table")
    }

    /// Puts back a barrier taken out with [`Table::remove`] (at the end of the order).
    pub fn insert(&mut self, b: Barrier<A, B>) {
        self.barriers.insert(b.key, b);
    }

    /// The pending barriers, in order.
    pub fn iter(&self) -> impl Iterator<Item = &Barrier<A, B>> {
        self.barriers.values()
    }

    /// The pending barriers' keys, in order.
    pub fn keys(&self) -> Vec<Key> {
        self.barriers.keys().copied().collect()
    }

    /// Takes out every pending barrier, in order.
    pub fn drain(&mut self) -> Vec<Barrier<A, B>> {
        self.barriers.drain(..).map(|(_, b)| b).collect()
    }

    /// The highest seq of `scope` (node `node_rank` for node barriers) known complete.
    pub fn released(&self, scope: Scope, node_rank: u32) -> u64 {
        let key = Key::new(scope, node_rank, 0);
        self.released
            .get(&(key.scope, key.node_rank))
            .copied()
            .unwrap_or(0)
    }

    /// Records that barrier `key` completed; returns whether that is news (a higher seq than
    /// known).
    pub fn release(&mut self, key: Key) -> bool {
        let known = self.released.entry((key.scope, key.node_rank)).or_insert(0);
        if key.seq <= *known {
            return false;
        }
        *known = key.seq;
        true
    }

    /// Records that barrier `key` completed and takes out every pending barrier of its scope
    /// at or below it (they completed too, under a previous leader), in order; nothing if
    /// that seq was already known complete.
    pub fn release_through(&mut self, key: Key) -> Vec<Barrier<A, B>> {
        if !self.release(key) {
            return Vec::new();
        }
        let done: Vec<Key> = self
            .barriers
            .keys()
            .filter(|k| k.scope == key.scope && k.node_rank == key.node_rank && k.seq <= key.seq)
            .copied()
            .collect();
        done.iter().filter_map(|k| self.remove(k)).collect()
    }
}

#[cfg(test)]
mod tests;
