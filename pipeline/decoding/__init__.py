"""The library shared by the phases: decoding, model conversion, metrics and checkpoint selection.

batching (sources to batches, encoded splits), translator (``Translator``: our beam search or
CTranslate2, ``ct2_backend``), translate_cli (the CLI: ``python -m pipeline.decoding.translate_cli``),
attention_maps (what the model attended to in one translation), conversion (HF Marian folder and
CTranslate2 models), bleu (sacreBLEU, chrF, the paper's tokenized BLEU), scoring (``score_split``,
``setup_of``), dev_bleu (one checkpoint's dev BLEU and its settings), dev_bleu_records (the
per-checkpoint record store), selection (which checkpoints to average, checked at --plan time).

Imports the pipeline core and `model/` only; the phases (pipeline.train, pipeline.evaluate,
pipeline.serve) and workflows import it, never the other way round (import-linter contracts in
pyproject.toml)."""
