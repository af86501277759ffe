#!/usr/bin/env bash
# Runs one end-to-end test (or one end-to-end file's tests) N times and prints how many runs
# passed: the check that a test is not flaky (docs/develop.md). TEST is FILE, for every test
# of tests/tests/FILE.rs, or FILE::NAME for one of them. The binaries are built first, as the
# full tier builds them; a failing run's output is kept under target/repeat/, a passing one's
# is removed. Exits 0 only when every run passed.
#
# Usage: scripts/repeat.sh FILE[::NAME] N
set -euo pipefail
cd "$(dirname "$0")/.."
if [ $# -ne 2 ]; then
  echo "usage: scripts/repeat.sh FILE[::NAME] N (a test file of tests/tests/, and a test in it)" >&2
  exit 64
fi
file=${1%%::*}
name=${1#*::}
[ "$name" = "$1" ] && name=""
n=$2
case $n in
  '' | *[!0-9]* | 0) echo "repeat.sh: N must be a positive number, not '$n'" >&2; exit 64 ;;
esac
if [ ! -f "tests/tests/$file.rs" ]; then
  echo "repeat.sh: there is no tests/tests/$file.rs" >&2
  exit 64
fi
cargo build --workspace --bins --examples -q
cargo test -q -p muster-tests --test "$file" --no-run
out="target/repeat/$file${name:+-$name}"
mkdir -p "$out"
filter=()
[ -n "$name" ] && filter=(--exact "$name")
pass=0
for i in $(seq 1 "$n"); do
  log="$out/run-$i.log"
  if cargo test -q -p muster-tests --test "$file" -- "${filter[@]}" >"$log" 2>&1; then
    pass=$((pass + 1))
    rm -f "$log"
  else
    echo "repeat.sh: run $i of $n failed; its output: $log"
  fi
done
echo "$1: $pass of $n passed"
[ "$pass" -eq "$n" ]
