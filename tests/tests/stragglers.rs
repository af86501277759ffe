//! Stragglers, end to end (`docs/hangs.md`): a 4-rank torch gloo DDP job under the real
//! `muster-agent launch`, unmodified (no muster import), where rank 3 spends 30 ms more per
//! step in its data loading: the agents' stack samples show the others waiting in backward
//! (where DDP all-reduces) and rank 3 in its data step, and `describe` names rank 3 on a line
//! of its own within 30 s. The same job balanced names nobody.
//!
//! A test binary of its own (not `stacks.rs`): four torch processes are all two cores hold,
//! and cargo runs a binary's tests side by side. Needs the peers' venv; without it, each test
//! prints `skipped: ...` and passes.
#![allow(clippy::unwrap_used, missing_docs)]

use muster_tests::{Agent, Stream, agent_bin, peers_python, workspace_root};
use std::process::Command;
use std::time::{Duration, Instant};

/// torch's import takes seconds on a 2-core machine, and every rank imports it at once.
const PYTHON_START: Duration = Duration::from_secs(120);

/// `launch --nproc-per-node 4` of the DDP loop, its coordinator's address, and when the four
/// ranks started training.
fn start(job: &str, env: &[(&str, &str)]) -> Option<(Agent, String, Instant)> {
    let python = peers_python(&["torch"])?;
    let script = workspace_root().join("tests/python/straggler_ddp.py");
    let agent = Agent::start_with_env(
        &[
            "launch",
            "--nproc-per-node",
            "4",
            "--job-id",
            job,
            "--hang-timeout",
            "off",
            "--",
            python.to_str().unwrap(),
            script.to_str().unwrap(),
        ],
        env,
    );
    let addr = agent.embedded_coordinator();
    agent.wait_for_lines(Stream::Stdout, 4, PYTHON_START, |l| {
        l.ends_with("] training")
    });
    Some((agent, addr, Instant::now()))
}

/// `muster-agent describe --coordinator ADDR JOB`'s output (exit 0 asserted).
fn describe(addr: &str, job: &str) -> String {
    let out = Command::new(agent_bin())
        .args(["describe", "--coordinator", addr, job])
        .output()
        .unwrap();
    assert!(out.status.success(), "{out:?}");
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn the_rank_the_others_wait_for_is_named_within_30_s() {
    let Some((agent, addr, training)) = start("ddp-skewed", &[("STRAGGLER_RANK", "3")]) else {
        return;
    };
    // The view is over each rank's last 30 s of samples: on a loaded machine the first
    // samples of the straggler can still be its start-up (torch's import, DDP's construction),
    // so where it spends its time may name that first. Every straggler line must name rank 3;
    // within 30 s one must name its data loading.
    let text = loop {
        let text = describe(&addr, "ddp-skewed");
        if let Some(line) = text.lines().find(|l| l.starts_with("straggler: ")) {
            assert!(
                line.starts_with("straggler: rank 3 (node 0, host "),
                "{text}"
            );
            if line.contains("load_batch") {
                break text;
            }
        }
        assert!(
            training.elapsed() < Duration::from_secs(30),
            "no straggler named at its data loading within 30 s:\n{text}\n{}",
            agent.output()
        );
        std::thread::sleep(Duration::from_secs(1));
    };
    eprintln!("named {:?} after training began", training.elapsed());
    let line = text.lines().find(|l| l.starts_with("straggler: ")).unwrap();
    assert!(line.contains("the others wait at torch.autograd"), "{text}");
    // Every rank's share of samples spent waiting is in the table.
    assert!(text.contains(" WAITING "), "{text}");
}

#[test]
fn a_balanced_job_names_nobody() {
    let Some((_agent, addr, training)) = start("balanced", &[]) else {
        return;
    };
    let mut last = String::new();
    while training.elapsed() < Duration::from_secs(25) {
        last = describe(&addr, "balanced");
        assert!(
            !last.lines().any(|l| l.starts_with("straggler: ")),
            "{last}"
        );
        std::thread::sleep(Duration::from_secs(1));
    }
    // Sampled all along: the view had what it needed to judge.
    assert!(last.contains(" WAITING "), "{last}");
}
