//! How the operator's commands (`submit`, `status`, `cancel`, `describe`) reach the
//! coordinator: one connection over the replica list with the command's TLS and token, and
//! the `Ops.DescribeJob` call they read a job through.

use crate::failover::{self, Coordinators};
use crate::security::SecurityArgs;
use muster_proto::v1 as pb;
use muster_proto::v1::ops_client::OpsClient;
use std::time::Duration;

/// How long an operator command or a registration tries to reach any replica.
pub(crate) const CONNECT_WINDOW: Duration = Duration::from_secs(2);

/// How long one long poll of `submit --wait` may wait for a change of the job.
const FOLLOW_WAIT: Duration = Duration::from_secs(5);

/// The replicas of a `--coordinator` value, one of them reached (tried in turn for a few
/// seconds) with `security`; calls then follow the leader with [`failover::call`].
pub(crate) async fn connect(list: &str, security: &SecurityArgs) -> Result<Coordinators, String> {
    let list = crate::cli::coordinator_list(list).map_err(|e| e.to_string())?;
    let security = security.resolve()?;
    let coordinators = failover::from_list(&list, failover::DEFAULT_BUDGET)
        .with_security(security.client().clone());
    failover::connect(&coordinators, CONNECT_WINDOW)
        .await
        .map_err(|e| e.to_string())?;
    Ok(coordinators)
}

/// `Ops.DescribeJob` on the leader; with `unless`, a long poll that answers once the job's
/// summary differs from it (or after [`FOLLOW_WAIT`]).
pub(crate) async fn describe(
    coordinators: &Coordinators,
    job_id: &str,
    unless: Option<pb::JobSummary>,
) -> Result<pb::DescribeJobResponse, tonic::Status> {
    let request = pb::DescribeJobRequest {
        job_id: job_id.to_owned(),
        wait_ms: if unless.is_some() {
            FOLLOW_WAIT.as_millis() as u64
        } else {
            0
        },
        unless,
    };
    failover::call(coordinators, "Ops.DescribeJob", |ch| {
        let request = request.clone();
        async move { OpsClient::new(ch).describe_job(request).await }
    })
    .await
    .map(tonic::Response::into_inner)
}

/// `Ops.DumpStacks` on the leader: every rank's stacks, grouped.
pub(crate) async fn dump_stacks(
    coordinators: &Coordinators,
    request: pb::DumpStacksRequest,
) -> Result<pb::DumpStacksResponse, tonic::Status> {
    failover::call(coordinators, "Ops.DumpStacks", |ch| {
        let request = request.clone();
        async move { OpsClient::new(ch).dump_stacks(request).await }
    })
    .await
    .map(tonic::Response::into_inner)
}

/// The first words operators read about a job, in `status` and `describe` alike: `job J:
/// STATE[ (over)], generation G, N nodes, W <unit>, restarts R/M`.
pub(crate) fn job_headline(s: &pb::JobSummary, unit: &str) -> String {
    let state = pb::RoundState::try_from(s.state)
        .unwrap_or_default()
        .as_str_name()
        .trim_start_matches("ROUND_STATE_")
        .to_lowercase();
    format!(
        "job {}: {state}{}, generation {}, {} nodes, {} {unit}, restarts {}/{}",
        s.job_id,
        if s.done { " (over)" } else { "" },
        s.generation,
        s.num_nodes,
        s.world_size,
        s.restart_count,
        s.max_restarts
    )
}
