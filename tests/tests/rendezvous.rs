//! torchrun's self-hosted rendezvous on two hosts (network namespaces): the same
//! `muster-agent launch --nnodes 2 --rdzv-backend c10d --rdzv-endpoint <n0>:29400 --rdzv-id
//! job1` on both, no coordinator started by hand. The agent on n0 (which owns the endpoint's
//! address) hosts the coordinator, n1's dials it; the workers must see one world of 4 with
//! distinct ranks, and both agents exit 0, also when n0's workers end long before n1's. Then
//! the same command under the peers' torchrun, when its venv is installed, to compare what the
//! workers see; and with the launch's TLS and cluster token, served and dialed securely.
//! Needs root for `ip netns`; skipped with a printed reason otherwise.

use muster_tests::netns::Net;
use muster_tests::{Agent, Finished, SLOW, agent_bin};
use std::collections::BTreeSet;
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// torchrun's c10d port.
const PORT: u16 = 29400;
/// The worker: one line with what the test compares, then `$EXTRA_SLEEP` seconds (set per
/// host, so the command line stays the same).
const WORKER: &str = "echo \"seen RANK=$RANK WORLD_SIZE=$WORLD_SIZE LOCAL_RANK=$LOCAL_RANK \
    LOCAL_WORLD_SIZE=$LOCAL_WORLD_SIZE GROUP_RANK=$GROUP_RANK MASTER_ADDR=$MASTER_ADDR\"; \
    sleep ${EXTRA_SLEEP:-0}";

/// What one worker printed: its `KEY=VALUE` pairs, by key.
type Seen = std::collections::BTreeMap<String, String>;

/// The `seen ...` lines of a run, parsed (with or without a `[rank R] ` prefix).
fn seen(f: &Finished) -> Vec<Seen> {
    f.stdout
        .iter()
        .filter_map(|l| l.split_once("seen ").map(|(_, rest)| rest))
        .map(|rest| {
            rest.split_whitespace()
                .filter_map(|kv| kv.split_once('='))
                .map(|(k, v)| (k.to_owned(), v.to_owned()))
                .collect()
        })
        .collect()
}

/// Checks that the two nodes' workers form one world of 4: ranks 0..4 once each, local ranks
/// 0 and 1 on each node, group ranks 0 and 1 (one per node), one MASTER_ADDR for all, and
/// returns that MASTER_ADDR.
fn check_world(what: &str, nodes: [&Finished; 2]) -> String {
    let all: Vec<Seen> = nodes.iter().flat_map(|f| seen(f)).collect();
    let dump = || {
        nodes
            .iter()
            .map(|f| f.dump())
            .collect::<Vec<_>>()
            .join("\n=====\n")
    };
    assert_eq!(all.len(), 4, "{what}: 4 workers\n{}", dump());
    let get = |s: &Seen, k: &str| s.get(k).cloned().unwrap_or_default();
    let ranks: BTreeSet<String> = all.iter().map(|s| get(s, "RANK")).collect();
    assert_eq!(
        ranks,
        ["0", "1", "2", "3"].map(str::to_owned).into(),
        "{what}: distinct ranks\n{}",
        dump()
    );
    for s in &all {
        assert_eq!(get(s, "WORLD_SIZE"), "4", "{what}: {s:?}");
        assert_eq!(get(s, "LOCAL_WORLD_SIZE"), "2", "{what}: {s:?}");
    }
    let mut groups = BTreeSet::new();
    for f in nodes {
        let mine = seen(f);
        let local: BTreeSet<String> = mine.iter().map(|s| get(s, "LOCAL_RANK")).collect();
        assert_eq!(
            local,
            ["0", "1"].map(str::to_owned).into(),
            "{what}: local ranks of one node\n{}",
            f.dump()
        );
        let group: BTreeSet<String> = mine.iter().map(|s| get(s, "GROUP_RANK")).collect();
        assert_eq!(
            group.len(),
            1,
            "{what}: one group rank per node\n{}",
            f.dump()
        );
        groups.extend(group);
    }
    assert_eq!(
        groups,
        ["0", "1"].map(str::to_owned).into(),
        "{what}: group ranks"
    );
    let masters: BTreeSet<String> = all.iter().map(|s| get(s, "MASTER_ADDR")).collect();
    assert_eq!(masters.len(), 1, "{what}: one MASTER_ADDR: {masters:?}");
    masters.into_iter().next().unwrap_or_default()
}

/// The launch flags both nodes get (torchrun's, verbatim).
fn rdzv_flags(endpoint: &str) -> Vec<String> {
    [
        "--nnodes",
        "2",
        "--nproc-per-node",
        "2",
        "--rdzv-backend",
        "c10d",
        "--rdzv-endpoint",
        endpoint,
        "--rdzv-id",
        "job1",
    ]
    .map(str::to_owned)
    .into()
}

/// Runs the same `muster-agent launch` (with `extra` flags) on n0 and n1 (n1's workers
/// sleeping `n1_sleep` seconds longer) and returns both runs. With `--no-agent-store`: these
/// tests hold the workers' environment to torchrun's, whose MASTER_ADDR:MASTER_PORT is node
/// 0's shared store (the agent store gives each node its own loopback port instead; its
/// multi-host test is `agent_store_ha.rs`).
fn run_muster(net: &Net, n1_sleep: &str, extra: &[String]) -> [Finished; 2] {
    let endpoint = format!("{}:{PORT}", net.addr("n0"));
    let mut args = vec!["launch".to_owned(), "--no-agent-store".to_owned()];
    args.extend(rdzv_flags(&endpoint));
    args.extend_from_slice(extra);
    args.extend(["--", "sh", "-c", WORKER].map(str::to_owned));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // n1 first: it must wait for n0's coordinator rather than fail.
    let n1 = net.spawn(
        "n1",
        agent_bin(),
        &args,
        &[("NO_COLOR", "1"), ("EXTRA_SLEEP", n1_sleep)],
    );
    let n0 = net.spawn(
        "n0",
        agent_bin(),
        &args,
        &[("NO_COLOR", "1"), ("EXTRA_SLEEP", "0")],
    );
    let deadline = Instant::now() + SLOW;
    [n0.finish_by(deadline), n1.finish_by(deadline)]
}

/// Checks a muster run: both exit 0, one world, n0 hosted (with the plaintext warning) and
/// n1 did not, and MASTER_ADDR is a node's address.
fn check_muster(net: &Net, what: &str, [n0, n1]: &[Finished; 2], plaintext: bool) {
    for f in [n0, n1] {
        assert_eq!(f.code(), Some(0), "{what}\n{}", f.dump());
    }
    let master = check_world(what, [n0, n1]);
    let addrs = [net.addr("n0").to_string(), net.addr("n1").to_string()];
    assert!(addrs.contains(&master), "{what}: MASTER_ADDR {master}");
    let hosts = |f: &Finished| {
        f.stderr
            .iter()
            .any(|l| l.contains("this agent hosts the rendezvous at"))
    };
    assert!(hosts(n0), "{what}: n0 hosts\n{}", n0.dump());
    assert!(!hosts(n1), "{what}: n1 dials\n{}", n1.dump());
    let warned = |f: &Finished| {
        f.stderr
            .iter()
            .any(|l| l.contains("warning") && l.contains("without TLS or authentication"))
    };
    assert_eq!(
        warned(n0),
        plaintext,
        "{what}: the plaintext warning\n{}",
        n0.dump()
    );
    assert!(!warned(n1), "{what}: only the host warns\n{}", n1.dump());
}

#[test]
fn same_command_on_two_hosts_needs_no_coordinator() {
    let Some(net) = Net::setup(&["n0", "n1"]) else {
        return;
    };
    let runs = run_muster(&net, "0", &[]);
    check_muster(&net, "c10d, two hosts", &runs, true);
}

#[test]
fn the_host_serves_until_the_other_node_is_done() {
    let Some(net) = Net::setup(&["n0", "n1"]) else {
        return;
    };
    // n0 (the host) is done at once; n1's workers run 3 s more and must still be able to
    // finish: the hosting agent keeps serving until then, and no longer.
    let runs = run_muster(&net, "3", &[]);
    check_muster(&net, "c10d, the host done first", &runs, true);
    let [n0, n1] = &runs;
    eprintln!(
        "host n0 ran {:?}, n1 ran {:?} (started together)",
        n0.elapsed, n1.elapsed
    );
    assert!(
        n0.elapsed >= Duration::from_secs(3),
        "the host left before n1 was done\n{}",
        n0.dump()
    );
    assert!(
        n0.elapsed < n1.elapsed + Duration::from_secs(5),
        "the host lingered long after n1\n{}\n=====\n{}",
        n0.dump(),
        n1.dump()
    );
}

#[test]
fn secured_with_the_launch_tls_and_token() {
    let Some(net) = Net::setup(&["n0", "n1"]) else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("muster-rendezvous-pki-{}", std::process::id()));
    let files = node_pki(&dir, &net.addr("n0").to_string());
    let runs = run_muster(&net, "0", &files);
    check_muster(&net, "c10d with TLS and the token", &runs, false);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A CA, one certificate for both nodes (naming the endpoint's address, for serving and as a
/// client) and a cluster token, written to `dir`; returns the launch flags that use them.
fn node_pki(dir: &std::path::Path, endpoint_host: &str) -> Vec<String> {
    use rcgen::{
        BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType,
        ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose,
    };
    std::fs::create_dir_all(dir).expect("PKI folder");
    let write = |name: &str, text: String| {
        let path = dir.join(name);
        std::fs::write(&path, text).expect("write a PKI file");
        path.to_str().expect("a UTF-8 temp path").to_owned()
    };
    let mut ca = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    ca.distinguished_name = DistinguishedName::new();
    ca.distinguished_name
        .push(DnType::CommonName, "rendezvous test CA");
    ca.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca = CertifiedIssuer::self_signed(ca, KeyPair::generate().expect("CA key"))
        .expect("self-signed CA");
    let mut node = CertificateParams::new(vec![endpoint_host.to_owned()]).expect("node params");
    node.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    node.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let key = KeyPair::generate().expect("node key");
    let cert = node.signed_by(&key, &ca).expect("signed node certificate");
    vec![
        "--tls-ca".to_owned(),
        write("ca.pem", ca.pem()),
        "--tls-cert".to_owned(),
        write("node.pem", cert.pem()),
        "--tls-key".to_owned(),
        write("node-key.pem", key.serialize_pem()),
        "--auth-token-file".to_owned(),
        write("token", "rendezvous-test-token-5a1c9e7f3b\n".to_owned()),
    ]
}

/// The peers' torchrun, or `None` with the reason printed.
fn torchrun() -> Option<PathBuf> {
    let python = muster_tests::peers::peers_python(&["torch"])?;
    let torchrun = python.with_file_name("torchrun");
    if !torchrun.exists() {
        eprintln!("skipped: {} does not exist", torchrun.display());
        return None;
    }
    Some(torchrun)
}

#[test]
fn workers_see_what_torchruns_see() {
    let Some(net) = Net::setup(&["n0", "n1"]) else {
        return;
    };
    let muster = run_muster(&net, "0", &[]);
    check_muster(&net, "muster", &muster, true);
    let Some(torchrun) = torchrun() else {
        return;
    };
    let endpoint = format!("{}:{PORT}", net.addr("n0"));
    let mut args = rdzv_flags(&endpoint);
    args.extend(["--no-python", "sh", "-c", WORKER].map(str::to_owned));
    let args: Vec<&str> = args.iter().map(String::as_str).collect();
    // torchrun's c10d hosts where the endpoint's address is one of the host name's, which
    // it is not here (the namespaces share the machine's host name): without is_host its
    // agents would all dial and wait. muster's agent binds instead of guessing.
    let start = |host: &str, is_host: &str| -> Agent {
        net.spawn(
            host,
            &torchrun,
            &args,
            &[
                ("EXTRA_SLEEP", "0"),
                ("PYTHONUNBUFFERED", "1"),
                ("PET_RDZV_CONF", is_host),
            ],
        )
    };
    let (n1, n0) = (start("n1", "is_host=0"), start("n0", "is_host=1"));
    let deadline = Instant::now() + SLOW;
    let peer = [n0.finish_by(deadline), n1.finish_by(deadline)];
    for (m, p) in muster.iter().zip(&peer) {
        assert_eq!(
            m.code(),
            p.code(),
            "exit status\n{}\n=====\n{}",
            m.dump(),
            p.dump()
        );
    }
    let torch_master = check_world("torchrun", [&peer[0], &peer[1]]);
    // torchrun's MASTER_ADDR here is `localhost` (its agent's view of the store's host),
    // which the other host cannot reach; muster's is node 0's address (checked above).
    eprintln!("MASTER_ADDR: torchrun {torch_master}");
}
