//! The coordinator's durable state lives behind [`Store`], a small key-value interface shaped
//! like etcd's (get, put, create-if-absent, delete, prefix list), so that the etcd
//! implementation ([`EtcdStore`]) can replace [`MemoryStore`] without the rest of the
//! coordinator changing. Only this module knows how state is kept, and only `etcd.rs` and
//! `election.rs` (the leader election over the same etcd) know etcd: the rest of the
//! coordinator asks the store whether it is [`Store::durable`], for its [`Store::election`] and
//! to [`Store::fence`] its writes, and never names the etcd client (`tests/boundaries.rs`
//! checks it). Barriers and sessions are deliberately not here: they are ephemeral and their
//! path never waits on a store.
//!
//! Keys written through the trait (by `service/values.rs`): `jobs/<job>/kv/<key>` (the job's
//! key-value store), `jobs/<job>/applied/<client id>` (a lane's last applied call, a
//! `pb::KvLaneRecord`, written with the value it changed by one [`Store::write_all`]), `jobs/<job>/gen/<incarnation>-<g>/nccl/<communicator>` (NCCL unique ids) and
//! `jobs/<job>/gen/<incarnation>-<g>/shared/<name>` (shared values); published values are stored as the
//! publisher's rank (4 bytes, little endian) followed by the bytes.

pub mod election;
mod etcd;
mod memory;

pub use etcd::EtcdStore;
pub use memory::MemoryStore;

use crate::config::{Config, StoreKind};
use async_trait::async_trait;
use election::{Election, Leadership};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// A failure of the store itself (not of the caller's request): the gRPC handlers answer it
/// with UNAVAILABLE and this message.
#[derive(Debug, thiserror::Error)]
#[error("state store: {0}")]
pub struct StoreError(pub String);

/// What the coordinator needs from a state store. Keys are `/`-separated strings; values are
/// opaque bytes. Implementations must be linearizable per key.
#[async_trait]
pub trait Store: Send + Sync + 'static {
    /// Whether the state outlives this process and is shared with other replicas (etcd): the
    /// coordinator then serves only while it leads ([`Store::election`]) and keeps its jobs'
    /// records here.
    fn durable(&self) -> bool {
        false
    }
    /// The leader election among the replicas sharing this store, with `candidate` (the
    /// address clients reach it at) standing and terms of lease `ttl`; `None` for a store
    /// of one process, where the only replica always leads. Must be called within a tokio
    /// runtime (the election starts observing at once).
    fn election(&self, candidate: &str, ttl: Duration) -> Option<Election> {
        let _ = (candidate, ttl);
        None
    }
    /// Makes every later write conditional on `term` still leading (a write of a replica that
    /// no longer leads changes nothing and fails), or unconditional again with `None`. A store
    /// without an election has nothing to fence.
    fn fence(&self, term: Option<&Leadership>) {
        let _ = term;
    }
    /// Reads a key.
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError>;
    /// Writes a key, replacing any value.
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError>;
    /// Writes several distinct keys (at most [`MAX_WRITE_ALL`]) in one transaction, each a put
    /// (`Some`) or a delete (`None`): all of them or, on any failure, none, under the same
    /// fence as [`Store::put`]. The key-value store writes a value (or deletes it) and its lane
    /// record so, so that a leader's death never leaves the value changed without the record
    /// that makes its retry safe.
    async fn write_all(&self, entries: Vec<(String, Option<Vec<u8>>)>) -> Result<(), StoreError>;
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
/// [`EtcdStore`] once its cluster has answered or has not within a bounded wait
/// ([`EtcdStore::reach`]: what etcd refuses is an error naming the endpoints; silence is a
/// warning, and the replica follows until etcd answers and it is elected). `config` must have
/// passed [`Config::validate`].
pub async fn open(config: &Config) -> Result<Arc<dyn Store>, StoreError> {
    Ok(match config.store {
        StoreKind::Memory => Arc::new(MemoryStore::default()),
        StoreKind::Etcd => {
            let (store, unreached) = EtcdStore::reach(&config.etcd).await?;
            if let Some(why) = unreached {
                tracing::warn!(
                    endpoints = %config.etcd.endpoints.join(","),
                    "etcd does not answer ({why}): serving as a follower that refuses every call as not the leader until etcd answers and this replica is elected"
                );
            }
            Arc::new(store)
        }
    })
}

/// The most keys one [`Store::write_all`] writes: far under etcd's limit on operations in one
/// transaction (`--max-txn-ops`, 128 by default).
pub const MAX_WRITE_ALL: usize = 16;

/// The store operations, by the names [`timed`] reports them under.
pub const OPS: &[&str] = &[
    "get",
    "put",
    "write_all",
    "create",
    "delete",
    "list",
    "delete_prefix",
];

/// Where [`timed`] reports how long an operation (one of [`OPS`]) took: given by the
/// caller (`lib.rs` passes the metrics hook), so that the store depends on no metrics.
pub type OpTimer = fn(op: &'static str, took: Duration);

/// Wraps `inner` so that every operation's latency is reported to `report`; the election and
/// the fence are the store's underneath.
pub fn timed(inner: Arc<dyn Store>, report: OpTimer) -> Arc<dyn Store> {
    Arc::new(Timed { inner, report })
}

/// The store [`timed`] returns.
struct Timed {
    inner: Arc<dyn Store>,
    report: OpTimer,
}

impl Timed {
    async fn time<T>(&self, op: &'static str, f: impl Future<Output = T>) -> T {
        let start = Instant::now();
        let out = f.await;
        (self.report)(op, start.elapsed());
        out
    }
}

#[async_trait]
impl Store for Timed {
    fn durable(&self) -> bool {
        self.inner.durable()
    }
    fn election(&self, candidate: &str, ttl: Duration) -> Option<Election> {
        self.inner.election(candidate, ttl)
    }
    fn fence(&self, term: Option<&Leadership>) {
        self.inner.fence(term);
    }
    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        self.time("get", self.inner.get(key)).await
    }
    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        self.time("put", self.inner.put(key, value)).await
    }
    async fn write_all(&self, entries: Vec<(String, Option<Vec<u8>>)>) -> Result<(), StoreError> {
        self.time("write_all", self.inner.write_all(entries)).await
    }
    async fn create(&self, key: &str, value: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError> {
        self.time("create", self.inner.create(key, value)).await
    }
    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        self.time("delete", self.inner.delete(key)).await
    }
    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        self.time("list", self.inner.list(prefix)).await
    }
    async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        self.time("delete_prefix", self.inner.delete_prefix(prefix))
            .await
    }
}

/// Checks what [`Store::write_all`] is given: between 1 and [`MAX_WRITE_ALL`] keys, no key twice
/// (etcd refuses a transaction that writes one key twice; the memory store would keep the
/// last, so both refuse it alike).
fn check_write_all<V>(entries: &[(String, V)]) -> Result<(), StoreError> {
    if entries.is_empty() || entries.len() > MAX_WRITE_ALL {
        return Err(StoreError(format!(
            "write_all of {} keys: between 1 and {MAX_WRITE_ALL} are allowed",
            entries.len()
        )));
    }
    for (i, (key, _)) in entries.iter().enumerate() {
        if entries[..i].iter().any(|(k, _)| k == key) {
            return Err(StoreError(format!("write_all names the key '{key}' twice")));
        }
    }
    Ok(())
}
