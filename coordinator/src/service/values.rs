//! `muster.v1.KeyValue`, `muster.v1.UniqueIds` and `muster.v1.SharedValues`: a job's
//! key-value data and its generations' published values, in the store under byte caps.
//!
//! Lanes: a `Set`, `Add`, `CompareAndSet` or `Delete` that names a `client_id` and a
//! `sequence` is applied at most once per (lane, sequence), so that a client may retry it when
//! the outcome is unknown (the leader died with the call in flight) without applying it again
//! over another client's write in between. The lane's record (`pb::KvLaneRecord`, at
//! `jobs/<job>/applied/<client_id>`: the last applied sequence, a digest of that call and its
//! answer) is written in the same store transaction as the value ([`Store::write_all`]): a new
//! leader finds either both or neither. Records count towards the job's byte caps like keys.

use super::*;
use prost::Message as _;
use sha2::{Digest as _, Sha256};

fn kv_key(job: &JobId, key: &str) -> String {
    format!("jobs/{job}/kv/{key}")
}

fn lane_key(job: &JobId, client_id: &str) -> String {
    format!("jobs/{job}/applied/{client_id}")
}

/// The bytes job `id`'s key-value data holds in the store, as the byte caps count them (each
/// key's name and value, each lane record's client id and record): what a new leader starts
/// the job's count from.
pub(super) async fn stored_kv_bytes(store: &dyn Store, id: &JobId) -> Result<usize, StoreError> {
    let mut bytes = 0;
    for prefix in [kv_key(id, ""), lane_key(id, "")] {
        bytes += store
            .list(&prefix)
            .await?
            .iter()
            .map(|(k, v)| k.len().saturating_sub(prefix.len()) + v.len())
            .sum::<usize>();
    }
    Ok(bytes)
}

/// Longest client id of a lane (a client's 128-bit random id in hex is 32).
const MAX_CLIENT_ID: usize = 64;

/// A lane call: the lane's client id and the call's number on it.
struct Lane {
    client_id: String,
    sequence: u64,
}

impl Lane {
    /// The lane a request names, checked; `None` for a call without one.
    fn of(client_id: String, sequence: u64) -> Result<Option<Lane>, Status> {
        if client_id.is_empty() {
            if sequence != 0 {
                return Err(Status::invalid_argument(format!(
                    "sequence {sequence} without a client_id: a sequence numbers the calls of the lane a client_id names"
                )));
            }
            return Ok(None);
        }
        if client_id.len() > MAX_CLIENT_ID
            || !client_id
                .bytes()
                .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return Err(Status::invalid_argument(format!(
                "client_id {client_id:?} must be 1 to {MAX_CLIENT_ID} characters of [0-9A-Za-z_-]"
            )));
        }
        if sequence == 0 {
            return Err(Status::invalid_argument(format!(
                "client_id '{client_id}' needs a sequence of 1 or more"
            )));
        }
        Ok(Some(Lane {
            client_id,
            sequence,
        }))
    }
}

/// SHA-256 of a call's kind and operands, each length-prefixed so that no two calls share an
/// encoding.
fn digest(parts: &[&[u8]]) -> Vec<u8> {
    let mut hash = Sha256::new();
    for part in parts {
        hash.update((part.len() as u64).to_le_bytes());
        hash.update(part);
    }
    hash.finalize().to_vec()
}

/// A lane's record answers another kind of call than the retry it is asked about: the digest
/// matched, so the record itself is wrong.
fn other_kind(lane: &Lane, job: &Job) -> Status {
    Status::internal(format!(
        "the record of lane '{}' in job '{}' answers another kind of call",
        lane.client_id, job.id
    ))
}

/// Where a lane call stands, found under the job's kv lock.
enum LaneState {
    /// Applied before (this is a retry): its answer.
    Applied(pb::kv_lane_record::Answer),
    /// To apply; the lane's record now counts this many bytes (0: none yet).
    Fresh { record_bytes: usize },
}

fn value_key(job: &JobId, values_id: &str, kind: &str, name: &str) -> String {
    format!("jobs/{job}/gen/{values_id}/{kind}/{name}")
}

/// A published value is stored as the publisher's rank (4 bytes, little endian) then the value.
fn encode_published(rank: u32, value: &[u8]) -> Vec<u8> {
    let mut v = Vec::with_capacity(4 + value.len());
    v.extend_from_slice(&rank.to_le_bytes());
    v.extend_from_slice(value);
    v
}

fn decode_published(stored: &[u8]) -> Result<(u32, &[u8]), Status> {
    match stored.split_first_chunk::<4>() {
        Some((rank, value)) => Ok((u32::from_le_bytes(*rank), value)),
        None => Err(Status::internal(
            "stored value is corrupt (shorter than its header)",
        )),
    }
}

/// The name id `root` of communicator `comm` is kept under: the communicator's own name for
/// the first (the name a one-id communicator has always used), `<comm>#<root>` for the others
/// (`#` is not a communicator character, so no communicator's name is another's id).
fn root_name(comm: &str, root: u32) -> String {
    if root == 0 {
        comm.to_owned()
    } else {
        format!("{comm}#{root}")
    }
}

/// A communicator's bootstrap plan as stored: its ranks per root, then each root's rank, every
/// number 4 bytes little endian.
fn encode_plan(ranks_per_root: u32, roots: &[u32]) -> Vec<u8> {
    std::iter::once(ranks_per_root)
        .chain(roots.iter().copied())
        .flat_map(u32::to_le_bytes)
        .collect()
}

fn decode_plan(stored: &[u8]) -> Result<(u32, Vec<u32>), Status> {
    let (_, plan) = decode_published(stored)?;
    let numbers: Vec<u32> = plan
        .chunks_exact(4)
        .map(|n| u32::from_le_bytes([n[0], n[1], n[2], n[3]]))
        .collect();
    match numbers.split_first() {
        Some((per, roots)) if plan.len() % 4 == 0 && !roots.is_empty() => {
            Ok((*per, roots.to_vec()))
        }
        _ => Err(Status::internal(
            "a stored NCCL bootstrap plan is corrupt (not a limit and one or more ranks)",
        )),
    }
}

/// `muster.v1.KeyValue`, `muster.v1.UniqueIds` and `muster.v1.SharedValues`.
#[derive(Clone)]
pub struct ValuesService(pub Arc<Coordinator>);

impl ValuesService {
    fn check_value(&self, value: &[u8]) -> Result<(), Status> {
        if value.len() > self.0.config.max_value_bytes {
            return Err(Status::resource_exhausted(format!(
                "value is {} bytes; the limit is {} (max_value_bytes)",
                value.len(),
                self.0.config.max_value_bytes
            )));
        }
        Ok(())
    }

    /// Writes `value` (None: deletes) under the job's byte cap. Caller holds the job's kv lock.
    async fn write(
        &self,
        job: &Job,
        total: &mut usize,
        key: &str,
        user_key: &str,
        value: Option<Vec<u8>>,
    ) -> Result<Option<Vec<u8>>, Status> {
        let old = self.0.store.get(key).await?;
        let old_len = old.as_ref().map_or(0, |v| user_key.len() + v.len());
        let new_len = value.as_ref().map_or(0, |v| user_key.len() + v.len());
        let store = &self.0.store;
        let written = async move {
            match value {
                Some(v) => store.put(key, v).await,
                None => store.delete(key).await.map(|_| ()),
            }
        };
        self.account(job, total, user_key, old_len, new_len, written)
            .await?;
        Ok(old)
    }

    /// Runs `written`, a store write that takes the job's data from `old_len` bytes to
    /// `new_len` (as the caps count them), within the job's and the coordinator's byte caps;
    /// refused before it runs when it would break one. Caller holds the job's kv lock.
    async fn account(
        &self,
        job: &Job,
        total: &mut usize,
        user_key: &str,
        old_len: usize,
        new_len: usize,
        written: impl Future<Output = Result<(), StoreError>>,
    ) -> Result<(), Status> {
        let next = (*total + new_len).saturating_sub(old_len);
        if next > self.0.config.max_job_bytes && new_len > old_len {
            return Err(Status::resource_exhausted(format!(
                "job '{}' key-value store would hold {next} bytes; the limit is {} (max_job_bytes: raise it with --max-job-bytes)",
                job.id, self.0.config.max_job_bytes
            )));
        }
        // Over all jobs too (max_total_bytes): reserved before the write, given back if it
        // does not happen.
        let grow = new_len.saturating_sub(old_len);
        self.0
            .stored
            .reserve(&job.id, grow, &format!("writing key '{user_key}'"))?;
        if let Err(e) = written.await {
            self.0.stored.release(&job.id, grow);
            return Err(e.into());
        }
        self.0
            .stored
            .release(&job.id, old_len.saturating_sub(new_len));
        *total = next;
        job.notify();
        Ok(())
    }

    /// Where call `digest` (`what`, for messages) stands on `lane`. Caller holds the job's kv
    /// lock, so no other call of the job is applied between this and the write.
    async fn lane_state(
        &self,
        job: &Job,
        lane: &Lane,
        digest: &[u8],
        what: &str,
    ) -> Result<LaneState, Status> {
        let Some(bytes) = self
            .0
            .store
            .get(&lane_key(&job.id, &lane.client_id))
            .await?
        else {
            return Ok(LaneState::Fresh { record_bytes: 0 });
        };
        let corrupt = |why: String| {
            Status::internal(format!(
                "the record of lane '{}' in job '{}' is corrupt: {why}",
                lane.client_id, job.id
            ))
        };
        let record =
            pb::KvLaneRecord::decode(bytes.as_slice()).map_err(|e| corrupt(e.to_string()))?;
        if record.sequence > lane.sequence {
            return Err(Status::failed_precondition(format!(
                "{what}: sequence {} of lane '{}' in job '{}' is stale: the lane already applied sequence {} (a lane numbers its calls upwards and sends each after the one before it answered)",
                lane.sequence, lane.client_id, job.id, record.sequence
            )));
        }
        if record.sequence < lane.sequence {
            return Ok(LaneState::Fresh {
                record_bytes: lane.client_id.len() + bytes.len(),
            });
        }
        if record.digest != digest {
            return Err(Status::failed_precondition(format!(
                "{what}: sequence {} of lane '{}' in job '{}' was already used by another call (another kind, key or operands); a retry must resend the same call",
                lane.sequence, lane.client_id, job.id
            )));
        }
        record
            .answer
            .map(LaneState::Applied)
            .ok_or_else(|| corrupt("it holds no answer".into()))
    }

    /// Writes `value` at `full` (user key `key`, holding `old` before; `None`: deletes it) and
    /// `lane`'s record of the call (`digest`, `answer`) in one store transaction, under the
    /// byte caps. Caller holds the job's kv lock.
    async fn write_on_lane(
        &self,
        job: &Job,
        total: &mut usize,
        (full, key): (&str, &str),
        (old, value): (Option<&[u8]>, Option<Vec<u8>>),
        (lane, record_bytes): (&Lane, usize),
        (digest, answer): (Vec<u8>, pb::kv_lane_record::Answer),
    ) -> Result<(), Status> {
        let record = pb::KvLaneRecord {
            sequence: lane.sequence,
            digest,
            answer: Some(answer),
        }
        .encode_to_vec();
        let old_len = old.map_or(0, |v| key.len() + v.len()) + record_bytes;
        let new_len =
            value.as_ref().map_or(0, |v| key.len() + v.len()) + lane.client_id.len() + record.len();
        let entries = vec![
            (full.to_owned(), value),
            (lane_key(&job.id, &lane.client_id), Some(record)),
        ];
        self.account(
            job,
            total,
            key,
            old_len,
            new_len,
            self.0.store.write_all(entries),
        )
        .await
    }

    async fn publish(
        &self,
        job: &Arc<Job>,
        generation: u64,
        rank: u32,
        kind: &str,
        name: &str,
        value: &[u8],
    ) -> Result<(), Status> {
        job.alive_member(generation, rank)?;
        let key = value_key(&job.id, &job.values_id(generation)?, kind, name);
        let stored = encode_published(rank, value);
        // Published values count towards max_total_bytes (given back if already published).
        let size = name.len() + stored.len();
        self.0
            .stored
            .reserve(&job.id, size, &format!("publishing {kind} '{name}'"))?;
        let created = self.0.store.create(&key, stored).await;
        if !matches!(created, Ok(None)) {
            self.0.stored.release(&job.id, size);
        }
        if let Some(existing) = created? {
            let (by, old) = decode_published(&existing)?;
            if old != value {
                return Err(Status::already_exists(format!(
                    "{kind} '{name}' of job '{}' generation {generation} was already published by rank {by} with different bytes",
                    job.id
                )));
            }
        }
        job.published(&key);
        Ok(())
    }

    async fn fetch(
        &self,
        job: &Arc<Job>,
        generation: u64,
        rank: u32,
        kind: &str,
        name: &str,
        wait_ms: u64,
    ) -> Result<(u32, Vec<u8>), Status> {
        let deadline = deadline("wait_ms", wait_ms)?;
        job.check_member(generation, rank)?;
        let key = value_key(&job.id, &job.values_id(generation)?, kind, name);
        let store = &self.0.store;
        wait_for_value(
            job,
            &key,
            deadline,
            || {
                format!(
                    "{kind} '{name}' of job '{}' generation {generation}",
                    job.id
                )
            },
            || async {
                if let Some(v) = store.get(&key).await? {
                    let (by, value) = decode_published(&v)?;
                    return Ok(Some((by, value.to_vec())));
                }
                job.alive_member(generation, rank)?;
                Ok(None)
            },
        )
        .await
    }

    /// Communicator `comm`'s bootstrap plan in `generation` (its ranks per root and each id's
    /// root), made on first use from the world size and `nccl_ranks_per_root`, and kept with
    /// the generation's values so that every rank, and a new leader, answers the same one.
    async fn plan(
        &self,
        job: &Arc<Job>,
        generation: u64,
        rank: u32,
        comm: &str,
    ) -> Result<(u32, Vec<u32>), Status> {
        let key = plan_key(job, generation, comm)?;
        if let Some(stored) = self.0.store.get(&key).await? {
            return decode_plan(&stored);
        }
        let world = job.world_size(generation, rank)?;
        let per = self.0.config.nccl_ranks_per_root;
        let roots = muster_core::nccl::roots(world, per);
        let plan = encode_plan(per, &roots);
        match self
            .publish(job, generation, rank, "nccl-roots", comm, &plan)
            .await
        {
            Ok(()) => Ok((per, roots)),
            // Another leader made it with another setting first: its plan stands.
            Err(refused) if refused.code() == tonic::Code::AlreadyExists => {
                match self.0.store.get(&key).await? {
                    Some(stored) => decode_plan(&stored),
                    None => Err(refused),
                }
            }
            Err(refused) => Err(refused),
        }
    }
}

/// Where communicator `comm`'s bootstrap plan of `generation` is kept.
fn plan_key(job: &Job, generation: u64, comm: &str) -> Result<String, Status> {
    Ok(value_key(
        &job.id,
        &job.values_id(generation)?,
        "nccl-roots",
        comm,
    ))
}

/// A request about one job, which a job token may make only for its own job.
trait JobScoped {
    fn job_id(&self) -> &str;
}

macro_rules! job_scoped {
    ($($t:ty),* $(,)?) => {
        $(impl JobScoped for $t {
            fn job_id(&self) -> &str {
                &self.job_id
            }
        })*
    };
}

job_scoped!(
    pb::SetRequest,
    pb::GetRequest,
    pb::AddRequest,
    pb::CompareAndSetRequest,
    pb::DeleteRequest,
    pb::ListRequest,
    pb::PublishUniqueIdRequest,
    pb::FetchUniqueIdRequest,
    pb::UniqueIdRootsRequest,
    pb::PublishValueRequest,
    pb::FetchValueRequest,
);

/// The request's message, once its caller may act on the job it names (`auth`): before the
/// job is even looked up, so a worker of one job cannot probe for others.
fn authorized<T: JobScoped>(request: Request<T>) -> Result<T, Status> {
    auth::authorize_job(&request, request.get_ref().job_id())?;
    Ok(request.into_inner())
}

#[tonic::async_trait]
impl pb::key_value_server::KeyValue for ValuesService {
    async fn set(&self, request: Request<pb::SetRequest>) -> Rpc<pb::SetResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let key = model::kv_key(&r.key)?;
        self.check_value(&r.value)?;
        let lane = Lane::of(r.client_id, r.sequence)?;
        let full = kv_key(&job.id, &key);
        let mut total = job.kv_bytes.lock().await;
        let Some(lane) = lane else {
            self.write(&job, &mut total, &full, &key, Some(r.value))
                .await?;
            return Ok(Response::new(pb::SetResponse {}));
        };
        let digest = digest(&[b"set", key.as_bytes(), &r.value]);
        let record_bytes = match self.lane_state(&job, &lane, &digest, "set").await? {
            LaneState::Applied(pb::kv_lane_record::Answer::Stored(_)) => {
                return Ok(Response::new(pb::SetResponse {}));
            }
            LaneState::Applied(_) => return Err(other_kind(&lane, &job)),
            LaneState::Fresh { record_bytes } => record_bytes,
        };
        let old = self.0.store.get(&full).await?;
        self.write_on_lane(
            &job,
            &mut total,
            (&full, &key),
            (old.as_deref(), Some(r.value)),
            (&lane, record_bytes),
            (digest, pb::kv_lane_record::Answer::Stored(true)),
        )
        .await?;
        Ok(Response::new(pb::SetResponse {}))
    }

    async fn get(&self, request: Request<pb::GetRequest>) -> Rpc<pb::GetResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let key = model::kv_key(&r.key)?;
        let deadline = deadline("wait_ms", r.wait_ms)?;
        let full = kv_key(&job.id, &key);
        let store = &self.0.store;
        if deadline.is_none() {
            return match store.get(&full).await? {
                Some(value) => Ok(Response::new(pb::GetResponse { value })),
                None => Err(Status::not_found(format!(
                    "key '{key}' not found in job '{}'",
                    job.id
                ))),
            };
        }
        let value = wait_for(
            &job,
            deadline,
            || format!("key '{key}' in job '{}'", job.id),
            || async { Ok(store.get(&full).await?) },
        )
        .await?;
        Ok(Response::new(pb::GetResponse { value }))
    }

    async fn add(&self, request: Request<pb::AddRequest>) -> Rpc<pb::AddResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let key = model::kv_key(&r.key)?;
        let lane = Lane::of(r.client_id, r.sequence)?;
        let full = kv_key(&job.id, &key);
        let digest = digest(&[b"add", key.as_bytes(), &r.delta.to_le_bytes()]);
        let mut total = job.kv_bytes.lock().await;
        let mut record_bytes = 0;
        if let Some(lane) = &lane {
            match self.lane_state(&job, lane, &digest, "add").await? {
                LaneState::Applied(pb::kv_lane_record::Answer::Added(value)) => {
                    return Ok(Response::new(pb::AddResponse { value }));
                }
                LaneState::Applied(_) => return Err(other_kind(lane, &job)),
                LaneState::Fresh { record_bytes: n } => record_bytes = n,
            }
        }
        let old = self.0.store.get(&full).await?;
        let current = match &old {
            None => 0i64,
            Some(v) => std::str::from_utf8(v)
                .ok()
                .and_then(|s| s.parse::<i64>().ok())
                .ok_or_else(|| {
                    Status::failed_precondition(format!(
                        "key '{key}' in job '{}' holds a value that is not a decimal integer; add needs a counter",
                        job.id
                    ))
                })?,
        };
        let value = current.checked_add(r.delta).ok_or_else(|| {
            Status::out_of_range(format!(
                "counter '{key}' would overflow: {current} + {}",
                r.delta
            ))
        })?;
        let text = value.to_string().into_bytes();
        match &lane {
            None => {
                self.write(&job, &mut total, &full, &key, Some(text))
                    .await?;
            }
            Some(lane) => {
                self.write_on_lane(
                    &job,
                    &mut total,
                    (&full, &key),
                    (old.as_deref(), Some(text)),
                    (lane, record_bytes),
                    (digest, pb::kv_lane_record::Answer::Added(value)),
                )
                .await?;
            }
        }
        Ok(Response::new(pb::AddResponse { value }))
    }

    async fn compare_and_set(
        &self,
        request: Request<pb::CompareAndSetRequest>,
    ) -> Rpc<pb::CompareAndSetResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let key = model::kv_key(&r.key)?;
        self.check_value(&r.desired)?;
        let lane = Lane::of(r.client_id, r.sequence)?;
        let full = kv_key(&job.id, &key);
        let expected = match &r.expected {
            Some(v) => [&[1u8][..], v].concat(),
            None => vec![0],
        };
        let digest = digest(&[b"compare_and_set", key.as_bytes(), &expected, &r.desired]);
        let swapped = || {
            Ok(Response::new(pb::CompareAndSetResponse {
                swapped: true,
                current: Some(r.desired.clone()),
            }))
        };
        let mut total = job.kv_bytes.lock().await;
        let mut record_bytes = 0;
        if let Some(lane) = &lane {
            match self
                .lane_state(&job, lane, &digest, "compare_and_set")
                .await?
            {
                // Only a swap is recorded, and what it left is the request's `desired`.
                LaneState::Applied(pb::kv_lane_record::Answer::Swapped(true)) => return swapped(),
                LaneState::Applied(_) => return Err(other_kind(lane, &job)),
                LaneState::Fresh { record_bytes: n } => record_bytes = n,
            }
        }
        let current = self.0.store.get(&full).await?;
        if current != r.expected {
            return Ok(Response::new(pb::CompareAndSetResponse {
                swapped: false,
                current,
            }));
        }
        match &lane {
            None => {
                self.write(&job, &mut total, &full, &key, Some(r.desired.clone()))
                    .await?;
            }
            Some(lane) => {
                self.write_on_lane(
                    &job,
                    &mut total,
                    (&full, &key),
                    (current.as_deref(), Some(r.desired.clone())),
                    (lane, record_bytes),
                    (digest, pb::kv_lane_record::Answer::Swapped(true)),
                )
                .await?;
            }
        }
        swapped()
    }

    async fn delete(&self, request: Request<pb::DeleteRequest>) -> Rpc<pb::DeleteResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let key = model::kv_key(&r.key)?;
        let lane = Lane::of(r.client_id, r.sequence)?;
        let full = kv_key(&job.id, &key);
        let mut total = job.kv_bytes.lock().await;
        let Some(lane) = lane else {
            let old = self.write(&job, &mut total, &full, &key, None).await?;
            return Ok(Response::new(pb::DeleteResponse {
                existed: old.is_some(),
            }));
        };
        let digest = digest(&[b"delete", key.as_bytes()]);
        let record_bytes = match self.lane_state(&job, &lane, &digest, "delete").await? {
            LaneState::Applied(pb::kv_lane_record::Answer::Existed(existed)) => {
                return Ok(Response::new(pb::DeleteResponse { existed }));
            }
            LaneState::Applied(_) => return Err(other_kind(&lane, &job)),
            LaneState::Fresh { record_bytes } => record_bytes,
        };
        let old = self.0.store.get(&full).await?;
        let existed = old.is_some();
        self.write_on_lane(
            &job,
            &mut total,
            (&full, &key),
            (old.as_deref(), None),
            (&lane, record_bytes),
            (digest, pb::kv_lane_record::Answer::Existed(existed)),
        )
        .await?;
        Ok(Response::new(pb::DeleteResponse { existed }))
    }

    async fn list(&self, request: Request<pb::ListRequest>) -> Rpc<pb::ListResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        if r.prefix.len() > 512 {
            return Err(Status::invalid_argument("prefix is longer than 512 bytes"));
        }
        let base = kv_key(&job.id, "");
        let items = self
            .0
            .store
            .list(&format!("{base}{}", r.prefix))
            .await?
            .into_iter()
            .map(|(k, value)| pb::KeyValuePair {
                key: k[base.len()..].to_owned(),
                value,
            })
            .collect();
        Ok(Response::new(pb::ListResponse { items }))
    }
}

#[tonic::async_trait]
impl pb::unique_ids_server::UniqueIds for ValuesService {
    async fn publish(
        &self,
        request: Request<pb::PublishUniqueIdRequest>,
    ) -> Rpc<pb::PublishUniqueIdResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let generation = model::generation(r.generation)?;
        let comm = model::communicator(&r.communicator)?;
        if r.unique_id.len() != muster_proto::NCCL_UNIQUE_ID_BYTES {
            return Err(Status::invalid_argument(format!(
                "unique_id is {} bytes; an NCCL unique id is exactly {}",
                r.unique_id.len(),
                muster_proto::NCCL_UNIQUE_ID_BYTES
            )));
        }
        // A first id published with no plan made is a one-id communicator's (any rank's, as
        // before plans); any other needs the plan, and only its root may publish it.
        let planned = r.root > 0
            || self
                .0
                .store
                .get(&plan_key(&job, generation, &comm)?)
                .await?
                .is_some();
        if planned {
            let (_, roots) = self.plan(&job, generation, r.rank, &comm).await?;
            match roots.get(r.root as usize) {
                None => {
                    return Err(Status::invalid_argument(format!(
                        "root {} is outside communicator '{comm}' of job '{}' generation {generation}: it has {} unique ids (roots 0 to {})",
                        r.root,
                        job.id,
                        roots.len(),
                        roots.len() - 1
                    )));
                }
                Some(&root) if root != r.rank => {
                    return Err(Status::permission_denied(format!(
                        "rank {} is not the root of unique id {} of communicator '{comm}' in job '{}' generation {generation}: rank {root} is",
                        r.rank, r.root, job.id
                    )));
                }
                Some(_) => {}
            }
        }
        let name = root_name(&comm, r.root);
        self.publish(&job, generation, r.rank, "nccl", &name, &r.unique_id)
            .await?;
        Ok(Response::new(pb::PublishUniqueIdResponse {}))
    }

    async fn fetch(
        &self,
        request: Request<pb::FetchUniqueIdRequest>,
    ) -> Rpc<pb::FetchUniqueIdResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let generation = model::generation(r.generation)?;
        let comm = model::communicator(&r.communicator)?;
        if !r.all {
            let (root_rank, unique_id) =
                ValuesService::fetch(self, &job, generation, r.rank, "nccl", &comm, r.wait_ms)
                    .await?;
            return Ok(Response::new(pb::FetchUniqueIdResponse {
                unique_id,
                root_rank,
                unique_ids: vec![],
            }));
        }
        let deadline = deadline("wait_ms", r.wait_ms)?;
        let (_, roots) = self.plan(&job, generation, r.rank, &comm).await?;
        let values_id = job.values_id(generation)?;
        let mut unique_ids = Vec::with_capacity(roots.len());
        for root in 0..roots.len() as u32 {
            let name = root_name(&comm, root);
            // An id already published is read at once; the first missing one is waited for.
            if let Some(stored) = self
                .0
                .store
                .get(&value_key(&job.id, &values_id, "nccl", &name))
                .await?
            {
                unique_ids.push(decode_published(&stored)?.1.to_vec());
                continue;
            }
            // What is left of the caller's wait (at least 1 ms: 0 would mean no limit).
            let wait_ms = deadline.map_or(0, |d| {
                (d.saturating_duration_since(Instant::now()).as_millis() as u64).max(1)
            });
            let (_, id) =
                ValuesService::fetch(self, &job, generation, r.rank, "nccl", &name, wait_ms)
                    .await?;
            unique_ids.push(id);
        }
        Ok(Response::new(pb::FetchUniqueIdResponse {
            unique_id: unique_ids[0].clone(),
            root_rank: roots[0],
            unique_ids,
        }))
    }

    async fn roots(
        &self,
        request: Request<pb::UniqueIdRootsRequest>,
    ) -> Rpc<pb::UniqueIdRootsResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let generation = model::generation(r.generation)?;
        let comm = model::communicator(&r.communicator)?;
        let (ranks_per_root, roots) = self.plan(&job, generation, r.rank, &comm).await?;
        Ok(Response::new(pb::UniqueIdRootsResponse {
            roots,
            ranks_per_root,
        }))
    }
}

#[tonic::async_trait]
impl pb::shared_values_server::SharedValues for ValuesService {
    async fn publish(
        &self,
        request: Request<pb::PublishValueRequest>,
    ) -> Rpc<pb::PublishValueResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let generation = model::generation(r.generation)?;
        let name = model::label("name", &r.name, 256)?;
        self.check_value(&r.value)?;
        ValuesService::publish(self, &job, generation, r.rank, "shared", &name, &r.value).await?;
        Ok(Response::new(pb::PublishValueResponse {}))
    }

    async fn fetch(&self, request: Request<pb::FetchValueRequest>) -> Rpc<pb::FetchValueResponse> {
        let r = authorized(request)?;
        let job = self.0.job(&r.job_id)?;
        let generation = model::generation(r.generation)?;
        let name = model::label("name", &r.name, 256)?;
        let (publisher_rank, value) =
            ValuesService::fetch(self, &job, generation, r.rank, "shared", &name, r.wait_ms)
                .await?;
        Ok(Response::new(pb::FetchValueResponse {
            value,
            publisher_rank,
        }))
    }
}
