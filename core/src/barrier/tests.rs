//! Data-driven tests of the barrier table: the node relay's cases (the texts its tests assert)
//! replayed on a bare table, plus the coordinator's texts and bookkeeping.

use super::*;

/// The node under test: node 1 of job 'j' generation 2, ranks 4, 5 and 6 on host-b.
const RANKS: Range<u32> = 4..7;

fn locate(rank: u32) -> pb::RankLocation {
    pb::RankLocation {
        rank: Some(rank),
        node_rank: Some(1),
        host: "host-b".into(),
    }
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

/// A wait's deadline, as the relay keeps it.
type Deadline = Option<Instant>;

/// The per-barrier state a relay keeps: the divergence error everyone gets once it happened.
type Diverged = Option<pb::BarrierError>;

/// Replays `script` on a table of ranks 4, 5 and 6 following the relay's rules for barriers
/// that complete locally (node barriers, and global ones when `whole_world`), and compares
/// every answer with `expected` (one line per answer; leading blanks ignored). Commands:
/// - `enter R node|global SEQ NAME [TIMEOUT_MS]`, `leave R`
/// - `+MS`: the clock moves on and expired waits are answered with the timeout text
fn check(whole_world: bool, script: &str, expected: &str) {
    let mut table: Table<Deadline, Diverged> = Table::default();
    let mut places = [Place::default(); 3];
    let mut left: Vec<u32> = vec![];
    let mut lines: Vec<String> = vec![];
    let t0 = Instant::now();
    let mut now = t0;
    let answer = |lines: &mut Vec<String>, to: &[u32], key: Key, err: Option<&pb::BarrierError>| {
        let mut to = to.to_vec();
        to.sort_unstable();
        let to: Vec<String> = to.iter().map(u32::to_string).collect();
        let scope = if key.scope == Scope::Global {
            "global"
        } else {
            "node"
        };
        lines.push(format!(
            "{} <- {scope} #{} {}",
            to.join(","),
            key.seq,
            describe(err)
        ));
    };
    // Answers every rank of `key` still waiting there.
    let deliver = |table: &mut Table<Deadline, Diverged>,
                   places: &mut [Place; 3],
                   lines: &mut Vec<String>,
                   key: Key,
                   err: Option<&pb::BarrierError>| {
        let b = table.get_mut(&key).expect("pending");
        let mut to = vec![];
        for a in b.arrivals_mut() {
            if places[(a.rank() - RANKS.start) as usize].answer(
                key.scope,
                key.seq,
                consumes_seq(err),
            ) {
                a.data = None;
                to.push(a.rank());
            }
        }
        if !to.is_empty() {
            answer(lines, &to, key, err);
        }
    };
    for line in script.lines().map(str::trim).filter(|l| !l.is_empty()) {
        let words: Vec<&str> = line.split_whitespace().collect();
        let num = |i: usize| -> u64 { words[i].parse().unwrap_or_else(|_| panic!("{line}")) };
        match words[0] {
            "enter" => {
                let rank = num(1) as u32;
                let scope = if words[2] == "global" {
                    Scope::Global
                } else {
                    Scope::Node
                };
                let key = Key::new(scope, 1, num(3));
                let place = &mut places[(rank - RANKS.start) as usize];
                if let Err(why) = place.check_entry(rank, scope, 1, key.seq) {
                    let err = crate::model::barrier_error(ErrKind::Unspecified, why);
                    answer(&mut lines, &[rank], key, Some(&err));
                    continue;
                }
                place.enter(scope, key.seq);
                if let Some(&gone) = left
                    .iter()
                    .find(|r| places[(**r - RANKS.start) as usize].done[scope.index()] < key.seq)
                {
                    let err = left_error(locate(gone), "j", 2, key);
                    places[(rank - RANKS.start) as usize].answer(scope, key.seq, true);
                    answer(&mut lines, &[rank], key, Some(&err));
                    continue;
                }
                let deadline = words.get(5).map(|_| now + Duration::from_millis(num(5)));
                let b = table.open(key, RANKS, now);
                b.arrive(rank, words[4].into(), now, deadline);
                if b.diverged() || b.extra.is_some() {
                    if b.extra.is_none() {
                        b.extra = Some(b.divergence_error(locate));
                    }
                    let err = b.extra.clone();
                    let complete = b.complete();
                    deliver(&mut table, &mut places, &mut lines, key, err.as_ref());
                    if complete {
                        let b = table.remove(&key).expect("pending");
                        table.recycle(b);
                    }
                } else if b.complete() {
                    deliver(&mut table, &mut places, &mut lines, key, None);
                    let b = table.remove(&key).expect("pending");
                    table.recycle(b);
                }
            }
            "leave" => left.push(num(1) as u32),
            t if t.starts_with('+') => {
                now += Duration::from_millis(t[1..].parse().unwrap_or(0));
                let mut i = 0;
                while i < table.len() {
                    let b = table.at_mut(i);
                    while let Some(pos) = b
                        .arrivals()
                        .iter()
                        .position(|a| a.data.is_some_and(|d| d <= now))
                    {
                        let a = b.remove_arrival(pos);
                        let key = b.key();
                        places[(a.rank() - RANKS.start) as usize].waiting[key.scope.index()] =
                            false;
                        let missing = b.missing_except(|r| r == a.rank(), locate);
                        let after = now.saturating_duration_since(a.entered());
                        let name = b.names()[a.name()].clone();
                        let err = if key.scope == Scope::Global && !whole_world {
                            node_incomplete_timeout_error(
                                key.seq,
                                &name,
                                after,
                                a.rank(),
                                "j",
                                2,
                                1,
                                missing,
                            )
                        } else {
                            timeout_error(
                                key,
                                &name,
                                after,
                                Waiter::Rank(a.rank()),
                                "j",
                                2,
                                missing,
                            )
                        };
                        b.prune_names();
                        answer(&mut lines, &[a.rank()], key, Some(&err));
                    }
                    if table.at(i).arrivals().is_empty() {
                        let b = table.remove_at(i);
                        table.recycle(b);
                    } else {
                        i += 1;
                    }
                }
            }
            other => panic!("unknown command {other}"),
        }
    }
    let expected: Vec<&str> = expected
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty())
        .collect();
    assert_eq!(lines, expected, "script:\n{script}");
}

#[test]
fn barriers_complete_when_every_expected_rank_arrives() {
    check(
        false,
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
fn misnumbered_entries_are_refused_with_the_shared_text() {
    check(
        false,
        "enter 4 node 2 a
         enter 4 node 1 a
         enter 4 node 1 a",
        "4 <- node #2 UNSPECIFIED: rank 4 sent node 1 barrier #2, but its last was #0: barrier calls must be numbered 1, 2, 3... per scope, one at a time
         4 <- node #1 UNSPECIFIED: rank 4 sent node 1 barrier #1, but its last was #1 and is still waiting: barrier calls must be numbered 1, 2, 3... per scope, one at a time",
    );
}

#[test]
fn different_names_diverge_naming_both_call_sites() {
    check(
        false,
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
    check(
        true,
        "enter 4 global 1 x
         enter 5 global 1 y",
        "4,5 <- global #1 DIVERGED: barrier divergence at global barrier #1: ranks met under different names: [x: ranks 4] [y: ranks 5]; not yet arrived: 6 (node 1, host host-b)",
    );
}

#[test]
fn a_timeout_withdraws_only_that_rank_which_may_retry_under_any_name() {
    check(
        false,
        "enter 4 node 1 a 100
         +50
         enter 5 node 1 a
         +60
         enter 4 node 1 a
         enter 6 node 1 a",
        "4 <- node #1 TIMEOUT [missing 6]: node 1 barrier #1 (a) timed out after 0.110s on rank 4 of job 'j' generation 2; missing ranks: 6 (node 1, host host-b)
         4,5,6 <- node #1 ok",
    );
    check(
        false,
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
fn a_global_timeout_before_the_node_is_complete_says_no_other_node_was_asked() {
    check(
        false,
        "enter 4 global 1 g 100
         enter 5 global 1 g
         +100",
        "4 <- global #1 TIMEOUT [missing 6]: global barrier #1 (g) timed out after 0.100s on rank 4 of job 'j' generation 2 while ranks of its own node (node 1) had not arrived; remote nodes were not consulted yet; missing ranks: 6 (node 1, host host-b)",
    );
    check(
        true,
        "enter 5 global 1 a 100
         +100",
        "5 <- global #1 TIMEOUT [missing 4,6]: global barrier #1 (a) timed out after 0.100s on rank 5 of job 'j' generation 2; missing ranks: 4 (node 1, host host-b), 6 (node 1, host host-b)",
    );
}

#[test]
fn a_rank_that_left_fails_the_barriers_it_never_entered() {
    let left =
        "RANK_LEFT: rank 6 (node 1, host host-b) has left job 'j' generation 2 before reaching";
    check(
        false,
        "enter 4 node 1 a
         enter 5 node 1 a
         enter 6 node 1 a
         leave 6
         enter 4 node 2 a
         enter 5 global 1 g",
        &format!(
            "4,5,6 <- node #1 ok
             4 <- node #2 {left} node 1 barrier #2; the barrier can never complete
             5 <- global #1 {left} global barrier #1; the barrier can never complete"
        ),
    );
}

#[test]
fn a_relays_timed_out_group_is_named_by_its_ranks_and_node() {
    let key = Key::new(Scope::Global, 7, 3);
    assert_eq!(key.node_rank, 0, "global keys do not depend on the node");
    let who = Waiter::Node {
        first: 4,
        last: 6,
        node_rank: 1,
    };
    let err = timeout_error(
        key,
        "g",
        Duration::from_millis(1500),
        who,
        "j",
        2,
        vec![locate(9)],
    );
    assert_eq!(
        describe(Some(&err)),
        "TIMEOUT [missing 9]: global barrier #3 (g) timed out after 1.500s on ranks 4..=6 (node 1) of job 'j' generation 2; missing ranks: 9 (node 1, host host-b)"
    );
}

#[test]
fn groups_arrive_together_and_withdraw_by_their_data() {
    let now = Instant::now();
    let mut table: Table<u64> = Table::default();
    let key = Key::new(Scope::Global, 0, 1);
    let b = table.open(key, 0..6, now);
    b.arrive(0, "g".into(), now, 1);
    b.arrive_group([3, 4, 5], "h".into(), now, 2);
    assert!(b.diverged() && !b.complete());
    assert_eq!(
        b.groups(),
        [
            pb::BarrierName {
                name: "g".into(),
                ranks: vec![0],
            },
            pb::BarrierName {
                name: "h".into(),
                ranks: vec![3, 4, 5],
            },
        ]
    );
    let out = b.withdraw(|a| a.data == 2);
    assert_eq!(out.iter().map(Arrival::rank).collect::<Vec<_>>(), [3, 4, 5]);
    // Unlike the relay, the coordinator keeps a withdrawn group's name.
    assert_eq!(b.names().len(), 2);
    let missing: Vec<u32> = b
        .missing(locate)
        .iter()
        .map(pb::RankLocation::rank)
        .collect();
    assert_eq!(missing, [1, 2, 3, 4, 5]);
    let info = b.info(Duration::from_millis(20), locate);
    assert_eq!((info.seq, info.waiting_ms, info.missing.len()), (1, 20, 5));
}

#[test]
fn a_released_seq_takes_out_every_pending_barrier_of_its_scope_at_or_below_it() {
    let now = Instant::now();
    let mut table: Table<()> = Table::default();
    for seq in 1..=3 {
        table.open(Key::new(Scope::Node, 1, seq), 4..7, now);
    }
    table.open(Key::new(Scope::Node, 2, 1), 7..9, now);
    table.open(Key::new(Scope::Global, 0, 1), 0..9, now);
    let out: Vec<u64> = table
        .release_through(Key::new(Scope::Node, 1, 2))
        .iter()
        .map(|b| b.key().seq)
        .collect();
    assert_eq!(out, [1, 2]);
    assert_eq!(table.len(), 3);
    assert_eq!(table.released(Scope::Node, 1), 2);
    assert_eq!(table.released(Scope::Node, 2), 0);
    assert!(
        table
            .release_through(Key::new(Scope::Node, 1, 1))
            .is_empty()
    );
    assert!(!table.release(Key::new(Scope::Node, 1, 2)));
    assert!(table.release(Key::new(Scope::Global, 5, 4)));
    assert_eq!(table.released(Scope::Global, 9), 4);
}

#[test]
fn finished_barriers_are_reused() {
    let now = Instant::now();
    let mut table: Table<(), Option<u32>> = Table::default();
    for seq in 1..=50 {
        let key = Key::new(Scope::Node, 1, seq);
        let b = table.open(key, 4..7, now);
        assert!(
            b.arrivals().is_empty() && b.extra.is_none(),
            "reset on reuse"
        );
        for r in 4..7 {
            b.arrive(r, "n".into(), now, ());
        }
        b.extra = Some(1);
        assert!(b.complete());
        let b = table.remove(&key).expect("pending");
        table.recycle(b);
        assert!(table.is_empty());
    }
    assert_eq!(table.spare(), 1);
}

#[test]
fn places_follow_the_seq_rule() {
    let mut p = Place::default();
    assert!(p.may_enter(Scope::Global, 1) && !p.may_enter(Scope::Global, 2));
    p.enter(Scope::Global, 1);
    assert!(!p.may_enter(Scope::Global, 1), "still waiting");
    assert!(p.may_enter(Scope::Node, 1), "scopes are numbered apart");
    // A timeout does not use the seq up: the same seq may be entered again.
    assert!(p.answer(Scope::Global, 1, false));
    assert!(p.may_enter(Scope::Global, 1) && p.may_enter(Scope::Global, 2));
    p.enter(Scope::Global, 1);
    assert!(!p.answer(Scope::Global, 2, true), "not waiting there");
    assert!(p.answer(Scope::Global, 1, true));
    assert!(!p.may_enter(Scope::Global, 1) && p.may_enter(Scope::Global, 2));
    p.resume(Scope::Global, 5);
    p.resume(Scope::Global, 3);
    assert!(p.may_enter(Scope::Global, 6) && !p.may_enter(Scope::Global, 5));
    p.seq[0] = u64::MAX;
    assert!(!p.may_enter(Scope::Global, 0), "no wrap-around");
}

#[test]
fn names_and_results_follow_the_shared_rules() {
    assert_eq!(check_name("train.rs:9"), Ok(()));
    assert_eq!(
        check_name(&"x".repeat(MAX_NAME + 1)),
        Err(format!(
            "barrier name is {} bytes long; the limit is {MAX_NAME}",
            MAX_NAME + 1
        ))
    );
    assert!(check_name("").is_err() && check_name("a\nb").is_err());
    let err = |kind| Some(crate::model::barrier_error(kind, String::new()));
    assert!(consumes_seq(None));
    assert!(!consumes_seq(err(ErrKind::Timeout).as_ref()));
    assert!(!consumes_seq(err(ErrKind::Unspecified).as_ref()));
    assert!(!consumes_seq(err(ErrKind::MembershipChanged).as_ref()));
    assert!(consumes_seq(err(ErrKind::Diverged).as_ref()));
    assert!(consumes_seq(err(ErrKind::RankFailed).as_ref()));
}

#[test]
fn missing_ranks_of_a_large_world_are_listed_in_order() {
    let now = Instant::now();
    let mut table: Table<()> = Table::default();
    let b = table.open(Key::new(Scope::Global, 0, 1), 0..100_000, now);
    for r in (0..100_000).rev().filter(|r| r % 1000 != 7) {
        b.arrive(r, "g".into(), now, ());
    }
    let missing: Vec<u32> = b
        .missing(locate)
        .iter()
        .map(pb::RankLocation::rank)
        .collect();
    assert_eq!(missing.len(), 100);
    assert!(missing.windows(2).all(|w| w[0] < w[1]) && missing[0] == 7);
}
