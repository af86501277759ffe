//! `muster.v1.Relay`: a node agent's relay stream, which enters global barriers for the
//! node's ranks at once, reports the waits it holds, and carries the registrations, leaves and
//! pushes of the node's ranks that register through it rather than with sessions of their own.

use super::*;

/// The most waits one relay report may list.
const MAX_REPORTED_BARRIERS: usize = 64;

/// `muster.v1.Relay`.
#[derive(Clone)]
pub struct RelayService(pub Arc<Coordinator>);

type RelayStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::RelayEvent, Status>> + Send>>;

#[tonic::async_trait]
impl pb::relay_server::Relay for RelayService {
    type AttachStream = RelayStream;

    async fn attach(&self, request: Request<Streaming<pb::RelayMessage>>) -> Rpc<RelayStream> {
        let mut inbound = request.into_inner();
        let first = first_message(&mut inbound, self.0.config.heartbeat_timeout, "relay").await?;
        let Some(pb::relay_message::Kind::Register(reg)) = first.kind else {
            return Err(Status::invalid_argument(
                "the first relay message must be register",
            ));
        };
        let job = self.0.job(&reg.job_id)?;
        let RelayRegister {
            generation,
            node_rank,
            resume,
            node_id,
        } = RelayRegister::try_from(&reg)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        job.relay_register(
            generation,
            node_rank,
            &node_id,
            tx.clone(),
            self.0.config.heartbeat_interval(),
            resume,
        )?;
        let coordinator = Arc::clone(&self.0);
        // Task policy: one per relay; ends with the stream. A relay that goes away needs no
        // action here: the ranks registered through it end with their agent (its reports,
        // its node's watch and lease), and the ones it still holds register again with
        // `resume` when it attaches again.
        tokio::spawn(async move {
            // A rank's message is taken only from the relay of the rank's node; anything else
            // is answered on the rank's behalf with why.
            let on_node = |rank: u32, act: &dyn Fn()| match job
                .check_on_node(generation, node_rank, rank, &tx)
            {
                Ok(()) => act(),
                Err(e) => {
                    let _ = tx.send(Ok(crate::job::rank_event(rank, Err(e.into()))));
                }
            };
            while let Ok(Some(msg)) = inbound.message().await {
                if job.retired() {
                    // A lapsed leader takes no barrier entry in; the relay moves on.
                    let _ = tx.send(Err(crate::tenure::Tenure::lapsed()));
                    break;
                }
                match msg.kind {
                    Some(pb::relay_message::Kind::Enter(e)) => {
                        let seq = e.seq;
                        // A span per group entry, like a session's barrier span.
                        let span = barrier_span(
                            &job.id,
                            generation,
                            e.seq,
                            BarrierFrom::Relay { node_rank },
                            &e.trace_context,
                        );
                        let _entered = span.enter();
                        match GroupEntry::try_from(e) {
                            Ok(g) => job.barrier_group(
                                generation, node_rank, g.seq, g.groups, g.timeout, &tx,
                            ),
                            Err(err) => {
                                let _ = tx.send(Ok(pb::RelayEvent {
                                    kind: Some(pb::relay_event::Kind::Barrier(pb::BarrierResult {
                                        scope: Scope::Global.to_wire(),
                                        seq,
                                        error: Some(pb::BarrierError {
                                            message: err.0,
                                            ..Default::default()
                                        }),
                                    })),
                                }));
                            }
                        }
                    }
                    Some(pb::relay_message::Kind::RankRegister(reg)) => {
                        let rank = reg.rank;
                        let answer = register_rank(&job, generation, node_rank, &tx, &reg)
                            .map(|info| registered(&coordinator.config, &info));
                        let _ = tx.send(Ok(crate::job::rank_event(rank, answer)));
                    }
                    Some(pb::relay_message::Kind::RankLeave(pb::RankLeave { rank })) => {
                        on_node(rank, &|| job.leave(generation, rank));
                    }
                    Some(pb::relay_message::Kind::RankLost(pb::RankLost { rank, reason })) => {
                        let checked = job
                            .check_on_node(generation, node_rank, rank, &tx)
                            .map_err(Status::from)
                            .and_then(|()| {
                                muster_core::model::label("reason", &reason, 4096)
                                    .map_err(|e| Status::invalid_argument(e.0))
                            });
                        match checked {
                            // A first reason, which the agent's report refines.
                            Ok(reason) => job.fail_rank(generation, rank, reason, None),
                            Err(status) => {
                                let _ = tx.send(Ok(crate::job::rank_event(rank, Err(status))));
                            }
                        }
                    }
                    Some(pb::relay_message::Kind::RankStep(pb::RankStep { rank, step })) => {
                        on_node(rank, &|| job.step_begun(generation, rank, step));
                    }
                    Some(pb::relay_message::Kind::RankHealed(pb::RankHealed { rank, epoch })) => {
                        on_node(rank, &|| job.healed(generation, rank, epoch));
                    }
                    Some(pb::relay_message::Kind::Heartbeat(_)) => {}
                    Some(pb::relay_message::Kind::Waiting(report)) => {
                        // Information for the ops view, capped like any list from the network.
                        let mut barriers = report.barriers;
                        barriers.truncate(MAX_REPORTED_BARRIERS);
                        job.relay_report(generation, node_rank, barriers);
                    }
                    Some(pb::relay_message::Kind::Register(_)) | None => {
                        let _ = tx.send(Err(Status::invalid_argument(
                            "register may only be the first relay message",
                        )));
                        break;
                    }
                }
            }
        });
        Ok(Response::new(Box::pin(self.0.tenure().guard(rx))))
    }
}

/// A rank's registration through node `node_rank`'s relay of `generation`: the session's
/// checks, plus that the rank is of this relay's job, generation and node.
fn register_rank(
    job: &Arc<Job>,
    generation: u64,
    node_rank: u32,
    relay: &crate::job::RelayOutbox,
    reg: &pb::Register,
) -> Result<crate::job::Registration, Status> {
    if reg.job_id != job.id.as_str() || reg.generation != generation {
        return Err(Status::invalid_argument(format!(
            "rank {} registered for job '{}' generation {} through the relay of job '{}' generation {generation}",
            reg.rank, reg.job_id, reg.generation, job.id
        )));
    }
    let SessionRegister {
        generation,
        rank,
        pid,
        host,
        resume,
        replacement,
    } = SessionRegister::try_from(reg)?;
    Ok(job.register_relayed(
        generation,
        node_rank,
        relay,
        rank,
        pid,
        host,
        resume,
        replacement,
    )?)
}
