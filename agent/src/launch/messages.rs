//! What the agent prints when a generation ends: the root cause of a failed job (also
//! copied to the agent's own error file), the line of a restart, the line of a coordinator
//! that lost the job.

use super::supervisor::PreviousEnd;
use muster_proto::v1 as pb;
use std::fmt::Write as _;

/// How a generation that this node rejoins after ended (seen here at `at`), for the line that
/// says how long until the next one ran: a failure is a restart; anything else (a node joined,
/// or one was drained) is a membership change, named with the coordinator's reason.
pub(super) fn previous_end(v: &pb::GenerationEnded, at: std::time::Instant) -> PreviousEnd {
    let failed = v.cause == pb::generation_ended::Cause::Failed as i32;
    let what = if failed {
        format!("generation {} failed", v.generation)
    } else {
        v.message
            .lines()
            .next()
            .filter(|l| !l.is_empty())
            .map_or_else(
                || format!("generation {} ended", v.generation),
                str::to_owned,
            )
    };
    PreviousEnd { at, failed, what }
}

/// The one line an agent prints when the coordinator lost the state of a job whose
/// `generation` ran on this node (see `docs/contract.md`, "A coordinator that lost the job").
pub(super) fn state_lost_line(job: &str, coordinator: &str, generation: u64) -> String {
    format!(
        "muster-agent: job {job} failed: the coordinator at {coordinator} lost the job's state (it no longer knows the job, whose generation {generation} ran here: restarted without a persistent store?); the workers were stopped and are not started again; run the coordinator with --store etcd to keep job state across its restarts"
    )
}

/// Prints the root cause and, as torchrun does, copies it to the agent's own
/// `TORCHELASTIC_ERROR_FILE` when it has one (a scheduler that launched the agent reads it
/// there), unless that file already exists.
pub(super) fn report_root_cause(job: &str, f: &pb::FailureInfo) {
    eprint!("{}", root_cause(job, f));
    let Some(path) = std::env::var_os(muster_core::contract::env::TORCHELASTIC_ERROR_FILE) else {
        return;
    };
    let message = if f.error_message.is_empty() {
        format!(
            "rank {} (node {}, host {}) {}",
            f.rank(),
            f.node_rank(),
            f.host,
            f.reason
        )
    } else {
        f.error_message.clone()
    };
    let timestamp = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let body = serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": f.error_traceback,
                "timestamp": timestamp.to_string(),
            }
        }
    });
    let written = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(&path)
        .and_then(|mut file| {
            use std::io::Write as _;
            file.write_all(body.to_string().as_bytes())
        });
    if let Err(e) = written {
        tracing::debug!(%e, path = %std::path::Path::new(&path).display(), "root cause not written to the agent's error file");
    }
}

/// The lines printed when a job fails for good: the root cause (the generation's first
/// failure, wherever it happened), its error, and its last stderr lines.
fn root_cause(job: &str, f: &pb::FailureInfo) -> String {
    let mut text = if f.node_id.is_empty() {
        format!(
            "muster-agent: job {job} failed: rank {} (node {}, host {}) {}\n",
            f.rank(),
            f.node_rank(),
            f.host,
            f.reason
        )
    } else {
        format!("muster-agent: job {job} failed: {}\n", f.reason)
    };
    if !f.error_message.is_empty() {
        let _ = writeln!(text, "muster-agent: error: {}", f.error_message.trim_end());
    }
    if !f.error_traceback.is_empty() {
        let _ = writeln!(text, "muster-agent: traceback of rank {}:", f.rank());
        for line in f.error_traceback.lines() {
            let _ = writeln!(text, "    {line}");
        }
    }
    if f.node_id.is_empty() {
        if f.stderr_tail.is_empty() {
            let _ = writeln!(
                text,
                "muster-agent: rank {} wrote nothing to stderr",
                f.rank()
            );
        } else {
            let _ = writeln!(
                text,
                "muster-agent: last stderr lines of rank {}:",
                f.rank()
            );
            for line in f.stderr_tail.lines() {
                let _ = writeln!(text, "    {line}");
            }
        }
    }
    text
}

/// The lines printed when the job goes on in a new generation: what ended the last one and
/// the restart budget on one line, then the failed rank's error and last stderr lines, each
/// on a line of its own (indented), not folded into the first.
pub(super) fn rejoin_message(job: &str, v: &pb::GenerationEnded) -> String {
    let failure = v
        .failure
        .as_ref()
        .filter(|_| v.cause == pb::generation_ended::Cause::Failed as i32);
    let Some(f) = failure else {
        let mut lines = v.message.lines();
        let mut text = format!(
            "muster-agent: job {job}: {}; joining again\n",
            lines.next().unwrap_or_default()
        );
        for line in lines {
            let _ = writeln!(text, "    {line}");
        }
        return text;
    };
    let what = if f.node_id.is_empty() {
        format!(
            "rank {} (node {}, host {}) of generation {} {}",
            f.rank(),
            f.node_rank(),
            f.host,
            f.generation,
            f.reason
        )
    } else {
        f.reason.clone()
    };
    let mut text = format!(
        "muster-agent: job {job}: {what}; restarting (restart {} of {}); joining again\n",
        v.restart_count + 1,
        v.max_restarts
    );
    let mut error = f.error_message.trim_end().lines();
    if let Some(first) = error.next() {
        let _ = writeln!(text, "muster-agent: error: {first}");
        for line in error {
            let _ = writeln!(text, "    {line}");
        }
    }
    if f.node_id.is_empty() && !f.stderr_tail.is_empty() {
        let _ = writeln!(
            text,
            "muster-agent: last stderr lines of rank {}:",
            f.rank()
        );
        for line in f.stderr_tail.lines() {
            let _ = writeln!(text, "    {line}");
        }
    }
    text
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn summaries() {
        let info = |tail: &str, err: &str| pb::FailureInfo {
            rank: Some(5),
            node_rank: Some(1),
            host: "h1".into(),
            reason: "exited with status 3".into(),
            stderr_tail: tail.into(),
            error_message: err.into(),
            ..Default::default()
        };
        assert_eq!(
            root_cause("j", &info("Traceback\nboom", "ValueError: boom")),
            "muster-agent: job j failed: rank 5 (node 1, host h1) exited with status 3\n\
             muster-agent: error: ValueError: boom\n\
             muster-agent: last stderr lines of rank 5:\n    Traceback\n    boom\n"
        );
        assert_eq!(
            root_cause("j", &info("", "")),
            "muster-agent: job j failed: rank 5 (node 1, host h1) exited with status 3\n\
             muster-agent: rank 5 wrote nothing to stderr\n"
        );
        let lost = pb::FailureInfo {
            node_id: "n1".into(),
            reason: "node 1 (host h1, agent n1) was lost: its agent disconnected".into(),
            ..Default::default()
        };
        assert_eq!(
            root_cause("j", &lost),
            "muster-agent: job j failed: node 1 (host h1, agent n1) was lost: its agent disconnected\n"
        );
    }

    #[test]
    fn a_previous_end_says_what_ended() {
        let at = std::time::Instant::now();
        let ended = |cause: pb::generation_ended::Cause, message: &str| pb::GenerationEnded {
            generation: 4,
            cause: cause as i32,
            rejoin: true,
            message: message.into(),
            ..Default::default()
        };
        use pb::generation_ended::Cause;
        let failed = previous_end(&ended(Cause::Failed, "rank 1 exited"), at);
        assert!(failed.failed);
        assert_eq!(failed.what, "generation 4 failed");
        let drained = previous_end(
            &ended(
                Cause::Superseded,
                "generation 4 of job 'j' was superseded by generation 5: node 'n1' was drained\nmore",
            ),
            at,
        );
        assert!(!drained.failed);
        assert_eq!(
            drained.what,
            "generation 4 of job 'j' was superseded by generation 5: node 'n1' was drained"
        );
        assert_eq!(
            previous_end(&ended(Cause::Superseded, ""), at).what,
            "generation 4 ended"
        );
    }

    #[test]
    fn rejoin_messages_keep_lines_apart() {
        let ended = |failure: Option<pb::FailureInfo>, cause: pb::generation_ended::Cause| {
            pb::GenerationEnded {
                generation: 2,
                cause: cause as i32,
                rejoin: true,
                failure,
                message: "node 1 joined\nsecond line".into(),
                restart_count: 1,
                max_restarts: 3,
            }
        };
        let failed = pb::FailureInfo {
            rank: Some(3),
            node_rank: Some(1),
            host: "h1".into(),
            reason: "exited with status 3".into(),
            generation: 2,
            stderr_tail: "Traceback (most recent call last):\n  File \"t.py\"\nValueError: boom"
                .into(),
            error_message: "ValueError: boom\nmore".into(),
            ..Default::default()
        };
        let lost = pb::FailureInfo {
            reason: "node 1 (host h1, agent n1) was lost".into(),
            node_id: "n1".into(),
            stderr_tail: "not ours".into(),
            ..Default::default()
        };
        use pb::generation_ended::Cause;
        for (v, expected) in [
            (
                ended(Some(failed.clone()), Cause::Failed),
                "muster-agent: job j: rank 3 (node 1, host h1) of generation 2 exited with status 3; restarting (restart 2 of 3); joining again\n\
                 muster-agent: error: ValueError: boom\n\
                 \x20   more\n\
                 muster-agent: last stderr lines of rank 3:\n\
                 \x20   Traceback (most recent call last):\n\
                 \x20     File \"t.py\"\n\
                 \x20   ValueError: boom\n",
            ),
            (
                ended(Some(lost), Cause::Failed),
                "muster-agent: job j: node 1 (host h1, agent n1) was lost; restarting (restart 2 of 3); joining again\n",
            ),
            (
                ended(Some(failed), Cause::Superseded),
                "muster-agent: job j: node 1 joined; joining again\n    second line\n",
            ),
        ] {
            assert_eq!(rejoin_message("j", &v), expected);
        }
    }
}
