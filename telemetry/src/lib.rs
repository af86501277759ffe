//! What a muster daemon (the coordinator, the agent) uses to report on itself, shared so that
//! the agent need not link the coordinator for it: logging and OpenTelemetry traces
//! ([`traces`]), Prometheus metric types and the `GET /metrics` endpoint ([`metrics`]), and
//! systemd's readiness and watchdog notifications ([`systemd`]). Which metrics a daemon keeps,
//! and when it is ready, stay with that daemon.

pub mod metrics;
pub mod systemd;
pub mod traces;
