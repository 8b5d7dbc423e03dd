#!/usr/bin/env bash
# Create ./.venv with torch and ddpq (editable, with the dev tools). Safe to run again: it
# reinstalls only when pyproject.toml changed.
# torch goes in first, pinned, so pip takes the local CPU wheel (2.13.0) instead of pulling a
# multi-GB CUDA build to satisfy a loose requirement. Override with DDPQ_TORCH_SPEC.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  echo "setup: creating .venv with $($PY --version)"
  "$PY" -m venv .venv
fi
# shellcheck disable=SC1091
. .venv/bin/activate
stamp=.venv/.ddpq-installed
want=$(sha256sum pyproject.toml | cut -d' ' -f1)
if [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$want" ] && python -c "import torch, service" 2>/dev/null; then
  exit 0
fi
log=.venv/pip.log
pipq() {
  # pip's output goes to a log; shown only when pip fails.
  if ! python -m pip install "$@" >>"$log" 2>&1; then
    echo "setup: pip install $* failed; the end of $log:" >&2
    tail -30 "$log" >&2
    exit 1
  fi
}
pipq --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  echo "setup: installing ${DDPQ_TORCH_SPEC:-torch==2.13.0}"
  pipq "${DDPQ_TORCH_SPEC:-torch==2.13.0}"
fi
echo "setup: installing ddpq[dev]"
pipq -e '.[dev]'
python -c "import torch, fastapi, sqlalchemy, service" >/dev/null
echo "$want" > "$stamp"
