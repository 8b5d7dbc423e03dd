#!/usr/bin/env bash
# Create ./.venv with torch and ddpq (editable, with the dev tools). Safe to run again: it
# reinstalls only when pyproject.toml changed.
# torch goes in first, pinned (2.13.0), so a loose requirement never pulls a build nobody
# chose: scripts/torch-install-args.sh picks DDPQ_TORCH_SPEC/DDPQ_TORCH_INDEX_URL, else a
# local wheel pip finds, else the CPU build on a machine without a CUDA GPU, else the CUDA one.
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
  # An array: a spec with pip options (an index URL) reaches pip as separate arguments.
  torch_args=()
  mapfile -t torch_args < <(scripts/torch-install-args.sh)
  [ "${#torch_args[@]}" -gt 0 ] || { echo "setup: no torch install arguments" >&2; exit 1; }
  pipq "${torch_args[@]}"
fi
echo "setup: installing ddpq[dev]"
pipq -e '.[dev]'
python -c "import torch, fastapi, sqlalchemy, service" >/dev/null
echo "$want" > "$stamp"
