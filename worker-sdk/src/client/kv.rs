//! The job's key-value store (TCPStore parity) over the coordinator's `KeyValue` service: one
//! typed method per RPC, each a call of [`Coordinator::unary`], and [`KvLane`], the
//! sequential lane whose `set`, `add`, `compare_and_set` and `delete` the coordinator applies
//! at most once, so that they are retried across a failover without being applied twice.

use std::time::Duration;

use muster_proto::v1::{self as pb, key_value_client::KeyValueClient};
use tokio::time::Instant;

use super::{Coordinator, Failed, MAX_MESSAGE_BYTES, wait_ms};
use crate::Error;

/// The outcome of [`Kv::compare_and_set`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CasOutcome {
    /// Whether the value was replaced.
    pub swapped: bool,
    /// The value after the call (`None`: the key does not exist).
    pub current: Option<Vec<u8>>,
}

/// The job's key-value store (TCPStore parity): small coordination data that user code shares
/// between ranks. Every method is a single RPC, cancel-safe, and retried across a coordinator
/// failover within the failover budget: `set`, `get`, `get_wait`, `delete`, `list` and an `add`
/// of 0 on any retryable failure; any other `add` and `compare_and_set`, which are not
/// idempotent, only when the failure proves the request was not applied (a follower refused
/// it, or no connection was made). Otherwise their error surfaces, and the counter or value may
/// or may not have changed: use a [`KvLane`] ([`Kv::lane`]) where that matters.
#[derive(Debug, Clone)]
pub struct Kv {
    coordinator: Coordinator,
    job_id: String,
}

impl Kv {
    /// The store of `job_id` on `coordinator`.
    pub fn new(coordinator: Coordinator, job_id: impl Into<String>) -> Self {
        Self {
            coordinator,
            job_id: job_id.into(),
        }
    }

    /// A new lane for writes that are retried like reads and applied at most once: see
    /// [`KvLane`].
    pub fn lane(&self) -> KvLane {
        KvLane {
            kv: self.clone(),
            client_id: format!("{:032x}", rand::random::<u128>()),
            sequence: 0,
        }
    }

    fn error(&self, failed: Failed, key: &str) -> Error {
        failed.error(|| format!("key '{key}' in job {}", self.job_id))
    }

    /// Sets `key`, replacing any value. Retried across a failover as idempotent: a retry whose
    /// first attempt was applied applies again, overwriting what another rank wrote between
    /// the two (docs/contract.md); where that matters, set on a lane ([`KvLane::set`]).
    pub async fn set(&self, key: &str, value: impl Into<Vec<u8>>) -> Result<(), Error> {
        self.set_on(None, key, value.into()).await
    }

    /// [`Kv::set`], on `lane` if given, which makes a retry of an applied set answer without
    /// applying it again.
    async fn set_on(
        &self,
        lane: Option<(&str, u64)>,
        key: &str,
        value: Vec<u8>,
    ) -> Result<(), Error> {
        let (client_id, sequence) = lane.unwrap_or_default();
        let request = pb::SetRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
            value,
            client_id: client_id.to_owned(),
            sequence,
        };
        self.coordinator
            .unary(
                true,
                || request.clone(),
                |channel, request| async move {
                    KeyValueClient::new(channel)
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .set(request)
                        .await
                },
            )
            .await
            .map_err(|e| self.error(e, key))?;
        Ok(())
    }

    /// The value of `key`, or `None` if it is not set.
    pub async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, Error> {
        let request = pb::GetRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
            wait_ms: 0,
        };
        let response = self
            .coordinator
            .unary(
                true,
                || request.clone(),
                |channel, request| async move {
                    KeyValueClient::new(channel)
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .get(request)
                        .await
                },
            )
            .await;
        match response {
            Ok(response) => Ok(Some(response.value)),
            Err(failed) if failed.status.code() == tonic::Code::NotFound => Ok(None),
            Err(e) => Err(self.error(e, key)),
        }
    }

    /// The value of `key`, waiting up to `wait` for another rank to set it
    /// ([`Error::Timeout`] after). A retry after a failover waits only for what is left.
    pub async fn get_wait(&self, key: &str, wait: Duration) -> Result<Vec<u8>, Error> {
        let started = Instant::now();
        let response = self
            .coordinator
            .unary(
                true,
                || pb::GetRequest {
                    job_id: self.job_id.clone(),
                    key: key.to_owned(),
                    wait_ms: wait_ms(Some(wait.saturating_sub(started.elapsed()))),
                },
                |channel, request| async move {
                    KeyValueClient::new(channel)
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .get(request)
                        .await
                },
            )
            .await
            .map_err(|e| self.error(e, key))?;
        Ok(response.value)
    }

    /// The values of `keys`, in their order, waiting up to `wait` for each to be set (torch's
    /// `multi_get`). The gets run concurrently on the one connection, so the whole call costs
    /// about one round trip, not one per key; the first failure is the answer.
    pub async fn get_wait_many(
        &self,
        keys: &[String],
        wait: Duration,
    ) -> Result<Vec<Vec<u8>>, Error> {
        futures::future::try_join_all(keys.iter().map(|key| self.get_wait(key, wait))).await
    }

    /// Adds `delta` to the counter at `key` (absent counts as 0) and returns the new value.
    /// An add of 0 reads the counter (creating it at 0, as torch's store does), and is retried
    /// like a read: torch polls counters so (its store-based barrier), and applying it twice
    /// changes nothing.
    pub async fn add(&self, key: &str, delta: i64) -> Result<i64, Error> {
        self.add_on(None, key, delta).await
    }

    /// [`Kv::add`], on `lane` (its client id and this call's sequence) if given, which makes
    /// any add safe to retry.
    async fn add_on(&self, lane: Option<(&str, u64)>, key: &str, delta: i64) -> Result<i64, Error> {
        let (client_id, sequence) = lane.unwrap_or_default();
        let request = pb::AddRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
            delta,
            client_id: client_id.to_owned(),
            sequence,
        };
        let response = self
            .coordinator
            .unary(
                delta == 0 || lane.is_some(),
                || request.clone(),
                |channel, request| async move {
                    KeyValueClient::new(channel)
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .add(request)
                        .await
                },
            )
            .await
            .map_err(|e| self.error(e, key))?;
        Ok(response.value)
    }

    /// Sets `key` to `desired` only if its value is `expected` (`None`: only if the key does
    /// not exist), atomically.
    pub async fn compare_and_set(
        &self,
        key: &str,
        expected: Option<&[u8]>,
        desired: impl Into<Vec<u8>>,
    ) -> Result<CasOutcome, Error> {
        self.compare_and_set_on(None, key, expected, desired.into())
            .await
    }

    /// [`Kv::compare_and_set`], on `lane` if given, which makes it safe to retry.
    async fn compare_and_set_on(
        &self,
        lane: Option<(&str, u64)>,
        key: &str,
        expected: Option<&[u8]>,
        desired: Vec<u8>,
    ) -> Result<CasOutcome, Error> {
        let (client_id, sequence) = lane.unwrap_or_default();
        let request = pb::CompareAndSetRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
            expected: expected.map(<[u8]>::to_vec),
            desired,
            client_id: client_id.to_owned(),
            sequence,
        };
        let response = self
            .coordinator
            .unary(
                lane.is_some(),
                || request.clone(),
                |channel, request| async move {
                    KeyValueClient::new(channel)
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .compare_and_set(request)
                        .await
                },
            )
            .await
            .map_err(|e| self.error(e, key))?;
        Ok(CasOutcome {
            swapped: response.swapped,
            current: response.current,
        })
    }

    /// Deletes `key`; says whether it existed. Retried across a failover as idempotent: a
    /// retry whose first attempt was applied says the key did not exist, and deletes what
    /// another rank set between the two; a delete on a lane ([`KvLane::delete`]) does neither.
    pub async fn delete(&self, key: &str) -> Result<bool, Error> {
        self.delete_on(None, key).await
    }

    /// [`Kv::delete`], on `lane` if given.
    async fn delete_on(&self, lane: Option<(&str, u64)>, key: &str) -> Result<bool, Error> {
        let (client_id, sequence) = lane.unwrap_or_default();
        let request = pb::DeleteRequest {
            job_id: self.job_id.clone(),
            key: key.to_owned(),
            client_id: client_id.to_owned(),
            sequence,
        };
        let response = self
            .coordinator
            .unary(
                true,
                || request.clone(),
                |channel, request| async move {
                    KeyValueClient::new(channel)
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .delete(request)
                        .await
                },
            )
            .await
            .map_err(|e| self.error(e, key))?;
        Ok(response.existed)
    }

    /// The keys and values under `prefix`, in key order.
    pub async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, Error> {
        let request = pb::ListRequest {
            job_id: self.job_id.clone(),
            prefix: prefix.to_owned(),
        };
        let response = self
            .coordinator
            .unary(
                true,
                || request.clone(),
                |channel, request| async move {
                    KeyValueClient::new(channel)
                        .max_decoding_message_size(MAX_MESSAGE_BYTES)
                        .list(request)
                        .await
                },
            )
            .await
            .map_err(|failed| {
                failed.error(|| format!("keys under '{prefix}' in job {}", self.job_id))
            })?;
        Ok(response
            .items
            .into_iter()
            .map(|item| (item.key, item.value))
            .collect())
    }
}

/// A lane of writes (`set`, `add`, `compare_and_set`, `delete`) on the job's store that are
/// retried across a coordinator failover like reads, and still applied at most once: each call carries the
/// lane's random 128-bit client id and its own sequence number (the same on every retry), and
/// the coordinator applies each sequence of a lane at most once, answering a retry of an
/// applied call with the first answer (`muster.v1.KvLaneRecord`).
///
/// A lane is sequential (its methods take `&mut self`): the coordinator keeps only the lane's
/// last call, so calls that must run at the same time need lanes of their own. Dropping a
/// call's future gives up its sequence; the next call takes the next one, and the dropped
/// call, if it still arrives, is refused as stale once a later one was applied. The
/// coordinator keeps one small record per lane used until the job is removed: make one lane
/// per long-lived client (a connection), not one per call.
#[derive(Debug)]
pub struct KvLane {
    kv: Kv,
    client_id: String,
    sequence: u64,
}

impl KvLane {
    /// The lane's client id (32 hex digits), as the coordinator's errors name it.
    pub fn client_id(&self) -> &str {
        &self.client_id
    }

    fn next(&mut self) -> u64 {
        self.sequence += 1;
        self.sequence
    }

    /// [`Kv::set`], applied at most once even when its outcome is unknown at first (the leader
    /// died with it in flight) and it is retried on the next leader: a retry of a set that was
    /// applied answers at once, and does not overwrite what another client wrote since.
    pub async fn set(&mut self, key: &str, value: impl Into<Vec<u8>>) -> Result<(), Error> {
        let sequence = self.next();
        self.kv
            .set_on(Some((&self.client_id, sequence)), key, value.into())
            .await
    }

    /// [`Kv::delete`], applied at most once as [`KvLane::set`]: a retry of a delete that was
    /// applied answers whether the key existed then.
    pub async fn delete(&mut self, key: &str) -> Result<bool, Error> {
        let sequence = self.next();
        self.kv
            .delete_on(Some((&self.client_id, sequence)), key)
            .await
    }

    /// [`Kv::add`], applied exactly once even when its outcome is unknown at first (the
    /// leader died with it in flight) and it is retried on the next leader.
    pub async fn add(&mut self, key: &str, delta: i64) -> Result<i64, Error> {
        let sequence = self.next();
        self.kv
            .add_on(Some((&self.client_id, sequence)), key, delta)
            .await
    }

    /// [`Kv::compare_and_set`], applied at most once and retried as [`KvLane::add`]: a retry
    /// of a swap that was applied answers that it swapped.
    pub async fn compare_and_set(
        &mut self,
        key: &str,
        expected: Option<&[u8]>,
        desired: impl Into<Vec<u8>>,
    ) -> Result<CasOutcome, Error> {
        let sequence = self.next();
        self.kv
            .compare_and_set_on(
                Some((&self.client_id, sequence)),
                key,
                expected,
                desired.into(),
            )
            .await
    }
}
