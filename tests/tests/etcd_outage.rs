//! Training outlives an outage of etcd itself (issue 28, item 7): 3 coordinator replicas on a
//! real etcd, 2 `muster-agent launch` nodes of 2 `fault_probe` workers (barriers, unique ids,
//! the key-value store), and etcd SIGKILLed for 2 minutes, four times the failover budget.
//! Every replica answers "no leader is elected" meanwhile, which proves that nobody can hand
//! the nodes' ranks to others (docs/ha.md, "An etcd outage"): the workers wait in their
//! barrier, keep their pids, go on once etcd is back, and the job exits 0 in one generation;
//! a follower killed as the outage begins and started again during it does not break that.
//! The workers' history passes the fault suite's checker (`muster_tests::faults`), their
//! key-value calls across the outage included (linearizable).
//!
//! And the other side: one agent cut off from every replica while a leader lives (network
//! namespaces, its link down) completes no census, stops its workers at its lease, and they
//! are gone before the survivors' smaller generation starts any worker. And an agent killed
//! while nobody leads and started again at once waits as a spare through the outage and the
//! new leader's re-attach window, then takes its old node's place. `etcd-outage-long` is a
//! kind of the fault suite. Skipped, printing why, where etcd is not installed (and the
//! second where network namespaces are not available).
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::time::{Duration, Instant};

use muster::client::{Coordinator, Kv};
use muster_tests::etcd::Etcd;
use muster_tests::faults::{self, Event, TcpProxy, Uplink, WorkerEvent};
use muster_tests::netns::Net;
use muster_tests::replicas::Replicas;
use muster_tests::{Agent, Stream, example_bin};

/// The election lease TTL of the replicas (etcd's smallest practical TTL is 2 s).
const TTL: Duration = Duration::from_secs(2);
/// How long etcd stays down: the 2 minutes.
const OUTAGE: Duration = Duration::from_secs(120);
/// Nodes and workers per node.
const NODES: usize = 2;
const NPROC: usize = 2;

/// The tests' runtime for their async calls (the replicas' health, a key-value call).
fn runtime() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap()
}

/// The last barrier every rank of generation `generation` completed, from the history.
fn progress(path: &Path) -> (Option<u64>, Vec<u64>) {
    let (events, _) = faults::read_history(path).unwrap_or_default();
    let mut generation = None;
    let mut done = vec![0u64; NODES * NPROC];
    for e in &events {
        if let Event::Worker {
            generation: g,
            rank,
            event,
            ..
        } = e
        {
            generation.get_or_insert(*g);
            if let WorkerEvent::BarrierExit { seq, .. } = event
                && let Some(d) = done.get_mut(*rank as usize)
            {
                *d = (*d).max(*seq);
            }
        }
    }
    (generation, done)
}

fn min_progress(path: &Path) -> u64 {
    progress(path).1.into_iter().min().unwrap_or(0)
}

/// Waits until every rank completed barrier `seq`.
fn wait_progress(path: &Path, seq: u64, timeout: Duration, agents: &mut [Agent], what: &str) {
    let deadline = Instant::now() + timeout;
    while min_progress(path) < seq {
        for (i, a) in agents.iter_mut().enumerate() {
            assert!(!a.exited(), "agent {i} exited {what}:\n{}", a.output());
        }
        assert!(
            Instant::now() < deadline,
            "the ranks did not all pass barrier {seq} within {timeout:?} {what}: {:?}",
            progress(path).1
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn a_job_outlives_a_two_minute_etcd_outage() {
    let Some(probe) = example_bin("fault_probe") else {
        println!("skipped: worker-sdk/examples/fault_probe.rs does not exist");
        return;
    };
    let Some(mut etcd) = Etcd::start(1) else {
        return;
    };
    let rt = runtime();
    let started = Instant::now();
    let mut replicas = Replicas::start(&etcd, 3, TTL, &[]);
    let leader = rt.block_on(replicas.wait_leader(Duration::from_secs(20), &[]));
    let addrs = replicas.addrs();
    let dir = std::env::temp_dir().join(format!("muster-etcd-outage-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let history = dir.join("history.jsonl");
    let history_arg = history.display().to_string();
    let probe_arg = probe.display().to_string();
    let job = "etcd-outage";
    let mut agents: Vec<Agent> = (0..NODES)
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
                    &NODES.to_string(),
                    "--node-rank",
                    &node,
                    "--nproc-per-node",
                    &NPROC.to_string(),
                    "--max-restarts",
                    "0",
                    "--grace-period-ms",
                    "1000",
                    "--",
                    &probe_arg,
                ],
                &[
                    ("NO_COLOR", "1"),
                    ("MUSTER_FAULT_HISTORY", &history_arg),
                    ("MUSTER_FAULT_PACE_MS", "100"),
                ],
            )
        })
        .collect();
    wait_progress(
        &history,
        5,
        Duration::from_secs(60),
        &mut agents,
        "before the outage",
    );

    let before = progress(&history).1;
    // A follower down as the outage begins and started again during it (as systemd or the
    // fault suite starts it) serves refusals as not the leader. One that exited without etcd
    // left its port refusing connections: no census completed, the workers' failover budget
    // ran out and the job restarted (the fault suite's finding 8).
    let follower = (leader + 1) % 3;
    replicas.kill(follower);
    let killed = Instant::now();
    etcd.kill(0);
    replicas.restart(follower);
    eprintln!(
        "etcd SIGKILLed, replica {follower} killed and started again ({:?}); barriers done per rank: {before:?}",
        killed.elapsed()
    );
    while killed.elapsed() < OUTAGE {
        for (i, a) in agents.iter_mut().enumerate() {
            assert!(
                !a.exited(),
                "agent {i} exited {:?} into the etcd outage:\n{}\n{}",
                killed.elapsed(),
                a.output(),
                replicas.logs()
            );
        }
        std::thread::sleep(Duration::from_millis(500));
    }
    let stalled = progress(&history).1;
    etcd.restart_retrying(0);
    let restarted = Instant::now();
    eprintln!(
        "etcd restarted after {:?}; barriers done per rank: {stalled:?}",
        killed.elapsed()
    );
    let resume_at = stalled.iter().copied().max().unwrap_or(0) + 3;
    wait_progress(
        &history,
        resume_at,
        Duration::from_secs(60),
        &mut agents,
        "after etcd came back",
    );
    eprintln!(
        "every rank passed barrier {resume_at} {:?} after etcd restarted",
        restarted.elapsed()
    );

    rt.block_on(async {
        let kv = Kv::new(Coordinator::connect(&addrs).await.unwrap(), job.to_owned());
        kv.set("fault-stop", "1").await.unwrap();
    });
    let deadline = Instant::now() + Duration::from_secs(60);
    let runs: Vec<_> = agents.into_iter().map(|a| a.finish_by(deadline)).collect();
    for (i, run) in runs.iter().enumerate() {
        assert_eq!(
            run.code(),
            Some(0),
            "agent {i}: {}\n{}",
            run.dump(),
            replicas.logs()
        );
    }
    // Each agent said why it kept its workers.
    for (i, run) in runs.iter().enumerate() {
        assert!(
            run.stderr
                .iter()
                .any(|l| l.contains("no coordinator replica leads")),
            "agent {i} did not name the leaderless replicas:\n{}",
            run.dump()
        );
    }

    let (events, bad) = faults::read_history(&history).unwrap();
    assert!(bad.is_empty(), "lines that did not parse: {bad:?}");
    let mut starts = Vec::new();
    let mut exits = Vec::new();
    for e in &events {
        if let Event::Worker {
            generation,
            rank,
            pid,
            event,
            ..
        } = e
        {
            match event {
                WorkerEvent::Start { restart_count, .. } => {
                    starts.push((*generation, *rank, *pid, *restart_count));
                }
                WorkerEvent::Exit { status, .. } => exits.push((*rank, *status)),
                _ => {}
            }
        }
    }
    starts.sort_unstable();
    assert_eq!(
        starts.len(),
        NODES * NPROC,
        "a worker started again: {starts:?}"
    );
    assert!(
        starts.iter().all(|s| s.0 == starts[0].0 && s.3 == 0),
        "not one generation: {starts:?}"
    );
    exits.sort_unstable();
    assert_eq!(
        exits,
        (0..u32::try_from(NODES * NPROC).unwrap())
            .map(|r| (r, 0))
            .collect::<Vec<_>>(),
        "not every worker exited 0"
    );
    let mut violations = faults::check_unique_ranks(&events);
    violations.extend(faults::check_barriers(&events));
    violations.extend(faults::check_unique_ids(&events));
    violations.extend(faults::check_linearizable(&events));
    assert!(
        violations.is_empty(),
        "{}",
        violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
    let _ = std::fs::remove_dir_all(&dir);
    eprintln!(
        "the job exited 0 after a {OUTAGE:?} etcd outage; test took {:?}",
        started.elapsed()
    );
}

/// Nanoseconds since the Unix epoch (the workers print the same clock with `date +%s%N`).
fn now_ns() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}

/// A worker's `ready` line: its generation, pid and start time (ns since the epoch).
fn ready(line: &str) -> Option<(u64, i32, u128)> {
    let field = |name: &str| {
        line.split_whitespace()
            .find_map(|w| w.strip_prefix(name))
            .map(str::to_owned)
    };
    if !line.contains("ready ") {
        return None;
    }
    Some((
        field("gen=")?.parse().ok()?,
        field("pid=")?.parse().ok()?,
        field("t=")?.parse().ok()?,
    ))
}

#[test]
fn a_node_cut_off_while_a_leader_lives_stops_its_workers_before_any_replacement_starts() {
    let Some(mut etcd) = Etcd::start(1) else {
        return;
    };
    let Some(net) = Net::setup(&["n0", "n1"]) else {
        return;
    };
    let uplink = Uplink::attach(&net, "n0");
    let rt = runtime();
    let replicas = Replicas::start(&etcd, 3, TTL, &[]);
    rt.block_on(replicas.wait_leader(Duration::from_secs(20), &[]));
    // The agents reach the replicas through proxies on the uplink.
    let proxies: Vec<TcpProxy> = (0..replicas.len())
        .map(|i| {
            let upstream: std::net::SocketAddr = replicas.addr(i).parse().unwrap();
            let listen = std::net::SocketAddr::from((uplink.addr, upstream.port()));
            TcpProxy::start(listen, upstream).unwrap()
        })
        .collect();
    let addrs: Vec<String> = (0..replicas.len())
        .map(|i| {
            let port = replicas.addr(i).rsplit(':').next().unwrap().to_owned();
            format!("{}:{port}", uplink.addr)
        })
        .collect();
    let addrs = addrs.join(",");
    let agent = muster_tests::agent_bin().display().to_string();
    let script =
        "echo \"ready rank=$RANK gen=$MUSTER_GENERATION pid=$$ t=$(date +%s%N)\"; exec sleep 600";
    let mut agents: Vec<Agent> = ["n0", "n1"]
        .iter()
        .map(|host| {
            net.spawn(
                host,
                &agent,
                &[
                    "launch",
                    "--coordinator",
                    &addrs,
                    "--job-id",
                    "cut-off",
                    "--nnodes",
                    "1:2",
                    "--nproc-per-node",
                    "2",
                    "--max-restarts",
                    "3",
                    "--grace-period-ms",
                    "1000",
                    "--",
                    "sh",
                    "-c",
                    script,
                ],
                &[("NO_COLOR", "1")],
            )
        })
        .collect();
    let first: Vec<Vec<(u64, i32, u128)>> = agents
        .iter()
        .map(|a| {
            a.wait_for_lines(Stream::Stdout, 2, Duration::from_secs(60), |l| {
                ready(l).is_some()
            })
            .iter()
            .filter_map(|l| ready(l))
            .collect()
        })
        .collect();
    let generation = first[0][0].0;
    assert!(
        first.iter().flatten().all(|r| r.0 == generation),
        "the nodes are not in one generation: {first:?}"
    );
    let cut_pids: Vec<i32> = first[1].iter().map(|r| r.1).collect();

    let cut_at = Instant::now();
    net.cut("n1");
    // When node 1's workers are gone, as this test sees it (at most 10 ms late).
    let mut gone_ns = None;
    let deadline = Instant::now() + Duration::from_secs(60);
    let replacement = loop {
        assert!(
            Instant::now() < deadline,
            "{}\n{}",
            agents[0].output(),
            agents[1].output()
        );
        if gone_ns.is_none()
            && cut_pids
                .iter()
                .all(|p| !Path::new(&format!("/proc/{p}")).exists())
        {
            gone_ns = Some(now_ns());
            eprintln!(
                "node 1's workers are gone {:?} after the cut",
                cut_at.elapsed()
            );
        }
        let later: Vec<(u64, i32, u128)> = agents[0]
            .lines(Stream::Stdout)
            .iter()
            .filter_map(|l| ready(l))
            .filter(|r| r.0 > generation)
            .collect();
        if let Some(start) = later.iter().map(|r| r.2).min()
            && gone_ns.is_some()
        {
            break start;
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    let gone_ns = gone_ns.unwrap();
    eprintln!(
        "the survivors' next generation started its first worker {:.0} ms after node 1's workers were gone",
        (replacement as f64 - gone_ns as f64) / 1e6
    );
    assert!(
        gone_ns < replacement,
        "a replacement worker started {:.0} ms before the cut-off node's workers were gone\n{}\n{}",
        (gone_ns - replacement) as f64 / 1e6,
        agents[0].output(),
        agents[1].output()
    );
    let lost = agents[1].wait_for_lines(Stream::Stderr, 1, Duration::from_secs(30), |l| {
        l.contains("(the lease)")
    });
    eprintln!("{}", lost[0]);
    for a in &mut agents {
        a.signal(nix::sys::signal::Signal::SIGTERM);
    }
    drop(agents);
    drop(proxies);
    drop(uplink);
    etcd.kill(0);
}

/// `muster-agent launch` of node `i` of the 2-node job `job` on `addrs`: each worker prints a
/// `ready` line and waits for `flag`.
fn waiting_node(addrs: &str, job: &str, flag: &Path) -> Agent {
    let script = format!(
        "echo \"ready rank=$RANK gen=$MUSTER_GENERATION pid=$$ t=$(date +%s%N)\"; \
         while [ ! -e {} ]; do sleep 0.1; done",
        flag.display()
    );
    Agent::start_with_env(
        &[
            "launch",
            "--coordinator",
            addrs,
            "--job-id",
            job,
            "--nnodes",
            "2",
            "--nproc-per-node",
            "1",
            "--max-restarts",
            "2",
            "--grace-period-ms",
            "1000",
            "--",
            "sh",
            "-c",
            &script,
        ],
        &[("NO_COLOR", "1")],
    )
}

/// The generations of `ready` lines.
fn generations(lines: &[String]) -> Vec<u64> {
    lines.iter().filter_map(|l| ready(l)).map(|r| r.0).collect()
}

/// Issue 28's long fault run, finding 2: an agent SIGKILLed while nobody leads (etcd down) and
/// started again at once finds its old node still in the running generation. The new leader
/// gives that node the heartbeat timeout to re-attach before it declares it lost, so the new
/// agent waits as a spare, and that wait must count from the new leader's first refusal, not
/// from the agent's start (which the outage used up: it gave up with "the job is full" and
/// the job was lost with restarts left). Here it takes its old node's place in generation 2
/// and the job exits 0.
#[test]
fn an_agent_restarted_during_an_etcd_outage_takes_its_old_nodes_place() {
    let Some(mut etcd) = Etcd::start(1) else {
        return;
    };
    let rt = runtime();
    let replicas = Replicas::start(&etcd, 3, TTL, &[]);
    rt.block_on(replicas.wait_leader(Duration::from_secs(20), &[]));
    let addrs = replicas.addrs();
    let flag = std::env::temp_dir().join(format!("muster-replaced-{}", std::process::id()));
    let _ = std::fs::remove_file(&flag);
    let job = "replaced-in-outage";
    let mut kept = waiting_node(&addrs, job, &flag);
    let lost = waiting_node(&addrs, job, &flag);
    for a in [&kept, &lost] {
        a.wait_for_lines(Stream::Stdout, 1, Duration::from_secs(60), |l| {
            ready(l).is_some()
        });
    }

    etcd.kill(0);
    // The leader's term lapses within its TTL; then nobody leads and nobody decides.
    let lapsing = Instant::now();
    while !rt.block_on(replicas.serving()).is_empty() {
        assert!(
            lapsing.elapsed() < Duration::from_secs(20),
            "a replica still serves with etcd down:\n{}",
            replicas.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    lost.signal(nix::sys::signal::Signal::SIGKILL);
    let lost = lost.finish(Duration::from_secs(10));
    let mut restarted = waiting_node(&addrs, job, &flag);
    // An outage longer than the agent's spare wait (15 s).
    let outage = Instant::now();
    while outage.elapsed() < Duration::from_secs(20) {
        for (what, a) in [("kept", &mut kept), ("restarted", &mut restarted)] {
            assert!(
                !a.exited(),
                "the {what} agent exited in the outage:\n{}\n{}",
                a.output(),
                lost.dump()
            );
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    etcd.restart_retrying(0);
    let back = Instant::now();
    let deadline = back + Duration::from_secs(60);
    while !generations(&restarted.lines(Stream::Stdout))
        .iter()
        .any(|&g| g > 1)
    {
        assert!(
            Instant::now() < deadline && !restarted.exited(),
            "the restarted agent did not take its old node's place:\n{}\n{}",
            restarted.output(),
            replicas.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    eprintln!(
        "the restarted agent's worker started {:?} after etcd came back",
        back.elapsed()
    );
    std::fs::write(&flag, b"").unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let runs = [kept.finish_by(deadline), restarted.finish_by(deadline)];
    let _ = std::fs::remove_file(&flag);
    for run in &runs {
        assert_eq!(run.code(), Some(0), "{}", run.dump());
    }
    assert!(
        runs[1].stderr.iter().any(|l| l.contains("as a spare")),
        "the restarted agent did not wait as a spare:\n{}",
        runs[1].dump()
    );
    // The kept node ran generation 1, then generation 2 with the restarted one.
    assert_eq!(generations(&runs[0].stdout), [1, 2], "{}", runs[0].dump());
    etcd.kill(0);
}
