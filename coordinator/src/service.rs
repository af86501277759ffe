//! The gRPC services: each handler validates its request into domain types, then acts on the
//! job registry. Handlers are thin; the rules live in `job.rs` (rounds, sessions, barriers)
//! and in [`Values`] (key-value store, unique ids, shared values over the [`Store`]).

use crate::auth;
use crate::config::Config;
use crate::job::{FailureDetail, Job, JobContext, JoinReq, NodeRef, Outbox, RoundConfig};
use crate::pool::{self, Pool};
use crate::store::{Store, StoreError};
use muster_core::model::{self, Invalid, JobId, Scope};
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
            store: store.as_etcd().is_some().then(|| Arc::clone(&store)),
            // Over etcd, decisions wait for a term (`ha.rs`, "A leader that did not run").
            tenure: if store.as_etcd().is_some() {
                crate::tenure::Tenure::elected()
            } else {
                crate::tenure::Tenure::always()
            },
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
            let kv_bytes: usize = self
                .store
                .list(&format!("jobs/{id}/kv/"))
                .await?
                .iter()
                .map(|(k, v)| k.len().saturating_sub(format!("jobs/{id}/kv/").len()) + v.len())
                .sum();
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

    fn round_config(
        &self,
        c: Option<pb::RendezvousConfig>,
    ) -> Result<Option<RoundConfig>, Invalid> {
        let Some(c) = c else { return Ok(None) };
        if c.min_nodes == 0
            && c.max_nodes == 0
            && c.last_call_ms == 0
            && c.join_timeout_ms == 0
            && c.max_restarts.is_none()
        {
            return Ok(None);
        }
        if let Some(n) = c.max_restarts
            && n > model::MAX_RESTARTS
        {
            return Err(Invalid(format!(
                "max_restarts ({n}) is above the limit of {}",
                model::MAX_RESTARTS
            )));
        }
        let min_nodes = c.min_nodes.max(1);
        let max_nodes = if c.max_nodes == 0 {
            min_nodes
        } else {
            c.max_nodes
        };
        if max_nodes < min_nodes {
            return Err(Invalid(format!(
                "max_nodes ({max_nodes}) must not be below min_nodes ({min_nodes})"
            )));
        }
        if max_nodes > model::MAX_NODES {
            return Err(Invalid(format!(
                "max_nodes ({max_nodes}) is above the limit of {}",
                model::MAX_NODES
            )));
        }
        Ok(Some(RoundConfig {
            min_nodes,
            max_nodes,
            last_call: model::wait("last_call_ms", c.last_call_ms)?
                .unwrap_or(self.config.last_call),
            join_timeout: model::wait("join_timeout_ms", c.join_timeout_ms)?
                .unwrap_or(self.config.join_timeout),
            max_restarts: c.max_restarts.unwrap_or(0),
        }))
    }
}

type Rpc<T> = Result<Response<T>, Status>;

/// Waits until `f` yields a value, the job changes its mind (the closure errors), or the
/// deadline passes. `f` is re-run after every change of the job.
async fn wait_for<T, F, Fut>(
    job: &Job,
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
        if job.retired() {
            return Err(Status::unavailable(format!(
                "stopped waiting for {}: this coordinator no longer leads; ask the leader",
                what()
            )));
        }
        if let Some(v) = f().await? {
            return Ok(v);
        }
        match deadline {
            Some(d) => match tokio::time::timeout_at(d, changed.changed()).await {
                Ok(_) => {}
                Err(_) => {
                    return Err(Status::deadline_exceeded(format!(
                        "timed out waiting for {}",
                        what()
                    )));
                }
            },
            None => {
                let _ = changed.changed().await;
            }
        }
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

/// The last `max` characters of `s` (what an agent reports may be long; the end matters).
fn clip(s: &str, max: usize) -> String {
    let n = s.chars().count();
    s.chars().skip(n.saturating_sub(max)).collect()
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

// --------------------------------------------------------------------------------------------
// Rendezvous
// --------------------------------------------------------------------------------------------

type WatchStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::NodeEvent, Status>> + Send>>;

/// `muster.v1.Rendezvous`.
#[derive(Clone)]
pub struct RendezvousService(pub Arc<Coordinator>);

/// Removes a joiner from its round if its caller goes away before the round closes.
struct JoinGuard {
    job: Arc<Job>,
    generation: u64,
    node_id: String,
    attempt: u64,
    armed: bool,
}

impl Drop for JoinGuard {
    fn drop(&mut self) {
        if self.armed {
            self.job
                .withdraw(self.generation, &self.node_id, self.attempt);
        }
    }
}

#[tonic::async_trait]
impl pb::rendezvous_server::Rendezvous for RendezvousService {
    /// Cancel-safe: a dropped call withdraws its node from the open round.
    async fn join(&self, request: Request<pb::JoinRequest>) -> Rpc<pb::JoinResponse> {
        let r = request.into_inner();
        let id = JobId::parse(&r.job_id)?;
        let req = JoinReq {
            node_id: model::node_id(&r.node_id)?,
            host: model::host("host", &r.host)?,
            local_world_size: match r.local_world_size {
                n @ 1..=model::MAX_LOCAL_WORLD_SIZE => n,
                n => {
                    return Err(Status::invalid_argument(format!(
                        "local_world_size {n} is out of range 1..={}",
                        model::MAX_LOCAL_WORLD_SIZE
                    )));
                }
            },
            requested: r.requested_node_rank,
            request_id: if r.request_id.is_empty() {
                String::new()
            } else {
                model::label("request_id", &r.request_id, 128)?
            },
        };
        let restarts_unset = r.config.as_ref().is_none_or(|c| c.max_restarts.is_none());
        let config = self.0.round_config(r.config)?;
        let job = {
            let mut jobs = self.0.jobs();
            match jobs.get(&id) {
                Some(job) => {
                    let have = job.config();
                    if let Some(mut c) = config {
                        if restarts_unset {
                            c.max_restarts = have.max_restarts;
                        }
                        if c != have {
                            return Err(Status::failed_precondition(format!(
                                "job '{id}' exists with min_nodes={} max_nodes={} last_call_ms={} join_timeout_ms={} max_restarts={}; this join asks for {}:{} {} {} {}",
                                have.min_nodes,
                                have.max_nodes,
                                have.last_call.as_millis(),
                                have.join_timeout.as_millis(),
                                have.max_restarts,
                                c.min_nodes,
                                c.max_nodes,
                                c.last_call.as_millis(),
                                c.join_timeout.as_millis(),
                                c.max_restarts
                            )));
                        }
                    }
                    Arc::clone(job)
                }
                None => {
                    self.0.may_create(&id, jobs.len())?;
                    let c = config.unwrap_or(RoundConfig {
                        min_nodes: 1,
                        max_nodes: 1,
                        last_call: self.0.config.last_call,
                        join_timeout: self.0.config.join_timeout,
                        max_restarts: 0,
                    });
                    let job = Job::new(id.clone(), c, &self.0.ctx);
                    jobs.insert(id, Arc::clone(&job));
                    job
                }
            }
        };
        let node_id = req.node_id.clone();
        let (generation, attempt, rx) = job.join(req)?;
        let mut guard = JoinGuard {
            job: Arc::clone(&job),
            generation,
            node_id,
            attempt,
            armed: true,
        };
        let answer = rx.await.map_err(|_| {
            Status::aborted(format!(
                "rendezvous round of job '{}' was abandoned",
                job.id
            ))
        });
        guard.armed = false;
        Ok(Response::new(answer??))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, request: Request<Streaming<pb::NodeMessage>>) -> Rpc<WatchStream> {
        let hb = self.0.config.heartbeat_timeout;
        let mut inbound = request.into_inner();
        let first = first_message(&mut inbound, hb, "node watch").await?;
        let Some(pb::node_message::Kind::Attach(a)) = first.kind else {
            return Err(Status::invalid_argument(
                "the first node watch message must be attach",
            ));
        };
        let job = self.0.job(&a.job_id)?;
        let generation = model::generation(a.generation)?;
        let node_id = model::node_id(&a.node_id)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let attached = pb::NodeAttached {
            heartbeat_interval_ms: self.0.config.heartbeat_interval().as_millis() as u64,
            heartbeat_timeout_ms: hb.as_millis() as u64,
        };
        let watch_id = job.watch(generation, a.node_rank, &node_id, tx.clone(), attached)?;
        let node_rank = a.node_rank;
        // Task "node-watch", one per attached agent: it is the node's lease. It ends with the
        // stream; if the node's ranks still run then, the generation fails naming the node.
        tokio::spawn(async move {
            use pb::node_message::Kind;
            let why = loop {
                // Silence counts only while this process runs (`tenure::within`).
                match crate::tenure::within(hb, inbound.message()).await {
                    None => {
                        break format!(
                            "no heartbeat from its agent for {:.1}s (agent stopped, hung or partitioned)",
                            hb.as_secs_f64()
                        );
                    }
                    Some(Err(status)) => {
                        break format!("its agent's stream broke: {}", status.message());
                    }
                    Some(Ok(None)) => break "its agent disconnected".to_owned(),
                    Some(Ok(Some(_))) if job.retired() => {
                        // A lapsed leader takes nothing in; the agent moves to the leader.
                        let _ = tx.send(Err(crate::tenure::Tenure::lapsed()));
                        break "this coordinator's leadership lapsed".to_owned();
                    }
                    Some(Ok(Some(msg))) => match msg.kind {
                        Some(Kind::Heartbeat(_)) => {
                            job.node_heartbeat(generation, node_rank, watch_id);
                            let _ = tx.send(Ok(pb::NodeEvent {
                                kind: Some(pb::node_event::Kind::Heartbeat(pb::Heartbeat {})),
                            }));
                        }
                        Some(Kind::Finished(_)) => {
                            // Ending the stream is the answer the agent waits for: it exits
                            // as soon as its node's end is recorded. The node is finished,
                            // so `node_lost` below only drops its outbox.
                            job.node_finished(generation, node_rank).await;
                            break "its agent finished".to_owned();
                        }
                        Some(Kind::Attach(_)) | None => {
                            let _ = tx.send(Err(Status::invalid_argument(
                                "attach may only be the first node watch message",
                            )));
                            break "protocol error on its watch stream".to_owned();
                        }
                    },
                }
            };
            job.node_lost(generation, node_rank, watch_id, &why);
        });
        // What a lapsed leader would push never leaves (`tenure::Tenure::guard`).
        Ok(Response::new(Box::pin(self.0.tenure().guard(rx))))
    }

    async fn report_failure(
        &self,
        request: Request<pb::ReportFailureRequest>,
    ) -> Rpc<pb::ReportFailureResponse> {
        let r = request.into_inner();
        let job = self.0.job(&r.job_id)?;
        let generation = model::generation(r.generation)?;
        job.check_member(generation, r.rank)?;
        let reason = model::label("reason", &r.reason, 4096)?;
        let detail = FailureDetail {
            exit_code: r.exit_code,
            signal: r.signal,
            error_message: clip(&r.error_message, 4096),
            error_traceback: clip(&r.error_traceback, 16384),
            stderr_tail: clip(&r.stderr_tail, 8192),
        };
        job.fail_rank(generation, r.rank, reason, Some(detail));
        Ok(Response::new(pb::ReportFailureResponse {}))
    }
}

// --------------------------------------------------------------------------------------------
// Sessions
// --------------------------------------------------------------------------------------------

/// `muster.v1.Session`.
#[derive(Clone)]
pub struct SessionService(pub Arc<Coordinator>);

type AttachStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::CoordinatorMessage, Status>> + Send>>;

#[tonic::async_trait]
impl pb::session_server::Session for SessionService {
    type AttachStream = AttachStream;

    async fn attach(&self, request: Request<Streaming<pb::WorkerMessage>>) -> Rpc<AttachStream> {
        let hb = self.0.config.heartbeat_timeout;
        let principal = request.extensions().get::<auth::Principal>().cloned();
        let mut inbound = request.into_inner();
        let first = first_message(&mut inbound, hb, "session").await?;
        let Some(pb::worker_message::Kind::Register(reg)) = first.kind else {
            return Err(Status::invalid_argument(
                "the first session message must be register",
            ));
        };
        if let Some(auth::Principal::Job(own)) = &principal
            && *own != reg.job_id
        {
            return Err(Status::permission_denied(format!(
                "the job token is for job '{own}', not job '{}'",
                reg.job_id
            )));
        }
        let job = self.0.job(&reg.job_id)?;
        let generation = model::generation(reg.generation)?;
        let host = if reg.host.is_empty() {
            String::new()
        } else {
            model::host("host", &reg.host)?
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let resume = reg
            .resume
            .then_some([reg.released_global, reg.released_node]);
        let info = job.register(generation, reg.rank, reg.pid, host, tx.clone(), resume)?;
        let _ = tx.send(Ok(pb::CoordinatorMessage {
            kind: Some(pb::coordinator_message::Kind::Registered(pb::Registered {
                heartbeat_interval_ms: self.0.config.heartbeat_interval().as_millis() as u64,
                world_size: info.world_size,
                node_rank: info.node_rank,
                num_nodes: info.num_nodes,
            })),
        }));
        tracing::debug!(job = %job.id, generation, rank = reg.rank, pid = reg.pid, "session registered");
        // Task policy: one per session; ends with the stream; on coordinator shutdown it is
        // dropped with the runtime (workers see the connection close).
        tokio::spawn(session_loop(job, generation, reg.rank, inbound, tx, hb));
        Ok(Response::new(Box::pin(self.0.tenure().guard(rx))))
    }
}

async fn session_loop(
    job: Arc<Job>,
    generation: u64,
    rank: u32,
    mut inbound: Streaming<pb::WorkerMessage>,
    outbox: Outbox,
    hb: Duration,
) {
    use pb::worker_message::Kind;
    let reason = loop {
        // Silence counts only while this process runs (`tenure::within`).
        match crate::tenure::within(hb, inbound.message()).await {
            None => {
                break format!(
                    "no heartbeat for {:.1}s (process stopped, hung or partitioned)",
                    hb.as_secs_f64()
                );
            }
            Some(Err(status)) => break format!("connection lost ({})", status.message()),
            Some(Ok(None)) => {
                break "session ended without leave (process exited or was killed)".to_owned();
            }
            Some(Ok(Some(_))) if job.retired() => {
                // A lapsed leader takes no barrier entry in; the worker moves to the leader.
                let _ = outbox.send(Err(crate::tenure::Tenure::lapsed()));
                return;
            }
            Some(Ok(Some(msg))) => match msg.kind {
                Some(Kind::Heartbeat(_)) => job.touch(generation, rank),
                Some(Kind::Barrier(b)) => {
                    let checked = Scope::from_wire(b.scope).and_then(|scope| {
                        Ok((
                            scope,
                            model::label("barrier name", &b.name, 512)?,
                            model::wait("timeout_ms", b.timeout_ms)?,
                        ))
                    });
                    // A span per entry, child of the worker's span when it sent its trace
                    // context; disabled (no work) unless DEBUG spans are recorded.
                    let span = tracing::debug_span!(
                        "barrier",
                        otel.kind = "server",
                        job = %job.id,
                        generation,
                        rank,
                        seq = b.seq,
                        name = %b.name,
                    );
                    crate::telemetry::set_parent(&span, &b.trace_context);
                    let _entered = span.enter();
                    match checked {
                        Ok((scope, name, timeout)) => {
                            job.barrier(generation, rank, scope, b.seq, name, timeout, &outbox)
                        }
                        Err(e) => {
                            let _ = outbox.send(Ok(pb::CoordinatorMessage {
                                kind: Some(pb::coordinator_message::Kind::Barrier(
                                    pb::BarrierResult {
                                        scope: b.scope,
                                        seq: b.seq,
                                        error: Some(pb::BarrierError {
                                            message: e.0,
                                            ..Default::default()
                                        }),
                                    },
                                )),
                            }));
                        }
                    }
                }
                Some(Kind::Leave(_)) => {
                    job.leave(generation, rank);
                    tracing::debug!(job = %job.id, generation, rank, "session left");
                    return;
                }
                Some(Kind::Register(_)) | None => {
                    let _ = outbox.send(Err(Status::invalid_argument(
                        "register may only be the first message of a session",
                    )));
                    break "protocol error: a second register".to_owned();
                }
            },
        }
    };
    if job.retired() {
        // This coordinator stopped leading: the worker re-attaches to the new leader.
        return;
    }
    if !reason.starts_with("no heartbeat") {
        // A process that exited is usually reported by its agent within milliseconds, with the
        // exit status and stderr: give that report a moment to arrive and name the cause.
        tokio::time::sleep(AGENT_REPORT_GRACE).await;
    }
    job.fail_rank(generation, rank, reason, None);
}

/// The most waits one relay report may list.
const MAX_REPORTED_BARRIERS: usize = 64;
/// The longest `DescribeJob` long poll (`wait_ms`).
const DESCRIBE_WAIT_MAX: Duration = Duration::from_secs(60);

/// How long a session that ended without leave waits for its agent's more precise report.
const AGENT_REPORT_GRACE: Duration = Duration::from_millis(150);

// --------------------------------------------------------------------------------------------
// Relay
// --------------------------------------------------------------------------------------------

/// `muster.v1.Relay`.
#[derive(Clone)]
pub struct RelayService(pub Arc<Coordinator>);

type RelayStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::RelayEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::relay_server::Relay for RelayService {
    type AttachStream = RelayStream;

    async fn attach(&self, request: Request<Streaming<pb::RelayMessage>>) -> Rpc<RelayStream> {
        let mut inbound = request.into_inner();
        let first = first_message(&mut inbound, self.0.config.heartbeat_timeout, "relay").await?;
        let Some(pb::relay_message::Kind::Register(reg)) = first.kind else {
            return Err(Status::invalid_argument(
                "the first relay message must be register",
            ));
        };
        let job = self.0.job(&reg.job_id)?;
        let generation = model::generation(reg.generation)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        job.relay_register(
            generation,
            reg.node_rank,
            tx.clone(),
            self.0.config.heartbeat_interval(),
            reg.resume.then_some(reg.released),
        )?;
        let node_rank = reg.node_rank;
        // Task policy: one per relay; ends with the stream. A relay that goes away needs no
        // action here: its workers' own sessions report their ends.
        tokio::spawn(async move {
            while let Ok(Some(msg)) = inbound.message().await {
                if job.retired() {
                    // A lapsed leader takes no barrier entry in; the relay moves on.
                    let _ = tx.send(Err(crate::tenure::Tenure::lapsed()));
                    break;
                }
                match msg.kind {
                    Some(pb::relay_message::Kind::Enter(e)) => {
                        let checked = e
                            .groups
                            .into_iter()
                            .map(|g| Ok((model::label("barrier name", &g.name, 512)?, g.ranks)))
                            .collect::<Result<Vec<_>, Invalid>>()
                            .and_then(|groups| {
                                Ok((groups, model::wait("timeout_ms", e.timeout_ms)?))
                            });
                        // A span per group entry, like a session's barrier span: a child of
                        // the trace context the relay passed on (the agent's relay span, or a
                        // worker's); disabled (no work) unless DEBUG spans are recorded.
                        let span = tracing::debug_span!(
                            "barrier",
                            otel.kind = "server",
                            job = %job.id,
                            generation,
                            node_rank,
                            seq = e.seq,
                            relayed = true,
                        );
                        crate::telemetry::set_parent(&span, &e.trace_context);
                        let _entered = span.enter();
                        match checked {
                            Ok((groups, timeout)) => job
                                .barrier_group(generation, node_rank, e.seq, groups, timeout, &tx),
                            Err(err) => {
                                let _ = tx.send(Ok(pb::RelayEvent {
                                    kind: Some(pb::relay_event::Kind::Barrier(pb::BarrierResult {
                                        scope: Scope::Global.to_wire(),
                                        seq: e.seq,
                                        error: Some(pb::BarrierError {
                                            message: err.0,
                                            ..Default::default()
                                        }),
                                    })),
                                }));
                            }
                        }
                    }
                    Some(pb::relay_message::Kind::Heartbeat(_)) => {}
                    Some(pb::relay_message::Kind::Waiting(report)) => {
                        // Information for the ops view, capped like any list from the network.
                        let mut barriers = report.barriers;
                        barriers.truncate(MAX_REPORTED_BARRIERS);
                        job.relay_report(generation, node_rank, barriers);
                    }
                    Some(pb::relay_message::Kind::Register(_)) | None => {
                        let _ = tx.send(Err(Status::invalid_argument(
                            "register may only be the first relay message",
                        )));
                        break;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(self.0.tenure().guard(rx))))
    }
}

// --------------------------------------------------------------------------------------------
// Key-value store, unique ids, shared values
// --------------------------------------------------------------------------------------------

fn kv_key(job: &JobId, key: &str) -> String {
    format!("jobs/{job}/kv/{key}")
}

fn value_key(job: &JobId, values_id: &str, kind: &str, name: &str) -> String {
    format!("jobs/{job}/gen/{values_id}/{kind}/{name}")
}

/// A published value is stored as the publisher's rank (4 bytes, little endian) then the value.
fn encode_published(rank: u32, value: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + value.len());
    v.extend_from_slice(&rank.to_le_bytes());
    v.extend_from_slice(value);
    v
}

fn decode_published(stored: &[u8]) -> Result<(u32, &[u8]), Status> {
    match stored.split_first_chunk::<4>() {
        Some((rank, value)) => Ok((u32::from_le_bytes(*rank), value)),
        None => Err(Status::internal(
            "stored value is corrupt (shorter than its header)",
        )),
    }
}

/// `muster.v1.KeyValue`, `muster.v1.UniqueIds` and `muster.v1.SharedValues`.
#[derive(Clone)]
pub struct ValuesService(pub Arc<Coordinator>);

impl ValuesService {
    fn check_value(&self, value: &[u8]) -> Result<(), Status> {
        if value.len() > self.0.config.max_value_bytes {
            return Err(Status::resource_exhausted(format!(
                "value is {} bytes; the limit is {} (max_value_bytes)",
                value.len(),
                self.0.config.max_value_bytes
            )));
        }
        Ok(())
    }

    /// Writes `value` (None: deletes) under the job's byte cap. Caller holds the job's kv lock.
    async fn write(
        &self,
        job: &Job,
        total: &mut usize,
        key: &str,
        user_key: &str,
        value: Option<Vec<u8>>,
    ) -> Result<Option<Vec<u8>>, Status> {
        let old = self.0.store.get(key).await?;
        let old_len = old.as_ref().map_or(0, |v| user_key.len() + v.len());
        let new_len = value.as_ref().map_or(0, |v| user_key.len() + v.len());
        let next = (*total + new_len).saturating_sub(old_len);
        if next > self.0.config.max_job_bytes && new_len > old_len {
            return Err(Status::resource_exhausted(format!(
                "job '{}' key-value store would hold {next} bytes; the limit is {} (max_job_bytes: raise it with --max-job-bytes)",
                job.id, self.0.config.max_job_bytes
            )));
        }
        // Over all jobs too (max_total_bytes): reserved before the write, given back if it
        // does not happen.
        let grow = new_len.saturating_sub(old_len);
        self.0
            .stored
            .reserve(&job.id, grow, &format!("writing key '{user_key}'"))?;
        let written = match value {
            Some(v) => self.0.store.put(key, v).await,
            None => self.0.store.delete(key).await.map(|_| ()),
        };
        if let Err(e) = written {
            self.0.stored.release(&job.id, grow);
            return Err(e.into());
        }
        self.0
            .stored
            .release(&job.id, old_len.saturating_sub(new_len));
        *total = next;
        job.notify();
        Ok(old)
    }

    async fn publish(
        &self,
        job: &Arc<Job>,
        generation: u64,
        rank: u32,
        kind: &str,
        name: &str,
        value: &[u8],
    ) -> Result<(), Status> {
        job.alive_member(generation, rank)?;
        let key = value_key(&job.id, &job.values_id(generation)?, kind, name);
        let stored = encode_published(rank, value);
        // Published values count towards max_total_bytes (given back if already published).
        let size = name.len() + stored.len();
        self.0
            .stored
            .reserve(&job.id, size, &format!("publishing {kind} '{name}'"))?;
        let created = self.0.store.create(&key, stored).await;
        if !matches!(created, Ok(None)) {
            self.0.stored.release(&job.id, size);
        }
        if let Some(existing) = created? {
            let (by, old) = decode_published(&existing)?;
            if old != value {
                return Err(Status::already_exists(format!(
                    "{kind} '{name}' of job '{}' generation {generation} was already published by rank {by} with different bytes",
                    job.id
                )));
            }
        }
        job.notify();
        Ok(())
    }

    async fn fetch(
        &self,
        job: &Arc<Job>,
        generation: u64,
        rank: u32,
        kind: &str,
        name: &str,
        wait_ms: u64,
    ) -> Result<(u32, Vec<u8>), Status> {
        let deadline = deadline("wait_ms", wait_ms)?;
        job.check_member(generation, rank)?;
        let key = value_key(&job.id, &job.values_id(generation)?, kind, name);
        let store = &self.0.store;
        wait_for(
            job,
            deadline,
            || {
                format!(
                    "{kind} '{name}' of job '{}' generation {generation}",
                    job.id
                )
            },
            || async {
                if let Some(v) = store.get(&key).await? {
                    let (by, value) = decode_published(&v)?;
                    return Ok(Some((by, value.to_vec())));
                }
                job.alive_member(generation, rank)?;
                Ok(None)
            },
        )
        .await
    }
}

/// A request about one job, which a job token may make only for its own job.
trait JobScoped {
    fn job_id(&self) -> &str;
}

macro_rules! job_scoped {
    ($($t:ty),* $(,)?) => {
        $(impl JobScoped for $t {
            fn job_id(&self) -> &str {
                &self.job_id
            }
        })*
    };
}

job_scoped!(
    pb::SetRequest,
    pb::GetRequest,
    pb::AddRequest,
    pb::CompareAndSetRequest,
    pb::DeleteRequest,
    pb::ListRequest,
    pb::PublishUniqueIdRequest,
    pb::FetchUniqueIdRequest,
    pb::PublishValueRequest,
    pb::FetchValueRequest,
);

/// The request's message, once its caller may act on the job it names (`auth`): before the
/// job is even looked up, so a worker of one job cannot probe for others.
fn authorized<T: JobScoped>(request: Request<T>) -> Result<T, Status> {
    auth::authorize_job(&request, request.get_ref().job_id())?;
    Ok(request.into_inner())
}

#[tonic::async_trait]
impl pb::key_value_server::KeyValue for ValuesService {
    async fn set(&self, request: Request<pb::SetRequest>) -> Rpc<pb::SetResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let key = model::kv_key(&r.key)?;
        self.check_value(&r.value)?;
        let mut total = job.kv_bytes.lock().await;
        self.write(
            &job,
            &mut total,
            &kv_key(&job.id, &key),
            &key,
            Some(r.value),
        )
        .await?;
        Ok(Response::new(pb::SetResponse {}))
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> Rpc<pb::GetResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let key = model::kv_key(&r.key)?;
        let deadline = deadline("wait_ms", r.wait_ms)?;
        let full = kv_key(&job.id, &key);
        let store = &self.0.store;
        if deadline.is_none() {
            return match store.get(&full).await? {
                Some(value) => Ok(Response::new(pb::GetResponse { value })),
                None => Err(Status::not_found(format!(
                    "key '{key}' not found in job '{}'",
                    job.id
                ))),
            };
        }
        let value = wait_for(
            &job,
            deadline,
            || format!("key '{key}' in job '{}'", job.id),
            || async { Ok(store.get(&full).await?) },
        )
        .await?;
        Ok(Response::new(pb::GetResponse { value }))
    }

    async fn add(&self, request: Request<pb::AddRequest>) -> Rpc<pb::AddResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let key = model::kv_key(&r.key)?;
        let full = kv_key(&job.id, &key);
        let mut total = job.kv_bytes.lock().await;
        let current = match self.0.store.get(&full).await? {
            None => 0i64,
            Some(v) => std::str::from_utf8(&v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "key '{key}' in job '{}' holds a value that is not a decimal integer; add needs a counter",
                        job.id
                    ))
                })?,
        };
        let value = current.checked_add(r.delta).ok_or_else(|| {
            Status::out_of_range(format!(
                "counter '{key}' would overflow: {current} + {}",
                r.delta
            ))
        })?;
        self.write(
            &job,
            &mut total,
            &full,
            &key,
            Some(value.to_string().into_bytes()),
        )
        .await?;
        Ok(Response::new(pb::AddResponse { value }))
    }

    async fn compare_and_set(
        &self,
        request: Request<pb::CompareAndSetRequest>,
    ) -> Rpc<pb::CompareAndSetResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let key = model::kv_key(&r.key)?;
        self.check_value(&r.desired)?;
        let full = kv_key(&job.id, &key);
        let mut total = job.kv_bytes.lock().await;
        let current = self.0.store.get(&full).await?;
        if current != r.expected {
            return Ok(Response::new(pb::CompareAndSetResponse {
                swapped: false,
                current,
            }));
        }
        self.write(&job, &mut total, &full, &key, Some(r.desired.clone()))
            .await?;
        Ok(Response::new(pb::CompareAndSetResponse {
            swapped: true,
            current: Some(r.desired),
        }))
    }

    async fn delete(&self, request: Request<pb::DeleteRequest>) -> Rpc<pb::DeleteResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let key = model::kv_key(&r.key)?;
        let mut total = job.kv_bytes.lock().await;
        let old = self
            .write(&job, &mut total, &kv_key(&job.id, &key), &key, None)
            .await?;
        Ok(Response::new(pb::DeleteResponse {
            existed: old.is_some(),
        }))
    }

    async fn list(&self, request: Request<pb::ListRequest>) -> Rpc<pb::ListResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        if r.prefix.len() > 512 {
            return Err(Status::invalid_argument("prefix is longer than 512 bytes"));
        }
        let base = kv_key(&job.id, "");
        let items = self
            .0
            .store
            .list(&format!("{base}{}", r.prefix))
            .await?
            .into_iter()
            .map(|(k, value)| pb::KeyValuePair {
                key: k[base.len()..].to_owned(),
                value,
            })
            .collect();
        Ok(Response::new(pb::ListResponse { items }))
    }
}

#[tonic::async_trait]
impl pb::unique_ids_server::UniqueIds for ValuesService {
    async fn publish(
        &self,
        request: Request<pb::PublishUniqueIdRequest>,
    ) -> Rpc<pb::PublishUniqueIdResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let generation = model::generation(r.generation)?;
        let comm = model::communicator(&r.communicator)?;
        if r.unique_id.len() != muster_proto::NCCL_UNIQUE_ID_BYTES {
            return Err(Status::invalid_argument(format!(
                "unique_id is {} bytes; an NCCL unique id is exactly {}",
                r.unique_id.len(),
                muster_proto::NCCL_UNIQUE_ID_BYTES
            )));
        }
        self.publish(&job, generation, r.rank, "nccl", &comm, &r.unique_id)
            .await?;
        Ok(Response::new(pb::PublishUniqueIdResponse {}))
    }

    async fn fetch(
        &self,
        request: Request<pb::FetchUniqueIdRequest>,
    ) -> Rpc<pb::FetchUniqueIdResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let generation = model::generation(r.generation)?;
        let comm = model::communicator(&r.communicator)?;
        let (root_rank, unique_id) =
            ValuesService::fetch(self, &job, generation, r.rank, "nccl", &comm, r.wait_ms).await?;
        Ok(Response::new(pb::FetchUniqueIdResponse {
            unique_id,
            root_rank,
        }))
    }
}

#[tonic::async_trait]
impl pb::shared_values_server::SharedValues for ValuesService {
    async fn publish(
        &self,
        request: Request<pb::PublishValueRequest>,
    ) -> Rpc<pb::PublishValueResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let generation = model::generation(r.generation)?;
        let name = model::label("name", &r.name, 256)?;
        self.check_value(&r.value)?;
        ValuesService::publish(self, &job, generation, r.rank, "shared", &name, &r.value).await?;
        Ok(Response::new(pb::PublishValueResponse {}))
    }

    async fn fetch(&self, request: Request<pb::FetchValueRequest>) -> Rpc<pb::FetchValueResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let generation = model::generation(r.generation)?;
        let name = model::label("name", &r.name, 256)?;
        let (publisher_rank, value) =
            ValuesService::fetch(self, &job, generation, r.rank, "shared", &name, r.wait_ms)
                .await?;
        Ok(Response::new(pb::FetchValueResponse {
            value,
            publisher_rank,
        }))
    }
}

// --------------------------------------------------------------------------------------------
// Ops
// --------------------------------------------------------------------------------------------

/// `muster.v1.Ops`.
#[derive(Clone)]
pub struct OpsService(pub Arc<Coordinator>);

#[tonic::async_trait]
impl pb::ops_server::Ops for OpsService {
    async fn list_jobs(&self, _: Request<pb::ListJobsRequest>) -> Rpc<pb::ListJobsResponse> {
        let jobs: Vec<Arc<Job>> = self.0.jobs().values().cloned().collect();
        let mut jobs: Vec<pb::JobSummary> = jobs.iter().map(|j| j.summary()).collect();
        jobs.sort_by(|a, b| a.job_id.cmp(&b.job_id));
        Ok(Response::new(pb::ListJobsResponse { jobs }))
    }

    async fn describe_job(
        &self,
        request: Request<pb::DescribeJobRequest>,
    ) -> Rpc<pb::DescribeJobResponse> {
        let r = request.into_inner();
        let job = self.0.job(&r.job_id)?;
        if let Some(unless) = r.unless.filter(|_| r.wait_ms > 0) {
            // The long poll: answer once the summary differs from the client's, or at the
            // deadline (a timeout here is not an error: the answer is the current view).
            let wait = Duration::from_millis(r.wait_ms).min(DESCRIBE_WAIT_MAX);
            let changed = wait_for(
                &job,
                Some(Instant::now() + wait),
                || format!("a change of job '{}'", job.id),
                || {
                    let differs = job.summary() != unless;
                    async move { Ok(differs.then_some(())) }
                },
            )
            .await;
            if let Err(status) = changed
                && status.code() != tonic::Code::DeadlineExceeded
            {
                return Err(status);
            }
        }
        let mut resp = job.describe();
        // Daemon agents' machines: their labels and host names.
        let machines = self.0.pool.machines(&r.job_id);
        for node in &mut resp.nodes {
            if let Some(m) = machines
                .iter()
                .find(|m| m.agent_id == node.node_id)
                .or_else(|| machines.iter().find(|m| m.address == node.host))
            {
                node.labels = m.labels.clone();
                node.hostname = m.hostname.clone();
            }
        }
        Ok(Response::new(resp))
    }

    async fn submit_job(
        &self,
        request: Request<pb::SubmitJobRequest>,
    ) -> Rpc<pb::SubmitJobResponse> {
        let spec = request
            .into_inner()
            .spec
            .ok_or_else(|| Status::invalid_argument("spec is missing"))?;
        let spec = pool::check_spec(spec, || {
            let n = self
                .0
                .next_job
                .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
            let t = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            format!("job-{t}-{n}")
        })?;
        let job_id = spec.job_id.clone();
        let agents = self.0.pool.submit(spec, |spec| self.0.create_job(spec))?;
        Ok(Response::new(pb::SubmitJobResponse { job_id, agents }))
    }

    async fn cancel_job(
        &self,
        request: Request<pb::CancelJobRequest>,
    ) -> Rpc<pb::CancelJobResponse> {
        let r = request.into_inner();
        let job = self.0.job(&r.job_id)?;
        let reason = if r.reason.is_empty() {
            "cancelled by an operator".to_owned()
        } else {
            model::label("reason", &r.reason, 1024)?
        };
        let cancelled = job.cancel(&reason);
        self.0.pool.cancel(&r.job_id, &reason);
        Ok(Response::new(pb::CancelJobResponse { cancelled }))
    }

    async fn list_agents(&self, _: Request<pb::ListAgentsRequest>) -> Rpc<pb::ListAgentsResponse> {
        Ok(Response::new(pb::ListAgentsResponse {
            agents: self.0.pool.list(),
        }))
    }

    async fn drain_node(
        &self,
        request: Request<pb::DrainNodeRequest>,
    ) -> Rpc<pb::DrainNodeResponse> {
        use pb::drain_node_request::Node;
        let r = request.into_inner();
        let job = self.0.job(&r.job_id)?;
        let node = match r.node {
            Some(Node::NodeId(id)) => NodeRef::Id(model::node_id(&id)?),
            Some(Node::NodeRank(rank)) => NodeRef::Rank(rank),
            None => {
                return Err(Status::invalid_argument(
                    "name the node to drain: set node_id or node_rank",
                ));
            }
        };
        let reason = if r.reason.is_empty() {
            "drained by an operator".to_owned()
        } else {
            model::label("reason", &r.reason, 1024)?
        };
        let resp = job.drain(&node, &reason)?;
        self.0.pool.drained(&r.job_id, &resp.node_id);
        Ok(Response::new(resp))
    }
}

// --------------------------------------------------------------------------------------------
// Daemon agents
// --------------------------------------------------------------------------------------------

/// `muster.v1.Agents`.
#[derive(Clone)]
pub struct AgentsService(pub Arc<Coordinator>);

type AgentStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::AgentCommand, Status>> + Send>>;

#[tonic::async_trait]
impl pb::agents_server::Agents for AgentsService {
    type ServeStream = AgentStream;

    async fn serve(&self, request: Request<Streaming<pb::AgentMessage>>) -> Rpc<AgentStream> {
        let hb = self.0.config.heartbeat_timeout;
        let mut inbound = request.into_inner();
        let first = first_message(&mut inbound, hb, "agent stream").await?;
        let Some(pb::agent_message::Kind::Register(info)) = first.kind else {
            return Err(Status::invalid_argument(
                "the first agent message must be register",
            ));
        };
        pool::check_machine(&info)?;
        let agent_id = info.agent_id.clone();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let _ = tx.send(Ok(pb::AgentCommand {
            kind: Some(pb::agent_command::Kind::Registered(pb::AgentRegistered {
                heartbeat_interval_ms: self.0.config.heartbeat_interval().as_millis() as u64,
                heartbeat_timeout_ms: hb.as_millis() as u64,
            })),
        }));
        let conn = self.0.pool.register(info, tx.clone());
        let coordinator = Arc::clone(&self.0);
        // Task "agent-stream", one per daemon agent: its lease. Ends with the stream (or its
        // silence past the heartbeat timeout), which takes the agent out of the pool.
        tokio::spawn(async move {
            use pb::agent_message::Kind;
            let why = loop {
                match crate::tenure::within(hb, inbound.message()).await {
                    None => break format!("no heartbeat for {:.1}s", hb.as_secs_f64()),
                    Some(Err(status)) => break format!("stream broke: {}", status.message()),
                    Some(Ok(None)) => break "disconnected".to_owned(),
                    Some(Ok(Some(msg))) => {
                        coordinator.pool.touch(&agent_id, conn);
                        match msg.kind {
                            Some(Kind::Heartbeat(_)) => {
                                let _ = tx.send(Ok(pb::AgentCommand {
                                    kind: Some(pb::agent_command::Kind::Heartbeat(
                                        pb::Heartbeat {},
                                    )),
                                }));
                            }
                            Some(Kind::Update(u)) => coordinator.pool.job_ended(&agent_id, &u),
                            Some(Kind::Register(_)) | None => {
                                let _ = tx.send(Err(Status::invalid_argument(
                                    "register may only be the first agent message",
                                )));
                                break "protocol error".to_owned();
                            }
                        }
                    }
                }
            };
            coordinator.pool.unregister(&agent_id, conn, &why);
        });
        Ok(Response::new(Box::pin(self.0.tenure().guard(rx))))
    }
}
