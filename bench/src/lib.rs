//! Shared pieces of muster's benchmark programs: starting a coordinator process, reading its
//! memory, running a launch and reading rank 0's barrier percentiles, percentiles, and what
//! a run records about the machine (date, commit, CPU).

pub mod floor;

use anyhow::{Context, bail};
use muster_proto::v1 as pb;
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tonic::transport::Channel;

/// The directory holding this workspace's built binaries (next to the running benchmark).
pub fn bin_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap_or_default();
    exe.parent().map(PathBuf::from).unwrap_or_default()
}

/// A coordinator process started for a benchmark; killed on drop.
pub struct CoordinatorProcess {
    /// Where it listens.
    pub addr: SocketAddr,
    child: Child,
}

impl CoordinatorProcess {
    /// Starts `muster-coordinator` from `bin_dir()` on a free loopback port.
    pub fn start() -> anyhow::Result<Self> {
        Self::start_with(|_| {})
    }

    /// Like [`CoordinatorProcess::start`], with more flags or environment set by `configure`
    /// (TLS, an OTLP endpoint); returns once it accepts TCP connections.
    pub fn start_with(configure: impl FnOnce(&mut Command)) -> anyhow::Result<Self> {
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let bin = bin_dir().join("muster-coordinator");
        let mut cmd = Command::new(&bin);
        cmd.args(["--listen", &addr.to_string(), "--log", "warn"])
            .stdin(Stdio::null());
        configure(&mut cmd);
        let child = cmd
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {}: {e} (build it first)", bin.display()))?;
        let mut coordinator = Self { addr, child };
        let deadline = Instant::now() + Duration::from_secs(10);
        while TcpStream::connect(addr).is_err() {
            if let Some(status) = coordinator.child.try_wait()? {
                bail!("the coordinator exited before listening ({status})");
            }
            anyhow::ensure!(Instant::now() < deadline, "the coordinator does not listen");
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(coordinator)
    }

    /// Stops the coordinator with SIGTERM (so that it drains and flushes what it exports),
    /// killing it after `grace`.
    pub fn stop(mut self, grace: Duration) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let deadline = Instant::now() + grace;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        // Drop kills it.
    }

    /// Resident memory of the coordinator process in bytes.
    pub fn rss_bytes(&self) -> u64 {
        let status = std::fs::read_to_string(format!("/proc/{}/status", self.child.id()))
            .unwrap_or_default();
        status
            .lines()
            .find_map(|l| l.strip_prefix("VmRSS:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map_or(0, |kb| kb * 1024)
    }
}

impl Drop for CoordinatorProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Connects `n` separate HTTP/2 connections to `addr`, retrying while it starts.
pub async fn channels(addr: SocketAddr, n: usize) -> anyhow::Result<Vec<Channel>> {
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let mut last = None;
        for _ in 0..200 {
            match Channel::from_shared(format!("http://{addr}"))?
                .tcp_nodelay(true)
                .initial_stream_window_size(Some(1 << 20))
                .connect()
                .await
            {
                Ok(c) => {
                    last = Some(Ok(c));
                    break;
                }
                Err(e) => last = Some(Err(e)),
            }
            tokio::time::sleep(Duration::from_millis(25)).await;
        }
        match last {
            Some(Ok(c)) => out.push(c),
            Some(Err(e)) => return Err(anyhow::anyhow!("cannot connect to {addr}: {e}")),
            None => anyhow::bail!("cannot connect to {addr}"),
        }
    }
    Ok(out)
}

/// The `q` quantile (0..=1) of `xs` (sorted in place).
pub fn quantile(xs: &mut [f64], q: f64) -> f64 {
    if xs.is_empty() {
        return f64::NAN;
    }
    xs.sort_by(f64::total_cmp);
    xs[((q * xs.len() as f64) as usize).min(xs.len() - 1)]
}

/// Whether the coordinator behind `ch` leads: it answers a leader-only call (`ListJobs`)
/// within a second, where a follower, or one backed by etcd that has not won its election
/// yet, answers UNAVAILABLE.
pub async fn leads(ch: &Channel) -> bool {
    let mut ops = pb::ops_client::OpsClient::new(ch.clone());
    let call = ops.list_jobs(pb::ListJobsRequest {});
    matches!(
        tokio::time::timeout(Duration::from_secs(1), call).await,
        Ok(Ok(_))
    )
}

/// How many nodes wait in `job`'s open round (0 if the job is unknown or unreachable).
pub async fn waiting(ch: &Channel, job: &str) -> u32 {
    muster_proto::v1::ops_client::OpsClient::new(ch.clone())
        .list_jobs(muster_proto::v1::ListJobsRequest {})
        .await
        .map(|r| {
            r.into_inner()
                .jobs
                .iter()
                .find(|j| j.job_id == job)
                .map_or(0, |j| j.nodes_waiting)
        })
        .unwrap_or(0)
}

/// Runs `cmd` to completion: its stdout and wall time in seconds, or an error with its
/// output when it fails.
pub fn run_output(cmd: &mut Command) -> anyhow::Result<(String, f64)> {
    let t = Instant::now();
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {cmd:?}"))?;
    let stdout = wait_output(child, &format!("{cmd:?}"))?;
    Ok((stdout, t.elapsed().as_secs_f64()))
}

/// Waits for `child` (spawned with piped stdout and stderr): its stdout, or an error with its
/// output, naming it `what`, when it fails.
pub fn wait_output(child: Child, what: &str) -> anyhow::Result<String> {
    let out = child
        .wait_with_output()
        .with_context(|| format!("waiting for {what}"))?;
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "{what} failed ({}): {stdout}{}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(stdout)
}

/// The number after `key` (as in `p50_us=`) in `line`.
pub fn field(line: &str, key: &str) -> Option<f64> {
    let start = line.find(key)? + key.len();
    let rest = &line[start..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Rank 0's barrier p50 and p99 in microseconds, from the output of `barrier_loop` workers.
pub fn rank0_latency(out: &str) -> anyhow::Result<(f64, f64)> {
    let line = out
        .lines()
        .find(|l| l.contains("rank=0 "))
        .with_context(|| format!("no rank 0 summary in the output: {out}"))?;
    Ok((
        field(line, "p50_us=").context("p50")?,
        field(line, "p99_us=").context("p99")?,
    ))
}

/// The peers' venv (torch, torchrun, accelerate): `venv` when given, else where
/// `scripts/install-peers.sh` puts it, `~/.cache/muster-peers`.
pub fn peers_venv(venv: Option<PathBuf>) -> PathBuf {
    venv.unwrap_or_else(|| {
        PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(".cache/muster-peers")
    })
}

/// A free loopback TCP port (for torchrun's rendezvous store).
pub fn free_port() -> anyhow::Result<u16> {
    Ok(TcpListener::bind("127.0.0.1:0")?.local_addr()?.port())
}

/// Waits for every child; an error naming `what` when one fails.
pub fn wait_all(children: Vec<Child>, what: &str) -> anyhow::Result<()> {
    for mut c in children {
        let status = c.wait()?;
        if !status.success() {
            bail!("{what} exited with {status}");
        }
    }
    Ok(())
}

/// Torch's barrier figures from `shared/peers/torch_peer.py`'s summary line: gloo
/// `dist.barrier()` (p50, p99) and TCPStore add+wait (p50, p99), in microseconds.
pub fn torch_barrier_latency(out: &str) -> anyhow::Result<((f64, f64), (f64, f64))> {
    let line = out
        .lines()
        .find(|l| l.contains("gloo_barrier_us"))
        .with_context(|| format!("no summary in torch output: {out}"))?;
    let (gloo, store) = line.split_once('|').context("torch summary format")?;
    Ok((
        (
            field(gloo, "p50=").context("gloo p50")?,
            field(gloo, "p99=").context("gloo p99")?,
        ),
        (
            field(store, "p50=").context("store p50")?,
            field(store, "p99=").context("store p99")?,
        ),
    ))
}

/// The gloo side of the all_reduce benchmarks, measured as muster's `allreduce_bench` example
/// measures (write it to a file and run it under torchrun).
pub const GLOO_ALLREDUCE_SCRIPT: &str = include_str!("../allreduce_gloo.py");

/// Rank 0's median time in microseconds for an all_reduce of `size` bytes, from the output of
/// `allreduce_bench` (muster, lines prefixed `[rank 0] `) or `allreduce_gloo.py`.
pub fn allreduce_p50_us(out: &str, size: usize) -> Option<f64> {
    out.lines()
        .map(|l| l.strip_prefix("[rank 0] ").unwrap_or(l))
        .filter(|l| l.starts_with("size_bytes="))
        .find(|l| field(l, "size_bytes=") == Some(size as f64))
        .and_then(|l| field(l, "time_us_p50="))
}

/// The restart benchmarks' Python worker: each worker appends `start <restart> <wall-ns>` to
/// `$RESTART_BENCH_LOG` when it starts; on the first generation rank 1 appends `death
/// <wall-ns>` one second in and exits 3, the others wait. The new generation notes its start
/// and exits 0.
pub const RESTART_WORKER: &str = r#"
import os, sys, time
log = os.environ["RESTART_BENCH_LOG"]
def note(line):
    with open(log, "a") as f:
        f.write(line + "\n")
# The new generation is whatever starts after the death (torchrun's restart count is per agent,
# so it cannot tell the generations apart on several nodes).
try:
    after = "death" in open(log).read()
except FileNotFoundError:
    after = False
restart = 1 if after else 0
note(f"start {restart} {time.time_ns()}")
if restart == 0:
    if os.environ.get("RANK") == "1":
        time.sleep(1.0)
        note(f"death {time.time_ns()}")
        sys.exit(3)
    time.sleep(120)
"#;

/// Milliseconds from the death to the last start of generation 1 (the restart), from a
/// [`RESTART_WORKER`] log of `workers` workers.
pub fn restart_ms(log: &Path, workers: u32) -> anyhow::Result<f64> {
    let text =
        std::fs::read_to_string(log).with_context(|| format!("reading {}", log.display()))?;
    let mut death = None;
    let mut starts = vec![];
    for line in text.lines() {
        let parts: Vec<&str> = line.split(' ').collect();
        match parts.as_slice() {
            ["death", t] => death = Some(t.parse::<u128>()?),
            ["start", "1", t] => starts.push(t.parse::<u128>()?),
            _ => {}
        }
    }
    let death = death.context("no death line")?;
    if starts.len() != workers as usize {
        bail!(
            "{} of {workers} workers of the new generation started:\n{text}",
            starts.len()
        );
    }
    let last = starts.into_iter().max().unwrap_or(death);
    Ok((last.saturating_sub(death)) as f64 / 1e6)
}

/// One restart round under `muster-agent launch --max-restarts 1`: `nodes` agents of
/// `per_node` workers running `python worker` (a [`RESTART_WORKER`]), against `coordinator`
/// when several nodes share a job (job id `bench-<round>`), each agent also given `extra`; the
/// restart time in milliseconds.
#[allow(clippy::too_many_arguments)]
pub fn muster_restart_round(
    agent: &Path,
    python: &Path,
    worker: &Path,
    log: &Path,
    (nodes, per_node): (u32, u32),
    coordinator: Option<&CoordinatorProcess>,
    round: usize,
    extra: &[&str],
) -> anyhow::Result<f64> {
    let children = (0..nodes)
        .map(|_| {
            let mut cmd = Command::new(agent);
            cmd.args(["launch", "--nproc-per-node", &per_node.to_string()]);
            cmd.args(["--max-restarts", "1", "--grace-period-ms", "3000"]);
            cmd.args(extra);
            if let Some(c) = coordinator {
                cmd.args(["--coordinator", &c.addr.to_string()]);
                cmd.args([
                    "--job-id",
                    &format!("bench-{round}"),
                    "--nnodes",
                    &nodes.to_string(),
                ]);
            }
            cmd.arg("--").arg(python).arg(worker);
            cmd.env("RESTART_BENCH_LOG", log)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()?;
    wait_all(children, "muster-agent")?;
    restart_ms(log, nodes * per_node)
}

/// The same round under `torchrun --max-restarts 1` (a c10d rendezvous on a free port when
/// `nodes` > 1); the restart time in milliseconds.
pub fn torch_restart_round(
    torchrun: &Path,
    worker: &Path,
    log: &Path,
    (nodes, per_node): (u32, u32),
    round: usize,
) -> anyhow::Result<f64> {
    let port = free_port()?;
    let children = (0..nodes)
        .map(|_| {
            let mut cmd = Command::new(torchrun);
            cmd.args([
                "--nproc-per-node",
                &per_node.to_string(),
                "--max-restarts",
                "1",
            ]);
            if nodes > 1 {
                cmd.args(["--nnodes", &nodes.to_string(), "--rdzv-backend", "c10d"]);
                cmd.args(["--rdzv-endpoint", &format!("127.0.0.1:{port}")]);
                cmd.args(["--rdzv-id", &format!("bench-{round}")]);
            }
            cmd.arg(worker);
            cmd.env("RESTART_BENCH_LOG", log)
                .env("OMP_NUM_THREADS", "1")
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()?;
    wait_all(children, "torchrun")?;
    restart_ms(log, nodes * per_node)
}

/// The 1, 5 and 15 minute load averages, as /proc/loadavg gives them.
pub fn load_average() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .unwrap_or_default()
        .split(' ')
        .take(3)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The floor any launcher adds to: `workers` interpreters of the worker spawned directly, from
/// the spawn to the last one's `start` line (the log already holds a death, so each notes
/// `start 1` and exits).
pub fn floor_ms(python: &Path, worker: &Path, log: &Path, workers: u32) -> anyhow::Result<f64> {
    std::fs::write(log, "death 0\n")?;
    let t0 = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)?
        .as_nanos();
    let children = (0..workers)
        .map(|r| {
            Command::new(python)
                .arg(worker)
                .env("RESTART_BENCH_LOG", log)
                .env("RANK", (r + 100).to_string())
                .stdout(Stdio::null())
                .spawn()
        })
        .collect::<Result<Vec<_>, _>>()?;
    wait_all(children, "a direct worker")?;
    let text = std::fs::read_to_string(log)?;
    let last = text
        .lines()
        .filter_map(|l| l.strip_prefix("start 1 "))
        .filter_map(|t| t.parse::<u128>().ok())
        .max()
        .context("no start line from a directly started worker")?;
    Ok(last.saturating_sub(t0) as f64 / 1e6)
}

/// The first line of a command's output, or `unknown` where it fails.
pub fn command_line(program: &str, args: &[&str]) -> String {
    Command::new(program)
        .args(args)
        .output()
        .ok()
        .filter(|o| o.status.success())
        .and_then(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .next()
                .map(str::to_owned)
        })
        .unwrap_or_else(|| "unknown".into())
}

/// The CPU's model name from /proc/cpuinfo.
pub fn cpu_model() -> String {
    std::fs::read_to_string("/proc/cpuinfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("model name"))
        .map(|v| v.trim_start_matches([' ', '\t', ':']).trim().to_owned())
        .unwrap_or_else(|| "unknown CPU model".into())
}

/// A join of simulated node `node` (of `nodes`, `local` ranks each) to `job`.
/// `watches`: the node will hold a lease (it attaches a watch and heartbeats on it, as an
/// agent does).
pub fn join_req(job: &str, node: u32, local: u32, nodes: u32, watches: bool) -> pb::JoinRequest {
    pb::JoinRequest {
        job_id: job.into(),
        node_id: format!("node-{node}"),
        host: format!("10.0.{}.{}", node / 250, node % 250),
        local_world_size: local,
        requested_node_rank: None,
        config: Some(pb::RendezvousConfig {
            min_nodes: nodes,
            max_nodes: nodes,
            last_call_ms: 0,
            join_timeout_ms: 600_000,
            max_restarts: None,
            recovery: 0,
            ..Default::default()
        }),
        request_id: String::new(),
        watches,
        spare: false,
    }
}

/// Joins `nodes - 1` nodes, waits until they are all in, then times the last join until every
/// node holds its assignment.
pub async fn rendezvous(
    chs: &[Channel],
    job: &str,
    nodes: u32,
    local: u32,
) -> anyhow::Result<Duration> {
    rendezvous_with(chs, job, nodes, local, false)
        .await
        .map(|r| r.took)
}

/// What [`rendezvous_with`] measured.
pub struct Rendezvous {
    /// From the first join sent to the coordinator counting `nodes - 1` joiners (polled every
    /// 20 ms): the cost of the joins themselves.
    pub joins: Duration,
    /// From the last join to every node holding its assignment.
    pub took: Duration,
    /// `node_ranks[n]` is node `node-<n>`'s node rank.
    pub node_ranks: Vec<u32>,
}

/// [`rendezvous`], with every node saying whether it will hold a lease ([`join_req`]); also
/// returns how long the joins took and each simulated node's place.
pub async fn rendezvous_with(
    chs: &[Channel],
    job: &str,
    nodes: u32,
    local: u32,
    watches: bool,
) -> anyhow::Result<Rendezvous> {
    let (done_tx, mut done_rx) = mpsc::unbounded_channel();
    let first = Instant::now();
    for n in 0..nodes - 1 {
        let mut c =
            pb::rendezvous_client::RendezvousClient::new(chs[n as usize % chs.len()].clone());
        let tx = done_tx.clone();
        let req = join_req(job, n, local, nodes, watches);
        tokio::spawn(async move {
            let r = c.join(req).await;
            let _ = tx.send((Instant::now(), n, r.map(|r| r.into_inner())));
        });
    }
    while waiting(&chs[0], job).await < nodes - 1 {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let joins = first.elapsed();
    let mut c = pb::rendezvous_client::RendezvousClient::new(chs[0].clone());
    let t0 = Instant::now();
    let last = c
        .join(join_req(job, nodes - 1, local, nodes, watches))
        .await?
        .into_inner();
    let mut latest = Instant::now();
    let mut node_ranks = vec![0; nodes as usize];
    node_ranks[nodes as usize - 1] = last.node_rank;
    let mut answers = vec![last];
    for _ in 0..nodes - 1 {
        let (at, n, r) = done_rx
            .recv()
            .await
            .ok_or_else(|| anyhow::anyhow!("a joiner vanished"))?;
        let answer = r?;
        node_ranks[n as usize] = answer.node_rank;
        answers.push(answer);
        latest = latest.max(at);
    }
    anyhow::ensure!(
        answers.iter().all(|a| a.num_nodes == nodes),
        "wrong node count"
    );
    Ok(Rendezvous {
        joins,
        took: latest - t0,
        node_ranks,
    })
}
