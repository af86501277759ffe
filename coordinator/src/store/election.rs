//! Leader election among coordinator replicas over etcd v3, with fencing: the groundwork of
//! high availability (issue 5). Only the leader serves; followers name it.
//!
//! # How a replica becomes leader
//!
//! Each replica runs one [`Election`] with its candidate id (the address clients should use,
//! `host:port`) and a key prefix shared by the replicas. While it stands for election (after
//! [`Election::campaign`]) its background task, one *term* at a time:
//!
//! 1. grants an etcd lease of the configured TTL and keeps it alive from a task of its own
//!    (a keep-alive every TTL/3);
//! 2. creates the leader key `<prefix>leader`, holding its candidate id, attached to that lease,
//!    in one transaction that only succeeds if the key is absent (`create_revision == 0`);
//! 3. if another candidate holds the key, follows it ([`Role::Follower`] names it) and watches
//!    the key until it is deleted (its holder resigned, or its lease expired because it died or
//!    stopped answering), then tries again;
//! 4. once it holds the key it is [`Role::Leader`] until it resigns, the key is deleted or
//!    recreated by someone else, or its lease is lost; then it steps down, and starts a new term
//!    with a new lease if it still stands.
//!
//! A watch that fails because its start revision was compacted re-reads the key and watches
//! again from the revision of that read; any other watch failure does the same after a short
//! backoff. A replica that has not been asked to campaign only observes the key, so that
//! [`Election::leader`] still names the leader.
//!
//! # Stepping down at the local lease deadline
//!
//! A leader must stop acting as one *before* anyone else can become leader, even when it
//! cannot reach etcd (network partition, etcd down) or was not running at all (SIGSTOP, a long
//! pause). So the keep-alive task tracks the lease's deadline locally: each keep-alive answered
//! by etcd moves it to *the time that keep-alive was sent* plus the TTL etcd granted. etcd
//! renewed the lease after we sent, so its expiry is never earlier than our deadline, and no
//! other candidate can create the leader key before our deadline passes. The term steps down
//! at the deadline by a local timer, without waiting for etcd to answer anything, and
//! [`Leadership::is_current`] turns false at the same instant. A keep-alive answer with TTL 0
//! (etcd says the lease is gone) steps down at once.
//!
//! # Fencing
//!
//! Stepping down on time is not enough: a leader can be paused between checking that it leads
//! and its write reaching etcd. So every write the leader makes goes through a transaction
//! that also compares the leader key's `create_revision` with the one this leader created it
//! at ([`Leadership::fence`]). That revision is the *fencing token*: it is unique per term
//! (etcd revisions only grow, and a re-created key gets a new one), and it stops matching the
//! moment the key is deleted (lease expiry, resignation) or created by the next leader. A
//! paused old leader that wakes up and writes gets [`ElectionError::NotLeader`] naming the
//! leader, and changes nothing. [`Leadership::put_fenced`] and [`Leadership::txn_fenced`] do
//! this; the etcd store's writes are meant to be conditional on [`Leadership::fence`] too.
//!
//! # What it does not hide
//!
//! - When etcd's own raft leader dies, keep-alives stall until etcd elects another (about its
//!   election timeout, 1 s by default, and more under load). A leader whose lease TTL is not
//!   comfortably above that may step down (and usually win again); the 2 s TTL of the tests
//!   does so now and then, the default 3 s rarely.
//! - etcd-client's balanced channel keeps sending some requests to a member that is down;
//!   they fail with "tcp connect error" before reaching etcd. The election retries exactly
//!   those (within its request timeout); [`Leadership::txn_fenced`] does too, and returns any
//!   other error to its caller, who knows whether the transaction is safe to apply twice.
//!
//! # Tasks
//!
//! `election driver` (one per [`Election`]): campaigns and observes; on an etcd error it logs,
//! reports [`Role::Unknown`] and retries with backoff; it ends (revoking its lease if it leads)
//! when the last [`Election`] handle is dropped. `election keep-alive` (one per term): keeps the
//! term's lease alive and publishes its deadline; aborted when the term ends.

use etcd_client::{
    Client, Compare, CompareOp, ConnectOptions, EventType, KeyValue, LeaseKeepAliveStream,
    LeaseKeeper, PutOptions, Txn, TxnOp, TxnOpResponse, WatchOptions, WatchStream,
};
use std::collections::VecDeque;
use std::fmt;
use std::future::Future;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;
use tokio::sync::watch;
use tokio::time::Instant;
use tokio_util::sync::{CancellationToken, DropGuard};

/// The etcd client crate, re-exported so that users of [`Leadership::fence`] and
/// [`Leadership::txn_fenced`] (the store, tests) name the same types.
pub use etcd_client;

/// The default lease TTL (`--lease-ttl-ms`'s default): a crashed leader is replaced within
/// about this long, and a leader that cannot reach etcd for this long steps down.
pub const DEFAULT_TTL: Duration =
    Duration::from_millis(crate::config::EtcdConfig::DEFAULT_LEASE_TTL_MS);

/// The default limit on one etcd request of the election (grant, campaign, read).
pub const DEFAULT_REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// How an election is run; the same `prefix` for every replica of one coordinator.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    /// This replica's id as the others should name it: the address clients use to reach it.
    pub candidate: String,
    /// The key prefix of this coordinator's state; the leader key is `<prefix>leader`.
    pub prefix: String,
    /// The lease TTL, in whole seconds (rounded up; etcd may raise it to its minimum).
    pub ttl: Duration,
    /// The limit on each etcd request the election makes.
    pub request_timeout: Duration,
}

impl ElectionConfig {
    /// A configuration with the default TTL and request timeout.
    pub fn new(candidate: impl Into<String>, prefix: impl Into<String>) -> Self {
        Self {
            candidate: candidate.into(),
            prefix: prefix.into(),
            ttl: DEFAULT_TTL,
            request_timeout: DEFAULT_REQUEST_TIMEOUT,
        }
    }

    /// The same configuration with lease TTL `ttl`.
    pub fn with_ttl(mut self, ttl: Duration) -> Self {
        self.ttl = ttl;
        self
    }

    /// The leader key: `<prefix>leader`.
    pub fn leader_key(&self) -> String {
        format!("{}leader", self.prefix)
    }

    /// The TTL in whole seconds, as etcd takes it (at least 1).
    fn ttl_secs(&self) -> i64 {
        let secs = self.ttl.as_secs() + u64::from(self.ttl.subsec_nanos() > 0);
        i64::try_from(secs.max(1)).unwrap_or(i64::MAX)
    }
}

/// What this replica is, as far as it knows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// No leader is known: none holds the key, etcd cannot be reached, or this replica just
    /// stepped down. Serve nothing that needs the leader.
    Unknown,
    /// Another candidate leads; its id (address), to name or forward to.
    Follower(String),
    /// This replica leads (its [`Leadership`] comes from [`Election::campaign`]).
    Leader,
}

/// Why a leadership ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LostReason {
    /// The lease deadline passed without a keep-alive answered by etcd (paused process, etcd
    /// unreachable).
    LeaseExpired,
    /// etcd answered a keep-alive saying the lease no longer exists (revoked or expired).
    LeaseRevoked,
    /// The leader key was deleted by someone else.
    KeyDeleted,
    /// The leader key was created again, by the named candidate.
    TakenOver(String),
    /// This replica resigned, or its [`Election`] was dropped.
    Resigned,
}

impl fmt::Display for LostReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::LeaseExpired => write!(f, "the lease deadline passed without a keep-alive"),
            Self::LeaseRevoked => write!(f, "etcd says the lease is gone"),
            Self::KeyDeleted => write!(f, "the leader key was deleted"),
            Self::TakenOver(by) => write!(f, "{by} took over the leader key"),
            Self::Resigned => write!(f, "resigned"),
        }
    }
}

/// Errors of the election and of fenced writes.
#[derive(Debug, thiserror::Error)]
pub enum ElectionError {
    /// This replica does not lead (any more): a fenced write was refused and changed nothing.
    #[error("not the leader{}", match leader {
        Some(l) => format!(" (the leader is {l})"),
        None => " (no leader is known)".to_owned(),
    })]
    NotLeader {
        /// Who leads now, when known.
        leader: Option<String>,
    },
    /// etcd refused or failed a request.
    #[error("etcd: {0}")]
    Etcd(#[from] etcd_client::Error),
    /// etcd did not answer in time.
    #[error("etcd did not answer within {0:?}")]
    Timeout(Duration),
    /// A watch ended or was cancelled by etcd.
    #[error("etcd watch on the leader key ended: {0}")]
    WatchEnded(String),
    /// etcd answered something the election does not expect (or the lease was lost before
    /// the campaign could complete).
    #[error("election: {0}")]
    Unexpected(String),
    /// The election's task has ended (its runtime is shutting down).
    #[error("the election has ended")]
    Closed,
}

/// Who holds the leader key.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Holder {
    id: String,
    create_revision: i64,
    lease: i64,
}

impl Holder {
    fn from_kv(kv: &KeyValue) -> Self {
        Self {
            id: String::from_utf8_lossy(kv.value()).into_owned(),
            create_revision: kv.create_revision(),
            lease: kv.lease(),
        }
    }
}

/// A replica's place in the election of one coordinator. Cloning shares it; the background
/// task ends (and a held leadership is released) when the last clone is dropped.
#[derive(Clone)]
pub struct Election {
    shared: Arc<Shared>,
    role: watch::Receiver<Role>,
    _stop: Arc<DropGuard>,
}

impl fmt::Debug for Election {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Election")
            .field("candidate", &self.shared.config.candidate)
            .field("key", &self.shared.config.leader_key())
            .field("role", &*self.role.borrow())
            .finish()
    }
}

struct Shared {
    client: Client,
    config: ElectionConfig,
    key: Vec<u8>,
    role: watch::Sender<Role>,
    /// Whether this replica stands for election.
    standing: watch::Sender<bool>,
    /// The leadership of the current term while it leads.
    current: Mutex<Option<Leadership>>,
    stop: CancellationToken,
}

impl Shared {
    /// Reads the leader key.
    fn get_key(
        &self,
    ) -> impl Future<Output = Result<etcd_client::GetResponse, etcd_client::Error>> + use<> {
        let mut kv = self.client.kv_client();
        let key = self.key.clone();
        async move { kv.get(key, None).await }
    }

    fn current(&self) -> Option<Leadership> {
        self.current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    fn set_current(&self, leadership: Option<Leadership>) {
        *self.current.lock().unwrap_or_else(PoisonError::into_inner) = leadership;
    }

    /// Publishes who holds the key (as seen by a replica that does not lead).
    fn observe(&self, holder: Option<&Holder>) {
        let role = match holder {
            Some(h) if h.id != self.config.candidate => Role::Follower(h.id.clone()),
            // Our own key from an earlier term: it goes away with that term's lease.
            _ => Role::Unknown,
        };
        self.role.send_if_modified(|r| {
            let changed = *r != role;
            *r = role;
            changed
        });
    }

    /// Runs the etcd request `call` makes, within the request timeout, again while it
    /// fails without having been sent (see [`never_sent`]).
    async fn timed<T, F>(&self, call: impl FnMut() -> F) -> Result<T, ElectionError>
    where
        F: Future<Output = Result<T, etcd_client::Error>>,
    {
        timed(self.config.request_timeout, call).await
    }
}

/// Runs the request `call` makes within `limit`, again (after 20 ms) while it fails without
/// having been sent.
async fn timed<T, F>(limit: Duration, mut call: impl FnMut() -> F) -> Result<T, ElectionError>
where
    F: Future<Output = Result<T, etcd_client::Error>>,
{
    let attempts = async {
        loop {
            match call().await {
                Err(e) if never_sent(&e) => {
                    tracing::debug!(error = %e, "election: etcd request not sent; retrying");
                    tokio::time::sleep(Duration::from_millis(20)).await;
                }
                result => return result,
            }
        }
    };
    tokio::time::timeout(limit, attempts)
        .await
        .map_err(|_| ElectionError::Timeout(limit))?
        .map_err(ElectionError::from)
}

/// Whether a request failed before it reached etcd, so that sending it again cannot apply it
/// twice. etcd-client's balanced channel keeps picking an endpoint whose member is down for
/// some requests, which then fail with "tcp connect error" while other members are fine.
fn never_sent(error: &etcd_client::Error) -> bool {
    match error {
        etcd_client::Error::GRpcStatus(status) => {
            status.code() == tonic::Code::Unavailable && status.message().contains("connect")
        }
        etcd_client::Error::TransportError(_) => true,
        _ => false,
    }
}

impl Election {
    /// Connects to etcd at `endpoints` (`host:port`) with options suited to the election
    /// (requests need an etcd leader, so a partitioned member cannot answer with stale data;
    /// HTTP/2 keep-alives find dead connections) and starts observing.
    pub async fn connect(
        endpoints: &[String],
        config: ElectionConfig,
    ) -> Result<Self, ElectionError> {
        let options = ConnectOptions::new()
            .with_require_leader(true)
            .with_connect_timeout(config.request_timeout)
            .with_keep_alive(Duration::from_secs(1), config.request_timeout)
            .with_keep_alive_while_idle(true);
        let client = Client::connect(endpoints, Some(options)).await?;
        Ok(Self::new(client, config))
    }

    /// Starts observing the leader key over `client` (it does not campaign until
    /// [`Election::campaign`]). Must be called within a tokio runtime.
    pub fn new(client: Client, config: ElectionConfig) -> Self {
        let (role_tx, role) = watch::channel(Role::Unknown);
        let stop = CancellationToken::new();
        let shared = Arc::new(Shared {
            client,
            key: config.leader_key().into_bytes(),
            config,
            role: role_tx,
            standing: watch::channel(false).0,
            current: Mutex::new(None),
            stop: stop.clone(),
        });
        tokio::spawn(drive(Arc::clone(&shared)));
        Self {
            shared,
            role,
            _stop: Arc::new(stop.drop_guard()),
        }
    }

    /// This replica's candidate id.
    pub fn candidate(&self) -> &str {
        &self.shared.config.candidate
    }

    /// Stands for election and resolves when this replica leads. The candidacy stays on
    /// (a lost leadership is campaigned for again) until [`Election::resign`].
    ///
    /// Cancel-safe: dropping the future leaves the candidacy on; the leadership it would have
    /// returned is then available from the next call.
    pub async fn campaign(&self) -> Result<Leadership, ElectionError> {
        self.shared
            .standing
            .send_if_modified(|s| !std::mem::replace(s, true));
        let mut role = self.role.clone();
        loop {
            role.wait_for(|r| *r == Role::Leader)
                .await
                .map_err(|_| ElectionError::Closed)?;
            if let Some(leadership) = self.shared.current().filter(Leadership::is_current) {
                return Ok(leadership);
            }
            // It was lost between the two reads; wait for the next change.
            role.changed().await.map_err(|_| ElectionError::Closed)?;
        }
    }

    /// Stops standing for election; if this replica leads, it steps down at once (its
    /// [`Leadership`] stops being current) and revokes its lease, which deletes the leader
    /// key so that another candidate leads without waiting for the TTL. An error means etcd
    /// could not be told; the lease then expires by itself.
    pub async fn resign(&self) -> Result<(), ElectionError> {
        self.shared.standing.send_replace(false);
        let current = self
            .shared
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let Some(leadership) = current else {
            return Ok(());
        };
        let was_current = leadership.is_current();
        leadership.end(LostReason::Resigned);
        self.shared.role.send_replace(Role::Unknown);
        if !was_current {
            // The term had already ended; its lease is revoked or expiring.
            return Ok(());
        }
        let lease = leadership.inner.lease;
        let client = &self.shared.client;
        let revoke = || {
            let mut leases = client.lease_client();
            async move { leases.revoke(lease).await }
        };
        match self.shared.timed(revoke).await {
            // Gone already (expired, or revoked as the term ended): the key is gone too.
            Err(ElectionError::Etcd(etcd_client::Error::GRpcStatus(status)))
                if status.code() == tonic::Code::NotFound =>
            {
                Ok(())
            }
            result => result.map(drop),
        }
    }

    /// The role as last seen (no etcd request).
    pub fn role(&self) -> Role {
        self.role.borrow().clone()
    }

    /// The role's transitions (Unknown, Follower(leader), Leader), for health reporting and
    /// for followers to know whom to name.
    pub fn roles(&self) -> watch::Receiver<Role> {
        self.role.clone()
    }

    /// The leader's id as last seen, this replica's own when it leads; `None` when unknown.
    pub fn leader(&self) -> Option<String> {
        match &*self.role.borrow() {
            Role::Leader => Some(self.shared.config.candidate.clone()),
            Role::Follower(leader) => Some(leader.clone()),
            Role::Unknown => None,
        }
    }

    /// The leader's id as etcd has it now (one read), `None` when no one holds the key.
    pub async fn current_leader(&self) -> Result<Option<String>, ElectionError> {
        let resp = self.shared.timed(|| self.shared.get_key()).await?;
        Ok(resp.kvs().first().map(|kv| Holder::from_kv(kv).id))
    }

    /// The current leadership, when this replica leads now.
    pub fn leadership(&self) -> Option<Leadership> {
        self.shared.current().filter(Leadership::is_current)
    }
}

/// The outcome of a fenced transaction that passed the fence.
#[derive(Debug, Clone)]
pub struct FencedTxn {
    /// The store's revision after the transaction (its writes' mod revision, if any).
    pub revision: i64,
    /// Whether the caller's own comparisons held (and so its operations ran).
    pub succeeded: bool,
    /// The responses of the caller's operations, in order, when they ran.
    pub responses: Vec<TxnOpResponse>,
}

/// Proof of leading one term, and the way to write under it. Cloning shares it.
#[derive(Clone)]
pub struct Leadership {
    inner: Arc<LeadershipInner>,
}

struct LeadershipInner {
    client: Client,
    key: Vec<u8>,
    candidate: String,
    create_revision: i64,
    lease: i64,
    request_timeout: Duration,
    /// The lease deadline, `None` once etcd said the lease is gone.
    deadline: watch::Receiver<Option<Instant>>,
    lost: CancellationToken,
    reason: Mutex<Option<LostReason>>,
}

impl fmt::Debug for Leadership {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Leadership")
            .field("candidate", &self.inner.candidate)
            .field("create_revision", &self.inner.create_revision)
            .field("lease", &self.inner.lease)
            .field("current", &self.is_current())
            .finish()
    }
}

impl Leadership {
    /// The fencing token: the leader key's create revision in this term.
    pub fn token(&self) -> i64 {
        self.inner.create_revision
    }

    /// The id of the term's etcd lease.
    pub fn lease_id(&self) -> i64 {
        self.inner.lease
    }

    /// Whether this term still leads as far as this replica knows: it has not stepped down
    /// and its lease deadline has not passed. A `true` may be stale by the time a write
    /// reaches etcd; fenced writes do not depend on it.
    pub fn is_current(&self) -> bool {
        !self.inner.lost.is_cancelled()
            && self
                .inner
                .deadline
                .borrow()
                .is_some_and(|d| Instant::now() < d)
    }

    /// Resolves when this term has stepped down, with the reason.
    pub async fn lost(&self) -> LostReason {
        self.inner.lost.cancelled().await;
        self.reason().unwrap_or(LostReason::Resigned)
    }

    /// Why this term ended, when it has.
    pub fn reason(&self) -> Option<LostReason> {
        self.inner
            .reason
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// The comparison that holds only while this term leads: the leader key's create revision
    /// equals [`Leadership::token`]. Add it to every transaction the leader writes with.
    pub fn fence(&self) -> Compare {
        Compare::create_revision(
            self.inner.key.clone(),
            CompareOp::Equal,
            self.inner.create_revision,
        )
    }

    /// Puts `key = value` only if this term still leads; returns the revision of the write.
    pub async fn put_fenced(
        &self,
        key: impl Into<Vec<u8>>,
        value: impl Into<Vec<u8>>,
    ) -> Result<i64, ElectionError> {
        let done = self
            .txn_fenced(Vec::new(), vec![TxnOp::put(key, value, None)])
            .await?;
        Ok(done.revision)
    }

    /// Runs `if compares then ops` only if this term still leads. Fails with
    /// [`ElectionError::NotLeader`], having changed nothing, when the fence does not hold;
    /// refuses without asking etcd when this replica already knows it stepped down.
    pub async fn txn_fenced(
        &self,
        compares: Vec<Compare>,
        ops: Vec<TxnOp>,
    ) -> Result<FencedTxn, ElectionError> {
        if !self.is_current() {
            return Err(ElectionError::NotLeader {
                leader: self.read_leader().await,
            });
        }
        let inner = Txn::new().when(compares).and_then(ops);
        let txn = Txn::new()
            .when([self.fence()])
            .and_then([TxnOp::txn(inner)])
            .or_else([TxnOp::get(self.inner.key.clone(), None)]);
        let resp = timed(self.inner.request_timeout, || {
            let mut kv = self.inner.client.kv_client();
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        })
        .await?;
        let revision = resp.header().map_or(0, |h| h.revision());
        let mut responses = resp.op_responses().into_iter();
        if resp.succeeded() {
            return match responses.next() {
                Some(TxnOpResponse::Txn(inner)) => Ok(FencedTxn {
                    revision,
                    succeeded: inner.succeeded(),
                    responses: inner.op_responses(),
                }),
                _ => Err(ElectionError::Unexpected(
                    "etcd answered a fenced transaction without its inner response".to_owned(),
                )),
            };
        }
        let leader = match responses.next() {
            Some(TxnOpResponse::Get(get)) => get.kvs().first().map(|kv| Holder::from_kv(kv).id),
            _ => None,
        };
        Err(ElectionError::NotLeader { leader })
    }

    /// Who holds the leader key now, for a refusal's message (best effort).
    async fn read_leader(&self) -> Option<String> {
        let get = timed(self.inner.request_timeout, || {
            let mut kv = self.inner.client.kv_client();
            let key = self.inner.key.clone();
            async move { kv.get(key, None).await }
        })
        .await
        .ok()?;
        get.kvs()
            .first()
            .map(|kv| Holder::from_kv(kv).id)
            .filter(|id| *id != self.inner.candidate)
    }

    /// Ends this term locally (the first reason wins).
    fn end(&self, reason: LostReason) {
        {
            let mut slot = self
                .inner
                .reason
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if slot.is_none() {
                *slot = Some(reason);
            }
        }
        self.inner.lost.cancel();
    }
}

/// The `election driver` task: observe while not standing, run terms while standing; on
/// error report Unknown and retry with backoff; ends when the election is dropped.
async fn drive(shared: Arc<Shared>) {
    let mut standing = shared.standing.subscribe();
    let mut backoff = Backoff::default();
    loop {
        if shared.stop.is_cancelled() {
            break;
        }
        let result = if *standing.borrow_and_update() {
            term(&shared, &mut standing).await
        } else {
            observe(&shared, &mut standing).await
        };
        match result {
            Ok(()) => backoff.reset(),
            Err(e) => {
                tracing::warn!(candidate = %shared.config.candidate, error = %e, "election: retrying");
                shared.role.send_replace(Role::Unknown);
                tokio::select! {
                    () = shared.stop.cancelled() => break,
                    () = backoff.wait() => {}
                }
            }
        }
    }
    tracing::debug!(candidate = %shared.config.candidate, "election driver ended");
}

/// Follows the leader key until this replica stands for election or the election ends.
async fn observe(
    shared: &Shared,
    standing: &mut watch::Receiver<bool>,
) -> Result<(), ElectionError> {
    let mut key = KeyWatch::default();
    let holder = key.resync(shared).await?;
    shared.observe(holder.as_ref());
    loop {
        tokio::select! {
            () = shared.stop.cancelled() => return Ok(()),
            _ = standing.changed() => return Ok(()),
            change = key.next(shared) => shared.observe(change?.as_ref()),
        }
    }
}

/// One term: a lease, attempts to create the leader key, following whoever holds it, and
/// leading once created. Ends when the lease is lost, the candidacy withdrawn, a leadership
/// ended, or on an etcd error.
async fn term(shared: &Shared, standing: &mut watch::Receiver<bool>) -> Result<(), ElectionError> {
    let sent = Instant::now();
    let ttl_secs = shared.config.ttl_secs();
    let grant = shared
        .timed(|| {
            let mut leases = shared.client.lease_client();
            async move { leases.grant(ttl_secs, None).await }
        })
        .await?;
    let lease = grant.id();
    let ttl = Duration::from_secs(u64::try_from(grant.ttl()).unwrap_or(1).max(1));
    let (deadline_tx, deadline) = watch::channel(Some(sent + ttl));
    let keeper = tokio::spawn(keep_alive(shared.client.clone(), lease, ttl, deadline_tx));
    let result = run_term(shared, standing, lease, deadline).await;
    keeper.abort();
    // Give the key up now rather than at the lease's expiry (also after a local step-down:
    // revoking a lease etcd already expired is harmless). Best effort, in the background.
    let client = shared.client.clone();
    let limit = shared.config.request_timeout;
    tokio::spawn(async move {
        let revoke = || {
            let mut leases = client.lease_client();
            async move { leases.revoke(lease).await }
        };
        if let Err(e) = timed(limit, revoke).await {
            tracing::debug!(lease, error = %e, "election: could not revoke an ended term's lease");
        }
    });
    result
}

async fn run_term(
    shared: &Shared,
    standing: &mut watch::Receiver<bool>,
    lease: i64,
    mut deadline: watch::Receiver<Option<Instant>>,
) -> Result<(), ElectionError> {
    let mut key = KeyWatch::default();
    loop {
        // Try to create the key; whoever holds it comes back either way.
        let txn = Txn::new()
            .when([Compare::create_revision(
                shared.key.clone(),
                CompareOp::Equal,
                0,
            )])
            .and_then([
                TxnOp::put(
                    shared.key.clone(),
                    shared.config.candidate.clone(),
                    Some(PutOptions::new().with_lease(lease)),
                ),
                TxnOp::get(shared.key.clone(), None),
            ])
            .or_else([TxnOp::get(shared.key.clone(), None)]);
        let create = || {
            let mut kv = shared.client.kv_client();
            let txn = txn.clone();
            async move { kv.txn(txn).await }
        };
        let resp = tokio::select! {
            resp = shared.timed(create) => resp?,
            _ = lease_lost(&mut deadline) => {
                return Err(ElectionError::Unexpected(
                    "the campaign's lease was lost before etcd answered".to_owned(),
                ));
            }
        };
        let revision = resp.header().map_or(0, |h| h.revision());
        let holder = resp.op_responses().into_iter().find_map(|r| match r {
            TxnOpResponse::Get(get) => get.kvs().first().map(Holder::from_kv),
            _ => None,
        });
        key.watch_from(shared, revision + 1).await?;
        // Held with this term's lease: created by this transaction, or by an earlier attempt
        // whose answer was lost.
        let ours = holder.as_ref().is_some_and(|h| h.lease == lease);
        if resp.succeeded() || ours {
            let Some(holder) = holder else {
                return Err(ElectionError::Unexpected(
                    "the leader key vanished right after it was created".to_owned(),
                ));
            };
            return lead(shared, standing, lease, holder, deadline, key).await;
        }
        shared.observe(holder.as_ref());
        // Follow until the key goes away.
        loop {
            tokio::select! {
                () = shared.stop.cancelled() => return Ok(()),
                _ = standing.changed() => {
                    if !*standing.borrow_and_update() {
                        return Ok(());
                    }
                }
                _ = lease_lost(&mut deadline) => {
                    return Err(ElectionError::Unexpected(
                        "the campaign's lease was lost while following".to_owned(),
                    ));
                }
                change = key.next(shared) => match change {
                    Ok(None) => break,
                    Ok(Some(h)) => shared.observe(Some(&h)),
                    Err(e) => {
                        tracing::debug!(error = %e, "election: leader key watch failed; re-reading");
                        shared.role.send_replace(Role::Unknown);
                    }
                },
            }
        }
    }
}

/// Leads until the term ends; always steps down (locally) before returning.
async fn lead(
    shared: &Shared,
    standing: &mut watch::Receiver<bool>,
    lease: i64,
    holder: Holder,
    mut deadline: watch::Receiver<Option<Instant>>,
    mut key: KeyWatch,
) -> Result<(), ElectionError> {
    let leadership = Leadership {
        inner: Arc::new(LeadershipInner {
            client: shared.client.clone(),
            key: shared.key.clone(),
            candidate: shared.config.candidate.clone(),
            create_revision: holder.create_revision,
            lease,
            request_timeout: shared.config.request_timeout,
            deadline: deadline.clone(),
            lost: CancellationToken::new(),
            reason: Mutex::new(None),
        }),
    };
    shared.set_current(Some(leadership.clone()));
    shared.role.send_replace(Role::Leader);
    tracing::info!(candidate = %shared.config.candidate, token = holder.create_revision, "election: leading");
    let reason = loop {
        tokio::select! {
            () = leadership.inner.lost.cancelled() => break LostReason::Resigned,
            () = shared.stop.cancelled() => break LostReason::Resigned,
            _ = standing.changed() => {
                if !*standing.borrow_and_update() {
                    break LostReason::Resigned;
                }
            }
            reason = lease_lost(&mut deadline) => break reason,
            change = key.next(shared) => match change {
                Ok(None) => break LostReason::KeyDeleted,
                Ok(Some(h)) if h.create_revision != holder.create_revision => {
                    break LostReason::TakenOver(h.id);
                }
                Ok(Some(_)) => {}
                Err(e) => tracing::debug!(error = %e, "election: leader key watch failed; re-reading"),
            },
        }
    };
    leadership.end(reason);
    let reason = leadership.reason().unwrap_or(LostReason::Resigned);
    {
        let mut current = shared
            .current
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if current
            .as_ref()
            .is_some_and(|c| Arc::ptr_eq(&c.inner, &leadership.inner))
        {
            *current = None;
        }
    }
    shared.role.send_replace(Role::Unknown);
    tracing::warn!(candidate = %shared.config.candidate, token = holder.create_revision, %reason, "election: stepped down");
    Ok(())
}

/// Resolves when the lease deadline passes (by the local clock) or etcd says the lease is
/// gone. Cancel-safe.
async fn lease_lost(deadline: &mut watch::Receiver<Option<Instant>>) -> LostReason {
    loop {
        let Some(at) = *deadline.borrow_and_update() else {
            return LostReason::LeaseRevoked;
        };
        tokio::select! {
            () = tokio::time::sleep_until(at) => {
                // A keep-alive answer may be waiting; the deadline is what it is now.
                if deadline.borrow().is_some_and(|d| d > at) {
                    continue;
                }
                return LostReason::LeaseExpired;
            }
            changed = deadline.changed() => {
                if changed.is_err() {
                    // The keep-alive task ended: nothing extends the deadline any more.
                    let at = *deadline.borrow();
                    return match at {
                        Some(at) => {
                            tokio::time::sleep_until(at).await;
                            LostReason::LeaseExpired
                        }
                        None => LostReason::LeaseRevoked,
                    };
                }
            }
        }
    }
}

/// The `election keep-alive` task of one term: sends a keep-alive every TTL/3 and moves the
/// deadline to (send time of the answered keep-alive + granted TTL); publishes `None` when
/// etcd says the lease is gone. Runs until aborted by its term.
///
/// A stream whose oldest keep-alive has waited a whole interval may be dead (a connection
/// that stopped answering), so a new stream is opened; but it may only be slow (a loaded
/// etcd answering later than TTL/3 and well within the TTL), so the old stream is kept and
/// its late answers still move the deadline, until the new stream has opened or it ends.
/// Dropping the old one at once stepped a leader down whose keep-alives etcd was renewing
/// all along (`ha_coordinator` failed so in CI once, on a loaded machine).
async fn keep_alive(
    client: Client,
    lease: i64,
    ttl: Duration,
    deadline: watch::Sender<Option<Instant>>,
) {
    let interval = (ttl / 3).max(Duration::from_millis(100));
    let extend = |next: Instant| {
        deadline.send_if_modified(|d| match d {
            Some(d) if *d < next => {
                *d = next;
                true
            }
            _ => false,
        });
    };
    // Opening a stream sends a keep-alive and awaits its answer (etcd-client checks that the
    // lease lives): a stream that opens renewed the lease at the open's send time.
    let open = |after: Duration| {
        let mut leases = client.lease_client();
        Box::pin(async move {
            tokio::time::sleep(after).await;
            let at = Instant::now();
            let opened = tokio::time::timeout(ttl, leases.keep_alive(lease)).await;
            (at, opened.ok().and_then(Result::ok).map(Box::new))
        })
    };
    // Exactly one of `opening` and `current` is set at any time.
    let mut opening = Some(open(Duration::ZERO));
    let mut current: Option<KeepAlives> = None;
    let mut slow: Option<KeepAlives> = None;
    let mut tick = tokio::time::interval(interval);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        let event = tokio::select! {
            (at, opened) = async {
                match opening.as_mut() {
                    Some(open) => open.await,
                    None => std::future::pending().await,
                }
            } => Event::Opened(at, opened),
            _ = tick.tick(), if current.is_some() => Event::Tick,
            answer = KeepAlives::next(&mut current) => Event::Current(answer),
            answer = KeepAlives::next(&mut slow) => Event::Slow(answer),
        };
        match event {
            Event::Opened(at, Some(opened)) => {
                let (keeper, answers) = *opened;
                extend(at + ttl);
                opening = None;
                current = Some(KeepAlives {
                    keeper,
                    answers,
                    unanswered: VecDeque::new(),
                });
                tick.reset();
            }
            Event::Opened(_, None) => opening = Some(open(Duration::from_millis(100))),
            Event::Tick => {
                let Some(stream) = current.as_mut() else {
                    continue;
                };
                if stream.late(interval) {
                    // No answer for a whole interval: open another stream, and keep this
                    // one's late answers.
                    slow = current.take();
                    opening = Some(open(Duration::ZERO));
                } else if !stream.send().await {
                    current = None;
                    opening = Some(open(Duration::from_millis(50)));
                }
            }
            Event::Current(Renewal::Ended) => {
                current = None;
                opening = Some(open(Duration::from_millis(50)));
            }
            Event::Slow(Renewal::Ended) => slow = None,
            Event::Current(answer) | Event::Slow(answer) => match answer {
                Renewal::Until(next) => extend(next),
                Renewal::Gone => {
                    deadline.send_replace(None);
                    return;
                }
                Renewal::Unpaired | Renewal::Ended => {}
            },
        }
    }
}

/// What the keep-alive task's loop waits for.
enum Event {
    /// A stream opened (with the open's send time), or failed to (`None`).
    Opened(Instant, Option<Box<(LeaseKeeper, LeaseKeepAliveStream)>>),
    /// Time for the next keep-alive on the current stream.
    Tick,
    /// An answer on the current stream.
    Current(Renewal),
    /// An answer on the stream left for being slow.
    Slow(Renewal),
}

/// What one answer on a keep-alive stream says.
#[derive(Debug, PartialEq, Eq)]
enum Renewal {
    /// The lease is renewed until then (the keep-alive's send time plus the granted TTL).
    Until(Instant),
    /// etcd says the lease is gone.
    Gone,
    /// An answer to no keep-alive this task sent (ignored).
    Unpaired,
    /// The stream ended or failed.
    Ended,
}

/// One keep-alive stream and the send times of its keep-alives not answered yet, oldest
/// first (etcd answers a stream's keep-alives in order).
struct KeepAlives {
    keeper: LeaseKeeper,
    answers: LeaseKeepAliveStream,
    unanswered: VecDeque<Instant>,
}

impl KeepAlives {
    /// Whether the oldest unanswered keep-alive has waited `interval` or more.
    fn late(&self, interval: Duration) -> bool {
        self.unanswered
            .front()
            .is_some_and(|sent| sent.elapsed() >= interval)
    }

    /// Sends a keep-alive; `false` if the stream is closed.
    async fn send(&mut self) -> bool {
        self.unanswered.push_back(Instant::now());
        self.keeper.keep_alive().await.is_ok()
    }

    /// The next answer of `stream`; never, without a stream.
    async fn next(stream: &mut Option<Self>) -> Renewal {
        let Some(stream) = stream else {
            return std::future::pending().await;
        };
        match stream.answers.message().await {
            Ok(Some(answer)) => renewal(&mut stream.unanswered, answer.ttl()),
            Ok(None) | Err(_) => Renewal::Ended,
        }
    }
}

/// What an answer granting `ttl_secs` says, given the send times of the keep-alives it may
/// answer (the oldest is answered and removed).
fn renewal(unanswered: &mut VecDeque<Instant>, ttl_secs: i64) -> Renewal {
    if ttl_secs <= 0 {
        return Renewal::Gone;
    }
    match unanswered.pop_front() {
        Some(sent) => Renewal::Until(sent + Duration::from_secs(ttl_secs.unsigned_abs())),
        None => Renewal::Unpaired,
    }
}

/// A watch on the leader key that survives compaction and broken streams by re-reading the
/// key and watching again after the read.
#[derive(Default)]
struct KeyWatch {
    stream: Option<WatchStream>,
    failures: u32,
}

impl KeyWatch {
    /// Reads the key and watches it from just after that read; returns who holds it.
    async fn resync(&mut self, shared: &Shared) -> Result<Option<Holder>, ElectionError> {
        self.stream = None;
        if self.failures > 0 {
            // Short: with several etcd members, the next try usually reaches a live one.
            let wait = Duration::from_millis(50 << self.failures.min(4));
            tokio::time::sleep(wait).await;
        }
        let result = async {
            let resp = shared.timed(|| shared.get_key()).await?;
            let revision = resp.header().map_or(0, |h| h.revision());
            self.watch_from(shared, revision + 1).await?;
            Ok(resp.kvs().first().map(Holder::from_kv))
        }
        .await;
        match &result {
            Ok(_) => self.failures = 0,
            Err(_) => self.failures += 1,
        }
        result
    }

    /// Watches the key from `revision` on.
    async fn watch_from(&mut self, shared: &Shared, revision: i64) -> Result<(), ElectionError> {
        let stream = shared
            .timed(|| {
                let mut watch = shared.client.watch_client();
                let key = shared.key.clone();
                let options = WatchOptions::new().with_start_revision(revision);
                async move { watch.watch(key, Some(options)).await }
            })
            .await?;
        self.stream = Some(stream);
        Ok(())
    }

    /// The key's next state: after a change, or after a re-read (compaction, a broken
    /// stream). An error leaves the watch to be re-established by the next call.
    async fn next(&mut self, shared: &Shared) -> Result<Option<Holder>, ElectionError> {
        loop {
            let Some(stream) = self.stream.as_mut() else {
                return self.resync(shared).await;
            };
            let message = match stream.message().await {
                Ok(Some(message)) => message,
                Ok(None) => {
                    self.stream = None;
                    self.failures += 1;
                    return Err(ElectionError::WatchEnded("the stream closed".to_owned()));
                }
                Err(e) => {
                    self.stream = None;
                    self.failures += 1;
                    return Err(e.into());
                }
            };
            if message.canceled() {
                self.stream = None;
                if message.compact_revision() > 0 {
                    tracing::debug!(
                        compact_revision = message.compact_revision(),
                        "election: watch compacted; re-reading the leader key"
                    );
                    continue;
                }
                self.failures += 1;
                return Err(ElectionError::WatchEnded(format!(
                    "cancelled by etcd: {}",
                    message.cancel_reason()
                )));
            }
            if let Some(event) = message.events().last() {
                return Ok(match event.event_type() {
                    EventType::Put => event.kv().map(Holder::from_kv),
                    EventType::Delete => None,
                });
            }
        }
    }
}

/// Exponential backoff between failed attempts, 50 ms to 800 ms.
#[derive(Default)]
struct Backoff {
    failures: u32,
}

impl Backoff {
    fn reset(&mut self) {
        self.failures = 0;
    }

    async fn wait(&mut self) {
        let wait = Duration::from_millis(50 << self.failures.min(4));
        self.failures += 1;
        tokio::time::sleep(wait).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_rounds_the_ttl_up_to_whole_seconds() {
        let config = ElectionConfig::new("h:1", "/m/");
        assert_eq!(config.leader_key(), "/m/leader");
        assert_eq!(config.ttl_secs(), 3);
        let check = |ttl: Duration, secs: i64| {
            assert_eq!(config.clone().with_ttl(ttl).ttl_secs(), secs, "{ttl:?}");
        };
        check(Duration::from_millis(1500), 2);
        check(Duration::from_secs(2), 2);
        check(Duration::ZERO, 1);
    }

    #[test]
    fn a_refusal_names_the_leader() {
        let named = ElectionError::NotLeader {
            leader: Some("10.0.0.2:7000".into()),
        };
        assert_eq!(
            named.to_string(),
            "not the leader (the leader is 10.0.0.2:7000)"
        );
        let unknown = ElectionError::NotLeader { leader: None };
        assert_eq!(unknown.to_string(), "not the leader (no leader is known)");
    }

    /// Each answer renews from the send time of the oldest keep-alive not answered yet, also
    /// when it comes late; a TTL of 0 says the lease is gone.
    #[test]
    fn an_answer_renews_from_its_keep_alives_send_time() {
        let t0 = Instant::now();
        let sent = [t0, t0 + Duration::from_millis(700)];
        let mut unanswered = VecDeque::from(sent);
        assert_eq!(
            renewal(&mut unanswered, 3),
            Renewal::Until(t0 + Duration::from_secs(3))
        );
        assert_eq!(
            renewal(&mut unanswered, 3),
            Renewal::Until(sent[1] + Duration::from_secs(3))
        );
        assert_eq!(renewal(&mut unanswered, 3), Renewal::Unpaired);
        assert_eq!(renewal(&mut VecDeque::from([t0]), 0), Renewal::Gone);
    }

    // Paused time: the deadlines pass exactly, with no real waiting.
    #[tokio::test(start_paused = true)]
    async fn the_lease_is_lost_at_the_local_deadline_unless_extended() {
        let start = Instant::now();
        let (tx, mut rx) = watch::channel(Some(start + Duration::from_millis(100)));
        // Extended once, then left to expire.
        let extend = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(50)).await;
            tx.send_replace(Some(start + Duration::from_millis(200)));
            tokio::time::sleep(Duration::from_millis(500)).await;
            drop(tx);
        });
        assert_eq!(lease_lost(&mut rx).await, LostReason::LeaseExpired);
        let lost_after = start.elapsed();
        assert!(
            lost_after >= Duration::from_millis(200) && lost_after < Duration::from_millis(400),
            "{lost_after:?}"
        );
        extend.abort();
    }

    /// A single etcd member on free loopback ports for this module's tests of etcd-facing
    /// internals (the election's behaviour is tested in `tests/tests/election.rs`); `None`
    /// when etcd is not installed.
    struct LocalEtcd {
        child: std::process::Child,
        dir: std::path::PathBuf,
        endpoint: String,
    }

    impl LocalEtcd {
        async fn start() -> Option<Self> {
            let bin = std::path::Path::new("/usr/bin/etcd");
            if !bin.exists() {
                println!("skipped: /usr/bin/etcd is missing");
                return None;
            }
            let port = || {
                std::net::TcpListener::bind("127.0.0.1:0")
                    .and_then(|l| l.local_addr())
                    .map(|a| a.port())
                    .expect("a free port")
            };
            let (client, peer) = (port(), port());
            let dir = std::env::temp_dir().join(format!("muster-election-{}", std::process::id()));
            let endpoint = format!("127.0.0.1:{client}");
            let child = std::process::Command::new(bin)
                .arg("--data-dir")
                .arg(&dir)
                .args(["--listen-client-urls", &format!("http://{endpoint}")])
                .args(["--advertise-client-urls", &format!("http://{endpoint}")])
                .args(["--listen-peer-urls", &format!("http://127.0.0.1:{peer}")])
                .args([
                    "--initial-advertise-peer-urls",
                    &format!("http://127.0.0.1:{peer}"),
                ])
                .args([
                    "--initial-cluster",
                    &format!("default=http://127.0.0.1:{peer}"),
                ])
                .stdout(std::process::Stdio::null())
                .stderr(std::process::Stdio::null())
                .spawn()
                .expect("etcd starts");
            let etcd = Self {
                child,
                dir,
                endpoint,
            };
            for _ in 0..100 {
                if let Ok(mut c) = Client::connect([&etcd.endpoint], None).await
                    && c.get("probe", None).await.is_ok()
                {
                    return Some(etcd);
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            panic!("etcd did not come up on {}", etcd.endpoint);
        }
    }

    impl Drop for LocalEtcd {
        fn drop(&mut self) {
            let _ = self.child.kill();
            let _ = self.child.wait();
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    #[tokio::test]
    async fn a_watch_from_a_compacted_revision_rereads_the_key() {
        let Some(etcd) = LocalEtcd::start().await else {
            return;
        };
        let mut client = Client::connect([&etcd.endpoint], None)
            .await
            .expect("connects");
        let config = ElectionConfig::new("me:1", "/compaction/");
        let key = config.leader_key();
        for i in 0..5 {
            client
                .put(key.clone(), format!("other:{i}"), None)
                .await
                .expect("puts");
        }
        let now = client.get(key.clone(), None).await.expect("reads");
        let revision = now.header().map(|h| h.revision()).expect("a header");
        client.compact(revision, None).await.expect("compacts");

        let shared = Shared {
            client: client.clone(),
            key: key.clone().into_bytes(),
            config,
            role: watch::channel(Role::Unknown).0,
            standing: watch::channel(false).0,
            current: Mutex::new(None),
            stop: CancellationToken::new(),
        };
        let mut watch = KeyWatch::default();
        watch.watch_from(&shared, 1).await.expect("watches");
        let next = tokio::time::timeout(Duration::from_secs(5), watch.next(&shared)).await;
        let holder = next
            .expect("answers")
            .expect("re-reads after the compaction");
        assert_eq!(holder.map(|h| h.id).as_deref(), Some("other:4"));
        // And it watches on from there.
        client.delete(key.clone(), None).await.expect("deletes");
        let next = tokio::time::timeout(Duration::from_secs(5), watch.next(&shared)).await;
        assert_eq!(next.expect("answers").expect("watches"), None);
    }

    #[tokio::test]
    async fn the_lease_is_lost_at_once_when_etcd_says_it_is_gone() {
        let (tx, mut rx) = watch::channel(Some(Instant::now() + Duration::from_secs(60)));
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            tx.send_replace(None);
            // Keep the sender until the receiver saw it.
            tokio::time::sleep(Duration::from_secs(1)).await;
        });
        let lost = tokio::time::timeout(Duration::from_secs(5), lease_lost(&mut rx)).await;
        assert_eq!(lost, Ok(LostReason::LeaseRevoked));
    }
}
