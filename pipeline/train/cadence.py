"""When a step logs, validates or checkpoints (`train.*_interval_*`): one place for the rules.

Every worker reaches the same decision at the same step without talking, except for the
time-based checkpoint (`train.checkpoint_interval_s`): wall clocks differ between workers, so
rank 0 decides and broadcasts, which waits for the device. That is asked on log steps only
(which all workers reach together), so a step that neither logs nor checkpoints never syncs,
and a time-based checkpoint comes at most `train.log_interval_steps` late.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from pipeline.config import TrainConfig


class Cadence:
    """The interval rules of one worker; `checkpointed()` restarts the checkpoint clock."""

    def __init__(self, tc: TrainConfig, world: int, device: torch.device, validates: bool):
        self.tc, self.world, self.device, self.validates = tc, world, device, validates
        self.last_checkpoint_t = time.monotonic()

    def _every(self, step: int, interval: int) -> bool:
        return step % interval == 0 or step == self.tc.max_steps

    def logs(self, step: int) -> bool:
        return self._every(step, self.tc.log_interval_steps)

    def validates_at(self, step: int) -> bool:
        return self.validates and self._every(step, self.tc.eval_interval_steps)

    def checkpoints_at(self, step: int) -> bool:
        if self._every(step, self.tc.checkpoint_interval_steps):
            return True
        if self.tc.checkpoint_interval_s <= 0 or not self.logs(step):
            return False
        flag = torch.tensor([int(time.monotonic() - self.last_checkpoint_t >= self.tc.checkpoint_interval_s)],
                            device=self.device)
        if self.world > 1:
            dist.broadcast(flag, src=0)
        return bool(flag.item())

    def checkpointed(self) -> None:
        self.last_checkpoint_t = time.monotonic()
