//! torch's Flight Recorder, on for every worker and read from outside: each worker gets
//! `TORCH_FR_BUFFER_SIZE` (torch records its last collectives, gloo's included in torch 2.15)
//! and a per-rank `TORCH_WORKER_SERVER_SOCKET`, and the agent's start-up hook on `PYTHONPATH`
//! (`agent/python/sitecustomize.py`, then `_muster_flight.py`) starts torch's own worker
//! server there once the script imports `torch.distributed`. A stack dump then asks each
//! rank's server for its traces (`POST /handler/fr_trace_json` and `dump_nccl_trace_json`,
//! torch's own dump paths) and keeps the last collectives beside the rank's stack
//! (`RankStack.collectives`). The hook costs a Python worker about 0.15 ms at start once its
//! bytecode is in the folder (Python writes it, or, under PYTHONDONTWRITEBYTECODE, the hook
//! itself), and about 1.1 ms while it is compiled from source (a compile's fixed cost: an
//! empty `sitecustomize` costs 0.9 ms).
//!
//! Nothing here reimplements the recorder: the agent only sets torch's variables, starts
//! torch's server and reads torch's JSON.

use bytes::Bytes;
use http_body_util::{BodyExt as _, Empty};
use hyper_util::rt::TokioIo;
use muster_proto::v1 as pb;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// torch's variable: how many collectives the recorder keeps per process (0: off).
pub const TORCH_FR_BUFFER_SIZE: &str = "TORCH_FR_BUFFER_SIZE";
/// torch's variable: where `worker_main` (and the agent's hook) starts the worker server.
pub const TORCH_WORKER_SERVER_SOCKET: &str = "TORCH_WORKER_SERVER_SOCKET";
/// Python's module search path, where the hook goes first.
pub const PYTHONPATH: &str = "PYTHONPATH";

/// The recorder's size the agent asks for: torch's own examples use 2000 (a few hundred
/// kilobytes of entries per process).
const BUFFER: &str = "2000";

/// The most collectives kept per rank in a dump (the newest).
const KEPT: usize = 8;

/// How long one rank's server may take to answer: well inside the coordinator's wait for a
/// node's stacks (2 s, `DUMP_WAIT`), so that a slow recorder costs its own lines, never the
/// node's answer.
const READ_TIMEOUT: Duration = Duration::from_secs(1);

/// The hook (`sitecustomize.py`, small: every Python worker runs it at start), the module it
/// imports once the script imports torch.distributed (`_muster_flight.py`), and the one that
/// marks rank 0's optimizer steps once it imports torch.optim (`_muster_steps.py`), written
/// into each launch's folder.
const HOOK: [(&str, &str); 3] = [
    (
        "sitecustomize.py",
        include_str!("../python/sitecustomize.py"),
    ),
    (
        "_muster_flight.py",
        include_str!("../python/_muster_flight.py"),
    ),
    (
        "_muster_steps.py",
        include_str!("../python/_muster_steps.py"),
    ),
];

/// One launch's folder: the hook (`py/sitecustomize.py`, compiled once by the first workers)
/// and the ranks' sockets (`<rank>.sock`, which a later worker of the same rank, respawned or
/// restarted, takes over), removed when dropped (by the guardian after a SIGKILL). Its path is
/// short (`/tmp/muster-fr-<pid>-<n>`): a Unix socket path has at most 107 bytes.
#[derive(Debug)]
pub struct Flight {
    dir: PathBuf,
}

impl Flight {
    /// Creates a fresh folder with the hook in it.
    pub fn prepare() -> std::io::Result<Self> {
        static NEXT: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "muster-fr-{}-{}",
            std::process::id(),
            NEXT.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("py"))?;
        for (name, text) in HOOK {
            std::fs::write(dir.join("py").join(name), text)?;
        }
        Ok(Self { dir })
    }

    /// The folder (what [`worker_env`] and [`annotate`] take).
    pub fn dir(&self) -> &Path {
        &self.dir
    }
}

impl Drop for Flight {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Rank `rank`'s worker server socket in `dir`.
pub fn socket(dir: &Path, rank: u32) -> PathBuf {
    dir.join(format!("{rank}.sock"))
}

/// What a worker of rank `rank` gets for the recorder: the buffer size unless the agent
/// inherited one (0 turns torch's recorder off), its socket, and the hook first on
/// `PYTHONPATH` (before `python_path`, the path it would have had). A user who set
/// `TORCH_WORKER_SERVER_SOCKET` keeps theirs, and the agent reads nothing.
pub fn worker_env(
    dir: &Path,
    rank: u32,
    inherited: impl Fn(&str) -> bool,
    python_path: Option<&str>,
) -> Vec<(&'static str, String)> {
    if inherited(TORCH_WORKER_SERVER_SOCKET) {
        return vec![];
    }
    let mut env = vec![];
    if !inherited(TORCH_FR_BUFFER_SIZE) {
        env.push((TORCH_FR_BUFFER_SIZE, BUFFER.to_owned()));
    }
    env.push((
        TORCH_WORKER_SERVER_SOCKET,
        socket(dir, rank).to_string_lossy().into_owned(),
    ));
    let hook = dir.join("py").to_string_lossy().into_owned();
    env.push((
        PYTHONPATH,
        match python_path.filter(|p| !p.is_empty()) {
            Some(rest) => format!("{hook}:{rest}"),
            None => hook,
        },
    ));
    env
}

/// Reads each rank's recorder in `dir` (all at once), filling `collectives`, or
/// `flight_recorder` with why not. A rank whose server is there is read even where its stack
/// could not be (ptrace refused); one without a server is told why only if it is a Python
/// rank whose stack was read (a program that is not Python, or one that exited, is left
/// alone).
pub async fn annotate(dir: &Path, stacks: &mut [pb::RankStack]) {
    let reads = stacks.iter().map(|s| {
        let python = s.error.is_empty() && !s.threads.is_empty();
        let path = s
            .rank
            .map(|r| socket(dir, r))
            .filter(|p| python || p.exists());
        async move {
            match path {
                Some(path) => Some(read(&path).await),
                None => None,
            }
        }
    });
    let results = futures::future::join_all(reads).await;
    for (stack, result) in stacks.iter_mut().zip(results) {
        match result {
            Some(Ok(collectives)) if collectives.is_empty() => {
                muster_core::stacks::NO_COLLECTIVE.clone_into(&mut stack.flight_recorder);
            }
            Some(Ok(collectives)) => stack.collectives = collectives,
            Some(Err(why)) => stack.flight_recorder = why,
            None => {}
        }
    }
}

/// torch's two recorders, each behind its own handler: the CPU-event one (gloo) and NCCL's.
const HANDLERS: [&str; 2] = ["/handler/fr_trace_json", "/handler/dump_nccl_trace_json"];

/// One rank's last collectives from its worker server at `socket` (both recorders, merged),
/// or why not (one line). A handler this torch lacks is skipped; both failing is the error.
pub async fn read(socket: &Path) -> Result<Vec<pb::Collective>, String> {
    if !socket.exists() {
        return Err(
            "no Flight Recorder: the rank has not imported torch.distributed (or its Python skipped the agent's start-up hook)"
                .to_owned(),
        );
    }
    let both = futures::future::join_all(HANDLERS.map(|h| post(socket, h)));
    let answers = tokio::time::timeout(READ_TIMEOUT, both)
        .await
        .map_err(|_| {
            format!(
                "its Flight Recorder did not answer within {} ms",
                READ_TIMEOUT.as_millis()
            )
        })?;
    let mut bodies = vec![];
    let mut last_error = String::new();
    for answer in answers {
        match answer {
            Ok(body) => bodies.push(body),
            Err(why) => last_error = why,
        }
    }
    if bodies.is_empty() {
        return Err(last_error);
    }
    parse(&bodies)
}

/// `POST path` over HTTP/1.1 to the server at `socket`: the body of a 200 answer.
async fn post(socket: &Path, path: &str) -> Result<Bytes, String> {
    let why = |e: &dyn std::fmt::Display| format!("its Flight Recorder did not answer ({e})");
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .map_err(|e| why(&e))?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(|e| why(&e))?;
    // Task "flight-conn", one per read: drives the connection; ends with it.
    tokio::spawn(conn);
    // An explicit empty body: torch 2.11's server waits for a POST's length.
    let request = http::Request::post(path)
        .header(http::header::HOST, "localhost")
        .header(http::header::CONTENT_LENGTH, "0")
        .body(Empty::<Bytes>::new())
        .map_err(|e| why(&e))?;
    let answer = sender.send_request(request).await.map_err(|e| why(&e))?;
    let status = answer.status();
    let body = answer
        .into_body()
        .collect()
        .await
        .map_err(|e| why(&e))?
        .to_bytes();
    if !status.is_success() {
        let text = String::from_utf8_lossy(&body);
        return Err(format!(
            "its Flight Recorder answered {status}: {}",
            text.lines().next().unwrap_or_default()
        ));
    }
    Ok(body)
}

/// The newest [`KEPT`] entries of torch's trace documents (`fr_trace_json`,
/// `dump_nccl_trace_json`), oldest first by creation time.
pub fn parse(bodies: &[Bytes]) -> Result<Vec<pb::Collective>, String> {
    let mut all = vec![];
    for body in bodies {
        all.extend(entries(body)?);
    }
    all.sort_by_key(|(at, _)| *at);
    let skip = all.len().saturating_sub(KEPT);
    Ok(all.into_iter().skip(skip).map(|(_, c)| c).collect())
}

/// An entry's place in time: its creation time, then its record id.
type When = (u64, u64);

/// One trace document's entries, each with its [`When`].
fn entries(body: &[u8]) -> Result<Vec<(When, pb::Collective)>, String> {
    let doc: serde_json::Value = serde_json::from_slice(body)
        .map_err(|e| format!("its Flight Recorder's trace is not JSON ({e})"))?;
    let Some(entries) = doc.get("entries").and_then(|e| e.as_array()) else {
        return Ok(vec![]);
    };
    let number = |e: &serde_json::Value, key: &str| e.get(key).and_then(|v| v.as_u64());
    let text = |e: &serde_json::Value, key: &str| {
        e.get(key)
            .and_then(|v| v.as_str())
            .unwrap_or_default()
            .to_owned()
    };
    Ok(entries
        .iter()
        .map(|e| {
            let p2p = e.get("is_p2p").and_then(|v| v.as_bool()).unwrap_or(false);
            let seq = if p2p {
                number(e, "p2p_seq_id")
            } else {
                number(e, "collective_seq_id")
            };
            let process_group = e
                .get("process_group")
                .and_then(|v| v.as_array())
                .and_then(|pg| pg.get(1))
                .and_then(|v| v.as_str())
                .unwrap_or_default()
                .to_owned();
            let input_sizes = e
                .get("input_sizes")
                .and_then(|v| v.as_array())
                .map(|sizes| {
                    sizes
                        .iter()
                        .map(|s| {
                            let dims: Vec<String> = s
                                .as_array()
                                .map(|d| d.iter().map(ToString::to_string).collect())
                                .unwrap_or_default();
                            format!("[{}]", dims.join(", "))
                        })
                        .collect()
                })
                .unwrap_or_default();
            (
                (
                    number(e, "time_created_ns").unwrap_or_default(),
                    number(e, "record_id").unwrap_or_default(),
                ),
                pb::Collective {
                    seq: seq.unwrap_or_default(),
                    op: text(e, "profiling_name"),
                    process_group,
                    input_sizes,
                    state: text(e, "state"),
                    p2p,
                },
            )
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Two entries as torch 2.15's gloo backend writes them (abridged from a real dump).
    const TRACE: &str = r#"{"comm_lib_version":"","entries":[
        {"collective_seq_id":2,"input_sizes":[[4]],"is_p2p":false,"p2p_seq_id":0,
         "process_group":["0","default_pg"],"profiling_name":"gloo:all_reduce","record_id":1,
         "state":"scheduled","time_created_ns":300},
        {"collective_seq_id":1,"input_sizes":[[4, 1024],[3]],"is_p2p":false,"p2p_seq_id":0,
         "process_group":["0","default_pg"],"profiling_name":"gloo:broadcast","record_id":0,
         "state":"completed","time_created_ns":100}],"pg_config":{},"version":"2.10"}"#;

    /// NCCL's recorder (`dump_nccl_trace_json`), created between the two.
    const NCCL: &str = r#"{"entries":[
        {"collective_seq_id":1,"input_sizes":[[1024]],"is_p2p":false,"p2p_seq_id":0,
         "process_group":["1","nccl_pg"],"profiling_name":"nccl:all_reduce","record_id":0,
         "state":"completed","time_created_ns":200}],"version":"2.10"}"#;

    #[test]
    fn torchs_two_recorders_are_merged_oldest_first() {
        let got = parse(&[
            Bytes::from_static(TRACE.as_bytes()),
            Bytes::from_static(NCCL.as_bytes()),
        ])
        .expect("torch's traces");
        let view: Vec<_> = got
            .iter()
            .map(|c| {
                (
                    c.seq,
                    c.op.as_str(),
                    c.process_group.as_str(),
                    c.input_sizes.join(" "),
                    c.state.as_str(),
                )
            })
            .collect();
        assert_eq!(
            view,
            [
                (
                    1,
                    "gloo:broadcast",
                    "default_pg",
                    "[4, 1024] [3]".to_owned(),
                    "completed"
                ),
                (
                    1,
                    "nccl:all_reduce",
                    "nccl_pg",
                    "[1024]".to_owned(),
                    "completed"
                ),
                (
                    2,
                    "gloo:all_reduce",
                    "default_pg",
                    "[4]".to_owned(),
                    "scheduled"
                ),
            ]
        );
        assert!(
            parse(&[Bytes::from_static(b"{}")])
                .expect("an empty document")
                .is_empty()
        );
        assert!(
            parse(&[Bytes::from_static(b"not json")])
                .expect_err("not JSON")
                .contains("not JSON")
        );
    }

    #[test]
    fn the_env_puts_the_hook_first_and_keeps_what_the_user_set() {
        let dir = Path::new("/tmp/muster-fr-1-0");
        let env = worker_env(dir, 3, |_| false, Some("/job"));
        assert_eq!(
            env,
            [
                (TORCH_FR_BUFFER_SIZE, "2000".to_owned()),
                (
                    TORCH_WORKER_SERVER_SOCKET,
                    "/tmp/muster-fr-1-0/3.sock".to_owned()
                ),
                (PYTHONPATH, "/tmp/muster-fr-1-0/py:/job".to_owned()),
            ]
        );
        let env = worker_env(dir, 3, |n| n == TORCH_FR_BUFFER_SIZE, None);
        assert_eq!(env.len(), 2);
        assert_eq!(env[1], (PYTHONPATH, "/tmp/muster-fr-1-0/py".to_owned()));
        assert!(worker_env(dir, 3, |n| n == TORCH_WORKER_SERVER_SOCKET, None).is_empty());
    }

    #[test]
    fn under_dontwritebytecode_the_hook_caches_its_bytecode_in_its_own_folder_only() {
        let flight = Flight::prepare().expect("a folder");
        // The user's module, in a folder of its own beside the hook's.
        let user = flight.dir().join("user");
        std::fs::create_dir(&user).expect("a folder");
        std::fs::write(user.join("usermod.py"), "VALUE = 7\n").expect("a module");
        let env = worker_env(flight.dir(), 0, |_| false, Some(&user.to_string_lossy()));
        let run = || {
            let out = std::process::Command::new("python3")
                .args([
                    "-c",
                    "import os, usermod; print(usermod.VALUE, os.environ.get('TORCH_WORKER_SERVER_SOCKET'))",
                ])
                .envs(env.iter().map(|(k, v)| (k, v)))
                .env("PYTHONDONTWRITEBYTECODE", "1")
                .output()
                .expect("python3 runs");
            assert!(out.status.success(), "{out:?}");
            String::from_utf8_lossy(&out.stdout).trim().to_owned()
        };
        // The hook ran (it took the socket's variable out of the environment).
        assert_eq!(run(), "7 None");
        let cached: Vec<String> = std::fs::read_dir(flight.dir().join("py/__pycache__"))
            .expect("the hook's cache")
            .map(|e| {
                e.expect("an entry")
                    .file_name()
                    .to_string_lossy()
                    .into_owned()
            })
            .collect();
        for module in ["sitecustomize.", "_muster_flight.", "_muster_steps."] {
            assert!(
                cached
                    .iter()
                    .any(|c| c.starts_with(module) && c.ends_with(".pyc")),
                "{module} in {cached:?}"
            );
        }
        // The user's tree stays as the flag asks.
        assert!(!user.join("__pycache__").exists());
        // Loaded from its bytecode the second time.
        assert_eq!(run(), "7 None");
        assert!(!user.join("__pycache__").exists());
    }

    #[tokio::test]
    async fn a_rank_without_a_server_says_why() {
        let flight = Flight::prepare().expect("a folder");
        assert!(flight.dir().join("py/sitecustomize.py").exists());
        assert!(flight.dir().join("py/_muster_flight.py").exists());
        let why = read(&socket(flight.dir(), 0)).await.expect_err("no socket");
        assert!(why.contains("has not imported torch.distributed"), "{why}");
        // A socket nobody serves: the connection's error.
        let path = socket(flight.dir(), 1);
        drop(std::os::unix::net::UnixListener::bind(&path).expect("a socket"));
        let why = read(&path).await.expect_err("nobody serves");
        assert!(
            why.starts_with("its Flight Recorder did not answer ("),
            "{why}"
        );
        let dir = flight.dir().to_owned();
        drop(flight);
        assert!(!dir.exists());
    }
}
