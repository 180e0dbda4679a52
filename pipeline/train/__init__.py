"""Training phase, split by who runs it.

The worker (inside each Ray Train worker, or in-process for tests): loop (the Trainer) and its
parts: device (precision, attention kernel, compile), feeder (host batches, prefetch, upload), step,
metrics, dev_loss, agreement (what the ranks share after a step), actions (what it decides),
checkpoint (the cadence and the checkpoint folder), early_stop, session, upload, preemption;
token_batches (a micro-batch's padded arrays) and corpus (shard loading).
The driver (the DAG's `train` entry): driver (checks, the TorchTrainer, the stage's outputs), elastic
(the worker range), resume (where an interrupted run stands, for --plan), dev_bleu_validation and
dev_bleu_task (dev BLEU per checkpoint as Ray Train's validation: its wiring, the task).
The global batch plan and --plan's bill are pipeline.plan's. Imports the pipeline core, pipeline.plan,
the shared library pipeline.decoding (dev BLEU scoring and records, checkpoint selection) and
`model/` only; never another phase."""
