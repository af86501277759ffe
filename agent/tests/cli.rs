//! The built `muster-agent` binary's command line: help, bad input and a minimal launch. (This
//! file also makes `cargo test --workspace` build the binary that the end-to-end tests in
//! `tests/` run.)

use std::process::{Command, Output};

fn agent(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_muster-agent"))
        .args(args)
        .output()
        .expect("muster-agent runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn help_mentions_the_launch_flags() {
    let out = agent(&["launch", "--help"]);
    assert!(out.status.success());
    let help = text(&out.stdout);
    for flag in [
        "--nproc-per-node",
        "--coordinator",
        "--job-id",
        "--nnodes",
        "--node-rank",
        "--grace-period-ms",
        "--no-relay",
    ] {
        assert!(help.contains(flag), "{flag} missing from\n{help}");
    }
}

#[test]
fn bad_input_is_one_line_and_status_2() {
    for (args, expected) in [
        (
            &["launch", "--nproc-per-node", "0", "--", "true"][..],
            "muster-agent: --nproc-per-node 0 is out of range 1..=4096\n",
        ),
        (
            &[
                "launch",
                "--nproc-per-node",
                "1",
                "--",
                "no-such-program-for-muster",
            ][..],
            "muster-agent: program 'no-such-program-for-muster' was not found in PATH\n",
        ),
    ] {
        let out = agent(args);
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        assert_eq!(text(&out.stderr), expected, "{args:?}");
        assert!(out.stdout.is_empty());
    }
}

#[test]
fn one_worker_runs_and_its_output_is_prefixed() {
    let out = agent(&[
        "launch",
        "--nproc-per-node",
        "1",
        "--",
        "sh",
        "-c",
        "echo hi",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout), "[rank 0] hi\n");
}
