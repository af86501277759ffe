#!/usr/bin/env bash
# The main job: a 4-process local job on the agent's embedded coordinator. The workers
# rendezvous, get their ranks, run main_process_first (and its compute-once-and-share
# variant), share an NCCL unique id, pass 100 barriers and exit cleanly.
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -q -p muster-agent -p muster --examples --bins
agent=target/release/muster-agent
"$agent" launch --nproc-per-node 4 -- target/release/examples/main_first
"$agent" launch --nproc-per-node 4 -- target/release/examples/barrier_loop --iters 100
