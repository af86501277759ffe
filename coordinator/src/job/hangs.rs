//! Stacks across the nodes and hang detection (`docs/hangs.md`).
//!
//! A dump (`Ops.DumpStacks`, and every detected hang) asks each node's agent for its workers'
//! stacks on the node's watch stream (`dump_stacks`), collects the answers (`stacks`) for at
//! most [`DUMP_WAIT`], and groups them with `muster_core::stacks`: each distinct stack once,
//! the ranks elsewhere than the waiting majority first. Nodes that do not answer in time are
//! named; ranks without a stack say why.
//!
//! A generation makes progress when one of its barriers completes at the coordinator, or when
//! an agent reports progress (its sampler saw a rank's stack change, or a rank outside any
//! wait use the CPU). A generation that made none for the job's hang timeout is a hang
//! ([`Job::hang_due`], checked by the coordinator's "hang-watch" task): it is dumped, and
//! recorded only if still no progress came meanwhile ([`Job::record_hang`]): a decision is
//! never taken on a stall that ended while its report was being made. Each stall is reported
//! once; progress re-arms the detection.

use super::*;
use muster_core::stacks;

/// How long a dump waits for the nodes' answers.
pub const DUMP_WAIT: Duration = Duration::from_secs(2);

/// How long a dump with native frames waits: an agent's first native read of a worker parses
/// its libraries' symbols (about a second for a torch worker), one worker after another.
pub const NATIVE_DUMP_WAIT: Duration = Duration::from_secs(15);

/// What a stack dump reads and shows.
#[derive(Debug, Clone, Copy, Default)]
pub struct StackDump {
    /// Keep every frame (no folding).
    pub full: bool,
    /// Merge Python ranks' native frames in (the agents pause each worker for the read).
    pub native: bool,
}

/// How many hangs a job keeps for its view.
pub(super) const RECENT_HANGS: usize = 4;

/// The dumps in flight: where each node's answer goes, by request id.
#[derive(Default)]
pub(super) struct Dumps {
    next: u64,
    waiting: HashMap<u64, mpsc::UnboundedSender<(u32, Vec<pb::RankStack>)>>,
}

/// When a running generation last made progress.
pub(super) struct Progress {
    at: Instant,
    /// The barrier seqs the coordinator had seen complete then (summed over scopes).
    released: u64,
    /// This stall has been taken for a hang (reported, or being dumped).
    reported: bool,
}

impl Progress {
    /// Progress now (a generation that starts, or a leader that takes a job over).
    pub(super) fn new() -> Self {
        Self {
            at: Instant::now(),
            released: 0,
            reported: false,
        }
    }

    fn made(&mut self) {
        self.at = Instant::now();
        self.reported = false;
    }
}

/// The rank the others wait for, as the straggler view named it, and since when.
pub(super) struct Straggler {
    rank: u32,
    line: String,
    since: Instant,
}

/// A stall long enough to be a hang, found by [`Job::hang_due`].
#[derive(Debug, Clone, Copy)]
pub struct HangDue {
    /// The generation that stalled.
    pub generation: u64,
    /// How long it has made no progress.
    pub idle: Duration,
    /// The job's hang timeout.
    pub timeout: Duration,
    /// What the hang does.
    pub action: OnHang,
}

impl Gen {
    /// The straggler view's line: the rank, where it is, and for how long it has stood out.
    pub(super) fn straggler_line(&self) -> String {
        let Some(s) = &self.straggler else {
            return String::new();
        };
        let loc = self.location(s.rank);
        format!(
            "straggler: rank {} (node {}, host {}): {}; for {}",
            s.rank,
            loc.node_rank(),
            loc.host,
            s.line
                .strip_prefix(&format!("rank {} ", s.rank))
                .unwrap_or(&s.line),
            seconds(s.since.elapsed())
        )
    }

    /// Every barrier seq the coordinator has seen complete, summed over scopes and nodes: it
    /// grows with every completion.
    fn released_total(&self) -> u64 {
        let nodes = (0..self.nodes.len() as u32)
            .map(|n| self.released(Scope::Node, n))
            .sum::<u64>();
        self.released(Scope::Global, 0) + nodes
    }

    /// Sends `event` to every node's agent whose watch is attached; returns the node ranks
    /// that have none.
    fn to_watches(&self, event: &pb::node_event::Kind) -> Vec<u32> {
        let mut missing = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            match &n.watch {
                Some((_, w)) => {
                    let _ = w.send(Ok(pb::NodeEvent {
                        kind: Some(event.clone()),
                    }));
                }
                None => missing.push(i as u32),
            }
        }
        missing
    }
}

/// What a dump collects.
struct Dump {
    generation: u64,
    request_id: u64,
    answers: mpsc::UnboundedReceiver<(u32, Vec<pb::RankStack>)>,
    /// The nodes asked, by node rank, with their hosts.
    asked: HashMap<u32, String>,
    /// Nodes not asked (no watch attached), as "node N (host): why".
    unanswered: Vec<String>,
    world_size: u32,
}

impl Job {
    /// An agent's progress notice for `generation` (its sampler saw its workers move).
    pub fn node_progress(&self, generation: u64) {
        let mut st = self.lock();
        if let Ok(g) = self.running(&mut st, generation) {
            g.progress.made();
        }
    }

    /// Whether the running generation has made no progress for the job's hang timeout, in a
    /// stall not yet taken for a hang; if so the stall is taken (so it is dumped once).
    pub fn hang_due(&self) -> Option<HangDue> {
        let mut st = self.lock();
        let timeout = st.config.hang.timeout?;
        let action = st.config.hang.action;
        if st.done.is_some() || self.retired() {
            return None;
        }
        let Phase::Running(g) = &mut st.phase else {
            return None;
        };
        if g.ended.is_some() || g.failure.is_some() {
            return None;
        }
        let released = g.released_total();
        if released != g.progress.released {
            g.progress.released = released;
            g.progress.made();
            return None;
        }
        let idle = g.progress.at.elapsed();
        if g.progress.reported || idle < timeout {
            return None;
        }
        g.progress.reported = true;
        Some(HangDue {
            generation: g.generation,
            idle,
            timeout,
            action,
        })
    }

    /// An agent's summary of its ranks' recent stack samples: kept per rank (ranks outside the
    /// node are dropped), and the straggler view decided again.
    pub fn node_samples(&self, generation: u64, node_rank: u32, samples: Vec<pb::RankSample>) {
        let mut st = self.lock();
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let Some(node) = g.nodes.get(node_rank as usize) else {
            return;
        };
        let mine = node.rank_offset..node.rank_offset + node.local_world_size;
        for s in samples {
            if let Some(r) = s.rank.filter(|r| mine.contains(r)) {
                g.ranks[r as usize].sampled = Some(s);
            }
        }
        let all: Option<Vec<pb::RankSample>> = g.ranks.iter().map(|r| r.sampled.clone()).collect();
        let found = all.as_deref().and_then(stacks::straggler);
        g.straggler = match (found, g.straggler.take()) {
            (Some((rank, line)), Some(was)) if was.rank == rank => Some(Straggler { line, ..was }),
            (Some((rank, line)), _) => Some(Straggler {
                rank,
                line,
                since: Instant::now(),
            }),
            (None, _) => None,
        };
    }

    /// An agent's answer to dump `request_id` of `generation`: the stacks of its node's ranks
    /// (ranks outside the node are dropped).
    pub fn stacks_reply(&self, generation: u64, node_rank: u32, answer: pb::NodeStacks) {
        let st = self.lock();
        let Phase::Running(g) = &st.phase else {
            return;
        };
        if g.generation != generation {
            return;
        }
        let Some(node) = g.nodes.get(node_rank as usize) else {
            return;
        };
        let mine = node.rank_offset..node.rank_offset + node.local_world_size;
        let ranks: Vec<pb::RankStack> = answer
            .ranks
            .into_iter()
            .filter(|r| r.rank.is_some_and(|r| mine.contains(&r)))
            .collect();
        if let Some(tx) = st.dumps.waiting.get(&answer.request_id) {
            let _ = tx.send((node_rank, ranks));
        }
    }

    fn begin_dump(&self, native: bool) -> Result<Dump, Error> {
        let mut st = self.lock();
        let id = self.id.clone();
        let Phase::Running(g) = &st.phase else {
            return Err(Error::FailedPrecondition(format!(
                "job '{id}' has no running generation (its rendezvous round is open)"
            )));
        };
        let generation = g.generation;
        let request_id = st.dumps.next + 1;
        let event = pb::node_event::Kind::DumpStacks(pb::DumpStacksCommand { request_id, native });
        let missing = g.to_watches(&event);
        let mut asked = HashMap::new();
        let mut unanswered = Vec::new();
        for (i, n) in g.nodes.iter().enumerate() {
            let i = i as u32;
            if missing.contains(&i) {
                unanswered.push(format!(
                    "node {i} ({}): its agent has no watch attached",
                    n.host
                ));
            } else {
                asked.insert(i, n.host.clone());
            }
        }
        let world_size = g.ranks.len() as u32;
        let (tx, answers) = mpsc::unbounded_channel();
        st.dumps.next = request_id;
        st.dumps.waiting.insert(request_id, tx);
        Ok(Dump {
            generation,
            request_id,
            answers,
            asked,
            unanswered,
            world_size,
        })
    }

    /// Every rank's stacks, read by the nodes' agents now, grouped. Waits at most
    /// [`DUMP_WAIT`] for the nodes ([`NATIVE_DUMP_WAIT`] with native frames); cancel-safe (a
    /// dropped call's collector is removed by the next dump's end or left to the job's end).
    pub async fn dump_stacks(&self, ask: StackDump) -> Result<pb::DumpStacksResponse, Error> {
        let StackDump { full, native } = ask;
        let mut dump = self.begin_dump(native)?;
        let wait = if native { NATIVE_DUMP_WAIT } else { DUMP_WAIT };
        let deadline = tokio::time::Instant::now() + wait;
        let mut ranks: Vec<pb::RankStack> = Vec::new();
        while !dump.asked.is_empty() {
            match tokio::time::timeout_at(deadline, dump.answers.recv()).await {
                Ok(Some((node, mut answer))) => {
                    if dump.asked.remove(&node).is_some() {
                        ranks.append(&mut answer);
                    }
                }
                Ok(None) | Err(_) => break,
            }
        }
        self.lock().dumps.waiting.remove(&dump.request_id);
        let mut asked: Vec<_> = dump.asked.into_iter().collect();
        asked.sort();
        for (node, host) in asked {
            dump.unanswered.push(format!(
                "node {node} ({host}): no answer within {} s",
                wait.as_secs()
            ));
        }
        // Every rank of the generation appears: one without a stack says why.
        let view = self.describe();
        ranks.sort_by_key(|r| r.rank);
        ranks.dedup_by_key(|r| r.rank);
        for info in &view.ranks {
            let rank = info.rank();
            if ranks.iter().any(|r| r.rank == Some(rank)) {
                continue;
            }
            ranks.push(pb::RankStack {
                rank: Some(rank),
                local_rank: info.local_rank,
                pid: info.pid,
                error: format!("no stack from its agent: {}", info.activity),
                ..Default::default()
            });
        }
        ranks.sort_by_key(|r| r.rank);
        let groups = stacks::group(&ranks, dump.world_size, full);
        let mut report = stacks::report(&groups, &dump.unanswered);
        // torch's Flight Recorder, where the agents read it: who is behind in collectives;
        // Python ranks whose native frames were asked for and could not be read; and Python
        // ranks whose process is stopped, in uninterruptible I/O or a zombie.
        for line in stacks::collectives(&ranks)
            .into_iter()
            .chain(stacks::native_notes(&ranks))
            .chain(stacks::state_notes(&ranks))
        {
            let _ = write!(report, "\n{line}");
        }
        // Ranks that use muster's SDK: where its barriers have them.
        for info in &view.ranks {
            if info.state == pb::RankState::Waiting as i32 {
                let _ = write!(
                    report,
                    "\nmuster: rank {} is {}",
                    info.rank(),
                    info.activity
                );
            }
        }
        Ok(pb::DumpStacksResponse {
            generation: dump.generation,
            groups,
            ranks,
            report,
            unanswered: dump.unanswered,
        })
    }

    /// Records the hang `due` found, with its `dump`, unless the generation moved on or made
    /// progress meanwhile (then returns `None`): every agent prints it, the job keeps it for
    /// its view, and `due.action` follows (a failure of the generation for fail and restart).
    pub fn record_hang(
        &self,
        due: &HangDue,
        dump: &pb::DumpStacksResponse,
    ) -> Option<pb::HangReport> {
        let mut st = self.lock();
        if st.done.is_some() || self.retired() {
            return None;
        }
        let id = self.id.clone();
        let max_restarts = st.config.max_restarts;
        let restarts = st.restarts;
        let Ok(g) = self.running(&mut st, due.generation) else {
            return None;
        };
        if !g.progress.reported || g.ended.is_some() || g.failure.is_some() {
            // Progress came while the stacks were read: no hang.
            return None;
        }
        let idle = g.progress.at.elapsed();
        let follows = match due.action {
            OnHang::Report => "reported; the job goes on".to_owned(),
            OnHang::Fail => "failing the job (--on-hang fail)".to_owned(),
            OnHang::Restart if restarts < max_restarts => format!(
                "restarting the job (--on-hang restart; restart {} of {max_restarts})",
                restarts + 1
            ),
            OnHang::Restart => format!(
                "failing the job (--on-hang restart, no restarts left: {restarts} of {max_restarts} used)"
            ),
        };
        let headline = format!(
            "no progress in generation {} for {} (hang timeout {}): {follows}",
            due.generation,
            seconds(idle),
            seconds(due.timeout)
        );
        let odd: Vec<u32> = dump
            .groups
            .iter()
            .filter(|grp| grp.likely_cause)
            .flat_map(|grp| grp.ranks.iter().copied())
            .collect();
        let hang = pb::HangReport {
            generation: due.generation,
            idle_ms: u64::try_from(idle.as_millis()).unwrap_or(u64::MAX),
            report: format!("{headline}\n{}", dump.report),
            action: due.action.name().to_owned(),
            at_unix_ms: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX)),
            odd_ranks: odd.clone(),
        };
        tracing::warn!(job = %id, generation = due.generation, "{headline}");
        crate::metrics::hang_detected(due.action);
        g.to_watches(&pb::node_event::Kind::Hang(hang.clone()));
        // The first odd rank carries the failure (else rank 0): its group's line is the cause.
        let cause = dump
            .groups
            .iter()
            .find(|grp| grp.likely_cause)
            .or_else(|| dump.groups.first());
        let rank = odd.first().copied().unwrap_or(0);
        let failure = (due.action != OnHang::Report).then(|| {
            let loc = g.location(rank.min(g.ranks.len().saturating_sub(1) as u32));
            Failure {
                rank: loc.rank(),
                node_rank: loc.node_rank(),
                host: loc.host,
                reason: format!(
                    "the job hung: no progress for {} (hang timeout {}); {}",
                    seconds(idle),
                    seconds(due.timeout),
                    cause.map_or("no stacks", |c| c.line.as_str())
                ),
                precise: true,
                detail: FailureDetail::default(),
                node_id: String::new(),
                hang: Some(due.action),
            }
        });
        st.hangs.push_front(hang.clone());
        st.hangs.truncate(RECENT_HANGS);
        if let Some(f) = failure {
            self.fail_generation(&mut st, due.generation, f);
        }
        self.notify();
        Some(hang)
    }
}

/// A duration as an operator reads it: "90 s", "5 min", "2 min 30 s".
pub(super) fn seconds(d: Duration) -> String {
    let s = d.as_secs();
    match (s / 60, s % 60) {
        (0, s) => format!("{s} s"),
        (m, 0) => format!("{m} min"),
        (m, s) => format!("{m} min {s} s"),
    }
}
