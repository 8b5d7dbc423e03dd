#!/usr/bin/env bash
# The whole test suite, as CI runs it: set up, bring up what the tests need (PostgreSQL,
# headless Chromium, a dev Slurm cluster), lint, type-check, then pytest. Extra arguments go to
# pytest (e.g. scripts/test.sh -m "not slow" tests/unit).
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate

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

echo "test: ruff + mypy + lint-imports"
ruff check .
mypy
lint-imports

set +e
# The 15 slowest tests, so a test that got slow shows up; a later --durations=N wins.
python -m pytest --durations=15 "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "test: pytest collected no tests — that is a failure" >&2
  exit 1
fi
exit "$rc"
