//! What grpcurl relies on: server reflection lists and describes muster's services, and
//! `grpc.health.v1` answers SERVING.
#![allow(clippy::unwrap_used, missing_docs)]

mod common;
use common::*;
use tonic_health::pb::health_client::HealthClient;
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};

async fn reflect(ch: &tonic::transport::Channel, req: MessageRequest) -> ServerReflectionResponse {
    let mut c = ServerReflectionClient::new(ch.clone());
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(req),
    };
    let mut stream = c
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().unwrap()
}

#[tokio::test]
async fn reflection_lists_and_describes_every_service() {
    let s = start_default().await;
    let r = reflect(&s.channel, MessageRequest::ListServices(String::new())).await;
    let Some(MessageResponse::ListServicesResponse(list)) = r.message_response else {
        panic!("unexpected {r:?}");
    };
    let names: Vec<String> = list.service.into_iter().map(|s| s.name).collect();
    for want in [
        "muster.v1.Rendezvous",
        "muster.v1.Session",
        "muster.v1.KeyValue",
        "muster.v1.UniqueIds",
        "muster.v1.SharedValues",
        "muster.v1.Ops",
        "grpc.health.v1.Health",
    ] {
        assert!(
            names.iter().any(|n| n == want),
            "{want} missing from {names:?}"
        );
    }
    // `grpcurl describe muster.v1.Ops` fetches the file that defines the symbol.
    let r = reflect(
        &s.channel,
        MessageRequest::FileContainingSymbol("muster.v1.Ops".into()),
    )
    .await;
    let Some(MessageResponse::FileDescriptorResponse(files)) = r.message_response else {
        panic!("unexpected {r:?}");
    };
    assert!(!files.file_descriptor_proto.is_empty());
}

#[tokio::test]
async fn health_says_serving() {
    let s = start_default().await;
    let mut h = HealthClient::new(s.channel.clone());
    for service in ["", "muster.v1.Session"] {
        let r = h
            .check(tonic_health::pb::HealthCheckRequest {
                service: service.into(),
            })
            .await
            .unwrap()
            .into_inner();
        assert_eq!(
            r.status,
            tonic_health::pb::health_check_response::ServingStatus::Serving as i32,
            "{service:?}"
        );
    }
}
