//! The randomized fault-injection suite's parts that are not processes
//! (`tests/tests/fault_injection.rs`): a seeded PRNG and the fault schedule it draws, the
//! history (JSON lines written by the `fault_probe` workers and by the harness) and the checker
//! that asserts the invariants over it, plus the `/proc` scan for orphan processes.
//!
//! The checker is plain functions over parsed [`Event`]s, each returning the [`Violation`]s it
//! found, so that it can be tested on hand-made histories (see the tests at the bottom).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::Path;

use crate::linearizable::{Op, Operation, Out};

/// xorshift64*: small, seeded and the same on every machine, so a seed replays a schedule.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    /// A generator for `seed` (any value; 0 is mapped to a fixed non-zero state).
    pub fn new(seed: u64) -> Self {
        Self(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1)
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let mut x = self.0;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }

    /// A value in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi, "empty range {lo}..={hi}");
        lo + self.next_u64() % (hi - lo + 1)
    }

    /// One element of a non-empty slice.
    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        let i = self.range(0, items.len() as u64 - 1);
        &items[usize::try_from(i).unwrap_or(0)]
    }
}

/// What a fault does.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum FaultKind {
    /// SIGKILL the leading coordinator replica; it is started again after the fault's
    /// duration.
    LeaderKill,
    /// SIGSTOP the leading replica for less than its election lease, then SIGCONT.
    LeaderPauseShort,
    /// SIGSTOP the leading replica for longer than its lease (a standby takes over), then
    /// SIGCONT: the deposed leader wakes up.
    LeaderPauseLong,
    /// SIGKILL etcd; it is started again after the fault's duration.
    EtcdKill,
    /// SIGKILL etcd for longer than the failover budget (30 s), then start it again: every
    /// replica refuses as not the leader meanwhile, and the job must wait it out without a
    /// restart (issue 28, docs/ha.md "An etcd outage").
    EtcdOutageLong,
    /// SIGSTOP etcd for the fault's duration, then SIGCONT.
    EtcdPause,
    /// SIGKILL one agent (its process only: its guardian must stop its workers); the agent is
    /// started again with the same flags after the fault's duration, as a supervisor would.
    AgentKill,
    /// SIGSTOP one agent for the fault's duration (below its lease), then SIGCONT.
    AgentPause,
    /// SIGKILL one running worker (the job restarts).
    WorkerKill,
    /// SIGSTOP one running worker for the fault's duration (below the heartbeat timeout),
    /// then SIGCONT.
    WorkerPause,
    /// Cut one agent's network link (network namespaces) for the fault's duration, then heal.
    LinkCut,
    /// SIGKILL one agent of the `in-place` job (a node, or the spare standing by): a spare takes
    /// a lost node's ranks in place (issue 30); a new agent is started after the fault's
    /// duration, and stands by as the spare, as a machine that comes back does.
    NodeLoss,
}

impl FaultKind {
    /// Every kind, in a fixed order (the schedule draws from a subset of it).
    pub const ALL: [FaultKind; 12] = [
        FaultKind::LeaderKill,
        FaultKind::LeaderPauseShort,
        FaultKind::LeaderPauseLong,
        FaultKind::EtcdKill,
        FaultKind::EtcdOutageLong,
        FaultKind::EtcdPause,
        FaultKind::AgentKill,
        FaultKind::AgentPause,
        FaultKind::WorkerKill,
        FaultKind::WorkerPause,
        FaultKind::LinkCut,
        FaultKind::NodeLoss,
    ];

    /// The kind's name in the printed schedule and the history.
    pub fn name(self) -> &'static str {
        match self {
            FaultKind::LeaderKill => "leader-kill",
            FaultKind::LeaderPauseShort => "leader-pause-short",
            FaultKind::LeaderPauseLong => "leader-pause-long",
            FaultKind::EtcdKill => "etcd-kill",
            FaultKind::EtcdOutageLong => "etcd-outage-long",
            FaultKind::EtcdPause => "etcd-pause",
            FaultKind::AgentKill => "agent-kill",
            FaultKind::AgentPause => "agent-pause",
            FaultKind::WorkerKill => "worker-kill",
            FaultKind::WorkerPause => "worker-pause",
            FaultKind::LinkCut => "link-cut",
            FaultKind::NodeLoss => "node-loss",
        }
    }

    /// How long the fault lasts (pause, downtime or cut), in milliseconds: a range per kind.
    fn duration_ms(self) -> (u64, u64) {
        match self {
            FaultKind::LeaderKill => (200, 2_000),
            // The election lease of the suite is 2 s.
            FaultKind::LeaderPauseShort => (100, 1_000),
            // Past the lease, and up to past the heartbeat timeout (10 s) as in finding 1.
            FaultKind::LeaderPauseLong => (3_000, 12_000),
            FaultKind::EtcdKill => (200, 2_000),
            // Past the failover budget of 30 s, which used to stop the workers.
            FaultKind::EtcdOutageLong => (31_000, 40_000),
            FaultKind::EtcdPause => (100, 1_500),
            FaultKind::AgentKill => (100, 1_000),
            // The agents' lease (and the coordinator's heartbeat timeout) is 10 s.
            FaultKind::AgentPause => (100, 3_000),
            FaultKind::WorkerKill => (0, 0),
            FaultKind::WorkerPause => (100, 3_000),
            FaultKind::LinkCut => (500, 3_000),
            FaultKind::NodeLoss => (100, 1_000),
        }
    }
}

impl fmt::Display for FaultKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// One planned fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// Its place in the schedule, from 0.
    pub index: usize,
    /// Quiet time before it, after the previous fault ended (milliseconds).
    pub gap_ms: u64,
    /// What it does.
    pub kind: FaultKind,
    /// Which agent (node) or worker it hits, where the kind has a choice: an index taken
    /// modulo the candidates when the fault runs.
    pub target: u64,
    /// How long it lasts (milliseconds; see [`FaultKind`]).
    pub duration_ms: u64,
}

impl fmt::Display for Fault {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "#{:<3} +{:>5}ms {:<18} target {:<3} for {}ms",
            self.index, self.gap_ms, self.kind, self.target, self.duration_ms
        )
    }
}

/// Draws `count` faults of `kinds` (uniformly) from `seed`, each after a quiet gap of
/// `gap_ms` (a range) so that the job can make progress between them.
pub fn schedule(seed: u64, count: usize, kinds: &[FaultKind], gap_ms: (u64, u64)) -> Vec<Fault> {
    assert!(!kinds.is_empty(), "no fault kinds to draw from");
    let mut rng = Rng::new(seed);
    (0..count)
        .map(|index| {
            let kind = *rng.pick(kinds);
            let (lo, hi) = kind.duration_ms();
            Fault {
                index,
                gap_ms: rng.range(gap_ms.0, gap_ms.1),
                kind,
                target: rng.range(0, 1023),
                duration_ms: rng.range(lo, hi),
            }
        })
        .collect()
}

// ------------------------------------------------------------------------------------------
// The history.
// ------------------------------------------------------------------------------------------

/// A history file read back: its events in file order, and the lines that are not events
/// (line number, text).
pub type History = (Vec<Event>, Vec<(usize, String)>);

/// What a worker recorded (the `fault_probe` example's lines).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WorkerEvent {
    /// The worker runs: the world size and restart count it was given.
    Start {
        /// `MUSTER_WORLD_SIZE`.
        world: u32,
        /// `MUSTER_RESTART_COUNT`.
        restart_count: u32,
    },
    /// About to enter barrier `name` for the `seq`-th time (from 1).
    BarrierEnter {
        /// The barrier's name.
        name: String,
        /// Which of its rounds.
        seq: u64,
    },
    /// Barrier `name` round `seq` completed for this worker.
    BarrierExit {
        /// The barrier's name.
        name: String,
        /// Which of its rounds.
        seq: u64,
    },
    /// The unique id fetched (hex).
    UniqueId {
        /// Its bytes in hex.
        value: String,
    },
    /// A key-value call of the workload: what it asked, when, and what it returned (`ret`
    /// `None`: not returned yet, or failed; a later line of the same `n` may complete it).
    Kv {
        /// Which call of the process (from 1).
        n: u64,
        /// The key.
        key: String,
        /// The call.
        op: Op,
        /// When it was called (microseconds since the Unix epoch).
        call_us: u64,
        /// When it returned, with what.
        ret: Option<(u64, Out)>,
    },
    /// The process ended by itself: 0, or 1 with the error.
    Exit {
        /// Its exit status.
        status: i32,
        /// What failed, for status 1.
        error: Option<String>,
    },
}

/// One coordinator's `DescribeJob` answer, as the harness recorded it.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Observation {
    /// The replica that answered.
    pub replica: usize,
    /// The job's generation.
    pub generation: u64,
    /// `RoundState` as its proto name without the prefix (`RUNNING`, `FINISHED`, ...).
    pub state: String,
    /// Whether the job is over for good.
    pub done: bool,
    /// Restarts so far.
    pub restart_count: u32,
    /// The job's restart budget.
    pub max_restarts: u32,
    /// The ranks it lists, in its order.
    pub ranks: Vec<u32>,
    /// Its failure reason, if any.
    pub failure: Option<String>,
}

impl Observation {
    /// Whether the state is final: finished, cancelled, or failed for good.
    pub fn is_final(&self) -> bool {
        self.state == "FINISHED" || self.state == "CANCELLED" || self.done
    }
}

/// One line of the history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Event {
    /// A worker's line.
    Worker {
        /// Wall-clock milliseconds since the Unix epoch (every event has it).
        t_ms: u64,
        /// `MUSTER_GENERATION`.
        generation: u64,
        /// Its global rank.
        rank: u32,
        /// Its node rank.
        node: u32,
        /// Its process id.
        pid: i32,
        /// What happened.
        event: WorkerEvent,
    },
    /// A fault the harness injected (its description and what it hit).
    Fault {
        /// When it started.
        t_ms: u64,
        /// Its place in the schedule.
        index: usize,
        /// [`FaultKind::name`].
        kind: String,
        /// What it hit, or why it was skipped (`skipped: ...`).
        detail: String,
    },
    /// A replica's `DescribeJob` failed (recorded when its error changes).
    ObserveError {
        /// When.
        t_ms: u64,
        /// Which replica.
        replica: usize,
        /// The status or connection error.
        error: String,
    },
    /// A `DescribeJob` answer.
    Observe {
        /// When it came.
        t_ms: u64,
        /// What it said.
        observation: Observation,
    },
    /// The job's end as the harness saw it: how long after the stop was asked the agents all
    /// exited (`None`: not by the deadline), and their exit codes.
    JobEnd {
        /// When the harness stopped waiting.
        t_ms: u64,
        /// From the stop to the last agent's exit; `None` if one still ran at the deadline.
        elapsed_ms: Option<u64>,
        /// The deadline, from the stop.
        deadline_ms: u64,
        /// Each agent's exit code (`None`: still running, or ended by a signal).
        codes: Vec<Option<i32>>,
    },
    /// Processes of the run still alive after it ended.
    Orphans {
        /// Their pids.
        pids: Vec<i32>,
        /// Each one's pid, state and command line.
        what: Vec<String>,
    },
}

impl Event {
    /// The JSON line of this event (what [`parse_line`] reads back).
    pub fn to_line(&self) -> String {
        use serde_json::json;
        let v = match self {
            Event::Worker {
                t_ms,
                generation,
                rank,
                node,
                pid,
                event,
            } => {
                let mut v = json!({"t_ms": t_ms, "gen": generation, "rank": rank, "node": node, "pid": pid});
                let fields = match event {
                    WorkerEvent::Start {
                        world,
                        restart_count,
                    } => json!({"event": "start", "world": world, "restart_count": restart_count}),
                    WorkerEvent::BarrierEnter { name, seq } => {
                        json!({"event": "barrier-enter", "name": name, "seq": seq})
                    }
                    WorkerEvent::BarrierExit { name, seq } => {
                        json!({"event": "barrier-exit", "name": name, "seq": seq})
                    }
                    WorkerEvent::UniqueId { value } => {
                        json!({"event": "unique-id", "value": value})
                    }
                    WorkerEvent::Exit { status, error } => {
                        json!({"event": "exit", "status": status, "error": error})
                    }
                    WorkerEvent::Kv {
                        n,
                        key,
                        op,
                        call_us,
                        ret,
                    } => kv_json(*n, key, op, *call_us, ret.as_ref()),
                };
                if let (Some(v), Some(f)) = (v.as_object_mut(), fields.as_object()) {
                    v.extend(f.clone());
                }
                v
            }
            Event::Fault {
                t_ms,
                index,
                kind,
                detail,
            } => {
                json!({"t_ms": t_ms, "event": "fault", "index": index, "kind": kind, "detail": detail})
            }
            Event::ObserveError {
                t_ms,
                replica,
                error,
            } => {
                json!({"t_ms": t_ms, "event": "observe-error", "replica": replica, "error": error})
            }
            Event::Observe {
                t_ms,
                observation: o,
            } => json!({
                "t_ms": t_ms, "event": "observe", "replica": o.replica, "generation": o.generation,
                "state": o.state, "done": o.done, "restart_count": o.restart_count,
                "max_restarts": o.max_restarts, "ranks": o.ranks, "failure": o.failure,
            }),
            Event::JobEnd {
                t_ms,
                elapsed_ms,
                deadline_ms,
                codes,
            } => json!({"t_ms": t_ms, "event": "job-end", "elapsed_ms": elapsed_ms,
                        "deadline_ms": deadline_ms, "codes": codes}),
            Event::Orphans { pids, what } => {
                json!({"event": "orphans", "pids": pids, "what": what})
            }
        };
        v.to_string()
    }
}

/// The fields of a `kv` line (see the `fault_probe` example).
fn kv_json(
    n: u64,
    key: &str,
    op: &Op,
    call_us: u64,
    ret: Option<&(u64, Out)>,
) -> serde_json::Value {
    use serde_json::json;
    let text = |b: &[u8]| String::from_utf8_lossy(b).into_owned();
    let mut v = match op {
        Op::Set(value) => json!({"op": "set", "value": text(value)}),
        Op::Get => json!({"op": "get"}),
        Op::Add(delta) => json!({"op": "add", "delta": delta}),
        Op::CompareSet { expected, desired } => json!({
            "op": "cas", "expected": expected.as_deref().map(text), "desired": text(desired)
        }),
        Op::Delete => json!({"op": "delete"}),
        Op::Append(value) => json!({"op": "append", "value": text(value)}),
    };
    let out = match ret {
        None => json!({"ret_us": null}),
        Some((t, out)) => {
            let mut o = match out {
                Out::Done => json!({"done": true}),
                Out::Value(value) => json!({"value": value.as_deref().map(text)}),
                Out::Sum(sum) => json!({"sum": sum}),
                Out::Cas { swapped, current } => {
                    json!({"swapped": swapped, "current": current.as_deref().map(text)})
                }
                Out::Existed(existed) => json!({"existed": existed}),
            };
            if let Some(o) = o.as_object_mut() {
                o.insert("ret_us".into(), json!(t));
            }
            o
        }
    };
    if let (Some(v), Some(o)) = (v.as_object_mut(), out.as_object()) {
        v.extend(o.clone());
        v.insert("event".into(), json!("kv"));
        v.insert("n".into(), json!(n));
        v.insert("key".into(), json!(key));
        v.insert("call_us".into(), json!(call_us));
    }
    v
}

/// A `kv` line's call (`None` if it is malformed).
fn parse_kv(v: &serde_json::Value) -> Option<WorkerEvent> {
    let bytes = |k: &str| -> Option<Option<Vec<u8>>> {
        match v.get(k)? {
            serde_json::Value::Null => Some(None),
            value => Some(Some(value.as_str()?.as_bytes().to_vec())),
        }
    };
    let op = match v.get("op")?.as_str()? {
        "set" => Op::Set(bytes("value")??),
        "get" => Op::Get,
        "add" => Op::Add(v.get("delta")?.as_i64()?),
        "cas" => Op::CompareSet {
            expected: bytes("expected")?,
            desired: bytes("desired")??,
        },
        "delete" => Op::Delete,
        "append" => Op::Append(bytes("value")??),
        _ => return None,
    };
    let ret = match v.get("ret_us")? {
        serde_json::Value::Null => None,
        t => {
            let out = match &op {
                Op::Set(_) | Op::Append(_) => Out::Done,
                Op::Get => Out::Value(bytes("value")?),
                Op::Add(_) => Out::Sum(v.get("sum")?.as_i64()?),
                Op::CompareSet { .. } => Out::Cas {
                    swapped: v.get("swapped")?.as_bool()?,
                    current: bytes("current")?,
                },
                Op::Delete => Out::Existed(v.get("existed")?.as_bool()?),
            };
            Some((t.as_u64()?, out))
        }
    };
    Some(WorkerEvent::Kv {
        n: v.get("n")?.as_u64()?,
        key: v.get("key")?.as_str()?.to_owned(),
        op,
        call_us: v.get("call_us")?.as_u64()?,
        ret,
    })
}

/// Parses one history line (`None` for a line that is not a known event).
pub fn parse_line(line: &str) -> Option<Event> {
    let v: serde_json::Value = serde_json::from_str(line).ok()?;
    let u = |k: &str| v.get(k).and_then(serde_json::Value::as_u64);
    let s = |k: &str| {
        v.get(k)
            .and_then(serde_json::Value::as_str)
            .map(str::to_owned)
    };
    let u32_of = |k: &str| u(k).and_then(|n| u32::try_from(n).ok());
    let t_ms = u("t_ms").unwrap_or(0);
    let event = s("event")?;
    let worker = |event: WorkerEvent| -> Option<Event> {
        Some(Event::Worker {
            t_ms,
            generation: u("gen")?,
            rank: u32_of("rank")?,
            node: u32_of("node")?,
            pid: i32::try_from(u("pid")?).ok()?,
            event,
        })
    };
    match event.as_str() {
        "start" => worker(WorkerEvent::Start {
            world: u32_of("world")?,
            restart_count: u32_of("restart_count")?,
        }),
        "barrier-enter" => worker(WorkerEvent::BarrierEnter {
            name: s("name")?,
            seq: u("seq")?,
        }),
        "barrier-exit" => worker(WorkerEvent::BarrierExit {
            name: s("name")?,
            seq: u("seq")?,
        }),
        "unique-id" => worker(WorkerEvent::UniqueId { value: s("value")? }),
        "kv" => worker(parse_kv(&v)?),
        "exit" => worker(WorkerEvent::Exit {
            status: i32::try_from(v.get("status")?.as_i64()?).ok()?,
            error: s("error"),
        }),
        "fault" => Some(Event::Fault {
            t_ms,
            index: usize::try_from(u("index")?).ok()?,
            kind: s("kind")?,
            detail: s("detail").unwrap_or_default(),
        }),
        "observe-error" => Some(Event::ObserveError {
            t_ms,
            replica: usize::try_from(u("replica")?).ok()?,
            error: s("error")?,
        }),
        "observe" => Some(Event::Observe {
            t_ms,
            observation: Observation {
                replica: usize::try_from(u("replica")?).ok()?,
                generation: u("generation")?,
                state: s("state")?,
                done: v.get("done")?.as_bool()?,
                restart_count: u32_of("restart_count")?,
                max_restarts: u32_of("max_restarts")?,
                ranks: v
                    .get("ranks")?
                    .as_array()?
                    .iter()
                    .filter_map(|r| r.as_u64().and_then(|r| u32::try_from(r).ok()))
                    .collect(),
                failure: s("failure"),
            },
        }),
        "job-end" => Some(Event::JobEnd {
            t_ms,
            elapsed_ms: u("elapsed_ms"),
            deadline_ms: u("deadline_ms")?,
            codes: v
                .get("codes")?
                .as_array()?
                .iter()
                .map(|c| c.as_i64().and_then(|c| i32::try_from(c).ok()))
                .collect(),
        }),
        "orphans" => Some(Event::Orphans {
            pids: v
                .get("pids")?
                .as_array()?
                .iter()
                .filter_map(|p| p.as_i64().and_then(|p| i32::try_from(p).ok()))
                .collect(),
            what: v
                .get("what")
                .and_then(serde_json::Value::as_array)
                .map(|a| {
                    a.iter()
                        .filter_map(|w| w.as_str().map(str::to_owned))
                        .collect()
                })
                .unwrap_or_default(),
        }),
        _ => None,
    }
}

/// Reads a history file: its events in file order, and the lines that did not parse (with
/// their line numbers).
pub fn read_history(path: &Path) -> std::io::Result<History> {
    let text = std::fs::read_to_string(path)?;
    let mut events = Vec::new();
    let mut bad = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        match parse_line(line) {
            Some(e) => events.push(e),
            None => bad.push((i + 1, line.to_owned())),
        }
    }
    Ok((events, bad))
}

// ------------------------------------------------------------------------------------------
// The checker.
// ------------------------------------------------------------------------------------------

/// One broken invariant.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// Which invariant (one of the `INV_*` names).
    pub invariant: &'static str,
    /// What was seen.
    pub detail: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[{}] {}", self.invariant, self.detail)
    }
}

/// No two live processes hold one rank in one generation.
pub const INV_UNIQUE_RANKS: &str = "unique-ranks";
/// A barrier completes exactly once for every rank of a generation, and only after every
/// rank entered it.
pub const INV_BARRIER_ONCE: &str = "barrier-once";
/// A unique id never changes within a generation (and differs between generations).
pub const INV_UNIQUE_ID: &str = "unique-id-stable";
/// Restarts never exceed `max_restarts`.
pub const INV_RESTARTS: &str = "restart-budget";
/// A final state never changes once observed, and agrees with how the workers ended.
pub const INV_FINAL_STATE: &str = "final-state";
/// No job hangs past its deadline.
pub const INV_DEADLINE: &str = "deadline";
/// No process of the run outlives it.
pub const INV_ORPHANS: &str = "no-orphans";
/// Faults never lose the job while its restart budget lasts: every agent exits 0.
pub const INV_JOB_SURVIVES: &str = "job-survives";
/// A new generation has a cause: a fault that ended a worker since the previous one started.
pub const INV_RESTART_CAUSE: &str = "restart-has-cause";
/// Every key of the workload's key-value history is linearizable (`crate::linearizable`):
/// no acknowledged write lost, no stale read, no set, add, compare-and-set or delete applied
/// twice (the lanes' at-most-once promise) or out of its call's time.
pub const INV_LINEARIZABLE: &str = "kv-linearizable";

/// The fault kinds that end a worker, so that the job must restart: the only faults after
/// which [`INV_RESTART_CAUSE`] accepts a new generation. Every other kind (a coordinator or
/// etcd failing over, a pause under the leases, a short link cut) must leave the running
/// generation alone.
pub const RESTARTING_KINDS: [FaultKind; 2] = [FaultKind::WorkerKill, FaultKind::AgentKill];

fn violation(invariant: &'static str, detail: String) -> Violation {
    Violation { invariant, detail }
}

/// The worker events of `events`, as `(generation, rank, node, pid, event)`.
fn worker_events(events: &[Event]) -> impl Iterator<Item = (u64, u32, u32, i32, &WorkerEvent)> {
    events.iter().filter_map(|e| match e {
        Event::Worker {
            generation,
            rank,
            node,
            pid,
            event,
            ..
        } => Some((*generation, *rank, *node, *pid, event)),
        _ => None,
    })
}

/// The world size each generation's workers reported (the first one seen).
fn worlds(events: &[Event]) -> BTreeMap<u64, u32> {
    let mut out = BTreeMap::new();
    for (generation, _, _, _, e) in worker_events(events) {
        if let WorkerEvent::Start { world, .. } = e {
            out.entry(generation).or_insert(*world);
        }
    }
    out
}

/// [`INV_UNIQUE_RANKS`]: per generation, every rank is started by one process only, within
/// the world size all its workers agree on; and no `DescribeJob` answer lists a rank twice.
pub fn check_unique_ranks(events: &[Event]) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut holders: BTreeMap<(u64, u32), BTreeSet<i32>> = BTreeMap::new();
    let mut worlds: BTreeMap<u64, BTreeSet<u32>> = BTreeMap::new();
    for (generation, rank, _, pid, e) in worker_events(events) {
        holders.entry((generation, rank)).or_default().insert(pid);
        if let WorkerEvent::Start { world, .. } = e {
            worlds.entry(generation).or_default().insert(*world);
            if rank >= *world {
                out.push(violation(
                    INV_UNIQUE_RANKS,
                    format!(
                        "generation {generation}: pid {pid} holds rank {rank} of a world of {world}"
                    ),
                ));
            }
        }
    }
    for ((generation, rank), pids) in &holders {
        if pids.len() > 1 {
            out.push(violation(
                INV_UNIQUE_RANKS,
                format!("generation {generation}: rank {rank} is held by processes {pids:?}"),
            ));
        }
    }
    for (generation, w) in &worlds {
        if w.len() > 1 {
            out.push(violation(
                INV_UNIQUE_RANKS,
                format!("generation {generation}: workers disagree on the world size: {w:?}"),
            ));
        }
    }
    for e in events {
        if let Event::Observe { t_ms, observation } = e {
            let distinct: BTreeSet<u32> = observation.ranks.iter().copied().collect();
            if distinct.len() != observation.ranks.len() {
                out.push(violation(
                    INV_UNIQUE_RANKS,
                    format!(
                        "replica {} at {t_ms} lists a rank twice in generation {}: {:?}",
                        observation.replica, observation.generation, observation.ranks
                    ),
                ));
            }
        }
    }
    out
}

/// [`INV_BARRIER_ONCE`]: per generation and rank, each barrier is entered and completed at
/// most once, completions are consecutive from 1, and a completion of barrier `s` by any rank
/// means every rank of the generation entered `s`; in a generation whose workers all exited
/// 0, every rank completed the same barriers.
pub fn check_barriers(events: &[Event]) -> Vec<Violation> {
    let mut out = Vec::new();
    let worlds = worlds(events);
    // (generation, rank) -> seqs, per name.
    let mut entered: BTreeMap<(u64, String, u32), Vec<u64>> = BTreeMap::new();
    let mut exited: BTreeMap<(u64, String, u32), Vec<u64>> = BTreeMap::new();
    let mut statuses: BTreeMap<(u64, u32), i32> = BTreeMap::new();
    for (generation, rank, _, _, e) in worker_events(events) {
        match e {
            WorkerEvent::BarrierEnter { name, seq } => {
                entered
                    .entry((generation, name.clone(), rank))
                    .or_default()
                    .push(*seq);
            }
            WorkerEvent::BarrierExit { name, seq } => {
                exited
                    .entry((generation, name.clone(), rank))
                    .or_default()
                    .push(*seq);
            }
            WorkerEvent::Exit { status, .. } => {
                statuses.insert((generation, rank), *status);
            }
            _ => {}
        }
    }
    for (what, map) in [("entered", &entered), ("completed", &exited)] {
        for ((generation, name, rank), seqs) in map {
            let mut seen = BTreeSet::new();
            for s in seqs {
                if !seen.insert(*s) {
                    out.push(violation(
                        INV_BARRIER_ONCE,
                        format!(
                            "generation {generation}: rank {rank} {what} barrier {name} #{s} twice"
                        ),
                    ));
                }
            }
        }
    }
    for ((generation, name, rank), seqs) in &exited {
        let mut sorted = seqs.clone();
        sorted.sort_unstable();
        sorted.dedup();
        if let Some(gap) = sorted
            .iter()
            .zip(1u64..)
            .find(|(s, expected)| **s != *expected)
        {
            out.push(violation(
                INV_BARRIER_ONCE,
                format!(
                    "generation {generation}: rank {rank} completed barrier {name} #{} without completing #{} first",
                    gap.0, gap.1
                ),
            ));
        }
        let world = worlds.get(generation).copied().unwrap_or(0);
        for s in &sorted {
            let missing: Vec<u32> = (0..world)
                .filter(|r| {
                    !entered
                        .get(&(*generation, name.clone(), *r))
                        .is_some_and(|e| e.contains(s))
                })
                .collect();
            if !missing.is_empty() {
                out.push(violation(
                    INV_BARRIER_ONCE,
                    format!(
                        "generation {generation}: rank {rank} completed barrier {name} #{s} before ranks {missing:?} entered it"
                    ),
                ));
            }
        }
    }
    // Generations whose every rank exited 0: the same completions everywhere.
    for (generation, world) in &worlds {
        let all_ok = (0..*world).all(|r| statuses.get(&(*generation, r)) == Some(&0));
        if !all_ok {
            continue;
        }
        let names: BTreeSet<&String> = exited
            .keys()
            .filter(|(g, _, _)| g == generation)
            .map(|(_, n, _)| n)
            .collect();
        for name in names {
            let per_rank: Vec<usize> = (0..*world)
                .map(|r| {
                    exited
                        .get(&(*generation, name.clone(), r))
                        .map_or(0, Vec::len)
                })
                .collect();
            if per_rank.iter().any(|n| *n != per_rank[0]) {
                out.push(violation(
                    INV_BARRIER_ONCE,
                    format!(
                        "generation {generation} ended cleanly but its ranks completed different numbers of barrier {name}: {per_rank:?}"
                    ),
                ));
            }
        }
    }
    out
}

/// [`INV_UNIQUE_ID`]: every fetch of the unique id in a generation, by any rank, returns the
/// same value, and two generations never share one.
pub fn check_unique_ids(events: &[Event]) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut values: BTreeMap<u64, BTreeMap<String, BTreeSet<u32>>> = BTreeMap::new();
    for (generation, rank, _, _, e) in worker_events(events) {
        if let WorkerEvent::UniqueId { value } = e {
            values
                .entry(generation)
                .or_default()
                .entry(value.clone())
                .or_default()
                .insert(rank);
        }
    }
    let mut first_gen: BTreeMap<&String, u64> = BTreeMap::new();
    for (generation, by_value) in &values {
        if by_value.len() > 1 {
            let seen: Vec<String> = by_value
                .iter()
                .map(|(v, ranks)| format!("{}… by ranks {ranks:?}", &v[..v.len().min(16)]))
                .collect();
            out.push(violation(
                INV_UNIQUE_ID,
                format!("generation {generation}: the unique id changed: {seen:?}"),
            ));
        }
        for v in by_value.keys() {
            if let Some(earlier) = first_gen.insert(v, *generation) {
                out.push(violation(
                    INV_UNIQUE_ID,
                    format!(
                        "generations {earlier} and {generation} share the unique id {}…",
                        &v[..v.len().min(16)]
                    ),
                ));
            }
        }
    }
    out
}

/// [`INV_RESTARTS`]: no worker starts with, and no coordinator reports, more restarts than
/// `max_restarts`; and the coordinator reports the budget the job was given.
pub fn check_restarts(events: &[Event], max_restarts: u32) -> Vec<Violation> {
    let mut out = Vec::new();
    for (generation, rank, _, pid, e) in worker_events(events) {
        if let WorkerEvent::Start { restart_count, .. } = e
            && *restart_count > max_restarts
        {
            out.push(violation(
                    INV_RESTARTS,
                    format!(
                        "generation {generation}: rank {rank} (pid {pid}) started as restart {restart_count}, over max_restarts {max_restarts}"
                    ),
                ));
        }
    }
    for e in events {
        if let Event::Observe {
            t_ms,
            observation: o,
        } = e
            && (o.restart_count > max_restarts || o.max_restarts != max_restarts)
        {
            out.push(violation(
                    INV_RESTARTS,
                    format!(
                        "replica {} at {t_ms} reports restart {} of a budget of {} (the job was given {max_restarts})",
                        o.replica, o.restart_count, o.max_restarts
                    ),
                ));
        }
    }
    out
}

/// [`INV_FINAL_STATE`]: once any replica answered a final state, every later answer shows the
/// same state; and when every agent exited 0 after the workers of the last generation all
/// exited 0, the last answer says FINISHED (a failed job must not exit 0 either).
pub fn check_final_state(events: &[Event]) -> Vec<Violation> {
    let mut out = Vec::new();
    let mut first_final: Option<(u64, &Observation)> = None;
    let mut last: Option<&Observation> = None;
    for e in events {
        let Event::Observe { t_ms, observation } = e else {
            continue;
        };
        last = Some(observation);
        match first_final {
            None if observation.is_final() => first_final = Some((*t_ms, observation)),
            Some((t0, f))
                if (f.state.as_str(), f.done) != (observation.state.as_str(), observation.done) =>
            {
                out.push(violation(
                    INV_FINAL_STATE,
                    format!(
                        "replica {} said {} (done {}) at {t0}, then replica {} said {} (done {}) at {t_ms}{}",
                        f.replica,
                        f.state,
                        f.done,
                        observation.replica,
                        observation.state,
                        observation.done,
                        observation
                            .failure
                            .as_deref()
                            .map(|r| format!(": {r}"))
                            .unwrap_or_default()
                    ),
                ));
                // One report per change is enough.
                first_final = Some((*t_ms, observation));
            }
            _ => {}
        }
    }
    let end = events.iter().rev().find_map(|e| match e {
        Event::JobEnd { codes, .. } => Some(codes),
        _ => None,
    });
    let last_gen = worlds(events).into_iter().next_back();
    if let (Some(codes), Some(last), Some((generation, world))) = (end, last, last_gen) {
        let agents_ok = !codes.is_empty() && codes.iter().all(|c| *c == Some(0));
        let workers_ok = (0..world).all(|r| {
            worker_events(events).any(|(g, rank, _, _, e)| {
                g == generation && rank == r && matches!(e, WorkerEvent::Exit { status: 0, .. })
            })
        });
        if agents_ok && workers_ok && last.state != "FINISHED" {
            out.push(violation(
                INV_FINAL_STATE,
                format!(
                    "every worker of generation {generation} and every agent exited 0, but replica {} says {} (done {}){}",
                    last.replica,
                    last.state,
                    last.done,
                    last.failure
                        .as_deref()
                        .map(|r| format!(": {r}"))
                        .unwrap_or_default()
                ),
            ));
        }
        if agents_ok && last.state == "FAILED" && last.done {
            out.push(violation(
                INV_FINAL_STATE,
                format!("every agent exited 0 but the job failed for good: {last:?}"),
            ));
        }
    }
    out
}

/// [`INV_DEADLINE`]: the job ended (every agent exited) within its deadline.
pub fn check_deadline(events: &[Event]) -> Vec<Violation> {
    let ends: Vec<&Event> = events
        .iter()
        .filter(|e| matches!(e, Event::JobEnd { .. }))
        .collect();
    if ends.is_empty() {
        return vec![violation(
            INV_DEADLINE,
            "the history has no job end: the harness did not see the job end".into(),
        )];
    }
    ends.into_iter()
        .filter_map(|e| match e {
            Event::JobEnd {
                elapsed_ms,
                deadline_ms,
                codes,
                ..
            } => match elapsed_ms {
                Some(ms) if ms <= deadline_ms => None,
                Some(ms) => Some(format!("the job ended {ms} ms after the stop, past its deadline of {deadline_ms} ms")),
                None => Some(format!(
                    "the job still ran {deadline_ms} ms after the stop (agents' exit codes so far: {codes:?})"
                )),
            }
            .map(|d| violation(INV_DEADLINE, d)),
            _ => None,
        })
        .collect()
}

/// [`INV_ORPHANS`]: the harness found no process of the run alive after it ended.
pub fn check_orphans(events: &[Event]) -> Vec<Violation> {
    events
        .iter()
        .filter_map(|e| match e {
            Event::Orphans { pids, what } if !pids.is_empty() => Some(violation(
                INV_ORPHANS,
                format!("processes outlived the run: {what:?}"),
            )),
            _ => None,
        })
        .collect()
}

/// [`INV_JOB_SURVIVES`]: when an agent exited other than 0, the job's restarts were spent
/// (the last `DescribeJob` answer shows `max_restarts` restarts, or a final failure with none
/// left).
pub fn check_job_survives(events: &[Event], max_restarts: u32) -> Vec<Violation> {
    let Some(codes) = events.iter().rev().find_map(|e| match e {
        Event::JobEnd { codes, .. } => Some(codes),
        _ => None,
    }) else {
        return Vec::new();
    };
    if codes.iter().all(|c| *c == Some(0)) {
        return Vec::new();
    }
    let last = events.iter().rev().find_map(|e| match e {
        Event::Observe { observation, .. } => Some(observation),
        _ => None,
    });
    match last {
        Some(o) if o.restart_count >= max_restarts => Vec::new(),
        Some(o) => vec![violation(
            INV_JOB_SURVIVES,
            format!(
                "agents exited {codes:?} with restarts left ({} of {max_restarts} used); the job is {} (done {}) at replica {}{}",
                o.restart_count,
                o.state,
                o.done,
                o.replica,
                o.failure
                    .as_deref()
                    .map(|r| format!(": {r}"))
                    .unwrap_or_default()
            ),
        )],
        None => vec![violation(
            INV_JOB_SURVIVES,
            format!("agents exited {codes:?} and no coordinator ever described the job"),
        )],
    }
}

/// [`INV_RESTART_CAUSE`]: every generation after the first started after a fault of
/// [`RESTARTING_KINDS`] that came after the previous generation started (the fault's own
/// record may follow its effects: it is written when the fault ends, stamped with its start).
pub fn check_restart_causes(events: &[Event]) -> Vec<Violation> {
    let mut starts: BTreeMap<u64, u64> = BTreeMap::new();
    for e in events {
        if let Event::Worker {
            t_ms,
            generation,
            event: WorkerEvent::Start { .. },
            ..
        } = e
        {
            let t = starts.entry(*generation).or_insert(*t_ms);
            *t = (*t).min(*t_ms);
        }
    }
    let faults: Vec<(u64, &str, &str)> = events
        .iter()
        .filter_map(|e| match e {
            Event::Fault {
                t_ms, kind, detail, ..
            } if !detail.starts_with("skipped") => Some((*t_ms, kind.as_str(), detail.as_str())),
            _ => None,
        })
        .collect();
    let restarting: Vec<&str> = RESTARTING_KINDS.iter().map(|k| k.name()).collect();
    let mut out = Vec::new();
    for ((_, before), (generation, start)) in starts.iter().zip(starts.iter().skip(1)) {
        let between: Vec<&(u64, &str, &str)> = faults
            .iter()
            .filter(|(t, _, _)| t >= before && t <= start)
            .collect();
        if !between.iter().any(|(_, k, _)| restarting.contains(k)) {
            let what: Vec<String> = between
                .iter()
                .map(|(_, k, d)| format!("{k} ({d})"))
                .collect();
            out.push(violation(
                INV_RESTART_CAUSE,
                format!(
                    "generation {generation} started at {start} with no worker ended since the previous one started; the faults in between: {what:?}"
                ),
            ));
        }
    }
    out
}

/// The workload's key-value calls, as the linearizability checker takes them: each call's
/// line written after it returned, else the one written before it (an unknown outcome).
pub fn kv_operations(events: &[Event]) -> Vec<Operation> {
    let mut calls: BTreeMap<(i32, u64, u64), Operation> = BTreeMap::new();
    for (generation, rank, _, pid, e) in worker_events(events) {
        if let WorkerEvent::Kv {
            n,
            key,
            op,
            call_us,
            ret,
        } = e
        {
            let slot = calls
                .entry((pid, *call_us, *n))
                .or_insert_with(|| Operation {
                    client: format!("generation {generation} rank {rank} (pid {pid})"),
                    key: key.clone(),
                    op: op.clone(),
                    call_us: *call_us,
                    ret: None,
                });
            if ret.is_some() {
                slot.ret.clone_from(ret);
            }
        }
    }
    calls.into_values().collect()
}

/// [`INV_LINEARIZABLE`]: the key-value history, per key.
pub fn check_linearizable(events: &[Event]) -> Vec<Violation> {
    crate::linearizable::check(&kv_operations(events))
        .into_iter()
        .map(|bad| violation(INV_LINEARIZABLE, bad.to_string()))
        .collect()
}

/// Every invariant over one history.
pub fn check_all(events: &[Event], max_restarts: u32) -> Vec<Violation> {
    let mut out = check_unique_ranks(events);
    out.extend(check_barriers(events));
    out.extend(check_unique_ids(events));
    out.extend(check_restarts(events, max_restarts));
    out.extend(check_final_state(events));
    out.extend(check_deadline(events));
    out.extend(check_orphans(events));
    out.extend(check_job_survives(events, max_restarts));
    out.extend(check_restart_causes(events));
    out.extend(check_linearizable(events));
    out
}

/// Live processes (not zombies) whose environment holds `marker` (`NAME=value`), with their
/// command lines: everything a run started inherits the variable the harness gave its
/// agents, so this finds the run's processes wherever they were reparented.
pub fn marked_processes(marker: &str) -> Vec<(i32, String)> {
    let Ok(entries) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    let me = i32::try_from(std::process::id()).unwrap_or(0);
    entries
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<i32>().ok())
        .filter(|pid| *pid != me)
        .filter_map(|pid| {
            let environ = std::fs::read(format!("/proc/{pid}/environ")).ok()?;
            if !environ.split(|b| *b == 0).any(|v| v == marker.as_bytes()) {
                return None;
            }
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
            let state = stat
                .rsplit_once(')')?
                .1
                .split_whitespace()
                .next()?
                .to_owned();
            if state == "Z" || state == "X" {
                return None;
            }
            let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).unwrap_or_default();
            let cmdline = String::from_utf8_lossy(&cmdline).replace('\0', " ");
            Some((pid, format!("{pid} [{state}] {}", cmdline.trim())))
        })
        .collect()
}

// ------------------------------------------------------------------------------------------
// Link cuts: the agents in network namespaces, the coordinators on the test's loopback.
// ------------------------------------------------------------------------------------------

/// A link from the test's own network namespace to the switch of a [`crate::netns::Net`], so
/// that agents inside its hosts reach coordinators that listen on the test's loopback (the
/// replicas of [`crate::replicas`]) through [`TcpProxy`]s on this link's address; cutting a
/// host ([`crate::netns::Net::cut`]) then cuts it off from every coordinator. Removed on drop.
#[derive(Debug)]
pub struct Uplink {
    /// The test namespace's end of the veth pair.
    name: String,
    /// Its address on the switch (`.250` of the net's /24).
    pub addr: std::net::Ipv4Addr,
}

impl Uplink {
    /// Plugs the test's namespace into `net`'s switch as `.250` of its /24. The switch's
    /// namespace is named after the hosts' (`<id>-<host>` and `<id>-sw`, see `netns.rs`).
    pub fn attach(net: &crate::netns::Net, any_host: &str) -> Self {
        let host = net.host(any_host);
        let id = host
            .ns
            .strip_suffix(&format!("-{any_host}"))
            .unwrap_or_else(|| panic!("namespace {} does not end with -{any_host}", host.ns));
        let switch = format!("{id}-sw");
        let [a, b, c, _] = host.addr.octets();
        let addr = std::net::Ipv4Addr::new(a, b, c, 250);
        let tag = std::process::id() % 1_000_000;
        let name = format!("mtu{tag}");
        let peer = format!("mtv{tag}");
        let _ = run_ip(&["link", "del", &name]);
        let this = Self { name, addr };
        must_ip(&[
            "link", "add", &this.name, "type", "veth", "peer", "name", &peer, "netns", &switch,
        ]);
        must_ip(&["-n", &switch, "link", "set", &peer, "master", "br0"]);
        must_ip(&["-n", &switch, "link", "set", &peer, "up"]);
        must_ip(&["addr", "add", &format!("{addr}/24"), "dev", &this.name]);
        must_ip(&["link", "set", &this.name, "up"]);
        this
    }
}

impl Drop for Uplink {
    fn drop(&mut self) {
        let _ = run_ip(&["link", "del", &self.name]);
    }
}

/// Runs `ip <args>`: its stderr when it fails.
fn run_ip(args: &[&str]) -> Result<(), String> {
    let out = std::process::Command::new("ip")
        .args(args)
        .stdin(std::process::Stdio::null())
        .output()
        .map_err(|e| format!("ip: {e}"))?;
    if out.status.success() {
        Ok(())
    } else {
        Err(String::from_utf8_lossy(&out.stderr).trim().to_owned())
    }
}

fn must_ip(args: &[&str]) {
    if let Err(e) = run_ip(args) {
        panic!("ip {}: {e}", args.join(" "));
    }
}

/// Forwards every TCP connection made to `listen` to `upstream`, byte for byte, one thread per
/// direction: a connection the upstream refuses is closed, and either side's end of stream is
/// passed on. Stops accepting on drop (connections already made go on until their ends close).
#[derive(Debug)]
pub struct TcpProxy {
    listen: std::net::SocketAddr,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl TcpProxy {
    /// Listens on `listen` and starts forwarding to `upstream`.
    pub fn start(
        listen: std::net::SocketAddr,
        upstream: std::net::SocketAddr,
    ) -> std::io::Result<Self> {
        use std::net::{Shutdown, TcpListener, TcpStream};
        use std::sync::atomic::Ordering;
        let listener = TcpListener::bind(listen)?;
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        std::thread::spawn(move || {
            for down in listener.incoming() {
                if stopped.load(Ordering::SeqCst) {
                    return;
                }
                let Ok(down) = down else { continue };
                std::thread::spawn(move || {
                    let Ok(up) =
                        TcpStream::connect_timeout(&upstream, std::time::Duration::from_secs(1))
                    else {
                        return;
                    };
                    let _ = up.set_nodelay(true);
                    let _ = down.set_nodelay(true);
                    let pipe = |mut from: TcpStream, mut to: TcpStream| {
                        std::thread::spawn(move || {
                            let _ = std::io::copy(&mut from, &mut to);
                            let _ = to.shutdown(Shutdown::Write);
                            let _ = from.shutdown(Shutdown::Read);
                        })
                    };
                    let (Ok(down2), Ok(up2)) = (down.try_clone(), up.try_clone()) else {
                        return;
                    };
                    pipe(down, up);
                    pipe(up2, down2);
                });
            }
        });
        Ok(Self { listen, stop })
    }
}

impl Drop for TcpProxy {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::SeqCst);
        // Wake the accepting thread so that it sees the flag.
        let _ = std::net::TcpStream::connect_timeout(
            &self.listen,
            std::time::Duration::from_millis(200),
        );
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn w(generation: u64, rank: u32, pid: i32, event: WorkerEvent) -> Event {
        Event::Worker {
            t_ms: 0,
            generation,
            rank,
            node: rank / 2,
            pid,
            event,
        }
    }

    fn start(generation: u64, rank: u32, pid: i32) -> Event {
        w(
            generation,
            rank,
            pid,
            WorkerEvent::Start {
                world: 2,
                restart_count: u32::try_from(generation - 1).unwrap_or(0),
            },
        )
    }

    fn enter(generation: u64, rank: u32, seq: u64) -> Event {
        w(
            generation,
            rank,
            100 + rank as i32,
            WorkerEvent::BarrierEnter {
                name: "probe".into(),
                seq,
            },
        )
    }

    fn exit_b(generation: u64, rank: u32, seq: u64) -> Event {
        w(
            generation,
            rank,
            100 + rank as i32,
            WorkerEvent::BarrierExit {
                name: "probe".into(),
                seq,
            },
        )
    }

    fn done(generation: u64, rank: u32) -> Event {
        w(
            generation,
            rank,
            100 + rank as i32,
            WorkerEvent::Exit {
                status: 0,
                error: None,
            },
        )
    }

    fn uid(generation: u64, rank: u32, value: &str) -> Event {
        w(
            generation,
            rank,
            100 + rank as i32,
            WorkerEvent::UniqueId {
                value: value.into(),
            },
        )
    }

    fn observe(replica: usize, state: &str, done: bool, restart_count: u32) -> Event {
        Event::Observe {
            t_ms: 0,
            observation: Observation {
                replica,
                generation: 1,
                state: state.into(),
                done,
                restart_count,
                max_restarts: 3,
                ranks: vec![0, 1],
                failure: None,
            },
        }
    }

    fn end(codes: Vec<Option<i32>>, elapsed_ms: Option<u64>) -> Event {
        Event::JobEnd {
            t_ms: 0,
            elapsed_ms,
            deadline_ms: 1000,
            codes,
        }
    }

    /// A clean two-rank generation: two barriers, one id, both exit 0.
    fn good() -> Vec<Event> {
        vec![
            start(1, 0, 100),
            start(1, 1, 101),
            uid(1, 0, "aa"),
            uid(1, 1, "aa"),
            enter(1, 0, 1),
            enter(1, 1, 1),
            exit_b(1, 1, 1),
            exit_b(1, 0, 1),
            enter(1, 0, 2),
            enter(1, 1, 2),
            exit_b(1, 0, 2),
            exit_b(1, 1, 2),
            done(1, 0),
            done(1, 1),
            observe(0, "RUNNING", false, 0),
            observe(1, "FINISHED", false, 0),
            end(vec![Some(0), Some(0)], Some(10)),
            Event::Orphans {
                pids: vec![],
                what: vec![],
            },
        ]
    }

    fn invariants(v: &[Violation]) -> Vec<&'static str> {
        v.iter().map(|v| v.invariant).collect()
    }

    #[test]
    fn a_good_history_passes_every_check() {
        assert_eq!(check_all(&good(), 3), vec![]);
    }

    #[test]
    fn history_lines_round_trip() {
        for e in good() {
            assert_eq!(parse_line(&e.to_line()), Some(e.clone()), "{}", e.to_line());
        }
        assert_eq!(parse_line("not json"), None);
        assert_eq!(parse_line(r#"{"event":"start"}"#), None);
    }

    #[test]
    fn kv_lines_round_trip_and_a_lost_write_is_caught() {
        // As the probe writes them.
        let lines = [
            r#"{"t_ms":1,"event":"kv","gen":1,"rank":0,"node":0,"pid":10,"n":1,"op":"set","key":"probe-reg","value":"a","call_us":100,"ret_us":110,"done":true}"#,
            r#"{"t_ms":1,"event":"kv","gen":1,"rank":0,"node":0,"pid":10,"n":2,"op":"add","key":"probe-count","delta":1,"call_us":100,"ret_us":null}"#,
            r#"{"t_ms":1,"event":"kv","gen":1,"rank":1,"node":0,"pid":11,"n":1,"op":"cas","key":"probe-reg","expected":null,"desired":"b","call_us":120,"ret_us":130,"swapped":false,"current":"a"}"#,
            r#"{"t_ms":1,"event":"kv","gen":1,"rank":1,"node":0,"pid":11,"n":2,"op":"delete","key":"probe-reg","call_us":140,"ret_us":150,"existed":true}"#,
            r#"{"t_ms":1,"event":"kv","gen":1,"rank":1,"node":0,"pid":11,"n":3,"op":"get","key":"probe-reg","call_us":160,"ret_us":170,"value":null}"#,
        ];
        let mut events: Vec<Event> = lines.iter().map(|l| parse_line(l).unwrap()).collect();
        for e in &events {
            assert_eq!(
                parse_line(&e.to_line()).as_ref(),
                Some(e),
                "{}",
                e.to_line()
            );
        }
        assert_eq!(kv_operations(&events).len(), 5);
        // The line written before a call is completed by the one written after it.
        let before = r#"{"t_ms":1,"event":"kv","gen":1,"rank":0,"node":0,"pid":10,"n":1,"op":"set","key":"probe-reg","value":"a","call_us":100,"ret_us":null}"#;
        events.insert(0, parse_line(before).unwrap());
        let ops = kv_operations(&events);
        assert_eq!(ops.len(), 5);
        assert!(
            ops.iter()
                .any(|o| o.op == Op::Set(b"a".to_vec()) && o.ret.is_some())
        );
        assert!(check_linearizable(&events).is_empty());
        // A read after the delete that sees the value again: the delete was lost.
        let stale = r#"{"t_ms":1,"event":"kv","gen":2,"rank":1,"node":0,"pid":12,"n":1,"op":"get","key":"probe-reg","call_us":200,"ret_us":210,"value":"a"}"#;
        events.push(parse_line(stale).unwrap());
        let v = check_linearizable(&events);
        assert_eq!(invariants(&v), [INV_LINEARIZABLE], "{v:?}");
        // check_all runs it too.
        assert!(invariants(&check_all(&events, 5)).contains(&INV_LINEARIZABLE));
    }

    #[test]
    fn two_processes_on_one_rank_are_caught() {
        let mut h = good();
        h.push(start(1, 1, 999));
        let v = check_unique_ranks(&h);
        assert_eq!(invariants(&v), vec![INV_UNIQUE_RANKS], "{v:?}");
        assert!(v[0].detail.contains("rank 1"), "{v:?}");
        // A rank outside the world, and a coordinator listing a rank twice.
        let mut h = good();
        h.push(w(
            1,
            5,
            555,
            WorkerEvent::Start {
                world: 2,
                restart_count: 0,
            },
        ));
        h.push(Event::Observe {
            t_ms: 7,
            observation: Observation {
                ranks: vec![0, 0],
                ..Observation::default()
            },
        });
        assert_eq!(
            check_unique_ranks(&h).len(),
            2,
            "{:?}",
            check_unique_ranks(&h)
        );
    }

    #[test]
    fn a_barrier_completed_twice_or_early_or_skipped_is_caught() {
        let mut h = good();
        h.push(exit_b(1, 0, 2));
        let v = check_barriers(&h);
        assert!(
            v.iter()
                .any(|v| v.invariant == INV_BARRIER_ONCE && v.detail.contains("twice")),
            "{v:?}"
        );
        // Rank 0 leaves barrier 3 that rank 1 never entered.
        let mut h = good();
        h.insert(12, enter(1, 0, 3));
        h.insert(13, exit_b(1, 0, 3));
        let v = check_barriers(&h);
        assert!(
            v.iter().any(|v| v.detail.contains("before ranks [1]")),
            "{v:?}"
        );
        // ... which also leaves the clean generation with uneven completions.
        assert!(
            v.iter().any(|v| v.detail.contains("different numbers")),
            "{v:?}"
        );
        // Completing #2 without #1.
        let h: Vec<Event> = good()
            .into_iter()
            .filter(|e| *e != exit_b(1, 1, 1))
            .collect();
        let v = check_barriers(&h);
        assert!(
            v.iter().any(|v| v.detail.contains("without completing #1")),
            "{v:?}"
        );
    }

    #[test]
    fn a_failed_generation_may_stop_mid_barrier() {
        // Rank 1 is killed inside barrier 2 (entered, never completed): not a violation.
        let h = vec![
            start(1, 0, 100),
            start(1, 1, 101),
            enter(1, 0, 1),
            enter(1, 1, 1),
            exit_b(1, 0, 1),
            exit_b(1, 1, 1),
            enter(1, 0, 2),
            enter(1, 1, 2),
            exit_b(1, 0, 2),
        ];
        assert_eq!(check_barriers(&h), vec![]);
    }

    #[test]
    fn a_changed_or_reused_unique_id_is_caught() {
        let mut h = good();
        h.push(uid(1, 1, "bb"));
        let v = check_unique_ids(&h);
        assert_eq!(invariants(&v), vec![INV_UNIQUE_ID], "{v:?}");
        let mut h = good();
        h.push(start(2, 0, 200));
        h.push(uid(2, 0, "aa"));
        let v = check_unique_ids(&h);
        assert!(v[0].detail.contains("share"), "{v:?}");
    }

    #[test]
    fn restarts_over_the_budget_are_caught() {
        let mut h = good();
        h.push(start(5, 0, 500)); // restart 4 of 3
        h.push(observe(2, "RUNNING", false, 4));
        let v = check_restarts(&h, 3);
        assert_eq!(invariants(&v), vec![INV_RESTARTS, INV_RESTARTS], "{v:?}");
    }

    #[test]
    fn a_final_state_that_changes_is_caught() {
        // FINISHED, then a new leader says FAILED (issue 14, finding 2).
        let mut h = good();
        h.insert(16, observe(2, "FAILED", true, 0));
        let v = check_final_state(&h);
        assert!(
            v.iter()
                .any(|v| v.detail.contains("said FINISHED") && v.detail.contains("FAILED")),
            "{v:?}"
        );
        // Clean exits everywhere but the last answer is FAILED.
        assert!(v.iter().any(|v| v.detail.contains("exited 0")), "{v:?}");
        // A failure with restarts left is not final: RUNNING after FAILED is fine.
        let h = vec![
            observe(0, "FAILED", false, 0),
            observe(0, "RUNNING", false, 1),
        ];
        assert_eq!(check_final_state(&h), vec![]);
    }

    #[test]
    fn a_hang_and_orphans_are_caught() {
        let h = vec![end(vec![Some(0), None], None)];
        assert_eq!(invariants(&check_deadline(&h)), vec![INV_DEADLINE]);
        let h = vec![end(vec![Some(0), Some(0)], Some(5000))];
        assert_eq!(invariants(&check_deadline(&h)), vec![INV_DEADLINE]);
        assert_eq!(invariants(&check_deadline(&[])), vec![INV_DEADLINE]);
        let h = vec![Event::Orphans {
            pids: vec![42],
            what: vec!["42 [S] fault_probe".into()],
        }];
        assert_eq!(invariants(&check_orphans(&h)), vec![INV_ORPHANS]);
    }

    #[test]
    fn a_job_lost_with_restarts_left_is_caught() {
        // Both agents gave up (exit 1) while the coordinator still had 3 restarts to give.
        let h = vec![
            observe(0, "FAILED", false, 0),
            end(vec![Some(1), Some(1)], Some(10)),
        ];
        let v = check_job_survives(&h, 3);
        assert_eq!(invariants(&v), vec![INV_JOB_SURVIVES], "{v:?}");
        // With the budget spent, failing is the expected end.
        let h = vec![
            observe(0, "FAILED", true, 3),
            end(vec![Some(1), Some(1)], Some(10)),
        ];
        assert_eq!(check_job_survives(&h, 3), vec![]);
        assert_eq!(check_job_survives(&good(), 3), vec![]);
    }

    fn fault(t_ms: u64, kind: FaultKind) -> Event {
        Event::Fault {
            t_ms,
            index: 0,
            kind: kind.name().into(),
            detail: "replica 0".into(),
        }
    }

    fn started(t_ms: u64, generation: u64) -> Event {
        Event::Worker {
            t_ms,
            generation,
            rank: 0,
            node: 0,
            pid: 7,
            event: WorkerEvent::Start {
                world: 1,
                restart_count: 0,
            },
        }
    }

    #[test]
    fn a_restart_without_a_cause_is_caught() {
        // A paused leader that fails the job when it wakes (issue 14, finding 1).
        let h = vec![
            started(10, 1),
            fault(20, FaultKind::LeaderPauseLong),
            started(30, 2),
        ];
        let v = check_restart_causes(&h);
        assert_eq!(invariants(&v), vec![INV_RESTART_CAUSE], "{v:?}");
        assert!(v[0].detail.contains("leader-pause-long"), "{v:?}");
        // A killed worker is a cause; a kill before the previous generation is not.
        let h = vec![
            started(10, 1),
            fault(20, FaultKind::WorkerKill),
            started(30, 2),
            fault(40, FaultKind::EtcdKill),
            started(50, 3),
        ];
        let v = check_restart_causes(&h);
        assert_eq!(v.len(), 1, "{v:?}");
        assert!(v[0].detail.contains("generation 3"), "{v:?}");
        assert_eq!(check_restart_causes(&good()), vec![]);
    }

    #[test]
    fn schedules_replay_from_their_seed() {
        let kinds = [FaultKind::WorkerKill, FaultKind::LeaderKill];
        let a = schedule(42, 50, &kinds, (100, 900));
        assert_eq!(a, schedule(42, 50, &kinds, (100, 900)));
        assert_ne!(a, schedule(43, 50, &kinds, (100, 900)));
        assert!(a.iter().all(|f| kinds.contains(&f.kind)));
        assert!(a.iter().any(|f| f.kind == FaultKind::WorkerKill));
        assert!(a.iter().any(|f| f.kind == FaultKind::LeaderKill));
        assert!(a.iter().all(|f| (100..=900).contains(&f.gap_ms)));
    }

    #[test]
    fn the_proxy_forwards_both_ways_and_passes_on_the_end() {
        use std::io::{Read, Write};
        let upstream = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        let up_addr = upstream.local_addr().expect("addr");
        let port = crate::free_port();
        let listen: std::net::SocketAddr = ([127, 0, 0, 1], port).into();
        let proxy = TcpProxy::start(listen, up_addr).expect("proxy");
        let mut client = std::net::TcpStream::connect(listen).expect("connect");
        let (mut server, _) = upstream.accept().expect("accept");
        client.write_all(b"ping").expect("write");
        let mut buf = [0u8; 4];
        server.read_exact(&mut buf).expect("read");
        assert_eq!(&buf, b"ping");
        server.write_all(b"pong").expect("write");
        client.read_exact(&mut buf).expect("read");
        assert_eq!(&buf, b"pong");
        drop(server);
        let mut rest = Vec::new();
        client.read_to_end(&mut rest).expect("end of stream");
        assert!(rest.is_empty());
        drop(proxy);
    }

    #[test]
    fn marked_processes_finds_a_child_by_its_environment() {
        let marker = format!("MUSTER_FAULT_RUN=unit-{}", std::process::id());
        let (name, value) = marker.split_once('=').unwrap_or_default();
        let mut child = std::process::Command::new("sleep")
            .arg("30")
            .env(name, value)
            .spawn()
            .expect("sleep runs");
        let pid = i32::try_from(child.id()).unwrap_or(0);
        // Until the child has exec'd, its environment is still ours (without the marker).
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        let mut found = marked_processes(&marker);
        while found.is_empty() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(5));
            found = marked_processes(&marker);
        }
        let _ = child.kill();
        let _ = child.wait();
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].0, pid);
        assert!(marked_processes(&marker).is_empty());
    }
}
