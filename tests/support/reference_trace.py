"""A bit-exact trace of the training step and of beam search, for refactors that must change no result.

Two fixtures, recorded once and committed (`tests/fixtures/reference_trace.json`), reproduced by
`tests/unit/core/test_reference_trace.py`:

- **losses**: the Multi30k tiny recipe (`configs/multi30k-tiny.toml`'s model and batch sizes, its seed,
  in fp32: bf16 is asked for by name only on CPUs that have it, and a fixture must mean the same
  everywhere) trained by the real loop (`Trainer` on a `LocalSession`) on
  the real Multi30k task-1 text: each step's loss and nll, the dev loss at the last step, and a
  digest of the final weights, all as exact bits.
- **beams**: beam 5 (alpha 1.0, the recipe's `[decode]`) over the first sentences of test_2016_flickr,
  as token ids, with the checkpoint `tests/support/tiny_model.py` trains deterministically (a 2+2-layer
  model on WMT news text: its beams are input-dependent, of every length, which a few steps of the
  recipe are not).

The text is the dataset's own lowercased tokenized files, cut into pieces by a SentencePiece BPE
model of 8000 pieces trained here on one thread (deterministic). One torch thread throughout: a
GEMM's reduction order, and so its last bit, may depend on the thread count.

The last bits also depend on which of ATen's CPU kernels run: PyTorch picks one set per machine
(`torch.backends.cpu.get_cpu_capability()`: "DEFAULT", "AVX2", "AVX512"), and a machine runs any
set below its own when `ATEN_CPU_CAPABILITY` names it. So the fixture holds one record per
capability (`capability()`, e.g. "x86_64 AVX2"), and a machine checks bits against its own
capability's record and against the nearest recorded one below it, that one in a subprocess under
`ATEN_CPU_CAPABILITY` (`records_to_check`). Nothing is compared by closeness.

    # record this machine's capability, at a commit whose results are the reference
    .venv/bin/python -m tests.support.reference_trace --write
    # record a capability below it (here: ATen's plain C++ kernels)
    ATEN_CPU_CAPABILITY=default .venv/bin/python -m tests.support.reference_trace --write
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import struct
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch

REPO = Path(__file__).resolve().parents[2]
FIXTURE = REPO / "tests" / "fixtures" / "reference_trace.json"
RECIPE = REPO / "configs" / "multi30k-tiny.toml"
TRAIN_STEPS = 8
BEAM_SENTENCES = 48


def _data(var: str, sub: str) -> Path:
    """$var, else ../shared/data/<sub>, else .test-data/<sub> (`make test-data`): as the tests' fixtures."""
    from tests.support.test_data import data_dir, missing

    found = data_dir(var, sub)
    if found is None:
        raise FileNotFoundError(missing(f"the {sub} test data", var))
    return found


def multi30k_dir() -> Path:
    return _data("MULTI30K_MIRROR", "multi30k") / "data" / "task1" / "tok"


def wmt14_dir() -> Path:
    return _data("WMT14_DATA", "wmt14")


def _lines(split: str, lang: str) -> list[str]:
    return (multi30k_dir() / f"{split}.lc.norm.tok.{lang}").read_text(encoding="utf-8").splitlines()


def _write_split(sp, out: Path, split: str, limit: int | None = None) -> Path:
    en, de = _lines(split, "en")[:limit], _lines(split, "de")[:limit]
    src = [ids + [3] for ids in sp.encode(en)]  # pieces + [eos]
    tgt = [ids for ids in sp.encode(de)]
    out.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({
        "idx": pa.array(np.arange(len(src), dtype=np.int64)),
        "src_ids": pa.array(src, pa.list_(pa.int32())),
        "tgt_ids": pa.array(tgt, pa.list_(pa.int32())),
        "src_len": pa.array([len(s) for s in src], pa.int32()),
        "tgt_len": pa.array([len(t) for t in tgt], pa.int32()),
        "tgt": pa.array(de),
    }), out / "part-00000.parquet")
    return out


def encode_multi30k(root: Path) -> dict[str, Path]:
    """SentencePiece (8000 BPE, our ids) on both sides of the training text, then the training split
    and the first 256 pairs of the dev split."""
    import sentencepiece as spm

    root.mkdir(parents=True, exist_ok=True)
    text = _lines("train", "en") + _lines("train", "de")
    spm.SentencePieceTrainer.train(sentence_iterator=iter(text), model_prefix=str(root / "spm"), vocab_size=8000,
                                   model_type="bpe", character_coverage=1.0, pad_id=0, unk_id=1, bos_id=2,
                                   eos_id=3, num_threads=1, minloglevel=2)
    sp = spm.SentencePieceProcessor(model_file=str(root / "spm.model"))
    return {"train": _write_split(sp, root / "train", "train"), "dev": _write_split(sp, root / "dev", "val", 256)}


def _beams(tiny: dict) -> tuple[list[list[int]], dict[str, torch.Tensor]]:
    """Beam 5 over the first BEAM_SENTENCES test_2016_flickr sources, 16 a batch; and the weights."""
    import sentencepiece as spm

    from model import ModelConfig, Transformer, beam_search
    from pipeline.decoding.batching import pad_batch

    mc = ModelConfig.from_dict(tiny["model_config"])
    state = torch.load(tiny["model"], map_location="cpu", weights_only=True)
    model = Transformer(mc)
    model.load_state_dict(state)
    model.eval()
    sp = spm.SentencePieceProcessor(model_file=tiny["spm"])
    src = [ids + [mc.eos_id] for ids in sp.encode(_lines("test_2016_flickr", "en")[:BEAM_SENTENCES])]
    with torch.inference_mode():
        beams = [list(map(int, hyp)) for i in range(0, len(src), 16)
                 for hyp in beam_search(model, pad_batch(src[i:i + 16], mc.pad_id), beam_size=5, alpha=1.0,
                                        max_len_a=1.0, max_len_b=50)]
    return beams, state


def _bits(x: float) -> str:
    return struct.pack(">d", float(x)).hex()


def _digest(state: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(state):
        h.update(name.encode())
        h.update(state[name].detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def trace(root: Path) -> dict:
    """Both fixtures, computed now under `root` (a scratch folder)."""
    from pipeline.config import load_config
    from pipeline.models import model_config_for
    from pipeline.train.loop import LocalSession, LoopSpec, Trainer
    from tests.support.tiny_model import news_pairs, train_tiny_model

    threads = torch.get_num_threads()
    try:
        splits = encode_multi30k(root / "data")
        cfg = load_config(RECIPE)
        cfg.train.max_steps, cfg.metrics.log_interval_steps, cfg.speed.precision = TRAIN_STEPS, 1, "fp32"
        cfg.metrics.val_loss_interval_steps = cfg.checkpoint.interval_steps = TRAIN_STEPS
        cfg.dev_bleu.enabled = False
        mc = model_config_for(cfg, {"vocab_size": 8000})
        spec = LoopSpec(cfg=cfg.to_dict(), model_config=mc.to_dict(), train_dir=str(splits["train"]),
                        dev_dir=str(splits["dev"]), num_threads=1)
        session = LocalSession(root / "ckpt")
        summary = Trainer(spec, session).run()
        state = torch.load(session.checkpoints()[-1] / "model.pt", map_location="cpu", weights_only=True)
        tiny = train_tiny_model(news_pairs(wmt14_dir()), root / "tiny")  # one thread, seeded
        beams, tiny_state = _beams(tiny)
        return {"precision": summary["precision"],
                "losses": [[_bits(h[1]), _bits(h[2])] for h in summary["history_train"]],
                "val": [[_bits(h[1]), _bits(h[2])] for h in summary["history_val"]],
                "weights_sha256": _digest(state), "tiny_weights_sha256": _digest(tiny_state), "beams": beams}
    finally:
        torch.set_num_threads(threads)


# ATen's CPU capabilities per architecture, lowest first: a machine can run every one up to its own.
LADDERS = {"x86_64": ("DEFAULT", "AVX2", "AVX512"), "aarch64": ("DEFAULT", "SVE256")}


def capability() -> str:
    """The architecture and the ATen CPU kernel set this process runs ("x86_64 AVX2"); under
    `ATEN_CPU_CAPABILITY=avx2` an AVX512 machine says "x86_64 AVX2"."""
    return f"{platform.machine()} {torch.backends.cpu.get_cpu_capability()}"


def records_to_check(own: str, recorded: list[str]) -> list[str]:
    """The records this machine compares bits against: its own capability's, if recorded, and the
    nearest recorded capability below it on the same architecture (run under ATEN_CPU_CAPABILITY).
    Empty when neither exists."""
    arch, cap = own.split(" ", 1)
    ladder = LADDERS.get(arch, (cap,))
    below = ladder[:ladder.index(cap)] if cap in ladder else ()
    lower = [f"{arch} {c}" for c in reversed(below) if f"{arch} {c}" in recorded][:1]
    return ([own] if own in recorded else []) + lower


def start_trace(key: str, root: Path) -> tuple[subprocess.Popen, Path]:
    """Start `trace` in a fresh process whose ATen kernels are those of capability `key` ("x86_64
    AVX2"); `finish_trace` reads its result. The trace runs on one thread, so it takes one core and
    runs beside this process's own trace on the other."""
    root.mkdir(parents=True, exist_ok=True)
    out, log = root / "trace.json", root / "trace.log"
    env = {**os.environ, "ATEN_CPU_CAPABILITY": key.split(" ", 1)[1].lower(), "OMP_NUM_THREADS": "1"}
    with open(log, "w") as f:
        proc = subprocess.Popen([sys.executable, "-m", "tests.support.reference_trace", "--out", str(out)],
                                cwd=REPO, env=env, stdout=f, stderr=subprocess.STDOUT)
    return proc, out


def finish_trace(proc: subprocess.Popen, out: Path, key: str) -> dict:
    """The trace of a `start_trace` process, once it ends; an error naming the capability if it failed."""
    if proc.wait() != 0:
        log = (out.parent / "trace.log").read_text()[-3000:]
        raise RuntimeError(f"the trace under ATEN_CPU_CAPABILITY for {key!r} failed (exit {proc.returncode}):\n{log}")
    got = json.loads(out.read_text())
    if got["capability"] != key:
        raise RuntimeError(f"asked for {key!r}, the subprocess ran {got['capability']!r}")
    return got


def machine() -> str:
    """The CPU's vendor and model name, recorded beside each record (for a reader; not part of the key)."""
    try:
        info = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or platform.machine()
    fields = {k.strip(): v.strip() for k, v in (line.split(":", 1) for line in info if ":" in line)}
    return " ".join(x for x in (fields.get("vendor_id"), fields.get("model name")) if x) or platform.machine()


def dumps(records: dict[str, dict]) -> str:
    """JSON with one beam per line (a diff then names the sentence that changed)."""
    parts = []
    for cls, got in records.items():
        beams = ",\n   ".join(json.dumps(b) for b in got["beams"])
        head = json.dumps({k: v for k, v in got.items() if k != "beams"})
        parts.append(f' {json.dumps(cls)}: {{\n  "record": {head},\n  "beams": [\n   {beams}\n  ]\n }}')
    return "{\n" + ",\n".join(parts) + "\n}\n"


def load() -> dict[str, dict]:
    """{cpu class: record}, each record with its "beams"."""
    return {cls: {**v["record"], "beams": v["beams"]} for cls, v in json.loads(FIXTURE.read_text()).items()}


def main() -> int:
    import tempfile

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write", action="store_true",
                    help=f"add (or replace) this capability's record in {FIXTURE.relative_to(REPO)}")
    ap.add_argument("--out", type=Path, help="write the trace as JSON to this file (the test's subprocess)")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        got = trace(Path(tmp))
    got.update(capability=capability(), torch=torch.__version__, machine=machine())
    if args.out:
        args.out.write_text(json.dumps(got))
    if args.write:
        records = load() if FIXTURE.exists() else {}
        records[capability()] = {k: v for k, v in got.items() if k != "capability"}
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(dumps(dict(sorted(records.items()))))
    print(capability(), {k: v for k, v in got.items() if k != "beams"})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
