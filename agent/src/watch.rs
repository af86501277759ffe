//! The node's lease and news channel (`Rendezvous.Watch`): a task that keeps one stream to the
//! coordinator for a generation, sends heartbeats, reconnects after a blip, and tells the
//! supervisor when the generation ends (failed elsewhere, superseded, cancelled) or when the
//! coordinator has not been heard for the lease: the node then stops its workers.
//!
//! A coordinator failover breaks the stream (an error or an end without a deliberate status):
//! the task then re-attaches with `resume = true`, following the leader among the replicas
//! ([`crate::failover`]), and gives up when the lease (since the coordinator was last heard) is
//! spent: the workers keep running through a failover that ends within it (a standby leads
//! about one election TTL after the leader's end). Past the lease only a census of the
//! replicas keeps them: while every replica refuses as not the leader (an etcd outage), no
//! leader can fail the node before the start of the last such round plus the coordinator's
//! heartbeat timeout, and the node keeps its workers for half that timeout after each round
//! ([`Coordinators::held_until`]; docs/ha.md, "An etcd outage"). The failover budget is not a
//! reason to keep workers: a leader alive across a partition fails a silent node after its
//! heartbeat timeout and may then hand its ranks to others, and the workers must be gone by
//! then. A stream that stays open and silent (a frozen coordinator, a cut link), or one that
//! does not open, counts against the lease too; with several replicas, the task tries another
//! one after half the lease of silence. Only a node that is finishing (every worker exited 0) goes on re-attaching for the
//! failover budget, to deliver `finished`.
//!
//! A coordinator that answers NOT_FOUND for the job has lost the job's state (an in-memory
//! coordinator that restarted): the node joined this job and got a generation, so the job
//! existed there. The task then reports [`WatchEvent::StateLost`] and the agent stops its
//! workers for good; joining again would rerun them as a new job behind the user's back.
//!
//! In-place recovery: the coordinator's `replace` (a rank of this node died and restarts are
//! left) is passed on as [`WatchEvent::Replace`]; the supervisor respawns that rank alone.
//!
//! Stacks (`docs/hangs.md`): the coordinator's `dump_stacks` is answered with the node's
//! workers' stacks, read by the generation's [`Sampler`] (a task per dump, so heartbeats go
//! on meanwhile); the sampler's progress notices go out as `progress` messages (the job's
//! hang timeout starts again); a `hang` report is printed on the agent's stderr.
//!
//! The lease counts the time this process runs: a heartbeat tick that comes much later than
//! its interval means the process did not run meanwhile (SIGSTOP, a suspended machine), and
//! the coordinator's silence during that gap says nothing about the coordinator. The gap is
//! named on stderr and not counted against the lease; what the coordinator said meanwhile
//! (heartbeats, or that the generation ended without this node) decides.
//!
//! Task "node-watch" (one per generation): on error, reconnects until the lease (or the
//! failover budget) runs out, then reports [`WatchEvent::Lost`]; on shutdown, aborted when its
//! [`Watch`] is dropped, or, after [`Watch::finish`], it sends `finished` (again after a
//! re-attach) and ends once the coordinator closes the stream.

use crate::failover::{self, Coordinators, Retry};
use crate::stacks::Sampler;
use muster_proto::v1 as pb;
use muster_proto::v1::rendezvous_client::RendezvousClient;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot, watch};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::Code;

/// A timer that fires this much later than due means this process did not run meanwhile:
/// the gap is not counted against the lease.
const STALL: Duration = Duration::from_millis(250);
/// A gap this long is also named on stderr.
const STALL_NOTICE: Duration = Duration::from_secs(1);
/// While the watch stream opens, the clock is read this often, so that a stop of this process
/// in the meantime is measured to within it (a single timer at the lease's end would only see
/// the part of the stop after its deadline).
const OPEN_TICK: Duration = Duration::from_millis(100);
/// The time a replica is given to open the watch stream, once half the lease of silence has
/// passed, before the next one is tried.
const OPEN_AT_LEAST: Duration = Duration::from_secs(1);

/// How long [`Watch::finish`] waits for the coordinator to take the `finished` message (on
/// top of the failover budget when the stream is being re-attached), and, with several
/// replicas, on top of the time the connection takes to notice a leader gone silent.
const FINISH_TIMEOUT: Duration = Duration::from_secs(2);

/// How long [`Watch::finish`] waits before it gives up on a stream that is not re-attaching.
/// With several replicas, a stream on a leader that froze looks attached until the
/// connection's keep-alive notices the silence: `finished` sits unread in the frozen
/// replica's socket meanwhile, and the next leader, not told, would take this node for one
/// that did not re-attach and fail a generation whose workers all finished. So the wait
/// outlasts that window, after which the stream re-attaches and sends `finished` again.
fn finish_wait(several: bool) -> Duration {
    if several {
        muster_core::failover::silence_noticed_within(true) + FINISH_TIMEOUT
    } else {
        FINISH_TIMEOUT
    }
}

/// What the watch tells the supervisor.
#[derive(Debug, Clone)]
pub enum WatchEvent {
    /// The generation ended (sent again when the coordinator learns a more precise reason).
    Ended(pb::GenerationEnded),
    /// In-place recovery: respawn one of this node's ranks (sent again after a coordinator
    /// failover; the supervisor ignores a repeat).
    Replace(pb::RankReplace),
    /// The coordinator has not been heard for the lease; the reason says what was tried.
    Lost(String),
    /// The coordinator at `coordinator` no longer knows the job (NOT_FOUND): it lost the job's
    /// state while this node ran a generation of it. `message` is its answer.
    StateLost {
        /// The coordinator's address.
        coordinator: String,
        /// Its answer.
        message: String,
    },
}

/// A running watch; dropping it aborts the task (the coordinator then sees the stream end).
pub struct Watch {
    events: mpsc::UnboundedReceiver<WatchEvent>,
    finish: Option<oneshot::Sender<()>>,
    reattaching: watch::Receiver<bool>,
    budget: Duration,
    /// [`finish_wait`] for this watch's coordinators.
    finish_wait: Duration,
    task: JoinHandle<()>,
}

impl Watch {
    /// Starts watching the generation `attach` names, with this lease, on the coordinators'
    /// leader.
    /// `sampler` reads the node's workers' stacks for the coordinator's dumps and reports
    /// their progress.
    pub fn start(
        coordinators: Coordinators,
        attach: pb::NodeAttach,
        lease: Duration,
        sampler: Option<Sampler>,
    ) -> Self {
        let (tx, events) = mpsc::unbounded_channel();
        let (finish, finish_rx) = oneshot::channel();
        let (reattaching_tx, reattaching) = watch::channel(false);
        let budget = coordinators.failover_timeout();
        let finish_wait = finish_wait(coordinators.len() > 1);
        let task = tokio::spawn(run(
            coordinators,
            attach,
            lease,
            tx,
            finish_rx,
            reattaching_tx,
            sampler,
        ));
        Self {
            events,
            finish: Some(finish),
            reattaching,
            budget,
            finish_wait,
            task,
        }
    }

    /// The next event. Cancel-safe. Pends forever once the task has ended.
    pub async fn next(&mut self) -> WatchEvent {
        match self.events.recv().await {
            Some(e) => e,
            None => std::future::pending().await,
        }
    }

    /// Whether the stream broke and the task is re-attaching (a failover in progress): the
    /// coordinator's word may come late, and [`WatchEvent::Lost`] says when it will not.
    pub fn reattaching(&self) -> bool {
        *self.reattaching.borrow()
    }

    /// Tells the coordinator that every worker of the node exited 0, and waits (bounded) for
    /// it to take that in: [`finish_wait`], plus the failover budget if the stream breaks
    /// meanwhile.
    pub async fn finish(mut self) {
        if let Some(tx) = self.finish.take() {
            let _ = tx.send(());
        }
        let budget = self.budget;
        let mut reattaching = self.reattaching.clone();
        let mut deadline = Instant::now() + self.finish_wait;
        loop {
            tokio::select! {
                _ = &mut self.task => return,
                () = tokio::time::sleep_until(deadline) => {
                    if !*reattaching.borrow() {
                        return;
                    }
                    // A failover while finishing: the task ends on its own when its budget
                    // is spent; wait for it, bounded once more.
                    deadline = failover::later(Instant::now(), budget);
                }
                r = reattaching.changed() => {
                    if r.is_err() {
                        return;
                    }
                }
            }
        }
    }
}

#[cfg(test)]
impl Watch {
    /// A watch with no coordinator behind it: the test sends its events.
    pub(crate) fn scripted() -> (Self, mpsc::UnboundedSender<WatchEvent>) {
        let (tx, events) = mpsc::unbounded_channel();
        let (finish, _) = oneshot::channel();
        let (_, reattaching) = watch::channel(false);
        let watch = Self {
            events,
            finish: Some(finish),
            reattaching,
            budget: Duration::ZERO,
            finish_wait: FINISH_TIMEOUT,
            task: tokio::spawn(std::future::pending()),
        };
        (watch, tx)
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The node's lease bookkeeping: when the coordinator was last heard, and since when the
/// stream is being re-attached after a retryable end.
struct Lease {
    lease: Duration,
    budget: Duration,
    /// How long a round of refusals (not the leader) from every replica keeps the node's
    /// workers ([`Coordinators::held_until`]): half the coordinator's heartbeat timeout (told
    /// in `attached`; the lease until then), or of the lease if that is shorter.
    hold: Duration,
    last_heard: Instant,
    /// The streak of failures since the stream broke; `None` while attached (or silent).
    streak: Option<Retry>,
    /// Every worker exited 0 and `finished` is being delivered: the failover budget applies
    /// (no worker runs that a leader could hand to others).
    finishing: bool,
    /// While re-attaching: until when the census of the replicas keeps the workers, if every
    /// replica refused lately as not the leader.
    held: Option<Instant>,
    /// How long this process did not run since the coordinator was last heard.
    stalled: Duration,
}

impl Lease {
    /// When the node gives up: the lease after the coordinator was last heard, or, while
    /// re-attaching, the census's hold if that is later (and, while finishing, the failover
    /// budget after the break).
    fn deadline(&self) -> Instant {
        self.without_census()
            .max(self.held.unwrap_or(self.last_heard))
    }

    /// The deadline the census may lengthen: the lease's end, or while finishing the failover
    /// budget's after the break if that is later.
    fn without_census(&self) -> Instant {
        let lease_end = failover::later(self.last_heard, self.lease);
        match &self.streak {
            Some(retry) if self.finishing => lease_end.max(retry.deadline()),
            _ => lease_end,
        }
    }

    /// Whether the node is past its lease, kept by the census alone.
    fn on_census(&self) -> bool {
        self.streak.is_some() && self.held.is_some_and(|h| h > self.without_census())
    }

    fn expired(&self) -> bool {
        Instant::now() >= self.deadline()
    }

    fn remaining(&self) -> Duration {
        self.deadline().saturating_duration_since(Instant::now())
    }

    /// The coordinator was heard.
    fn heard(&mut self) {
        self.last_heard = Instant::now();
        self.stalled = Duration::ZERO;
    }

    /// A timer due at `due` fired only now: if that is a [`STALL`], this process did not run
    /// for the difference, and the coordinator's silence meanwhile is not counted. Returns the
    /// gap when it is worth a line ([`STALL_NOTICE`]).
    fn woke(&mut self, due: Instant) -> Option<Duration> {
        let now = Instant::now();
        let gap = now.saturating_duration_since(due);
        if gap < STALL {
            return None;
        }
        self.stalled += gap;
        self.last_heard = (self.last_heard + gap).min(now);
        (gap >= STALL_NOTICE).then_some(gap)
    }

    /// The stream broke retryably: a failover starts (if one is not under way).
    fn broke(&mut self) {
        if self.streak.is_none() {
            self.streak = Some(Retry::new(self.budget));
            self.held = None;
        }
    }

    /// An attempt to re-attach to `addr` failed with `status`: the census counts it
    /// ([`Coordinators::saw`]). Returns `true` when the census first proves, in this streak,
    /// that no replica leads (worth a line).
    fn saw(&mut self, coordinators: &Coordinators, addr: &str, status: &tonic::Status) -> bool {
        coordinators.saw(addr, status);
        if self.streak.is_none() {
            return false;
        }
        let before = self.held.is_some();
        self.held = coordinators
            .held_until(self.hold)
            .filter(|h| *h > Instant::now());
        !before && self.held.is_some()
    }
}

async fn run(
    coordinators: Coordinators,
    attach: pb::NodeAttach,
    lease: Duration,
    tx: mpsc::UnboundedSender<WatchEvent>,
    mut finish: oneshot::Receiver<()>,
    reattaching: watch::Sender<bool>,
    mut sampler: Option<Sampler>,
) {
    let mut progress = sampler.as_mut().and_then(Sampler::progress);
    let dumper = sampler.as_ref().map(Sampler::dumper);
    let mut state = Lease {
        lease,
        // For `finished` only (see `Lease::finishing`); with one address the lease alone
        // decides (`failover::reattach_budget`).
        budget: failover::reattach_budget(&coordinators),
        hold: lease / 2,
        last_heard: Instant::now(),
        streak: None,
        finishing: false,
        held: None,
        stalled: Duration::ZERO,
    };
    let mut backoff = failover::Backoff::default();
    let mut last_error = String::from("no answer");
    let mut attached_once = false;
    let mut broke_at: Option<(Instant, String)> = None;
    // Whether another replica was tried since the coordinator was last heard.
    let mut tried_other = false;
    loop {
        if state.expired() {
            let what = if state.stalled >= STALL_NOTICE {
                format!(
                    "the coordinator was not heard for {:.1}s (the lease) of the time this agent ran, besides {:.1}s it did not run (stopped or suspended)",
                    lease.as_secs_f64(),
                    state.stalled.as_secs_f64()
                )
            } else if state.on_census() {
                format!(
                    "the coordinator was not heard for {:.1}s (the lease); every replica had refused as not the leader, but not all of them again within {:.1}s",
                    lease.as_secs_f64(),
                    state.hold.as_secs_f64()
                )
            } else if state.streak.is_some() {
                format!(
                    "the coordinator was not heard for {:.1}s (the lease) and no replica took the node back",
                    lease.as_secs_f64()
                )
            } else {
                format!(
                    "the coordinator was not heard for {:.1}s (the lease)",
                    lease.as_secs_f64()
                )
            };
            let _ = tx.send(WatchEvent::Lost(format!("{what}: {last_error}")));
            return;
        }
        let (addr, channel) = failover::channel(&coordinators);
        let mut client = RendezvousClient::new(channel);
        let (out, out_rx) = mpsc::channel::<pb::NodeMessage>(16);
        let _ = out
            .send(pb::NodeMessage {
                kind: Some(pb::node_message::Kind::Attach(pb::NodeAttach {
                    resume: attached_once,
                    attempt: next_attempt(),
                    ..attach.clone()
                })),
            })
            .await;
        if state.finishing {
            let _ = out
                .send(pb::NodeMessage {
                    kind: Some(pb::node_message::Kind::Finished(pb::NodeFinished {})),
                })
                .await;
        }
        // The call is kept across a stall of this process: dropping it would end a stream
        // the coordinator may already hold, and a watch that ends while the node's ranks run
        // is a lost node there. With several replicas, a replica that has not answered by
        // half the lease of silence (or within [`OPEN_AT_LEAST`] of being asked, after that)
        // is left for the next one, as a silent open stream is: a replica frozen right after
        // it took the lead answers nothing, and waiting for its connection's keep-alive to
        // fail spent the rest of a node's lease in the fault suite's long run while another
        // replica led. A live leader answers an attach in milliseconds.
        let asked = Instant::now();
        let give_up_at = |state: &Lease| {
            let lease_end = Instant::now() + state.remaining();
            if coordinators.len() < 2 {
                return lease_end;
            }
            lease_end.min((state.last_heard + lease / 2).max(asked + OPEN_AT_LEAST))
        };
        let mut open_by = give_up_at(&state);
        let open = client.watch(tokio_stream::wrappers::ReceiverStream::new(out_rx));
        tokio::pin!(open);
        let opened = loop {
            let due = (Instant::now() + OPEN_TICK).min(open_by);
            match tokio::time::timeout_at(due, &mut open).await {
                Ok(answer) => {
                    // The answer may have come while this process was stopped: the stall is
                    // named all the same (the loop below starts a fresh timer).
                    if let Some(gap) = state.woke(due) {
                        print_stall(&attach.job_id, gap, lease, "");
                    }
                    break Some(answer);
                }
                // A timer that fired well after it was due: this process did not run
                // meanwhile (stopped while the stream was opening), which the lease does not
                // count. Give the coordinator a whole lease to answer before judging.
                Err(_) => {
                    if let Some(gap) = state.woke(due) {
                        state.last_heard = Instant::now();
                        print_stall(&attach.job_id, gap, lease, "");
                    }
                    // A shorter stall moved `last_heard` on by itself (`Lease::woke`).
                    open_by = give_up_at(&state);
                    if Instant::now() >= open_by {
                        break None;
                    }
                }
            }
        };
        let mut stream = match opened {
            Some(Ok(r)) => r.into_inner(),
            Some(Err(status)) if status.code() == Code::NotFound => {
                let _ = tx.send(state_lost(addr, &status));
                return;
            }
            Some(Err(status)) if gone(&status) => {
                // The generation is over at the coordinator (it moved on while this node could
                // not hear it): stop and join again; the join says whether the job goes on.
                let _ = tx.send(WatchEvent::Ended(superseded(&attach, &status)));
                return;
            }
            Some(Err(status)) => {
                last_error = format!("{addr}: {}", crate::security::explain(&status));
                if failover::retryable(&status) {
                    // A follower (it may name the leader), or a replica that is down. Before
                    // the first attach, that is a failover right after the join; after a
                    // silence, the lease alone decides.
                    if !attached_once {
                        state.broke();
                        let _ = reattaching.send(true);
                    }
                    if state.saw(&coordinators, &addr, &status) {
                        eprintln!(
                            "muster-agent: job {}: no coordinator replica leads (each one refused as not the leader: is etcd reachable?); the workers keep running while every replica answers so",
                            attach.job_id
                        );
                    }
                    coordinators.failed(&addr, failover::leader_hint(&status).as_deref());
                }
                pause(&mut state, &mut backoff).await;
                continue;
            }
            None => {
                // Past half the lease the next replica is tried (`give_up_at`); past the
                // lease, the check above ends the watch.
                last_error = format!("{addr} did not open the watch stream in time");
                state.saw(
                    &coordinators,
                    &addr,
                    &tonic::Status::deadline_exceeded(last_error.clone()),
                );
                coordinators.failed(&addr, None);
                continue;
            }
        };
        let mut interval = Duration::from_secs(1);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        // When the next tick is due (the first one fires at once).
        let mut due = Instant::now();
        // Whether the stream ended the way a coordinator that went away ends it.
        let mut broke = false;
        loop {
            tokio::select! {
                msg = stream.message() => {
                    // A message (or the stream's end) that waited while this process was
                    // stopped: the stall is named, and not counted against the lease, before
                    // the message is taken (the tick below would only have run after it).
                    if let Some(gap) = state.woke(due) {
                        print_stall(&attach.job_id, gap, lease, "");
                        due = Instant::now() + interval;
                    }
                    match msg {
                    Ok(Some(event)) => {
                        state.heard();
                        tried_other = false;
                        backoff.reset();
                        match event.kind {
                            Some(pb::node_event::Kind::Attached(a)) => {
                                attached_once = true;
                                if state.streak.take().is_some() {
                                    let _ = reattaching.send(false);
                                }
                                if let Some((at, from)) = broke_at.take() {
                                    crate::metrics::failover(crate::metrics::Stream::Watch);
                                    eprintln!(
                                        "muster-agent: job {}: re-attached to the coordinator at {addr} {:.0} ms after losing {from}",
                                        attach.job_id,
                                        at.elapsed().as_secs_f64() * 1000.0
                                    );
                                }
                                if a.heartbeat_timeout_ms > 0 {
                                    state.hold = Duration::from_millis(a.heartbeat_timeout_ms).min(lease) / 2;
                                }
                                let asked = Duration::from_millis(a.heartbeat_interval_ms.max(50));
                                // Heartbeat often enough for the coordinator and for our lease.
                                let want = asked.min(lease / 4).max(Duration::from_millis(20));
                                if want != interval {
                                    interval = want;
                                    tick = tokio::time::interval(interval);
                                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                                    due = Instant::now();
                                }
                            }
                            Some(pb::node_event::Kind::Ended(ended)) => {
                                let _ = tx.send(WatchEvent::Ended(ended));
                            }
                            Some(pb::node_event::Kind::Replace(replace)) => {
                                let _ = tx.send(WatchEvent::Replace(replace));
                            }
                            Some(pb::node_event::Kind::DumpStacks(cmd)) => {
                                answer_dump(dumper.clone(), &cmd, out.clone());
                            }
                            Some(pb::node_event::Kind::Hang(hang)) => {
                                print_hang(&attach.job_id, &hang);
                            }
                            Some(pb::node_event::Kind::Heartbeat(_)) | None => {}
                        }
                    }
                    Ok(None) if state.finishing => return,
                    Ok(None) => {
                        // A coordinator ends a watch deliberately with a status; a bare end is
                        // a coordinator that went away.
                        last_error = format!("{addr} closed the watch stream");
                        broke = true;
                        coordinators.failed(&addr, None);
                        break;
                    }
                    Err(status) if status.code() == Code::NotFound => {
                        let _ = tx.send(state_lost(addr, &status));
                        return;
                    }
                    Err(status) if gone(&status) => {
                        let _ = tx.send(WatchEvent::Ended(superseded(&attach, &status)));
                        return;
                    }
                    Err(status) => {
                        last_error = format!("{addr}: {}", crate::security::explain(&status));
                        if failover::retryable(&status) {
                            broke = true;
                            coordinators.failed(&addr, failover::leader_hint(&status).as_deref());
                        }
                        // Otherwise not a failover: reconnect within the lease, as after a blip.
                        break;
                    }
                    }
                }
                _ = tick.tick() => {
                    if let Some(gap) = state.woke(due) {
                        print_stall(
                            &attach.job_id,
                            gap,
                            lease,
                            &format!(", asking the coordinator at {addr} where the job stands"),
                        );
                    }
                    due = Instant::now() + interval;
                    let silent = state.last_heard.elapsed();
                    if silent >= lease {
                        break;
                    }
                    if !tried_other && coordinators.len() > 1 && silent >= lease / 2 {
                        // A frozen leader keeps its connections open: ask another replica,
                        // which either is the new leader or names it.
                        tried_other = true;
                        last_error = format!("{addr} went silent");
                        coordinators.failed(&addr, None);
                        break;
                    }
                    // A full buffer means the stream is stuck: the lease check above decides.
                    let _ = out.try_send(pb::NodeMessage {
                        kind: Some(pb::node_message::Kind::Heartbeat(pb::Heartbeat {})),
                    });
                }
                Some(notice) = next_progress(&mut progress) => {
                    let kind = match notice {
                        crate::stacks::Notice::Progress => {
                            pb::node_message::Kind::Progress(pb::NodeProgress {})
                        }
                        crate::stacks::Notice::Samples(ranks) => {
                            pb::node_message::Kind::Samples(pb::NodeSamples { ranks })
                        }
                    };
                    let _ = out.try_send(pb::NodeMessage { kind: Some(kind) });
                }
                r = &mut finish, if !state.finishing => {
                    if r.is_err() {
                        return;
                    }
                    state.finishing = true;
                    let _ = out
                        .send(pb::NodeMessage {
                            kind: Some(pb::node_message::Kind::Finished(pb::NodeFinished {})),
                        })
                        .await;
                    // Keep the stream open: the coordinator ends it once it has taken this in.
                }
            }
        }
        drop(out);
        if broke {
            if state.streak.is_none() {
                eprintln!(
                    "muster-agent: job {}: lost the watch stream ({last_error}); re-attaching to the coordinator's leader (failover budget {} ms)",
                    attach.job_id,
                    state.budget.as_millis()
                );
                broke_at = Some((Instant::now(), addr.clone()));
            }
            state.broke();
            let _ = reattaching.send(true);
        }
        pause(&mut state, &mut backoff).await;
    }
}

/// The sampler's next notice; pends forever without a sampler (or once it ended).
async fn next_progress(
    progress: &mut Option<mpsc::UnboundedReceiver<crate::stacks::Notice>>,
) -> Option<crate::stacks::Notice> {
    match progress {
        Some(rx) => match rx.recv().await {
            Some(n) => Some(n),
            None => {
                *progress = None;
                std::future::pending().await
            }
        },
        None => std::future::pending().await,
    }
}

/// Task "stack-dump" (one per `dump_stacks`): reads the node's stacks and answers on the
/// watch stream; on error (the stream gone), the answer is dropped (the coordinator names the
/// node as unanswered); it ends with its answer.
fn answer_dump(
    dumper: Option<crate::stacks::Dumper>,
    command: &pb::DumpStacksCommand,
    out: mpsc::Sender<pb::NodeMessage>,
) {
    let (request_id, native) = (command.request_id, command.native);
    tokio::spawn(async move {
        let ranks = match dumper {
            Some(d) => d.dump(native).await,
            None => Vec::new(),
        };
        let _ = out
            .send(pb::NodeMessage {
                kind: Some(pb::node_message::Kind::Stacks(pb::NodeStacks {
                    request_id,
                    ranks,
                })),
            })
            .await;
    });
}

/// This agent's own stall (it did not run for `gap`), on its stderr, once per stall;
/// `then` says what it does about it.
fn print_stall(job: &str, gap: Duration, lease: Duration, then: &str) {
    eprintln!(
        "muster-agent: job {job}: this agent did not run for {:.1}s (it was stopped, e.g. by SIGSTOP, or its machine was suspended); not counted against its {:.1}s lease{then}",
        gap.as_secs_f64(),
        lease.as_secs_f64()
    );
}

/// The coordinator's hang report, on this agent's stderr.
fn print_hang(job: &str, hang: &pb::HangReport) {
    let mut text = String::new();
    for (i, line) in hang.report.lines().enumerate() {
        if i == 0 {
            text.push_str(&format!("muster-agent: job {job}: {line}\n"));
        } else {
            text.push_str(&format!("    {line}\n"));
        }
    }
    eprint!("{text}");
}

/// The number of an open of a node's watch ([`pb::NodeAttach::attempt`]): the wall clock's
/// microseconds, kept above every number this process gave before (so that a restarted agent
/// also numbers above its predecessor, unless the clock stepped back). The leader refuses an
/// open numbered below the node's registered watch: one this task left for another replica
/// (`give_up_at`) and a busy leader read late cannot replace the newer watch.
fn next_attempt() -> u64 {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_micros()).unwrap_or(u64::MAX));
    let after = |last: u64| now.max(last.saturating_add(1));
    let last = LAST
        .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |l| Some(after(l)))
        .unwrap_or_default();
    after(last)
}

/// Sleeps one backoff step, cut short at the deadline (a stall meanwhile moves it on).
async fn pause(state: &mut Lease, backoff: &mut failover::Backoff) {
    let step = backoff.next_sleep().min(state.remaining());
    let due = Instant::now() + step;
    tokio::time::sleep_until(due).await;
    state.woke(due);
}

/// The event for a coordinator at `coordinator` that answered NOT_FOUND for the job.
fn state_lost(coordinator: String, status: &tonic::Status) -> WatchEvent {
    WatchEvent::StateLost {
        coordinator,
        message: status.message().to_owned(),
    }
}

/// The `GenerationEnded` a refused or ended watch stands for.
fn superseded(attach: &pb::NodeAttach, status: &tonic::Status) -> pb::GenerationEnded {
    pb::GenerationEnded {
        generation: attach.generation,
        cause: pb::generation_ended::Cause::Superseded as i32,
        rejoin: true,
        message: status.message().to_owned(),
        ..Default::default()
    }
}

/// Whether the coordinator says this generation (or job) no longer exists for this node.
fn gone(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        Code::FailedPrecondition | Code::NotFound | Code::PermissionDenied | Code::InvalidArgument
    )
}
