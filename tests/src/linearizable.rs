//! A linearizability checker for key-value histories (issue 28), in the manner of Wing & Gong
//! with Lowe's cache, as porcupine (etcd's robustness tests) does it: each key is checked on
//! its own (a store of independent registers is linearizable when each register is), by a
//! depth-first search over the order in which the operations could have taken effect, each
//! between its call and its return, remembering every (set of operations applied, value)
//! already tried so that no state is searched twice.
//!
//! An operation whose outcome is unknown (the client saw no answer: a connection lost, a
//! timeout) has no return: it may have taken effect at any time after its call, or never, and
//! any result matches. A delete that answers that the key did not exist says nothing: the
//! store's contract (`Kv::delete`) lets a retry after a failover, whose first attempt was
//! applied, answer so ([`answers`]); one that answers it existed must be right. Times are the clients' wall clock in microseconds; operations whose
//! times tie count as concurrent (the permissive reading, so a coarse clock never makes a
//! history fail).
//!
//! No crate fitted: `stateright`'s tester checks a history by enumerating interleavings
//! without the state cache (exponential in the length of a fault run's history) and brings an
//! HTTP explorer; `porcupine` is Go.

use std::collections::{BTreeMap, HashSet};
use std::fmt;

/// An operation on one key, as the store offers it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Op {
    /// Sets the value.
    Set(Vec<u8>),
    /// Reads the value (`None`: no such key).
    Get,
    /// Adds to the value read as a decimal integer (a missing key is 0); returns the sum.
    Add(i64),
    /// Sets `desired` if the value is `expected` (`None`: the key does not exist); returns
    /// whether it did and the value after.
    CompareSet {
        /// The value it must have (`None`: absent).
        expected: Option<Vec<u8>>,
        /// The value it gets.
        desired: Vec<u8>,
    },
    /// Removes the key; returns whether it existed.
    Delete,
    /// Appends to the value (a missing key is empty).
    Append(Vec<u8>),
}

/// What an operation returned.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Out {
    /// `Set` and `Append`.
    Done,
    /// `Get`: the value, `None` for no such key.
    Value(Option<Vec<u8>>),
    /// `Add`: the sum.
    Sum(i64),
    /// `CompareSet`: whether it swapped, and the value after.
    Cas {
        /// Whether the value was `expected` and is now `desired`.
        swapped: bool,
        /// The value after the call.
        current: Option<Vec<u8>>,
    },
    /// `Delete`: whether the key existed.
    Existed(bool),
}

/// One operation of a history.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Operation {
    /// Who made it (a process, a thread): for messages only.
    pub client: String,
    /// The key.
    pub key: String,
    /// What it asked.
    pub op: Op,
    /// When it was called (microseconds, any origin shared by every client).
    pub call_us: u64,
    /// When it returned, with what; `None` when its outcome is unknown.
    pub ret: Option<(u64, Out)>,
}

impl fmt::Display for Operation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let show = |v: &[u8]| String::from_utf8_lossy(v).into_owned();
        let op = match &self.op {
            Op::Set(v) => format!("set {}", show(v)),
            Op::Get => "get".to_owned(),
            Op::Add(d) => format!("add {d}"),
            Op::CompareSet { expected, desired } => format!(
                "compare_set {} -> {}",
                expected.as_deref().map_or("(absent)".into(), show),
                show(desired)
            ),
            Op::Delete => "delete".to_owned(),
            Op::Append(v) => format!("append {}", show(v)),
        };
        let out = match &self.ret {
            None => "unknown outcome".to_owned(),
            Some((t, out)) => {
                let out = match out {
                    Out::Done => "ok".to_owned(),
                    Out::Value(v) => v.as_deref().map_or("(absent)".into(), show),
                    Out::Sum(n) => n.to_string(),
                    Out::Cas { swapped, current } => format!(
                        "swapped={swapped} current={}",
                        current.as_deref().map_or("(absent)".into(), show)
                    ),
                    Out::Existed(e) => format!("existed={e}"),
                };
                format!("returned {out} at {t}")
            }
        };
        write!(
            f,
            "{} {} {op}: called at {}, {out}",
            self.client, self.key, self.call_us
        )
    }
}

/// The effect of `op` on `value`: the value after and the result, or `None` when the store
/// would refuse it there (an add to a value that is not an integer).
pub fn step(value: &Option<Vec<u8>>, op: &Op) -> Option<(Option<Vec<u8>>, Out)> {
    Some(match op {
        Op::Set(v) => (Some(v.clone()), Out::Done),
        Op::Get => (value.clone(), Out::Value(value.clone())),
        Op::Add(d) => {
            let current: i64 = match value {
                None => 0,
                Some(v) => std::str::from_utf8(v).ok()?.trim().parse().ok()?,
            };
            let sum = current.checked_add(*d)?;
            (Some(sum.to_string().into_bytes()), Out::Sum(sum))
        }
        Op::CompareSet { expected, desired } => {
            if value == expected {
                (
                    Some(desired.clone()),
                    Out::Cas {
                        swapped: true,
                        current: Some(desired.clone()),
                    },
                )
            } else {
                (
                    value.clone(),
                    Out::Cas {
                        swapped: false,
                        current: value.clone(),
                    },
                )
            }
        }
        Op::Delete => (None, Out::Existed(value.is_some())),
        Op::Append(v) => {
            let mut after = value.clone().unwrap_or_default();
            after.extend_from_slice(v);
            (Some(after), Out::Done)
        }
    })
}

/// Whether `observed`, what the store answered, is an answer the store may give where the
/// model computed `computed`: the same, except that a delete may answer "did not exist" after
/// a retry whose first attempt deleted the key (a documented limit of `Kv::delete`, which is
/// retried as idempotent rather than on a lane; found by this checker under etcd outages).
pub fn answers(observed: &Out, computed: &Out) -> bool {
    matches!((observed, computed), (Out::Existed(false), Out::Existed(_))) || observed == computed
}

/// A key whose operations admit no linearization: the key and its operations by call time.
#[derive(Debug, Clone)]
pub struct NotLinearizable {
    /// The key.
    pub key: String,
    /// Its operations, by call time.
    pub ops: Vec<Operation>,
}

impl fmt::Display for NotLinearizable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "key {:?}: {} operations admit no linearization:",
            self.key,
            self.ops.len()
        )?;
        const SHOWN: usize = 40;
        for op in self.ops.iter().take(SHOWN) {
            writeln!(f, "  {op}")?;
        }
        if self.ops.len() > SHOWN {
            writeln!(f, "  ... and {} more", self.ops.len() - SHOWN)?;
        }
        Ok(())
    }
}

/// Checks every key of `history` (each starting absent); returns the keys that are not
/// linearizable.
pub fn check(history: &[Operation]) -> Vec<NotLinearizable> {
    let mut keys: BTreeMap<&str, Vec<&Operation>> = BTreeMap::new();
    for op in history {
        keys.entry(&op.key).or_default().push(op);
    }
    keys.into_iter()
        .filter(|(_, ops)| !linearizable(ops))
        .map(|(key, ops)| {
            let mut ops: Vec<Operation> = ops.into_iter().cloned().collect();
            ops.sort_by_key(|o| o.call_us);
            NotLinearizable {
                key: key.to_owned(),
                ops,
            }
        })
        .collect()
}

/// One event of a key's history: an operation's call or its return.
#[derive(Debug, Clone, Copy)]
struct Entry {
    op: usize,
    call: bool,
    prev: usize,
    next: usize,
}

/// Whether the operations of one key (starting absent) can be ordered so that each takes
/// effect once, between its call and its return, with the results they returned.
fn linearizable(ops: &[&Operation]) -> bool {
    let n = ops.len();
    if n == 0 {
        return true;
    }
    // Events by time; calls before returns at the same time (ties overlap). An unknown
    // outcome returns after everything.
    let mut events: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * n);
    for (i, op) in ops.iter().enumerate() {
        events.push((op.call_us, true, i));
        events.push((op.ret.as_ref().map_or(u64::MAX, |r| r.0), false, i));
    }
    events.sort_by_key(|&(t, call, i)| (t, !call, i));
    // A doubly linked list over `events`, with a head sentinel at index `len`.
    let head = events.len();
    let mut list: Vec<Entry> = events
        .iter()
        .enumerate()
        .map(|(i, &(_, call, op))| Entry {
            op,
            call,
            prev: if i == 0 { head } else { i - 1 },
            next: i + 1,
        })
        .collect();
    list.push(Entry {
        op: usize::MAX,
        call: false,
        prev: head,
        next: 0,
    });
    let end = events.len();
    let mut ret_of = vec![0usize; n];
    for (i, e) in events.iter().enumerate() {
        if !e.1 {
            ret_of[e.2] = i;
        }
    }
    // Unknown outcomes still pending: once only those are left, the history is explained.
    let mut pending_known = ops.iter().filter(|o| o.ret.is_some()).count();

    let unlink = |list: &mut Vec<Entry>, i: usize| {
        let (p, nx) = (list[i].prev, list[i].next);
        list[p].next = nx;
        if nx != end {
            list[nx].prev = p;
        }
    };
    let relink = |list: &mut Vec<Entry>, i: usize| {
        let (p, nx) = (list[i].prev, list[i].next);
        list[p].next = i;
        if nx != end {
            list[nx].prev = i;
        }
    };

    let words = n.div_ceil(64);
    let mut applied = vec![0u64; words];
    let mut value: Option<Vec<u8>> = None;
    let mut seen: HashSet<(Vec<u64>, Option<Vec<u8>>)> = HashSet::new();
    // (call entry, value before it was applied)
    let mut stack: Vec<(usize, Option<Vec<u8>>)> = Vec::new();
    let mut at = list[head].next;
    loop {
        if pending_known == 0 {
            return true;
        }
        if at != end && list[at].call {
            let entry = list[at];
            let op = ops[entry.op];
            let fits = step(&value, &op.op).filter(|(_, out)| {
                op.ret
                    .as_ref()
                    .is_none_or(|(_, observed)| answers(observed, out))
            });
            if let Some((after, _)) = fits {
                let mut next_applied = applied.clone();
                next_applied[entry.op / 64] |= 1 << (entry.op % 64);
                if seen.insert((next_applied.clone(), after.clone())) {
                    stack.push((at, std::mem::replace(&mut value, after)));
                    applied = next_applied;
                    if op.ret.is_some() {
                        pending_known -= 1;
                    }
                    unlink(&mut list, at);
                    unlink(&mut list, ret_of[entry.op]);
                    at = list[head].next;
                    continue;
                }
            }
            at = entry.next;
            continue;
        }
        // A return whose operation has not taken effect (or the end, with only calls of
        // unknown outcome before it): undo the last operation applied and try past it.
        let Some((call, before)) = stack.pop() else {
            return false;
        };
        let op = list[call].op;
        value = before;
        applied[op / 64] &= !(1 << (op % 64));
        if ops[op].ret.is_some() {
            pending_known += 1;
        }
        relink(&mut list, ret_of[op]);
        relink(&mut list, call);
        at = list[call].next;
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn op(client: &str, key: &str, op: Op, call: u64, ret: Option<(u64, Out)>) -> Operation {
        Operation {
            client: client.into(),
            key: key.into(),
            op,
            call_us: call,
            ret,
        }
    }

    fn v(s: &str) -> Vec<u8> {
        s.as_bytes().to_vec()
    }

    fn read(s: Option<&str>) -> Out {
        Out::Value(s.map(v))
    }

    #[test]
    fn sequential_and_concurrent_histories_pass() {
        let h = vec![
            op("a", "k", Op::Set(v("1")), 0, Some((10, Out::Done))),
            op("b", "k", Op::Get, 20, Some((30, read(Some("1"))))),
            // Concurrent set and get: the get may see either value.
            op("a", "k", Op::Set(v("2")), 40, Some((60, Out::Done))),
            op("b", "k", Op::Get, 45, Some((50, read(Some("1"))))),
            op("c", "k", Op::Get, 46, Some((55, read(Some("2"))))),
            op("a", "k", Op::Delete, 70, Some((80, Out::Existed(true)))),
            op("b", "k", Op::Get, 90, Some((95, read(None)))),
        ];
        assert!(check(&h).is_empty());
        // Adds from several clients, overlapping, each sum seen once.
        let adds = vec![
            op("a", "n", Op::Add(1), 0, Some((50, Out::Sum(2)))),
            op("b", "n", Op::Add(1), 10, Some((40, Out::Sum(1)))),
            op("c", "n", Op::Add(1), 60, Some((70, Out::Sum(3)))),
            op(
                "a",
                "n",
                Op::CompareSet {
                    expected: Some(v("3")),
                    desired: v("10"),
                },
                80,
                Some((
                    90,
                    Out::Cas {
                        swapped: true,
                        current: Some(v("10")),
                    },
                )),
            ),
            op("b", "s", Op::Append(v("x")), 0, Some((5, Out::Done))),
            op("c", "s", Op::Append(v("y")), 1, Some((6, Out::Done))),
            op("a", "s", Op::Get, 10, Some((11, read(Some("yx"))))),
        ];
        assert!(check(&adds).is_empty());
    }

    #[test]
    fn a_lost_write_is_caught() {
        let h = vec![
            op("a", "k", Op::Set(v("1")), 0, Some((10, Out::Done))),
            op("a", "k", Op::Set(v("2")), 20, Some((30, Out::Done))),
            // The second write was acknowledged, then lost.
            op("b", "k", Op::Get, 40, Some((50, read(Some("1"))))),
        ];
        let bad = check(&h);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].key, "k");
        assert!(
            bad[0].to_string().contains("admit no linearization"),
            "{}",
            bad[0]
        );
    }

    #[test]
    fn a_stale_read_after_a_failover_is_caught() {
        // Two readers: one sees the new value, a later one (served by a replica that lost
        // the write) the old one.
        let h = vec![
            op("a", "k", Op::Set(v("old")), 0, Some((10, Out::Done))),
            op("a", "k", Op::Set(v("new")), 20, Some((30, Out::Done))),
            op("b", "k", Op::Get, 40, Some((45, read(Some("new"))))),
            op("c", "k", Op::Get, 50, Some((55, read(Some("old"))))),
        ];
        assert_eq!(check(&h).len(), 1);
        // Had the two reads overlapped the write, either order would do.
        let fine = vec![
            op("a", "k", Op::Set(v("old")), 0, Some((10, Out::Done))),
            op("a", "k", Op::Set(v("new")), 20, Some((60, Out::Done))),
            op("b", "k", Op::Get, 40, Some((45, read(Some("old"))))),
            op("c", "k", Op::Get, 50, Some((55, read(Some("new"))))),
        ];
        assert!(check(&fine).is_empty());
    }

    #[test]
    fn an_add_applied_twice_is_caught() {
        // A lane's retry applied again: the counter is one delta ahead of any order of the
        // adds that were made (the at-most-once promise of lanes, checked on the history).
        let h = vec![
            op("a", "n", Op::Add(1), 0, Some((100, Out::Sum(1)))),
            op("b", "n", Op::Add(1), 110, Some((120, Out::Sum(3)))),
        ];
        assert_eq!(check(&h).len(), 1);
        // A compare-and-set that reports a swap against a value the key never had.
        let cas = vec![
            op("a", "k", Op::Set(v("1")), 0, Some((10, Out::Done))),
            op(
                "b",
                "k",
                Op::CompareSet {
                    expected: Some(v("2")),
                    desired: v("3"),
                },
                20,
                Some((
                    30,
                    Out::Cas {
                        swapped: true,
                        current: Some(v("3")),
                    },
                )),
            ),
        ];
        assert_eq!(check(&cas).len(), 1);
    }

    #[test]
    fn a_delete_may_say_absent_after_a_retry_but_not_present_when_absent() {
        // The key existed; the delete answered "did not exist" (its first attempt, applied,
        // lost its answer in a failover, and the retry found the key gone): allowed.
        let retried = vec![
            op("a", "k", Op::Set(v("1")), 0, Some((10, Out::Done))),
            op("b", "k", Op::Delete, 20, Some((30, Out::Existed(false)))),
            op("c", "k", Op::Get, 40, Some((50, read(None)))),
        ];
        assert!(check(&retried).is_empty());
        // Its effect is still checked: a read after it that sees the value is caught.
        let undone = vec![
            op("a", "k", Op::Set(v("1")), 0, Some((10, Out::Done))),
            op("b", "k", Op::Delete, 20, Some((30, Out::Existed(false)))),
            op("c", "k", Op::Get, 40, Some((50, read(Some("1"))))),
        ];
        assert_eq!(check(&undone).len(), 1);
        // And "it existed" must be true.
        let wrong = vec![op("b", "k", Op::Delete, 20, Some((30, Out::Existed(true))))];
        assert_eq!(check(&wrong).len(), 1);
    }

    #[test]
    fn unknown_outcomes_may_have_happened_or_not() {
        // An add whose answer was lost may have applied (the next sum is 2) ...
        let applied = vec![
            op("a", "n", Op::Add(1), 0, None),
            op("b", "n", Op::Add(1), 50, Some((60, Out::Sum(2)))),
        ];
        assert!(check(&applied).is_empty());
        // ... or not (the next sum is 1).
        let not = vec![
            op("a", "n", Op::Add(1), 0, None),
            op("b", "n", Op::Add(1), 50, Some((60, Out::Sum(1)))),
        ];
        assert!(check(&not).is_empty());
        // But not twice.
        let twice = vec![
            op("a", "n", Op::Add(1), 0, None),
            op("b", "n", Op::Add(1), 50, Some((60, Out::Sum(3)))),
        ];
        assert_eq!(check(&twice).len(), 1);
        // Nor before it was called.
        let early = vec![
            op("b", "n", Op::Add(1), 0, Some((10, Out::Sum(2)))),
            op("a", "n", Op::Add(1), 50, None),
        ];
        assert_eq!(check(&early).len(), 1);
    }

    #[test]
    fn keys_are_checked_apart_and_a_long_history_is_quick() {
        // 4 clients, 2,000 overlapping adds on one key and reads of another: the cache keeps
        // the search linear.
        let mut h = Vec::new();
        let mut sum = 0;
        for i in 0..2_000u64 {
            sum += 1;
            let t = i * 10;
            h.push(op(
                &format!("c{}", i % 4),
                "n",
                Op::Add(1),
                t,
                Some((t + 25, Out::Sum(sum))),
            ));
            h.push(op("r", "other", Op::Get, t, Some((t + 1, read(None)))));
        }
        let started = std::time::Instant::now();
        assert!(check(&h).is_empty());
        assert!(started.elapsed() < std::time::Duration::from_secs(5));
        // A bad key does not hide behind a good one.
        h.push(op(
            "x",
            "other",
            Op::Get,
            100_000,
            Some((100_001, read(Some("?")))),
        ));
        let bad = check(&h);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].key, "other");
    }
}
