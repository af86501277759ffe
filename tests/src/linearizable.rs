//! A linearizability checker for key-value histories (issue 28), in the manner of Wing & Gong
//! with Lowe's cache, as porcupine (etcd's robustness tests) does it: each key is checked on
//! its own (a store of independent registers is linearizable when each register is), by a
//! depth-first search over the order in which the operations could have taken effect, each
//! between its call and its return, remembering every (set of operations applied, value)
//! already tried so that no state is searched twice. The set is remembered by a 128-bit
//! Zobrist fingerprint (one random word pair per operation, XORed in and out), not by a
//! bitset: a fault run's key has some 15,000 operations, and a bitset of each state searched
//! took 10 GiB on the long schedule. Two sets sharing a fingerprint by chance (about 2^-128
//! per pair) could only make a history fail, never pass.
//!
//! An operation whose outcome is unknown (the client saw no answer: a connection lost, a
//! timeout) has no return: it may have taken effect at any time after its call, or never, and
//! any result matches. Applying one where it leaves the value as it is (a read, a failed
//! compare-and-set) is never tried: the state without it can do everything that one can. Every
//! answer must be the model's, a delete's "existed" included: the workloads' writes are lane
//! calls, whose retry answers what the first attempt found. Times are the clients' wall clock
//! in microseconds; operations whose times tie count as concurrent (the permissive reading, so
//! a coarse clock never makes a history fail).
//!
//! No crate fitted: `stateright`'s tester checks a history by enumerating interleavings
//! without the state cache (exponential in the length of a fault run's history) and brings an
//! HTTP explorer; `porcupine` is Go.

use std::collections::{BTreeMap, HashMap};
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

/// A key whose operations admit no linearization: the key and its operations by call time.
#[derive(Debug, Clone)]
pub struct NotLinearizable {
    /// The key.
    pub key: String,
    /// Its operations, by call time.
    pub ops: Vec<Operation>,
    /// Where in `ops` the search got stuck at its furthest: the operation whose return no
    /// order of the operations before it could reach.
    pub stuck: usize,
}

impl fmt::Display for NotLinearizable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(
            f,
            "key {:?}: {} operations admit no linearization; the furthest any order got is up to the return of operation {} (marked), shown with its neighbours by call time:",
            self.key,
            self.ops.len(),
            self.stuck
        )?;
        const BEFORE: usize = 30;
        const AFTER: usize = 10;
        let from = self.stuck.saturating_sub(BEFORE);
        let to = (self.stuck + AFTER + 1).min(self.ops.len());
        if from > 0 {
            writeln!(f, "  ... {from} earlier")?;
        }
        for (i, op) in self.ops.iter().enumerate().take(to).skip(from) {
            let mark = if i == self.stuck { ">>" } else { "  " };
            writeln!(f, "{mark}{op}")?;
        }
        if to < self.ops.len() {
            writeln!(f, "  ... and {} more", self.ops.len() - to)?;
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
        .filter_map(|(key, mut ops)| {
            ops.sort_by_key(|o| o.call_us);
            let stuck = linearizable(&ops).err()?;
            Some(NotLinearizable {
                key: key.to_owned(),
                ops: ops.into_iter().cloned().collect(),
                stuck,
            })
        })
        .collect()
}

/// Operation `i`'s random word pair of the Zobrist fingerprint (splitmix64 of `i`, twice):
/// fixed, so that a run is repeatable.
fn fingerprint(i: usize) -> u128 {
    let mix = |mut z: u64| {
        z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let i = i as u64;
    (u128::from(mix(2 * i)) << 64) | u128::from(mix(2 * i + 1))
}

/// One event of a key's known operations: a call or a return.
#[derive(Debug, Clone, Copy)]
struct Entry {
    op: usize,
    call: bool,
    time: u64,
    prev: usize,
    next: usize,
}

/// A state of the search, as the cache remembers it: the fingerprint of the known operations
/// applied and the value. The unknown-outcome operations still pending are kept beside it.
type Key = (u128, Option<Vec<u8>>);

/// One level of the depth-first search: the operations that may take effect next, the next
/// one to try, and the one applied from here (with the value before it), to undo.
struct Frame {
    candidates: Vec<usize>,
    next: usize,
    applied: Option<(usize, Option<Vec<u8>>)>,
}

/// Whether the operations of one key (starting absent) can be ordered so that each takes
/// effect once, between its call and its return, with the results they returned; an
/// operation of unknown outcome takes effect once after its call, or never.
///
/// The known operations' calls and returns are a doubly linked list in time order (Wing &
/// Gong): an operation may take effect next when its call comes before the list's first
/// return. The unknown-outcome operations stay out of the list: one may take effect once
/// called before that first return. The search tries the known operations first, and of the
/// unknown ones that are alike (the same operation with the same argument) only the first
/// called: applying any other instead reaches the same states. A state is skipped when the
/// cache holds one with the same known operations applied, the same value, and every
/// unknown operation still pending here pending there too: that one can do all this one can.
/// Without these, 31 unknown adds of a fault run's counter made the search try their
/// subsets at every step (2^31). When no order exists, the error is the known operation
/// whose return the search could not get past when it had applied the most.
fn linearizable(ops: &[&Operation]) -> Result<(), usize> {
    let known: Vec<usize> = (0..ops.len()).filter(|&i| ops[i].ret.is_some()).collect();
    if known.is_empty() {
        return Ok(());
    }
    let mut unknown: Vec<usize> = (0..ops.len()).filter(|&i| ops[i].ret.is_none()).collect();
    unknown.sort_by_key(|&i| (ops[i].call_us, i));
    // Each unknown operation's class: alike operations share one.
    let mut classes: HashMap<&Op, usize> = HashMap::new();
    let class: Vec<usize> = unknown
        .iter()
        .map(|&i| {
            let next = classes.len();
            *classes.entry(&ops[i].op).or_insert(next)
        })
        .collect();
    // Where each operation is among the unknown ones (for the pending set).
    let mut slot = vec![usize::MAX; ops.len()];
    for (s, &i) in unknown.iter().enumerate() {
        slot[i] = s;
    }

    // Events by time; calls before returns at the same time (ties overlap).
    let mut events: Vec<(u64, bool, usize)> = Vec::with_capacity(2 * known.len());
    for &i in &known {
        let ret = ops[i].ret.as_ref().map_or(u64::MAX, |r| r.0);
        events.push((ops[i].call_us, true, i));
        events.push((ret, false, i));
    }
    events.sort_by_key(|&(t, call, i)| (t, !call, i));
    // A doubly linked list over `events`, with a head sentinel at index `len`.
    let head = events.len();
    let end = events.len();
    let mut list: Vec<Entry> = events
        .iter()
        .enumerate()
        .map(|(i, &(time, call, op))| Entry {
            op,
            call,
            time,
            prev: if i == 0 { head } else { i - 1 },
            next: i + 1,
        })
        .collect();
    list.push(Entry {
        op: usize::MAX,
        call: false,
        time: 0,
        prev: head,
        next: 0,
    });
    let mut call_of = vec![0usize; ops.len()];
    let mut ret_of = vec![0usize; ops.len()];
    for (i, e) in events.iter().enumerate() {
        if e.1 {
            call_of[e.2] = i;
        } else {
            ret_of[e.2] = i;
        }
    }
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

    let zobrist: Vec<u128> = (0..ops.len()).map(fingerprint).collect();
    let mut fingerprint_now: u128 = 0;
    let mut value: Option<Vec<u8>> = None;
    let mut pending_known = known.len();
    // Unknown operations still pending, as a bitset over `unknown`.
    let mut pending = vec![u64::MAX; unknown.len().div_ceil(64)];
    let mut seen: HashMap<Key, Vec<Vec<u64>>> = HashMap::new();
    // The most known operations applied on any path, and the return it stopped at.
    let mut furthest = (0usize, known[0]);

    // The operations that may take effect next: the known calls before the first return,
    // then the first pending unknown operation of each class called by then.
    let candidates = |list: &Vec<Entry>, pending: &[u64]| -> Vec<usize> {
        let mut out = Vec::new();
        let mut at = list[head].next;
        while at != end && list[at].call {
            out.push(list[at].op);
            at = list[at].next;
        }
        let first_return = if at == end { u64::MAX } else { list[at].time };
        let mut classes_taken: Vec<usize> = Vec::new();
        for (s, &i) in unknown.iter().enumerate() {
            if ops[i].call_us > first_return {
                break;
            }
            if pending[s / 64] & (1 << (s % 64)) != 0 && !classes_taken.contains(&class[s]) {
                classes_taken.push(class[s]);
                out.push(i);
            }
        }
        out
    };

    let mut frames = vec![Frame {
        candidates: candidates(&list, &pending),
        next: 0,
        applied: None,
    }];
    while let Some(frame) = frames.last_mut() {
        // Undo what was applied from this level before trying its next candidate.
        if let Some((i, before)) = frame.applied.take() {
            value = before;
            if ops[i].ret.is_some() {
                fingerprint_now ^= zobrist[i];
                pending_known += 1;
                relink(&mut list, ret_of[i]);
                relink(&mut list, call_of[i]);
            } else {
                pending[slot[i] / 64] |= 1 << (slot[i] % 64);
            }
        }
        let Some(&i) = frame.candidates.get(frame.next) else {
            if known.len() - pending_known >= furthest.0 {
                let mut at = list[head].next;
                while at != end && list[at].call {
                    at = list[at].next;
                }
                if at != end {
                    furthest = (known.len() - pending_known, list[at].op);
                }
            }
            frames.pop();
            continue;
        };
        frame.next += 1;
        let op = ops[i];
        let fits = step(&value, &op.op).filter(|(after, out)| match &op.ret {
            Some((_, observed)) => observed == out,
            None => *after != value,
        });
        let Some((after, _)) = fits else {
            continue;
        };
        let (next_fingerprint, mut next_pending) = (fingerprint_now, pending.clone());
        let next_fingerprint = if op.ret.is_some() {
            next_fingerprint ^ zobrist[i]
        } else {
            next_pending[slot[i] / 64] &= !(1 << (slot[i] % 64));
            next_fingerprint
        };
        let known_sets = seen.entry((next_fingerprint, after.clone())).or_default();
        let covered = known_sets
            .iter()
            .any(|there| there.iter().zip(&next_pending).all(|(t, h)| h & !t == 0));
        if covered {
            continue;
        }
        known_sets.push(next_pending.clone());
        frame.applied = Some((i, std::mem::replace(&mut value, after)));
        fingerprint_now = next_fingerprint;
        pending = next_pending;
        if op.ret.is_some() {
            pending_known -= 1;
            unlink(&mut list, call_of[i]);
            unlink(&mut list, ret_of[i]);
        }
        if pending_known == 0 {
            return Ok(());
        }
        frames.push(Frame {
            candidates: candidates(&list, &pending),
            next: 0,
            applied: None,
        });
    }
    Err(furthest.1)
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
    fn a_delete_must_say_whether_the_key_existed() {
        // Deletes are lane calls: a retry whose first attempt was applied answers what that
        // attempt found, so "did not exist" about a key that existed is caught (as it was
        // allowed before deletes were on lanes).
        let set = || op("a", "k", Op::Set(v("1")), 0, Some((10, Out::Done)));
        let right = vec![
            set(),
            op("b", "k", Op::Delete, 20, Some((30, Out::Existed(true)))),
            op("c", "k", Op::Get, 40, Some((50, read(None)))),
        ];
        assert!(check(&right).is_empty());
        let absent = vec![
            set(),
            op("b", "k", Op::Delete, 20, Some((30, Out::Existed(false)))),
            op("c", "k", Op::Get, 40, Some((50, read(None)))),
        ];
        assert_eq!(check(&absent).len(), 1);
        // Its effect is checked: a read after it that sees the value is caught.
        let undone = vec![
            set(),
            op("b", "k", Op::Delete, 20, Some((30, Out::Existed(true)))),
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

    #[test]
    fn many_unknown_outcomes_stay_quick_whether_the_history_passes_or_not() {
        // A counter with 4 clients, 2,000 overlapping adds and 31 adds of unknown outcome
        // along the way, none applied (the fault run's counter that took 10 GiB): quick.
        let mut h = Vec::new();
        let mut sum = 0;
        for i in 0..2_000u64 {
            let t = i * 10;
            if i % 64 == 0 && i / 64 < 31 {
                h.push(op("k", "n", Op::Add(1), t, None));
            }
            sum += 1;
            h.push(op(
                &format!("c{}", i % 4),
                "n",
                Op::Add(1),
                t,
                Some((t + 25, Out::Sum(sum))),
            ));
        }
        // Registers too: 12 writes of unknown outcome, overwritten, and reads.
        for i in 0..1_000u64 {
            let t = i * 10;
            if i % 80 == 0 {
                h.push(op("k", "r", Op::Set(v(&format!("lost{i}"))), t, None));
            }
            h.push(op(
                "w",
                "r",
                Op::Set(v(&i.to_string())),
                t,
                Some((t + 4, Out::Done)),
            ));
            h.push(op(
                "g",
                "r",
                Op::Get,
                t + 5,
                Some((t + 6, read(Some(&i.to_string())))),
            ));
        }
        let started = std::time::Instant::now();
        assert!(check(&h).is_empty());
        // One sum off by 2 late in the run: no order explains it, found as quickly.
        let last = h
            .iter_mut()
            .rev()
            .find(|o| o.key == "n" && o.ret.is_some())
            .unwrap();
        last.ret = Some((last.ret.as_ref().unwrap().0, Out::Sum(sum + 40)));
        let bad = check(&h);
        assert_eq!(bad.len(), 1);
        assert_eq!(bad[0].key, "n");
        assert!(
            started.elapsed() < std::time::Duration::from_secs(10),
            "{:?}",
            started.elapsed()
        );
    }
}
