//! `muster.v1.Rendezvous`: joins into rounds (withdrawn when the caller goes away), the
//! agents' watch streams (each one its node's lease), and agents' failure reports.

use super::*;

type WatchStream = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::NodeEvent, Status>> + Send>>;

/// `muster.v1.Rendezvous`.
#[derive(Clone)]
pub struct RendezvousService(pub Arc<Coordinator>);

/// Removes a joiner from its round if its caller goes away before the round closes.
struct JoinGuard {
    job: Arc<Job>,
    generation: u64,
    node_id: String,
    attempt: u64,
    armed: bool,
}

impl Drop for JoinGuard {
    fn drop(&mut self) {
        if self.armed {
            self.job
                .withdraw(self.generation, &self.node_id, self.attempt);
        }
    }
}

/// Withdraws a parked `Quorum` call when its handler ends (answered, timed out or dropped
/// because the client went away); withdrawing an answered call does nothing.
struct QuorumGuard {
    job: Arc<Job>,
    generation: u64,
    rank: u32,
    token: u64,
}

impl Drop for QuorumGuard {
    fn drop(&mut self) {
        self.job
            .quorum_withdraw(self.generation, self.rank, self.token);
    }
}

#[tonic::async_trait]
impl pb::rendezvous_server::Rendezvous for RendezvousService {
    /// A long poll (in-place recovery): parked in the job's quorum table until every rank
    /// called, answered DEADLINE_EXCEEDED after `wait_ms`. Cancel-safe: a dropped call (its
    /// client went away) withdraws itself from the table.
    async fn quorum(&self, request: Request<pb::QuorumRequest>) -> Rpc<pb::QuorumResponse> {
        auth::authorize_job(&request, &request.get_ref().job_id)?;
        let ask = QuorumAsk::try_from(request.into_inner())?;
        let job = self.0.job(ask.job_id.as_str())?;
        let (token, rx) = job.quorum(&ask)?;
        let _guard = QuorumGuard {
            job: Arc::clone(&job),
            generation: ask.generation,
            rank: ask.rank,
            token,
        };
        match tokio::time::timeout(ask.wait, rx).await {
            Ok(Ok(answer)) => Ok(Response::new(answer?)),
            Ok(Err(_)) => Err(Status::unavailable(format!(
                "job '{}' dropped the Quorum call of rank {} (its coordinator stopped leading); ask again",
                job.id, ask.rank
            ))),
            Err(_) => Err(Status::deadline_exceeded(format!(
                "no quorum of job '{}' generation {} within {} ms (rank {} waited; a rank is still being replaced or has not called yet); ask again",
                job.id,
                ask.generation,
                ask.wait.as_millis(),
                ask.rank
            ))),
        }
    }

    /// Cancel-safe: a dropped call withdraws its node from the open round.
    async fn join(&self, request: Request<pb::JoinRequest>) -> Rpc<pb::JoinResponse> {
        auth::cluster_only(&request, "muster.v1.Rendezvous.Join")?;
        let Join {
            job_id: id,
            node: req,
            round,
        } = Join::try_from(request.into_inner())?;
        let defaults = self.0.round_defaults();
        let job = {
            let mut jobs = self.0.jobs();
            match jobs.get(&id) {
                Some(job) => {
                    let have = job.config();
                    if let Some(spec) = round {
                        // A join that leaves the restart budget or the recovery mode unset
                        // takes the job's; hang detection is the first joiner's.
                        let c = RoundConfig {
                            hang: have.hang,
                            max_spares: have.max_spares,
                            ..spec.resolve(defaults, have.max_restarts, have.recovery, have.hang)
                        };
                        if c != have {
                            return Err(Status::failed_precondition(format!(
                                "job '{id}' exists with min_nodes={} max_nodes={} last_call_ms={} join_timeout_ms={} max_restarts={} recovery={}; this join asks for {}:{} {} {} {} {}",
                                have.min_nodes,
                                have.max_nodes,
                                have.last_call.as_millis(),
                                have.join_timeout.as_millis(),
                                have.max_restarts,
                                have.recovery,
                                c.min_nodes,
                                c.max_nodes,
                                c.last_call.as_millis(),
                                c.join_timeout.as_millis(),
                                c.max_restarts,
                                c.recovery
                            )));
                        }
                    }
                    Arc::clone(job)
                }
                None => {
                    self.0.may_create(&id, jobs.len())?;
                    let c = round.map_or(defaults, |spec| {
                        spec.resolve(defaults, 0, Recovery::Restart, Hang::default())
                    });
                    let job = Job::new(id.clone(), c, &self.0.ctx);
                    jobs.insert(id, Arc::clone(&job));
                    job
                }
            }
        };
        let node_id = req.node_id.clone();
        let (generation, attempt, rx) = job.join(req)?;
        let mut guard = JoinGuard {
            job: Arc::clone(&job),
            generation,
            node_id,
            attempt,
            armed: true,
        };
        let answer = rx.await.map_err(|_| {
            Status::aborted(format!(
                "rendezvous round of job '{}' was abandoned",
                job.id
            ))
        });
        guard.armed = false;
        Ok(Response::new(answer??))
    }

    type WatchStream = WatchStream;

    async fn watch(&self, request: Request<Streaming<pb::NodeMessage>>) -> Rpc<WatchStream> {
        auth::cluster_only(&request, "muster.v1.Rendezvous.Watch")?;
        let hb = self.0.config.heartbeat_timeout;
        let mut inbound = request.into_inner();
        let first = first_message(&mut inbound, hb, "node watch").await?;
        let Some(pb::node_message::Kind::Attach(a)) = first.kind else {
            return Err(Status::invalid_argument(
                "the first node watch message must be attach",
            ));
        };
        let job = self.0.job(&a.job_id)?;
        let NodeAttach {
            generation,
            node_rank,
            node_id,
            attempt,
        } = NodeAttach::try_from(&a)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let attached = pb::NodeAttached {
            heartbeat_interval_ms: self.0.config.heartbeat_interval().as_millis() as u64,
            heartbeat_timeout_ms: hb.as_millis() as u64,
        };
        let watch_id = job.watch(
            generation,
            node_rank,
            &node_id,
            attempt,
            tx.clone(),
            attached,
        )?;
        // Task "node-watch", one per attached agent: it is the node's lease. It ends with the
        // stream; if the node's ranks still run then, the generation fails naming the node.
        tokio::spawn(async move {
            use pb::node_message::Kind;
            // Whether the agent sent anything after its attach: it heartbeats as soon as it
            // reads `attached`, so until then it may not know this stream opened.
            let mut heard = false;
            let why = loop {
                // Silence counts only while this process runs (`tenure::within`).
                match crate::tenure::within(hb, inbound.message()).await {
                    None => {
                        break format!(
                            "no heartbeat from its agent for {:.1}s (agent stopped, hung or partitioned)",
                            hb.as_secs_f64()
                        );
                    }
                    Some(Err(status)) => {
                        let why = format!("its agent's stream broke: {}", status.message());
                        if !heard {
                            break unanswered(why, hb).await;
                        }
                        break why;
                    }
                    Some(Ok(None)) if !heard => {
                        break unanswered("its agent disconnected".to_owned(), hb).await;
                    }
                    Some(Ok(None)) => break "its agent disconnected".to_owned(),
                    Some(Ok(Some(_))) if job.retired() => {
                        // A lapsed leader takes nothing in; the agent moves to the leader.
                        let _ = tx.send(Err(crate::tenure::Tenure::lapsed()));
                        break "this coordinator's leadership lapsed".to_owned();
                    }
                    Some(Ok(Some(msg))) => match msg.kind {
                        Some(Kind::Heartbeat(_)) => {
                            heard = true;
                            job.node_heartbeat(generation, node_rank, watch_id);
                            let _ = tx.send(Ok(pb::NodeEvent {
                                kind: Some(pb::node_event::Kind::Heartbeat(pb::Heartbeat {})),
                            }));
                        }
                        Some(Kind::Progress(_)) => {
                            job.node_progress(generation);
                        }
                        Some(Kind::Samples(s)) => {
                            job.node_samples(generation, node_rank, s.ranks);
                        }
                        Some(Kind::Stacks(answer)) => {
                            job.stacks_reply(generation, node_rank, answer);
                        }
                        Some(Kind::Finished(_)) => {
                            // Ending the stream is the answer the agent waits for: it exits
                            // as soon as its node's end is recorded. The node is finished,
                            // so `node_lost` below only drops its outbox.
                            job.node_finished(generation, node_rank).await;
                            break "its agent finished".to_owned();
                        }
                        Some(Kind::Attach(_)) | None => {
                            let _ = tx.send(Err(Status::invalid_argument(
                                "attach may only be the first node watch message",
                            )));
                            break "protocol error on its watch stream".to_owned();
                        }
                    },
                }
            };
            job.node_lost(generation, node_rank, watch_id, &why);
        });
        // What a lapsed leader would push never leaves (`tenure::Tenure::guard`).
        Ok(Response::new(Box::pin(self.0.tenure().guard(rx))))
    }

    async fn report_failure(
        &self,
        request: Request<pb::ReportFailureRequest>,
    ) -> Rpc<pb::ReportFailureResponse> {
        auth::cluster_only(&request, "muster.v1.Rendezvous.ReportFailure")?;
        let r = request.into_inner();
        let job = self.0.job(&r.job_id)?;
        let report = FailureReport::try_from(r)?;
        job.check_member(report.generation, report.rank)?;
        job.check_reporter(report.generation, report.rank, &report.node_id)?;
        job.fail_rank(
            report.generation,
            report.rank,
            report.reason,
            Some(report.detail),
        );
        Ok(Response::new(pb::ReportFailureResponse {}))
    }
}

/// A node's watch stream that ended before its agent sent anything after the attach: the
/// agent may never have read the answer (it leaves an open that is slow to answer for another
/// replica, `agent/src/watch.rs`, and a busy leader can take the open just before the agent
/// gives up on it). The node is lost only if no newer watch attaches within the heartbeat
/// timeout, the time a silent node gets anyway (`Job::node_lost` ignores an attach that a
/// newer one replaced). An agent that dies right after it attached is thus seen after that
/// timeout, not at once. Returns `why`, after the wait.
async fn unanswered(why: String, heartbeat_timeout: Duration) -> String {
    tokio::time::sleep(heartbeat_timeout).await;
    format!(
        "{why} before it answered the attach, and no newer watch attached within {:.1}s",
        heartbeat_timeout.as_secs_f64()
    )
}
