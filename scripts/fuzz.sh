#!/usr/bin/env bash
# Runs every fuzz target in fuzz/ for a bounded time (libFuzzer's -max_total_time).
# Usage: scripts/fuzz.sh [SECONDS_PER_TARGET] [TARGET...]   (default: 60 s, every target)
# Needs the nightly toolchain (`rustup toolchain install nightly`); installs cargo-fuzz if
# it is missing. Corpora grow under fuzz/corpus/<target>, crashes land in
# fuzz/artifacts/<target>/ and make the script exit non-zero.
set -euo pipefail
cd "$(dirname "$0")/../fuzz"
secs="${1:-60}"
shift || true
if ! cargo +nightly fuzz --version >/dev/null 2>&1; then
    cargo install cargo-fuzz --locked
fi
targets=("$@")
if [ ${#targets[@]} -eq 0 ]; then
    mapfile -t targets < <(cargo +nightly fuzz list)
fi
cargo +nightly fuzz build -O
status=0
for t in "${targets[@]}"; do
    mkdir -p "corpus/$t"
    echo "== $t: ${secs}s"
    log="$(mktemp)"
    # -close_fd_mask=1: the targets' stdout (agent_flags prints clap's help and version) is
    # dropped; libFuzzer reports and panic messages are on stderr.
    if cargo +nightly fuzz run -O "$t" -- -max_total_time="$secs" -rss_limit_mb=2048 -close_fd_mask=1 >"$log" 2>&1; then
        grep -E '^(#[0-9]+ +DONE|Done [0-9]+ runs)' "$log" || tail -n 3 "$log"
    else
        grep -E '(ERROR|SUMMARY|panicked|Test unit written)' "$log" || tail -n 20 "$log"
        echo "!! $t found a crash; see fuzz/artifacts/$t/"
        status=1
    fi
    rm -f "$log"
done
exit "$status"
