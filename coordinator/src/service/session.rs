//! `muster.v1.Session`: a worker's session stream (register, heartbeats, barrier entries,
//! leave); a session that ends without leave fails its rank.

use super::*;

use muster_core::failure::{AGENT_REPORT_GRACE, SESSION_LOST};

/// `muster.v1.Session`.
#[derive(Clone)]
pub struct SessionService(pub Arc<Coordinator>);

type AttachStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::CoordinatorMessage, Status>> + Send>>;

#[tonic::async_trait]
impl pb::session_server::Session for SessionService {
    type AttachStream = AttachStream;

    async fn attach(&self, request: Request<Streaming<pb::WorkerMessage>>) -> Rpc<AttachStream> {
        let hb = self.0.config.heartbeat_timeout;
        let principal = request.extensions().get::<auth::Principal>().cloned();
        let mut inbound = request.into_inner();
        let first = first_message(&mut inbound, hb, "session").await?;
        let Some(pb::worker_message::Kind::Register(reg)) = first.kind else {
            return Err(Status::invalid_argument(
                "the first session message must be register",
            ));
        };
        if let Some(auth::Principal::Job(own)) = &principal
            && *own != reg.job_id
        {
            return Err(Status::permission_denied(format!(
                "the job token is for job '{own}', not job '{}'",
                reg.job_id
            )));
        }
        let job = self.0.job(&reg.job_id)?;
        let SessionRegister {
            generation,
            rank,
            pid,
            host,
            resume,
            replacement,
        } = SessionRegister::try_from(&reg)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let info = job.register(
            generation,
            rank,
            pid,
            host,
            Outbox::Session(tx.clone()),
            resume,
            replacement,
        )?;
        let _ = tx.send(Ok(registered(&self.0.config, &info)));
        tracing::debug!(job = %job.id, generation, rank, pid, "session registered");
        // Task policy: one per session; ends with the stream; on coordinator shutdown it is
        // dropped with the runtime (workers see the connection close).
        tokio::spawn(session_loop(
            job,
            (generation, rank, info.session),
            inbound,
            tx.into(),
            hb,
        ));
        Ok(Response::new(Box::pin(self.0.tenure().guard(rx))))
    }
}

async fn session_loop(
    job: Arc<Job>,
    (generation, rank, session): (u64, u32, u64),
    mut inbound: Streaming<pb::WorkerMessage>,
    outbox: Outbox,
    hb: Duration,
) {
    use pb::worker_message::Kind;
    let reason = loop {
        // Silence counts only while this process runs (`tenure::within`).
        match crate::tenure::within(hb, inbound.message()).await {
            None => break muster_core::failure::no_heartbeat(hb),
            Some(Err(status)) => break format!("connection lost ({})", status.message()),
            Some(Ok(None)) => {
                break SESSION_LOST.to_owned();
            }
            Some(Ok(Some(_))) if job.retired() => {
                // A lapsed leader takes no barrier entry in; the worker moves to the leader.
                let _ = outbox.send(Err(crate::tenure::Tenure::lapsed()));
                return;
            }
            Some(Ok(Some(msg))) => match msg.kind {
                Some(Kind::Heartbeat(_)) => job.touch(generation, rank),
                Some(Kind::Step(pb::StepBegun { step })) => job.step_begun(generation, rank, step),
                Some(Kind::Healed(pb::Healed { epoch })) => job.healed(generation, rank, epoch),
                Some(Kind::Barrier(b)) => {
                    let checked = BarrierEntry::try_from(&b);
                    // A span per entry, child of the worker's span when it sent its trace
                    // context.
                    let span = barrier_span(
                        &job.id,
                        generation,
                        b.seq,
                        BarrierFrom::Rank {
                            rank,
                            name: &b.name,
                        },
                        &b.trace_context,
                    );
                    let _entered = span.enter();
                    match checked {
                        Ok(e) => job
                            .barrier(generation, rank, e.scope, e.seq, e.name, e.timeout, &outbox),
                        Err(e) => {
                            let _ = outbox.send(Ok(pb::CoordinatorMessage {
                                kind: Some(pb::coordinator_message::Kind::Barrier(
                                    pb::BarrierResult {
                                        scope: b.scope,
                                        seq: b.seq,
                                        error: Some(pb::BarrierError {
                                            message: e.0,
                                            ..Default::default()
                                        }),
                                    },
                                )),
                            }));
                        }
                    }
                }
                Some(Kind::Leave(_)) => {
                    job.leave(generation, rank);
                    tracing::debug!(job = %job.id, generation, rank, "session left");
                    return;
                }
                Some(Kind::Register(_)) | None => {
                    let _ = outbox.send(Err(Status::invalid_argument(
                        "register may only be the first message of a session",
                    )));
                    break "protocol error: a second register".to_owned();
                }
            },
        }
    };
    if job.retired() {
        // This coordinator stopped leading: the worker re-attaches to the new leader.
        return;
    }
    if !reason.starts_with("no heartbeat") {
        // A process that exited is usually reported by its agent within milliseconds, with the
        // exit status and stderr: give that report a moment to arrive and name the cause.
        tokio::time::sleep(AGENT_REPORT_GRACE).await;
    }
    job.session_lost(generation, rank, session, reason);
}
