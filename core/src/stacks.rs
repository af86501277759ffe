//! Ranks' stacks made readable: library frames folded, ranks grouped by where their main
//! threads stand, and the ranks elsewhere than the waiting majority named as the likely cause.
//!
//! A frame's origin is read from its module and file path:
//! - a module (the shared object or program of a native frame: C, C++, Rust), or no file (a
//!   frame the reader could not place): native, shown as its function and module
//!   (`c10d::Work::wait (libtorch_cpu.so)`; templates and argument lists left out unless
//!   `full`); consecutive frames of one shared library fold like a Python library's, the
//!   program's own are kept;
//! - under the last `site-packages/` or `dist-packages/` component: the library named by the
//!   top-level package below it (`torch`, `accelerate`, `muster`, `numpy`, ...);
//! - under a `muster/` directory whose parent is `python/`: muster's Python package run from a
//!   source checkout (`worker-sdk/python/python/muster/`), the library `muster`;
//! - under `lib/python3.N/` (or `lib64/`), or a `<frozen module>` file: Python's standard
//!   library, the library `stdlib`;
//! - anything else: the user's own code (a library run from a source checkout included).
//!
//! A library frame is shown as the dotted path of its module's directory below the library's
//! root, then the function (`torch.distributed.barrier`); a module file at the root is named by
//! itself (`threading.wait`). A user frame is shown as `file:line function (source)`.

use muster_proto::v1 as pb;
use std::cmp::Reverse;
use std::collections::HashMap;
use std::fmt::Write as _;
use std::hash::{DefaultHasher, Hash, Hasher};

/// The library name of Python's standard library.
const STDLIB: &str = "stdlib";

/// Function names of decorators' inner functions: a run's entry point by one of these names
/// says nothing the innermost frame does not, so folding drops it.
const WRAPPERS: &[&str] = &[
    "wrapper",
    "inner",
    "_fn",
    "wrapped",
    "decorate_context",
    "<lambda>",
];

/// The most frames a group's line shows when not `full`: the innermost [`LINE_INNER`], a
/// `...`, and the outermost one.
const LINE_FRAMES: usize = 8;
/// The innermost frames a shortened line keeps.
const LINE_INNER: usize = 6;

/// Where a frame's code comes from.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Origin<'a> {
    /// A native frame (its module's file name, empty when unknown), or one the reader could
    /// not place.
    Native { module: &'a str },
    /// The user's own code.
    User,
    /// A library: its name (its top-level package, or [`STDLIB`]) and the dotted path of the
    /// frame's module directory.
    Library { name: &'a str, module: String },
}

/// Whether `file` is a library's (an installed package, muster's, or Python's standard
/// library) rather than the user's own code or a native frame: the agent reads the source line
/// of the innermost frame that is not.
pub fn is_library(file: &str) -> bool {
    matches!(classify(file), Origin::Library { .. })
}

/// Where a frame's code comes from: native when it names a module, else by its file.
fn origin(frame: &pb::StackFrame) -> Origin<'_> {
    if frame.module.is_empty() {
        classify(&frame.file)
    } else {
        Origin::Native {
            module: frame.module.rsplit('/').next().unwrap_or(&frame.module),
        }
    }
}

/// A thread's frames (innermost first) as text, innermost first.
///
/// Unless `full`, each run of consecutive frames of one library is folded to its innermost
/// frame and its entry point (the run's outermost frame); the entry is left out when it reads
/// the same as the innermost or is a decorator's wrapper. The user's own frames and native
/// frames are always kept.
pub fn fold(frames: &[pb::StackFrame], full: bool) -> Vec<String> {
    let origins: Vec<Origin<'_>> = frames.iter().map(origin).collect();
    if full {
        return frames
            .iter()
            .zip(&origins)
            .map(|(f, o)| render(f, o, true))
            .collect();
    }
    let mut out = Vec::new();
    let mut start = 0;
    while start < frames.len() {
        let end = run_end(&origins, start);
        let inner = render(&frames[start], &origins[start], false);
        let entry = (end - start > 1)
            .then(|| &frames[end - 1])
            .filter(|f| !WRAPPERS.contains(&last_segment(&f.function)))
            .map(|f| render(f, &origins[end - 1], false))
            .filter(|text| *text != inner);
        out.push(inner);
        out.extend(entry);
        start = end;
    }
    out
}

/// Whether a thread stands in a known wait, judged by its innermost library run (the frames
/// from the innermost Python frame on, while they are of one library; leading native frames
/// are skipped). It waits when any frame of that run is in `torch.distributed` (a collective,
/// a barrier, a store wait), in muster's package, is accelerate's `wait_for_everyone`, or is
/// a standard-library wait: threading `wait`/`acquire`/`join`, queue `get`,
/// concurrent.futures `result`/`wait`, selectors `select`, and multiprocessing's connection
/// and queue waits (`wait`, `poll`, `recv`, `recv_bytes`, `get`, `join`, `acquire`).
///
/// A user frame innermost is not a wait, even when the line calls one: a C function such as
/// `time.sleep` has no Python frame, so the user's line is all a reader sees of it.
pub fn is_wait(frames: &[pb::StackFrame]) -> bool {
    let origins: Vec<Origin<'_>> = frames.iter().map(origin).collect();
    let Some(start) = origins
        .iter()
        .position(|o| !matches!(o, Origin::Native { .. }))
    else {
        return false;
    };
    let Origin::Library { name, .. } = &origins[start] else {
        return false;
    };
    (start..run_end(&origins, start)).any(|i| match &origins[i] {
        Origin::Library { module, .. } => waits(name, module, &frames[i].function),
        _ => false,
    })
}

/// Whether the frames stand where ranks wait for each other: a wait ([`is_wait`]), or a
/// backward pass (torch's autograd, where DDP all-reduces the gradients, so a rank that
/// waits for a slower one spends its wait there). The straggler view counts these samples.
pub fn is_sync(frames: &[pb::StackFrame]) -> bool {
    is_wait(frames)
        || frames.iter().any(|f| match origin(f) {
            Origin::Library { name, module } => {
                name == "torch"
                    && (module.starts_with("torch.autograd") || f.function.ends_with("backward"))
            }
            _ => false,
        })
}

/// Where a thread stands, in one folded frame: its innermost frame of the user's own code,
/// else its innermost folded frame (`train.py:21 load_batch (time.sleep(0.03))`).
pub fn site(frames: &[pb::StackFrame]) -> String {
    match frames
        .iter()
        .find(|f| !f.file.is_empty() && origin(f) == Origin::User)
    {
        Some(f) => fold(std::slice::from_ref(f), true).remove(0),
        None => fold(frames, false).into_iter().next().unwrap_or_default(),
    }
}

/// Where a thread waits, in one line: the wait's innermost folded frame, and the user's line
/// it was called from when there is one (`torch.autograd._engine_run_backward <-
/// train.py:30 train_step`).
pub fn wait_site(frames: &[pb::StackFrame]) -> String {
    let inner = fold(frames, false).into_iter().next().unwrap_or_default();
    let user = site(frames);
    if user.is_empty() || user == inner {
        inner
    } else {
        format!("{inner} <- {user}")
    }
}

/// The fewest samples per rank before the straggler view judges.
pub const STRAGGLER_MIN_SAMPLES: u32 = 16;
/// How much less than the others' median share of samples in waits a rank must wait to be
/// named, and how much less than every other rank.
pub const STRAGGLER_GAP: f64 = 0.3;
const STRAGGLER_MARGIN: f64 = 0.15;

/// The rank the others wait for, from the ranks' recent samples, and the evidence: the rank
/// that waits least, when it waits at least [`STRAGGLER_GAP`] less than the others' median
/// and clearly less than each of them, every rank having [`STRAGGLER_MIN_SAMPLES`]. In a
/// balanced job every rank waits about as much, and nobody is named.
pub fn straggler(samples: &[pb::RankSample]) -> Option<(u32, String)> {
    if samples.len() < 2
        || samples
            .iter()
            .any(|s| s.rank.is_none() || s.samples < STRAGGLER_MIN_SAMPLES)
    {
        return None;
    }
    let low = samples
        .iter()
        .min_by(|a, b| a.waiting_share.total_cmp(&b.waiting_share))?;
    let mut others: Vec<f64> = samples
        .iter()
        .filter(|s| s.rank != low.rank)
        .map(|s| s.waiting_share)
        .collect();
    others.sort_by(f64::total_cmp);
    let median = others[others.len() / 2];
    let next = others[0];
    if median - low.waiting_share < STRAGGLER_GAP || next - low.waiting_share < STRAGGLER_MARGIN {
        return None;
    }
    let rank = low.rank?;
    // Where the others wait most: the most common of their waiting spots.
    let mut spots: HashMap<&str, usize> = HashMap::new();
    for s in samples
        .iter()
        .filter(|s| s.rank != low.rank && !s.waiting_at.is_empty())
    {
        *spots.entry(s.waiting_at.as_str()).or_default() += 1;
    }
    let mut spots: Vec<(&str, usize)> = spots.into_iter().collect();
    spots.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(b.0)));
    let pct = |x: f64| (x * 100.0).round() as u32;
    let mut line = format!(
        "rank {rank} waits in {}% of its samples, the others in {}% (median)",
        pct(low.waiting_share),
        pct(median)
    );
    if !low.busy_at.is_empty() {
        let _ = write!(
            line,
            "; it spends {}% at {}",
            pct(low.busy_share),
            low.busy_at
        );
    }
    if let Some((spot, _)) = spots.first() {
        let _ = write!(line, "; the others wait at {spot}");
    }
    Some((rank, line))
}

/// Ranks as people write them: sorted, each once, consecutive ranks as a range
/// (`0,2-7`).
pub fn ranks_text(ranks: &[u32]) -> String {
    let mut sorted = ranks.to_vec();
    sorted.sort_unstable();
    sorted.dedup();
    let mut text = String::new();
    let mut i = 0;
    while i < sorted.len() {
        let mut j = i;
        while j + 1 < sorted.len() && sorted[j + 1] == sorted[j] + 1 {
            j += 1;
        }
        if !text.is_empty() {
            text.push(',');
        }
        if j > i {
            let _ = write!(text, "{}-{}", sorted[i], sorted[j]);
        } else {
            let _ = write!(text, "{}", sorted[i]);
        }
        i = j + 1;
    }
    text
}

/// A hash of what a rank is doing, for the agent's sampler to tell whether a rank's stack
/// changed between samples: every thread's frames (function, file, line), `native` and
/// `error`. What changes without the rank moving (`unchanged_ms`, `waiting_share`, the source
/// text, pids, thread ids and names, whether a thread was active) is left out.
///
/// Stable within one build of muster, not across builds: never store or send it.
pub fn fingerprint(stack: &pb::RankStack) -> u64 {
    let mut h = DefaultHasher::new();
    stack.threads.len().hash(&mut h);
    for thread in &stack.threads {
        thread.frames.len().hash(&mut h);
        for f in &thread.frames {
            (&f.function, &f.file, f.line).hash(&mut h);
        }
    }
    stack.native.hash(&mut h);
    stack.error.hash(&mut h);
    h.finish()
}

/// The grouped view: ranks whose main threads stand at the same folded stack, one group each,
/// the likely causes first, then by size (largest first), ties by lowest rank.
///
/// The waiting majority is the largest group whose main thread [`is_wait`] (ties: the group
/// holding the lowest rank). When there is one, every other group whose ranks could be read is
/// a likely cause; when no group waits, none is. A rank that cannot be read stands as
/// `cannot read: {error}`, a process that is not Python as `not Python: {native}`, a Python
/// process without threads as `no Python thread` and a main thread without frames as
/// `no Python frame`. A rank without a rank number is left out. `world_size` is the "of N" in
/// each line (at least the number of ranks given).
pub fn group(ranks: &[pb::RankStack], world_size: u32, full: bool) -> Vec<pb::StackGroup> {
    let mut sorted: Vec<(u32, &pb::RankStack)> =
        ranks.iter().filter_map(|r| Some((r.rank?, r))).collect();
    sorted.sort_by_key(|(rank, _)| *rank);
    sorted.dedup_by_key(|(rank, _)| *rank);

    let mut drafts: Vec<Draft> = Vec::new();
    let mut index: HashMap<Vec<String>, usize> = HashMap::new();
    for (rank, stack) in &sorted {
        let key = key(stack, full);
        match index.get(&key) {
            Some(&i) => {
                let d = &mut drafts[i];
                d.ranks.push(*rank);
                d.unchanged_ms = d.unchanged_ms.min(stack.unchanged_ms);
            }
            None => {
                index.insert(key.clone(), drafts.len());
                drafts.push(Draft {
                    native_lead: native_lead(stack, full),
                    frames: key,
                    ranks: vec![*rank],
                    unchanged_ms: stack.unchanged_ms,
                    readable: stack.error.is_empty(),
                    // Ranks are taken in order, so this is the group's lowest rank's stack.
                    waits: stack.error.is_empty()
                        && stack.threads.first().is_some_and(|t| is_wait(&t.frames)),
                });
            }
        }
    }

    let majority = drafts
        .iter()
        .enumerate()
        .filter(|(_, d)| d.waits)
        .max_by_key(|(_, d)| (d.ranks.len(), Reverse(d.ranks.first().copied())))
        .map(|(i, _)| i);
    let world = world_size.max(u32::try_from(sorted.len()).unwrap_or(u32::MAX));

    let mut groups: Vec<pb::StackGroup> = drafts
        .into_iter()
        .enumerate()
        .map(|(i, d)| {
            let likely_cause = majority.is_some_and(|m| m != i) && d.readable;
            let line = line(&d, likely_cause, world, full);
            pb::StackGroup {
                ranks: d.ranks,
                frames: d.frames,
                likely_cause,
                unchanged_ms: d.unchanged_ms,
                line,
            }
        })
        .collect();
    groups.sort_by_key(|g| {
        (
            !g.likely_cause,
            Reverse(g.ranks.len()),
            g.ranks.first().copied(),
        )
    });
    groups
}

/// The grouped view as text, what `muster-agent describe --stacks` prints: each group's line,
/// then `no answer from {node}` for each node that did not answer; `no ranks running` when
/// there is neither. Lines are joined by newlines, with none after the last.
pub fn report(groups: &[pb::StackGroup], unanswered: &[String]) -> String {
    if groups.is_empty() && unanswered.is_empty() {
        return "no ranks running".to_owned();
    }
    let lines = groups
        .iter()
        .map(|g| g.line.clone())
        .chain(unanswered.iter().map(|n| format!("no answer from {n}")));
    lines.collect::<Vec<_>>().join("\n")
}

/// The Python ranks of a native dump whose native frames could not be read, as report lines
/// (`rank 3: no native frames: ...`), ranks with one reason together.
pub fn native_notes(ranks: &[pb::RankStack]) -> Vec<String> {
    by_text(ranks, |r| {
        (has_python(r) && !r.native.is_empty()).then_some(r.native.as_str())
    })
    .into_iter()
    .map(|(why, ranks)| format!("{}: {why}", who(&ranks)))
    .collect()
}

/// The Python ranks whose stacks were read and whose process the kernel has stopped, in
/// uninterruptible I/O or a zombie (`RankStack.process_state`), as report lines (`rank 1: its
/// process is stopped ...`), ranks in one state together: their stacks say where they are, not
/// that they do not run. A rank that is not Python is left out (its group's line says its
/// state already), and so is one that could not be read (its line says why).
pub fn state_notes(ranks: &[pb::RankStack]) -> Vec<String> {
    by_text(ranks, |r| {
        let python = r.error.is_empty() && (r.native.is_empty() || has_python(r));
        (python && !r.process_state.is_empty()).then_some(r.process_state.as_str())
    })
    .into_iter()
    .map(|(state, ranks)| {
        let whose = if ranks.len() == 1 {
            "its process is"
        } else {
            "their processes are"
        };
        format!("{}: {whose} {state}", who(&ranks))
    })
    .collect()
}

/// The ranks for which `text` says something, grouped by what it says, in the order each text
/// first appears (the ranks in the order given).
fn by_text<'a>(
    ranks: &'a [pb::RankStack],
    text: impl Fn(&'a pb::RankStack) -> Option<&'a str>,
) -> Vec<(&'a str, Vec<u32>)> {
    let mut groups: Vec<(&str, Vec<u32>)> = Vec::new();
    for r in ranks {
        let (Some(rank), Some(t)) = (r.rank, text(r)) else {
            continue;
        };
        match groups.iter_mut().find(|(seen, _)| *seen == t) {
            Some((_, ranks)) => ranks.push(rank),
            None => groups.push((t, vec![rank])),
        }
    }
    groups
}

/// What torch's Flight Recorder says of the ranks (`RankStack.collectives`), as report
/// lines: for each process group, each distinct last collective with its ranks, then the
/// verdict, if any: the ranks behind the others in the group's sequence (the likely cause
/// of a hang: the others wait in a collective they never entered), or, where every rank
/// reached the same sequence number, ranks that disagree on what that collective is (one
/// called another operation or other sizes). Ranks whose recorder could not be read are
/// named with why, once per reason, where some rank's could (a job that never uses
/// torch.distributed gets nothing). Empty where no rank has anything to say.
pub fn collectives(ranks: &[pb::RankStack]) -> Vec<String> {
    // Ranks whose recorder answered with no entry: at sequence 0 in every group.
    let mut none_yet: Vec<u32> = vec![];
    // Process group -> rank -> its last collective there.
    let mut groups: std::collections::BTreeMap<&str, Vec<(u32, &pb::Collective)>> =
        Default::default();
    let mut unread: std::collections::BTreeMap<&str, Vec<u32>> = Default::default();
    for stack in ranks {
        let Some(rank) = stack.rank else { continue };
        if stack.flight_recorder == NO_COLLECTIVE {
            none_yet.push(rank);
        } else if !stack.flight_recorder.is_empty() {
            unread
                .entry(stack.flight_recorder.as_str())
                .or_default()
                .push(rank);
        }
        let mut last: HashMap<&str, &pb::Collective> = HashMap::new();
        for c in stack.collectives.iter().filter(|c| !c.p2p) {
            let slot = last.entry(c.process_group.as_str()).or_insert(c);
            if c.seq >= slot.seq {
                *slot = c;
            }
        }
        for (pg, c) in last {
            groups.entry(pg).or_default().push((rank, c));
        }
    }
    let what = |c: &pb::Collective| {
        let mut text = format!("#{} {}", c.seq, c.op);
        if !c.input_sizes.is_empty() {
            let _ = write!(text, " {}", c.input_sizes.join(" "));
        }
        text
    };
    let mut lines = vec![];
    if groups.is_empty() {
        return lines;
    }
    for (pg, mut at) in groups {
        at.sort_by_key(|(rank, _)| *rank);
        // Distinct last collectives, the lowest sequence first.
        let mut distinct: Vec<(String, u64, Vec<u32>, &str)> = vec![];
        for (rank, c) in &at {
            let text = what(c);
            match distinct.iter_mut().find(|d| d.0 == text) {
                Some(d) => d.2.push(*rank),
                None => distinct.push((text, c.seq, vec![*rank], c.state.as_str())),
            }
        }
        distinct.sort_by_key(|d| (d.1, d.2.first().copied()));
        for (text, _, ranks, state) in &distinct {
            lines.push(format!(
                "flight recorder ({pg}): {} last called collective {text} ({state})",
                who(ranks)
            ));
        }
        if !none_yet.is_empty() {
            distinct.insert(0, ("none".to_owned(), 0, none_yet.clone(), ""));
            lines.push(format!(
                "flight recorder ({pg}): {} called no collective yet",
                who(&none_yet)
            ));
        }
        let top = at.iter().map(|(_, c)| c.seq).max().unwrap_or(0);
        let mut behind: Vec<u32> = at
            .iter()
            .filter(|(_, c)| c.seq < top)
            .map(|(r, _)| *r)
            .chain(none_yet.iter().copied())
            .collect();
        behind.sort_unstable();
        if !behind.is_empty() {
            let (is, its) = if behind.len() == 1 {
                ("is", "its last collective is")
            } else {
                ("are", "their last collectives are")
            };
            let theirs: Vec<String> = distinct
                .iter()
                .filter(|d| d.1 < top)
                .map(|d| {
                    if d.0 == "none" {
                        "none".to_owned()
                    } else {
                        format!("#{}", d.1)
                    }
                })
                .collect();
            let said = if theirs.iter().all(|t| t == "none") {
                if behind.len() == 1 {
                    "it has"
                } else {
                    "they have"
                }
                .to_owned()
                    + " called no collective yet"
            } else {
                format!("{its} {}", theirs.join(", "))
            };
            lines.push(format!(
                "flight recorder: rank{} {} {is} behind in {pg}: {said}, the others reached #{top}",
                if behind.len() == 1 { "" } else { "s" },
                ranks_text(&behind),
            ));
        } else if distinct.len() > 1 {
            let sides: Vec<String> = distinct
                .iter()
                .map(|(text, _, ranks, _)| {
                    let op = text.split_once(' ').map_or(text.as_str(), |(_, rest)| rest);
                    format!("{} {op}", ranks_text(ranks))
                })
                .collect();
            lines.push(format!(
                "flight recorder: the ranks disagree on collective #{top} of {pg}: {}",
                sides.join("; ")
            ));
        }
    }
    for (why, ranks) in unread {
        lines.push(format!("flight recorder: {}: {why}", who(&ranks)));
    }
    lines
}

/// What a Flight Recorder that answered with no entry says (`RankStack.flight_recorder`):
/// the rank has called no collective yet.
pub const NO_COLLECTIVE: &str = "no collective recorded yet";

/// `rank 3` or `ranks 0,2`.
fn who(ranks: &[u32]) -> String {
    match ranks.len() {
        1 => format!("rank {}", ranks_text(ranks)),
        _ => format!("ranks {}", ranks_text(ranks)),
    }
}

/// A group while ranks are added to it.
struct Draft {
    frames: Vec<String>,
    /// How many of `frames` are a Python stack's innermost native frames (a native dump):
    /// shown in full before the line's cut, which applies to the Python frames after them.
    native_lead: usize,
    /// In ascending order.
    ranks: Vec<u32>,
    unchanged_ms: u64,
    /// Whether its ranks could be read (no `error`).
    readable: bool,
    /// Whether its lowest rank's main thread waits.
    waits: bool,
}

/// How many folded frames a readable Python rank's main thread has before its innermost
/// Python frame (0 for a rank without native or without Python frames).
fn native_lead(stack: &pb::RankStack, full: bool) -> usize {
    let Some(main) = stack.threads.first().filter(|_| stack.error.is_empty()) else {
        return 0;
    };
    let n = main
        .frames
        .iter()
        .take_while(|f| !f.module.is_empty())
        .count();
    if n == main.frames.len() {
        0
    } else {
        fold(&main.frames[..n], full).len()
    }
}

/// Whether a rank's stack has a Python frame (one with a file and no module).
fn has_python(stack: &pb::RankStack) -> bool {
    stack
        .threads
        .iter()
        .flat_map(|t| &t.frames)
        .any(|f| f.module.is_empty() && !f.file.is_empty())
}

/// What a rank is grouped by: its main thread's folded frames (after what the program is,
/// for one that is not Python), or the one line saying why there are none.
fn key(stack: &pb::RankStack, full: bool) -> Vec<String> {
    if !stack.error.is_empty() {
        return vec![format!("cannot read: {}", stack.error)];
    }
    let python = stack.native.is_empty() || has_python(stack);
    match stack.threads.first() {
        Some(main) if !python => std::iter::once(format!("not Python: {}", stack.native))
            .chain(fold(&main.frames, full))
            .collect(),
        Some(main) => {
            let frames = fold(&main.frames, full);
            if frames.is_empty() {
                vec!["no Python frame".to_owned()]
            } else {
                frames
            }
        }
        None if !stack.native.is_empty() => vec![format!("not Python: {}", stack.native)],
        None => vec!["no Python thread".to_owned()],
    }
}

/// A group's line of the report.
fn line(d: &Draft, likely_cause: bool, world: u32, full: bool) -> String {
    let ranks = ranks_text(&d.ranks);
    let mut text = match (likely_cause, d.ranks.len()) {
        (true, 1) => format!("rank {ranks} is elsewhere: "),
        (true, _) => format!("ranks {ranks} are elsewhere: "),
        (false, 1) => format!("rank {ranks} (1 of {world}): "),
        (false, n) => format!("ranks {ranks} ({n} of {world}): "),
    };
    let (lead, rest) = d.frames.split_at(d.native_lead.min(d.frames.len()));
    if full || rest.len() <= LINE_FRAMES {
        text.push_str(&d.frames.join(" <- "));
    } else {
        let shown: Vec<&str> = lead
            .iter()
            .chain(&rest[..LINE_INNER])
            .map(String::as_str)
            .chain(["..."])
            .chain(rest.last().map(String::as_str))
            .collect();
        text.push_str(&shown.join(" <- "));
    }
    text.push_str(&for_text(d.unchanged_ms));
    text
}

/// `, for 42 s`: how long a stack stood still, rounded down; empty when unknown (0).
fn for_text(ms: u64) -> String {
    match ms {
        0 => String::new(),
        1..1000 => format!(", for 0.{} s", ms / 100),
        1000..120_000 => format!(", for {} s", ms / 1000),
        _ => match (ms / 60_000, ms / 1000 % 60) {
            (min, 0) => format!(", for {min} min"),
            (min, s) => format!(", for {min} min {s} s"),
        },
    }
}

/// Whether a native frame's module (a file name) is a shared library (`libc.so.6`) rather
/// than the program itself, whose frames are the user's own and are kept.
fn is_shared_library(module: &str) -> bool {
    module.contains(".so")
}

/// Where the run of frames starting at `start` ends (exclusive): consecutive frames of the
/// same library, or native frames of the same shared library, form one run; any other frame
/// is a run by itself.
fn run_end(origins: &[Origin<'_>], start: usize) -> usize {
    let same = |o: &Origin<'_>| match (&origins[start], o) {
        (Origin::Library { name, .. }, Origin::Library { name: n, .. }) => n == name,
        (Origin::Native { module }, Origin::Native { module: m }) => {
            is_shared_library(module) && m == module
        }
        _ => false,
    };
    start + 1 + origins[start + 1..].iter().take_while(|o| same(o)).count()
}

/// Whether a frame of a library is one of its known waits.
fn waits(library: &str, module: &str, function: &str) -> bool {
    let f = last_segment(function);
    match library {
        "torch" => module == "torch.distributed" || module.starts_with("torch.distributed."),
        "muster" => true,
        "accelerate" => f == "wait_for_everyone",
        STDLIB => match module {
            "threading" => matches!(f, "wait" | "acquire" | "join"),
            "queue" => f == "get",
            "concurrent.futures" => matches!(f, "result" | "wait"),
            "selectors" => f == "select",
            "multiprocessing" => matches!(
                f,
                "wait"
                    | "poll"
                    | "_poll"
                    | "recv"
                    | "_recv"
                    | "recv_bytes"
                    | "_recv_bytes"
                    | "get"
                    | "join"
                    | "acquire"
            ),
            _ => false,
        },
        _ => false,
    }
}

/// A frame as text: see the module's doc (`full`: a native function's name as it is).
fn render(frame: &pb::StackFrame, origin: &Origin<'_>, full: bool) -> String {
    let function = if frame.function.is_empty() {
        "?"
    } else {
        &frame.function
    };
    match origin {
        Origin::Native { module } => {
            let mut text = if full {
                function.to_owned()
            } else {
                short_native(function)
            };
            let file = frame.file.rsplit('/').next().unwrap_or(&frame.file);
            match (module.is_empty(), file.is_empty() || frame.line == 0) {
                (true, true) => {}
                (false, true) => {
                    let _ = write!(text, " ({module})");
                }
                (true, false) => {
                    let _ = write!(text, " ({file}:{})", frame.line);
                }
                (false, false) => {
                    let _ = write!(text, " ({module} {file}:{})", frame.line);
                }
            }
            text
        }
        Origin::Library { module, .. } => format!("{module}.{function}"),
        Origin::User => {
            let base = frame.file.rsplit('/').next().unwrap_or(&frame.file);
            let mut text = format!("{base}:{} {function}", frame.line);
            let source = frame.source.trim();
            if !source.is_empty() {
                let _ = write!(text, " ({source})");
            }
            text
        }
    }
}

/// A demangled C++ or Rust name without its template arguments and parameter lists
/// (`pybind11::cpp_function::initialize<...>::{lambda(...)#1}::_FUN` reads
/// `pybind11::cpp_function::initialize::{lambda#1}::_FUN`), and without a Rust symbol's hash.
/// A Rust trait method's leading `<Type as Trait>` keeps its two names.
fn short_native(function: &str) -> String {
    let mut out = String::with_capacity(function.len());
    let (mut angle, mut paren) = (0usize, 0usize);
    // The depth of angle brackets whose text is kept: 1 inside a leading `<Type as Trait>`.
    let kept = usize::from(function.starts_with('<'));
    let bytes = function.as_bytes();
    for (i, c) in function.char_indices() {
        let visible = angle <= kept && paren == 0;
        match c {
            // `operator<` and `operator()` are names, not brackets; `->` is an arrow.
            '<' if !function[..i].ends_with("operator")
                && !function[..i].ends_with("operator<") =>
            {
                angle += 1;
                if angle <= kept && paren == 0 {
                    out.push(c);
                }
            }
            '>' if angle > 0 && !(i > 0 && bytes[i - 1] == b'-') => {
                angle -= 1;
                if angle < kept && paren == 0 {
                    out.push(c);
                }
            }
            '(' if !function[..i].ends_with("operator") => paren += 1,
            ')' if paren > 0 => paren -= 1,
            _ if visible => out.push(c),
            _ => {}
        }
    }
    // A Rust legacy symbol's hash (`::h0123456789abcdef`).
    if let Some((head, hash)) = out.rsplit_once("::h")
        && hash.len() == 16
        && hash.bytes().all(|b| b.is_ascii_hexdigit())
    {
        out.truncate(head.len());
    }
    if out.is_empty() {
        function.to_owned()
    } else {
        out
    }
}

/// Where a file's code comes from: see the module's doc.
fn classify(file: &str) -> Origin<'_> {
    if file.is_empty() {
        return Origin::Native { module: "" };
    }
    if let Some(module) = file
        .strip_prefix("<frozen ")
        .and_then(|m| m.strip_suffix('>'))
    {
        let parts: Vec<&str> = module.split('.').collect();
        return Origin::Library {
            name: STDLIB,
            module: module_path(&parts),
        };
    }
    let parts: Vec<&str> = file.split('/').collect();
    if let Some(i) = parts
        .iter()
        .rposition(|p| *p == "site-packages" || *p == "dist-packages")
        && let Some(origin) = library(&parts[i + 1..], None)
    {
        return origin;
    }
    if let Some(i) = parts.iter().rposition(|p| *p == "muster")
        && i > 0
        && parts[i - 1] == "python"
        && let Some(origin) = library(&parts[i..], None)
    {
        return origin;
    }
    if let Some(i) = parts
        .windows(2)
        .rposition(|w| matches!(w[0], "lib" | "lib64") && is_python_dir(w[1]))
        && let Some(origin) = library(&parts[i + 2..], Some(STDLIB))
    {
        return origin;
    }
    Origin::User
}

/// The library of a file at `rest` below a library root (`torch/distributed/x.py`), named by
/// its top-level package unless `name` is given; `None` when there is no file below the root.
fn library<'a>(rest: &[&'a str], name: Option<&'a str>) -> Option<Origin<'a>> {
    let top = rest.first()?;
    Some(Origin::Library {
        name: name.unwrap_or_else(|| stem(top)),
        module: module_path(rest),
    })
}

/// The dotted module directory of a file at `rest` below a library root; a module file at
/// the root is named by itself.
fn module_path(rest: &[&str]) -> String {
    match rest {
        [file] => stem(file).to_owned(),
        [dirs @ .., _] => dirs.join("."),
        [] => String::new(),
    }
}

/// A file name without its extension.
fn stem(file: &str) -> &str {
    file.split('.').next().unwrap_or(file)
}

/// Whether a directory is a Python 3 install's library (`python3.11`, `python3.13t`).
fn is_python_dir(dir: &str) -> bool {
    dir.strip_prefix("python3.")
        .map(|v| v.strip_suffix('t').unwrap_or(v))
        .is_some_and(|v| !v.is_empty() && v.bytes().all(|b| b.is_ascii_digit()))
}

/// The last part of a qualified function name (`Accelerator.wait_for_everyone`).
fn last_segment(function: &str) -> &str {
    function.rsplit('.').next().unwrap_or(function)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SITE: &str = "/v/lib/python3.11/site-packages";

    fn frame(file: &str, line: u32, function: &str) -> pb::StackFrame {
        pb::StackFrame {
            function: function.to_owned(),
            file: file.to_owned(),
            line,
            ..Default::default()
        }
    }

    /// A native frame of `module` (a path), with no line table.
    fn native(module: &str, function: &str) -> pb::StackFrame {
        pb::StackFrame {
            function: function.to_owned(),
            module: module.to_owned(),
            ..Default::default()
        }
    }

    fn lib(path: &str, function: &str) -> pb::StackFrame {
        frame(&format!("{SITE}/{path}"), 100, function)
    }

    fn user(line: u32, function: &str) -> pb::StackFrame {
        frame("/home/u/train.py", line, function)
    }

    fn rank(rank: u32, frames: Vec<pb::StackFrame>, unchanged_ms: u64) -> pb::RankStack {
        pb::RankStack {
            rank: Some(rank),
            threads: vec![pb::ThreadStack {
                thread_id: 1000 + u64::from(rank),
                name: "MainThread".to_owned(),
                active: false,
                frames,
            }],
            unchanged_ms,
            ..Default::default()
        }
    }

    /// Accelerate's `wait_for_everyone` into torch's barrier, from `train.py:15`.
    fn accelerate_barrier() -> Vec<pb::StackFrame> {
        vec![
            lib("torch/distributed/distributed_c10d.py", "barrier"),
            lib("torch/distributed/c10d_logger.py", "wrapper"),
            lib("accelerate/utils/other.py", "wait_for_everyone"),
            lib("accelerate/accelerator.py", "wait_for_everyone"),
            user(15, "<module>"),
        ]
    }

    fn lines(groups: &[pb::StackGroup]) -> Vec<&str> {
        groups.iter().map(|g| g.line.as_str()).collect()
    }

    fn check_frame(file: &str, function: &str, expected: &str) {
        assert_eq!(
            fold(&[frame(file, 7, function)], false),
            [expected],
            "{file}"
        );
    }

    #[test]
    fn frames_render_by_origin() {
        check_frame(
            "/v/lib/python3.11/site-packages/torch/distributed/distributed_c10d.py",
            "barrier",
            "torch.distributed.barrier",
        );
        check_frame(
            "/usr/lib/python3/dist-packages/accelerate/accelerator.py",
            "Accelerator.wait_for_everyone",
            "accelerate.Accelerator.wait_for_everyone",
        );
        check_frame(
            "/v/lib/python3.11/site-packages/six.py",
            "reraise",
            "six.reraise",
        );
        check_frame("/usr/lib/python3.11/threading.py", "wait", "threading.wait");
        check_frame(
            "/usr/lib/python3.11/concurrent/futures/_base.py",
            "result",
            "concurrent.futures.result",
        );
        check_frame("<frozen runpy>", "_run_code", "runpy._run_code");
        check_frame(
            "<frozen importlib._bootstrap>",
            "_call_with_frames_removed",
            "importlib._call_with_frames_removed",
        );
        check_frame(
            "/home/u/muster/worker-sdk/python/python/muster/accelerator.py",
            "wait_for_everyone",
            "muster.wait_for_everyone",
        );
        check_frame("/home/u/muster/train.py", "main", "train.py:7 main");
        check_frame("/home/u/proj/lib/util.py", "load", "util.py:7 load");
        check_frame("", "PyEval_EvalFrame", "PyEval_EvalFrame");
        let mut with_source = user(9, "slow_data_step");
        with_source.source = "    time.sleep(600)\n".to_owned();
        assert_eq!(
            fold(&[with_source], false),
            ["train.py:9 slow_data_step (time.sleep(600))"]
        );
    }

    #[test]
    fn library_runs_fold_to_innermost_and_entry() {
        assert_eq!(
            fold(&accelerate_barrier(), false),
            [
                "torch.distributed.barrier",
                "accelerate.utils.wait_for_everyone",
                "accelerate.wait_for_everyone",
                "train.py:15 <module>",
            ]
        );
        // A run's middle goes; an entry reading as the innermost goes; user frames all stay.
        let frames = [
            frame("/usr/lib/python3.11/threading.py", 320, "wait"),
            frame("/usr/lib/python3.11/threading.py", 600, "wait"),
            frame(
                "/usr/lib/python3.11/concurrent/futures/_base.py",
                40,
                "wait",
            ),
            frame(
                "/usr/lib/python3.11/concurrent/futures/_base.py",
                450,
                "result",
            ),
            user(30, "fetch"),
            lib("torch/nn/modules/module.py", "_call_impl"),
            lib("torch/nn/modules/module.py", "_call_impl"),
            user(40, "main"),
        ];
        assert_eq!(
            fold(&frames, false),
            [
                "threading.wait",
                "concurrent.futures.result",
                "train.py:30 fetch",
                "torch.nn.modules._call_impl",
                "train.py:40 main",
            ]
        );
    }

    #[test]
    fn full_keeps_every_frame() {
        assert_eq!(
            fold(&accelerate_barrier(), true),
            [
                "torch.distributed.barrier",
                "torch.distributed.wrapper",
                "accelerate.utils.wait_for_everyone",
                "accelerate.wait_for_everyone",
                "train.py:15 <module>",
            ]
        );
    }

    #[test]
    fn waits_are_read_from_the_innermost_library_run() {
        assert!(is_wait(&accelerate_barrier()));
        let stdlib =
            |path: &str, function: &str| frame(&format!("/usr/lib/python3.11/{path}"), 1, function);
        assert!(is_wait(&[stdlib("threading.py", "wait"), user(3, "main")]));
        assert!(is_wait(&[
            stdlib("threading.py", "Condition.wait"),
            stdlib("concurrent/futures/_base.py", "result"),
            user(3, "main"),
        ]));
        assert!(is_wait(&[stdlib("queue.py", "get"), user(3, "main")]));
        assert!(is_wait(&[
            stdlib("selectors.py", "select"),
            user(3, "main")
        ]));
        assert!(is_wait(&[
            stdlib("multiprocessing/connection.py", "_recv_bytes"),
            user(3, "main"),
        ]));
        assert!(is_wait(&[
            frame("", 0, "pthread_cond_wait"),
            lib("muster/comm.py", "barrier"),
            user(3, "main"),
        ]));
        // The user's own line innermost: `time.sleep` shows as the user's line.
        assert!(!is_wait(&[user(9, "slow_data_step"), user(14, "<module>")]));
        // Torch computing, not waiting; a wait further out than the innermost run is not one.
        assert!(!is_wait(&[
            lib("torch/nn/functional.py", "linear"),
            user(9, "step"),
            lib("torch/distributed/distributed_c10d.py", "barrier"),
        ]));
        assert!(!is_wait(&[
            stdlib("json/decoder.py", "decode"),
            user(3, "main")
        ]));
        assert!(!is_wait(&[]));
    }

    #[test]
    fn ranks_read_as_ranges() {
        for (ranks, text) in [
            (&[0, 2, 3, 4, 5, 6, 7][..], "0,2-7"),
            (&[1], "1"),
            (&[1, 3], "1,3"),
            (&[7, 6, 0, 1, 1], "0-1,6-7"),
            (&[], ""),
        ] {
            assert_eq!(ranks_text(ranks), text, "{ranks:?}");
        }
    }

    #[test]
    fn durations_round_down() {
        for (ms, text) in [
            (0, ""),
            (400, ", for 0.4 s"),
            (999, ", for 0.9 s"),
            (42_900, ", for 42 s"),
            (119_999, ", for 119 s"),
            (120_000, ", for 2 min"),
            (185_000, ", for 3 min 5 s"),
        ] {
            assert_eq!(for_text(ms), text, "{ms}");
        }
    }

    #[test]
    fn fingerprint_follows_frames_not_timing() {
        let a = rank(0, accelerate_barrier(), 1_000);
        let mut later = a.clone();
        later.unchanged_ms = 60_000;
        later.waiting_share = 0.9;
        later.pid = 4242;
        later.threads[0].thread_id = 7;
        later.threads[0].frames[4].source = "accelerator.wait_for_everyone()".to_owned();
        assert_eq!(fingerprint(&a), fingerprint(&later));

        let mut moved = a.clone();
        moved.threads[0].frames[4].line = 16;
        assert_ne!(fingerprint(&a), fingerprint(&moved));
        let mut failed = a.clone();
        failed.error = "exited".to_owned();
        assert_ne!(fingerprint(&a), fingerprint(&failed));
    }

    #[test]
    fn accelerate_hang_names_the_rank_elsewhere() {
        let mut slow = user(9, "slow_data_step");
        slow.source = "time.sleep(600)".to_owned();
        let ranks = [
            rank(0, accelerate_barrier(), 43_500),
            rank(1, vec![slow, user(14, "<module>")], 42_100),
            rank(2, accelerate_barrier(), 42_000),
        ];
        let groups = group(&ranks, 3, false);
        assert_eq!(
            lines(&groups),
            [
                "rank 1 is elsewhere: train.py:9 slow_data_step (time.sleep(600)) \
                 <- train.py:14 <module>, for 42 s",
                "ranks 0,2 (2 of 3): torch.distributed.barrier \
                 <- accelerate.utils.wait_for_everyone <- accelerate.wait_for_everyone \
                 <- train.py:15 <module>, for 42 s",
            ]
        );
        assert_eq!(groups[0].ranks, [1]);
        assert!(groups[0].likely_cause);
        assert_eq!(groups[1].ranks, [0, 2]);
        assert!(!groups[1].likely_cause);
        assert_eq!(groups[1].unchanged_ms, 42_000);
        assert_eq!(groups[1].frames, fold(&accelerate_barrier(), false));
    }

    #[test]
    fn balanced_ranks_form_one_group_and_no_cause() {
        let ranks: Vec<_> = (0..4).map(|r| rank(r, accelerate_barrier(), 0)).collect();
        let groups = group(&ranks, 4, false);
        assert_eq!(
            lines(&groups),
            ["ranks 0-3 (4 of 4): torch.distributed.barrier \
              <- accelerate.utils.wait_for_everyone <- accelerate.wait_for_everyone \
              <- train.py:15 <module>"]
        );
        assert!(!groups[0].likely_cause);
        assert_eq!(groups[0].unchanged_ms, 0);
    }

    fn all_reduce_at(line: u32) -> Vec<pb::StackFrame> {
        vec![
            lib("torch/distributed/distributed_c10d.py", "all_reduce"),
            lib("torch/distributed/c10d_logger.py", "wrapper"),
            user(line, "step"),
            user(30, "<module>"),
        ]
    }

    #[test]
    fn of_two_collective_sites_the_other_is_the_cause() {
        // Equal sizes: the group holding rank 0 is the majority.
        let ranks = [
            rank(2, all_reduce_at(22), 5_000),
            rank(0, all_reduce_at(20), 5_000),
            rank(3, all_reduce_at(22), 5_000),
            rank(1, all_reduce_at(20), 5_000),
        ];
        let groups = group(&ranks, 4, false);
        assert_eq!(
            lines(&groups),
            [
                "ranks 2-3 are elsewhere: torch.distributed.all_reduce <- train.py:22 step \
                 <- train.py:30 <module>, for 5 s",
                "ranks 0-1 (2 of 4): torch.distributed.all_reduce <- train.py:20 step \
                 <- train.py:30 <module>, for 5 s",
            ]
        );
        assert!(groups[0].likely_cause && !groups[1].likely_cause);

        // The larger group is the majority, whatever its ranks.
        let ranks = [
            rank(0, all_reduce_at(20), 0),
            rank(1, all_reduce_at(22), 0),
            rank(2, all_reduce_at(22), 0),
        ];
        let groups = group(&ranks, 3, false);
        assert_eq!(groups[0].ranks, [0]);
        assert!(groups[0].likely_cause);
        assert_eq!(groups[1].ranks, [1, 2]);
        assert!(!groups[1].likely_cause);
    }

    #[test]
    fn without_a_waiting_group_nobody_is_marked() {
        let ranks = [
            rank(0, vec![user(9, "step"), user(14, "<module>")], 0),
            rank(1, vec![user(9, "step"), user(14, "<module>")], 0),
            rank(2, vec![user(11, "log"), user(14, "<module>")], 0),
        ];
        let groups = group(&ranks, 3, false);
        assert_eq!(
            lines(&groups),
            [
                "ranks 0-1 (2 of 3): train.py:9 step <- train.py:14 <module>",
                "rank 2 (1 of 3): train.py:11 log <- train.py:14 <module>",
            ]
        );
        assert!(groups.iter().all(|g| !g.likely_cause));
    }

    #[test]
    fn native_frames_show_their_module_and_fold_by_it() {
        const TORCH: &str = "/v/lib/python3.11/site-packages/torch/lib";
        let frames = vec![
            native("/usr/lib/x86_64-linux-gnu/libc.so.6", ""),
            native("/usr/lib/x86_64-linux-gnu/libc.so.6", "pthread_cond_wait"),
            native(
                "/usr/lib/x86_64-linux-gnu/libstdc++.so.6.0.30",
                "std::condition_variable::wait(std::unique_lock<std::mutex>&)",
            ),
            native(&format!("{TORCH}/libtorch_cpu.so"), "c10d::Work::wait"),
            native(
                &format!("{TORCH}/libtorch_python.so"),
                "pybind11::cpp_function::initialize<bool (*)(c10d::Work*)>(bool, char [654])::{lambda(pybind11::detail::function_call&)#1}::_FUN",
            ),
            native(
                &format!("{TORCH}/libtorch_python.so"),
                "pybind11::cpp_function::dispatcher",
            ),
            lib("torch/distributed/distributed_c10d.py", "all_reduce"),
            user(9, "run"),
        ];
        assert_eq!(
            fold(&frames, false),
            [
                "? (libc.so.6)",
                "pthread_cond_wait (libc.so.6)",
                "std::condition_variable::wait (libstdc++.so.6.0.30)",
                "c10d::Work::wait (libtorch_cpu.so)",
                "pybind11::cpp_function::initialize::{lambda#1}::_FUN (libtorch_python.so)",
                "pybind11::cpp_function::dispatcher (libtorch_python.so)",
                "torch.distributed.all_reduce",
                "train.py:9 run",
            ]
        );
        // `full` keeps a native name as it is.
        assert_eq!(
            fold(&frames, true)[2],
            "std::condition_variable::wait(std::unique_lock<std::mutex>&) (libstdc++.so.6.0.30)"
        );
        // Leading native frames do not hide the wait, nor the user's line.
        assert!(is_wait(&frames));
        assert_eq!(site(&frames), "train.py:9 run");
        // Nor the Python frames in a group's line: its cut applies after them.
        let mut deep = frames[..6].to_vec();
        deep.extend(accelerate_barrier());
        let groups = group(&[rank(0, deep.clone(), 0), rank(1, deep, 0)], 2, false);
        assert_eq!(
            groups[0].line,
            "ranks 0-1 (2 of 2): ? (libc.so.6) <- pthread_cond_wait (libc.so.6) \
             <- std::condition_variable::wait (libstdc++.so.6.0.30) \
             <- c10d::Work::wait (libtorch_cpu.so) \
             <- pybind11::cpp_function::initialize::{lambda#1}::_FUN (libtorch_python.so) \
             <- pybind11::cpp_function::dispatcher (libtorch_python.so) \
             <- torch.distributed.barrier <- accelerate.utils.wait_for_everyone \
             <- accelerate.wait_for_everyone <- train.py:15 <module>"
        );
        // A native frame with a line table names its source position; the program's own
        // frames are all kept (only a shared library's fold).
        let rust = vec![
            pb::StackFrame {
                function: "muster_worker_sdk::barrier::wait::h0123456789abcdef".to_owned(),
                file: "/src/worker-sdk/src/barrier.rs".to_owned(),
                line: 42,
                module: "/work/target/debug/probe".to_owned(),
                ..Default::default()
            },
            native("/work/target/debug/probe", "tokio::runtime::park"),
            native("/work/target/debug/probe", "probe::main"),
        ];
        assert_eq!(
            fold(&rust, false),
            [
                "muster_worker_sdk::barrier::wait (probe barrier.rs:42)",
                "tokio::runtime::park (probe)",
                "probe::main (probe)"
            ]
        );
    }

    #[test]
    fn native_names_lose_templates_arguments_and_hashes() {
        for (name, short) in [
            ("clock_nanosleep", "clock_nanosleep"),
            (
                "std::vector<int, std::allocator<int> >::push_back(int const&)",
                "std::vector::push_back",
            ),
            ("operator<<(std::ostream&, char const*)", "operator<<"),
            ("foo::operator()(int) const", "foo::operator() const"),
            (
                "std::_Function_handler<void (), a::b>::_M_invoke(std::_Any_data const&)",
                "std::_Function_handler::_M_invoke",
            ),
            (
                "core::ops::function::FnOnce::call_once::h9f8e7d6c5b4a3921",
                "core::ops::function::FnOnce::call_once",
            ),
            (
                "<alloc::boxed::Box<F,A> as core::ops::function::FnOnce<Args>>::call_once",
                "<alloc::boxed::Box as core::ops::function::FnOnce>::call_once",
            ),
        ] {
            assert_eq!(short_native(name), short, "{name}");
        }
    }

    #[test]
    fn a_program_with_a_native_stack_is_grouped_by_it_after_what_it_is() {
        let sleeping = |r: u32| pb::RankStack {
            rank: Some(r),
            native: "/usr/bin/sleep (pid 7) is not Python; it is sleeping".to_owned(),
            threads: vec![pb::ThreadStack {
                frames: vec![
                    native("/usr/lib/x86_64-linux-gnu/libc.so.6", "clock_nanosleep"),
                    native("/usr/bin/sleep", ""),
                ],
                ..Default::default()
            }],
            ..Default::default()
        };
        let groups = group(&[sleeping(0)], 1, false);
        assert_eq!(
            lines(&groups),
            [
                "rank 0 (1 of 1): not Python: /usr/bin/sleep (pid 7) is not Python; it is sleeping \
              <- clock_nanosleep (libc.so.6) <- ? (sleep)"
            ]
        );
        // A Python rank whose native frames could not be read keeps its Python stack; the
        // reason is a note of its own.
        let mut python = rank(3, accelerate_barrier(), 0);
        python.native = "no native frames: it has no thread left to read".to_owned();
        let mut other = rank(4, accelerate_barrier(), 0);
        other.native = python.native.clone();
        let ranks = [rank(2, accelerate_barrier(), 0), python, other, sleeping(5)];
        assert_eq!(
            native_notes(&ranks),
            ["ranks 3-4: no native frames: it has no thread left to read"]
        );
        let groups = group(&ranks, 6, false);
        assert!(groups.iter().any(|g| g.ranks == [2, 3, 4]), "{groups:?}");
    }

    #[test]
    fn stopped_ranks_get_a_note_and_keep_their_group() {
        const STOPPED: &str = "stopped (by SIGSTOP, a terminal's Ctrl-Z or a debugger): it runs nothing until it gets SIGCONT";
        let mut one = rank(1, accelerate_barrier(), 0);
        one.process_state = STOPPED.to_owned();
        let mut three = rank(3, accelerate_barrier(), 0);
        three.process_state = STOPPED.to_owned();
        let mut io = rank(2, accelerate_barrier(), 0);
        io.process_state = "in uninterruptible I/O in the kernel at nfs_wait_bit_killable".into();
        // Not Python: its group's line says it is stopped.
        let mut native = rank(4, vec![], 0);
        native.threads.clear();
        native.native = "/usr/bin/sleep (pid 7) is not Python; it is stopped".into();
        native.process_state = STOPPED.to_owned();
        // Unreadable: its line says why.
        let mut gone = rank(5, vec![], 0);
        gone.error = "process 9 exited while it was being read".into();
        gone.process_state = "a zombie: it exited and was not reaped yet".into();
        let ranks = [
            rank(0, accelerate_barrier(), 0),
            one,
            io,
            three,
            native,
            gone,
        ];
        assert_eq!(
            state_notes(&ranks),
            [
                format!("ranks 1,3: their processes are {STOPPED}"),
                "rank 2: its process is in uninterruptible I/O in the kernel at nfs_wait_bit_killable"
                    .to_owned(),
            ]
        );
        // The grouping is by stack alone.
        let groups = group(&ranks, 6, false);
        assert!(groups.iter().any(|g| g.ranks == [0, 1, 2, 3]), "{groups:?}");
        assert!(state_notes(&ranks[..1]).is_empty());
    }

    #[test]
    fn unreadable_and_non_python_ranks() {
        let ranks = [
            rank(0, accelerate_barrier(), 0),
            rank(1, accelerate_barrier(), 0),
            pb::RankStack {
                rank: Some(2),
                error: "ptrace denied: run the agent with CAP_SYS_PTRACE".to_owned(),
                ..Default::default()
            },
            pb::RankStack {
                rank: Some(3),
                native: "bash (pid 77), waiting in wait4".to_owned(),
                unchanged_ms: 400,
                ..Default::default()
            },
            pb::RankStack {
                rank: Some(4),
                ..Default::default()
            },
            // No rank number: left out.
            pb::RankStack::default(),
        ];
        let groups = group(&ranks, 5, false);
        assert_eq!(
            lines(&groups),
            [
                "rank 3 is elsewhere: not Python: bash (pid 77), waiting in wait4, for 0.4 s",
                "rank 4 is elsewhere: no Python thread",
                "ranks 0-1 (2 of 5): torch.distributed.barrier \
                 <- accelerate.utils.wait_for_everyone <- accelerate.wait_for_everyone \
                 <- train.py:15 <module>",
                "rank 2 (1 of 5): cannot read: ptrace denied: run the agent with \
                 CAP_SYS_PTRACE",
            ]
        );
        let marked: Vec<bool> = groups.iter().map(|g| g.likely_cause).collect();
        assert_eq!(marked, [true, true, false, false]);
    }

    #[test]
    fn long_stacks_are_cut_in_the_line_only() {
        let frames: Vec<_> = (1..=10).map(|n| user(n, &format!("f{n}"))).collect();
        let groups = group(&[rank(0, frames.clone(), 0)], 1, false);
        assert_eq!(
            groups[0].line,
            "rank 0 (1 of 1): train.py:1 f1 <- train.py:2 f2 <- train.py:3 f3 \
             <- train.py:4 f4 <- train.py:5 f5 <- train.py:6 f6 <- ... <- train.py:10 f10"
        );
        assert_eq!(groups[0].frames.len(), 10);

        let full = group(&[rank(0, frames, 0)], 1, true);
        assert_eq!(full[0].line.matches(" <- ").count(), 9);
        assert!(!full[0].line.contains("..."));
    }

    #[test]
    fn report_lists_groups_then_silent_nodes() {
        let groups = group(&[rank(0, vec![user(9, "step")], 0)], 2, false);
        assert_eq!(
            report(&groups, &["node 1 (host b): no reply in 2 s".to_owned()]),
            "rank 0 (1 of 2): train.py:9 step\nno answer from node 1 (host b): no reply in 2 s"
        );
        assert_eq!(report(&[], &[]), "no ranks running");
    }

    /// A backward pass counts as a wait for the straggler view (DDP all-reduces there), a
    /// user's data step does not; a thread's site is its innermost user frame.
    #[test]
    fn backward_is_where_ranks_sync_and_sites_name_the_users_line() {
        let backward = vec![
            lib("torch/autograd/graph.py", "_engine_run_backward"),
            lib("torch/autograd/__init__.py", "backward"),
            lib("torch/_tensor.py", "backward"),
            user(30, "train_step"),
        ];
        assert!(is_sync(&backward) && !is_wait(&backward));
        assert!(is_sync(&accelerate_barrier()));
        let mut data = vec![user(21, "load_batch"), user(40, "<module>")];
        data[0].source = "time.sleep(0.03)".into();
        assert!(!is_sync(&data));
        assert_eq!(site(&data), "train.py:21 load_batch (time.sleep(0.03))");
        assert_eq!(site(&backward), "train.py:30 train_step");
        assert_eq!(
            wait_site(&backward),
            "torch.autograd._engine_run_backward <- train.py:30 train_step"
        );
        assert_eq!(
            site(&[lib("torch/distributed/distributed_c10d.py", "barrier")]),
            "torch.distributed.barrier"
        );
    }

    fn sample(rank: u32, waiting_share: f64, samples: u32) -> pb::RankSample {
        pb::RankSample {
            rank: Some(rank),
            samples,
            waiting_share,
            busy_at: format!("train.py:21 load_batch (rank {rank})"),
            busy_share: 1.0 - waiting_share,
            waiting_at: "torch.autograd.backward".into(),
        }
    }

    /// The rank that waits far less than the others is named with its evidence; a balanced
    /// job, a close second or too few samples name nobody.
    #[test]
    fn the_rank_the_others_wait_for_is_named_only_when_it_stands_out() {
        let skewed = [
            sample(0, 0.80, 40),
            sample(1, 0.75, 40),
            sample(2, 0.82, 40),
            sample(3, 0.08, 40),
        ];
        assert_eq!(
            straggler(&skewed),
            Some((
                3,
                "rank 3 waits in 8% of its samples, the others in 80% (median); it spends 92% at train.py:21 load_batch (rank 3); the others wait at torch.autograd.backward".to_owned()
            ))
        );
        let balanced = [
            sample(0, 0.40, 40),
            sample(1, 0.25, 40),
            sample(2, 0.45, 40),
            sample(3, 0.35, 40),
        ];
        assert_eq!(straggler(&balanced), None);
        // Two slow ranks: neither stands out from every other.
        let two = [
            sample(0, 0.80, 40),
            sample(1, 0.10, 40),
            sample(2, 0.82, 40),
            sample(3, 0.12, 40),
        ];
        assert_eq!(straggler(&two), None);
        let young = [sample(0, 0.8, 40), sample(1, 0.0, 5)];
        assert_eq!(straggler(&young), None);
        assert_eq!(straggler(&[sample(0, 0.9, 40)]), None);
    }

    fn recorded(rank: u32, calls: &[(u64, &str)]) -> pb::RankStack {
        pb::RankStack {
            rank: Some(rank),
            collectives: calls
                .iter()
                .map(|(seq, op)| pb::Collective {
                    seq: *seq,
                    op: (*op).to_owned(),
                    process_group: "default_pg".into(),
                    input_sizes: vec!["[4]".into()],
                    state: "scheduled".into(),
                    p2p: false,
                })
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn the_flight_recorder_names_the_rank_behind() {
        let ranks = [
            recorded(0, &[(1, "gloo:all_reduce"), (2, "gloo:barrier")]),
            recorded(1, &[(1, "gloo:all_reduce")]),
            recorded(2, &[(1, "gloo:all_reduce"), (2, "gloo:barrier")]),
            pb::RankStack {
                rank: Some(3),
                flight_recorder: "no answer".into(),
                ..Default::default()
            },
        ];
        assert_eq!(
            collectives(&ranks),
            [
                "flight recorder (default_pg): rank 1 last called collective #1 gloo:all_reduce [4] (scheduled)",
                "flight recorder (default_pg): ranks 0,2 last called collective #2 gloo:barrier [4] (scheduled)",
                "flight recorder: rank 1 is behind in default_pg: its last collective is #1, the others reached #2",
                "flight recorder: rank 3: no answer",
            ]
        );
    }

    #[test]
    fn the_flight_recorder_names_ranks_that_disagree_and_nothing_when_all_agree() {
        let ranks = [
            recorded(0, &[(2, "gloo:all_reduce")]),
            recorded(1, &[(2, "gloo:barrier")]),
            recorded(2, &[(2, "gloo:all_reduce")]),
        ];
        let lines = collectives(&ranks);
        assert_eq!(
            lines.last().map(String::as_str),
            Some(
                "flight recorder: the ranks disagree on collective #2 of default_pg: 0,2 gloo:all_reduce [4]; 1 gloo:barrier [4]"
            )
        );
        let same = [
            recorded(0, &[(2, "gloo:all_reduce")]),
            recorded(1, &[(2, "gloo:all_reduce")]),
        ];
        assert_eq!(
            collectives(&same),
            [
                "flight recorder (default_pg): ranks 0-1 last called collective #2 gloo:all_reduce [4] (scheduled)"
            ]
        );
        assert!(collectives(&[pb::RankStack::default()]).is_empty());
    }

    /// The Accelerate hang: rank 1 sleeps before its first collective, the others wait in
    /// the first barrier.
    #[test]
    fn a_rank_that_called_no_collective_is_behind() {
        let none = pb::RankStack {
            rank: Some(1),
            flight_recorder: NO_COLLECTIVE.into(),
            ..Default::default()
        };
        let ranks = [
            recorded(0, &[(1, "gloo:barrier")]),
            none.clone(),
            recorded(2, &[(1, "gloo:barrier")]),
        ];
        assert_eq!(
            collectives(&ranks),
            [
                "flight recorder (default_pg): ranks 0,2 last called collective #1 gloo:barrier [4] (scheduled)",
                "flight recorder (default_pg): rank 1 called no collective yet",
                "flight recorder: rank 1 is behind in default_pg: it has called no collective yet, the others reached #1",
            ]
        );
        // Nobody has called one: nothing to say.
        assert!(collectives(&[none]).is_empty());
    }
}
