//! Requests as the job rules take them: each prost request (or stream message) becomes one of
//! these through `TryFrom` at the edge (the coordinator's gRPC handlers), so the job code only
//! sees checked values. A failed check is an [`Invalid`] naming the field, which becomes
//! `INVALID_ARGUMENT`; fields are checked in the order the wire message lists them, so the
//! first bad field is the one named.

use crate::failure::FailureDetail;
pub use crate::model::OnHang;
use crate::model::{self, Invalid, JobId, Scope};
use muster_proto::v1 as pb;
use std::time::Duration;

/// How a job's rounds are formed (validated `RendezvousConfig`, defaults filled in).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundConfig {
    /// Fewest nodes a round closes with.
    pub min_nodes: u32,
    /// Most nodes a round takes.
    pub max_nodes: u32,
    /// How long to wait for more nodes once `min_nodes` have joined.
    pub last_call: Duration,
    /// How long a round may stay open.
    pub join_timeout: Duration,
    /// Restarts allowed after failed generations.
    pub max_restarts: u32,
    /// What a worker's death does.
    pub recovery: Recovery,
    /// How a hang is detected and what it does.
    pub hang: Hang,
    /// Spare agents admitted (standing by to take a lost node's ranks in place).
    pub max_spares: u32,
}

/// A job's hang detection (`RendezvousConfig.hang_timeout_ms` and `on_hang`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Hang {
    /// How long the running generation may make no progress; `None`: no detection.
    pub timeout: Option<Duration>,
    /// What a detected hang does.
    pub action: OnHang,
}

/// The shortest hang timeout: below it, a healthy step between two samples would be a hang.
pub const MIN_HANG_TIMEOUT: Duration = Duration::from_secs(1);

impl Hang {
    /// Checks the wire's pair; `None` when the timeout is absent (the job's, or none).
    pub fn from_wire(timeout_ms: Option<u64>, action: i32) -> Result<Option<Self>, Invalid> {
        let action = OnHang::from_wire("on_hang", action)?.unwrap_or_default();
        let Some(ms) = timeout_ms else {
            return Ok(None);
        };
        let timeout = match model::wait("hang_timeout_ms", ms)? {
            Some(d) if d < MIN_HANG_TIMEOUT => {
                return Err(Invalid(format!(
                    "hang_timeout_ms is {ms} ms; the least is {} ms (0 turns hang detection off)",
                    MIN_HANG_TIMEOUT.as_millis()
                )));
            }
            d => d,
        };
        Ok(Some(Self { timeout, action }))
    }

    /// The wire's timeout (0: off).
    pub fn timeout_ms(&self) -> u64 {
        self.timeout
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// What a worker's death does (the wire's `RecoveryMode`, never unspecified here; the workers'
/// `MUSTER_RECOVERY`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
#[cfg_attr(feature = "clap", derive(clap::ValueEnum))]
pub enum Recovery {
    /// The generation ends and every worker restarts (the default).
    #[default]
    Restart,
    /// Only the dead worker is respawned; the others agree on a new membership (`Quorum`).
    InPlace,
}

impl Recovery {
    /// The wire value; `None` for RECOVERY_MODE_UNSPECIFIED (the caller's default applies).
    /// A value outside the enum is an [`Invalid`] naming `field`.
    pub fn from_wire(field: &str, v: i32) -> Result<Option<Self>, Invalid> {
        match pb::RecoveryMode::try_from(v) {
            Ok(pb::RecoveryMode::Unspecified) => Ok(None),
            Ok(pb::RecoveryMode::Restart) => Ok(Some(Self::Restart)),
            Ok(pb::RecoveryMode::InPlace) => Ok(Some(Self::InPlace)),
            Err(_) => Err(Invalid(format!(
                "{field} {v} is not a recovery mode (1: restart, 2: in-place)"
            ))),
        }
    }

    /// The mode an answer names (`JoinResponse.recovery`): unspecified (a coordinator that
    /// predates in-place recovery) and unknown values are a restart, the behaviour before it.
    pub fn from_answer(v: i32) -> Self {
        Self::from_wire("recovery", v)
            .ok()
            .flatten()
            .unwrap_or_default()
    }

    /// The wire value.
    pub fn to_wire(self) -> i32 {
        match self {
            Self::Restart => pb::RecoveryMode::Restart as i32,
            Self::InPlace => pb::RecoveryMode::InPlace as i32,
        }
    }

    /// The contract's spelling, what an operator types (`--recovery`, the config file's
    /// `muster_recovery`, the workers' `MUSTER_RECOVERY`): `restart` or `in-place`.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Restart => "restart",
            Self::InPlace => "in-place",
        }
    }

    /// Reads the contract's spelling; the error lists the ones accepted.
    pub fn parse(s: &str) -> Result<Self, String> {
        match s {
            "restart" => Ok(Self::Restart),
            "in-place" => Ok(Self::InPlace),
            other => Err(format!(
                "'{other}' is not a recovery mode: expected restart or in-place"
            )),
        }
    }
}

impl std::fmt::Display for Recovery {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A join's `RendezvousConfig` as checked: what it sets, before the coordinator's defaults
/// fill in the waits it leaves at 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RoundSpec {
    /// Fewest nodes a round closes with (at least 1).
    pub min_nodes: u32,
    /// Most nodes a round takes (at least `min_nodes`).
    pub max_nodes: u32,
    /// The last call, when set.
    pub last_call: Option<Duration>,
    /// The join timeout, when set.
    pub join_timeout: Option<Duration>,
    /// The restart budget, when set: a join that leaves it unset takes the existing job's.
    pub max_restarts: Option<u32>,
    /// The recovery mode, when set: a join that leaves it unset takes the existing job's.
    pub recovery: Option<Recovery>,
    /// Hang detection, when set: a join that leaves it unset takes the existing job's.
    pub hang: Option<Hang>,
    /// Spares admitted, when set (the first joiner's stands, as for hang detection).
    pub max_spares: Option<u32>,
}

impl RoundSpec {
    /// Checks a join's configuration; `None` when it sets nothing (the job's, or the
    /// coordinator's defaults, apply).
    pub fn from_wire(c: Option<pb::RendezvousConfig>) -> Result<Option<Self>, Invalid> {
        let Some(c) = c else { return Ok(None) };
        if c.min_nodes == 0
            && c.max_nodes == 0
            && c.last_call_ms == 0
            && c.join_timeout_ms == 0
            && c.max_restarts.is_none()
            && c.recovery == 0
            && c.hang_timeout_ms.is_none()
            && c.on_hang == 0
            && c.max_spares.is_none()
        {
            return Ok(None);
        }
        if let Some(n) = c.max_restarts
            && n > model::MAX_RESTARTS
        {
            return Err(Invalid(format!(
                "max_restarts ({n}) is above the limit of {}",
                model::MAX_RESTARTS
            )));
        }
        if let Some(n) = c.max_spares
            && n > model::MAX_NODES
        {
            return Err(Invalid(format!(
                "max_spares ({n}) is above the limit of {}",
                model::MAX_NODES
            )));
        }
        let min_nodes = c.min_nodes.max(1);
        let max_nodes = if c.max_nodes == 0 {
            min_nodes
        } else {
            c.max_nodes
        };
        if max_nodes < min_nodes {
            return Err(Invalid(format!(
                "max_nodes ({max_nodes}) must not be below min_nodes ({min_nodes})"
            )));
        }
        if max_nodes > model::MAX_NODES {
            return Err(Invalid(format!(
                "max_nodes ({max_nodes}) is above the limit of {}",
                model::MAX_NODES
            )));
        }
        Ok(Some(Self {
            min_nodes,
            max_nodes,
            last_call: model::wait("last_call_ms", c.last_call_ms)?,
            join_timeout: model::wait("join_timeout_ms", c.join_timeout_ms)?,
            max_restarts: c.max_restarts,
            recovery: Recovery::from_wire("recovery", c.recovery)?,
            hang: Hang::from_wire(c.hang_timeout_ms, c.on_hang)?,
            max_spares: c.max_spares,
        }))
    }

    /// The configuration with the waits it left unset taken from `defaults` and, when it
    /// left the restart budget, the recovery mode or hang detection unset, `max_restarts`,
    /// `recovery` and `hang` (the existing job's, or restart, 0 and none for a new one), and
    /// the spares `defaults` has where it left them unset.
    pub fn resolve(
        self,
        defaults: RoundConfig,
        max_restarts: u32,
        recovery: Recovery,
        hang: Hang,
    ) -> RoundConfig {
        RoundConfig {
            min_nodes: self.min_nodes,
            max_nodes: self.max_nodes,
            last_call: self.last_call.unwrap_or(defaults.last_call),
            join_timeout: self.join_timeout.unwrap_or(defaults.join_timeout),
            max_restarts: self.max_restarts.unwrap_or(max_restarts),
            recovery: self.recovery.unwrap_or(recovery),
            hang: self.hang.unwrap_or(hang),
            max_spares: self.max_spares.unwrap_or(defaults.max_spares),
        }
    }
}

/// A validated join, as the job's round takes it.
#[derive(Debug, Clone)]
pub struct JoinReq {
    /// The node's self-chosen name.
    pub node_id: String,
    /// The node's advertised host.
    pub host: String,
    /// Workers on the node.
    pub local_world_size: u32,
    /// The node rank asked for, if any.
    pub requested: Option<u32>,
    /// The caller's id of this join attempt (empty: none), so that a retried join whose
    /// round already closed gets the same place.
    pub request_id: String,
    /// The caller will watch its node once the round closes (an agent does).
    pub watches: bool,
    /// A spare: it stands by, taking no ranks until a node is lost.
    pub spare: bool,
}

/// `Rendezvous.Join`, checked.
#[derive(Debug, Clone)]
pub struct Join {
    /// The job joined (created by the first join).
    pub job_id: JobId,
    /// The node and its place.
    pub node: JoinReq,
    /// The round configuration the join asks for, if it sets one.
    pub round: Option<RoundSpec>,
}

impl TryFrom<pb::JoinRequest> for Join {
    type Error = Invalid;

    fn try_from(r: pb::JoinRequest) -> Result<Self, Invalid> {
        let job_id = JobId::parse(&r.job_id)?;
        let node = JoinReq {
            node_id: model::node_id(&r.node_id)?,
            host: model::host("host", &r.host)?,
            local_world_size: match r.local_world_size {
                n @ 1..=model::MAX_LOCAL_WORLD_SIZE => n,
                n => {
                    return Err(Invalid(format!(
                        "local_world_size {n} is out of range 1..={}",
                        model::MAX_LOCAL_WORLD_SIZE
                    )));
                }
            },
            requested: r.requested_node_rank,
            request_id: if r.request_id.is_empty() {
                String::new()
            } else {
                model::label("request_id", &r.request_id, 128)?
            },
            watches: r.watches,
            spare: r.spare,
        };
        Ok(Self {
            job_id,
            node,
            round: RoundSpec::from_wire(r.config)?,
        })
    }
}

/// The last `max` characters of `s` (what an agent reports may be long; the end matters).
fn clip(s: &str, max: usize) -> String {
    let n = s.chars().count();
    s.chars().skip(n.saturating_sub(max)).collect()
}

/// `Rendezvous.ReportFailure`, checked: the agent's account of a worker's end.
#[derive(Debug, Clone)]
pub struct FailureReport {
    /// The generation the worker ran in.
    pub generation: u64,
    /// The worker's global rank.
    pub rank: u32,
    /// The one-line reason.
    pub reason: String,
    /// Exit status, error file and stderr, each clipped to its end.
    pub detail: FailureDetail,
    /// The reporting agent's node id (empty: not said).
    pub node_id: String,
}

impl TryFrom<pb::ReportFailureRequest> for FailureReport {
    type Error = Invalid;

    fn try_from(r: pb::ReportFailureRequest) -> Result<Self, Invalid> {
        Ok(Self {
            generation: model::generation(r.generation)?,
            rank: r.rank,
            reason: model::label("reason", &r.reason, 4096)?,
            detail: FailureDetail {
                exit_code: r.exit_code,
                signal: r.signal,
                error_message: clip(&r.error_message, 4096),
                error_traceback: clip(&r.error_traceback, 16384),
                stderr_tail: clip(&r.stderr_tail, 8192),
            },
            node_id: if r.node_id.is_empty() {
                String::new()
            } else {
                model::node_id(&r.node_id)?
            },
        })
    }
}

/// A session's `Register`, checked (the job id is looked up by the caller).
#[derive(Debug, Clone)]
pub struct SessionRegister {
    /// The generation the worker belongs to.
    pub generation: u64,
    /// The worker's global rank.
    pub rank: u32,
    /// Its process id, for the ops view.
    pub pid: u32,
    /// Its host (empty: the node's).
    pub host: String,
    /// When re-attaching after a failover: the last barrier seq released, per scope (global,
    /// node).
    pub resume: Option<[u64; 2]>,
    /// In-place recovery: the worker replaces its rank, spawned for this membership epoch
    /// (at least 1).
    pub replacement: Option<u64>,
}

impl TryFrom<&pb::Register> for SessionRegister {
    type Error = Invalid;

    fn try_from(r: &pb::Register) -> Result<Self, Invalid> {
        Ok(Self {
            generation: model::generation(r.generation)?,
            rank: r.rank,
            pid: r.pid,
            host: if r.host.is_empty() {
                String::new()
            } else {
                model::host("host", &r.host)?
            },
            resume: r.resume.then_some([r.released_global, r.released_node]),
            replacement: match (r.replacement, r.epoch) {
                (true, 0) => {
                    return Err(Invalid(
                        "epoch 0 with replacement: a replacement registers with the membership epoch it was spawned for (MUSTER_EPOCH, at least 1)".to_owned(),
                    ));
                }
                (true, e) => Some(e),
                (false, _) => None,
            },
        })
    }
}

/// A session's barrier entry, checked.
#[derive(Debug, Clone)]
pub struct BarrierEntry {
    /// Which ranks the barrier spans.
    pub scope: Scope,
    /// The call's number in its scope (1, 2, 3...).
    pub seq: u64,
    /// The call site's name: ranks that meet under different names diverged.
    pub name: String,
    /// How long the rank waits (None: no limit).
    pub timeout: Option<Duration>,
}

impl TryFrom<&pb::BarrierEnter> for BarrierEntry {
    type Error = Invalid;

    fn try_from(b: &pb::BarrierEnter) -> Result<Self, Invalid> {
        Ok(Self {
            scope: Scope::from_wire(b.scope)?,
            seq: b.seq,
            name: model::label("barrier name", &b.name, crate::barrier::MAX_NAME)?,
            timeout: model::wait("timeout_ms", b.timeout_ms)?,
        })
    }
}

/// A relay's `RelayRegister`, checked (the job id is looked up by the caller).
#[derive(Debug, Clone)]
pub struct RelayRegister {
    /// The generation the relay's node runs.
    pub generation: u64,
    /// The relay's node.
    pub node_rank: u32,
    /// When re-attaching after a failover: the last global barrier seq released.
    pub resume: Option<u64>,
    /// The agent's node id (empty: not said).
    pub node_id: String,
}

impl TryFrom<&pb::RelayRegister> for RelayRegister {
    type Error = Invalid;

    fn try_from(r: &pb::RelayRegister) -> Result<Self, Invalid> {
        Ok(Self {
            generation: model::generation(r.generation)?,
            node_rank: r.node_rank,
            resume: r.resume.then_some(r.released),
            node_id: if r.node_id.is_empty() {
                String::new()
            } else {
                model::node_id(&r.node_id)?
            },
        })
    }
}

/// A relay's aggregated entry into a global barrier, checked.
#[derive(Debug, Clone)]
pub struct GroupEntry {
    /// The global barrier's number.
    pub seq: u64,
    /// Each call-site name with the node's ranks that entered under it.
    pub groups: Vec<(String, Vec<u32>)>,
    /// How long the ranks wait (None: no limit).
    pub timeout: Option<Duration>,
}

impl TryFrom<pb::GroupEnter> for GroupEntry {
    type Error = Invalid;

    fn try_from(e: pb::GroupEnter) -> Result<Self, Invalid> {
        let groups = e
            .groups
            .into_iter()
            .map(|g| {
                Ok((
                    model::label("barrier name", &g.name, crate::barrier::MAX_NAME)?,
                    g.ranks,
                ))
            })
            .collect::<Result<Vec<_>, Invalid>>()?;
        Ok(Self {
            seq: e.seq,
            groups,
            timeout: model::wait("timeout_ms", e.timeout_ms)?,
        })
    }
}

/// How long a `Quorum` call waits when it sets no `wait_ms`.
pub const QUORUM_WAIT_DEFAULT: Duration = Duration::from_secs(30);
/// The longest a `Quorum` call may wait.
pub const QUORUM_WAIT_MAX: Duration = Duration::from_secs(60);

/// `Rendezvous.Quorum`, checked (the job id is looked up by the caller).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct QuorumAsk {
    /// The job asked about.
    pub job_id: JobId,
    /// The generation the caller runs in.
    pub generation: u64,
    /// The caller's rank.
    pub rank: u32,
    /// The membership epoch of the caller's communicator.
    pub epoch: u64,
    /// The steps the caller committed (None: a replacement with no state yet).
    pub step: Option<u64>,
    /// The caller's released barrier seqs (global, node).
    pub released: [u64; 2],
    /// How long the call waits before DEADLINE_EXCEEDED.
    pub wait: Duration,
}

impl TryFrom<pb::QuorumRequest> for QuorumAsk {
    type Error = Invalid;

    fn try_from(r: pb::QuorumRequest) -> Result<Self, Invalid> {
        let wait = match r.wait_ms {
            0 => QUORUM_WAIT_DEFAULT,
            ms if ms > QUORUM_WAIT_MAX.as_millis() as u64 => {
                return Err(Invalid(format!(
                    "wait_ms {ms} is above the limit of {} (0 means {})",
                    QUORUM_WAIT_MAX.as_millis(),
                    QUORUM_WAIT_DEFAULT.as_millis()
                )));
            }
            ms => Duration::from_millis(ms),
        };
        Ok(Self {
            job_id: JobId::parse(&r.job_id)?,
            generation: model::generation(r.generation)?,
            rank: r.rank,
            epoch: r.epoch,
            step: r.step,
            released: [r.released_global, r.released_node],
            wait,
        })
    }
}

/// A node's watch `NodeAttach`, checked (the job id is looked up by the caller).
#[derive(Debug, Clone)]
pub struct NodeAttach {
    /// The generation the node runs.
    pub generation: u64,
    /// The node's rank in it.
    pub node_rank: u32,
    /// The node id it joined with: proves it is the node placed there.
    pub node_id: String,
    /// The agent's number for this open (0: unnumbered); a lower one than the node's
    /// registered watch is refused.
    pub attempt: u64,
}

impl TryFrom<&pb::NodeAttach> for NodeAttach {
    type Error = Invalid;

    fn try_from(a: &pb::NodeAttach) -> Result<Self, Invalid> {
        Ok(Self {
            generation: model::generation(a.generation)?,
            node_rank: a.node_rank,
            node_id: model::node_id(&a.node_id)?,
            attempt: a.attempt,
        })
    }
}

/// A node named by an operator: by its id or by its rank in the running generation.
#[derive(Debug, Clone)]
pub enum NodeRef {
    /// The node id it joined with.
    Id(String),
    /// Its node rank in the running generation.
    Rank(u32),
}

impl std::fmt::Display for NodeRef {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Id(id) => write!(f, "node '{id}'"),
            Self::Rank(r) => write!(f, "node rank {r}"),
        }
    }
}

/// An operator's reason (for a cancel or a drain), or `default` when it gave none.
fn reason_or(reason: &str, default: &str) -> Result<String, Invalid> {
    if reason.is_empty() {
        Ok(default.to_owned())
    } else {
        model::label("reason", reason, 1024)
    }
}

/// `Ops.DrainNode`, checked (the job id is looked up by the caller).
#[derive(Debug, Clone)]
pub struct Drain {
    /// The node to drain.
    pub node: NodeRef,
    /// Why, as the node's agent and the ops view will read it.
    pub reason: String,
}

impl TryFrom<pb::DrainNodeRequest> for Drain {
    type Error = Invalid;

    fn try_from(r: pb::DrainNodeRequest) -> Result<Self, Invalid> {
        use pb::drain_node_request::Node;
        let node = match r.node {
            Some(Node::NodeId(id)) => NodeRef::Id(model::node_id(&id)?),
            Some(Node::NodeRank(rank)) => NodeRef::Rank(rank),
            None => {
                return Err(Invalid(
                    "name the node to drain: set node_id or node_rank".into(),
                ));
            }
        };
        Ok(Self {
            node,
            reason: reason_or(&r.reason, "drained by an operator")?,
        })
    }
}

/// `Ops.CancelJob`'s reason, checked (the job id is looked up by the caller).
#[derive(Debug, Clone)]
pub struct Cancel {
    /// Why, as the agents and the ops view will read it.
    pub reason: String,
}

impl TryFrom<&pb::CancelJobRequest> for Cancel {
    type Error = Invalid;

    fn try_from(r: &pb::CancelJobRequest) -> Result<Self, Invalid> {
        Ok(Self {
            reason: reason_or(&r.reason, "no reason given")?,
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn join(config: Option<pb::RendezvousConfig>) -> pb::JoinRequest {
        pb::JoinRequest {
            job_id: "j".into(),
            node_id: "n".into(),
            host: "h".into(),
            local_world_size: 1,
            config,
            ..Default::default()
        }
    }

    /// The first bad field is the one named, and a config that sets nothing is no config.
    #[test]
    fn joins() {
        let bad = |r: pb::JoinRequest| Join::try_from(r).unwrap_err().0;
        assert!(
            bad(pb::JoinRequest {
                job_id: String::new(),
                host: String::new(),
                ..join(None)
            })
            .starts_with("job_id")
        );
        assert!(
            bad(pb::JoinRequest {
                local_world_size: 0,
                ..join(None)
            })
            .starts_with("local_world_size 0")
        );
        let c = |min, max| pb::RendezvousConfig {
            min_nodes: min,
            max_nodes: max,
            ..Default::default()
        };
        assert!(bad(join(Some(c(3, 2)))).starts_with("max_nodes (2) must not be below"));
        let ok = Join::try_from(join(Some(c(0, 0)))).map(|j| j.round.is_none());
        assert_eq!(ok, Ok(true));
        let spec = Join::try_from(join(Some(c(2, 0)))).map(|j| j.round);
        let defaults = RoundConfig {
            min_nodes: 1,
            max_nodes: 1,
            last_call: Duration::from_secs(1),
            join_timeout: Duration::from_secs(2),
            max_restarts: 0,
            recovery: Recovery::Restart,
            hang: Hang::default(),
            max_spares: 0,
        };
        assert_eq!(
            spec.map(|s| s.map(|s| s.resolve(defaults, 7, Recovery::Restart, Hang::default()))),
            Ok(Some(RoundConfig {
                min_nodes: 2,
                max_nodes: 2,
                max_restarts: 7,
                ..defaults
            }))
        );
    }

    /// A hang timeout is off at 0, at least a second otherwise, within the wait limit; an
    /// unknown action is named; a join that sets neither leaves the job's.
    #[test]
    fn hang_settings_are_checked_naming_the_field() {
        let round = |hang_timeout_ms, on_hang| {
            RoundSpec::from_wire(Some(pb::RendezvousConfig {
                hang_timeout_ms,
                on_hang,
                ..Default::default()
            }))
            .map(|s| s.and_then(|s| s.hang))
        };
        assert_eq!(round(None, 0), Ok(None));
        assert_eq!(
            round(Some(90_000), pb::OnHang::Fail as i32),
            Ok(Some(Hang {
                timeout: Some(Duration::from_secs(90)),
                action: OnHang::Fail
            }))
        );
        assert_eq!(
            round(Some(0), 0),
            Ok(Some(Hang {
                timeout: None,
                action: OnHang::Report
            }))
        );
        assert_eq!(
            round(Some(999), 0).unwrap_err().0,
            "hang_timeout_ms is 999 ms; the least is 1000 ms (0 turns hang detection off)"
        );
        assert!(
            round(Some(u64::MAX), 0)
                .unwrap_err()
                .0
                .starts_with("hang_timeout_ms is ")
        );
        assert_eq!(
            round(Some(5_000), 7).unwrap_err().0,
            "on_hang 7 is not a hang action (1: report, 2: fail, 3: restart)"
        );
        assert_eq!(OnHang::parse("restart"), Ok(OnHang::Restart));
        assert!(OnHang::parse("stop").is_err());
    }

    #[test]
    fn recovery_spellings() {
        for mode in [Recovery::Restart, Recovery::InPlace] {
            assert_eq!(Recovery::parse(mode.as_str()), Ok(mode));
            assert_eq!(Recovery::from_wire("r", mode.to_wire()), Ok(Some(mode)));
        }
        assert_eq!(
            Recovery::parse("inplace"),
            Err("'inplace' is not a recovery mode: expected restart or in-place".to_owned())
        );
        assert_eq!(Recovery::from_wire("r", 0), Ok(None));
        assert_eq!(Recovery::from_answer(0), Recovery::Restart);
        assert_eq!(Recovery::from_answer(99), Recovery::Restart);
    }

    #[test]
    fn recovery_modes_and_quorum_calls_are_checked_naming_the_field() {
        let round = |recovery| {
            RoundSpec::from_wire(Some(pb::RendezvousConfig {
                recovery,
                ..Default::default()
            }))
        };
        let spec = round(pb::RecoveryMode::InPlace as i32).unwrap().unwrap();
        assert_eq!(spec.recovery, Some(Recovery::InPlace));
        assert_eq!(round(0), Ok(None));
        assert!(
            round(9)
                .unwrap_err()
                .0
                .starts_with("recovery 9 is not a recovery mode")
        );
        let defaults = RoundConfig {
            min_nodes: 1,
            max_nodes: 1,
            last_call: Duration::from_secs(1),
            join_timeout: Duration::from_secs(2),
            max_restarts: 0,
            recovery: Recovery::Restart,
            hang: Hang::default(),
            max_spares: 0,
        };
        // Unset: the job's mode; set: the join's.
        let unset = RoundSpec {
            recovery: None,
            ..spec
        };
        assert_eq!(
            unset
                .resolve(defaults, 0, Recovery::InPlace, Hang::default())
                .recovery,
            Recovery::InPlace
        );
        assert_eq!(
            spec.resolve(defaults, 0, Recovery::Restart, Hang::default())
                .recovery,
            Recovery::InPlace
        );
        let ask = |f: fn(&mut pb::QuorumRequest)| {
            let mut r = pb::QuorumRequest {
                job_id: "j".into(),
                generation: 1,
                ..Default::default()
            };
            f(&mut r);
            QuorumAsk::try_from(r)
        };
        assert_eq!(ask(|_| {}).unwrap().wait, QUORUM_WAIT_DEFAULT);
        assert!(ask(|r| r.job_id.clear()).unwrap_err().0.contains("job_id"));
        assert!(
            ask(|r| r.generation = 0)
                .unwrap_err()
                .0
                .contains("generation")
        );
        assert!(
            ask(|r| r.wait_ms = 60_001)
                .unwrap_err()
                .0
                .starts_with("wait_ms 60001 is above the limit of 60000")
        );
        let reg = |replacement, epoch| {
            SessionRegister::try_from(&pb::Register {
                generation: 1,
                replacement,
                epoch,
                ..Default::default()
            })
            .map(|r| r.replacement)
        };
        assert_eq!(reg(true, 2), Ok(Some(2)));
        assert_eq!(reg(false, 2), Ok(None));
        assert!(
            reg(true, 0)
                .unwrap_err()
                .0
                .starts_with("epoch 0 with replacement")
        );
    }

    #[test]
    fn drains_name_the_node_and_default_the_reason() {
        let d = Drain::try_from(pb::DrainNodeRequest::default()).unwrap_err();
        assert_eq!(d.0, "name the node to drain: set node_id or node_rank");
        let d = Drain::try_from(pb::DrainNodeRequest {
            node: Some(pb::drain_node_request::Node::NodeRank(2)),
            ..Default::default()
        });
        assert!(
            matches!(d, Ok(Drain { node: NodeRef::Rank(2), ref reason }) if reason == "drained by an operator")
        );
    }
}
