//! Fuzz target `requests`: arbitrary bytes decoded as `muster.v1` messages and handled the way
//! the coordinator handles them. Unary requests go to the real handlers of one in-process
//! coordinator (in-memory store, paused clock, so long polls time out at once); stream
//! messages (sessions, relays, node watches, agents) and stored job records go through the
//! validation their handlers apply. Errors are expected; a panic is a bug.
//!
//! Input: frames of `[selector: u8][length: u16 LE][payload]`, applied in order to the same
//! coordinator so that one input can create a job and then act on it.
#![no_main]

use libfuzzer_sys::fuzz_target;
use muster_coordinator::config::Config;
use muster_coordinator::job::{Job, JobContext};
use muster_coordinator::service::{Coordinator, OpsService, RendezvousService, ValuesService};
use muster_coordinator::{MemoryStore, Store};
use muster_core::model::{self, JobId, Scope};
use muster_proto::v1 as pb;
use pb::key_value_server::KeyValue;
use pb::ops_server::Ops;
use pb::rendezvous_server::Rendezvous;
use pb::shared_values_server::SharedValues;
use pb::unique_ids_server::UniqueIds;
use prost::Message;
use std::future::Future;
use std::sync::Arc;
use std::time::Duration;
use tonic::{Request, Response, Status};

/// How long (on the paused clock) a call may wait before it is dropped, as a client that
/// goes away would.
const PATIENCE: Duration = Duration::from_millis(50);

async fn call<T>(f: impl Future<Output = Result<Response<T>, Status>>) {
    let _ = tokio::time::timeout(PATIENCE, f).await;
}

fn decode<T: Message + Default>(bytes: &[u8]) -> Option<T> {
    T::decode(bytes).ok()
}

/// Validates a stream message's fields as the stream handlers do.
fn check_stream_message(selector: u8, bytes: &[u8]) {
    match selector {
        0 => {
            let Some(m) = decode::<pb::WorkerMessage>(bytes) else {
                return;
            };
            match m.kind {
                Some(pb::worker_message::Kind::Register(r)) => {
                    let _ = JobId::parse(&r.job_id);
                    let _ = model::generation(r.generation);
                    if !r.host.is_empty() {
                        let _ = model::host("host", &r.host);
                    }
                }
                Some(pb::worker_message::Kind::Barrier(b)) => {
                    let _ = Scope::from_wire(b.scope).map(|s| model::scope_name(s, 0));
                    let _ = model::label("barrier name", &b.name, 512);
                    let _ = model::wait("timeout_ms", b.timeout_ms);
                }
                _ => {}
            }
        }
        1 => {
            let Some(m) = decode::<pb::RelayMessage>(bytes) else {
                return;
            };
            if let Some(pb::relay_message::Kind::Register(r)) = &m.kind {
                let _ = JobId::parse(&r.job_id);
                let _ = model::generation(r.generation);
            }
            if let Some(pb::relay_message::Kind::Enter(e)) = &m.kind {
                for g in &e.groups {
                    let _ = model::label("barrier name", &g.name, 512);
                }
                let _ = model::wait("timeout_ms", e.timeout_ms);
            }
            if let Some(pb::relay_message::Kind::RankLost(l)) = &m.kind {
                let _ = model::label("reason", &l.reason, 4096);
            }
        }
        2 => {
            let Some(m) = decode::<pb::NodeMessage>(bytes) else {
                return;
            };
            if let Some(pb::node_message::Kind::Attach(a)) = m.kind {
                let _ = JobId::parse(&a.job_id);
                let _ = model::generation(a.generation);
                let _ = model::node_id(&a.node_id);
            }
        }
        _ => {
            let Some(m) = decode::<pb::AgentMessage>(bytes) else {
                return;
            };
            let _ = m.encoded_len();
        }
    }
}

/// A job rebuilt from a stored record (what a new leader reads from etcd), then described.
fn restore_record(bytes: &[u8]) {
    let Some(record) = decode::<pb::JobRecord>(bytes) else {
        return;
    };
    // A record names at most a few million ranks (MAX_NODES x MAX_LOCAL_WORLD_SIZE is the
    // validated bound); larger ones only measure the allocator.
    let ranks: u64 = record
        .running
        .iter()
        .flat_map(|g| &g.nodes)
        .map(|n| u64::from(n.local_world_size))
        .sum();
    if ranks > 1 << 16 {
        return;
    }
    let ctx = JobContext {
        incarnation: 1,
        store: None,
        tenure: muster_coordinator::tenure::Tenure::always(),
        heartbeat_timeout: std::time::Duration::from_secs(10),
    };
    if let Ok(job) = Job::restore(&record, 0, &ctx) {
        let _ = job.describe();
        let _ = job.summary();
        let (tx, _rx) = tokio::sync::mpsc::unbounded_channel();
        let _ = job.register(record.generation, 0, 1, "h".into(), tx, Some([1, 1]), None);
        job.retire("fuzz");
    }
}

async fn handle(coordinator: &Arc<Coordinator>, selector: u8, bytes: &[u8]) {
    let rendezvous = RendezvousService(Arc::clone(coordinator));
    let values = ValuesService(Arc::clone(coordinator));
    let ops = OpsService(Arc::clone(coordinator));
    macro_rules! unary {
        ($svc:expr, $method:path, $ty:ty) => {
            if let Some(m) = decode::<$ty>(bytes) {
                call($method(&$svc, Request::new(m))).await;
            }
        };
    }
    match selector % 23 {
        0 => unary!(rendezvous, Rendezvous::join, pb::JoinRequest),
        1 => unary!(
            rendezvous,
            Rendezvous::report_failure,
            pb::ReportFailureRequest
        ),
        2 => unary!(values, KeyValue::set, pb::SetRequest),
        3 => unary!(values, KeyValue::get, pb::GetRequest),
        4 => unary!(values, KeyValue::add, pb::AddRequest),
        5 => unary!(values, KeyValue::compare_and_set, pb::CompareAndSetRequest),
        6 => unary!(values, KeyValue::delete, pb::DeleteRequest),
        7 => unary!(values, KeyValue::list, pb::ListRequest),
        8 => unary!(values, UniqueIds::publish, pb::PublishUniqueIdRequest),
        9 => unary!(values, UniqueIds::fetch, pb::FetchUniqueIdRequest),
        10 => unary!(values, SharedValues::publish, pb::PublishValueRequest),
        11 => unary!(values, SharedValues::fetch, pb::FetchValueRequest),
        12 => unary!(ops, Ops::list_jobs, pb::ListJobsRequest),
        13 => unary!(ops, Ops::describe_job, pb::DescribeJobRequest),
        14 => unary!(ops, Ops::submit_job, pb::SubmitJobRequest),
        15 => unary!(ops, Ops::cancel_job, pb::CancelJobRequest),
        16 => unary!(ops, Ops::list_agents, pb::ListAgentsRequest),
        17 => unary!(ops, Ops::drain_node, pb::DrainNodeRequest),
        18 => unary!(values, UniqueIds::roots, pb::UniqueIdRootsRequest),
        19 => restore_record(bytes),
        s => check_stream_message(s - 20, bytes),
    }
}

fuzz_target!(|data: &[u8]| {
    let Ok(rt) = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .start_paused(true)
        .build()
    else {
        return;
    };
    rt.block_on(async {
        let store: Arc<dyn Store> = Arc::new(MemoryStore::default());
        let config = Config {
            max_value_bytes: 4096,
            max_job_bytes: 1 << 16,
            ..Config::default()
        };
        let coordinator = Coordinator::new(config, store);
        let mut rest = data;
        while let [selector, lo, hi, tail @ ..] = rest {
            let len = usize::from(u16::from_le_bytes([*lo, *hi])).min(tail.len());
            let (payload, next) = tail.split_at(len);
            handle(&coordinator, *selector, payload).await;
            rest = next;
        }
    });
});
