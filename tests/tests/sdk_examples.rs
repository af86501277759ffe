//! End-to-end tests of the worker SDK's examples run under `muster-agent`: barriers across
//! ranks, main-process-first ordering, and failure propagation from one rank to the others.
//! A test whose example does not exist in `worker-sdk/examples/` is skipped with a message.

use muster_tests::{Agent, SLOW, example_bin};
use std::path::{Path, PathBuf};
use std::time::Duration;

fn example(name: &str) -> Option<PathBuf> {
    let path = example_bin(name);
    if path.is_none() {
        eprintln!("skipped: worker-sdk/examples/{name}.rs does not exist");
    }
    path
}

fn launch(n: u32, program: &Path, args: &[&str]) -> Agent {
    launch_with(&[], n, program, args)
}

/// `muster-agent launch <flags> --nproc-per-node N --job-id sdk -- PROGRAM ARGS`.
fn launch_with(flags: &[&str], n: u32, program: &Path, args: &[&str]) -> Agent {
    let n = n.to_string();
    let program = program.to_str().expect("a UTF-8 target path");
    let mut all = vec!["launch"];
    all.extend_from_slice(flags);
    all.extend_from_slice(&["--nproc-per-node", &n, "--job-id", "sdk", "--", program]);
    all.extend_from_slice(args);
    Agent::start(&all)
}

#[test]
fn barrier_loop_with_four_ranks() {
    // Through the agent's node relay (the default), then through each rank's session.
    for flags in [&[][..], &["--no-relay"][..]] {
        let Some(bin) = example("barrier_loop") else {
            return;
        };
        let run = launch_with(flags, 4, &bin, &["--iters", "50", "--warmup", "5"]).finish(SLOW);
        assert_eq!(run.code(), Some(0), "{flags:?}\n{}", run.dump());
        for rank in 0..4 {
            let lines = run.rank_stdout(rank);
            assert_eq!(lines.len(), 1, "rank {rank} {flags:?}\n{}", run.dump());
            assert!(
                lines[0].starts_with(&format!("rank={rank} iters=50 p50_us=")),
                "{flags:?}\n{}",
                run.dump()
            );
        }
        eprintln!("barrier_loop {flags:?}: {}", run.stdout.join(" | "));
    }
}

#[test]
fn fail_at_makes_the_other_ranks_fail_fast_naming_the_failed_rank() {
    let Some(bin) = example("fail_at") else {
        return;
    };
    let run = launch(4, &bin, &["--rank", "2", "--code", "7"]).finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(
        run.stderr.iter().any(
            |l| l == "muster-agent: job sdk failed: rank 2 (local rank 2) exited with status 7"
        ),
        "{}",
        run.dump()
    );
    // The others learn of the failure from the coordinator and say so before the agent stops
    // them; the whole job ends well within the grace period.
    for rank in [0, 1, 3] {
        let error = run
            .rank_stdout(rank)
            .into_iter()
            .find(|l| l.starts_with(&format!("rank={rank} error: ")))
            .unwrap_or_else(|| panic!("rank {rank} printed no error\n{}", run.dump()))
            .to_owned();
        assert!(error.contains("rank 2"), "rank {rank}: {error}");
    }
    assert!(
        run.elapsed < Duration::from_secs(4),
        "{:?}\n{}",
        run.elapsed,
        run.dump()
    );
}

#[test]
fn main_first_with_four_ranks() {
    let Some(bin) = example("main_first") else {
        return;
    };
    let run = launch(4, &bin, &[]).finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    // The main process finishes its block before any other rank starts its own.
    let position = |needle: &str| run.stdout.iter().position(|l| l.ends_with(needle));
    let main_done = position("rank=0 main_process_first: done")
        .unwrap_or_else(|| panic!("rank 0 never finished its block\n{}", run.dump()));
    for rank in 1..4 {
        let start = position(&format!("rank={rank} main_process_first: start"))
            .unwrap_or_else(|| panic!("rank {rank} never started its block\n{}", run.dump()));
        assert!(
            main_done < start,
            "rank {rank} started before rank 0 was done\n{}",
            run.dump()
        );
    }
}
