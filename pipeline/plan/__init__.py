"""`--plan`'s bill of the train stage, and the train run's params: what it costs, before it runs.

flops: FLOPs and host ops of a micro-batch, counted on the model; bill: FLOPs per step, hours and
GPU-hours on GPUs; cpu_rate: this CPU's matmul rate at the step's own products; cpu_bill: the hours
of a run that trains on this CPU; train_bill: which of the two a run gets. The batches it prices
are the workers' batch plan (pipeline.batch_plan). Imports the pipeline core, pipeline.batch_plan
and `model/` only: the train phase logs the bill in its run's params, and the workflows and
benchmarks/gpu_check.py read it; it imports no phase.
"""
