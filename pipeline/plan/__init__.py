"""The plan of the train stage and `--plan`'s bill of it.

step_groups: the global batch plan every worker computes (the pairs kept, each epoch's step groups,
each step's split over the workers); shapes: the fixed micro-batch shapes a GPU pads to and their
count over an epoch; flops: FLOPs and host ops of a micro-batch, counted on the model; bill: FLOPs
per step, hours and GPU-hours on GPUs (`--plan`, and the train run's params); cpu_rate: this CPU's
matmul rate at the step's own products; cpu_bill: the hours of a run that trains on this CPU.
Imports the pipeline core and `model/` only: the train phase builds on it (pipeline.train), and
the workflows and benchmarks/gpu_check.py read it; it imports no phase.
"""
