//! CPU all_reduce against torch's gloo, in one run: for each process count, muster's
//! `allreduce_bench` example under `muster-agent launch` (the SDK's CPU communicator) and
//! `allreduce_gloo.py` under torchrun (gloo), which measure the same way (f32 sum; per size a
//! checked call, warm-up, then back-to-back calls each timed on its own between two barriers;
//! rank 0's median), plus this machine's single-thread memcpy bandwidth as the yardstick for
//! processes on one machine. Prints, per process count, bus bandwidth (nccl-tests' busbw =
//! algbw x 2(N-1)/N) for both, their ratio and muster's share of memcpy, then the 4-byte
//! latency.
//!
//! Needs release builds: `cargo build --release -p muster-agent -p muster --examples -p
//! muster-bench`, and for the gloo side the peers' venv (`scripts/install-peers.sh`, in
//! `~/.cache/muster-peers`); without it only muster runs.
//!
//! `target/release/allreduce [--procs 2,4,8] [--sizes 4,4096,...] [--iters 100]
//! [--bytes-per-size 536870912] [--rounds 3]` (about 4 minutes on 2 cores)

use anyhow::{Context, bail};
use clap::Parser;
use muster_bench::{GLOO_ALLREDUCE_SCRIPT, bin_dir, free_port, load_average, peers_venv, quantile};
use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::PathBuf;
use std::process::Command;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Process counts (all on this machine).
    #[arg(long, value_delimiter = ',', default_value = "2,4,8")]
    procs: Vec<usize>,
    /// Message sizes in bytes of f32.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "4,4096,65536,1048576,16777216,67108864,268435456"
    )]
    sizes: Vec<usize>,
    /// Most timed iterations per size (small sizes run this many).
    #[arg(long, default_value_t = 100)]
    iters: usize,
    /// Large sizes run clamp(this / size, 3, iters) timed iterations.
    #[arg(long, default_value_t = 512 << 20)]
    bytes_per_size: usize,
    /// Rounds (each runs muster and gloo once per process count); medians are over rounds.
    #[arg(long, default_value_t = 3)]
    rounds: usize,
    /// Timed 256 MiB copies for the memcpy yardstick.
    #[arg(long, default_value_t = 7)]
    memcpy_reps: usize,
    /// A size runs with P processes only when P x size x 4 (the worker's buffer, the
    /// communicator's or gloo's scratch, slack) fits in this share of the available memory.
    #[arg(long, default_value_t = 0.6)]
    mem_share: f64,
    /// The peers' venv.
    #[arg(long, env = "MUSTER_PEERS_VENV")]
    venv: Option<PathBuf>,
}

/// One size's figures from rank 0 (median over rounds where there are several).
#[derive(Clone, Copy, Default)]
struct Figures {
    p50_us: f64,
    busbw_gbs: f64,
}

impl Figures {
    /// nccl-tests' bus bandwidth of an all_reduce of `size` bytes over `procs` ranks taking
    /// `p50_us`: size / time x 2(N-1)/N.
    fn new(size: usize, p50_us: f64, procs: usize) -> Self {
        let algbw = size as f64 / p50_us / 1e3;
        Figures {
            p50_us,
            busbw_gbs: algbw * 2.0 * (procs - 1) as f64 / procs as f64,
        }
    }
}

/// Runs `cmd` to its end: its stdout, or an error with its output.
fn run(cmd: &mut Command) -> anyhow::Result<String> {
    muster_bench::run_output(cmd).map(|(stdout, _)| stdout)
}

/// The number after `key=` in `line`.
fn field(line: &str, key: &str) -> Option<f64> {
    let start = line.find(key)? + key.len();
    let rest = &line[start..];
    let end = rest
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(rest.len());
    rest[..end].parse().ok()
}

/// Rank 0's result lines (the agent prefixes them with `[rank 0] `), by size in bytes, and
/// its peak resident memory in MiB where it says. busbw is computed here from the size and the
/// median time (the printed figure is rounded, which loses the small sizes).
fn parse(
    out: &str,
    what: &str,
    procs: usize,
) -> anyhow::Result<(BTreeMap<usize, Figures>, Option<f64>)> {
    let mut figures = BTreeMap::new();
    let mut rss = None;
    for line in out.lines() {
        let line = line.strip_prefix("[rank 0] ").unwrap_or(line);
        if line.starts_with("peak_rss_mib=") {
            rss = field(line, "peak_rss_mib=");
        }
        if !line.starts_with("size_bytes=") {
            continue;
        }
        let size = field(line, "size_bytes=").context("size_bytes")? as usize;
        let p50_us = field(line, "time_us_p50=").context("time_us_p50")?;
        figures.insert(size, Figures::new(size, p50_us, procs));
    }
    if figures.is_empty() {
        bail!("no result lines in {what}'s output: {out}");
    }
    Ok((figures, rss))
}

/// A bandwidth in GB/s with three significant digits (small sizes give tiny figures).
fn gbs(v: f64) -> String {
    let digits = if v > 0.0 && v.is_finite() {
        (2 - v.log10().floor() as i32).max(0) as usize
    } else {
        1
    };
    format!("{v:.digits$} GB/s")
}

/// Single-thread memcpy bandwidth in GB/s (bytes copied once per copy): the median of `reps`
/// copies between two 256 MiB buffers, after one untimed copy that faults the pages in.
fn memcpy_gbs(reps: usize) -> f64 {
    const LEN: usize = 256 << 20;
    let src = vec![1u8; LEN];
    let mut dst = vec![0u8; LEN];
    dst.copy_from_slice(&src);
    let mut secs: Vec<f64> = (0..reps.max(1))
        .map(|_| {
            let t = Instant::now();
            black_box(&mut dst).copy_from_slice(black_box(&src));
            t.elapsed().as_secs_f64()
        })
        .collect();
    black_box(&dst);
    LEN as f64 / quantile(&mut secs, 0.5) / 1e9
}

/// `MemAvailable` in bytes (0 where /proc does not say).
fn mem_available() -> u64 {
    std::fs::read_to_string("/proc/meminfo")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("MemAvailable:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

fn human(bytes: usize) -> String {
    match bytes {
        b if b >= 1 << 20 && b % (1 << 20) == 0 => format!("{} MiB", b >> 20),
        b if b >= 1 << 10 && b % (1 << 10) == 0 => format!("{} KiB", b >> 10),
        b => format!("{b} B"),
    }
}

fn list(sizes: &[usize]) -> String {
    sizes
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(",")
}

/// Per size present in every round: the median over rounds of the median time (the mean of
/// the middle two for an even count), and the bus bandwidth from that time.
fn medians(rounds: &[BTreeMap<usize, Figures>], procs: usize) -> BTreeMap<usize, Figures> {
    let Some(first) = rounds.first() else {
        return BTreeMap::new();
    };
    first
        .keys()
        .filter(|size| rounds.iter().all(|r| r.contains_key(size)))
        .map(|&size| {
            let mut p50: Vec<f64> = rounds.iter().map(|r| r[&size].p50_us).collect();
            p50.sort_by(f64::total_cmp);
            let mid = p50.len() / 2;
            let p50_us = if p50.len() % 2 == 1 {
                p50[mid]
            } else {
                (p50[mid - 1] + p50[mid]) / 2.0
            };
            (size, Figures::new(size, p50_us, procs))
        })
        .collect()
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let bins = bin_dir();
    let agent = bins.join("muster-agent");
    let worker = bins.join("examples/allreduce_bench");
    for p in [&agent, &worker] {
        anyhow::ensure!(
            p.exists(),
            "missing {}: build with `cargo build --release -p muster-agent -p muster --examples \
             -p muster-bench` first",
            p.display()
        );
    }
    let venv = peers_venv(args.venv.clone());
    let torchrun = venv.join("bin/torchrun");
    let dir = std::env::temp_dir().join(format!("muster-allreduce-bench-{}", std::process::id()));
    let gloo = if torchrun.exists() {
        std::fs::create_dir_all(&dir)?;
        let script = dir.join("allreduce_gloo.py");
        std::fs::write(&script, GLOO_ALLREDUCE_SCRIPT)?;
        Some((torchrun, script))
    } else {
        eprintln!(
            "note: no torchrun at {} (run scripts/install-peers.sh): muster only, no gloo column",
            torchrun.display()
        );
        None
    };

    let memcpy = memcpy_gbs(args.memcpy_reps);
    println!(
        "single-thread memcpy: {memcpy:.2} GB/s (256 MiB buffers, median of {} copies)",
        args.memcpy_reps
    );
    // Other work on the machine skews every figure here; say how busy it was.
    println!("load average at start: {}", load_average());
    let available = mem_available();
    let started = Instant::now();
    let mut goals = vec![];

    for &procs in &args.procs {
        let limit = (available as f64 * args.mem_share) as usize;
        let (sizes, capped): (Vec<usize>, Vec<usize>) = args
            .sizes
            .iter()
            .partition(|&&s| procs.saturating_mul(s).saturating_mul(4) <= limit);
        if sizes.is_empty() {
            println!("\n{procs} processes: no size fits in memory; skipped");
            continue;
        }
        let (mut muster_rounds, mut gloo_rounds) = (vec![], vec![]);
        for round in 0..args.rounds {
            eprintln!("{procs} processes, round {}: muster", round + 1);
            let out = run(Command::new(&agent)
                .args(["launch", "--nproc-per-node", &procs.to_string()])
                .args(["--job-id", "bench", "--"])
                .arg(&worker)
                .args(["--sizes", &list(&sizes)])
                .args(["--iters", &args.iters.to_string()])
                .args(["--bytes-per-size", &args.bytes_per_size.to_string()])
                .env("MUSTER_COMM_BACKEND", "cpu"))?;
            let (figures, rss) = parse(&out, "muster", procs)?;
            muster_rounds.push(figures);
            if let Some(rss) = rss {
                eprintln!("  muster rank 0 peak RSS {rss:.0} MiB");
            }
            if let Some((torchrun, script)) = &gloo {
                eprintln!("{procs} processes, round {}: gloo", round + 1);
                let out = run(Command::new(torchrun)
                    .args(["--nproc-per-node", &procs.to_string()])
                    .args(["--master-addr", "127.0.0.1"])
                    .args(["--master-port", &free_port()?.to_string()])
                    .arg(script)
                    .args(["--sizes", &list(&sizes)])
                    .args(["--iters", &args.iters.to_string()])
                    .args(["--bytes-per-size", &args.bytes_per_size.to_string()])
                    .env("OMP_NUM_THREADS", "1"))?;
                gloo_rounds.push(parse(&out, "gloo", procs)?.0);
            }
        }
        let m = medians(&muster_rounds, procs);
        let g = medians(&gloo_rounds, procs);
        print_table(procs, &m, &g, memcpy);
        goals.push(Goals::of(procs, &m, &g, memcpy));
        if !capped.is_empty() {
            println!(
                "\nNot run with {procs} processes (P x size x 4 over {:.0}% of the {:.1} GiB \
                 available): {}",
                args.mem_share * 100.0,
                available as f64 / (1u64 << 30) as f64,
                capped
                    .iter()
                    .map(|&s| human(s))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    print_goals(&goals);
    println!("\nload average at end: {}", load_average());
    println!(
        "\n(whole run {:.0} s; bandwidths from the median of per-iteration times; busbw = algbw x \
         2(N-1)/N; % of memcpy = muster busbw / single-thread memcpy)",
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}

fn print_table(
    procs: usize,
    m: &BTreeMap<usize, Figures>,
    g: &BTreeMap<usize, Figures>,
    memcpy: f64,
) {
    println!("\n### {procs} processes\n");
    println!(
        "| size | muster p50 | muster busbw | gloo p50 | gloo busbw | muster / gloo busbw | muster % of memcpy |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (&size, mf) in m {
        let (gp50, gbus, ratio) = match g.get(&size) {
            Some(gf) => (
                format!("{:.1} us", gf.p50_us),
                gbs(gf.busbw_gbs),
                format!("{:.2}x", mf.busbw_gbs / gf.busbw_gbs),
            ),
            None => ("-".into(), "-".into(), "-".into()),
        };
        println!(
            "| {} | {:.1} us | {} | {gp50} | {gbus} | {ratio} | {:.1}% |",
            human(size),
            mf.p50_us,
            gbs(mf.busbw_gbs),
            mf.busbw_gbs / memcpy * 100.0
        );
    }
    let smallest = m.keys().next().copied();
    if let Some(size) = smallest {
        let mp = m[&size].p50_us;
        match g.get(&size) {
            Some(gf) => println!(
                "\n{} latency, {procs} processes: muster p50 {mp:.1} us, gloo p50 {:.1} us, \
                 muster / gloo {:.2}x",
                human(size),
                gf.p50_us,
                mp / gf.p50_us
            ),
            None => println!(
                "\n{} latency, {procs} processes: muster p50 {mp:.1} us",
                human(size)
            ),
        }
    }
}

/// The goals for one process count: busbw at least 3x gloo's at 64 MiB, peak busbw at
/// least 50% of single-thread memcpy, 4-byte latency at most 0.5x gloo's.
struct Goals {
    procs: usize,
    ratio_64mib: Option<f64>,
    peak: Option<(usize, f64)>,
    latency_ratio: Option<f64>,
}

impl Goals {
    fn of(
        procs: usize,
        m: &BTreeMap<usize, Figures>,
        g: &BTreeMap<usize, Figures>,
        memcpy: f64,
    ) -> Self {
        let ratio = |size: usize| Some(m.get(&size)?.busbw_gbs / g.get(&size)?.busbw_gbs);
        let peak = m
            .iter()
            .max_by(|a, b| a.1.busbw_gbs.total_cmp(&b.1.busbw_gbs))
            .map(|(&size, f)| (size, f.busbw_gbs / memcpy * 100.0));
        let latency_ratio = (|| Some(m.get(&4)?.p50_us / g.get(&4)?.p50_us))();
        Goals {
            procs,
            ratio_64mib: ratio(64 << 20),
            peak,
            latency_ratio,
        }
    }
}

fn verdict(met: Option<bool>) -> &'static str {
    match met {
        Some(true) => "met",
        Some(false) => "missed",
        None => "not measured",
    }
}

fn print_goals(goals: &[Goals]) {
    println!("\n### Goals\n");
    println!(
        "| processes | muster / gloo busbw at 64 MiB (goal >= 3x) | peak muster busbw, % of memcpy (goal >= 50%) | 4 B p50 muster / gloo (goal <= 0.5x) |"
    );
    println!("| --- | --- | --- | --- |");
    for g in goals {
        let ratio = g.ratio_64mib.map_or("-".into(), |r| format!("{r:.2}x"));
        let peak = g.peak.map_or("-".into(), |(size, pct)| {
            format!("{pct:.1}% (at {})", human(size))
        });
        let latency = g.latency_ratio.map_or("-".into(), |r| format!("{r:.2}x"));
        println!(
            "| {} | {ratio}: {} | {peak}: {} | {latency}: {} |",
            g.procs,
            verdict(g.ratio_64mib.map(|r| r >= 3.0)),
            verdict(g.peak.map(|(_, pct)| pct >= 50.0)),
            verdict(g.latency_ratio.map(|r| r <= 0.5)),
        );
    }
}
