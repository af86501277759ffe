//! The coordinator's durable state lives behind [`Store`], a small key-value interface shaped
//! like etcd's (get, put, create-if-absent, delete, prefix list), so that the etcd
//! implementation ([`EtcdStore`]) can replace [`MemoryStore`] without the rest of the
//! coordinator changing. Only this module knows how state is kept, and only `etcd.rs` knows
//! etcd. Barriers and sessions are deliberately not here: they are ephemeral and their path
//! never waits on a store.
//!
//! Keys written through the trait (by `service.rs`): `jobs/<job>/kv/<key>` (the job's
//! key-value store), `jobs/<job>/gen/<incarnation>-<g>/nccl/<communicator>` (NCCL unique ids) and
//! `jobs/<job>/gen/<incarnation>-<g>/shared/<name>` (shared values); published values are stored as the
//! publisher's rank (4 bytes, little endian) followed by the bytes.

mod etcd;
mod memory;

pub use etcd::EtcdStore;
pub use memory::MemoryStore;

use crate::config::{Config, StoreKind};
use async_trait::async_trait;
use std::sync::Arc;
use std::time::Instant;

/// A failure of the store itself (not of the caller's request): the gRPC handlers answer it
/// with UNAVAILABLE and this message.
#[derive(Debug, thiserror::Error)]
#[error("state store: {0}")]
pub struct StoreError(pub String);

/// What the coordinator needs from a state store. Keys are `/`-separated strings; values are
/// opaque bytes. Implementations must be linearizable per key.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// The etcd store, when this is one: it is durable, and the coordinator runs a leader
    /// election over its client and fences its writes.
    fn as_etcd(&self) -> Option<&EtcdStore> {
        None
    }
    /// Reads a key.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// Writes a key, replacing any value.
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError>;
    /// Writes a key only if it does not exist; returns the existing value otherwise.
    async fn create(&self, key: &str, value: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError>;
    /// Deletes a key; says whether it existed.
    async fn delete(&self, key: &str) -> Result<bool, StoreError>;
    /// Lists the keys under a prefix, in key order.
    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError>;
    /// Deletes every key under a prefix; returns how many went.
    async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError>;
}

/// Opens the store `config` asks for (`--store`): a fresh [`MemoryStore`], or an
/// [`EtcdStore`] once its cluster has answered (a bounded wait; the error names the
/// endpoints). `config` must have passed [`Config::validate`].
pub async fn open(config: &Config) -> Result<Arc<dyn Store>, StoreError> {
    Ok(match config.store {
        StoreKind::Memory => Arc::new(MemoryStore::default()),
        StoreKind::Etcd => Arc::new(EtcdStore::connect(&config.etcd).await?),
    })
}

/// Wraps `inner` so that every operation's latency is recorded in
/// `muster_store_operation_seconds{op}` (see [`crate::metrics`]); [`Store::as_etcd`] still
/// reaches the etcd store underneath.
pub fn timed(inner: Arc<dyn Store>) -> Arc<dyn Store> {
    Arc::new(Timed(inner))
}

/// The store [`timed`] returns.
struct Timed(Arc<dyn Store>);

impl Timed {
    async fn time<T>(&self, op: &'static str, f: impl Future<Output = T>) -> T {
        let start = Instant::now();
        let out = f.await;
        crate::metrics::store_op(op, start.elapsed());
        out
    }
}

#[async_trait]
impl Store for Timed {
    fn as_etcd(&self) -> Option<&EtcdStore> {
        self.0.as_etcd()
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.time("get", self.0.get(key)).await
    }
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.time("put", self.0.put(key, value)).await
    }
    async fn create(&self, key: &str, value: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError> {
        self.time("create", self.0.create(key, value)).await
    }
    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.time("delete", self.0.delete(key)).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        self.time("list", self.0.list(prefix)).await
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        self.time("delete_prefix", self.0.delete_prefix(prefix))
            .await
    }
}
