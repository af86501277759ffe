//! A generation's first failure and what the agent reported about it: what the job records,
//! what the metrics count, and the text every waiter of the generation is told.

use crate::model::JobId;
use muster_proto::v1 as pb;
use pb::barrier_error::Kind as ErrKind;
use std::fmt::Write as _;

/// How many heartbeat intervals make a session's heartbeat timeout: the coordinator asks for a
/// heartbeat every `timeout / HEARTBEATS_PER_TIMEOUT` (its `Registered` answer), and whoever
/// watches a session (the coordinator, or the agent's gateway for its workers) gives up on it
/// after that many intervals of silence.
pub const HEARTBEATS_PER_TIMEOUT: u32 = 3;

/// Why a worker's session ended without `leave`, at the coordinator (a worker's own session)
/// or at its agent's gateway.
pub const SESSION_LOST: &str = "session ended without leave (process exited or was killed)";

/// How long a session's end waits before it is reported as its rank's failure, so that the
/// agent's report of the process's end (exit status, stderr) usually comes first and names
/// the cause.
pub const AGENT_REPORT_GRACE: std::time::Duration = std::time::Duration::from_millis(150);

/// Why a session that stopped sending heartbeats for `timeout` failed its rank.
pub fn no_heartbeat(timeout: std::time::Duration) -> String {
    format!(
        "no heartbeat for {:.1}s (process stopped, hung or partitioned)",
        timeout.as_secs_f64()
    )
}

/// The first failure of a generation: which rank, where, and why.
#[derive(Debug, Clone)]
pub struct Failure {
    /// The failed global rank.
    pub rank: u32,
    /// Its node rank.
    pub node_rank: u32,
    /// Its host.
    pub host: String,
    /// Why it failed.
    pub reason: String,
    /// Whether the reason came from the agent (exit status) rather than a dropped session.
    pub precise: bool,
    /// What the agent reported beyond the reason.
    pub detail: FailureDetail,
    /// The failed node's id, for a node-level failure (a lost agent).
    pub node_id: String,
    /// A hang the coordinator detected, and what it does (`reason` holds the report).
    pub hang: Option<crate::model::OnHang>,
}

/// What an agent reports about a worker's end beyond the one-line reason.
#[derive(Debug, Clone, Default)]
pub struct FailureDetail {
    /// The exit code, when the worker exited.
    pub exit_code: Option<i32>,
    /// The signal number, when a signal ended it.
    pub signal: Option<i32>,
    /// Its structured error (error file) message and traceback.
    pub error_message: String,
    /// The traceback of that error.
    pub error_traceback: String,
    /// Its last stderr lines.
    pub stderr_tail: String,
}

/// Where [`Failure::describe`]'s account turns to the worker's stderr, which runs to the end
/// of the line it is part of: a view that must not show stderr cuts there.
pub const LAST_STDERR: &str = "; last stderr: ";

/// The head of every rank-failed text, the coordinator's ([`Failure::describe`]) and the agent
/// relay's (a local death it tells its node's waiters of before the coordinator's word):
/// "rank R (node N, host H) of job 'J' generation G failed: WHY".
pub fn rank_failed(
    rank: u32,
    node_rank: u32,
    host: &str,
    job: &str,
    generation: u64,
    why: &str,
) -> String {
    format!(
        "rank {rank} (node {node_rank}, host {host}) of job '{job}' generation {generation} failed: {why}"
    )
}

/// What a barrier wait is answered with while in-place recovery replaces a rank, the
/// coordinator's and the agent relay's alike: `death` (a [`rank_failed`] text), what is done
/// about it (`detail`, for example the restart and the membership epoch, or empty), and what
/// the worker must do next.
pub fn replacing_in_place(death: &str, detail: &str) -> String {
    format!(
        "{death}; replacing it in place{detail}: go to the step boundary (quorum) before entering barriers"
    )
}

impl Failure {
    /// The one-line account every waiter and the job's final state carry: rank, node, host,
    /// reason, then the error message and the end of stderr when the agent reported them.
    pub fn describe(&self, job: &JobId, generation: u64) -> String {
        let mut text = rank_failed(
            self.rank,
            self.node_rank,
            &self.host,
            job.as_str(),
            generation,
            &self.reason,
        );
        let d = &self.detail;
        if !d.error_message.is_empty() {
            let _ = write!(text, "; error: {}", d.error_message.trim_end());
        }
        if !d.stderr_tail.is_empty() {
            let n = d.stderr_tail.chars().count();
            let tail: String = d.stderr_tail.chars().skip(n.saturating_sub(2048)).collect();
            let _ = write!(text, "{LAST_STDERR}{}", tail.trim_end());
        }
        text
    }

    /// The failure as the job record and the ops view carry it.
    pub fn to_info(&self, generation: u64) -> pb::FailureInfo {
        pb::FailureInfo {
            rank: Some(self.rank),
            node_rank: Some(self.node_rank),
            host: self.host.clone(),
            reason: self.reason.clone(),
            generation,
            exit_code: self.detail.exit_code,
            signal: self.detail.signal,
            error_message: self.detail.error_message.clone(),
            error_traceback: self.detail.error_traceback.clone(),
            stderr_tail: self.detail.stderr_tail.clone(),
            node_id: self.node_id.clone(),
            hang: self.hang.is_some(),
        }
    }

    /// The error a waiter at one of the generation's barriers is answered with.
    pub fn to_error(&self, job: &JobId, generation: u64) -> pb::BarrierError {
        pb::BarrierError {
            kind: ErrKind::RankFailed as i32,
            message: self.describe(job, generation),
            rank: self.rank,
            node_rank: self.node_rank,
            host: self.host.clone(),
            missing: vec![],
        }
    }
}
