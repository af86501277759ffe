//! Randomized fault injection (issue 14), in the manner of etcd's robustness tests and Jepsen:
//! a seeded schedule of faults (SIGKILL and SIGSTOP/SIGCONT of the leading coordinator, of
//! etcd, of an agent, of a worker; an agent's network link cut where network namespaces are
//! available) against a running job of 2 agents with 2 `fault_probe` workers each, on 3
//! coordinator replicas over a real etcd; then a checker
//! (`muster_tests::faults`) over the recorded history asserts the invariants, among them that
//! the workers' key-value history is linearizable (`muster_tests::linearizable`). See
//! docs/robustness.md.
//!
//! - `MUSTER_FAULT_SEED=N` replays a schedule (the seed and the schedule are printed first);
//! - `MUSTER_FAULT_COUNT=N` sets the number of faults (default [`SHORT_COUNT`]), and
//!   `MUSTER_FAULTS_LONG=1` runs [`LONG_COUNT`];
//! - `MUSTER_FAULT_KINDS=leader-kill,worker-kill` draws from those kinds only;
//! - `MUSTER_FAULT_KNOWN_BUGS=1` also draws the kinds that trip open findings of issue 14
//!   (see [`KNOWN_BUG_KINDS`]) and runs the failover after the job finished
//!   ([`FAILOVER_AFTER_FINISH`]);
//! - `MUSTER_FAULT_KEEP=1` keeps the run's folder (history and logs) even when it passes;
//! - `MUSTER_FAULT_CHECK=<history.jsonl>` runs the checker alone over a kept history;
//! - `MUSTER_FAULT_BALANCER=1` puts the replicas behind a load balancer (see [`BALANCER`]);
//! - `MUSTER_FAULT_WORKLOADS=probe,multi-job` chooses the jobs that run together under the
//!   schedule (default: every one of [`WORKLOADS`]): `probe` is the job above, the target of
//!   the agent and link faults; `multi-job` adds [`SIDE_JOBS`] more `fault_probe` jobs of one
//!   agent each on the same replicas, whose workers the worker faults may hit too, each with
//!   a history and checked on its own; `torch-store` adds a job of torch's own TCPStore
//!   clients on the agent store (`tests/python/fault_store.py`, the peers' PyTorch), and
//!   `python` one of Python SDK workers (`tests/python/fault_python.py`: barriers,
//!   `main_process_first_share`, the store, a `Communicator` all_reduce; the `muster` package
//!   in the peers' venv); each is skipped, saying why, without its Python; `in-place` adds a
//!   `ddp_train` job under `--recovery in-place` of 2 nodes and a spare agent standing by
//!   (`--max-spares 1`), whose workers the worker faults may kill and whose agents the
//!   `node-loss` faults kill (a spare takes a lost node's ranks; a new agent is started and
//!   stands by as the spare), and whose final checksum must equal a failure-free run's; a scan
//!   of its trainers every 100 ms asserts that no rank ever has two live processes, and once a
//!   spare took a lost node's place the harness sends that node's late writes (a `Join` and a
//!   `ReportFailure` as the lost agent) and asserts that they are refused, naming the spare,
//!   and change nothing. The run's first line names the seed and the workloads;
//! - `MUSTER_SOAK=1` is the soak (issue 28, not in CI): 8 jobs of 4 ranks (every workload,
//!   `multi-job` with [`SOAK_SIDE_JOBS`] jobs) for 30 minutes (`MUSTER_SOAK_MINUTES=N` for
//!   another length), with a fault about every minute from [`SOAK_KINDS`]; it reports the
//!   replicas' and agents' memory and descriptors after a warm-up ([`SOAK_WARMUP`]) and at
//!   its end (and fails if either sum grew by more than 10% between them), the calls made and the keys lost (the linearizability
//!   checker: 0), and how the jobs ended.
//!
//! It skips, printing why, where etcd is not installed.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use muster::client::{Coordinator, Kv};
use muster_proto::v1 as pb;
use muster_tests::etcd::Etcd;
use muster_tests::faults::{
    self, Event, Fault, FaultKind, Observation, TcpProxy, Uplink, check_all, marked_processes,
    schedule,
};
use muster_tests::netns::Net;
use muster_tests::replicas::Replicas;
use muster_tests::{Agent, example_bin};
use nix::sys::signal::Signal;
use nix::unistd::Pid;

/// The election lease TTL of the replicas (etcd's smallest practical TTL is 2 s).
const TTL: Duration = Duration::from_secs(2);
/// Coordinator replicas.
const REPLICAS: usize = 3;
/// Agents (nodes) of the job, and workers per agent.
const NODES: usize = 2;
const NPROC: usize = 2;
/// Faults of the default (CI) schedule: about a minute.
const SHORT_COUNT: usize = 15;
/// Faults of the long schedule (`MUSTER_FAULTS_LONG=1`).
const LONG_COUNT: usize = 200;
/// Quiet time between two faults (milliseconds): room for a restarted generation to form.
const GAP_MS: (u64, u64) = (1_500, 3_500);
/// The soak's quiet time between two faults: one a minute or so.
const SOAK_GAP_MS: (u64, u64) = (45_000, 75_000);
/// The soak's fault kinds: none that kills a coordinator or an agent, whose memory and
/// descriptors it compares between its start and end.
const SOAK_KINDS: &[FaultKind] = &[
    FaultKind::WorkerKill,
    FaultKind::WorkerPause,
    FaultKind::EtcdKill,
    FaultKind::EtcdPause,
    FaultKind::LeaderPauseShort,
    FaultKind::AgentPause,
];
/// The soak's `multi-job` jobs: with the probe job, `torch-store`, `python` and `in-place`,
/// 8 jobs.
const SOAK_SIDE_JOBS: usize = 4;
/// How much the soak lets the summed memory of the replicas, or of the agents, grow.
const SOAK_GROWTH: f64 = 1.10;
/// When the soak takes its start figures: after the warm-up, in which the replicas' memory
/// grew in steps in the run of 2026-11-29 (x1.15 over the first 6 minutes, then 2.7% in 24).
const SOAK_WARMUP: Duration = Duration::from_secs(6 * 60);
/// How long the job may take to end once asked to stop (it may be mid-restart).
const STOP_DEADLINE: Duration = Duration::from_secs(90);
/// How long the harness keeps observing after the job ended.
const SETTLE: Duration = Duration::from_secs(3);

/// The fault kinds that trip findings of issue 14 that are still open, drawn only with
/// `MUSTER_FAULT_KNOWN_BUGS=1`; move a kind out of this list once its finding is fixed. Empty:
/// `leader-pause-long` (finding 1, a deposed leader that woke failed the job) is fixed.
const KNOWN_BUG_KINDS: &[FaultKind] = &[];

/// Whether a leader SIGKILL follows the job's end (finding 2 of issue 14, a finished job read
/// as FAILED after a failover: fixed).
const FAILOVER_AFTER_FINISH: bool = true;

/// With network namespaces, whether a killed replica's proxy keeps accepting connections (and
/// closes each at once, its replica being down), as a TCP load balancer in front of the
/// replicas does, rather than refusing them as a dead host's port does. Off by default (the
/// default topology is the dead host's); `MUSTER_FAULT_BALANCER=1` turns it on. It found two
/// bugs, both fixed (see docs/robustness.md).
const BALANCER: bool = false;

/// The workloads a run can have ([`Settings::workloads`]), in the order they start.
const WORKLOADS: &[&str] = &["probe", "multi-job", "torch-store", "python", "in-place"];
/// Workloads of issue 28 not written yet: asked for, they stop the run with a message.
const NOT_YET: &[&str] = &[];
/// `in-place`'s training: 240 steps on 2 processes, 100 ms apart (about 25 s of the schedule).
const IN_PLACE_TRAIN: &[&str] = &[
    "--epochs",
    "30",
    "--samples",
    "512",
    "--batch-size",
    "32",
    "--eval-samples",
    "0",
    "--quiet",
];
/// The invariant of `in-place`: the job exits 0 with the failure-free run's checksum.
const INV_IN_PLACE: &str = "in-place-checksum";
/// The invariant of `in-place` with spares: a rank never has two live trainers (a spare's
/// replacement never runs beside the lost node's worker).
const INV_ONE_OWNER: &str = "in-place-one-owner";
/// The invariant of `in-place` with spares: once a spare took a lost node's place, that node's
/// late writes (a `Join`, a `ReportFailure`) are refused, naming the spare, and change nothing.
const INV_LATE_WRITES: &str = "in-place-late-writes-refused";
/// The `in-place` job's agents: 2 nodes and the spare.
const IN_PLACE_AGENTS: usize = 3;
/// The extra jobs of `multi-job`, each one agent of [`NPROC`] workers.
const SIDE_JOBS: usize = 2;

/// The job's restart budget: generous, so that the schedule (not the budget) ends the job;
/// the checker still asserts that no restart goes past it.
fn max_restarts(count: usize) -> u32 {
    u32::try_from(count * 2 + 5).unwrap_or(u32::MAX)
}

fn now_ms() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
}

/// What the soak measures of the run's long-lived processes: resident memory (kB, from
/// `/proc/<pid>/status`) and open descriptors (`/proc/<pid>/fd`), summed over the replicas and
/// over the agents.
#[derive(Debug, Clone, Copy)]
struct Usage {
    replicas_kb: u64,
    replicas_fds: usize,
    agents_kb: u64,
    agents_fds: usize,
    agents: usize,
}

impl Usage {
    fn of(cluster: &Cluster, sides: &[SideJob]) -> Self {
        let rss = |pid: i32| -> u64 {
            std::fs::read_to_string(format!("/proc/{pid}/status"))
                .ok()
                .and_then(|s| {
                    s.lines()
                        .find_map(|l| l.strip_prefix("VmRSS:"))
                        .and_then(|v| v.split_whitespace().next()?.parse().ok())
                })
                .unwrap_or(0)
        };
        let fds = |pid: i32| -> usize {
            std::fs::read_dir(format!("/proc/{pid}/fd")).map_or(0, Iterator::count)
        };
        let replicas: Vec<i32> = (0..cluster.replicas.len())
            .map(|i| pid(cluster.replicas.pid(i)))
            .collect();
        let agents: Vec<i32> = cluster
            .agents
            .iter()
            .chain(sides.iter().filter_map(|s| s.agent.as_ref()))
            .chain(cluster.in_place.iter().flat_map(|j| j.agents.iter()))
            .map(|a| a.pid().as_raw())
            .collect();
        Self {
            replicas_kb: replicas.iter().map(|p| rss(*p)).sum(),
            replicas_fds: replicas.iter().map(|p| fds(*p)).sum(),
            agents_kb: agents.iter().map(|p| rss(*p)).sum(),
            agents_fds: agents.iter().map(|p| fds(*p)).sum(),
            agents: agents.len(),
        }
    }
}

impl std::fmt::Display for Usage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "replicas {:.1} MiB RSS, {} fds; {} agents {:.1} MiB RSS, {} fds",
            self.replicas_kb as f64 / 1024.0,
            self.replicas_fds,
            self.agents,
            self.agents_kb as f64 / 1024.0,
            self.agents_fds
        )
    }
}

/// A job of the `multi-job` workload.
struct SideJob {
    id: String,
    /// `None` once it ended.
    agent: Option<Agent>,
    path: PathBuf,
    history: History,
    observer: Option<std::thread::JoinHandle<usize>>,
    /// Created when the job should end (torch-store's workers look for it; the probes read
    /// `fault-stop`).
    stop_file: PathBuf,
}

/// The history file, shared by the harness's threads (the workers append to it too).
#[derive(Clone)]
struct History(Arc<Mutex<File>>);

impl History {
    fn open(path: &Path) -> Self {
        let f = OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .unwrap();
        Self(Arc::new(Mutex::new(f)))
    }

    fn record(&self, event: &Event) {
        let line = event.to_line() + "\n";
        let mut f = self.0.lock().unwrap();
        f.write_all(line.as_bytes()).unwrap();
    }
}

/// The run's settings, from the environment.
struct Settings {
    seed: u64,
    count: usize,
    kinds: Vec<FaultKind>,
    known_bugs: bool,
    keep: bool,
    balancer: bool,
    /// The workloads (a subset of [`WORKLOADS`], `probe` always among them).
    workloads: Vec<&'static str>,
    /// `MUSTER_SOAK=1`: how long the soak lasts.
    soak: Option<Duration>,
}

impl Settings {
    /// Workers of each side job (and of `in-place`): 4 in the soak, else [`NPROC`].
    fn side_nproc(&self) -> usize {
        if self.soak.is_some() { 4 } else { NPROC }
    }
}

impl Settings {
    fn from_env() -> Self {
        let var = |name: &str| std::env::var(name).ok().filter(|v| !v.is_empty());
        let seed = var("MUSTER_FAULT_SEED").map_or_else(
            || now_ms() ^ u64::from(std::process::id()).rotate_left(32),
            |s| {
                s.parse()
                    .unwrap_or_else(|e| panic!("MUSTER_FAULT_SEED {s:?}: {e}"))
            },
        );
        let long = var("MUSTER_FAULTS_LONG").is_some_and(|v| v != "0");
        let count =
            var("MUSTER_FAULT_COUNT").map_or(if long { LONG_COUNT } else { SHORT_COUNT }, |s| {
                s.parse()
                    .unwrap_or_else(|e| panic!("MUSTER_FAULT_COUNT {s:?}: {e}"))
            });
        let known_bugs = var("MUSTER_FAULT_KNOWN_BUGS").is_some_and(|v| v != "0");
        let kinds: Vec<FaultKind> = match var("MUSTER_FAULT_KINDS") {
            Some(list) => list
                .split(',')
                .map(|name| {
                    FaultKind::ALL
                        .into_iter()
                        .find(|k| k.name() == name.trim())
                        .unwrap_or_else(|| {
                            panic!(
                                "MUSTER_FAULT_KINDS: unknown kind {name:?}; kinds: {:?}",
                                FaultKind::ALL.map(FaultKind::name)
                            )
                        })
                })
                .collect(),
            None => FaultKind::ALL
                .into_iter()
                .filter(|k| known_bugs || !KNOWN_BUG_KINDS.contains(k))
                .collect(),
        };
        let workloads: Vec<&'static str> = match var("MUSTER_FAULT_WORKLOADS") {
            None => WORKLOADS.to_vec(),
            Some(list) => {
                let asked: Vec<&str> = list.split(',').map(str::trim).collect();
                for name in &asked {
                    assert!(
                        !NOT_YET.contains(name),
                        "MUSTER_FAULT_WORKLOADS: workload {name:?} is not written yet (issue 28); workloads: {WORKLOADS:?}"
                    );
                    assert!(
                        WORKLOADS.contains(name),
                        "MUSTER_FAULT_WORKLOADS: unknown workload {name:?}; workloads: {WORKLOADS:?}"
                    );
                }
                assert!(
                    asked.contains(&"probe"),
                    "MUSTER_FAULT_WORKLOADS: `probe` is the schedule's target and must be listed"
                );
                WORKLOADS
                    .iter()
                    .copied()
                    .filter(|w| asked.contains(w))
                    .collect()
            }
        };
        let soak = var("MUSTER_SOAK").filter(|v| v != "0").map(|_| {
            let minutes: u64 = var("MUSTER_SOAK_MINUTES").map_or(30, |m| {
                m.parse()
                    .unwrap_or_else(|e| panic!("MUSTER_SOAK_MINUTES {m:?}: {e}"))
            });
            Duration::from_secs(minutes * 60)
        });
        let (count, kinds) = match soak {
            // About one fault a minute, from the kinds that spare coordinators and agents.
            Some(d) => (
                usize::try_from(d.as_secs() / 60).unwrap_or(1).max(1),
                SOAK_KINDS.to_vec(),
            ),
            None => (count, kinds),
        };
        Self {
            seed,
            count,
            kinds,
            known_bugs,
            keep: var("MUSTER_FAULT_KEEP").is_some_and(|v| v != "0"),
            balancer: BALANCER || var("MUSTER_FAULT_BALANCER").is_some_and(|v| v != "0"),
            workloads,
            soak,
        }
    }
}

/// Everything that runs: etcd, the replicas and the agents.
struct Cluster {
    etcd: Etcd,
    replicas: Replicas,
    agents: Vec<Agent>,
    /// Agents replaced after a kill, kept for their output.
    dead_agents: Vec<(usize, Agent)>,
    /// The run's own copies of `fault_probe` and `muster-agent` (a build of the workspace
    /// during a long run must not pull the binaries from under it).
    probe: PathBuf,
    agent: PathBuf,
    job: String,
    history_path: PathBuf,
    marker: (String, String),
    max_restarts: u32,
    history: History,
    /// The coordinator addresses the agents are given: the replicas' own, or with network
    /// namespaces the proxies' on the uplink.
    agent_addrs: String,
    /// Network namespaces (one host per agent), when the machine has them: link cuts need them.
    net: Option<Links>,
    /// [`BALANCER`] or `MUSTER_FAULT_BALANCER=1`.
    balancer: bool,
    /// The `in-place` workload's job, when it runs.
    in_place: Option<InPlace>,
}

/// The `in-place` workload's job: 2 nodes of half its ranks and a spare agent standing by.
/// Every agent gets the same flags: the first two to join are its nodes, a later one finds
/// the job full and stands by as its spare (`--max-spares 1`).
struct InPlace {
    id: String,
    /// The failure-free run's checksum.
    reference: String,
    /// `muster-agent launch`'s arguments and environment.
    args: Vec<String>,
    env: Vec<(String, String)>,
    /// Its agents, and those the schedule killed (kept for their output).
    agents: Vec<Agent>,
    lost: Vec<Agent>,
    /// What the owner scan saw: two live trainers of one rank.
    doubled: Arc<Mutex<Vec<String>>>,
    /// Late writes of a replaced node that were not refused, or that changed the job.
    late: Vec<String>,
}

impl InPlace {
    fn start_agent(&self, agent: &Path) -> Agent {
        let mut cmd = std::process::Command::new(agent);
        cmd.args(&self.args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())));
        Agent::spawn(cmd, format!("in-place job {}", self.id))
    }
}

/// The `in-place` job's live trainers by rank (`RANK` in their environment), from `/proc`.
fn trainers_by_rank(marker: &str) -> BTreeMap<String, Vec<i32>> {
    let mut by_rank: BTreeMap<String, Vec<i32>> = BTreeMap::new();
    for (pid, what) in marked_processes(marker) {
        if !what
            .split_whitespace()
            .nth(2)
            .is_some_and(|p| p.ends_with("/ddp_train"))
        {
            continue;
        }
        let environ = std::fs::read(format!("/proc/{pid}/environ")).unwrap_or_default();
        if let Some(rank) = environ
            .split(|b| *b == 0)
            .find_map(|v| v.strip_prefix(b"RANK="))
        {
            by_rank
                .entry(String::from_utf8_lossy(rank).into_owned())
                .or_default()
                .push(pid);
        }
    }
    by_rank
}

/// Scans the `in-place` job's trainers every 100 ms until `stop`, keeping every sight of a
/// rank with two live processes (each checked again once, 50 ms later, so that a process
/// caught between its exit and its reaping is not counted).
fn scan_owners(
    marker: String,
    doubled: Arc<Mutex<Vec<String>>>,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        while !stop.load(Ordering::SeqCst) {
            let twice: Vec<(String, Vec<i32>)> = trainers_by_rank(&marker)
                .into_iter()
                .filter(|(_, pids)| pids.len() > 1)
                .collect();
            if !twice.is_empty() {
                std::thread::sleep(Duration::from_millis(50));
                let again = trainers_by_rank(&marker);
                for (rank, pids) in twice {
                    let still: Vec<i32> = again
                        .get(&rank)
                        .map(|now| pids.iter().copied().filter(|p| now.contains(p)).collect())
                        .unwrap_or_default();
                    if still.len() > 1 {
                        doubled.lock().unwrap().push(format!(
                            "rank {rank} had live trainers {still:?} at {}",
                            now_ms()
                        ));
                    }
                }
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    })
}

/// The agents' hosts, and the way from them to the replicas.
struct Links {
    // Dropped in this order: the proxies and the uplink before the namespaces.
    proxies: Vec<Option<TcpProxy>>,
    uplink: Uplink,
    net: Net,
}

impl Links {
    /// Hosts `n0`, `n1`, ... and the uplink; `None` (after printing why) where network
    /// namespaces are unavailable.
    fn setup() -> Option<Self> {
        let names: Vec<String> = (0..NODES).map(|n| format!("n{n}")).collect();
        let net = Net::setup(&names.iter().map(String::as_str).collect::<Vec<_>>())?;
        let uplink = Uplink::attach(&net, "n0");
        Some(Self {
            proxies: Vec::new(),
            uplink,
            net,
        })
    }

    /// A proxy per replica on the uplink (same port); returns the proxies' addresses.
    fn forward(&mut self, replicas: &Replicas) -> String {
        let mut addrs = Vec::new();
        for i in 0..replicas.len() {
            self.proxies.push(None);
            addrs.push(self.open(replicas, i));
        }
        addrs.join(",")
    }

    /// (Re)starts replica `i`'s proxy; returns its address.
    fn open(&mut self, replicas: &Replicas, i: usize) -> String {
        let upstream: std::net::SocketAddr = replicas.addr(i).parse().unwrap();
        let listen = std::net::SocketAddr::from((self.uplink.addr, upstream.port()));
        // The port may be held for a moment by the previous listener's last connection.
        let deadline = Instant::now() + Duration::from_secs(10);
        let proxy = loop {
            match TcpProxy::start(listen, upstream) {
                Ok(p) => break p,
                Err(e) if Instant::now() < deadline => {
                    eprintln!("proxy {listen} not started yet: {e}");
                    std::thread::sleep(Duration::from_millis(100));
                }
                Err(e) => panic!("cannot listen on {listen}: {e}"),
            }
        };
        self.proxies[i] = Some(proxy);
        listen.to_string()
    }

    /// Closes replica `i`'s proxy: while the replica is down its address refuses connections,
    /// as a dead host's port does (a proxy that accepted and then closed them would be another
    /// topology: a load balancer in front of the replicas).
    fn close(&mut self, i: usize) {
        self.proxies[i] = None;
    }
}

impl Cluster {
    fn start_agent(&self, node: usize) -> Agent {
        let addrs = self.agent_addrs.clone();
        let node = node.to_string();
        let nnodes = NODES.to_string();
        let nproc = NPROC.to_string();
        let max_restarts = self.max_restarts.to_string();
        let history = self.history_path.display().to_string();
        let args = [
            "launch",
            "--coordinator",
            &addrs,
            "--job-id",
            &self.job,
            "--nnodes",
            &nnodes,
            "--node-rank",
            &node,
            "--nproc-per-node",
            &nproc,
            "--max-restarts",
            &max_restarts,
            "--grace-period-ms",
            "1000",
            "--",
            &self.probe.display().to_string(),
        ];
        let env = [
            ("NO_COLOR", "1"),
            ("MUSTER_FAULT_HISTORY", &history),
            (&self.marker.0, &self.marker.1),
        ];
        match &self.net {
            Some(links) => links
                .net
                .spawn(&format!("n{node}"), &self.agent, &args, &env),
            None => {
                let mut cmd = std::process::Command::new(&self.agent);
                cmd.args(args).envs(env);
                Agent::spawn(cmd, format!("agent {node}: {}", args.join(" ")))
            }
        }
    }

    fn marker(&self) -> String {
        format!("{}={}", self.marker.0, self.marker.1)
    }

    /// Starts a side job (`multi-job`, `torch-store`): one local agent of [`NPROC`] workers
    /// running `command`, appending to `history`; `stop_file` is the torch workers' signal to
    /// end.
    fn start_side_agent(
        &self,
        id: &str,
        nproc: usize,
        history: &Path,
        stop_file: &Path,
        command: &[String],
    ) -> Agent {
        let nproc = nproc.to_string();
        let max_restarts = self.max_restarts.to_string();
        let history = history.display().to_string();
        let stop_file = stop_file.display().to_string();
        let mut args: Vec<String> = [
            "launch",
            "--coordinator",
            &self.agent_addrs,
            "--job-id",
            id,
            "--nnodes",
            "1",
            "--nproc-per-node",
            &nproc,
            "--max-restarts",
            &max_restarts,
            "--grace-period-ms",
            "1000",
            "--",
        ]
        .map(str::to_owned)
        .to_vec();
        args.extend(command.iter().cloned());
        let mut cmd = std::process::Command::new(&self.agent);
        cmd.args(&args).envs([
            ("NO_COLOR", "1"),
            ("MUSTER_FAULT_HISTORY", history.as_str()),
            ("MUSTER_FAULT_STOP_FILE", stop_file.as_str()),
            (self.marker.0.as_str(), self.marker.1.as_str()),
        ]);
        Agent::spawn(cmd, format!("side job {id}: {}", args.join(" ")))
    }

    /// The running (not stopped) workers of the run: `fault_probe`s, `torch-store`'s torch
    /// clients, `python`'s SDK workers and `in-place`'s trainers.
    fn workers(&self) -> Vec<i32> {
        let probe = self.probe.display().to_string();
        marked_processes(&self.marker())
            .into_iter()
            .filter(|(_, what)| {
                let mut parts = what.split_whitespace();
                let _pid = parts.next();
                let state = parts.next().unwrap_or_default();
                let program = parts.next();
                let script = parts.next().unwrap_or_default();
                state != "[T]"
                    && (program == Some(probe.as_str())
                        || program.is_some_and(|p| p.ends_with("/ddp_train"))
                        || script.ends_with("/fault_store.py")
                        || script.ends_with("/fault_python.py"))
            })
            .map(|(pid, _)| pid)
            .collect()
    }

    /// The replica that leads (the only one SERVING), waiting up to 20 s; `None` if none
    /// does by then.
    fn leader(&self, rt: &tokio::runtime::Runtime) -> Option<usize> {
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let [one] = rt.block_on(self.replicas.serving())[..] {
                return Some(one);
            }
            if Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Injects `fault` and undoes it (resume, restart) after its duration; returns what it hit.
    fn inject(&mut self, rt: &tokio::runtime::Runtime, fault: &Fault) -> String {
        let hold = Duration::from_millis(fault.duration_ms);
        match fault.kind {
            FaultKind::LeaderKill => {
                let Some(leader) = self.leader(rt) else {
                    return "skipped: no leader within 20 s".into();
                };
                self.replicas.kill(leader);
                if let Some(links) = &mut self.net
                    && !self.balancer
                {
                    links.close(leader);
                }
                std::thread::sleep(hold);
                self.replicas.restart(leader);
                if let Some(links) = &mut self.net
                    && !self.balancer
                {
                    links.open(&self.replicas, leader);
                }
                format!("replica {leader}")
            }
            FaultKind::LeaderPauseShort | FaultKind::LeaderPauseLong => {
                let Some(leader) = self.leader(rt) else {
                    return "skipped: no leader within 20 s".into();
                };
                self.replicas.stop(leader);
                std::thread::sleep(hold);
                self.replicas.cont(leader);
                format!("replica {leader}")
            }
            FaultKind::EtcdKill | FaultKind::EtcdOutageLong => {
                self.etcd.kill(0);
                std::thread::sleep(hold);
                self.etcd.restart_retrying(0);
                "etcd member 0".into()
            }
            FaultKind::EtcdPause => {
                let pid = pid(self.etcd.pid(0));
                signal(pid, Signal::SIGSTOP);
                std::thread::sleep(hold);
                signal(pid, Signal::SIGCONT);
                format!("etcd member 0 (pid {pid})")
            }
            FaultKind::AgentKill => {
                let node = usize::try_from(fault.target).unwrap_or(0) % NODES;
                let pid = self.agents[node].pid();
                self.agents[node].signal(Signal::SIGKILL);
                let deadline = Instant::now() + Duration::from_secs(10);
                while !self.agents[node].exited() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                std::thread::sleep(hold);
                let fresh = self.start_agent(node);
                let old = std::mem::replace(&mut self.agents[node], fresh);
                self.dead_agents.push((node, old));
                format!("agent {node} (pid {pid}), started again")
            }
            FaultKind::AgentPause => {
                let node = usize::try_from(fault.target).unwrap_or(0) % NODES;
                let agent = &self.agents[node];
                agent.signal(Signal::SIGSTOP);
                std::thread::sleep(hold);
                agent.signal(Signal::SIGCONT);
                format!("agent {node} (pid {})", agent.pid())
            }
            FaultKind::WorkerKill | FaultKind::WorkerPause => {
                let workers = self.workers();
                if workers.is_empty() {
                    return "skipped: no worker running".into();
                }
                let pid = workers[usize::try_from(fault.target).unwrap_or(0) % workers.len()];
                if fault.kind == FaultKind::WorkerKill {
                    signal(pid, Signal::SIGKILL);
                } else {
                    signal(pid, Signal::SIGSTOP);
                    std::thread::sleep(hold);
                    signal(pid, Signal::SIGCONT);
                }
                format!("worker pid {pid}")
            }
            FaultKind::NodeLoss => {
                let agent_bin = self.agent.clone();
                let addrs: Vec<String> = (0..self.replicas.len())
                    .map(|r| self.replicas.addr(r).to_owned())
                    .collect();
                let Some(job) = &mut self.in_place else {
                    return "skipped: no in-place job".into();
                };
                if job.agents.is_empty() {
                    return "skipped: the in-place job has no agent".into();
                }
                if job.agents.iter_mut().any(Agent::exited) {
                    return "skipped: the in-place job has ended".into();
                }
                let i = usize::try_from(fault.target).unwrap_or(0) % job.agents.len();
                let pid = job.agents[i].pid();
                // The node it holds (agents' node ids end with their pid); none for a spare.
                let held = rt
                    .block_on(in_place_view(&addrs, &job.id))
                    .ok()
                    .and_then(|d| {
                        d.nodes
                            .into_iter()
                            .find(|n| n.node_id.ends_with(&format!("-{pid}")))
                    });
                job.agents[i].signal(Signal::SIGKILL);
                let deadline = Instant::now() + Duration::from_secs(10);
                while !job.agents[i].exited() && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(10));
                }
                let lost = job.agents.remove(i);
                job.lost.push(lost);
                std::thread::sleep(hold);
                let fresh = job.start_agent(&agent_bin);
                job.agents.push(fresh);
                let mut detail = format!("in-place agent {i} (pid {pid}), a new one started");
                match held.map(|node| rt.block_on(late_writes(&addrs, &job.id, &node))) {
                    Some(Ok(seen)) => detail.push_str(&format!("; {seen}")),
                    Some(Err(violation)) => {
                        detail.push_str(&format!("; {violation}"));
                        job.late.push(violation);
                    }
                    None => {}
                }
                detail
            }
            FaultKind::LinkCut => {
                let Some(links) = &self.net else {
                    return "skipped: network namespaces are not available here".into();
                };
                let node = usize::try_from(fault.target).unwrap_or(0) % NODES;
                let host = format!("n{node}");
                links.net.cut(&host);
                std::thread::sleep(hold);
                links.net.heal(&host);
                format!("agent {node}'s link (host {host})")
            }
        }
    }

    /// Whether an agent exited by itself (not one the schedule killed).
    fn an_agent_ended(&mut self) -> Option<usize> {
        (0..self.agents.len()).find(|i| self.agents[*i].exited())
    }
}

/// Whether a new agent the schedule started was refused because the job had finished before
/// its join arrived (the job can end between the skip check and the join): the product's
/// answer to a plain launch on a finished job id, exit 1, not a failure of the job.
fn arrived_late(run: &muster_tests::Finished) -> bool {
    run.code() == Some(1)
        && run
            .stderr
            .iter()
            .any(|l| l.contains("rendezvous of job") && l.contains("has finished"))
}

/// The in-place job's `DescribeJob` from whichever replica answers (the leader).
async fn in_place_view(addrs: &[String], job: &str) -> Result<pb::DescribeJobResponse, String> {
    let mut last = String::from("no replica");
    for addr in addrs {
        match leader_call(addr, |ch| async move {
            pb::ops_client::OpsClient::new(ch)
                .describe_job(pb::DescribeJobRequest {
                    job_id: job.into(),
                    ..Default::default()
                })
                .await
        })
        .await
        {
            Ok(d) => return Ok(d),
            Err(e) => last = format!("{e:?}"),
        }
    }
    Err(last)
}

/// One call at `addr`, within 2 s.
async fn leader_call<T, F>(
    addr: &str,
    call: impl FnOnce(tonic::transport::Channel) -> F,
) -> Result<T, tonic::Status>
where
    F: std::future::Future<Output = Result<tonic::Response<T>, tonic::Status>>,
{
    let run = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| tonic::Status::internal(e.to_string()))?
            .connect_timeout(Duration::from_millis(500))
            .connect()
            .await
            .map_err(|e| tonic::Status::unavailable(format!("connect: {e}")))?;
        call(channel).await.map(tonic::Response::into_inner)
    };
    tokio::time::timeout(Duration::from_secs(2), run)
        .await
        .unwrap_or_else(|_| Err(tonic::Status::unavailable("no answer within 2 s")))
}

/// [`INV_LATE_WRITES`]: once a spare took `node`'s place, the lost agent's late writes (a
/// `Join` as that node, a `ReportFailure` for its first rank) are refused, naming the spare,
/// and change neither the job's membership epoch nor its restarts. `Ok` says what was seen
/// (also when no spare took the place: nothing is sent then); `Err` is the violation.
async fn late_writes(addrs: &[String], job: &str, node: &pb::NodeInfo) -> Result<String, String> {
    let id = &node.node_id;
    let deadline = Instant::now() + Duration::from_secs(10);
    let before = loop {
        if let Ok(d) = in_place_view(addrs, job).await
            && (d.replaced.contains_key(id) || d.summary.as_ref().is_some_and(|s| s.done))
        {
            break d;
        }
        if Instant::now() >= deadline {
            return Ok(format!(
                "no spare took node '{id}' within 10 s: no late writes sent"
            ));
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    if !before.replaced.contains_key(id) {
        return Ok("the job ended before a spare took the place: no late writes sent".into());
    }
    let generation = before.summary.as_ref().map_or(0, |s| s.generation);
    // Each call goes to whichever replica leads (the others answer UNAVAILABLE).
    let mut outcomes = vec![];
    for call in ["Join", "ReportFailure"] {
        let mut got = Err(tonic::Status::unavailable("no replica"));
        for addr in addrs {
            got = match call {
                "Join" => leader_call(addr, |ch| async move {
                    pb::rendezvous_client::RendezvousClient::new(ch)
                        .join(pb::JoinRequest {
                            job_id: job.into(),
                            node_id: id.clone(),
                            host: node.host.clone(),
                            local_world_size: node.local_world_size,
                            request_id: format!("late-{id}"),
                            ..Default::default()
                        })
                        .await
                })
                .await
                .map(drop),
                _ => leader_call(addr, |ch| async move {
                    pb::rendezvous_client::RendezvousClient::new(ch)
                        .report_failure(pb::ReportFailureRequest {
                            job_id: job.into(),
                            generation,
                            rank: node.rank_offset,
                            reason: "a late report of the replaced agent".into(),
                            exit_code: Some(1),
                            node_id: id.clone(),
                            ..Default::default()
                        })
                        .await
                })
                .await
                .map(drop),
            };
            if !matches!(&got, Err(s) if s.code() == tonic::Code::Unavailable) {
                break;
            }
        }
        outcomes.push((call, got));
    }
    let after = in_place_view(addrs, job).await?;
    let done = after.summary.as_ref().is_some_and(|s| s.done);
    for (call, got) in &outcomes {
        match got {
            Err(s)
                if s.code() == tonic::Code::PermissionDenied
                    && s.message().contains("was replaced by spare") => {}
            // The job ended meanwhile: a final job refuses everything.
            Err(s) if done && s.code() == tonic::Code::FailedPrecondition => {}
            Err(s) => {
                return Err(format!(
                    "the late {call} of replaced node '{id}' got {:?}: {}",
                    s.code(),
                    s.message()
                ));
            }
            Ok(()) => {
                return Err(format!(
                    "the late {call} of replaced node '{id}' was accepted"
                ));
            }
        }
    }
    if (after.epoch, after.restart_count) != (before.epoch, before.restart_count) {
        return Err(format!(
            "replaced node '{id}''s refused late writes changed the job: epoch {} -> {}, restarts {} -> {}",
            before.epoch, after.epoch, before.restart_count, after.restart_count
        ));
    }
    Ok(format!(
        "the late Join and ReportFailure of replaced node '{id}' were refused"
    ))
}

fn pid(p: u32) -> i32 {
    i32::try_from(p).unwrap()
}

fn signal(p: i32, s: Signal) {
    // The process may have died on its own meanwhile: not a harness error.
    let _ = nix::sys::signal::kill(Pid::from_raw(p), s);
}

/// Asks every replica for `DescribeJob(job)` every 200 ms until `stop`, and records each
/// answer (from whichever replica gives one: a deposed leader that still answers is exactly
/// what the final-state check must see).
fn observe(
    addrs: Vec<String>,
    job: String,
    history: History,
    stop: Arc<AtomicBool>,
) -> std::thread::JoinHandle<usize> {
    std::thread::spawn(move || {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let mut answers = 0;
        let mut last_error: Vec<Option<String>> = vec![None; addrs.len()];
        while !stop.load(Ordering::SeqCst) {
            for (replica, addr) in addrs.iter().enumerate() {
                match rt.block_on(describe(replica, addr, &job)) {
                    Ok(o) => {
                        history.record(&Event::Observe {
                            t_ms: now_ms(),
                            observation: o,
                        });
                        answers += 1;
                        last_error[replica] = None;
                    }
                    Err(error) if last_error[replica].as_ref() != Some(&error) => {
                        history.record(&Event::ObserveError {
                            t_ms: now_ms(),
                            replica,
                            error: error.clone(),
                        });
                        last_error[replica] = Some(error);
                    }
                    Err(_) => {}
                }
            }
            std::thread::sleep(Duration::from_millis(200));
        }
        answers
    })
}

/// One `DescribeJob` at `addr`, within a second: the answer, or what failed (the status
/// code and message without the details that change between calls).
async fn describe(replica: usize, addr: &str, job: &str) -> Result<Observation, String> {
    let call = async {
        let channel = tonic::transport::Endpoint::from_shared(format!("http://{addr}"))
            .map_err(|e| e.to_string())?
            .connect_timeout(Duration::from_millis(500))
            .connect()
            .await
            .map_err(|e| format!("connect: {e}"))?;
        pb::ops_client::OpsClient::new(channel)
            .describe_job(pb::DescribeJobRequest {
                job_id: job.into(),
                ..Default::default()
            })
            .await
            .map_err(|s| format!("{:?}: {}", s.code(), s.message()))
    };
    let answer = tokio::time::timeout(Duration::from_secs(1), call)
        .await
        .map_err(|_| "no answer within 1 s".to_owned())??
        .into_inner();
    let summary = answer.summary.unwrap_or_default();
    let state = pb::RoundState::try_from(summary.state)
        .map(|s| {
            s.as_str_name()
                .trim_start_matches("ROUND_STATE_")
                .to_owned()
        })
        .unwrap_or_else(|_| format!("state {}", summary.state));
    Ok(Observation {
        replica,
        generation: summary.generation,
        state,
        done: summary.done,
        restart_count: summary.restart_count.max(answer.restart_count),
        max_restarts: summary.max_restarts,
        ranks: answer.ranks.iter().map(pb::RankInfo::rank).collect(),
        failure: answer
            .failure
            .map(|f| format!("rank {} node {}: {}", f.rank(), f.node_rank(), f.reason)),
    })
}

/// Sets the key that makes the workers stop (through whichever replica leads).
fn ask_to_stop(rt: &tokio::runtime::Runtime, addrs: &str, job: &str) {
    rt.block_on(async {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let attempt = async {
                let kv = Kv::new(Coordinator::connect(addrs).await?, job.to_owned());
                kv.set("fault-stop", "1").await
            };
            match tokio::time::timeout(Duration::from_secs(20), attempt).await {
                Ok(Ok(())) => return,
                Ok(Err(e)) if Instant::now() < deadline => eprintln!("fault-stop not set: {e}"),
                Err(_) if Instant::now() < deadline => eprintln!("fault-stop not set in 20 s"),
                other => panic!("cannot set fault-stop for job {job}: {other:?}"),
            }
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    });
}

/// Runs the checker alone over a kept history (`MUSTER_FAULT_CHECK=<path>`), with the budget
/// the coordinators reported; panics listing the violations.
fn check_again(path: &Path) {
    let (events, bad) = faults::read_history(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let max_restarts = events
        .iter()
        .find_map(|e| match e {
            Event::Observe { observation, .. } => Some(observation.max_restarts),
            _ => None,
        })
        .unwrap_or(0);
    let violations = check_all(&events, max_restarts);
    println!(
        "{}: {} events, {} lines that are not events, max_restarts {max_restarts}",
        path.display(),
        events.len(),
        bad.len()
    );
    for v in &violations {
        println!("VIOLATION {v}");
    }
    assert!(violations.is_empty(), "{} violation(s)", violations.len());
}

#[test]
fn randomized_faults_keep_the_invariants() {
    if let Some(path) = std::env::var_os("MUSTER_FAULT_CHECK") {
        check_again(Path::new(&path));
        return;
    }
    let Some(probe_bin) = example_bin("fault_probe") else {
        println!("skipped: worker-sdk/examples/fault_probe.rs does not exist");
        return;
    };
    let settings = Settings::from_env();
    let Some(etcd) = Etcd::start(1) else { return };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    let gap = if settings.soak.is_some() {
        SOAK_GAP_MS
    } else {
        GAP_MS
    };
    let plan = schedule(settings.seed, settings.count, &settings.kinds, gap);
    let max_restarts = max_restarts(settings.count);
    println!(
        "fault injection: seed {}, workloads {} ({} faults of {:?}; replay with MUSTER_FAULT_SEED={} MUSTER_FAULT_COUNT={} MUSTER_FAULT_WORKLOADS={}{})",
        settings.seed,
        settings.workloads.join(","),
        settings.count,
        settings.kinds.iter().map(|k| k.name()).collect::<Vec<_>>(),
        settings.seed,
        settings.count,
        settings.workloads.join(","),
        if settings.known_bugs {
            " MUSTER_FAULT_KNOWN_BUGS=1"
        } else {
            ""
        }
    );
    for f in &plan {
        println!("  {f}");
    }
    let dir = std::env::temp_dir().join(format!(
        "muster-faults-{}-{}",
        std::process::id(),
        settings.seed
    ));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let history_path = dir.join("history.jsonl");
    let (probe, agent) = (dir.join("fault_probe"), dir.join("muster-agent"));
    std::fs::copy(&probe_bin, &probe).unwrap();
    std::fs::copy(muster_tests::agent_bin(), &agent).unwrap();
    let history = History::open(&history_path);
    println!("history: {}", history_path.display());

    let started = Instant::now();
    // With link cuts, the agents run in network namespaces and reach the replicas through
    // proxies on an uplink; the replicas advertise the uplink's address (their leader hints
    // must be reachable from the agents).
    let mut links = if settings.kinds.contains(&FaultKind::LinkCut) {
        let links = Links::setup();
        if links.is_none() {
            println!("link-cut faults are skipped: no network namespaces (see above)");
        }
        links
    } else {
        None
    };
    let advertise = links.as_ref().map(|l| l.uplink.addr.to_string());
    let replicas = Replicas::start_advertising(&etcd, REPLICAS, TTL, &[], advertise.as_deref());
    rt.block_on(replicas.wait_leader(Duration::from_secs(20), &[]));
    let job = format!("faults-{}", settings.seed);
    let agent_addrs = match &mut links {
        Some(links) => links.forward(&replicas),
        None => replicas.addrs(),
    };
    let mut cluster = Cluster {
        etcd,
        replicas,
        agents: Vec::new(),
        dead_agents: Vec::new(),
        probe,
        agent,
        job: job.clone(),
        history_path: history_path.clone(),
        marker: (
            "MUSTER_FAULT_RUN".into(),
            format!("{}-{}", std::process::id(), settings.seed),
        ),
        max_restarts,
        history: history.clone(),
        agent_addrs,
        net: links,
        balancer: settings.balancer,
        in_place: None,
    };
    cluster.agents = (0..NODES).map(|n| cluster.start_agent(n)).collect();
    let stop_observing = Arc::new(AtomicBool::new(false));
    let addrs: Vec<String> = (0..REPLICAS)
        .map(|i| cluster.replicas.addr(i).to_owned())
        .collect();
    let observer = observe(
        addrs,
        job.clone(),
        history.clone(),
        Arc::clone(&stop_observing),
    );
    // The schedule starts once every worker of the first generation runs (before any side
    // job starts).
    let deadline = Instant::now() + Duration::from_secs(60);
    while cluster.workers().len() < NODES * NPROC {
        assert!(
            Instant::now() < deadline,
            "the job's workers did not all start within 60 s\n{}\n{}",
            cluster
                .agents
                .iter()
                .map(Agent::output)
                .collect::<Vec<_>>()
                .join("\n"),
            cluster.replicas.logs()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    println!("the job runs after {:?}", started.elapsed());
    // multi-job: more jobs on the same replicas, each with a history of its own.
    let mut sides: Vec<SideJob> = Vec::new();
    let mut side_jobs: Vec<(String, Vec<String>)> = Vec::new();
    if settings.workloads.contains(&"multi-job") {
        let count = if settings.soak.is_some() {
            SOAK_SIDE_JOBS
        } else {
            SIDE_JOBS
        };
        for i in 0..count {
            side_jobs.push((
                format!("{job}-side-{i}"),
                vec![cluster.probe.display().to_string()],
            ));
        }
    }
    // A Python workload: its script under the peers' venv, which must have `package`.
    let python_job = |workload: &str, package: &str, script: &str| {
        let python = muster_tests::peers_python(&[package]);
        if python.is_none() {
            println!(
                "the {workload} workload is skipped: no `{package}` in the peers' venv (see above)"
            );
        }
        python.map(|python| {
            (
                format!("{job}-{workload}"),
                vec![
                    python.display().to_string(),
                    muster_tests::workspace_root()
                        .join("tests/python")
                        .join(script)
                        .display()
                        .to_string(),
                ],
            )
        })
    };
    if settings.workloads.contains(&"torch-store") {
        side_jobs.extend(python_job("torch-store", "torch", "fault_store.py"));
    }
    // in-place: the failure-free reference first (on an embedded coordinator, away from the
    // faults), then the job under the schedule.
    let mut owner_scan = None;
    let stop_scanning = Arc::new(AtomicBool::new(false));
    if settings.workloads.contains(&"in-place") {
        match example_bin("ddp_train") {
            Some(bin) => {
                let trainer = dir.join("ddp_train");
                std::fs::copy(&bin, &trainer).unwrap();
                let trainer = trainer.display().to_string();
                let nproc = settings.side_nproc().to_string();
                // In the soak the training lasts the soak: its 240 steps spread over it.
                let sleep_ms = settings
                    .soak
                    .map_or(100, |d| u64::try_from(d.as_millis() / 240).unwrap_or(100))
                    .to_string();
                let mut args = vec!["launch", "--nproc-per-node", &nproc, "--job-id"];
                let reference_job = format!("{job}-in-place-reference");
                args.push(&reference_job);
                args.push("--");
                args.push(&trainer);
                args.extend_from_slice(IN_PLACE_TRAIN);
                let mut cmd = std::process::Command::new(&cluster.agent);
                cmd.args(&args)
                    .envs([("MUSTER_COMM_BACKEND", "cpu"), ("NO_COLOR", "1")]);
                let run = Agent::spawn(cmd, String::from("in-place reference"))
                    .finish(Duration::from_secs(120));
                assert_eq!(run.code(), Some(0), "{}", run.dump());
                let reference = muster_tests::recovery::checksum(&run);
                let id = format!("{job}-in-place");
                let max = max_restarts.to_string();
                // 2 nodes of half the ranks each: the same world size and checksum.
                let per_node = (settings.side_nproc() / 2).max(1).to_string();
                let mut args: Vec<&str> = vec![
                    "launch",
                    "--coordinator",
                    &cluster.agent_addrs,
                    "--job-id",
                    &id,
                    "--nnodes",
                    "2",
                    "--nproc-per-node",
                    &per_node,
                    "--recovery",
                    "in-place",
                    "--max-restarts",
                    &max,
                    "--max-spares",
                    "1",
                    "--grace-period-ms",
                    "1000",
                ];
                // In the soak a step comes every 7.5 s and takes milliseconds: the ranks sleep
                // between steps, use no CPU and complete no muster barrier (their all_reduce
                // goes peer to peer), and a native program's changing stack does not count,
                // so by the rules of docs/hangs.md the job makes no progress and is reported
                // hung after 5 minutes, its workers dumped. The rules say to turn detection
                // off for such a job.
                if settings.soak.is_some() {
                    args.extend_from_slice(&["--hang-timeout", "off"]);
                }
                args.extend_from_slice(&["--", &trainer]);
                args.extend_from_slice(IN_PLACE_TRAIN);
                args.extend_from_slice(&["--step-sleep-ms", &sleep_ms]);
                let mut job = InPlace {
                    id: id.clone(),
                    reference: reference.clone(),
                    args: args.iter().map(|a| (*a).to_owned()).collect(),
                    env: [
                        ("MUSTER_COMM_BACKEND", "cpu"),
                        ("NO_COLOR", "1"),
                        (cluster.marker.0.as_str(), cluster.marker.1.as_str()),
                    ]
                    .map(|(k, v)| (k.to_owned(), v.to_owned()))
                    .to_vec(),
                    agents: vec![],
                    lost: vec![],
                    doubled: Arc::default(),
                    late: Vec::new(),
                };
                // The nodes first, the spare once they run (it finds the job full).
                job.agents.push(job.start_agent(&cluster.agent));
                job.agents.push(job.start_agent(&cluster.agent));
                let deadline = Instant::now() + Duration::from_secs(60);
                while trainers_by_rank(&cluster.marker()).len() < settings.side_nproc()
                    && Instant::now() < deadline
                {
                    std::thread::sleep(Duration::from_millis(50));
                }
                job.agents.push(job.start_agent(&cluster.agent));
                owner_scan = Some(scan_owners(
                    cluster.marker(),
                    Arc::clone(&job.doubled),
                    Arc::clone(&stop_scanning),
                ));
                println!(
                    "job {id} started (in-place, 2 nodes and {} spare; the failure-free {reference})",
                    IN_PLACE_AGENTS - 2
                );
                cluster.in_place = Some(job);
            }
            None => println!("the in-place workload is skipped: no ddp_train example"),
        }
    }
    if settings.workloads.contains(&"python") {
        side_jobs.extend(python_job("python", "muster", "fault_python.py"));
    }
    {
        for (id, command) in side_jobs {
            let path = dir.join(format!("history-{id}.jsonl"));
            let history = History::open(&path);
            let stop_file = dir.join(format!("stop-{id}"));
            let agent =
                cluster.start_side_agent(&id, settings.side_nproc(), &path, &stop_file, &command);
            let observer = observe(
                (0..REPLICAS)
                    .map(|r| cluster.replicas.addr(r).to_owned())
                    .collect(),
                id.clone(),
                history.clone(),
                Arc::clone(&stop_observing),
            );
            println!("job {id} started: {}", command.join(" "));
            sides.push(SideJob {
                id,
                agent: Some(agent),
                path,
                history,
                observer: Some(observer),
                stop_file,
            });
        }
    }

    // The soak compares memory and descriptors between its start, taken after
    // [`SOAK_WARMUP`] while the faults go on, and its end.
    let warmed_at = Instant::now() + SOAK_WARMUP;
    let mut soak_start = None;
    let mut injected = 0;
    for fault in &plan {
        let due = Instant::now() + Duration::from_millis(fault.gap_ms);
        if settings.soak.is_some() && soak_start.is_none() && warmed_at <= due {
            std::thread::sleep(warmed_at.saturating_duration_since(Instant::now()));
            let u = Usage::of(&cluster, &sides);
            println!("soak start: {u}");
            soak_start = Some(u);
        }
        std::thread::sleep(due.saturating_duration_since(Instant::now()));
        if let Some(node) = cluster.an_agent_ended() {
            println!(
                "agent {node} ended before fault #{}: the schedule stops here",
                fault.index
            );
            break;
        }
        let t_ms = now_ms();
        let detail = cluster.inject(&rt, fault);
        println!(
            "{:>7.1}s {fault}: {detail}",
            started.elapsed().as_secs_f64()
        );
        let event = Event::Fault {
            t_ms,
            index: fault.index,
            kind: fault.kind.name().into(),
            detail,
        };
        cluster.history.record(&event);
        for side in &sides {
            side.history.record(&event);
        }
        injected += 1;
    }
    let schedule_took = started.elapsed();
    let soak_end = settings.soak.map(|_| {
        let u = Usage::of(&cluster, &sides);
        println!("soak end:   {u}");
        u
    });
    if settings.soak.is_some() && soak_start.is_none() {
        println!(
            "soak: the schedule ended within the warm-up ({SOAK_WARMUP:?}): no start figures, memory not compared"
        );
    }

    // The end: stop the workers, wait for every agent.
    let stop_asked = Instant::now();
    ask_to_stop(&rt, &cluster.replicas.addrs(), &job);
    for side in &sides {
        std::fs::write(&side.stop_file, b"stop").unwrap();
        ask_to_stop(&rt, &cluster.replicas.addrs(), &side.id);
    }
    let deadline = stop_asked + STOP_DEADLINE;
    // When each side job's agent was first seen exited (its own deadline, apart from the
    // others').
    let mut side_ended: Vec<Option<Duration>> = vec![None; sides.len()];
    loop {
        for (i, side) in sides.iter_mut().enumerate() {
            if side_ended[i].is_none() && side.agent.as_mut().is_some_and(Agent::exited) {
                side_ended[i] = Some(stop_asked.elapsed());
            }
        }
        let running = cluster.agents.iter_mut().any(|a| !a.exited())
            || side_ended.iter().any(Option::is_none);
        if !running || Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    for (side, ended) in sides.iter_mut().zip(&side_ended) {
        let Some(mut agent) = side.agent.take() else {
            continue;
        };
        let (code, out) = if agent.exited() {
            let run = agent.finish(Duration::from_secs(1));
            (run.code(), run.dump())
        } else {
            (None, agent.output())
        };
        side.history.record(&Event::JobEnd {
            t_ms: now_ms(),
            elapsed_ms: ended.map(|e| u64::try_from(e.as_millis()).unwrap_or(u64::MAX)),
            deadline_ms: u64::try_from(STOP_DEADLINE.as_millis()).unwrap_or(u64::MAX),
            codes: vec![code],
        });
        std::fs::write(dir.join(format!("{}.log", side.id)), out).unwrap();
    }
    let elapsed = stop_asked.elapsed();
    let all_exited = cluster.agents.iter_mut().all(Agent::exited);
    let agents = std::mem::take(&mut cluster.agents);
    let mut outputs = Vec::new();
    let mut codes = Vec::new();
    // Each agent's output, then its stderr again with the time each line came (UTC, as in
    // replicas.log).
    let timed = |agent: &Agent| format!("\n--- stderr, timed (UTC)\n{}", agent.stderr_timed());
    for (node, agent) in agents.into_iter().enumerate() {
        let mut agent = agent;
        if agent.exited() {
            let times = timed(&agent);
            let run = agent.finish(Duration::from_secs(1));
            codes.push(run.code());
            outputs.push((node, run.dump() + &times));
        } else {
            codes.push(None);
            outputs.push((node, agent.output() + &timed(&agent)));
        }
    }
    for (node, agent) in &cluster.dead_agents {
        outputs.push((*node, agent.output() + &timed(agent)));
    }
    history.record(&Event::JobEnd {
        t_ms: now_ms(),
        elapsed_ms: all_exited.then(|| u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)),
        deadline_ms: u64::try_from(STOP_DEADLINE.as_millis()).unwrap_or(u64::MAX),
        codes: codes.clone(),
    });
    println!("the job ended {elapsed:?} after the stop; agents exited {codes:?}");

    // The in-place job ends by itself (its training is done): wait for its agents (a spare
    // leaves with it).
    let in_place_run = cluster.in_place.take().map(|job| {
        let deadline = Instant::now() + Duration::from_secs(120);
        let runs: Vec<muster_tests::Finished> = job
            .agents
            .into_iter()
            .map(|a| a.finish_by(deadline))
            .collect();
        let lost: Vec<muster_tests::Finished> = job
            .lost
            .into_iter()
            .map(|a| a.finish(Duration::from_secs(5)))
            .collect();
        stop_scanning.store(true, Ordering::SeqCst);
        if let Some(scan) = owner_scan.take() {
            scan.join().unwrap();
        }
        let doubled = job.doubled.lock().unwrap().clone();
        println!(
            "the in-place job ended: its agents exited {:?} ({} lost to the schedule)",
            runs.iter()
                .map(muster_tests::Finished::code)
                .collect::<Vec<_>>(),
            lost.len()
        );
        (runs, lost, doubled, job.late, job.reference)
    });

    // A failover after the end: the final state must survive it (finding 2).
    if (FAILOVER_AFTER_FINISH || settings.known_bugs)
        && let Some(leader) = cluster.leader(&rt)
    {
        cluster.replicas.kill(leader);
        let event = Event::Fault {
            t_ms: now_ms(),
            index: plan.len(),
            kind: FaultKind::LeaderKill.name().into(),
            detail: format!("replica {leader}, after the job ended"),
        };
        history.record(&event);
        for side in &sides {
            side.history.record(&event);
        }
        let _ = cluster.leader(&rt);
        // The observer watches the new leader past the 10 s re-attach window of a
        // recovered job, the window in which finding 2 turned FINISHED into FAILED.
        std::thread::sleep(Duration::from_secs(12));
    }
    std::thread::sleep(SETTLE);
    stop_observing.store(true, Ordering::SeqCst);
    let answers = observer.join().unwrap();
    for side in &mut sides {
        if let Some(o) = side.observer.take() {
            o.join().unwrap();
        }
    }

    // Orphans: anything that carries the run's marker once every agent is gone.
    let deadline = Instant::now() + Duration::from_secs(10);
    let mut orphans = marked_processes(&cluster.marker());
    while !orphans.is_empty() && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
        orphans = marked_processes(&cluster.marker());
    }
    let event = Event::Orphans {
        pids: orphans.iter().map(|(p, _)| *p).collect(),
        what: orphans.iter().map(|(_, w)| w.clone()).collect(),
    };
    history.record(&event);
    for side in &sides {
        side.history.record(&event);
    }
    for (p, _) in &orphans {
        signal(*p, Signal::SIGKILL);
    }
    let replica_logs = cluster.replicas.logs();
    for (i, (node, out)) in outputs.iter().enumerate() {
        std::fs::write(dir.join(format!("agent-{node}-{i}.log")), out).unwrap();
    }
    std::fs::write(dir.join("replicas.log"), &replica_logs).unwrap();
    drop(cluster);

    // The checker.
    let (events, bad) = faults::read_history(&history_path).unwrap();
    for (line, text) in &bad {
        println!("history line {line} is not an event: {text}");
    }
    let generations: std::collections::BTreeSet<u64> = events
        .iter()
        .filter_map(|e| match e {
            Event::Worker { generation, .. } => Some(*generation),
            _ => None,
        })
        .collect();
    let mut by_kind = std::collections::BTreeMap::new();
    for e in &events {
        if let Event::Fault { kind, detail, .. } = e {
            let entry = by_kind.entry(kind.clone()).or_insert((0, 0));
            if detail.starts_with("skipped") {
                entry.1 += 1;
            } else {
                entry.0 += 1;
            }
        }
    }
    let checking = Instant::now();
    let mut violations = check_all(&events, max_restarts);
    let in_place_done = in_place_run.is_some();
    if let Some((runs, lost, doubled, late, reference)) = in_place_run {
        let log: Vec<String> = runs
            .iter()
            .chain(&lost)
            .enumerate()
            .map(|(i, r)| format!("=== agent {i}\n{}", r.dump()))
            .collect();
        std::fs::write(dir.join("in-place.log"), log.join("\n")).unwrap();
        let all = || runs.iter().chain(&lost);
        let recovered = all()
            .flat_map(|r| &r.stderr)
            .filter(|l| l.contains("respawned in place"))
            .count();
        let spares = all()
            .flat_map(|r| &r.stderr)
            .filter(|l| l.contains("this spare takes node"))
            .count();
        let got = runs
            .iter()
            .flat_map(|r| r.rank_stdout(0))
            .find(|l| l.starts_with("final "))
            .and_then(|l| l.split(' ').find(|w| w.starts_with("checksum=")))
            .map(str::to_owned);
        let codes: Vec<Option<i32>> = runs.iter().map(muster_tests::Finished::code).collect();
        println!(
            "in-place job: exits {codes:?}, {recovered} rank(s) respawned in place, {spares} node(s) taken by a spare, {} (failure-free {reference})",
            got.as_deref().unwrap_or("no checksum")
        );
        let failed = runs.iter().any(|r| r.code() != Some(0) && !arrived_late(r));
        if failed || got.as_deref() != Some(reference.as_str()) {
            violations.push(faults::Violation {
                invariant: INV_IN_PLACE,
                detail: format!(
                    "the in-place job's agents exited {codes:?} with {} instead of the failure-free {reference}; its log: {}",
                    got.as_deref().unwrap_or("no checksum"),
                    dir.join("in-place.log").display()
                ),
            });
        }
        for d in doubled {
            violations.push(faults::Violation {
                invariant: INV_ONE_OWNER,
                detail: format!(
                    "{d}; the in-place log: {}",
                    dir.join("in-place.log").display()
                ),
            });
        }
        for detail in late {
            violations.push(faults::Violation {
                invariant: INV_LATE_WRITES,
                detail,
            });
        }
    }
    for side in &sides {
        let (events, bad) = faults::read_history(&side.path).unwrap();
        for (line, text) in &bad {
            println!("{} history line {line} is not an event: {text}", side.id);
        }
        let found = check_all(&events, max_restarts);
        let generations: std::collections::BTreeSet<u64> = events
            .iter()
            .filter_map(|e| match e {
                Event::Worker { generation, .. } => Some(*generation),
                _ => None,
            })
            .collect();
        println!(
            "job {}: {} generations; {} history events; {} key-value calls checked; {} violation(s)",
            side.id,
            generations.len(),
            events.len(),
            faults::kv_operations(&events).len(),
            found.len()
        );
        violations.extend(found.into_iter().map(|mut v| {
            v.detail = format!("job {}: {}", side.id, v.detail);
            v
        }));
    }
    let kv = faults::kv_operations(&events);
    let unknown = kv.iter().filter(|o| o.ret.is_none()).count();
    println!(
        "seed {}: {injected} faults in {schedule_took:?} (injected, skipped per kind: {by_kind:?}); {} generations; {answers} DescribeJob answers; {} history events; {} key-value calls ({unknown} of unknown outcome) checked for linearizability; checker {:?}; whole run {:?}",
        settings.seed,
        generations.len(),
        events.len(),
        kv.len(),
        checking.elapsed(),
        started.elapsed()
    );
    if let (Some(start), Some(end)) = (soak_start, soak_end) {
        let ops: usize = std::iter::once(history_path.clone())
            .chain(sides.iter().map(|s| s.path.clone()))
            .filter_map(|p| faults::read_history(&p).ok())
            .map(|(events, _)| faults::kv_operations(&events).len())
            .sum();
        let lost = violations
            .iter()
            .filter(|v| v.invariant == faults::INV_LINEARIZABLE)
            .count();
        println!(
            "soak: {:?}, {} jobs, {injected} faults; {ops} key-value calls, {lost} key(s) not linearizable; start: {start}; end: {end}; replicas x{:.3} RSS, agents x{:.3} RSS",
            settings.soak.unwrap_or_default(),
            1 + sides.len() + usize::from(in_place_done),
            end.replicas_kb as f64 / start.replicas_kb.max(1) as f64,
            end.agents_kb as f64 / start.agents_kb.max(1) as f64,
        );
        for (what, a, b) in [
            ("the replicas' memory", start.replicas_kb, end.replicas_kb),
            ("the agents' memory", start.agents_kb, end.agents_kb),
        ] {
            if b as f64 > a as f64 * SOAK_GROWTH {
                violations.push(faults::Violation {
                    invariant: "soak-flat",
                    detail: format!("{what} grew from {a} kB to {b} kB over the soak"),
                });
            }
        }
    }
    for v in &violations {
        println!("VIOLATION {v}");
    }
    if violations.is_empty() && !settings.keep {
        let _ = std::fs::remove_dir_all(&dir);
    } else {
        println!("the run's history and logs are in {}", dir.display());
    }
    assert!(
        violations.is_empty(),
        "seed {} broke {} invariant(s) (replay: MUSTER_FAULT_SEED={} MUSTER_FAULT_COUNT={}); history in {}:\n{}",
        settings.seed,
        violations.len(),
        settings.seed,
        settings.count,
        dir.display(),
        violations
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n")
    );
    assert!(
        injected > 0 || settings.count == 0,
        "no fault was injected\n{}",
        outputs
            .iter()
            .map(|(_, o)| o.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    );
}
