//! The worker of the randomized fault-injection suite (`tests/tests/fault_injection.rs`): it
//! loops on global barriers, publishes and fetches a unique id, and uses the key-value store,
//! appending one JSON line per step to a history file that the suite's checker reads.
//!
//! Usage: `fault_probe` under `muster-agent launch`, with `MUSTER_FAULT_HISTORY` naming the
//! history file (appended to, one `write` per line, so lines of concurrent workers never
//! interleave). Optional: `MUSTER_FAULT_PACE_MS` (pause between barriers, default 50).
//!
//! Lines (every one has `t_ms`, `gen`, `rank`, `node`, `pid`):
//! - `{"event":"start","world":W,"restart_count":N}`
//! - `{"event":"barrier-enter","name":"probe","seq":S}` before a barrier is entered, and
//!   `{"event":"barrier-exit",...}` once it completed
//! - `{"event":"unique-id","value":"<hex>"}` each time the id is fetched (at the start and
//!   every [`REFETCH_EVERY`] barriers)
//! - `{"event":"exit","status":0}`, or `{"event":"exit","status":1,"error":"..."}`
//! - `{"event":"kv","n":N,"op":"add","key":K,"call_us":C,"ret_us":null,...}` before each
//!   key-value call of the workload below (`n` counts this process's calls), and the same line
//!   with `"ret_us":R` and the result once it returned: a call without its second line (the
//!   process was killed, or the call failed) has an unknown outcome. The suite checks them for
//!   linearizability (`muster_tests::linearizable`).
//!
//! The key-value workload, after each barrier: every rank adds 1 to `probe-count` (its lane:
//! applied at most once); even ranks set `probe-reg`, odd ranks read it; every
//! [`CAS_EVERY`] barriers rank 0 compare-and-sets it from the value it last wrote, and every
//! [`DELETE_EVERY`] rank 1 deletes it. The keys outlive generations, so the history spans
//! restarts and failovers.
//!
//! How it ends: the suite sets the key `fault-stop`; rank 0, seeing it after barrier `S`,
//! sets `stop-at-<generation>` to `S + 2` before it enters barrier `S + 1`, so every rank
//! reads it after completing `S + 1` at the latest and all stop after the same barrier.

use std::fs::{File, OpenOptions};
use std::io::Write;
use std::process::ExitCode;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use muster::{Accelerator, NCCL_UNIQUE_ID_BYTES};

/// The barrier every rank loops on.
const BARRIER: &str = "probe";
/// The unique id's communicator name.
const COMMUNICATOR: &str = "probe";
/// The key the suite sets when the job should end.
const STOP_KEY: &str = "fault-stop";
/// How often (in barriers) the unique id is fetched again, to see that it does not change.
const REFETCH_EVERY: u64 = 10;
/// How often (in barriers) rank 0 compare-and-sets the register.
const CAS_EVERY: u64 = 5;
/// How often (in barriers) rank 1 deletes the register.
const DELETE_EVERY: u64 = 7;
/// The workload's counter and register keys.
const COUNTER: &str = "probe-count";
const REGISTER: &str = "probe-reg";

fn main() -> ExitCode {
    let Some(path) = std::env::var_os("MUSTER_FAULT_HISTORY") else {
        eprintln!("fault_probe: MUSTER_FAULT_HISTORY is not set (the history file to append to)");
        return ExitCode::from(64);
    };
    let history = match OpenOptions::new().create(true).append(true).open(&path) {
        Ok(f) => f,
        Err(e) => {
            eprintln!("fault_probe: cannot open {}: {e}", path.to_string_lossy());
            return ExitCode::from(64);
        }
    };
    let mut probe = Probe {
        history,
        head: format!(r#""pid":{}"#, std::process::id()),
        calls: 0,
    };
    match run(&mut probe) {
        Ok(()) => {
            probe.record("exit", r#""status":0"#);
            ExitCode::SUCCESS
        }
        Err(e) => {
            let error = serde_json::Value::String(e.to_string());
            probe.record("exit", &format!(r#""status":1,"error":{error}"#));
            eprintln!("fault_probe: {e}");
            ExitCode::FAILURE
        }
    }
}

/// The history file and what every line of this process starts with.
struct Probe {
    history: File,
    /// `"gen":G,"rank":R,"node":N,"pid":P` once the rank is known.
    head: String,
    /// Key-value calls made so far.
    calls: u64,
}

impl Probe {
    /// Appends one line in a single `write` (O_APPEND: lines of concurrent writers stay whole).
    fn record(&mut self, event: &str, fields: &str) {
        let t_ms = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_millis());
        let sep = if fields.is_empty() { "" } else { "," };
        let line = format!(
            r#"{{"t_ms":{t_ms},"event":"{event}",{}{sep}{fields}}}"#,
            self.head
        ) + "\n";
        if let Err(e) = self.history.write_all(line.as_bytes()) {
            eprintln!("fault_probe: cannot append to the history: {e}");
        }
    }
}

fn run(probe: &mut Probe) -> Result<(), Box<dyn std::error::Error>> {
    let pace = match std::env::var("MUSTER_FAULT_PACE_MS") {
        Ok(v) => Duration::from_millis(
            v.parse()
                .map_err(|e| format!("MUSTER_FAULT_PACE_MS {v:?}: {e}"))?,
        ),
        Err(_) => Duration::from_millis(50),
    };
    let accelerator = Accelerator::from_env()?;
    let generation = accelerator.generation();
    let rank = accelerator.process_index();
    probe.head = format!(
        r#""gen":{generation},"rank":{rank},"node":{},{}"#,
        accelerator.node_rank(),
        probe.head
    );
    probe.record(
        "start",
        &format!(
            r#""world":{},"restart_count":{}"#,
            accelerator.num_processes(),
            accelerator.restart_count()
        ),
    );
    if rank == 0 {
        accelerator.publish_nccl_unique_id(COMMUNICATOR, &fresh_id())?;
    }
    let record_id = |probe: &mut Probe| -> Result<(), muster::Error> {
        let id = accelerator.fetch_nccl_unique_id(COMMUNICATOR)?;
        let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
        probe.record("unique-id", &format!(r#""value":"{hex}""#));
        Ok(())
    };
    record_id(probe)?;
    let kv = accelerator.kv();
    let stop_at_key = format!("stop-at-{generation}");
    let mut stop_at: Option<u64> = None;
    // The value this rank last wrote to the register (rank 0 compare-and-sets from it).
    let mut written: Option<String> = None;
    for seq in 1.. {
        let fields = format!(r#""name":"{BARRIER}","seq":{seq}"#);
        probe.record("barrier-enter", &fields);
        accelerator.wait_for_everyone_named(BARRIER)?;
        probe.record("barrier-exit", &fields);
        if seq % REFETCH_EVERY == 0 {
            record_id(probe)?;
        }
        workload(probe, &kv, generation, rank, seq, &mut written)?;
        if stop_at.is_none() {
            if rank == 0 {
                if kv.get(STOP_KEY)?.is_some() {
                    stop_at = Some(seq + 2);
                    kv.set(&stop_at_key, (seq + 2).to_string())?;
                }
            } else if let Some(v) = kv.get(&stop_at_key)? {
                let v = String::from_utf8_lossy(&v).into_owned();
                stop_at = Some(v.parse().map_err(|e| format!("{stop_at_key} {v:?}: {e}"))?);
            }
        }
        if stop_at.is_some_and(|s| seq >= s) {
            break;
        }
        std::thread::sleep(pace);
    }
    accelerator.finish()?;
    Ok(())
}

/// Microseconds since the Unix epoch: the clock of the `kv` lines (shared by every process of
/// the machine).
fn now_us() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_micros())
}

/// A JSON string, or `null`.
fn json(value: Option<&[u8]>) -> String {
    value.map_or_else(
        || "null".to_owned(),
        |v| serde_json::Value::String(String::from_utf8_lossy(v).into_owned()).to_string(),
    )
}

/// Runs one key-value call and records it: before it, with an unknown outcome; after it, if
/// it returned, with `result`. `fields` says what it asked. A failed call keeps its unknown
/// outcome (it may or may not have been applied).
fn timed<T>(
    probe: &mut Probe,
    fields: &str,
    call: impl FnOnce() -> Result<T, muster::Error>,
    result: impl FnOnce(&T) -> String,
) -> Result<T, muster::Error> {
    probe.calls += 1;
    let n = probe.calls;
    let call_us = now_us();
    probe.record(
        "kv",
        &format!(r#""n":{n},{fields},"call_us":{call_us},"ret_us":null"#),
    );
    let answer = call();
    let ret_us = now_us();
    if let Ok(value) = &answer {
        probe.record(
            "kv",
            &format!(
                r#""n":{n},{fields},"call_us":{call_us},"ret_us":{ret_us},{}"#,
                result(value)
            ),
        );
    }
    answer
}

/// The key-value workload of one barrier (see the module comment).
fn workload(
    probe: &mut Probe,
    kv: &muster::KvStore<'_>,
    generation: u64,
    rank: usize,
    seq: u64,
    written: &mut Option<String>,
) -> Result<(), muster::Error> {
    timed(
        probe,
        &format!(r#""op":"add","key":"{COUNTER}","delta":1"#),
        || kv.add(COUNTER, 1),
        |sum| format!(r#""sum":{sum}"#),
    )?;
    if rank.is_multiple_of(2) {
        let value = format!("g{generation}r{rank}s{seq}");
        timed(
            probe,
            &format!(r#""op":"set","key":"{REGISTER}","value":"{value}""#),
            || kv.set(REGISTER, value.clone()),
            |()| String::from(r#""done":true"#),
        )?;
        *written = Some(value);
    } else {
        timed(
            probe,
            &format!(r#""op":"get","key":"{REGISTER}""#),
            || kv.get(REGISTER),
            |v| format!(r#""value":{}"#, json(v.as_deref())),
        )?;
    }
    if rank == 0 && seq.is_multiple_of(CAS_EVERY) {
        let desired = format!("g{generation}r{rank}s{seq}cas");
        let expected = written.clone();
        timed(
            probe,
            &format!(
                r#""op":"cas","key":"{REGISTER}","expected":{},"desired":"{desired}""#,
                json(expected.as_deref().map(str::as_bytes))
            ),
            || {
                kv.compare_and_set(
                    REGISTER,
                    expected.as_deref().map(str::as_bytes),
                    desired.clone(),
                )
            },
            |o| {
                format!(
                    r#""swapped":{},"current":{}"#,
                    o.swapped,
                    json(o.current.as_deref())
                )
            },
        )?;
    }
    if rank == 1 && seq.is_multiple_of(DELETE_EVERY) {
        timed(
            probe,
            &format!(r#""op":"delete","key":"{REGISTER}""#),
            || kv.delete(REGISTER),
            |existed| format!(r#""existed":{existed}"#),
        )?;
    }
    Ok(())
}

/// A unique id that differs between generations and processes (the pid and the clock mixed by
/// xorshift; it only has to differ, not to be secret).
fn fresh_id() -> [u8; NCCL_UNIQUE_ID_BYTES] {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos());
    let mut x = (nanos as u64) ^ (u64::from(std::process::id()) << 32) | 1;
    let mut id = [0u8; NCCL_UNIQUE_ID_BYTES];
    for b in &mut id {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        *b = x.to_le_bytes()[0];
    }
    id
}
