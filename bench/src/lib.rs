//! Shared pieces of muster's benchmark programs: starting a coordinator process, reading its
//! memory, percentiles.

use std::net::{SocketAddr, TcpListener};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::time::Duration;
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
        let port = TcpListener::bind("127.0.0.1:0")?.local_addr()?.port();
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let bin = bin_dir().join("muster-coordinator");
        let child = Command::new(&bin)
            .args(["--listen", &addr.to_string(), "--log", "warn"])
            .stdin(Stdio::null())
            .spawn()
            .map_err(|e| anyhow::anyhow!("cannot start {}: {e} (build it first)", bin.display()))?;
        Ok(Self { addr, child })
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
