//! In-place recovery's step-boundary call: `Rendezvous.Quorum` under the failover policy,
//! asked again whenever its long poll runs out, and its answer checked into a [`Quorum`].

use std::time::Duration;

use muster_proto::v1::{self as pb, rendezvous_client::RendezvousClient};

use super::{Coordinator, SessionConfig, wait_ms};
use crate::{Error, RankLocation};

/// How long one `Quorum` long poll waits at the coordinator before DEADLINE_EXCEEDED, after
/// which it is asked again (the coordinator caps it at 60 s).
pub const QUORUM_POLL: Duration = Duration::from_secs(30);

/// The membership every rank agreed on after a rank died (or a collective failed): the epoch
/// its communicators are built under, the step every rank continues from, and which ranks
/// receive their state from which.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Quorum {
    /// The quorum's id: every rank's communicator for it is built under this epoch.
    pub epoch: u64,
    /// Ranks in the job (unchanged by an in-place recovery).
    pub world_size: u32,
    /// The step every rank continues from: the highest any member committed. `None` when no
    /// member had state (every rank is a replacement).
    pub step: Option<u64>,
    /// Ranks whose state is behind `step`, each with the healthy rank it heals from.
    pub heal: Vec<Heal>,
    /// The released barrier sequence numbers (global, node) a replacement continues from.
    pub released: (u64, u64),
    /// Every rank's place, by rank (empty when the coordinator does not say).
    pub members: Vec<RankLocation>,
}

/// One healed rank and its source.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Heal {
    /// The rank whose state is behind.
    pub rank: u32,
    /// The healthy rank it receives its state from.
    pub source: u32,
}

impl Quorum {
    /// The rank `rank` heals from, if it is healed.
    pub fn source_of(&self, rank: u32) -> Option<u32> {
        self.heal.iter().find(|h| h.rank == rank).map(|h| h.source)
    }

    /// The ranks `rank` sends its state to, in rank order (empty unless it is a source).
    pub fn healed_by(&self, rank: u32) -> Vec<u32> {
        let mut ranks: Vec<u32> = self
            .heal
            .iter()
            .filter(|h| h.source == rank)
            .map(|h| h.rank)
            .collect();
        ranks.sort_unstable();
        ranks
    }

    /// Checks the coordinator's answer to a request made at `epoch`: every rank and source
    /// inside the world, no rank healed twice or from itself or from a healed rank, an epoch
    /// not older than the request's.
    pub(crate) fn from_response(response: pb::QuorumResponse, epoch: u64) -> Result<Self, Error> {
        let bad = |why: String| Error::Protocol(format!("the quorum answer {why}"));
        let world = response.world_size;
        if world == 0 {
            return Err(bad("has a world size of 0".into()));
        }
        if response.epoch < epoch {
            return Err(bad(format!(
                "is for epoch {}, older than this rank's epoch {epoch}",
                response.epoch
            )));
        }
        let mut heal = Vec::with_capacity(response.heal.len());
        for entry in &response.heal {
            let (Some(rank), Some(source)) = (entry.rank, entry.source) else {
                return Err(bad("has a heal entry without its rank or source".into()));
            };
            if rank >= world || source >= world || rank == source {
                return Err(bad(format!(
                    "heals rank {rank} from rank {source} in a world of {world}"
                )));
            }
            if heal.iter().any(|h: &Heal| h.rank == rank) {
                return Err(bad(format!("heals rank {rank} twice")));
            }
            heal.push(Heal { rank, source });
        }
        if let Some(h) = heal
            .iter()
            .find(|h| heal.iter().any(|o| o.rank == h.source))
        {
            return Err(bad(format!(
                "heals rank {} from rank {}, which is healed itself",
                h.rank, h.source
            )));
        }
        let members: Vec<RankLocation> = response
            .members
            .into_iter()
            .map(RankLocation::from)
            .collect();
        if !members.is_empty() && members.len() != world as usize {
            return Err(bad(format!(
                "lists {} members for a world of {world}",
                members.len()
            )));
        }
        Ok(Self {
            epoch: response.epoch,
            world_size: world,
            step: response.step,
            heal,
            released: (response.released_global, response.released_node),
            members,
        })
    }
}

/// What this rank tells the coordinator at its step boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QuorumAsk {
    /// The epoch of this rank's communicator (a replacement: the epoch it was spawned for).
    pub epoch: u64,
    /// The steps this rank has committed; `None` for a replacement that has no state yet.
    pub step: Option<u64>,
    /// The last barrier seqs (global, node) this rank was released from.
    pub released: (u64, u64),
}

impl Coordinator {
    /// Calls `Rendezvous.Quorum` for `config`'s rank until the quorum forms: each long poll
    /// waits `poll` at most (DEADLINE_EXCEEDED asks again), and a failover is retried as for
    /// every idempotent call (a newer call of the same rank replaces the older at the
    /// coordinator). Errors: FAILED_PRECONDITION ([`Error::Rpc`]) when the job does not
    /// recover in place or the generation ended (the message says why), a lost coordinator
    /// ([`Error::Connection`]), an answer the protocol does not allow ([`Error::Protocol`]).
    pub async fn quorum(
        &self,
        config: &SessionConfig,
        ask: QuorumAsk,
        poll: Duration,
    ) -> Result<Quorum, Error> {
        loop {
            let request = pb::QuorumRequest {
                job_id: config.job_id.clone(),
                generation: config.generation,
                rank: config.rank,
                epoch: ask.epoch,
                step: ask.step,
                released_global: ask.released.0,
                released_node: ask.released.1,
                wait_ms: wait_ms(Some(poll)),
            };
            let answer = self
                .unary(
                    true,
                    || request.clone(),
                    |channel, request| async move {
                        RendezvousClient::new(channel).quorum(request).await
                    },
                )
                .await
                .map_err(|failed| {
                    failed.error(|| {
                        format!(
                            "the quorum of job {} generation {} (rank {}, epoch {})",
                            config.job_id, config.generation, config.rank, ask.epoch
                        )
                    })
                });
            match answer {
                Ok(response) => return Quorum::from_response(response, ask.epoch),
                Err(Error::Timeout { .. }) => {
                    tracing::debug!(
                        rank = config.rank,
                        epoch = ask.epoch,
                        "quorum not formed yet; asking again"
                    );
                }
                Err(error) => return Err(error),
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn response(heal: &[(u32, u32)]) -> pb::QuorumResponse {
        pb::QuorumResponse {
            epoch: 2,
            world_size: 4,
            step: Some(15),
            heal: heal
                .iter()
                .map(|&(rank, source)| pb::Heal {
                    rank: Some(rank),
                    source: Some(source),
                })
                .collect(),
            released_global: 3,
            released_node: 1,
            members: Vec::new(),
        }
    }

    #[test]
    fn answers_are_checked() {
        let quorum = Quorum::from_response(response(&[(3, 0), (1, 0)]), 1).ok();
        let quorum = quorum.as_ref();
        assert_eq!(quorum.map(|q| q.healed_by(0)), Some(vec![1, 3]));
        assert_eq!(quorum.and_then(|q| q.source_of(3)), Some(0));
        assert_eq!(quorum.and_then(|q| q.source_of(2)), None);
        assert_eq!(quorum.map(|q| q.released), Some((3, 1)));
        let error = |heal: &[(u32, u32)], epoch: u64| {
            Quorum::from_response(response(heal), epoch)
                .err()
                .map(|e| e.to_string())
                .unwrap_or_default()
        };
        assert!(error(&[(4, 0)], 0).contains("heals rank 4 from rank 0 in a world of 4"));
        assert!(error(&[(1, 1)], 0).contains("heals rank 1 from rank 1"));
        assert!(error(&[(1, 0), (1, 2)], 0).contains("heals rank 1 twice"));
        assert!(error(&[(1, 0), (2, 1)], 0).contains("which is healed itself"));
        assert!(error(&[], 3).contains("older than this rank's epoch 3"));
    }
}
