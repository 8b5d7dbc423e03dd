#!/usr/bin/env bash
# Decide how scripts/setup.sh installs torch; install nothing. Prints the arguments for
# `pip install`, one per line, on stdout, and one line saying which path was taken and
# roughly what it downloads on stderr. Decisions, first match wins:
#   1. DDPQ_TORCH_SPEC and/or DDPQ_TORCH_INDEX_URL set: exactly that. DDPQ_TORCH_SPEC is
#      split like a shell would (quotes kept together), so it may carry pip options, e.g.
#      DDPQ_TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu";
#      DDPQ_TORCH_INDEX_URL adds `--index-url URL` (the spec defaults to the pinned torch).
#   2. pip finds a wheel of the pinned torch without an index (its find-links: pip.conf,
#      PIP_FIND_LINKS): that local file, no download.
#   3. no CUDA GPU (`nvidia-smi -L` lists none; without nvidia-smi, no /dev/nvidia0): the CPU
#      build from PyTorch's CPU wheel index, about 200 MB.
#   4. otherwise the default build from the package index: CUDA, about 3 GB with its
#      nvidia-* libraries.
# Uses the `python` on PATH (setup.sh runs it inside .venv) for pip and for the splitting.
set -euo pipefail
TORCH_PIN=torch==2.13.0
CPU_INDEX_URL=https://download.pytorch.org/whl/cpu
say() { echo "setup: torch: $*" >&2; }
has_cuda_gpu() {
  if command -v nvidia-smi >/dev/null 2>&1; then
    nvidia-smi -L 2>/dev/null | grep -q '^GPU'
  else
    [ -e /dev/nvidia0 ]
  fi
}

if [ -n "${DDPQ_TORCH_SPEC:-}" ] || [ -n "${DDPQ_TORCH_INDEX_URL:-}" ]; then
  args=()
  if [ -n "${DDPQ_TORCH_SPEC:-}" ]; then
    # shlex, not eval: quotes group words, but nothing in the value is executed or expanded.
    words=$(python -c 'import shlex, sys; print("\n".join(shlex.split(sys.argv[1])))' \
      "$DDPQ_TORCH_SPEC") && [ -n "$words" ] || {
      echo "setup: DDPQ_TORCH_SPEC=$DDPQ_TORCH_SPEC: not words a shell could split" >&2
      exit 2
    }
    mapfile -t args <<<"$words"
  else
    args=("$TORCH_PIN")
  fi
  [ -n "${DDPQ_TORCH_INDEX_URL:-}" ] && args+=(--index-url "$DDPQ_TORCH_INDEX_URL")
  say "as asked (DDPQ_TORCH_SPEC/DDPQ_TORCH_INDEX_URL): pip install ${args[*]}"
elif python -m pip install --dry-run --no-index --no-deps --ignore-installed --quiet \
  "$TORCH_PIN" >/dev/null 2>&1; then
  args=("$TORCH_PIN")
  say "$TORCH_PIN from a local wheel that pip finds without an index (find-links); no download"
elif ! has_cuda_gpu; then
  args=("$TORCH_PIN" --index-url "$CPU_INDEX_URL")
  say "no CUDA GPU found: the CPU build from $CPU_INDEX_URL (about 200 MB)"
else
  args=("$TORCH_PIN")
  say "CUDA GPU found: the default (CUDA) build from the package index" \
    "(about 3 GB with its nvidia-* libraries)"
fi
printf '%s\n' "${args[@]}"
