//! The command line: clap definitions, and their validation into a [`LaunchSpec`] before
//! anything is started. Every problem found here is a [`UsageError`]: one line, exit status 2.

use crate::program::{Program, ProgramError};
use clap::{Args, Parser, Subcommand};
use muster_coordinator::model::{self, JobId};
use std::ffi::{OsStr, OsString};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// `muster-agent`: one per machine; joins a job's rendezvous and runs the machine's workers.
#[derive(Debug, Parser)]
#[command(name = "muster-agent", version, about, long_about = None)]
pub struct Cli {
    /// What to do.
    #[command(subcommand)]
    pub command: Command,
}

/// The agent's subcommands.
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Join a job's rendezvous and run this node's workers until they finish.
    Launch(LaunchArgs),
}

/// `muster-agent launch`: the flags follow torchrun's where torchrun has one.
#[derive(Debug, Args)]
pub struct LaunchArgs {
    /// Workers to run on this node.
    #[arg(long, value_name = "N", alias = "nproc_per_node")]
    pub nproc_per_node: u32,

    /// The coordinator's HOST:PORT. Without it the agent runs a coordinator of its own on
    /// 127.0.0.1 (single-node jobs).
    #[arg(long, value_name = "HOST:PORT")]
    pub coordinator: Option<String>,

    /// The job id (1 to 128 characters of [A-Za-z0-9._-]). Every node of a job gives the same
    /// one. Default: a fresh id (single-node jobs only).
    #[arg(long, value_name = "ID", alias = "job_id")]
    pub job_id: Option<String>,

    /// How many nodes the job has: MIN or MIN:MAX.
    #[arg(long, value_name = "MIN[:MAX]", default_value = "1:1")]
    pub nnodes: String,

    /// The node rank this node asks for. Default: any free one.
    #[arg(long, value_name = "R", alias = "node_rank")]
    pub node_rank: Option<u32>,

    /// The address other nodes reach this node at (MASTER_ADDR when it is node 0). Default:
    /// the host name (127.0.0.1 with the embedded coordinator).
    #[arg(long, value_name = "HOST")]
    pub host: Option<String>,

    /// How long workers get between SIGTERM and SIGKILL when they are stopped.
    #[arg(
        long,
        value_name = "MS",
        default_value_t = 5000,
        alias = "grace_period_ms"
    )]
    pub grace_period_ms: u64,

    /// Restarts allowed after a failure (only 0 for now).
    #[arg(long, value_name = "N", default_value_t = 0, alias = "max_restarts")]
    pub max_restarts: u32,

    /// Do not run the node relay. By default the agent relays its workers' barriers: they send
    /// them over a local Unix socket (MUSTER_AGENT_SOCKET), node barriers complete in the agent
    /// and each global barrier costs the coordinator one message per node. With this flag each
    /// worker sends its barriers over its own coordinator session (slower; for comparison and
    /// debugging).
    #[arg(long)]
    pub no_relay: bool,

    /// The program to run and its arguments, after `--`.
    #[arg(value_name = "PROGRAM", trailing_var_arg = true)]
    pub command: Vec<OsString>,
}

/// A node count range from `--nnodes`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeRange {
    /// Fewest nodes the rendezvous may close with.
    pub min: u32,
    /// Most nodes the rendezvous takes.
    pub max: u32,
}

/// Everything `launch` needs, validated: nothing in here can be wrong in a way the agent
/// could have found out before starting.
#[derive(Debug, Clone)]
pub struct LaunchSpec {
    /// Workers on this node (1 to 4096).
    pub nproc_per_node: u32,
    /// An external coordinator's `host:port`; `None` runs the embedded one.
    pub coordinator: Option<String>,
    /// The job id (valid for the coordinator).
    pub job_id: String,
    /// `--nnodes`.
    pub nodes: NodeRange,
    /// `--node-rank`, below `nodes.max`.
    pub node_rank: Option<u32>,
    /// `--host`.
    pub host: Option<String>,
    /// SIGTERM-to-SIGKILL grace period for stopping workers.
    pub grace_period: Duration,
    /// `--max-restarts` (always 0 for now).
    pub max_restarts: u32,
    /// Whether to run the node relay (not `--no-relay`).
    pub relay: bool,
    /// The worker program, resolved on `PATH`.
    pub program: Program,
}

/// A problem with the command line; the agent prints `muster-agent: <problem>` and exits 2.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum UsageError {
    /// Clap could not parse the arguments (its message, first line only).
    #[error("{0} (see `muster-agent launch --help`)")]
    Parse(String),
    /// Nothing after `--`.
    #[error(
        "no program to launch: give it after `--`, as in `muster-agent launch --nproc-per-node 2 -- python3 train.py`"
    )]
    NoProgram,
    /// The program cannot be run.
    #[error(transparent)]
    Program(#[from] ProgramError),
    /// `--nproc-per-node` is 0 or too large.
    #[error("--nproc-per-node {0} is out of range 1..={max}", max = model::MAX_LOCAL_WORLD_SIZE)]
    NprocPerNode(u32),
    /// `--nnodes` does not parse or makes no sense.
    #[error("--nnodes '{0}' is malformed: {1}")]
    Nnodes(String, &'static str),
    /// `--node-rank` is not below the most nodes the job can have.
    #[error(
        "--node-rank {rank} is out of range for --nnodes {min}:{max} (node ranks are 0..{max})"
    )]
    NodeRank {
        /// The requested rank.
        rank: u32,
        /// `--nnodes` minimum.
        min: u32,
        /// `--nnodes` maximum.
        max: u32,
    },
    /// `--max-restarts` above 0.
    #[error("--max-restarts > 0 is not supported yet")]
    MaxRestarts,
    /// `--job-id` is not a valid job id.
    #[error("--job-id: {0}")]
    JobId(String),
    /// `--coordinator` is not `host:port`.
    #[error("--coordinator '{0}' is malformed: expected HOST:PORT, as in 10.0.0.1:29470")]
    Coordinator(String),
    /// `--host` is not a valid host.
    #[error("--host: {0}")]
    Host(String),
    /// A multi-node job needs what only the user can give.
    #[error("--nnodes {0}:{1} needs {2}: every node must name the same one")]
    MultiNode(u32, u32, &'static str),
}

/// What the command line asks for.
#[derive(Debug)]
pub enum Parsed {
    /// Launch a job.
    Launch(LaunchSpec),
    /// Help or version was asked for (and printed); exit with this status.
    Exit(i32),
}

/// Parses and validates the command line (`args` includes the program name) against the
/// `PATH` given. Help and version requests are printed here.
pub fn parse<I, T>(args: I, path_var: Option<&OsStr>) -> Result<Parsed, UsageError>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString> + Clone,
{
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => {
            use clap::error::ErrorKind;
            return match e.kind() {
                ErrorKind::DisplayHelp
                | ErrorKind::DisplayVersion
                | ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand => {
                    let code = e.exit_code();
                    // Nothing useful to do when stdout is gone.
                    let _ = e.print();
                    Ok(Parsed::Exit(code))
                }
                _ => Err(UsageError::Parse(first_line(&e.to_string()))),
            };
        }
    };
    match cli.command {
        Command::Launch(args) => args.validate(path_var).map(Parsed::Launch),
    }
}

/// Clap's message on one line, without the `error: ` label, the usage block and the help
/// hint; a first line ending in `:` keeps the indented lines that complete it.
fn first_line(message: &str) -> String {
    let mut lines = message.lines();
    let first = lines.next().unwrap_or_default();
    let mut line = first
        .strip_prefix("error: ")
        .unwrap_or(first)
        .trim()
        .to_owned();
    if line.ends_with(':') {
        let more: Vec<&str> = lines
            .take_while(|l| l.starts_with(char::is_whitespace) && !l.trim().is_empty())
            .map(str::trim)
            .collect();
        line = format!("{line} {}", more.join(", "));
    }
    line
}

impl LaunchArgs {
    /// Checks everything that can be checked before starting: ranges, formats, and that the
    /// program resolves on `path_var` to an executable file.
    pub fn validate(self, path_var: Option<&OsStr>) -> Result<LaunchSpec, UsageError> {
        if self.nproc_per_node == 0 || self.nproc_per_node > model::MAX_LOCAL_WORLD_SIZE {
            return Err(UsageError::NprocPerNode(self.nproc_per_node));
        }
        let nodes = parse_nnodes(&self.nnodes)?;
        if let Some(rank) = self.node_rank
            && rank >= nodes.max
        {
            return Err(UsageError::NodeRank {
                rank,
                min: nodes.min,
                max: nodes.max,
            });
        }
        if self.max_restarts > 0 {
            return Err(UsageError::MaxRestarts);
        }
        if let Some(c) = &self.coordinator
            && !is_host_port(c)
        {
            return Err(UsageError::Coordinator(c.clone()));
        }
        if let Some(h) = &self.host {
            model::host("host", h).map_err(|e| UsageError::Host(e.0))?;
        }
        if nodes.max > 1 {
            if self.coordinator.is_none() {
                return Err(UsageError::MultiNode(nodes.min, nodes.max, "--coordinator"));
            }
            if self.job_id.is_none() {
                return Err(UsageError::MultiNode(nodes.min, nodes.max, "--job-id"));
            }
        }
        let job_id = match self.job_id {
            Some(id) => JobId::parse(&id)
                .map_err(|e| UsageError::JobId(e.0))?
                .as_str()
                .to_owned(),
            None => fresh_job_id(),
        };
        let mut command = self.command.into_iter();
        let name = command.next().ok_or(UsageError::NoProgram)?;
        let program = Program::resolve(name, command.collect(), path_var)?;
        Ok(LaunchSpec {
            nproc_per_node: self.nproc_per_node,
            coordinator: self.coordinator,
            job_id,
            nodes,
            node_rank: self.node_rank,
            host: self.host,
            grace_period: Duration::from_millis(self.grace_period_ms),
            max_restarts: self.max_restarts,
            relay: !self.no_relay,
            program,
        })
    }
}

/// Parses `MIN` or `MIN:MAX` with `1 <= MIN <= MAX <= MAX_NODES`.
pub fn parse_nnodes(s: &str) -> Result<NodeRange, UsageError> {
    let bad = |why| UsageError::Nnodes(s.to_owned(), why);
    let number = |part: &str| {
        part.trim()
            .parse::<u32>()
            .map_err(|_| bad("expected MIN or MIN:MAX, as in 2 or 1:4"))
    };
    let (min, max) = match s.split_once(':') {
        Some((min, max)) => (number(min)?, number(max)?),
        None => {
            let n = number(s)?;
            (n, n)
        }
    };
    if min == 0 {
        return Err(bad("a job needs at least 1 node"));
    }
    if max < min {
        return Err(bad("MAX is below MIN"));
    }
    if max > model::MAX_NODES {
        return Err(bad("more nodes than the coordinator allows (100000)"));
    }
    Ok(NodeRange { min, max })
}

/// `host:port` with a non-empty host and a port in 1..=65535 (`[v6]:port` included).
fn is_host_port(s: &str) -> bool {
    let Some((host, port)) = s.rsplit_once(':') else {
        return false;
    };
    let host_ok = !host.is_empty()
        && !host.contains('/')
        && (!host.contains(':') || (host.starts_with('[') && host.ends_with(']')));
    host_ok && matches!(port.parse::<u16>(), Ok(p) if p > 0)
}

/// A job id that no other launch on this machine uses: `job-<pid>-<unix millis>`.
fn fresh_job_id() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    format!("job-{}-{millis}", std::process::id())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Parses `args` (after `muster-agent launch`) with `PATH=/usr/bin:/bin` and compares the
    /// outcome: `Ok(summary)` of the spec, or `Err(message)`.
    fn check(args: &str, expected: Result<&str, &str>) {
        let argv = ["muster-agent", "launch"]
            .into_iter()
            .map(str::to_owned)
            .chain(args.split_whitespace().map(str::to_owned));
        let got = match parse(argv, Some(OsStr::new("/usr/bin:/bin"))) {
            Ok(Parsed::Launch(s)) => Ok(format!(
                "n={} nodes={}:{} rank={:?} coord={:?} job={} grace={}ms relay={} prog={} args={:?}",
                s.nproc_per_node,
                s.nodes.min,
                s.nodes.max,
                s.node_rank,
                s.coordinator,
                if s.job_id.starts_with("job-") {
                    "<fresh>"
                } else {
                    &s.job_id
                },
                s.grace_period.as_millis(),
                s.relay,
                s.program.name.to_string_lossy(),
                s.program.args,
            )),
            Ok(Parsed::Exit(code)) => Ok(format!("exit {code}")),
            Err(e) => Err(e.to_string()),
        };
        let got = got.as_deref().map_err(String::as_str);
        assert_eq!(got, expected, "muster-agent launch {args}");
    }

    #[test]
    fn valid_command_lines() {
        check(
            "--nproc-per-node 4 -- sh -c true",
            Ok(
                r#"n=4 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=["-c", "true"]"#,
            ),
        );
        check(
            "--nproc_per_node=2 --grace-period-ms 10 --job-id a.b-c_1 sh",
            Ok(
                r#"n=2 nodes=1:1 rank=None coord=None job=a.b-c_1 grace=10ms relay=true prog=sh args=[]"#,
            ),
        );
        check(
            "--nproc-per-node 1 --nnodes 2:4 --node-rank 3 --coordinator 10.0.0.1:29470 --job-id j -- sh -x --flag",
            Ok(
                r#"n=1 nodes=2:4 rank=Some(3) coord=Some("10.0.0.1:29470") job=j grace=5000ms relay=true prog=sh args=["-x", "--flag"]"#,
            ),
        );
        check(
            "--nproc-per-node 1 --nnodes 2 --coordinator [::1]:1 --job-id j -- /bin/sh",
            Ok(
                r#"n=1 nodes=2:2 rank=None coord=Some("[::1]:1") job=j grace=5000ms relay=true prog=/bin/sh args=[]"#,
            ),
        );
        check(
            "--nproc-per-node 1 --max-restarts 0 -- sh",
            Ok(
                r#"n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]"#,
            ),
        );
        check(
            "--nproc-per-node 1 --no-relay -- sh",
            Ok(
                r#"n=1 nodes=1:1 rank=None coord=None job=<fresh> grace=5000ms relay=false prog=sh args=[]"#,
            ),
        );
        check(
            "--nproc-per-node 1 --node-rank 0 -- sh",
            Ok(
                r#"n=1 nodes=1:1 rank=Some(0) coord=None job=<fresh> grace=5000ms relay=true prog=sh args=[]"#,
            ),
        );
    }

    #[test]
    fn invalid_command_lines() {
        check(
            "--nproc-per-node 2 --",
            Err(
                "no program to launch: give it after `--`, as in `muster-agent launch --nproc-per-node 2 -- python3 train.py`",
            ),
        );
        check(
            "--nproc-per-node 2",
            Err(
                "no program to launch: give it after `--`, as in `muster-agent launch --nproc-per-node 2 -- python3 train.py`",
            ),
        );
        check(
            "--nproc-per-node 0 -- sh",
            Err("--nproc-per-node 0 is out of range 1..=4096"),
        );
        check(
            "--nproc-per-node 4097 -- sh",
            Err("--nproc-per-node 4097 is out of range 1..=4096"),
        );
        check(
            "--nproc-per-node x -- sh",
            Err(
                "invalid value 'x' for '--nproc-per-node <N>': invalid digit found in string (see `muster-agent launch --help`)",
            ),
        );
        check(
            "-- sh",
            Err(
                "the following required arguments were not provided: --nproc-per-node <N> (see `muster-agent launch --help`)",
            ),
        );
        check(
            "--nproc-per-node 1 -- no-such-program-muster-test",
            Err("program 'no-such-program-muster-test' was not found in PATH"),
        );
        check(
            "--nproc-per-node 1 -- /no/such/program",
            Err("program '/no/such/program' does not exist"),
        );
        check(
            "--nproc-per-node 1 -- /etc/passwd",
            Err("program '/etc/passwd' is not executable"),
        );
        check("--nproc-per-node 1 -- /", Err("program '/' is a directory"));
        for bad in ["0", "0:2", "2:1", "a", "1:", ":2", "1:2:3", "100001"] {
            let Err(err) = parse_nnodes(bad) else {
                panic!("--nnodes {bad} was accepted");
            };
            check(
                &format!("--nproc-per-node 1 --nnodes {bad} -- sh"),
                Err(&err.to_string()),
            );
        }
        check(
            "--nproc-per-node 1 --nnodes 0 -- sh",
            Err("--nnodes '0' is malformed: a job needs at least 1 node"),
        );
        check(
            "--nproc-per-node 1 --nnodes 2:1 -- sh",
            Err("--nnodes '2:1' is malformed: MAX is below MIN"),
        );
        check(
            "--nproc-per-node 1 --nnodes 1:x -- sh",
            Err("--nnodes '1:x' is malformed: expected MIN or MIN:MAX, as in 2 or 1:4"),
        );
        check(
            "--nproc-per-node 1 --node-rank 1 -- sh",
            Err("--node-rank 1 is out of range for --nnodes 1:1 (node ranks are 0..1)"),
        );
        check(
            "--nproc-per-node 1 --nnodes 2:3 --node-rank 3 --coordinator h:1 --job-id j -- sh",
            Err("--node-rank 3 is out of range for --nnodes 2:3 (node ranks are 0..3)"),
        );
        check(
            "--nproc-per-node 1 --max-restarts 1 -- sh",
            Err("--max-restarts > 0 is not supported yet"),
        );
        check(
            "--nproc-per-node 1 --job-id a/b -- sh",
            Err(
                r#"--job-id: job_id "a/b" contains '/'; allowed are letters, digits, '.', '_', '-'"#,
            ),
        );
        for bad in [
            "host",
            "host:",
            ":1",
            "host:0",
            "host:70000",
            "http://h:1",
            "::1:5",
        ] {
            check(
                &format!("--nproc-per-node 1 --coordinator {bad} -- sh"),
                Err(&format!(
                    "--coordinator '{bad}' is malformed: expected HOST:PORT, as in 10.0.0.1:29470"
                )),
            );
        }
        check(
            "--nproc-per-node 1 --nnodes 2 -- sh",
            Err("--nnodes 2:2 needs --coordinator: every node must name the same one"),
        );
        check(
            "--nproc-per-node 1 --nnodes 1:2 --coordinator h:1 -- sh",
            Err("--nnodes 1:2 needs --job-id: every node must name the same one"),
        );
        check(
            "--nproc-per-node 1 --bogus -- sh",
            Err("unexpected argument '--bogus' found (see `muster-agent launch --help`)"),
        );
    }
}
