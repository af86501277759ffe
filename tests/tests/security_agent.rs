//! End-to-end tests of the agent's TLS and authentication: a real `muster-coordinator` with
//! mutual TLS and a cluster token on 127.0.0.1, real `muster-agent launch` processes with
//! `--tls-*` and `--auth-token-file`, and SDK example workers that reach the coordinator with
//! the job token and TLS files their agent hands them. Also what must fail, and fail fast: an
//! agent without the token, an agent with a certificate from another CA. And what must never
//! show: the cluster token and job tokens, in any process's output at debug level.

use muster_tests::pki::Pki;
use muster_tests::{Agent, Finished, SLOW, agent_bin, coordinator_bin, example_bin};
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

/// What the agents in a failing test get as `--failover-timeout-ms`: a refusal must end the
/// launch well within it (or at worst at it), never hang.
const FAILOVER_MS: &str = "3000";

/// Debug logs everywhere (rustls, h2 and tonic included), trace for muster's own crates.
const VERBOSE: &str = "debug,muster_agent=trace,muster_coordinator=trace,muster=trace";

/// A fresh PKI in a directory of its own, removed on drop.
struct Setup {
    pki: Pki,
}

impl Setup {
    fn new(name: &str) -> Self {
        let dir = std::env::temp_dir().join(format!(
            "muster-security-agent-{}-{name}",
            std::process::id()
        ));
        let _ = std::fs::remove_dir_all(&dir);
        Self {
            pki: Pki::generate(&dir, &[]),
        }
    }

    /// A `muster-coordinator` with mutual TLS and the cluster token on 127.0.0.1, its output
    /// captured (at `log` level).
    fn coordinator(&self, log: &str) -> (Agent, String) {
        let addr = format!("127.0.0.1:{}", muster_tests::free_port());
        let mut cmd = Command::new(coordinator_bin());
        cmd.args(["--listen", &addr, "--tls-cert"])
            .arg(&self.pki.server_cert)
            .arg("--tls-key")
            .arg(&self.pki.server_key)
            .arg("--tls-client-ca")
            .arg(&self.pki.ca)
            .arg("--auth-token-file")
            .arg(&self.pki.token_file)
            .env("RUST_LOG", log)
            .env("NO_COLOR", "1");
        let coordinator = Agent::spawn(cmd, "muster-coordinator");
        let deadline = Instant::now() + SLOW;
        while std::net::TcpStream::connect(&addr).is_err() {
            assert!(
                Instant::now() < deadline,
                "the coordinator does not listen\n{}",
                coordinator.output()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        (coordinator, addr)
    }

    /// The client flags: the cluster CA, and `identity` (certificate, key) for mutual TLS.
    fn tls_flags(&self, identity: (&Path, &Path)) -> Vec<String> {
        vec![
            "--tls-ca".into(),
            shown(&self.pki.ca),
            "--tls-cert".into(),
            shown(identity.0),
            "--tls-key".into(),
            shown(identity.1),
        ]
    }

    /// The agent's flags with the cluster CA, its client certificate and the token.
    fn secure_flags(&self) -> Vec<String> {
        let mut flags = self.tls_flags((&self.pki.client_cert, &self.pki.client_key));
        flags.extend(["--auth-token-file".into(), shown(&self.pki.token_file)]);
        flags
    }
}

impl Drop for Setup {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.pki.dir);
    }
}

fn shown(p: &Path) -> String {
    p.to_str().expect("a UTF-8 temporary path").to_owned()
}

/// `muster-agent launch --coordinator <addr> --job-id <job> <flags> -- sh -c <script>`.
fn launch(addr: &str, job: &str, flags: &[String], script: &str, env: &[(&str, &str)]) -> Agent {
    let mut args: Vec<&str> = vec![
        "launch",
        "--coordinator",
        addr,
        "--job-id",
        job,
        "--advertise-addr",
        "127.0.0.1",
        "--grace-period-ms",
        "1000",
    ];
    args.extend(flags.iter().map(String::as_str));
    args.extend(["--", "sh", "-c", script]);
    let mut cmd = Command::new(agent_bin());
    cmd.args(&args)
        .env("NO_COLOR", "1")
        .envs(env.iter().copied());
    Agent::spawn(cmd, format!("muster-agent {args:?}"))
}

/// The SDK example `name` with `args` as a shell command, or `None` (with the reason
/// printed) when it is missing.
fn example(name: &str, args: &str) -> Option<String> {
    let Some(bin) = example_bin(name) else {
        eprintln!("skipped: worker-sdk/examples/{name}.rs is missing");
        return None;
    };
    Some(format!("{} {args}", shown(&bin)))
}

/// Runs a two-node job (2 workers per node) on a secured coordinator: each worker checks its
/// security environment (prints `token=ok` when `MUSTER_TOKEN` is its job's token, and the
/// `MUSTER_TLS_*` it got), then execs `worker` (an SDK example). Returns both agents' runs
/// and the coordinator's process (still running).
fn secured_job(setup: &Setup, job: &str, worker: &str, log: &str) -> (Vec<Finished>, Agent) {
    let (coordinator, addr) = setup.coordinator(log);
    // What the workers' token must be, for a comparison in the worker (never printed).
    let expected = setup.pki.dir.join("expected-job-token");
    std::fs::write(&expected, muster_core::job_token::mint(Pki::TOKEN, job))
        .expect("write the expected job token");
    let script = format!(
        "if [ \"$MUSTER_TOKEN\" = \"$(cat {expected})\" ]; then t=ok; else t=wrong; fi; \
         echo ready rank=$RANK token=$t ca=$MUSTER_TLS_CA cert=$MUSTER_TLS_CERT \
         key=$MUSTER_TLS_KEY domain=${{MUSTER_TLS_DOMAIN:-none}}; exec {worker}",
        expected = shown(&expected),
    );
    let agents: Vec<Agent> = (0..2)
        .map(|node| {
            let mut flags = setup.secure_flags();
            flags.extend(
                [
                    "--nnodes",
                    "2",
                    "--node-rank",
                    &node.to_string(),
                    "--nproc-per-node",
                    "2",
                ]
                .map(str::to_owned),
            );
            launch(&addr, job, &flags, &script, &[("RUST_LOG", log)])
        })
        .collect();
    let deadline = Instant::now() + SLOW * 2;
    let runs: Vec<Finished> = agents.into_iter().map(|a| a.finish_by(deadline)).collect();
    (runs, coordinator)
}

/// (a) Two nodes, mutual TLS and the cluster token: `allreduce_bench` (the CPU communicator
/// finds its peers in the key-value store; barriers go through the node relays and the
/// coordinator) runs to its end, and every worker got its job token and the TLS files.
#[test]
fn a_secured_two_node_job_runs_its_sdk_workers_to_the_end() {
    let setup = Setup::new("job");
    let Some(worker) = example("allreduce_bench", "--sizes 4,4096 --iters 5") else {
        return;
    };
    let (runs, coordinator) = secured_job(&setup, "sec-job", &worker, "warn");
    for run in &runs {
        assert_eq!(
            run.code(),
            Some(0),
            "{}\n--- coordinator\n{}",
            run.dump(),
            coordinator.output()
        );
    }
    let ready: Vec<&String> = runs
        .iter()
        .flat_map(|r| r.stdout.iter())
        .filter(|l| l.contains("] ready "))
        .collect();
    assert_eq!(ready.len(), 4, "{ready:?}");
    let ca = shown(&setup.pki.ca);
    let cert = shown(&setup.pki.client_cert);
    let key = shown(&setup.pki.client_key);
    for line in ready {
        assert!(line.contains(" token=ok "), "{line}");
        assert!(
            line.contains(&format!(" ca={ca} cert={cert} key={key} domain=none")),
            "{line}"
        );
    }
    // Rank 0 measured both sizes across the two nodes.
    let sizes = runs[0]
        .rank_stdout(0)
        .into_iter()
        .filter(|l| l.starts_with("size_bytes="))
        .count();
    assert_eq!(sizes, 2, "{}", runs[0].dump());
}

/// (b) The same agent without `--auth-token-file`: the coordinator refuses it, and the agent
/// says so in one line and exits 1 at once (a refusal is an answer, not retried).
#[test]
fn an_agent_without_the_token_fails_fast_saying_unauthenticated() {
    let setup = Setup::new("notoken");
    let (_coordinator, addr) = setup.coordinator("warn");
    let mut flags = setup.tls_flags((&setup.pki.client_cert, &setup.pki.client_key));
    flags.extend(["--failover-timeout-ms".into(), FAILOVER_MS.into()]);
    let run = launch(&addr, "sec-notoken", &flags, "true", &[]).finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(run.elapsed < Duration::from_secs(10), "{}", run.dump());
    assert_eq!(run.stderr.len(), 1, "one line\n{}", run.dump());
    let line = &run.stderr[0];
    assert!(line.starts_with("muster-agent: "), "{line}");
    assert!(
        line.contains("UNAUTHENTICATED") && line.contains("credentials"),
        "{line}"
    );
}

/// (b') A wrong token is refused the same way, and its value is not echoed.
#[test]
fn an_agent_with_a_wrong_token_fails_fast() {
    let setup = Setup::new("wrongtoken");
    let (_coordinator, addr) = setup.coordinator("warn");
    let wrong = setup.pki.dir.join("wrong-token");
    std::fs::write(&wrong, "not-the-cluster-token-0123456789\n").expect("write a token file");
    let mut flags = setup.tls_flags((&setup.pki.client_cert, &setup.pki.client_key));
    flags.extend([
        "--auth-token-file".into(),
        shown(&wrong),
        "--failover-timeout-ms".into(),
        FAILOVER_MS.into(),
    ]);
    let run = launch(&addr, "sec-wrongtoken", &flags, "true", &[]).finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(run.elapsed < Duration::from_secs(10), "{}", run.dump());
    assert_eq!(run.stderr.len(), 1, "one line\n{}", run.dump());
    assert!(run.stderr[0].contains("UNAUTHENTICATED"), "{}", run.dump());
    assert!(
        !run.dump().contains("not-the-cluster-token"),
        "{}",
        run.dump()
    );
}

/// (c) A client certificate from another CA: the coordinator rejects the handshake, and the
/// agent says so in one line within its failover budget.
#[test]
fn an_agent_with_a_foreign_client_certificate_fails_with_a_handshake_error() {
    let setup = Setup::new("foreign");
    let (_coordinator, addr) = setup.coordinator("warn");
    let mut flags = setup.tls_flags((
        &setup.pki.foreign_client_cert,
        &setup.pki.foreign_client_key,
    ));
    flags.extend([
        "--auth-token-file".into(),
        shown(&setup.pki.token_file),
        "--failover-timeout-ms".into(),
        FAILOVER_MS.into(),
    ]);
    let run = launch(&addr, "sec-foreign", &flags, "true", &[]).finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(run.elapsed < Duration::from_secs(15), "{}", run.dump());
    assert_eq!(run.stderr.len(), 1, "one line\n{}", run.dump());
    eprintln!("{}", run.stderr[0]);
    let line = run.stderr[0].to_lowercase();
    assert!(
        line.contains("tls") && (line.contains("handshake") || line.contains("certificate")),
        "{}",
        run.dump()
    );
}

/// (c') An agent that does not trust the coordinator's CA refuses it, in one line.
#[test]
fn an_agent_that_does_not_trust_the_coordinator_fails_with_a_certificate_error() {
    let setup = Setup::new("distrust");
    let (_coordinator, addr) = setup.coordinator("warn");
    let flags: Vec<String> = [
        "--tls-ca",
        &shown(&setup.pki.foreign_ca),
        "--tls-cert",
        &shown(&setup.pki.client_cert),
        "--tls-key",
        &shown(&setup.pki.client_key),
        "--auth-token-file",
        &shown(&setup.pki.token_file),
        "--failover-timeout-ms",
        FAILOVER_MS,
    ]
    .map(str::to_owned)
    .to_vec();
    let run = launch(&addr, "sec-distrust", &flags, "true", &[]).finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(run.elapsed < Duration::from_secs(15), "{}", run.dump());
    assert_eq!(run.stderr.len(), 1, "one line\n{}", run.dump());
    eprintln!("{}", run.stderr[0]);
    assert!(
        run.stderr[0].to_lowercase().contains("certificate"),
        "{}",
        run.dump()
    );
}

/// (d) A secured job like (a), running `main_first` (barriers, shared values, unique ids),
/// with debug logs on every process: neither the cluster token nor any job token (`mj1.…`)
/// shows up in any output.
#[test]
fn no_token_shows_in_any_output_at_debug_level() {
    let setup = Setup::new("logs");
    let Some(worker) = example("main_first", "") else {
        return;
    };
    let (runs, coordinator) = secured_job(&setup, "sec-logs", &worker, VERBOSE);
    let job_token = muster_core::job_token::mint(Pki::TOKEN, "sec-logs");
    let mut all = coordinator.output();
    for run in &runs {
        all.push_str(&run.dump());
    }
    drop(coordinator);
    // The logs are really verbose (so that a token would have been there to find).
    assert!(all.lines().count() > 50, "{all}");
    eprintln!(
        "{} lines, {} from h2, {} from rustls",
        all.lines().count(),
        all.matches(" h2::").count(),
        all.matches(" rustls::").count()
    );
    assert!(!all.contains(Pki::TOKEN), "the cluster token leaked");
    assert!(!all.contains(&job_token), "a job token leaked");
    let mac = job_token.rsplit('.').next().unwrap_or_default();
    assert!(!all.contains(mac), "a job token's MAC leaked");
    assert!(!all.contains("mj1."), "something like a job token shows");
    for run in &runs {
        assert_eq!(run.code(), Some(0), "{}", run.dump());
    }
}

/// (e) Daemon mode on the secured coordinator: `serve` registers with TLS and the token,
/// `submit --wait` places a job on it and follows it, and the placed job's workers get their
/// job token as a launch's do. `status` without the token is refused.
#[test]
fn a_secured_daemon_agent_runs_a_submitted_job() {
    let setup = Setup::new("daemon");
    let (coordinator, addr) = setup.coordinator("warn");
    let flags = setup.secure_flags();
    let mut args = vec!["serve", "--coordinator", &addr, "--agent-id", "sec-daemon"];
    args.extend(flags.iter().map(String::as_str));
    let mut cmd = Command::new(agent_bin());
    cmd.args(&args).env("NO_COLOR", "1");
    let daemon = Agent::spawn(cmd, "muster-agent serve");
    daemon.wait_for_lines(muster_tests::Stream::Stderr, 1, SLOW, |l| {
        l.contains("serving as")
    });
    let expected = setup.pki.dir.join("expected-job-token");
    std::fs::write(
        &expected,
        muster_core::job_token::mint(Pki::TOKEN, "sec-submitted"),
    )
    .expect("write the expected job token");
    let script = format!(
        "[ \"$MUSTER_TOKEN\" = \"$(cat {})\" ] && [ -n \"$MUSTER_TLS_CA\" ]",
        shown(&expected)
    );
    let mut submit = vec![
        "submit",
        "--coordinator",
        &addr,
        "--job-id",
        "sec-submitted",
        "--nproc-per-node",
        "2",
        "--wait",
    ];
    submit.extend(flags.iter().map(String::as_str));
    submit.extend(["--", "sh", "-c", &script]);
    let out = Command::new(agent_bin())
        .args(&submit)
        .output()
        .expect("muster-agent runs");
    let shown_out = format!(
        "{}\n--- stdout\n{}--- stderr\n{}\n--- daemon\n{}\n--- coordinator\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
        daemon.output(),
        coordinator.output()
    );
    assert!(out.status.success(), "{shown_out}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("job sec-submitted: finished"),
        "{shown_out}"
    );
    // An operator without the token is refused, in one line.
    let tls = setup.tls_flags((&setup.pki.client_cert, &setup.pki.client_key));
    let mut status = vec!["status", "--coordinator", &addr];
    status.extend(tls.iter().map(String::as_str));
    let out = Command::new(agent_bin())
        .args(&status)
        .output()
        .expect("muster-agent runs");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("UNAUTHENTICATED"), "{err}");
}
