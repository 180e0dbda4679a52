"""The dev BLEU record store: one JSON file per checkpoint, beside Ray Train's checkpoints.

Each validation writes a record, ``<Ray Train run dir>/dev_bleu/<checkpoint>.json`` (status
validated | skipped | failed, scores, settings, seconds): the train stage sums them up, early
stopping reads them as they appear, ``average`` reads them to select by dev BLEU (and writes the
ones it scores itself), ``score``'s report lists them, the Table 3 runner takes the final
checkpoint's (``table3_dev_bleu``). Records outlive Ray's checkpoint rotation.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from pipeline import storage
from pipeline.decoding.dev_bleu import DevBleuSettings, record_key

log = logging.getLogger(__name__)

RECORDS = "dev_bleu"  # folder of per-checkpoint records in the Ray Train run dir
SNAPSHOT = "checkpoint_manager_snapshot.json"  # Ray Train V2's (as pipeline.train.resume)


def step_of(checkpoint_name: str) -> int:
    """``checkpoint_0000100`` -> 100 (pipeline.train.checkpoint.checkpoint_dir_name)."""
    return int(checkpoint_name.rsplit("_", 1)[-1])


def newest_registered_step(run_dir: str) -> int:
    """The step of the latest checkpoint Ray Train registered (its snapshot); -1 if unreadable."""
    try:
        snap = json.loads(storage.read_text(storage.join(run_dir, SNAPSHOT)))
        return step_of((snap.get("latest_checkpoint_result") or {})["checkpoint_dir_name"])
    except (OSError, ValueError, KeyError, TypeError):
        return -1


def write_record(run_dir: str, record: dict[str, Any]) -> None:
    record = {**record, "finished": time.strftime("%Y-%m-%dT%H:%M:%S")}
    storage.write_json(storage.join(run_dir, RECORDS, f"{record['checkpoint']}.json"), record)


def record_names(run_dir: str) -> list[str]:
    """The names of the run's record files (none: [])."""
    try:
        return sorted(rel for rel, _ in storage.list_files(storage.join(run_dir, RECORDS)) if rel.endswith(".json"))
    except (FileNotFoundError, OSError):
        return []


def read_record(run_dir: str, name: str) -> dict[str, Any]:
    """One record (OSError / ValueError while it is being written)."""
    return storage.read_json(storage.join(run_dir, RECORDS, name))


def read_records(run_dir: str) -> list[dict[str, Any]]:
    """Every record of the run, by step (none: [])."""
    records = []
    for name in record_names(run_dir):
        try:
            records.append(read_record(run_dir, name))
        except (OSError, ValueError):
            log.warning("dev BLEU: unreadable record %s", storage.join(run_dir, RECORDS, name))
    return sorted(records, key=lambda r: r.get("step", 0))


def scores_for(records: list[dict[str, Any]], settings: DevBleuSettings) -> dict[str, dict[str, Any]]:
    """checkpoint name -> its validated record made with ``settings`` (compared by
    ``dev_bleu.record_key``: a greedy CTranslate2 record holds for any alpha)."""
    key = record_key(settings.to_dict())
    return {r["checkpoint"]: r for r in records
            if r.get("status") == "validated" and record_key(r.get("settings") or {}) == key}


def table3_dev_bleu(train: dict[str, Any], metric: str) -> dict[str, Any]:
    """For the Table 3 runner: the dev BLEU of the row's final checkpoint (§6.2: no averaging) as
    validated during training, with its decoding settings; {} when training made none."""
    final = train.get("final_step")
    dev = train.get("dev_bleu") or {}
    rec = next((r for r in read_records(dev["run_dir"]) if r.get("step") == final
                and r.get("status") == "validated"), None) if dev.get("run_dir") else None
    if rec is None or metric not in rec:
        return {}
    s = rec["settings"]
    how = (f"dev BLEU of the step-{final} checkpoint during training: {rec['num_sentences']} sentences, "
           f"{rec['engine']}, beam {s['beam_size']}, alpha {s['alpha']}, max length {s['max_len_a']} * source + "
           f"{s['max_len_b']}")
    return {"bleu_dev_training": rec[metric], "bleu_sacre_dev_training": rec["bleu_sacre"],
            "bleu_dev_training_source": how}
