"""The parts of benchmarks/peer_eole.py (ours vs eole 0.6.4 on Multi30k), one concern each.

``ours``: our workflow run up to ``score`` on the budget's steps. ``eole_setup``: eole's venv, our
data and vocabulary written as eole's files, eole's training config. ``eole_run``: eole trained
for our train loop's seconds, its last checkpoints averaged, ``eole predict``. ``report``: the
sacreBLEU scores, the side-by-side table with its notes, the JSON result.
"""

from __future__ import annotations

import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def log(msg: str) -> None:
    print(f"[peer_eole {time.strftime('%H:%M:%S')}] {msg}", flush=True)
