"""`train.compile`: the model under torch.compile, with a count of what it compiled.

Token-bucketed batches give every micro-batch new shapes (B pairs, S and T columns, Ms and Mt
real positions). A model compiled for static shapes would recompile for each one, and once
dynamo's recompile limit (8 per code object) is reached it silently runs the rest eagerly: a
compiled run slower than eager with nobody told. So the model is compiled with ``dynamic=True``
(every dimension symbolic from the first call) and `CountingBackend` counts the graphs the
backend is handed: the first compilation, every recompilation and every piece a graph break
leaves. The Trainer exposes the count (`Trainer.num_compiled_graphs`), the loop logs it as
``train/compiled_graphs``, gpu_check reports it, and tests/unit/train/test_compile.py bounds it.

Duck sizing is turned off: by default dynamo gives dimensions that happen to be equal in the
first batch it sees one symbol and guards on the equality (here: a first micro-batch whose source
and target are both 35 columns wide), so the first batch where they differ recompiled.

What remains (tests/unit/train/test_compile.py, token-bucketed batches, 300 steps; 4 graphs on a
tiny model with torch 2.13): at the first step the training forward (twice: dynamo hands it over
twice on its first call, no guard failure logged), at the first validation one for grad mode off
and one for a dev batch of a single pair (dynamo always specializes sizes 0 and 1); nothing after
that, however many steps and shapes follow. Validation passes host-computed positions, as
training does: a `nonzero` inside the model would break the graph into pieces that recompile.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
import torch.fx.experimental._config  # noqa: F401 (use_duck_shape, below)

log = logging.getLogger(__name__)


class CountingBackend:
    """A torch.compile backend that hands each graph to `backend` and counts them."""

    def __init__(self, backend: str = "inductor"):
        from torch._dynamo import lookup_backend

        self.name = backend
        self.inner = lookup_backend(backend)
        self.num_graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Any:
        self.num_graphs += 1
        log.info("torch.compile (%s): graph %d (%d nodes)", self.name, self.num_graphs, len(gm.graph.nodes))
        return self.inner(gm, example_inputs)


def compile_model(model: torch.nn.Module, backend: str = "inductor") -> tuple[torch.nn.Module, CountingBackend]:
    """(the compiled module, its counter). dynamic=True: batch shapes change every step."""
    counter = CountingBackend(backend)
    # Process-wide, set before the first call compiles: a training process compiles the model only.
    torch.fx.experimental._config.use_duck_shape = False
    return torch.compile(model, dynamic=True, backend=counter), counter
