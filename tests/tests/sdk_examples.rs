//! End-to-end tests of the worker SDK's examples run under `muster-agent`: barriers across
//! ranks, main-process-first ordering, and failure propagation from one rank to the others.
//! A test whose example does not exist in `worker-sdk/examples/` is skipped with a message.

use muster_tests::{Agent, Finished, SLOW, example_bin};
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
            |l| l == "muster-agent: job sdk failed: rank 2 (node 0, host 127.0.0.1) exited with status 7"
        ),
        "{}",
        run.dump()
    );
    // The others learn of the failure from the coordinator and say so before the agent stops
    // them; the whole job ends well within the grace period.
    errors_name(&run, &[0, 1, 3], 2);
    assert!(
        run.elapsed < Duration::from_secs(4),
        "{:?}\n{}",
        run.elapsed,
        run.dump()
    );
}

/// A worker that dies between registering (through its agent, and with its relay)
/// and its first barrier (issue 29): the others' first barrier fails naming it, and the job
/// fails once, with its exit status.
#[test]
fn a_worker_that_dies_before_its_first_barrier_fails_the_others_first_barrier() {
    let Some(bin) = example("fail_at") else {
        return;
    };
    let run = launch(4, &bin, &["--rank", "1", "--code", "9", "--at", "0"]).finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(
        run.stderr.iter().any(
            |l| l == "muster-agent: job sdk failed: rank 1 (node 0, host 127.0.0.1) exited with status 9"
        ),
        "{}",
        run.dump()
    );
    errors_name(&run, &[0, 2, 3], 1);
    for rank in [0, 2, 3] {
        assert!(
            !run.rank_stdout(rank)
                .iter()
                .any(|l| l.contains("passed the barrier")),
            "{}",
            run.dump()
        );
    }
    assert!(
        run.elapsed < Duration::from_secs(4),
        "{:?}\n{}",
        run.elapsed,
        run.dump()
    );
}

/// A worker that exits 0 while the others wait, without `leave` (issue 29): the supervisor
/// does not report a clean exit, so the coordinator learns of it from the agent's gateway,
/// whose session with the worker ended (`rank_lost`); the others' barrier fails naming it,
/// and so does the job.
#[test]
fn a_worker_that_exits_0_without_leave_fails_the_others_naming_it() {
    let Some(bin) = example("fail_at") else {
        return;
    };
    let run = launch(4, &bin, &["--rank", "2", "--code", "0"]).finish(SLOW);
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(
        run.stderr.iter().any(|l| l
            == "muster-agent: job sdk failed: rank 2 (node 0, host 127.0.0.1) session ended without leave (process exited or was killed)"),
        "{}",
        run.dump()
    );
    errors_name(&run, &[0, 1, 3], 2);
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
    // The main process finishes its block before any other rank starts its own, by the clock
    // each line carries: where lines land in the merged output depends on pipe scheduling.
    let at = |needle: &str| -> u128 {
        let line = run
            .stdout
            .iter()
            .find(|l| l.contains(needle))
            .unwrap_or_else(|| panic!("no line with {needle:?}\n{}", run.dump()));
        let (_, ns) = line
            .rsplit_once("at_ns=")
            .unwrap_or_else(|| panic!("no at_ns= in {line:?}"));
        ns.trim()
            .parse()
            .unwrap_or_else(|e| panic!("at_ns in {line:?}: {e}"))
    };
    let main_done = at("rank=0 main_process_first: done");
    for rank in 1..4 {
        let start = at(&format!("rank={rank} main_process_first: start"));
        assert!(
            main_done <= start,
            "rank {rank} started {} ns before rank 0 was done\n{}",
            main_done - start,
            run.dump()
        );
    }
}

/// The worker process of global rank `rank` among `agent`'s children, from /proc.
fn worker_pid(agent: i32, rank: u32) -> Option<i32> {
    let want = format!("RANK={rank}");
    std::fs::read_dir("/proc").ok()?.find_map(|e| {
        let pid: i32 = e.ok()?.file_name().to_str()?.parse().ok()?;
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
        let ppid: i32 = stat
            .rsplit_once(')')?
            .1
            .split_whitespace()
            .nth(1)?
            .parse()
            .ok()?;
        let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
        (ppid == agent && environ.split(|b| *b == 0).any(|v| v == want.as_bytes())).then_some(pid)
    })
}

#[test]
fn a_worker_killed_mid_barrier_fails_every_other_rank_within_two_seconds() {
    let Some(bin) = example("barrier_loop") else {
        return;
    };
    let agent = launch(3, &bin, &["--iters", "100000000", "--warmup", "0"]);
    let deadline = std::time::Instant::now() + SLOW;
    let victim = loop {
        if let Some(pid) = worker_pid(agent.pid().as_raw(), 1) {
            break pid;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "rank 1's process never appeared"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Let the ranks get well into their barrier loop, then kill rank 1 in the middle of it.
    std::thread::sleep(Duration::from_millis(500));
    let killed = std::time::Instant::now();
    nix::sys::signal::kill(
        nix::unistd::Pid::from_raw(victim),
        nix::sys::signal::Signal::SIGKILL,
    )
    .expect("rank 1 can be killed");
    for rank in [0, 2] {
        agent.wait_for_lines(muster_tests::Stream::Stderr, 1, SLOW, |l| {
            l.starts_with(&format!("[rank {rank}] barrier_loop: ")) && l.contains("rank 1")
        });
    }
    let noticed = killed.elapsed();
    let run = agent.finish(SLOW);
    assert!(
        noticed < Duration::from_secs(2),
        "the others learned after {noticed:?}\n{}",
        run.dump()
    );
    assert_eq!(run.code(), Some(1), "{}", run.dump());
    assert!(
        run.stderr
            .iter()
            .any(|l| l.contains("rank 1 (local rank 1)") && l.contains("SIGKILL")),
        "{}",
        run.dump()
    );
    eprintln!("the other ranks learned of rank 1's SIGKILL after {noticed:?}");
}

/// Checks that each of `ranks` printed a `fail_at` error line naming rank `dead`.
fn errors_name(run: &Finished, ranks: &[u32], dead: u32) {
    for &rank in ranks {
        let error = run
            .rank_stdout(rank)
            .into_iter()
            .find(|l| l.starts_with(&format!("rank={rank} error: ")))
            .unwrap_or_else(|| panic!("rank {rank} printed no error\n{}", run.dump()));
        assert!(
            error.contains(&format!("rank {dead}")),
            "rank {rank}: {error}"
        );
    }
}
