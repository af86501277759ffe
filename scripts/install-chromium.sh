#!/usr/bin/env bash
# Installs Debian's chromium for the web view's headless browser test (tests/tests/web_view.rs),
# only when it is missing; safe to run again. Exits non-zero when it cannot (no apt, no root and
# no sudo, no network): the test then skips with the reason this script printed.
set -euo pipefail
if command -v chromium >/dev/null 2>&1; then
  exit 0
fi
if ! command -v apt-get >/dev/null 2>&1; then
  echo "install-chromium.sh: apt-get not found (chromium is installed from Debian's packages)" >&2
  exit 1
fi
sudo=""
if [ "$(id -u)" -ne 0 ]; then
  if ! sudo -n true 2>/dev/null; then
    echo "install-chromium.sh: not root and sudo needs a password; install chromium yourself" >&2
    exit 1
  fi
  sudo="sudo -n"
fi
# Several test processes may call this at once: one installs, the others wait for it.
exec 9>"${TMPDIR:-/tmp}/muster-install-chromium.lock"
flock 9
command -v chromium >/dev/null 2>&1 && exit 0
$sudo apt-get update -qq
DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends chromium >/dev/null
command -v chromium >/dev/null 2>&1
