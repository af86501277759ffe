//! Joining a job's rendezvous round as one node, and settling the generation's MASTER_PORT
//! when the workers use rank 0's own TCPStore (`--no-agent-store`).

use super::LaunchError;
use crate::env::{NodeAssignment, Recovery};
use crate::failover::{self, Coordinators};
use crate::spec::LaunchSpec;
use muster_proto::v1 as pb;
use muster_proto::v1::key_value_client::KeyValueClient;
use muster_proto::v1::rendezvous_client::RendezvousClient;
use std::time::{Duration, Instant};

/// How long a node other than node 0 waits for node 0's MASTER_PORT.
const MASTER_PORT_WAIT: Duration = Duration::from_secs(60);

/// Joins the round and settles MASTER_PORT. Cancel-safe: dropping it withdraws the join
/// (the coordinator sees the call go away).
///
/// The join carries a request id of its own; when it fails retryably (a follower's refusal,
/// a coordinator that died during the long poll) the same request, with the same id, goes to
/// the leader again within the failover budget, and a round that closed meanwhile gives this
/// node the place it already had.
pub(super) async fn join(
    spec: &LaunchSpec,
    coordinators: &Coordinators,
    host: &str,
    node_id: &str,
) -> Result<NodeAssignment, LaunchError> {
    // 0 on the wire means "the coordinator's default": an explicit zero is sent as 1 ms.
    let millis = |d: Option<Duration>| {
        d.map_or(0, |d| {
            u64::try_from(d.as_millis()).unwrap_or(u64::MAX).max(1)
        })
    };
    let request = pb::JoinRequest {
        job_id: spec.job_id.clone(),
        node_id: node_id.to_owned(),
        host: host.to_owned(),
        local_world_size: spec.nproc_per_node,
        requested_node_rank: spec.node_rank,
        config: Some(pb::RendezvousConfig {
            min_nodes: spec.nodes.min,
            max_nodes: spec.nodes.max,
            last_call_ms: millis(spec.last_call),
            join_timeout_ms: millis(spec.join_timeout),
            max_restarts: Some(spec.max_restarts),
            recovery: spec.recovery.to_wire(),
            hang_timeout_ms: Some(spec.hang.timeout_ms()),
            on_hang: spec.hang.action.to_wire(),
            max_spares: Some(spec.max_spares),
        }),
        request_id: failover::request_id(),
        watches: true,
        spare: spec.spare,
    };
    let join_error = |status| LaunchError::Join {
        job: spec.job_id.clone(),
        status,
    };
    // A running generation with every node it can take refuses the join. Wait as a spare for
    // a while: an agent restarted after a crash its coordinator has not noticed yet (a host
    // that lost power, a cut link) replaces its old node once the coordinator declares that
    // node lost (the heartbeat timeout) and opens the next round. A second agent started on
    // a job id that is in use gets the refusal after the wait.
    let mut spare = SpareWait::new(Instant::now());
    let mut said = false;
    let answer = loop {
        let asked = Instant::now();
        let answer = failover::call(coordinators, "Rendezvous.Join", |channel| {
            let request = request.clone();
            async move { RendezvousClient::new(channel).join(request).await }
        })
        .await;
        match answer {
            Err(status)
                if status.code() == tonic::Code::FailedPrecondition
                    && status.message().contains("the job is full")
                    && spare.refused(asked, Instant::now(), &coordinators.leader_addr()) =>
            {
                if !said && !spec.quiet {
                    eprintln!(
                        "muster-agent: job {}: every node of the running generation is taken; waiting up to {} s as a spare, in case one of them is lost (a restarted agent replaces its old node; a coordinator failover starts the wait again)",
                        spec.job_id,
                        FULL_JOB_WAIT.as_secs()
                    );
                }
                said = true;
                tokio::time::sleep(FULL_JOB_RETRY).await;
            }
            answer => break answer.map_err(join_error)?.into_inner(),
        }
    };
    if answer.local_world_size != spec.nproc_per_node {
        return Err(join_error(tonic::Status::internal(format!(
            "the coordinator assigned {} workers to this node, which runs {}",
            answer.local_world_size, spec.nproc_per_node
        ))));
    }
    let epoch = match &answer.took_over {
        Some(t) => {
            if !spec.quiet {
                eprintln!(
                    "muster-agent: job {}: this spare takes node {}'s place (ranks {}-{}, membership epoch {}): node '{}' (host {}) was lost: {}",
                    spec.job_id,
                    answer.node_rank,
                    answer.rank_offset,
                    answer.rank_offset + answer.local_world_size - 1,
                    t.epoch,
                    t.node_id,
                    t.host,
                    t.reason
                );
            }
            t.epoch
        }
        None => 0,
    };
    let recovery = Recovery::from_answer(answer.recovery);
    if recovery != spec.recovery && !spec.quiet {
        // Only a coordinator that predates in-place recovery answers so (it leaves the field
        // unset); one that knows it refuses a join whose mode differs from the job's.
        eprintln!(
            "muster-agent: job {}: the coordinator runs this job with --recovery {recovery}, not {} (it does not support in-place recovery)",
            spec.job_id, spec.recovery
        );
    }
    let master_port = match spec.master_port {
        // With the agent store each node serves its own loopback port, set once the store
        // has started ([`super::start_store`]): there is nothing to share.
        _ if spec.agent_store => 0,
        Some(port) => port,
        None => {
            master_port(coordinators, &answer)
                .await
                .map_err(|why| LaunchError::MasterPort {
                    job: spec.job_id.clone(),
                    why,
                })?
        }
    };
    let node = NodeAssignment {
        coordinator: coordinators.addr().to_owned(),
        failover_timeout: coordinators.failover_timeout(),
        job_id: answer.job_id,
        node_id: node_id.to_owned(),
        generation: answer.generation,
        node_rank: answer.node_rank,
        num_nodes: answer.num_nodes,
        rank_offset: answer.rank_offset,
        local_world_size: answer.local_world_size,
        world_size: answer.world_size,
        restart_count: answer.restart_count,
        max_restarts: answer.max_restarts,
        recovery,
        // A spare's workers are all replacements, in the epoch that gave it the place.
        epoch,
        host: host.to_owned(),
        master_addr: spec.master_addr.clone().unwrap_or(answer.master_host),
        master_port,
        agent_socket: None,
        error_dir: None,
        flight_dir: None,
    };
    Ok(node)
}

/// How long a join refused because the running generation is full is retried, counted from
/// the first refusal by the coordinator leading now (the coordinator's default heartbeat
/// timeout, 10 s, plus a restart round).
const FULL_JOB_WAIT: Duration = Duration::from_secs(15);
/// How often it is retried meanwhile.
const FULL_JOB_RETRY: Duration = Duration::from_secs(1);
/// A refusal that took longer than this to come went through a failover (a refusal by the
/// leader takes milliseconds; a follower's redirect takes one backoff step).
const FAILED_OVER: Duration = Duration::from_secs(1);

/// The spare's wait for a node of the running generation to be declared lost.
///
/// A leader declares a silent node lost one heartbeat timeout after its last word, and a new
/// leader gives every node of the job one heartbeat timeout to re-attach from when it took
/// over (docs/ha.md). So the wait counts from the first refusal by the leader of now: a
/// refusal from another address, or one that came only after the call failed over (the
/// same replica may lead again after an etcd outage), starts it again. Before, the wait ran
/// from the agent's first try, and a failover during it (or an etcd outage, when nobody
/// leads) used it up: the restarted agent gave up ("the job is full") while its old node was
/// still in its re-attach window, and the job was lost with restarts left.
#[derive(Debug)]
struct SpareWait {
    /// When the wait ends.
    until: Instant,
    /// The address of the last refusal.
    leader: Option<String>,
}

impl SpareWait {
    fn new(now: Instant) -> Self {
        SpareWait {
            until: now + FULL_JOB_WAIT,
            leader: None,
        }
    }

    /// A join asked at `asked` was refused at `now` by `addr` because the job is full:
    /// whether to go on waiting.
    fn refused(&mut self, asked: Instant, now: Instant, addr: &str) -> bool {
        let failed_over = now.saturating_duration_since(asked) > FAILED_OVER;
        if failed_over || self.leader.as_deref().is_some_and(|l| l != addr) {
            self.until = now + FULL_JOB_WAIT;
        }
        self.leader = Some(addr.to_owned());
        now < self.until
    }
}

/// MASTER_PORT: node 0 finds a free port (bind :0, close) and, in a multi-node job, shares it
/// through the job's key-value store; the other nodes read it from there.
async fn master_port(
    coordinators: &Coordinators,
    answer: &pb::JoinResponse,
) -> Result<u16, String> {
    let key = format!("muster/master_port/gen{}", answer.generation);
    if answer.node_rank == 0 {
        let port = std::net::TcpListener::bind(("0.0.0.0", 0))
            .and_then(|l| l.local_addr())
            .map_err(|e| format!("no free port: {e}"))?
            .port();
        if answer.num_nodes > 1 {
            let request = pb::SetRequest {
                job_id: answer.job_id.clone(),
                key,
                value: port.to_string().into_bytes(),
                // One writer per generation's key: a retry applied twice changes nothing.
                ..Default::default()
            };
            failover::call(coordinators, "KeyValue.Set", |channel| {
                let request = request.clone();
                async move { KeyValueClient::new(channel).set(request).await }
            })
            .await
            .map_err(|s| crate::security::explain(&s))?;
        }
        return Ok(port);
    }
    let request = pb::GetRequest {
        job_id: answer.job_id.clone(),
        key: key.clone(),
        wait_ms: u64::try_from(MASTER_PORT_WAIT.as_millis()).unwrap_or(u64::MAX),
    };
    let value = failover::call(coordinators, "KeyValue.Get", |channel| {
        let request = request.clone();
        async move { KeyValueClient::new(channel).get(request).await }
    })
    .await
    .map_err(|s| {
        format!(
            "node 0 did not publish it: {}",
            crate::security::explain(&s)
        )
    })?
    .into_inner()
    .value;
    std::str::from_utf8(&value)
        .ok()
        .and_then(|s| s.parse::<u16>().ok())
        .ok_or_else(|| format!("node 0 published a malformed port under '{key}'"))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    const MS: Duration = Duration::from_millis(1);

    #[test]
    fn a_full_job_is_waited_for_from_the_first_refusal() {
        let t0 = Instant::now();
        let mut spare = SpareWait::new(t0);
        let mut t = t0;
        while t < t0 + FULL_JOB_WAIT - MS {
            assert!(spare.refused(t, t + 5 * MS, "a:1"));
            t += FULL_JOB_RETRY;
        }
        assert!(!spare.refused(t0 + FULL_JOB_WAIT, t0 + FULL_JOB_WAIT + 5 * MS, "a:1"));
    }

    #[test]
    fn a_new_leader_starts_the_wait_again() {
        let t0 = Instant::now();
        let mut spare = SpareWait::new(t0);
        assert!(spare.refused(t0, t0 + 5 * MS, "a:1"));
        // 14 s later another replica leads (the redirect took one backoff step).
        let t = t0 + Duration::from_secs(14);
        assert!(spare.refused(t, t + 60 * MS, "b:2"));
        // The old wait would have ended at 15 s; the new one runs to 29 s.
        let late = t0 + Duration::from_secs(28);
        assert!(spare.refused(late, late + 5 * MS, "b:2"));
        let end = t0 + Duration::from_secs(30);
        assert!(!spare.refused(end, end + 5 * MS, "b:2"));
    }

    #[test]
    fn a_refusal_after_a_failover_starts_the_wait_again() {
        // The same replica leads again after an etcd outage that held the call for 40 s.
        let t0 = Instant::now();
        let mut spare = SpareWait::new(t0);
        assert!(spare.refused(t0, t0 + 5 * MS, "a:1"));
        let asked = t0 + Duration::from_secs(2);
        let answered = asked + Duration::from_secs(40);
        assert!(spare.refused(asked, answered, "a:1"));
        let later = answered + Duration::from_secs(14);
        assert!(spare.refused(later, later + 5 * MS, "a:1"));
        let end = answered + Duration::from_secs(16);
        assert!(!spare.refused(end, end + 5 * MS, "a:1"));
    }
}
