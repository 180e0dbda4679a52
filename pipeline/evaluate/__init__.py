"""Evaluation phase: average the last checkpoints, beam-decode the test sets, score BLEU/chrF and
write the report. Imports the pipeline core and `model/` only (never pipeline.data or pipeline.train).
Exception: dev_bleu.py (Ray Train's validation task) converts checkpoints with pipeline.serve.export,
imported inside the task; pipeline.train's stage imports dev_bleu to hand that task to its trainer."""
