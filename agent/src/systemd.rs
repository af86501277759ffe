//! systemd's service protocol for `muster-agent serve` in a `Type=notify` unit (see
//! deploy/systemd/muster-agent.service): READY=1 once the coordinator accepted the agent's
//! registration, watchdog pings from its runtime from then on, STOPPING=1 when it shuts down.
//!
//! The notifications themselves are shared with the coordinator (`muster_telemetry::systemd`); this
//! module decides when the agent sends them. Nothing is sent when the process was not started
//! by systemd. Workers inherit `$NOTIFY_SOCKET`, but the unit keeps `NotifyAccess=main`, so
//! systemd ignores anything they send, and `$WATCHDOG_PID` names the agent, so a worker never
//! believes the watchdog is its own.
//!
//! READY=1 means "registered": the agent is in its coordinator's pool and can be given jobs,
//! so `systemctl start` (and units ordered after this one) wait until then. An agent whose
//! coordinator is down stays "activating" and keeps retrying, as it does outside systemd,
//! until the unit's `TimeoutStartSec=` runs out. A later re-registration (after a failover)
//! sends nothing: the service stays ready while it reconnects.

use muster_telemetry::systemd as notify;

/// Call on the agent's runtime once the coordinator at `coordinator` has accepted the first
/// registration (its `Agents.Serve` stream is open): sends READY=1 with a status naming it,
/// and starts the watchdog task (see [`muster_telemetry::systemd::spawn_watchdog`]) when
/// the unit sets `WatchdogSec=`. The task ends with the runtime.
pub fn registered(coordinator: &str) {
    if !notify::under_systemd() {
        return;
    }
    notify::ready(&format!("serving jobs for coordinator {coordinator}"));
    let _watchdog = notify::spawn_watchdog();
}

/// Call when `serve` has returned (its jobs' workers are stopped): sends STOPPING=1 with the
/// exit status, so systemd shows "deactivating" rather than a watchdog timeout while the
/// runtime winds down.
pub fn stopped(code: u8) {
    notify::stopping(&format!("stopped, exit status {code}"));
}
