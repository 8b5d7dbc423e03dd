#!/usr/bin/env bash
# Install Debian packages quietly: `scripts/apt-install.sh PKG...` runs apt-get update and
# install without prompts or progress output. apt's and dpkg's output goes to a log, shown
# (its last 40 lines) only when apt fails; exits with apt's status then. Uses sudo unless
# run as root. The log: $DDPQ_APT_LOG (default: a new file under ${TMPDIR:-/tmp}).
set -euo pipefail
(($# > 0)) || { echo "usage: $0 PACKAGE..." >&2; exit 2; }
SUDO=()
[[ "$(id -u)" == "0" ]] || SUDO=(sudo)
log="${DDPQ_APT_LOG:-$(mktemp "${TMPDIR:-/tmp}/ddpq-apt.XXXXXX.log")}"
# Wait for another apt (unattended upgrades) instead of failing on its lock.
apt=("${SUDO[@]}" env DEBIAN_FRONTEND=noninteractive apt-get -qq -o DPkg::Lock::Timeout=600)
rc=0
{ "${apt[@]}" update && "${apt[@]}" install -y --no-install-recommends "$@"; } >>"$log" 2>&1 || rc=$?
if ((rc != 0)); then
    echo "apt-install: installing $* failed (exit $rc); the end of $log:" >&2
    tail -40 "$log" >&2
    exit "$rc"
fi
