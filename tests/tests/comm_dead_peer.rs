//! A peer lost in the middle of a CPU all_reduce, end to end: `allreduce_kill` under
//! `muster-agent launch`, one rank ending abruptly (exit, abort) or freezing (SIGSTOP) partway
//! into a large all_reduce; every other rank must print an error that names it, quickly,
//! instead of hanging.

use std::time::Duration;

use muster_tests::{Agent, SLOW, coordinator::Coordinator, example_bin};

/// Runs `allreduce_kill` with 4 ranks (rank 2 the victim) and returns, for each survivor, its
/// error line and how long after the victim's death it came.
fn run(how: &str, flags: &[&str]) -> Option<Vec<(u32, String, u128)>> {
    let Some(bin) = example_bin("allreduce_kill") else {
        eprintln!("skipped: worker-sdk/examples/allreduce_kill.rs does not exist");
        return None;
    };
    let mut args = vec!["launch"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&[
        "--nproc-per-node",
        "4",
        "--job-id",
        "comm-dead",
        "--",
        bin.to_str().expect("a UTF-8 path"),
        "--rank",
        "2",
        "--at",
        "2",
        "--mib",
        "16",
        "--how",
        how,
    ]);
    let run = Agent::start(&args).finish(SLOW);
    let at_ms = |line: &str| -> Option<u128> {
        line.split("at_ms=")
            .nth(1)?
            .split(|c: char| !c.is_ascii_digit())
            .next()?
            .parse()
            .ok()
    };
    let died = run
        .rank_stdout(2)
        .into_iter()
        .find(|l| l.starts_with("rank=2 dying"))
        .and_then(at_ms)
        .unwrap_or_else(|| panic!("rank 2 never died\n{}", run.dump()));
    let mut out = Vec::new();
    for rank in [0, 1, 3] {
        let line = run
            .rank_stdout(rank)
            .into_iter()
            .find(|l| l.starts_with(&format!("rank={rank} error")))
            .unwrap_or_else(|| panic!("rank {rank} printed no error ({how})\n{}", run.dump()))
            .to_owned();
        let after = at_ms(&line).unwrap_or(0).saturating_sub(died);
        out.push((rank, line, after));
    }
    Some(out)
}

fn check(how: &str, results: &[(u32, String, u128)], within: Duration) {
    for (rank, line, after) in results {
        assert!(
            line.contains("rank 2 (node 0, host 127.0.0.1)"),
            "rank {rank} ({how}): {line}"
        );
        assert!(
            line.contains("all_reduce of 4194304 f32"),
            "rank {rank} ({how}): {line}"
        );
        assert!(
            *after < within.as_millis(),
            "rank {rank} ({how}) took {after} ms: {line}"
        );
        eprintln!("{how}: rank {rank} after {after} ms: {line}");
    }
}

#[test]
fn a_rank_that_exits_mid_all_reduce_is_named_by_every_other_rank() {
    for how in ["exit", "abort"] {
        let Some(results) = run(how, &[]) else {
            return;
        };
        check(how, &results, Duration::from_secs(2));
    }
}

#[test]
fn a_stopped_rank_is_named_after_the_heartbeat_timeout() {
    let coordinator = Coordinator::start(&["--heartbeat-timeout-ms", "1000"]);
    let Some(results) = run(
        "stop",
        &[
            "--coordinator",
            &coordinator.addr,
            "--grace-period-ms",
            "500",
        ],
    ) else {
        return;
    };
    // The heartbeat timeout plus the coordinator's check interval and some slack.
    check("stop", &results, Duration::from_secs(4));
}
