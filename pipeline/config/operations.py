"""The operational sections beside the recipe: how the train stage runs (``speed``, ``workers``),
when it checkpoints and reports (``checkpoint``, ``metrics``) and what ``--plan``'s bill assumes
(``plan``). Every field is `op`: changing one never invalidates a cached stage. Standard library
only, plus `checks`."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from .checks import check as _check

Precision = Literal["auto", "bf16", "fp16", "fp32"]  # speed.precision
Placement = Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"]  # workers.placement_strategy
GradCompression = Literal["none", "bf16"]  # speed.grad_compression
CheckpointUpload = Literal["async", "sync"]  # checkpoint.upload
Auto = Literal["auto"]  # workers.use_gpu, decode.use_gpu, speed.compile, speed.shape_buckets: decided per device
AttentionBackend = Literal["auto", "flash", "efficient", "cudnn", "math"]  # speed.attention_backend


def op(default: Any = dataclasses.MISSING, **kw: Any) -> Any:
    """An operational field: not part of any cache key."""
    return field(default=default, metadata={"cache": False}, **kw)


@dataclass(kw_only=True)
class SpeedSection:
    """How fast each training step runs on its device: precision, kernels, micro-batches,
    compilation (``speed``). Never part of a cache key: these change the rounding, not the recipe."""

    # "auto": bf16 autocast where the device does bf16 natively (CUDA; a CPU with AVX512-BF16 or
    # AMX), else fp32 (fp16 on a GPU without bf16). "bf16" on a CPU without it is an error.
    precision: Precision = op("auto")  # (pipeline/train/device.py)
    # Per worker micro-batch cap (src or tgt tokens): memory for speed; accumulation keeps
    # train.tokens_per_step fixed.
    max_tokens_per_batch: int = op(12500)
    prefetch: bool = op(True)  # prepare the next step's micro-batches in a background thread
    # torch.compile(dynamic=True) the model: "auto" = on a GPU (small models are bound by Python's
    # kernel launches there), eager on a CPU (compiling costs minutes there and gains little).
    compile: bool | Auto = op("auto")
    compile_backend: str = op("inductor")  # torch.compile backend ("aot_eager": capture only, for tests)
    # Micro-batches padded to a few fixed shapes (pipeline/batch_plan/shapes.py): "auto" = on a GPU, where
    # every new shape costs a cuDNN attention plan and GEMM choices; a CPU rounds positions to 64
    # in bf16 only (pipeline.train.device.row_multiple).
    shape_buckets: bool | Auto = op("auto")
    # The scaled-dot-product-attention kernel on a GPU: "auto" = the fastest of flash,
    # memory-efficient and cuDNN on this GPU, timed at the worker's start on a training-sized shape
    # (pipeline/train/device.py); or one of them, or "math". A CPU keeps PyTorch's own choice.
    attention_backend: AttentionBackend = op("auto")
    # The output projection fused with the label-smoothed loss, in row chunks (model/training.py,
    # linear_label_smoothed_nll): no (tokens x vocabulary) logits, bf16 or fp32, are ever held.
    # "auto" = on a GPU; a CPU keeps its projection + chunked loss (faster there: fewer, larger GEMMs).
    fused_loss: bool | Auto = op("auto")
    grad_compression: GradCompression = op("none")  # "bf16": DDP all-reduces gradients in bf16 (multi-node)

    def validate(self) -> None:
        _check(self.max_tokens_per_batch > 0, "speed.max_tokens_per_batch", "must be > 0")


@dataclass(kw_only=True)
class WorkersSection:
    """The train stage's Ray Train worker group: its size, devices, placement and how it survives
    failures and preemption (``workers``; never part of a cache key)."""

    # Ray Train workers (one per GPU); accumulation keeps tokens/step fixed. N, or [min, max]:
    # elastic (pipeline.train.elastic): the group shrinks to the workers left when one is lost,
    # and grows back when capacity returns, checked every elastic_resize_interval_s.
    num_workers: int | list[int] = op(8)
    elastic_resize_interval_s: float = op(60.0)  # Ray's ScalingConfig(elastic_resize_monitor_interval_s)
    # "auto": GPU workers when the Ray cluster has a GPU, else CPU workers; true: GPUs or an error
    # before anything starts; false: CPUs (pipeline/train/driver.py, gpu_training).
    use_gpu: bool | Auto = op("auto")
    # CPUs Ray reserves for each worker, and its torch threads. 0 = auto: on CPU, the cluster's
    # CPUs shared out over the workers (local mode: the whole machine); on GPU, 1.
    cpus_per_worker: int = op(0)
    # Ray placement of the workers: "PACK" (fill a node first: NVLink/NCCL within one 8-GPU node),
    # "SPREAD", or "STRICT_SPREAD" (one worker per node).
    placement_strategy: Placement = op("PACK")
    max_failures: int = op(3)  # Ray Train FailureConfig: worker failures survived per run
    corpus_cache_dir: str = op("")  # node-local folder for the shared training-split copy; "" = <tmp>
    # SIGTERM (a spot/preemptible VM's or Kubernetes' notice) -> a checkpoint at the next agreed
    # step boundary if a step + a save fit in this many seconds, then the group stops and the run
    # resumes there (pipeline.train.preemption). 0 = off: SIGTERM ends the worker at once.
    preemption_grace_s: float = op(25.0)
    # How often Ray Train's controller polls its workers (RAY_TRAIN_HEALTH_CHECK_INTERVAL_S): a
    # started group, a reported checkpoint, a finished run and a dead worker are each noticed at the
    # next poll. Ray's 2 s by default: 0.5 s took ~5 s off a 30-step train stage but made local
    # mode's 600 steps ~12% slower (2 cores, AVX512-BF16, bf16; docs/benchmarks.md, "Ray Train's
    # poll interval").
    # An explicit RAY_TRAIN_HEALTH_CHECK_INTERVAL_S in the driver's environment wins.
    controller_poll_s: float = op(2.0)

    def validate(self) -> None:
        if isinstance(self.num_workers, list):
            _check(len(self.num_workers) == 2, "workers.num_workers", f"a range is [min, max], got {self.num_workers}")
            _check(self.num_workers[0] >= 1, "workers.num_workers", f"min must be >= 1, got {self.num_workers}")
            _check(self.num_workers[0] <= self.num_workers[1], "workers.num_workers",
                   f"min must be <= max, got {self.num_workers}")
        else:
            _check(self.num_workers >= 1, "workers.num_workers", "must be >= 1")
        _check(self.elastic_resize_interval_s >= 0, "workers.elastic_resize_interval_s", "must be >= 0")
        _check(self.cpus_per_worker >= 0, "workers.cpus_per_worker", "must be >= 0 (0 = auto)")
        _check(self.max_failures >= 0, "workers.max_failures", "must be >= 0")
        _check(self.preemption_grace_s >= 0, "workers.preemption_grace_s", "must be >= 0 (0 = off)")
        _check(self.controller_poll_s > 0, "workers.controller_poll_s", "must be > 0")


@dataclass(kw_only=True)
class CheckpointSection:
    """When the train stage checkpoints, how many it keeps and how they reach storage
    (``checkpoint``; never part of a cache key)."""

    interval_steps: int = op(1000)  # a checkpoint every N steps, and at train.max_steps
    interval_s: float = op(0.0)  # 0 = only the step interval
    num_to_keep: int = op(5)  # >= average.checkpoints; §6.1 averages the last 5
    upload: CheckpointUpload = op("async")  # "async": upload in the background (Ray Train ASYNC); "sync"
    # An object store that refuses or drops writes: a checkpoint upload is retried with backoff for
    # up to this many seconds (pipeline.train.upload), then the worker fails (workers.max_failures).
    upload_retry_s: float = op(600.0)

    def validate(self) -> None:
        _check(self.interval_steps > 0, "checkpoint.interval_steps", "must be > 0")
        _check(self.num_to_keep >= 1, "checkpoint.num_to_keep", "must be >= 1")
        _check(self.upload_retry_s >= 0, "checkpoint.upload_retry_s", "must be >= 0 (0 = no retry)")


@dataclass
class MetricsSection:
    """How often the training loop reports (``metrics``; never part of a cache key)."""

    log_interval_steps: int = op(100)  # the progress line and the train/* metrics
    # The dev loss (val/loss, val/ppl); train.early_stop_metric = "val_loss" counts these.
    val_loss_interval_steps: int = op(1000)

    def validate(self) -> None:
        _check(self.log_interval_steps > 0, "metrics.log_interval_steps", "must be > 0")
        _check(self.val_loss_interval_steps > 0, "metrics.val_loss_interval_steps", "must be > 0")


@dataclass
class PlanSection:
    """The bill --plan prints (pipeline/plan/bill.py): the GPU each worker has, and the MFU it
    assumes unless a benchmarks/gpu_check.sh JSON (mfu_from, or --mfu-from) measured one (``plan``)."""

    gpu_type: str = op("A100")  # a name of pipeline/plan/bill.py's PEAK_FLOPS (its datasheet peak)
    mfu_from: str = op("")  # a gpu_check.sh JSON whose measured MFU the bill uses; "" = assumed_mfu
    assumed_mfu: float = op(0.3)  # printed as an ASSUMPTION when nothing measured one

    def validate(self) -> None:
        _check(0.0 < self.assumed_mfu <= 1.0, "plan.assumed_mfu", "must be in (0, 1] (0.3 = 30%)")
