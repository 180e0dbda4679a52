"""Training phase: the train stage (Ray Train driver), the per-worker Trainer and its parts (feeder,
step, metrics, validate, cadence, checkpoint, session), token-bucket batching, corpus loading.
Imports the pipeline core and `model/` only."""
