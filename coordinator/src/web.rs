//! The live web view (`--web-addr`): a read-only page of jobs, nodes, ranks, pending barriers
//! with who they wait for, failures and restarts, refreshing itself from a JSON view.
//!
//! Three routes over plain HTTP/1: `GET /` is one embedded file (`web/index.html`, HTML and
//! script, no build step), `GET /api/view` the JSON it polls, and `GET /api/stacks?job=ID` a
//! job's grouped stacks (`Ops.DumpStacks`), read when the page's "read stacks" is pressed
//! (each read asks every node's agent to read its workers, so the poll does not). The JSON is built from the
//! Ops handlers' own answers (`ListJobs`, `DescribeJob`, `ListAgents`; their content comes from
//! `job/views.rs`), written in protobuf's JSON mapping with every field present, so the page
//! reads the same field names as `grpcurl` and the `.proto` file, and rank 0 shows as `0`.
//!
//! Exposure is the metrics endpoint's (`--metrics-addr`): off unless an address is given, plain
//! HTTP, no credentials. What it shows is chosen for that: the Ops views hold no token or
//! unique id, and the worker's stderr tail and traceback (which could hold anything a program
//! prints) are left out; `DescribeJob` with a credential still has them. Stacks are frames
//! (function, file, line, and the user's own line of source as the report prints it), never
//! local variables, arguments or the environment: the agents do not read those.

use crate::ha::Gate;
use crate::service::{Coordinator, OpsService};
use axum::http::{StatusCode, header};
use axum::response::IntoResponse;
use muster_proto::v1 as pb;
use pb::ops_server::Ops as _;
use serde_json::{Value, json};
use std::sync::Arc;
use tokio::net::TcpListener;

/// The page: markup, style and script in one file, embedded in the binary.
pub const PAGE: &str = include_str!("web/index.html");

/// The page may run its own inline script and style and fetch from this origin only; it is
/// never framed. Data is put into the page as text (never as markup), so a barrier or job name
/// cannot inject anything either way.
const PAGE_POLICY: &str = "default-src 'none'; script-src 'unsafe-inline'; style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// What the coordinator knows now, for the web view. Reads through the Ops handlers, as
/// `muster-agent status` and the metrics' gauges do, so all three agree.
#[derive(Clone)]
pub struct View {
    coordinator: Arc<Coordinator>,
    gate: Gate,
}

impl View {
    /// A view of `coordinator`, empty while `gate` says this replica does not lead (a
    /// follower's job state is not the cluster's).
    pub fn new(coordinator: Arc<Coordinator>, gate: Gate) -> Self {
        Self { coordinator, gate }
    }

    /// The JSON the page polls: `{"serving", "note", "jobs": [DescribeJobResponse],
    /// "agents": [AgentInfo]}`.
    pub async fn json(&self) -> Value {
        if let Err(status) = self.gate.check() {
            return json!({ "serving": false, "note": status.message(), "jobs": [], "agents": [] });
        }
        let ops = OpsService(Arc::clone(&self.coordinator));
        let summaries = ops
            .list_jobs(tonic::Request::new(pb::ListJobsRequest {}))
            .await
            .map(|r| r.into_inner().jobs)
            .unwrap_or_default();
        let mut jobs = Vec::with_capacity(summaries.len());
        for s in summaries {
            let request = tonic::Request::new(pb::DescribeJobRequest {
                job_id: s.job_id,
                ..Default::default()
            });
            // A job removed between the list and this call is simply not shown.
            let Ok(d) = ops.describe_job(request).await else {
                continue;
            };
            let mut d = d.into_inner();
            for f in d.failure.iter_mut().chain(d.recent_failures.iter_mut()) {
                f.stderr_tail.clear();
                f.error_traceback.clear();
            }
            if let Some(s) = &mut d.summary
                && let Some(at) = s.reason.find(muster_core::failure::LAST_STDERR)
            {
                s.reason.truncate(at);
                s.reason
                    .push_str(" (the worker's stderr is not shown here)");
            }
            jobs.push(to_json("muster.v1.DescribeJobResponse", &d));
        }
        let agents = ops
            .list_agents(tonic::Request::new(pb::ListAgentsRequest {}))
            .await
            .map(|r| r.into_inner().agents)
            .unwrap_or_default();
        let agents: Vec<Value> = agents
            .iter()
            .map(|a| to_json("muster.v1.AgentInfo", a))
            .collect();
        json!({ "serving": true, "note": "", "jobs": jobs, "agents": agents })
    }
}

/// `message` for the page (`muster_proto::json::page`: proto field names, zeros included). A
/// message the descriptors cannot describe becomes `{"error": ...}` rather than failing the
/// whole view.
fn to_json(full_name: &str, message: &impl prost::Message) -> Value {
    muster_proto::json::page(full_name, message)
        .unwrap_or_else(|e| json!({ "error": format!("cannot show {full_name}: {e}") }))
}

/// Serves the page and its JSON on `listener` until the task is dropped or aborted (as the
/// metrics endpoint: `lib.rs` aborts it when serving ends). Only `GET` (and `HEAD`) of the two
/// routes; anything else is 404, or 405 for another method. Cancel-safe.
pub async fn serve(listener: TcpListener, view: View) {
    use axum::routing::get;
    let app = axum::Router::new()
        .route("/", get(page))
        .route("/api/view", get(api))
        .route("/api/stacks", get(stacks))
        .fallback(|| async {
            (
                StatusCode::NOT_FOUND,
                "not found; try /, /api/view or /api/stacks?job=ID\n",
            )
        })
        .with_state(view);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(%e, "the web view stopped serving");
    }
}

async fn page() -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "text/html; charset=utf-8"),
            (header::CACHE_CONTROL, "no-store"),
            (header::CONTENT_SECURITY_POLICY, PAGE_POLICY),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        PAGE,
    )
}

async fn api(axum::extract::State(view): axum::extract::State<View>) -> impl IntoResponse {
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        view.json().await.to_string(),
    )
}

/// `GET /api/stacks?job=ID`: the job's grouped stacks as `DumpStacksResponse` JSON, or
/// `{"error": ...}` naming what went wrong (no such job, no running generation, a follower).
async fn stacks(
    axum::extract::State(view): axum::extract::State<View>,
    uri: axum::http::Uri,
) -> impl IntoResponse {
    let body = view.stacks(uri.query().unwrap_or_default()).await;
    (
        [
            (header::CONTENT_TYPE, "application/json"),
            (header::CACHE_CONTROL, "no-store"),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body.to_string(),
    )
}

impl View {
    /// The stacks of the job a query string (`job=ID`) names.
    pub async fn stacks(&self, query: &str) -> Value {
        if let Err(status) = self.gate.check() {
            return json!({ "error": status.message() });
        }
        let Some(job) = query
            .split('&')
            .find_map(|kv| kv.strip_prefix("job="))
            .filter(|j| !j.is_empty())
        else {
            return json!({ "error": "name the job: /api/stacks?job=ID" });
        };
        let ops = OpsService(Arc::clone(&self.coordinator));
        let request = tonic::Request::new(pb::DumpStacksRequest {
            job_id: job.to_owned(),
            ..Default::default()
        });
        match ops.dump_stacks(request).await {
            Ok(r) => to_json("muster.v1.DumpStacksResponse", &r.into_inner()),
            Err(status) => json!({ "error": status.message() }),
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn zeros_and_enums_are_written_by_name() {
        let rank = pb::RankInfo {
            rank: Some(0),
            node_rank: Some(0),
            state: pb::RankState::Waiting as i32,
            last_seen_ms_ago: 1500,
            activity: "waiting at global barrier #1 'step'".into(),
            ..Default::default()
        };
        let v = to_json("muster.v1.RankInfo", &rank);
        assert_eq!(v["rank"], 0, "{v}");
        assert_eq!(v["node_rank"], 0, "{v}");
        assert_eq!(v["state"], "RANK_STATE_WAITING", "{v}");
        assert_eq!(v["last_seen_ms_ago"], 1500, "{v}");
        assert_eq!(v["activity"], "waiting at global barrier #1 'step'", "{v}");
    }

    #[test]
    fn a_recovery_is_written_with_the_fields_the_page_reads() {
        let r = pb::RecoveryInfo {
            epoch: 1,
            rank: Some(0),
            node_rank: Some(0),
            host: "h".into(),
            reason: "exited with status 9".into(),
            replacement_pid: 42,
            quorum_epoch: 1,
            healed_from: Some(0),
            quorum_ms: 250,
            respawn_ms: 120,
            resumed_ms: 400,
            spare_node_id: "spare-1".into(),
            spare_host: "10.0.0.9".into(),
            detect_ms: 2_000,
            healed_ms: 330,
            full_step_ms: 480,
        };
        let v = to_json("muster.v1.RecoveryInfo", &r);
        assert_eq!(
            (&v["rank"], &v["healed_from"]),
            (&json!(0), &json!(0)),
            "{v}"
        );
        assert_eq!(v["replacement_pid"], 42, "{v}");
        for field in [
            "epoch",
            "node_rank",
            "reason",
            "replacement_pid",
            "quorum_epoch",
            "healed_from",
            "quorum_ms",
            "respawn_ms",
            "resumed_ms",
            "spare_node_id",
            "detect_ms",
            "healed_ms",
            "full_step_ms",
        ] {
            assert!(v.get(field).is_some(), "{field} missing from {v}");
            assert!(
                PAGE.contains(&format!("r.{field}")),
                "the page does not show {field}"
            );
        }
        let d = to_json(
            "muster.v1.DescribeJobResponse",
            &pb::DescribeJobResponse {
                recoveries: vec![r],
                epoch: 1,
                training: Some(pb::TrainingTime {
                    ettr: 0.5,
                    wall_ms: 2_000,
                    last_step: 7,
                    lost_ms: 900,
                    detection_ms: 100,
                    respawn_ms: 200,
                    heal_ms: 300,
                    restarts_ms: 250,
                    ..Default::default()
                }),
                recent_restarts: vec![pb::RestartInfo {
                    failed_generation: 1,
                    generation: 2,
                    reason: "rank 1 exited with status 1".into(),
                    failed_unix_ms: 1,
                    detect_ms: 10,
                    formed_ms: 20,
                    registered_ms: 30,
                    resumed_ms: 40,
                    full_step_ms: 50,
                }],
                ..Default::default()
            },
        );
        // The restarts' timeline, with the fields the page reads.
        for field in [
            "failed_generation",
            "generation",
            "reason",
            "detect_ms",
            "formed_ms",
            "registered_ms",
            "resumed_ms",
            "full_step_ms",
        ] {
            assert!(
                d["recent_restarts"][0].get(field).is_some(),
                "{field} missing from {d}"
            );
            assert!(PAGE.contains(&format!("r.{field}")), "{field}");
        }
        assert_eq!(d["recoveries"][0]["reason"], "exited with status 9", "{d}");
        assert!(PAGE.contains("d.recoveries") && PAGE.contains("d.epoch"));
        // The headline's effective training time reads these fields.
        assert_eq!(
            (&d["training"]["ettr"], &d["training"]["wall_ms"]),
            (&json!(0.5), &json!(2000)),
            "{d}"
        );
        for field in [
            "ettr",
            "wall_ms",
            "last_step",
            "lost_ms",
            "detection_ms",
            "respawn_ms",
            "heal_ms",
            "restarts_ms",
        ] {
            assert!(PAGE.contains(&format!("d.training.{field}")), "{field}");
        }
        // Spares standing by, and the nodes they replaced, with the fields the page reads.
        let d = to_json(
            "muster.v1.DescribeJobResponse",
            &pb::DescribeJobResponse {
                spares: vec![pb::SpareInfo {
                    node_id: "spare-1".into(),
                    host: "10.0.0.9".into(),
                    local_world_size: 2,
                    standing_ms: 1_500,
                    connected: true,
                }],
                max_spares: 1,
                replaced: [("n1".to_owned(), "replaced by spare 'spare-1'".to_owned())].into(),
                ..Default::default()
            },
        );
        assert_eq!(d["max_spares"], 1, "{d}");
        assert_eq!(d["replaced"]["n1"], "replaced by spare 'spare-1'", "{d}");
        for field in [
            "node_id",
            "host",
            "local_world_size",
            "connected",
            "standing_ms",
        ] {
            assert!(
                d["spares"][0].get(field).is_some(),
                "{field} missing from {d}"
            );
            assert!(
                PAGE.contains(&format!("p.{field}")),
                "the page does not show {field}"
            );
        }
        assert!(PAGE.contains("d.spares") && PAGE.contains("d.replaced"));
    }

    /// A follower's job state is not the cluster's: its view is empty and names the leader.
    #[tokio::test]
    async fn a_replica_that_does_not_lead_shows_no_jobs_and_names_the_leader() {
        let coordinator = Coordinator::new(
            crate::Config::default(),
            Arc::new(crate::MemoryStore::default()),
        );
        let gate = Gate::new(
            crate::ha::Readiness::Following(Some("10.1.2.3:29470".into())),
            "127.0.0.1:29470",
        );
        let v = View::new(Arc::clone(&coordinator), gate.clone())
            .json()
            .await;
        assert_eq!(v["serving"], false, "{v}");
        assert!(
            v["note"].as_str().unwrap().contains("10.1.2.3:29470"),
            "{v}"
        );
        assert_eq!(v["jobs"], json!([]), "{v}");
        gate.set(crate::ha::Readiness::Serving);
        let v = View::new(coordinator, gate).json().await;
        assert_eq!(
            (&v["serving"], &v["note"]),
            (&json!(true), &json!("")),
            "{v}"
        );
    }

    /// The stacks route names what is wrong instead of failing: no job named, an unknown job.
    #[tokio::test]
    async fn the_stacks_route_names_a_missing_or_unknown_job() {
        let coordinator = Coordinator::new(
            crate::Config::default(),
            Arc::new(crate::MemoryStore::default()),
        );
        let view = View::new(
            coordinator,
            Gate::new(crate::ha::Readiness::Serving, "127.0.0.1:29470"),
        );
        let v = view.stacks("").await;
        assert_eq!(v["error"], "name the job: /api/stacks?job=ID", "{v}");
        let v = view.stacks("job=nope").await;
        assert!(
            v["error"]
                .as_str()
                .unwrap()
                .contains("job 'nope' not found"),
            "{v}"
        );
        assert!(PAGE.contains("/api/stacks?job=") && PAGE.contains("d.hangs"));
    }

    #[test]
    fn an_unknown_message_is_named_not_fatal() {
        let v = to_json("muster.v1.NoSuchMessage", &pb::RankInfo::default());
        assert!(
            v["error"]
                .as_str()
                .unwrap()
                .contains("descriptor set has no muster.v1.NoSuchMessage"),
            "{v}"
        );
    }
}
