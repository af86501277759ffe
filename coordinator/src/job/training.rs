//! The job's effective training time (ETTR), from rank 0's step markers: of the wall-clock
//! since the first marker, the time in steps that moved the job forward, and the time lost to
//! recoveries, restarts and redone steps.
//!
//! A marker says that rank 0 began step `s`. The interval from one marker to the next counts
//! when the next names a step above every step begun before (the job got further); otherwise
//! it is lost: a step interrupted and begun again after an in-place recovery, or a generation
//! restarted from a checkpoint that begins steps it had already done. The step in progress is
//! neither yet. The counts are in the job record (written with it, and at least once a minute
//! while markers come): a new leader goes on from the last record, and the interval from the
//! last marker it knew of to its first one counts as any interval does.
//!
//! The lost time is split by what the coordinator saw of it ([`Parts`]): each in-place
//! recovery, once rank 0 marks a step after its quorum, adds its detection, its respawn (or
//! start on a spare) and its heal (registration to training again); each restart adds the time
//! from its failure to rank 0's first marker in the next generation. The rest is steps begun
//! again or redone.

use std::cell::Cell;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// The wall clock, since the Unix epoch (what the job record's times are in).
pub(super) fn unix_now() -> Duration {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default()
}

use muster_proto::v1 as pb;

/// Rank 0's markers so far.
#[derive(Debug, Default)]
pub(super) struct Steps {
    /// When the first marker came.
    first: Option<Instant>,
    /// The last marker: its step and when it came.
    last: Option<(u64, Instant)>,
    /// The highest step begun.
    highest: u64,
    counted: Duration,
    lost: Duration,
    /// What the lost time went to, as far as the coordinator saw it.
    parts: Parts,
    /// The recoveries and restarts that end at the coming marker: lost time within its
    /// interval even when that marker names a step above every other (the interrupted step
    /// had been committed). Where they reach back past the interval's start (a lost node's
    /// death is taken to be when its agent was last heard, while rank 0 still trained), the
    /// excess is not lost time: it comes off their first phases.
    ending: Parts,
    /// When the counts were last put in the job record (for [`Steps::begun`]'s answer; the
    /// record is built from a shared borrow of the job's state).
    recorded: Cell<Option<Instant>>,
}

/// The parts of the lost time: in-place recoveries (detection, respawn or spare, heal) and
/// restarts.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(super) struct Parts {
    pub(super) detection: Duration,
    pub(super) respawn: Duration,
    pub(super) heal: Duration,
    pub(super) restarts: Duration,
}

impl Parts {
    fn recoveries(&self) -> Duration {
        self.detection + self.respawn + self.heal
    }

    fn total(&self) -> Duration {
        self.recoveries() + self.restarts
    }

    /// Takes `excess` off the phases, the earliest first.
    fn trim(&mut self, mut excess: Duration) {
        for phase in [
            &mut self.detection,
            &mut self.respawn,
            &mut self.heal,
            &mut self.restarts,
        ] {
            let cut = excess.min(*phase);
            *phase -= cut;
            excess -= cut;
        }
    }

    fn add(&mut self, other: &Parts) {
        self.detection += other.detection;
        self.respawn += other.respawn;
        self.heal += other.heal;
        self.restarts += other.restarts;
    }
}

/// How often markers alone have the counts written to the job record.
const RECORD_EVERY: Duration = Duration::from_secs(60);

impl Steps {
    /// Rank 0 began `step` at `now`. Returns whether the counts are due in the job record
    /// (none written for [`RECORD_EVERY`]).
    pub(super) fn begun(&mut self, step: u64, now: Instant) -> bool {
        let mut ending = std::mem::take(&mut self.ending);
        match self.last {
            None => {
                self.first = Some(now);
                self.highest = step;
            }
            Some((_, at)) => {
                let took = now.saturating_duration_since(at);
                ending.trim(ending.total().saturating_sub(took));
                self.parts.add(&ending);
                if step > self.highest {
                    let lost = ending.total();
                    self.counted += took - lost;
                    self.lost += lost;
                    self.highest = step;
                } else {
                    self.lost += took;
                }
            }
        }
        self.last = Some((step, now));
        self.recorded
            .get()
            .is_none_or(|at| now.saturating_duration_since(at) >= RECORD_EVERY)
    }

    /// An in-place recovery ends at the marker about to be counted (rank 0's first after its
    /// quorum): `detected`, `registered` and `resumed` are the times from the death to its
    /// detection, to its last replacement's registration and to that marker.
    pub(super) fn recovered(
        &mut self,
        detected: Duration,
        registered: Duration,
        resumed: Duration,
    ) {
        let registered = registered.clamp(detected, resumed.max(detected));
        self.ending.detection += detected.min(resumed);
        self.ending.respawn += registered.saturating_sub(detected);
        self.ending.heal += resumed.saturating_sub(registered);
    }

    /// A restart ends at the marker about to be counted (rank 0's first in the new
    /// generation), `took` after the failure.
    pub(super) fn restarted(&mut self, took: Duration) {
        self.ending.restarts += took;
    }

    /// The counts for the job record, written at `now`, `unix` since the Unix epoch (`None`
    /// before the first marker).
    pub(super) fn to_record(&self, now: Instant, unix: Duration) -> Option<pb::TrainingRecord> {
        let (first, (last_step, last)) = (self.first?, self.last?);
        self.recorded.set(Some(now));
        let unix_ms = |at: Instant| {
            unix.saturating_sub(now.saturating_duration_since(at))
                .as_millis() as u64
        };
        Some(pb::TrainingRecord {
            first_unix_ms: unix_ms(first),
            last_unix_ms: unix_ms(last),
            last_step,
            highest_step: self.highest,
            counted_ms: self.counted.as_millis() as u64,
            lost_ms: self.lost.as_millis() as u64,
            recoveries_ms: self.parts.recoveries().as_millis() as u64,
            detection_ms: self.parts.detection.as_millis() as u64,
            respawn_ms: self.parts.respawn.as_millis() as u64,
            heal_ms: self.parts.heal.as_millis() as u64,
            restarts_ms: self.parts.restarts.as_millis() as u64,
        })
    }

    /// The counts a job record kept, as of `now`, `unix` since the Unix epoch (a new
    /// leader's).
    pub(super) fn restore(r: &pb::TrainingRecord, now: Instant, unix: Duration) -> Self {
        let at = |ms: u64| {
            let ago = unix.saturating_sub(Duration::from_millis(ms));
            now.checked_sub(ago).unwrap_or(now)
        };
        Self {
            first: Some(at(r.first_unix_ms)),
            last: Some((r.last_step, at(r.last_unix_ms))),
            highest: r.highest_step,
            counted: Duration::from_millis(r.counted_ms),
            lost: Duration::from_millis(r.lost_ms),
            parts: Parts {
                detection: Duration::from_millis(r.detection_ms),
                respawn: Duration::from_millis(r.respawn_ms),
                heal: Duration::from_millis(r.heal_ms),
                restarts: Duration::from_millis(r.restarts_ms),
            },
            ending: Parts::default(),
            recorded: Cell::new(Some(now)),
        }
    }

    /// The view at `now`; `None` before the first marker. The parts are as measured (a
    /// recovery's death may come before the first marker, or its interval be counted).
    pub(super) fn view(&self, now: Instant) -> Option<pb::TrainingTime> {
        let (first, (last_step, _)) = (self.first?, self.last?);
        let wall = now.saturating_duration_since(first);
        let ms = |d: Duration| d.as_millis() as u64;
        let p = &self.parts;
        Some(pb::TrainingTime {
            ettr: if wall.is_zero() {
                0.0
            } else {
                self.counted.as_secs_f64() / wall.as_secs_f64()
            },
            wall_ms: ms(wall),
            counted_ms: ms(self.counted),
            lost_ms: ms(self.lost),
            recoveries_ms: ms(p.recoveries()),
            last_step,
            highest_step: self.highest,
            detection_ms: ms(p.detection),
            respawn_ms: ms(p.respawn),
            heal_ms: ms(p.heal),
            restarts_ms: ms(p.restarts),
        })
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn at(start: Instant, ms: u64) -> Instant {
        start + Duration::from_millis(ms)
    }

    #[test]
    fn steps_that_move_forward_count_and_the_others_are_lost() {
        let t = Instant::now();
        let mut steps = Steps::default();
        assert!(steps.view(t).is_none());
        // Steps 0..=3, 100 ms each.
        for s in 0..4 {
            steps.begun(s, at(t, 100 * s));
        }
        // Step 3 is interrupted at 350 ms; a recovery (seen 50 ms after the death, the
        // replacement registered at 150 ms), then step 3 again at 700 ms (the recovery ends
        // there), step 4 at 800 ms.
        let ms = Duration::from_millis;
        steps.recovered(ms(50), ms(150), ms(350));
        steps.begun(3, at(t, 700));
        steps.begun(4, at(t, 800));
        let v = steps.view(at(t, 850)).unwrap();
        assert_eq!((v.wall_ms, v.counted_ms, v.lost_ms), (850, 400, 400));
        assert_eq!((v.recoveries_ms, v.last_step, v.highest_step), (350, 4, 4));
        assert_eq!((v.detection_ms, v.respawn_ms, v.heal_ms), (50, 100, 200));
        assert!((v.ettr - 400.0 / 850.0).abs() < 1e-9);

        // A restart from a checkpoint at step 2 (it ends at the new generation's first
        // marker): steps 2..=4 are redone, lost; step 5 counts.
        steps.restarted(ms(500));
        for (i, s) in (2..=5).enumerate() {
            steps.begun(s, at(t, 1_500 + 100 * i as u64));
        }
        steps.begun(6, at(t, 1_900));
        let v = steps.view(at(t, 1_900)).unwrap();
        assert_eq!(
            (v.counted_ms, v.lost_ms),
            (400 + 100 + 100, 400 + 700 + 200)
        );
        assert_eq!(
            (v.recoveries_ms, v.restarts_ms, v.highest_step),
            (350, 500, 6)
        );
        // A recovery after which rank 0 goes on with the next step (the interrupted one had
        // been committed): its time is lost all the same, the rest of the interval counts.
        steps.recovered(Duration::ZERO, ms(100), ms(250));
        steps.begun(7, at(t, 2_300));
        let v = steps.view(at(t, 2_300)).unwrap();
        assert_eq!((v.counted_ms, v.lost_ms), (600 + 150, 1_300 + 250));
        // A registration the clocks put outside the recovery stays within it.
        let mut other = Steps::default();
        other.begun(0, t);
        other.recovered(ms(80), ms(40), ms(300));
        other.recovered(ms(10), ms(900), ms(300));
        other.begun(1, at(t, 1_000));
        assert_eq!(
            other.parts,
            Parts {
                detection: ms(90),
                respawn: ms(290),
                heal: ms(220),
                restarts: Duration::ZERO
            }
        );
        // A recovery reaching back past the last marker (a lost node's death taken to be when
        // its agent was last heard, while rank 0 still trained): the excess comes off its
        // detection, then its respawn.
        let mut early = Steps::default();
        early.begun(0, t);
        early.recovered(ms(150), ms(250), ms(400));
        early.begun(1, at(t, 200));
        let v = early.view(at(t, 200)).unwrap();
        assert_eq!((v.counted_ms, v.lost_ms), (0, 200));
        assert_eq!((v.detection_ms, v.respawn_ms, v.heal_ms), (0, 50, 150));
    }

    /// A new leader goes on from the record: the counts kept, and the interval from the last
    /// marker in the record to the next one counted as any interval is.
    #[test]
    fn the_counts_survive_a_record_and_go_on() {
        let t = Instant::now();
        let mut steps = Steps::default();
        assert!(steps.begun(0, t), "the first marker is due in the record");
        // The job writes its record then (the wall clock at 1000 s).
        let unix = |ms: u64| Duration::from_secs(1_000) + Duration::from_millis(ms);
        assert!(steps.to_record(t, unix(0)).is_some());
        assert!(!steps.begun(1, at(t, 100)));
        steps.recovered(
            Duration::ZERO,
            Duration::from_millis(20),
            Duration::from_millis(50),
        );
        steps.restarted(Duration::from_millis(70));
        steps.begun(1, at(t, 300));
        let record = steps.to_record(at(t, 300), unix(300)).unwrap();
        assert_eq!(
            (
                record.counted_ms,
                record.lost_ms,
                record.last_step,
                record.highest_step
            ),
            (100, 200, 1, 1)
        );
        assert_eq!(record.last_unix_ms - record.first_unix_ms, 300);
        let now = at(t, 1_000);
        let mut restored = Steps::restore(&record, now, unix(1_000));
        // Step 2 came 900 ms after the last marker the record knew (step 1 at 300 ms).
        restored.begun(2, at(t, 1_200));
        let v = restored.view(at(t, 1_200)).unwrap();
        assert_eq!((v.counted_ms, v.lost_ms, v.highest_step), (1_000, 200, 2));
        assert_eq!((v.respawn_ms, v.heal_ms, v.restarts_ms), (20, 30, 70));
        assert!(v.wall_ms.abs_diff(1_200) <= 2, "{v:?}");
        assert!(!restored.begun(3, at(t, 1_300)), "just recorded");
        assert!(restored.begun(4, at(t, 1_000 + 60_000)));
    }
}
