//! Values published once per generation and fetched by the other ranks: NCCL unique ids
//! ([`UniqueIds`]) and shared values ([`SharedValues`]), each call a [`Coordinator::unary`].

use std::time::Duration;

use muster_proto::{
    NCCL_UNIQUE_ID_BYTES,
    v1::{
        self as pb, shared_values_client::SharedValuesClient, unique_ids_client::UniqueIdsClient,
    },
};
use tokio::time::Instant;

use super::{Coordinator, wait_ms};
use crate::Error;

/// NCCL unique ids of one generation: the communicator's root publishes its id, the other
/// ranks fetch it. Fenced by generation, so a restarted job never reuses an old id. Both calls
/// are idempotent and retried across a coordinator failover.
#[derive(Debug, Clone)]
pub struct UniqueIds {
    coordinator: Coordinator,
    job_id: String,
    generation: u64,
    rank: u32,
}

impl UniqueIds {
    /// The unique ids of `job_id`'s `generation`, as seen by `rank`.
    pub fn new(
        coordinator: Coordinator,
        job_id: impl Into<String>,
        generation: u64,
        rank: u32,
    ) -> Self {
        Self {
            coordinator,
            job_id: job_id.into(),
            generation,
            rank,
        }
    }

    /// Publishes `communicator`'s id. Publishing the same bytes again is fine; different bytes
    /// are refused (ALREADY_EXISTS).
    pub async fn publish(
        &self,
        communicator: &str,
        id: &[u8; NCCL_UNIQUE_ID_BYTES],
    ) -> Result<(), Error> {
        self.publish_root(communicator, 0, id).await
    }

    /// Publishes id number `root` of `communicator`, whose root this rank is (see
    /// [`UniqueIds::roots`]).
    pub async fn publish_root(
        &self,
        communicator: &str,
        root: u32,
        id: &[u8; NCCL_UNIQUE_ID_BYTES],
    ) -> Result<(), Error> {
        let request = pb::PublishUniqueIdRequest {
            job_id: self.job_id.clone(),
            generation: self.generation,
            rank: self.rank,
            communicator: communicator.to_owned(),
            unique_id: id.to_vec(),
            root,
        };
        self.coordinator
            .unary(
                true,
                || request.clone(),
                |channel, request| async move {
                    UniqueIdsClient::new(channel).publish(request).await
                },
            )
            .await
            .map_err(|failed| failed.error(|| format!("publishing unique id '{communicator}'")))?;
        Ok(())
    }

    /// Fetches `communicator`'s id, waiting until it is published, the generation fails or
    /// `wait` passes (`None`: as long as the generation is alive).
    pub async fn fetch(
        &self,
        communicator: &str,
        wait: Option<Duration>,
    ) -> Result<[u8; NCCL_UNIQUE_ID_BYTES], Error> {
        let response = self.fetch_ids(communicator, wait, false).await?;
        unique_id(communicator, &response.unique_id)
    }

    /// Fetches every id of `communicator`'s roots, in root order, waiting until each is
    /// published, the generation fails or `wait` passes (`None`: as long as the generation is
    /// alive).
    pub async fn fetch_all(
        &self,
        communicator: &str,
        wait: Option<Duration>,
    ) -> Result<Vec<[u8; NCCL_UNIQUE_ID_BYTES]>, Error> {
        let response = self.fetch_ids(communicator, wait, true).await?;
        if response.unique_ids.is_empty() {
            return Err(Error::Protocol(format!(
                "the coordinator answered no unique ids for communicator '{communicator}'"
            )));
        }
        response
            .unique_ids
            .iter()
            .map(|id| unique_id(communicator, id))
            .collect()
    }

    async fn fetch_ids(
        &self,
        communicator: &str,
        wait: Option<Duration>,
        all: bool,
    ) -> Result<pb::FetchUniqueIdResponse, Error> {
        let started = Instant::now();
        self.coordinator
            .unary(
                true,
                || pb::FetchUniqueIdRequest {
                    job_id: self.job_id.clone(),
                    generation: self.generation,
                    rank: self.rank,
                    communicator: communicator.to_owned(),
                    wait_ms: wait_ms(wait.map(|w| w.saturating_sub(started.elapsed()))),
                    all,
                },
                |channel, request| async move { UniqueIdsClient::new(channel).fetch(request).await },
            )
            .await
            .map_err(|failed| failed.error(|| format!("NCCL unique id '{communicator}'")))
    }

    /// Which rank makes each of `communicator`'s ids, in id order, as the coordinator planned
    /// it (NCCL's bootstrap roots, see `muster_core::nccl`): one entry (rank 0) for a
    /// communicator with one id. A coordinator that predates plans (UNIMPLEMENTED) counts as
    /// one id.
    pub async fn roots(&self, communicator: &str) -> Result<Vec<u32>, Error> {
        let answer = self
            .coordinator
            .unary(
                true,
                || pb::UniqueIdRootsRequest {
                    job_id: self.job_id.clone(),
                    generation: self.generation,
                    rank: self.rank,
                    communicator: communicator.to_owned(),
                },
                |channel, request| async move { UniqueIdsClient::new(channel).roots(request).await },
            )
            .await;
        match answer {
            Ok(response) if response.roots.is_empty() => Err(Error::Protocol(format!(
                "the coordinator planned no roots for communicator '{communicator}'"
            ))),
            Ok(response) => Ok(response.roots),
            Err(failed) if failed.status.code() == tonic::Code::Unimplemented => Ok(vec![0]),
            Err(failed) => Err(failed.error(|| format!("NCCL roots of '{communicator}'"))),
        }
    }
}

/// `bytes` as an NCCL unique id of `communicator`, or a protocol error saying its size.
fn unique_id(communicator: &str, bytes: &[u8]) -> Result<[u8; NCCL_UNIQUE_ID_BYTES], Error> {
    <[u8; NCCL_UNIQUE_ID_BYTES]>::try_from(bytes).map_err(|_| {
        Error::Protocol(format!(
            "unique id '{communicator}' has {} bytes, expected {NCCL_UNIQUE_ID_BYTES}",
            bytes.len()
        ))
    })
}

/// Values computed once per generation and shared (`main_process_first_share`): the publisher
/// stores bytes under a name, the others fetch them instead of computing them again. Both
/// calls are idempotent and retried across a coordinator failover.
#[derive(Debug, Clone)]
pub struct SharedValues {
    coordinator: Coordinator,
    job_id: String,
    generation: u64,
    rank: u32,
}

impl SharedValues {
    /// The shared values of `job_id`'s `generation`, as seen by `rank`.
    pub fn new(
        coordinator: Coordinator,
        job_id: impl Into<String>,
        generation: u64,
        rank: u32,
    ) -> Self {
        Self {
            coordinator,
            job_id: job_id.into(),
            generation,
            rank,
        }
    }

    /// Publishes `value` under `name`. The same bytes again are fine; different bytes are
    /// refused (ALREADY_EXISTS).
    pub async fn publish(&self, name: &str, value: impl Into<Vec<u8>>) -> Result<(), Error> {
        let request = pb::PublishValueRequest {
            job_id: self.job_id.clone(),
            generation: self.generation,
            rank: self.rank,
            name: name.to_owned(),
            value: value.into(),
        };
        self.coordinator
            .unary(
                true,
                || request.clone(),
                |channel, request| async move {
                    SharedValuesClient::new(channel).publish(request).await
                },
            )
            .await
            .map_err(|failed| failed.error(|| format!("publishing shared value '{name}'")))?;
        Ok(())
    }

    /// Fetches the value under `name`, waiting until it is published, the generation fails or
    /// `wait` passes (`None`: as long as the generation is alive).
    pub async fn fetch(&self, name: &str, wait: Option<Duration>) -> Result<Vec<u8>, Error> {
        let started = Instant::now();
        let response =
            self.coordinator
                .unary(
                    true,
                    || pb::FetchValueRequest {
                        job_id: self.job_id.clone(),
                        generation: self.generation,
                        rank: self.rank,
                        name: name.to_owned(),
                        wait_ms: wait_ms(wait.map(|w| w.saturating_sub(started.elapsed()))),
                    },
                    |channel, request| async move {
                        SharedValuesClient::new(channel).fetch(request).await
                    },
                )
                .await
                .map_err(|failed| failed.error(|| format!("shared value '{name}'")))?;
        Ok(response.value)
    }
}
