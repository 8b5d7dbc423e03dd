#!/usr/bin/env bash
# The test suite.
#
#   scripts/test.sh          everything, as CI runs it: set up, bring up what the tests need
#                            (PostgreSQL, headless Chromium, a dev Slurm cluster), lint,
#                            type-check, then pytest in two passes: every independent test on
#                            several processes (pytest-xdist), then the `serial` ones alone.
#   scripts/test.sh --fast   the lane to run after every change (a few minutes): tests/unit
#                            and tests/integration on SQLite, no slow test, no service to start.
#
# Extra arguments go to pytest (e.g. scripts/test.sh tests/unit -k spec).
# DDPQ_TEST_WORKERS=N sets the pytest processes (default 4: most tests wait on processes, the
# network or the database, so 4 keep a 2-core box busy (6 overload it); 0 runs here).
# DDPQ_TEST_DRY_RUN=1 prints the pytest commands and runs nothing.
set -euo pipefail
cd "$(dirname "$0")/.."

fast=0
if [ "${1:-}" = "--fast" ]; then
  fast=1
  shift
fi
workers=${DDPQ_TEST_WORKERS:-4}
xdist=()
if [ "$workers" != "0" ]; then
  # loadgroup: tests that share the Slurm cluster or the root network namespace keep one
  # process (tests/conftest.py: XDIST_GROUPS, read by its pytest_xdist_make_scheduler).
  xdist=(-n "$workers" --dist loadgroup)
fi

if [ "$fast" = "1" ]; then
  passes=("python -m pytest ${xdist[*]} -m 'not slow and not postgres and not serial and not slurm' tests/unit tests/integration")
else
  # The 15 slowest tests, so a test that got slow shows up; a later --durations=N wins.
  passes=(
    "python -m pytest ${xdist[*]} --durations=15 -m 'not serial'"
    "python -m pytest --durations=5 -m serial"
  )
fi

if [ "${DDPQ_TEST_DRY_RUN:-0}" = "1" ]; then
  for pass in "${passes[@]}"; do
    printf '%s' "$pass"
    [ "$#" -eq 0 ] || printf ' %q' "$@"
    printf '\n'
  done
  exit 0
fi

scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate

if [ "$fast" = "0" ]; then
  if ! pg_isready -q -h 127.0.0.1 -p 5432 2>/dev/null; then
    if command -v pg_ctlcluster >/dev/null && [ -d /etc/postgresql ]; then
      echo "test: starting PostgreSQL"
      pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -1)" main start
    else
      echo "test: PostgreSQL is not reachable at 127.0.0.1:5432 (set DDPQ_TEST_PG_URL)" >&2
    fi
  fi
  [ -x scripts/install-browser.sh ] && scripts/install-browser.sh
  if [ -x scripts/slurm-dev-cluster.sh ] && [ "${DDPQ_TEST_SLURM:-1}" = "1" ]; then
    scripts/slurm-dev-cluster.sh up && export DDPQ_TEST_SLURM=1
  fi
fi

# The linters run beside the first pytest pass (mypy alone takes ~30 s of one core that the
# tests, mostly waiting on processes, leave free); their verdict counts as a pass's.
echo "test: ruff + mypy + lint-imports (beside pytest; their output comes after it)"
lint_log=$(mktemp)
(ruff check . && mypy && lint-imports) >"$lint_log" 2>&1 &
lint_pid=$!
# Interrupted or done, leave no linter running and no log behind.
trap 'kill "$lint_pid" 2>/dev/null || true; rm -f "$lint_log"' EXIT

rc=0
for i in "${!passes[@]}"; do
  set +e
  eval "${passes[$i]}" '"$@"'
  pass_rc=$?
  set -e
  if [ "$pass_rc" -eq 5 ]; then
    if [ "$i" -gt 0 ] && [ "$#" -gt 0 ]; then
      pass_rc=0  # the tests asked for include no serial one
    else
      echo "test: pytest collected no tests — that is a failure" >&2
      pass_rc=1
    fi
  fi
  if [ "$rc" -eq 0 ]; then
    rc=$pass_rc
  fi
done
set +e
wait "$lint_pid"
lint_rc=$?
set -e
echo "test: ruff + mypy + lint-imports:"
cat "$lint_log"
rm -f "$lint_log"
if [ "$lint_rc" -ne 0 ]; then
  echo "test: the linters failed (exit $lint_rc)" >&2
  [ "$rc" -ne 0 ] || rc=$lint_rc
fi
exit "$rc"
