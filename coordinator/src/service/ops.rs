//! `muster.v1.Ops`: the operator's views (job list, `DescribeJob` with its long poll) and
//! actions (submit, cancel, drain).

use super::*;

/// The longest `DescribeJob` long poll (`wait_ms`).
const DESCRIBE_WAIT_MAX: Duration = Duration::from_secs(60);

/// The daemon agent that runs a node: the agent whose id is the node id (daemon agents join
/// under their agent id), else, for an agent that joined under another id, the only agent of
/// the job at the node's address. Agents sharing an address (several on one machine, or behind
/// one NAT) are told apart by id alone: guessing by address would show another node's labels.
fn machine_of<'a>(
    machines: &'a [pb::MachineInfo],
    node_id: &str,
    host: &str,
) -> Option<&'a pb::MachineInfo> {
    if let Some(m) = machines.iter().find(|m| m.agent_id == node_id) {
        return Some(m);
    }
    let mut at_host = machines.iter().filter(|m| m.address == host);
    match (at_host.next(), at_host.next()) {
        (Some(m), None) => Some(m),
        _ => None,
    }
}

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
            if let Some(m) = machine_of(&machines, &node.node_id, &node.host) {
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
        let Cancel { reason } = Cancel::try_from(&r)?;
        let cancelled = job.cancel(&reason);
        self.0.pool.cancel(&r.job_id, &reason);
        Ok(Response::new(pb::CancelJobResponse { cancelled }))
    }

    async fn dump_stacks(
        &self,
        request: Request<pb::DumpStacksRequest>,
    ) -> Rpc<pb::DumpStacksResponse> {
        let r = request.into_inner();
        let job = self.0.job(&r.job_id)?;
        let ask = StackDump {
            full: r.full,
            native: r.native,
        };
        Ok(Response::new(job.dump_stacks(ask).await?))
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
        let r = request.into_inner();
        let job = self.0.job(&r.job_id)?;
        let job_id = r.job_id.clone();
        let Drain { node, reason } = Drain::try_from(r)?;
        let drained = job.drain(&node, &reason)?;
        self.0.pool.drained(&job_id, &drained.node_id);
        Ok(Response::new(drained.into()))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn machine(id: &str, address: &str) -> pb::MachineInfo {
        pb::MachineInfo {
            agent_id: id.into(),
            address: address.into(),
            ..Default::default()
        }
    }

    /// A submitted job's recovery mode is the job's: its agents' joins then agree with it.
    #[tokio::test]
    async fn a_submitted_job_takes_the_specs_recovery_mode() {
        let c = Coordinator::new(
            crate::Config::default(),
            Arc::new(crate::MemoryStore::default()),
        );
        let spec = |id: &str, recovery: pb::RecoveryMode| pb::JobSpec {
            job_id: id.into(),
            program: "/bin/true".into(),
            min_nodes: 1,
            max_nodes: 1,
            nproc_per_node: 1,
            recovery: recovery as i32,
            ..Default::default()
        };
        c.create_job(&spec("inplace", pb::RecoveryMode::InPlace))
            .unwrap();
        c.create_job(&spec("default", pb::RecoveryMode::Unspecified))
            .unwrap();
        let mode = |id: &str| c.job(id).unwrap().describe().config.unwrap().recovery;
        assert_eq!(mode("inplace"), pb::RecoveryMode::InPlace as i32);
        assert_eq!(mode("default"), pb::RecoveryMode::Restart as i32);
        let bad = pool::check_spec(
            pb::JobSpec {
                recovery: 5,
                ..spec("bad", pb::RecoveryMode::Restart)
            },
            || "fresh".into(),
        )
        .unwrap_err();
        assert_eq!(bad.code(), tonic::Code::InvalidArgument);
        assert!(
            bad.message().contains("recovery 5 is not a recovery mode"),
            "{bad:?}"
        );
    }

    /// A node's machine is found by its id; by address only when no other agent of the job
    /// shares that address (two agents on one machine once both showed the first one's labels).
    #[test]
    fn a_node_is_matched_to_its_machine_by_agent_id() {
        let shared = [machine("b", "10.0.0.1"), machine("c", "10.0.0.1")];
        let alone = [machine("b", "10.0.0.1"), machine("d", "10.0.0.2")];
        for (machines, node_id, host, expected) in [
            (&shared[..], "c", "10.0.0.1", Some("c")),
            (&shared[..], "b", "10.0.0.1", Some("b")),
            (&shared[..], "old-style-id", "10.0.0.1", None),
            (&alone[..], "old-style-id", "10.0.0.2", Some("d")),
            (&alone[..], "old-style-id", "10.0.0.9", None),
        ] {
            assert_eq!(
                machine_of(machines, node_id, host).map(|m| m.agent_id.as_str()),
                expected,
                "{node_id} at {host}"
            );
        }
    }
}
