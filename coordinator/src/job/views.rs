//! The ops views of a job: `DescribeJob` (nodes, ranks, pending barriers, and what each
//! missing rank does instead) and the job list's one-line summary.

use super::*;

/// How long ago `at` was, in whole milliseconds.
pub(super) fn ms_since(now: Instant, at: Instant) -> u64 {
    u64::try_from(now.saturating_duration_since(at).as_millis()).unwrap_or(u64::MAX)
}

/// A rank's state on the wire (waiting when it waits at one of the coordinator's barriers).
pub(super) fn rank_state(s: &RankSlot) -> pb::RankState {
    match s.state {
        RankState::Pending => pb::RankState::Pending,
        RankState::Running if s.place.waiting.contains(&true) => pb::RankState::Waiting,
        RankState::Running => pb::RankState::Running,
        RankState::Failed => pb::RankState::Failed,
        RankState::Left => pb::RankState::Left,
        RankState::Replacing => pb::RankState::Replacing,
    }
}

/// Whether the rank's agent samples Python stacks of it (a script without muster's SDK reads
/// as running then; a program that is not Python and never connected stays pending).
fn python_sampled(s: &RankSlot) -> bool {
    s.sampled
        .as_ref()
        .is_some_and(|x| !x.busy_at.is_empty() || !x.waiting_at.is_empty())
}

impl Gen {
    /// One line saying what `rank` is doing, for the ops view. `held` is the wait its relay
    /// reported, if any: (scope index, seq, name, milliseconds waited).
    pub(super) fn activity(
        &self,
        rank: u32,
        now: Instant,
        held: Option<&(usize, u64, String, u64)>,
    ) -> String {
        let s = &self.ranks[rank as usize];
        let scope_of = |idx: usize| {
            if idx == Scope::Node.index() {
                scope_name(Scope::Node, s.node_rank)
            } else {
                scope_name(Scope::Global, s.node_rank)
            }
        };
        let heard = ms_since(now, s.last_seen);
        let last = match s.last_scope {
            Some(i) => format!(
                "last barrier: {} #{} '{}'",
                scope_of(i),
                s.place.seq[i],
                s.names[i]
            ),
            None => "no barrier entered yet".to_owned(),
        };
        match s.state {
            RankState::Pending if s.had_session => {
                format!("re-attaching after a coordinator failover ({last})")
            }
            // A script that does not use muster's SDK: its agent's samples say what it does.
            RankState::Pending if python_sampled(s) => {
                let smp = s
                    .sampled
                    .as_ref()
                    .map(|x| (x.waiting_share, x.busy_at.as_str(), x.busy_share));
                let (share, busy, busy_share) = smp.unwrap_or_default();
                let mut line = format!(
                    "running without a muster session (its agent samples it: waiting in {:.0}% of samples",
                    share * 100.0
                );
                // Where it spends its time outside waits, when that is a good share of it
                // (not a start-up's import still in the window).
                if !busy.is_empty() && busy_share >= 0.25 {
                    let _ = write!(line, ", mostly elsewhere at {busy}");
                }
                line.push(')');
                line
            }
            RankState::Pending => format!(
                "no session yet (the worker has not connected; {}s since the generation started or it was last heard)",
                heard / 1000
            ),
            RankState::Failed => match &self.failure {
                Some(f) if f.rank == rank => format!("failed: {} ({last})", f.reason),
                _ => format!("stopped: its node or generation failed ({last})"),
            },
            RankState::Left => format!("left cleanly ({last})"),
            RankState::Replacing => {
                let why = self
                    .recoveries
                    .iter()
                    .find(|r| r.info.rank == Some(rank))
                    .map_or_else(String::new, |r| format!(": {}", r.info.reason));
                format!(
                    "being replaced in place (membership epoch {}; its replacement has not registered){why}",
                    self.epoch
                )
            }
            RankState::Running => {
                for idx in [Scope::Global.index(), Scope::Node.index()] {
                    if s.place.waiting[idx] {
                        let scope = if idx == Scope::Node.index() {
                            Scope::Node
                        } else {
                            Scope::Global
                        };
                        let key = BarrierKey::new(scope, s.node_rank, s.place.seq[idx]);
                        let waited = self
                            .barriers
                            .get(&key)
                            .map_or(0, |b| ms_since(now, b.opened()));
                        return format!(
                            "waiting at {} #{} '{}' for {waited} ms (heard {heard} ms ago)",
                            scope_of(idx),
                            s.place.seq[idx],
                            s.names[idx]
                        );
                    }
                }
                if let Some((idx, seq, name, waited)) = held {
                    return format!(
                        "waiting at its node's relay in {} #{seq} '{name}' for {waited} ms (heard {heard} ms ago)",
                        scope_of(*idx)
                    );
                }
                format!("running outside barriers ({last}; heard {heard} ms ago)")
            }
        }
    }
}

impl Job {
    /// The ops view of this job: its nodes, ranks, pending barriers (the coordinator's and
    /// those its relays reported) and, for every rank a barrier waits for, what that rank is
    /// doing instead.
    pub fn describe(&self) -> pb::DescribeJobResponse {
        let st = self.lock();
        let config = pb::RendezvousConfig {
            min_nodes: st.config.min_nodes,
            max_nodes: st.config.max_nodes,
            last_call_ms: st.config.last_call.as_millis() as u64,
            join_timeout_ms: st.config.join_timeout.as_millis() as u64,
            max_restarts: Some(st.config.max_restarts),
            recovery: st.config.recovery.to_wire(),
            hang_timeout_ms: Some(st.config.hang.timeout_ms()),
            on_hang: st.config.hang.action.to_wire(),
            max_spares: Some(st.config.max_spares),
        };
        let mut resp = pb::DescribeJobResponse {
            summary: Some(self.summary_locked(&st)),
            config: Some(config),
            restart_count: st.restarts,
            drained: st.drained.clone(),
            recent_failures: st.recent_failures.iter().cloned().collect(),
            hangs: st.hangs.iter().cloned().collect(),
            hang_timeout_ms: st.config.hang.timeout_ms(),
            on_hang: st.config.hang.action.to_wire(),
            spares: st.spares.iter().map(Spare::info).collect(),
            max_spares: st.config.max_spares,
            replaced: st.replaced.clone(),
            ..Default::default()
        };
        let now = Instant::now();
        match &st.phase {
            Phase::Open(round) => {
                resp.nodes = round
                    .joiners
                    .iter()
                    .map(|j| pb::NodeInfo {
                        node_id: j.req.node_id.clone(),
                        node_rank: j.req.requested,
                        host: j.req.host.clone(),
                        local_world_size: j.req.local_world_size,
                        rank_offset: 0,
                        state: pb::NodeState::Joining as i32,
                        ..Default::default()
                    })
                    .collect();
            }
            Phase::Running(g) => {
                resp.epoch = g.epoch;
                resp.straggler = g.straggler_line();
                resp.recoveries = g.recoveries_view();
                let cancelled = match &st.done {
                    Some(Done::Cancelled(why)) => Some(cancelled_text(why)),
                    _ => None,
                };
                resp.nodes = g
                    .nodes
                    .iter()
                    .enumerate()
                    .map(|(i, n)| {
                        let ranks = n.rank_offset..n.rank_offset + n.local_world_size;
                        let failed = ranks
                            .clone()
                            .any(|r| g.ranks[r as usize].state == RankState::Failed);
                        let state = if st.drained.contains_key(&n.node_id) {
                            pb::NodeState::Drained
                        } else if n.finished {
                            pb::NodeState::Finished
                        } else if cancelled.is_some() {
                            pb::NodeState::Cancelled
                        } else if failed {
                            pb::NodeState::Failed
                        } else if n.watch.is_some() {
                            pb::NodeState::Running
                        } else {
                            pb::NodeState::Starting
                        };
                        pb::NodeInfo {
                            node_id: n.node_id.clone(),
                            node_rank: Some(i as u32),
                            host: n.host.clone(),
                            local_world_size: n.local_world_size,
                            rank_offset: n.rank_offset,
                            state: state as i32,
                            last_seen_ms_ago: n.last_seen.map(|at| ms_since(now, at)),
                            ..Default::default()
                        }
                    })
                    .collect();
                // Waits held by relays, by rank: (scope index, seq, name, reported age).
                let mut held: HashMap<u32, (usize, u64, String, u64)> = HashMap::new();
                for node in &g.nodes {
                    let Some((at, barriers)) = &node.report else {
                        continue;
                    };
                    let age = ms_since(now, *at);
                    for b in barriers {
                        let idx = if b.scope == pb::BarrierScope::Node as i32 {
                            Scope::Node.index()
                        } else {
                            Scope::Global.index()
                        };
                        for n in &b.names {
                            for r in &n.ranks {
                                held.insert(*r, (idx, b.seq, n.name.clone(), b.waiting_ms + age));
                            }
                        }
                    }
                }
                let restarts = st.restarts;
                resp.ranks = g
                    .ranks
                    .iter()
                    .enumerate()
                    .map(|(r, s)| {
                        let r = r as u32;
                        let node = &g.nodes[s.node_rank as usize];
                        let mut state = rank_state(s);
                        if state == pb::RankState::Running && held.contains_key(&r) {
                            state = pb::RankState::Waiting;
                        }
                        // Sampled by its agent: running, if without a muster session.
                        if state == pb::RankState::Pending && !s.had_session && python_sampled(s) {
                            state = pb::RankState::Running;
                        }
                        let stopped = cancelled.is_some()
                            && matches!(s.state, RankState::Pending | RankState::Running);
                        if stopped {
                            state = pb::RankState::Cancelled;
                        }
                        pb::RankInfo {
                            rank: Some(r),
                            node_rank: Some(s.node_rank),
                            host: g.location(r).host,
                            pid: s.pid,
                            state: state as i32,
                            last_seen_ms_ago: ms_since(now, s.last_seen),
                            global_seq: s.place.seq[0],
                            node_seq: s.place.seq[1],
                            local_rank: Some(r - node.rank_offset),
                            restart_count: restarts,
                            last_barrier: s
                                .last_scope
                                .map_or_else(String::new, |i| s.names[i].clone()),
                            sampled: s.sampled.clone(),
                            activity: match &cancelled {
                                // Its workers were stopped by the cancel, not by a failure.
                                Some(why) if stopped => format!("stopped: the job was {why}"),
                                _ => g.activity(r, now, held.get(&r)),
                            },
                        }
                    })
                    .collect();
                let mut barriers: Vec<_> = g.barriers.iter().collect();
                barriers.sort_by_key(|b| {
                    let k = b.key();
                    (k.scope.index(), k.node_rank, k.seq)
                });
                resp.barriers = barriers
                    .into_iter()
                    .map(|b| {
                        let waited = now.saturating_duration_since(b.opened());
                        b.info(waited, |r| g.location(r))
                    })
                    .collect();
                // Waits held by relays: shown as reported, aged to now.
                for node in &g.nodes {
                    let Some((at, barriers)) = &node.report else {
                        continue;
                    };
                    let age = ms_since(now, *at);
                    for b in barriers {
                        resp.barriers.push(pb::BarrierInfo {
                            waiting_ms: b.waiting_ms + age,
                            ..b.clone()
                        });
                    }
                }
                // What each missing rank does instead.
                for b in &mut resp.barriers {
                    let idx = if b.scope == pb::BarrierScope::Node as i32 {
                        Scope::Node.index()
                    } else {
                        Scope::Global.index()
                    };
                    b.missing_detail = b
                        .missing
                        .iter()
                        .filter_map(|m| {
                            let s = g.ranks.get(m.rank() as usize)?;
                            let info = &resp.ranks[m.rank() as usize];
                            Some(pb::MissingRank {
                                rank: m.rank,
                                node_rank: m.node_rank,
                                host: m.host.clone(),
                                state: info.state,
                                last_seen_ms_ago: info.last_seen_ms_ago,
                                last_seq: s.place.seq[idx],
                                last_barrier: s.names[idx].clone(),
                                activity: info.activity.clone(),
                            })
                        })
                        .collect();
                }
                resp.failure = g.failure.as_ref().map(|f| f.to_info(g.generation));
            }
        }
        resp.training = st.steps.view(now);
        resp.recent_restarts = st.restart_timeline.view();
        resp
    }

    /// One line of the job list.
    pub fn summary(&self) -> pb::JobSummary {
        let st = self.lock();
        self.summary_locked(&st)
    }

    pub(super) fn summary_locked(&self, st: &JobState) -> pb::JobSummary {
        let mut s = pb::JobSummary {
            job_id: self.id.to_string(),
            generation: st.generation,
            restart_count: st.restarts,
            max_restarts: st.config.max_restarts,
            done: st.done.is_some(),
            reason: match &st.done {
                Some(Done::Cancelled(why)) => cancelled_text(why),
                Some(Done::Failed(why) | Done::Finished(why)) => why.clone(),
                None => String::new(),
            },
            ..Default::default()
        };
        match &st.phase {
            Phase::Open(round) => {
                s.state = if matches!(st.done, Some(Done::Cancelled(_))) {
                    pb::RoundState::Cancelled
                } else {
                    pb::RoundState::Open
                } as i32;
                s.nodes_waiting = round.joiners.len() as u32;
            }
            Phase::Running(g) => {
                s.num_nodes = g.nodes.len() as u32;
                s.world_size = g.ranks.len() as u32;
                s.state = if matches!(st.done, Some(Done::Cancelled(_))) {
                    pb::RoundState::Cancelled
                } else if g.failure.is_some() {
                    pb::RoundState::Failed
                } else if matches!(st.done, Some(Done::Finished(_))) {
                    pb::RoundState::Finished
                } else {
                    pb::RoundState::Running
                } as i32;
            }
        }
        s
    }
}
