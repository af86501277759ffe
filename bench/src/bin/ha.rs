//! High-availability benchmark (issue 5): what the etcd store costs against the memory store
//! (rendezvous time, barrier p50/p99 for the same lightweight ranks), and the failover time
//! of coordinator replicas (leader SIGKILLed -> the first barrier that completes under the new
//! leader), median over rounds, at the coordinator's default lease TTL. Prints markdown tables.
//!
//! Needs an `etcd` binary (`/usr/bin/etcd` or on PATH; `scripts/install-deps.sh` installs it):
//! without one it prints why and exits 0. Build the coordinator first (`cargo build --release
//! -p muster-coordinator -p muster-bench`); it is taken from the directory of this program.
//!
//! The ranks speak the wire protocol directly (as in `scale`), one session stream per rank,
//! so what is measured is the coordinator. Across a failover each rank re-attaches with
//! `Register.resume` to whichever replica accepts it and re-sends its pending barrier, retrying
//! either like the SDK does (`worker-sdk/src/failover.rs`: exponential backoff from 50 ms to
//! 250 ms, jittered) or at a fixed short interval (what the coordinator alone allows); both
//! are reported.
//!
//! `target/release/ha [--ranks 8] [--iters 2000] [--rounds 10] [--rendezvous-rounds 5]`

use anyhow::{Context, bail};
use clap::Parser;
use muster_bench::{bin_dir, leads, quantile, waiting};
use muster_proto::v1 as pb;
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Lightweight ranks (one simulated node each, one session stream each).
    #[arg(long, default_value_t = 8)]
    ranks: u32,
    /// Timed barriers per store.
    #[arg(long, default_value_t = 2000)]
    iters: usize,
    /// Leader kills in the failover benchmark (per retry policy).
    #[arg(long, default_value_t = 10)]
    rounds: usize,
    /// Rendezvous rounds per store.
    #[arg(long, default_value_t = 5)]
    rendezvous_rounds: usize,
    /// Coordinator replicas in the failover benchmark.
    #[arg(long, default_value_t = 3)]
    replicas: usize,
    /// The election lease TTL; default: the coordinator's own default.
    #[arg(long)]
    lease_ttl_ms: Option<u64>,
}

// ------------------------------------------------------------------------------------------
// Processes: etcd and coordinators.
// ------------------------------------------------------------------------------------------

fn free_port() -> anyhow::Result<u16> {
    Ok(muster_tests::free_port())
}

/// A coordinator process with fixed flags on a fixed port: restartable; killed on drop.
struct Coordinator {
    addr: String,
    args: Vec<String>,
    child: Option<Child>,
}

impl Coordinator {
    fn start(args: &[String]) -> anyhow::Result<Self> {
        let addr = format!("127.0.0.1:{}", free_port()?);
        let mut c = Self {
            addr,
            args: args.to_vec(),
            child: None,
        };
        c.spawn()?;
        Ok(c)
    }

    fn spawn(&mut self) -> anyhow::Result<()> {
        let bin = bin_dir().join("muster-coordinator");
        let child = Command::new(&bin)
            .args(["--listen", &self.addr, "--log", "warn"])
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .spawn()
            .with_context(|| format!("cannot start {} (build it first)", bin.display()))?;
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(15);
        while std::net::TcpStream::connect(&self.addr).is_err() {
            if let Some(status) = self
                .child
                .as_mut()
                .and_then(|c| c.try_wait().ok().flatten())
            {
                bail!("coordinator {} exited at startup: {status}", self.addr);
            }
            if Instant::now() > deadline {
                bail!("coordinator {} does not accept connections", self.addr);
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Ok(())
    }

    fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

impl Drop for Coordinator {
    fn drop(&mut self) {
        self.kill();
    }
}

async fn connect(addr: &str) -> anyhow::Result<Channel> {
    Ok(Channel::from_shared(format!("http://{addr}"))?
        .tcp_nodelay(true)
        .connect_timeout(Duration::from_millis(500))
        .connect()
        .await?)
}

/// Waits until one of `addrs` answers a leader-only call (followers answer UNAVAILABLE);
/// returns its index.
async fn wait_leader(addrs: &[String], timeout: Duration) -> anyhow::Result<usize> {
    let deadline = Instant::now() + timeout;
    loop {
        for (i, addr) in addrs.iter().enumerate() {
            let Ok(Ok(ch)) = tokio::time::timeout(Duration::from_secs(1), connect(addr)).await
            else {
                continue;
            };
            if leads(&ch).await {
                return Ok(i);
            }
        }
        if Instant::now() > deadline {
            bail!("no coordinator of {addrs:?} leads within {timeout:?}");
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

// ------------------------------------------------------------------------------------------
// Rendezvous and ranks.
// ------------------------------------------------------------------------------------------

fn join_req(job: &str, node: u32, nodes: u32) -> pb::JoinRequest {
    pb::JoinRequest {
        job_id: job.into(),
        node_id: format!("node-{node}"),
        host: "127.0.0.1".into(),
        local_world_size: 1,
        requested_node_rank: Some(node),
        config: Some(pb::RendezvousConfig {
            min_nodes: nodes,
            max_nodes: nodes,
            last_call_ms: 0,
            join_timeout_ms: 60_000,
            max_restarts: None,
            recovery: 0,
            ..Default::default()
        }),
        request_id: format!("{job}-{node}-{}", std::process::id()),
        watches: false,
        spare: false,
    }
}

/// Forms `job` of `nodes` one-rank nodes: joins all but one, waits until they wait, then times
/// the last join until every node holds its answer. Returns (time, generation).
async fn rendezvous(ch: &Channel, job: &str, nodes: u32) -> anyhow::Result<(Duration, u64)> {
    let mut joins = Vec::new();
    for n in 0..nodes - 1 {
        let mut c = pb::rendezvous_client::RendezvousClient::new(ch.clone());
        let req = join_req(job, n, nodes);
        joins.push(tokio::spawn(async move {
            let r = c.join(req).await;
            (Instant::now(), r)
        }));
    }
    while waiting(ch, job).await < nodes - 1 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let t0 = Instant::now();
    let last = pb::rendezvous_client::RendezvousClient::new(ch.clone())
        .join(join_req(job, nodes - 1, nodes))
        .await?
        .into_inner();
    let mut latest = Instant::now();
    for j in joins {
        let (at, r) = j.await?;
        r?;
        latest = latest.max(at);
    }
    Ok((latest - t0, last.generation))
}

/// How a rank retries after losing its coordinator.
#[derive(Clone, Copy)]
enum Retry {
    /// The SDK's policy: 50 ms doubling to 1 s, each sleep jittered in [0.5x, 1.5x].
    Sdk,
    /// A fixed short interval.
    Every(Duration),
}

impl Retry {
    fn describe(self) -> String {
        match self {
            Retry::Sdk => "SDK policy (50 ms -> 250 ms backoff, jittered)".into(),
            Retry::Every(d) => format!("every {} ms", d.as_millis()),
        }
    }
}

/// A cheap xorshift for jitter.
fn jitter(state: &mut u64) -> f64 {
    *state ^= *state << 13;
    *state ^= *state >> 7;
    *state ^= *state << 17;
    0.5 + (*state % 1000) as f64 / 1000.0
}

/// One rank's session: re-attached (with `resume`) to whichever address accepts it when its
/// stream breaks.
struct Rank {
    addrs: Vec<String>,
    job: String,
    generation: u64,
    rank: u32,
    /// The last global barrier this rank got a result for.
    released: u64,
    stream: Option<(
        mpsc::Sender<pb::WorkerMessage>,
        tonic::Streaming<pb::CoordinatorMessage>,
    )>,
    /// The address to try first (the leader, or the one a follower named).
    next: usize,
    retry: Retry,
    rng: u64,
    last_beat: Instant,
    /// Successful registrations so far (the first one included).
    attaches: u64,
}

impl Rank {
    fn new(addrs: &[String], job: &str, generation: u64, rank: u32, retry: Retry) -> Self {
        Self {
            addrs: addrs.to_vec(),
            job: job.into(),
            generation,
            rank,
            released: 0,
            stream: None,
            next: 0,
            retry,
            rng: (u64::from(std::process::id()) << 20) ^ u64::from(rank) ^ 0x2545_f491_4f6c_dd1d,
            last_beat: Instant::now(),
            attaches: 0,
        }
    }

    /// One registration attempt at `addrs[next]`.
    async fn try_attach(&mut self, resume: bool) -> Result<(), Option<String>> {
        let addr = self.addrs[self.next].clone();
        let ch = connect(&addr).await.map_err(|_| None)?;
        let (tx, rx) = mpsc::channel(8);
        let register = pb::Register {
            job_id: self.job.clone(),
            generation: self.generation,
            rank: self.rank,
            pid: self.rank,
            host: "127.0.0.1".into(),
            resume,
            released_global: self.released,
            released_node: 0,
            replacement: false,
            epoch: 0,
        };
        tx.send(pb::WorkerMessage {
            kind: Some(pb::worker_message::Kind::Register(register)),
        })
        .await
        .map_err(|_| None)?;
        let leader_hint = |s: &tonic::Status| {
            s.metadata()
                .get("muster-leader")
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        let mut client = pb::session_client::SessionClient::new(ch);
        let attach = client.attach(ReceiverStream::new(rx));
        let mut stream = match tokio::time::timeout(Duration::from_secs(2), attach).await {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(s)) => return Err(leader_hint(&s)),
            Err(_) => return Err(None),
        };
        match tokio::time::timeout(Duration::from_secs(2), stream.message()).await {
            Ok(Ok(Some(pb::CoordinatorMessage {
                kind: Some(pb::coordinator_message::Kind::Registered(_)),
            }))) => {
                self.stream = Some((tx, stream));
                Ok(())
            }
            Ok(Err(s)) => Err(leader_hint(&s)),
            _ => Err(None),
        }
    }

    /// Registers (re-registers with `resume` after the first time), trying addresses until one
    /// accepts; fails after 60 s.
    async fn attach(&mut self, resume: bool) -> anyhow::Result<()> {
        let deadline = Instant::now() + Duration::from_secs(60);
        let mut backoff = Duration::from_millis(50);
        loop {
            match self.try_attach(resume).await {
                Ok(()) => {
                    self.attaches += 1;
                    return Ok(());
                }
                Err(hint) => {
                    self.next = hint
                        .and_then(|h| self.addrs.iter().position(|a| *a == h))
                        .unwrap_or((self.next + 1) % self.addrs.len());
                }
            }
            if Instant::now() > deadline {
                bail!("rank {} cannot re-attach to {:?}", self.rank, self.addrs);
            }
            let sleep = match self.retry {
                Retry::Every(d) => d,
                Retry::Sdk => {
                    let s = backoff.mul_f64(jitter(&mut self.rng));
                    backoff = (backoff * 2).min(Duration::from_millis(250));
                    s
                }
            };
            tokio::time::sleep(sleep).await;
        }
    }

    /// Global barrier `released + 1`, re-sent after every re-attach until it completes.
    async fn barrier(&mut self) -> anyhow::Result<()> {
        let seq = self.released + 1;
        loop {
            if self.stream.is_none() {
                self.attach(true).await?;
            }
            let (tx, rx) = self.stream.as_mut().context("attached")?;
            if self.last_beat.elapsed() > Duration::from_millis(500) {
                self.last_beat = Instant::now();
                let beat = pb::WorkerMessage {
                    kind: Some(pb::worker_message::Kind::Heartbeat(pb::Heartbeat {})),
                };
                if tx.send(beat).await.is_err() {
                    self.stream = None;
                    continue;
                }
            }
            let enter = pb::WorkerMessage {
                kind: Some(pb::worker_message::Kind::Barrier(pb::BarrierEnter {
                    scope: pb::BarrierScope::Global as i32,
                    seq,
                    name: "bench".into(),
                    timeout_ms: 0,
                    trace_context: Default::default(),
                })),
            };
            if tx.send(enter).await.is_err() {
                self.stream = None;
                continue;
            }
            loop {
                match rx.message().await {
                    Ok(Some(pb::CoordinatorMessage {
                        kind: Some(pb::coordinator_message::Kind::Barrier(b)),
                    })) if b.seq == seq => {
                        if let Some(e) = b.error {
                            bail!("rank {}: barrier {seq} failed: {}", self.rank, e.message);
                        }
                        self.released = seq;
                        return Ok(());
                    }
                    Ok(Some(pb::CoordinatorMessage {
                        kind: Some(pb::coordinator_message::Kind::GenerationFailed(e)),
                    })) => bail!("rank {}: generation failed: {}", self.rank, e.message),
                    Ok(Some(_)) => {}
                    Ok(None) | Err(_) => {
                        self.stream = None;
                        break;
                    }
                }
            }
        }
    }

    async fn leave(mut self) {
        if let Some((tx, mut rx)) = self.stream.take() {
            let _ = tx
                .send(pb::WorkerMessage {
                    kind: Some(pb::worker_message::Kind::Leave(pb::Leave {})),
                })
                .await;
            drop(tx);
            let _ = tokio::time::timeout(Duration::from_secs(2), async {
                while let Ok(Some(_)) = rx.message().await {}
            })
            .await;
        }
    }
}

/// Forms `job` of `ranks` one-rank nodes at `addrs[leader]` and attaches every rank.
async fn form(
    addrs: &[String],
    leader: usize,
    job: &str,
    ranks: u32,
    retry: Retry,
) -> anyhow::Result<(Duration, Vec<Rank>)> {
    let ch = connect(&addrs[leader]).await?;
    let (took, generation) = rendezvous(&ch, job, ranks).await?;
    let mut out = Vec::new();
    for r in 0..ranks {
        let mut rank = Rank::new(addrs, job, generation, r, retry);
        rank.next = leader;
        rank.attach(false).await?;
        out.push(rank);
    }
    Ok((took, out))
}

/// One store's numbers: rendezvous times (median) and barrier p50/p99 as seen by rank 0.
struct StoreNumbers {
    rendezvous_ms: f64,
    p50_us: f64,
    p99_us: f64,
}

async fn measure_store(addrs: &[String], args: &Args) -> anyhow::Result<StoreNumbers> {
    let leader = wait_leader(addrs, Duration::from_secs(20)).await?;
    let mut rdzv = Vec::new();
    for i in 0..args.rendezvous_rounds {
        let ch = connect(&addrs[leader]).await?;
        let (t, _) = rendezvous(&ch, &format!("rdzv-{i}"), args.ranks).await?;
        rdzv.push(t.as_secs_f64() * 1e3);
    }
    let (_, ranks) = form(addrs, leader, "barriers", args.ranks, Retry::Sdk).await?;
    let warmup = 20;
    let iters = args.iters;
    let mut tasks = Vec::new();
    for mut rank in ranks {
        tasks.push(tokio::spawn(async move {
            let mut lat = Vec::with_capacity(iters);
            for i in 0..warmup + iters {
                let t = Instant::now();
                rank.barrier().await?;
                if i >= warmup {
                    lat.push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            rank.leave().await;
            anyhow::Ok(lat)
        }));
    }
    let mut lat0 = Vec::new();
    for (i, t) in tasks.into_iter().enumerate() {
        let lat = t.await??;
        if i == 0 {
            lat0 = lat;
        }
    }
    Ok(StoreNumbers {
        rendezvous_ms: quantile(&mut rdzv, 0.5),
        p50_us: quantile(&mut lat0, 0.5),
        p99_us: quantile(&mut lat0, 0.99),
    })
}

/// Kills the leader of `replicas` `rounds` times under ranks looping on barriers; returns each
/// round's time from the SIGKILL to the first barrier completed after it (ms).
async fn failover(
    replicas: &mut [Coordinator],
    args: &Args,
    retry: Retry,
    job: &str,
) -> anyhow::Result<Vec<f64>> {
    let addrs: Vec<String> = replicas.iter().map(|c| c.addr.clone()).collect();
    let mut leader = wait_leader(&addrs, Duration::from_secs(20)).await?;
    let (_, ranks) = form(&addrs, leader, job, args.ranks, retry).await?;
    let epoch = Instant::now();
    let now_us = move || u64::try_from(epoch.elapsed().as_micros()).unwrap_or(u64::MAX);
    // Rank 0's last released barrier, and the seq every rank stops at (set at the end to a
    // few past rank 0's progress: the ranks are never more than one barrier apart, so every
    // rank sees it before reaching it).
    let done = Arc::new(AtomicU64::new(0));
    let target = Arc::new(AtomicU64::new(u64::MAX));
    // Rank 0's registrations so far, and the first barrier it completed on a stream opened
    // after the kill (a result the old leader sent just before dying, read after the kill, does
    // not count: it did not come from the new leader).
    let attaches = Arc::new(AtomicU64::new(0));
    let attaches_at_kill = Arc::new(AtomicU64::new(u64::MAX));
    let first_after_us = Arc::new(AtomicU64::new(u64::MAX));
    let mut tasks = Vec::new();
    for mut rank in ranks {
        let (target, done) = (target.clone(), done.clone());
        let (attaches, attaches_at_kill, first_after_us) = (
            attaches.clone(),
            attaches_at_kill.clone(),
            first_after_us.clone(),
        );
        tasks.push(tokio::spawn(async move {
            while rank.released < target.load(Ordering::SeqCst) {
                rank.barrier().await?;
                if rank.rank == 0 {
                    let now = now_us();
                    if rank.attaches > attaches_at_kill.load(Ordering::SeqCst) {
                        first_after_us.fetch_min(now, Ordering::SeqCst);
                    }
                    attaches.store(rank.attaches, Ordering::SeqCst);
                    done.store(rank.released, Ordering::SeqCst);
                }
            }
            rank.leave().await;
            anyhow::Ok(())
        }));
    }
    let mut times = Vec::new();
    for round in 0..args.rounds {
        // Some barriers under the current leader first.
        let before = done.load(Ordering::SeqCst);
        let settle = Instant::now() + Duration::from_secs(30);
        while done.load(Ordering::SeqCst) < before + 50 {
            if Instant::now() > settle {
                bail!("round {round}: the barriers do not progress");
            }
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
        first_after_us.store(u64::MAX, Ordering::SeqCst);
        attaches_at_kill.store(attaches.load(Ordering::SeqCst), Ordering::SeqCst);
        let killed_us = now_us();
        replicas[leader].kill();
        let wait = Instant::now() + Duration::from_secs(60);
        while first_after_us.load(Ordering::SeqCst) == u64::MAX {
            if Instant::now() > wait {
                bail!(
                    "round {round}: no barrier completed under a new leader within 60 s of the SIGKILL of {}",
                    addrs[leader]
                );
            }
            tokio::time::sleep(Duration::from_millis(1)).await;
        }
        let ms = (first_after_us.load(Ordering::SeqCst) - killed_us) as f64 / 1e3;
        eprintln!("  round {round}: {ms:.0} ms");
        times.push(ms);
        attaches_at_kill.store(u64::MAX, Ordering::SeqCst);
        // The killed replica comes back as a standby; the next round kills the new leader.
        replicas[leader].spawn()?;
        leader = wait_leader(&addrs, Duration::from_secs(20)).await?;
    }
    target.store(done.load(Ordering::SeqCst) + 5, Ordering::SeqCst);
    for t in tasks {
        t.await??;
    }
    Ok(times)
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    // A one-member etcd on loopback ports, in a temporary directory (the tests' fixture).
    let Some(etcd) = muster_tests::etcd::Etcd::start(1) else {
        println!("skipped: no etcd binary; scripts/install-deps.sh installs it");
        return Ok(());
    };
    let ttl: Vec<String> = args
        .lease_ttl_ms
        .map(|t| vec!["--lease-ttl-ms".to_owned(), t.to_string()])
        .unwrap_or_default();
    let etcd_args = |prefix: &str| {
        let mut a = vec![
            "--store".to_owned(),
            "etcd".to_owned(),
            "--etcd-endpoints".to_owned(),
            etcd.endpoints_arg(),
            "--etcd-prefix".to_owned(),
            prefix.to_owned(),
        ];
        a.extend(ttl.iter().cloned());
        a
    };

    let memory = {
        let c = Coordinator::start(&[])?;
        measure_store(std::slice::from_ref(&c.addr), &args).await?
    };
    let on_etcd = {
        let c = Coordinator::start(&etcd_args("/bench-store/"))?;
        let n = measure_store(std::slice::from_ref(&c.addr), &args).await?;
        drop(c);
        n
    };
    println!(
        "| store | ranks | rendezvous (last join -> all assigned, median of {}) | barrier p50 | barrier p99 ({} barriers) |",
        args.rendezvous_rounds, args.iters
    );
    println!("| --- | --- | --- | --- | --- |");
    for (name, n) in [("memory", &memory), ("etcd", &on_etcd)] {
        println!(
            "| {name} | {} | {:.1} ms | {:.0} us | {:.0} us |",
            args.ranks, n.rendezvous_ms, n.p50_us, n.p99_us
        );
    }
    println!(
        "\netcd / memory: barrier p50 {:.2}x, rendezvous {:.2}x\n",
        on_etcd.p50_us / memory.p50_us,
        on_etcd.rendezvous_ms / memory.rendezvous_ms
    );

    let ttl_label = args
        .lease_ttl_ms
        .map_or("default".to_owned(), |t| format!("{t} ms"));
    println!(
        "| replicas | ranks | lease TTL | client retry | failover (SIGKILL -> first barrier), median of {} | min | max |",
        args.rounds
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    for (i, retry) in [Retry::Sdk, Retry::Every(Duration::from_millis(25))]
        .into_iter()
        .enumerate()
    {
        let prefix = format!("/bench-failover-{i}/");
        let mut replicas = Vec::new();
        for _ in 0..args.replicas {
            let port = free_port()?;
            let addr = format!("127.0.0.1:{port}");
            let mut a = etcd_args(&prefix);
            a.extend(["--advertise-addr".to_owned(), addr.clone()]);
            let mut c = Coordinator {
                addr,
                args: a,
                child: None,
            };
            c.spawn()?;
            replicas.push(c);
        }
        eprintln!("failover, client retry {}:", retry.describe());
        let mut times = failover(&mut replicas, &args, retry, &format!("failover-{i}")).await?;
        let (min, max) = (
            times.iter().copied().fold(f64::INFINITY, f64::min),
            times.iter().copied().fold(0.0, f64::max),
        );
        println!(
            "| {} | {} | {ttl_label} | {} | {:.0} ms | {min:.0} ms | {max:.0} ms |",
            args.replicas,
            args.ranks,
            retry.describe(),
            quantile(&mut times, 0.5)
        );
    }
    drop(etcd);
    Ok(())
}
