//! Expiry of jobs in a final state (finished, failed, cancelled), or abandoned (a rendezvous
//! round open with no node waiting, not a submitted job waiting for its agents): which jobs
//! are due, and what an expired job's id answers afterwards.
//!
//! A sweep (`Coordinator::expire_finished`, every [`Retention::sweep_interval`]) notes when
//! each job was first seen in such a state and removes it `finished_job_ttl` later (a job that
//! leaves the state, say a node joins the empty round, starts over): from
//! memory, from the pool, and from the store (its key-value data, published values and, over
//! etcd, its record). The removed job leaves a tombstone, so that calls naming it hear that it
//! expired, and when, rather than only "not found". Tombstones are bounded
//! ([`Retention::TOMBSTONES`], oldest dropped first) and kept in memory only: after a
//! failover an expired job is simply unknown. A join under an expired job's id creates a new
//! job (a rerun under a fixed job name); while the old one's stored data is still being
//! removed, such a join is told UNAVAILABLE (and retries), so the removal never deletes the
//! new job's data.

use std::collections::{HashMap, VecDeque};
use std::sync::Mutex;
use std::time::{Duration, SystemTime};
use tokio::time::Instant;
use tonic::Status;

use muster_core::model::JobId;

/// The job ages and tombstones behind expiry. One small lock, never held across an `.await`.
#[derive(Debug)]
pub struct Retention {
    ttl: Duration,
    state: Mutex<State>,
}

#[derive(Debug, Default)]
struct State {
    /// Jobs seen in a final state, since when (monotonic, and wall clock for messages).
    final_since: HashMap<JobId, (Instant, SystemTime)>,
    /// Expired jobs, by id.
    expired: HashMap<JobId, Expired>,
    /// Expired ids, oldest first (to bound `expired`).
    order: VecDeque<JobId>,
}

/// What is remembered of an expired job.
#[derive(Debug, Clone)]
struct Expired {
    /// "finished", "failed" or "cancelled".
    outcome: &'static str,
    /// When it was first seen in that state.
    ended: SystemTime,
    /// When it was removed.
    at: SystemTime,
    /// Its stored data is still being deleted (a failed delete is retried at the next sweep).
    removing: bool,
}

impl Retention {
    /// Most tombstones kept.
    pub const TOMBSTONES: usize = 10_000;

    /// Expiry after `ttl` in a final state.
    pub fn new(ttl: Duration) -> Self {
        Self {
            ttl,
            state: Mutex::default(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// How often to sweep: a quarter of the TTL, between 10 ms and 10 s, so that a job goes
    /// at most that long after its TTL.
    pub fn sweep_interval(&self) -> Duration {
        (self.ttl / 4).clamp(Duration::from_millis(10), Duration::from_secs(10))
    }

    /// Records that `job` is (`outcome` is some) or is not in a removable state (final or
    /// abandoned) at `now`; says whether it has been in one for the TTL.
    pub fn due(&self, job: &JobId, outcome: Option<&'static str>, now: Instant) -> bool {
        let mut st = self.lock();
        match outcome {
            None => {
                st.final_since.remove(job);
                false
            }
            Some(_) => {
                let (since, _) = *st
                    .final_since
                    .entry(job.clone())
                    .or_insert_with(|| (now, SystemTime::now()));
                now.duration_since(since) >= self.ttl
            }
        }
    }

    /// `job` leaves memory now: its calls hear that it expired; its stored data is to be
    /// removed ([`Retention::removing`], then [`Retention::removed`]).
    pub fn expire(&self, job: &JobId, outcome: &'static str) {
        let mut st = self.lock();
        let ended = st
            .final_since
            .remove(job)
            .map_or_else(SystemTime::now, |(_, wall)| wall);
        let tombstone = Expired {
            outcome,
            ended,
            at: SystemTime::now(),
            removing: true,
        };
        if st.expired.insert(job.clone(), tombstone).is_none() {
            st.order.push_back(job.clone());
        }
        while st.order.len() > Self::TOMBSTONES {
            // Never drop one whose data is still being removed: its id must stay blocked.
            let Some(old) = st.order.pop_front() else {
                break;
            };
            if st.expired.get(&old).is_some_and(|e| e.removing) {
                st.order.push_back(old);
                break;
            }
            st.expired.remove(&old);
        }
    }

    /// Expired jobs whose stored data is still to be removed.
    pub fn removing(&self) -> Vec<JobId> {
        let st = self.lock();
        st.expired
            .iter()
            .filter(|(_, e)| e.removing)
            .map(|(id, _)| id.clone())
            .collect()
    }

    /// `job`'s stored data is gone.
    pub fn removed(&self, job: &JobId) {
        if let Some(e) = self.lock().expired.get_mut(job) {
            e.removing = false;
        }
    }

    /// What a call naming `job`, which is not in memory, should hear if it expired.
    pub fn expired(&self, job: &JobId) -> Option<Status> {
        let st = self.lock();
        let e = st.expired.get(job)?;
        Some(Status::not_found(format!(
            "job '{job}' expired at {}: it was {} at {}, and jobs in a final state (or abandoned) are removed after {} ms (--finished-job-ttl-ms)",
            rfc3339(e.at),
            e.outcome,
            rfc3339(e.ended),
            self.ttl.as_millis()
        )))
    }

    /// A new job is about to be created under `job`: forgets its tombstone, or refuses while
    /// the expired job's stored data is still being removed.
    pub fn creating(&self, job: &JobId) -> Result<(), Status> {
        let mut st = self.lock();
        match st.expired.get(job) {
            Some(e) if e.removing => Err(Status::unavailable(format!(
                "job '{job}' expired and its stored data is being removed; try again shortly"
            ))),
            Some(_) => {
                st.expired.remove(job);
                st.order.retain(|id| id != job);
                Ok(())
            }
            None => Ok(()),
        }
    }

    /// Forgets every age (this coordinator stopped leading, or reloaded every job); the
    /// tombstones stay for messages, but pending removals are the next leader's to redo.
    pub fn reset(&self) {
        let mut st = self.lock();
        st.final_since.clear();
        for e in st.expired.values_mut() {
            e.removing = false;
        }
    }
}

/// `t` as an RFC 3339 UTC time with seconds ("2026-11-25T10:53:07Z").
pub fn rfc3339(t: SystemTime) -> String {
    let secs = t
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs());
    let (days, rem) = (secs / 86_400, secs % 86_400);
    // Howard Hinnant's civil_from_days.
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn rfc3339_formats_utc() {
        let at = |s: u64| rfc3339(SystemTime::UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(1_795_607_587), "2026-11-25T11:53:07Z");
    }

    #[test]
    fn a_job_is_due_after_the_ttl_in_a_final_state_and_leaves_a_tombstone() {
        let r = Retention::new(Duration::from_secs(60));
        let j = JobId::parse("j").unwrap();
        let t0 = Instant::now();
        assert!(!r.due(&j, Some("finished"), t0));
        // Leaving the final state (a new round) resets the age.
        assert!(!r.due(&j, None, t0 + Duration::from_secs(30)));
        assert!(!r.due(&j, Some("failed"), t0 + Duration::from_secs(40)));
        assert!(!r.due(&j, Some("failed"), t0 + Duration::from_secs(99)));
        assert!(r.due(&j, Some("failed"), t0 + Duration::from_secs(100)));
        r.expire(&j, "failed");
        let e = r.expired(&j).unwrap();
        assert_eq!(e.code(), tonic::Code::NotFound);
        assert!(e.message().contains("job 'j' expired at "), "{e:?}");
        assert!(e.message().contains("it was failed at"), "{e:?}");
        // A join under the id waits for the removal, then creates a new job.
        assert_eq!(r.creating(&j).unwrap_err().code(), tonic::Code::Unavailable);
        assert_eq!(r.removing(), vec![j.clone()]);
        r.removed(&j);
        assert!(r.removing().is_empty());
        r.creating(&j).unwrap();
        assert!(r.expired(&j).is_none());
    }
}
