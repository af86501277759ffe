//! The job's effective training time (ETTR), from rank 0's step markers: of the wall-clock
//! since the first marker, the time in steps that moved the job forward, and the time lost to
//! recoveries, restarts and redone steps.
//!
//! A marker says that rank 0 began step `s`. The interval from one marker to the next counts
//! when the next names a step above every step begun before (the job got further); otherwise
//! it is lost: a step interrupted and begun again after an in-place recovery, or a generation
//! restarted from a checkpoint that begins steps it had already done. The step in progress is
//! neither yet. Kept in memory by the leader: a new leader starts counting afresh.

use std::time::{Duration, Instant};

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
}

impl Steps {
    /// Rank 0 began `step` at `now`.
    pub(super) fn begun(&mut self, step: u64, now: Instant) {
        match self.last {
            None => {
                self.first = Some(now);
                self.highest = step;
            }
            Some((_, at)) => {
                let took = now.saturating_duration_since(at);
                if step > self.highest {
                    self.counted += took;
                    self.highest = step;
                } else {
                    self.lost += took;
                }
            }
        }
        self.last = Some((step, now));
    }

    /// The view at `now`, with `recoveries` the time of the running generation's in-place
    /// recoveries (death to resumed); `None` before the first marker.
    pub(super) fn view(&self, now: Instant, recoveries: Duration) -> Option<pb::TrainingTime> {
        let (first, (last_step, _)) = (self.first?, self.last?);
        let wall = now.saturating_duration_since(first);
        let ms = |d: Duration| d.as_millis() as u64;
        Some(pb::TrainingTime {
            ettr: if wall.is_zero() {
                0.0
            } else {
                self.counted.as_secs_f64() / wall.as_secs_f64()
            },
            wall_ms: ms(wall),
            counted_ms: ms(self.counted),
            lost_ms: ms(self.lost),
            recoveries_ms: ms(recoveries.min(self.lost)),
            last_step,
            highest_step: self.highest,
            // Set by the view, which knows the recoveries.
            detection_ms: 0,
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
        assert!(steps.view(t, Duration::ZERO).is_none());
        // Steps 0..=3, 100 ms each.
        for s in 0..4 {
            steps.begun(s, at(t, 100 * s));
        }
        // Step 3 is interrupted; a recovery, then step 3 again at 700 ms, step 4 at 800 ms.
        steps.begun(3, at(t, 700));
        steps.begun(4, at(t, 800));
        let v = steps.view(at(t, 850), Duration::from_millis(350)).unwrap();
        assert_eq!((v.wall_ms, v.counted_ms, v.lost_ms), (850, 400, 400));
        assert_eq!((v.recoveries_ms, v.last_step, v.highest_step), (350, 4, 4));
        assert!((v.ettr - 400.0 / 850.0).abs() < 1e-9);

        // A restart from a checkpoint at step 2: steps 2..=4 are redone, lost; step 5 counts.
        for (i, s) in (2..=5).enumerate() {
            steps.begun(s, at(t, 1_500 + 100 * i as u64));
        }
        steps.begun(6, at(t, 1_900));
        let v = steps.view(at(t, 1_900), Duration::ZERO).unwrap();
        assert_eq!(
            (v.counted_ms, v.lost_ms),
            (400 + 100 + 100, 400 + 700 + 200)
        );
        assert_eq!((v.recoveries_ms, v.highest_step), (0, 6));
        // What recoveries took is never more than what was lost.
        let v = steps.view(at(t, 1_900), Duration::from_secs(60)).unwrap();
        assert_eq!(v.recoveries_ms, v.lost_ms);
    }
}
