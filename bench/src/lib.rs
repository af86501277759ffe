//! Shared pieces of muster's benchmark programs: starting a coordinator process, reading its
//! memory, running a launch and reading rank 0's barrier percentiles, percentiles.

use anyhow::{Context, bail};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};
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
