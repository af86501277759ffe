//! The edge where the job's decisions become wire messages: barrier results, the generation's
//! failure and end as pushed to sessions, relays and watches, and a join's answer. The rules
//! that decide them live in the other files; only this one (and the record in `persist.rs`
//! and the views in `views.rs`) builds the protocol's messages.

use super::*;

pub(super) fn result(
    scope: Scope,
    seq: u64,
    error: Option<pb::BarrierError>,
) -> pb::CoordinatorMessage {
    pb::CoordinatorMessage {
        kind: Some(pb::coordinator_message::Kind::Barrier(pb::BarrierResult {
            scope: scope.to_wire(),
            seq,
            error,
        })),
    }
}

pub(super) fn relay_result(seq: u64, error: Option<pb::BarrierError>) -> pb::RelayEvent {
    pb::RelayEvent {
        kind: Some(pb::relay_event::Kind::Barrier(pb::BarrierResult {
            scope: Scope::Global.to_wire(),
            seq,
            error,
        })),
    }
}

/// A message (or the status its session ends with) for `rank`, registered through its node's
/// relay.
pub fn rank_event(rank: u32, message: Result<pb::CoordinatorMessage, Status>) -> pb::RelayEvent {
    let kind = match message {
        Ok(message) => pb::rank_event::Kind::Message(message),
        Err(status) => pb::rank_event::Kind::Refused(pb::RankRefused {
            code: status.code() as i32,
            message: status.message().to_owned(),
        }),
    };
    pb::RelayEvent {
        kind: Some(pb::relay_event::Kind::Rank(pb::RankEvent {
            rank,
            kind: Some(kind),
        })),
    }
}

/// Node `node_rank`'s answer to its join of the round that formed `nodes`.
pub(super) fn join_answer(
    job: &JobId,
    generation: u64,
    nodes: &[NodeSlot],
    node_rank: usize,
    restart_count: u32,
    config: RoundConfig,
) -> pb::JoinResponse {
    let node = &nodes[node_rank];
    let world_size = nodes
        .last()
        .map_or(0, |n| n.rank_offset + n.local_world_size);
    pb::JoinResponse {
        job_id: job.to_string(),
        generation,
        node_rank: node_rank as u32,
        num_nodes: nodes.len() as u32,
        rank_offset: node.rank_offset,
        local_world_size: node.local_world_size,
        world_size,
        master_host: nodes.first().map(|n| n.host.clone()).unwrap_or_default(),
        restart_count,
        max_restarts: config.max_restarts,
        recovery: config.recovery.to_wire(),
        took_over: node.took_over.clone(),
    }
}

/// The ending `node_id` hears: `ended` itself, unless the generation was superseded and the
/// node is drained: then CAUSE_DRAINED without rejoin, so that its agent stops for good.
pub(super) fn drained_end(
    ended: &pb::GenerationEnded,
    node_id: &str,
    drained: &HashMap<String, String>,
) -> pb::GenerationEnded {
    match drained.get(node_id) {
        Some(reason) if ended.cause == pb::generation_ended::Cause::Superseded as i32 => {
            pb::GenerationEnded {
                cause: pb::generation_ended::Cause::Drained as i32,
                rejoin: false,
                message: format!(
                    "node '{node_id}' was drained from generation {} by an operator ({reason}); the job continues on the other nodes",
                    ended.generation
                ),
                ..ended.clone()
            }
        }
        _ => ended.clone(),
    }
}

impl Gen {
    pub(super) fn send(&self, rank: u32, msg: pb::CoordinatorMessage) {
        if let Some(outbox) = &self.ranks[rank as usize].outbox {
            // A closed outbox means the session is gone; its own end handles that.
            let _ = outbox.send(Ok(msg));
        }
    }

    /// Answers every arrival of a barrier with the same result: each session-arrived rank
    /// through its session, each relaying node once. Marks the ranks done with `seq`.
    pub(super) fn deliver<'a>(
        &mut self,
        key: BarrierKey,
        arrivals: impl Iterator<Item = &'a Arrival>,
        error: Option<&pb::BarrierError>,
    ) {
        // One flag per node (a list searched per arrival made a 100,000-rank barrier
        // quadratic: 100,000 arrivals against up to 12,500 nodes told).
        let mut node_told = vec![false; self.nodes.len()];
        for a in arrivals {
            let slot = &mut self.ranks[a.rank() as usize];
            // Every result the coordinator delivers here uses the seq up (a timeout does not
            // come this way).
            if !slot.place.answer(key.scope, key.seq, true) {
                continue;
            }
            if a.data.relayed {
                let node = slot.node_rank;
                if let Some(told) = node_told.get_mut(node as usize)
                    && !*told
                {
                    *told = true;
                    self.relay_send(node, relay_result(key.seq, error.cloned()));
                }
            } else {
                self.send(a.rank(), result(key.scope, key.seq, error.cloned()));
            }
        }
    }

    pub(super) fn relay_send(&self, node_rank: u32, event: pb::RelayEvent) {
        if let Some(relay) = &self.nodes[node_rank as usize].relay {
            let _ = relay.send(Ok(event));
        }
    }

    /// Sends `ended` to every node's watcher and keeps it for watchers that attach later. A
    /// drained node (in `drained`) hears its own ending instead (see [`drained_end`]).
    pub(super) fn end(&mut self, ended: pb::GenerationEnded, drained: &HashMap<String, String>) {
        for node in &self.nodes {
            if let Some((_, w)) = &node.watch {
                let _ = w.send(Ok(pb::NodeEvent {
                    kind: Some(pb::node_event::Kind::Ended(drained_end(
                        &ended,
                        &node.node_id,
                        drained,
                    ))),
                }));
            }
        }
        self.ended = Some(Box::new(ended));
    }

    /// Tells every live session of the generation that it failed, with `error`, so that
    /// ranks outside barriers (inside a collective) learn of it too.
    pub(super) fn sessions_failed(&self, error: &pb::BarrierError) {
        for rank in 0..self.ranks.len() {
            self.send(
                rank as u32,
                pb::CoordinatorMessage {
                    kind: Some(pb::coordinator_message::Kind::GenerationFailed(
                        error.clone(),
                    )),
                },
            );
        }
    }

    /// Tells every relaying agent that the generation is over, with `error`.
    pub(super) fn relays_failed(&self, error: &pb::BarrierError) {
        for n in 0..self.nodes.len() {
            self.relay_send(
                n as u32,
                pb::RelayEvent {
                    kind: Some(pb::relay_event::Kind::Failed(error.clone())),
                },
            );
        }
    }
}

impl From<Drained> for pb::DrainNodeResponse {
    fn from(d: Drained) -> Self {
        Self {
            node_id: d.node_id,
            generation: d.generation,
            remaining_nodes: d.remaining_nodes,
        }
    }
}
