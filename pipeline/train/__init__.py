"""Training phase, split by who runs it.

The worker (inside each Ray Train worker, or in-process for tests): loop (the Trainer) and its
parts: device (precision, attention kernel, compile), feeder (host batches: collate, prefetch, upload), step,
metrics, dev_loss, agreement (what the ranks share after a step, and what it decides: log, validate,
checkpoint, stop), checkpoint (the checkpoint folder, written and restored), early_stop, session,
upload, preemption; corpus (shard loading).
The driver (the DAG's `train` entry): driver (the TorchTrainer, the stage's outputs), inputs (the
checks before any worker starts), elastic (the worker range), resume (where an interrupted run
stands, for --plan), dev_bleu_validation and dev_bleu_task (dev BLEU per checkpoint as Ray Train's
validation: its wiring, the task).
The workers' batch plan is pipeline.batch_plan's, --plan's bill pipeline.plan's. Imports the pipeline
core, pipeline.batch_plan, pipeline.plan, the shared library pipeline.decoding (dev BLEU scoring and
records, checkpoint selection) and `model/` only; never another phase."""
