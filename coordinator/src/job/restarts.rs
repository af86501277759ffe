//! The timeline of the job's restarts (a generation failed with restarts left): when the
//! failure was seen, when the next generation's round closed, when its ranks had all
//! registered, and when rank 0 marked its first step and completed it. `describe` and the web
//! view show the recent ones; the job record keeps them for a new leader. An in-place
//! recovery's timeline is its `RecoveryInfo` (`recovery.rs`).

use super::training::unix_now;
use muster_proto::v1 as pb;
use std::collections::VecDeque;
use std::time::{Duration, Instant};

/// How many restarts the job keeps (newest first).
const KEPT: usize = 8;

/// One restart: its view, and when its failure happened (its times count from there).
#[derive(Debug)]
struct Track {
    info: pb::RestartInfo,
    failed: Instant,
}

impl Track {
    fn since(&self) -> u64 {
        // At least 1: 0 means "not yet".
        (self.failed.elapsed().as_millis() as u64).max(1)
    }
}

/// The job's recent restarts, newest first.
#[derive(Debug, Default)]
pub(super) struct RestartTimeline {
    list: VecDeque<Track>,
}

impl RestartTimeline {
    /// Generation `failed_generation` failed (`reason`), `detected` after its cause (a lost
    /// node's agent last heard), and the job restarts.
    pub(super) fn failed(&mut self, failed_generation: u64, reason: &str, detected: Duration) {
        let reason = reason.lines().next().unwrap_or_default().to_owned();
        self.list.push_front(Track {
            info: pb::RestartInfo {
                failed_generation,
                reason,
                failed_unix_ms: unix_now().saturating_sub(detected).as_millis() as u64,
                detect_ms: detected.as_millis() as u64,
                ..Default::default()
            },
            failed: Instant::now()
                .checked_sub(detected)
                .unwrap_or_else(Instant::now),
        });
        self.list.truncate(KEPT);
    }

    /// The restart under way: the newest, if `generation` is (or may become) its new one.
    fn current(&mut self, generation: u64) -> Option<&mut Track> {
        self.list.front_mut().filter(|t| {
            t.info.generation == generation
                || (t.info.generation == 0 && t.info.failed_generation < generation)
        })
    }

    /// Generation `generation`'s round closed.
    pub(super) fn formed(&mut self, generation: u64) {
        if let Some(t) = self.current(generation)
            && t.info.generation == 0
        {
            t.info.generation = generation;
            t.info.formed_ms = t.since();
        }
    }

    /// Every rank of generation `generation` registered.
    pub(super) fn registered(&mut self, generation: u64) {
        if let Some(t) = self.current(generation)
            && t.info.generation == generation
            && t.info.registered_ms == 0
        {
            t.info.registered_ms = t.since();
        }
    }

    /// Rank 0 marked a step in generation `generation`. Returns the restart's whole time
    /// (failure to training again) at the generation's first marker.
    pub(super) fn marker(&mut self, generation: u64) -> Option<Duration> {
        let t = self.current(generation)?;
        if t.info.generation != generation {
            return None;
        }
        if t.info.resumed_ms == 0 {
            t.info.resumed_ms = t.since();
            return Some(t.failed.elapsed());
        }
        if t.info.full_step_ms == 0 {
            t.info.full_step_ms = t.since();
        }
        None
    }

    /// The view (and the job record's list): newest first.
    pub(super) fn view(&self) -> Vec<pb::RestartInfo> {
        self.list.iter().map(|t| t.info.clone()).collect()
    }

    /// The timeline a job record kept (a new leader's).
    pub(super) fn restore(records: &[pb::RestartInfo]) -> Self {
        let (now, unix) = (Instant::now(), unix_now());
        let list = records
            .iter()
            .take(KEPT)
            .map(|r| {
                let ago = unix.saturating_sub(Duration::from_millis(r.failed_unix_ms));
                Track {
                    info: r.clone(),
                    failed: now.checked_sub(ago).unwrap_or(now),
                }
            })
            .collect();
        Self { list }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn a_restart_records_each_phase_once_in_order() {
        let mut t = RestartTimeline::default();
        // Markers of a generation no restart made change nothing.
        assert_eq!(t.marker(1), None);
        t.failed(
            1,
            "rank 3 exited with status 1\nmore",
            Duration::from_millis(40),
        );
        let v = t.view();
        assert_eq!(v.len(), 1);
        assert_eq!((v[0].failed_generation, v[0].generation), (1, 0));
        assert_eq!(v[0].reason, "rank 3 exited with status 1");
        assert_eq!(v[0].detect_ms, 40);
        // A late marker of the failed generation is not the new one's.
        assert_eq!(t.marker(1), None);
        t.formed(2);
        t.registered(2);
        let took = t.marker(2).unwrap();
        assert!(took >= Duration::from_millis(40), "{took:?}");
        assert_eq!(t.marker(2), None);
        assert_eq!(t.marker(2), None);
        let v = t.view();
        let r = &v[0];
        assert_eq!(r.generation, 2);
        assert!(r.formed_ms >= 40 && r.registered_ms >= r.formed_ms, "{r:?}");
        assert!(
            r.resumed_ms >= r.registered_ms && r.full_step_ms >= r.resumed_ms,
            "{r:?}"
        );
        // Phases already recorded stay as they are.
        let before = t.view();
        t.formed(2);
        t.registered(2);
        assert_eq!(t.view(), before);

        // A new leader keeps the timeline, its times from the same failure.
        let restored = RestartTimeline::restore(&before);
        assert_eq!(restored.view(), before);
        let failed_ago = restored.list[0].failed.elapsed();
        assert!(failed_ago >= Duration::from_millis(40), "{failed_ago:?}");
        assert!(failed_ago < Duration::from_secs(5), "{failed_ago:?}");

        // At most KEPT, newest first.
        for g in 2..20 {
            t.failed(g, "again", Duration::ZERO);
        }
        let v = t.view();
        assert_eq!(v.len(), KEPT);
        assert_eq!(v[0].failed_generation, 19);
    }
}
