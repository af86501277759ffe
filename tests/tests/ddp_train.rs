//! End-to-end tests of the `ddp_train` example under `muster-agent launch`: data-parallel
//! training on 1 and 4 processes reaches the same weights (Accelerate's own training
//! equivalence check), a run killed mid-way and restarted by the agent resumes from its
//! checkpoint to exactly the weights of an uninterrupted run, and gradients sent in bf16 stay
//! close to f32 training.

use muster_tests::{Agent, Finished, SLOW, example_bin};
use std::path::{Path, PathBuf};

/// Where a test's run writes its checkpoints and final weights (emptied first).
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("muster-ddp-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Runs `ddp_train ARGS` on `procs` processes with the agent's extra `flags`.
fn train(flags: &[&str], procs: u32, args: &[&str]) -> Option<Finished> {
    let Some(bin) = example_bin("ddp_train") else {
        eprintln!("skipped: worker-sdk/examples/ddp_train does not exist");
        return None;
    };
    let procs = procs.to_string();
    let job = format!("ddp-{}", std::process::id());
    let mut all = vec!["launch"];
    all.extend_from_slice(flags);
    all.extend_from_slice(&["--nproc-per-node", &procs, "--job-id", &job, "--"]);
    all.push(bin.to_str().expect("a UTF-8 target path"));
    all.extend_from_slice(args);
    let run = Agent::start_with_env(&all, &[("MUSTER_COMM_BACKEND", "cpu")]).finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    Some(run)
}

/// The saved weights, by tensor name.
fn weights(dir: &Path) -> Vec<(String, Vec<f32>)> {
    let state = muster::checkpoint::load_model(dir).expect("the final weights load");
    state
        .iter()
        .map(|(name, t)| (name.to_owned(), t.to_vec::<f32>().expect("f32 weights")))
        .collect()
}

/// The largest absolute difference between two sets of weights with the same names.
fn max_difference(a: &[(String, Vec<f32>)], b: &[(String, Vec<f32>)]) -> f32 {
    assert_eq!(
        a.iter().map(|(n, _)| n).collect::<Vec<_>>(),
        b.iter().map(|(n, _)| n).collect::<Vec<_>>()
    );
    a.iter()
        .zip(b)
        .flat_map(|((_, x), (_, y))| x.iter().zip(y).map(|(x, y)| (x - y).abs()))
        .fold(0.0, f32::max)
}

/// The main process's lines that start with `prefix`.
fn lines<'a>(run: &'a Finished, prefix: &str) -> Vec<&'a str> {
    run.rank_stdout(0)
        .into_iter()
        .filter(|l| l.starts_with(prefix))
        .collect()
}

const COMMON: &[&str] = &["--epochs", "3", "--samples", "512", "--batch-size", "32"];

#[test]
fn one_and_four_processes_reach_the_same_weights() {
    let dir = scratch("equivalence");
    let (one, four) = (dir.join("one"), dir.join("four"));
    let mut args = COMMON.to_vec();
    args.extend_from_slice(&["--out", one.to_str().expect("UTF-8")]);
    let Some(run1) = train(&[], 1, &args) else {
        return;
    };
    args.pop();
    args.push(four.to_str().expect("UTF-8"));
    let run4 = train(&[], 4, &args).expect("the example exists");
    let difference = max_difference(&weights(&one), &weights(&four));
    eprintln!("1 vs 4 processes: largest weight difference {difference:e}");
    // Only the order of float additions differs (per-rank partial means, the ring's
    // reduction order): the same global batches, the same updates.
    assert!(difference < 1e-5, "weights differ by {difference}");
    // Every evaluation averaged exactly the evaluation set: padding was dropped by
    // gather_for_metrics on both.
    let (eval1, eval4) = (lines(&run1, "eval "), lines(&run4, "eval "));
    assert_eq!(eval1.len(), 3, "{}", run1.dump());
    assert!(
        eval4.iter().all(|l| l.ends_with(" n=100")),
        "{}",
        run4.dump()
    );
    for (a, b) in eval1.iter().zip(&eval4) {
        let mse = |l: &str| -> f64 {
            l.split(' ')
                .find_map(|w| w.strip_prefix("mse="))
                .and_then(|v| v.parse().ok())
                .expect("an mse")
        };
        assert!((mse(a) - mse(b)).abs() < 1e-4, "{a} vs {b}");
    }
    // Progress is reported by the main process only.
    for rank in 1..4 {
        assert!(run4.rank_stdout(rank).is_empty(), "{}", run4.dump());
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_killed_run_resumes_to_the_uninterrupted_result() {
    let dir = scratch("resume");
    let (a, b) = (dir.join("a"), dir.join("b"));
    let args = |d: &Path| -> Vec<String> {
        let mut v: Vec<String> = COMMON.iter().map(|s| s.to_string()).collect();
        for s in ["--grad-accum", "2", "--checkpoint-every", "5", "--quiet"] {
            v.push(s.to_owned());
        }
        v.push("--checkpoint-dir".to_owned());
        v.push(d.to_str().expect("UTF-8").to_owned());
        v.push("--out".to_owned());
        v.push(d.join("final").to_str().expect("UTF-8").to_owned());
        v
    };
    let plain = args(&a);
    let plain: Vec<&str> = plain.iter().map(String::as_str).collect();
    let Some(uninterrupted) = train(&[], 2, &plain) else {
        return;
    };
    let mut failing = args(&b);
    failing.extend(["--fail-at-step".to_owned(), "12".to_owned()]);
    let failing: Vec<&str> = failing.iter().map(String::as_str).collect();
    let resumed = train(&["--max-restarts", "1"], 2, &failing).expect("the example exists");
    // The last rank aborted at step 12 of the first attempt; the agent restarted the job,
    // which loaded the checkpoint of step 10 and went on from batch 4 of epoch 1.
    assert!(
        resumed
            .stderr
            .iter()
            .any(|l| l.contains("killed by signal 6") && l.contains("restarting")),
        "{}",
        resumed.dump()
    );
    let resume = lines(&resumed, "resumed from ");
    assert_eq!(resume.len(), 1, "{}", resumed.dump());
    assert!(
        resume[0].ends_with("checkpoint_1 at epoch=1 batch=4 step=10"),
        "{}",
        resume[0]
    );
    // Bit for bit the same weights as the run that was never interrupted.
    let last = |run: &Finished| {
        lines(run, "final ")
            .first()
            .and_then(|l| l.split(' ').find(|w| w.starts_with("checksum=")))
            .map(str::to_owned)
            .unwrap_or_else(|| panic!("no final line\n{}", run.dump()))
    };
    assert_eq!(last(&uninterrupted), last(&resumed));
    assert_eq!(
        max_difference(&weights(&a.join("final")), &weights(&b.join("final"))),
        0.0
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn gradients_sent_in_bf16_or_f16_stay_close_to_f32() {
    let dir = scratch("precision");
    let mut results = vec![];
    for precision in ["f32", "bf16", "f16"] {
        let out = dir.join(precision);
        let mut args = COMMON.to_vec();
        args.extend_from_slice(&["--comm-precision", precision, "--quiet"]);
        args.extend_from_slice(&["--out", out.to_str().expect("UTF-8")]);
        if train(&[], 2, &args).is_none() {
            return;
        }
        results.push(weights(&out));
    }
    for (name, other) in [("bf16", &results[1]), ("f16", &results[2])] {
        let difference = max_difference(&results[0], other);
        eprintln!("{name} gradients: largest weight difference from f32 {difference:e}");
        assert!(difference > 0.0, "{name} gradients should round");
        assert!(difference < 0.05, "{name} weights drift by {difference}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
