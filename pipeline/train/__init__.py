"""Training phase: the train stage (Ray Train driver), the per-worker Trainer and its parts (feeder,
step, metrics, validate, cadence, checkpoint, session), token-bucket batching, corpus loading, and
dev BLEU per checkpoint as Ray Train's validation (dev_bleu: its wiring; dev_bleu_task: the task).
Imports the pipeline core, the shared library pipeline.decoding (dev BLEU scoring and records,
checkpoint selection) and `model/` only; never another phase."""
