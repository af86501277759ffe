//! Accelerate's process model, shown: `main_process_first` (the main process runs first, the
//! others after it, every process runs the block), `main_process_first_share` (the main process
//! computes, the others receive), `local_main_process_first`, and NCCL unique-id distribution.

use std::{
    process::ExitCode,
    thread::sleep,
    time::{Duration, SystemTime, UNIX_EPOCH},
};

use muster::{Accelerator, NCCL_UNIQUE_ID_BYTES};

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("main_first: {e}");
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<(), muster::Error> {
    let accelerator = Accelerator::from_env()?;
    let rank = accelerator.process_index();
    muster::print!(
        accelerator,
        "node {} of {}: {} local processes, {} in all, generation {}",
        accelerator.node_rank(),
        accelerator.num_nodes(),
        accelerator.local_num_processes(),
        accelerator.num_processes(),
        accelerator.generation()
    );

    // Every process runs the block; the main process first (it sleeps so that the ordering is
    // visible), the others only once it is done. Each line carries the wall clock in
    // nanoseconds, the order that counts: lines from several processes may reach a merged
    // console in another order.
    accelerator.main_process_first(|| {
        println!("rank={rank} main_process_first: start at_ns={}", now_ns());
        if accelerator.is_main_process() {
            sleep(Duration::from_millis(200));
        }
        println!("rank={rank} main_process_first: done at_ns={}", now_ns());
    })?;

    // Only the main process computes; the others receive its value.
    let vocabulary: Vec<String> = accelerator.main_process_first_share(|| {
        println!("rank={rank} main_process_first_share: computing the vocabulary");
        sleep(Duration::from_millis(100));
        ["<pad>", "hello", "world"].map(String::from).to_vec()
    })?;
    if !accelerator.is_main_process() {
        println!(
            "rank={rank} main_process_first_share: received {vocabulary:?} without computing it"
        );
    }

    // The same per node: local rank 0 first, then the other processes of its node.
    accelerator.local_main_process_first(|| {
        println!(
            "rank={rank} local_main_process_first: node {} local rank {}",
            accelerator.node_rank(),
            accelerator.local_process_index()
        );
    })?;

    // Rank 0 is the root of communicator "world": it publishes the id, everyone fetches it.
    if accelerator.is_main_process() {
        accelerator.publish_nccl_unique_id("world", &pseudo_random_id())?;
    }
    let id = accelerator.fetch_nccl_unique_id("world")?;
    println!(
        "rank={rank} nccl unique id 'world': digest={:016x}",
        fnv1a(&id)
    );

    accelerator.wait_for_everyone()?;
    accelerator.finish()
}

/// 128 bytes that differ from run to run (a stand-in for `ncclGetUniqueId`).
fn pseudo_random_id() -> [u8; NCCL_UNIQUE_ID_BYTES] {
    let nanos = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let mut state = nanos ^ (u64::from(std::process::id()) << 32);
    let mut id = [0u8; NCCL_UNIQUE_ID_BYTES];
    for chunk in id.chunks_mut(8) {
        // SplitMix64.
        state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = state;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        chunk.copy_from_slice(&(z ^ (z >> 31)).to_le_bytes());
    }
    id
}

/// A short digest to compare ids by eye (FNV-1a, 64 bits).
fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |hash, byte| {
        (hash ^ u64::from(*byte)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// Nanoseconds since the Unix epoch: one clock for every process of the machine.
fn now_ns() -> u128 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos())
}
