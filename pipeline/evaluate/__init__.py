"""Evaluation phase: average the last checkpoints, beam-decode the test sets, score BLEU/chrF and
write the report. Imports the pipeline core and `model/` only (never pipeline.data or pipeline.train)."""
