//! Scale benchmark: rendezvous time for many simulated nodes and barrier latency for many
//! simulated ranks, all as tasks sharing a few connections to one coordinator process.
//!
//! Also the NCCL bootstrap's id distribution: every rank asks for its communicator's plan, the
//! roots publish their ids and every rank fetches them all, with one root and with one per 128
//! ranks (`ncclCommInitRankScalable`).
//!
//! `--paths floor` runs the node path's barrier against a bare server that only counts
//! entries and sends results (`muster_bench::floor`): the share of tonic, h2 and the machine.
//!
//! And idling: a formed job of simulated nodes that each hold a lease as an agent does (a
//! watch, heartbeats at the interval the coordinator asks for) stays up for `--idle-secs`
//! with no spurious failure, then still barriers.
//!
//! `cargo run --release -p muster-bench --bin scale -- [--nodes 1000,10000] [--ranks 512,4096]
//! [--bootstrap 4096,16384] [--idle-ranks 100000 --idle-secs 600]`

use clap::Parser;
use muster_bench::{CoordinatorProcess, channels, leads, quantile, rendezvous, rendezvous_with};
use muster_proto::v1 as pb;
use std::time::{Duration, Instant};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;
use tonic::transport::Channel;

#[derive(Parser)]
struct Args {
    /// Simulated node counts for the rendezvous benchmark.
    #[arg(long, value_delimiter = ',', default_value = "1000,10000")]
    nodes: Vec<u32>,
    /// Simulated rank counts for the barrier benchmark.
    #[arg(long, value_delimiter = ',', default_value = "512,4096")]
    ranks: Vec<u32>,
    /// Simulated rank counts for the NCCL bootstrap's id distribution, e.g. 4096,16384 (none
    /// by default: skipped).
    #[arg(long, value_delimiter = ',')]
    bootstrap: Vec<u32>,
    /// Which ways ranks reach the coordinator in the barrier benchmark.
    #[arg(long, value_delimiter = ',', default_value = "sessions,relayed,node")]
    paths: Vec<Path>,
    /// Barriers per rank count.
    #[arg(long, default_value_t = 50)]
    iters: usize,
    /// Connections the simulated clients share.
    #[arg(long, default_value_t = 8)]
    connections: usize,
    /// Simulated ranks (8 per node) of the idle check (0: skipped).
    #[arg(long, default_value_t = 0)]
    idle_ranks: u32,
    /// How long the idle check's job idles, in seconds.
    #[arg(long, default_value_t = 600)]
    idle_secs: u64,
    /// The idle check's coordinator `--heartbeat-timeout-ms` (0: its default, 10 s; the
    /// nodes heartbeat at the interval it gives, a third of it).
    #[arg(long, default_value_t = 0)]
    heartbeat_timeout_ms: u64,
    /// Runs the barrier cases on a coordinator backed by a one-member etcd (the tests'
    /// fixture; needs the `etcd` binary) instead of its memory store, and prints how long the
    /// ranks' registrations took.
    #[arg(long)]
    etcd: bool,
}

/// How the simulated ranks reach the coordinator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Path {
    /// One session stream per rank, which enters each barrier itself.
    Sessions,
    /// One session per rank for liveness, barriers through one relay stream per node.
    Relayed,
    /// Ranks registered through their node's relay stream, no session (issue 29).
    Node,
    /// The node path's streams and messages against a bare server that only counts entries
    /// and sends results (`muster_bench::floor`): the transport's share of a barrier.
    Floor,
}

struct Rank {
    tx: mpsc::Sender<pb::WorkerMessage>,
    rx: tonic::Streaming<pb::CoordinatorMessage>,
}

async fn attach(ch: Channel, job: &str, rank: u32) -> anyhow::Result<Rank> {
    let (tx, rx) = mpsc::channel(4);
    tx.send(pb::WorkerMessage {
        kind: Some(pb::worker_message::Kind::Register(pb::Register {
            job_id: job.into(),
            generation: 1,
            rank,
            pid: rank,
            host: String::new(),
            ..Default::default()
        })),
    })
    .await?;
    let mut stream = pb::session_client::SessionClient::new(ch)
        .attach(ReceiverStream::new(rx))
        .await?
        .into_inner();
    stream.message().await?;
    Ok(Rank { tx, rx: stream })
}

/// Forms `ranks` ranks (8 per node), attaches them all and times `iters` barriers as seen by
/// rank 0 (entry to release). Returns (p50, p99, coordinator bytes per rank).
async fn barriers(
    chs: &[Channel],
    coordinator: &CoordinatorProcess,
    job: &str,
    ranks: u32,
    iters: usize,
    path: Path,
) -> anyhow::Result<(f64, f64, f64)> {
    let local = 8.min(ranks);
    let before = coordinator.rss_bytes();
    rendezvous(chs, job, ranks / local, local).await?;
    if path == Path::Node {
        let t = Instant::now();
        let relays = attach_relays(chs, job, ranks / local, local, true).await?;
        eprintln!(
            "{ranks} ranks: relays attached and ranks registered in {:.0} ms",
            t.elapsed().as_secs_f64() * 1e3
        );
        let per_rank = (coordinator.rss_bytes().saturating_sub(before)) as f64 / f64::from(ranks);
        let (p50, p99) = relay_loops(relays, local, iters).await?;
        return Ok((p50, p99, per_rank));
    }
    let relayed = path == Path::Relayed;
    let mut sessions = Vec::with_capacity(ranks as usize);
    for r in 0..ranks {
        sessions.push(attach(chs[r as usize % chs.len()].clone(), job, r).await?);
    }
    let per_rank = (coordinator.rss_bytes().saturating_sub(before)) as f64 / f64::from(ranks);
    if relayed {
        return relayed_barriers(chs, job, ranks / local, local, sessions, iters)
            .await
            .map(|(p50, p99)| (p50, p99, per_rank));
    }
    let (lat_tx, mut lat_rx) = mpsc::unbounded_channel();
    let mut tasks = vec![];
    for (r, mut s) in sessions.into_iter().enumerate() {
        let lat_tx = lat_tx.clone();
        tasks.push(tokio::spawn(async move {
            for seq in 1..=(iters as u64 + 5) {
                let t = Instant::now();
                s.tx.send(pb::WorkerMessage {
                    kind: Some(pb::worker_message::Kind::Barrier(pb::BarrierEnter {
                        scope: pb::BarrierScope::Global as i32,
                        seq,
                        name: "bench".into(),
                        timeout_ms: 0,
                        trace_context: Default::default(),
                    })),
                })
                .await?;
                let m = s.rx.message().await?;
                if let Some(pb::coordinator_message::Kind::Barrier(b)) = m.and_then(|m| m.kind)
                    && let Some(e) = b.error
                {
                    anyhow::bail!("barrier failed: {}", e.message);
                }
                if r == 0 && seq > 5 {
                    let _ = lat_tx.send(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            s.tx.send(pb::WorkerMessage {
                kind: Some(pb::worker_message::Kind::Leave(pb::Leave {})),
            })
            .await?;
            while s.rx.message().await?.is_some() {}
            anyhow::Ok(())
        }));
    }
    drop(lat_tx);
    for t in tasks {
        t.await??;
    }
    let mut lat = vec![];
    while let Some(x) = lat_rx.recv().await {
        lat.push(x);
    }
    Ok((quantile(&mut lat, 0.5), quantile(&mut lat, 0.99), per_rank))
}

/// The same barriers as agents run them: one relay stream per simulated node enters one group
/// of `local` ranks per barrier; the ranks' sessions only stay alive (heartbeats). Returns
/// (p50, p99) in microseconds as seen by node 0's relay.
async fn relayed_barriers(
    chs: &[Channel],
    job: &str,
    nodes: u32,
    local: u32,
    sessions: Vec<Rank>,
    iters: usize,
) -> anyhow::Result<(f64, f64)> {
    let keepalive: Vec<_> = sessions
        .into_iter()
        .map(|s| {
            tokio::spawn(async move {
                loop {
                    let beat = pb::WorkerMessage {
                        kind: Some(pb::worker_message::Kind::Heartbeat(pb::Heartbeat {})),
                    };
                    if s.tx.send(beat).await.is_err() {
                        return s;
                    }
                    tokio::time::sleep(Duration::from_secs(1)).await;
                }
            })
        })
        .collect();
    let relays = attach_relays(chs, job, nodes, local, false).await?;
    let latencies = relay_loops(relays, local, iters).await;
    for k in keepalive {
        k.abort();
    }
    latencies
}

/// A node's relay stream, as an agent holds it.
struct Relay {
    tx: mpsc::Sender<pb::RelayMessage>,
    rx: tonic::Streaming<pb::RelayEvent>,
    /// The last barrier sequence number the node entered.
    seq: u64,
}

/// Attaches one relay stream per simulated node; with `register`, registers the node's
/// `local` ranks through it (issue 29: no session of their own) and checks each answer.
async fn attach_relays(
    chs: &[Channel],
    job: &str,
    nodes: u32,
    local: u32,
    register: bool,
) -> anyhow::Result<Vec<Relay>> {
    let mut relays = Vec::with_capacity(nodes as usize);
    for node in 0..nodes {
        let (tx, rx) = mpsc::channel(local as usize + 4);
        tx.send(pb::RelayMessage {
            kind: Some(pb::relay_message::Kind::Register(pb::RelayRegister {
                job_id: job.into(),
                generation: 1,
                node_rank: node,
                ..Default::default()
            })),
        })
        .await?;
        let mut stream = pb::relay_client::RelayClient::new(chs[node as usize % chs.len()].clone())
            .attach(ReceiverStream::new(rx))
            .await?
            .into_inner();
        stream.message().await?;
        relays.push(Relay {
            tx,
            rx: stream,
            seq: 0,
        });
    }
    if register {
        for (node, relay) in relays.iter_mut().enumerate() {
            for rank in node as u32 * local..(node as u32 + 1) * local {
                relay
                    .tx
                    .send(pb::RelayMessage {
                        kind: Some(pb::relay_message::Kind::RankRegister(pb::Register {
                            job_id: job.into(),
                            generation: 1,
                            rank,
                            pid: rank,
                            ..Default::default()
                        })),
                    })
                    .await?;
            }
        }
        for relay in &mut relays {
            for _ in 0..local {
                match relay.rx.message().await?.and_then(|m| m.kind) {
                    Some(pb::relay_event::Kind::Rank(pb::RankEvent {
                        kind: Some(pb::rank_event::Kind::Message(_)),
                        ..
                    })) => {}
                    other => anyhow::bail!("a rank's registration was answered {other:?}"),
                }
            }
        }
    }
    Ok(relays)
}

/// Waits until the coordinator behind `ch` leads (it answers a leader-only call): one backed by
/// etcd refuses joins until it has won its election.
async fn leading(ch: &Channel) -> anyhow::Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !leads(ch).await {
        anyhow::ensure!(
            Instant::now() < deadline,
            "the coordinator did not lead within 20 s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    Ok(())
}

/// Runs `iters` (after 5 warm-up) global barriers through `relays`, each entering one group of
/// its `local` ranks; returns (p50, p99) in microseconds as seen by node 0's relay.
async fn relay_loops(relays: Vec<Relay>, local: u32, iters: usize) -> anyhow::Result<(f64, f64)> {
    relay_loops_keeping(relays, local, iters)
        .await
        .map(|(p50, p99, _)| (p50, p99))
}

/// [`relay_loops`], handing the streams back for more barriers (each call's barriers continue
/// the node's sequence).
async fn relay_loops_keeping(
    relays: Vec<Relay>,
    local: u32,
    iters: usize,
) -> anyhow::Result<(f64, f64, Vec<Relay>)> {
    let (lat_tx, mut lat_rx) = mpsc::unbounded_channel();
    let mut tasks = vec![];
    for (
        node,
        Relay {
            tx,
            rx: mut stream,
            seq: first,
        },
    ) in relays.into_iter().enumerate()
    {
        let node = node as u32;
        let ranks: Vec<u32> = (node * local..(node + 1) * local).collect();
        let lat_tx = lat_tx.clone();
        tasks.push(tokio::spawn(async move {
            let last = first + iters as u64 + 5;
            for seq in first + 1..=last {
                let t = Instant::now();
                let groups = vec![pb::BarrierName {
                    name: "bench".into(),
                    ranks: ranks.clone(),
                }];
                tx.send(pb::RelayMessage {
                    kind: Some(pb::relay_message::Kind::Enter(pb::GroupEnter {
                        seq,
                        groups,
                        timeout_ms: 0,
                        trace_context: Default::default(),
                    })),
                })
                .await?;
                let m = stream.message().await?;
                if let Some(pb::relay_event::Kind::Barrier(b)) = m.and_then(|m| m.kind)
                    && let Some(e) = b.error
                {
                    anyhow::bail!("barrier failed: {}", e.message);
                }
                if node == 0 && seq > first + 5 {
                    let _ = lat_tx.send(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            anyhow::Ok(Relay {
                tx,
                rx: stream,
                seq: last,
            })
        }));
    }
    drop(lat_tx);
    // The streams stay open until every node is done, as the job's would.
    let mut done = vec![];
    for t in tasks {
        done.push(t.await??);
    }
    let mut lat = vec![];
    while let Some(x) = lat_rx.recv().await {
        lat.push(x);
    }
    Ok((quantile(&mut lat, 0.5), quantile(&mut lat, 0.99), done))
}

/// Distributes communicator `world`'s NCCL unique ids to `ranks` light clients (tasks) of a
/// formed job: each asks for the plan, each root publishes its id, each rank fetches what it
/// did not make (every id, with several roots). Returns the time from the first plan request
/// to the last rank holding every id, and how many ids there were.
async fn bootstrap(chs: &[Channel], job: &str, ranks: u32) -> anyhow::Result<(Duration, usize)> {
    let local = 8.min(ranks);
    rendezvous(chs, job, ranks / local, local).await?;
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(ranks as usize);
    for rank in 0..ranks {
        let mut ids =
            pb::unique_ids_client::UniqueIdsClient::new(chs[rank as usize % chs.len()].clone());
        let job = job.to_owned();
        tasks.push(tokio::spawn(async move {
            let roots = ids
                .roots(pb::UniqueIdRootsRequest {
                    job_id: job.clone(),
                    generation: 1,
                    rank,
                    communicator: "world".into(),
                })
                .await?
                .into_inner()
                .roots;
            if let Some(root) = roots.iter().position(|&r| r == rank) {
                ids.publish(pb::PublishUniqueIdRequest {
                    job_id: job.clone(),
                    generation: 1,
                    rank,
                    communicator: "world".into(),
                    unique_id: vec![root as u8; 128],
                    root: root as u32,
                })
                .await?;
                if roots.len() == 1 {
                    return Ok(1);
                }
            }
            let fetched = ids
                .fetch(pb::FetchUniqueIdRequest {
                    job_id: job,
                    generation: 1,
                    rank,
                    communicator: "world".into(),
                    all: roots.len() > 1,
                    ..Default::default()
                })
                .await?
                .into_inner();
            anyhow::ensure!(
                roots.len() == 1 || fetched.unique_ids.len() == roots.len(),
                "rank {rank} got {} of {} ids",
                fetched.unique_ids.len(),
                roots.len()
            );
            anyhow::Ok(roots.len())
        }));
    }
    let mut count = 0;
    for t in tasks {
        count = t.await??;
    }
    Ok((started.elapsed(), count))
}

/// Attaches one watch per simulated node of a job formed with leases (node `node-<n>` at node
/// rank `node_ranks[n]`) and heartbeats on each at
/// the interval the coordinator asks for, as an agent does. Every event other than a
/// heartbeat's answer goes to `events` (a spurious failure would be a `GenerationEnded`).
async fn hold_leases(
    chs: &[Channel],
    job: &str,
    node_ranks: &[u32],
    events: mpsc::UnboundedSender<String>,
) -> anyhow::Result<Vec<tokio::task::JoinHandle<()>>> {
    let mut tasks = Vec::with_capacity(node_ranks.len());
    let mut attached = Vec::with_capacity(node_ranks.len());
    // Every node attaches at once, as agents do after their join's answer: the coordinator
    // loses a node whose watch does not attach within the heartbeat timeout.
    for (index, &node) in node_ranks.iter().enumerate() {
        let (ready, answered) = tokio::sync::oneshot::channel::<anyhow::Result<()>>();
        attached.push(answered);
        let (channel, job, events) = (
            chs[node as usize % chs.len()].clone(),
            job.to_owned(),
            events.clone(),
        );
        tasks.push(tokio::spawn(async move {
            let (tx, rx) = mpsc::channel(4);
            let attach = pb::NodeMessage {
                kind: Some(pb::node_message::Kind::Attach(pb::NodeAttach {
                    job_id: job,
                    generation: 1,
                    node_rank: node,
                    node_id: format!("node-{index}"),
                    resume: false,
                    attempt: 0,
                })),
            };
            let opened = async {
                tx.send(attach).await?;
                let mut stream = pb::rendezvous_client::RendezvousClient::new(channel)
                    .watch(ReceiverStream::new(rx))
                    .await?
                    .into_inner();
                match stream.message().await?.and_then(|m| m.kind) {
                    Some(pb::node_event::Kind::Attached(a)) => {
                        anyhow::Ok((stream, Duration::from_millis(a.heartbeat_interval_ms)))
                    }
                    other => anyhow::bail!("node {node}'s watch was answered {other:?}"),
                }
            };
            let (mut stream, interval) = match opened.await {
                Ok(opened) => {
                    let _ = ready.send(Ok(()));
                    opened
                }
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            let mut beat = tokio::time::interval(interval);
            loop {
                tokio::select! {
                    _ = beat.tick() => {
                        let heartbeat = pb::NodeMessage {
                            kind: Some(pb::node_message::Kind::Heartbeat(pb::Heartbeat {})),
                        };
                        if tx.send(heartbeat).await.is_err() {
                            let _ = events.send(format!("node {node}: its watch closed"));
                            return;
                        }
                    }
                    event = stream.message() => match event {
                        Ok(Some(pb::NodeEvent { kind: Some(pb::node_event::Kind::Heartbeat(_)) })) => {}
                        Ok(Some(other)) => {
                            let _ = events.send(format!("node {node}: {other:?}"));
                        }
                        Ok(None) | Err(_) => {
                            let _ = events.send(format!("node {node}: its watch ended: {event:?}"));
                            return;
                        }
                    },
                }
            }
        }));
    }
    for answered in attached {
        answered.await??;
    }
    Ok(tasks)
}

/// The idle check: `ranks` simulated ranks (8 per node) form with leases, register through
/// their node's relay, barrier, idle for `idle`, and barrier again. Prints what the
/// coordinator's leases and the relays saw.
async fn idle_check(args: &Args) -> anyhow::Result<()> {
    let (ranks, idle) = (args.idle_ranks, Duration::from_secs(args.idle_secs));
    let (iters, connections) = (args.iters, args.connections);
    let local = 8.min(ranks);
    let nodes = ranks / local;
    let job = format!("idle-{ranks}");
    let coordinator = CoordinatorProcess::start_with(|cmd| {
        if args.heartbeat_timeout_ms > 0 {
            cmd.args([
                "--heartbeat-timeout-ms",
                &args.heartbeat_timeout_ms.to_string(),
            ]);
        }
    })?;
    let chs = channels(coordinator.addr, connections).await?;
    let formed = Instant::now();
    let node_ranks = rendezvous_with(&chs, &job, nodes, local, true)
        .await?
        .node_ranks;
    let (events_tx, mut events) = mpsc::unbounded_channel();
    let leases = hold_leases(&chs, &job, &node_ranks, events_tx).await?;
    let relays = attach_relays(&chs, &job, nodes, local, true).await?;
    let formed = formed.elapsed();
    let (p50, p99, relays) = relay_loops_keeping(relays, local, iters).await?;
    let rss_before = coordinator.rss_bytes();
    let started = Instant::now();
    let mut seen = vec![];
    while started.elapsed() < idle {
        tokio::time::sleep(Duration::from_secs(1)).await;
        while let Ok(event) = events.try_recv() {
            seen.push(event);
        }
    }
    let rss_after = coordinator.rss_bytes();
    let (after_p50, after_p99, _) = relay_loops_keeping(relays, local, iters).await?;
    while let Ok(event) = events.try_recv() {
        seen.push(event);
    }
    println!(
        "| simulated ranks | formed with leases | barrier p50 / p99 before | idle | events on the watches | barrier p50 / p99 after | coordinator RSS before / after idling |"
    );
    println!("| --- | --- | --- | --- | --- | --- | --- |");
    println!(
        "| {ranks} ({nodes} nodes) | {:.1} s | {:.1} / {:.1} ms | {} s | {} | {:.1} / {:.1} ms | {:.0} / {:.0} MiB |",
        formed.as_secs_f64(),
        p50 / 1e3,
        p99 / 1e3,
        idle.as_secs(),
        seen.len(),
        after_p50 / 1e3,
        after_p99 / 1e3,
        rss_before as f64 / f64::from(1 << 20),
        rss_after as f64 / f64::from(1 << 20),
    );
    for event in seen.iter().take(10) {
        println!("event: {event}");
    }
    for lease in leases {
        lease.abort();
    }
    anyhow::ensure!(seen.is_empty(), "{} spurious events while idle", seen.len());
    Ok(())
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.idle_ranks > 0 {
        return idle_check(&args).await;
    }
    let coordinator = CoordinatorProcess::start()?;
    let chs = channels(coordinator.addr, args.connections).await?;
    println!(
        "| simulated nodes | rendezvous (last join -> all assigned) | joins (first join -> all but one in) |"
    );
    println!("| --- | --- | --- |");
    for &n in &args.nodes {
        let (mut took, mut joins) = (vec![], vec![]);
        for i in 0..3 {
            let r = rendezvous_with(&chs, &format!("rdzv-{n}-{i}"), n, 1, false).await?;
            took.push(r.took.as_secs_f64() * 1e3);
            joins.push(r.joins.as_secs_f64() * 1e3);
        }
        println!(
            "| {n} | {:.1} ms (median of 3) | {:.0} ms (median of 3) |",
            quantile(&mut took, 0.5),
            quantile(&mut joins, 0.5)
        );
    }
    drop(chs);
    drop(coordinator);
    println!();
    println!(
        "| simulated ranks | path | barrier p50 | barrier p99 | coordinator memory per rank |"
    );
    println!("| --- | --- | --- | --- | --- |");
    for &r in &args.ranks {
        for &path in &args.paths {
            if path == Path::Floor {
                let local = 8.min(r);
                let floor = muster_bench::floor::start((r / local) as usize)?;
                let chs = channels(floor.addr, args.connections).await?;
                let relays = attach_relays(&chs, "floor", r / local, local, false).await?;
                let (p50, p99) = relay_loops(relays, local, args.iters).await?;
                println!(
                    "| {r} | the floor: the node path's streams against a bare server | {p50:.0} us | {p99:.0} us | - |"
                );
                continue;
            }
            // A fresh coordinator per case, so its memory growth is this case's alone.
            let etcd = if args.etcd {
                Some(
                    muster_tests::etcd::Etcd::start(1)
                        .ok_or_else(|| anyhow::anyhow!("--etcd needs the etcd binary"))?,
                )
            } else {
                None
            };
            let coordinator = CoordinatorProcess::start_with(|cmd| {
                if let Some(etcd) = &etcd {
                    cmd.args(["--store", "etcd", "--etcd-endpoints", &etcd.endpoints_arg()]);
                }
            })?;
            let chs = channels(coordinator.addr, args.connections).await?;
            if etcd.is_some() {
                leading(&chs[0]).await?;
            }
            let (p50, p99, per_rank) =
                barriers(&chs, &coordinator, &format!("bar-{r}"), r, args.iters, path).await?;
            let path = match path {
                Path::Sessions => "1 session per rank",
                Path::Relayed => "relayed: 1 group per 8-rank node",
                Path::Node | Path::Floor => {
                    "node stream only: ranks registered through their relay"
                }
            };
            println!(
                "| {r} | {path} | {p50:.0} us | {p99:.0} us | {:.1} KiB |",
                per_rank / 1024.0
            );
        }
    }
    if args.bootstrap.is_empty() {
        return Ok(());
    }
    println!();
    println!(
        "| simulated ranks | ranks per root | unique ids | plan, publish and fetch (all ranks) |"
    );
    println!("| --- | --- | --- | --- |");
    for &r in &args.bootstrap {
        for per_root in [0u32, 128] {
            let coordinator = CoordinatorProcess::start_with(|cmd| {
                cmd.args(["--nccl-ranks-per-root", &per_root.to_string()]);
            })?;
            let chs = channels(coordinator.addr, args.connections).await?;
            let (took, ids) = bootstrap(&chs, &format!("boot-{r}-{per_root}"), r).await?;
            println!(
                "| {r} | {} | {ids} | {:.0} ms |",
                if per_root == 0 {
                    "one root".to_owned()
                } else {
                    per_root.to_string()
                },
                took.as_secs_f64() * 1e3
            );
        }
    }
    Ok(())
}
