//! systemd's service protocol for `Type=notify` units: READY=1, watchdog pings and STOPPING=1.
//!
//! Everything here goes through `$NOTIFY_SOCKET` (sd_notify(3)) and does nothing when the
//! process was not started by systemd (the variable is unset), so the binaries call these
//! functions unconditionally. A failed notification is logged, never fatal: a daemon that
//! serves but cannot tell systemd so is still better than one that exits. When to send what is
//! each daemon's decision (the coordinator's `cli.rs`, the agent's `systemd.rs`).
//!
//! The watchdog pings come from a task on the same tokio runtime as the daemon's work, so a
//! runtime that stops making progress (a blocked worker thread on a current-thread runtime, a
//! deadlock) stops the pings and systemd restarts the service after `WatchdogSec=`.

use sd_notify::NotifyState;
use std::time::Duration;

/// Whether the process runs under a service manager that listens for notifications.
pub fn under_systemd() -> bool {
    std::env::var_os("NOTIFY_SOCKET").is_some_and(|s| !s.is_empty())
}

/// Tells systemd the service is ready (`READY=1`) with a one-line status shown by
/// `systemctl status`.
pub fn ready(status: &str) {
    send(&[NotifyState::Ready, NotifyState::Status(status)]);
}

/// Tells systemd the service is shutting down (`STOPPING=1`), so `systemctl status` says
/// "deactivating" while in-flight work drains.
pub fn stopping(status: &str) {
    send(&[NotifyState::Stopping, NotifyState::Status(status)]);
}

/// How often to ping the watchdog: half of `$WATCHDOG_USEC` (sd_watchdog_enabled(3)
/// recommends pinging at half the interval), or `None` when no watchdog is configured for
/// this process (unset, or `$WATCHDOG_PID` names another process).
pub fn watchdog_interval() -> Option<Duration> {
    sd_notify::watchdog_enabled()
        .filter(|d| !d.is_zero())
        .map(|d| d / 2)
}

/// Spawns task "watchdog" on the current tokio runtime: it sends `WATCHDOG=1` every
/// [`watchdog_interval`] until the runtime ends. Returns `None`, spawning nothing, when no
/// watchdog is configured. Policy: on a failed send, log and keep pinging; on shutdown, it is
/// dropped with the runtime (systemd stops expecting pings once STOPPING=1 is sent and the
/// process exits).
///
/// Must be called from within a tokio runtime.
pub fn spawn_watchdog() -> Option<tokio::task::JoinHandle<()>> {
    let every = watchdog_interval()?;
    tracing::debug!(?every, "systemd watchdog enabled");
    Some(tokio::spawn(async move {
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            send(&[NotifyState::Watchdog]);
        }
    }))
}

/// Sends `states` to `$NOTIFY_SOCKET`; a failure is logged and otherwise ignored.
fn send(states: &[NotifyState<'_>]) {
    if !under_systemd() {
        return;
    }
    if let Err(e) = sd_notify::notify(states) {
        tracing::warn!(error = %e, "cannot notify systemd through $NOTIFY_SOCKET");
    }
}
