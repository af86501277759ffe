//! Persistence: the job's record (what a new leader rebuilds the job from), the task that
//! writes it in order, join answers held until their record is stored, and restoring a job.

use super::*;
use muster_core::requests::Recovery;
use prost::Message as _;

/// The job's record writer: the version of the job's state to write (counted up by every
/// [`Job::persist`]) and the version last written. The writer builds the record itself, from
/// the state as it is when it gets to it: a version only says "the state changed", and writes
/// are ordered and only the latest matters, so changes made while a write is in flight are
/// written once, together. (Building the record at every change made a 16,384-rank job on etcd
/// rebuild it at each rank's registration, under the job's lock, until the coordinator's own
/// lease keep-alive starved and it lost its leadership.)
pub(super) struct Persist {
    pub(super) pending: watch::Sender<u64>,
    pub(super) written: watch::Sender<u64>,
}

/// The store key of a job's record.
pub fn record_key(job: &JobId) -> String {
    format!("records/{job}")
}

/// The store prefix of every job record.
pub const RECORDS_PREFIX: &str = "records/";

/// One bit per rank (bit r of byte r / 8), set where `set` holds: the record's rank sets.
pub(super) fn rank_bits(ranks: &[RankSlot], set: impl Fn(&RankSlot) -> bool) -> Vec<u8> {
    let mut bits = vec![0u8; ranks.len().div_ceil(8)];
    for (r, slot) in ranks.iter().enumerate() {
        if set(slot) {
            bits[r / 8] |= 1 << (r % 8);
        }
    }
    bits
}

/// The body of a job's "job-record" task (see [`Job::with_state`]): `job` is the job it
/// writes, held weakly so that the task ends with the job.
pub(super) async fn write_records(
    key: String,
    store: Arc<dyn Store>,
    job: std::sync::Weak<Job>,
    mut pending: watch::Receiver<u64>,
    written: watch::Sender<u64>,
    retired: CancellationToken,
) {
    loop {
        tokio::select! {
            changed = pending.changed() => {
                if changed.is_err() {
                    return;
                }
            }
            () = retired.cancelled() => return,
        }
        let Some(job) = job.upgrade() else { return };
        // Under the job's lock, which every `persist` holds: the version read is the state's.
        let (version, bytes) = {
            let st = job.lock();
            let version = *pending.borrow_and_update();
            (version, job.record(&st).encode_to_vec())
        };
        drop(job);
        let mut backoff = Duration::from_millis(50);
        loop {
            match store.put(&key, bytes.clone()).await {
                Ok(()) => {
                    written.send_replace(version);
                    break;
                }
                Err(e) => {
                    if retired.is_cancelled() {
                        return;
                    }
                    tracing::warn!(key, "job record not written, retrying: {e}");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_secs(1));
                    if pending.has_changed().unwrap_or(true) {
                        // A newer record replaces this one.
                        break;
                    }
                }
            }
        }
    }
}

impl Gen {
    /// A running generation from its record: every rank pending (re-attaching).
    /// REPLACING ranks (in-place recovery) stay REPLACING, with their replacement order
    /// rebuilt (sent again when their node's agent re-attaches): `restarts` and `config` are
    /// the job's, for its counts.
    pub(super) fn restore(
        r: &pb::GenerationRecord,
        ended: Option<pb::GenerationEnded>,
        restarts: u32,
        config: RoundConfig,
    ) -> Result<Self, String> {
        let mut nodes = Vec::with_capacity(r.nodes.len());
        let mut ranks = vec![];
        let mut left = 0;
        for (node_rank, n) in r.nodes.iter().enumerate() {
            if n.rank_offset as usize != ranks.len() {
                return Err(format!(
                    "stored generation {} has node {node_rank} at rank offset {}, expected {}",
                    r.generation,
                    n.rank_offset,
                    ranks.len()
                ));
            }
            nodes.push(NodeSlot {
                node_id: n.node_id.clone(),
                request_id: n.request_id.clone(),
                host: n.host.clone(),
                local_world_size: n.local_world_size,
                rank_offset: n.rank_offset,
                relay: None,
                report: None,
                watch: None,
                attempt: 0,
                finished: n.finished,
                watched: n.watched,
                last_seen: None,
                min_watch: 0,
                took_over: n.took_over.clone(),
            });
            let bit = |bits: &[u8], rank: usize| {
                bits.get(rank / 8)
                    .is_some_and(|b| b & (1 << (rank % 8)) != 0)
            };
            for _ in 0..n.local_world_size {
                let mut slot = RankSlot::new(node_rank as u32);
                let rank = ranks.len();
                slot.had_session = bit(&r.sessions, rank);
                if n.finished || bit(&r.left, rank) {
                    // It left cleanly under the previous leader: not expected back.
                    slot.state = RankState::Left;
                    left += 1;
                } else if bit(&r.replacing, rank) && ended.is_none() {
                    // Its death is not forgotten, and its node's agent is told again.
                    slot.state = RankState::Replacing;
                    // The order as it was sent; a record without it (none is written so)
                    // gets one for the generation's epoch.
                    let stored = r
                        .replace_orders
                        .iter()
                        .find(|o| o.rank == Some(rank as u32) && o.generation == r.generation);
                    slot.replace = Some(stored.cloned().unwrap_or_else(|| pb::RankReplace {
                        generation: r.generation,
                        rank: Some(rank as u32),
                        epoch: r.epoch,
                        restart_count: restarts,
                        max_restarts: config.max_restarts,
                        message: format!(
                            "rank {rank} of generation {} is being replaced in place (membership epoch {}; order sent again by a new coordinator leader)",
                            r.generation, r.epoch
                        ),
                    }));
                }
                ranks.push(slot);
            }
        }
        let replacing = ranks.iter().any(|s| s.state == RankState::Replacing);
        let failure = r.failure.as_ref().map(|f| Failure {
            rank: f.rank(),
            node_rank: f.node_rank(),
            host: f.host.clone(),
            reason: f.reason.clone(),
            precise: true,
            detail: FailureDetail {
                exit_code: f.exit_code,
                signal: f.signal,
                error_message: f.error_message.clone(),
                error_traceback: f.error_traceback.clone(),
                stderr_tail: f.stderr_tail.clone(),
            },
            node_id: f.node_id.clone(),
            // Only whether it was a hang matters once the generation failed.
            hang: f.hang.then_some(OnHang::Fail),
        });
        let had_sessions = ranks.iter().filter(|s| s.had_session).count() as u32;
        Ok(Self {
            generation: r.generation,
            values_id: r.values_id.clone(),
            recovered: true,
            nodes,
            ranks,
            barriers: barrier::Table::default(),
            failure,
            ended: ended.map(Box::new),
            left,
            had_sessions,
            next_token: 1,
            epoch: r.epoch,
            // A restored death keeps its membership change open (barriers wait for the
            // quorum); otherwise the next quorum takes a fresh epoch.
            quorum_epoch: if replacing {
                r.epoch.saturating_sub(1)
            } else {
                r.epoch
            },
            recoveries: r.recoveries.iter().map(Recovered::restore).collect(),
            quorum: HashMap::new(),
            // A new leader's clock starts at its takeover: the silence before it is unknown.
            progress: Progress::new(),
            straggler: None,
        })
    }
}

impl Job {
    /// Rebuilds a job from its stored record (a new leader or a restarted coordinator):
    /// the same generation, nodes, ranks and restart count; sessions, relays and watches
    /// re-attach with `resume`. `kv_bytes` is the size of its stored key-value data.
    pub fn restore(
        record: &pb::JobRecord,
        kv_bytes: usize,
        ctx: &JobContext,
    ) -> Result<Arc<Self>, String> {
        let id = JobId::parse(&record.job_id).map_err(|e| e.0)?;
        let config = RoundConfig {
            min_nodes: record.min_nodes.max(1),
            max_nodes: record.max_nodes.max(record.min_nodes).max(1),
            last_call: Duration::from_millis(record.last_call_ms),
            join_timeout: Duration::from_millis(record.join_timeout_ms),
            max_restarts: record.max_restarts,
            // An older record (or an unknown value) reads as restart, today's behaviour.
            recovery: Recovery::from_wire("recovery", record.recovery)
                .ok()
                .flatten()
                .unwrap_or_default(),
            // An older record reads as no hang detection.
            hang: Hang::from_wire(Some(record.hang_timeout_ms), record.on_hang)
                .ok()
                .flatten()
                .unwrap_or_default(),
            max_spares: record.max_spares,
        };
        let done = if !record.cancelled.is_empty() {
            Some(Done::Cancelled(record.cancelled.clone()))
        } else if !record.failed.is_empty() {
            Some(Done::Failed(record.failed.clone()))
        } else if !record.finished.is_empty() {
            Some(Done::Finished(record.finished.clone()))
        } else {
            None
        };
        let phase = match &record.running {
            Some(r) if r.generation == record.generation => {
                let mut g = Gen::restore(r, record.ended.clone(), record.restarts, config)?;
                if matches!(done, Some(Done::Finished(_))) {
                    // Final: every rank left, whatever bits an older record lacks.
                    for slot in &mut g.ranks {
                        slot.state = RankState::Left;
                    }
                    for node in &mut g.nodes {
                        node.finished = true;
                    }
                    g.left = g.ranks.len() as u32;
                }
                Phase::Running(Box::new(g))
            }
            _ => Phase::Open(OpenRound {
                seq: 0,
                joiners: Joiners::default(),
                opened: Instant::now(),
                min_reached: None,
            }),
        };
        let state = JobState {
            config,
            generation: record.generation.max(1),
            restarts: record.restarts,
            next_round_seq: 1,
            phase,
            done,
            next_watch: 1,
            drained: record.drained.clone(),
            recent_failures: Default::default(),
            hangs: Default::default(),
            dumps: Default::default(),
            steps: record
                .training
                .as_ref()
                .map(|t| training::Steps::restore(t, Instant::now(), training::unix_now()))
                .unwrap_or_default(),
            restart_timeline: restarts::RestartTimeline::restore(&record.recent_restarts),
            spares: record.spares.iter().map(Spare::restore).collect(),
            replaced: record.replaced.clone(),
        };
        Ok(Self::with_state(id, state, kv_bytes, ctx))
    }

    /// The job's record as it stands.
    pub(super) fn record(&self, st: &JobState) -> pb::JobRecord {
        let c = st.config;
        let (mut failed, mut cancelled, mut finished) =
            (String::new(), String::new(), String::new());
        match &st.done {
            Some(Done::Failed(why)) => failed.clone_from(why),
            Some(Done::Cancelled(why)) => cancelled.clone_from(why),
            Some(Done::Finished(why)) => finished.clone_from(why),
            None => {}
        }
        let (running, ended) = match &st.phase {
            Phase::Running(g) => (
                Some(pb::GenerationRecord {
                    generation: g.generation,
                    values_id: g.values_id.clone(),
                    nodes: g
                        .nodes
                        .iter()
                        .map(|n| pb::NodeRecord {
                            node_id: n.node_id.clone(),
                            host: n.host.clone(),
                            local_world_size: n.local_world_size,
                            rank_offset: n.rank_offset,
                            request_id: n.request_id.clone(),
                            watched: n.watched,
                            finished: n.finished,
                            took_over: n.took_over.clone(),
                        })
                        .collect(),
                    failure: g.failure.as_ref().map(|f| f.to_info(g.generation)),
                    sessions: rank_bits(&g.ranks, |slot| slot.had_session),
                    left: rank_bits(&g.ranks, |slot| slot.state == RankState::Left),
                    epoch: g.epoch,
                    replacing: rank_bits(&g.ranks, |slot| slot.state == RankState::Replacing),
                    replace_orders: g
                        .ranks
                        .iter()
                        .filter(|slot| slot.state == RankState::Replacing)
                        .filter_map(|slot| slot.replace.clone())
                        .collect(),
                    recoveries: g.recoveries.iter().map(Recovered::to_record).collect(),
                }),
                g.ended.as_deref().cloned(),
            ),
            Phase::Open(_) => (None, None),
        };
        pb::JobRecord {
            job_id: self.id.to_string(),
            min_nodes: c.min_nodes,
            max_nodes: c.max_nodes,
            last_call_ms: c.last_call.as_millis() as u64,
            join_timeout_ms: c.join_timeout.as_millis() as u64,
            max_restarts: c.max_restarts,
            generation: st.generation,
            restarts: st.restarts,
            running,
            failed,
            cancelled,
            ended,
            drained: st.drained.clone(),
            finished,
            recovery: c.recovery.to_wire(),
            hang_timeout_ms: c.hang.timeout_ms(),
            on_hang: c.hang.action.to_wire(),
            spares: st.spares.iter().map(Spare::to_record).collect(),
            max_spares: c.max_spares,
            replaced: st.replaced.clone(),
            training: st.steps.to_record(Instant::now(), training::unix_now()),
            recent_restarts: st.restart_timeline.view(),
        }
    }

    /// Queues the job's current record for writing; returns its version (0 without a
    /// durable store). Takes the locked state only as proof that the lock is held: the
    /// writer reads the version and builds the record under the same lock.
    pub(super) fn persist(&self, _locked: &JobState) -> u64 {
        let Some(p) = &self.persist else {
            return 0;
        };
        let mut version = 0;
        p.pending.send_modify(|v| {
            *v += 1;
            version = *v;
        });
        version
    }

    /// Sends each join answer once the record of version `version` is in the store (at once
    /// without a durable store), so that no node learns a place a new leader would not know.
    pub(super) fn answer_when_persisted(
        &self,
        version: u64,
        replies: Vec<(
            oneshot::Sender<Result<pb::JoinResponse, Error>>,
            pb::JoinResponse,
        )>,
    ) {
        if self.persist.is_none() {
            for (tx, answer) in replies {
                let _ = tx.send(Ok(answer));
            }
            return;
        }
        let stored = self.stored_then(version);
        let job = self.id.clone();
        // Task "join-answer", one per closed round with a durable store: ends when the
        // record is written or the job is retired.
        tokio::spawn(async move {
            if stored.await {
                for (tx, answer) in replies {
                    let _ = tx.send(Ok(answer));
                }
            } else {
                for (tx, _) in replies {
                    let _ = tx.send(Err(Error::Unavailable(format!(
                        "the coordinator stopped leading before job '{job}''s new generation was stored; join again"
                    ))));
                }
            }
        });
    }

    /// Waits until the record queued last is in the store (at once without a durable store;
    /// gives up when the job is retired).
    pub(super) async fn persisted(&self) {
        self.stored_then(self.queued_version()).await;
    }

    /// The version the last [`Job::persist`] counted (0 without a durable store).
    pub(super) fn queued_version(&self) -> u64 {
        self.persist.as_ref().map_or(0, |p| *p.pending.borrow())
    }

    /// Resolves once the record of `version` is in the store: `true` (at once without a
    /// durable store), or `false` if the job is retired first. Owns what it waits on, so a
    /// task can hold it: the one wait behind join answers and replacement orders.
    pub(super) fn stored_then(&self, version: u64) -> impl Future<Output = bool> + Send + 'static {
        let waits = self
            .persist
            .as_ref()
            .map(|p| (p.written.subscribe(), self.retired.clone()));
        async move {
            let Some((mut written, retired)) = waits else {
                return true;
            };
            tokio::select! {
                ok = written.wait_for(|w| *w >= version) => ok.is_ok(),
                () = retired.cancelled() => false,
            }
        }
    }

    /// Whether the record of `version` is in the store (always without a durable store).
    pub(super) fn stored(&self, version: u64) -> bool {
        self.persist
            .as_ref()
            .is_none_or(|p| *p.written.borrow() >= version)
    }
}
