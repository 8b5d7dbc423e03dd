#!/usr/bin/env bash
# Benchmarks #1 and #2 on one GPU (a few minutes): a small bf16 transformer's steps/s with
# ddpq's sink vs no reporting vs naive .item()+INSERT, and the checkpoint stall of a
# ~1.2 GB model + AdamW state (the size of the H200 reference figures in issue 7).
# Usage (from the repository root, venv active):  bash bench/gpu.sh [OUT_DIR]
set -euo pipefail
out="${1:-bench-gpu-results}"
mkdir -p "$out"
export OMP_NUM_THREADS=1
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$out/gpu.txt"
python -c "import torch; assert torch.cuda.is_available(), 'CUDA is not available'; print(torch.__version__)"
python -m bench.gpu_reporting --size default --json "$out/gpu_reporting.json"
python -m bench.checkpoint --size default --device cuda --mbytes "${DDPQ_BENCH_CKPT_MB:-1200}" \
    --json "$out/checkpoint_gpu.json"
echo "results in $out/"
