//! Daemon agents (`muster-agent serve`) and the jobs submitted to them. An agent registers its
//! machine over `Agents.Serve` and keeps the stream open as its lease; `Ops.SubmitJob` places a
//! job on idle agents that match its node selector, which then run it exactly as
//! `muster-agent launch` would (joining the job's rendezvous like any node). An agent that
//! registers, or becomes idle, while a submitted job runs with fewer than its most nodes is
//! started on it too: the job's next round takes it in (torchrun's elastic scale-up). An
//! in-place job that admits spares (`JobSpec.max_spares`) gets that many more idle agents,
//! started as spares (`StartJob.spare`), and an idle agent fills a missing spare the same way.
//!
//! The pool's state sits behind one small lock, held for microseconds and never across an
//! `.await`; commands go out through each agent's unbounded outbox.

use muster_core::model::{self, JobId};
use muster_proto::v1 as pb;
use std::collections::{BTreeMap, BTreeSet};
use std::sync::{Mutex, MutexGuard};
use std::time::Instant;
use tokio::sync::mpsc;
use tonic::Status;

/// Where an agent's commands go (its `Agents.Serve` stream).
pub type AgentOutbox = mpsc::UnboundedSender<Result<pb::AgentCommand, Status>>;

/// Most labels (and selector entries) a machine or job may carry.
const MAX_LABELS: usize = 64;
/// Most arguments and environment entries of a submitted job.
const MAX_ARGS: usize = 4096;

struct AgentEntry {
    info: pb::MachineInfo,
    outbox: AgentOutbox,
    /// Which registration this is (a reconnect replaces the entry).
    conn: u64,
    last_seen: Instant,
    /// Submitted jobs it runs now.
    jobs: BTreeSet<String>,
}

struct Submitted {
    spec: pb::JobSpec,
    agents: BTreeSet<String>,
    /// Agents started as its spares.
    spares: BTreeSet<String>,
    /// A node reported the job's end, or it was cancelled: no agent is added any more.
    over: bool,
    /// Agents whose node was drained from the job: never offered it again.
    drained: BTreeSet<String>,
}

#[derive(Default)]
struct PoolState {
    agents: BTreeMap<String, AgentEntry>,
    jobs: BTreeMap<String, Submitted>,
    next_conn: u64,
}

/// The registered daemon agents and the submitted jobs.
#[derive(Default)]
pub struct Pool {
    state: Mutex<PoolState>,
}

impl PoolState {
    /// Starts waiting jobs on `agent_id` if it is idle: the first job (by id) that is not
    /// over, has fewer than its most nodes, and whose selector the agent matches.
    fn offer(&mut self, agent_id: &str) {
        let Some(agent) = self.agents.get_mut(agent_id) else {
            return;
        };
        if !agent.jobs.is_empty() {
            return;
        }
        for (id, job) in &mut self.jobs {
            if job.over
                || job.drained.contains(agent_id)
                || !matches(&agent.info.labels, &job.spec.node_selector)
            {
                continue;
            }
            let spare = if (job.agents.len() as u32) < max_nodes(&job.spec) {
                false
            } else if (job.spares.len() as u32) < job.spec.max_spares {
                true
            } else {
                continue;
            };
            tracing::info!(job = %id, agent = agent_id, spare, "starting a submitted job on a newly available agent");
            if spare {
                job.spares.insert(agent_id.to_owned());
            } else {
                job.agents.insert(agent_id.to_owned());
            }
            agent.jobs.insert(id.clone());
            let _ = agent.outbox.send(Ok(start(&job.spec, spare)));
            return;
        }
    }
}

fn max_nodes(spec: &pb::JobSpec) -> u32 {
    spec.max_nodes.max(spec.min_nodes)
}

fn matches(
    labels: &std::collections::HashMap<String, String>,
    selector: &std::collections::HashMap<String, String>,
) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

fn start(spec: &pb::JobSpec, spare: bool) -> pb::AgentCommand {
    pb::AgentCommand {
        kind: Some(pb::agent_command::Kind::Start(pb::StartJob {
            spec: Some(spec.clone()),
            spare,
        })),
    }
}

/// Checks a machine's registration; the error names the field.
pub fn check_machine(m: &pb::MachineInfo) -> Result<(), Status> {
    model::node_id(&m.agent_id).map_err(|e| Status::invalid_argument(format!("agent_id: {e}")))?;
    model::label("hostname", &m.hostname, 255)?;
    if !m.address.is_empty() {
        model::host("address", &m.address)?;
    }
    check_labels("labels", &m.labels)?;
    if m.gpus.len() > 1024 {
        return Err(Status::invalid_argument(format!(
            "gpus: {} listed, at most 1024",
            m.gpus.len()
        )));
    }
    Ok(())
}

fn check_labels(
    field: &str,
    labels: &std::collections::HashMap<String, String>,
) -> Result<(), Status> {
    if labels.len() > MAX_LABELS {
        return Err(Status::invalid_argument(format!(
            "{field}: {} entries, at most {MAX_LABELS}",
            labels.len()
        )));
    }
    for (k, v) in labels {
        model::label(&format!("{field} key"), k, 128)?;
        if v.len() > 256 {
            return Err(Status::invalid_argument(format!(
                "{field}: the value of '{k}' is longer than 256 bytes"
            )));
        }
    }
    Ok(())
}

/// Checks a submitted job and fills its defaults (a job id when empty, max_nodes); the error
/// names the field.
pub fn check_spec(
    mut spec: pb::JobSpec,
    fresh_id: impl FnOnce() -> String,
) -> Result<pb::JobSpec, Status> {
    if spec.job_id.is_empty() {
        spec.job_id = fresh_id();
    }
    JobId::parse(&spec.job_id)?;
    if spec.program.is_empty() {
        return Err(Status::invalid_argument(
            "program is empty: name the program to run",
        ));
    }
    model::label("program", &spec.program, 4096)?;
    if spec.args.len() > MAX_ARGS || spec.env.len() > MAX_ARGS {
        return Err(Status::invalid_argument(format!(
            "at most {MAX_ARGS} arguments and {MAX_ARGS} environment entries"
        )));
    }
    for k in spec.env.keys() {
        let ok = !k.is_empty()
            && !k.starts_with(|c: char| c.is_ascii_digit())
            && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_');
        if !ok {
            return Err(Status::invalid_argument(format!(
                "env: '{k}' is not a valid variable name"
            )));
        }
    }
    if !(1..=model::MAX_LOCAL_WORLD_SIZE).contains(&spec.nproc_per_node) {
        return Err(Status::invalid_argument(format!(
            "nproc_per_node {} is out of range 1..={}",
            spec.nproc_per_node,
            model::MAX_LOCAL_WORLD_SIZE
        )));
    }
    spec.min_nodes = spec.min_nodes.max(1);
    spec.max_nodes = max_nodes(&spec);
    if spec.max_nodes > model::MAX_NODES {
        return Err(Status::invalid_argument(format!(
            "max_nodes {} is above the limit of {}",
            spec.max_nodes,
            model::MAX_NODES
        )));
    }
    if spec.max_restarts > model::MAX_RESTARTS {
        return Err(Status::invalid_argument(format!(
            "max_restarts {} is above the limit of {}",
            spec.max_restarts,
            model::MAX_RESTARTS
        )));
    }
    // Unspecified means restart; the agents' joins then carry what the job has.
    let recovery = muster_core::requests::Recovery::from_wire("recovery", spec.recovery)?;
    if spec.max_spares > 0 && recovery != Some(muster_core::requests::Recovery::InPlace) {
        return Err(Status::invalid_argument(format!(
            "max_spares {}: spares take a lost node's ranks in place; the job needs recovery in-place",
            spec.max_spares
        )));
    }
    if spec.max_spares > model::MAX_NODES {
        return Err(Status::invalid_argument(format!(
            "max_spares {} is above the limit of {}",
            spec.max_spares,
            model::MAX_NODES
        )));
    }
    check_labels("node_selector", &spec.node_selector)?;
    Ok(spec)
}

impl Pool {
    fn lock(&self) -> MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Registers (or re-registers) an agent and starts a waiting job on it if one fits.
    /// Returns the registration's id for [`Pool::unregister`].
    pub fn register(&self, info: pb::MachineInfo, outbox: AgentOutbox) -> u64 {
        let mut st = self.lock();
        st.next_conn += 1;
        let conn = st.next_conn;
        let id = info.agent_id.clone();
        let jobs = st
            .agents
            .remove(&id)
            .map(|old| old.jobs)
            .unwrap_or_default();
        tracing::info!(agent = %id, host = %info.hostname, cpus = info.cpus, gpus = info.gpus.len(), "agent registered");
        st.agents.insert(
            id.clone(),
            AgentEntry {
                info,
                outbox,
                conn,
                last_seen: Instant::now(),
                jobs,
            },
        );
        st.offer(&id);
        conn
    }

    /// The agent was heard from.
    pub fn touch(&self, agent_id: &str, conn: u64) {
        if let Some(a) = self.lock().agents.get_mut(agent_id)
            && a.conn == conn
        {
            a.last_seen = Instant::now();
        }
    }

    /// Empties the pool (this coordinator stopped leading): every agent's stream ends with
    /// UNAVAILABLE and `why`, so that it registers with the new leader. The pool is not
    /// stored: agents bring their machines back, and the jobs they run are stored as jobs.
    pub fn retire(&self, why: &str) {
        let mut st = self.lock();
        for (_, agent) in std::mem::take(&mut st.agents) {
            let _ = agent.outbox.send(Err(Status::unavailable(why.to_owned())));
        }
        st.jobs.clear();
    }

    /// The agent's stream ended: it leaves the pool (unless a newer registration replaced
    /// it). Its jobs notice through their own node watches.
    pub fn unregister(&self, agent_id: &str, conn: u64, why: &str) {
        let mut st = self.lock();
        if st.agents.get(agent_id).is_some_and(|a| a.conn == conn) {
            tracing::warn!(agent = agent_id, why, "agent left the pool");
            if let Some(a) = st.agents.remove(agent_id) {
                for job in a.jobs {
                    if let Some(j) = st.jobs.get_mut(&job) {
                        j.agents.remove(agent_id);
                        j.spares.remove(agent_id);
                    }
                }
            }
        }
    }

    /// A job ended on an agent: the job takes no more agents (unless the agent's node was
    /// only drained: the job goes on without it), and the agent is free.
    pub fn job_ended(&self, agent_id: &str, update: &pb::JobUpdate) {
        let mut st = self.lock();
        if let Some(j) = st.jobs.get_mut(&update.job_id) {
            if update.outcome == pb::JobOutcome::Drained as i32 {
                j.drained.insert(agent_id.to_owned());
                j.agents.remove(agent_id);
                j.spares.remove(agent_id);
            } else {
                j.over = true;
            }
        }
        let idle = match st.agents.get_mut(agent_id) {
            Some(a) => {
                a.jobs.remove(&update.job_id);
                a.jobs.is_empty()
            }
            None => false,
        };
        tracing::info!(job = %update.job_id, agent = agent_id, outcome = update.outcome, message = %update.message, "job ended on agent");
        if idle {
            let ids: Vec<String> = st.agents.keys().cloned().collect();
            for id in ids {
                st.offer(&id);
            }
        }
    }

    /// Places a checked job on idle matching agents (at least min_nodes, at most max_nodes).
    /// `create` makes the coordinator's job record before any agent is told.
    pub fn submit(
        &self,
        spec: pb::JobSpec,
        create: impl FnOnce(&pb::JobSpec) -> Result<(), Status>,
    ) -> Result<Vec<String>, Status> {
        let mut st = self.lock();
        if st.jobs.contains_key(&spec.job_id) {
            return Err(Status::already_exists(format!(
                "job '{}' was already submitted",
                spec.job_id
            )));
        }
        let matching: Vec<&String> = st
            .agents
            .iter()
            .filter(|(_, a)| matches(&a.info.labels, &spec.node_selector))
            .map(|(id, _)| id)
            .collect();
        let idle: Vec<String> = matching
            .iter()
            .filter(|id| {
                st.agents
                    .get(id.as_str())
                    .is_some_and(|a| a.jobs.is_empty())
            })
            .map(|id| (*id).clone())
            .collect();
        if (idle.len() as u32) < spec.min_nodes {
            return Err(Status::failed_precondition(format!(
                "job '{}' needs at least {} idle agents{}; {} registered, {} match, {} of them idle",
                spec.job_id,
                spec.min_nodes,
                if spec.node_selector.is_empty() {
                    String::new()
                } else {
                    let mut sel: Vec<String> = spec
                        .node_selector
                        .iter()
                        .map(|(k, v)| format!("{k}={v}"))
                        .collect();
                    sel.sort();
                    format!(" matching {}", sel.join(","))
                },
                st.agents.len(),
                matching.len(),
                idle.len()
            )));
        }
        create(&spec)?;
        let mut idle = idle.into_iter();
        let chosen: Vec<String> = idle.by_ref().take(spec.max_nodes as usize).collect();
        let spares: Vec<String> = idle.take(spec.max_spares as usize).collect();
        for (id, spare) in chosen
            .iter()
            .map(|id| (id, false))
            .chain(spares.iter().map(|id| (id, true)))
        {
            if let Some(a) = st.agents.get_mut(id) {
                a.jobs.insert(spec.job_id.clone());
                let _ = a.outbox.send(Ok(start(&spec, spare)));
            }
        }
        tracing::info!(job = %spec.job_id, agents = ?chosen, spares = ?spares, "job submitted");
        st.jobs.insert(
            spec.job_id.clone(),
            Submitted {
                spec,
                agents: chosen.iter().cloned().collect(),
                spares: spares.iter().cloned().collect(),
                over: false,
                drained: BTreeSet::new(),
            },
        );
        Ok(chosen.into_iter().chain(spares).collect())
    }

    /// Tells the agents running `job_id` to stop it. Returns whether the job was submitted.
    pub fn cancel(&self, job_id: &str, reason: &str) -> bool {
        let mut st = self.lock();
        let Some(job) = st.jobs.get_mut(job_id) else {
            return false;
        };
        job.over = true;
        let agents: Vec<String> = job.agents.iter().cloned().collect();
        for id in agents {
            if let Some(a) = st.agents.get(&id) {
                let _ = a.outbox.send(Ok(pb::AgentCommand {
                    kind: Some(pb::agent_command::Kind::Stop(pb::StopJob {
                        job_id: job_id.to_owned(),
                        reason: reason.to_owned(),
                    })),
                }));
            }
        }
        true
    }

    /// Whether `job_id` was submitted and is not over: its agents may still be on their way
    /// to join it, so an empty round of it is not abandoned.
    pub fn waits_for_agents(&self, job_id: &str) -> bool {
        self.lock().jobs.get(job_id).is_some_and(|j| !j.over)
    }

    /// Forgets the submitted job `job_id` (it expired, see `retention.rs`): it is offered to
    /// no agent again. Agents that still list it free themselves when they report its end.
    pub fn forget(&self, job_id: &str) {
        self.lock().jobs.remove(job_id);
    }

    /// A node of `job_id` was drained: if it is a daemon agent (its agent id is the node
    /// id), the job is never offered to it again. Agents with another id are recorded when
    /// they report the drain (`JOB_OUTCOME_DRAINED`).
    pub fn drained(&self, job_id: &str, node_id: &str) {
        let mut st = self.lock();
        if let Some(j) = st.jobs.get_mut(job_id)
            && j.agents.contains(node_id)
        {
            j.drained.insert(node_id.to_owned());
        }
    }

    /// The machines of the agents that run `job_id` now (for the ops view's labels).
    pub fn machines(&self, job_id: &str) -> Vec<pb::MachineInfo> {
        let st = self.lock();
        st.agents
            .values()
            .filter(|a| a.jobs.contains(job_id))
            .map(|a| a.info.clone())
            .collect()
    }

    /// The registered agents, by id.
    pub fn list(&self) -> Vec<pb::AgentInfo> {
        let st = self.lock();
        let now = Instant::now();
        st.agents
            .values()
            .map(|a| pb::AgentInfo {
                machine: Some(a.info.clone()),
                last_seen_ms_ago: now.duration_since(a.last_seen).as_millis() as u64,
                jobs: a.jobs.iter().cloned().collect(),
                spare_for: a
                    .jobs
                    .iter()
                    .filter(|j| {
                        st.jobs
                            .get(j.as_str())
                            .is_some_and(|s| s.spares.contains(&a.info.agent_id))
                    })
                    .cloned()
                    .collect(),
            })
            .collect()
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn spec(min: u32, max: u32) -> pb::JobSpec {
        pb::JobSpec {
            job_id: "j".into(),
            program: "/bin/true".into(),
            min_nodes: min,
            max_nodes: max,
            nproc_per_node: 1,
            ..Default::default()
        }
    }

    fn agent(
        pool: &Pool,
        id: &str,
        labels: &[(&str, &str)],
    ) -> mpsc::UnboundedReceiver<Result<pb::AgentCommand, Status>> {
        let (tx, rx) = mpsc::unbounded_channel();
        pool.register(
            pb::MachineInfo {
                agent_id: id.into(),
                hostname: id.into(),
                labels: labels
                    .iter()
                    .map(|(k, v)| ((*k).into(), (*v).into()))
                    .collect(),
                ..Default::default()
            },
            tx,
        );
        rx
    }

    fn started(
        rx: &mut mpsc::UnboundedReceiver<Result<pb::AgentCommand, Status>>,
    ) -> Option<String> {
        match rx.try_recv() {
            Ok(Ok(pb::AgentCommand {
                kind: Some(pb::agent_command::Kind::Start(s)),
            })) => Some(s.spec.unwrap().job_id),
            _ => None,
        }
    }

    #[test]
    fn submit_places_on_idle_matching_agents_and_late_agents_join_up_to_max() {
        let pool = Pool::default();
        let mut a = agent(&pool, "a", &[("zone", "x")]);
        let mut b = agent(&pool, "b", &[("zone", "y")]);
        let mut s = spec(1, 2);
        s.node_selector.insert("zone".into(), "x".into());
        let chosen = pool.submit(s, |_| Ok(())).unwrap();
        assert_eq!(chosen, ["a"]);
        assert_eq!(started(&mut a).as_deref(), Some("j"));
        assert_eq!(started(&mut b), None);
        // A matching agent that registers later joins (elastic, up to max_nodes).
        let mut c = agent(&pool, "c", &[("zone", "x")]);
        assert_eq!(started(&mut c).as_deref(), Some("j"));
        let mut d = agent(&pool, "d", &[("zone", "x")]);
        assert_eq!(started(&mut d), None, "max_nodes reached");
        let listed = pool.list();
        assert_eq!(listed.len(), 4);
        assert_eq!(listed[0].jobs, ["j"]);
    }

    /// Whether the next command on `rx` starts a job as a spare.
    fn as_spare(rx: &mut mpsc::UnboundedReceiver<Result<pb::AgentCommand, Status>>) -> bool {
        match rx.try_recv() {
            Ok(Ok(pb::AgentCommand {
                kind: Some(pb::agent_command::Kind::Start(s)),
            })) => s.spare,
            other => panic!("no start: {other:?}"),
        }
    }

    #[test]
    fn an_in_place_job_gets_its_spares_from_idle_agents_and_a_lost_spare_is_replaced() {
        let pool = Pool::default();
        let mut a = agent(&pool, "a", &[]);
        let mut b = agent(&pool, "b", &[]);
        let mut c = agent(&pool, "c", &[]);
        let s = pb::JobSpec {
            max_spares: 1,
            recovery: pb::RecoveryMode::InPlace as i32,
            ..spec(2, 2)
        };
        let chosen = pool.submit(s, |_| Ok(())).unwrap();
        assert_eq!(chosen, ["a", "b", "c"]);
        assert!(!as_spare(&mut a) && !as_spare(&mut b));
        assert!(as_spare(&mut c));
        let listed = pool.list();
        assert_eq!(listed[2].spare_for, ["j"]);
        assert!(listed[0].spare_for.is_empty());
        // The spare's agent goes away: the next idle agent stands by in its stead.
        pool.unregister("c", 3, "gone");
        let mut d = agent(&pool, "d", &[]);
        assert!(as_spare(&mut d));
        let mut e = agent(&pool, "e", &[]);
        assert_eq!(started(&mut e), None, "max_spares reached");
        // Spares need in-place recovery, and a count within the limit.
        let restart = pb::JobSpec {
            max_spares: 1,
            ..spec(1, 1)
        };
        let err = check_spec(restart, String::new).unwrap_err();
        assert!(err.message().contains("recovery in-place"), "{err:?}");
    }

    #[test]
    fn a_drained_agent_is_not_offered_the_job_again_and_the_job_goes_on() {
        let pool = Pool::default();
        let mut a = agent(&pool, "a", &[]);
        let mut b = agent(&pool, "b", &[]);
        assert_eq!(pool.submit(spec(1, 3), |_| Ok(())).unwrap(), ["a", "b"]);
        assert_eq!(started(&mut a).as_deref(), Some("j"));
        assert_eq!(started(&mut b).as_deref(), Some("j"));
        assert_eq!(pool.machines("j").len(), 2);
        pool.job_ended(
            "b",
            &pb::JobUpdate {
                job_id: "j".into(),
                outcome: pb::JobOutcome::Drained as i32,
                message: "drained".into(),
            },
        );
        // b is idle now but drained from j; a newcomer still joins (the job is not over).
        assert_eq!(started(&mut b), None);
        let mut c = agent(&pool, "c", &[]);
        assert_eq!(started(&mut c).as_deref(), Some("j"));
        assert_eq!(pool.machines("j").len(), 2);
    }

    #[test]
    fn too_few_agents_is_refused_and_names_the_counts() {
        let pool = Pool::default();
        let _a = agent(&pool, "a", &[]);
        let e = pool.submit(spec(2, 2), |_| Ok(())).unwrap_err();
        assert_eq!(e.code(), tonic::Code::FailedPrecondition);
        assert!(
            e.message()
                .contains("at least 2 idle agents; 1 registered, 1 match, 1 of them idle"),
            "{}",
            e.message()
        );
        assert!(pool.list()[0].jobs.is_empty(), "nothing changed");
    }

    #[test]
    fn bad_specs_name_the_field() {
        let check = |mut f: Box<dyn FnMut(&mut pb::JobSpec)>, want: &str| {
            let mut s = spec(1, 1);
            f(&mut s);
            let e = check_spec(s, || "fresh".into()).unwrap_err();
            assert!(e.message().contains(want), "{} !~ {want}", e.message());
        };
        check(Box::new(|s| s.program.clear()), "program is empty");
        check(Box::new(|s| s.nproc_per_node = 0), "nproc_per_node 0");
        check(Box::new(|s| s.job_id = "bad id".into()), "job");
        check(
            Box::new(|s| {
                s.env.insert("1X".into(), "v".into());
            }),
            "env: '1X'",
        );
        check(
            Box::new(|s| s.max_nodes = model::MAX_NODES + 1),
            "max_nodes",
        );
        let filled = check_spec(
            pb::JobSpec {
                job_id: String::new(),
                ..spec(2, 0)
            },
            || "fresh".into(),
        )
        .unwrap();
        assert_eq!((filled.job_id.as_str(), filled.max_nodes), ("fresh", 2));
    }
}
