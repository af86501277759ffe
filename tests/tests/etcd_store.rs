//! The coordinator's etcd store against real etcd servers (`muster_tests::etcd::Etcd`): the
//! same conformance checks for `MemoryStore` and `EtcdStore`, a `muster-coordinator --store
//! etcd` process whose key-value data and unique ids survive its SIGKILL, a start without etcd
//! (a refusing follower; with a user, a bounded failure), flag validation, and a three-member
//! cluster losing a member.
//! Tests that need etcd skip (printing why) where it is not installed.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_coordinator::config::EtcdConfig;
use muster_coordinator::{EtcdStore, MemoryStore, Store};
use muster_proto::v1 as pb;
use muster_tests::coordinator::Coordinator;
use muster_tests::etcd::Etcd;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tonic::Code;
use tonic::transport::Channel;

/// The coordinator's default `max_value_bytes` (1 MiB): the largest value the store must hold.
const MAX_VALUE: usize = 1 << 20;

async fn etcd_store(etcd: &Etcd, prefix: &str) -> EtcdStore {
    EtcdStore::connect(&EtcdConfig {
        endpoints: etcd.endpoints(),
        prefix: Some(prefix.into()),
        ..EtcdConfig::default()
    })
    .await
    .unwrap()
}

fn v(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// Everything the coordinator relies on from a `Store`, on `s`; `other` is a second store that
/// must not see `s`'s keys (another etcd prefix, another memory map).
async fn conformance(s: Arc<dyn Store>, other: Arc<dyn Store>) {
    // get / put / overwrite.
    assert_eq!(s.get("jobs/j/kv/a").await.unwrap(), None);
    s.put("jobs/j/kv/a", v("1")).await.unwrap();
    assert_eq!(s.get("jobs/j/kv/a").await.unwrap(), Some(v("1")));
    s.put("jobs/j/kv/a", v("2")).await.unwrap();
    assert_eq!(s.get("jobs/j/kv/a").await.unwrap(), Some(v("2")));
    // An empty value is a value, not an absence.
    s.put("jobs/j/kv/empty", vec![]).await.unwrap();
    assert_eq!(s.get("jobs/j/kv/empty").await.unwrap(), Some(vec![]));
    // The largest value a job's store takes (torch's 8 MiB, the coordinator's default
    // max_value_bytes) under the longest key: one etcd request, with etcd's
    // --max-request-bytes as docs/ha.md asks.
    let key = format!(
        "jobs/j/kv/{}",
        "k".repeat(muster_core::model::MAX_KV_KEY_BYTES)
    );
    let big: Vec<u8> = (0..8 << 20).map(|i| (i % 251) as u8).collect();
    s.put(&key, big.clone()).await.unwrap();
    assert!(s.get(&key).await.unwrap() == Some(big));
    s.delete(&key).await.unwrap();

    // create-if-absent: the first wins, later ones read it and change nothing.
    assert_eq!(s.create("jobs/j/gen/1/nccl/w", v("x")).await.unwrap(), None);
    assert_eq!(
        s.create("jobs/j/gen/1/nccl/w", v("y")).await.unwrap(),
        Some(v("x"))
    );
    assert_eq!(s.get("jobs/j/gen/1/nccl/w").await.unwrap(), Some(v("x")));
    // Concurrent creates agree on one winner.
    let racers: Vec<_> = (0..16u8)
        .map(|i| {
            let s = Arc::clone(&s);
            tokio::spawn(async move { (i, s.create("jobs/j/race", vec![i; 64]).await.unwrap()) })
        })
        .collect();
    let mut winners = vec![];
    let mut seen = vec![];
    for r in racers {
        match r.await.unwrap() {
            (i, None) => winners.push(i),
            (_, Some(existing)) => seen.push(existing),
        }
    }
    assert_eq!(winners.len(), 1, "exactly one create wins: {winners:?}");
    let won = vec![winners[0]; 64];
    assert!(
        seen.iter().all(|e| *e == won),
        "every loser reads the winner"
    );
    assert_eq!(s.get("jobs/j/race").await.unwrap(), Some(won));

    // delete says whether the key existed.
    assert!(s.delete("jobs/j/kv/a").await.unwrap());
    assert!(!s.delete("jobs/j/kv/a").await.unwrap());
    assert_eq!(s.get("jobs/j/kv/a").await.unwrap(), None);
    // A deleted key can be created again.
    assert_eq!(s.create("jobs/j/kv/a", v("3")).await.unwrap(), None);

    // write_all: every key or none (a key named twice is refused before anything is written).
    let both = |x: &str| {
        vec![
            ("jobs/j/kv/n".to_owned(), Some(v(x))),
            ("jobs/j/applied/lane".to_owned(), Some(v(x))),
        ]
    };
    s.write_all(both("1")).await.unwrap();
    let mut twice = both("2");
    twice.push(("jobs/j/kv/n".to_owned(), None));
    assert!(s.write_all(twice).await.is_err());
    assert!(s.write_all(Vec::new()).await.is_err());
    for (key, _) in both("") {
        assert_eq!(s.get(&key).await.unwrap(), Some(v("1")), "{key}");
    }
    // A delete and a put in one transaction (a lane's delete and its record).
    s.write_all(vec![
        ("jobs/j/kv/n".to_owned(), None),
        ("jobs/j/applied/lane".to_owned(), Some(v("2"))),
    ])
    .await
    .unwrap();
    assert_eq!(s.get("jobs/j/kv/n").await.unwrap(), None);
    assert_eq!(s.get("jobs/j/applied/lane").await.unwrap(), Some(v("2")));
    assert!(s.delete("jobs/j/applied/lane").await.unwrap());

    // Binary values: every byte, NULs and invalid UTF-8 included; non-ASCII keys.
    let binary: Vec<u8> = (0..=255u8).chain([0, 0, 0xff, 0xfe, 0xc0]).collect();
    s.put("jobs/j/kv/bïn", binary.clone()).await.unwrap();
    assert_eq!(s.get("jobs/j/kv/bïn").await.unwrap(), Some(binary));

    // list: only the prefix, in key order; a prefix is a string prefix, not a directory.
    for k in ["l/b", "l/a", "l/c/d", "lx", "l"] {
        s.put(k, v(k)).await.unwrap();
    }
    let listed = s.list("l/").await.unwrap();
    let keys: Vec<&str> = listed.iter().map(|(k, _)| k.as_str()).collect();
    assert_eq!(keys, ["l/a", "l/b", "l/c/d"]);
    assert!(listed.iter().all(|(k, val)| *val == v(k)));
    assert_eq!(s.list("l/c/").await.unwrap().len(), 1);
    assert!(s.list("nothing/").await.unwrap().is_empty());
    let all = s.list("l").await.unwrap();
    assert_eq!(all.len(), 5, "{all:?}");

    // delete_prefix removes what list shows, nothing else.
    assert_eq!(s.delete_prefix("l/").await.unwrap(), 3);
    assert!(s.list("l/").await.unwrap().is_empty());
    assert_eq!(s.get("lx").await.unwrap(), Some(v("lx")));
    assert_eq!(s.get("l").await.unwrap(), Some(v("l")));
    assert_eq!(s.delete_prefix("l/").await.unwrap(), 0);

    // Values at the coordinator's limit; a list larger than a gRPC message's default 4 MiB.
    let big: Vec<u8> = (0..MAX_VALUE).map(|i| (i * 7 % 251) as u8).collect();
    for i in 0..6 {
        let mut value = big.clone();
        value[0] = i;
        s.put(&format!("big/{i}"), value).await.unwrap();
    }
    assert_eq!(s.get("big/3").await.unwrap().unwrap()[1..], big[1..]);
    assert_eq!(
        s.create("big/3", vec![]).await.unwrap().unwrap().len(),
        MAX_VALUE
    );
    let listed = s.list("big/").await.unwrap();
    assert_eq!(listed.len(), 6);
    assert!(listed.iter().all(|(_, val)| val.len() == MAX_VALUE));
    assert_eq!(s.delete_prefix("big/").await.unwrap(), 6);

    // Isolation: the other store sees none of this, and its writes do not reach `s`.
    assert_eq!(other.get("jobs/j/race").await.unwrap(), None);
    assert!(other.list("").await.unwrap().is_empty());
    other.put("jobs/j/kv/empty", v("other")).await.unwrap();
    assert_eq!(s.get("jobs/j/kv/empty").await.unwrap(), Some(vec![]));
    assert_eq!(s.delete_prefix("").await.unwrap(), 7);
    assert!(s.list("").await.unwrap().is_empty());
    assert_eq!(
        other.list("").await.unwrap(),
        [("jobs/j/kv/empty".to_owned(), v("other"))]
    );
}

#[tokio::test]
async fn memory_store_conformance() {
    conformance(
        Arc::new(MemoryStore::default()),
        Arc::new(MemoryStore::default()),
    )
    .await;
}

#[tokio::test]
async fn etcd_store_conformance() {
    let Some(etcd) = Etcd::start(1) else { return };
    let started = Instant::now();
    let a = etcd_store(&etcd, "/conformance-a/").await;
    let b = etcd_store(&etcd, "/conformance-a-b/").await;
    assert_eq!(a.prefix(), "/conformance-a/");
    conformance(Arc::new(a), Arc::new(b)).await;
    eprintln!("etcd conformance: {:?}", started.elapsed());
}

#[tokio::test]
async fn etcd_store_errors_name_the_endpoints_and_recover() {
    let Some(mut etcd) = Etcd::start(1) else {
        return;
    };
    let s = etcd_store(&etcd, "/recover/").await;
    s.put("k", v("before")).await.unwrap();
    etcd.kill(0);
    let t = Instant::now();
    let e = s.get("k").await.unwrap_err().to_string();
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    assert!(e.contains(&etcd.endpoints_arg()), "{e}");
    assert!(e.contains("/recover/k"), "{e}");
    assert!(!e.contains('\n'), "{e}");
    etcd.restart(0);
    // The same store reconnects by itself.
    let t = Instant::now();
    loop {
        match s.get("k").await {
            Ok(got) => {
                assert_eq!(got, Some(v("before")));
                break;
            }
            Err(e) if t.elapsed() < Duration::from_secs(15) => {
                eprintln!("not yet: {e}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the store did not recover: {e}"),
        }
    }
    eprintln!("recovered {:?} after the restart", t.elapsed());
}

/// Keeps calling `op` until it succeeds (at most `limit`), returning how long that took.
async fn until_ok<F, Fut>(limit: Duration, mut op: F) -> Duration
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<(), muster_coordinator::StoreError>>,
{
    let t = Instant::now();
    loop {
        match op().await {
            Ok(()) => return t.elapsed(),
            Err(e) if t.elapsed() < limit => {
                eprintln!("retrying: {e}");
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
            Err(e) => panic!("no success within {limit:?}: {e}"),
        }
    }
}

#[tokio::test]
async fn three_member_cluster_survives_one_member() {
    let Some(mut etcd) = Etcd::start(3) else {
        return;
    };
    let s = etcd_store(&etcd, "/quorum/").await;
    s.put("before", v("1")).await.unwrap();
    for victim in [0, 2] {
        let pid = etcd.pid(victim);
        etcd.kill(victim);
        eprintln!("killed member {victim} (pid {pid})");
        // The first writes may meet the dead member's connection, or a proposal lost with a
        // dead raft leader (it times out after OP_TIMEOUT) while the other two elect a new
        // one; then quorum serves every call.
        let settle = until_ok(Duration::from_secs(30), || async {
            s.put(&format!("after-{victim}"), v("x")).await
        })
        .await;
        eprintln!("first write after killing member {victim}: {settle:?}");
        let t = Instant::now();
        for i in 0..50 {
            let k = format!("loop-{victim}-{i}");
            s.put(&k, v("y")).await.unwrap();
            assert_eq!(s.get(&k).await.unwrap(), Some(v("y")));
            assert_eq!(s.create(&k, v("z")).await.unwrap(), Some(v("y")));
        }
        eprintln!("150 operations on two members: {:?}", t.elapsed());
        assert_eq!(s.get("before").await.unwrap(), Some(v("1")));
        etcd.restart(victim);
    }
    // Every member has everything, the restarted ones included.
    for (i, endpoint) in etcd.endpoints().into_iter().enumerate() {
        let one = EtcdStore::connect(&EtcdConfig {
            endpoints: vec![endpoint],
            prefix: Some("/quorum/".into()),
            ..EtcdConfig::default()
        })
        .await
        .unwrap();
        let n = one.list("loop-").await.unwrap().len();
        assert_eq!(n, 100, "member {i} has {n} loop keys");
    }
}

/// A channel to the coordinator at `addr` once it serves (over etcd: once it leads).
async fn channel(addr: &str) -> Channel {
    let endpoint = Channel::from_shared(format!("http://{addr}")).unwrap();
    let t = Instant::now();
    while t.elapsed() < Duration::from_secs(15) {
        if let Ok(c) = endpoint.connect().await {
            let mut ops = pb::ops_client::OpsClient::new(c.clone());
            match ops.list_jobs(pb::ListJobsRequest {}).await {
                Ok(_) => return c,
                Err(e) => assert_eq!(e.code(), Code::Unavailable, "{e:?}"),
            }
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("coordinator at {addr} did not come up");
}

/// Forms job `job` of one node with `local` workers; returns its generation.
async fn form(ch: &Channel, job: &str, local: u32) -> u64 {
    let r = pb::rendezvous_client::RendezvousClient::new(ch.clone())
        .join(pb::JoinRequest {
            job_id: job.into(),
            node_id: "n0".into(),
            host: "host-n0".into(),
            local_world_size: local,
            requested_node_rank: None,
            config: Some(pb::RendezvousConfig {
                min_nodes: 1,
                max_nodes: 1,
                last_call_ms: 0,
                join_timeout_ms: 60_000,
                max_restarts: None,
                recovery: 0,
                ..Default::default()
            }),
            request_id: String::new(),
            watches: false,
            spare: false,
        })
        .await
        .unwrap()
        .into_inner();
    r.generation
}

fn kv(ch: &Channel) -> pb::key_value_client::KeyValueClient<Channel> {
    pb::key_value_client::KeyValueClient::new(ch.clone())
}

async fn kv_get(ch: &Channel, job: &str, key: &str) -> Result<Vec<u8>, tonic::Status> {
    kv(ch)
        .get(pb::GetRequest {
            job_id: job.into(),
            key: key.into(),
            wait_ms: 0,
        })
        .await
        .map(|r| r.into_inner().value)
}

#[tokio::test]
async fn coordinator_state_survives_its_restart_on_etcd() {
    let Some(mut etcd) = Etcd::start(1) else {
        return;
    };
    let args = [
        "--store",
        "etcd",
        "--etcd-endpoints",
        &etcd.endpoints_arg(),
        "--etcd-prefix",
        "/restart/",
    ];
    // One NCCL bootstrap root per rank before the restart; the default (128) after it.
    let first_args = [&args[..], &["--nccl-ranks-per-root", "1"]].concat();
    let coordinator = Coordinator::start(&first_args);
    let ch = channel(&coordinator.addr).await;
    let generation = form(&ch, "persist", 2).await;
    let big: Vec<u8> = (0..MAX_VALUE).map(|i| (i % 253) as u8).collect();
    for (key, value) in [
        ("a", v("alpha")),
        ("dir/b", vec![0, 1, 2, 255]),
        ("big", big.clone()),
    ] {
        kv(&ch)
            .set(pb::SetRequest {
                job_id: "persist".into(),
                key: key.into(),
                value,
                ..Default::default()
            })
            .await
            .unwrap();
    }
    let counter = kv(&ch)
        .add(pb::AddRequest {
            job_id: "persist".into(),
            key: "count".into(),
            delta: 5,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .value;
    assert_eq!(counter, 5);
    let id: Vec<u8> = (0..128).map(|i| i as u8 ^ 0x5a).collect();
    let mut ids = pb::unique_ids_client::UniqueIdsClient::new(ch.clone());
    ids.publish(pb::PublishUniqueIdRequest {
        job_id: "persist".into(),
        generation,
        rank: 0,
        communicator: "world".into(),
        unique_id: id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    let fetched = ids
        .fetch(pb::FetchUniqueIdRequest {
            job_id: "persist".into(),
            generation,
            rank: 1,
            communicator: "world".into(),
            wait_ms: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(fetched.unique_id, id);
    // A communicator planned with a root per rank, both ids published.
    let roots = |rank| pb::UniqueIdRootsRequest {
        job_id: "persist".into(),
        generation,
        rank,
        communicator: "scaled".into(),
    };
    assert_eq!(
        ids.roots(roots(1)).await.unwrap().into_inner().roots,
        [0, 1]
    );
    for root in [0, 1] {
        ids.publish(pb::PublishUniqueIdRequest {
            job_id: "persist".into(),
            generation,
            rank: root,
            communicator: "scaled".into(),
            unique_id: vec![root as u8; 128],
            root,
        })
        .await
        .unwrap();
    }

    // SIGKILL (Coordinator's drop), then a new process on the same etcd.
    let old_pid = coordinator.pid();
    drop(coordinator);
    let t = Instant::now();
    let coordinator = Coordinator::start(&args);
    assert_ne!(coordinator.pid(), old_pid);
    let ch = channel(&coordinator.addr).await;
    eprintln!("restarted coordinator serving after {:?}", t.elapsed());

    // The stored state, as the store holds it: the unique id with its publisher's rank.
    let store = etcd_store(&etcd, "/restart/").await;
    let stored = store
        .list("jobs/persist/gen/")
        .await
        .unwrap()
        .into_iter()
        .find(|(key, _)| key.ends_with(&format!("-{generation}/nccl/world")))
        .map(|(_, value)| value)
        .expect("the unique id survives the coordinator");
    assert_eq!(stored[..4], 0u32.to_le_bytes());
    assert_eq!(stored[4..], id);

    // The job itself is stored: once the new process leads (the old one's election lease
    // expires first), the same generation runs and serves the same unique id.
    let t = Instant::now();
    while let Err(e) = kv_get(&ch, "persist", "a").await {
        assert_eq!(e.code(), Code::Unavailable, "{e:?}");
        assert!(t.elapsed() < Duration::from_secs(10), "not leading: {e:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    eprintln!(
        "restarted coordinator leading {:?} after it started",
        t.elapsed()
    );
    let summary = pb::ops_client::OpsClient::new(ch.clone())
        .list_jobs(pb::ListJobsRequest {})
        .await
        .unwrap()
        .into_inner();
    let job = summary
        .jobs
        .iter()
        .find(|j| j.job_id == "persist")
        .expect("the job survives the coordinator");
    assert_eq!(job.generation, generation);
    assert_eq!(job.world_size, 2);
    let again = pb::unique_ids_client::UniqueIdsClient::new(ch.clone())
        .fetch(pb::FetchUniqueIdRequest {
            job_id: "persist".into(),
            generation,
            rank: 1,
            communicator: "world".into(),
            wait_ms: 0,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(again.unique_id, id);
    // The plan made before the restart stands, though this process would plan one root.
    let mut ids = pb::unique_ids_client::UniqueIdsClient::new(ch.clone());
    let plan = ids.roots(roots(0)).await.unwrap().into_inner();
    assert_eq!((plan.roots, plan.ranks_per_root), (vec![0, 1], 1));
    let all = ids
        .fetch(pb::FetchUniqueIdRequest {
            job_id: "persist".into(),
            generation,
            rank: 1,
            communicator: "scaled".into(),
            all: true,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(all.unique_ids, [vec![0; 128], vec![1; 128]]);
    assert_eq!(kv_get(&ch, "persist", "a").await.unwrap(), v("alpha"));
    assert_eq!(kv_get(&ch, "persist", "big").await.unwrap(), big);
    assert_eq!(kv_get(&ch, "persist", "count").await.unwrap(), v("5"));
    let listed = kv(&ch)
        .list(pb::ListRequest {
            job_id: "persist".into(),
            prefix: "dir/".into(),
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(listed.items.len(), 1);
    assert_eq!(listed.items[0].key, "dir/b");
    assert_eq!(listed.items[0].value, [0, 1, 2, 255]);
    let counter = kv(&ch)
        .add(pb::AddRequest {
            job_id: "persist".into(),
            key: "count".into(),
            delta: 1,
            ..Default::default()
        })
        .await
        .unwrap()
        .into_inner()
        .value;
    assert_eq!(counter, 6);

    // etcd gone: the RPC fails UNAVAILABLE, naming the endpoints, within the store's timeout.
    etcd.kill(0);
    let t = Instant::now();
    let e = kv_get(&ch, "persist", "a").await.unwrap_err();
    assert_eq!(e.code(), Code::Unavailable, "{e:?}");
    // The store's error names the endpoints; once the election lease has run out, the
    // coordinator has stepped down and says so.
    assert!(
        e.message().contains(&etcd.endpoints_arg()) || e.message().contains("not the leader"),
        "{e:?}"
    );
    assert!(t.elapsed() < Duration::from_secs(8), "{:?}", t.elapsed());
    // And back: the coordinator recovers without a restart.
    etcd.restart(0);
    let t = Instant::now();
    loop {
        match kv_get(&ch, "persist", "a").await {
            Ok(value) => {
                assert_eq!(value, v("alpha"));
                break;
            }
            Err(e) if t.elapsed() < Duration::from_secs(15) => {
                assert_eq!(e.code(), Code::Unavailable, "{e:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("the coordinator did not recover: {e:?}"),
        }
    }
}

/// Runs the coordinator with `args` (and `env`) until it exits, at most `limit`; returns the
/// exit code, its stderr lines and how long it ran.
fn run_coordinator(
    args: &[&str],
    env: &[(&str, &str)],
    limit: Duration,
) -> (i32, Vec<String>, Duration) {
    let bin = muster_tests::coordinator_bin();
    let t = Instant::now();
    let mut child = Command::new(&bin)
        .args(["--listen", "127.0.0.1:0"])
        .args(args)
        .envs(env.iter().copied())
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    loop {
        if let Some(status) = child.try_wait().unwrap() {
            let mut stderr = String::new();
            std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut stderr).unwrap();
            let lines = stderr.lines().map(str::to_owned).collect();
            return (status.code().unwrap_or(-1), lines, t.elapsed());
        }
        if t.elapsed() > limit {
            let _ = child.kill();
            let _ = child.wait();
            panic!("muster-coordinator {args:?} still running after {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// A replica started while etcd does not answer comes up as a follower that refuses every call
/// as not the leader, and leads once etcd answers. One that exited instead left its port
/// refusing connections, so clients' census of the replicas never completed through an etcd
/// outage and the jobs restarted (the fault suite's finding 8).
#[tokio::test]
async fn a_coordinator_started_without_etcd_refuses_as_a_follower_then_leads() {
    let Some(mut etcd) = Etcd::start(1) else {
        return;
    };
    let endpoints = etcd.endpoints_arg();
    etcd.kill(0);
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let dir = std::env::temp_dir().join(format!("muster-etcd-late-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let log = dir.join("stderr");
    let mut child = Command::new(muster_tests::coordinator_bin())
        .args(["--listen", &addr, "--store", "etcd", "--etcd-endpoints"])
        .arg(&endpoints)
        .env("NO_COLOR", "1")
        .env_remove("RUST_LOG")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let started = Instant::now();
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(
            child.try_wait().unwrap().is_none(),
            "it exited: {}",
            std::fs::read_to_string(&log).unwrap()
        );
        assert!(started.elapsed() < Duration::from_secs(10), "not listening");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let ch = Channel::from_shared(format!("http://{addr}"))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let refused = kv_get(&ch, "late", "k").await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(
        muster_core::failover::not_leading(&refused),
        "not a refusal as not the leader: {refused:?}"
    );
    etcd.restart_retrying(0);
    let back = Instant::now();
    let answer = loop {
        match kv_get(&ch, "late", "k").await {
            Err(s) if s.code() == Code::Unavailable => {
                assert!(back.elapsed() < Duration::from_secs(30), "never led: {s:?}");
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            other => break other,
        }
    };
    // Leading: the job is unknown, not refused.
    assert_eq!(answer.unwrap_err().code(), Code::NotFound);
    let _ = child.kill();
    let _ = child.wait();
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(
        stderr
            .lines()
            .any(|l| l.contains("etcd does not answer") && l.contains(&endpoints)),
        "no warning naming the endpoints: {stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// With a user, connecting authenticates, so a coordinator cannot start without etcd: it exits
/// with one line naming the endpoints, within seconds.
#[test]
fn unreachable_etcd_fails_startup_quickly_with_a_user() {
    // Nothing listens: refused at once.
    let refused = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let refused_addr = refused.local_addr().unwrap().to_string();
    drop(refused);
    // Accepts TCP connections but never speaks: only the connect timeout ends the wait.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let silent_addr = silent.local_addr().unwrap().to_string();
    let dir = std::env::temp_dir().join(format!("muster-etcd-store-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let password_file = dir.join("password");
    std::fs::write(&password_file, "s3cret-pw\n").unwrap();
    let user = [
        "--etcd-user",
        "muster",
        "--etcd-password-file",
        password_file.to_str().unwrap(),
    ];
    for endpoint in [&refused_addr, &silent_addr] {
        let mut args = vec!["--store", "etcd", "--etcd-endpoints", endpoint];
        args.extend_from_slice(&user);
        let (code, stderr, elapsed) = run_coordinator(&args, &[], Duration::from_secs(15));
        eprintln!("{endpoint}: exit {code} after {elapsed:?}: {stderr:?}");
        assert_eq!(code, 1, "{stderr:?}");
        assert_eq!(stderr.len(), 1, "one line: {stderr:?}");
        assert!(stderr[0].contains(endpoint.as_str()), "{stderr:?}");
        assert!(
            !stderr[0].contains("s3cret"),
            "the password leaked: {stderr:?}"
        );
        assert!(elapsed < Duration::from_secs(8), "{elapsed:?}");
    }
    // A password file that cannot be read is named.
    let (code, stderr, _) = run_coordinator(
        &[
            "--store",
            "etcd",
            "--etcd-endpoints",
            &refused_addr,
            "--etcd-user",
            "muster",
            "--etcd-password-file",
            "/nonexistent/password",
        ],
        &[],
        Duration::from_secs(15),
    );
    assert_eq!(code, 1, "{stderr:?}");
    assert_eq!(stderr.len(), 1, "{stderr:?}");
    assert!(stderr[0].contains("/nonexistent/password"), "{stderr:?}");
    drop(silent);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Flags, environment, and what the one line must say.
type Case<'a> = (&'a [&'a str], &'a [(&'a str, &'a str)], &'a str);

#[test]
fn bad_store_flags_exit_64_with_one_line() {
    let dir = std::env::temp_dir().join(format!("muster-etcd-flags-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let config = dir.join("coordinator.toml");
    std::fs::write(
        &config,
        "store = \"etcd\"\netcd_endpoints = [\"127.0.0.1:2379\", \"x\"]\n",
    )
    .unwrap();
    let config = config.to_str().unwrap();
    let cases: &[Case<'_>] = &[
        (
            &["--etcd-endpoints", "127.0.0.1:2379"],
            &[],
            "--etcd-endpoints needs --store etcd",
        ),
        (
            &["--etcd-prefix", "/x/"],
            &[],
            "--etcd-prefix needs --store etcd",
        ),
        (
            &["--etcd-ca", "/ca.pem"],
            &[],
            "--etcd-ca needs --store etcd",
        ),
        (
            &["--store", "memory", "--etcd-user", "u"],
            &[],
            "--etcd-user needs --store etcd",
        ),
        (
            &["--store", "etcd"],
            &[],
            "--store etcd needs --etcd-endpoints",
        ),
        (
            &["--store", "etcd", "--etcd-endpoints", " , "],
            &[],
            "needs --etcd-endpoints",
        ),
        (
            &["--store", "etcd", "--etcd-endpoints", "localhost"],
            &[],
            "'localhost' is not host:port",
        ),
        (
            &["--store", "etcd", "--etcd-endpoints", "a:1,b:99999"],
            &[],
            "'b:99999' is not host:port",
        ),
        (
            &["--store", "etcd", "--etcd-endpoints", "ftp://a:1"],
            &[],
            "scheme 'ftp'",
        ),
        (
            &["--store", "etcd", "--etcd-endpoints", "https://a:1"],
            &[],
            "is https, which needs --etcd-ca",
        ),
        (
            &[
                "--store",
                "etcd",
                "--etcd-endpoints",
                "http://a:1",
                "--etcd-ca",
                "/ca.pem",
            ],
            &[],
            "plain http, but TLS options are set",
        ),
        (
            &[
                "--store",
                "etcd",
                "--etcd-endpoints",
                "a:1",
                "--etcd-prefix",
                "muster",
            ],
            &[],
            "--etcd-prefix must start and end with '/'",
        ),
        (
            &[
                "--store",
                "etcd",
                "--etcd-endpoints",
                "a:1",
                "--etcd-cert",
                "/c.pem",
            ],
            &[],
            "--etcd-cert needs --etcd-key",
        ),
        (
            &[
                "--store",
                "etcd",
                "--etcd-endpoints",
                "a:1",
                "--etcd-key",
                "/k.pem",
            ],
            &[],
            "--etcd-key needs --etcd-cert",
        ),
        (
            &[
                "--store",
                "etcd",
                "--etcd-endpoints",
                "a:1",
                "--etcd-user",
                "u",
            ],
            &[],
            "--etcd-user needs --etcd-password-file",
        ),
        (
            &[
                "--store",
                "etcd",
                "--etcd-endpoints",
                "a:1",
                "--etcd-password-file",
                "/p",
            ],
            &[],
            "--etcd-password-file needs --etcd-user",
        ),
        // The environment and the config file are layers like the flags.
        (
            &[],
            &[("MUSTER_COORDINATOR_STORE", "etcd")],
            "--store etcd needs --etcd-endpoints",
        ),
        (
            &[],
            &[("MUSTER_COORDINATOR_ETCD_ENDPOINTS", "a:1")],
            "--etcd-endpoints needs --store etcd",
        ),
        (
            &[],
            &[("MUSTER_COORDINATOR_STORE", "disk")],
            "unknown store 'disk'",
        ),
        (&["--config", config], &[], "'x' is not host:port"),
        // Flags win over the file.
        (
            &["--config", config, "--store", "memory"],
            &[],
            "--etcd-endpoints needs --store etcd",
        ),
    ];
    for (args, env, needle) in cases {
        let (code, stderr, _) = run_coordinator(args, env, Duration::from_secs(10));
        assert_eq!(code, 64, "{args:?} {env:?}: {stderr:?}");
        assert_eq!(stderr.len(), 1, "{args:?} {env:?}: {stderr:?}");
        assert!(
            stderr[0].contains(needle),
            "{args:?} {env:?}: {stderr:?} lacks {needle:?}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn etcd_user_and_password_file() {
    let Some(etcd) = Etcd::start(1) else { return };
    etcd.enable_auth("r00t-pw");
    let dir = std::env::temp_dir().join(format!("muster-etcd-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let good = dir.join("good");
    std::fs::write(&good, "r00t-pw\n").unwrap();
    let bad = dir.join("bad");
    std::fs::write(&bad, "wrong-pw").unwrap();
    let endpoints = etcd.endpoints_arg();
    let auth = |file: &std::path::Path| {
        [
            "--store",
            "etcd",
            "--etcd-endpoints",
            &endpoints,
            "--etcd-user",
            "root",
            "--etcd-password-file",
            file.to_str().unwrap(),
        ]
        .map(str::to_owned)
    };

    // The right password (its file's newline dropped): the coordinator serves.
    let args = auth(&good);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let coordinator = Coordinator::start(&args);
    let ch = channel(&coordinator.addr).await;
    form(&ch, "auth", 1).await;
    kv(&ch)
        .set(pb::SetRequest {
            job_id: "auth".into(),
            key: "k".into(),
            value: v("v"),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(kv_get(&ch, "auth", "k").await.unwrap(), v("v"));
    drop(coordinator);

    // A wrong password, or none: one line, no password in it, quickly.
    let args = auth(&bad);
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    let no_user = ["--store", "etcd", "--etcd-endpoints", &endpoints];
    for args in [&args[..], &no_user[..]] {
        let (code, stderr, elapsed) = run_coordinator(args, &[], Duration::from_secs(15));
        eprintln!("exit {code} after {elapsed:?}: {stderr:?}");
        assert_eq!(code, 1, "{stderr:?}");
        assert_eq!(stderr.len(), 1, "{stderr:?}");
        assert!(stderr[0].contains(&endpoints), "{stderr:?}");
        assert!(!stderr[0].contains("-pw"), "a password leaked: {stderr:?}");
        assert!(elapsed < Duration::from_secs(8), "{elapsed:?}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test]
async fn etcd_mutual_tls() {
    let Some(etcd) = Etcd::start_tls(1) else {
        return;
    };
    let tls = etcd.tls_files().unwrap().clone();
    let endpoints = etcd.endpoints_arg();
    let (ca, cert, key) = (
        tls.ca.to_str().unwrap(),
        tls.client_cert.to_str().unwrap(),
        tls.client_key.to_str().unwrap(),
    );
    let base = ["--store", "etcd", "--etcd-endpoints", &endpoints];
    let mut full: Vec<&str> = base.to_vec();
    full.extend(["--etcd-ca", ca, "--etcd-cert", cert, "--etcd-key", key]);
    let coordinator = Coordinator::start(&full);
    let ch = channel(&coordinator.addr).await;
    form(&ch, "tls", 1).await;
    kv(&ch)
        .set(pb::SetRequest {
            job_id: "tls".into(),
            key: "k".into(),
            value: v("over tls"),
            ..Default::default()
        })
        .await
        .unwrap();
    assert_eq!(kv_get(&ch, "tls", "k").await.unwrap(), v("over tls"));
    drop(coordinator);

    // No client certificate, an unknown CA, or plain text: refused, in one line.
    let mut no_cert = base.to_vec();
    no_cert.extend(["--etcd-ca", ca]);
    let mut no_ca = base.to_vec();
    no_ca.extend(["--etcd-cert", cert, "--etcd-key", key]);
    for args in [&no_cert, &no_ca, &base.to_vec()] {
        let (code, stderr, elapsed) = run_coordinator(args, &[], Duration::from_secs(15));
        eprintln!("{args:?}: exit {code} after {elapsed:?}: {stderr:?}");
        assert_eq!(code, 1, "{stderr:?}");
        assert_eq!(stderr.len(), 1, "{stderr:?}");
        assert!(stderr[0].contains(&endpoints), "{stderr:?}");
    }
}
