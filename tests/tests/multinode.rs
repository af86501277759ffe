//! Several hosts on one machine: the coordinator and one agent per node, each in a network
//! namespace of its own on a bridged veth network (`muster_tests::netns`), running real jobs
//! across the nodes; then one node is cut off (link down) or its agent is SIGKILLed, and the
//! others must fail fast naming it, or, with restarts, carry on as a smaller generation.
//! Needs root for `ip netns`; skipped with a printed reason otherwise.
//!
//! The coordinator listens on a non-loopback address, so it runs as a cluster should: mutual
//! TLS and the cluster token, and the agents hand their workers job tokens.

use muster_tests::cluster::Cluster;
use muster_tests::{Agent, Finished, SLOW, Stream, example_bin};
use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// The coordinator's heartbeat timeout in these tests (its default is 10 s).
const HEARTBEAT_TIMEOUT: Duration = Duration::from_secs(2);
/// Workers per node.
const NPROC: u32 = 2;
/// The coordinator's last-call window: a round with MIN nodes waits this long for more. Long
/// enough that three agents started together always make the first round of a `2:3` job.
const LAST_CALL: Duration = Duration::from_secs(2);
/// How long an agent keeps its workers without hearing from the coordinator (its default is
/// 10 s).
const LEASE: Duration = Duration::from_secs(3);
/// Room for scheduling on a loaded 2-core machine, on top of what the protocol needs.
const SLACK: Duration = Duration::from_secs(3);

/// The coordinator (heartbeat timeout [`HEARTBEAT_TIMEOUT`], [`LAST_CALL`]) in host `coord`
/// and hosts `n0`.. for the nodes, and the `barrier_loop` example's path; `None` when
/// namespaces are unavailable or the example is missing.
fn start(nodes: usize) -> Option<(Cluster, String)> {
    let Some(barrier_loop) = example_bin("barrier_loop") else {
        eprintln!("skipped: worker-sdk/examples/barrier_loop.rs does not exist");
        return None;
    };
    let timeout_ms = HEARTBEAT_TIMEOUT.as_millis().to_string();
    let last_call_ms = LAST_CALL.as_millis().to_string();
    let cluster = Cluster::start(
        nodes,
        &[
            "--heartbeat-timeout-ms",
            &timeout_ms,
            "--last-call-ms",
            &last_call_ms,
        ],
    )?;
    let barrier_loop = barrier_loop
        .to_str()
        .expect("a UTF-8 target path")
        .to_owned();
    Some((cluster, barrier_loop))
}

/// `muster-agent launch` on host `host` with `flags`, 2 workers of `sh -c script`.
fn agent(cluster: &Cluster, host: &str, job: &str, flags: &[&str], script: &str) -> Agent {
    agent_of(cluster, host, job, NPROC, flags, script)
}

/// [`agent`] with `nproc` workers.
fn agent_of(
    cluster: &Cluster,
    host: &str,
    job: &str,
    nproc: u32,
    flags: &[&str],
    script: &str,
) -> Agent {
    let nproc = nproc.to_string();
    let mut all = vec![
        "--nproc-per-node",
        &nproc,
        "--grace-period-ms",
        "1000",
        // These jobs check node 0's shared MASTER_ADDR:MASTER_PORT, which only the opt-out
        // has (with the agent store each node serves its own loopback port:
        // tests/tests/agent_store_ha.rs).
        "--no-agent-store",
    ];
    all.extend_from_slice(flags);
    cluster.agent(host, job, &all, &["sh", "-c", script], &[])
}

/// A worker script: one `ready` line with the environment the test checks, then
/// `barrier_loop` with `iters` iterations.
fn ready_then_loop(barrier_loop: &str, iters: &str) -> String {
    format!(
        "echo ready rank=$RANK local=$LOCAL_RANK node=$GROUP_RANK nodes=$GROUP_WORLD_SIZE \
         world=$WORLD_SIZE master=$MASTER_ADDR:$MASTER_PORT host=$MUSTER_HOST \
         gen=$MUSTER_GENERATION restarts=$TORCHELASTIC_RESTART_COUNT; \
         exec {barrier_loop} --iters {iters} --warmup 5"
    )
}

/// The `key=value` fields of a worker's `ready` line.
fn fields(line: &str) -> BTreeMap<String, String> {
    line.split_whitespace()
        .filter_map(|f| f.split_once('='))
        .map(|(k, v)| (k.to_owned(), v.to_owned()))
        .collect()
}

/// Waits for the `ready` lines of `agent`'s workers of generation `generation`.
fn ready(agent: &Agent, generation: u64) -> Vec<BTreeMap<String, String>> {
    ready_of(agent, generation, NPROC)
}

/// [`ready`] for an agent of `nproc` workers.
fn ready_of(agent: &Agent, generation: u64, nproc: u32) -> Vec<BTreeMap<String, String>> {
    let gen_field = format!(" gen={generation} ");
    agent
        .wait_for_lines(Stream::Stdout, nproc as usize, SLOW, |l| {
            l.contains("] ready ") && l.contains(&gen_field)
        })
        .iter()
        .map(|l| fields(l))
        .collect()
}

/// The node rank every `ready` line of one agent agrees on.
fn node_rank(lines: &[BTreeMap<String, String>]) -> u32 {
    let ranks: Vec<&str> = lines.iter().map(|f| f["node"].as_str()).collect();
    assert!(ranks.windows(2).all(|w| w[0] == w[1]), "{lines:?}");
    ranks[0].parse().expect("a numeric node rank")
}

/// Whether `line` names the lost node: its address (the host it advertised) or its node rank.
fn names_node(line: &str, addr: &str, node: u32) -> bool {
    line.contains(addr) || line.contains(&format!("node {node}"))
}

/// Both output streams of a finished run.
fn all_lines(run: &Finished) -> impl Iterator<Item = &String> {
    run.stdout.iter().chain(&run.stderr)
}

/// Three agents (2 workers each) on three hosts form one 6-rank job at a coordinator on a
/// fourth host: dense node ranks, contiguous global ranks, and MASTER_ADDR is node 0's veth
/// address for every worker.
#[test]
fn three_hosts_run_one_job() {
    let Some((cluster, barrier_loop)) = start(3) else {
        return;
    };
    let started = Instant::now();
    let script = ready_then_loop(&barrier_loop, "200");
    let agents: Vec<(String, Agent)> = (0..3)
        .map(|i| {
            let host = format!("n{i}");
            let agent = agent(&cluster, &host, "mn-three", &["--nnodes", "3"], &script);
            (host, agent)
        })
        .collect();
    let mut master = None;
    let mut by_node = BTreeMap::new();
    let mut runs = Vec::new();
    for (host, agent) in agents {
        let run = agent.finish(SLOW);
        assert_eq!(run.code(), Some(0), "{host}\n{}", run.dump());
        let addr = cluster.net.addr(&host).to_string();
        let lines: Vec<BTreeMap<String, String>> = run
            .stdout
            .iter()
            .filter(|l| l.contains("] ready "))
            .map(|l| fields(l))
            .collect();
        assert_eq!(lines.len(), NPROC as usize, "{host}\n{}", run.dump());
        let node = node_rank(&lines);
        for f in &lines {
            let rank: u32 = f["rank"].parse().expect("numeric RANK");
            let local: u32 = f["local"].parse().expect("numeric LOCAL_RANK");
            assert_eq!(rank, node * NPROC + local, "{host}: {f:?}");
            assert_eq!(f["nodes"], "3", "{host}: {f:?}");
            assert_eq!(f["world"], "6", "{host}: {f:?}");
            assert_eq!(f["host"], addr, "{host}: MUSTER_HOST");
            assert_eq!(f["gen"], "1", "{host}: {f:?}");
            let m = f["master"].clone();
            assert_eq!(master.get_or_insert(m.clone()), &m, "one MASTER_ADDR:PORT");
            // The barrier loop ran to its end on this rank.
            let done = format!("rank={rank} iters=200 ");
            assert!(
                run.rank_stdout(rank).iter().any(|l| l.starts_with(&done)),
                "{host}: rank {rank} did not finish its loop\n{}",
                run.dump()
            );
        }
        assert!(
            by_node.insert(node, addr).is_none(),
            "node rank {node} twice"
        );
        runs.push(run);
    }
    assert_eq!(by_node.keys().copied().collect::<Vec<_>>(), [0, 1, 2]);
    let master = master.expect("some worker ran");
    let (master_addr, master_port) = master.rsplit_once(':').expect("ADDR:PORT");
    assert_eq!(
        master_addr, by_node[&0],
        "MASTER_ADDR is node 0's veth address"
    );
    assert!(master_port.parse::<u16>().is_ok_and(|p| p > 0), "{master}");
    eprintln!(
        "3 hosts x {NPROC} workers, 200 barriers: {:?}; MASTER_ADDR:PORT {master}; p50 lines: {}",
        started.elapsed(),
        runs.iter()
            .flat_map(|r| r.stdout.iter().filter(|l| l.contains(" iters=200 ")))
            .cloned()
            .collect::<Vec<_>>()
            .join(" | ")
    );
}

/// Starts a 3-node job of endless barrier loops and waits until every worker runs; returns
/// the agents by host and each host's node rank.
fn endless_job(
    cluster: &Cluster,
    barrier_loop: &str,
    job: &str,
    flags: &[&str],
) -> (Vec<(String, Agent)>, BTreeMap<String, u32>) {
    let script = format!(
        "if [ \"$MUSTER_RESTART_COUNT\" = 0 ]; then {}; else {}; fi",
        ready_then_loop(barrier_loop, "100000000"),
        ready_then_loop(barrier_loop, "50"),
    );
    let agents: Vec<(String, Agent)> = (0..3)
        .map(|i| {
            let host = format!("n{i}");
            let agent = agent(cluster, &host, job, flags, &script);
            (host, agent)
        })
        .collect();
    let nodes = agents
        .iter()
        .map(|(host, agent)| (host.clone(), node_rank(&ready(agent, 1))))
        .collect();
    // Let the barrier loops get going across the nodes.
    std::thread::sleep(Duration::from_millis(500));
    (agents, nodes)
}

/// What a failure test measured.
struct Detection {
    /// From the fault to the last survivor's first line naming the lost node.
    noticed: Duration,
    /// From the fault to the last survivor's exit.
    exited: Duration,
    /// The first survivor's line naming the lost node.
    line: String,
    /// The lost node's agent (dead after a SIGKILL, partitioned after a cut).
    lost: Agent,
}

/// After a fault at `fault` on `lost` (node rank `node`), every other agent's workers must say
/// which node is gone within `notice_bound`, and the agents must exit 1 within `exit_bound`.
fn survivors_fail(
    cluster: &Cluster,
    agents: Vec<(String, Agent)>,
    lost: &str,
    node: u32,
    fault: Instant,
    notice_bound: Duration,
    exit_bound: Duration,
) -> Detection {
    let addr = cluster.net.addr(lost).to_string();
    let (lost_agent, survivors): (Vec<_>, Vec<_>) =
        agents.into_iter().partition(|(host, _)| host == lost);
    // First every survivor's first line naming the lost node (a line already there is found
    // at once, so the maximum is the last survivor's), then their exits.
    let mut noticed = Duration::ZERO;
    let mut named = Vec::new();
    for (_, agent) in &survivors {
        let wait = (fault + exit_bound).saturating_duration_since(Instant::now());
        named.push(
            agent
                .try_wait_for_lines(Stream::Stderr, 1, wait, |l| {
                    l.starts_with("[rank ") && names_node(l, &addr, node)
                })
                .ok()
                .and_then(|lines| lines.into_iter().next()),
        );
        noticed = noticed.max(fault.elapsed());
    }
    let line = named.iter().flatten().next().cloned().unwrap_or_default();
    let mut exited = Duration::ZERO;
    for ((host, agent), named) in survivors.into_iter().zip(named) {
        let run = agent.finish_by(fault + exit_bound + SLACK);
        exited = exited.max(fault.elapsed());
        assert!(
            named.is_some(),
            "{host}: no worker named the lost node {node} ({addr})\n{}\n--- coordinator\n{}",
            run.dump(),
            cluster.coordinator_process.output()
        );
        assert_eq!(run.code(), Some(1), "{host}\n{}", run.dump());
        assert!(
            all_lines(&run).any(|l| l.starts_with("muster-agent: job ") && l.contains(" failed")),
            "{host}: no failure summary\n{}",
            run.dump()
        );
    }
    assert!(
        noticed < notice_bound,
        "the lost node was noticed after {noticed:?} (bound {notice_bound:?})"
    );
    assert!(
        exited < exit_bound,
        "the survivors exited {exited:?} after the fault (bound {exit_bound:?})"
    );
    Detection {
        noticed,
        exited,
        line,
        lost: lost_agent
            .into_iter()
            .next()
            .expect("the lost host has an agent")
            .1,
    }
}

/// A node whose link goes down mid-job is noticed by the coordinator's heartbeat timeout: the
/// other nodes' workers fail naming it, and their agents exit 1 (no restarts by default). The
/// cut-off node learns it has lost the coordinator when its lease runs out, and stops its
/// workers too.
#[test]
fn a_node_cut_off_mid_job_fails_the_others_after_the_heartbeat_timeout() {
    let Some((cluster, barrier_loop)) = start(3) else {
        return;
    };
    let lease_ms = LEASE.as_millis().to_string();
    let (agents, nodes) = endless_job(
        &cluster,
        &barrier_loop,
        "mn-cut",
        &["--nnodes", "3", "--lease-ms", &lease_ms],
    );
    let lost = "n1";
    let cut = Instant::now();
    cluster.net.cut(lost);
    let d = survivors_fail(
        &cluster,
        agents,
        lost,
        nodes[lost],
        cut,
        HEARTBEAT_TIMEOUT + SLACK,
        HEARTBEAT_TIMEOUT + SLACK + Duration::from_secs(3),
    );
    eprintln!(
        "link of node {} cut: the other nodes' workers named it after {:?} and their agents exited after {:?} (heartbeat timeout {HEARTBEAT_TIMEOUT:?}): {}",
        nodes[lost], d.noticed, d.exited, d.line
    );
    let run = d.lost.finish_by(cut + LEASE + SLACK);
    assert_eq!(run.code(), Some(1), "the cut-off node\n{}", run.dump());
    assert!(
        run.stderr
            .iter()
            .any(|l| l
                .starts_with("muster-agent: job mn-cut failed: this node lost the coordinator")),
        "the cut-off node\n{}",
        run.dump()
    );
    eprintln!(
        "the cut-off node stopped its workers {:?} after the cut (lease {LEASE:?})",
        cut.elapsed()
    );
}

/// A node whose agent is SIGKILLed mid-job (its connections close at once) fails the other
/// nodes within a few seconds, whatever the heartbeat timeout.
#[test]
fn a_node_whose_agent_is_killed_fails_the_others_within_seconds() {
    let Some((cluster, barrier_loop)) = start(3) else {
        return;
    };
    let (agents, nodes) = endless_job(&cluster, &barrier_loop, "mn-kill", &["--nnodes", "3"]);
    let lost = "n2";
    let victim = &agents
        .iter()
        .find(|(host, _)| host == lost)
        .expect("the lost host has an agent")
        .1;
    let killed = Instant::now();
    victim.signal(nix::sys::signal::Signal::SIGKILL);
    let d = survivors_fail(
        &cluster,
        agents,
        lost,
        nodes[lost],
        killed,
        Duration::from_secs(3),
        Duration::from_secs(6),
    );
    eprintln!(
        "agent of node {} SIGKILLed: the other nodes' workers named it after {:?} and their agents exited after {:?}: {}",
        nodes[lost], d.noticed, d.exited, d.line
    );
}

/// An agent SIGKILLed with 8 workers in a barrier loop (issue 29): the coordinator learns of
/// it from the node's own stream, and the job fails once, for the lost node. Every worker of
/// the other node names that node and its agent as the cause; none names a worker's session
/// (its 8 workers' sessions ended too, but a session's end waits for the agent's more precise
/// word); the coordinator records one failure of the generation.
#[test]
fn an_agent_killed_with_eight_workers_mid_barrier_fails_the_job_once_naming_its_node() {
    let Some((cluster, barrier_loop)) = start(2) else {
        return;
    };
    let job = "mn-kill8";
    let script = ready_then_loop(&barrier_loop, "100000000");
    let agents: Vec<Agent> = ["n0", "n1"]
        .iter()
        .map(|host| agent_of(&cluster, host, job, 8, &["--nnodes", "2"], &script))
        .collect();
    let nodes: Vec<u32> = agents
        .iter()
        .map(|a| node_rank(&ready_of(a, 1, 8)))
        .collect();
    // Let the barrier loops get going across the nodes.
    std::thread::sleep(Duration::from_millis(500));
    let [survivor, victim] = <[Agent; 2]>::try_from(agents).unwrap_or_else(|_| unreachable!());
    let killed = Instant::now();
    victim.signal(nix::sys::signal::Signal::SIGKILL);
    let run = survivor.finish_by(killed + Duration::from_secs(6) + SLACK);
    let exited = killed.elapsed();
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    let addr = cluster.net.addr("n1").to_string();
    let failed: Vec<&String> = run
        .stderr
        .iter()
        .filter(|l| l.starts_with("[rank ") && l.contains(" failed: "))
        .collect();
    assert_eq!(failed.len(), 8, "one error per worker\n{}", run.dump());
    for line in &failed {
        assert!(
            names_node(line, &addr, nodes[1]) && line.contains("agent"),
            "{line}\n{}",
            run.dump()
        );
        assert!(!line.contains("session"), "{line}");
    }
    let summary = all_lines(&run)
        .find(|l| l.starts_with(&format!("muster-agent: job {job} failed")))
        .unwrap_or_else(|| panic!("no failure summary\n{}", run.dump()));
    assert!(
        names_node(summary, &addr, nodes[1]) && summary.contains("agent"),
        "{summary}"
    );
    let coordinator = cluster.coordinator_process.output();
    let failures = coordinator
        .lines()
        .filter(|l| l.contains(&format!("of job '{job}' generation 1 failed")))
        .count();
    assert_eq!(failures, 1, "{coordinator}");
    eprintln!(
        "agent of node {} SIGKILLed with 8 workers: the other node's agent exited after {exited:?}: {}",
        nodes[1], failed[0]
    );
}

/// With `--max-restarts 1` and `--nnodes 2:3`, cutting one of three nodes makes the other two
/// re-rendezvous as generation 2 (4 ranks, MASTER_ADDR on the new node 0) and finish, within
/// the heartbeat timeout, the last-call window and some slack.
#[test]
fn survivors_of_a_cut_node_restart_as_a_smaller_generation_and_finish() {
    let Some((cluster, barrier_loop)) = start(3) else {
        return;
    };
    let (agents, nodes) = endless_job(
        &cluster,
        &barrier_loop,
        "mn-restart",
        &["--nnodes", "2:3", "--max-restarts", "1"],
    );
    let lost = "n0";
    let cut = Instant::now();
    cluster.net.cut(lost);
    let bound = HEARTBEAT_TIMEOUT + LAST_CALL + SLACK;
    let (lost_agent, survivors): (Vec<_>, Vec<_>) =
        agents.into_iter().partition(|(host, _)| host == lost);
    let mut second = BTreeMap::new();
    let mut masters = Vec::new();
    for (host, agent) in survivors {
        let lines = ready(&agent, 2);
        let run = agent.finish_by(cut + bound);
        assert_eq!(run.code(), Some(0), "{host}\n{}", run.dump());
        let addr = cluster.net.addr(&host).to_string();
        for f in &lines {
            assert_eq!(f["world"], "4", "{host}: {f:?}");
            assert_eq!(f["nodes"], "2", "{host}: {f:?}");
            assert_eq!(f["restarts"], "1", "{host}: {f:?}");
            assert_eq!(f["host"], addr, "{host}: MUSTER_HOST");
            masters.push(f["master"].clone());
        }
        assert!(
            run.stdout.iter().any(|l| l.contains(" iters=50 ")),
            "{host}: generation 2 did not finish its loop\n{}",
            run.dump()
        );
        second.insert(node_rank(&lines), addr);
    }
    let finished = cut.elapsed();
    assert_eq!(
        second.keys().copied().collect::<Vec<_>>(),
        [0, 1],
        "{second:?}"
    );
    masters.dedup();
    assert_eq!(
        masters.len(),
        1,
        "one MASTER_ADDR:PORT in generation 2: {masters:?}"
    );
    assert!(
        masters[0].starts_with(&format!("{}:", second[&0])),
        "generation 2's MASTER_ADDR is its node 0's address: {masters:?} {second:?}"
    );
    drop(lost_agent);
    eprintln!(
        "node {} cut: the other two finished as generation 2 after {finished:?} (heartbeat timeout {HEARTBEAT_TIMEOUT:?}, last call {LAST_CALL:?})",
        nodes[lost]
    );
}
