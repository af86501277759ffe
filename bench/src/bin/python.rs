//! The Python SDK's benchmark, side by side in one run (issue 16): `wait_for_everyone` p50 at
//! 2 and 8 processes against the Rust SDK's `barrier_loop` (goal <= 1.3x) and against torch's
//! TCPStore and gloo barriers (goal <= 0.3x TCPStore at 8); an in-place all_reduce of a 64 MiB
//! float32 CPU buffer on 2 processes against gloo (goal >= 3x speed); `init_process_group`
//! through `muster.torch` against `env://` at 8 processes (goal <= 1x; the worker's connection
//! is made by `import muster`, before the call, and a column times it made in the call, with
//! `MUSTER_EARLY_CONNECT=0`, as before 2026-11-30), with two peers: torchrun
//! (`env://` on the TCPStore its agent hosts, listening before the workers start) and rank 0's
//! own TCPStore under `muster-agent launch --no-agent-store` (the clients that connect before
//! rank 0 listens back off and retry, so its times are bimodal; the runs that took over 300 ms
//! are counted). Muster and the peers alternate round by round; figures are medians over rounds.
//!
//! Needs release builds (`cargo build --release -p muster-agent -p muster-bench --bins` and
//! `cargo build --release -p muster --examples`) and the `muster` package in the peers' venv
//! (`scripts/test-python.sh` installs it).
//!
//! `target/release/python [--rounds 3] [--init-rounds 7] [--iters 300] [--only init]`

use anyhow::Context;
use clap::Parser;
use muster_bench::{
    GLOO_ALLREDUCE_SCRIPT, allreduce_p50_us, bin_dir, field, free_port, load_average, peers_venv,
    quantile, rank0_latency, run_output, torch_barrier_latency,
};
use std::path::{Path, PathBuf};
use std::process::Command;

#[derive(Parser)]
struct Args {
    /// Rounds per comparison; medians are over rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Rounds of the `init_process_group` comparison (each call is one sample, and rank 0's
    /// TCPStore is bimodal).
    #[arg(long, default_value_t = 7)]
    init_rounds: usize,
    /// Timed barriers per run.
    #[arg(long, default_value_t = 300)]
    iters: u32,
    /// Runs only this comparison: `barrier`, `allreduce` or `init`.
    #[arg(long, value_parser = ["barrier", "allreduce", "init"])]
    only: Option<String>,
    /// The peers' venv (with the muster package installed).
    #[arg(long, env = "MUSTER_PEERS_VENV")]
    venv: Option<PathBuf>,
    /// The shared/ folder beside the checkout (for `peers/torch_peer.py`).
    #[arg(long, default_value = concat!(env!("CARGO_MANIFEST_DIR"), "/../../shared"))]
    shared: PathBuf,
}

/// What the runs need.
struct Setup {
    agent: PathBuf,
    python: PathBuf,
    torchrun: PathBuf,
    sdk_bench: PathBuf,
    init_pg: PathBuf,
    barrier_loop: PathBuf,
    torch_peer: PathBuf,
    dir: PathBuf,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let venv = peers_venv(args.venv.clone());
    let bins = bin_dir();
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let setup = Setup {
        agent: bins.join("muster-agent"),
        python: venv.join("bin/python3"),
        torchrun: venv.join("bin/torchrun"),
        sdk_bench: here.join("sdk_bench.py"),
        init_pg: here.join("init_pg.py"),
        barrier_loop: bins.join("examples/barrier_loop"),
        torch_peer: args.shared.join("peers/torch_peer.py"),
        dir: std::env::temp_dir().join(format!("muster-python-bench-{}", std::process::id())),
    };
    let wanted = |part: &str| args.only.as_deref().is_none_or(|only| only == part);
    let mut needed = vec![&setup.agent, &setup.torchrun];
    if wanted("barrier") {
        needed.push(&setup.barrier_loop);
    }
    for p in needed {
        anyhow::ensure!(
            p.exists(),
            "missing {}: see this program's header",
            p.display()
        );
    }
    let imports = Command::new(&setup.python)
        .args(["-c", "import muster, numpy, torch"])
        .status()?;
    anyhow::ensure!(
        imports.success(),
        "the peers' venv lacks muster, numpy or torch: run scripts/test-python.sh"
    );
    std::fs::create_dir_all(&setup.dir)?;
    println!("## Python SDK (medians over {} rounds)\n", args.rounds);
    println!("load at start: {}\n", load_average());
    if wanted("barrier") {
        barrier_table(&setup, &args)?;
    }
    if wanted("allreduce") {
        allreduce_table(&setup, args.rounds)?;
    }
    if wanted("init") {
        init_table(&setup, args.init_rounds)?;
    }
    println!("\nload at end: {}", load_average());
    let _ = std::fs::remove_dir_all(&setup.dir);
    Ok(())
}

/// `wait_for_everyone` at 2 and 8 processes against the Rust SDK and torch's barriers.
fn barrier_table(setup: &Setup, args: &Args) -> anyhow::Result<()> {
    println!(
        "| processes | Python `wait_for_everyone` p50 | Rust `barrier_loop` p50 | TCPStore barrier p50 | gloo barrier p50 | Python / Rust (goal <= 1.3x) | Python / TCPStore (goal <= 0.3x at 8) |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for n in [2u32, 8] {
        let (mut py, mut rs, mut st, mut gl) = (vec![], vec![], vec![], vec![]);
        for round in 0..args.rounds {
            eprintln!("barrier n={n} round {}/{}", round + 1, args.rounds);
            py.push(python_barrier(setup, n, args.iters)?);
            rs.push(rust_barrier(setup, n, args.iters)?);
            let (gloo, store) = torch_barrier(setup, n, args.iters)?;
            st.push(store);
            gl.push(gloo);
        }
        let (py, rs, st, gl) = (
            quantile(&mut py, 0.5),
            quantile(&mut rs, 0.5),
            quantile(&mut st, 0.5),
            quantile(&mut gl, 0.5),
        );
        println!(
            "| {n} | {py:.0} us | {rs:.0} us | {st:.0} us | {gl:.0} us | {:.2}x | {:.2}x |",
            py / rs,
            py / st
        );
    }
    Ok(())
}

/// The Python communicator's 64 MiB all_reduce on 2 processes against gloo's.
fn allreduce_table(setup: &Setup, rounds: usize) -> anyhow::Result<()> {
    const SIZE: usize = 64 << 20;
    let (mut m, mut g) = (vec![], vec![]);
    let script = setup.dir.join("allreduce_gloo.py");
    std::fs::write(&script, GLOO_ALLREDUCE_SCRIPT)?;
    for round in 0..rounds {
        eprintln!("all_reduce round {}/{}", round + 1, rounds);
        let (out, _) = run_output(
            Command::new(&setup.agent)
                .args(["launch", "--nproc-per-node", "2", "--"])
                .arg(&setup.python)
                .arg(&setup.sdk_bench)
                .args(["--iters", "10", "--warmup", "2", "--allreduce-mib", "64"]),
        )?;
        m.push(allreduce_p50_us(&out, SIZE).context("no all_reduce line from the Python SDK")?);
        let (out, _) = run_output(
            Command::new(&setup.torchrun)
                .args(["--nproc-per-node", "2", "--master-addr", "127.0.0.1"])
                .args(["--master-port", &free_port()?.to_string()])
                .arg(&script)
                .args(["--sizes", &SIZE.to_string()])
                .args(["--iters", "100", "--bytes-per-size", "536870912"])
                .env("OMP_NUM_THREADS", "1"),
        )?;
        g.push(allreduce_p50_us(&out, SIZE).context("no 64 MiB line from gloo")?);
    }
    let (m, g) = (quantile(&mut m, 0.5), quantile(&mut g, 0.5));
    println!(
        "\n| CPU all_reduce, 64 MiB f32, 2 processes | Python `Communicator` | gloo | speed (goal >= 3x) |"
    );
    println!("| --- | --- | --- | --- |");
    println!(
        "| median time | {:.1} ms | {:.1} ms | {:.2}x |",
        m / 1e3,
        g / 1e3,
        g / m
    );
    Ok(())
}

/// `init_process_group("gloo")` at 8 processes: `muster.torch` under `muster-agent launch`,
/// torchrun's `env://` (its agent's TCPStore), and `env://` on rank 0's own TCPStore under
/// `muster-agent launch --no-agent-store`, alternating round by round.
fn init_table(setup: &Setup, rounds: usize) -> anyhow::Result<()> {
    let (mut mu, mut late, mut tr, mut r0) = (vec![], vec![], vec![], vec![]);
    for round in 0..rounds {
        eprintln!("init_process_group round {}/{rounds}", round + 1);
        mu.push(init_ms(setup, Init::Muster)?);
        late.push(init_ms(setup, Init::MusterConnectingInTheCall)?);
        tr.push(init_ms(setup, Init::Torchrun)?);
        r0.push(init_ms(setup, Init::Rank0)?);
    }
    let list = |xs: &[f64]| {
        xs.iter()
            .map(|x| format!("{x:.0}"))
            .collect::<Vec<_>>()
            .join(", ")
    };
    println!(
        "\nruns (ms, in order): muster.torch {}; connecting in the call {}; torchrun env:// {}; rank 0's TCPStore {}",
        list(&mu),
        list(&late),
        list(&tr),
        list(&r0)
    );
    let retried = r0.iter().filter(|&&x| x > RETRY_MS).count();
    let (mu, late, tr, r0) = (
        quantile(&mut mu, 0.5),
        quantile(&mut late, 0.5),
        quantile(&mut tr, 0.5),
        quantile(&mut r0, 0.5),
    );
    println!(
        "\n| `init_process_group(\"gloo\")`, 8 processes, rank 0's call | `muster.torch` | `muster.torch`, connecting in the call | torchrun `env://` (its agent's TCPStore) | `env://`, rank 0's TCPStore | muster / torchrun (goal <= 1x) | muster / rank 0's TCPStore |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| median of {rounds} | {mu:.1} ms | {late:.1} ms | {tr:.1} ms | {r0:.1} ms ({retried} of {rounds} over {RETRY_MS:.0} ms) | {:.2}x | {:.2}x |",
        mu / tr,
        mu / r0
    );
    Ok(())
}

/// Rank 0's TCPStore runs slower than this waited for a client's connect retry.
const RETRY_MS: f64 = 300.0;

/// Where `init_pg.py` runs.
#[derive(Clone, Copy)]
enum Init {
    /// `muster.torch.init_process_group` under `muster-agent launch` (the connection made by
    /// `import muster`, before the clock starts).
    Muster,
    /// The same with `MUSTER_EARLY_CONNECT=0`: the call makes the connection.
    MusterConnectingInTheCall,
    /// `env://` under torchrun: its agent hosts the TCPStore.
    Torchrun,
    /// `env://` under `muster-agent launch --no-agent-store`: rank 0 hosts the TCPStore.
    Rank0,
}

/// Rank 0's `wait_for_everyone` p50 in microseconds, Python SDK under the agent.
fn python_barrier(s: &Setup, n: u32, iters: u32) -> anyhow::Result<f64> {
    let (out, _) = run_output(
        Command::new(&s.agent)
            .args(["launch", "--nproc-per-node", &n.to_string(), "--"])
            .arg(&s.python)
            .arg(&s.sdk_bench)
            .args(["--iters", &iters.to_string()]),
    )?;
    out.lines()
        .find_map(|l| field(l, "barrier_p50_us="))
        .with_context(|| format!("no barrier_p50_us in {out}"))
}

/// Rank 0's barrier p50 in microseconds, the Rust SDK's `barrier_loop` under the agent.
fn rust_barrier(s: &Setup, n: u32, iters: u32) -> anyhow::Result<f64> {
    let (out, _) = run_output(
        Command::new(&s.agent)
            .args(["launch", "--nproc-per-node", &n.to_string(), "--"])
            .arg(&s.barrier_loop)
            .args(["--iters", &iters.to_string(), "--warmup", "50"]),
    )?;
    Ok(rank0_latency(&out)?.0)
}

/// torch's gloo and TCPStore barrier p50 in microseconds under torchrun.
fn torch_barrier(s: &Setup, n: u32, iters: u32) -> anyhow::Result<(f64, f64)> {
    let (out, _) = run_output(
        Command::new(&s.torchrun)
            .args(["--nproc-per-node", &n.to_string()])
            .arg(&s.torch_peer)
            .args(["--iters", &iters.to_string(), "--sizes", "0.001"])
            .env("OMP_NUM_THREADS", "1"),
    )?;
    let ((gloo, _), (store, _)) = torch_barrier_latency(&out)?;
    Ok((gloo, store))
}

/// Rank 0's `init_process_group` time in milliseconds at 8 processes. The ranks start the call
/// together (`--start-dir`, a file barrier), so that the figure times the store rather than the
/// spread of the interpreters' `import torch`.
fn init_ms(s: &Setup, how: Init) -> anyhow::Result<f64> {
    let start = s.dir.join(format!("init-start-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&start);
    let mut command = match how {
        Init::Torchrun => {
            let mut c = Command::new(&s.torchrun);
            c.args(["--nproc-per-node", "8", "--master-addr", "127.0.0.1"])
                .args(["--master-port", &free_port()?.to_string()]);
            c
        }
        Init::Muster | Init::MusterConnectingInTheCall | Init::Rank0 => {
            let mut c = Command::new(&s.agent);
            if matches!(how, Init::MusterConnectingInTheCall) {
                c.env("MUSTER_EARLY_CONNECT", "0");
            }
            c.args(["launch", "--nproc-per-node", "8"]);
            if matches!(how, Init::Rank0) {
                c.arg("--no-agent-store");
            }
            c.arg("--").arg(&s.python);
            c
        }
    };
    let script_how = if matches!(how, Init::Muster | Init::MusterConnectingInTheCall) {
        "muster"
    } else {
        "env"
    };
    command
        .arg(&s.init_pg)
        .args(["--how", script_how])
        .arg("--start-dir")
        .arg(&start)
        .env("OMP_NUM_THREADS", "1");
    let (out, _) = run_output(&mut command)?;
    let _ = std::fs::remove_dir_all(&start);
    out.lines()
        .find_map(|l| field(l, "init_ms="))
        .with_context(|| format!("no init_ms in {out}"))
}
