"""Evaluation phase: average the last checkpoints, beam-decode the test sets, score BLEU/chrF and
write the report (the stages average, translate, score; attention_plots for score's report).
Imports the pipeline core, the shared library pipeline.decoding (Translator, metrics, dev BLEU,
selection) and `model/` only; never another phase (pipeline.data, pipeline.train, pipeline.serve).
Exception: score reads the raw test reference with pipeline.data.clean.file_lines (an ignored
import in the contract, pyproject.toml)."""
