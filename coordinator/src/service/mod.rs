//! The gRPC services: each handler converts its request into checked domain values at the edge
//! (`TryFrom` impls in `muster_core::requests`, or `muster_core::model`'s checks), then acts on
//! the job registry. Handlers are thin; the rules live in `job/` (rounds, sessions, barriers)
//! and in [`ValuesService`] (key-value store, unique ids, shared values over the [`Store`]).
//!
//! This file holds the registry every service shares ([`Coordinator`]) and the helpers of
//! their handlers; each gRPC service has a file of its own: `rendezvous.rs`, `session.rs`,
//! `relay.rs`, `values.rs` (`KeyValue`, `UniqueIds`, `SharedValues`), `ops.rs` and
//! `agents.rs`.

mod agents;
mod ops;
mod relay;
mod rendezvous;
mod session;
mod values;

pub use agents::AgentsService;
pub use ops::OpsService;
pub use relay::RelayService;
pub use rendezvous::RendezvousService;
pub use session::SessionService;
pub use values::ValuesService;

use crate::auth;
use crate::config::Config;
use crate::job::{Job, JobContext, Outbox, StackDump};
use crate::pool::{self, Pool};
use crate::store::{Store, StoreError};
use muster_core::model::{self, JobId, Scope};
use muster_core::requests::{
    BarrierEntry, Cancel, Drain, FailureReport, GroupEntry, Hang, Join, NodeAttach, QuorumAsk,
    Recovery, RelayRegister, RoundConfig, SessionRegister,
};

use muster_proto::v1 as pb;
use std::collections::HashMap;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::time::Instant;
use tonic::{Request, Response, Status, Streaming};

impl From<StoreError> for Status {
    fn from(e: StoreError) -> Self {
        Status::unavailable(e.to_string())
    }
}

/// Every job the coordinator knows, plus what all services share.
pub struct Coordinator {
    config: Config,
    store: Arc<dyn Store>,
    jobs: Mutex<HashMap<JobId, Arc<Job>>>,
    /// Daemon agents and submitted jobs.
    pool: Pool,
    next_job: std::sync::atomic::AtomicU64,
    /// What new jobs are made with: the incarnation that names new generations' values (a
    /// job deleted from the store and started again under the same id must never be served
    /// an earlier generation 1's unique id), and the durable store for job records.
    ctx: JobContext,
    /// Whether `jobs` holds the current state: false from a lost term until the next term's
    /// state is loaded, so that a request that got past the gate just before it closed is told
    /// UNAVAILABLE, not that its job does not exist.
    leading: std::sync::atomic::AtomicBool,
    /// Stored bytes over all jobs, bounded by `max_total_bytes` (`limits.rs`).
    stored: crate::limits::StoredBytes,
    /// Ages of jobs in a final state, and tombstones of expired ones (`retention.rs`).
    retention: crate::retention::Retention,
}

impl Coordinator {
    /// A coordinator over `store`.
    pub fn new(config: Config, store: Arc<dyn Store>) -> Arc<Self> {
        let ctx = JobContext {
            // Nanoseconds since the epoch at startup: distinct for every start of a
            // coordinator whose clock does not run backwards.
            incarnation: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64),
            store: store.durable().then(|| Arc::clone(&store)),
            // Over etcd, decisions wait for a term (`ha.rs`, "A leader that did not run").
            tenure: if store.durable() {
                crate::tenure::Tenure::elected()
            } else {
                crate::tenure::Tenure::always()
            },
            heartbeat_timeout: config.heartbeat_timeout,
        };
        // Liveness timeouts discount the time this process did not run from now on.
        crate::tenure::start_stall_clock();
        Arc::new(Self {
            store,
            jobs: Mutex::new(HashMap::new()),
            pool: Pool::default(),
            next_job: std::sync::atomic::AtomicU64::new(1),
            leading: std::sync::atomic::AtomicBool::new(ctx.store.is_none()),
            stored: crate::limits::StoredBytes::new(config.max_total_bytes),
            retention: crate::retention::Retention::new(config.finished_job_ttl),
            ctx,
            config,
        })
    }

    /// The store.
    pub fn store(&self) -> &Arc<dyn Store> {
        &self.store
    }

    /// Whether this coordinator may act as the leader now (set by the leadership loop).
    pub fn tenure(&self) -> &crate::tenure::Tenure {
        &self.ctx.tenure
    }

    /// Drops every job from memory (this coordinator stopped leading): their streams end with
    /// UNAVAILABLE and `why`, so that clients re-attach to the new leader.
    pub fn retire_all(&self, why: &str) {
        self.leading
            .store(false, std::sync::atomic::Ordering::SeqCst);
        let jobs: Vec<Arc<Job>> = self.jobs().drain().map(|(_, j)| j).collect();
        for job in &jobs {
            job.retire(why);
        }
        self.stored.reset(HashMap::new());
        self.retention.reset();
        self.pool.retire(why);
        if !jobs.is_empty() {
            tracing::info!(jobs = jobs.len(), "dropped every job: {why}");
        }
    }

    /// Loads every job from the store (this coordinator now leads): the state the last
    /// leader persisted replaces whatever is in memory. Returns how many jobs it loaded.
    pub async fn recover(&self) -> Result<usize, StoreError> {
        use prost::Message as _;
        let records = self.store.list(crate::job::RECORDS_PREFIX).await?;
        let mut loaded = HashMap::new();
        let mut stored = HashMap::new();
        for (key, bytes) in records {
            let record = match pb::JobRecord::decode(bytes.as_slice()) {
                Ok(r) => r,
                Err(e) => {
                    tracing::error!(key, "skipping an unreadable job record: {e}");
                    continue;
                }
            };
            let Ok(id) = JobId::parse(&record.job_id) else {
                tracing::error!(key, "skipping a job record with an invalid job id");
                continue;
            };
            let kv_bytes = values::stored_kv_bytes(self.store.as_ref(), &id).await?;
            // Published values (unique ids, shared values) count towards max_total_bytes too.
            // (`jobs/<job>/gen/<values id>/<kind>/<name>`: the name as counted when published.)
            let gen_prefix = format!("jobs/{id}/gen/");
            let published: usize = self
                .store
                .list(&gen_prefix)
                .await?
                .iter()
                .map(|(k, v)| {
                    let name = k[gen_prefix.len().min(k.len())..].splitn(3, '/').nth(2);
                    name.map_or(0, str::len) + v.len()
                })
                .sum();
            match Job::restore(&record, kv_bytes, &self.ctx) {
                Ok(job) => {
                    stored.insert(id.clone(), kv_bytes + published);
                    job.arm_recovery_grace(self.config.heartbeat_timeout);
                    loaded.insert(id, job);
                }
                Err(e) => tracing::error!(key, "skipping a job record: {e}"),
            }
        }
        let n = loaded.len();
        let old: Vec<Arc<Job>> = {
            let mut jobs = self.jobs();
            std::mem::replace(&mut *jobs, loaded)
                .into_values()
                .collect()
        };
        for job in old {
            job.retire("the coordinator reloaded its state from the store");
        }
        self.stored.reset(stored);
        self.retention.reset();
        self.leading
            .store(true, std::sync::atomic::Ordering::SeqCst);
        Ok(n)
    }

    /// Creates a job record for a submitted job, so that the ops view shows it before any
    /// node joins; its agents' joins then agree with this configuration.
    fn create_job(&self, spec: &pb::JobSpec) -> Result<(), Status> {
        let id = JobId::parse(&spec.job_id)?;
        let mut jobs = self.jobs();
        if jobs.contains_key(&id) {
            return Err(Status::already_exists(format!(
                "job '{id}' already exists (launched or submitted before)"
            )));
        }
        self.may_create(&id, jobs.len())?;
        let config = RoundConfig {
            min_nodes: spec.min_nodes,
            max_nodes: spec.max_nodes,
            last_call: self.config.last_call,
            join_timeout: self.config.join_timeout,
            max_restarts: spec.max_restarts,
            recovery: Recovery::from_wire("recovery", spec.recovery)?.unwrap_or_default(),
            hang: Hang::from_wire(spec.hang_timeout_ms, spec.on_hang)?.unwrap_or_default(),
            max_spares: spec.max_spares,
        };
        jobs.insert(id.clone(), Job::new(id, config, &self.ctx));
        Ok(())
    }

    /// Whether job `id` may be created now, with `held` jobs in memory: within `max_jobs`,
    /// and not while an expired job of that id is still being removed.
    fn may_create(&self, id: &JobId, held: usize) -> Result<(), Status> {
        if held >= self.config.max_jobs {
            return Err(Status::resource_exhausted(format!(
                "job '{id}' cannot be created: the coordinator holds {held} jobs; the limit is {} (max_jobs: raise it with --max-jobs; finished, failed and cancelled jobs are removed {} ms after they end, --finished-job-ttl-ms)",
                self.config.max_jobs,
                self.config.finished_job_ttl.as_millis()
            )));
        }
        self.retention.creating(id)
    }

    /// Removes the jobs that have been in a final state (finished, failed, cancelled), or
    /// abandoned (an open round no node waits in), for `finished_job_ttl`: from memory and the pool at once (calls naming them then hear
    /// that they expired), then their stored data and record; a store failure is retried at
    /// the next sweep. Run every [`Coordinator::sweep_interval`] by the "expiry" task.
    pub async fn expire_finished(&self) {
        let now = Instant::now();
        let held: Vec<(JobId, Arc<Job>)> = self
            .jobs()
            .iter()
            .map(|(id, job)| (id.clone(), Arc::clone(job)))
            .collect();
        for (id, job) in held {
            let submitted = self.pool.waits_for_agents(id.as_str());
            let outcome = expiry_outcome(&job.summary(), submitted);
            if !self.retention.due(&id, outcome, now) {
                continue;
            }
            let Some(outcome) = outcome else { continue };
            let removed = {
                let mut jobs = self.jobs();
                match jobs.get(&id) {
                    Some(j) if Arc::ptr_eq(j, &job) => {
                        self.retention.expire(&id, outcome);
                        jobs.remove(&id)
                    }
                    _ => None,
                }
            };
            if let Some(job) = removed {
                tracing::info!(job = %id, outcome, ttl_ms = self.config.finished_job_ttl.as_millis() as u64, "job expired: removing it");
                // Nothing of it may run or write any more (its record writer stops too).
                job.retire(&format!(
                    "job '{id}' expired ({outcome} {} ms ago, --finished-job-ttl-ms)",
                    self.config.finished_job_ttl.as_millis()
                ));
                self.pool.forget(id.as_str());
                self.stored.forget(&id);
            }
        }
        for id in self.retention.removing() {
            // Data first, record last: a record left behind by a failure is loaded as a
            // final job by the next leader and expires again.
            let removed = async {
                self.store.delete_prefix(&format!("jobs/{id}/")).await?;
                self.store.delete(&crate::job::record_key(&id)).await?;
                Ok::<(), StoreError>(())
            };
            match removed.await {
                Ok(()) => self.retention.removed(&id),
                Err(e) => {
                    tracing::warn!(job = %id, "expired job's stored data not removed, retrying at the next sweep: {e}");
                }
            }
        }
    }

    /// How often [`Coordinator::expire_finished`] should run.
    pub fn sweep_interval(&self) -> Duration {
        self.retention.sweep_interval()
    }

    /// Stored bytes (key-value data and published values) over all jobs.
    pub fn stored_bytes(&self) -> usize {
        self.stored.total()
    }

    /// The jobs held now (a copy of the list: the lock is not held while they are used).
    pub fn job_list(&self) -> Vec<Arc<Job>> {
        self.jobs().values().cloned().collect()
    }

    fn jobs(&self) -> std::sync::MutexGuard<'_, HashMap<JobId, Arc<Job>>> {
        self.jobs.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn job(&self, id: &str) -> Result<Arc<Job>, Status> {
        let id = JobId::parse(id)?;
        self.jobs().get(&id).cloned().ok_or_else(|| {
            if let Some(expired) = self.retention.expired(&id) {
                expired
            } else if self.leading.load(std::sync::atomic::Ordering::SeqCst) {
                Status::not_found(format!("job '{id}' not found (no node has joined it)"))
            } else {
                Status::unavailable(
                    "this coordinator is not leading (its state is not loaded); ask the leader",
                )
            }
        })
    }

    /// The round configuration of a job whose joins set none, and the waits a join's
    /// configuration leaves unset.
    fn round_defaults(&self) -> RoundConfig {
        RoundConfig {
            min_nodes: 1,
            max_nodes: 1,
            last_call: self.config.last_call,
            join_timeout: self.config.join_timeout,
            max_restarts: 0,
            recovery: Recovery::Restart,
            hang: Hang::default(),
            max_spares: 0,
        }
    }
}

type Rpc<T> = Result<Response<T>, Status>;

/// Waits until `f` yields a value, the job changes its mind (the closure errors), or the
/// deadline passes. `f` is re-run after every change of the job.
async fn wait_for<T, F, Fut>(
    job: &Job,
    deadline: Option<Instant>,
    what: impl Fn() -> String,
    f: F,
) -> Result<T, Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, Status>>,
{
    wait_until(job, None, deadline, what, f).await
}

/// [`wait_for`] the value published under store key `key`: woken by its publish
/// ([`Job::published`]) rather than by every change of the job, and by the job's changes
/// (a failed generation ends the wait).
async fn wait_for_value<T, F, Fut>(
    job: &Job,
    key: &str,
    deadline: Option<Instant>,
    what: impl Fn() -> String,
    f: F,
) -> Result<T, Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, Status>>,
{
    let waited = wait_until(job, Some(key), deadline, what, f).await;
    job.forget_value(key);
    waited
}

async fn wait_until<T, F, Fut>(
    job: &Job,
    key: Option<&str>,
    deadline: Option<Instant>,
    what: impl Fn() -> String,
    mut f: F,
) -> Result<T, Status>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<Option<T>, Status>>,
{
    loop {
        let mut changed = job.subscribe();
        let mut published = key.map(|key| job.watch_value(key));
        if job.retired() {
            return Err(Status::unavailable(format!(
                "stopped waiting for {}: this coordinator no longer leads; ask the leader",
                what()
            )));
        }
        if let Some(v) = f().await? {
            return Ok(v);
        }
        let woken = async {
            match &mut published {
                Some(published) => {
                    tokio::select! {
                        _ = changed.changed() => {}
                        _ = published.changed() => {}
                    }
                }
                None => {
                    let _ = changed.changed().await;
                }
            }
        };
        match deadline {
            Some(d) => {
                if tokio::time::timeout_at(d, woken).await.is_err() {
                    return Err(Status::deadline_exceeded(format!(
                        "timed out waiting for {}",
                        what()
                    )));
                }
            }
            None => woken.await,
        }
    }
}

/// The answer to a rank's registration, on its session or through its node's relay.
fn registered(config: &Config, info: &crate::job::Registration) -> pb::CoordinatorMessage {
    pb::CoordinatorMessage {
        kind: Some(pb::coordinator_message::Kind::Registered(pb::Registered {
            heartbeat_interval_ms: config.heartbeat_interval().as_millis() as u64,
            world_size: info.world_size,
            node_rank: info.node_rank,
            num_nodes: info.num_nodes,
        })),
    }
}

/// Reads the first message of a stream (`what`: "session" or "relay"), which must come within
/// `within`.
async fn first_message<T: prost::Message + Default>(
    inbound: &mut Streaming<T>,
    within: Duration,
    what: &str,
) -> Result<T, Status> {
    match tokio::time::timeout(within, inbound.message()).await {
        Err(_) => Err(Status::deadline_exceeded(format!(
            "no register message within the heartbeat timeout ({:.1}s) on a new {what}",
            within.as_secs_f64()
        ))),
        Ok(Err(status)) => Err(status),
        Ok(Ok(None)) => Err(Status::invalid_argument(format!(
            "{what} ended before register"
        ))),
        Ok(Ok(Some(m))) => Ok(m),
    }
}

/// What makes a job removable once it has lasted `finished_job_ttl`, if anything: the final
/// state its summary shows ("finished", "failed", "cancelled"), or an abandoned round (open
/// with no node waiting: every joiner gave up or went away) unless it is a submitted job still
/// waiting for its agents (`submitted`).
fn expiry_outcome(s: &pb::JobSummary, submitted: bool) -> Option<&'static str> {
    use pb::RoundState;
    match RoundState::try_from(s.state) {
        Ok(RoundState::Cancelled) => Some("cancelled"),
        Ok(RoundState::Finished) => Some("finished"),
        _ if s.done => Some("failed"),
        Ok(RoundState::Open) if s.nodes_waiting == 0 && !submitted => {
            Some("abandoned (its rendezvous round open with no node waiting)")
        }
        _ => None,
    }
}

fn deadline(field: &str, ms: u64) -> Result<Option<Instant>, Status> {
    Ok(model::wait(field, ms)?.map(|d| Instant::now() + d))
}

/// Who entered a barrier: a rank on its session, or a node's relay with a group entry.
enum BarrierFrom<'a> {
    Rank { rank: u32, name: &'a str },
    Relay { node_rank: u32 },
}

/// The coordinator's span for one barrier entry, a child of the trace context the client
/// passed on (a worker's span, or the agent's relay span); disabled (no work) unless DEBUG
/// spans are recorded.
fn barrier_span(
    job: &JobId,
    generation: u64,
    seq: u64,
    from: BarrierFrom<'_>,
    trace_context: &HashMap<String, String>,
) -> tracing::Span {
    use tracing::field::Empty;
    let span = tracing::debug_span!(
        "barrier",
        otel.kind = "server",
        job = %job,
        generation,
        seq,
        rank = Empty,
        name = Empty,
        node_rank = Empty,
        relayed = Empty,
    );
    if !span.is_disabled() {
        match from {
            BarrierFrom::Rank { rank, name } => {
                span.record("rank", rank);
                span.record("name", name);
            }
            BarrierFrom::Relay { node_rank } => {
                span.record("node_rank", node_rank);
                span.record("relayed", true);
            }
        }
    }
    muster_telemetry::traces::set_parent(&span, trace_context);
    span
}
