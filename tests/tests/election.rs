//! Leader election with fencing (`muster_coordinator::election`) against a real etcd: exactly
//! one candidate leads, another takes over within the lease TTL when the leader dies or is
//! paused, and a leader that lost its lease cannot write. Skipped, with the reason printed,
//! when etcd is not installed.

use muster_coordinator::election::etcd_client::{
    Client, EventType, GetOptions, Txn, TxnOp, WatchOptions,
};
use muster_coordinator::election::{
    Election, ElectionConfig, ElectionError, Leadership, LostReason, Role,
};
use muster_tests::etcd::Etcd;
use muster_tests::{Agent, Stream};
use nix::sys::signal::Signal;
use std::process::Command;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// The lease TTL of every test: etcd's minimum with its default timing is 2 s.
const TTL: Duration = Duration::from_secs(2);

/// How much later than the TTL a takeover may come in these tests. The goal is TTL + 1 s
/// (etcd checks for expired leases every 500 ms; measured: TTL - 0.3 s after a SIGSTOP,
/// TTL + 0.1 to 0.5 s after a SIGKILL); the rest is room for a loaded machine.
const SLACK: Duration = Duration::from_millis(1500);

/// A key prefix of its own for each election of this process.
fn prefix(test: &str) -> String {
    static NEXT: AtomicU32 = AtomicU32::new(0);
    format!(
        "/muster-test/{test}/{}-{}/",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}

async fn candidate(etcd: &Etcd, prefix: &str, id: &str) -> Election {
    let config = ElectionConfig::new(id, prefix).with_ttl(TTL);
    Election::connect(&etcd.endpoints(), config)
        .await
        .expect("connects to etcd")
}

async fn client(etcd: &Etcd) -> Client {
    Client::connect(etcd.endpoints(), None)
        .await
        .expect("connects to etcd")
}

/// Waits until `election`'s role satisfies `f`, at most `limit`.
async fn wait_role(election: &Election, limit: Duration, f: impl Fn(&Role) -> bool) -> Role {
    let mut roles = election.roles();
    let waited = tokio::time::timeout(limit, roles.wait_for(|r| f(r))).await;
    match waited {
        Ok(Ok(role)) => role.clone(),
        _ => panic!(
            "{}: role did not come within {limit:?}; it is {:?}",
            election.candidate(),
            election.role()
        ),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn exactly_one_of_three_leads_and_a_resignation_hands_over() {
    let Some(etcd) = Etcd::start(1) else { return };
    let prefix = prefix("one-of-three");
    let mut candidates = Vec::new();
    for id in ["a:1", "b:2", "c:3"] {
        candidates.push(candidate(&etcd, &prefix, id).await);
    }
    let mut campaigns = tokio::task::JoinSet::new();
    for (i, c) in candidates.iter().enumerate() {
        let c = c.clone();
        campaigns.spawn(async move { (i, c.campaign().await) });
    }
    let (first, leadership) = tokio::time::timeout(Duration::from_secs(10), campaigns.join_next())
        .await
        .expect("someone leads within 10 s")
        .expect("a campaign ran")
        .expect("the campaign was not aborted");
    let leadership = leadership.expect("the campaign succeeds");
    let leader_id = candidates[first].candidate().to_owned();
    // The others settle on following it.
    for (i, c) in candidates.iter().enumerate() {
        if i != first {
            let role = wait_role(c, Duration::from_secs(5), |r| {
                matches!(r, Role::Follower(_))
            })
            .await;
            assert_eq!(role, Role::Follower(leader_id.clone()));
            assert_eq!(c.leader().as_deref(), Some(leader_id.as_str()));
        }
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let leaders: Vec<_> = candidates
        .iter()
        .filter(|c| c.role() == Role::Leader)
        .map(|c| c.candidate().to_owned())
        .collect();
    assert_eq!(leaders, vec![leader_id.clone()], "exactly one leads");
    assert_eq!(
        candidates[(first + 1) % 3]
            .current_leader()
            .await
            .expect("reads"),
        Some(leader_id.clone())
    );
    assert!(
        campaigns.try_join_next().is_none(),
        "only one campaign resolved"
    );

    // A non-candidate observer names the leader too.
    let observer = candidate(&etcd, &prefix, "observer:0").await;
    wait_role(&observer, Duration::from_secs(5), |r| {
        *r == Role::Follower(leader_id.clone())
    })
    .await;

    // Resigning hands over at once (no TTL to wait for).
    let resigned = Instant::now();
    candidates[first].resign().await.expect("resigns");
    assert!(!leadership.is_current());
    assert_eq!(leadership.lost().await, LostReason::Resigned);
    let (second, next) = tokio::time::timeout(Duration::from_secs(5), campaigns.join_next())
        .await
        .expect("another leads within 5 s")
        .expect("a campaign ran")
        .expect("the campaign was not aborted");
    let next = next.expect("the campaign succeeds");
    println!(
        "handover after a resignation: {:?} ({} -> {})",
        resigned.elapsed(),
        leader_id,
        candidates[second].candidate()
    );
    assert_ne!(second, first);
    assert!(next.token() > leadership.token(), "fencing tokens grow");
    next.put_fenced(format!("{prefix}x"), "1")
        .await
        .expect("the new leader writes");
    campaigns.abort_all();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_leader_whose_lease_is_gone_cannot_write() {
    let Some(etcd) = Etcd::start(1) else { return };
    let prefix = prefix("fencing");
    let key = format!("{prefix}value");
    let a = candidate(&etcd, &prefix, "a:1").await;
    let b = candidate(&etcd, &prefix, "b:2").await;
    let old = a.campaign().await.expect("a leads");
    old.put_fenced(key.clone(), "from a")
        .await
        .expect("a writes while it leads");
    let b_campaign = tokio::spawn({
        let b = b.clone();
        async move { b.campaign().await }
    });
    wait_role(&b, Duration::from_secs(5), |r| {
        *r == Role::Follower("a:1".into())
    })
    .await;

    // Revoke a's lease behind its back, as an expiry would: the leader key goes with it.
    let mut etcd_client = client(&etcd).await;
    etcd_client
        .lease_revoke(old.lease_id())
        .await
        .expect("revokes the lease");
    // The fence no longer holds, whatever a believes.
    let raw = etcd_client
        .txn(
            Txn::new()
                .when([old.fence()])
                .and_then([TxnOp::put(key.clone(), "raw from a", None)]),
        )
        .await
        .expect("the transaction runs");
    assert!(!raw.succeeded(), "a transaction fenced by a's token fails");
    let refused = old.put_fenced(key.clone(), "late from a").await;
    assert!(
        matches!(refused, Err(ElectionError::NotLeader { .. })),
        "{refused:?}"
    );

    // a's candidacy would start a new term and may win the key again: withdraw it.
    a.resign().await.expect("a withdraws");
    let new = tokio::time::timeout(Duration::from_secs(5), b_campaign)
        .await
        .expect("b leads within 5 s")
        .expect("the campaign ran")
        .expect("b leads");
    new.put_fenced(key.clone(), "from b")
        .await
        .expect("b writes");
    let refused = old.put_fenced(key.clone(), "later from a").await;
    match refused {
        Err(e @ ElectionError::NotLeader { .. }) => {
            println!("old leader's write refused: {e}");
            assert!(matches!(e, ElectionError::NotLeader { leader: Some(l) } if l == "b:2"));
        }
        other => panic!("a wrote after losing its lease: {other:?}"),
    }
    let value = etcd_client
        .get(key.clone(), None)
        .await
        .expect("reads")
        .kvs()
        .first()
        .map(|kv| kv.value().to_vec());
    assert_eq!(value.as_deref(), Some(&b"from b"[..]));
    let reason = tokio::time::timeout(Duration::from_secs(5), old.lost())
        .await
        .expect("a steps down");
    println!("a stepped down: {reason}");
    assert!(!old.is_current());
    let role = wait_role(&a, Duration::from_secs(5), |r| *r != Role::Leader).await;
    assert_ne!(role, Role::Leader);
}

/// The `candidate` example of the coordinator, built if missing. As with the other binaries
/// of these tests (see `muster_tests`), one that exists is used as it is: `cargo test
/// --workspace` builds it fresh. (Building it from here every time would rebuild the
/// coordinator under another feature set, twice per run.)
fn candidate_bin() -> std::path::PathBuf {
    let path = muster_tests::profile_dir().join("examples/candidate");
    if !path.exists() {
        let status = Command::new(env!("CARGO"))
            .args([
                "build",
                "-p",
                "muster-coordinator",
                "--example",
                "candidate",
            ])
            .current_dir(muster_tests::workspace_root())
            .status()
            .expect("cargo runs");
        assert!(status.success(), "building the candidate example failed");
    }
    path
}

fn spawn_candidate(etcd: &Etcd, prefix: &str, id: &str, counter: &str) -> Agent {
    let mut cmd = Command::new(candidate_bin());
    cmd.args([
        &etcd.endpoints().join(","),
        prefix,
        id,
        &TTL.as_secs().to_string(),
        counter,
    ]);
    Agent::spawn(cmd, format!("candidate {id}"))
}

/// Every value `key` had, with its mod revision, oldest first.
async fn history(client: &mut Client, key: &str) -> Vec<(i64, String)> {
    let now = client.get(key, None).await.expect("reads");
    let Some(last) = now.kvs().first().map(|kv| kv.mod_revision()) else {
        return Vec::new();
    };
    let mut stream = client
        .watch(key, Some(WatchOptions::new().with_start_revision(1)))
        .await
        .expect("watches");
    let mut values = Vec::new();
    while values.last().is_none_or(|(r, _)| *r < last) {
        let message = tokio::time::timeout(Duration::from_secs(5), stream.message())
            .await
            .expect("the history comes")
            .expect("the watch works")
            .expect("the watch goes on");
        for event in message.events() {
            if event.event_type() == EventType::Put {
                let kv = event.kv().expect("a put has its value");
                values.push((
                    kv.mod_revision(),
                    String::from_utf8_lossy(kv.value()).into_owned(),
                ));
            }
        }
    }
    values
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_paused_leader_is_fenced_and_steps_down_when_it_resumes() {
    let Some(etcd) = Etcd::start(1) else { return };
    let prefix = prefix("sigstop");
    let counter = format!("{prefix}counter");
    let old = spawn_candidate(&etcd, &prefix, "old:1", &counter);
    old.wait_for_lines(Stream::Stdout, 1, Duration::from_secs(20), |l| {
        l.starts_with("leading")
    });
    old.wait_for_lines(Stream::Stdout, 5, Duration::from_secs(10), |l| {
        l.starts_with("wrote")
    });
    let b = candidate(&etcd, &prefix, "new:2").await;
    let campaign = tokio::spawn({
        let b = b.clone();
        async move { b.campaign().await }
    });
    wait_role(&b, Duration::from_secs(5), |r| {
        *r == Role::Follower("old:1".into())
    })
    .await;

    let stopped = Instant::now();
    old.signal(Signal::SIGSTOP);
    let new = tokio::time::timeout(TTL + Duration::from_secs(3), campaign)
        .await
        .expect("the standby leads")
        .expect("the campaign ran")
        .expect("the standby leads");
    let takeover = stopped.elapsed();
    println!("takeover from a SIGSTOPped leader (TTL {TTL:?}): {takeover:?}");
    assert!(takeover < TTL + SLACK, "takeover took {takeover:?}");
    for n in 1..=5 {
        new.put_fenced(counter.clone(), format!("new:2:{n}"))
            .await
            .expect("the new leader writes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    old.signal(Signal::SIGCONT);
    let resumed = Instant::now();
    let down = old.wait_for_lines(Stream::Stdout, 1, Duration::from_secs(5), |l| {
        l.starts_with("stepped down")
    });
    println!(
        "the old leader, {:?} after SIGCONT: {}",
        resumed.elapsed(),
        down[0]
    );
    // Let it try for a while: it campaigns again and follows, never writing.
    for n in 6..=10 {
        new.put_fenced(counter.clone(), format!("new:2:{n}"))
            .await
            .expect("the new leader writes");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let mut etcd_client = client(&etcd).await;
    let values = history(&mut etcd_client, &counter).await;
    let first_new = values
        .iter()
        .position(|(_, v)| v.starts_with("new:2:"))
        .expect("the new leader's writes are there");
    let (takeover_revision, _) = values[first_new];
    assert!(takeover_revision > new.token());
    let late: Vec<_> = values[first_new..]
        .iter()
        .filter(|(_, v)| !v.starts_with("new:2:"))
        .collect();
    assert!(
        late.is_empty(),
        "the old leader wrote after the takeover: {late:?}"
    );
    assert_eq!(values.len() - first_new, 10, "{values:?}");
    // Every write the old leader reported landed before the new leader's term began.
    let out = old.output();
    for line in out.lines().filter(|l| l.starts_with("wrote")) {
        let revision: i64 = line
            .rsplit("revision=")
            .next()
            .and_then(|r| r.parse().ok())
            .unwrap_or_else(|| panic!("a revision in {line:?}"));
        assert!(revision < new.token(), "{line} after the takeover\n{out}");
    }
    let refused = out.lines().filter(|l| l.starts_with("refused")).count();
    println!(
        "old leader: {} writes before the pause, {refused} refused after it",
        out.lines().filter(|l| l.starts_with("wrote")).count()
    );
    assert_eq!(b.role(), Role::Leader);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_killed_leader_is_replaced_within_the_ttl() {
    let Some(etcd) = Etcd::start(1) else { return };
    let prefix = prefix("sigkill");
    let counter = format!("{prefix}counter");
    let old = spawn_candidate(&etcd, &prefix, "old:1", &counter);
    old.wait_for_lines(Stream::Stdout, 1, Duration::from_secs(20), |l| {
        l.starts_with("leading")
    });
    let b = candidate(&etcd, &prefix, "new:2").await;
    let campaign = tokio::spawn({
        let b = b.clone();
        async move { b.campaign().await }
    });
    wait_role(&b, Duration::from_secs(5), |r| {
        *r == Role::Follower("old:1".into())
    })
    .await;
    let killed = Instant::now();
    old.signal(Signal::SIGKILL);
    let new = tokio::time::timeout(TTL + Duration::from_secs(3), campaign)
        .await
        .expect("the standby leads")
        .expect("the campaign ran")
        .expect("the standby leads");
    let takeover = killed.elapsed();
    println!("takeover from a SIGKILLed leader (TTL {TTL:?}): {takeover:?}");
    assert!(takeover < TTL + SLACK, "takeover took {takeover:?}");
    new.put_fenced(counter, "new").await.expect("writes");
}

/// A fenced put retried over transport errors: etcd-client's balanced channel keeps sending
/// some requests to a killed member ("tcp connect error"); a refusal is not retried.
async fn put_retrying(leadership: &Leadership, key: &str, value: &str) {
    let mut tries = 0;
    loop {
        match leadership.put_fenced(key, value).await {
            Ok(_) => return,
            Err(e @ ElectionError::NotLeader { .. }) => panic!("{e}"),
            Err(e) if tries < 20 => {
                println!("retrying a fenced put after: {e}");
                tries += 1;
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            Err(e) => panic!("{e}"),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn election_survives_losing_the_etcd_leader_member() {
    let Some(mut etcd) = Etcd::start(3) else {
        return;
    };
    let prefix = prefix("three-members");
    let key = format!("{prefix}value");
    let a = candidate(&etcd, &prefix, "a:1").await;
    let b = candidate(&etcd, &prefix, "b:2").await;
    let first = a.campaign().await.expect("a leads");
    let b_campaign = tokio::spawn({
        let b = b.clone();
        async move { b.campaign().await }
    });
    wait_role(&b, Duration::from_secs(10), |r| {
        *r == Role::Follower("a:1".into())
    })
    .await;
    first
        .put_fenced(key.clone(), "a before")
        .await
        .expect("a writes");

    // Kill the member that is etcd's raft leader.
    let endpoints = etcd.endpoints();
    let mut raft_leader = None;
    for (i, endpoint) in endpoints.iter().enumerate() {
        let mut one = Client::connect([endpoint], None).await.expect("connects");
        let status = one.status().await.expect("a member answers");
        if status.header().map(|h| h.member_id()) == Some(status.leader()) {
            raft_leader = Some(i);
        }
    }
    let raft_leader = raft_leader.expect("one member leads etcd");
    let killed = Instant::now();
    etcd.kill(raft_leader);
    println!("killed etcd member {raft_leader} (its raft leader)");

    // Whoever leads the coordinators after the etcd election can write, and only one leads.
    let deadline = Instant::now() + Duration::from_secs(15);
    let (leader, leadership) = loop {
        assert!(
            Instant::now() < deadline,
            "no writable leader after killing the member"
        );
        let current = [&a, &b]
            .into_iter()
            .find_map(|c| c.leadership().map(|l| (c.clone(), l)));
        if let Some((c, l)) = current
            && l.put_fenced(key.clone(), format!("{} after", c.candidate()))
                .await
                .is_ok()
        {
            break (c, l);
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    println!(
        "{} writes {:?} after the etcd member was killed (token {} -> {})",
        leader.candidate(),
        killed.elapsed(),
        first.token(),
        leadership.token()
    );
    let leaders = [&a, &b].iter().filter(|c| c.role() == Role::Leader).count();
    assert_eq!(leaders, 1);

    // A resignation still hands over, to the other candidate.
    let other = if leader.candidate() == "a:1" { &b } else { &a };
    // The other one still stands (a campaign stays on across a lost term).
    let resigned = Instant::now();
    leader.resign().await.expect("resigns");
    let next = tokio::time::timeout(Duration::from_secs(10), async {
        loop {
            if let Some(l) = other.leadership() {
                return l;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    })
    .await
    .expect("the other candidate leads");
    println!(
        "handover to {} with 2 of 3 members: {:?}",
        other.candidate(),
        resigned.elapsed()
    );
    put_retrying(&next, &key, "other").await;
    assert!(matches!(
        leadership.put_fenced(key.clone(), "stale").await,
        Err(ElectionError::NotLeader { .. })
    ));
    let live: Vec<String> = (0..3)
        .filter(|&i| i != raft_leader)
        .map(|i| etcd.endpoints()[i].clone())
        .collect();
    let mut etcd_client = Client::connect(live, None).await.expect("connects");
    let value = etcd_client
        .get(key, Some(GetOptions::new()))
        .await
        .expect("reads");
    assert_eq!(value.kvs()[0].value(), b"other");
    b_campaign.abort();
}
