"""The per-worker training loop: the paper's recipe (§5) on token-bucketed steps.

Runs inside each Ray Train worker (`pipeline.train.stage` gives it a session over `ray.train`) or
in-process for tests and benchmarks (`LocalSession`); it imports neither Ray nor MLflow.

One optimizer step = one step group of ~`train.tokens_per_step` target tokens
(`pipeline.train.batching`), cut into `num_workers * accum` micro-batches; every worker computes the
same global plan and takes its share. The step itself (accumulation, loss normalization, clipping,
Adam, lr schedule) is `pipeline.train.step`. Per-step dropout seeds make a resumed run replay the
steps it lost exactly.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import shutil
import tempfile
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ContextManager, Iterator, Protocol

import numpy as np
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from model import ModelConfig, Transformer, label_smoothed_nll, make_optimizer, make_scheduler
from pipeline.train import batching
from pipeline.train import checkpoint as train_checkpoint
from pipeline.config import from_dict as config_from_dict
from pipeline.train.checkpoint import Progress
from pipeline.train.corpus import Corpus, load_corpus, load_shared_corpus
from pipeline.train.step import (MicroBatch, accumulate_gradients, optimizer_step, pin, resolve_precision,
                                 step_seed, to_device, upload)

log = logging.getLogger(__name__)

FAIL_AT_STEP_ENV = "TRANSFORMER_REPRO_FAIL_AT_STEP"  # tests only: "K:marker-file[:hang]", see `_maybe_fail`


@dataclass
class LoopSpec:
    """What the driver sends to every worker (JSON-able: Ray's `train_loop_config`)."""

    cfg: dict[str, Any]  # Config.to_dict()
    model_config: dict[str, Any]  # ModelConfig.to_dict()
    train_dir: str
    dev_dir: str = ""  # "" = no validation
    tracking_uri: str | None = None
    run_id: str | None = None  # the stage's MLflow run; None = log nothing
    fail_at_step: int = 0  # tests only: one worker fails before this step (once: fail_marker)
    fail_marker: str = ""
    fail_mode: str = "raise"  # or "hang", or "upload" (the worker dies during a checkpoint upload)
    num_threads: int = 0  # torch threads of this worker (the CPUs Ray reserved for it); 0 = leave as is

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class Session(Protocol):
    """The loop's view of its runner (Ray Train or a test)."""

    rank: int
    world_size: int
    device: torch.device

    def latest_checkpoint(self) -> ContextManager[str | None]: ...
    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None, dir_name: str | None,
               upload_async: bool = False) -> None: ...


class LocalSession:
    """In-process session: checkpoints are copied to `root/<name>`; rank/world from torch.distributed."""

    def __init__(self, root: str | Path, device: str = "cpu"):
        self.root = Path(root)
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world_size = dist.get_world_size() if dist.is_initialized() else 1
        self.device = torch.device(device)
        self.reports: list[dict[str, Any]] = []

    def checkpoints(self) -> list[Path]:
        return sorted(p for p in self.root.glob("checkpoint_*") if (p / train_checkpoint.META_FILE).exists())

    @contextlib.contextmanager
    def latest_checkpoint(self) -> Iterator[str | None]:
        found = self.checkpoints()
        yield str(found[-1]) if found else None

    def report(self, metrics: dict[str, Any], checkpoint_dir: str | None, dir_name: str | None,
               upload_async: bool = False) -> None:
        self.reports.append(dict(metrics))
        if checkpoint_dir is not None and self.rank == 0:
            shutil.copytree(checkpoint_dir, self.root / (dir_name or f"checkpoint_{len(self.reports)}"))


@dataclass
class _Window:
    """Sums since the last log line."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    tokens_src: int = 0
    tokens_tgt: int = 0
    loss: torch.Tensor | None = None
    nll: torch.Tensor | None = None
    lr: float = 0.0  # the rate the last step used
    grad_norm: float = float("nan")  # of the last step (computed on log steps only)


class Trainer:
    """One worker's state and loop; `run()` trains up to `train.max_steps` and returns a summary."""

    def __init__(self, spec: LoopSpec, session: Session):
        self.spec, self.session = spec, session
        self.cfg = config_from_dict(spec.cfg)
        self.tc = self.cfg.train
        self.mcfg = ModelConfig.from_dict(spec.model_config)
        self.device = session.device
        self.rank, self.world = session.rank, session.world_size
        if spec.num_threads > 0:
            torch.set_num_threads(spec.num_threads)  # Ray's OMP_NUM_THREADS may say otherwise
        if self.device.type == "cpu":
            torch.set_flush_denormal(True)  # denormals slow CPU matmuls many-fold late in training
        else:
            torch.cuda.set_device(self.device)
        self.precision = resolve_precision(self.tc.precision, self.device)
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.precision)
        self.autocast = ((lambda: torch.autocast(self.device.type, dtype=dtype)) if dtype is not None
                         else contextlib.nullcontext)
        self.train_data = load_shared_corpus(spec.train_dir, self.tc.corpus_cache_dir or None)
        keep = batching.keep_mask(self.train_data.src_len, self.train_data.tgt_len, self.tc.max_len)
        self.rows = np.flatnonzero(keep).astype(np.int32 if len(keep) < 2**31 else np.int64)
        self.num_dropped = int(len(keep) - len(self.rows))
        self.dev_data: Corpus | None = load_corpus(spec.dev_dir) if spec.dev_dir else None
        torch.manual_seed(self.tc.seed)  # identical initial weights on every worker
        self.model = Transformer(self.mcfg).to(self.device)
        self.optimizer = make_optimizer(self.model, betas=(self.tc.adam_beta1, self.tc.adam_beta2),
                                        eps=self.tc.adam_eps)
        self.scheduler = make_scheduler(self.optimizer, self.mcfg.d_model, self.tc.warmup_steps, self.tc.lr_scale)
        self.scaler = torch.amp.GradScaler("cuda") if self.precision == "fp16" else None
        self.forward_model: torch.nn.Module = self.model  # what steps call (compiled if asked)
        if self.tc.compile:
            # dynamic=True: batch shapes change every step (token buckets); one graph serves them.
            self.forward_model = torch.compile(self.model, dynamic=True, backend=self.tc.compile_backend)
        self.progress = Progress()
        self.tracker = _make_tracker(spec.tracking_uri, spec.run_id) if self.rank == 0 else None
        self.last_metrics: dict[str, float] = {}
        self.start_step = 0  # the step this attempt resumed from

    # -- setup ---------------------------------------------------------------------------------

    def restore(self) -> None:
        with self.session.latest_checkpoint() as path:
            if path is None:
                return
            self.progress = train_checkpoint.load(path, model=self.model, optimizer=self.optimizer,
                                                  scheduler=self.scheduler, scaler=self.scaler,
                                                  device=self.device)
        if self.rank == 0:
            log.info("resumed from checkpoint at step %d (epoch %d, step %d of that epoch)",
                     self.progress.step, self.progress.epoch, self.progress.step_in_epoch)

    def _wrapped(self) -> torch.nn.Module:
        if self.world == 1:
            return self.forward_model
        ids = [self.device.index] if self.device.type == "cuda" else None
        # No buffer to sync (the sinusoid table is constant; LayerNorm keeps no statistics).
        ddp = DDP(self.forward_model, device_ids=ids, broadcast_buffers=False, gradient_as_bucket_view=True)
        if self.tc.grad_compression == "bf16":
            # Halves all-reduce bytes between nodes; gradients are averaged in bf16 (lossy).
            from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

            ddp.register_comm_hook(None, default_hooks.bf16_compress_hook)
        return ddp

    # -- loop ----------------------------------------------------------------------------------

    def run(self) -> dict[str, Any]:
        self.restore()
        self.start_step = self.progress.step
        model = self._wrapped()
        p, tc = self.progress, self.tc
        plan = self._plan(p.epoch)
        if self.rank == 0:
            log.info("training from step %d to %d on %d worker(s), %s; %d pairs kept, %d dropped "
                     "(> train.max_len=%d pieces); %d steps in epoch %d", p.step, tc.max_steps, self.world,
                     self.precision, len(self.rows), self.num_dropped, tc.max_len, len(plan), p.epoch)
        window, t_attempt, last_ckpt_t = _Window(), time.perf_counter(), time.monotonic()
        time_base = p.train_time_s
        feeder = _Feeder(self._host_batches, prefetch=tc.prefetch)
        try:
            while p.step < tc.max_steps:
                if p.step_in_epoch >= len(plan):
                    p.epoch, p.step_in_epoch = p.epoch + 1, 0
                    plan = self._plan(p.epoch)
                    continue
                self._maybe_fail(p.step + 1)
                group = plan[p.step_in_epoch]
                nxt = plan[p.step_in_epoch + 1] if p.step_in_epoch + 1 < len(plan) else None
                self._train_step(model, feeder.take(group), window, lambda: feeder.ahead(nxt))
                p.step += 1
                p.step_in_epoch += 1
                p.train_time_s = time_base + time.perf_counter() - t_attempt
                log_step = p.step % tc.log_interval_steps == 0 or p.step == tc.max_steps
                if log_step:
                    self._log(window)
                    window = _Window()
                if self.dev_data is not None and (p.step % tc.eval_interval_steps == 0 or p.step == tc.max_steps):
                    self._evaluate(model)
                if self._checkpoint_due(last_ckpt_t, log_step):
                    self._checkpoint()
                    last_ckpt_t = time.monotonic()
        finally:
            feeder.close()
        return self.summary()

    def _plan(self, epoch: int) -> list[np.ndarray]:
        d = self.train_data
        return batching.plan_epoch(self.rows, d.src_len, d.tgt_len, self.tc.tokens_per_step, self.tc.seed, epoch)

    def _host_batches(self, group: np.ndarray) -> tuple[list[MicroBatch], int, int]:
        """This worker's micro-batches of one step, collated and pinned on the host, and the
        step's (target, source) token counts: O(batch) work, no device involved (so it can run
        ahead, in the feeder's thread)."""
        d = self.train_data
        step_tgt = int(batching.target_tokens(d.tgt_len[group]).sum())
        step_src = int(d.src_len[group].sum()) + len(group)
        split = batching.split_step(group, d.src_len, d.tgt_len, self.world, self.tc.max_tokens_per_batch)
        micro = []
        for rows in split.for_worker(self.rank):
            weight = 1.0 if len(rows) else 0.0  # no rows left for this worker: a zero-weight stand-in
            rows = rows if len(rows) else group[:1]
            b = batching.collate(rows, d.src_values, d.src_offsets, d.tgt_values, d.tgt_offsets,
                                 self.mcfg.pad_id, self.mcfg.bos_id, self.mcfg.eos_id)
            micro.append(pin(b, self.device, weight))
        return micro, step_tgt, step_src

    def _train_step(self, model: torch.nn.Module, host: tuple[list[MicroBatch], int, int], window: _Window,
                    start_prefetch: Any = None) -> None:
        p = self.progress
        host_micro, step_tgt, step_src = host
        micro = [upload(mb, self.device) for mb in host_micro]
        torch.manual_seed(step_seed(self.tc.seed, self.rank, p.step + 1))
        model.train()
        if start_prefetch is not None:
            # Started here, not before the set-up above: the prefetch thread's Python holds the GIL
            # in bursts, and the model's kernels (which release it) are what it should overlap.
            start_prefetch()
        loss, nll = accumulate_gradients(model, micro, step_tgt, self.world, self.tc.label_smoothing,
                                         self.mcfg.pad_id, self.autocast, self.scaler)
        want_norm = (p.step + 1) % self.tc.log_interval_steps == 0 or p.step + 1 == self.tc.max_steps
        window.lr = self.optimizer.param_groups[0]["lr"]
        norm = optimizer_step(self.model, self.optimizer, self.scheduler, self.scaler, self.tc.clip_norm, want_norm)
        if norm is not None:
            window.grad_norm = norm
        window.steps += 1
        window.tokens_src += step_src
        window.tokens_tgt += step_tgt
        window.loss = loss if window.loss is None else window.loss + loss
        window.nll = nll if window.nll is None else window.nll + nll
        p.tokens_src += step_src
        p.tokens_tgt += step_tgt

    def _all_reduce(self, values: torch.Tensor) -> list[float]:
        t = values.to(self.device, torch.float64)
        if self.world > 1:
            dist.all_reduce(t)
        return t.tolist()

    def _log(self, w: _Window) -> None:
        loss, nll = self._all_reduce(torch.stack([w.loss, w.nll]))
        if self.rank != 0:
            return
        p, elapsed = self.progress, time.perf_counter() - w.start
        step_time = elapsed / max(w.steps, 1)
        m = {"train/loss": loss / w.tokens_tgt, "train/nll": nll / w.tokens_tgt,
             "train/ppl": math.exp(min(nll / w.tokens_tgt, 50.0)), "train/lr": w.lr,
             "train/grad_norm": w.grad_norm,
             "train/tgt_tokens_per_s": w.tokens_tgt / elapsed, "train/src_tokens_per_s": w.tokens_src / elapsed,
             "train/step_time_s": step_time}
        self.last_metrics.update(m)
        p.history_train.append([float(p.step), m["train/loss"], m["train/nll"], m["train/lr"]])
        _safe_log(self.tracker, m, p.step)
        eta = (self.tc.max_steps - p.step) * step_time
        log.info("step %d/%d | loss %.4f | nll %.4f | lr %.3g | %.0f tgt tok/s | %.3f s/step | ETA %s",
                 p.step, self.tc.max_steps, m["train/loss"], m["train/nll"], w.lr,
                 m["train/tgt_tokens_per_s"], step_time, _hms(eta))

    @torch.no_grad()
    def _evaluate(self, model: torch.nn.Module) -> None:
        """Loss and perplexity on the dev split: each worker a stride of the batches, sums all-reduced."""
        d = self.dev_data
        rows = np.flatnonzero((d.src_len + 1 <= self.mcfg.max_positions) & (d.tgt_len + 1 <= self.mcfg.max_positions))
        batches = batching.plan_eval_batches(rows, d.src_len, d.tgt_len, self.tc.max_tokens_per_batch)
        inner = model.module if isinstance(model, DDP) else model
        inner.eval()
        sums = torch.zeros(3, dtype=torch.float64, device=self.device)
        for rows_b in batches[self.rank::self.world]:
            b = batching.collate(rows_b, d.src_values, d.src_offsets, d.tgt_values, d.tgt_offsets,
                                 self.mcfg.pad_id, self.mcfg.bos_id, self.mcfg.eos_id)
            mb = to_device(b, self.device)
            with self.autocast():
                logits = inner(mb.src, mb.tgt_in)
            loss, nll = label_smoothed_nll(logits, mb.tgt_out, epsilon=self.tc.label_smoothing,
                                           ignore_index=self.mcfg.pad_id)
            sums += torch.stack([loss.double(), nll.double(), torch.tensor(float(b.num_tgt_tokens),
                                 dtype=torch.float64, device=self.device)])
        inner.train()
        loss, nll, n = self._all_reduce(sums)
        if self.rank != 0 or n == 0:
            return
        m = {"val/loss": loss / n, "val/nll": nll / n, "val/ppl": math.exp(min(nll / n, 50.0))}
        self.last_metrics.update(m)
        self.progress.history_val.append([float(self.progress.step), m["val/loss"], m["val/nll"]])
        _safe_log(self.tracker, m, self.progress.step)
        log.info("step %d/%d | val loss %.4f | val ppl %.2f", self.progress.step, self.tc.max_steps,
                 m["val/loss"], m["val/ppl"])

    def _checkpoint_due(self, last_ckpt_t: float, log_step: bool) -> bool:
        step, tc = self.progress.step, self.tc
        due = step % tc.checkpoint_interval_steps == 0 or step == tc.max_steps
        if tc.checkpoint_interval_s > 0 and log_step and not due:
            # Wall clocks differ between workers: rank 0 decides, and tells the others with a
            # broadcast, which waits for the device. Asked on log steps only (which all workers
            # reach together), so a step that neither logs nor checkpoints never syncs; a
            # time-based checkpoint comes at most `train.log_interval_steps` late.
            flag = torch.tensor([int(time.monotonic() - last_ckpt_t >= tc.checkpoint_interval_s)],
                                device=self.device)
            if self.world > 1:
                dist.broadcast(flag, src=0)
            due = bool(flag.item())
        return due

    def _checkpoint(self) -> None:
        """Rank 0 writes the folder and reports it; the others report without (a barrier)."""
        p, t0 = self.progress, time.perf_counter()
        metrics = {"step": p.step, "epoch": p.epoch, **self.last_metrics}
        name = train_checkpoint.checkpoint_dir_name(p.step)
        upload_async = self.tc.checkpoint_upload == "async"
        if self.rank != 0:
            self.session.report(metrics, None, None, upload_async)
            return
        tmp = tempfile.mkdtemp(prefix=f"{name}-")
        try:
            train_checkpoint.save(tmp, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                  scaler=self.scaler, progress=p, model_config=self.spec.model_config,
                                  extra={"seed": self.tc.seed, "world_size": self.world,
                                         "num_dropped": self.num_dropped})
            self._maybe_fail_upload(tmp)
            # async: Ray Train uploads in a background thread, registers the checkpoint only once
            # it is complete, deletes `tmp` afterwards, and waits for the upload before the run ends.
            self.session.report(metrics, tmp, name, upload_async)
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        if not upload_async:
            shutil.rmtree(tmp, ignore_errors=True)
        stall = time.perf_counter() - t0
        log.info("step %d/%d | checkpoint %s (%s upload; the loop waited %.2f s)", p.step, self.tc.max_steps,
                 name, "background" if upload_async else "synchronous", stall)

    def _maybe_fail(self, step: int) -> None:
        """Tests only: the last worker fails before `fail_at_step`, once (the marker file says so).

        fail_mode "raise": an exception (a worker failure for Ray Train to recover from);
        "hang": the worker stops there, so a test can kill the driver at a known step.
        """
        s = self.spec
        if s.fail_at_step != step or self.rank != self.world - 1 or not s.fail_marker or s.fail_mode == "upload":
            return
        if os.path.exists(s.fail_marker):
            return
        Path(s.fail_marker).write_text(str(step))
        if s.fail_mode == "hang":
            log.warning("test hook %s: worker %d hangs before step %d", FAIL_AT_STEP_ENV, self.rank, step)
            while True:
                time.sleep(60)
        raise RuntimeError(f"injected failure before step {step} (test hook {FAIL_AT_STEP_ENV})")

    def _maybe_fail_upload(self, checkpoint_dir: str) -> None:
        """Tests only (fail_mode "upload"): at the first checkpoint at or after `fail_at_step`,
        rank 0's process dies while that checkpoint is being uploaded (once: the marker file)."""
        s = self.spec
        if s.fail_mode != "upload" or self.progress.step < s.fail_at_step or os.path.exists(s.fail_marker):
            return
        Path(s.fail_marker).write_text(str(self.progress.step))
        self.session.die_during_next_upload = True  # RaySession.report: the upload kills the worker

    def summary(self) -> dict[str, Any]:
        p = self.progress
        return {"final_step": p.step, "start_step": self.start_step, "epoch": p.epoch,
                "tokens_seen": {"src": p.tokens_src, "tgt": p.tokens_tgt},
                "train_time_s": p.train_time_s, "num_dropped_too_long": self.num_dropped,
                "num_pairs": len(self.rows), "precision": self.precision, "world_size": self.world,
                "history_train": p.history_train, "history_val": p.history_val, "last_metrics": self.last_metrics}


class _Feeder:
    """Hands out a step's host micro-batches, built one step ahead in a background thread.

    The batches are a pure function of the step's rows, so prefetch on or off gives the same
    losses (tested); on a GPU the collate, the pinning and the index computation then overlap
    the previous step's kernels instead of delaying the next launch."""

    def __init__(self, build: Any, prefetch: bool):
        self.build = build
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if prefetch else None
        self.pending: tuple[np.ndarray, Future] | None = None

    def take(self, group: np.ndarray) -> tuple[list[MicroBatch], int, int]:
        """The step's batches: the prefetched ones if they are this group's, else built now."""
        ahead, self.pending = self.pending, None
        if ahead is not None and ahead[0] is group:
            return ahead[1].result()
        return self.build(group)

    def ahead(self, next_group: np.ndarray | None) -> None:
        """Start building the next step's batches in the background (no-op without prefetch)."""
        if self.pool is not None and next_group is not None:
            self.pending = (next_group, self.pool.submit(self.build, next_group))

    def close(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)


def train_worker(spec: dict[str, Any], session: Session) -> dict[str, Any]:
    """Entry point of a worker: build, resume, train; the summary (rank 0's is the stage's)."""
    return Trainer(LoopSpec(**spec), session).run()


def _make_tracker(uri: str | None, run_id: str | None) -> Any:
    if not run_id:
        return None
    from pipeline.tracking import RunLogger  # MLflow is imported lazily, on first log

    return RunLogger(uri, run_id)


_tracking_warned = False


def _safe_log(tracker: Any, metrics: dict[str, float], step: int) -> None:
    """Tracking must never stop training: a failure is logged once and then ignored."""
    global _tracking_warned
    if tracker is None:
        return
    try:
        tracker.log_metrics(metrics, step=step)
    except Exception as e:  # noqa: BLE001 (any store error)
        if not _tracking_warned:
            log.warning("could not log metrics to MLflow (%s); training continues", e)
            _tracking_warned = True


def _hms(seconds: float) -> str:
    s = int(max(seconds, 0))
    return f"{s // 3600}:{s % 3600 // 60:02d}:{s % 60:02d}"
