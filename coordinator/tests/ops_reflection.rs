//! The ops API as grpcurl sees it: clients that know nothing of muster's `.proto` discover
//! `muster.v1.Ops` through server reflection (`grpc.reflection.v1`) and call it dynamically:
//! a Rust client with prost-types and raw bytes, and Python's grpcio-reflection from the
//! peers' venv (skipped with a printed reason when absent).
#![allow(clippy::unwrap_used, missing_docs)]

mod common;
#[path = "../../tests/src/peers.rs"]
mod peers;

use common::*;
use muster_proto::v1 as pb;
use prost::Message as _;
use prost::bytes::{Buf as _, BufMut as _};
use prost_types::{FileDescriptorProto, ServiceDescriptorProto};
use tonic::codec::{Codec, DecodeBuf, Decoder, EncodeBuf, Encoder};
use tonic::transport::Channel;
use tonic::{Code, Status};
use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
use tonic_reflection::pb::v1::{ServerReflectionRequest, ServerReflectionResponse};

async fn reflect(ch: &Channel, req: MessageRequest) -> ServerReflectionResponse {
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(req),
    };
    let mut stream = ServerReflectionClient::new(ch.clone())
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    stream.message().await.unwrap().unwrap()
}

/// The decoded file descriptors of the file that defines `symbol` (and what it imports).
async fn files_for(ch: &Channel, symbol: &str) -> Vec<FileDescriptorProto> {
    let r = reflect(ch, MessageRequest::FileContainingSymbol(symbol.into())).await;
    let Some(MessageResponse::FileDescriptorResponse(files)) = r.message_response else {
        panic!("no file for {symbol}: {r:?}");
    };
    files
        .file_descriptor_proto
        .iter()
        .map(|b| FileDescriptorProto::decode(b.as_slice()).unwrap())
        .collect()
}

/// Raw protobuf bytes in and out: a call whose types the client does not compile in.
#[derive(Clone, Copy, Default)]
struct RawCodec;

impl Codec for RawCodec {
    type Encode = Vec<u8>;
    type Decode = Vec<u8>;
    type Encoder = RawCodec;
    type Decoder = RawCodec;
    fn encoder(&mut self) -> Self::Encoder {
        RawCodec
    }
    fn decoder(&mut self) -> Self::Decoder {
        RawCodec
    }
}

impl Encoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;
    fn encode(&mut self, item: Vec<u8>, dst: &mut EncodeBuf<'_>) -> Result<(), Status> {
        dst.put_slice(&item);
        Ok(())
    }
}

impl Decoder for RawCodec {
    type Item = Vec<u8>;
    type Error = Status;
    fn decode(&mut self, src: &mut DecodeBuf<'_>) -> Result<Option<Vec<u8>>, Status> {
        let mut out = vec![0; src.remaining()];
        src.copy_to_slice(&mut out);
        Ok(Some(out))
    }
}

/// Calls `path` with `body` as raw bytes.
async fn raw_call(ch: &Channel, path: &str, body: Vec<u8>) -> Result<Vec<u8>, Status> {
    let mut grpc = tonic::client::Grpc::new(ch.clone());
    grpc.ready().await.unwrap();
    let path = http::uri::PathAndQuery::try_from(path.to_owned()).unwrap();
    grpc.unary(tonic::Request::new(body), path, RawCodec)
        .await
        .map(tonic::Response::into_inner)
}

/// A length-delimited field `number` holding `s`, encoded by hand.
fn string_field(number: i32, s: &str) -> Vec<u8> {
    let mut out = vec![];
    prost::encoding::encode_key(
        u32::try_from(number).unwrap(),
        prost::encoding::WireType::LengthDelimited,
        &mut out,
    );
    prost::encoding::encode_varint(s.len() as u64, &mut out);
    out.extend_from_slice(s.as_bytes());
    out
}

fn field_number(file: &FileDescriptorProto, message: &str, field: &str) -> i32 {
    let m = file
        .message_type
        .iter()
        .find(|m| m.name() == message)
        .unwrap_or_else(|| panic!("message {message} missing"));
    m.field
        .iter()
        .find(|f| f.name() == field)
        .unwrap_or_else(|| panic!("{message}.{field} missing"))
        .number()
}

#[tokio::test]
async fn a_client_discovers_the_ops_api_through_reflection_alone_and_calls_it() {
    let s = start_default().await;
    form(&s.channel, "seen", 1, 2).await;

    let r = reflect(&s.channel, MessageRequest::ListServices(String::new())).await;
    let Some(MessageResponse::ListServicesResponse(list)) = r.message_response else {
        panic!("unexpected {r:?}");
    };
    assert!(list.service.iter().any(|s| s.name == "muster.v1.Ops"));

    let files = files_for(&s.channel, "muster.v1.Ops").await;
    let (file, ops): (&FileDescriptorProto, &ServiceDescriptorProto) = files
        .iter()
        .find_map(|f| f.service.iter().find(|s| s.name() == "Ops").map(|s| (f, s)))
        .expect("a file defines service Ops");
    assert_eq!(file.package(), "muster.v1");
    let method = |name: &str| {
        ops.method
            .iter()
            .find(|m| m.name() == name)
            .unwrap_or_else(|| panic!("Ops.{name} missing"))
    };
    for (name, input, output) in [
        ("ListJobs", "ListJobsRequest", "ListJobsResponse"),
        ("DescribeJob", "DescribeJobRequest", "DescribeJobResponse"),
        ("CancelJob", "CancelJobRequest", "CancelJobResponse"),
        ("DrainNode", "DrainNodeRequest", "DrainNodeResponse"),
        ("ListAgents", "ListAgentsRequest", "ListAgentsResponse"),
        ("DumpStacks", "DumpStacksRequest", "DumpStacksResponse"),
    ] {
        let m = method(name);
        assert_eq!(m.input_type(), format!(".muster.v1.{input}"), "{name}");
        assert_eq!(m.output_type(), format!(".muster.v1.{output}"), "{name}");
    }
    // DrainNode names the node by id or rank (one of them), with a reason.
    let drain = file
        .message_type
        .iter()
        .find(|m| m.name() == "DrainNodeRequest")
        .unwrap();
    let names: Vec<&str> = drain.field.iter().map(|f| f.name()).collect();
    assert_eq!(names, ["job_id", "node_id", "node_rank", "reason"]);
    assert_eq!(drain.oneof_decl.len(), 1);
    // The missing ranks' detail is described too.
    let info = file
        .message_type
        .iter()
        .find(|m| m.name() == "BarrierInfo")
        .unwrap();
    assert!(info.field.iter().any(|f| f.name() == "missing_detail"));

    // A dynamic call: DescribeJob with job_id at the field number reflection gave.
    let job_id = field_number(file, "DescribeJobRequest", "job_id");
    let path = format!(
        "/{}.{}/{}",
        file.package(),
        ops.name(),
        method("DescribeJob").name()
    );
    let body = raw_call(&s.channel, &path, string_field(job_id, "seen"))
        .await
        .unwrap();
    // Checked with the compiled type only as an oracle.
    let d = pb::DescribeJobResponse::decode(body.as_slice()).unwrap();
    assert_eq!(d.summary.unwrap().job_id, "seen");
    assert_eq!(d.ranks.len(), 2);
    // And DrainNode validates what it is sent: an unknown job is NOT_FOUND.
    let drain_job = field_number(file, "DrainNodeRequest", "job_id");
    let drain_path = format!("/muster.v1.Ops/{}", method("DrainNode").name());
    let err = raw_call(&s.channel, &drain_path, string_field(drain_job, "ghost"))
        .await
        .unwrap_err();
    assert_eq!(err.code(), Code::NotFound, "{err:?}");
}

/// The Python side: grpcio-reflection's messages over `grpc.reflection.v1` (the service
/// muster serves; grpcio's own descriptor database speaks only v1alpha), a descriptor pool
/// built from what came back, and dynamic calls of Ops.ListJobs and Ops.DescribeJob.
const PY_CLIENT: &str = r#"
import sys, grpc
from grpc_reflection.v1alpha import reflection_pb2 as rpb
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, json_format

addr, job = sys.argv[1], sys.argv[2]
ch = grpc.insecure_channel(addr)
info = ch.stream_stream(
    "/grpc.reflection.v1.ServerReflection/ServerReflectionInfo",
    request_serializer=rpb.ServerReflectionRequest.SerializeToString,
    response_deserializer=rpb.ServerReflectionResponse.FromString,
)
def ask(**kw):
    return next(iter(info(iter([rpb.ServerReflectionRequest(**kw)]))))

services = [s.name for s in ask(list_services="").list_services_response.service]
print("services:", " ".join(sorted(services)))
assert "muster.v1.Ops" in services, services

protos = {}
for raw in ask(file_containing_symbol="muster.v1.Ops").file_descriptor_response.file_descriptor_proto:
    fd = descriptor_pb2.FileDescriptorProto.FromString(raw)
    protos[fd.name] = fd
pool = descriptor_pool.DescriptorPool()
added = set()
def add(name):
    if name in added:
        return
    fd = protos.get(name)
    if fd is None:
        resp = ask(file_by_filename=name).file_descriptor_response
        for raw in resp.file_descriptor_proto:
            f = descriptor_pb2.FileDescriptorProto.FromString(raw)
            protos.setdefault(f.name, f)
        fd = protos[name]
    for dep in fd.dependency:
        add(dep)
    pool.Add(fd)
    added.add(name)
for name in list(protos):
    add(name)

ops = pool.FindServiceByName("muster.v1.Ops")
print("methods:", " ".join(m.name for m in ops.methods))
def call(method, **fields):
    m = ops.FindMethodByName(method)
    req_t = message_factory.GetMessageClass(m.input_type)
    resp_t = message_factory.GetMessageClass(m.output_type)
    stub = ch.unary_unary(
        "/%s/%s" % (ops.full_name, m.name),
        request_serializer=req_t.SerializeToString,
        response_deserializer=resp_t.FromString,
    )
    return stub(req_t(**fields))

jobs = call("ListJobs")
print("jobs:", " ".join(j.job_id for j in jobs.jobs))
assert job in [j.job_id for j in jobs.jobs]
d = call("DescribeJob", job_id=job)
text = json_format.MessageToJson(d, indent=None)
print("describe:", text)
assert d.summary.job_id == job and len(d.ranks) == 2
# JSON as grpcurl prints it drops zero scalars; ranks are `optional` so that rank 0 and
# node rank 0 still show.
import json
view = json.loads(text)
first = min(view["ranks"], key=lambda r: r.get("rank", -1))
assert first["rank"] == 0 and first["nodeRank"] == 0 and first["localRank"] == 0, first
assert any(n["nodeRank"] == 0 for n in view["nodes"]), view["nodes"]
try:
    call("DrainNode", job_id="ghost", node_rank=0)
    raise SystemExit("DrainNode of an unknown job succeeded")
except grpc.RpcError as e:
    assert e.code() == grpc.StatusCode.NOT_FOUND, e
    print("drain ghost:", e.code().name)
print("ok")
"#;

#[tokio::test]
async fn python_grpcio_reflection_discovers_and_calls_the_ops_api() {
    let Some(python) = peers::peers_python(&["grpc", "grpc_reflection", "google/protobuf"]) else {
        return;
    };
    let s = start_default().await;
    form(&s.channel, "py-seen", 2, 1).await;
    let addr = s.addr.to_string();
    let out = tokio::process::Command::new(&python)
        .args(["-c", PY_CLIENT, &addr, "py-seen"])
        .output()
        .await
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "python client failed: {}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        out.status
    );
    assert!(
        stdout.contains("methods: ") && stdout.contains("DrainNode"),
        "{stdout}"
    );
    assert!(stdout.contains("drain ghost: NOT_FOUND"), "{stdout}");
    assert!(stdout.lines().last() == Some("ok"), "{stdout}");
}
