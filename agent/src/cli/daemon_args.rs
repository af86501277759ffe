//! The daemon-mode and operator subcommands' arguments (`serve`, `submit`, `status`,
//! `cancel`, `describe`), and how a job placed on a daemon agent becomes `launch` flags
//! ([`ServeArgs::launch_args`]), so that it is validated as a launch without an argv.

use super::launch_args::{LaunchArgs, Nproc};
use super::values::Limit;
use crate::env::Recovery;
use crate::security::SecurityArgs;
use clap::Args;
use muster_core::requests::OnHang;
use muster_proto::v1 as pb;
use std::collections::HashMap;
use std::ffi::OsString;
use std::time::Duration;

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
    /// `describe` (describe.rs).
    Describe(DescribeArgs),
}

/// `muster-agent serve`.
#[derive(Debug, Clone, Args)]
pub struct ServeArgs {
    /// The coordinator's HOST:PORT, or its replicas' as a comma-separated list.
    #[arg(long, value_name = "HOST:PORT[,HOST:PORT...]")]
    pub coordinator: String,
    /// How long the jobs run here (agent and workers) retry across a coordinator failover.
    #[arg(long, value_name = "MS", default_value_t = muster_core::failover::DEFAULT_BUDGET_MS)]
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
    /// The hang timeout of the jobs run here that set none (`90s`, `5m`, `off`), as
    /// `launch --hang-timeout`. Default: launch's (5m).
    #[arg(long, value_name = "DURATION", value_parser = super::values::parse_limit)]
    pub hang_timeout: Option<super::values::Limit>,
    /// What a hang does in the jobs run here that set nothing, as `launch --on-hang`.
    #[arg(long, value_name = "ACTION", value_parser = OnHang::parse)]
    pub on_hang: Option<OnHang>,
    /// Where to serve Prometheus metrics (`GET /metrics`, plain HTTP), as an IP address and
    /// port (0.0.0.0:29472): the workers of the jobs run here by state, restarts, failures by
    /// cause, coordinator failovers and the relays' barrier latency. Default: none.
    #[arg(long, value_name = "IP:PORT")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// TLS and the cluster token, for this agent's calls and the jobs it runs.
    #[command(flatten)]
    pub security: SecurityArgs,
}

impl ServeArgs {
    /// The `launch` flags of a job the coordinator placed on this agent: the job's own
    /// settings, this agent's coordinator list, failover budget, address and security (the
    /// files are read again at validation: a rotated token is picked up by the next job), and
    /// the defaults of a bare `launch` for the rest. Validated like a command line
    /// ([`LaunchArgs::validate`]), so a job placed here starts exactly as a launch would.
    pub fn launch_args(&self, job: &pb::JobSpec) -> Result<LaunchArgs, String> {
        let mut args = LaunchArgs::defaults()?;
        args.coordinator = Some(self.coordinator.clone());
        args.job_id = Some(job.job_id.clone());
        args.nnodes = Some(format!(
            "{}:{}",
            job.min_nodes,
            job.max_nodes.max(job.min_nodes)
        ));
        args.nproc_per_node = Some(Nproc::Count(job.nproc_per_node));
        args.max_restarts = Some(job.max_restarts);
        args.max_spares = Some(job.max_spares);
        // Unspecified: what a bare launch does (a restart).
        args.recovery = Recovery::from_wire("recovery", job.recovery)
            .map_err(|_| {
                format!(
                    "job '{}' asks for recovery mode {}, which this agent does not know",
                    job.job_id, job.recovery
                )
            })?
            .or(args.recovery);
        // 0: the job leaves it to the agents.
        args.grace_period_ms = Some(if job.grace_period_ms > 0 {
            job.grace_period_ms
        } else {
            self.grace_period_ms
        });
        // Hang detection: the job's, else this agent's defaults, else a bare launch's.
        args.hang_timeout = match job.hang_timeout_ms {
            Some(0) => Some(Limit(None)),
            Some(ms) => Some(Limit(Some(Duration::from_millis(ms)))),
            None => self.hang_timeout,
        };
        args.on_hang = OnHang::from_wire("on_hang", job.on_hang)
            .map_err(|e| format!("job '{}': {}", job.job_id, e.0))?
            .or(self.on_hang);
        // A job that opts out does so on every agent; one that does not leaves it to the
        // serving agent's own MUSTER_NO_AGENT_STORE, as a bare launch would.
        args.no_agent_store |= job.no_agent_store;
        args.failover_timeout_ms = self.failover_timeout_ms;
        args.advertise_addr = self.advertise_addr.clone();
        args.security = self.security.clone();
        args.command = std::iter::once(&job.program)
            .chain(&job.args)
            .map(OsString::from)
            .collect();
        Ok(args)
    }
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
    /// What a worker's death does: restart (the default: the job restarts) or in-place (only
    /// the dead worker is respawned), as `launch --recovery`.
    #[arg(long, value_enum, value_name = "MODE")]
    pub recovery: Option<Recovery>,
    /// Spare agents the job admits (with `--recovery in-place`): that many more idle matching
    /// agents stand by to take a lost node's ranks, as `launch --max-spares`.
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub max_spares: u32,
    /// Extra environment for the workers, `NAME=VALUE` (repeatable).
    #[arg(long = "env", value_name = "NAME=VALUE")]
    pub env: Vec<String>,
    /// Only machines with these labels, `key=value` (repeatable or comma-separated).
    #[arg(long = "selector", value_name = "K=V[,K=V]", value_delimiter = ',')]
    pub selector: Vec<String>,
    /// SIGTERM-to-SIGKILL grace when workers are stopped (0: the agents' default).
    #[arg(long, value_name = "MS", default_value_t = 0)]
    pub grace_period_ms: u64,
    /// How long the job may make no progress before it is a hang (`90s`, `5m`, `off`), as
    /// `launch --hang-timeout`. Default: the serving agents'.
    #[arg(long, value_name = "DURATION", value_parser = super::values::parse_limit)]
    pub hang_timeout: Option<super::values::Limit>,
    /// What a hang does (report, fail, restart), as `launch --on-hang`. Default: the serving
    /// agents'.
    #[arg(long, value_name = "ACTION", value_parser = OnHang::parse)]
    pub on_hang: Option<OnHang>,
    /// Give the workers rank 0's own torch TCPStore instead of their agents' store (as
    /// `launch --no-agent-store`).
    #[arg(long, alias = "no_agent_store")]
    pub no_agent_store: bool,
    /// Wait until the job ends: exit 0 if it finished, 3 if an operator cancelled it, 1 if it
    /// failed. Only states are shown: the workers' output is on each agent's stdout and stderr.
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

    /// The job as the coordinator takes it (`Ops.SubmitJob`); the error names the flag.
    pub fn job_spec(&self) -> Result<pb::JobSpec, String> {
        let (min, max) = node_range(&self.nnodes)?;
        let (program, rest) = self
            .command
            .split_first()
            .ok_or("no program to run: give it after `--`")?;
        Ok(pb::JobSpec {
            job_id: self.job_id.clone().unwrap_or_default(),
            program: program.clone(),
            args: rest.to_vec(),
            env: pairs("--env", &self.env)?,
            min_nodes: min,
            max_nodes: max,
            nproc_per_node: self.nproc_per_node,
            max_restarts: self.max_restarts,
            node_selector: pairs("--selector", &self.selector)?,
            grace_period_ms: self.grace_period_ms,
            no_agent_store: self.no_agent_store,
            recovery: self.recovery.unwrap_or_default().to_wire(),
            hang_timeout_ms: self
                .hang_timeout
                .map(|Limit(t)| t.map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))),
            on_hang: self.on_hang.map_or(0, OnHang::to_wire),
            max_spares: self.max_spares,
        })
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
    #[arg(long, default_value = "no reason given")]
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
fn node_range(s: &str) -> Result<(u32, u32), String> {
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
    use crate::cli::tests::machine;
    use crate::cli::{NodeRange, Parsed, parse_in};
    use std::time::Duration;

    /// `muster-agent <args>` parsed as a daemon-mode command.
    fn request(args: &[&str]) -> Request {
        let argv = std::iter::once("muster-agent").chain(args.iter().copied());
        match parse_in(argv, &machine(None)).unwrap().0 {
            Parsed::Daemon(r) => r,
            other => panic!("not a daemon-mode command: {other:?}"),
        }
    }

    fn serve(args: &[&str]) -> ServeArgs {
        match request(&[&["serve"], args].concat()) {
            Request::Serve(a) => a,
            other => panic!("not serve: {other:?}"),
        }
    }

    /// What `submit` sends reaches the spec a daemon agent runs, through the launch's own
    /// validation: the job's settings, the serving agent's, and a bare launch's defaults.
    #[test]
    fn a_submitted_job_reaches_the_launch_spec() {
        let Request::Submit(submit) = request(&[
            "submit",
            "--coordinator=10.0.0.1:29470",
            "--job-id=j1",
            "--nnodes=1:2",
            "--nproc-per-node=3",
            "--max-restarts=2",
            "--grace-period-ms=1234",
            "--env=A=1",
            "--",
            "sh",
            "-c",
            "exit 0",
        ]) else {
            panic!("not submit")
        };
        let job = submit.job_spec().unwrap();
        let agent = serve(&[
            "--coordinator=10.0.0.1:29470, 10.0.0.2:29470",
            "--failover-timeout-ms=700",
            "--advertise-addr=10.0.0.9",
            "--grace-period-ms=99",
        ]);
        let (spec, _) = agent
            .launch_args(&job)
            .unwrap()
            .validate_in(&machine(None))
            .unwrap();
        assert_eq!(
            spec.coordinator.as_deref(),
            Some("10.0.0.1:29470,10.0.0.2:29470")
        );
        assert_eq!(spec.job_id, "j1");
        assert_eq!(spec.nodes, NodeRange { min: 1, max: 2 });
        assert_eq!(spec.nproc_per_node, 3);
        assert_eq!(spec.max_restarts, 2);
        assert_eq!(spec.grace_period, Duration::from_millis(1234));
        assert_eq!(spec.failover_timeout, Duration::from_millis(700));
        assert_eq!(spec.advertise_addr.as_deref(), Some("10.0.0.9"));
        assert_eq!(spec.program.name, "sh");
        assert_eq!(spec.program.args, ["-c", "exit 0"]);
        // A bare launch's defaults for what a job cannot say.
        assert_eq!(spec.lease, Duration::from_secs(10));
        assert!(spec.relay);
        assert!(spec.agent_store, "the agent store is the default");

        // No grace period of its own: the serving agent's.
        let job = pb::JobSpec {
            grace_period_ms: 0,
            ..job
        };
        let (spec, _) = agent
            .launch_args(&job)
            .unwrap()
            .validate_in(&machine(None))
            .unwrap();
        assert_eq!(spec.grace_period, Duration::from_millis(99));
    }

    /// `submit --no-agent-store` reaches the daemon agent's spec as `launch --no-agent-store`
    /// reaches a launch's: rank 0's own TCPStore.
    #[test]
    fn a_submitted_job_opts_out_of_the_agent_store_as_a_launch_does() {
        let Request::Submit(submit) = request(&[
            "submit",
            "--coordinator=10.0.0.1:29470",
            "--job-id=j2",
            "--nproc-per-node=2",
            "--no-agent-store",
            "--",
            "sh",
        ]) else {
            panic!("not submit")
        };
        let job = submit.job_spec().unwrap();
        assert!(job.no_agent_store);
        let agent = serve(&["--coordinator=10.0.0.1:29470"]);
        let (spec, _) = agent
            .launch_args(&job)
            .unwrap()
            .validate_in(&machine(None))
            .unwrap();
        assert!(!spec.agent_store);
        let argv = [
            "muster-agent",
            "launch",
            "--coordinator=10.0.0.1:29470",
            "--nproc-per-node=2",
            "--no-agent-store",
            "sh",
        ];
        let Parsed::Launch(launched) = parse_in(argv, &machine(None)).unwrap().0 else {
            panic!("not launch")
        };
        assert_eq!(launched.agent_store, spec.agent_store);
    }

    /// `submit --recovery` reaches the daemon agent's spec; without it, a restart, as a bare
    /// launch; a mode the agent does not know is refused naming the job.
    #[test]
    fn a_submitted_job_recovers_as_it_asks() {
        let submit = |extra: &[&str]| {
            let args = [
                &["submit", "--coordinator=10.0.0.1:29470", "--job-id=j3"][..],
                extra,
                &["--nproc-per-node=2", "--", "sh"][..],
            ]
            .concat();
            let Request::Submit(submit) = request(&args) else {
                panic!("not submit")
            };
            submit.job_spec().unwrap()
        };
        let agent = serve(&["--coordinator=10.0.0.1:29470"]);
        let spec_of = |job: &pb::JobSpec| {
            agent
                .launch_args(job)
                .map(|a| a.validate_in(&machine(None)).unwrap().0.recovery)
        };
        let job = submit(&["--recovery=in-place"]);
        assert_eq!(job.recovery, pb::RecoveryMode::InPlace as i32);
        assert_eq!(spec_of(&job), Ok(Recovery::InPlace));
        let job = submit(&[]);
        assert_eq!(job.recovery, pb::RecoveryMode::Restart as i32);
        assert_eq!(spec_of(&job), Ok(Recovery::Restart));
        let unspecified = pb::JobSpec {
            recovery: pb::RecoveryMode::Unspecified as i32,
            ..job.clone()
        };
        assert_eq!(spec_of(&unspecified), Ok(Recovery::Restart));
        let unknown = pb::JobSpec { recovery: 9, ..job };
        assert_eq!(
            spec_of(&unknown),
            Err("job 'j3' asks for recovery mode 9, which this agent does not know".to_owned())
        );
        let argv = std::iter::once("muster-agent").chain([
            "submit",
            "--coordinator=10.0.0.1:29470",
            "--nproc-per-node=2",
            "--recovery=sometimes",
            "--",
            "sh",
        ]);
        let err = parse_in(argv, &machine(None)).unwrap_err().to_string();
        assert!(
            err.contains("sometimes") && !err.contains('\n'),
            "one line naming the value: {err}"
        );
    }

    /// A placed job the launch would refuse is refused with the launch's message.
    #[test]
    fn a_placed_job_is_checked_like_a_launch() {
        let agent = serve(&["--coordinator=10.0.0.1:29470"]);
        let check = |job: pb::JobSpec| {
            agent
                .launch_args(&job)
                .unwrap()
                .validate_in(&machine(None))
                .map(|_| ())
                .map_err(|e| e.to_string())
        };
        let job = pb::JobSpec {
            job_id: "j2".to_owned(),
            program: "sh".to_owned(),
            min_nodes: 1,
            max_nodes: 1,
            nproc_per_node: 1,
            ..Default::default()
        };
        assert_eq!(check(job.clone()), Ok(()));
        assert_eq!(
            check(pb::JobSpec {
                nproc_per_node: 0,
                ..job.clone()
            }),
            Err("--nproc-per-node 0 is out of range 1..=4096".to_owned())
        );
        assert_eq!(
            check(pb::JobSpec {
                job_id: "no spaces".to_owned(),
                ..job.clone()
            })
            .map_err(|e| e.starts_with("--job-id: ")),
            Err(true)
        );
        assert_eq!(
            check(pb::JobSpec {
                program: "no-such-program-here".to_owned(),
                ..job
            })
            .map_err(|e| e.contains("no-such-program-here")),
            Err(true)
        );
    }

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

/// `muster-agent describe`.
#[derive(Debug, Clone, Args)]
pub struct DescribeArgs {
    /// The coordinator's HOST:PORT, or its replicas' as a comma-separated list.
    #[arg(long, value_name = "HOST:PORT[,HOST:PORT...]")]
    pub coordinator: String,
    /// The job to describe.
    pub job_id: String,
    /// Redraw every SECONDS (default 2) until the job is over or Ctrl-C. Give the job first
    /// (`describe JOB --watch`) or the interval with `=` (`--watch=5 JOB`).
    #[arg(
        long,
        value_name = "SECONDS",
        num_args = 0..=1,
        default_missing_value = "2",
        value_parser = watch_interval
    )]
    pub watch: Option<Duration>,
    /// Print the DescribeJob reply as JSON instead, one line per refresh, in proto3's JSON
    /// mapping as grpcurl prints it (zero values left out; ranks always shown).
    #[arg(long)]
    pub json: bool,
    /// Also read every rank's stack (each node's agent reads its workers from outside, no
    /// code change needed) and print them grouped: each distinct stack once with its ranks,
    /// the ranks elsewhere than the waiting majority first. With --json, the DumpStacks reply.
    #[arg(long)]
    pub stacks: bool,
    /// With --stacks: every frame, library frames not folded.
    #[arg(long, requires = "stacks")]
    pub full: bool,
    /// With --stacks: merge native frames (C, C++, Rust) into the Python ranks' stacks. Each
    /// agent pauses each worker for about a millisecond to read them; the first such read of
    /// a worker parses its libraries (about a second for a torch worker). Workers that are not
    /// Python always show their native stacks.
    #[arg(long, requires = "stacks")]
    pub native: bool,
    /// TLS and the cluster token.
    #[command(flatten)]
    pub security: SecurityArgs,
}

/// `--watch`'s value: seconds, at least 0.1 (a tighter loop only loads the coordinator).
pub(crate) fn watch_interval(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("'{s}' is not a number of seconds (as 2 or 0.5)"))?;
    if !secs.is_finite() || !(0.1..=86_400.0).contains(&secs) {
        return Err(format!("'{s}' is out of range: 0.1 to 86400 seconds"));
    }
    Ok(Duration::from_secs_f64(secs))
}
