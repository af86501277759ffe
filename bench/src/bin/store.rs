//! The agent store's benchmark, side by side with rank 0's TCPStore in one run (issue 17).
//!
//! 1. `init_process_group("gloo", init_method="env://")` at 8 and 32 processes under
//!    `muster-agent launch`, with the agent store (the default) against `--no-agent-store`
//!    (rank 0's own TCPStore): rank 0's call and the slowest rank's call, medians over rounds,
//!    the two alternating (goal <= 1.2x). Every rank waits on a file barrier before the call
//!    (`init_pg.py --start-dir`), so the figures time the store, not `import torch`.
//! 2. torch's own `TCPStore` client (`store_ops.py`, two ranks, rank 1 timing) against the
//!    agent store, one node (the coordinator embedded in the agent), against the agent store
//!    with the coordinator in its own process (what a store call that leaves the node pays,
//!    less the network), and against rank 0's TCPStore: set, get, add p50 and p90 (goal <=
//!    2x).
//! 3. Where the time goes: the Rust SDK's `Kv` set/get/add (the very calls the agent store
//!    makes, on the same client) timed from a worker straight to the coordinator process, and
//!    the loopback hop to each store (`check([])`, which the agent answers without a
//!    coordinator call); what neither explains is the agent's own work. The same calls through
//!    the agent's gateway (a worker's own path) are printed beside them.
//!
//! Needs release builds (`cargo build --release -p muster-agent -p muster-coordinator -p
//! muster-bench --bins`) and torch in the peers' venv (`scripts/install-peers.sh`).
//!
//! `target/release/store [--rounds 5] [--procs 8,32] [--iters 1000]`

use anyhow::Context;
use clap::Parser;
use muster_bench::{
    CoordinatorProcess, bin_dir, command_line, cpu_model, field, load_average, peers_venv,
    quantile, run_output,
};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

#[derive(Parser)]
struct Args {
    /// Rounds per comparison; medians are over rounds.
    #[arg(long, default_value_t = 5)]
    rounds: usize,
    /// Process counts for `init_process_group` (`--procs` with none: skip it).
    #[arg(long, value_delimiter = ',', num_args = 0.., default_value = "8,32")]
    procs: Vec<u32>,
    /// Timed calls of each store operation per run.
    #[arg(long, default_value_t = 1000)]
    iters: u32,
    /// Skip the per-operation tables.
    #[arg(long)]
    no_ops: bool,
    /// The peers' venv (torch).
    #[arg(long, env = "MUSTER_PEERS_VENV")]
    venv: Option<PathBuf>,
    /// Internal: run as a worker under `muster-agent launch` timing the Rust SDK's `Kv` calls
    /// to the job's coordinator.
    #[arg(long, hide = true)]
    kv_worker: bool,
    /// Internal: the coordinator the `--kv-worker` calls go to, straight (as the agent store's
    /// own calls do); without it they go through the agent's gateway, as a worker's calls do.
    #[arg(long, hide = true)]
    kv_coordinator: Option<String>,
}

/// Which store the workers reach at MASTER_ADDR:MASTER_PORT.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Store {
    /// The agent store of a one-node launch: its coordinator is embedded in the agent.
    AgentLocal,
    /// The agent store with the coordinator in its own process (`--coordinator`), as for a
    /// job of several nodes.
    AgentRemote,
    /// `--no-agent-store`: rank 0's own TCPStore.
    Rank0,
}

impl Store {
    fn name(self) -> &'static str {
        match self {
            Store::AgentLocal => "agent store, coordinator in the agent",
            Store::AgentRemote => "agent store, coordinator in its own process",
            Store::Rank0 => "rank 0's TCPStore",
        }
    }
}

/// What the runs need.
struct Setup {
    agent: PathBuf,
    python: PathBuf,
    init_pg: PathBuf,
    store_ops: PathBuf,
    dir: PathBuf,
    /// For [`Store::AgentRemote`].
    coordinator: CoordinatorProcess,
}

/// The operations timed, in the order printed, with how many client round trips and
/// coordinator calls each costs through the agent store. torch's `get` waits for the key
/// first (a `WAIT`, then a `GET`: two round trips, each one `Kv::get`); its `set` has no reply,
/// so it is timed with an empty `check` behind it, whose reply comes once the set is applied.
const OPS: [(&str, &str, u32, u32); 3] = [
    ("set_applied", "set (+ empty check)", 1, 1),
    ("get", "get", 2, 2),
    ("add", "add", 1, 1),
];

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.kv_worker {
        return kv_worker(args.iters, args.kv_coordinator);
    }
    let venv = peers_venv(args.venv.clone());
    let bins = bin_dir();
    let here = Path::new(env!("CARGO_MANIFEST_DIR")).join("python");
    let agent = bins.join("muster-agent");
    anyhow::ensure!(
        agent.exists() && bins.join("muster-coordinator").exists(),
        "missing {} or muster-coordinator: see this program's header",
        agent.display()
    );
    let python = venv.join("bin/python3");
    let imports = Command::new(&python)
        .args(["-c", "import torch.distributed"])
        .status()
        .with_context(|| format!("running {}", python.display()))?;
    anyhow::ensure!(
        imports.success(),
        "the peers' venv lacks torch: run scripts/install-peers.sh"
    );
    let setup = Setup {
        agent,
        python,
        init_pg: here.join("init_pg.py"),
        store_ops: here.join("store_ops.py"),
        dir: std::env::temp_dir().join(format!("muster-store-bench-{}", std::process::id())),
        coordinator: CoordinatorProcess::start()?,
    };
    std::fs::create_dir_all(&setup.dir)?;
    let started = Instant::now();
    println!("## Agent store (issue 17)\n");
    println!(
        "date {}, commit {}, {} CPUs ({}), load at start {}; medians over {} rounds\n",
        command_line("date", &["-u", "+%Y-%m-%d %H:%M UTC"]),
        command_line("git", &["rev-parse", "--short", "HEAD"]),
        std::thread::available_parallelism().map_or(0, |n| n.get()),
        cpu_model(),
        load_average(),
        args.rounds
    );
    if !args.procs.is_empty() {
        init_table(&setup, &args)?;
    }
    if !args.no_ops {
        ops_tables(&setup, &args)?;
    }
    println!(
        "\nload at end {}; whole run {:.0} s",
        load_average(),
        started.elapsed().as_secs_f64()
    );
    let _ = std::fs::remove_dir_all(&setup.dir);
    Ok(())
}

/// `muster-agent launch` of `nproc` workers running `worker`, reaching `store`; its stdout.
fn launch(
    s: &Setup,
    store: Store,
    nproc: u32,
    run: usize,
    worker: &[&std::ffi::OsStr],
) -> anyhow::Result<String> {
    let mut cmd = Command::new(&s.agent);
    cmd.args(["launch", "--nproc-per-node", &nproc.to_string()]);
    match store {
        Store::AgentLocal => {}
        Store::AgentRemote => {
            cmd.args(["--coordinator", &s.coordinator.addr.to_string()]);
            cmd.args(["--nnodes", "1", "--job-id", &format!("store-bench-{run}")]);
        }
        Store::Rank0 => {
            cmd.arg("--no-agent-store");
        }
    }
    cmd.arg("--").args(worker).env("OMP_NUM_THREADS", "1");
    Ok(run_output(&mut cmd)?.0)
}

/// Rank 0's and the slowest rank's `init_process_group` in milliseconds.
fn init_ms(s: &Setup, store: Store, nproc: u32, run: usize) -> anyhow::Result<(f64, f64)> {
    let start_dir = s.dir.join(format!("start-{run}"));
    let out = launch(
        s,
        store,
        nproc,
        run,
        &[
            s.python.as_os_str(),
            s.init_pg.as_os_str(),
            "--how".as_ref(),
            "env".as_ref(),
            "--start-dir".as_ref(),
            start_dir.as_os_str(),
        ],
    )?;
    let line = out
        .lines()
        .find(|l| l.contains("init_ms="))
        .with_context(|| format!("no init_ms in {out}"))?;
    Ok((
        field(line, "init_ms=").context("init_ms")?,
        field(line, "slowest_ms=").context("slowest_ms")?,
    ))
}

fn init_table(s: &Setup, args: &Args) -> anyhow::Result<()> {
    println!(
        "| `init_process_group(\"gloo\")`, processes | agent store, rank 0 | rank 0's TCPStore, rank 0 | ratio (goal <= 1.2x) | agent store, slowest rank | rank 0's TCPStore, slowest rank | ratio |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    let mut run = 0;
    for &n in &args.procs {
        let mut times: BTreeMap<Store, (Vec<f64>, Vec<f64>)> = BTreeMap::new();
        for round in 0..args.rounds {
            let mut order = [Store::AgentLocal, Store::Rank0];
            if round % 2 == 1 {
                order.reverse();
            }
            for store in order {
                run += 1;
                eprintln!(
                    "init_process_group n={n} round {}/{}: {}",
                    round + 1,
                    args.rounds,
                    store.name()
                );
                let (rank0, slowest) = init_ms(s, store, n, run)?;
                let entry = times.entry(store).or_default();
                entry.0.push(rank0);
                entry.1.push(slowest);
            }
        }
        let mut median = |store: Store| {
            let (r, w) = times.get_mut(&store).expect("every store ran");
            (quantile(r, 0.5), quantile(w, 0.5))
        };
        let (a0, aw) = median(Store::AgentLocal);
        let (t0, tw) = median(Store::Rank0);
        println!(
            "| {n} | {a0:.1} ms | {t0:.1} ms | {:.2}x | {aw:.1} ms | {tw:.1} ms | {:.2}x |",
            a0 / t0,
            aw / tw
        );
    }
    Ok(())
}

/// p50 and p90 in microseconds per operation, from `op=NAME p50_us=.. p90_us=..` lines.
type OpTimes = BTreeMap<String, (f64, f64)>;

fn parse_ops(out: &str) -> anyhow::Result<OpTimes> {
    let ops: OpTimes = out
        .lines()
        .filter_map(|l| {
            // The agent may put `[rank N] ` before a worker's line.
            let l = &l[l.find("op=")? + 3..];
            let name = l.split(' ').next()?.to_owned();
            Some((name, (field(l, "p50_us=")?, field(l, "p90_us=")?)))
        })
        .collect();
    anyhow::ensure!(!ops.is_empty(), "no op= lines in {out}");
    Ok(ops)
}

/// torch's client against `store`, two ranks.
fn torch_ops(s: &Setup, store: Store, iters: u32, run: usize) -> anyhow::Result<OpTimes> {
    let out = launch(
        s,
        store,
        2,
        run,
        &[
            s.python.as_os_str(),
            s.store_ops.as_os_str(),
            "--iters".as_ref(),
            iters.to_string().as_ref(),
        ],
    )?;
    parse_ops(&out)
}

/// The Rust SDK's `Kv` from one worker of a launch with `store`: with the coordinator in its
/// own process, straight to it (the calls the agent store makes, on the same client); with
/// the coordinator in the agent, through the agent's gateway (a worker's own path since issue
/// 29: the worker has no coordinator address).
fn sdk_ops(s: &Setup, store: Store, iters: u32, run: usize) -> anyhow::Result<OpTimes> {
    let me = std::env::current_exe()?;
    let addr = s.coordinator.addr.to_string();
    let iters = iters.to_string();
    let mut worker: Vec<&std::ffi::OsStr> = vec![
        me.as_os_str(),
        "--kv-worker".as_ref(),
        "--iters".as_ref(),
        iters.as_ref(),
    ];
    if store == Store::AgentRemote {
        worker.extend::<[&std::ffi::OsStr; 2]>(["--kv-coordinator".as_ref(), addr.as_ref()]);
    }
    let out = launch(s, store, 1, run, &worker)?;
    parse_ops(&out)
}

/// Median over rounds of each operation's p50 and p90.
fn medians(rounds: &mut [OpTimes]) -> OpTimes {
    let names: Vec<String> = rounds
        .first()
        .map_or(vec![], |r| r.keys().cloned().collect());
    names
        .into_iter()
        .map(|name| {
            let mut p50: Vec<f64> = rounds
                .iter()
                .filter_map(|r| r.get(&name))
                .map(|v| v.0)
                .collect();
            let mut p90: Vec<f64> = rounds
                .iter()
                .filter_map(|r| r.get(&name))
                .map(|v| v.1)
                .collect();
            let m = (quantile(&mut p50, 0.5), quantile(&mut p90, 0.5));
            (name, m)
        })
        .collect()
}

fn ops_tables(s: &Setup, args: &Args) -> anyhow::Result<()> {
    let stores = [Store::AgentLocal, Store::AgentRemote, Store::Rank0];
    let mut torch: BTreeMap<Store, Vec<OpTimes>> = BTreeMap::new();
    let mut sdk: BTreeMap<Store, Vec<OpTimes>> = BTreeMap::new();
    for round in 0..args.rounds {
        // Each round starts with a different store, so drift in the machine's load spreads
        // over all of them.
        let mut order = stores;
        order.rotate_left(round % stores.len());
        for store in order {
            let run = 1000 + round * 10 + store as usize;
            eprintln!(
                "store operations round {}/{}: {}",
                round + 1,
                args.rounds,
                store.name()
            );
            torch
                .entry(store)
                .or_default()
                .push(torch_ops(s, store, args.iters, run)?);
            if store != Store::Rank0 {
                sdk.entry(store)
                    .or_default()
                    .push(sdk_ops(s, store, args.iters, run + 5)?);
            }
        }
    }
    let torch: BTreeMap<Store, OpTimes> = torch
        .into_iter()
        .map(|(k, mut v)| (k, medians(&mut v)))
        .collect();
    let sdk: BTreeMap<Store, OpTimes> = sdk
        .into_iter()
        .map(|(k, mut v)| (k, medians(&mut v)))
        .collect();
    let get = |t: &BTreeMap<Store, OpTimes>, store: Store, op: &str| {
        t.get(&store)
            .and_then(|o| o.get(op))
            .copied()
            .unwrap_or((f64::NAN, f64::NAN))
    };

    println!(
        "\n| torch `TCPStore` client, p50 / p90 | {} | {} | {} | ratio of p50, agent (in the agent) / TCPStore (goal <= 2x) | ratio of p50, agent (own process) / TCPStore |",
        Store::AgentLocal.name(),
        Store::AgentRemote.name(),
        Store::Rank0.name()
    );
    println!("| --- | --- | --- | --- | --- | --- |");
    for (op, label, _, _) in OPS.iter().copied().chain([
        ("check_empty", "empty check (the hop alone)", 1, 0),
        (
            "connect",
            "a new client: connect and handshake (the agent store also checks it is its worker's)",
            0,
            0,
        ),
    ]) {
        let (l, r, t) = (
            get(&torch, Store::AgentLocal, op),
            get(&torch, Store::AgentRemote, op),
            get(&torch, Store::Rank0, op),
        );
        println!(
            "| {label} | {:.0} / {:.0} us | {:.0} / {:.0} us | {:.0} / {:.0} us | {:.2}x | {:.2}x |",
            l.0,
            l.1,
            r.0,
            r.1,
            t.0,
            t.1,
            l.0 / t.0,
            r.0 / t.0
        );
    }

    println!(
        "\nWhere an agent store call's time goes (p50, us): the client's round trips to the agent \
         (each an empty check), the coordinator calls (the Rust SDK's `Kv`, timed from a worker \
         straight to the coordinator process: the agent store's own call, which with the \
         coordinator in the agent stays in one process), and what is left: the agent's own work \
         (parsing, the task hand-offs of the gRPC client, key mapping) and noise.\n"
    );
    println!(
        "| operation, coordinator | agent store p50 | round trips x hop | coordinator calls x `Kv` p50 | left |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for store in [Store::AgentLocal, Store::AgentRemote] {
        let hop = get(&torch, store, "check_empty").0;
        for (op, label, trips, calls) in OPS {
            let total = get(&torch, store, op).0;
            let kv_op = if op == "set_applied" { "set" } else { op };
            let kv = get(&sdk, Store::AgentRemote, kv_op).0;
            let (h, k) = (f64::from(trips) * hop, f64::from(calls) * kv);
            let place = if store == Store::AgentLocal {
                "in the agent"
            } else {
                "own process"
            };
            println!(
                "| {label}, {place} | {total:.0} | {trips} x {hop:.0} = {h:.0} | {calls} x {kv:.0} = {k:.0} | {:.0} |",
                total - h - k
            );
        }
    }
    println!(
        "\n| Rust SDK `Kv` from a worker, p50 / p90 | coordinator in the agent, through the agent's gateway | own process, straight to it |"
    );
    println!("| --- | --- | --- |");
    for op in ["set", "get", "add"] {
        let (l, r) = (
            get(&sdk, Store::AgentLocal, op),
            get(&sdk, Store::AgentRemote, op),
        );
        println!(
            "| {op} | {:.0} / {:.0} us | {:.0} / {:.0} us |",
            l.0, l.1, r.0, r.1
        );
    }
    Ok(())
}

/// The worker side of [`sdk_ops`]: the calls the agent store makes for torch's set, get and
/// add, on the same client, from the environment `muster-agent launch` gives a worker.
fn kv_worker(iters: u32, straight_to: Option<String>) -> anyhow::Result<()> {
    let rank = muster::env::RankInfo::from_env()?;
    let addr = match straight_to {
        Some(addr) => addr,
        None => rank.coordinator.clone().context(
            "not under muster-agent launch (neither MUSTER_AGENT_SOCKET nor MUSTER_COORDINATOR)",
        )?,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let coordinator = muster::client::Coordinator::connect(&addr).await?;
        let kv = muster::client::Kv::new(coordinator, &rank.job_id);
        // The agent store's keys for generation 1: the same key lengths and map.
        let key = format!("torch/g{}/bench/key", rank.generation);
        let counter = format!("torch/g{}/bench/counter", rank.generation);
        kv.set(&key, vec![b'x'; 16]).await?;
        let warmup = (iters / 10).max(10);
        for (name, op) in [("set", 0), ("get", 1), ("add", 2)] {
            let mut xs = Vec::with_capacity(iters as usize);
            for i in 0..warmup + iters {
                let t = Instant::now();
                match op {
                    0 => kv.set(&key, vec![b'x'; 16]).await?,
                    1 => {
                        kv.get(&key).await?.context("the key vanished")?;
                    }
                    _ => {
                        kv.add(&counter, 1).await?;
                    }
                }
                if i >= warmup {
                    xs.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            let p50 = quantile(&mut xs, 0.5);
            let p90 = quantile(&mut xs, 0.9);
            println!("op={name} p50_us={p50:.1} p90_us={p90:.1} n={iters}");
        }
        anyhow::Ok(())
    })
}
