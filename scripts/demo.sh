#!/usr/bin/env bash
# The main job: 4-process local jobs on the agent's embedded coordinator. The workers
# rendezvous, get their ranks, run main_process_first (and its compute-once-and-share
# variant), share an NCCL unique id, pass 100 barriers and exit cleanly; then a data-parallel
# training job (ddp_train) checkpoints every 10 steps, loses its last rank on step 15, is
# restarted by the agent and resumes from its newest checkpoint.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo build --release -q -p muster-agent -p muster --examples --bins
agent=target/release/muster-agent
"$agent" launch --nproc-per-node 4 -- target/release/examples/main_first
"$agent" launch --nproc-per-node 4 -- target/release/examples/barrier_loop --iters 100
run=$(mktemp -d)
trap 'rm -rf "$run"' EXIT
"$agent" launch --nproc-per-node 4 --max-restarts 1 -- target/release/examples/ddp_train \
    --epochs 3 --checkpoint-dir "$run" --checkpoint-every 10 --fail-at-step 15 --out "$run/final"
