//! Fuzz target `job_ops`: one in-process job driven through an arbitrary sequence of joins,
//! withdrawals, session registrations, heartbeats, barrier entries (any seq, scope, rank and
//! generation), leaves, failures, node ends and cancellation, on a paused clock so that
//! last-call windows, join and barrier timeouts fire. Inputs are what the handlers would pass
//! after validation; ranks, seqs and generations are taken raw, as the wire gives them.
//! Nothing may panic, and every call must return without blocking.
#![no_main]

use arbitrary::Arbitrary;
use libfuzzer_sys::fuzz_target;
use muster_coordinator::job::{FailureDetail, Job, JobContext, JoinReq, RoundConfig};
use muster_core::model::{self, JobId, Scope};
use std::time::Duration;

#[derive(Arbitrary, Debug)]
enum Op {
    Join {
        node: u8,
        local_world_size: u8,
        requested: Option<u8>,
        request_id: u8,
    },
    Withdraw {
        generation: u8,
        node: u8,
        attempt: u8,
    },
    Register {
        generation: u8,
        rank: u16,
        resume: Option<(u64, u64)>,
    },
    Touch {
        generation: u8,
        rank: u16,
    },
    Barrier {
        session: u8,
        node_scope: bool,
        seq: u64,
        name: u8,
        timeout_ms: u16,
    },
    Leave {
        session: u8,
    },
    FailRank {
        generation: u8,
        rank: u16,
        exit_code: Option<i32>,
    },
    NodeFinished {
        generation: u8,
        node_rank: u8,
    },
    /// A node's lease ended (a spare may take its place).
    NodeLost {
        generation: u8,
        node_rank: u8,
    },
    Cancel,
    Describe,
    Sleep {
        ms: u16,
    },
}

#[derive(Arbitrary, Debug)]
struct Input {
    min_nodes: u8,
    extra_nodes: u8,
    last_call_ms: u16,
    max_restarts: u8,
    ops: Vec<Op>,
}

fuzz_target!(|input: Input| {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
    else {
        return;
    };
    rt.block_on(run(input));
});

async fn run(input: Input) {
    let min_nodes = u32::from(input.min_nodes % 8).max(1);
    let config = RoundConfig {
        min_nodes,
        max_nodes: min_nodes + u32::from(input.extra_nodes % 4),
        last_call: Duration::from_millis(u64::from(input.last_call_ms)),
        join_timeout: Duration::from_secs(60),
        max_restarts: u32::from(input.max_restarts % 4),
        recovery: if input.max_restarts & 0x80 != 0 {
            muster_coordinator::job::Recovery::InPlace
        } else {
            muster_coordinator::job::Recovery::Restart
        },
        hang: muster_coordinator::job::Hang::default(),
        max_spares: u32::from(input.extra_nodes >> 4) % 3,
    };
    let ctx = JobContext {
        incarnation: 1,
        store: None,
        tenure: muster_coordinator::tenure::Tenure::always(),
        heartbeat_timeout: Duration::from_secs(10),
    };
    let Ok(id) = JobId::parse("fuzz") else { return };
    let job = Job::new(id, config, &ctx);
    // Receivers are kept so that outboxes stay open, as live sessions' streams would.
    let mut answers = Vec::new();
    let mut sessions = Vec::new();
    for op in input.ops {
        match op {
            Op::Join {
                node,
                local_world_size,
                requested,
                request_id,
            } => {
                let req = JoinReq {
                    node_id: format!("node-{}", node % 16),
                    host: format!("host-{}", node % 16),
                    local_world_size: u32::from(local_world_size % 8).max(1),
                    requested: requested.map(|r| u32::from(r % 16)),
                    request_id: if request_id % 2 == 0 {
                        String::new()
                    } else {
                        format!("req-{request_id}")
                    },
                    watches: request_id % 3 == 0,
                    spare: request_id % 5 == 0,
                };
                if let Ok(answer) = job.join(req) {
                    answers.push(answer);
                }
            }
            Op::Withdraw {
                generation,
                node,
                attempt,
            } => job.withdraw(
                u64::from(generation),
                &format!("node-{}", node % 16),
                u64::from(attempt),
            ),
            Op::Register {
                generation,
                rank,
                resume,
            } => {
                let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
                let resume = resume.map(|(g, n)| [g, n]);
                let registered = job.register(
                    u64::from(generation),
                    u32::from(rank),
                    1,
                    "host".into(),
                    tx.clone(),
                    resume,
                    None,
                );
                if registered.is_ok() {
                    sessions.push((u64::from(generation), u32::from(rank), tx.into(), rx));
                }
            }
            Op::Touch { generation, rank } => job.touch(u64::from(generation), u32::from(rank)),
            Op::Barrier {
                session,
                node_scope,
                seq,
                name,
                timeout_ms,
            } => {
                // As in the session handler: only a registered session enters barriers, with
                // its own generation and rank (seq and scope come raw from the wire).
                let Some((generation, rank, outbox, _)) = pick(&sessions, session) else {
                    continue;
                };
                let scope = if node_scope {
                    Scope::Node
                } else {
                    Scope::Global
                };
                let Ok(name) = model::label("barrier name", &format!("b{name}"), 512) else {
                    continue;
                };
                let Ok(timeout) = model::wait("timeout_ms", u64::from(timeout_ms)) else {
                    continue;
                };
                job.barrier(*generation, *rank, scope, seq, name, timeout, outbox);
            }
            Op::Leave { session } => {
                if let Some((generation, rank, _, _)) = pick(&sessions, session) {
                    job.leave(*generation, *rank);
                }
            }
            Op::FailRank {
                generation,
                rank,
                exit_code,
            } => {
                let _ = job.fail_rank(
                    u64::from(generation),
                    u32::from(rank),
                    "fuzz".into(),
                    Some(FailureDetail {
                        exit_code,
                        ..FailureDetail::default()
                    }),
                );
            }
            Op::NodeFinished {
                generation,
                node_rank,
            } => {
                job.node_finished(u64::from(generation), u32::from(node_rank))
                    .await
            }
            Op::NodeLost {
                generation,
                node_rank,
            } => job.node_lost(
                u64::from(generation),
                u32::from(node_rank),
                0,
                "fuzz: its lease ended",
            ),
            Op::Cancel => {
                let _ = job.cancel("fuzz");
            }
            Op::Describe => {
                let _ = job.describe();
                let _ = job.summary();
            }
            Op::Sleep { ms } => tokio::time::sleep(Duration::from_millis(u64::from(ms))).await,
        }
        // Let spawned timers and waiters run.
        tokio::task::yield_now().await;
        for (_, _, _, rx) in &mut sessions {
            while rx.try_recv().is_ok() {}
        }
    }
    let _ = job.describe();
    job.retire("fuzz done");
    drop(answers);
}

/// A live session: its generation, rank, outbox and the outbox's receiving end.
type Session = (
    u64,
    u32,
    muster_coordinator::job::Outbox,
    tokio::sync::mpsc::UnboundedReceiver<
        Result<muster_proto::v1::CoordinatorMessage, tonic::Status>,
    >,
);

fn pick(sessions: &[Session], i: u8) -> Option<&Session> {
    if sessions.is_empty() {
        return None;
    }
    sessions.get(usize::from(i) % sessions.len())
}
