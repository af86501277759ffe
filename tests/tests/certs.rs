//! End-to-end tests of `muster-agent certs`: the files it writes and the flags it prints are
//! enough to run a real `muster-coordinator` with mutual TLS and the cluster token, and real
//! `muster-agent launch` agents whose SDK workers reach it; a client certificate from another
//! `certs` run is refused; and bad input exits with one line and writes nothing.

use muster_tests::{Agent, Finished, SLOW, agent_bin, coordinator_bin, example_bin};
use std::collections::BTreeMap;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

/// What refused agents get as `--failover-timeout-ms`: a refusal must end the launch well
/// within it, never hang.
const FAILOVER_MS: &str = "3000";

/// A directory of this test's own, removed on drop (not created: `certs` makes it).
struct Scratch(PathBuf);

impl Scratch {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("muster-certs-e2e-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        Scratch(dir)
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        // A test may have made it read-only.
        let _ = std::fs::set_permissions(&self.0, std::fs::Permissions::from_mode(0o700));
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn shown(p: &Path) -> String {
    p.to_str().expect("a UTF-8 temporary path").to_owned()
}

/// Runs `muster-agent certs <args>` to its end.
fn certs(args: &[&str]) -> Output {
    Command::new(agent_bin())
        .arg("certs")
        .args(args)
        .env("NO_COLOR", "1")
        .output()
        .expect("muster-agent runs")
}

fn dump(out: &Output) -> String {
    format!(
        "{}\n--- stdout\n{}--- stderr\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// What `certs` printed to run next: the coordinator's command line and the agents' flags,
/// as words (the scratch paths have no blanks, so no shell quoting to undo).
struct Printed {
    coordinator: Vec<String>,
    agent_flags: Vec<String>,
}

impl Printed {
    /// The value of the agents' `flag`.
    fn flag(&self, flag: &str) -> String {
        value_of(&self.agent_flags, flag)
    }

    /// The agents' flags for the coordinator at `addr`.
    fn agent_flags_for(&self, addr: &str) -> Vec<String> {
        with_value(&self.agent_flags, "--coordinator", addr)
    }
}

/// `muster-agent status <flags>`, which must succeed; its stdout.
fn status(flags: &[String]) -> String {
    let out = Command::new(agent_bin())
        .arg("status")
        .args(flags)
        .output()
        .expect("muster-agent runs");
    assert!(out.status.success(), "{}", dump(&out));
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// Runs `certs --out <dir> --host ...` and reads what it printed.
fn certs_ok(dir: &Path, hosts: &[&str]) -> Printed {
    let mut args = vec!["--out".to_owned(), shown(dir)];
    for h in hosts {
        args.extend(["--host".to_owned(), (*h).to_owned()]);
    }
    let out = certs(&args.iter().map(String::as_str).collect::<Vec<_>>());
    assert!(out.status.success(), "{}", dump(&out));
    assert!(out.stderr.is_empty(), "{}", dump(&out));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let words = |first: &str| -> Vec<String> {
        let line = stdout
            .lines()
            .map(str::trim)
            .find(|l| l.starts_with(first))
            .unwrap_or_else(|| panic!("no line starting with {first}\n{stdout}"));
        line.split_whitespace().map(str::to_owned).collect()
    };
    assert!(stdout.contains("production keeps its own PKI"), "{stdout}");
    Printed {
        coordinator: words("muster-coordinator "),
        agent_flags: words("--coordinator "),
    }
}

/// Where the value of `flag` is in `words`.
fn value_at(words: &[String], flag: &str) -> usize {
    words
        .iter()
        .position(|w| w == flag)
        .filter(|at| at + 1 < words.len())
        .unwrap_or_else(|| panic!("no {flag} VALUE in {words:?}"))
        + 1
}

/// The value after `flag` in `words`.
fn value_of(words: &[String], flag: &str) -> String {
    words[value_at(words, flag)].clone()
}

/// `words` with the value after `flag` replaced by `value`.
fn with_value(words: &[String], flag: &str, value: &str) -> Vec<String> {
    let mut words = words.to_vec();
    let at = value_at(&words, flag);
    words[at] = value.to_owned();
    words
}

/// The coordinator exactly as printed, on every address as printed (which it refuses without
/// TLS and the token), but on a free port rather than 29470 (tests run side by side). Returns
/// it and its port.
fn coordinator(printed: &Printed) -> (Agent, u16) {
    assert_eq!(printed.coordinator[0], "muster-coordinator");
    let port = muster_tests::free_port();
    assert_eq!(value_of(&printed.coordinator, "--listen"), "0.0.0.0:29470");
    let args = with_value(
        &printed.coordinator[1..],
        "--listen",
        &format!("0.0.0.0:{port}"),
    );
    let addr = format!("127.0.0.1:{port}");
    let mut cmd = Command::new(coordinator_bin());
    cmd.args(&args).env("RUST_LOG", "warn").env("NO_COLOR", "1");
    let coordinator = Agent::spawn(cmd, format!("muster-coordinator {args:?}"));
    let deadline = Instant::now() + SLOW;
    while std::net::TcpStream::connect(&addr).is_err() {
        assert!(
            Instant::now() < deadline,
            "the coordinator does not listen\n{}",
            coordinator.output()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    (coordinator, port)
}

/// `muster-agent launch <flags> --job-id <job> <more> -- sh -c <script>`.
fn launch(flags: &[String], job: &str, more: &[&str], script: &str) -> Agent {
    let mut cmd = Command::new(agent_bin());
    cmd.arg("launch")
        .args(flags)
        .args(["--job-id", job, "--advertise-addr", "127.0.0.1"])
        .args(more)
        .args(["--", "sh", "-c", script])
        .env("NO_COLOR", "1");
    Agent::spawn(cmd, format!("muster-agent launch {job} {flags:?} {more:?}"))
}

/// The files of `dir` and their contents.
fn contents(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    std::fs::read_dir(dir)
        .expect("list the directory")
        .map(|e| {
            let e = e.expect("an entry");
            let bytes = std::fs::read(e.path()).expect("read a file");
            (e.file_name().to_string_lossy().into_owned(), bytes)
        })
        .collect()
}

/// `certs`, then a two-node job with the printed flags: one agent reaches the coordinator by
/// its first `--host` (a DNS name), the other by the second (an IP address), so both kinds of
/// name in the server certificate are checked by a real handshake. The workers (the SDK's
/// `allreduce_bench`) reach the coordinator with the TLS files and job token their agent
/// hands them. `status` with the same flags then shows the finished job, and a daemon agent
/// (`serve`) runs a job given to `submit`, all with the same flags.
#[test]
fn a_two_node_job_runs_with_what_certs_wrote_and_printed() {
    let scratch = Scratch::new("job");
    let dir = scratch.0.join("pki");
    let printed = certs_ok(&dir, &["localhost", "127.0.0.1"]);
    let Some(bench) = example_bin("allreduce_bench") else {
        eprintln!("skipped: worker-sdk/examples/allreduce_bench.rs is missing");
        return;
    };
    let (coordinator, port) = coordinator(&printed);
    assert_eq!(
        printed.agent_flags[..2],
        ["--coordinator".to_owned(), "localhost:29470".to_owned()]
    );
    let worker = format!("exec {} --sizes 4,4096 --iters 5", shown(&bench));
    let agents: Vec<Agent> = ["localhost", "127.0.0.1"]
        .iter()
        .enumerate()
        .map(|(node, host)| {
            let mut flags = printed.agent_flags_for(&format!("{host}:{port}"));
            flags.extend(["--failover-timeout-ms".to_owned(), "20000".to_owned()]);
            launch(
                &flags,
                "certs-job",
                &[
                    "--nnodes",
                    "2",
                    "--node-rank",
                    &node.to_string(),
                    "--nproc-per-node",
                    "2",
                    "--grace-period-ms",
                    "1000",
                ],
                &worker,
            )
        })
        .collect();
    let deadline = Instant::now() + SLOW * 2;
    let runs: Vec<Finished> = agents.into_iter().map(|a| a.finish_by(deadline)).collect();
    for run in &runs {
        assert_eq!(
            run.code(),
            Some(0),
            "{}\n--- coordinator\n{}",
            run.dump(),
            coordinator.output()
        );
    }
    // Rank 0 measured both sizes across the two nodes.
    let sizes = runs[0]
        .rank_stdout(0)
        .into_iter()
        .filter(|l| l.starts_with("size_bytes="))
        .count();
    assert_eq!(sizes, 2, "{}", runs[0].dump());

    let flags = printed.agent_flags_for(&format!("localhost:{port}"));
    let jobs = status(&flags);
    assert!(jobs.contains("certs-job"), "{jobs}");

    // Daemon mode with the same flags: `serve` registers, `submit --wait` places a job on it
    // and follows it to its end.
    let mut cmd = Command::new(agent_bin());
    cmd.args(["serve", "--agent-id", "certs-daemon"])
        .args(&flags)
        .env("NO_COLOR", "1");
    let daemon = Agent::spawn(cmd, "muster-agent serve");
    daemon.wait_for_lines(muster_tests::Stream::Stderr, 1, SLOW, |l| {
        l.contains("serving as")
    });
    let out = Command::new(agent_bin())
        .args([
            "submit",
            "--job-id",
            "certs-submitted",
            "--nproc-per-node",
            "2",
            "--wait",
        ])
        .args(&flags)
        .args(["--", "true"])
        .output()
        .expect("muster-agent runs");
    let context = format!(
        "{}\n--- daemon\n{}\n--- coordinator\n{}",
        dump(&out),
        daemon.output(),
        coordinator.output()
    );
    assert!(out.status.success(), "{context}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("job certs-submitted: finished"),
        "{context}"
    );
}

/// A second `certs` run makes a second CA: its client certificate is refused by a
/// coordinator of the first (the handshake fails, the agent says so in one line and exits 1
/// fast), and an agent that trusts only the second CA refuses the first's coordinator.
#[test]
fn a_client_certificate_from_another_certs_run_is_refused() {
    let scratch = Scratch::new("foreign");
    let ours = certs_ok(&scratch.0.join("ours"), &["localhost"]);
    let theirs = certs_ok(&scratch.0.join("theirs"), &["localhost"]);
    let (coordinator, port) = coordinator(&ours);
    let addr = format!("localhost:{port}");
    // Their identity, our CA and token.
    let mut foreign_identity = ours.agent_flags_for(&addr);
    foreign_identity = with_value(&foreign_identity, "--tls-cert", &theirs.flag("--tls-cert"));
    foreign_identity = with_value(&foreign_identity, "--tls-key", &theirs.flag("--tls-key"));
    // Our identity and token, their CA.
    let distrust = with_value(
        &ours.agent_flags_for(&addr),
        "--tls-ca",
        &theirs.flag("--tls-ca"),
    );
    // What the one line says: the coordinator refused our certificate, or we its.
    for (case, flags, says) in [
        (
            "foreign identity",
            foreign_identity,
            "does not accept this agent's client certificate",
        ),
        (
            "distrust",
            distrust,
            "invalid peer certificate: UnknownIssuer",
        ),
    ] {
        let mut flags = flags;
        flags.extend(["--failover-timeout-ms".to_owned(), FAILOVER_MS.to_owned()]);
        let run = launch(&flags, "certs-foreign", &[], "true").finish(SLOW);
        let context = format!(
            "{case}\n{}\n--- coordinator\n{}",
            run.dump(),
            coordinator.output()
        );
        assert_eq!(run.code(), Some(1), "{context}");
        assert!(run.elapsed < Duration::from_secs(15), "{context}");
        assert_eq!(run.stderr.len(), 1, "one line\n{context}");
        let line = &run.stderr[0];
        assert!(
            line.starts_with("muster-agent: TLS handshake with the coordinator"),
            "{context}"
        );
        assert!(line.contains(says), "{context}");
    }
    // The coordinator refused them, not everyone: our own flags still reach it.
    status(&ours.agent_flags_for(&addr));
}

/// Bad input: one line on stderr, the documented exit status, and nothing written; files
/// already there are left byte for byte as they were, unless `--force`.
#[test]
fn bad_input_exits_with_one_line_and_writes_nothing() {
    let scratch = Scratch::new("bad");
    std::fs::create_dir(&scratch.0).expect("mkdir");
    let missing = scratch.0.join("new");
    let file = scratch.0.join("a-file");
    std::fs::write(&file, "x").expect("write");
    let check = |args: &[&str], code: i32, says: &str| {
        let out = certs(args);
        let context = format!("certs {args:?}\n{}", dump(&out));
        assert_eq!(out.status.code(), Some(code), "{context}");
        assert!(out.stdout.is_empty(), "{context}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(err.lines().count(), 1, "{context}");
        assert!(err.starts_with("muster-agent: "), "{context}");
        assert!(err.contains(says), "{context}");
    };
    let m = shown(&missing);
    check(&["--out", &m], 2, "certs needs at least one --host");
    check(&["--host", "localhost"], 2, "certs needs --out DIR");
    check(&["--out", &m, "--host", "node1:29470"], 2, "without a port");
    check(
        &["--out", &m, "--host", "ok", "--host", "a b"],
        2,
        "is not a host name",
    );
    assert!(!missing.exists());
    // Where no one may make a directory, root included.
    check(
        &["--out", "/sys/muster-certs-e2e/pki", "--host", "localhost"],
        1,
        "cannot create /sys/muster-certs-e2e/pki",
    );
    assert!(!Path::new("/sys/muster-certs-e2e").exists());
    check(
        &["--out", &shown(&file), "--host", "localhost"],
        1,
        "is not a directory",
    );
    check(
        &["--out", &shown(&file.join("pki")), "--host", "localhost"],
        1,
        "Not a directory",
    );
    assert_eq!(std::fs::read_to_string(&file).ok().as_deref(), Some("x"));

    // A directory without write permission (root writes anyway: checked only for others).
    let locked = scratch.0.join("locked");
    std::fs::create_dir(&locked).expect("mkdir");
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o500)).expect("chmod");
    let probe = locked.join("probe");
    if std::fs::write(&probe, "").is_ok() {
        let _ = std::fs::remove_file(&probe);
        eprintln!("not checked: a read-only directory (this user, root, may write into it)");
    } else {
        check(
            &["--out", &shown(&locked), "--host", "localhost"],
            1,
            "Permission denied",
        );
        assert_eq!(contents(&locked).len(), 0);
    }
    std::fs::set_permissions(&locked, std::fs::Permissions::from_mode(0o700)).expect("chmod");

    // Existing files: refused, left as they were; --force replaces them all.
    let dir = scratch.0.join("pki");
    certs_ok(&dir, &["localhost"]);
    let before = contents(&dir);
    assert_eq!(before.len(), 7, "{:?}", before.keys());
    let d = shown(&dir);
    check(
        &["--out", &d, "--host", "localhost"],
        1,
        "already holds ca.pem, ca-key.pem, server.pem, server-key.pem, client.pem, client-key.pem, token; nothing was written (pass --force to replace them)",
    );
    assert_eq!(contents(&dir), before);
    let out = certs(&["--out", &d, "--host", "localhost", "--force"]);
    assert!(out.status.success(), "{}", dump(&out));
    let after = contents(&dir);
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>()
    );
    for (name, bytes) in &after {
        assert_ne!(Some(bytes), before.get(name), "{name} was not replaced");
    }
}
