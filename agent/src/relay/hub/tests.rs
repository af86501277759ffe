//! Data-driven tests of the node relay's hub: scripts of worker entries, coordinator events and
//! clock steps, checked against every answer the hub sends (see `check`).

use super::*;
use muster_core::barrier::MAX_NAME;

/// The node under test: node 1 of job 'j' generation 2, ranks 4, 5 and 6 on host-b.
const OFFSET: u32 = 4;

fn node() -> NodeAssignment {
    NodeAssignment {
        coordinator: "127.0.0.1:1".into(),
        failover_timeout: crate::failover::DEFAULT_BUDGET,
        job_id: "j".into(),
        node_id: String::new(),
        generation: 2,
        node_rank: 1,
        num_nodes: 2,
        rank_offset: OFFSET,
        local_world_size: 3,
        world_size: 7,
        restart_count: 0,
        max_restarts: 0,
        recovery: crate::env::Recovery::Restart,
        epoch: 0,
        host: "host-b".into(),
        master_addr: "host-a".into(),
        master_port: 1,
        agent_socket: None,
        error_dir: None,
        flight_dir: None,
    }
}

/// A single-node job: ranks 0, 1 and 2 are the whole generation.
fn single_node() -> NodeAssignment {
    NodeAssignment {
        node_rank: 0,
        num_nodes: 1,
        rank_offset: 0,
        world_size: 3,
        host: "host-a".into(),
        ..node()
    }
}

/// Records what the hub sends, one line per call, naming ranks by global rank.
struct Recorder {
    lines: Vec<String>,
    offset: u32,
}

fn describe(error: Option<&pb::BarrierError>) -> String {
    let Some(e) = error else {
        return "ok".into();
    };
    let kind = ErrKind::try_from(e.kind).map_or_else(
        |_| e.kind.to_string(),
        |k| k.as_str_name().trim_start_matches("KIND_").to_owned(),
    );
    let missing = if e.missing.is_empty() {
        String::new()
    } else {
        let ranks: Vec<String> = e.missing.iter().map(|m| m.rank().to_string()).collect();
        format!(" [missing {}]", ranks.join(","))
    };
    format!("{kind}{missing}: {}", e.message)
}

impl Sink for Recorder {
    fn workers(&mut self, to: &[u32], msg: &pb::CoordinatorMessage) {
        let mut ranks: Vec<u32> = to.iter().map(|l| l + self.offset).collect();
        ranks.sort_unstable();
        let ranks: Vec<String> = ranks.iter().map(u32::to_string).collect();
        let what = match &msg.kind {
            Some(pb::coordinator_message::Kind::Barrier(r)) => {
                let scope = match Scope::from_wire(r.scope) {
                    Ok(Scope::Global) => "global",
                    Ok(Scope::Node) => "node",
                    Err(_) => "scope?",
                };
                format!("{scope} #{} {}", r.seq, describe(r.error.as_ref()))
            }
            other => format!("{other:?}"),
        };
        self.lines.push(format!("{} <- {what}", ranks.join(",")));
    }

    fn coordinator(&mut self, msg: pb::RelayMessage) {
        let Some(pb::relay_message::Kind::Enter(e)) = msg.kind else {
            return self.lines.push(format!("=> {msg:?}"));
        };
        let groups: Vec<String> = e
            .groups
            .iter()
            .map(|g| {
                let ranks: Vec<String> = g.ranks.iter().map(u32::to_string).collect();
                format!("[{}: {}]", g.name, ranks.join(","))
            })
            .collect();
        let trace = e
            .trace_context
            .get("traceparent")
            .map_or_else(String::new, |t| format!(" trace {t}"));
        self.lines.push(format!(
            "=> enter #{} {} timeout {}{trace}",
            e.seq,
            groups.join(" "),
            e.timeout_ms
        ));
    }

    fn close(&mut self, local: u32, why: &str) {
        self.lines
            .push(format!("{} closed: {why}", local + self.offset));
    }

    fn wake_timer(&mut self) {}
}

fn error(kind: ErrKind, message: &str) -> pb::BarrierError {
    simple_error(kind, message.to_owned())
}

/// Runs `script` (one command per line) against a fresh hub whose ranks 4, 5 and 6 have
/// registered, and compares everything sent with `expected` (one line per send, in order;
/// leading blanks ignored). Commands:
/// - `enter R node|global SEQ NAME [TIMEOUT_MS] [trace=T]` (T: the entry's `traceparent`;
///   a group entry shows the one it carries as `trace T`), `leave R`, `lost R` (its
///   connection closed without `leave`)
/// - `+MS`: the clock moves on and expired waits are answered
/// - `result SEQ ok|timeout|failed`: the coordinator's answer to global barrier SEQ
/// - `failed`, `dead`: the coordinator's failure event (superseded; rank 6 exited);
///   `closed`: the coordinator stream broke for good
/// - `failover`: the relay registers again after a failover (recorded with the `released`
///   seq it sends) and re-sends the barriers in flight
/// - `reg R [job=J] [gen=G]`: a further registration (refusals are recorded)
/// - in-place recovery: `changed` (the coordinator's MEMBERSHIP_CHANGED as a `failed`
///   event), `result SEQ changed`, `replace R [resume=GLOBAL,NODE]` (a replacement's
///   registration), `rereg R GLOBAL,NODE` (its second `register`, with the quorum's seqs)
fn check(script: &str, expected: &str) {
    check_on(&node(), script, expected);
}

/// [`check`] on another node.
fn check_on(node: &NodeAssignment, script: &str, expected: &str) {
    let offset = node.rank_offset;
    let completed = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(0));
    let mut hub = Hub::new(node).counting(std::sync::Arc::clone(&completed));
    let mut rec = Recorder {
        lines: Vec::new(),
        offset,
    };
    let register = |hub: &mut Hub, rank: u32, job: &str, generation: u64| {
        hub.register(&pb::Register {
            job_id: job.into(),
            generation,
            rank,
            pid: 100 + rank,
            host: String::new(),
            ..Default::default()
        })
    };
    for rank in offset..offset + node.local_world_size {
        assert_eq!(register(&mut hub, rank, "j", 2), Ok(rank - offset));
    }
    let mut now = Instant::now();
    for line in script.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> u64 { words[i].parse().unwrap_or_else(|_| panic!("{line}")) };
        let local = |i: usize| num(i) as u32 - offset;
        match words[0] {
            "enter" => {
                let scope = match words[2] {
                    "node" => pb::BarrierScope::Node,
                    "global" => pb::BarrierScope::Global,
                    _ => pb::BarrierScope::Unspecified,
                };
                let mut entry = pb::BarrierEnter {
                    scope: scope as i32,
                    seq: num(3),
                    name: words[4].into(),
                    ..Default::default()
                };
                for (i, word) in words.iter().enumerate().skip(5) {
                    match word.strip_prefix("trace=") {
                        Some(t) => {
                            entry.trace_context.insert("traceparent".into(), t.into());
                        }
                        None => entry.timeout_ms = num(i),
                    }
                }
                hub.enter(local(1), entry, now, &mut rec);
            }
            "leave" => hub.leave(local(1), &mut rec),
            "lost" => hub.lost(local(1), "gone", now, &mut rec),
            "result" => {
                let err = match words[2] {
                    "ok" => None,
                    "timeout" => Some(error(ErrKind::Timeout, "remote node 0 late")),
                    "failed" => Some(error(ErrKind::RankFailed, "rank 0 failed")),
                    "changed" => Some(error(ErrKind::MembershipChanged, "rank 6 replaced")),
                    other => panic!("result {other}"),
                };
                let event = pb::RelayEvent {
                    kind: Some(pb::relay_event::Kind::Barrier(pb::BarrierResult {
                        scope: Scope::Global.to_wire(),
                        seq: num(1),
                        error: err,
                    })),
                };
                hub.on_event(event, &mut rec);
            }
            "failed" | "dead" => {
                let err = match words[0] {
                    "failed" => error(ErrKind::StaleGeneration, "superseded"),
                    _ => error(ErrKind::RankFailed, "rank 6 exited with status 3"),
                };
                let event = pb::RelayEvent {
                    kind: Some(pb::relay_event::Kind::Failed(err)),
                };
                hub.on_event(event, &mut rec);
            }
            "closed" => hub.coordinator_lost("no coordinator".into(), &mut rec),
            "changed" => {
                let event = pb::RelayEvent {
                    kind: Some(pb::relay_event::Kind::Failed(error(
                        ErrKind::MembershipChanged,
                        "rank 6 replaced",
                    ))),
                };
                hub.on_event(event, &mut rec);
            }
            "replace" | "rereg" => {
                let seqs = words.get(2).map(|w| {
                    let w = w.strip_prefix("resume=").unwrap_or(w);
                    let (g, n) = w.split_once(',').unwrap_or_else(|| panic!("{line}"));
                    (
                        g.parse().unwrap_or_else(|_| panic!("{line}")),
                        n.parse().unwrap_or_else(|_| panic!("{line}")),
                    )
                });
                let reg = pb::Register {
                    job_id: "j".into(),
                    generation: 2,
                    rank: num(1) as u32,
                    pid: 200 + num(1) as u32,
                    replacement: true,
                    epoch: 1,
                    resume: seqs.is_some(),
                    released_global: seqs.map_or(0, |s| s.0),
                    released_node: seqs.map_or(0, |s| s.1),
                    ..Default::default()
                };
                let got = if words[0] == "replace" {
                    hub.register(&reg).map(|_| ())
                } else {
                    hub.reregister(local(1), &reg)
                };
                if let Err(why) = got {
                    rec.lines.push(format!("refused: {why}"));
                }
            }
            "failover" => {
                rec.lines
                    .push(format!("re-register released={}", hub.released()));
                hub.resend(&mut rec);
            }
            "reg" => {
                let mut job = "j";
                let mut generation = 2;
                for w in &words[2..] {
                    match w.split_once('=') {
                        Some(("job", j)) => job = j,
                        Some(("gen", g)) => generation = g.parse().unwrap_or(0),
                        _ => panic!("{line}"),
                    }
                }
                if let Err(why) = register(&mut hub, num(1) as u32, job, generation) {
                    rec.lines.push(format!("refused: {why}"));
                }
            }
            t if t.starts_with('+') => {
                now += Duration::from_millis(t[1..].parse().unwrap_or(0));
                hub.expire(now, &mut rec);
            }
            other => panic!("unknown command {other}"),
        }
    }
    let expected: Vec<&str> = expected
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(rec.lines, expected, "script:\n{script}");
    // Every barrier answered with a result to the ranks counts once (the sampler's progress).
    let results = expected
        .iter()
        .filter(|l| l.contains(" <- ") && l.ends_with(" ok"))
        .count() as u64;
    assert_eq!(
        completed.load(std::sync::atomic::Ordering::Relaxed),
        results,
        "script:\n{script}"
    );
}

#[test]
fn node_barriers_complete_when_every_local_rank_arrives() {
    check(
        "enter 4 node 1 a
         enter 5 node 1 a
         enter 6 node 1 a
         enter 6 node 2 b
         enter 4 node 2 b
         enter 5 node 2 b",
        "4,5,6 <- node #1 ok
         4,5,6 <- node #2 ok",
    );
}

#[test]
fn scopes_are_numbered_apart_and_misnumbered_entries_are_rejected() {
    check(
        "enter 4 node 2 a
         enter 4 node 1 a
         enter 4 node 1 a
         enter 4 global 1 g
         enter 4 scope 1 g",
        "4 <- node #2 UNSPECIFIED: rank 4 sent node 1 barrier #2, but its last was #0: barrier calls must be numbered 1, 2, 3... per scope, one at a time
         4 <- node #1 UNSPECIFIED: rank 4 sent node 1 barrier #1, but its last was #1 and is still waiting: barrier calls must be numbered 1, 2, 3... per scope, one at a time
         4 <- scope? #1 UNSPECIFIED: barrier scope 0 is not valid; use GLOBAL (1) or NODE (2)",
    );
}

#[test]
fn different_names_diverge_for_everyone_at_that_seq() {
    check(
        "enter 4 node 1 a.rs:1
         enter 5 node 1 b.rs:2
         enter 6 node 1 a.rs:1
         enter 4 node 2 c
         enter 5 node 2 c
         enter 6 node 2 c",
        "4,5 <- node #1 DIVERGED: barrier divergence at node 1 barrier #1: ranks met under different names: [a.rs:1: ranks 4] [b.rs:2: ranks 5]; not yet arrived: 6 (node 1, host host-b)
         6 <- node #1 DIVERGED: barrier divergence at node 1 barrier #1: ranks met under different names: [a.rs:1: ranks 4] [b.rs:2: ranks 5]; not yet arrived: 6 (node 1, host host-b)
         4,5,6 <- node #2 ok",
    );
}

#[test]
fn a_local_timeout_withdraws_only_that_rank_which_may_retry() {
    check(
        "enter 4 node 1 a 100
         +50
         enter 5 node 1 a
         +60
         enter 4 node 1 a
         enter 6 node 1 a",
        "4 <- node #1 TIMEOUT [missing 6]: node 1 barrier #1 (a) timed out after 0.110s on rank 4 of job 'j' generation 2; missing ranks: 6 (node 1, host host-b)
         4,5,6 <- node #1 ok",
    );
    // A retry under another name is not a divergence with the withdrawn entry.
    check(
        "enter 4 node 1 a 100
         +100
         enter 4 node 1 b
         enter 5 node 1 b
         enter 6 node 1 b",
        "4 <- node #1 TIMEOUT [missing 5,6]: node 1 barrier #1 (a) timed out after 0.100s on rank 4 of job 'j' generation 2; missing ranks: 5 (node 1, host host-b), 6 (node 1, host host-b)
         4,5,6 <- node #1 ok",
    );
}

#[test]
fn a_failover_resends_the_barriers_in_flight_and_the_ranks_see_nothing() {
    check(
        "failover
         enter 4 global 1 g
         enter 5 global 1 g
         enter 6 global 1 h 2000
         +100
         failover
         result 1 ok
         failover
         enter 4 global 2 g
         enter 5 global 2 g
         enter 6 global 2 g
         result 2 timeout
         failover
         enter 4 node 1 n
         enter 5 node 1 n
         failover
         enter 6 node 1 n
         +5000",
        "re-register released=0
         => enter #1 [g: 4,5] [h: 6] timeout 2000
         re-register released=0
         => enter #1 [g: 4,5] [h: 6] timeout 2000
         4,5,6 <- global #1 ok
         re-register released=1
         => enter #2 [g: 4,5,6] timeout 0
         4,5,6 <- global #2 TIMEOUT: remote node 0 late
         re-register released=1
         re-register released=1
         4,5,6 <- node #1 ok",
    );
}

#[test]
fn global_barriers_go_to_the_coordinator_once_per_node() {
    check(
        "enter 4 global 1 g
         enter 5 global 1 g
         enter 6 global 1 g
         result 1 ok
         enter 4 global 2 g 1000
         +100
         enter 5 global 2 g
         enter 6 global 2 g 500
         +600
         result 2 timeout
         enter 5 global 2 g
         enter 4 global 2 g
         enter 6 global 2 g
         result 2 ok",
        "=> enter #1 [g: 4,5,6] timeout 0
         4,5,6 <- global #1 ok
         => enter #2 [g: 4,5,6] timeout 500
         4,5,6 <- global #2 TIMEOUT: remote node 0 late
         => enter #2 [g: 4,5,6] timeout 0
         4,5,6 <- global #2 ok",
    );
}

/// Without an exporter in the agent, a group entry passes on the trace context of the
/// node's first arrival that sent one (the same after a failover); untraced, none.
#[test]
fn a_group_entry_carries_the_first_arriving_ranks_trace_context() {
    check(
        "enter 5 global 1 g
         enter 6 global 1 g trace=t6
         enter 4 global 1 g trace=t4
         failover
         result 1 ok
         enter 4 global 2 g 100 trace=t4-withdrawn
         +100
         enter 5 global 2 g trace=t5
         enter 4 global 2 g
         enter 6 global 2 g trace=t6
         result 2 ok
         enter 4 global 3 g
         enter 5 global 3 g
         enter 6 global 3 g",
        "=> enter #1 [g: 4,5,6] timeout 0 trace t6
         re-register released=0
         => enter #1 [g: 4,5,6] timeout 0 trace t6
         4,5,6 <- global #1 ok
         4 <- global #2 TIMEOUT [missing 5,6]: global barrier #2 (g) timed out after 0.100s on rank 4 of job 'j' generation 2 while ranks of its own node (node 1) had not arrived; remote nodes were not consulted yet; missing ranks: 5 (node 1, host host-b), 6 (node 1, host host-b)
         => enter #2 [g: 4,5,6] timeout 0 trace t5
         4,5,6 <- global #2 ok
         => enter #3 [g: 4,5,6] timeout 0",
    );
}

#[test]
fn a_single_node_job_completes_global_barriers_here() {
    check_on(
        &single_node(),
        "enter 0 global 1 g
         enter 1 global 1 g
         enter 2 global 1 g
         enter 1 global 2 a 100
         +100
         enter 0 global 2 a
         enter 1 global 2 a
         enter 2 global 2 a
         enter 0 global 3 x
         enter 1 global 3 y",
        "0,1,2 <- global #1 ok
         1 <- global #2 TIMEOUT [missing 0,2]: global barrier #2 (a) timed out after 0.100s on rank 1 of job 'j' generation 2; missing ranks: 0 (node 0, host host-a), 2 (node 0, host host-a)
         0,1,2 <- global #2 ok
         0,1 <- global #3 DIVERGED: barrier divergence at global barrier #3: ranks met under different names: [x: ranks 0] [y: ranks 1]; not yet arrived: 2 (node 0, host host-a)",
    );
}

#[test]
fn global_divergence_is_left_to_the_coordinator() {
    check(
        "enter 4 global 1 a
         enter 5 global 1 b
         enter 6 global 1 a
         result 1 failed",
        "=> enter #1 [a: 4,6] [b: 5] timeout 0
         4,5,6 <- global #1 RANK_FAILED: rank 0 failed",
    );
}

#[test]
fn a_global_timeout_before_the_node_is_complete_is_answered_here() {
    check(
        "enter 4 global 1 g 100
         enter 5 global 1 g
         +100
         enter 4 global 1 g
         enter 6 global 1 g",
        "4 <- global #1 TIMEOUT [missing 6]: global barrier #1 (g) timed out after 0.100s on rank 4 of job 'j' generation 2 while ranks of its own node (node 1) had not arrived; remote nodes were not consulted yet; missing ranks: 6 (node 1, host host-b)
         => enter #1 [g: 4,5,6] timeout 0",
    );
}

#[test]
fn a_dead_rank_fails_every_wait_once_the_coordinator_confirms() {
    let exited = "RANK_FAILED: rank 6 exited with status 3";
    check(
        "enter 4 node 1 a
         enter 4 global 1 g
         enter 5 global 1 g
         lost 6
         enter 5 node 1 a
         dead
         result 1 ok
         enter 4 node 2 a",
        &format!(
            "4,5 <- node #1 {exited}
             4,5 <- global #1 {exited}
             4 <- node #2 {exited}"
        ),
    );
    // Without a word from the coordinator, the relay fails them itself after a second.
    let gone = "RANK_FAILED: rank 6 (node 1, host host-b) of job 'j' generation 2 failed: gone";
    check(
        "enter 4 node 1 a
         lost 6
         +999
         enter 5 global 1 g
         +1
         enter 4 global 1 g
         dead",
        &format!(
            "4 <- node #1 {gone}
             5 <- global #1 {gone}
             4 <- global #1 {gone}"
        ),
    );
    // Waits already at the coordinator fail too.
    check(
        "enter 4 global 1 g
         enter 5 global 1 g
         enter 6 global 1 g
         lost 5
         dead",
        &format!(
            "=> enter #1 [g: 4,5,6] timeout 0
             4,5,6 <- global #1 {exited}"
        ),
    );
}

#[test]
fn a_rank_that_left_fails_the_barriers_it_never_entered() {
    let left =
        "RANK_LEFT: rank 6 (node 1, host host-b) has left job 'j' generation 2 before reaching";
    check(
        "enter 4 node 1 a
         enter 5 node 1 a
         enter 6 node 1 a
         enter 4 node 2 a
         enter 4 global 1 g
         leave 6
         enter 5 node 2 a
         enter 5 global 1 g",
        &format!(
            "4,5,6 <- node #1 ok
             4 <- node #2 {left} node 1 barrier #2; the barrier can never complete
             4 <- global #1 {left} global barrier #1; the barrier can never complete
             5 <- node #2 {left} node 1 barrier #2; the barrier can never complete
             5 <- global #1 {left} global barrier #1; the barrier can never complete"
        ),
    );
}

#[test]
fn a_coordinator_failure_event_fails_every_wait_now_and_later() {
    check(
        "enter 4 node 1 a
         enter 5 global 1 g
         failed
         enter 6 node 1 a
         lost 4
         +2000",
        "4 <- node #1 STALE_GENERATION: superseded
         5 <- global #1 STALE_GENERATION: superseded
         6 <- node #1 STALE_GENERATION: superseded",
    );
}

#[test]
fn a_lost_coordinator_stream_closes_every_connection() {
    check(
        "enter 4 node 1 a
         leave 6
         closed
         reg 6",
        "4 <- node #1 RANK_LEFT: rank 6 (node 1, host host-b) has left job 'j' generation 2 before reaching node 1 barrier #1; the barrier can never complete
         4 closed: no coordinator
         5 closed: no coordinator
         refused: no coordinator",
    );
}

#[test]
fn registrations_of_other_jobs_generations_nodes_or_twice_are_refused() {
    check(
        "reg 5 job=k
         reg 5 gen=3
         reg 3
         reg 7
         reg 5",
        "refused: rank 5 registered for job 'k', but this agent runs job 'j'
         refused: rank 5 registered for generation 3, but this agent runs generation 2 of job 'j'
         refused: rank 3 does not run on node 1 of job 'j' (its ranks are 4..7)
         refused: rank 7 does not run on node 1 of job 'j' (its ranks are 4..7)
         refused: rank 5 of job 'j' generation 2 has already connected to this agent (pid 105)",
    );
}

#[test]
fn malformed_entries_are_rejected_without_using_the_seq() {
    let long = "x".repeat(MAX_NAME + 1);
    check(
        &format!(
            "enter 4 node 1 {long}
             enter 4 node 1 a 99999999999
             enter 4 node 1 a"
        ),
        &format!(
            "4 <- node #1 UNSPECIFIED: barrier name is {} bytes long; the limit is {MAX_NAME}
             4 <- node #1 UNSPECIFIED: timeout_ms is 99999999999 ms; the limit is 86400000 ms",
            MAX_NAME + 1
        ),
    );
}

/// A hub of [`node`] with its three local ranks registered, and a recorder for it.
fn registered_hub() -> (Hub, Recorder) {
    let mut hub = Hub::new(&node());
    for rank in OFFSET..OFFSET + 3 {
        let reg = pb::Register {
            job_id: "j".into(),
            generation: 2,
            rank,
            pid: 1,
            host: String::new(),
            ..Default::default()
        };
        assert!(hub.register(&reg).is_ok());
    }
    let rec = Recorder {
        lines: Vec::new(),
        offset: OFFSET,
    };
    (hub, rec)
}

#[test]
fn finished_barriers_are_reused() {
    let (mut hub, mut rec) = registered_hub();
    let now = Instant::now();
    for seq in 1..=50 {
        for local in 0..3 {
            let entry = pb::BarrierEnter {
                scope: Scope::Node.to_wire(),
                seq,
                name: "n".into(),
                timeout_ms: 0,
                trace_context: Default::default(),
            };
            hub.enter(local, entry, now, &mut rec);
        }
        assert!(hub.barriers.is_empty());
    }
    assert_eq!(hub.barriers.spare(), 1);
    assert_eq!(rec.lines.len(), 50);
}

#[test]
fn held_waits_are_reported_once_old_enough_and_sent_ones_are_not() {
    let (mut hub, mut rec) = registered_hub();
    let t0 = Instant::now();
    let enter = |scope: pb::BarrierScope, seq: u64| pb::BarrierEnter {
        scope: scope as i32,
        seq,
        name: "train.rs:9".into(),
        timeout_ms: 0,
        trace_context: Default::default(),
    };
    hub.enter(0, enter(pb::BarrierScope::Node, 1), t0, &mut rec);
    hub.enter(1, enter(pb::BarrierScope::Node, 1), t0, &mut rec);
    // A global barrier the whole node entered goes to the coordinator: not reported.
    for local in 0..3 {
        hub.enter(local, enter(pb::BarrierScope::Global, 1), t0, &mut rec);
    }
    assert!(
        hub.waiting_report(t0, Duration::from_secs(1)).is_empty(),
        "too young"
    );
    let report = hub.waiting_report(t0 + Duration::from_millis(1500), Duration::from_secs(1));
    assert_eq!(report.len(), 1, "{report:?}");
    let b = &report[0];
    assert_eq!(
        (b.scope, b.node_rank, b.seq),
        (pb::BarrierScope::Node as i32, Some(1), 1)
    );
    assert_eq!(b.names[0].name, "train.rs:9");
    assert_eq!(b.names[0].ranks, [OFFSET, OFFSET + 1]);
    assert_eq!(
        b.missing
            .iter()
            .map(pb::RankLocation::rank)
            .collect::<Vec<_>>(),
        [OFFSET + 2]
    );
    assert_eq!(b.waiting_ms, 1500);
}

/// A node of an in-place job.
fn in_place() -> NodeAssignment {
    NodeAssignment {
        recovery: crate::env::Recovery::InPlace,
        ..node()
    }
}

/// In place, a local death is confirmed by the coordinator's MEMBERSHIP_CHANGED: the waits
/// end with it, entries are answered at once until the replacement registers, and the
/// replacement continues the sequences from the seqs it brings; nothing fails for good.
#[test]
fn in_place_a_local_death_withdraws_waits_until_the_replacement() {
    let changed = "MEMBERSHIP_CHANGED: rank 6 replaced";
    check_on(
        &in_place(),
        "enter 4 node 1 a
         enter 5 node 1 a
         enter 4 global 1 g
         lost 6
         enter 5 global 1 g
         changed
         enter 4 node 2 b
         enter 5 node 2 b
         replace 6 resume=1,2
         enter 6 node 3 c
         enter 4 node 3 c
         enter 5 node 3 c
         enter 4 global 2 g
         enter 5 global 2 g
         enter 6 global 2 g",
        &format!(
            "4,5 <- node #1 {changed}
             4,5 <- global #1 {changed}
             4 <- node #2 {changed}
             5 <- node #2 {changed}
             4,5,6 <- node #3 ok
             => enter #2 [g: 4,5,6] timeout 0"
        ),
    );
}

/// In place, without the coordinator's word within DEATH_CONFIRM the node's waits are
/// withdrawn (not failed for good); when the coordinator then fails the generation (no
/// restarts left), everything fails as in restart mode.
#[test]
fn in_place_an_unconfirmed_death_withdraws_and_a_failure_still_fails() {
    let withdrawn = "MEMBERSHIP_CHANGED: rank 6 (node 1, host host-b) of job 'j' generation 2 failed: gone; replacing it in place: go to the step boundary (quorum) before entering barriers";
    let exited = "RANK_FAILED: rank 6 exited with status 3";
    check_on(
        &in_place(),
        "enter 4 node 1 a
         lost 6
         +999
         enter 5 node 1 a
         +1
         enter 4 node 2 a
         dead
         enter 5 node 2 a",
        &format!(
            "4,5 <- node #1 {withdrawn}
             4 <- node #2 {withdrawn}
             5 <- node #2 {exited}"
        ),
    );
}

/// In place, the coordinator's MEMBERSHIP_CHANGED answer to a global barrier also ends the
/// node's other waits: with a local death, until the replacement registers; with a death
/// elsewhere, once (a rank held at a node barrier would miss the quorum): later entries wait
/// as usual.
#[test]
fn in_place_a_withdrawn_global_barrier_ends_the_nodes_other_waits() {
    let changed = "MEMBERSHIP_CHANGED: rank 6 replaced";
    check_on(
        &in_place(),
        "enter 4 global 1 g
         enter 5 global 1 g
         enter 6 global 1 g
         enter 4 node 1 n
         lost 6
         result 1 changed
         enter 5 node 1 n",
        &format!(
            "=> enter #1 [g: 4,5,6] timeout 0
             4,5,6 <- global #1 {changed}
             4 <- node #1 {changed}
             5 <- node #1 {changed}"
        ),
    );
    check_on(
        &in_place(),
        "enter 4 global 1 g
         enter 5 global 1 g
         enter 6 global 1 g
         enter 4 node 1 n
         result 1 changed
         enter 4 node 2 n
         enter 4 global 2 g",
        &format!(
            "=> enter #1 [g: 4,5,6] timeout 0
             4,5,6 <- global #1 {changed}
             4 <- node #1 {changed}"
        ),
    );
}

/// Who may register as a replacement: only in place, only for a dead rank; a second
/// `register` carries the quorum's seqs, and only a replacement's is taken.
#[test]
fn replacement_registrations() {
    let refused = "refused: rank 6 of job 'j' generation 2 has already connected to this agent";
    check(
        "lost 6
         replace 6",
        &format!("{refused} (pid 106): the job does not recover in place"),
    );
    check_on(
        &in_place(),
        "replace 6
         lost 5
         reg 5
         replace 5
         rereg 5 0,3
         enter 5 node 4 a
         enter 4 node 4 a
         rereg 4 0,1",
        &format!(
            "{refused} (pid 106) and is still connected: a replacement registers once the rank's previous worker is gone
             refused: rank 5 of job 'j' generation 2 has already connected to this agent (pid 105)
             4 <- node #4 UNSPECIFIED: rank 4 sent node 1 barrier #4, but its last was #0: barrier calls must be numbered 1, 2, 3... per scope, one at a time
             refused: sent `register` twice to the agent"
        ),
    );
}
