//! An operator's cancel is its own final state, with its reason, everywhere (issue 19, item 1),
//! with real agents and a real coordinator process: `muster-agent cancel` (or
//! `Ops.CancelJob`) ends the job ROUND_STATE_CANCELLED with "cancelled by an operator:
//! <reason>" in DescribeJob, ListJobs, `muster-agent status`, the metrics and every agent's
//! log, and the agents and `submit --wait` exit 3. Before, the job ended FAILED with "rank 0
//! ... was lost: its agent disconnected", the reason was gone and `submit --wait` exited 1.
//! Also: launch mode (workers with SDK sessions), daemon mode (whose nodes show their own
//! machine's labels when agents share an address, item 4), a cancel while the round is open
//! (`status` says a node is not ranked yet, item 5), and the etcd store, where the final state
//! survives the leader's death.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_proto::v1 as pb;
use muster_tests::coordinator::Coordinator;
use muster_tests::etcd::Etcd;
use muster_tests::replicas::Replicas;
use muster_tests::{Agent, SLOW, Stream, agent_bin, example_bin};
use pb::ops_client::OpsClient;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const REASON: &str = "bad learning rate";
const SAID: &str = "cancelled by an operator: bad learning rate";

fn cli(args: &[&str]) -> Output {
    Command::new(agent_bin())
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("muster-agent runs")
}

fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

/// `Ops.DescribeJob`, retried while the coordinator answers UNAVAILABLE (a new leader still
/// loading) or NOT_FOUND (no agent joined yet); with `unless`, a long poll that answers at the job's next change or after `wait`.
async fn describe(
    addr: &str,
    job: &str,
    unless: Option<pb::JobSummary>,
    wait: Duration,
) -> pb::DescribeJobResponse {
    let deadline = Instant::now() + SLOW;
    loop {
        let request = pb::DescribeJobRequest {
            job_id: job.into(),
            wait_ms: u64::try_from(wait.as_millis()).unwrap(),
            unless: unless.clone(),
        };
        let answer = match OpsClient::connect(format!("http://{addr}")).await {
            Ok(mut ops) => ops.describe_job(request).await,
            Err(e) => Err(tonic::Status::unavailable(e.to_string())),
        };
        match answer {
            Ok(r) => return r.into_inner(),
            // Unavailable: a leader still loading; NotFound: no agent has joined it yet.
            Err(s)
                if matches!(s.code(), tonic::Code::Unavailable | tonic::Code::NotFound)
                    && Instant::now() < deadline =>
            {
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(s) => panic!("DescribeJob({job}) at {addr}: {s:?}"),
        }
    }
}

/// Polls DescribeJob until `ready` holds.
fn wait_until(
    addr: &str,
    job: &str,
    what: &str,
    ready: impl Fn(&pb::DescribeJobResponse) -> bool,
) -> pb::DescribeJobResponse {
    let rt = runtime();
    let deadline = Instant::now() + SLOW;
    loop {
        let d = rt.block_on(describe(addr, job, None, Duration::ZERO));
        if ready(&d) {
            return d;
        }
        assert!(Instant::now() < deadline, "never {what}: {d:#?}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Every rank has a session, or (workers without the SDK) the generation runs.
fn running(d: &pb::DescribeJobResponse, sessions: bool) -> bool {
    d.summary.as_ref().is_some_and(|s| {
        s.state == pb::RoundState::Running as i32
            && (!sessions
                || (!d.ranks.is_empty()
                    && d.ranks
                        .iter()
                        .all(|r| r.state != pb::RankState::Pending as i32)))
    })
}

/// The job as the operator left it: CANCELLED with the reason, no failure, no failed rank;
/// and it stays so (a long poll that answers at the job's next change sees none).
fn check_cancelled(addr: &str, job: &str, logs: &dyn Fn() -> String) {
    let rt = runtime();
    let d = rt.block_on(describe(addr, job, None, Duration::ZERO));
    let s = d.summary.clone().unwrap();
    assert_eq!(
        s.state,
        pb::RoundState::Cancelled as i32,
        "{d:#?}\n{}",
        logs()
    );
    assert!(s.done, "{s:?}");
    assert_eq!(s.reason, SAID, "{s:?}");
    assert!(d.failure.is_none(), "{:?}\n{}", d.failure, logs());
    for r in &d.ranks {
        // A worker whose wait ended with the cancel may leave its session cleanly first.
        if r.state != pb::RankState::Left as i32 {
            assert_eq!(r.state, pb::RankState::Cancelled as i32, "{r:?}");
            assert!(r.activity.contains(SAID), "{r:?}");
        }
    }
    for n in &d.nodes {
        assert_eq!(n.state, pb::NodeState::Cancelled as i32, "{n:?}");
    }
    let later = rt.block_on(describe(
        addr,
        job,
        d.summary.clone(),
        Duration::from_secs(2),
    ));
    assert_eq!(later.summary, d.summary, "the final state changed");
    assert!(later.failure.is_none(), "{:?}", later.failure);
    // The job list says the same.
    let listed = rt
        .block_on(async {
            OpsClient::connect(format!("http://{addr}"))
                .await
                .unwrap()
                .list_jobs(pb::ListJobsRequest {})
                .await
        })
        .unwrap()
        .into_inner();
    let mine = listed.jobs.iter().find(|j| j.job_id == job).unwrap();
    assert_eq!(Some(mine), d.summary.as_ref());
}

/// One HTTP/1.0 GET over plain TCP; the body.
fn scrape(addr: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).unwrap();
    s.write_all(b"GET /metrics HTTP/1.0\r\nHost: x\r\n\r\n")
        .unwrap();
    let mut out = String::new();
    s.read_to_string(&mut out).unwrap();
    out.split_once("\r\n\r\n").unwrap().1.to_owned()
}

fn free_addr() -> String {
    format!("127.0.0.1:{}", muster_tests::free_port())
}

#[test]
fn a_cancelled_launch_ends_cancelled_with_its_reason_and_its_agents_exit_3() {
    let Some(worker) = example_bin("barrier_loop") else {
        eprintln!("skipped: the barrier_loop example is not built (cargo build --examples)");
        return;
    };
    let worker = worker.to_str().unwrap().to_owned();
    let metrics = free_addr();
    let c = Coordinator::start(&["--metrics-addr", &metrics]);
    let job = "cancel-launch";
    // Workers with sessions and barriers (the SDK), two nodes.
    let agents: Vec<Agent> = (0..2)
        .map(|_| {
            Agent::start_with_env(
                &[
                    "launch",
                    "--coordinator",
                    &c.addr,
                    "--job-id",
                    job,
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    "1",
                    "--grace-period-ms",
                    "2000",
                    "--",
                    &worker,
                    "--iters",
                    "1000000000",
                ],
                &[("NO_COLOR", "1")],
            )
        })
        .collect();
    wait_until(&c.addr, job, "running with sessions", |d| running(d, true));
    let out = cli(&["cancel", "--coordinator", &c.addr, "--reason", REASON, job]);
    assert!(out.status.success(), "{out:?}");
    assert_eq!(stdout(&out).trim(), format!("job {job} cancelled"));
    let deadline = Instant::now() + SLOW;
    for agent in agents {
        let run = agent.finish_by(deadline);
        assert_eq!(run.code(), Some(3), "{}", run.dump());
        assert!(
            run.stderr.iter().any(|l| l.contains(&format!(
                "job {job}: {SAID}; workers stopped, exiting with status 3"
            ))),
            "{}",
            run.dump()
        );
        // The agent's own lines (the workers' are prefixed by rank) name no failure.
        assert!(
            !run.stderr.iter().any(|l| l.starts_with("muster-agent:")
                && (l.contains("failed") || l.contains("joining again"))),
            "{}",
            run.dump()
        );
    }
    // Both agents are gone (their watches and sessions dropped): nothing turned it FAILED.
    check_cancelled(&c.addr, job, &String::new);
    let status = stdout(&cli(&["status", "--coordinator", &c.addr, job]));
    assert!(
        status.starts_with(&format!("job {job}: cancelled (over), generation 1")),
        "{status}"
    );
    assert!(status.contains(&format!("; {SAID}")), "{status}");
    let all = stdout(&cli(&["status", "--coordinator", &c.addr]));
    assert!(all.contains(SAID), "{all}");
    // A second cancel changes nothing and says so.
    let again = cli(&["cancel", "--coordinator", &c.addr, "--reason", "other", job]);
    assert!(again.status.success(), "{again:?}");
    assert_eq!(stdout(&again).trim(), format!("job {job} was already over"));
    check_cancelled(&c.addr, job, &String::new);
    // This coordinator ran one job: exact values.
    let text = scrape(&metrics);
    assert!(
        text.lines()
            .any(|l| l == "muster_jobs{state=\"cancelled\"} 1"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l == "muster_jobs{state=\"failed\"} 0"),
        "{text}"
    );
    assert!(
        text.lines().any(|l| l == "muster_jobs_cancelled_total 1"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l == "muster_generation_failures_total{cause=\"node_lost\"} 0"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l == "muster_ranks{state=\"failed\"} 0"),
        "{text}"
    );
    assert!(
        text.lines()
            .any(|l| l == "muster_nodes{state=\"cancelled\"} 2"),
        "{text}"
    );
}

fn serve(c: &Coordinator, id: &str, labels: &str) -> Agent {
    let agent = Agent::start_with_env(
        &[
            "serve",
            "--coordinator",
            &c.addr,
            "--agent-id",
            id,
            "--labels",
            labels,
            "--grace-period-ms",
            "2000",
        ],
        &[("NO_COLOR", "1")],
    );
    agent.wait_for_lines(Stream::Stderr, 1, SLOW, |l| l.contains("serving as"));
    agent
}

#[test]
fn a_cancelled_submitted_job_ends_cancelled_and_submit_wait_exits_3() {
    let c = Coordinator::start(&[]);
    // Two agents on one address (this machine), told apart only by their ids.
    let b = serve(&c, "agent-zone-b", "pool=cx,zone=b");
    let cc = serve(&c, "agent-zone-c", "pool=cx,zone=c");
    let job = "cancel-daemon";
    let submit = Agent::start_with_env(
        &[
            "submit",
            "--coordinator",
            &c.addr,
            "--job-id",
            job,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--selector",
            "pool=cx",
            "--wait",
            "--",
            "sh",
            "-c",
            "echo running rank=$RANK; exec sleep 60",
        ],
        &[("NO_COLOR", "1")],
    );
    for agent in [&b, &cc] {
        agent.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l.contains("running rank="));
    }
    let d = wait_until(&c.addr, job, "running", |d| running(d, false));
    // Item 4: each node shows its own machine's labels (both share 127.0.0.1).
    assert_eq!(d.nodes.len(), 2, "{d:#?}");
    for n in &d.nodes {
        let zone = match n.node_id.as_str() {
            "agent-zone-b" => "b",
            "agent-zone-c" => "c",
            other => panic!("node id {other} is not an agent id: {d:#?}"),
        };
        assert_eq!(
            n.labels.get("zone").map(String::as_str),
            Some(zone),
            "{n:?}"
        );
        assert_eq!(n.host, "127.0.0.1", "{n:?}");
    }
    let out = cli(&["cancel", "--coordinator", &c.addr, "--reason", REASON, job]);
    assert!(out.status.success(), "{out:?}");
    let run = submit.finish(SLOW);
    assert_eq!(run.code(), Some(3), "{}", run.dump());
    assert!(
        run.stdout
            .iter()
            .any(|l| l.contains("worker output is not shown here")
                && l.contains("each agent prints its workers' lines")),
        "{}",
        run.dump()
    );
    assert_eq!(
        run.stdout.last().map(String::as_str),
        Some(format!("job {job}: {SAID}").as_str()),
        "{}",
        run.dump()
    );
    for agent in [&b, &cc] {
        agent.wait_for_lines(Stream::Stderr, 1, SLOW, |l| {
            l.contains(&format!(
                "job {job}: {SAID}; workers stopped, exiting with status 3"
            ))
        });
    }
    let logs = || format!("{}\n{}", b.output(), cc.output());
    check_cancelled(&c.addr, job, &logs);
    // The agents heard the cancel, not a signal, and are idle again.
    for agent in [&b, &cc] {
        assert!(!agent.output().contains("SIGTERM"), "{}", agent.output());
    }
    let deadline = Instant::now() + SLOW;
    loop {
        let all = stdout(&cli(&["status", "--coordinator", &c.addr]));
        if all.matches("jobs [], seen").count() == 2 {
            break;
        }
        assert!(Instant::now() < deadline, "agents not idle:\n{all}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_job_cancelled_while_its_round_is_open_refuses_its_joiner_with_the_reason() {
    let c = Coordinator::start(&[]);
    let job = "cancel-open";
    let agent = Agent::start_with_env(
        &[
            "launch",
            "--coordinator",
            &c.addr,
            "--job-id",
            job,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--",
            "true",
        ],
        &[("NO_COLOR", "1")],
    );
    wait_until(&c.addr, job, "one node waiting", |d| d.nodes.len() == 1);
    // Item 5: a joiner without a rank is said to be not ranked yet, not node 4294967295.
    let status = stdout(&cli(&["status", "--coordinator", &c.addr, job]));
    assert!(status.contains("1 nodes waiting"), "{status}");
    assert!(
        status.contains("  node (not yet ranked) ") && status.contains("joining the open round"),
        "{status}"
    );
    assert!(!status.contains("4294967295"), "{status}");
    let out = cli(&["cancel", "--coordinator", &c.addr, "--reason", REASON, job]);
    assert!(out.status.success(), "{out:?}");
    let run = agent.finish(SLOW);
    assert_eq!(run.code(), Some(3), "{}", run.dump());
    assert!(
        run.stderr.iter().any(|l| l.contains(&format!(
            "job {job}: job '{job}' was {SAID}; exiting with status 3"
        ))),
        "{}",
        run.dump()
    );
    let d = wait_until(&c.addr, job, "cancelled", |d| {
        d.summary.as_ref().is_some_and(|s| s.done)
    });
    let s = d.summary.unwrap();
    assert_eq!(s.state, pb::RoundState::Cancelled as i32, "{s:?}");
    assert_eq!(s.reason, SAID);
}

#[test]
fn a_cancel_stored_in_etcd_survives_the_leaders_death() {
    let Some(etcd) = Etcd::start(1) else { return };
    let rt = runtime();
    let ttl = Duration::from_secs(2);
    let grace = Duration::from_secs(2);
    let grace_ms = grace.as_millis().to_string();
    let mut replicas = Replicas::start(&etcd, 2, ttl, &["--heartbeat-timeout-ms", &grace_ms]);
    let leader = rt.block_on(replicas.wait_leader(SLOW, &[]));
    let addrs = replicas.addrs();
    let job = "cancel-etcd";
    let agents: Vec<Agent> = (0..2)
        .map(|node| {
            let node = node.to_string();
            Agent::start_with_env(
                &[
                    "launch",
                    "--coordinator",
                    &addrs,
                    "--job-id",
                    job,
                    "--nnodes",
                    "2",
                    "--node-rank",
                    &node,
                    "--nproc-per-node",
                    "1",
                    "--",
                    "sh",
                    "-c",
                    "echo running rank=$RANK; exec sleep 60",
                ],
                &[("NO_COLOR", "1")],
            )
        })
        .collect();
    for a in &agents {
        a.wait_for_lines(Stream::Stdout, 1, SLOW, |l| l.contains("running rank="));
    }
    let addr = replicas.addr(leader).to_owned();
    let cancelled = rt
        .block_on(async {
            OpsClient::connect(format!("http://{addr}"))
                .await
                .unwrap()
                .cancel_job(pb::CancelJobRequest {
                    job_id: job.into(),
                    reason: REASON.into(),
                })
                .await
        })
        .unwrap()
        .into_inner();
    assert!(cancelled.cancelled);
    let deadline = Instant::now() + SLOW;
    for a in agents {
        let run = a.finish_by(deadline);
        assert_eq!(run.code(), Some(3), "{}\n{}", run.dump(), replicas.logs());
    }
    check_cancelled(&addr, job, &|| replicas.logs());
    // The new leader loads the record: still cancelled, with the reason, and past the
    // re-attach grace (no agent comes back) nothing turns it FAILED.
    replicas.kill(leader);
    let new = rt.block_on(replicas.wait_leader(SLOW, &[leader]));
    let addr = replicas.addr(new).to_owned();
    check_cancelled(&addr, job, &|| replicas.logs());
    let d = rt.block_on(describe(&addr, job, None, Duration::ZERO));
    let later = rt.block_on(describe(&addr, job, d.summary.clone(), grace * 3));
    assert_eq!(later.summary, d.summary, "{}", replicas.logs());
    assert!(later.failure.is_none(), "{:?}", later.failure);
}
