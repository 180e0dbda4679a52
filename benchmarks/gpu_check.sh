#!/usr/bin/env bash
# The GPU path in one command (<= 10 minutes on one GPU), on a bare CUDA image: it needs only a
# Python >= 3.11 with a CUDA torch >= 2.11, numpy, pyarrow and sentencepiece (no Ray, MLflow,
# CTranslate2, transformers...), installs nothing and writes gpu_check.json here.
#   bash benchmarks/gpu_check.sh [--peak-flops 989e12] [--json gpu_check.json] [--smoke]
# PYTHON=... picks the interpreter (default: .venv/bin/python if present, else python3).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-$( [ -x .venv/bin/python ] && echo .venv/bin/python || echo python3 )}"
if [[ " $* " != *" --smoke "* ]]; then
  "$PYTHON" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 'gpu_check: torch sees no CUDA GPU (--smoke runs on a CPU)')"
  nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
fi
exec timeout 590 "$PYTHON" benchmarks/gpu_check.py "$@"
