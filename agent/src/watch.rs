//! The node's lease and news channel (`Rendezvous.Watch`): a task that keeps one stream to the
//! coordinator for a generation, sends heartbeats, reconnects after a blip, and tells the
//! supervisor when the generation ends (failed elsewhere, superseded, cancelled) or when the
//! coordinator has not been heard for the lease: the node then stops its workers.
//!
//! Task "node-watch" (one per generation): on error, reconnects until the lease runs out, then
//! reports [`WatchEvent::Lost`]; on shutdown, aborted when its [`Watch`] is dropped, or, after
//! [`Watch::finish`], it sends `finished` and ends once the coordinator closes the stream.

use muster_proto::v1 as pb;
use muster_proto::v1::rendezvous_client::RendezvousClient;
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio::time::Instant;
use tonic::Code;
use tonic::transport::Channel;

/// How long [`Watch::finish`] waits for the coordinator to take the `finished` message.
const FINISH_TIMEOUT: Duration = Duration::from_secs(2);

/// What the watch tells the supervisor.
#[derive(Debug, Clone)]
pub enum WatchEvent {
    /// The generation ended (sent again when the coordinator learns a more precise reason).
    Ended(pb::GenerationEnded),
    /// The coordinator has not been heard for the lease; the reason says what was tried.
    Lost(String),
}

/// A running watch; dropping it aborts the task (the coordinator then sees the stream end).
pub struct Watch {
    events: mpsc::UnboundedReceiver<WatchEvent>,
    finish: Option<oneshot::Sender<()>>,
    task: JoinHandle<()>,
}

impl Watch {
    /// Starts watching the generation `attach` names, with this lease.
    pub fn start(channel: Channel, attach: pb::NodeAttach, lease: Duration) -> Self {
        let (tx, events) = mpsc::unbounded_channel();
        let (finish, finish_rx) = oneshot::channel();
        let client = RendezvousClient::new(channel);
        let task = tokio::spawn(run(client, attach, lease, tx, finish_rx));
        Self {
            events,
            finish: Some(finish),
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

    /// Tells the coordinator that every worker of the node exited 0, and waits (bounded) for
    /// it to take that in.
    pub async fn finish(mut self) {
        if let Some(tx) = self.finish.take() {
            let _ = tx.send(());
        }
        let _ = tokio::time::timeout(FINISH_TIMEOUT, &mut self.task).await;
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn run(
    mut client: RendezvousClient<Channel>,
    attach: pb::NodeAttach,
    lease: Duration,
    tx: mpsc::UnboundedSender<WatchEvent>,
    mut finish: oneshot::Receiver<()>,
) {
    let mut last_heard = Instant::now();
    let mut backoff = Duration::from_millis(50);
    let mut last_error = String::from("no answer");
    loop {
        if last_heard.elapsed() >= lease {
            let _ = tx.send(WatchEvent::Lost(format!(
                "the coordinator was not heard for {:.1}s (the lease): {last_error}",
                lease.as_secs_f64()
            )));
            return;
        }
        let (out, out_rx) = mpsc::channel::<pb::NodeMessage>(16);
        let _ = out
            .send(pb::NodeMessage {
                kind: Some(pb::node_message::Kind::Attach(attach.clone())),
            })
            .await;
        let remaining = lease.saturating_sub(last_heard.elapsed());
        let opened = tokio::time::timeout(
            remaining,
            client.watch(tokio_stream::wrappers::ReceiverStream::new(out_rx)),
        )
        .await;
        let mut stream = match opened {
            Ok(Ok(r)) => r.into_inner(),
            Ok(Err(status)) if gone(&status) => {
                // The generation is over at the coordinator (it moved on while this node could
                // not hear it): stop and join again; the join says whether the job goes on.
                let _ = tx.send(WatchEvent::Ended(pb::GenerationEnded {
                    generation: attach.generation,
                    cause: pb::generation_ended::Cause::Superseded as i32,
                    rejoin: true,
                    message: status.message().to_owned(),
                    ..Default::default()
                }));
                return;
            }
            Ok(Err(status)) => {
                last_error = status.message().to_owned();
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
                continue;
            }
            Err(_) => continue,
        };
        let mut interval = Duration::from_secs(1);
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                msg = stream.message() => match msg {
                    Ok(Some(event)) => {
                        last_heard = Instant::now();
                        backoff = Duration::from_millis(50);
                        match event.kind {
                            Some(pb::node_event::Kind::Attached(a)) => {
                                let asked = Duration::from_millis(a.heartbeat_interval_ms.max(50));
                                // Heartbeat often enough for the coordinator and for our lease.
                                let want = asked.min(lease / 4).max(Duration::from_millis(20));
                                if want != interval {
                                    interval = want;
                                    tick = tokio::time::interval(interval);
                                    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                                }
                            }
                            Some(pb::node_event::Kind::Ended(ended)) => {
                                let _ = tx.send(WatchEvent::Ended(ended));
                            }
                            Some(pb::node_event::Kind::Heartbeat(_)) | None => {}
                        }
                    }
                    Ok(None) => {
                        last_error = "the coordinator closed the watch stream".to_owned();
                        break;
                    }
                    Err(status) if gone(&status) => {
                        let _ = tx.send(WatchEvent::Ended(pb::GenerationEnded {
                            generation: attach.generation,
                            cause: pb::generation_ended::Cause::Superseded as i32,
                            rejoin: true,
                            message: status.message().to_owned(),
                            ..Default::default()
                        }));
                        return;
                    }
                    Err(status) => {
                        last_error = status.message().to_owned();
                        break;
                    }
                },
                _ = tick.tick() => {
                    if last_heard.elapsed() >= lease {
                        break;
                    }
                    // A full buffer means the stream is stuck: the lease check above decides.
                    let _ = out.try_send(pb::NodeMessage {
                        kind: Some(pb::node_message::Kind::Heartbeat(pb::Heartbeat {})),
                    });
                }
                r = &mut finish => {
                    if r.is_ok() {
                        let _ = out
                            .send(pb::NodeMessage {
                                kind: Some(pb::node_message::Kind::Finished(pb::NodeFinished {})),
                            })
                            .await;
                        drop(out);
                        // The coordinator ends the stream once it has read ours to the end.
                        while let Ok(Some(_)) = stream.message().await {}
                    }
                    return;
                }
            }
        }
        tokio::time::sleep(backoff.min(lease.saturating_sub(last_heard.elapsed()))).await;
        backoff = (backoff * 2).min(Duration::from_secs(1));
    }
}

/// Whether the coordinator says this generation (or job) no longer exists for this node.
fn gone(status: &tonic::Status) -> bool {
    matches!(
        status.code(),
        Code::FailedPrecondition | Code::NotFound | Code::PermissionDenied | Code::InvalidArgument
    )
}
