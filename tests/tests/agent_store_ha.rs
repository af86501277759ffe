//! The agent store (issue 17) under faults and across hosts, with an unmodified torch DDP gloo
//! script (`tests/python/ddp_store_failover.py`, which keeps torch's default store busy while
//! it trains) under the real `muster-agent launch`:
//!
//! - coordinator replicas on a real etcd (`muster_tests::replicas`), the leader SIGKILLed while
//!   the job initialises (three ranks inside `init_process_group`, waiting in the store for the
//!   fourth, which starts its own store traffic during the failover) and while it trains: the
//!   store calls in flight are retried on the new leader and complete, every rank starts once
//!   (no restart of the generation) and the job exits 0, its shared counter exact;
//! - two agents on network-namespace hosts (`muster_tests::cluster`), each serving its own
//!   workers' store on its loopback: the ranks of both nodes rendezvous and trade keys through
//!   the coordinator's key-value store, and on each host only the agent listens on its
//!   `MASTER_PORT`, on loopback.
//!
//! Every step of the script adds 1 to a counter besides reading one with an add of 0, and
//! checks at the end that both are exact: an add in flight at the instant of the leader's death
//! may or may not have been applied, so the agent sends every mutation on its connection's lane
//! (`muster::client::KvLane`), which the coordinator applies at most once per sequence, and a
//! retry of an applied call gets its first answer. Three tests pin the retries down with a call
//! sent to a leader that is frozen (SIGSTOP) and then SIGKILLed: an add of 0 through the SDK
//! (retried as a read), an add and a compare-and-set on SDK lanes, and torch's own client's add,
//! compare_set, append and queue_push through the agent store, each exactly once.
//!
//! Each test skips, printing why, without the peers' PyTorch, etcd, or (for the hosts) root.
//! They run one at a time (a lock in this file): each runs 4 torch processes, and the failover
//! tests' timing would not hold with several on a 2-core machine.

use muster::client::{Coordinator, Kv};
use muster_tests::cluster::Cluster;
use muster_tests::etcd::Etcd;
use muster_tests::replicas::Replicas;
use muster_tests::sockets::{Listener, Ready, held_by, listeners_of, ready};
use muster_tests::{Agent, Finished, Stream, peers_python, workspace_root};
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, Shutdown, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The election lease TTL (etcd's smallest practical TTL is 2 s).
const TTL: Duration = Duration::from_secs(2);
/// How long a standby may take to lead after the leader's death, with room for a loaded
/// machine (the HA tests check the tight bound; here it only has to happen).
const TAKEOVER: Duration = Duration::from_secs(20);
/// torch's import alone takes seconds on a 2-core machine; four ranks import it at once.
const PYTHON_LIMIT: Duration = Duration::from_secs(180);
/// Nodes (agents) and workers per node of every job here.
const NODES: u32 = 2;
const NPROC: u32 = 2;
const WORLD: u32 = NODES * NPROC;
/// Steps every rank trains after the failover before the test stops the job.
const STEPS_AFTER: u32 = 10;

/// One test at a time (see the module comment).
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// The folder of files that steer the script (see its docstring); removed when dropped.
struct Steer(PathBuf);

impl Steer {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "muster-agent-store-ha-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        Self(dir)
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temporary path")
    }

    /// Lets the last rank call `init_process_group`.
    fn init(&self) {
        std::fs::write(self.0.join("init"), b"go").expect("the init file");
    }

    /// Ends the training loop (at the next step).
    fn stop(&self) {
        std::fs::write(self.0.join("stop"), b"go").expect("the stop file");
    }
}

impl Drop for Steer {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn script() -> String {
    workspace_root()
        .join("tests/python/ddp_store_failover.py")
        .to_str()
        .expect("a UTF-8 workspace path")
        .to_owned()
}

/// The `launch` flags of node `node` of the job, besides the coordinator's.
fn node_flags(node: u32) -> Vec<String> {
    [
        "--nnodes",
        &NODES.to_string(),
        "--node-rank",
        &node.to_string(),
        "--nproc-per-node",
        &NPROC.to_string(),
        "--grace-period-ms",
        "1000",
    ]
    .map(str::to_owned)
    .to_vec()
}

/// The two agents of job `job` at the coordinator replicas `addrs`, on this host.
fn launch_local(python: &Path, addrs: &str, job: &str, steer: &Steer) -> Vec<Agent> {
    let python = python.to_str().expect("a UTF-8 venv path");
    let script = script();
    (0..NODES)
        .map(|node| {
            let mut args: Vec<String> = ["launch", "--coordinator", addrs, "--job-id", job]
                .map(str::to_owned)
                .to_vec();
            args.extend(node_flags(node));
            args.extend(["--", python, &script, steer.path()].map(str::to_owned));
            let args: Vec<&str> = args.iter().map(String::as_str).collect();
            Agent::start_with_env(&args, &[("NO_COLOR", "1")])
        })
        .collect()
}

/// The highest step every rank of `agents` has printed (0 before the first).
fn steps_done(agents: &[Agent]) -> Vec<u32> {
    let mut done = vec![0; WORLD as usize];
    for agent in agents {
        for line in agent.lines(Stream::Stdout) {
            if let Some(rest) = line.split_once("] step rank=").map(|(_, r)| r)
                && let Some((rank, n)) = rest.split_once(" n=")
                && let (Ok(rank), Ok(n)) = (rank.parse::<usize>(), n.parse::<u32>())
                && rank < done.len()
            {
                done[rank] = done[rank].max(n);
            }
        }
    }
    done
}

/// Waits until every rank has printed step `n` or later; panics with the agents' output after
/// `timeout`.
fn wait_steps(agents: &[Agent], n: u32, timeout: Duration, context: impl Fn() -> String) {
    let deadline = Instant::now() + timeout;
    loop {
        let done = steps_done(agents);
        if done.iter().all(|&d| d >= n) {
            return;
        }
        if Instant::now() >= deadline {
            panic!(
                "not every rank reached step {n} within {timeout:?}: {done:?}\n{}\n{}",
                outputs(agents),
                context()
            );
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn outputs(agents: &[Agent]) -> String {
    agents
        .iter()
        .map(Agent::output)
        .collect::<Vec<_>>()
        .join("\n")
}

/// Every agent exited 0, every rank started once (one `initialising` line, restart count 0)
/// and printed its final line with the same step count, exact counters (of starts and of
/// steps) and parameters in sync. Returns the step count.
fn check_finished(runs: &[Finished], context: &str) -> u32 {
    let dump = || {
        runs.iter()
            .map(Finished::dump)
            .collect::<Vec<_>>()
            .join("\n")
            + "\n"
            + context
    };
    for run in runs {
        assert_eq!(run.code(), Some(0), "{}", dump());
    }
    let mut steps = None;
    for rank in 0..WORLD {
        let lines: Vec<&str> = runs.iter().flat_map(|r| r.rank_stdout(rank)).collect();
        let starts = lines
            .iter()
            .filter(|l| l.starts_with("initialising "))
            .count();
        assert_eq!(starts, 1, "rank {rank} started {starts} times\n{}", dump());
        let last = lines.last().copied().unwrap_or_default();
        let fields: Vec<&str> = last.split(' ').collect();
        let n: u32 = fields
            .iter()
            .find_map(|f| f.strip_prefix("steps="))
            .and_then(|s| s.parse().ok())
            .unwrap_or_else(|| panic!("rank {rank} ended without its result\n{}", dump()));
        let expected = format!(
            "ddp_store_failover rank={rank} world={WORLD} steps={n} started={WORLD} \
             stepped={} restart_count=0 params_in_sync=True",
            WORLD * n
        );
        assert_eq!(last, expected, "{}", dump());
        assert_eq!(*steps.get_or_insert(n), n, "{}", dump());
    }
    steps.unwrap_or_default()
}

/// The keys of the job's store (torch's, under `torch/`) with their values, read through the
/// coordinator.
async fn store_keys(kv: &Kv) -> Vec<(String, String)> {
    kv.list("torch/")
        .await
        .expect("the job's keys")
        .into_iter()
        .map(|(k, v)| (k, String::from_utf8_lossy(&v).into_owned()))
        .collect()
}

/// Coordinator replicas on etcd and the runtime their health checks need.
struct Ha {
    runtime: tokio::runtime::Runtime,
    replicas: Replicas,
    _etcd: Etcd,
}

impl Ha {
    /// One etcd member and two replicas, one of them leading; `None` without etcd.
    fn start() -> Option<(Self, usize)> {
        let etcd = Etcd::start(1)?;
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()
            .expect("a tokio runtime");
        let replicas = Replicas::start(&etcd, 2, TTL, &[]);
        let leader = runtime.block_on(replicas.wait_leader(Duration::from_secs(30), &[]));
        Some((
            Self {
                runtime,
                replicas,
                _etcd: etcd,
            },
            leader,
        ))
    }

    /// SIGKILLs replica `leader`, calls `meanwhile` at once, and waits for the other replica to
    /// lead; returns when that happened, after the kill.
    fn kill_leader(&mut self, leader: usize, meanwhile: impl FnOnce()) -> Duration {
        let killed = Instant::now();
        self.replicas.kill(leader);
        meanwhile();
        let new = self
            .runtime
            .block_on(self.replicas.wait_leader(TAKEOVER, &[leader]));
        let took = killed.elapsed();
        eprintln!("replica {new} leads {took:?} after the SIGKILL of replica {leader}");
        took
    }
}

/// The coordinator leader is SIGKILLed while ranks 0 to 2 are inside `init_process_group`,
/// waiting in the store (through their agents, at the leader) for rank 3's keys; rank 3 is let
/// go at once, so its TCPStore handshake, its `add` to torch's init counter and its gloo keys
/// go out during the failover. The waits in flight are retried on the new leader, rank 3's
/// calls complete there, and the job trains and exits 0 with every rank started once.
#[test]
fn a_leader_killed_while_the_job_initialises() {
    let Some(python) = peers_python(&["torch"]) else {
        return;
    };
    let _serial = serial();
    let Some((mut ha, leader)) = Ha::start() else {
        return;
    };
    let started = Instant::now();
    let job = "agent-store-ha-init";
    let steer = Steer::new("init");
    let agents = launch_local(&python, &ha.replicas.addrs(), job, &steer);
    for agent in &agents {
        agent.wait_for_lines(Stream::Stdout, NPROC as usize, PYTHON_LIMIT, |l| {
            l.contains("] initialising rank=")
        });
    }
    // Ranks 0 to 2 are inside init_process_group once torch's init counter says 3 and their
    // gloo addresses are in the store (a key each, besides the counter): they wait for rank
    // 3's.
    let kv = Kv::new(
        ha.runtime
            .block_on(Coordinator::connect(&ha.replicas.addrs()))
            .expect("a client of the replicas"),
        job,
    );
    let deadline = Instant::now() + PYTHON_LIMIT;
    let keys = loop {
        let keys = ha.runtime.block_on(store_keys(&kv));
        let counted = keys.iter().any(|(k, v)| k.ends_with("/init/") && v == "3");
        if counted && keys.len() > (WORLD - 1) as usize {
            break keys;
        }
        assert!(
            Instant::now() < deadline,
            "ranks 0 to 2 did not reach the store's rendezvous: {keys:?}\n{}",
            outputs(&agents)
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let names: Vec<&str> = keys.iter().map(|(k, _)| k.as_str()).collect();
    eprintln!("the store's keys before the kill: {names:?}");
    let took = ha.kill_leader(leader, || steer.init());
    wait_steps(&agents, 3, PYTHON_LIMIT, || ha.replicas.logs());
    steer.stop();
    let deadline = Instant::now() + PYTHON_LIMIT;
    let runs: Vec<Finished> = agents.into_iter().map(|a| a.finish_by(deadline)).collect();
    let steps = check_finished(&runs, &ha.replicas.logs());
    eprintln!(
        "failover took {took:?}; the job trained {steps} steps and took {:?}",
        started.elapsed()
    );
}

/// The coordinator leader is SIGKILLed while the job trains, each step's store calls (a set,
/// an add, a blocking get of another rank's key, a delete) in flight through both agents: they
/// are retried on the new leader and complete, training goes on for [`STEPS_AFTER`] more
/// steps, and the job exits 0 with every rank started once and the shared counter exact (an
/// add applied twice would show).
#[test]
fn a_leader_killed_while_the_job_trains() {
    let Some(python) = peers_python(&["torch"]) else {
        return;
    };
    let _serial = serial();
    let Some((mut ha, leader)) = Ha::start() else {
        return;
    };
    let started = Instant::now();
    let steer = Steer::new("train");
    steer.init();
    let agents = launch_local(
        &python,
        &ha.replicas.addrs(),
        "agent-store-ha-train",
        &steer,
    );
    wait_steps(&agents, 5, PYTHON_LIMIT, || ha.replicas.logs());
    let mut agents = agents;
    for (i, agent) in agents.iter_mut().enumerate() {
        assert!(!agent.exited(), "agent {i} ended early\n{}", agent.output());
    }
    let at_kill = steps_done(&agents);
    let took = ha.kill_leader(leader, || {});
    let resumed = Instant::now();
    let target = at_kill.iter().max().copied().unwrap_or_default() + STEPS_AFTER;
    wait_steps(&agents, target, PYTHON_LIMIT, || ha.replicas.logs());
    eprintln!(
        "steps at the kill {at_kill:?}; {STEPS_AFTER} more on every rank {:?} after the new leader",
        resumed.elapsed()
    );
    steer.stop();
    let deadline = Instant::now() + PYTHON_LIMIT;
    let runs: Vec<Finished> = agents.into_iter().map(|a| a.finish_by(deadline)).collect();
    let steps = check_finished(&runs, &ha.replicas.logs());
    assert!(steps >= target, "{steps} steps, fewer than {target}");
    eprintln!(
        "failover took {took:?}; the job trained {steps} steps and took {:?}",
        started.elapsed()
    );
}

/// A job at the replicas of `ha`, formed by a real agent whose one worker prints its
/// `MASTER_PORT` (the agent store's) and sleeps, and the job's store through the SDK once the
/// job exists. Returns the agent, the store and the port.
fn sleeping_job(ha: &Ha, job: &str) -> (Agent, Kv, u16) {
    job_with_worker(ha, job, "exec sleep 300")
}

/// As [`sleeping_job`], its one worker running the shell command `then` after printing its
/// port (only the agent's own workers may use its store).
fn job_with_worker(ha: &Ha, job: &str, then: &str) -> (Agent, Kv, u16) {
    let addrs = ha.replicas.addrs();
    let worker = format!("echo \"store port $MASTER_PORT\"; {then}");
    let agent = Agent::start_with_env(
        &[
            "launch",
            "--coordinator",
            &addrs,
            "--job-id",
            job,
            "--nproc-per-node",
            "1",
            "--",
            "sh",
            "-c",
            &worker,
        ],
        &[("NO_COLOR", "1")],
    );
    let line = agent.wait_for_lines(Stream::Stdout, 1, PYTHON_LIMIT, |l| {
        l.contains("store port ")
    });
    let port = line[0]
        .rsplit_once("store port ")
        .and_then(|(_, p)| p.trim().parse().ok())
        .unwrap_or_else(|| panic!("a malformed port line: {}", line[0]));
    let kv = Kv::new(
        ha.runtime
            .block_on(Coordinator::connect(&addrs))
            .expect("a client of the replicas"),
        job,
    );
    (agent, kv, port)
}

/// Runs `calls` (spawned on the test's runtime) while the leader is frozen: they must still be
/// pending half a second later (their requests sit unread in the frozen leader's socket), then
/// the leader is SIGKILLed and they must complete on the new leader. Returns what they
/// returned.
fn in_flight_at_the_leaders_death<T: std::fmt::Debug + Send + 'static>(
    ha: &mut Ha,
    calls: impl Future<Output = T> + Send + 'static,
) -> T {
    // Asked again now: on a loaded machine a lease can lapse and move the lead after start.
    let leader = ha.runtime.block_on(ha.replicas.wait_leader(TAKEOVER, &[]));
    ha.replicas.stop(leader);
    let pending = ha.runtime.spawn(calls);
    // Long enough for the requests to reach the frozen leader's socket; the result must be
    // the same if they had not (a refused or unconnected call is retried in any case).
    std::thread::sleep(Duration::from_millis(500));
    if pending.is_finished() {
        let early = ha.runtime.block_on(pending);
        panic!(
            "the calls ended while leader {leader} was frozen: {early:?}\n{}",
            ha.replicas.logs()
        );
    }
    ha.kill_leader(leader, || {});
    ha.runtime
        .block_on(async { tokio::time::timeout(TAKEOVER, pending).await })
        .expect("the calls complete after the failover")
        .expect("the task ran")
}

/// The SDK client under the agent store: an `add` of 0 (torch's read of a counter) sent to a
/// leader that is frozen (SIGSTOP, so the request sits unread in its socket) and then
/// SIGKILLed is retried on the new leader and completes with the counter's value. The job is
/// formed by a real agent whose worker only sleeps.
#[test]
fn an_add_of_0_in_flight_at_the_leaders_death_is_retried() {
    let _serial = serial();
    let Some((mut ha, _)) = Ha::start() else {
        return;
    };
    let (_agent, kv, _) = sleeping_job(&ha, "agent-store-ha-add0");
    assert_eq!(ha.runtime.block_on(kv.add("counter", 5)).ok(), Some(5));
    let value = in_flight_at_the_leaders_death(&mut ha, {
        let kv = kv.clone();
        async move { kv.add("counter", 0).await }
    });
    assert_eq!(
        value.map_err(|e| e.to_string()),
        Ok(5),
        "{}",
        ha.replicas.logs()
    );
}

/// An add of 7 and a compare-and-set, each on an SDK lane (`KvLane`), in flight at a frozen
/// leader's death: both are retried on the new leader with their sequences, and each is applied
/// exactly once (the counter ends at 12, not 19; the swap answers swapped, where a second
/// application would have found "v2" and answered not swapped).
#[test]
fn lane_calls_in_flight_at_the_leaders_death_apply_once() {
    let _serial = serial();
    let Some((mut ha, _)) = Ha::start() else {
        return;
    };
    let (_agent, kv, _) = sleeping_job(&ha, "agent-store-ha-lanes");
    ha.runtime.block_on(async {
        assert_eq!(kv.add("counter", 5).await.ok(), Some(5));
        kv.set("cas", "v1").await.expect("a set");
    });
    let (added, swapped) = in_flight_at_the_leaders_death(&mut ha, {
        let (mut adds, mut swaps) = (kv.lane(), kv.lane());
        async move {
            tokio::join!(async move { adds.add("counter", 7).await }, async move {
                swaps.compare_and_set("cas", Some(b"v1"), "v2").await
            })
        }
    });
    let logs = ha.replicas.logs();
    assert_eq!(added.map_err(|e| e.to_string()), Ok(12), "{logs}");
    let swapped = swapped.unwrap_or_else(|e| panic!("the swap failed: {e}\n{logs}"));
    assert!(swapped.swapped, "{swapped:?}\n{logs}");
    assert_eq!(swapped.current.as_deref(), Some(&b"v2"[..]));
    ha.runtime.block_on(async {
        assert_eq!(kv.get("counter").await.ok().flatten(), Some(b"12".to_vec()));
        assert_eq!(kv.get("cas").await.ok().flatten(), Some(b"v2".to_vec()));
    });
}

/// A TCP proxy to one coordinator that, while armed, passes requests on and swallows what comes
/// back, until [`AnswerEater::cut`] closes every connection: a call that the coordinator applied
/// and whose answer was lost, as when a leader dies between its write and its answer (the one
/// failure a frozen leader cannot show: it applies nothing).
struct AnswerEater {
    addr: std::net::SocketAddr,
    armed: Arc<AtomicBool>,
    live: Arc<Mutex<Vec<TcpStream>>>,
}

impl AnswerEater {
    fn start(upstream: &str) -> Self {
        let upstream: std::net::SocketAddr = upstream.parse().expect("a replica's address");
        let listener = TcpListener::bind("127.0.0.1:0").expect("a proxy port");
        let addr = listener.local_addr().expect("its address");
        let armed = Arc::new(AtomicBool::new(false));
        let live: Arc<Mutex<Vec<TcpStream>>> = Arc::default();
        let (eating, held) = (Arc::clone(&armed), Arc::clone(&live));
        // Policy: runs until the test process ends; a failed connection just ends.
        std::thread::spawn(move || {
            for down in listener.incoming().flatten() {
                let Ok(up) = TcpStream::connect(upstream) else {
                    continue;
                };
                let (Ok(down2), Ok(up2)) = (down.try_clone(), up.try_clone()) else {
                    continue;
                };
                for s in [&down, &up] {
                    if let Ok(s) = s.try_clone() {
                        held.lock().expect("the connections").push(s);
                    }
                }
                std::thread::spawn(move || {
                    let (mut from, mut to) = (down2, up2);
                    let _ = std::io::copy(&mut from, &mut to);
                    let _ = to.shutdown(Shutdown::Both);
                });
                let eating = Arc::clone(&eating);
                std::thread::spawn(move || {
                    let (mut from, mut to) = (up, down);
                    let mut buf = [0u8; 16 << 10];
                    while let Ok(n @ 1..) = from.read(&mut buf) {
                        if !eating.load(Ordering::SeqCst) && to.write_all(&buf[..n]).is_err() {
                            break;
                        }
                    }
                    let _ = to.shutdown(Shutdown::Both);
                });
            }
        });
        Self { addr, armed, live }
    }

    fn arm(&self) {
        self.armed.store(true, Ordering::SeqCst);
    }

    /// Disarms and closes every connection made so far: the client sees its call fail with
    /// its answer unknown.
    fn cut(&self) {
        self.armed.store(false, Ordering::SeqCst);
        for s in self.live.lock().expect("the connections").drain(..) {
            let _ = s.shutdown(Shutdown::Both);
        }
    }
}

/// An add, a compare-and-set, a set and a delete on an SDK lane, each applied by the leader
/// with its answer lost on the way back (an [`AnswerEater`] between the client and the leader;
/// the test reads the applied value directly while the call still waits), then the connection
/// cut: the client retries with the same sequence, and the coordinator answers from the lane's
/// record instead of applying again. The counter ends at 12 (an add applied twice would make it
/// 19), the swap answers swapped (applied twice, it would find "v2" and answer not swapped),
/// the set is not written again after another client deleted its key, and the delete does not
/// delete what another client set since.
#[test]
fn a_lane_call_applied_with_its_answer_lost_is_answered_once() {
    let _serial = serial();
    let Some((ha, leader)) = Ha::start() else {
        return;
    };
    let (_agent, kv, _) = sleeping_job(&ha, "agent-store-ha-lost-answer");
    ha.runtime.block_on(async {
        assert_eq!(kv.add("counter", 5).await.ok(), Some(5));
        kv.set("cas", "v1").await.expect("a set");
    });
    let eater = AnswerEater::start(ha.replicas.addr(leader));
    let proxied = Kv::new(
        ha.runtime
            .block_on(Coordinator::connect(&eater.addr.to_string()))
            .expect("a client through the proxy"),
        "agent-store-ha-lost-answer",
    );
    // One call first, so that the connection is up before answers are swallowed.
    assert_eq!(
        ha.runtime.block_on(proxied.get("cas")).ok().flatten(),
        Some(b"v1".to_vec())
    );
    let holds = |key: &str, value: Option<&[u8]>| {
        let deadline = Instant::now() + TAKEOVER;
        while ha.runtime.block_on(kv.get(key)).ok().flatten().as_deref() != value {
            assert!(Instant::now() < deadline, "'{key}' never became {value:?}");
            std::thread::sleep(Duration::from_millis(20));
        }
    };
    let applied = |key: &str, value: &[u8]| holds(key, Some(value));
    let mut lane = proxied.lane();
    eater.arm();
    let add = ha.runtime.spawn(async move {
        let added = lane.add("counter", 7).await;
        (added, lane)
    });
    applied("counter", b"12");
    assert!(!add.is_finished(), "the add's answer came through");
    eater.cut();
    let (added, mut lane) = ha.runtime.block_on(add).expect("the task ran");
    assert_eq!(
        added.map_err(|e| e.to_string()),
        Ok(12),
        "{}",
        ha.replicas.logs()
    );
    eater.arm();
    let swap = ha.runtime.spawn(async move {
        let swapped = lane.compare_and_set("cas", Some(b"v1"), "v2").await;
        (swapped, lane)
    });
    applied("cas", b"v2");
    assert!(!swap.is_finished(), "the swap's answer came through");
    eater.cut();
    let (swapped, mut lane) = ha.runtime.block_on(swap).expect("the task ran");
    let swapped =
        swapped.unwrap_or_else(|e| panic!("the swap failed: {e}\n{}", ha.replicas.logs()));
    assert!(swapped.swapped, "{swapped:?}");
    // The fault suite's finding: a set applied, its answer lost, and the key read and deleted
    // by another client before the retry. The retry answers without writing the key again.
    eater.arm();
    let set = ha.runtime.spawn(async move {
        let set = lane.set("reg", "mine").await;
        (set, lane)
    });
    applied("reg", b"mine");
    assert!(!set.is_finished(), "the set's answer came through");
    assert_eq!(ha.runtime.block_on(kv.delete("reg")).ok(), Some(true));
    eater.cut();
    let (set, mut lane) = ha.runtime.block_on(set).expect("the task ran");
    assert_eq!(set.map_err(|e| e.to_string()), Ok(()));
    assert_eq!(ha.runtime.block_on(kv.get("reg")).ok(), Some(None));
    // A delete the same way, with the key set again before its retry: the retry says the key
    // existed and leaves the new value.
    ha.runtime.block_on(kv.set("reg", "again")).expect("a set");
    eater.arm();
    let delete = ha.runtime.spawn(async move { lane.delete("reg").await });
    holds("reg", None);
    assert!(!delete.is_finished(), "the delete's answer came through");
    ha.runtime.block_on(kv.set("reg", "theirs")).expect("a set");
    eater.cut();
    let existed = ha.runtime.block_on(delete).expect("the task ran");
    assert_eq!(existed.map_err(|e| e.to_string()), Ok(true));
    ha.runtime.block_on(async {
        assert_eq!(kv.get("counter").await.ok().flatten(), Some(b"12".to_vec()));
        assert_eq!(kv.get("cas").await.ok().flatten(), Some(b"v2".to_vec()));
        assert_eq!(kv.get("reg").await.ok().flatten(), Some(b"theirs".to_vec()));
    });
}

/// torch's own `TCPStore` client (`tests/python/tcpstore_client.py in-flight`, the job's
/// worker) sends an add of 7, a compare_set, an append and a queue_push through the agent
/// store, each on a connection of its own, while the leader is frozen; the leader is then SIGKILLed. Every call completes
/// on the new leader, applied once: the counter ends at 12, the swapped value is "v2", the log
/// "ax" (an append retried after its swap was applied would make it "axx") and the queue holds
/// one item.
#[test]
fn torchs_mutations_in_flight_at_the_leaders_death_apply_once() {
    let Some(python) = peers_python(&["torch"]) else {
        return;
    };
    let _serial = serial();
    let Some((mut ha, leader)) = Ha::start() else {
        return;
    };
    let steer = Steer::new("torch-in-flight");
    let go = steer.0.join("go");
    // The client is the job's worker: only the agent's own workers may use its store.
    let worker = format!(
        "exec {} {} \"$MASTER_PORT\" in-flight {} counter cas log q",
        python.display(),
        workspace_root()
            .join("tests/python/tcpstore_client.py")
            .display(),
        go.display()
    );
    let (client, kv, _) = job_with_worker(&ha, "agent-store-ha-torch", &worker);
    client.wait_for_lines(Stream::Stdout, 1, PYTHON_LIMIT, |l| {
        l.ends_with("] connected")
    });
    // torch's keys, as the agent store maps them (generation 1).
    let key = |k: &str| format!("torch/g1/{k}");
    ha.runtime.block_on(async {
        assert_eq!(kv.add(&key("counter"), 5).await.ok(), Some(5));
        kv.set(&key("cas"), "v1").await.expect("a set");
        kv.set(&key("log"), "a").await.expect("a set");
    });
    // The calls go out at once after the freeze: a frozen leader's lease runs out within the
    // TTL, and a call sent after that would go to the next leader, not be in flight.
    ha.replicas.stop(leader);
    std::fs::write(&go, b"go").expect("the go file");
    // Each call is sent just after its line; the leader stays frozen until they all are.
    client.wait_for_lines(Stream::Stdout, 4, PYTHON_LIMIT, |l| {
        l.contains("] calling ")
    });
    std::thread::sleep(Duration::from_millis(500));
    let mut client = client;
    assert!(
        !client.exited(),
        "a frozen leader answered\n{}",
        client.output()
    );
    ha.kill_leader(leader, || {});
    let done = client.finish(PYTHON_LIMIT);
    let logs = ha.replicas.logs();
    assert_eq!(done.code(), Some(0), "{}\n{logs}", done.dump());
    // The worker's own lines, without the agent's `[rank 0] ` prefix.
    let mut printed: Vec<&str> = done
        .stdout
        .iter()
        .filter_map(|l| l.split_once("] ").map(|(_, line)| line))
        .filter(|l| !l.starts_with("calling ") && *l != "connected" && !l.starts_with("store port"))
        .collect();
    printed.sort();
    assert_eq!(
        printed,
        ["add 12", "append done", "compare_set v2", "queue_push done"],
        "{}\n{logs}",
        done.dump()
    );
    let stored = ha.runtime.block_on(async {
        let mut stored = Vec::new();
        for k in [
            key("counter"),
            key("cas"),
            key("log"),
            "torch/q1/q/tail".into(),
        ] {
            let v = kv.get(&k).await.expect("a read").unwrap_or_default();
            stored.push(String::from_utf8_lossy(&v).into_owned());
        }
        stored
    });
    assert_eq!(stored, ["12", "v2", "ax", "1"], "{logs}");
}

/// Two agents on two network-namespace hosts, a coordinator on a third (TLS and tokens): each
/// agent serves its own workers' store on its loopback, and the job, whose gloo rendezvous and
/// per-step keys cross the nodes, completes. While it trains, on each host only its agent
/// listens on the workers' `MASTER_PORT`, on 127.0.0.1; the agent listens on nothing else but
/// loopback; no worker listens on more ports than the others (theirs are gloo's data plane);
/// and on the coordinator's host only the coordinator listens.
#[test]
fn two_hosts_each_serve_their_workers_store_on_loopback() {
    let Some(python) = peers_python(&["torch"]) else {
        return;
    };
    let _serial = serial();
    let Some(cluster) = Cluster::start(NODES as usize, &[]) else {
        return;
    };
    let started = Instant::now();
    let steer = Steer::new("hosts");
    steer.init();
    let python = python.to_str().expect("a UTF-8 venv path");
    let script = script();
    let agents: Vec<Agent> = (0..NODES)
        .map(|node| {
            let flags = node_flags(node);
            let flags: Vec<&str> = flags.iter().map(String::as_str).collect();
            cluster.agent(
                &format!("n{node}"),
                "agent-store-hosts",
                &flags,
                &[python, &script, steer.path()],
                // gloo's own address: the host name resolves to loopback in a namespace.
                &[("GLOO_SOCKET_IFNAME", "eth0")],
            )
        })
        .collect();
    let mut ports = Vec::new();
    for (node, agent) in agents.iter().enumerate() {
        let lines = agent.wait_for_lines(Stream::Stdout, NPROC as usize, PYTHON_LIMIT, |l| {
            l.contains("] ready ")
        });
        let ready: Vec<Ready> = lines
            .iter()
            .map(|l| ready(l).unwrap_or_else(|| panic!("a malformed ready line: {l}")))
            .collect();
        ports.push(check_host(&cluster, node, agent, &ready));
    }
    eprintln!("MASTER_PORT per host: {ports:?}");
    let coordinator_pid = cluster.coordinator_process.pid().as_raw().unsigned_abs();
    let on_coordinator = listeners_of(coordinator_pid);
    assert!(
        !on_coordinator.is_empty() && on_coordinator.iter().all(|l| l.pids == [coordinator_pid]),
        "only the coordinator (pid {coordinator_pid}) may listen on its host: {on_coordinator:#?}"
    );
    wait_steps(&agents, 3, PYTHON_LIMIT, || {
        cluster.coordinator_process.output()
    });
    steer.stop();
    let deadline = Instant::now() + PYTHON_LIMIT;
    let runs: Vec<Finished> = agents.into_iter().map(|a| a.finish_by(deadline)).collect();
    let steps = check_finished(&runs, &cluster.coordinator_process.output());
    eprintln!("two hosts trained {steps} steps in {:?}", started.elapsed());
}

/// On host `n<node>`: every rank of `agent` got MASTER_ADDR=127.0.0.1, one MASTER_PORT and
/// TORCHELASTIC_USE_AGENT_STORE=True; only the agent listens on that port, on 127.0.0.1; the
/// agent listens on loopback only; the workers all listen on as many ports. Returns the port.
fn check_host(cluster: &Cluster, node: usize, agent: &Agent, ready: &[Ready]) -> u16 {
    let port = ready[0].master_port;
    for r in ready {
        assert_eq!(
            (
                r.master_addr.as_str(),
                r.master_port,
                r.agent_store.as_str()
            ),
            ("127.0.0.1", port, "True"),
            "n{node}: rank {} got another store\n{}",
            r.rank,
            agent.output()
        );
    }
    let agent_pid = agent.pid().as_raw().unsigned_abs();
    let all = listeners_of(agent_pid);
    let on_master: Vec<&Listener> = all.iter().filter(|l| l.port == port).collect();
    assert_eq!(
        on_master,
        [&Listener {
            addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port,
            pids: vec![agent_pid],
        }],
        "n{node} ({}): only the agent (pid {agent_pid}) may listen on MASTER_PORT {port}, on \
         127.0.0.1; all listeners: {all:#?}",
        cluster.net.addr(&format!("n{node}"))
    );
    let beyond: Vec<&Listener> = held_by(&all, agent_pid)
        .into_iter()
        .filter(|l| !l.addr.is_loopback())
        .collect();
    assert!(
        beyond.is_empty(),
        "n{node}: the agent listens beyond loopback: {beyond:#?}"
    );
    let counts: Vec<usize> = ready.iter().map(|r| held_by(&all, r.pid).len()).collect();
    assert!(
        counts.iter().all(|&c| c == counts[0]),
        "n{node}: a rank listens on more ports than the others (a store server?): {counts:?}\n{all:#?}"
    );
    port
}
