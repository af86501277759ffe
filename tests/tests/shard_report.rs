//! Accelerate-exact data sharding end to end: the `shard_report` example (the worker SDK's
//! `muster::data`) under `muster-agent launch`, against hand-checked reports, and against
//! Accelerate's own classes (`tests/python/shard_report.py`) over a grid of lengths, batch
//! sizes, process counts and flags.
//!
//! The grid needs the peers' virtual environment (torch, accelerate: `$MUSTER_PEERS_VENV`,
//! else `~/.cache/muster-peers`, made by `scripts/install-peers.sh`); without it those tests
//! print `skipped: ...` and pass. The muster side of the grid is the example's `--cases` mode:
//! the library's sampler and `gather_for_metrics`' truncation (`metrics_from_gathered`) for
//! every rank, from one process; the launched tests cover the collective path.

use muster_tests::{Agent, Finished, SLOW, example_bin, peers_python, workspace_root};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A hand-checked report: the example's `--simulate` output (every rank's batches and rank 0's
/// gathers, step by step).
struct Case {
    world: u32,
    args: &'static str,
    report: &'static str,
}

const CASES: &[Case] = &[
    // The seeds' worked example: the last step wraps around to the start of the epoch, and
    // gather_for_metrics keeps the 10 % 8 = 2 real items.
    Case {
        world: 2,
        args: "--len 10 --batch-size 4",
        report: "
            rank=0 step=0 batch=0,1,2,3
            rank=1 step=0 batch=4,5,6,7
            step=0 gathered=0,1,2,3,4,5,6,7
            rank=0 step=1 batch=8,9,0,1
            rank=1 step=1 batch=2,3,4,5
            step=1 gathered=8,9",
    },
    // Each global batch of 4 split in two; the last one padded from the first batch.
    Case {
        world: 2,
        args: "--len 10 --batch-size 4 --split-batches",
        report: "
            rank=0 step=0 batch=0,1
            rank=1 step=0 batch=2,3
            step=0 gathered=0,1,2,3
            rank=0 step=1 batch=4,5
            rank=1 step=1 batch=6,7
            step=1 gathered=4,5,6,7
            rank=0 step=2 batch=8,9
            rank=1 step=2 batch=0,1
            step=2 gathered=8,9",
    },
    // No padding: rank 1 has one batch, and takes part in step 1's gather with nothing.
    Case {
        world: 2,
        args: "--len 10 --batch-size 4 --no-even-batches",
        report: "
            rank=0 step=0 batch=0,1,2,3
            rank=1 step=0 batch=4,5,6,7
            step=0 gathered=0,1,2,3,4,5,6,7
            rank=0 step=1 batch=8,9
            step=1 gathered=8,9",
    },
    Case {
        world: 2,
        args: "--len 10 --batch-size 4 --drop-last",
        report: "
            rank=0 step=0 batch=0,1,2,3
            rank=1 step=0 batch=4,5,6,7
            step=0 gathered=0,1,2,3,4,5,6,7",
    },
    // Three ranks: five batches of 2 make two rounds, the sixth batch comes from the start.
    Case {
        world: 3,
        args: "--len 10 --batch-size 2",
        report: "
            rank=0 step=0 batch=0,1
            rank=1 step=0 batch=2,3
            rank=2 step=0 batch=4,5
            step=0 gathered=0,1,2,3,4,5
            rank=0 step=1 batch=6,7
            rank=1 step=1 batch=8,9
            rank=2 step=1 batch=0,1
            step=1 gathered=6,7,8,9",
    },
    // A length that is no multiple of anything: the last batch is topped up with item 0.
    Case {
        world: 2,
        args: "--len 7 --batch-size 2",
        report: "
            rank=0 step=0 batch=0,1
            rank=1 step=0 batch=2,3
            step=0 gathered=0,1,2,3
            rank=0 step=1 batch=4,5
            rank=1 step=1 batch=6,0
            step=1 gathered=4,5,6",
    },
    // Fewer items than one round (L < B * P): the dataset repeats.
    Case {
        world: 2,
        args: "--len 3 --batch-size 4",
        report: "
            rank=0 step=0 batch=0,1,2,0
            rank=1 step=0 batch=1,2,0,1
            step=0 gathered=0,1,2",
    },
    // Three ranks splitting batches of 3, the last one padded from the first.
    Case {
        world: 3,
        args: "--len 7 --batch-size 3 --split-batches",
        report: "
            rank=0 step=0 batch=0
            rank=1 step=0 batch=1
            rank=2 step=0 batch=2
            step=0 gathered=0,1,2
            rank=0 step=1 batch=3
            rank=1 step=1 batch=4
            rank=2 step=1 batch=5
            step=1 gathered=3,4,5
            rank=0 step=2 batch=6
            rank=1 step=2 batch=0
            rank=2 step=2 batch=1
            step=2 gathered=6",
    },
    // One process: Accelerate leaves the loader alone (the last batch stays partial).
    Case {
        world: 1,
        args: "--len 10 --batch-size 4",
        report: "
            rank=0 step=0 batch=0,1,2,3
            step=0 gathered=0,1,2,3
            rank=0 step=1 batch=4,5,6,7
            step=1 gathered=4,5,6,7
            rank=0 step=2 batch=8,9
            step=2 gathered=8,9",
    },
    // A stream (IterableDatasetShard): the same batches, but the padding is gathered too
    // (the stream's length is unknown, as Accelerate's remainder is 0 there).
    Case {
        world: 2,
        args: "--len 10 --batch-size 4 --iterable",
        report: "
            rank=0 step=0 batch=0,1,2,3
            rank=1 step=0 batch=4,5,6,7
            step=0 gathered=0,1,2,3,4,5,6,7
            rank=0 step=1 batch=8,9,0,1
            rank=1 step=1 batch=2,3,4,5
            step=1 gathered=8,9,0,1,2,3,4,5",
    },
];

fn example() -> Option<PathBuf> {
    let path = example_bin("shard_report");
    if path.is_none() {
        eprintln!("skipped: worker-sdk/examples/shard_report.rs does not exist");
    }
    path
}

fn lines(text: &str) -> Vec<String> {
    text.lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .map(str::to_owned)
        .collect()
}

/// Runs `program args` with `input` on stdin; its stdout lines (it must succeed).
fn run_with_input(program: &Path, args: &[&str], input: &str) -> Vec<String> {
    let mut child = Command::new(program)
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("cannot start {}: {e}", program.display()));
    let mut stdin = child.stdin.take().expect("stdin is piped");
    let input = input.to_owned();
    let writer = std::thread::spawn(move || stdin.write_all(input.as_bytes()));
    let out = child.wait_with_output().expect("the process runs");
    writer
        .join()
        .expect("the writer thread")
        .expect("stdin is written");
    assert!(
        out.status.success(),
        "{} {args:?}: {}\n{}",
        program.display(),
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    lines(&String::from_utf8_lossy(&out.stdout))
}

/// The example's `--simulate` report.
fn simulate(bin: &Path, world: u32, args: &str) -> Vec<String> {
    let mut all: Vec<String> = args.split_whitespace().map(str::to_owned).collect();
    all.extend(["--simulate".to_owned(), world.to_string()]);
    let all: Vec<&str> = all.iter().map(String::as_str).collect();
    run_with_input(bin, &all, "")
}

/// What rank `rank` prints under the agent, from a whole report: its own batch lines, and for
/// rank 0 also the `order=` and `gathered=` lines, in the report's order.
fn rank_lines(report: &[String], rank: u32) -> Vec<String> {
    let own = format!("rank={rank} ");
    report
        .iter()
        .filter(|l| l.starts_with(&own) || (rank == 0 && !l.starts_with("rank=")))
        .cloned()
        .collect()
}

/// `muster-agent launch --nproc-per-node N --job-id JOB -- PROGRAM ARGS`, to completion. The
/// gathers go over the CPU backend (several ranks may share one GPU here).
fn launch(flags: &[&str], world: u32, job: &str, program: &[&str], limit: Duration) -> Finished {
    let n = world.to_string();
    let mut all = vec!["launch"];
    all.extend_from_slice(flags);
    all.extend_from_slice(&["--nproc-per-node", &n, "--job-id", job, "--"]);
    all.extend_from_slice(program);
    Agent::start_with_env(&all, &[("MUSTER_COMM_BACKEND", "cpu")]).finish(limit)
}

#[test]
fn hand_checked_reports_from_the_library() {
    let Some(bin) = example() else {
        return;
    };
    for case in CASES {
        let got = simulate(&bin, case.world, case.args);
        assert_eq!(
            got,
            lines(case.report),
            "P={} {}\n{}",
            case.world,
            case.args,
            got.join("\n")
        );
    }
}

#[test]
fn hand_checked_reports_under_the_agent() {
    let Some(bin) = example() else {
        return;
    };
    let program = bin.to_str().expect("a UTF-8 target path");
    let started = Instant::now();
    // The hand-checked cases, and a shuffled one (compared with the simulated report, which
    // shares nothing with the launched run but the library).
    let shuffled = Case {
        world: 3,
        args: "--len 11 --batch-size 2 --seed 7 --epoch 1",
        report: "",
    };
    for (i, case) in CASES.iter().chain([&shuffled]).enumerate() {
        let report = if case.report.is_empty() {
            simulate(&bin, case.world, case.args)
        } else {
            lines(case.report)
        };
        let mut argv = vec![program];
        argv.extend(case.args.split_whitespace());
        let run = launch(&[], case.world, &format!("shard-{i}"), &argv, SLOW);
        assert_eq!(run.code(), Some(0), "{}\n{}", case.args, run.dump());
        for rank in 0..case.world {
            assert_eq!(
                run.rank_stdout(rank),
                rank_lines(&report, rank),
                "rank {rank} of {}: {}\n{}",
                case.world,
                case.args,
                run.dump()
            );
        }
    }
    eprintln!(
        "{} launched reports in {:?}",
        CASES.len() + 1,
        started.elapsed()
    );
}

#[test]
fn bad_flags_are_one_line_errors_with_status_2() {
    let Some(bin) = example() else {
        return;
    };
    for args in [
        &["--len", "10", "--batch-size", "4", "--bogus"][..],
        &["--len", "ten", "--batch-size", "4"],
        &["--batch-size", "4"],
        &[
            "--len",
            "10",
            "--batch-size",
            "3",
            "--split-batches",
            "--simulate",
            "2",
        ],
        &["--len", "10", "--batch-size", "0", "--simulate", "2"],
    ] {
        let out = Command::new(&bin).args(args).output().expect("runs");
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {stderr}");
        assert_eq!(stderr.lines().count(), 1, "{args:?}: {stderr}");
        assert!(stderr.starts_with("shard_report: "), "{args:?}: {stderr}");
        assert!(out.stdout.is_empty(), "{args:?}");
    }
}

fn script() -> String {
    let path = workspace_root().join("tests/python/shard_report.py");
    path.to_str().expect("a UTF-8 checkout path").to_owned()
}

/// Reports keyed by their `case <line>` headers; an error of either side reads `error` (the
/// messages differ, the refusal must not).
fn by_case(output: &[String]) -> Vec<(String, Vec<String>)> {
    let mut cases: Vec<(String, Vec<String>)> = Vec::new();
    for line in output {
        if let Some(case) = line.strip_prefix("case ") {
            cases.push((case.to_owned(), Vec::new()));
        } else if let Some((_, report)) = cases.last_mut() {
            let line = if line.starts_with("error: ") {
                "error".to_owned()
            } else {
                line.clone()
            };
            report.push(line);
        } else {
            panic!("a report line before any case: {line}");
        }
    }
    cases
}

fn flag_sets() -> Vec<Vec<&'static str>> {
    let mut sets = Vec::new();
    for bits in 0..8 {
        let mut flags = Vec::new();
        if bits & 1 != 0 {
            flags.push("--split-batches");
        }
        if bits & 2 != 0 {
            flags.push("--no-even-batches");
        }
        if bits & 4 != 0 {
            flags.push("--drop-last");
        }
        sets.push(flags);
    }
    // A stream has no uneven mode.
    for bits in 0..4 {
        let mut flags = vec!["--iterable"];
        if bits & 1 != 0 {
            flags.push("--split-batches");
        }
        if bits & 2 != 0 {
            flags.push("--drop-last");
        }
        sets.push(flags);
    }
    sets
}

#[test]
fn the_library_matches_accelerate_over_a_grid() {
    let Some(bin) = example() else {
        return;
    };
    let Some(python) = peers_python(&["torch", "accelerate"]) else {
        return;
    };
    let started = Instant::now();
    let mut grid = String::new();
    for len in 0..=13 {
        for batch in 1..=4 {
            for world in 1..=4 {
                for flags in flag_sets() {
                    grid += &format!(
                        "--len {len} --batch-size {batch} --simulate {world} {}\n",
                        flags.join(" ")
                    );
                }
            }
        }
    }
    // Shuffled: muster draws the permutation (not torch's), Accelerate shards that same order.
    let mut shuffled = String::new();
    for len in [1, 5, 10, 13] {
        for batch in 1..=3 {
            for world in 1..=3 {
                for flags in flag_sets().iter().take(8) {
                    for epoch in [0, 1] {
                        shuffled += &format!(
                            "--len {len} --batch-size {batch} --simulate {world} --seed 42 \
                             --epoch {epoch} {}\n",
                            flags.join(" ")
                        );
                    }
                }
            }
        }
    }
    let muster = by_case(&run_with_input(
        &bin,
        &["--cases"],
        &(grid.clone() + &shuffled),
    ));
    // Accelerate gets the shuffled cases with the order muster drew, in place of the seed.
    let mut accelerate_input = grid;
    let mut orders = 0;
    for (case, report) in muster.iter().filter(|(case, _)| case.contains("--seed")) {
        let flags: Vec<&str> = case.split_whitespace().collect();
        let mut kept = Vec::new();
        let mut i = 0;
        while i < flags.len() {
            if flags[i] == "--seed" || flags[i] == "--epoch" {
                i += 2;
                continue;
            }
            kept.push(flags[i]);
            i += 1;
        }
        // A case muster refuses has no order; Accelerate must refuse it in order too.
        if let Some(order) = report.first().and_then(|l| l.strip_prefix("order=")) {
            kept.extend(["--order", order]);
            orders += 1;
        }
        accelerate_input += &format!("{}\n", kept.join(" "));
    }
    let python = python.to_str().expect("a UTF-8 venv path");
    let accelerate = by_case(&run_with_input(
        Path::new(python),
        &[&script(), "--cases"],
        &accelerate_input,
    ));
    assert_eq!(
        muster.len(),
        accelerate.len(),
        "both sides answer every case"
    );
    let mut errors = 0;
    for ((case, ours), (_, theirs)) in muster.iter().zip(&accelerate) {
        let ours: Vec<&String> = ours.iter().filter(|l| !l.starts_with("order=")).collect();
        let theirs: Vec<&String> = theirs.iter().collect();
        assert_eq!(
            ours, theirs,
            "{case}: muster (left) and Accelerate (right) differ"
        );
        errors += usize::from(ours.first().is_some_and(|l| *l == "error"));
    }
    eprintln!(
        "{} cases ({orders} shuffled, {errors} refused by both) agree with Accelerate in {:?}",
        muster.len(),
        started.elapsed()
    );
}

#[test]
fn a_launched_accelerate_run_prints_what_the_launched_example_prints() {
    let Some(bin) = example() else {
        return;
    };
    let Some(python) = peers_python(&["torch", "accelerate"]) else {
        return;
    };
    let python = python.to_str().expect("a UTF-8 venv path");
    let script = script();
    // One case: two processes importing torch cost some 20 s on a 2-core machine.
    for args in ["--len 10 --batch-size 4"] {
        let report = simulate(&bin, 2, args);
        let mut argv = vec![python, script.as_str()];
        argv.extend(args.split_whitespace());
        // gloo on the CPU, as `accelerate launch --cpu` would.
        let run = launch(
            &["--cpu"],
            2,
            "shard-accelerate",
            &argv,
            Duration::from_secs(120),
        );
        assert_eq!(run.code(), Some(0), "{args}\n{}", run.dump());
        for rank in 0..2 {
            assert_eq!(
                run.rank_stdout(rank),
                rank_lines(&report, rank),
                "rank {rank}: {args}\n{}",
                run.dump()
            );
        }
        eprintln!("accelerate under the agent, {args}: {:?}", run.elapsed);
    }
}
