//! In-place recovery at step boundaries: [`Membership::changed`], the per-step check that costs
//! no coordinator call and no lock, and [`Membership::quorum`], the call that agrees on the
//! new membership after a rank died.
//!
//! The flow, on every rank of a job launched with `--recovery in-place`
//! (`MUSTER_RECOVERY=in-place`):
//!
//! 1. A rank dies. The coordinator pushes `membership_changed` (a new epoch) to every live
//!    session; the session task stores the epoch in an atomic and wakes the
//!    [`FailureWatch`](crate::FailureWatch), so a collective blocked on the dead rank ends at
//!    once with [`Error::MembershipChanged`] (or [`Error::PeerLost`]) naming it.
//! 2. The training loop discards the step ([`Error::is_recoverable`]) or sees
//!    [`Membership::changed`] at its next step boundary, and calls [`Membership::quorum`] with
//!    the steps it committed. A replacement (spawned with `MUSTER_EPOCH`) calls it first, with
//!    no step.
//! 3. The quorum's answer ([`Quorum`]) names the epoch, the step every rank continues from,
//!    and which ranks heal from which: the communicator is rebuilt for the epoch
//!    ([`Communicator::reconfigure`](crate::comm::Communicator::reconfigure)) and the healed
//!    ranks receive their state ([`Communicator::heal`](crate::comm::Communicator::heal)).
//!
//! In restart mode nothing is ever pushed: [`Membership::changed`] stays false and a quorum
//! call is refused (FAILED_PRECONDITION) by the coordinator.

use std::sync::atomic::Ordering;

use crate::{Accelerator, Error};

pub use crate::client::{Heal, Quorum};

/// A training process's view of the job's membership, from [`Accelerator::membership`]:
/// cheap to make (it borrows the accelerator), made once per step or kept.
#[derive(Debug, Clone, Copy)]
pub struct Membership<'a> {
    accelerator: &'a Accelerator,
    /// The session's watch: its pushed epoch is what [`Membership::changed`] loads.
    watch_epoch: Option<&'a std::sync::atomic::AtomicU64>,
}

impl<'a> Membership<'a> {
    pub(crate) fn new(accelerator: &'a Accelerator) -> Self {
        Self {
            accelerator,
            watch_epoch: accelerator.session().map(|s| s.pushed_epoch_atomic()),
        }
    }

    /// Whether this rank must go to [`Membership::quorum`] before its next step: the
    /// coordinator pushed a membership epoch above the one of this rank's last quorum (a rank
    /// died), or this process is a replacement that has not taken part in a quorum yet.
    ///
    /// The fast path of every step: at most three atomic loads, no coordinator call, no lock
    /// (the session task stores the pushed epoch when the push arrives).
    #[inline]
    pub fn changed(&self) -> bool {
        let state = &self.accelerator.membership;
        if state.awaiting_first.load(Ordering::Acquire) {
            return true;
        }
        self.watch_epoch.is_some_and(|pushed| {
            pushed.load(Ordering::Acquire) > state.current.load(Ordering::Acquire)
        })
    }

    /// The epoch of the last quorum this process took part in (0 before any; a replacement's
    /// spawn epoch before its first).
    pub fn epoch(&self) -> u64 {
        self.accelerator.membership.current.load(Ordering::Acquire)
    }

    /// The highest membership epoch the coordinator has pushed to this process (0: none).
    pub fn pushed_epoch(&self) -> u64 {
        self.watch_epoch
            .map_or(0, |pushed| pushed.load(Ordering::Acquire))
    }

    /// Agrees on the new membership with every other rank: calls `Rendezvous.Quorum` (a long
    /// poll, asked again when it runs out and retried across a coordinator failover) with this
    /// rank's epoch, `step` (the training steps it has committed; `None` for a replacement
    /// that has no state yet) and its released barrier seqs, and returns once every rank of
    /// the generation is alive and has asked. This process then belongs to the quorum's epoch:
    /// rebuild communicators for it and heal.
    ///
    /// A replacement's first quorum also moves its barrier sequence numbers to the quorum's
    /// released seqs (and registers it with the agent relay, resuming from them), so that its
    /// next barrier is the one the other ranks enter next.
    ///
    /// Errors: FAILED_PRECONDITION ([`Error::Rpc`]) when the job does not recover in place or
    /// the generation ended (no restarts left, cancelled): exit, as in restart mode; a lost
    /// coordinator; an answer the protocol does not allow.
    pub fn quorum(&self, step: Option<u64>) -> Result<Quorum, Error> {
        self.accelerator.take_quorum(step)
    }
}
