//! `muster.v1.Agents`: daemon agents' streams (each one the agent's lease in the pool).

use super::*;

/// `muster.v1.Agents`.
#[derive(Clone)]
pub struct AgentsService(pub Arc<Coordinator>);

type AgentStream =
    Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::AgentCommand, Status>> + Send>>;

#[tonic::async_trait]
impl pb::agents_server::Agents for AgentsService {
    type ServeStream = AgentStream;

    async fn serve(&self, request: Request<Streaming<pb::AgentMessage>>) -> Rpc<AgentStream> {
        let hb = self.0.config.heartbeat_timeout;
        let mut inbound = request.into_inner();
        let first = first_message(&mut inbound, hb, "agent stream").await?;
        let Some(pb::agent_message::Kind::Register(info)) = first.kind else {
            return Err(Status::invalid_argument(
                "the first agent message must be register",
            ));
        };
        pool::check_machine(&info)?;
        let agent_id = info.agent_id.clone();
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let _ = tx.send(Ok(pb::AgentCommand {
            kind: Some(pb::agent_command::Kind::Registered(pb::AgentRegistered {
                heartbeat_interval_ms: self.0.config.heartbeat_interval().as_millis() as u64,
                heartbeat_timeout_ms: hb.as_millis() as u64,
            })),
        }));
        let conn = self.0.pool.register(info, tx.clone());
        let coordinator = Arc::clone(&self.0);
        // Task "agent-stream", one per daemon agent: its lease. Ends with the stream (or its
        // silence past the heartbeat timeout), which takes the agent out of the pool.
        tokio::spawn(async move {
            use pb::agent_message::Kind;
            let why = loop {
                match crate::tenure::within(hb, inbound.message()).await {
                    None => break format!("no heartbeat for {:.1}s", hb.as_secs_f64()),
                    Some(Err(status)) => break format!("stream broke: {}", status.message()),
                    Some(Ok(None)) => break "disconnected".to_owned(),
                    Some(Ok(Some(msg))) => {
                        coordinator.pool.touch(&agent_id, conn);
                        match msg.kind {
                            Some(Kind::Heartbeat(_)) => {
                                let _ = tx.send(Ok(pb::AgentCommand {
                                    kind: Some(pb::agent_command::Kind::Heartbeat(
                                        pb::Heartbeat {},
                                    )),
                                }));
                            }
                            Some(Kind::Update(u)) => coordinator.pool.job_ended(&agent_id, &u),
                            Some(Kind::Register(_)) | None => {
                                let _ = tx.send(Err(Status::invalid_argument(
                                    "register may only be the first agent message",
                                )));
                                break "protocol error".to_owned();
                            }
                        }
                    }
                }
            };
            coordinator.pool.unregister(&agent_id, conn, &why);
        });
        Ok(Response::new(Box::pin(self.0.tenure().guard(rx))))
    }
}
