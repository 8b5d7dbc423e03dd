#!/usr/bin/env bash
# The main job on the embedded default: SQLite + one local worker, a real 2-rank DDP training
# job (digits, gloo on CPU), watched live until it ends. State stays in ./.ddpq/.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# shellcheck disable=SC1091
. .venv/bin/activate
export DDPQ_HOME=${DDPQ_HOME:-.ddpq}
mkdir -p "$DDPQ_HOME"
url=$(python -c "from service.config import Settings; print(Settings().resolved_api_url)")
if python - "$url" <<'PY' 2>/dev/null; then
import sys, httpx
httpx.get(sys.argv[1] + "/healthz", timeout=1).raise_for_status()
PY
  echo "demo: something already answers at $url — stop it (or set DDPQ_PORT) and run again." >&2
  exit 2
fi
ddpq db upgrade
echo "demo: starting the API and a local worker (log: $DDPQ_HOME/up.log)"
ddpq up >"$DDPQ_HOME/up.log" 2>&1 &
up_pid=$!
stop() { kill -TERM "$up_pid" 2>/dev/null && wait "$up_pid" 2>/dev/null || true; }
trap stop EXIT
for _ in $(seq 1 60); do
  if python - "$url" <<'PY' 2>/dev/null; then break; fi
import sys, httpx
httpx.get(sys.argv[1] + "/readyz", timeout=1).raise_for_status()
PY
  kill -0 "$up_pid" 2>/dev/null || { echo "demo: ddpq up exited; see $DDPQ_HOME/up.log" >&2; tail -20 "$DDPQ_HOME/up.log" >&2; exit 1; }
  sleep 0.5
done
echo "demo: dashboard and API at $url (while this runs)"
ddpq submit examples/digits.yaml --wait
echo
echo "demo: done. Everything is stored in $DDPQ_HOME/. Run '. .venv/bin/activate && ddpq up' and open $url to browse it."
