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
read -r url host port < <(python -c "from service.core.config import Settings; s = Settings(); print(s.resolved_api_url, s.host, s.port)")
# Anything listening there (a ddpq or any other server) would make `ddpq up` fail.
if python - "$host" "$port" <<'PY' 2>/dev/null; then
import socket, sys
socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close()
PY
  echo "demo: something already listens at $url — stop it, or pick another port: DDPQ_PORT=8001 scripts/demo.sh" >&2
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
echo "demo: done. Everything is stored in $DDPQ_HOME/. Run '. .venv/bin/activate && ddpq up --port $port' and open $url to browse it."
