//! `muster-agent describe JOB`: the hang view in the terminal. One `Ops.DescribeJob` call,
//! printed for a person in a hurry: the job's state first, then each pending barrier with who
//! arrived, who is missing and what each missing rank is doing instead (activity, pid, node,
//! host, for how long), then the nodes and ranks as compact tables, the in-place recoveries
//! (who died, its replacement, who healed it, how long to the quorum) and the last failure.
//! `--watch [SECONDS]` redraws it in place, as `watch(1)` does, until the job is over or
//! Ctrl-C. The rendering ([`render`]) is a pure function of the reply, so that it is tested
//! without a coordinator.

use crate::cli::daemon_args::DescribeArgs;
use crate::operator::{connect, describe as describe_job, dump_stacks};
use muster_core::stacks::ranks_text;
use muster_proto::v1 as pb;
use std::fmt::Write as _;

/// What `watch(1)` sends before each frame: cursor home, clear the screen.
pub const CLEAR: &str = "\x1b[H\x1b[2J";

/// Runs `describe`; returns the exit status (0 shown; with `--watch`, 0 when the job finished
/// or on Ctrl-C, 1 when it ended failed or cancelled), or a one-line error.
pub async fn run(args: DescribeArgs) -> Result<u8, String> {
    let coordinators = connect(&args.coordinator, &args.security).await?;
    let fetch = || async {
        describe_job(&coordinators, &args.job_id, None)
            .await
            .map_err(|s| match s.code() {
                tonic::Code::NotFound => format!(
                    "job '{}' is not known to the coordinator at {}: {}",
                    args.job_id,
                    coordinators.leader_addr(),
                    s.message()
                ),
                _ => format!(
                    "cannot describe job '{}': {}",
                    args.job_id,
                    crate::security::explain(&s)
                ),
            })
    };
    let stacks = || async {
        if !args.stacks {
            return Ok(None);
        }
        let request = pb::DumpStacksRequest {
            job_id: args.job_id.clone(),
            full: args.full,
            native: args.native,
        };
        dump_stacks(&coordinators, request)
            .await
            .map(Some)
            .map_err(|s| {
                format!(
                    "cannot read the stacks of job '{}': {}",
                    args.job_id,
                    crate::security::explain(&s)
                )
            })
    };
    let show = |d: &pb::DescribeJobResponse,
                s: Option<&pb::DumpStacksResponse>|
     -> Result<String, String> {
        Ok(if args.json {
            let mut out = format!("{}\n", json(d)?);
            if let Some(s) = s {
                out.push_str(&muster_proto::json::grpcurl(
                    "muster.v1.DumpStacksResponse",
                    s,
                )?);
                out.push('\n');
            }
            out
        } else {
            let mut out = render(d);
            if let Some(s) = s {
                out.push_str(&render_stacks(s));
            }
            out
        })
    };
    let Some(every) = args.watch else {
        let d = fetch().await?;
        let s = stacks().await?;
        print!("{}", show(&d, s.as_ref())?);
        return Ok(0);
    };
    // Registered now, before the first frame: a Ctrl-C right after it is not lost.
    let mut ctrl_c = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())
        .map_err(|e| format!("cannot watch for Ctrl-C: {e}"))?;
    loop {
        // A call may wait out a coordinator failover: Ctrl-C must not wait for it.
        let (d, s) = tokio::select! {
            d = async { Ok::<_, String>((fetch().await?, stacks().await?)) } => d?,
            _ = ctrl_c.recv() => return Ok(0),
        };
        if args.json {
            print!("{}", show(&d, s.as_ref())?);
        } else {
            print!(
                "{CLEAR}Every {:.1}s: muster-agent describe {}    {}\n\n{}",
                every.as_secs_f64(),
                args.job_id,
                clock(),
                show(&d, s.as_ref())?
            );
        }
        // Each frame whole, even into a pipe.
        let _ = std::io::Write::flush(&mut std::io::stdout());
        let summary = d.summary.unwrap_or_default();
        if summary.state == pb::RoundState::Finished as i32 {
            return Ok(0);
        }
        if summary.done {
            return Ok(1);
        }
        tokio::select! {
            () = tokio::time::sleep(every) => {}
            _ = ctrl_c.recv() => return Ok(0),
        }
    }
}

/// `d` in proto3's JSON mapping, on one line, read through `muster.v1`'s descriptor set (the
/// one gRPC reflection serves), so that it is what grpcurl would print for the same reply.
pub fn json(d: &pb::DescribeJobResponse) -> Result<String, String> {
    muster_proto::json::grpcurl("muster.v1.DescribeJobResponse", d)
}

/// The grouped stacks of one DumpStacks reply, after the job's view.
pub fn render_stacks(s: &pb::DumpStacksResponse) -> String {
    let mut out = format!("\nstacks (generation {}):\n", s.generation);
    for line in s.report.lines() {
        let _ = writeln!(out, "  {line}");
    }
    out
}

/// The hangs the coordinator detected, newest first: the headline and the grouped stacks.
fn render_hangs(d: &pb::DescribeJobResponse, out: &mut String) {
    for (i, h) in d.hangs.iter().enumerate() {
        out.push('\n');
        let mut lines = h.report.lines();
        let headline = lines.next().unwrap_or_default();
        let _ = writeln!(
            out,
            "{} {headline}",
            if i == 0 { "HANG:" } else { "earlier hang:" }
        );
        if i == 0 {
            for line in lines {
                let _ = writeln!(out, "  {line}");
            }
        }
    }
}

/// The time of day (UTC) for the watch header, as `watch(1)` shows one.
fn clock() -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let day = secs % 86_400;
    format!(
        "{:02}:{:02}:{:02} UTC",
        day / 3600,
        (day / 60) % 60,
        day % 60
    )
}

/// An optional rank for people: the number, or `?` when the coordinator did not say (a joiner
/// that asked for no node rank).
pub fn or_none(rank: Option<u32>) -> String {
    rank.map_or_else(|| "?".to_owned(), |r| r.to_string())
}

/// A wire enum's name without its prefix, in lower case (`RANK_STATE_WAITING` -> `waiting`).
fn enum_word(name: &str, prefix: &str) -> String {
    name.trim_start_matches(prefix).to_lowercase()
}

/// Milliseconds as a person reads them: `850 ms`, `12.3 s`, `4 min 05 s`, `2 h 03 min`.
pub fn ago(ms: u64) -> String {
    match ms {
        0..1_000 => format!("{ms} ms"),
        1_000..60_000 => format!("{:.1} s", ms as f64 / 1000.0),
        60_000..3_600_000 => format!("{} min {:02} s", ms / 60_000, (ms / 1000) % 60),
        _ => format!("{} h {:02} min", ms / 3_600_000, (ms / 60_000) % 60),
    }
}

/// Rows as columns padded to their widest cell, indented by two spaces; the last column is
/// not padded (it holds free text).
fn table(header: &[&str], rows: &[Vec<String>]) -> String {
    let mut widths: Vec<usize> = header.iter().map(|h| h.len()).collect();
    for row in rows {
        for (w, cell) in widths.iter_mut().zip(row) {
            *w = (*w).max(cell.chars().count());
        }
    }
    let line = |cells: &mut dyn Iterator<Item = &str>| {
        let mut s = String::new();
        for (i, cell) in cells.enumerate() {
            if i + 1 == widths.len() {
                let _ = write!(s, "  {cell}");
            } else {
                let _ = write!(s, "  {cell:<w$}", w = widths[i]);
            }
        }
        s.trim_end().to_owned() + "\n"
    };
    let mut out = line(&mut header.iter().copied());
    for row in rows {
        out.push_str(&line(&mut row.iter().map(String::as_str)));
    }
    out
}

/// At most this many rank rows; beyond it only the ranks that are not simply running are
/// listed (a thousand healthy rows would hide the one that matters).
const RANK_ROWS: usize = 64;

/// The whole view of one DescribeJob reply, ending with a newline.
pub fn render(d: &pb::DescribeJobResponse) -> String {
    let s = d.summary.clone().unwrap_or_default();
    let mut out = String::new();
    out.push_str(&crate::operator::job_headline(&s, "ranks"));
    if s.state == pb::RoundState::Open as i32 {
        let _ = write!(out, ", {} nodes waiting to start", s.nodes_waiting);
    }
    let in_place = d
        .config
        .as_ref()
        .is_some_and(|c| c.recovery == pb::RecoveryMode::InPlace as i32);
    if in_place {
        out.push_str(", in-place recovery");
    }
    if d.max_spares > 0 {
        let _ = write!(
            out,
            ", spares {}/{} standing by",
            d.spares.len(),
            d.max_spares
        );
    }
    if d.epoch > 0 {
        let _ = write!(out, ", membership epoch {}", d.epoch);
    }
    out.push('\n');
    if let Some(t) = &d.training {
        out.push_str(&training_line(t));
    }
    if !d.straggler.is_empty() {
        let _ = writeln!(out, "{}", d.straggler);
    }
    for s in &d.spares {
        let _ = writeln!(
            out,
            "spare: {} (host {}, {} slots) standing by for {}{}",
            s.node_id,
            s.host,
            s.local_world_size,
            ago(s.standing_ms),
            if s.connected {
                ""
            } else {
                " (its agent has not joined this coordinator again since the failover)"
            }
        );
    }

    let rank_info = |r: u32| d.ranks.iter().find(|i| i.rank() == r);
    let node_info = |n: u32| d.nodes.iter().find(|i| i.node_rank == Some(n));
    if !d.barriers.is_empty() {
        out.push('\n');
    }
    for b in &d.barriers {
        let node_scope = b.scope == pb::BarrierScope::Node as i32;
        let names: Vec<&str> = b.names.iter().map(|n| n.name.as_str()).collect();
        let arrived: Vec<u32> = b.names.iter().flat_map(|n| n.ranks.clone()).collect();
        let total = arrived.len() + b.missing.len();
        let what = match (node_scope, b.node_rank) {
            (true, n) => format!("node {} barrier", or_none(n)),
            // A global barrier as one node's relay holds it: that node's part only.
            (false, Some(n)) => format!("global barrier (node {n}'s part)"),
            (false, None) => "global barrier".to_owned(),
        };
        let _ = writeln!(
            out,
            "WAITING {what} #{} '{}' for {}: {} of {total} arrived ({}), {} missing",
            b.seq,
            names.join("' / '"),
            ago(b.waiting_ms),
            arrived.len(),
            if arrived.is_empty() {
                "none".to_owned()
            } else {
                format!("ranks {}", ranks_text(&arrived))
            },
            b.missing.len()
        );
        if b.names.len() > 1 {
            let _ = write!(out, "  DIVERGENCE: ranks entered under different names:");
            for n in &b.names {
                let _ = write!(out, " '{}' by ranks {};", n.name, ranks_text(&n.ranks));
            }
            out.pop();
            out.push('\n');
        }
        let detail: Vec<&pb::MissingRank> = b.missing_detail.iter().collect();
        for m in &b.missing {
            let r = m.rank();
            let found = detail.iter().find(|x| x.rank == m.rank);
            let info = rank_info(r);
            let node = m.node_rank.and_then(node_info);
            let pid = info
                .map(|i| i.pid)
                .filter(|p| *p > 0)
                .map_or_else(|| "no pid yet".to_owned(), |p| format!("pid {p}"));
            let mut place = format!("node {}", or_none(m.node_rank));
            if let Some(n) = node {
                let _ = write!(place, " ({})", n.node_id);
            }
            let _ = write!(place, ", host {}", m.host);
            let activity = found
                .map(|x| x.activity.clone())
                .or_else(|| info.map(|i| i.activity.clone()))
                .filter(|a| !a.is_empty())
                .unwrap_or_else(|| "unknown".to_owned());
            let _ = writeln!(out, "  missing rank {r} on {place}, {pid}: {activity}");
        }
    }

    if !d.nodes.is_empty() {
        out.push('\n');
        let rows: Vec<Vec<String>> = d
            .nodes
            .iter()
            .map(|n| {
                let ranks = if n.local_world_size == 0 {
                    "-".to_owned()
                } else if s.state == pb::RoundState::Open as i32 {
                    format!("{} to come", n.local_world_size)
                } else {
                    let last = n.rank_offset + n.local_world_size - 1;
                    if last == n.rank_offset {
                        last.to_string()
                    } else {
                        format!("{}-{last}", n.rank_offset)
                    }
                };
                let mut host = n.host.clone();
                if !n.hostname.is_empty() && n.hostname != n.host {
                    host = format!("{host} ({})", n.hostname);
                }
                let mut labels: Vec<String> =
                    n.labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
                labels.sort();
                vec![
                    or_none(n.node_rank),
                    enum_word(
                        pb::NodeState::try_from(n.state)
                            .unwrap_or_default()
                            .as_str_name(),
                        "NODE_STATE_",
                    ),
                    ranks,
                    n.last_seen_ms_ago.map_or_else(|| "-".to_owned(), ago),
                    host,
                    format!("{} {}", n.node_id, labels.join(","))
                        .trim_end()
                        .to_owned(),
                ]
            })
            .collect();
        out.push_str(&table(
            &["NODE", "STATE", "RANKS", "SEEN", "HOST", "ID"],
            &rows,
        ));
    }

    if !d.ranks.is_empty() {
        out.push('\n');
        let plain = |r: &&pb::RankInfo| r.state == pb::RankState::Running as i32;
        let shown: Vec<&pb::RankInfo> = if d.ranks.len() <= RANK_ROWS {
            d.ranks.iter().collect()
        } else {
            d.ranks
                .iter()
                .filter(|r| !plain(r))
                .take(RANK_ROWS)
                .collect()
        };
        let rows: Vec<Vec<String>> = shown
            .iter()
            .map(|r| {
                vec![
                    or_none(r.rank),
                    or_none(r.node_rank),
                    or_none(r.local_rank),
                    if r.pid > 0 {
                        r.pid.to_string()
                    } else {
                        "-".to_owned()
                    },
                    enum_word(
                        pb::RankState::try_from(r.state)
                            .unwrap_or_default()
                            .as_str_name(),
                        "RANK_STATE_",
                    ),
                    ago(r.last_seen_ms_ago),
                    r.activity.clone(),
                ]
            })
            .collect();
        // With stack samples, each rank's share of them spent waiting, before the activity.
        let sampled = shown.iter().any(|r| r.sampled.is_some());
        let rows: Vec<Vec<String>> = if sampled {
            rows.into_iter()
                .zip(&shown)
                .map(|(mut row, r)| {
                    let share = r.sampled.as_ref().map_or_else(
                        || "-".to_owned(),
                        |s| format!("{:.0}%", s.waiting_share * 100.0),
                    );
                    row.insert(row.len() - 1, share);
                    row
                })
                .collect()
        } else {
            rows
        };
        let header = if sampled {
            "RANK NODE LOCAL PID STATE SEEN WAITING ACTIVITY"
        } else {
            "RANK NODE LOCAL PID STATE SEEN ACTIVITY"
        };
        out.push_str(&table(
            // The headers as words of one literal: RANK quoted alone reads as the worker variable.
            &header.split(' ').collect::<Vec<_>>(),
            &rows,
        ));
        if shown.len() < d.ranks.len() {
            let _ = writeln!(
                out,
                "  ({} more ranks running, not shown)",
                d.ranks.len() - shown.len()
            );
        }
    }

    if !d.recoveries.is_empty() {
        out.push('\n');
        for r in &d.recoveries {
            out.push_str(&recovery_line(r));
        }
    }
    if !d.recent_restarts.is_empty() {
        out.push('\n');
        for r in &d.recent_restarts {
            out.push_str(&restart_line(r));
        }
    }

    if let Some(f) = &d.failure {
        out.push('\n');
        let mut line = format!("FAILED generation {}: ", f.generation);
        if f.node_id.is_empty() {
            let _ = write!(
                line,
                "rank {} (node {}, host {}) {}",
                or_none(f.rank),
                or_none(f.node_rank),
                f.host,
                f.reason
            );
        } else {
            line.push_str(&f.reason);
        }
        // The agent's reason usually says it already ("exited with status 3"); the coordinator's
        // own reasons (a lost session) do not.
        if let Some(c) = f
            .exit_code
            .filter(|c| !f.reason.contains(&format!("status {c}")))
        {
            let _ = write!(line, "; exit code {c}");
        }
        if let Some(sig) = f
            .signal
            .filter(|s| !f.reason.contains(&format!("signal {s}")))
        {
            let _ = write!(line, "; signal {sig}");
        }
        let _ = writeln!(out, "{line}");
        if !f.error_message.is_empty() {
            let first = f.error_message.lines().next().unwrap_or_default();
            let _ = writeln!(out, "  error: {first}");
        }
        if let Some(last) = f.stderr_tail.lines().rev().find(|l| !l.trim().is_empty()) {
            let _ = writeln!(out, "  last stderr line: {}", last.trim_end());
        }
    }
    render_hangs(d, &mut out);
    // What made the restarts: the earlier generations' failures (the current one's is above,
    // and those in the restarts' timeline are there).
    let current = d.failure.as_ref().map(|f| f.generation);
    let earlier: Vec<_> = d
        .recent_failures
        .iter()
        .filter(|f| Some(f.generation) != current)
        .filter(|f| {
            !d.recent_restarts
                .iter()
                .any(|r| r.failed_generation == f.generation)
        })
        .collect();
    if !earlier.is_empty() {
        out.push('\n');
        for f in earlier {
            let _ = writeln!(
                out,
                "earlier: generation {} failed: rank {} (node {}, host {}) {}",
                f.generation,
                or_none(f.rank),
                or_none(f.node_rank),
                f.host,
                f.reason
            );
        }
    }
    let mut drained: Vec<_> = d.drained.iter().collect();
    drained.sort();
    for (node, why) in drained {
        let _ = writeln!(out, "drained: node {node}: {why}");
    }
    let mut replaced: Vec<_> = d.replaced.iter().collect();
    replaced.sort();
    for (node, why) in replaced {
        let _ = writeln!(out, "replaced: node {node}: {why}");
    }
    out
}

/// The effective training time, ending with a newline: `training: ETTR 93.1% of 2 min 03 s
/// since rank 0's first step marker, at step S; lost L (detecting D, respawning or starting on
/// a spare R, healing H, restarts X, steps begun again or redone Y)`.
fn training_line(t: &pb::TrainingTime) -> String {
    let mut line = format!(
        "training: ETTR {:.1}% of {} since rank 0's first step marker, at step {}",
        t.ettr * 100.0,
        ago(t.wall_ms),
        t.last_step
    );
    if t.lost_ms > 0 {
        let seen = t.recoveries_ms + t.restarts_ms;
        let _ = write!(
            line,
            "; lost {} (detecting {}, respawning or starting on a spare {}, healing {}, restarts {}, steps begun again or redone {})",
            ago(t.lost_ms),
            ago(t.detection_ms),
            ago(t.respawn_ms),
            ago(t.heal_ms),
            ago(t.restarts_ms),
            ago(t.lost_ms.saturating_sub(seen))
        );
    }
    line.push('\n');
    line
}

/// One restart's timeline, ending with a newline: `RESTARTED generation 1 -> 2: why; seen
/// after D, nodes placed after F, ranks registered after R, training again after T, first full
/// step after S` (the phases so far; each time from the failure).
fn restart_line(r: &pb::RestartInfo) -> String {
    let mut line = if r.generation > 0 {
        format!(
            "RESTARTED generation {} -> {}: {}",
            r.failed_generation, r.generation, r.reason
        )
    } else {
        format!(
            "RESTARTING generation {}: {}",
            r.failed_generation, r.reason
        )
    };
    if r.detect_ms > 0 {
        let _ = write!(
            line,
            "; seen {} after its agent was last heard",
            ago(r.detect_ms)
        );
    }
    for (ms, what) in [
        (r.formed_ms, "nodes placed"),
        (r.registered_ms, "ranks registered"),
        (r.resumed_ms, "training again"),
        (r.full_step_ms, "first full step"),
    ] {
        if ms > 0 {
            let _ = write!(line, ", {what} after {}", ago(ms));
        }
    }
    if r.generation == 0 {
        line.push_str(", waiting for the nodes to rejoin");
    }
    line.push('\n');
    line
}

/// One in-place recovery, ending with a newline: `RECOVERED epoch E: rank R (node N, host H)
/// REASON; replaced by pid P after T1, healed from rank S, quorum Q in T2` (or where it
/// stands while it is open).
fn recovery_line(r: &pb::RecoveryInfo) -> String {
    let closed = r.quorum_epoch > 0;
    let mut line = format!(
        "{} epoch {}: rank {} (node {}, host {}) {}",
        if closed { "RECOVERED" } else { "RECOVERING" },
        r.epoch,
        or_none(r.rank),
        or_none(r.node_rank),
        r.host,
        r.reason
    );
    let on_spare = if r.spare_node_id.is_empty() {
        String::new()
    } else {
        format!(" on spare {} (host {})", r.spare_node_id, r.spare_host)
    };
    if r.detect_ms > 0 {
        let _ = write!(
            line,
            "; seen {} after its agent was last heard",
            ago(r.detect_ms)
        );
    }
    if r.replacement_pid > 0 {
        let _ = write!(
            line,
            "; replaced by pid {}{on_spare} after {}",
            r.replacement_pid,
            ago(r.respawn_ms)
        );
    } else {
        let _ = write!(line, "; waiting for its replacement{on_spare}");
    }
    if closed {
        if let Some(source) = r.healed_from {
            let _ = write!(line, ", healed from rank {source}");
        }
        let _ = write!(line, ", quorum {} in {}", r.quorum_epoch, ago(r.quorum_ms));
        if r.healed_ms > 0 {
            let _ = write!(line, ", state received after {}", ago(r.healed_ms));
        }
        if r.resumed_ms > 0 {
            let _ = write!(line, ", training again after {}", ago(r.resumed_ms));
        }
        if r.full_step_ms > 0 {
            let _ = write!(line, ", first full step after {}", ago(r.full_step_ms));
        }
    } else if r.replacement_pid > 0 {
        line.push_str(", waiting for the quorum");
    }
    line.push('\n');
    line
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// The effective training time under the headline, its lost time split.
    #[test]
    fn the_training_line_says_what_share_counted_and_where_the_rest_went() {
        let mut d = stuck();
        d.training = Some(pb::TrainingTime {
            ettr: 0.9,
            wall_ms: 123_000,
            counted_ms: 110_700,
            lost_ms: 12_300,
            recoveries_ms: 1_400,
            last_step: 240,
            highest_step: 240,
            detection_ms: 1_000,
            respawn_ms: 150,
            heal_ms: 250,
            restarts_ms: 9_000,
        });
        let text = render(&d);
        assert_eq!(
            text.lines().nth(1),
            Some(
                "training: ETTR 90.0% of 2 min 03 s since rank 0's first step marker, at step 240; \
                 lost 12.3 s (detecting 1.0 s, respawning or starting on a spare 150 ms, healing 250 ms, \
                 restarts 9.0 s, steps begun again or redone 1.9 s)"
            ),
            "{text}"
        );
        // Nothing lost: no split.
        d.training = Some(pb::TrainingTime {
            ettr: 1.0,
            wall_ms: 500,
            counted_ms: 500,
            ..Default::default()
        });
        assert!(
            render(&d).contains(
                "\ntraining: ETTR 100.0% of 500 ms since rank 0's first step marker, at step 0\n"
            ),
            "{}",
            render(&d)
        );
    }

    /// In place: the epoch in the headline, the replaced rank's state in the table, and one
    /// line per recovery, closed or still open.
    #[test]
    fn recoveries_are_listed_with_who_replaced_and_healed_whom() {
        let mut d = stuck();
        d.config = Some(pb::RendezvousConfig {
            recovery: pb::RecoveryMode::InPlace as i32,
            ..Default::default()
        });
        d.epoch = 3;
        d.ranks[1].state = pb::RankState::Replacing as i32;
        d.ranks[1].pid = 0;
        d.recoveries = vec![
            pb::RecoveryInfo {
                epoch: 1,
                rank: Some(2),
                node_rank: Some(1),
                host: "10.0.0.2".into(),
                reason: "exited with status 3".into(),
                replacement_pid: 4242,
                quorum_epoch: 2,
                healed_from: Some(0),
                quorum_ms: 1_250,
                respawn_ms: 480,
                healed_ms: 1_300,
                resumed_ms: 1_400,
                full_step_ms: 1_480,
                ..Default::default()
            },
            pb::RecoveryInfo {
                epoch: 3,
                rank: Some(1),
                node_rank: Some(0),
                host: "10.0.0.1".into(),
                reason: "killed by signal 9 (SIGKILL)".into(),
                ..Default::default()
            },
            pb::RecoveryInfo {
                epoch: 4,
                rank: Some(0),
                node_rank: Some(0),
                host: "10.0.0.1".into(),
                reason: "stopped answering".into(),
                replacement_pid: 77,
                ..Default::default()
            },
        ];
        let text = render(&d);
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "job train: running, generation 2, 2 nodes, 4 ranks, restarts 1/3, in-place recovery, membership epoch 3"
        );
        assert!(
            lines[11].starts_with("  1     0     1      -    replacing  150 ms"),
            "{text}"
        );
        assert!(
            text.contains(
                "\nRECOVERED epoch 1: rank 2 (node 1, host 10.0.0.2) exited with status 3; replaced by pid 4242 after 480 ms, healed from rank 0, quorum 2 in 1.2 s, state received after 1.3 s, training again after 1.4 s, first full step after 1.5 s\n\
                 RECOVERING epoch 3: rank 1 (node 0, host 10.0.0.1) killed by signal 9 (SIGKILL); waiting for its replacement\n\
                 RECOVERING epoch 4: rank 0 (node 0, host 10.0.0.1) stopped answering; replaced by pid 77 after 0 ms, waiting for the quorum\n\n\
                 FAILED generation 1"
            ),
            "{text}"
        );
    }

    /// Restarts: one line each, its phases so far.
    #[test]
    fn restarts_are_listed_with_their_phases() {
        let mut d = stuck();
        d.recent_restarts = vec![
            pb::RestartInfo {
                failed_generation: 2,
                reason: "node 1 (host 10.0.0.2, agent a1) was lost: no heartbeat".into(),
                detect_ms: 3_100,
                ..Default::default()
            },
            pb::RestartInfo {
                failed_generation: 1,
                generation: 2,
                reason: "rank 3 (node 1, host 10.0.0.2) exited with status 1".into(),
                formed_ms: 900,
                registered_ms: 1_300,
                resumed_ms: 2_500,
                full_step_ms: 2_600,
                ..Default::default()
            },
        ];
        let text = render(&d);
        assert!(
            text.contains(
                "\nRESTARTING generation 2: node 1 (host 10.0.0.2, agent a1) was lost: no heartbeat; seen 3.1 s after its agent was last heard, waiting for the nodes to rejoin\n\
                 RESTARTED generation 1 -> 2: rank 3 (node 1, host 10.0.0.2) exited with status 1, nodes placed after 900 ms, ranks registered after 1.3 s, training again after 2.5 s, first full step after 2.6 s\n"
            ),
            "{text}"
        );
    }

    /// A job of two nodes, two ranks each, rank 3 missing from global barrier #2 'step'.
    fn stuck() -> pb::DescribeJobResponse {
        let rank = |r: u32, state: pb::RankState, pid: u32, activity: &str| pb::RankInfo {
            rank: Some(r),
            node_rank: Some(r / 2),
            local_rank: Some(r % 2),
            host: format!("10.0.0.{}", r / 2 + 1),
            pid,
            state: state as i32,
            last_seen_ms_ago: 150,
            activity: activity.into(),
            ..Default::default()
        };
        let waiting = "waiting at global barrier #2 'step' for 12300 ms";
        let stuck = "running (last barrier: global #1 'init'; heard 150 ms ago)";
        pb::DescribeJobResponse {
            summary: Some(pb::JobSummary {
                job_id: "train".into(),
                generation: 2,
                state: pb::RoundState::Running as i32,
                num_nodes: 2,
                world_size: 4,
                restart_count: 1,
                max_restarts: 3,
                ..Default::default()
            }),
            nodes: (0..2)
                .map(|n| pb::NodeInfo {
                    node_id: format!("agent-{n}"),
                    node_rank: Some(n),
                    host: format!("10.0.0.{}", n + 1),
                    local_world_size: 2,
                    rank_offset: n * 2,
                    state: pb::NodeState::Running as i32,
                    last_seen_ms_ago: Some(40),
                    ..Default::default()
                })
                .collect(),
            ranks: vec![
                rank(0, pb::RankState::Waiting, 100, waiting),
                rank(1, pb::RankState::Waiting, 101, waiting),
                rank(2, pb::RankState::Waiting, 200, waiting),
                rank(3, pb::RankState::Running, 201, stuck),
            ],
            barriers: vec![pb::BarrierInfo {
                scope: pb::BarrierScope::Global as i32,
                node_rank: None,
                seq: 2,
                names: vec![pb::BarrierName {
                    name: "step".into(),
                    ranks: vec![0, 1, 2],
                }],
                missing: vec![pb::RankLocation {
                    rank: Some(3),
                    node_rank: Some(1),
                    host: "10.0.0.2".into(),
                }],
                waiting_ms: 12_300,
                missing_detail: vec![pb::MissingRank {
                    rank: Some(3),
                    node_rank: Some(1),
                    host: "10.0.0.2".into(),
                    activity: stuck.into(),
                    ..Default::default()
                }],
            }],
            failure: Some(pb::FailureInfo {
                rank: Some(0),
                node_rank: Some(0),
                host: "10.0.0.1".into(),
                reason: "exited with status 3".into(),
                generation: 1,
                exit_code: Some(3),
                error_message: "ValueError: boom".into(),
                ..Default::default()
            }),
            restart_count: 1,
            ..Default::default()
        }
    }

    /// The view leads with the state, then the barrier and its missing rank with its node,
    /// host, pid and activity; then the tables; rank 0 and node 0 are printed as numbers.
    #[test]
    fn a_stuck_rank_is_named_with_what_it_does() {
        let text = render(&stuck());
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(
            lines[0],
            "job train: running, generation 2, 2 nodes, 4 ranks, restarts 1/3"
        );
        assert_eq!(
            lines[2],
            "WAITING global barrier #2 'step' for 12.3 s: 3 of 4 arrived (ranks 0-2), 1 missing"
        );
        assert_eq!(
            lines[3],
            "  missing rank 3 on node 1 (agent-1), host 10.0.0.2, pid 201: running (last barrier: global #1 'init'; heard 150 ms ago)"
        );
        assert_eq!(lines[5], "  NODE  STATE    RANKS  SEEN   HOST      ID");
        assert_eq!(lines[6], "  0     running  0-1    40 ms  10.0.0.1  agent-0");
        assert_eq!(
            lines[9],
            "  RANK  NODE  LOCAL  PID  STATE    SEEN    ACTIVITY"
        );
        assert!(
            lines[10].starts_with("  0     0     0      100  waiting  150 ms  waiting at"),
            "{text}"
        );
        assert!(
            text.contains(
                "FAILED generation 1: rank 0 (node 0, host 10.0.0.1) exited with status 3\n  error: ValueError: boom\n"
            ),
            "{text}"
        );
    }

    /// The earlier generations' failures (what made the restarts) follow the current one's.
    #[test]
    fn earlier_failures_are_listed_after_the_current_one() {
        let mut d = stuck();
        let current = d.failure.clone().unwrap();
        let earlier = pb::FailureInfo {
            generation: 0,
            rank: Some(2),
            node_rank: Some(1),
            host: "10.0.0.2".into(),
            reason: "killed by signal 9 (SIGKILL)".into(),
            ..Default::default()
        };
        d.recent_failures = vec![current, earlier];
        let text = render(&d);
        assert!(
            text.ends_with(
                "earlier: generation 0 failed: rank 2 (node 1, host 10.0.0.2) killed by signal 9 (SIGKILL)\n"
            ),
            "{text}"
        );
        assert_eq!(text.matches("generation 1").count(), 1, "{text}");
    }

    /// Ranks that diverged on a barrier's name are called out; a rank without a session shows
    /// no pid; a joiner without a node rank shows `?`.
    #[test]
    fn divergence_and_unknowns_are_spelled_out() {
        let mut d = stuck();
        let b = &mut d.barriers[0];
        b.names = vec![
            pb::BarrierName {
                name: "step".into(),
                ranks: vec![0, 1],
            },
            pb::BarrierName {
                name: "eval".into(),
                ranks: vec![2],
            },
        ];
        d.ranks[3].pid = 0;
        let text = render(&d);
        assert!(text.contains("#2 'step' / 'eval' for"), "{text}");
        assert!(
            text.contains(
                "  DIVERGENCE: ranks entered under different names: 'step' by ranks 0-1; 'eval' by ranks 2\n"
            ),
            "{text}"
        );
        assert!(
            text.contains("host 10.0.0.2, no pid yet: running"),
            "{text}"
        );
        assert_eq!(or_none(None), "?");
    }

    #[test]
    fn durations_and_ranges_read_at_a_glance() {
        for (ms, text) in [
            (0, "0 ms"),
            (999, "999 ms"),
            (1_000, "1.0 s"),
            (59_949, "59.9 s"),
            (65_000, "1 min 05 s"),
            (3_600_000 + 180_000, "1 h 03 min"),
        ] {
            assert_eq!(ago(ms), text);
        }
        assert_eq!(ranks_text(&[5, 0, 1, 2, 7, 8, 3]), "0-3,5,7-8");
        assert_eq!(ranks_text(&[]), "");
        assert_eq!(ranks_text(&[4]), "4");
    }

    /// `--json` is proto3 JSON as grpcurl prints it: zero values are left out, but rank 0 and
    /// node 0 are present fields and show; a global barrier has no node rank.
    #[test]
    fn json_shows_rank_zero_as_grpcurl_would() {
        let text = json(&stuck()).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let r0 = &v["ranks"][0];
        assert_eq!(
            (&r0["rank"], &r0["nodeRank"], &r0["localRank"]),
            (&0.into(), &0.into(), &0.into()),
            "{text}"
        );
        assert_eq!(v["nodes"][0]["nodeRank"], 0, "{text}");
        assert_eq!(v["failure"]["rank"], 0, "{text}");
        assert_eq!(v["barriers"][0]["missing"][0]["rank"], 3, "{text}");
        assert!(v["barriers"][0].get("nodeRank").is_none(), "{text}");
        // A zero that is not a rank is left out, as grpcurl does without -emit-defaults.
        assert!(r0.get("globalSeq").is_none(), "{text}");
        assert_eq!(v["summary"]["state"], "ROUND_STATE_RUNNING", "{text}");
        assert!(!text.contains('\n'), "one line: {text}");
    }

    /// A wide job lists only its ranks that are not plainly running.
    #[test]
    fn a_wide_job_lists_the_ranks_that_matter() {
        let mut d = stuck();
        let template = d.ranks[3].clone();
        d.ranks = (0..200)
            .map(|r| pb::RankInfo {
                rank: Some(r),
                state: if r == 150 {
                    pb::RankState::Failed as i32
                } else {
                    pb::RankState::Running as i32
                },
                ..template.clone()
            })
            .collect();
        let text = render(&d);
        assert!(
            text.contains("  (199 more ranks running, not shown)"),
            "{text}"
        );
        assert!(text.contains("\n  150 "), "{text}");
    }

    #[test]
    fn watch_intervals_are_checked() {
        assert_eq!(
            crate::cli::daemon_args::watch_interval("2"),
            Ok(std::time::Duration::from_secs(2))
        );
        assert_eq!(
            crate::cli::daemon_args::watch_interval("0.5"),
            Ok(std::time::Duration::from_millis(500))
        );
        assert_eq!(
            crate::cli::daemon_args::watch_interval("job-1"),
            Err("'job-1' is not a number of seconds (as 2 or 0.5)".to_owned())
        );
        assert_eq!(
            crate::cli::daemon_args::watch_interval("0"),
            Err("'0' is out of range: 0.1 to 86400 seconds".to_owned())
        );
    }
}
