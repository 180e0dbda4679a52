"""Training phase: the train stage (Ray Train driver), the per-worker loop, one optimizer step,
token-bucket batching, corpus loading and checkpoints. Imports the pipeline core and `model/` only."""
