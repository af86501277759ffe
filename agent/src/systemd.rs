//! systemd's service protocol for `muster-agent serve` in a `Type=notify` unit (see
//! deploy/systemd/muster-agent.service): READY=1 once the daemon runs, watchdog pings from its
//! runtime, STOPPING=1 when it shuts down.
//!
//! The notifications themselves are the coordinator's (`muster_coordinator::systemd`); this
//! module decides when the agent sends them. Nothing is sent when the process was not started
//! by systemd. Workers inherit `$NOTIFY_SOCKET`, but the unit keeps `NotifyAccess=main`, so
//! systemd ignores anything they send, and `$WATCHDOG_PID` names the agent, so a worker never
//! believes the watchdog is its own.
//!
//! READY=1 means "the daemon is up and (re)connects to its coordinator on its own", not
//! "registered": an agent whose coordinator is down still starts, and registers once the
//! coordinator answers, as it does outside systemd.

use muster_coordinator::systemd as notify;

/// Call on the agent's runtime when `serve` starts: sends READY=1 with a status naming the
/// coordinator(s), and starts the watchdog task (see
/// [`muster_coordinator::systemd::spawn_watchdog`]) when the unit sets `WatchdogSec=`.
/// Returns the watchdog task, if any; it ends with the runtime.
pub fn serving(coordinator: &str) -> Option<tokio::task::JoinHandle<()>> {
    if !notify::under_systemd() {
        return None;
    }
    let watchdog = notify::spawn_watchdog();
    notify::ready(&format!("serving jobs for coordinator {coordinator}"));
    watchdog
}

/// Call when `serve` has returned (its jobs' workers are stopped): sends STOPPING=1 with the
/// exit status, so systemd shows "deactivating" rather than a watchdog timeout while the
/// runtime winds down.
pub fn stopped(code: u8) {
    notify::stopping(&format!("stopped, exit status {code}"));
}
