//! Overhead of security and tracing on barrier latency: the `barrier_loop` example on two
//! `muster-agent launch` nodes against a separate `muster-coordinator` process on 127.0.0.1,
//! plaintext against mutual TLS + the cluster token (a throwaway PKI from
//! `muster_tests::pki`), and plaintext with an OTLP exporter configured (the coordinator and
//! the agents export to a receiver this program runs, which counts the spans it gets). Each
//! process count runs with the node relay (one coordinator message per node and barrier) and
//! with `--no-relay` (every worker's barriers on its own gRPC session). Runs alternate between
//! the modes; every figure is a median over rounds.
//!
//! Needs release builds (`cargo build --release -p muster-agent -p muster-coordinator
//! -p muster-bench --bin security` and `cargo build --release -p muster --examples`).
//!
//! `target/release/security [--procs 8,32] [--rounds 5] [--iters 300]`

use anyhow::Context;
use clap::Parser;
use muster_bench::{CoordinatorProcess, bin_dir, quantile, rank0_latency, wait_output};
use muster_tests::pki::Pki;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[derive(Parser)]
struct Args {
    /// Total worker counts (split evenly over the two nodes).
    #[arg(long, value_delimiter = ',', default_value = "8,32")]
    procs: Vec<u32>,
    /// Rounds (each runs every mode once); medians are over rounds.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Timed barriers per run.
    #[arg(long, default_value_t = 300)]
    iters: u32,
    /// Untimed barriers before them.
    #[arg(long, default_value_t = 20)]
    warmup: u32,
    /// How long one run may take before it counts as hung.
    #[arg(long, default_value_t = 120)]
    run_timeout_s: u64,
}

/// The OpenTelemetry variables that would turn export on (or off) behind the benchmark's back.
const OTEL_VARS: [&str; 4] = [
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
];

#[derive(Clone, Copy, PartialEq, Eq)]
enum Mode {
    /// Plaintext, no token, no exporter.
    Plain,
    /// Mutual TLS and the cluster token (job tokens for the workers).
    Secure,
    /// Plaintext, with the coordinator and agents exporting spans over OTLP/gRPC.
    Traced,
}

const MODES: [Mode; 3] = [Mode::Plain, Mode::Secure, Mode::Traced];

/// An OTLP trace receiver that counts the spans it gets.
#[derive(Clone, Default)]
struct Receiver(Arc<AtomicU64>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let spans: usize = request
            .into_inner()
            .resource_spans
            .iter()
            .flat_map(|r| &r.scope_spans)
            .map(|s| s.spans.len())
            .sum();
        self.0.fetch_add(spans as u64, Ordering::Relaxed);
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

struct Bench {
    args: Args,
    agent: PathBuf,
    barrier_loop: PathBuf,
    pki: Pki,
    /// The receiver's `http://127.0.0.1:PORT`.
    endpoint: String,
    spans: Arc<AtomicU64>,
}

/// One run's result: rank 0's p50 and p99 (us), and the spans the receiver got during it.
struct Sample {
    p50: f64,
    p99: f64,
    spans: u64,
}

impl Bench {
    fn client_flags(&self) -> Vec<OsString> {
        vec![
            "--tls-ca".into(),
            self.pki.ca.clone().into(),
            "--tls-cert".into(),
            self.pki.client_cert.clone().into(),
            "--tls-key".into(),
            self.pki.client_key.clone().into(),
            "--auth-token-file".into(),
            self.pki.token_file.clone().into(),
        ]
    }

    /// Sets or clears the exporter's environment of `cmd` for `mode`.
    fn otel_env(&self, cmd: &mut Command, mode: Mode) {
        for var in OTEL_VARS {
            cmd.env_remove(var);
        }
        if mode == Mode::Traced {
            // A short batch delay, so that export happens while the barriers run rather than
            // after them (the default is 5 s, longer than a run).
            cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", &self.endpoint)
                .env("OTEL_BSP_SCHEDULE_DELAY", "200");
        }
    }

    /// One job of `procs` workers on two nodes against a fresh coordinator.
    fn run(&self, procs: u32, relay: bool, mode: Mode, job: &str) -> anyhow::Result<Sample> {
        let spans_before = self.spans.load(Ordering::Relaxed);
        let coordinator = CoordinatorProcess::start_with(|cmd| {
            self.otel_env(cmd, mode);
            if mode == Mode::Secure {
                cmd.arg("--tls-cert")
                    .arg(&self.pki.server_cert)
                    .arg("--tls-key")
                    .arg(&self.pki.server_key)
                    .arg("--tls-client-ca")
                    .arg(&self.pki.ca)
                    .arg("--auth-token-file")
                    .arg(&self.pki.token_file);
            }
        })?;
        let addr = coordinator.addr.to_string();
        let per_node = (procs / 2).to_string();
        let mut pids = vec![];
        let (tx, rx) = std::sync::mpsc::channel();
        for node in 0..2 {
            let mut cmd = Command::new(&self.agent);
            cmd.args(["launch", "--coordinator", &addr, "--job-id", job])
                .args(["--nnodes", "2", "--node-rank", &node.to_string()])
                .args(["--nproc-per-node", &per_node]);
            if !relay {
                cmd.arg("--no-relay");
            }
            if mode == Mode::Secure {
                cmd.args(self.client_flags());
            }
            self.otel_env(&mut cmd, mode);
            cmd.arg("--")
                .arg(&self.barrier_loop)
                .args(["--iters", &self.args.iters.to_string()])
                .args(["--warmup", &self.args.warmup.to_string()])
                .stdin(Stdio::null())
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            let child = cmd.spawn().context("starting muster-agent")?;
            pids.push(child.id());
            let tx = tx.clone();
            std::thread::spawn(move || {
                let _ = tx.send(wait_output(child, &format!("muster-agent node {node}")));
            });
        }
        let mut out = String::new();
        for _ in 0..2 {
            match rx.recv_timeout(Duration::from_secs(self.args.run_timeout_s)) {
                Ok(result) => out += &result?,
                Err(_) => {
                    for pid in &pids {
                        let _ = Command::new("kill")
                            .args(["-KILL", &pid.to_string()])
                            .status();
                    }
                    anyhow::bail!("{job}: the agents ran past {}s", self.args.run_timeout_s);
                }
            }
        }
        // SIGTERM, so that a traced coordinator flushes its last batch.
        coordinator.stop(Duration::from_secs(5));
        let (p50, p99) = rank0_latency(&out).with_context(|| job.to_owned())?;
        Ok(Sample {
            p50,
            p99,
            spans: self.spans.load(Ordering::Relaxed) - spans_before,
        })
    }
}

fn median(xs: &[f64]) -> f64 {
    quantile(&mut xs.to_vec(), 0.5)
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    anyhow::ensure!(
        args.procs.iter().all(|&n| n >= 2 && n % 2 == 0),
        "--procs: every count must be even (two nodes)"
    );
    let bins = bin_dir();
    let agent = bins.join("muster-agent");
    let barrier_loop = bins.join("examples/barrier_loop");
    for p in [&agent, &barrier_loop, &bins.join("muster-coordinator")] {
        anyhow::ensure!(
            p.exists(),
            "missing {}: build with --release first",
            p.display()
        );
    }
    let dir = std::env::temp_dir().join(format!("muster-security-bench-{}", std::process::id()));
    let pki = Pki::generate(&dir, &[]);

    // The OTLP receiver, on a small runtime of its own.
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()?;
    let receiver = Receiver::default();
    let spans = receiver.0.clone();
    let listener = runtime.block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))?;
    let endpoint = format!("http://{}", listener.local_addr()?);
    runtime.spawn(
        tonic::transport::Server::builder()
            .add_service(TraceServiceServer::new(receiver))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener)),
    );

    let bench = Bench {
        args,
        agent,
        barrier_loop,
        pki,
        endpoint,
        spans,
    };
    let args = &bench.args;
    println!(
        "## Security and tracing overhead (rank 0's p50/p99 over {} barriers after {} warm-up; 2 nodes; median of {} rounds)\n",
        args.iters, args.warmup, args.rounds
    );
    let mut tls_rows = vec![];
    let mut trace_rows = vec![];
    for &procs in &args.procs {
        for relay in [true, false] {
            let topology = if relay { "relay" } else { "--no-relay" };
            // [mode][round]
            let mut samples: [Vec<Sample>; 3] = [vec![], vec![], vec![]];
            for round in 0..args.rounds {
                // Rotate the order so that no mode always runs first (or after another).
                for k in 0..MODES.len() {
                    let m = (round + k) % MODES.len();
                    let job = format!("sec-{procs}-{}-{m}-{round}", u8::from(relay));
                    let s = bench.run(procs, relay, MODES[m], &job)?;
                    eprintln!(
                        "{procs} {topology} mode {m} round {round}: p50 {:.0} us p99 {:.0} us, {} spans",
                        s.p50, s.p99, s.spans
                    );
                    samples[m].push(s);
                }
            }
            let p50 = |m: usize| median(&samples[m].iter().map(|s| s.p50).collect::<Vec<_>>());
            let p99 = |m: usize| median(&samples[m].iter().map(|s| s.p99).collect::<Vec<_>>());
            let spans = median(
                &samples[2]
                    .iter()
                    .map(|s| s.spans as f64)
                    .collect::<Vec<_>>(),
            );
            let plain_spans = samples[0].iter().map(|s| s.spans).sum::<u64>();
            anyhow::ensure!(plain_spans == 0, "spans arrived from untraced runs");
            tls_rows.push(format!(
                "| {procs} | {topology} | {:.0} us | {:.0} us | {:.0} us | {:.0} us | {:.2}x | {:.2}x |",
                p50(0),
                p99(0),
                p50(1),
                p99(1),
                p50(1) / p50(0),
                p99(1) / p99(0),
            ));
            trace_rows.push(format!(
                "| {procs} | {topology} | {:.0} us | {:.0} us | {:.0} us | {:.0} us | {:.2}x | {:.2}x | {spans:.0} |",
                p50(0),
                p99(0),
                p50(2),
                p99(2),
                p50(2) / p50(0),
                p99(2) / p99(0),
            ));
        }
    }
    println!("### Mutual TLS + cluster token against plaintext\n");
    println!(
        "| processes | path | plaintext p50 | plaintext p99 | TLS+auth p50 | TLS+auth p99 | p50 ratio | p99 ratio |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- |");
    for row in &tls_rows {
        println!("{row}");
    }
    println!("\n### OTLP trace export (plaintext) against none\n");
    println!(
        "| processes | path | no exporter p50 | no exporter p99 | exporter p50 | exporter p99 | p50 ratio | p99 ratio | spans received per run |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- | --- | --- |");
    for row in &trace_rows {
        println!("{row}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
