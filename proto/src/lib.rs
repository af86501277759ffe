//! muster's wire API: the `muster.v1` messages and services, generated from `proto/` at build
//! time. Clients and servers sit behind the `client` and `server` features so that the worker
//! SDK never compiles server code. Keep this crate slim: no logic beyond what prost generates,
//! except [`security`], what both clients (SDK and agent) must present identically, and
//! [`json`] (feature `json`), the one JSON rendering of wire messages operators read.

/// The `muster.v1` package: messages, `*_client` and `*_server` modules.
#[allow(missing_docs, clippy::all, clippy::pedantic, rust_2018_idioms)]
pub mod v1 {
    tonic::include_proto!("muster.v1");
}

pub mod security;

#[cfg(feature = "json")]
pub mod json;

/// The encoded `FileDescriptorSet` of `muster.v1`, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/muster_v1_descriptor.bin"));

/// The port the coordinator listens on unless told otherwise.
pub const DEFAULT_COORDINATOR_PORT: u16 = 29470;

/// The size of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const NCCL_UNIQUE_ID_BYTES: usize = 128;
