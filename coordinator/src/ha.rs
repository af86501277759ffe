//! Serving only while leading: the [`Gate`] every muster service sits behind, and the
//! leadership loop that opens it (`--store etcd`).
//!
//! With the memory store the gate is always open. Over a durable store (etcd), every replica
//! runs [`lead`]: it campaigns in the store's election (`store/election.rs`); once it leads,
//! it fences the store's writes with its term,
//! loads every job from the store (`Coordinator::recover`) and opens the gate; when the term
//! ends (lease lost, etcd unreachable past the TTL, a fenced write refused) it closes the
//! gate and drops every job from memory, ending their streams with UNAVAILABLE so that
//! clients re-attach to whoever leads next, and campaigns again. On shutdown (SIGTERM) it
//! closes the gate and resigns, revoking its lease so that a standby leads at once instead of
//! after the TTL. A closed gate answers every call UNAVAILABLE naming the leader (also in the
//! `muster-leader` response metadata) before any handler runs, so a refused call was
//! certainly not applied; `grpc.health.v1` reports NOT_SERVING for the empty service and
//! every muster service.
//!
//!
//! A leader that did not run past its lease decides nothing: see `tenure.rs`.

use crate::service::Coordinator;
use crate::store::Store;
use crate::store::election::{Election, Leadership, Role};
use std::sync::{Arc, PoisonError, RwLock};
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;
use tonic::Status;
use tonic::metadata::MetadataMap;

/// The response metadata key that names the leader's address on a refused call (the clients'
/// constant: they read what the gate writes).
pub use muster_core::failover::LEADER_KEY as LEADER_METADATA;

/// Whether this replica serves, and if not, whom to name.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Readiness {
    /// Leading (or running on the memory store): every call is served.
    Serving,
    /// Not leading; the leader's address when known.
    Following(Option<String>),
}

/// The gate in front of every muster service: open while this replica serves.
#[derive(Clone)]
pub struct Gate {
    state: Arc<watch::Sender<Readiness>>,
    /// The term this replica serves under: a request is refused the moment its lease deadline
    /// passes, before the leadership task has run (a process woken from SIGSTOP runs queued
    /// requests first).
    term: Arc<RwLock<Option<Leadership>>>,
    /// This replica's address, for the refusal message.
    me: Arc<str>,
}

impl Gate {
    /// A gate in state `initial` for the replica at `me`.
    pub fn new(initial: Readiness, me: &str) -> Self {
        Self {
            state: Arc::new(watch::channel(initial).0),
            term: Arc::new(RwLock::new(None)),
            me: me.into(),
        }
    }

    /// Sets the state.
    pub fn set(&self, r: Readiness) {
        self.state.send_if_modified(|s| {
            let changed = *s != r;
            *s = r;
            changed
        });
    }

    /// Serves under `term` (`None`: no term, the memory store).
    fn serve(&self, term: Option<Leadership>) {
        *self.term.write().unwrap_or_else(PoisonError::into_inner) = term;
        self.set(Readiness::Serving);
    }

    /// Updates the leader named while following (no change while serving).
    fn follow(&self, leader: Option<String>) {
        self.state.send_if_modified(|s| match s {
            Readiness::Following(l) if *l != leader => {
                *l = leader;
                true
            }
            _ => false,
        });
    }

    /// The state's changes.
    pub fn subscribe(&self) -> watch::Receiver<Readiness> {
        self.state.subscribe()
    }

    /// Ok while serving; otherwise the UNAVAILABLE status that names the leader.
    pub fn check(&self) -> Result<(), Status> {
        let leader = match &*self.state.borrow() {
            Readiness::Serving => {
                let term = self.term.read().unwrap_or_else(PoisonError::into_inner);
                if term.as_ref().is_none_or(Leadership::is_current) {
                    return Ok(());
                }
                // Its term's lease deadline passed: it is stepping down (and may lead again).
                return Err(Status::unavailable(format!(
                    "coordinator {} is not the leader: its leader lease lapsed (etcd answered no keep-alive within the lease TTL) and it is stepping down; retry shortly",
                    self.me
                )));
            }
            Readiness::Following(l) => l.clone(),
        };
        let mut metadata = MetadataMap::new();
        let message = match leader {
            Some(l) if *l == *self.me => format!(
                "coordinator {} is taking over as leader (loading state); retry shortly",
                self.me
            ),
            Some(l) => {
                if let Ok(v) = l.parse() {
                    metadata.insert(LEADER_METADATA, v);
                }
                format!(
                    "coordinator {} is not the leader; the leader is {l}",
                    self.me
                )
            }
            None => format!(
                "coordinator {} is not the leader and no leader is elected yet (is etcd reachable?); retry shortly",
                self.me
            ),
        };
        Err(Status::with_metadata(
            tonic::Code::Unavailable,
            message,
            metadata,
        ))
    }
}

/// How long a replica shutting down waits for etcd to revoke its lease
/// ([`Election::resign`]): less than the binary's 2 s drain, so that a stuck etcd delays the
/// exit by at most this (the lease then expires by itself, within its TTL).
pub const RESIGN_TIMEOUT: Duration = Duration::from_millis(1500);

/// Runs this replica's leadership (see the module comment) until `stop` is cancelled (the
/// process is shutting down); then closes the gate and resigns, revoking its lease so that a
/// standby leads at once rather than after the TTL, within [`RESIGN_TIMEOUT`].
/// Returns at once over a store without an election (the memory store).
pub async fn lead(
    coordinator: Arc<Coordinator>,
    store: &dyn Store,
    me: String,
    ttl: Duration,
    gate: Gate,
    stop: CancellationToken,
) {
    let Some(election) = store.election(&me, ttl) else {
        return;
    };
    let mut roles = election.roles();
    let hints = gate.clone();
    // Task "leader-hint": keeps the leader a follower names up to date. Ends with the
    // election (the runtime).
    tokio::spawn(async move {
        loop {
            let leader = match &*roles.borrow_and_update() {
                Role::Follower(l) => Some(l.clone()),
                Role::Leader | Role::Unknown => None,
            };
            hints.follow(leader);
            if roles.changed().await.is_err() {
                return;
            }
        }
    });
    tokio::select! {
        () = terms(&coordinator, store, &me, &election, &gate) => {}
        () = stop.cancelled() => {}
    }
    // Shutting down: refuse calls from now on, then give the leader key up (the election's
    // own revoke on drop would never run: the runtime ends with the process).
    gate.set(Readiness::Following(None));
    coordinator.tenure().hold(None);
    let leading = election.leadership().is_some();
    let started = tokio::time::Instant::now();
    match tokio::time::timeout(RESIGN_TIMEOUT, election.resign()).await {
        Ok(Ok(())) if leading => tracing::info!(
            ms = started.elapsed().as_millis() as u64,
            "resigned: the leader key is released"
        ),
        Ok(Ok(())) => tracing::debug!("withdrew from the election (not leading)"),
        Ok(Err(e)) => tracing::warn!("could not resign; the lease expires within its TTL: {e}"),
        Err(_) => tracing::warn!(
            "etcd did not answer the resignation within {RESIGN_TIMEOUT:?}; the lease expires within its TTL"
        ),
    }
    coordinator.retire_all(&format!(
        "coordinator {me} is shutting down; re-attach to the new leader"
    ));
}

/// Campaigns, leads while the term lasts, and again, for ever. Cancel-safe: dropped when
/// the replica shuts down, which then resigns.
async fn terms(
    coordinator: &Coordinator,
    store: &dyn Store,
    me: &str,
    election: &Election,
    gate: &Gate,
) {
    let mut backoff = Duration::from_millis(100);
    loop {
        let leadership = match election.campaign().await {
            Ok(l) => l,
            Err(e) => {
                tracing::warn!("campaign failed: {e}");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
                continue;
            }
        };
        let started = tokio::time::Instant::now();
        gate.follow(Some(me.to_owned()));
        store.fence(Some(&leadership));
        coordinator.tenure().hold(Some(leadership.clone()));
        match coordinator.recover().await {
            Ok(jobs) if leadership.is_current() => {
                backoff = Duration::from_millis(100);
                gate.serve(Some(leadership.clone()));
                tracing::info!(
                    jobs,
                    token = leadership.token(),
                    ms = started.elapsed().as_millis() as u64,
                    "leading: state loaded from the store"
                );
            }
            Ok(_) => {}
            Err(e) => {
                tracing::error!("cannot load state after winning the election; stepping down: {e}");
                let _ = election.resign().await;
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
        if leadership.is_current() {
            let reason = leadership.lost().await;
            tracing::warn!("stepped down: {reason}");
        }
        gate.set(Readiness::Following(None));
        coordinator.tenure().hold(None);
        coordinator.retire_all(&format!(
            "coordinator {me} stopped leading; re-attach to the new leader"
        ));
    }
}
