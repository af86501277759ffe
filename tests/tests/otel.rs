//! Traces across processes: a real `muster-coordinator` exporting OTLP to a receiver this test
//! runs, and SDK sessions in the test process exporting to the same receiver. A barrier
//! between two ranks and a key-value call each show up as one trace: the coordinator's span
//! is a child of the worker's, and each side names its service. A barrier that goes through
//! the agents' relays (two `muster-agent launch` processes, whose workers are this test binary
//! run again as [`relayed_worker`]) is one trace too: worker, then agent, then coordinator.
#![allow(clippy::unwrap_used, missing_docs)]

use muster::Scope;
use muster::client::{Coordinator, Kv, Session, SessionConfig};
use muster_proto::v1 as pb;
use muster_tests::{Agent, SLOW};
use opentelemetry::trace::TracerProvider as _;
use opentelemetry_otlp::WithExportConfig as _;
use opentelemetry_proto::tonic::collector::trace::v1::trace_service_server::{
    TraceService, TraceServiceServer,
};
use opentelemetry_proto::tonic::collector::trace::v1::{
    ExportTraceServiceRequest, ExportTraceServiceResponse,
};
use opentelemetry_proto::tonic::common::v1::any_value::Value;
use opentelemetry_proto::tonic::trace::v1::Span;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::Instrument as _;
use tracing_subscriber::Layer as _;
use tracing_subscriber::layer::SubscriberExt as _;
use tracing_subscriber::util::SubscriberInitExt as _;

/// Every span the receiver got, with its resource's `service.name`.
#[derive(Clone, Default)]
struct Receiver(Arc<Mutex<Vec<(String, Span)>>>);

#[tonic::async_trait]
impl TraceService for Receiver {
    async fn export(
        &self,
        request: tonic::Request<ExportTraceServiceRequest>,
    ) -> Result<tonic::Response<ExportTraceServiceResponse>, tonic::Status> {
        let mut spans = self.0.lock().unwrap();
        for resource_spans in request.into_inner().resource_spans {
            let service = resource_spans
                .resource
                .iter()
                .flat_map(|r| &r.attributes)
                .find(|kv| kv.key == "service.name")
                .and_then(|kv| kv.value.as_ref()?.value.as_ref())
                .map_or_else(String::new, |v| match v {
                    Value::StringValue(s) => s.clone(),
                    other => format!("{other:?}"),
                });
            for scope in resource_spans.scope_spans {
                for span in scope.spans {
                    spans.push((service.clone(), span));
                }
            }
        }
        Ok(tonic::Response::new(ExportTraceServiceResponse::default()))
    }
}

/// The coordinator process, killed on drop.
struct Process(Child);

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// The standard variables that would change what a process exports, removed for `cmd`, and
/// the endpoint and a short batch delay set.
fn exporting_to(cmd: &mut Command, endpoint: &str) {
    cmd.env("OTEL_EXPORTER_OTLP_ENDPOINT", endpoint)
        .env("OTEL_BSP_SCHEDULE_DELAY", "100")
        .env_remove("OTEL_SERVICE_NAME")
        .env_remove("OTEL_SDK_DISABLED")
        .env_remove("OTEL_TRACES_EXPORTER");
}

/// Starts the OTLP receiver (on the current runtime); returns its endpoint.
async fn start_receiver() -> (String, Receiver) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let receiver = Receiver::default();
    let serving = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(receiver.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(serving);
    (endpoint, receiver)
}

/// Starts a coordinator process exporting to `endpoint` (default service name); returns it and
/// its address.
fn start_coordinator(endpoint: &str) -> (Process, String) {
    let addr = format!("127.0.0.1:{}", muster_tests::free_port());
    let mut cmd = Command::new(muster_tests::coordinator_bin());
    cmd.args(["--listen", &addr])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::null());
    exporting_to(&mut cmd, endpoint);
    (Process(cmd.spawn().unwrap()), addr)
}

/// How many spans of `service` named `name` are in `spans`.
fn count(spans: &[(String, Span)], service: &str, name: &str) -> usize {
    spans
        .iter()
        .filter(|(s, span)| s == service && span.name == name)
        .count()
}

/// The spans received once `ready` says they are all there; panics listing what came after
/// 20 s.
async fn spans_when(
    receiver: &Receiver,
    ready: impl Fn(&[(String, Span)]) -> bool,
) -> Vec<(String, Span)> {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let spans = receiver.0.lock().unwrap().clone();
        if ready(&spans) {
            return spans;
        }
        assert!(
            Instant::now() < deadline,
            "spans missing; received: {:?}",
            spans
                .iter()
                .map(|(s, span)| format!("{s}/{}", span.name))
                .collect::<Vec<_>>()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn session_config(job: &str, generation: u64, rank: u32) -> SessionConfig {
    SessionConfig {
        job_id: job.to_owned(),
        generation,
        rank,
        pid: std::process::id(),
        host: "127.0.0.1".to_owned(),
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_barrier_and_a_kv_call_are_one_trace_across_processes() {
    // The receiver, and the coordinator exporting to it (default service name, short batch
    // delay).
    let (endpoint, receiver) = start_receiver().await;
    let (_coordinator, addr) = start_coordinator(&endpoint);

    // This process is the workers: its own tracer, exporting to the same receiver.
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_tonic()
        .with_endpoint(&endpoint)
        .build()
        .unwrap();
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder_empty()
                .with_service_name("muster-worker")
                .build(),
        )
        .build();
    let filter = tracing_subscriber::filter::Targets::new()
        .with_target("muster", tracing::Level::TRACE)
        .with_target("otel", tracing::Level::TRACE);
    tracing_subscriber::registry()
        .with(
            tracing_opentelemetry::layer()
                .with_tracer(provider.tracer("otel-test"))
                .with_filter(filter),
        )
        .init();

    // A job of one node with two ranks.
    let connection = connect(&addr).await;
    let mut rendezvous = pb::rendezvous_client::RendezvousClient::new(connection.channel());
    let joined = rendezvous
        .join(pb::JoinRequest {
            job_id: "traced".into(),
            node_id: "node-0".into(),
            host: "127.0.0.1".into(),
            local_world_size: 2,
            requested_node_rank: Some(0),
            config: Some(pb::RendezvousConfig {
                min_nodes: 1,
                max_nodes: 1,
                ..Default::default()
            }),
            request_id: "traced-node-0".into(),
            watches: false,
            spare: false,
        })
        .await
        .unwrap()
        .into_inner();
    let mut ranks = Vec::new();
    for rank in 0..2 {
        let config = session_config("traced", joined.generation, rank);
        let session = Session::attach(&connection, config).await.unwrap();
        ranks.push(tokio::spawn(
            async move {
                session.barrier(Scope::Global, "otel", None).await.unwrap();
                if rank == 0 {
                    Kv::new(session.coordinator().clone(), "traced")
                        .set("k", b"v".to_vec())
                        .instrument(tracing::info_span!("kv_step"))
                        .await
                        .unwrap();
                }
                session.leave().await.unwrap();
            }
            .instrument(tracing::info_span!("rank_step", rank)),
        ));
    }
    for rank in ranks {
        rank.await.unwrap();
    }
    let flush = tokio::task::spawn_blocking(move || provider.shutdown());
    flush.await.unwrap().unwrap();

    // Wait until the coordinator exported its side too.
    let spans = spans_when(&receiver, |spans| {
        count(spans, "muster-coordinator", "barrier") >= 2
            && count(spans, "muster-coordinator", "muster.v1.KeyValue/Set") >= 1
            && count(spans, "muster-worker", "muster.barrier") >= 2
            && count(spans, "muster-worker", "kv_step") >= 1
    })
    .await;

    // Each rank's barrier span is the parent of one coordinator barrier span, in its trace.
    let child_of = |parent: &Span, name: &str| {
        spans.iter().any(|(service, span)| {
            service == "muster-coordinator"
                && span.name == name
                && span.trace_id == parent.trace_id
                && span.parent_span_id == parent.span_id
        })
    };
    let worker_barriers: Vec<&Span> = spans
        .iter()
        .filter(|(s, span)| s == "muster-worker" && span.name == "muster.barrier")
        .map(|(_, span)| span)
        .collect();
    assert_eq!(worker_barriers.len(), 2);
    for parent in &worker_barriers {
        assert!(
            child_of(parent, "barrier"),
            "no coordinator barrier span in trace {} under span {}",
            hex(&parent.trace_id),
            hex(&parent.span_id)
        );
    }
    // The two ranks' barriers are two traces (each rank's own).
    assert_ne!(worker_barriers[0].trace_id, worker_barriers[1].trace_id);
    // The key-value call's server span is a child of the caller's span.
    let (_, kv_step) = spans
        .iter()
        .find(|(s, span)| s == "muster-worker" && span.name == "kv_step")
        .unwrap();
    assert!(
        child_of(kv_step, "muster.v1.KeyValue/Set"),
        "no coordinator KeyValue/Set span under the worker's kv_step span"
    );
}

/// Connects to the coordinator process, waiting for it to listen.
async fn connect(addr: &str) -> Coordinator {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match Coordinator::connect(addr).await {
            Ok(c) => return c,
            Err(e) if Instant::now() > deadline => panic!("coordinator at {addr}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(20)).await,
        }
    }
}

/// Set for the worker processes of [`a_relayed_barrier_is_one_trace_across_processes`]: it
/// turns [`relayed_worker`] from a no-op into a worker.
const WORKER_ENV: &str = "MUSTER_OTEL_TEST_WORKER";
/// How many global barriers each worker enters.
const RELAYED_BARRIERS: usize = 3;

/// Not a test of its own: the worker program of
/// [`a_relayed_barrier_is_one_trace_across_processes`], which runs this test binary under
/// `muster-agent launch` with `--ignored --exact relayed_worker`. It traces as a traced
/// application would (the daemons' OTLP setup from the environment, as `muster-worker`) and
/// enters a few global barriers, which go through its agent's relay.
#[test]
#[ignore = "the worker process of a_relayed_barrier_is_one_trace_across_processes"]
fn relayed_worker() {
    if std::env::var_os(WORKER_ENV).is_none() {
        return;
    }
    let telemetry =
        muster_telemetry::traces::init("muster-worker", tracing_subscriber::EnvFilter::new("warn"));
    assert!(telemetry.exporting(), "the worker does not export spans");
    let accelerator = muster::Accelerator::from_env().unwrap();
    for _ in 0..RELAYED_BARRIERS {
        accelerator.wait_for_everyone().unwrap();
    }
    accelerator.finish().unwrap();
    // Flushes the worker's spans.
    drop(telemetry);
}

/// Two agents of one job, relay on (the default), each with two workers doing global barriers;
/// coordinator, agents and workers all export to this test's receiver. Each barrier a node
/// hands to the coordinator is one trace: the coordinator's span is a child of the agent's
/// `muster.relay.barrier` span, itself a child of a worker's `muster.barrier` span.
#[test]
fn a_relayed_barrier_is_one_trace_across_processes() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let (endpoint, receiver) = runtime.block_on(start_receiver());
    let (_coordinator, addr) = start_coordinator(&endpoint);
    let worker = std::env::current_exe().unwrap();
    let worker = worker.to_str().unwrap();
    let agent = |node: &str, host: &str| {
        let mut cmd = Command::new(muster_tests::agent_bin());
        cmd.args(["launch", "--nproc-per-node", "2", "--nnodes", "2"])
            .args(["--coordinator", &addr, "--job-id", "relay-traced"])
            .args(["--node-rank", node, "--host", host, "--", worker])
            .args(["relayed_worker", "--exact", "--ignored", "--nocapture"])
            .args(["--test-threads", "1"])
            .env(WORKER_ENV, "1");
        exporting_to(&mut cmd, &endpoint);
        Agent::spawn(cmd, format!("muster-agent (node {node})"))
    };
    let nodes = [agent("0", "127.0.0.1"), agent("1", "127.0.0.2")];
    for node in nodes {
        let run = node.finish(SLOW);
        assert_eq!(run.code(), Some(0), "{}", run.dump());
    }

    // One coordinator span per node and barrier, marked as relayed.
    let relayed = |span: &Span| span.attributes.iter().any(|kv| kv.key == "relayed");
    let spans = runtime.block_on(spans_when(&receiver, |spans| {
        let coordinator = spans
            .iter()
            .filter(|(s, span)| s == "muster-coordinator" && span.name == "barrier")
            .filter(|(_, span)| relayed(span))
            .count();
        coordinator >= 2 * RELAYED_BARRIERS
            && count(spans, "muster-agent", "muster.relay.barrier") >= 2 * RELAYED_BARRIERS
            && count(spans, "muster-worker", "muster.barrier") >= 4 * RELAYED_BARRIERS
    }));
    // The span of `service` named `name` with this trace and span id.
    let find = |service: &str, name: &str, trace: &[u8], id: &[u8]| {
        spans
            .iter()
            .find(|(s, span)| {
                s == service && span.name == name && span.trace_id == trace && span.span_id == id
            })
            .map(|(_, span)| span)
    };
    for (_, barrier) in spans
        .iter()
        .filter(|(s, span)| s == "muster-coordinator" && span.name == "barrier" && relayed(span))
    {
        let trace = hex(&barrier.trace_id);
        let relay = find(
            "muster-agent",
            "muster.relay.barrier",
            &barrier.trace_id,
            &barrier.parent_span_id,
        )
        .unwrap_or_else(|| {
            panic!(
                "the coordinator's relayed barrier span in trace {trace} is not a child of an \
                 agent's relay span"
            )
        });
        assert!(
            find(
                "muster-worker",
                "muster.barrier",
                &relay.trace_id,
                &relay.parent_span_id
            )
            .is_some(),
            "the agent's relay span in trace {trace} is not a child of a worker's barrier span"
        );
    }
}
