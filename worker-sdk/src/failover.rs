//! The SDK's side of coordinator failover: the one policy of [`muster_core::failover`]
//! (shared with the agent) under the SDK's names, the budget read from the environment, and
//! the sleeps of a streak of failures on tokio's clock.
//!
//! [`crate::client`] applies the policy to unary calls and to the session stream, for the
//! workers and for the agent (which uses the same client); the rules themselves are tested in
//! `muster-core`.

use std::time::Duration;

use muster_core::failover::{self as policy, Streak};
use tokio::time::Instant;

use crate::Error;

pub(crate) use muster_core::failover::{
    BUDGET_ENV as TIMEOUT_ENV, Census, DEFAULT_BUDGET as DEFAULT_TIMEOUT, Rotation, Verdict,
    classify_call, classify_stream, held_alive, is_local, leader_hint, parse_addrs,
    silence_noticed_within,
};

/// The failover budget from the process environment ([`TIMEOUT_ENV`], else 30 s).
pub(crate) fn timeout_from_env() -> Result<Duration, Error> {
    timeout_from(std::env::var(TIMEOUT_ENV).ok().as_deref())
}

/// The failover budget from [`TIMEOUT_ENV`]'s value, if set: milliseconds, 0 meaning no
/// retries at all.
pub(crate) fn timeout_from(value: Option<&str>) -> Result<Duration, Error> {
    policy::budget_from(value).map_err(|e| Error::Config(e.to_string()))
}

/// One streak of failures, of one call or one re-attach, the SDK's and the agent's alike: the
/// policy's backoff and budget, counted from the first failure (a wait that legitimately
/// lasts long is not cut short by the budget).
#[derive(Debug)]
pub struct Retry {
    streak: Streak,
    started: Instant,
}

impl Retry {
    /// A streak that starts now with `budget`.
    pub fn new(budget: Duration) -> Self {
        Self {
            streak: Streak::new(budget),
            started: Instant::now(),
        }
    }

    /// When the budget runs out.
    pub fn deadline(&self) -> Instant {
        later(self.started, self.streak.budget())
    }

    /// Sleeps before the next attempt; `false` (at once) when the budget is spent. The last
    /// sleep is cut short at the deadline, so one more attempt is made right at it.
    ///
    /// Cancel-safe: dropping it only skips the sleep.
    pub async fn pause(&mut self) -> bool {
        self.pause_until(None).await
    }

    /// [`Retry::pause`], going on past the budget until `held`, if that is later (while every
    /// replica refuses as not the leader: [`crate::client::Coordinator::held_until`]).
    pub async fn pause_until(&mut self, held: Option<Instant>) -> bool {
        let deadline = held.map_or(Duration::ZERO, |h| {
            h.saturating_duration_since(self.started)
        });
        match self.streak.pause_until(self.started.elapsed(), deadline) {
            Some(delay) => {
                tokio::time::sleep(delay).await;
                true
            }
            None => false,
        }
    }

    /// Leaves `held` (up to now) out of the streak's time: the part of an attempt that a
    /// running replica held (a long poll), or that the worker's agent held while it retried
    /// under its own budget, spent none of this client's
    /// ([`crate::client::Coordinator::call_if`]).
    pub fn excluding(&mut self, held: Duration) {
        self.started = later(self.started, held).min(Instant::now());
    }

    /// Time since the first failure.
    pub fn elapsed(&self) -> Duration {
        self.started.elapsed()
    }

    /// The budget this retry runs under.
    pub fn budget(&self) -> Duration {
        self.streak.budget()
    }
}

/// `t + d`, saturating far in the future instead of overflowing.
pub fn later(t: Instant, d: Duration) -> Instant {
    t.checked_add(d)
        .unwrap_or_else(|| t + Duration::from_secs(100 * 365 * 24 * 3600))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timeouts() {
        assert_eq!(timeout_from(None).ok(), Some(DEFAULT_TIMEOUT));
        assert_eq!(
            timeout_from(Some(" 1500 ")).ok(),
            Some(Duration::from_millis(1500))
        );
        assert_eq!(timeout_from(Some("0")).ok(), Some(Duration::ZERO));
        let error = timeout_from(Some("5s")).err().map(|e| e.to_string());
        assert_eq!(
            error.as_deref(),
            Some(
                "bad muster environment: MUSTER_FAILOVER_TIMEOUT_MS=\"5s\" is not a number of \
                 milliseconds: invalid digit found in string"
            )
        );
    }

    // Paused time: the budget passes at once, and exactly, on tokio's clock.
    #[tokio::test(start_paused = true)]
    async fn retries_stop_at_the_budget() {
        let budget = Duration::from_millis(400);
        let mut retry = Retry::new(budget);
        let mut attempts = 0;
        while retry.pause().await {
            attempts += 1;
        }
        let elapsed = retry.elapsed();
        assert!(elapsed >= budget, "gave up after {elapsed:?}");
        assert!(
            elapsed < budget + Duration::from_millis(200),
            "slept past the deadline: {elapsed:?}"
        );
        // 50, 100, 200, 400 ms steps (each x0.5..1.5), the last one cut at the deadline.
        assert!((3..=6).contains(&attempts), "{attempts} attempts");

        let mut none = Retry::new(Duration::ZERO);
        assert!(!none.pause().await, "a zero budget never retries");
    }
}
