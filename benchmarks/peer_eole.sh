#!/usr/bin/env bash
# Ours vs eole 0.6.4 on Multi30k at equal wall-clock training time: see
# benchmarks/peer_eole.py. eole goes into its own venv (.venv-eole, or --eole-venv), never .venv.
#   benchmarks/peer_eole.sh --budget-s 600 --out work/peer-eole/peer_eole.json
set -euo pipefail
cd "$(dirname "$0")/.."
exec .venv/bin/python benchmarks/peer_eole.py "$@"
