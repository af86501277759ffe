//! Step markers for a script that never imports muster (issue 30 item 4): a torch DDP loop on
//! gloo under `muster-agent launch`, with nothing of muster in it, must still give its job an
//! effective training time. The agent's start-up hook registers a global optimizer step hook in
//! global rank 0's worker (`agent/python/_muster_steps.py`), which sends each step to the
//! agent's step socket; the agent passes it to the coordinator as rank 0's marker. Skipped,
//! saying why, without the peers' torch.

use muster_tests::coordinator::Coordinator;
use muster_tests::{Agent, SLOW, agent_bin, peers_python, workspace_root};
use std::process::Command;

#[test]
fn an_unmodified_torch_loop_reports_its_steps_and_its_effective_training_time() {
    let Some(python) = peers_python(&["torch"]) else {
        return;
    };
    let coordinator = Coordinator::start(&[]);
    let job = format!("steps-{}", std::process::id());
    let script = workspace_root().join("tests/python/steps_unmodified.py");
    let run = Agent::start_with_env(
        &[
            "launch",
            "--coordinator",
            &coordinator.addr,
            "--job-id",
            &job,
            "--nproc-per-node",
            "2",
            "--",
            python.to_str().expect("a UTF-8 path"),
            script.to_str().expect("a UTF-8 path"),
        ],
        &[("NO_COLOR", "1")],
    )
    .finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    assert!(
        run.rank_stdout(0).contains(&"done steps=20"),
        "{}",
        run.dump()
    );
    let mut cmd = Command::new(agent_bin());
    cmd.args(["describe", "--coordinator", &coordinator.addr, &job]);
    let view = Agent::spawn(cmd, "muster-agent describe").finish(SLOW);
    assert_eq!(view.code(), Some(0), "{}", view.dump());
    let text = view.stdout.join("\n");
    // Adam keeps its step count: the last marker is step 20, rank 0's 20th optimizer step.
    let line = text
        .lines()
        .find(|l| l.starts_with("training: ETTR "))
        .unwrap_or_else(|| panic!("no training line in\n{text}"));
    assert!(line.contains(", at step 20"), "{line}");
}
