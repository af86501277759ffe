//! Spare agents (issue 30): a lost machine replaced in place. `ddp_train` runs as 2 nodes × 2
//! ranks under `muster-agent launch --recovery in-place --max-spares 1`, with a third agent
//! launched `--spare`. When node 1 is lost (its agent SIGKILLed, or its link cut past the
//! lease), the spare takes ranks 2-3: node 0's workers keep their processes, the spare's
//! workers heal from them, the job exits 0 and its checksum equals a failure-free run's. The
//! lost agent coming back is refused, named as replaced; a new agent on that machine stands by
//! as a spare. Without a spare (the spare itself lost, or a second loss) the job restarts the
//! generation, and says so.
//!
//! The node tests run on network-namespace hosts (`muster_tests::cluster`; skipped, printing
//! why, without root). The failover tests run on loopback against three coordinator replicas
//! on a real etcd (skipped without etcd), the leader SIGKILLed during the recovery.

use muster_tests::cluster::Cluster;
use muster_tests::etcd::Etcd;
use muster_tests::recovery::{checksum, ddp_train, start, started, starts, wait_for_step};
use muster_tests::replicas::Replicas;
use muster_tests::{Agent, Finished, SLOW, Stream};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// The coordinator's heartbeat timeout here (its default is 10 s): a cut node is lost after it.
const HEARTBEAT_TIMEOUT: &str = "2000";
/// The coordinator's last call: both nodes of a `1:2` job make the first round.
const LAST_CALL: &str = "2000";
/// The agents' lease (their default is 10 s): a cut agent stops its workers after it.
const LEASE: &str = "3000";
/// How long a run may take on a loaded 2-core machine, recovery included.
const LIMIT: Duration = Duration::from_secs(120);
/// 8 epochs of 8 steps, paced so that a loss happens mid-run.
const TRAIN: &[&str] = &[
    "--epochs",
    "8",
    "--samples",
    "512",
    "--batch-size",
    "32",
    "--eval-samples",
    "0",
    "--step-sleep-ms",
    "100",
];
/// The job's flags on every agent (the spare adds `--spare`).
const JOB: &[&str] = &[
    "--nproc-per-node",
    "2",
    "--recovery",
    "in-place",
    "--max-restarts",
    "3",
    "--max-spares",
    "1",
    "--lease-ms",
    LEASE,
];

/// The failure-free checksum: the same training on 4 processes of one agent, unpaced.
fn reference(bin: &Path) -> &'static str {
    static REFERENCE: OnceLock<String> = OnceLock::new();
    REFERENCE.get_or_init(|| {
        let train: Vec<&str> = TRAIN[..8].iter().copied().chain(["--quiet"]).collect();
        let (agent, _) = start(bin, 4, &[], &train);
        let run = agent.finish(LIMIT);
        assert_eq!(run.code(), Some(0), "{}", run.dump());
        checksum(&run)
    })
}

/// The worker command: a `started rank=R pid=P restarts=N` line, then the trainer.
fn trainer(bin: &Path) -> Vec<String> {
    let script = format!(
        "echo started rank=$RANK pid=$$ restarts=$MUSTER_RESTART_COUNT; exec {} {}",
        bin.display(),
        TRAIN.join(" ")
    );
    vec!["sh".into(), "-c".into(), script]
}

/// The cluster (coordinator host and hosts n0, n1, n2) and the trainer, or `None` where
/// namespaces or the example are missing.
fn cluster() -> Option<(Cluster, PathBuf)> {
    let bin = ddp_train()?;
    let cluster = Cluster::start(
        3,
        &[
            "--heartbeat-timeout-ms",
            HEARTBEAT_TIMEOUT,
            "--last-call-ms",
            LAST_CALL,
        ],
    )?;
    Some((cluster, bin))
}

/// `muster-agent launch` of the job on `host` with `flags` besides [`JOB`].
fn agent(cluster: &Cluster, bin: &Path, host: &str, job: &str, flags: &[&str]) -> Agent {
    let mut all = JOB.to_vec();
    all.extend_from_slice(flags);
    let command = trainer(bin);
    let command: Vec<&str> = command.iter().map(String::as_str).collect();
    cluster.agent(host, job, &all, &command, &[("MUSTER_COMM_BACKEND", "cpu")])
}

/// Nodes 0 and 1 of job `job` (`nnodes` as given), started together, and the spare on n2
/// once it stands by; node 0's ranks' pids once training reached step 10.
fn job_with_spare(
    cluster: &Cluster,
    bin: &Path,
    job: &str,
    nnodes: &str,
) -> (Agent, Agent, Agent, [i32; 2]) {
    let n0 = agent(
        cluster,
        bin,
        "n0",
        job,
        &["--nnodes", nnodes, "--node-rank", "0"],
    );
    let n1 = agent(
        cluster,
        bin,
        "n1",
        job,
        &["--nnodes", nnodes, "--node-rank", "1"],
    );
    let spare = agent(cluster, bin, "n2", job, &["--nnodes", nnodes, "--spare"]);
    spare.wait_for_lines(Stream::Stderr, 1, LIMIT, |l| {
        l.contains("standing by as a spare")
    });
    let pids = [started(&n0, 0, 1, LIMIT).pid, started(&n0, 1, 1, LIMIT).pid];
    wait_for_step(&n0, 10, LIMIT);
    (n0, n1, spare, pids)
}

/// What every recovery by the spare must show: node 0 and the spare exit 0, node 0's ranks
/// kept their pids, the spare ran ranks 2-3 once each as replacements (one restart counted),
/// and the weights are a failure-free run's.
fn assert_healed_by_the_spare(bin: &Path, n0: Agent, spare: Agent, pids: [i32; 2], lost: Instant) {
    assert_healed_by_the_spare_with(bin, n0, spare, pids, lost, String::new);
}

/// [`assert_healed_by_the_spare`], with `more` (the coordinators' logs) in every failure's
/// message.
fn assert_healed_by_the_spare_with(
    bin: &Path,
    n0: Agent,
    spare: Agent,
    pids: [i32; 2],
    lost: Instant,
    more: impl Fn() -> String,
) {
    let n0 = n0.finish(LIMIT);
    let spare = spare.finish(LIMIT);
    let context = || format!("node 0: {}\nspare: {}\n{}", n0.dump(), spare.dump(), more());
    assert_eq!(n0.code(), Some(0), "{}", context());
    assert_eq!(spare.code(), Some(0), "{}", context());
    let kept = starts(&n0, 2);
    for rank in 0..2u32 {
        let seen: Vec<i32> = kept[&rank].iter().map(|s| s.pid).collect();
        assert_eq!(seen, [pids[rank as usize]], "rank {rank}\n{}", context());
    }
    let taken = starts(&spare, 4);
    for rank in 2..4u32 {
        let s = &taken[&rank];
        assert_eq!(s.len(), 1, "rank {rank}\n{}", context());
        assert_eq!(s[0].restarts, 1, "rank {rank}\n{}", context());
    }
    let took = spare
        .stderr
        .iter()
        .find(|l| l.contains("this spare takes node 1's place (ranks 2-3"));
    assert!(took.is_some(), "{}", context());
    assert_eq!(checksum(&n0), reference(bin), "{}", context());
    eprintln!(
        "node 1 lost; the job finished {:?} later: {}",
        lost.elapsed(),
        took.map_or("", |l| l.as_str())
    );
}

/// A fresh job id.
fn job_id(name: &str) -> String {
    format!("spare-{name}-{}", std::process::id())
}

#[test]
fn a_killed_agents_ranks_go_to_the_spare_and_the_weights_are_bit_identical() {
    let Some((cluster, bin)) = cluster() else {
        return;
    };
    let job = job_id("kill");
    let (n0, n1, spare, pids) = job_with_spare(&cluster, &bin, &job, "2");
    let lost = Instant::now();
    n1.signal(nix::sys::signal::Signal::SIGKILL);
    assert_the_timeline(&cluster, &job);
    assert_healed_by_the_spare(&bin, n0, spare, pids, lost);
    drop(n1);
}

/// `describe` shows the recovery's every phase once its first full step is done (the spare's
/// workers report their heal through their agent's relay), and the lost time split.
fn assert_the_timeline(cluster: &Cluster, job: &str) {
    let deadline = Instant::now() + LIMIT;
    loop {
        let view = describe(cluster, job);
        if let Some(line) = view.lines().find(|l| {
            l.starts_with("RECOVERED") && l.contains("rank 2 ") && l.contains("first full step")
        }) {
            for phase in [
                "on spare ",
                "healed from rank ",
                "quorum ",
                "state received after ",
                "training again after ",
            ] {
                assert!(line.contains(phase), "{phase:?} missing from\n{view}");
            }
            let training = view.lines().find(|l| l.starts_with("training: "));
            assert!(
                training.is_some_and(|l| l.contains("respawning or starting on a spare")),
                "{view}"
            );
            return;
        }
        assert!(
            Instant::now() < deadline,
            "no whole recovery timeline in\n{view}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
}

#[test]
fn a_node_cut_off_past_its_lease_is_replaced_and_its_agent_is_refused_when_it_comes_back() {
    let Some((cluster, bin)) = cluster() else {
        return;
    };
    let job = job_id("cut");
    let (n0, n1, spare, pids) = job_with_spare(&cluster, &bin, &job, "2");
    let lost = Instant::now();
    cluster.net.cut("n1");
    spare.wait_for_lines(Stream::Stderr, 1, LIMIT, |l| {
        l.contains("this spare takes node 1's place")
    });
    // The recovery's timeline starts at the loss: detected once the agent had been silent for
    // the heartbeat timeout, then the spare's replacements.
    let view = describe(&cluster, &job);
    let line = view
        .lines()
        .find(|l| l.starts_with("RECOVER") && l.contains("rank 2 "))
        .unwrap_or_else(|| panic!("no recovery of rank 2 in\n{view}"));
    assert!(line.contains("after its agent was last heard"), "{view}");
    assert!(line.contains("on spare "), "{view}");
    // The link comes back within the lost agent's lease: its watch is refused, naming the
    // spare, and it stops its workers and leaves.
    cluster.net.heal("n1");
    let old = n1.finish(LIMIT);
    assert_ne!(old.code(), Some(0), "{}", old.dump());
    assert!(
        old.stderr
            .iter()
            .any(|l| l.contains("was replaced by spare")),
        "{}",
        old.dump()
    );
    // A new agent on that machine joins the full job as a spare, and leaves with it.
    let back = agent(&cluster, &bin, "n1", &job, &["--nnodes", "2"]);
    back.wait_for_lines(Stream::Stderr, 1, LIMIT, |l| {
        l.contains("standing by as a spare") || l.contains("was not needed")
    });
    assert_healed_by_the_spare(&bin, n0, spare, pids, lost);
    let back = back.finish(LIMIT);
    assert_eq!(back.code(), Some(0), "{}", back.dump());
    assert!(
        back.stderr.iter().any(|l| l.contains("was not needed")),
        "{}",
        back.dump()
    );
}

/// Node 1's agent SIGKILLed with no spare standing by: the job restarts its generation, and
/// every message says no spare could take the node.
fn restarted_without_a_spare(run: &Finished) {
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    assert!(
        run.stderr.iter().any(|l| l
            .contains("no spare of 2 slots stands by (0 standing by), so the generation restarts")),
        "{}",
        run.dump()
    );
    let ranks = starts(run, 2);
    assert!(
        ranks[&0].len() == 2 && ranks[&0][1].restarts > 0,
        "rank 0 starts again in the next generation\n{}",
        run.dump()
    );
}

#[test]
fn two_losses_with_one_spare_restart_the_generation_at_the_second() {
    let Some((cluster, bin)) = cluster() else {
        return;
    };
    let job = job_id("twice");
    let (n0, n1, spare, _) = job_with_spare(&cluster, &bin, &job, "1:2");
    n1.signal(nix::sys::signal::Signal::SIGKILL);
    spare.wait_for_lines(Stream::Stderr, 1, LIMIT, |l| {
        l.contains("this spare takes node 1's place")
    });
    started(&spare, 2, 1, LIMIT);
    spare.signal(nix::sys::signal::Signal::SIGKILL);
    // Node 0 alone makes the next generation (1:2 nodes) and finishes.
    restarted_without_a_spare(&n0.finish(LIMIT));
}

#[test]
fn a_spare_lost_before_it_is_used_leaves_the_job_to_restart() {
    let Some((cluster, bin)) = cluster() else {
        return;
    };
    let job = job_id("spare-lost");
    let (n0, n1, spare, _) = job_with_spare(&cluster, &bin, &job, "1:2");
    spare.signal(nix::sys::signal::Signal::SIGKILL);
    drop(spare);
    // Its join call ends with its process: the coordinator withdraws it at once.
    let deadline = Instant::now() + LIMIT;
    while describe(&cluster, &job).contains("spares 1/1") {
        assert!(Instant::now() < deadline, "the lost spare still stands by");
        std::thread::sleep(Duration::from_millis(50));
    }
    n1.signal(nix::sys::signal::Signal::SIGKILL);
    restarted_without_a_spare(&n0.finish(LIMIT));
}

/// `muster-agent describe` of `job`, run in host n0.
fn describe(cluster: &Cluster, job: &str) -> String {
    let mut args = vec!["describe", "--coordinator", &cluster.coordinator];
    args.extend(cluster.security.iter().map(String::as_str));
    args.push(job);
    let run = cluster
        .net
        .spawn("n0", muster_tests::agent_bin(), &args, &[("NO_COLOR", "1")])
        .finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    run.stdout.join("\n")
}

// Through a coordinator failover (loopback, three replicas on etcd).

static SERIAL: Mutex<()> = Mutex::new(());

/// When the leader dies, relative to node 1's loss.
#[derive(Debug, Clone, Copy)]
enum LeaderDies {
    /// Right after node 1's agent is SIGKILLed: the takeover is the new leader's (the old
    /// one may have decided and stored it, or not).
    RightAfterTheLoss,
    /// Once the spare has its place: the replacements register and heal on the new leader.
    AfterTheTakeover,
}

fn leader_killed_during_a_takeover(when: LeaderDies) {
    let Some(bin) = ddp_train() else {
        return;
    };
    let _serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let Some(etcd) = Etcd::start(1) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("a tokio runtime");
    let mut replicas = Replicas::start(
        &etcd,
        3,
        Duration::from_secs(2),
        &["--heartbeat-timeout-ms", HEARTBEAT_TIMEOUT],
    );
    let leader = runtime.block_on(replicas.wait_leader(LIMIT, &[]));
    let addrs = replicas.addrs();
    let job = job_id(&format!("{when:?}").to_lowercase());
    let command = trainer(&bin);
    let launch = |flags: &[&str]| {
        let mut args = vec!["launch", "--coordinator", &addrs, "--job-id", &job];
        args.extend_from_slice(JOB);
        args.extend_from_slice(flags);
        args.push("--");
        args.extend(command.iter().map(String::as_str));
        Agent::start_with_env(&args, &[("MUSTER_COMM_BACKEND", "cpu"), ("NO_COLOR", "1")])
    };
    let n0 = launch(&["--nnodes", "2", "--node-rank", "0"]);
    let n1 = launch(&["--nnodes", "2", "--node-rank", "1"]);
    let spare = launch(&["--nnodes", "2", "--spare"]);
    spare.wait_for_lines(Stream::Stderr, 1, LIMIT, |l| {
        l.contains("standing by as a spare")
    });
    let pids = [started(&n0, 0, 1, LIMIT).pid, started(&n0, 1, 1, LIMIT).pid];
    wait_for_step(&n0, 10, LIMIT);
    let lost = Instant::now();
    n1.signal(nix::sys::signal::Signal::SIGKILL);
    if let LeaderDies::AfterTheTakeover = when {
        spare.wait_for_lines(Stream::Stderr, 1, LIMIT, |l| {
            l.contains("this spare takes node 1's place")
        });
    }
    replicas.kill(leader);
    let new = runtime.block_on(replicas.wait_leader(LIMIT, &[leader]));
    eprintln!(
        "{when:?}: replica {new} leads {:?} after the loss",
        lost.elapsed()
    );
    // The spare ran ranks 2-3 once each: no leader gave the place twice.
    assert_healed_by_the_spare_with(&bin, n0, spare, pids, lost, || replicas.logs());
    drop(n1);
}

#[test]
fn the_leader_killed_right_after_a_node_loss_still_gives_its_place_to_the_spare() {
    leader_killed_during_a_takeover(LeaderDies::RightAfterTheLoss);
}

#[test]
fn the_leader_killed_after_the_takeover_lets_the_spare_heal_on_the_new_leader() {
    leader_killed_during_a_takeover(LeaderDies::AfterTheTakeover);
}
