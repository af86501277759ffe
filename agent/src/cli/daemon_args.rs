//! The daemon-mode and operator subcommands' arguments (`serve`, `submit`, `status`,
//! `cancel`), and how a job placed on a daemon agent becomes `launch` flags
//! ([`ServeArgs::launch_args`]), so that it is validated as a launch without an argv.

use crate::security::SecurityArgs;
use clap::Args;
use std::collections::HashMap;

/// A daemon-mode or operator command.
#[derive(Debug, Clone)]
pub enum Request {
    /// `serve`.
    Serve(ServeArgs),
    /// `submit`.
    Submit(SubmitArgs),
    /// `status`.
    Status(StatusArgs),
    /// `cancel`.
    Cancel(CancelArgs),
}

/// `muster-agent serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// The coordinator's HOST:PORT, or its replicas' as a comma-separated list.
    #[arg(long, value_name = "HOST:PORT[,HOST:PORT...]")]
    pub coordinator: String,
    /// How long the jobs run here (agent and workers) retry across a coordinator failover.
    #[arg(long, value_name = "MS", default_value_t = 30_000)]
    pub failover_timeout_ms: u64,
    /// Labels of this machine, `key=value` (repeat the flag or separate with commas); jobs
    /// select machines by them.
    #[arg(
        long = "labels",
        alias = "label",
        value_name = "K=V[,K=V]",
        value_delimiter = ','
    )]
    pub labels: Vec<String>,
    /// This agent's id in the pool. Default: host name and process id.
    #[arg(long, value_name = "ID")]
    pub agent_id: Option<String>,
    /// The address other nodes reach this machine at. Default: the local address that routes
    /// to the coordinator.
    #[arg(long, value_name = "HOST")]
    pub advertise_addr: Option<String>,
    /// How long workers get between SIGTERM and SIGKILL when a job is stopped, unless the job
    /// says otherwise.
    #[arg(long, value_name = "MS", default_value_t = 5000)]
    pub grace_period_ms: u64,
    /// Where to serve Prometheus metrics (`GET /metrics`, plain HTTP), as an IP address and
    /// port (0.0.0.0:29472): the workers of the jobs run here by state, restarts, failures by
    /// cause, coordinator failovers and the relays' barrier latency. Default: none.
    #[arg(long, value_name = "IP:PORT")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// TLS and the cluster token, for this agent's calls and the jobs it runs.
    #[command(flatten)]
    pub security: SecurityArgs,
}

/// `muster-agent submit`.
#[derive(Debug, Clone, Args)]
pub struct SubmitArgs {
    /// The coordinator's HOST:PORT, or its replicas' as a comma-separated list.
    #[arg(long, value_name = "HOST:PORT[,HOST:PORT...]")]
    pub coordinator: String,
    /// The job id. Default: the coordinator picks one.
    #[arg(long, value_name = "ID")]
    pub job_id: Option<String>,
    /// How many nodes: MIN or MIN:MAX.
    #[arg(long, value_name = "MIN[:MAX]", default_value = "1")]
    pub nnodes: String,
    /// Workers per node.
    #[arg(long, value_name = "N")]
    pub nproc_per_node: u32,
    /// Restarts allowed after a failure.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_restarts: u32,
    /// Extra environment for the workers, `NAME=VALUE` (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Only machines with these labels, `key=value` (repeatable or comma-separated).
    #[arg(long = "selector", value_name = "K=V[,K=V]", value_delimiter = ',')]
    pub selector: Vec<String>,
    /// SIGTERM-to-SIGKILL grace when workers are stopped (0: the agents' default).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub grace_period_ms: u64,
    /// Wait until the job ends and exit 0 only if it finished.
    #[arg(long)]
    pub wait: bool,
    /// TLS and the cluster token.
    #[command(flatten)]
    pub security: SecurityArgs,
    /// The program and its arguments, after `--`.
    #[arg(value_name = "PROGRAM", trailing_var_arg = true, required = true)]
    pub command: Vec<String>,
}

impl SubmitArgs {
    /// Checks what can be checked before calling the coordinator; the error names the flag.
    pub fn check(&self) -> Result<(), String> {
        node_range(&self.nnodes)?;
        pairs("--env", &self.env)?;
        pairs("--selector", &self.selector)?;
        if self.nproc_per_node == 0 {
            return Err("--nproc-per-node 0 is out of range: at least 1".to_owned());
        }
        Ok(())
    }
}

/// `muster-agent status`.
#[derive(Debug, Clone, Args)]
pub struct StatusArgs {
    /// The coordinator's HOST:PORT, or its replicas' as a comma-separated list.
    #[arg(long, value_name = "HOST:PORT[,HOST:PORT...]")]
    pub coordinator: String,
    /// A job to describe. Without it: every job and every daemon agent.
    pub job_id: Option<String>,
    /// TLS and the cluster token.
    #[command(flatten)]
    pub security: SecurityArgs,
}

/// `muster-agent cancel`.
#[derive(Debug, Clone, Args)]
pub struct CancelArgs {
    /// The coordinator's HOST:PORT, or its replicas' as a comma-separated list.
    #[arg(long, value_name = "HOST:PORT[,HOST:PORT...]")]
    pub coordinator: String,
    /// The job to cancel.
    pub job_id: String,
    /// Why (shown to the job's agents and workers).
    #[arg(long, default_value = "cancelled by an operator")]
    pub reason: String,
    /// TLS and the cluster token.
    #[command(flatten)]
    pub security: SecurityArgs,
}

/// Parses `key=value` items; the error names the flag and the item.
pub fn pairs(flag: &str, items: &[String]) -> Result<HashMap<String, String>, String> {
    let mut out = HashMap::new();
    for item in items.iter().filter(|i| !i.is_empty()) {
        let Some((k, v)) = item.split_once('=') else {
            return Err(format!("{flag} '{item}' is malformed: expected KEY=VALUE"));
        };
        if k.is_empty() {
            return Err(format!("{flag} '{item}' has an empty key"));
        }
        out.insert(k.to_owned(), v.to_owned());
    }
    Ok(out)
}

/// Parses `MIN` or `MIN:MAX`.
pub(crate) fn node_range(s: &str) -> Result<(u32, u32), String> {
    let bad = |why: &str| format!("--nnodes '{s}' is malformed: {why}");
    let (min, max) = match s.split_once(':') {
        Some((a, b)) => (a, b),
        None => (s, s),
    };
    let min: u32 = min.parse().map_err(|_| bad("MIN is not a number"))?;
    let max: u32 = max.parse().map_err(|_| bad("MAX is not a number"))?;
    if min == 0 || max < min {
        return Err(bad("expected 1 <= MIN <= MAX"));
    }
    Ok((min, max))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn pairs_and_ranges() {
        let p = pairs("--labels", &["a=1".into(), "b=x=y".into()]).unwrap();
        assert_eq!(p["a"], "1");
        assert_eq!(p["b"], "x=y");
        assert_eq!(
            pairs("--labels", &["nokey".into()]).unwrap_err(),
            "--labels 'nokey' is malformed: expected KEY=VALUE"
        );
        assert_eq!(node_range("2").unwrap(), (2, 2));
        assert_eq!(node_range("1:3").unwrap(), (1, 3));
        assert!(node_range("3:1").unwrap_err().contains("MIN <= MAX"));
        assert!(node_range("x").unwrap_err().contains("not a number"));
    }
}
