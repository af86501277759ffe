//! Single flag values parsed alone (`--nnodes`, `--coordinator`) and the job ids a launch
//! derives when none is given; shared by the launch's validation, the rendezvous flags and
//! the Slurm defaults.

use super::UsageError;
use crate::net::is_host_port;
use crate::spec::NodeRange;
use muster_core::model;
use std::time::{SystemTime, UNIX_EPOCH};

/// `s` with every character a job id cannot hold ([A-Za-z0-9._-] only) replaced by `-`, for
/// job ids derived from addresses, rendezvous ids and Slurm's variables.
pub(crate) fn job_id_chars(s: &str) -> String {
    model::name_chars(s)
}

/// The job id every machine of a multi-node launch derives from the main machine's address
/// and port: `muster-<addr>-<port>`, with characters a job id cannot hold replaced by `-`.
pub(crate) fn derived_job_id(addr: &str, port: u16) -> String {
    let addr = job_id_chars(addr);
    let mut id = format!("muster-{addr}-{port}");
    id.truncate(128);
    id
}

/// A duration flag that can also be `off` (clap reads a plain `Option<Option<_>>` as a flag
/// with an optional value, so the "off" is wrapped).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limit(pub Option<std::time::Duration>);

/// [`parse_duration`] as a flag's value.
pub fn parse_limit(s: &str) -> Result<Limit, String> {
    parse_duration(s).map(Limit)
}

/// A duration as an operator writes it: `90s`, `5m`, `1h`, `500ms`, `2m30s`, or a bare number
/// of seconds; `0` or `off` is `None` (the thing it bounds is off).
pub fn parse_duration(s: &str) -> Result<Option<std::time::Duration>, String> {
    let t = s.trim();
    if t == "off" || t == "0" {
        return Ok(None);
    }
    let bad = || format!("'{s}' is not a duration: expected e.g. 90s, 5m, 1h, 500ms or off");
    if let Ok(secs) = t.parse::<f64>() {
        return if secs.is_finite() && secs > 0.0 {
            Ok(Some(std::time::Duration::from_secs_f64(secs)))
        } else {
            Err(bad())
        };
    }
    let mut total = std::time::Duration::ZERO;
    let mut rest = t;
    while !rest.is_empty() {
        let digits = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(bad)?;
        let (number, tail) = rest.split_at(digits);
        let n: f64 = number.parse().map_err(|_| bad())?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let scale = match unit {
            "ms" => 0.001,
            "s" => 1.0,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            _ => return Err(bad()),
        };
        total += std::time::Duration::try_from_secs_f64(n * scale).map_err(|_| bad())?;
        rest = next;
    }
    if total.is_zero() {
        return Ok(None);
    }
    Ok(Some(total))
}

/// Parses `MIN` or `MIN:MAX` with `1 <= MIN <= MAX <= MAX_NODES`.
pub fn parse_nnodes(s: &str) -> Result<NodeRange, UsageError> {
    let bad = |why| UsageError::Nnodes(s.to_owned(), why);
    let number = |part: &str| {
        part.trim()
            .parse::<u32>()
            .map_err(|_| bad("expected MIN or MIN:MAX, as in 2 or 1:4"))
    };
    let (min, max) = match s.split_once(':') {
        Some((min, max)) => (number(min)?, number(max)?),
        None => {
            let n = number(s)?;
            (n, n)
        }
    };
    if min == 0 {
        return Err(bad("a job needs at least 1 node"));
    }
    if max < min {
        return Err(bad("MAX is below MIN"));
    }
    if max > model::MAX_NODES {
        return Err(bad("more nodes than the coordinator allows (100000)"));
    }
    Ok(NodeRange { min, max })
}

/// A `--coordinator` value: one `host:port` or a comma-separated list of them; returned
/// without blanks or repeats.
pub fn coordinator_list(value: &str) -> Result<String, UsageError> {
    match crate::failover::split_list(value) {
        Some(addrs) if addrs.iter().all(|a| is_host_port(a)) => Ok(addrs.join(",")),
        _ => Err(UsageError::Coordinator(value.to_owned())),
    }
}

/// A job id that no other launch on this machine uses: `job-<pid>-<unix millis>`.
pub(crate) fn fresh_job_id() -> String {
    let millis = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_millis())
        .unwrap_or_default();
    format!("job-{}-{millis}", std::process::id())
}
