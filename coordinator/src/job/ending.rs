//! How a generation or the job ends: a rank's failure (and the restart budget that decides
//! whether the nodes rejoin), every rank leaving cleanly (finished), and an operator's cancel.
//! Every end of the job is final.

use super::*;

/// How a cancel reads wherever it is shown (the agents' logs, `GenerationEnded`, the job's
/// summary): one wording, so that an operator can grep for it.
pub(super) fn cancelled_text(why: &str) -> String {
    format!("cancelled by an operator: {why}")
}

/// What a join, a joiner of the open round or a wait of a cancelled job is answered.
pub(super) fn cancelled_refusal(job: &JobId, why: &str) -> String {
    format!("job '{job}' was {}", cancelled_text(why))
}

impl Job {
    /// Marks `rank` failed and fails its generation (if it is the first failure): every
    /// pending barrier of the generation gets an error naming the rank, and every node's agent
    /// learns whether to restart. A `detail` (from the agent: exit status, signal, error file)
    /// replaces a first reason that was only "session lost".
    pub fn fail_rank(
        &self,
        generation: u64,
        rank: u32,
        reason: String,
        detail: Option<FailureDetail>,
    ) {
        let mut st = self.lock();
        if self.retired() || matches!(st.done, Some(Done::Finished(_) | Done::Cancelled(_))) {
            // A finished or cancelled job is final; a failed one only learns the precise
            // reason of its first failure below.
            return;
        }
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let Some(slot) = g.ranks.get_mut(rank as usize) else {
            return;
        };
        let precise = detail.is_some();
        if slot.state == RankState::Left && !precise {
            return;
        }
        if self.fail_in_place(&mut st, generation, rank, &reason, precise) {
            return;
        }
        let Ok(g) = self.running(&mut st, generation) else {
            return;
        };
        let slot = &mut g.ranks[rank as usize];
        slot.state = RankState::Failed;
        slot.outbox = None;
        if let Some(f) = &mut g.failure {
            if f.rank == rank && precise && !f.precise {
                f.reason = reason;
                f.precise = true;
                f.detail = detail.unwrap_or_default();
                // Tell the agents again: they print the most precise reason they heard.
                if let Some(ended) = &g.ended
                    && ended.cause == pb::generation_ended::Cause::Failed as i32
                {
                    let mut ended = (**ended).clone();
                    ended.failure = Some(f.to_info(generation));
                    g.end(ended, &HashMap::new());
                }
                self.persist(&st);
            }
            return;
        }
        let loc = g.location(rank);
        let failure = Failure {
            rank,
            node_rank: loc.node_rank(),
            host: loc.host,
            reason,
            precise,
            detail: detail.unwrap_or_default(),
            node_id: String::new(),
            hang: None,
        };
        self.fail_generation(&mut st, generation, failure);
    }

    /// Records the generation's first failure, fails its waits, tells the agents whether to
    /// restart, and marks the job over when no restart is left. Takes the lock's guard and
    /// releases it.
    pub(super) fn fail_generation(
        &self,
        st: &mut MutexGuard<'_, JobState>,
        generation: u64,
        f: Failure,
    ) {
        if st.done.is_some() {
            // Final (finished, failed or cancelled): nothing changes it any more.
            return;
        }
        let (restarts, max_restarts) = (st.restarts, st.config.max_restarts);
        // A hang with `--on-hang fail` ends the job whatever budget is left.
        let rejoin = restarts < max_restarts && f.hang != Some(OnHang::Fail);
        let id = self.id.clone();
        let text = f.describe(&id, generation);
        if !rejoin {
            let why = if max_restarts == 0 || f.hang.is_some() {
                text.clone()
            } else {
                format!("{text} (no restarts left: {restarts} of {max_restarts} used)")
            };
            self.conclude(st, Done::Failed(why));
        }
        let Ok(g) = self.running(st, generation) else {
            return;
        };
        // A lost node's failure is seen after its agent was last heard.
        let detected = (!f.node_id.is_empty())
            .then(|| g.nodes.get(f.node_rank as usize)?.last_seen)
            .flatten()
            .map_or(Duration::ZERO, |t| t.elapsed());
        tracing::warn!(job = %id, generation, rejoin, "{text}");
        crate::metrics::generation_failed(&f);
        let err = f.to_error(&id, generation);
        let info = f.to_info(generation);
        let ended_failure = info.clone();
        // The restart's reason without the worker's stderr (the timeline is on the
        // unauthenticated web view, as the failures are without theirs).
        let timeline_reason = rejoin.then(|| {
            if info.node_id.is_empty() {
                format!(
                    "rank {} (node {}, host {}) {}",
                    info.rank(),
                    info.node_rank(),
                    info.host,
                    info.reason
                )
            } else {
                info.reason.clone()
            }
        });
        g.failure = Some(f);
        g.end_quorums(|| Error::FailedPrecondition(text.clone()));
        g.fail_all_barriers(&err);
        g.relays_failed(&err);
        g.sessions_failed(&err);
        let message = if rejoin {
            format!(
                "{text}; restarting (restart {} of {max_restarts})",
                restarts + 1
            )
        } else if max_restarts == 0 {
            text
        } else {
            format!("{text}; no restarts left ({restarts} of {max_restarts} used)")
        };
        g.end(
            pb::GenerationEnded {
                generation,
                cause: pb::generation_ended::Cause::Failed as i32,
                rejoin,
                failure: Some(info),
                message,
                restart_count: restarts,
                max_restarts,
            },
            &HashMap::new(),
        );
        st.recent_failures.push_front(ended_failure);
        st.recent_failures.truncate(super::RECENT_FAILURES);
        if let Some(reason) = timeline_reason {
            st.restart_timeline.failed(generation, &reason, detected);
        }
        self.persist(st);
        self.notify();
    }

    /// Marks the job finished (final) once every rank of its healthy running generation has
    /// left and every node whose agent watched it has finished (or went away after its ranks
    /// left). Returns whether it did; the caller persists.
    pub(super) fn check_finished(&self, st: &mut JobState) -> bool {
        if st.done.is_some() {
            return false;
        }
        let Phase::Running(g) = &st.phase else {
            return false;
        };
        if g.failure.is_some()
            || g.ended.is_some()
            || (g.left as usize) < g.ranks.len()
            || g.nodes.iter().any(|n| !n.finished && n.watch.is_some())
        {
            return false;
        }
        let why = format!(
            "every rank of generation {} ({} ranks on {} nodes) left cleanly",
            g.generation,
            g.ranks.len(),
            g.nodes.len()
        );
        tracing::info!(job = %self.id, generation = g.generation, "job finished: {why}");
        self.conclude(st, Done::Finished(why));
        true
    }

    /// Cancels the job: joiners of an open round and every wait of the running generation
    /// get an error, the agents are told to stop, and later joins are refused. A job already
    /// over (finished, failed or cancelled) stays as it is: returns false.
    pub fn cancel(&self, why: &str) -> bool {
        let mut st = self.lock();
        if st.done.is_some() {
            return false;
        }
        self.conclude(&mut st, Done::Cancelled(why.to_owned()));
        let (generation, restarts, max_restarts) =
            (st.generation, st.restarts, st.config.max_restarts);
        tracing::warn!(job = %self.id, generation, "job {}", cancelled_text(why));
        crate::metrics::job_cancelled();
        let message = cancelled_refusal(&self.id, why);
        match &mut st.phase {
            Phase::Open(round) => {
                for j in round.joiners.drain() {
                    let _ = j.reply.send(Err(Error::Cancelled(message.clone())));
                }
            }
            Phase::Running(g) => {
                let err = simple_error(ErrKind::Cancelled, message.clone());
                crate::metrics::generation_ended(crate::metrics::Cause::Cancelled);
                g.fail_all_barriers(&err);
                g.relays_failed(&err);
                g.end_quorums(|| Error::FailedPrecondition(message.clone()));
                g.end(
                    pb::GenerationEnded {
                        generation,
                        cause: pb::generation_ended::Cause::Cancelled as i32,
                        rejoin: false,
                        failure: None,
                        // What the agents print: the reason, not the job id they know.
                        message: cancelled_text(why),
                        restart_count: restarts,
                        max_restarts,
                    },
                    &HashMap::new(),
                );
            }
        }
        self.persist(&st);
        drop(st);
        self.notify();
        true
    }
}
