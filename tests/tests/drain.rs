//! Draining a node with the real `muster-agent launch`: three agents of one job (nodes 2:3)
//! on a coordinator process; `Ops.DrainNode` stops one agent's workers, that agent exits 0
//! saying it was drained, and the other two carry on as generation 2 with two nodes and no
//! restart counted.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_proto::v1 as pb;
use muster_tests::coordinator::Coordinator;
use muster_tests::{Agent, SLOW, Stream};
use pb::ops_client::OpsClient;

fn agent(coordinator: &str, job: &str) -> Agent {
    Agent::start(&[
        "launch",
        "--coordinator",
        coordinator,
        "--job-id",
        job,
        "--nnodes",
        "2:3",
        "--nproc-per-node",
        "1",
        "--grace-period-ms",
        "1000",
        "--last-call-ms",
        "500",
        "--",
        "sh",
        "-c",
        "echo ready gen=$MUSTER_GENERATION nodes=$GROUP_WORLD_SIZE restart=$TORCHELASTIC_RESTART_COUNT; exec sleep 60",
    ])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drained_agent_exits_0_and_the_others_continue_as_a_smaller_generation() {
    let c = Coordinator::start(&[]);
    let job = "drain-e2e";
    let mut agents: Vec<Agent> = (0..3).map(|_| agent(&c.addr, job)).collect();
    for a in &agents {
        a.wait_for_lines(Stream::Stdout, 1, SLOW, |l| {
            l.contains("ready gen=1 nodes=3")
        });
    }
    let mut ops = OpsClient::connect(format!("http://{}", c.addr))
        .await
        .unwrap();
    let d = ops
        .describe_job(pb::DescribeJobRequest {
            job_id: job.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.nodes.len(), 3);
    // Node ids end in the agent's pid: drain node rank 1 and find its agent.
    let node = &d.nodes[1];
    let pos = agents
        .iter()
        .position(|a| node.node_id.ends_with(&format!("-{}", a.pid())))
        .unwrap_or_else(|| panic!("no agent for node {node:?}"));
    let resp = ops
        .drain_node(pb::DrainNodeRequest {
            job_id: job.into(),
            node: Some(pb::drain_node_request::Node::NodeRank(1)),
            reason: "kernel upgrade".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!((resp.generation, resp.remaining_nodes), (1, 2));
    let drained = agents.remove(pos).finish(SLOW);
    assert_eq!(drained.code(), Some(0), "{}", drained.dump());
    assert!(
        drained.stderr.iter().any(|l| l.contains("was drained")
            && l.contains("kernel upgrade")
            && l.contains("leaves the job (exit 0)")),
        "{}",
        drained.dump()
    );
    for a in &agents {
        a.wait_for_lines(Stream::Stdout, 1, SLOW, |l| {
            l.contains("ready gen=2 nodes=2 restart=0")
        });
        // How long the membership change took, named as one: not "after the failure", and no
        // restart number (issue 19).
        a.wait_for_lines(Stream::Stderr, 1, SLOW, |l| {
            l.contains("generation 2 running 1 worker on node")
                && l.contains(
                    "ms after generation 1 of job 'drain-e2e' was superseded by generation 2",
                )
                && l.contains("kernel upgrade")
        });
        assert!(!a.output().contains("after the failure"), "{}", a.output());
    }
    let d = ops
        .describe_job(pb::DescribeJobRequest {
            job_id: job.into(),
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(d.restart_count, 0, "a drain is not a restart");
    assert_eq!(d.nodes.len(), 2);
    assert!(d.drained.contains_key(&node.node_id));
    // Below min_nodes (2 of 2 left): refused.
    let err = ops
        .drain_node(pb::DrainNodeRequest {
            job_id: job.into(),
            node: Some(pb::drain_node_request::Node::NodeRank(0)),
            reason: String::new(),
        })
        .await
        .unwrap_err();
    assert_eq!(err.code(), tonic::Code::FailedPrecondition, "{err:?}");
    ops.cancel_job(pb::CancelJobRequest {
        job_id: job.into(),
        reason: "test over".into(),
    })
    .await
    .unwrap();
    for a in agents {
        let run = a.finish(SLOW);
        // A cancelled job's agents exit 3 (cancel.rs tests that in full).
        assert_eq!(run.code(), Some(3), "{}", run.dump());
    }
}
