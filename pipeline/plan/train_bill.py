"""The train stage's bill: this CPU's (cpu_bill.py) when the run trains on it, else the GPUs'
(bill.py). `--plan` prints it (workflows/runner.py); the train stage logs it as its run's params."""

from __future__ import annotations

from typing import Callable

import numpy as np

from model import ModelConfig
from pipeline.config import Config
from pipeline.plan import bill
from pipeline.plan.cpu_bill import CpuBill, make_cpu_bill


def train_bill(cfg: Config, mc: ModelConfig, cpu: Callable[[], tuple[str, int]],
               lengths: tuple[np.ndarray, np.ndarray] | None = None, mfu_from: str = "",
               shapes: bool = False) -> bill.Bill | CpuBill:
    """The bill of `cfg`'s train stage for the model `mc` at the encode stage's `lengths` (None:
    assumed ones). `cpu()`: (precision, torch threads) of a CPU worker of a local run on this machine
    (`pipeline.train.driver.local_cpu_training`, the run's own rules), asked only when it trains here
    (a GPU recipe's precision may not hold on this CPU)."""
    source = bill.encode_lengths_source(lengths) if lengths is not None else ""
    if bill.trains_on_this_cpu(cfg):
        return make_cpu_bill(cfg, mc, *cpu(), lengths, source, shapes=shapes)
    return bill.make_bill(cfg, mc, lengths, source, mfu_from, shapes)
