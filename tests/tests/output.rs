//! End-to-end tests of where `muster-agent launch` sends its workers' output: a closed stdout
//! or stderr (`| head -1`), torchrun's `--redirects`, `--tee`, `--log-line-prefix-template` and
//! duplicate filters, and `--no-prefix`. Workers are `sh -c 'echo ...'`.

use muster_tests::{Agent, Finished, SLOW, agent_bin, group_alive};
use std::io::{BufRead, BufReader};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

/// A fresh folder under the system's temporary folder, removed on drop.
struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("muster-output-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("create the test folder");
        Self(dir)
    }

    fn path(&self) -> &Path {
        &self.0
    }

    fn arg(&self) -> &str {
        self.0.to_str().expect("temporary paths are UTF-8")
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// `muster-agent launch --nproc-per-node N <flags> -- sh -c SCRIPT`, run to its end.
fn run(n: u32, flags: &[&str], script: &str) -> Finished {
    let n = n.to_string();
    let mut args = vec!["launch", "--nproc-per-node", &n];
    args.extend_from_slice(flags);
    args.extend_from_slice(&["--", "sh", "-c", script]);
    Agent::start(&args).finish(SLOW)
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// The sorted lines of `lines` that a worker wrote (not the agent's own `muster-agent:` ones).
fn worker_lines(lines: &[String]) -> Vec<String> {
    let mut v: Vec<String> = lines
        .iter()
        .filter(|l| !l.starts_with("muster-agent"))
        .cloned()
        .collect();
    v.sort();
    v
}

/// Where the agent says the logs go ("muster-agent: job J: worker logs in DIR").
fn logs_folder(run: &Finished) -> PathBuf {
    run.stderr
        .iter()
        .find_map(|l| {
            l.split_once(": worker logs in ")
                .map(|(_, d)| PathBuf::from(d))
        })
        .unwrap_or_else(|| panic!("no 'worker logs in' line\n{}", run.dump()))
}

/// `muster-agent launch ... | head -1`, and `... 2>err | head -1`: the agent's output pipe
/// closes after one line while the workers still write. The job must run to its normal end
/// (exit 0, every worker done, its log files complete), without a panic, and leave no worker.
#[test]
fn a_closed_output_neither_crashes_the_agent_nor_stops_the_job() {
    const LINES: u32 = 300;
    for both in [true, false] {
        let dir = TempDir::new(if both { "pipe-both" } else { "pipe-out" });
        let logs = dir.path().join("logs");
        let script = format!(
            "echo first $RANK; sleep 0.3; i=0; while [ $i -lt {LINES} ]; do echo line $i; echo err $i >&2; i=$((i+1)); done; echo $$ > {d}/pid_$RANK; echo ok > {d}/done_$RANK",
            d = dir.arg()
        );
        let (reader, writer) = std::io::pipe().expect("pipe");
        let err_file = dir.path().join("stderr");
        let stderr = if both {
            Stdio::from(writer.try_clone().expect("dup the pipe"))
        } else {
            Stdio::from(std::fs::File::create(&err_file).expect("stderr file"))
        };
        let mut child = Command::new(agent_bin())
            .args(["launch", "--nproc-per-node", "2", "--job-id", "pipe"])
            .args(["--log-dir", logs.to_str().expect("UTF-8")])
            .args(["--", "sh", "-c", &script])
            .stdin(Stdio::null())
            .stdout(writer)
            .stderr(stderr)
            .process_group(0)
            .spawn()
            .expect("start muster-agent");
        // `head -1`: one line, then the reader is gone.
        let mut first = String::new();
        BufReader::new(reader)
            .read_line(&mut first)
            .expect("read the first line");
        let deadline = Instant::now() + SLOW;
        let status = loop {
            if let Some(status) = child.try_wait().expect("wait for the agent") {
                break status;
            }
            if Instant::now() >= deadline {
                let _ = child.kill();
                let _ = child.wait();
                panic!("the agent did not end within {SLOW:?} (both={both})");
            }
            std::thread::sleep(Duration::from_millis(10));
        };
        let stderr = if both { String::new() } else { read(&err_file) };
        assert_eq!(
            status.code(),
            Some(0),
            "both={both}: {status}; first line {first:?}\n{stderr}"
        );
        assert!(
            !stderr.contains("panicked") && !stderr.contains("Broken pipe"),
            "{stderr}"
        );
        if !both {
            assert!(stderr.contains("2 workers exited 0"), "{stderr}");
        }
        for rank in 0..2 {
            assert_eq!(read(&dir.path().join(format!("done_{rank}"))), "ok\n");
            let pid: i32 = read(&dir.path().join(format!("pid_{rank}")))
                .trim()
                .parse()
                .expect("a pid");
            assert!(
                !group_alive(pid),
                "worker {rank} (pid {pid}) is still running"
            );
            let rank_dir = logs.join(format!("pipe/attempt_0/rank_{rank}"));
            let out = read(&rank_dir.join("stdout.log"));
            assert_eq!(out.lines().count(), 1 + LINES as usize, "both={both}");
            assert!(out.ends_with(&format!("line {}\n", LINES - 1)));
            assert_eq!(
                read(&rank_dir.join("stderr.log")).lines().count(),
                LINES as usize
            );
        }
    }
}

/// `--redirects 3`: nothing of the workers on the console, everything in the files; without
/// `--log-dir` the files go to a folder the agent names.
#[test]
fn redirects_send_the_streams_to_the_files_only() {
    for with_dir in [true, false] {
        let dir = TempDir::new(if with_dir {
            "redirects"
        } else {
            "redirects-tmp"
        });
        let mut flags = vec!["--job-id", "redir", "--redirects", "3"];
        if with_dir {
            flags.extend_from_slice(&["--log-dir", dir.arg()]);
        }
        let run = run(2, &flags, "echo out $RANK; echo err $RANK >&2");
        assert_eq!(run.code(), Some(0), "{}", run.dump());
        assert_eq!(
            worker_lines(&run.stdout),
            Vec::<String>::new(),
            "{}",
            run.dump()
        );
        assert_eq!(
            worker_lines(&run.stderr),
            Vec::<String>::new(),
            "{}",
            run.dump()
        );
        let attempt = logs_folder(&run);
        if with_dir {
            assert_eq!(attempt, dir.path().join("redir/attempt_0"));
        }
        for rank in 0..2 {
            let rank_dir = attempt.join(format!("rank_{rank}"));
            assert_eq!(read(&rank_dir.join("stdout.log")), format!("out {rank}\n"));
            assert_eq!(read(&rank_dir.join("stderr.log")), format!("err {rank}\n"));
        }
        if !with_dir {
            // DIR/<job>/attempt_0: remove DIR.
            if let Some(root) = attempt.parent().and_then(Path::parent) {
                let _ = std::fs::remove_dir_all(root);
            }
        }
    }
}

/// `--tee`: to the files and the console; per local rank, and over `--redirects`.
#[test]
fn tee_sends_the_streams_to_the_files_and_the_console() {
    let dir = TempDir::new("tee");
    let run = run(
        2,
        &[
            "--job-id",
            "tee",
            "--log-dir",
            dir.arg(),
            "-r",
            "3",
            "-t",
            "0:3,1:2",
        ],
        "echo out $RANK; echo err $RANK >&2",
    );
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    // Rank 0 tees both streams; rank 1 only stderr, so its stdout stays redirected.
    assert_eq!(
        worker_lines(&run.stdout),
        ["[rank 0] out 0"],
        "{}",
        run.dump()
    );
    assert_eq!(
        worker_lines(&run.stderr),
        ["[rank 0] err 0", "[rank 1] err 1"],
        "{}",
        run.dump()
    );
    for rank in 0..2 {
        let rank_dir = dir.path().join(format!("tee/attempt_0/rank_{rank}"));
        assert_eq!(read(&rank_dir.join("stdout.log")), format!("out {rank}\n"));
        assert_eq!(read(&rank_dir.join("stderr.log")), format!("err {rank}\n"));
    }
}

/// `--log-line-prefix-template` with torchrun's placeholders; `--duplicate-stdout-filters`
/// copies the matching console lines, prefixed, into the attempt's filtered file.
#[test]
fn the_prefix_template_and_the_duplicate_filters() {
    let dir = TempDir::new("template");
    let run = run(
        2,
        &[
            "--job-id",
            "tpl",
            "--log-dir",
            dir.arg(),
            "--log-line-prefix-template",
            "${role_name}:${rank}/${local_rank}@${hostname}| ",
            "--duplicate-stdout-filters",
            "apple,kiwi",
        ],
        "echo role=$ROLE_NAME; echo apple $RANK; echo pear $RANK",
    );
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    let host = read(Path::new("/proc/sys/kernel/hostname"));
    let host = host.trim();
    let role = run
        .stdout
        .iter()
        .find_map(|l| l.split_once("role=").map(|(_, r)| r.to_owned()))
        .unwrap_or_else(|| panic!("no role line\n{}", run.dump()));
    let mut expected = Vec::new();
    for rank in 0..2 {
        let prefix = format!("{role}:{rank}/{rank}@{host}| ");
        for line in [
            format!("role={role}"),
            format!("apple {rank}"),
            format!("pear {rank}"),
        ] {
            expected.push(format!("{prefix}{line}"));
        }
    }
    expected.sort();
    assert_eq!(worker_lines(&run.stdout), expected, "{}", run.dump());
    let mut filtered: Vec<String> = read(&dir.path().join("tpl/attempt_0/filtered_stdout.log"))
        .lines()
        .map(str::to_owned)
        .collect();
    filtered.sort();
    assert_eq!(
        filtered,
        [
            format!("{role}:0/0@{host}| apple 0"),
            format!("{role}:1/1@{host}| apple 1")
        ]
    );
    assert!(
        !dir.path()
            .join("tpl/attempt_0/filtered_stderr.log")
            .exists()
    );
}

/// `--no-prefix` (and `--no_prefix`, and an empty template): the workers' lines as they wrote
/// them.
#[test]
fn no_prefix_prints_the_lines_as_they_are() {
    for flags in [
        &["--no-prefix"][..],
        &["--no_prefix"],
        &["--log-line-prefix-template="],
    ] {
        let run = run(2, flags, "echo out $RANK; echo err $RANK >&2");
        assert_eq!(run.code(), Some(0), "{flags:?}\n{}", run.dump());
        assert_eq!(
            worker_lines(&run.stdout),
            ["out 0", "out 1"],
            "{}",
            run.dump()
        );
        assert_eq!(
            worker_lines(&run.stderr),
            ["err 0", "err 1"],
            "{}",
            run.dump()
        );
    }
}

/// torchrun's `PET_*` variables set the output flags too; a flag beats its variable.
#[test]
fn pet_variables_set_the_output_flags() {
    let run = Agent::start_with_env(
        &[
            "launch",
            "--nproc-per-node",
            "2",
            "--tee",
            "0:2",
            "--",
            "sh",
            "-c",
            "echo out $RANK; echo err $RANK >&2",
        ],
        &[
            ("PET_REDIRECTS", "3"),
            ("PET_TEE", "3"),
            ("PET_LOG_LINE_PREFIX_TEMPLATE", "<${rank}> "),
        ],
    )
    .finish(SLOW);
    assert_eq!(run.code(), Some(0), "{}", run.dump());
    assert_eq!(
        worker_lines(&run.stdout),
        Vec::<String>::new(),
        "{}",
        run.dump()
    );
    assert_eq!(worker_lines(&run.stderr), ["<0> err 0"], "{}", run.dump());
    if let Some(root) = logs_folder(&run).parent().and_then(Path::parent) {
        let _ = std::fs::remove_dir_all(root);
    }
}
