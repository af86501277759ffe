#!/usr/bin/env bash
# The NCCL checks on a GPU machine, from binaries built elsewhere (`scripts/gpu-pack.sh` puts
# them in .gpu/): the SDK's NCCL unit tests, the `nccl_check` example under `muster-agent
# launch` (one rank per GPU; with one GPU, a second rank must be refused naming the device), and
# `muster.torch` with torch's NCCL backend (bench/python/nccl_gpu.py) through `muster.torch`,
# `muster://` and, for comparison, torchrun's `env://`, and torch's Flight Recorder over NCCL read by
# the agent (bench/python/fr_nccl.py). Needs python3 with torch and the
# `nvidia-nccl` wheel (the GPU image has both); the CI machine has no GPU and never runs this.
#
# Usage: scripts/gpu-check.sh [ARTIFACTS_DIR [OUT_DIR]]; exits 1 if any check failed.
set -uo pipefail
cd "$(dirname "$0")/.."
art=$(realpath "${1:-.gpu}")
out=${2:-${OUT:-/tmp/gpu-check}}
mkdir -p "$out"
export PYTHONUNBUFFERED=1
nvidia-smi -L
nccl_lib=$(python3 -c 'import nvidia.nccl, os; print(os.path.join(list(nvidia.nccl.__path__)[0], "lib"))' || true)
# The nvidia-nccl wheel's libnccl.so.2, found by name as a user's LD_LIBRARY_PATH would have it.
export LD_LIBRARY_PATH="$nccl_lib:${LD_LIBRARY_PATH:-}"
py=$(command -v python3)
# Where the unit test that loads PyTorch's NCCL wheel looks for it.
export MUSTER_PEERS_VENV=$("$py" -c 'import sys; print(sys.prefix)')
export PYTHONPATH="$art/site"
agent="$art/bin/muster-agent"
failed=()

# step NAME SECONDS COMMAND...: runs COMMAND with a time limit, logging to $out/NAME.log.
step() {
    local name=$1 limit=$2
    shift 2
    echo "== $name: $*"
    local start=$(date +%s%N)
    timeout "$limit" "$@" > "$out/$name.log" 2>&1
    local rc=$?
    cat "$out/$name.log"
    echo "== $name: rc=$rc after $(( ($(date +%s%N) - start) / 1000000 )) ms"
    return $rc
}

step unit 120 "$art/bin/muster-lib-tests" comm::nccl --test-threads=1 --nocapture || failed+=(unit)
# A test that found no GPU prints "skipped:" and passes: here that is a failure.
if grep -q "skipped:" "$out/unit.log"; then failed+=(unit-skipped); fi
step check-1 90 "$agent" launch --nproc-per-node 1 -- "$art/bin/nccl_check" --mib 64 --iters 20 \
    || failed+=(check-1)
step check-1-256 90 "$agent" launch --nproc-per-node 1 -- "$art/bin/nccl_check" --mib 256 --iters 10 \
    || failed+=(check-1-256)
# Two ranks on one GPU: rank 1 must fail fast, naming the missing device, and the job end.
if step check-2 60 "$agent" launch --nproc-per-node 2 --max-restarts 0 -- "$art/bin/nccl_check" --mib 1; then
    failed+=(check-2-succeeded)
elif ! grep -q "needs CUDA device 1" "$out/check-2.log"; then
    failed+=(check-2-unclear)
fi
for how in muster url; do
    step "torch-$how" 120 "$agent" launch --nproc-per-node 1 -- "$py" bench/python/nccl_gpu.py --how "$how" \
        || failed+=("torch-$how")
done
step torch-env 120 torchrun --standalone --nproc-per-node 1 bench/python/nccl_gpu.py --how env || failed+=(torch-env)
# torch's Flight Recorder over NCCL through the agent (docs/hangs.md): an unmodified NCCL
# script, its stacks dumped while it sleeps; the rank's last collective must be NCCL's.
flight() {
    FR_SLEEP=60 "$agent" launch --nproc-per-node 1 --job-id fr-nccl --hang-timeout off -- \
        "$py" bench/python/fr_nccl.py > "$out/fr-launch.out" 2> "$out/fr-launch.err" &
    local launch=$! addr="" i
    for i in $(seq 90); do
        grep -q "ready rank=0" "$out/fr-launch.out" && break
        sleep 1
    done
    addr=$(grep -o "coordinator 127[0-9.:]*" "$out/fr-launch.err" | head -1 | cut -d' ' -f2)
    "$agent" describe --coordinator "$addr" fr-nccl --stacks
    local rc=$?
    kill "$launch"
    wait "$launch"
    cat "$out/fr-launch.err"
    return $rc
}
export -f flight
export agent py out
step flight-recorder 150 bash -c flight || failed+=(flight-recorder)
grep -q "last called collective #[0-9]* nccl:all_reduce \[1024\]" "$out/flight-recorder.log" \
    || failed+=(flight-recorder-no-nccl)
grep -h "allreduce_gpu_ms\|per call" "$out"/*.log
if [ ${#failed[@]} -gt 0 ]; then
    echo "gpu-check.sh: FAILED: ${failed[*]}"
    exit 1
fi
echo "gpu-check.sh: every check passed"
