"""The workers' batch plan: what every train worker computes, the same on all of them, every step.

step_groups: the pairs kept, each epoch's step groups of ~`train.tokens_per_step` target tokens,
each step's split over the workers and gradient-accumulation micro-batches, the dev batches;
shapes: the fixed micro-batch shapes a GPU pads to (`speed.shape_buckets`) and their count over an
epoch. Pure numpy on the encode stage's lengths: no torch, no Ray. Imports the pipeline core only:
the train phase reads it every step, and `--plan`'s bill (pipeline.plan) prices it.
"""
