//! Unmodified PyTorch and Accelerate scripts (`tests/python/`) under the real
//! `muster-agent launch`, 2 processes on CPU: the torchrun environment contract is enough for
//! `init_process_group("gloo", init_method="env://")`, DDP and Accelerate's `Accelerator()`.
//!
//! They need the peers' virtual environment (PyTorch, Accelerate): `$MUSTER_PEERS_VENV`, else
//! `~/.cache/muster-peers`, made by `scripts/install-peers.sh` (which `scripts/test.sh` runs).
//! Without it each test prints `skipped: ...` and passes.

use muster_tests::{Agent, Finished, peers_python, workspace_root};
use std::time::Duration;

/// torch's import alone takes seconds on a 2-core machine; both ranks import it at once.
const PYTHON_LIMIT: Duration = Duration::from_secs(90);

/// `muster-agent launch <flags> --nproc-per-node 2 --job-id JOB -- PYTHON tests/python/SCRIPT`.
fn launch(
    python: &std::path::Path,
    script: &str,
    job: &str,
    flags: &[&str],
    env: &[(&str, &str)],
) -> Finished {
    let python = python.to_str().expect("a UTF-8 venv path");
    let script = workspace_root().join("tests/python").join(script);
    let script = script.to_str().expect("a UTF-8 checkout path");
    let mut args = vec!["launch"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&[
        "--nproc-per-node",
        "2",
        "--job-id",
        job,
        "--",
        python,
        script,
    ]);
    let run = Agent::start_with_env(&args, env).finish(PYTHON_LIMIT);
    eprintln!("{script}: {:?}", run.elapsed);
    run
}

#[test]
fn a_plain_pytorch_ddp_script_runs_under_the_agent() {
    let Some(python) = peers_python(&["torch", "accelerate"]) else {
        return;
    };
    let run = launch(&python, "torch_ddp.py", "interop-torch", &[], &[]);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    for rank in 0..2 {
        let expected = format!(
            "torch_ddp rank={rank} world=2 local_rank={rank} restart_count=0 \
             run_id=interop-torch all_reduce=3 params_in_sync=True"
        );
        assert_eq!(run.rank_stdout(rank), [expected], "{}", run.dump());
    }
}

#[test]
fn a_plain_accelerate_script_runs_under_the_agent_with_bf16() {
    let Some(python) = peers_python(&["torch", "accelerate"]) else {
        return;
    };
    // `accelerate launch`'s flags: bf16 mixed precision, and gloo on the CPU (without
    // ACCELERATE_USE_CPU, Accelerate on a machine without GPUs runs every process alone, as a
    // world of 1).
    let run = launch(
        &python,
        "accelerate_script.py",
        "interop-accelerate",
        &["--mixed_precision", "bf16", "--cpu"],
        &[],
    );
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    for rank in 0..2 {
        let lines = run.rank_stdout(rank);
        let expected = format!(
            "accelerate rank={rank} world=2 local={rank} main={} distributed_type=MULTI_CPU \
             gathered=[1, 11] mixed_precision=bf16",
            if rank == 0 { "True" } else { "False" }
        );
        assert!(
            lines.contains(&expected.as_str()),
            "{expected:?}\n{}",
            run.dump()
        );
    }
    // main_process_first: the main process's block ends before the other's begins, by the
    // machine's monotonic clock (the merged output interleaves the ranks' pipes as read).
    let at = |needle: &str| -> u64 {
        run.stdout
            .iter()
            .find_map(|l| l.split_once(needle)?.1.strip_prefix(" t=")?.parse().ok())
            .unwrap_or_else(|| panic!("no {needle:?} with a time\n{}", run.dump()))
    };
    assert!(
        at("accelerate rank=0 main_process_first done")
            < at("accelerate rank=1 main_process_first start"),
        "{}",
        run.dump()
    );
}
