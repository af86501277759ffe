//! In-place recovery's SDK pieces that need no coordinator support for `Quorum`: a CPU
//! communicator rebuilt under a new membership epoch (its own key, a working mesh), healing
//! that moves a training state from its source to a healed rank bit for bit, and the quorum
//! client against a stand-in `Rendezvous` service (asked again after DEADLINE_EXCEEDED, the
//! request's epoch, step and released seqs, a refusal). The push that ends a blocked collective
//! is tested inside the crate (`comm/recovery_tests.rs`).

#![allow(clippy::unwrap_used)]

mod support;

use std::{
    pin::Pin,
    sync::{Arc, Mutex},
    time::Duration,
};

use muster::{
    Error,
    checkpoint::{CheckpointState, DataPosition, StateDict, Tensor},
    client::{Coordinator, QuorumAsk, SessionConfig},
    membership::{Heal, Quorum},
    train::SeededRng,
};
use muster_proto::v1::{
    self as pb,
    rendezvous_server::{Rendezvous, RendezvousServer},
};
use support::with_comms;
use tonic::{Request, Response, Status, Streaming};

/// A model whose values depend on `seed`, with several element types.
fn model(seed: f32) -> StateDict {
    let weights: Vec<f32> = (0..1000).map(|i| seed * (i as f32).sin()).collect();
    StateDict::new()
        .with(
            "fc.weight",
            Tensor::from_slice(&[10, 100], &weights).unwrap(),
        )
        .with(
            "fc.bias",
            Tensor::vector(&[f64::from(seed), -0.0, f64::EPSILON]),
        )
        .with("steps", Tensor::scalar(15i64))
}

#[test]
fn a_rebuilt_communicator_heals_a_rank_bit_for_bit() {
    let world = 3u32;
    let results = with_comms("recovery-heal", &[world], move |accelerator, comm| {
        let rank = accelerator.process_index() as u32;
        // Ranks 0 and 1 trained to step 15 alike; rank 2 is a replacement with fresh state.
        let (mut weights, mut position) = if rank < 2 {
            (model(0.37), DataPosition { epoch: 1, step: 7 })
        } else {
            (model(9.0), DataPosition { epoch: 0, step: 0 })
        };
        // Every rank's generator is seeded alike; the trained ranks drew 15 times.
        let mut rng = SeededRng::new(5);
        if rank < 2 {
            for _ in 0..15 {
                rng.next_u64();
            }
        }
        let quorum = Quorum {
            epoch: 1,
            world_size: world,
            step: Some(15),
            heal: vec![Heal { rank: 2, source: 0 }],
            released: (0, 0),
            members: Vec::new(),
        };
        // Healing needs the communicator of the quorum's epoch.
        let mut state = CheckpointState::new();
        state
            .register_model("model", &mut weights)
            .register_data_position("data", &mut position);
        let early = comm.heal(&quorum, &mut state).unwrap_err().to_string();
        assert!(early.contains("reconfigure first"), "{early}");
        drop(state);

        comm.reconfigure(accelerator, &quorum).unwrap();
        assert_eq!(comm.epoch(), 1);
        // The rebuilt mesh publishes under the epoch's key, beside the first one's.
        let generation = accelerator.generation();
        let key = |epoch: &str| format!("muster/comm/{generation}{epoch}/1/{rank}");
        assert!(accelerator.kv().get(&key(".1")).unwrap().is_some());
        assert!(accelerator.kv().get(&key("")).unwrap().is_some());
        // The same quorum again changes nothing.
        comm.reconfigure(accelerator, &quorum).unwrap();

        let mut state = CheckpointState::new();
        state
            .register_model("model", &mut weights)
            .register_data_position("data", &mut position)
            .register_rng("dropout", &mut rng);
        comm.heal(&quorum, &mut state).unwrap();
        drop(state);
        // The healed mesh still reduces.
        let mut sum = [rank as i64 + 1];
        comm.all_reduce(&mut sum, muster::comm::ReduceOp::Sum)
            .unwrap();
        assert_eq!(sum, [6]);
        (weights, position, rng)
    });
    let (source, healed) = (&results[0], &results[2]);
    assert_eq!(healed.0, source.0);
    for (name, tensor) in source.0.iter() {
        assert_eq!(
            healed.0.tensor(name).unwrap().bytes(),
            tensor.bytes(),
            "{name}"
        );
    }
    assert_eq!(healed.1, DataPosition { epoch: 1, step: 7 });
    // The replacement's generator draws on where its source's was, not from its own start.
    assert_eq!(healed.2, source.2);
    assert_ne!(healed.2, SeededRng::new(5));
    assert_eq!(results[1].0, source.0, "rank 1 was not involved");
}

/// A `Rendezvous` whose `Quorum` runs out once (DEADLINE_EXCEEDED), then answers; every
/// request is kept.
#[derive(Default, Clone)]
struct StandIn {
    requests: Arc<Mutex<Vec<pb::QuorumRequest>>>,
}

type Events = Pin<Box<dyn tokio_stream::Stream<Item = Result<pb::NodeEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Rendezvous for StandIn {
    async fn join(
        &self,
        _: Request<pb::JoinRequest>,
    ) -> Result<Response<pb::JoinResponse>, Status> {
        Err(Status::unimplemented("stand-in"))
    }

    async fn report_failure(
        &self,
        _: Request<pb::ReportFailureRequest>,
    ) -> Result<Response<pb::ReportFailureResponse>, Status> {
        Err(Status::unimplemented("stand-in"))
    }

    type WatchStream = Events;

    async fn watch(
        &self,
        _: Request<Streaming<pb::NodeMessage>>,
    ) -> Result<Response<Events>, Status> {
        Err(Status::unimplemented("stand-in"))
    }

    async fn quorum(
        &self,
        request: Request<pb::QuorumRequest>,
    ) -> Result<Response<pb::QuorumResponse>, Status> {
        let request = request.into_inner();
        let count = {
            let mut requests = self.requests.lock().unwrap();
            requests.push(request.clone());
            requests.len()
        };
        if request.job_id == "ended" {
            return Err(Status::failed_precondition(
                "job 'ended' generation 1 failed: rank 2 has no restarts left",
            ));
        }
        if count == 1 {
            return Err(Status::deadline_exceeded(
                "the quorum of epoch 1 has not formed",
            ));
        }
        Ok(Response::new(pb::QuorumResponse {
            epoch: 2,
            world_size: 4,
            step: Some(15),
            heal: vec![pb::Heal {
                rank: Some(3),
                source: Some(0),
            }],
            released_global: 4,
            released_node: 2,
            members: Vec::new(),
        }))
    }
}

#[test]
fn the_quorum_client_asks_again_until_the_quorum_forms() {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .unwrap();
    let service = StandIn::default();
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let served = service.clone();
    runtime.spawn(async move {
        let listener = tokio::net::TcpListener::from_std(listener).unwrap();
        tonic::transport::Server::builder()
            .add_service(RendezvousServer::new(served))
            .serve_with_incoming(tokio_stream::wrappers::TcpListenerStream::new(listener))
            .await
            .unwrap();
    });
    let config = |job: &str| SessionConfig {
        job_id: job.to_owned(),
        generation: 1,
        rank: 3,
        pid: 1,
        host: "h".to_owned(),
    };
    let ask = QuorumAsk {
        epoch: 1,
        step: None,
        released: (0, 0),
    };
    let (quorum, refused) = runtime.block_on(async {
        let coordinator = Coordinator::connect(&addr).await.unwrap();
        let quorum = coordinator
            .quorum(&config("job"), ask, Duration::from_millis(50))
            .await
            .unwrap();
        let survivor = QuorumAsk {
            epoch: 1,
            step: Some(15),
            released: (4, 2),
        };
        let refused = coordinator
            .quorum(&config("ended"), survivor, Duration::from_millis(50))
            .await
            .unwrap_err();
        (quorum, refused)
    });
    assert_eq!(
        quorum,
        Quorum {
            epoch: 2,
            world_size: 4,
            step: Some(15),
            heal: vec![Heal { rank: 3, source: 0 }],
            released: (4, 2),
            members: Vec::new(),
        }
    );
    let requests = service.requests.lock().unwrap().clone();
    assert_eq!(
        requests.len(),
        3,
        "asked twice, then once more: {requests:?}"
    );
    for request in &requests[..2] {
        assert_eq!(
            (
                request.job_id.as_str(),
                request.generation,
                request.rank,
                request.epoch
            ),
            ("job", 1, 3, 1)
        );
        assert_eq!(request.step, None);
        assert_eq!(request.wait_ms, 50);
    }
    let last = &requests[2];
    assert_eq!(
        (last.step, last.released_global, last.released_node),
        (Some(15), 4, 2)
    );
    assert!(
        matches!(&refused, Error::Rpc(status) if status.code() == tonic::Code::FailedPrecondition),
        "{refused:?}"
    );
    assert!(
        refused.to_string().contains("no restarts left"),
        "{refused}"
    );
}
