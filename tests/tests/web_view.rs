//! The coordinator's live web view (`--web-addr`), end to end: a real `muster-coordinator`
//! process with a cluster token, two real `muster-agent launch` nodes of a job whose rank 1
//! never reaches the barrier rank 0 waits at, a one-node job that failed after a restart, and
//! an idle daemon agent. Over HTTP, the JSON names the job, the barrier, the missing rank and
//! what it is doing, the failure and restart, and the agent; neither it nor the page holds the
//! cluster token, the job token or the NCCL unique id published in the job. In Debian's
//! headless chromium, the rendered page names the job, the barrier and the missing rank
//! (skipped, with the reason printed, where chromium cannot be installed).
//! `MUSTER_WEB_SCREENSHOT=1` also writes the page's screenshot to `docs/web-view.png`.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_proto::v1 as pb;
use muster_tests::coordinator::Coordinator;
use muster_tests::{Agent, SLOW, example_bin, free_port, http, workspace_root};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// The cluster token, long and distinctive enough that any copy of it would be found.
const TOKEN: &str = "web-view-cluster-token-5f1c9e7a2b";
/// The job whose rank 1 never arrives.
const STUCK: &str = "train-stuck";
/// The job that fails, is restarted once, and fails for good.
const FAILED: &str = "eval-failed";
/// An idle daemon agent's id.
const POOLED: &str = "idle-gpu-box";

/// A coordinator with a web view, the stuck job running and the failed job over.
struct Scene {
    coordinator: Coordinator,
    web: u16,
    _agents: Vec<Agent>,
    dir: PathBuf,
    unique_id: Vec<u8>,
    /// The stuck barrier's name, as DescribeJob gives it.
    barrier: String,
}

impl Drop for Scene {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn launch(coordinator: &str, token_file: &Path, job: &str, extra: &[&str], cmd: &str) -> Agent {
    let token_file = token_file.to_str().unwrap();
    let mut args = vec![
        "launch",
        "--coordinator",
        coordinator,
        "--auth-token-file",
        token_file,
        "--job-id",
        job,
        "--nproc-per-node",
        "1",
        "--last-call-ms",
        "300",
        "--grace-period-ms",
        "500",
    ];
    args.extend_from_slice(extra);
    args.extend_from_slice(&["--", "sh", "-c", cmd]);
    Agent::start(&args)
}

/// GET `path` from the web view: the status line's code, the headers (lower-cased) and the
/// body.
fn get(port: u16, path: &str) -> (u16, String, String) {
    let answer = http(port, "GET", path, "").unwrap_or_else(|e| panic!("GET {path}: {e}"));
    let (head, body) = answer.split_once("\r\n\r\n").unwrap();
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .unwrap_or_else(|| panic!("no status in {head}"));
    (code, head.to_ascii_lowercase(), body.to_owned())
}

fn view(port: u16) -> Value {
    let (code, head, body) = get(port, "/api/view");
    assert_eq!(code, 200, "{head}\n{body}");
    assert!(head.contains("content-type: application/json"), "{head}");
    serde_json::from_str(&body).unwrap_or_else(|e| panic!("{e}: {body}"))
}

fn job<'a>(view: &'a Value, id: &str) -> Option<&'a Value> {
    view["jobs"]
        .as_array()?
        .iter()
        .find(|j| j["summary"]["job_id"] == id)
}

/// Polls the web view until `ready` holds for it (or panics with the last view after `SLOW`
/// times two: the agents start real processes on a loaded machine).
fn wait_for(port: u16, what: &str, ready: impl Fn(&Value) -> bool) -> Value {
    let deadline = Instant::now() + 2 * SLOW;
    loop {
        let v = view(port);
        if ready(&v) {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "no {what} in the web view: {v:#}"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The stuck barrier of `STUCK` in `v`: a global barrier rank 0 arrived at and rank 1 is
/// missing from, with what rank 1 is doing.
fn stuck_barrier(v: &Value) -> Option<&Value> {
    job(v, STUCK)?["barriers"].as_array()?.iter().find(|b| {
        b["missing_detail"]
            .as_array()
            .is_some_and(|m| m.iter().any(|m| m["rank"] == 1))
    })
}

async fn scene(name: &str) -> Scene {
    let barrier_loop = example_bin("barrier_loop").unwrap();
    let dir = std::env::temp_dir().join(format!("muster-web-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let token_file = dir.join("token");
    std::fs::write(&token_file, TOKEN).unwrap();
    let web = free_port();
    let coordinator = Coordinator::start(&[
        "--web-addr",
        &format!("127.0.0.1:{web}"),
        "--auth-token-file",
        token_file.to_str().unwrap(),
    ]);
    // Rank 1 stands for a worker stuck before its first barrier (in data loading, say): alive,
    // never arriving. Rank 0 waits at its first barrier.
    let stuck = format!(
        "if [ \"$RANK\" = 1 ]; then echo stuck; exec sleep 600; fi; exec {} --warmup 1 --iters 1",
        barrier_loop.display()
    );
    let mut agents: Vec<Agent> = (0..2)
        .map(|_| {
            launch(
                &coordinator.addr,
                &token_file,
                STUCK,
                &["--nnodes", "2"],
                &stuck,
            )
        })
        .collect();
    let failed = launch(
        &coordinator.addr,
        &token_file,
        FAILED,
        &["--nnodes", "1", "--max-restarts", "1"],
        "echo 'loss diverged' >&2; exit 3",
    );
    let run = failed.finish(2 * SLOW);
    assert_ne!(run.code(), Some(0), "{}", run.dump());

    // An idle daemon agent, for the pool's table.
    agents.push(Agent::start(&[
        "serve",
        "--coordinator",
        &coordinator.addr,
        "--auth-token-file",
        token_file.to_str().unwrap(),
        "--agent-id",
        POOLED,
        "--labels",
        "zone=b",
    ]));
    let v = wait_for(web, "stuck barrier and pooled agent", |v| {
        stuck_barrier(v).is_some() && v["agents"].as_array().is_some_and(|a| !a.is_empty())
    });
    let barrier = stuck_barrier(&v).unwrap()["names"][0]["name"]
        .as_str()
        .unwrap()
        .to_owned();

    // A unique id published in the stuck job, as rank 0's NCCL setup would.
    let unique_id: Vec<u8> = (0..128u8).map(|i| i.wrapping_mul(37) ^ 0xa5).collect();
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", coordinator.addr))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let bearer: tonic::metadata::MetadataValue<_> = format!("Bearer {TOKEN}").parse().unwrap();
    let mut ids = pb::unique_ids_client::UniqueIdsClient::with_interceptor(
        channel,
        move |mut r: tonic::Request<()>| {
            r.metadata_mut().insert("authorization", bearer.clone());
            Ok(r)
        },
    );
    let generation = job(&v, STUCK).unwrap()["summary"]["generation"]
        .as_u64()
        .unwrap();
    ids.publish(pb::PublishUniqueIdRequest {
        job_id: STUCK.into(),
        generation,
        rank: 0,
        communicator: "web-view".into(),
        unique_id: unique_id.clone(),
        ..Default::default()
    })
    .await
    .unwrap();
    Scene {
        coordinator,
        web,
        _agents: agents,
        dir,
        unique_id,
        barrier,
    }
}

/// Every form a secret of the scene could take in a page: the tokens as they are, the unique
/// id in hex and as protobuf's JSON writes bytes (base64), and as the page would print it.
fn secrets(scene: &Scene) -> Vec<String> {
    let hex: String = scene.unique_id.iter().map(|b| format!("{b:02x}")).collect();
    let decimal = scene
        .unique_id
        .iter()
        .map(u8::to_string)
        .collect::<Vec<_>>()
        .join(",");
    vec![
        TOKEN.to_owned(),
        muster_core::job_token::mint(TOKEN, STUCK),
        muster_core::job_token::mint(TOKEN, FAILED),
        hex[..32].to_owned(),
        base64_prefix(&scene.unique_id),
        decimal[..40].to_owned(),
    ]
}

/// The first 24 base64 characters of `bytes` (18 bytes), enough to recognise a copy.
fn base64_prefix(bytes: &[u8]) -> String {
    const A: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    bytes[..18]
        .chunks(3)
        .flat_map(|c| {
            let n = (u32::from(c[0]) << 16) | (u32::from(c[1]) << 8) | u32::from(c[2]);
            [18, 12, 6, 0].map(|s| A[((n >> s) & 63) as usize] as char)
        })
        .collect()
}

fn assert_no_secrets(scene: &Scene, what: &str, text: &str) {
    for s in secrets(scene) {
        assert!(!text.contains(&s), "{what} shows a secret ({s}):\n{text}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_json_view_names_the_stuck_barrier_the_missing_rank_and_the_failure() {
    let scene = scene("json").await;
    let v = view(scene.web);
    assert_eq!(v["serving"], true, "{v:#}");

    // The stuck job: running, two nodes, rank 0 waiting, rank 1 missing with what it does.
    let stuck = job(&v, STUCK).unwrap();
    assert_eq!(
        stuck["summary"]["state"], "ROUND_STATE_RUNNING",
        "{stuck:#}"
    );
    assert_eq!(stuck["summary"]["world_size"], 2, "{stuck:#}");
    assert_eq!(stuck["nodes"].as_array().unwrap().len(), 2, "{stuck:#}");
    // Zeros are written, not dropped: rank 0 on node 0 is there by number.
    let rank0 = &stuck["ranks"][0];
    assert_eq!(
        (&rank0["rank"], &rank0["node_rank"]),
        (&0.into(), &0.into())
    );
    assert_eq!(rank0["state"], "RANK_STATE_WAITING", "{stuck:#}");
    let b = stuck_barrier(&v).unwrap();
    assert_eq!(b["scope"], "BARRIER_SCOPE_GLOBAL", "{b:#}");
    assert!(scene.barrier.contains("barrier_loop.rs:"), "{b:#}");
    assert_eq!(b["names"][0]["ranks"], serde_json::json!([0]), "{b:#}");
    let missing = &b["missing_detail"][0];
    assert_eq!(missing["rank"], 1, "{b:#}");
    assert_eq!(missing["state"], "RANK_STATE_PENDING", "{b:#}");
    assert!(
        missing["activity"]
            .as_str()
            .unwrap()
            .starts_with("no session yet"),
        "{b:#}"
    );
    // The barrier's age grows from one view to the next: the page is live.
    let before = b["waiting_ms"].as_u64().unwrap();
    let later = wait_for(scene.web, "older barrier", |v| {
        stuck_barrier(v).is_some_and(|b| b["waiting_ms"].as_u64().unwrap() > before)
    });
    assert!(stuck_barrier(&later).is_some());

    // The failed job: over, after one restart, naming its rank and exit status; the worker's
    // stderr is not shown on this unauthenticated page.
    let failed = job(&v, FAILED).unwrap();
    assert_eq!(
        failed["summary"]["state"], "ROUND_STATE_FAILED",
        "{failed:#}"
    );
    assert_eq!(failed["summary"]["done"], true, "{failed:#}");
    assert_eq!(failed["restart_count"], 1, "{failed:#}");
    let f = &failed["failure"];
    assert_eq!(
        (&f["rank"], &f["exit_code"]),
        (&0.into(), &3.into()),
        "{f:#}"
    );
    assert_eq!(f["stderr_tail"], "", "{f:#}");
    // What made the restart, too: both generations' failures, newest first, without stderr.
    let past = failed["recent_failures"].as_array().unwrap();
    let generations: Vec<_> = past.iter().map(|f| f["generation"].clone()).collect();
    assert_eq!(generations, [2, 1], "{failed:#}");
    assert!(past.iter().all(|f| f["stderr_tail"] == ""), "{failed:#}");
    assert!(!v.to_string().contains("loss diverged"), "{v:#}");

    // No credential and no unique id anywhere, in the JSON or the page.
    // The idle daemon agent, with its labels.
    let pooled = &v["agents"][0];
    assert_eq!(pooled["machine"]["agent_id"], POOLED, "{pooled:#}");
    assert_eq!(pooled["machine"]["labels"]["zone"], "b", "{pooled:#}");
    assert_eq!(pooled["jobs"], serde_json::json!([]), "{pooled:#}");

    assert_no_secrets(&scene, "/api/view", &v.to_string());
    let (code, head, page) = get(scene.web, "/");
    assert_eq!(code, 200, "{head}");
    assert!(head.contains("content-type: text/html"), "{head}");
    assert!(
        head.contains("content-security-policy: default-src 'none'"),
        "{head}"
    );
    assert!(page.contains("/api/view"), "{page}");
    assert_no_secrets(&scene, "/", &page);

    // Read-only, and nothing else is served.
    let (code, _, body) = get(scene.web, "/metrics");
    assert_eq!(code, 404, "{body}");
    let answer = http(scene.web, "POST", "/api/view", "{}").unwrap();
    assert!(answer.starts_with("HTTP/1.0 405"), "{answer}");
    // The gRPC port still serves (the web view is a listener of its own).
    assert!(std::net::TcpStream::connect(&scene.coordinator.addr).is_ok());
}

#[test]
fn a_taken_web_port_fails_the_start_in_one_line() {
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let web = taken.local_addr().unwrap().to_string();
    let listen = format!("127.0.0.1:{}", free_port());
    let out = Command::new(muster_tests::coordinator_bin())
        .args(["--listen", &listen, "--web-addr", &web])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{stderr}");
    let line = format!("muster-coordinator: cannot listen on web address {web}: ");
    assert!(
        stderr.lines().any(|l| l.starts_with(&line)),
        "expected a line starting with {line:?}: {stderr}"
    );
}

/// Debian's chromium, installed by `scripts/install-chromium.sh` when missing; `None` (with
/// the reason printed) where it cannot be.
fn chromium() -> Option<PathBuf> {
    let script = workspace_root().join("scripts/install-chromium.sh");
    let out = Command::new(&script)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("cannot run {}: {e}", script.display()));
    if !out.status.success() {
        eprintln!(
            "skipped: chromium is not installed and {} could not install it ({}): {}",
            script.display(),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
        return None;
    }
    let found = std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|p| p.join("chromium"))
            .find(|p| p.exists())
    });
    if found.is_none() {
        eprintln!("skipped: install-chromium.sh succeeded but no chromium is on PATH");
    }
    found
}

/// Runs headless chromium on `url` with `mode` (`--dump-dom`, or `--screenshot=<file>`) in a
/// fresh profile, killing it past a minute; its stdout.
fn run_chromium(chromium: &Path, profile: &Path, mode: &str, url: &str) -> String {
    let mut child = Command::new(chromium)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args([
            "--window-size=1280,900",
            "--virtual-time-budget=5000",
            mode,
            url,
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        if child.try_wait().unwrap().is_some() {
            break;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let out = child.wait_with_output().unwrap();
            panic!(
                "chromium ran past a minute on {url}: {}",
                String::from_utf8_lossy(&out.stderr)
            );
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let out = child.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "chromium {mode} failed ({}): {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn headless_chromium_renders_the_job_its_stuck_barrier_and_the_missing_rank() {
    let Some(chromium) = chromium() else {
        return;
    };
    let scene = scene("browser").await;
    let url = format!("http://127.0.0.1:{}/", scene.web);
    let profile = scene.dir.join("chromium-profile");
    let dom = run_chromium(&chromium, &profile, "--dump-dom", &url);
    // The script ran and drew the view from the JSON (the static page has none of these).
    assert!(dom.contains("data-loaded=\"true\""), "{dom}");
    assert!(dom.contains(&format!("data-job=\"{STUCK}\"")), "{dom}");
    assert!(
        dom.contains(&format!("data-barrier=\"{}\"", scene.barrier)),
        "{dom}"
    );
    assert!(dom.contains("data-missing-rank=\"1\""), "{dom}");
    assert!(dom.contains("missing: rank 1"), "{dom}");
    assert!(dom.contains("no session yet"), "{dom}");
    assert!(
        dom.contains(&format!("data-failed-job=\"{FAILED}\"")),
        "{dom}"
    );
    // Both failed generations: the restart's cause as well as the final failure.
    for generation in [1, 2] {
        assert!(
            dom.contains(&format!("data-failed-generation=\"{generation}\"")),
            "{dom}"
        );
    }
    assert!(dom.contains(&format!("data-agent=\"{POOLED}\"")), "{dom}");
    assert_no_secrets(&scene, "the rendered page", &dom);

    let shot = scene.dir.join("web-view.png");
    run_chromium(
        &chromium,
        &profile,
        &format!("--screenshot={}", shot.display()),
        &url,
    );
    let png = std::fs::read(&shot).unwrap();
    assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "not a PNG");
    if std::env::var_os("MUSTER_WEB_SCREENSHOT").is_some() {
        std::fs::write(workspace_root().join("docs/web-view.png"), &png).unwrap();
    }
}
