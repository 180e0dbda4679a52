#!/usr/bin/env bash
# The GPU path in one command (<= 8 minutes on one GPU): train steps eager and compiled with
# tokens/s and MFU, host syncs per step, checkpoint stall, beam-4 decoding. Installs nothing:
# PYTHON must have this project's dependencies and a CUDA torch (default: .venv/bin/python).
#   bash benchmarks/gpu_check.sh [--peak-flops 989e12] [--json gpu_check.json]
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
"$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA GPU')"
nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
exec timeout 480 "$PYTHON" benchmarks/gpu_check.py "$@"
