//! Unmodified PyTorch scripts under the real `muster-agent launch` with the agent store (the
//! default): torch's `env://` connects every rank to its node's agent as a client, so no worker
//! opens a store server and the store outlives rank 0; `MUSTER_NO_AGENT_STORE=1` (the
//! environment form of `--no-agent-store`) gives rank 0's own TCPStore back.
//!
//! Who listens where is read from `/proc` (`muster_tests::sockets`) while the workers wait after their
//! process group is up. The tests need the peers' virtual environment (PyTorch):
//! `$MUSTER_PEERS_VENV`, else `~/.cache/muster-peers`; without it each prints `skipped: ...`.

use muster_tests::coordinator::Coordinator;
use muster_tests::sockets::{Listener, Ready, held_by, listeners, ready};
use muster_tests::{Agent, Finished, Stream, peers_python, workspace_root};
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::time::Duration;

/// torch's import alone takes seconds on a 2-core machine; every rank imports it at once.
const PYTHON_LIMIT: Duration = Duration::from_secs(120);

/// A file that releases the workers when it appears; removed with its folder when dropped.
struct GoFile(PathBuf);

impl GoFile {
    fn new(name: &str) -> Self {
        let dir =
            std::env::temp_dir().join(format!("muster-agent-store-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a scratch folder");
        Self(dir.join("go"))
    }

    fn path(&self) -> &str {
        self.0.to_str().expect("a UTF-8 temporary path")
    }

    fn release(&self) {
        std::fs::write(&self.0, b"go").expect("the go file");
    }
}

impl Drop for GoFile {
    fn drop(&mut self) {
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir_all(dir);
        }
    }
}

/// Starts `muster-agent launch --nproc-per-node N --job-id JOB -- PYTHON tests/python/SCRIPT
/// ARGS`.
fn launch(
    python: &Path,
    nproc: u32,
    job: &str,
    script: &str,
    script_args: &[&str],
    env: &[(&str, &str)],
) -> Agent {
    launch_path(
        python,
        &[],
        nproc,
        job,
        &workspace_root().join("tests/python").join(script),
        script_args,
        env,
    )
}

/// Starts `muster-agent launch FLAGS --nproc-per-node N --job-id JOB -- PYTHON SCRIPT ARGS`.
fn launch_path(
    python: &Path,
    flags: &[&str],
    nproc: u32,
    job: &str,
    script: &Path,
    script_args: &[&str],
    env: &[(&str, &str)],
) -> Agent {
    let python = python.to_str().expect("a UTF-8 venv path");
    let script = script.to_str().expect("a UTF-8 script path");
    let nproc = nproc.to_string();
    let mut args = vec!["launch"];
    args.extend_from_slice(flags);
    args.extend_from_slice(&[
        "--nproc-per-node",
        &nproc,
        "--job-id",
        job,
        "--",
        python,
        script,
    ]);
    args.extend_from_slice(script_args);
    Agent::start_with_env(&args, env)
}

/// Waits for every rank's `ready` line, by rank.
fn wait_ready(agent: &Agent, nproc: u32) -> Vec<Ready> {
    let lines = agent.wait_for_lines(Stream::Stdout, nproc as usize, PYTHON_LIMIT, |l| {
        l.contains("] ready ")
    });
    let mut ready: Vec<Ready> = lines
        .iter()
        .map(|l| ready(l).unwrap_or_else(|| panic!("a malformed ready line: {l}")))
        .collect();
    ready.sort_by_key(|r| r.rank);
    assert_eq!(
        ready.iter().map(|r| r.rank).collect::<Vec<_>>(),
        (0..nproc).collect::<Vec<_>>(),
        "{}",
        agent.output()
    );
    ready
}

fn finish(agent: Agent) -> Finished {
    let run = agent.finish(PYTHON_LIMIT);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    run
}

/// With the agent store: every rank gets MASTER_ADDR=127.0.0.1, this node's agent store's
/// port and TORCHELASTIC_USE_AGENT_STORE=True; only the agent listens on MASTER_PORT, on
/// loopback; no worker holds a listener on it, and rank 0 listens on no more ports than the
/// other ranks (the ports they all hold are gloo's data plane, out of scope here). Then rank
/// 0 exits first and the other ranks go on using the store.
#[test]
fn no_worker_opens_a_store_server_and_the_store_outlives_rank_0() {
    let Some(python) = peers_python(&["torch"]) else {
        return;
    };
    let nproc = 3;
    let go = GoFile::new("agent");
    let agent = launch(
        &python,
        nproc,
        "agent-store-launch",
        "agent_store_job.py",
        &[go.path(), "rank0-first"],
        &[],
    );
    let ready = wait_ready(&agent, nproc);
    let port = ready[0].master_port;
    for r in &ready {
        assert_eq!(
            (
                r.master_addr.as_str(),
                r.master_port,
                r.agent_store.as_str()
            ),
            ("127.0.0.1", port, "True"),
            "rank {} got another store: {}",
            r.rank,
            agent.output()
        );
    }
    let agent_pid = agent.pid().as_raw().unsigned_abs();
    let all = listeners();
    let on_master: Vec<&Listener> = all.iter().filter(|l| l.port == port).collect();
    assert_eq!(
        on_master,
        [&Listener {
            addr: IpAddr::V4(Ipv4Addr::LOCALHOST),
            port,
            pids: vec![agent_pid],
        }],
        "only the agent (pid {agent_pid}) may listen on MASTER_PORT {port}, on 127.0.0.1; all listeners: {all:#?}"
    );
    let counts: Vec<usize> = ready.iter().map(|r| held_by(&all, r.pid).len()).collect();
    eprintln!("listening sockets per rank (gloo's): {counts:?}");
    assert!(
        counts.iter().all(|&c| c == counts[0]),
        "a rank listens on more ports than the others (a store server?): {counts:?}\n{all:#?}"
    );

    go.release();
    let run = finish(agent);
    assert_eq!(
        run.rank_stdout(0).last().copied(),
        Some("rank 0 leaves first"),
        "{}",
        run.dump()
    );
    for rank in 1..nproc {
        let expected = format!(
            "after-rank0 rank={rank} rank0_said=goodbye seen=rank1,rank2 count={}",
            nproc - 1
        );
        assert_eq!(
            run.rank_stdout(rank).last().copied(),
            Some(expected.as_str()),
            "{}",
            run.dump()
        );
    }
}

/// An unmodified DDP training script (`tests/python/torch_ddp.py`: gloo from `env://`, an
/// all_reduce, a DDP step, all_gather, a barrier) on 4 processes with the agent store.
#[test]
fn a_ddp_script_trains_on_4_processes_with_the_agent_store() {
    let Some(python) = peers_python(&["torch"]) else {
        return;
    };
    let run = finish(launch(
        &python,
        4,
        "agent-store-ddp",
        "torch_ddp.py",
        &[],
        &[],
    ));
    for rank in 0..4 {
        let expected = format!(
            "torch_ddp rank={rank} world=4 local_rank={rank} restart_count=0 \
             run_id=agent-store-ddp all_reduce=10 params_in_sync=True"
        );
        assert_eq!(run.rank_stdout(rank), [expected], "{}", run.dump());
    }
}

/// `MUSTER_NO_AGENT_STORE=1` (`--no-agent-store`): TORCHELASTIC_USE_AGENT_STORE=False, and
/// rank 0 opens torch's TCPStore on MASTER_PORT, as under plain torchrun.
#[test]
fn the_opt_out_gives_rank_0_its_own_tcp_store() {
    let Some(python) = peers_python(&["torch"]) else {
        return;
    };
    let nproc = 2;
    let go = GoFile::new("opt-out");
    let agent = launch(
        &python,
        nproc,
        "agent-store-opt-out",
        "agent_store_job.py",
        &[go.path(), "together"],
        &[("MUSTER_NO_AGENT_STORE", "1")],
    );
    let ready = wait_ready(&agent, nproc);
    let port = ready[0].master_port;
    for r in &ready {
        assert_eq!(
            (r.master_port, r.agent_store.as_str()),
            (port, "False"),
            "{}",
            agent.output()
        );
    }
    let all = listeners();
    let owners: Vec<u32> = all
        .iter()
        .filter(|l| l.port == port)
        .flat_map(|l| l.pids.clone())
        .collect();
    assert!(
        !owners.is_empty() && owners.iter().all(|&p| p == ready[0].pid),
        "rank 0 (pid {}) should hold MASTER_PORT {port}, held by {owners:?}: {all:#?}",
        ready[0].pid
    );
    go.release();
    let run = finish(agent);
    for rank in 0..nproc {
        let expected = format!("together rank={rank} sum=1");
        assert_eq!(
            run.rank_stdout(rank).last().copied(),
            Some(expected.as_str()),
            "{}",
            run.dump()
        );
    }
}

/// Accelerate's own distributed test scripts (`accelerate/test_utils/scripts/` in the peers'
/// venv), unmodified, on 2 CPU processes with the agent store (`--cpu`, as
/// `accelerate launch --cpu` would run them). Each raises on any mismatch, so exit 0 is the
/// check; `ran` is a line only the distributed path prints, so a silent single-process run
/// cannot pass.
fn accelerate_script(name: &str, ran: &str) {
    let Some(python) = peers_python(&["torch", "accelerate"]) else {
        return;
    };
    let path = format!("accelerate/test_utils/scripts/{name}");
    let Some(script) = venv_file(&python, &path) else {
        eprintln!("skipped: the peers' accelerate has no {path}");
        return;
    };
    let job = format!(
        "agent-store-{}",
        name.trim_end_matches(".py").replace('_', "-")
    );
    let agent = launch_path(&python, &["--cpu"], 2, &job, &script, &[], &[]);
    let run = agent.finish(ACCELERATE_LIMIT);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    assert!(
        run.stdout.iter().any(|l| l.contains(ran)),
        "no line with {ran:?}\n{}",
        run.dump()
    );
}

#[test]
fn accelerates_test_script_runs_with_the_agent_store() {
    accelerate_script("test_script.py", "] Num processes: 2");
}

// Accelerate's `test_ops.py` is not run: it builds a bare `PartialState()`, which ignores
// `ACCELERATE_USE_CPU`, so on a machine without GPUs every process calls
// `init_process_group` (LOCAL_RANK is set) and then runs the tests alone
// (`DistributedType.NO`, as under torchrun and `accelerate launch --cpu`) and exits without
// `destroy_process_group`. A rank that finishes while another is still in gloo's
// connectFullMesh fails that rank ("Connection closed by peer"), whatever the store: a race
// of the script's on CPU, seen here once in 7 runs.

#[test]
fn accelerates_test_sync_runs_with_the_agent_store() {
    accelerate_script(
        "test_sync.py",
        "**Test Distributed `no_sync` context manager**",
    );
}

/// Accelerate's test script trains several small models on 2 cores.
const ACCELERATE_LIMIT: Duration = Duration::from_secs(420);

/// `site-packages/PATH` of the venv whose python is `python`, if it exists.
fn venv_file(python: &Path, path: &str) -> Option<PathBuf> {
    let lib = python.parent()?.parent()?.join("lib");
    std::fs::read_dir(lib)
        .ok()?
        .flatten()
        .map(|dir| dir.path().join("site-packages").join(path))
        .find(|p| p.exists())
}

/// With a coordinator that authenticates every call (a cluster token), the agent store's calls
/// carry the job's token: a DDP script whose whole rendezvous goes through the store succeeds.
#[test]
fn the_agent_store_authenticates_at_a_coordinator_with_a_token() {
    let Some(python) = peers_python(&["torch"]) else {
        return;
    };
    let go = GoFile::new("token");
    let token_file = go.0.with_file_name("cluster-token");
    std::fs::write(&token_file, "agent-store-test-cluster-token-0123456789\n")
        .expect("the token file");
    let token_file = token_file.to_str().expect("a UTF-8 temporary path");
    let coordinator = Coordinator::start(&["--auth-token-file", token_file]);
    let agent = launch_path(
        &python,
        &[
            "--coordinator",
            &coordinator.addr,
            "--auth-token-file",
            token_file,
        ],
        2,
        "agent-store-token",
        &workspace_root().join("tests/python/torch_ddp.py"),
        &[],
        &[],
    );
    let run = finish(agent);
    for rank in 0..2 {
        let expected = format!(
            "torch_ddp rank={rank} world=2 local_rank={rank} restart_count=0 \
             run_id=agent-store-token all_reduce=3 params_in_sync=True"
        );
        assert_eq!(run.rank_stdout(rank), [expected], "{}", run.dump());
    }
}
