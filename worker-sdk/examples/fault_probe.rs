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
    for seq in 1.. {
        let fields = format!(r#""name":"{BARRIER}","seq":{seq}"#);
        probe.record("barrier-enter", &fields);
        accelerator.wait_for_everyone_named(BARRIER)?;
        probe.record("barrier-exit", &fields);
        if seq % REFETCH_EVERY == 0 {
            record_id(probe)?;
        }
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
