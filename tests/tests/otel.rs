//! Traces across processes: a real `muster-coordinator` exporting OTLP to a receiver this test
//! runs, and SDK sessions in the test process exporting to the same receiver. A barrier
//! between two ranks and a key-value call each show up as one trace: the coordinator's span
//! is a child of the worker's, and each side names its service.
#![allow(clippy::unwrap_used, missing_docs)]

use muster::Scope;
use muster::client::{Coordinator, Kv, Session, SessionConfig};
use muster_proto::v1 as pb;
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
    // The receiver.
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let endpoint = format!("http://{}", listener.local_addr().unwrap());
    let receiver = Receiver::default();
    let serving = tonic::transport::Server::builder()
        .add_service(TraceServiceServer::new(receiver.clone()))
        .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener));
    tokio::spawn(serving);

    // The coordinator, exporting to it (default service name, short batch delay).
    let addr = format!("127.0.0.1:{}", muster_tests::free_port());
    let _coordinator = Process(
        Command::new(muster_tests::coordinator_bin())
            .args(["--listen", &addr])
            .env("OTEL_EXPORTER_OTLP_ENDPOINT", &endpoint)
            .env("OTEL_BSP_SCHEDULE_DELAY", "100")
            .env_remove("OTEL_SERVICE_NAME")
            .env_remove("OTEL_SDK_DISABLED")
            .env_remove("OTEL_TRACES_EXPORTER")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );

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
    let deadline = Instant::now() + Duration::from_secs(20);
    let spans = loop {
        let spans = receiver.0.lock().unwrap().clone();
        let named = |service: &str, name: &str| {
            spans
                .iter()
                .filter(|(s, span)| s == service && span.name == name)
                .count()
        };
        if named("muster-coordinator", "barrier") >= 2
            && named("muster-coordinator", "muster.v1.KeyValue/Set") >= 1
            && named("muster-worker", "muster.barrier") >= 2
            && named("muster-worker", "kv_step") >= 1
        {
            break spans;
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
    };

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
