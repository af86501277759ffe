//! Fuzz target `agent_flags`: arbitrary argument vectors for `muster-agent`
//! (`muster_agent::cli::parse_in`, what `cli::parse` runs against this process): a
//! subcommand, then tokens drawn from the agent's own flags (every name and alias), typical
//! values, `--flag=value` pairs, free text and bytes that are not UTF-8, against an arbitrary
//! machine (GPUs found or not, a driver seen or not, `CUDA_VISIBLE_DEVICES`, a core count).
//! Usage errors are expected; a panic is a bug.
//!
//! Paths into `/dev`, `/proc` and `/sys` are skipped: `--config-file`, `--auth-token-file` and
//! the TLS flags read the file they name, and `/dev/stdin` or `/dev/zero` would block or grow
//! without end, which is no bug of the parser.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use muster_agent::cli::{Context, parse_in};
use muster_agent::gpu::{Discovery, GpuInfo};
use std::ffi::{OsStr, OsString};
use std::os::unix::ffi::OsStringExt;

const COMMANDS: &[&str] = &["launch", "serve", "submit", "status", "cancel", "help", ""];

/// Every long flag of every subcommand, with their aliases, and the short ones.
const FLAGS: &[&str] = &[
    "--nproc-per-node",
    "--nproc_per_node",
    "--coordinator",
    "--failover-timeout-ms",
    "--failover_timeout_ms",
    "--job-id",
    "--job_id",
    "--nnodes",
    "--node-rank",
    "--node_rank",
    "--advertise-addr",
    "--advertise_addr",
    "--host",
    "--max-restarts",
    "--max_restarts",
    "--grace-period-ms",
    "--grace_period_ms",
    "--no-relay",
    "--metrics-addr",
    "--metrics_addr",
    "--join-timeout-ms",
    "--join_timeout_ms",
    "--last-call-ms",
    "--last_call_ms",
    "--rdzv-conf",
    "--rdzv_conf",
    "--lease-ms",
    "--lease_ms",
    "--monitor-interval",
    "--monitor_interval",
    "--master-addr",
    "--master_addr",
    "--master-port",
    "--master_port",
    "--gpu-ids",
    "--gpu_ids",
    "--gpu-mapping",
    "--gpu_mapping",
    "--log-dir",
    "--log_dir",
    "--local-ranks-filter",
    "--local_ranks_filter",
    "--config-file",
    "--config_file",
    "--num_processes",
    "--num-processes",
    "--num_machines",
    "--num-machines",
    "--machine_rank",
    "--machine-rank",
    "--main_process_ip",
    "--main-process-ip",
    "--main_process_port",
    "--main-process-port",
    "--mixed-precision",
    "--mixed_precision",
    "--cpu",
    "--use_cpu",
    "--use-cpu",
    "--multi_gpu",
    "--multi-gpu",
    "--debug",
    "--enable_cpu_affinity",
    "--labels",
    "--agent-id",
    "--env",
    "--selector",
    "--wait",
    "--reason",
    "--tls-ca",
    "--tls-cert",
    "--tls-key",
    "--tls-domain",
    "--auth-token-file",
    "-m",
    "--module",
    "--no-python",
    "--no_python",
    "--run-path",
    "--run_path",
    "--role",
    "--shutdown-timeout",
    "--shutdown_timeout",
    "--local-addr",
    "--local_addr",
    "--virtual-local-rank",
    "--virtual_local_rank",
    "--start-method",
    "--start_method",
    "--event-log-handler",
    "--event_log_handler",
    "--numa-binding",
    "--numa_binding",
    "--signals-to-handle",
    "--signals_to_handle",
    "--print-completion",
    "--print_completion",
    "--help",
    "--version",
    "-h",
    "-V",
    "--",
];

/// Values the flags above take, valid and almost valid.
const VALUES: &[&str] = &[
    "0",
    "1",
    "2",
    "8",
    "-1",
    "4294967295",
    "4294967296",
    "18446744073709551616",
    "1:4",
    "4:1",
    "0:0",
    ":",
    "1:",
    "gpu",
    "cpu",
    "auto",
    "127.0.0.1:29470",
    "localhost:1",
    "host:99999",
    "a:1,b:2",
    "[::1]:29470",
    "http://127.0.0.1:29470",
    "0.0.0.0:0",
    "0,1",
    "0,0",
    "1,x",
    "GPU-0",
    "0:0,1:1",
    "0-1",
    "a=b",
    "a=",
    "=b",
    "pool=default,zone=a",
    "timeout=5,join_timeout=10,last_call_timeout=0.5",
    "timeout=-1",
    "timeout=nan",
    "timeout=1e400",
    "fp16",
    "bf16",
    "no",
    "fp8",
    "1.5",
    "nan",
    "inf",
    "x",
    "",
    " ",
    "python",
    "/bin/true",
    "missing-program",
    "job",
    "-",
];

#[derive(Arbitrary, Debug)]
enum Token {
    Flag(u8),
    Value(u8),
    Pair(u8, u8),
    PairText(u8, String),
    Text(String),
    Bytes(Vec<u8>),
}

#[derive(Arbitrary, Debug)]
struct Input {
    command: u8,
    tokens: Vec<Token>,
    gpus: u8,
    driver_seen: bool,
    cuda_visible_devices: Option<String>,
    cpus: u8,
}

fn pick<'a>(list: &[&'a str], i: u8) -> &'a str {
    list[usize::from(i) % list.len()]
}

fn unsafe_path(arg: &[u8]) -> bool {
    [
        b"/dev".as_slice(),
        b"/proc",
        b"/sys",
        b"dev/",
        b"proc/",
        b"sys/",
    ]
    .iter()
    .any(|p| arg.windows(p.len()).any(|w| w == *p))
}

fuzz_target!(|input: Input| {
    let mut args: Vec<OsString> = vec!["muster-agent".into()];
    let command = pick(COMMANDS, input.command);
    if !command.is_empty() {
        args.push(command.into());
    }
    for token in input.tokens {
        let arg = match token {
            Token::Flag(i) => pick(FLAGS, i).into(),
            Token::Value(i) => pick(VALUES, i).into(),
            Token::Pair(f, v) => format!("{}={}", pick(FLAGS, f), pick(VALUES, v)).into(),
            Token::PairText(f, v) => format!("{}={v}", pick(FLAGS, f)).into(),
            Token::Text(t) => t.into(),
            Token::Bytes(b) => OsString::from_vec(b),
        };
        if unsafe_path(arg.as_encoded_bytes()) {
            return;
        }
        args.push(arg);
    }
    let gpus = (0..u32::from(input.gpus % 9))
        .map(|index| GpuInfo {
            index,
            name: None,
            uuid: Some(format!("GPU-{index}")),
            bus: None,
        })
        .collect();
    let ctx = Context {
        path_var: Some(OsStr::new("/usr/bin:/bin")),
        gpus: Discovery {
            gpus,
            driver_seen: input.driver_seen,
        },
        cuda_visible_devices: input.cuda_visible_devices,
        // A real machine has at least one core (`Context::of_process`).
        cpus: u32::from(input.cpus).max(1),
        ..Context::default()
    };
    let _ = parse_in(args, &ctx);
});
