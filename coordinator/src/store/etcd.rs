//! [`EtcdStore`]: the coordinator's state in an etcd v3 cluster (`--store etcd`), so that it
//! survives the coordinator process.
//!
//! What is stored where: every [`Store`] key `k` is the etcd key `<prefix>k`, the prefix being
//! `--etcd-prefix` (default `/muster/`), so several coordinators (or clusters of them) can
//! share one etcd without seeing each other's keys. Values are the bytes the coordinator gives,
//! unchanged (see the parent module for the key layout and value encodings). Nothing else is
//! written: no leases, no metadata keys.
//!
//! How each operation maps onto etcd: `get`/`put`/`delete` are single-key requests (reads are
//! linearizable, etcd's default); `write_all` is one transaction of puts and deletes (all or none);
//! `create` is one transaction (`create_revision(key) == 0` ?
//! put : get), so two coordinators racing on one key agree on one value; `list` and
//! `delete_prefix` are range requests over the prefix. Every request runs under
//! [`OP_TIMEOUT`], and the client keeps HTTP/2 keep-alives, so a dead or partitioned cluster
//! turns into a [`StoreError`] naming the endpoints within seconds instead of a hang (the
//! handlers answer it UNAVAILABLE). Within that bound a request is retried when it never
//! reached etcd (a dead member of a larger cluster) and, for reads, on any UNAVAILABLE: see
//! [`EtcdStore::call`]. The client reconnects by itself, so the store recovers when etcd
//! returns.
//!
//! Fencing: once the coordinator leads (see `election.rs`), [`Store::fence`] makes
//! every write a transaction nested under the leader key's comparison, so a write of a
//! replica that no longer leads (paused past its lease, partitioned) changes nothing and
//! fails with "no longer the leader".

use super::election::{Election, ElectionConfig, Leadership};
use super::{Store, StoreError, check_write_all};
use crate::config::EtcdConfig;
use async_trait::async_trait;
use etcd_client::{
    Certificate, Client, Compare, CompareOp, ConnectOptions, DeleteOptions, GetOptions, Identity,
    KvClient, TlsOptions, Txn, TxnOp, TxnOpResponse, TxnResponse,
};
use std::future::Future;
use std::sync::{PoisonError, RwLock};
use std::time::Duration;

/// Longest wait for one etcd request (connection included).
pub const OP_TIMEOUT: Duration = Duration::from_secs(5);
/// Longest wait for the cluster's first answer when the coordinator starts.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(3);
/// Largest etcd response the store reads: a `list` of a whole job's key-value store (capped by
/// `max_job_bytes`, 64 MiB by default) must fit, with room for keys and framing.
const MAX_RESPONSE_BYTES: usize = 256 << 20;

/// A [`Store`] in etcd under a key prefix. Cheap to share: one client, one HTTP/2 connection
/// per endpoint, balanced.
pub struct EtcdStore {
    client: Client,
    kv: KvClient,
    /// The comparison every write is conditional on while this coordinator leads.
    fence: RwLock<Option<Compare>>,
    prefix: String,
    /// The endpoints as configured, comma-joined: every error names them.
    endpoints: String,
}

impl std::fmt::Debug for EtcdStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EtcdStore")
            .field("endpoints", &self.endpoints)
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

impl EtcdStore {
    /// Connects to the cluster `config` names (TLS and user as configured) and waits up to
    /// [`CONNECT_TIMEOUT`] for it to answer one linearizable read; a cluster that does not
    /// answer is an error. `config` must have passed validation.
    pub async fn connect(config: &EtcdConfig) -> Result<Self, StoreError> {
        let (store, unreached) = Self::reach(config).await?;
        match unreached {
            None => Ok(store),
            Some(why) => Err(StoreError(format!(
                "cannot use etcd at {}: {why}",
                store.endpoints
            ))),
        }
    }

    /// [`EtcdStore::connect`], except that a cluster that does not answer within
    /// [`CONNECT_TIMEOUT`] (down, or not reachable yet) is not an error: the store comes back
    /// with why, and reaches etcd when it answers (the client reconnects by itself). What
    /// etcd refuses (a permission, the prefix) is an error, and so is one that does not answer
    /// with a user configured, since connecting authenticates. The coordinator starts this
    /// way (`store::open`): a replica started during an etcd outage serves as a follower that
    /// refuses every call as not the leader, which completes clients' census of the replicas
    /// (docs/ha.md, "An etcd outage"), instead of exiting and leaving its port refusing
    /// connections (the fault suite's finding 8).
    pub async fn reach(config: &EtcdConfig) -> Result<(Self, Option<String>), StoreError> {
        let endpoints = config.endpoints.join(",");
        let mut options = ConnectOptions::new()
            .with_connect_timeout(CONNECT_TIMEOUT)
            .with_timeout(OP_TIMEOUT)
            .with_keep_alive(Duration::from_secs(5), Duration::from_secs(3))
            .with_keep_alive_while_idle(true);
        if config.tls() {
            options = options.with_tls(tls_options(config)?);
        }
        if let (Some(user), Some(file)) = (&config.user, &config.password_file) {
            let password = std::fs::read_to_string(file).map_err(|e| {
                StoreError(format!(
                    "cannot read the etcd password file {}: {e}",
                    file.display()
                ))
            })?;
            // One line: a trailing newline is the file's, not the password's.
            let password = password.trim_end_matches(['\n', '\r']);
            // Tokens expire (etcd's simple tokens after 5 minutes): authenticate again then.
            options = options
                .with_user(user.clone(), password)
                .with_auto_token_refresh(true);
        }
        // With a user, connecting authenticates, a request like any other: retried while the
        // chosen member is unreachable, within the same bound.
        let deadline = tokio::time::Instant::now() + CONNECT_TIMEOUT;
        let client = loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let failed = match tokio::time::timeout(
                left,
                Client::connect(&config.endpoints, Some(options.clone())),
            )
            .await
            {
                Ok(Ok(client)) => break client,
                Ok(Err(e)) if unavailable(&e) && left > Duration::from_millis(100) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
                Ok(Err(e)) => one_line(&e),
                Err(_) => format!("no answer within {CONNECT_TIMEOUT:?}"),
            };
            return Err(StoreError(format!(
                "cannot connect to etcd at {endpoints}: {failed}"
            )));
        };
        let store = Self {
            client: client.clone(),
            fence: RwLock::new(None),
            kv: client
                .kv_client()
                .max_decoding_message_size(MAX_RESPONSE_BYTES),
            prefix: config.prefix().to_owned(),
            endpoints,
        };
        // A linearizable count of the prefix: answered only by a cluster with a leader. Within
        // what is left of the bound (connecting without a user is lazy and takes no time).
        let deadline = deadline.max(tokio::time::Instant::now() + Duration::from_millis(500));
        let options = GetOptions::new().with_prefix().with_count_only();
        let unreached = loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            let answer = tokio::time::timeout(
                left,
                store
                    .kv
                    .clone()
                    .get(store.prefix.clone(), Some(options.clone())),
            )
            .await;
            match answer {
                Ok(Ok(_)) => break None,
                Ok(Err(e)) if unavailable(&e) && left > Duration::from_millis(100) => {
                    tokio::time::sleep(Duration::from_millis(50)).await;
                }
                Ok(Err(e)) if unreached(&e) => break Some(one_line(&e)),
                Ok(Err(e)) => {
                    return Err(StoreError(format!(
                        "cannot use etcd at {}: {}",
                        store.endpoints,
                        one_line(&e)
                    )));
                }
                Err(_) => break Some(format!("no answer within {CONNECT_TIMEOUT:?}")),
            }
        };
        if unreached.is_none() {
            tracing::info!(endpoints = %store.endpoints, prefix = %store.prefix, "etcd store connected");
        }
        Ok((store, unreached))
    }

    /// The key prefix (`--etcd-prefix`).
    pub fn prefix(&self) -> &str {
        &self.prefix
    }

    /// The etcd client (shared with the leader election, so both use one connection).
    pub fn client(&self) -> Client {
        self.client.clone()
    }

    /// Makes every later write conditional on `fence` (the leader key's comparison of the
    /// current term), or unconditional again with `None`.
    pub fn set_fence(&self, fence: Option<Compare>) {
        *self.fence.write().unwrap_or_else(PoisonError::into_inner) = fence;
    }

    /// Runs the write transaction `inner` under the fence, if one is set, and returns the
    /// inner transaction's response. A failed fence changes nothing and is an error.
    async fn write(&self, op: &str, key: &str, inner: Txn) -> Result<TxnResponse, StoreError> {
        let fence = self
            .fence
            .read()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        let Some(fence) = fence else {
            return self
                .call(op, key, false, |mut kv| {
                    let txn = inner.clone();
                    async move { kv.txn(txn).await }
                })
                .await;
        };
        let outer = Txn::new().when([fence]).and_then([TxnOp::txn(inner)]);
        let r = self
            .call(op, key, false, |mut kv| {
                let txn = outer.clone();
                async move { kv.txn(txn).await }
            })
            .await?;
        if !r.succeeded() {
            return Err(StoreError(format!(
                "etcd {op} '{}{key}' refused: this coordinator is no longer the leader (its leader key changed), so it may not write",
                self.prefix
            )));
        }
        match r.op_responses().into_iter().next() {
            Some(TxnOpResponse::Txn(inner)) => Ok(inner),
            _ => Err(StoreError(format!(
                "etcd {op} '{}{key}' at {}: unexpected transaction response",
                self.prefix, self.endpoints
            ))),
        }
    }

    fn key(&self, key: &str) -> String {
        format!("{}{key}", self.prefix)
    }

    /// Runs one request, retried while that is safe, all within [`OP_TIMEOUT`]; a failure
    /// names the operation, the key and the endpoints.
    ///
    /// Retries: the client balances requests over every endpoint, a dead member's included,
    /// and a request sent there fails at connect. Such a request never reached etcd, so any
    /// operation may be sent again (to another member, chosen anew). A `read` is also retried
    /// on any other UNAVAILABLE answer (no leader, leader changed, a dropped connection):
    /// reading twice changes nothing. A write that may have reached etcd is not retried, the
    /// rule of etcd's own Go client (`isSafeRetryMutableRPC`).
    async fn call<T, F, Fut>(
        &self,
        op: &str,
        key: &str,
        read: bool,
        request: F,
    ) -> Result<T, StoreError>
    where
        F: FnMut(KvClient) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        self.call_within(OP_TIMEOUT, op, key, read, request)
            .await
            .map_err(|e| {
                StoreError(format!(
                    "etcd {op} '{}{key}' failed at {}: {e}",
                    self.prefix, self.endpoints
                ))
            })
    }

    /// [`EtcdStore::call`] within `limit`; the error is the last cause alone.
    async fn call_within<T, F, Fut>(
        &self,
        limit: Duration,
        op: &str,
        key: &str,
        read: bool,
        mut request: F,
    ) -> Result<T, String>
    where
        F: FnMut(KvClient) -> Fut,
        Fut: Future<Output = Result<T, etcd_client::Error>>,
    {
        let deadline = tokio::time::Instant::now() + limit;
        let mut backoff = Duration::from_millis(10);
        let error = loop {
            let left = deadline.saturating_duration_since(tokio::time::Instant::now());
            match tokio::time::timeout(left, request(self.kv.clone())).await {
                Ok(Ok(v)) => return Ok(v),
                Ok(Err(e)) => {
                    let retry = if read {
                        unavailable(&e)
                    } else {
                        never_sent(&e)
                    };
                    let left = deadline.saturating_duration_since(tokio::time::Instant::now());
                    if !retry || left <= backoff {
                        break one_line(&e);
                    }
                    tracing::debug!(op, key, error = %one_line(&e), "etcd request retried");
                    tokio::time::sleep(backoff).await;
                    backoff = (backoff * 2).min(Duration::from_millis(200));
                }
                Err(_) => break format!("no answer within {limit:?}"),
            }
        };
        Err(error)
    }
}

/// How many keys the (single) delete of a write transaction removed.
fn deleted(r: TxnResponse) -> i64 {
    match r.op_responses().into_iter().next() {
        Some(TxnOpResponse::Delete(d)) => d.deleted(),
        _ => 0,
    }
}

/// Whether the request failed before reaching any etcd member (connection refused or not
/// established), so that sending it again cannot apply it twice.
fn never_sent(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            s.code() == tonic::Code::Unavailable
                && (s.message().contains("connect error") || {
                    let mut cause: Option<&dyn std::error::Error> = std::error::Error::source(s);
                    let mut refused = false;
                    while let Some(c) = cause {
                        refused |= c
                            .downcast_ref::<std::io::Error>()
                            .is_some_and(|io| io.kind() == std::io::ErrorKind::ConnectionRefused);
                        cause = c.source();
                    }
                    refused
                })
        }
        _ => false,
    }
}

/// Whether etcd (or the way to it) is unavailable for now, or the request was cut on its
/// way (a member killed under it): worth retrying a read.
fn unavailable(e: &etcd_client::Error) -> bool {
    match e {
        etcd_client::Error::GRpcStatus(s) => {
            matches!(s.code(), tonic::Code::Unavailable | tonic::Code::Cancelled)
        }
        etcd_client::Error::TransportError(_) | etcd_client::Error::IoError(_) => true,
        _ => false,
    }
}

/// Whether an error says that etcd did not answer (nothing listens, no route, a timeout, or a
/// cluster without a leader), rather than that it refused this client (its TLS, its
/// credentials): only the first lets a coordinator start without etcd ([`EtcdStore::reach`]).
fn unreached(e: &etcd_client::Error) -> bool {
    use std::error::Error as _;
    use std::io::ErrorKind;
    let silent = |mut next: Option<&(dyn std::error::Error + 'static)>| {
        while let Some(error) = next {
            if let Some(io) = error.downcast_ref::<std::io::Error>() {
                return matches!(
                    io.kind(),
                    ErrorKind::ConnectionRefused
                        | ErrorKind::TimedOut
                        | ErrorKind::HostUnreachable
                        | ErrorKind::NetworkUnreachable
                );
            }
            if error.to_string().contains("timed out") {
                return true;
            }
            next = error.source();
        }
        false
    };
    match e {
        // Sent by etcd itself ("etcdserver: no leader"), or made by the client from a
        // transport error (which then is its source).
        etcd_client::Error::GRpcStatus(status) if status.code() == tonic::Code::Unavailable => {
            status.source().is_none() || silent(status.source())
        }
        etcd_client::Error::TransportError(t) => silent(Some(t)),
        etcd_client::Error::IoError(io) => silent(Some(io)),
        _ => false,
    }
}

/// One line for an etcd-client error: a gRPC status as its message and its deepest cause
/// (`tcp connect error: Connection refused (os error 111)`), not its debug dump.
fn one_line(e: &etcd_client::Error) -> String {
    let mut text = match e {
        etcd_client::Error::GRpcStatus(s) => {
            let mut text = format!("{:?}: {}", s.code(), s.message());
            let mut cause: Option<&dyn std::error::Error> = std::error::Error::source(s);
            let mut deepest = None;
            while let Some(c) = cause {
                deepest = Some(c);
                cause = c.source();
            }
            if let Some(c) = deepest.map(|c| c.to_string())
                && !text.ends_with(&c)
            {
                text = format!("{text}: {c}");
            }
            text
        }
        other => other.to_string(),
    };
    if let Some(i) = text.find('\n') {
        text.truncate(i);
    }
    text
}

fn tls_options(config: &EtcdConfig) -> Result<TlsOptions, StoreError> {
    let read = |what: &str, path: &std::path::Path| {
        std::fs::read(path).map_err(|e| {
            StoreError(format!(
                "cannot read the etcd {what} {}: {e}",
                path.display()
            ))
        })
    };
    let mut tls = TlsOptions::new();
    if let Some(ca) = &config.ca {
        tls = tls.ca_certificate(Certificate::from_pem(read("CA certificate", ca)?));
    }
    if let (Some(cert), Some(key)) = (&config.cert, &config.key) {
        tls = tls.identity(Identity::from_pem(
            read("client certificate", cert)?,
            read("client key", key)?,
        ));
    }
    Ok(tls)
}

#[async_trait]
impl Store for EtcdStore {
    fn durable(&self) -> bool {
        true
    }

    /// The election under `<prefix>election/`, over this store's client (one connection for
    /// both).
    fn election(&self, candidate: &str, ttl: Duration) -> Option<Election> {
        let config =
            ElectionConfig::new(candidate, format!("{}election/", self.prefix)).with_ttl(ttl);
        Some(Election::new(self.client(), config))
    }

    fn fence(&self, term: Option<&Leadership>) {
        self.set_fence(term.map(Leadership::fence));
    }

    async fn get(&self, key: &str) -> Result<Option<Vec<u8>>, StoreError> {
        let full = self.key(key);
        let mut r = self
            .call("get", key, true, |mut kv| {
                let full = full.clone();
                async move { kv.get(full, None).await }
            })
            .await?;
        Ok(r.take_kvs()
            .into_iter()
            .next()
            .map(|kv| kv.into_key_value().1))
    }

    async fn put(&self, key: &str, value: Vec<u8>) -> Result<(), StoreError> {
        let full = self.key(key);
        let txn = Txn::new().and_then([TxnOp::put(full, value, None)]);
        self.write("put", key, txn).await?;
        Ok(())
    }

    /// One transaction of puts and deletes, nested under the fence like every write: etcd
    /// applies all of it or none, so a leader that dies (or loses its term) mid-call leaves no
    /// key written without the others.
    async fn write_all(&self, entries: Vec<(String, Option<Vec<u8>>)>) -> Result<(), StoreError> {
        check_write_all(&entries)?;
        let first = entries[0].0.clone();
        let ops: Vec<TxnOp> = entries
            .into_iter()
            .map(|(key, value)| match value {
                Some(value) => TxnOp::put(self.key(&key), value, None),
                None => TxnOp::delete(self.key(&key), None),
            })
            .collect();
        self.write("write_all", &first, Txn::new().and_then(ops))
            .await?;
        Ok(())
    }

    async fn create(&self, key: &str, value: Vec<u8>) -> Result<Option<Vec<u8>>, StoreError> {
        let full = self.key(key);
        let txn = Txn::new()
            .when([Compare::create_revision(full.clone(), CompareOp::Equal, 0)])
            .and_then([TxnOp::put(full.clone(), value, None)])
            .or_else([TxnOp::get(full, None)]);
        let r = self.write("create", key, txn).await?;
        if r.succeeded() {
            return Ok(None);
        }
        // The comparison failed, so the key existed when the transaction's get ran.
        match r.op_responses().into_iter().next() {
            Some(TxnOpResponse::Get(mut g)) => match g.take_kvs().into_iter().next() {
                Some(kv) => Ok(Some(kv.into_key_value().1)),
                None => Err(StoreError(format!(
                    "etcd create '{}{key}' at {}: the key existed but its read found nothing",
                    self.prefix, self.endpoints
                ))),
            },
            _ => Err(StoreError(format!(
                "etcd create '{}{key}' at {}: unexpected transaction response",
                self.prefix, self.endpoints
            ))),
        }
    }

    async fn delete(&self, key: &str) -> Result<bool, StoreError> {
        let full = self.key(key);
        let r = self
            .write(
                "delete",
                key,
                Txn::new().and_then([TxnOp::delete(full, None)]),
            )
            .await?;
        Ok(deleted(r) > 0)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<(String, Vec<u8>)>, StoreError> {
        let full = self.key(prefix);
        let mut r = self
            .call("list", prefix, true, |mut kv| {
                let full = full.clone();
                async move { kv.get(full, Some(GetOptions::new().with_prefix())).await }
            })
            .await?;
        // etcd returns a range in key order.
        r.take_kvs()
            .into_iter()
            .map(|kv| {
                let (k, v) = kv.into_key_value();
                let k = k
                    .strip_prefix(self.prefix.as_bytes())
                    .map(<[u8]>::to_vec)
                    .and_then(|k| String::from_utf8(k).ok())
                    .ok_or_else(|| {
                        StoreError(format!(
                            "etcd list '{}{prefix}' at {}: a key under the prefix is not UTF-8",
                            self.prefix, self.endpoints
                        ))
                    })?;
                Ok((k, v))
            })
            .collect()
    }

    async fn delete_prefix(&self, prefix: &str) -> Result<u64, StoreError> {
        let full = self.key(prefix);
        let txn = Txn::new().and_then([TxnOp::delete(
            full,
            Some(DeleteOptions::new().with_prefix()),
        )]);
        let r = self.write("delete_prefix", prefix, txn).await?;
        Ok(u64::try_from(deleted(r)).unwrap_or(0))
    }
}
