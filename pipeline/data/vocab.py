"""Stage ``vocab``: one shared SentencePiece BPE model (§5.1: "a shared source-target vocabulary of
about 37000 tokens") trained on a deterministic sample of both sides of the training split.

The sample is ``ceil(vocab.sample_sentences / 2)`` training pairs drawn with ``vocab.seed``
(both sides of each, so ``sample_sentences`` sentences), written to a local file in shard order;
SentencePiece then reads all of it (no sampling of its own), so the model depends only on the
data, the seed and the ``vocab`` section. Special ids are fixed: pad=0, unk=1, bos=2, eos=3.
"""

from __future__ import annotations

import logging
import math
import tempfile
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq

from pipeline import storage
from pipeline.data.shards import shard_uris
from pipeline.stage import StageContext, StageResult

log = logging.getLogger(__name__)

SPECIAL_IDS = {"pad_id": 0, "unk_id": 1, "bos_id": 2, "eos_id": 3}


def sample_indices(num_rows: int, num_pairs: int, seed: int) -> np.ndarray:
    """Sorted row indices (``idx``) of the sample: all rows when the split is small enough."""
    if num_pairs >= num_rows:
        return np.arange(num_rows, dtype=np.int64)
    rng = np.random.default_rng(seed)
    return np.sort(rng.choice(num_rows, size=num_pairs, replace=False)).astype(np.int64)


def write_sample(train_dir: str, chosen: np.ndarray, path: Path) -> int:
    """Stream the training shards and write the chosen pairs' two sides, one sentence a line."""
    n = 0
    with path.open("w", encoding="utf-8", newline="\n") as out:
        for uri in shard_uris(train_dir):
            fs, p = storage.resolve(uri)
            with fs.open_input_file(p) as f:
                for batch in pq.ParquetFile(f).iter_batches(columns=["idx", "src", "tgt"], batch_size=65536):
                    idx = batch.column(0).to_numpy()
                    pos = np.minimum(np.searchsorted(chosen, idx), len(chosen) - 1)
                    mask = chosen[pos] == idx
                    for s, t, keep in zip(batch.column(1).to_pylist(), batch.column(2).to_pylist(), mask):
                        if keep:
                            out.write(f"{s}\n{t}\n")
                            n += 2
    return n


def train_spm(sample_path: Path, model_prefix: Path, size: int, model_type: str, character_coverage: float,
              num_threads: int) -> None:
    import sentencepiece as spm

    spm.SentencePieceTrainer.train(
        input=str(sample_path), model_prefix=str(model_prefix), vocab_size=size, model_type=model_type,
        character_coverage=character_coverage, **SPECIAL_IDS,
        input_sentence_size=0, shuffle_input_sentence=False,  # use the whole (already sampled) file, in order
        hard_vocab_limit=False,  # tiny test corpora may not support the requested size
        num_threads=num_threads, minloglevel=1)
    normalize_model(Path(f"{model_prefix}.model"))


def normalize_model(model_path: Path) -> None:
    """Blank what SentencePiece records about *how* it ran (temp paths, thread count) in the model.

    The pieces and scores do not depend on ``num_threads`` (checked for BPE in the tests), but the
    trainer spec stored in ``spm.model`` holds the input path, model prefix and thread count,
    which would make the file differ between runs; fixed values make it byte-reproducible.
    """
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(model_path.read_bytes())
    del proto.trainer_spec.input[:]
    proto.trainer_spec.input.append("sample.txt")
    proto.trainer_spec.model_prefix = "spm"
    proto.trainer_spec.ClearField("num_threads")
    model_path.write_bytes(proto.SerializeToString(deterministic=True))


def run(ctx: StageContext) -> StageResult:
    import sentencepiece as spm

    v = ctx.cfg.vocab
    train = ctx.inputs["prepare"].outputs["splits"]["train"]
    chosen = sample_indices(train["num_rows"], math.ceil(v.sample_sentences / 2), v.seed)
    out_dir = storage.absolute(ctx.out_dir)
    with tempfile.TemporaryDirectory() as tmp:
        sample = Path(tmp) / "sample.txt"
        num_sentences = write_sample(train["dir"], chosen, sample)
        log.info("vocab: training SentencePiece %s (size %d) on %d sentences", v.model_type, v.size, num_sentences)
        prefix = Path(tmp) / "spm"
        train_spm(sample, prefix, v.size, v.model_type, v.character_coverage, v.num_threads)
        sp = spm.SentencePieceProcessor(model_file=f"{prefix}.model")
        got = {"pad_id": sp.pad_id(), "unk_id": sp.unk_id(), "bos_id": sp.bos_id(), "eos_id": sp.eos_id()}
        if got != SPECIAL_IDS:
            raise RuntimeError(f"SentencePiece ids {got} differ from the fixed {SPECIAL_IDS}")
        vocab_size = sp.get_piece_size()
        if vocab_size != v.size:
            log.warning("vocab: got %d pieces instead of vocab.size=%d (too little text)", vocab_size, v.size)
        model_uri = storage.join(out_dir, "spm.model")
        storage.upload(f"{prefix}.model", model_uri)
        storage.upload(f"{prefix}.vocab", storage.join(out_dir, "spm.vocab"))
    outputs = {"model": model_uri, "vocab": storage.join(out_dir, "spm.vocab"), "vocab_size": vocab_size,
               **SPECIAL_IDS, "num_sample_sentences": num_sentences}
    return StageResult(outputs=outputs, metrics={"vocab/size": float(vocab_size),
                                                 "vocab/num_sample_sentences": float(num_sentences)})
