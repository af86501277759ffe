//! NCCL's bootstrap at scale: which ranks make the unique ids of a communicator that uses
//! several (`ncclCommInitRankScalable`, NCCL ≥ 2.23), one per bootstrap root.
//!
//! NCCL splits a communicator's ranks into contiguous blocks, one per id, and every rank of a
//! block bootstraps through that id's root (`rootIdFromRank` in NCCL's `bootstrap.cc`): the
//! first `world % ids` blocks hold one rank more than the others. The root of an id is the
//! process that called `ncclGetUniqueId` for it (its address is in the id), so the rank that
//! makes id `i` is the first rank of block `i`, as NCCL's user guide recommends
//! (`rankHasRoot`). Ranks are laid out node after node, so with blocks at least a node wide
//! every root is on its own node.
//!
//! The coordinator decides the plan ([`roots`]) once per communicator and generation, so that
//! every rank uses the same ids in the same order.

/// Ranks per bootstrap root unless configured: PyTorch's default (`TORCH_NCCL_RANKS_PER_ROOT`,
/// 128), above which `ProcessGroupNCCL` switches to `ncclCommInitRankScalable` with one root
/// per 128 ranks.
pub const DEFAULT_RANKS_PER_ROOT: u32 = 128;

/// The ranks that make the unique ids of a communicator of `world_size` ranks with at most
/// `ranks_per_root` ranks per id, in id order: `[0]` (one id, as `ncclCommInitRankConfig`)
/// when the world fits one root or `ranks_per_root` is 0 (scalable bootstrap off).
pub fn roots(world_size: u32, ranks_per_root: u32) -> Vec<u32> {
    if ranks_per_root == 0 || world_size <= ranks_per_root {
        return vec![0];
    }
    let ids = world_size.div_ceil(ranks_per_root);
    (0..ids).map(|i| first_rank(i, world_size, ids)).collect()
}

/// The first rank of block `id` of `ids` over `world_size` ranks (NCCL's `firstRankFromRoot`).
fn first_rank(id: u32, world_size: u32, ids: u32) -> u32 {
    id * (world_size / ids) + id.min(world_size % ids)
}

/// Which id rank `rank` bootstraps through (NCCL's `rootIdFromRank`), of `ids` over
/// `world_size` ranks.
pub fn root_of(rank: u32, world_size: u32, ids: u32) -> u32 {
    let extra = world_size % ids;
    let per = world_size / ids;
    let wide = extra * (per + 1);
    if rank < wide {
        rank / (per + 1)
    } else {
        (rank - wide) / per + extra
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    /// NCCL's user guide: 3 ids over 7 ranks are made by ranks 0, 3 and 5.
    #[test]
    fn the_user_guides_example() {
        assert_eq!(roots(7, 3), [0, 3, 5]);
    }

    /// One id while the world fits one root, or when the scalable bootstrap is off.
    #[test]
    fn one_root_up_to_the_limit() {
        assert_eq!(roots(1, 128), [0]);
        assert_eq!(roots(128, 128), [0]);
        assert_eq!(roots(100_000, 0), [0]);
        assert_eq!(roots(129, 128), [0, 65]);
    }

    /// Every rank's block starts at its root, no block is larger than asked, and the blocks
    /// differ by at most one rank: at 100,000 ranks and 12,500 nodes of 8, each root is on a
    /// node of its own.
    #[test]
    fn blocks_are_even_and_start_at_their_root() {
        for (world, per) in [
            (100_000, 128),
            (16_384, 128),
            (1000, 7),
            (9, 2),
            (1_000_000, 128),
        ] {
            let plan = roots(world, per);
            let ids = plan.len() as u32;
            assert_eq!(ids, world.div_ceil(per));
            let mut sizes = vec![0u32; plan.len()];
            for rank in 0..world {
                let id = root_of(rank, world, ids);
                assert!(plan[id as usize] <= rank, "{world}/{per}: rank {rank}");
                sizes[id as usize] += 1;
            }
            for (id, root) in plan.iter().enumerate() {
                assert_eq!(root_of(*root, world, ids), id as u32, "{world}/{per}");
            }
            let (min, max) = (sizes.iter().min().unwrap(), sizes.iter().max().unwrap());
            assert!(max - min <= 1 && *max <= per, "{world}/{per}: {min}..{max}");
        }
        let nodes: std::collections::HashSet<u32> =
            roots(100_000, 128).iter().map(|r| r / 8).collect();
        assert_eq!(nodes.len(), 782);
    }
}
