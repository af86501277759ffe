//! Validated domain types and the checks that make them: a job id, a node id, a host, a label,
//! a generation, a wait, a barrier scope. Every request from the network is converted into
//! these at the edge, by the `TryFrom` impls in [`crate::requests`] (called in the
//! coordinator's gRPC handlers) or by these checks directly, so the rest of the coordinator
//! never sees an unchecked job id, an empty host or a zero world size.

use std::fmt;
use std::time::Duration;

/// Largest number of workers one node may run.
pub const MAX_LOCAL_WORLD_SIZE: u32 = 4096;
/// Largest number of nodes a job may have.
pub const MAX_NODES: u32 = 100_000;
/// Largest restart budget a job may ask for.
pub const MAX_RESTARTS: u32 = 10_000;
/// Largest timeout a caller may ask for (one day): anything longer is a mistake.
pub const MAX_WAIT: Duration = Duration::from_secs(24 * 3600);

/// A request field that failed validation; becomes `INVALID_ARGUMENT` naming the field.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Invalid(pub String);

impl fmt::Display for Invalid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Whether `c` may be in a name (a job id, a node id): an ASCII letter or digit, '.', '_' or
/// '-'.
pub fn name_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-')
}

/// `s` with every character a name cannot hold ([`name_char`]) replaced by `-`: for ids made
/// from addresses, host names and other programs' variables.
pub fn name_chars(s: &str) -> String {
    s.chars()
        .map(|c| if name_char(c) { c } else { '-' })
        .collect()
}

fn check_name(field: &str, value: &str, max: usize, extra: &[char]) -> Result<(), Invalid> {
    if value.is_empty() {
        return Err(Invalid(format!("{field} must not be empty")));
    }
    if value.len() > max {
        return Err(Invalid(format!(
            "{field} is {} bytes long; the limit is {max}",
            value.len()
        )));
    }
    if let Some(c) = value
        .chars()
        .find(|c| !(name_char(*c) || extra.contains(c)))
    {
        return Err(Invalid(format!(
            "{field} {value:?} contains {c:?}; allowed are letters, digits, '.', '_', '-'{}",
            extra.iter().map(|c| format!(", {c:?}")).collect::<String>()
        )));
    }
    Ok(())
}

/// A job's name: 1 to 128 characters of `[A-Za-z0-9._-]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(String);

impl JobId {
    /// Checks a job id from the network.
    pub fn parse(s: &str) -> Result<Self, Invalid> {
        check_name("job_id", s, 128, &[])?;
        Ok(Self(s.to_owned()))
    }

    /// The id as a string.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Checks a node's self-chosen name (unique within a job).
pub fn node_id(s: &str) -> Result<String, Invalid> {
    check_name("node_id", s, 256, &[':'])?;
    Ok(s.to_owned())
}

/// Checks a host name or address advertised by a node or a worker.
pub fn host(field: &str, s: &str) -> Result<String, Invalid> {
    check_name(field, s, 255, &[':', '[', ']', '%'])?;
    Ok(s.to_owned())
}

/// Checks a communicator name (NCCL unique ids are published per communicator).
pub fn communicator(s: &str) -> Result<String, Invalid> {
    check_name("communicator", s, 128, &[':', '/'])?;
    Ok(s.to_owned())
}

/// Checks the name of a shared value or a barrier call site: printable, no control characters.
pub fn label(field: &str, s: &str, max: usize) -> Result<String, Invalid> {
    if s.is_empty() {
        return Err(Invalid(format!("{field} must not be empty")));
    }
    if s.len() > max {
        return Err(Invalid(format!(
            "{field} is {} bytes long; the limit is {max}",
            s.len()
        )));
    }
    if let Some(c) = s.chars().find(|&c| c.is_control() || is_bidi_control(c)) {
        let what = if c.is_control() {
            "a control character"
        } else {
            "a bidirectional formatting character, which can make names display as something else"
        };
        return Err(Invalid(format!(
            "{field} {s:?} contains {c:?} (U+{:04X}, {what}); control and bidirectional formatting characters are not allowed",
            c as u32
        )));
    }
    Ok(s.to_owned())
}

/// Whether `c` changes the display order of text around it (Unicode's bidirectional
/// formatting characters: embeddings and overrides U+202A-U+202E, isolates U+2066-U+2069,
/// and the marks U+200E, U+200F and U+061C). A name holding one can show in a listing as a
/// different name (issue 14), so names refuse them.
pub fn is_bidi_control(c: char) -> bool {
    matches!(c, '\u{202A}'..='\u{202E}' | '\u{2066}'..='\u{2069}' | '\u{200E}' | '\u{200F}' | '\u{061C}')
}

/// The longest key of the key-value store: torch's TCPStore takes 8 KiB keys (its libuv
/// server's limit, with the `/` its client adds), and the agent store puts its own prefix
/// (`torch/g<generation>/`) before them.
pub const MAX_KV_KEY_BYTES: usize = 8 * 1024 + 64;

/// Checks a key of the key-value store.
pub fn kv_key(s: &str) -> Result<String, Invalid> {
    label("key", s, MAX_KV_KEY_BYTES)
}

/// A generation as sent by a client: restart rounds count from 1.
pub fn generation(g: u64) -> Result<u64, Invalid> {
    if g == 0 {
        return Err(Invalid(
            "generation must be at least 1 (take it from the rendezvous answer or MUSTER_GENERATION)"
                .into(),
        ));
    }
    Ok(g)
}

/// A wait in milliseconds; 0 means "no wait" or "no limit" depending on the call.
pub fn wait(field: &str, ms: u64) -> Result<Option<Duration>, Invalid> {
    if ms == 0 {
        return Ok(None);
    }
    let d = Duration::from_millis(ms);
    if d > MAX_WAIT {
        return Err(Invalid(format!(
            "{field} is {ms} ms; the limit is {} ms",
            MAX_WAIT.as_millis()
        )));
    }
    Ok(Some(d))
}

/// Which ranks a barrier spans (validated `BarrierScope`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Every rank of the generation.
    Global,
    /// The ranks of one node.
    Node,
}

impl Scope {
    /// Converts the wire enum; `UNSPECIFIED` and unknown values are rejected.
    pub fn from_wire(v: i32) -> Result<Self, Invalid> {
        use muster_proto::v1::BarrierScope;
        match BarrierScope::try_from(v) {
            Ok(BarrierScope::Global) => Ok(Self::Global),
            Ok(BarrierScope::Node) => Ok(Self::Node),
            _ => Err(Invalid(format!(
                "barrier scope {v} is not valid; use GLOBAL (1) or NODE (2)"
            ))),
        }
    }

    /// The wire value.
    pub fn to_wire(self) -> i32 {
        use muster_proto::v1::BarrierScope;
        match self {
            Self::Global => BarrierScope::Global as i32,
            Self::Node => BarrierScope::Node as i32,
        }
    }

    /// Index into per-scope arrays.
    pub fn index(self) -> usize {
        match self {
            Self::Global => 0,
            Self::Node => 1,
        }
    }
}

impl std::fmt::Display for Scope {
    /// "global" or "node".
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Global => "global",
            Self::Node => "node",
        })
    }
}

/// How many ranks an error message lists before it says "and N more".
pub const RANKS_SHOWN: usize = 16;

/// "global barrier" or "node N barrier", for messages.
pub fn scope_name(scope: Scope, node_rank: u32) -> String {
    match scope {
        Scope::Global => "global barrier".into(),
        Scope::Node => format!("node {node_rank} barrier"),
    }
}

/// "3 (node 1, host h), 4 (node 1, host h) and 9 more": ranks with where they run, for
/// messages (the coordinator's and the agent relay's alike).
pub fn list_ranks(ranks: &[muster_proto::v1::RankLocation]) -> String {
    use std::fmt::Write as _;
    let mut s = String::new();
    for (i, r) in ranks.iter().enumerate() {
        if i == RANKS_SHOWN {
            let _ = write!(s, " and {} more", ranks.len() - RANKS_SHOWN);
            break;
        }
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{} (node {}, host {})", r.rank(), r.node_rank(), r.host);
    }
    s
}

/// A barrier error with only a kind and a message.
pub fn barrier_error(
    kind: muster_proto::v1::barrier_error::Kind,
    message: String,
) -> muster_proto::v1::BarrierError {
    muster_proto::v1::BarrierError {
        kind: kind as i32,
        message,
        ..Default::default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn check(input: &str, ok: bool) {
        assert_eq!(JobId::parse(input).is_ok(), ok, "job id {input:?}");
    }

    #[test]
    fn job_ids() {
        for (input, ok) in [
            ("train", true),
            ("a.b_c-9", true),
            ("", false),
            ("has space", false),
            ("slash/no", false),
            (&"x".repeat(128), true),
            (&"x".repeat(129), false),
            ("ünicode", false),
        ] {
            check(input, ok);
        }
    }

    #[test]
    fn labels_refuse_control_and_bidi_characters() {
        for (input, ok) in [
            ("step-1 / epoch 2", true),
            ("ünicode ok", true),
            ("tab\there", false),
            ("a\u{202E}b", false),
            ("a\u{202A}b", false),
            ("a\u{2066}b", false),
            ("a\u{2069}b", false),
            ("a\u{200E}b", false),
            ("a\u{200F}b", false),
            ("a\u{061C}b", false),
            ("a\u{2067}b", false),
        ] {
            let got = label("key", input, 512);
            assert_eq!(got.is_ok(), ok, "{input:?}: {got:?}");
            if let Err(Invalid(message)) = got {
                // Named and escaped: the message itself never carries the raw character.
                assert!(message.starts_with("key "), "{message}");
                assert!(!message.contains(|c: char| c.is_control() || is_bidi_control(c)));
                assert!(message.contains("U+"), "{message}");
            }
        }
    }

    #[test]
    fn waits() {
        assert_eq!(wait("wait_ms", 0), Ok(None));
        assert_eq!(wait("wait_ms", 5), Ok(Some(Duration::from_millis(5))));
        assert!(wait("wait_ms", u64::MAX).is_err());
    }
}

/// What a detected hang does (the wire's `OnHang`, never unspecified here).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OnHang {
    /// The report is recorded and printed; the job goes on.
    #[default]
    Report,
    /// The job fails with the report as its root cause, without a restart.
    Fail,
    /// The generation fails and the job restarts (counted against `max_restarts`).
    Restart,
}

impl OnHang {
    /// The wire value; `None` for ON_HANG_UNSPECIFIED. A value outside the enum is an
    /// [`Invalid`] naming `field`.
    pub fn from_wire(field: &str, v: i32) -> Result<Option<Self>, Invalid> {
        match muster_proto::v1::OnHang::try_from(v) {
            Ok(muster_proto::v1::OnHang::Unspecified) => Ok(None),
            Ok(muster_proto::v1::OnHang::Report) => Ok(Some(Self::Report)),
            Ok(muster_proto::v1::OnHang::Fail) => Ok(Some(Self::Fail)),
            Ok(muster_proto::v1::OnHang::Restart) => Ok(Some(Self::Restart)),
            Err(_) => Err(Invalid(format!(
                "{field} {v} is not a hang action (1: report, 2: fail, 3: restart)"
            ))),
        }
    }

    /// The wire value.
    pub fn to_wire(self) -> i32 {
        match self {
            Self::Report => muster_proto::v1::OnHang::Report as i32,
            Self::Fail => muster_proto::v1::OnHang::Fail as i32,
            Self::Restart => muster_proto::v1::OnHang::Restart as i32,
        }
    }

    /// The name an operator types (`--on-hang`).
    pub fn name(self) -> &'static str {
        match self {
            Self::Report => "report",
            Self::Fail => "fail",
            Self::Restart => "restart",
        }
    }

    /// Reads an operator's spelling; the error lists the ones accepted.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "report" => Ok(Self::Report),
            "fail" => Ok(Self::Fail),
            "restart" => Ok(Self::Restart),
            other => Err(format!(
                "'{other}' is not a hang action: expected report, fail or restart"
            )),
        }
    }
}

impl std::fmt::Display for OnHang {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
