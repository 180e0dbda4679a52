"""The per-worker training loop: the paper's recipe (§5) on token-bucketed steps.

Runs inside each Ray Train worker (`pipeline.train.driver` gives it a `RaySession`) or in-process
for tests and benchmarks (`LocalSession`); it imports neither Ray nor MLflow.

One optimizer step = one step group of ~`train.tokens_per_step` target tokens
(`pipeline.batch_plan.step_groups`), cut into `world_size * accum` micro-batches; every worker computes
the same global plan and takes its share. The `Trainer` holds the worker's model, optimizer and
data and runs the loop: each step returns what it did (`StepResult`), which is counted in the
loop's one state (`LoopState`: the `Progress`, the window since the last log line, the attempt's
start); the step's agreement then decides, in one pure function (`pipeline.train.agreement.decide`),
the actions the loop carries out in order (`carry_out`). Each of its parts is a unit of its own:

    pipeline.train.device      how the worker runs on its device (WorkerDevice): precision and
                               autocast, the loss settings, torch.compile, the attention kernel
    pipeline.train.feeder      the step groups of each epoch (StepPlan); this worker's StepBatch
                               of a step, built one step ahead, and its upload to the device
    pipeline.train.step        one step on the device: accumulation, loss normalization, Adam
    pipeline.train.metrics     the window since the last log line, the progress line, MLflow
    pipeline.train.dev_loss    dev loss and perplexity (DevLoss)
    pipeline.train.agreement   what the ranks share after a step, in one collective (StepAgreement),
                               which steps log, validate, checkpoint (Cadence), and what the step's
                               agreement decides: log, dev loss, early stop, stop for a preemption
                               notice, checkpoint (decide, Action)
    pipeline.train.checkpoint  the checkpoint folder, restored, written and reported (Checkpointer)
    pipeline.train.early_stop  the EarlyStop rule (train.early_stop_patience) and the loop's
                               EarlyStopDecision, rebuilt at a resume
    pipeline.train.session     Ray Train or the test process (and wrappers around them)

Per-step dropout seeds make a resumed run replay the steps it lost exactly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from model import ModelConfig, Transformer, make_optimizer, make_scheduler
from pipeline.batch_plan.shapes import ShapeBuckets
from pipeline.config import from_dict as config_from_dict
from pipeline.config.devices import on_for
from pipeline.tracking import spool_dir_for  # imports no MLflow (it loads lazily)
from pipeline.train import elastic, preemption
from pipeline.train.agreement import Action, Agreed, Cadence, Local, StepAgreement, decide
from pipeline.train.checkpoint import Checkpointer, Progress
from pipeline.train.corpus import load_corpus, load_shared_corpus
from pipeline.train.dev_loss import DevLoss
from pipeline.train.device import WorkerDevice
from pipeline.train.early_stop import EarlyStopDecision
from pipeline.train.feeder import Feeder, HostBatcher, MicroBatch, StepBatch, StepPlan, upload
from pipeline.train.metrics import TrainLog, Window
from pipeline.train.session import LocalSession, Session, wrap  # noqa: F401 (LocalSession: re-exported)
from pipeline.train.step import TrainedModel, accumulate_gradients, optimizer_step, step_seed

log = logging.getLogger(__name__)


@dataclass(kw_only=True)
class LoopSpec:
    """What the driver sends to every worker (JSON-able: Ray's `train_loop_config`)."""

    cfg: dict[str, Any]  # Config.to_dict()
    model_config: dict[str, Any]  # ModelConfig.to_dict()
    train_dir: str
    dev_dir: str = ""  # "" = no validation
    tracking_uri: str | None = None
    run_id: str | None = None  # the stage's MLflow run; None = log nothing
    num_threads: int = 0  # torch threads of this worker (the CPUs Ray reserved for it); 0 = leave as is
    session_wrapper: str = ""  # "module:function[:arg]" around the worker's session (pipeline.train.session)
    dev_bleu_dir: str = ""  # the Ray Train run dir whose dev BLEU records early stopping reads ("" = none)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass(kw_only=True)
class StepResult:
    """What one optimizer step did (its sums stay on the device: reading them would sync)."""

    loss: torch.Tensor  # () this worker's label-smoothed loss sum over the step's target tokens
    nll: torch.Tensor  # () its nll sum
    lr: float  # the rate the step used
    grad_norm: float | None  # the gradient norm, on log steps only
    src_tokens: int  # the step's non-pad source tokens (all workers)
    tgt_tokens: int  # its target tokens (all workers)
    started: float  # time.perf_counter() when the step began


@dataclass(kw_only=True)
class LoopState:
    """The loop's mutable state: where training stands, and what this attempt has run since its start."""

    progress: Progress = field(default_factory=Progress)  # saved in every checkpoint
    window: Window = field(default_factory=Window)  # the steps since the last log line
    start_step: int = 0  # the step this attempt resumed from
    time_base_s: float = 0.0  # progress.train_time_s when this attempt's loop began
    attempt_start: float = 0.0  # time.perf_counter() then

    def begin(self) -> None:
        """An attempt's loop begins: a new window, the attempt's clock started."""
        self.window, self.attempt_start = Window(), time.perf_counter()
        self.time_base_s = self.progress.train_time_s

    def advance(self, r: StepResult) -> None:
        """Count the step `r` in the window (its sums stay on the device: no sync) and the progress."""
        w, p = self.window, self.progress
        w.steps, w.lr = w.steps + 1, r.lr
        w.tokens_src, w.tokens_tgt = w.tokens_src + r.src_tokens, w.tokens_tgt + r.tgt_tokens
        w.loss = r.loss if w.loss is None else w.loss + r.loss
        w.nll = r.nll if w.nll is None else w.nll + r.nll
        if r.grad_norm is not None:
            w.grad_norm = r.grad_norm
        p.tokens_src, p.tokens_tgt = p.tokens_src + r.src_tokens, p.tokens_tgt + r.tgt_tokens
        p.step, p.step_in_epoch = p.step + 1, p.step_in_epoch + 1
        p.train_time_s = self.time_base_s + time.perf_counter() - self.attempt_start


class Trainer:
    """One worker's model, optimizer and data, and the loop; `run()` trains up to `train.max_steps`.
    `cpu_kernels`: the model's (`Transformer`'s); False: PyTorch's dropout on a CPU too (an eager
    run compared with a compiled one, whose dropout is PyTorch's)."""

    def __init__(self, spec: LoopSpec, session: Session, cpu_kernels: bool = True):
        self.spec, self.session = spec, session
        self.cfg = config_from_dict(spec.cfg)
        self.tc = tc = self.cfg.train
        self.speed = speed = self.cfg.speed
        self.mcfg = ModelConfig.from_dict(spec.model_config)
        self.device, self.rank, self.world = session.device, session.rank, session.world_size
        self.device_setup = WorkerDevice(speed, self.device, spec.num_threads)
        self.train_data = load_shared_corpus(spec.train_dir, self.cfg.workers.corpus_cache_dir or None)
        self.plan = StepPlan(self.train_data, tc.max_len, tc.tokens_per_step, tc.seed)
        torch.manual_seed(tc.seed)  # identical initial weights on every worker
        module = Transformer(self.mcfg, cpu_kernels=cpu_kernels).to(self.device)
        # speed.shape_buckets: fixed shapes on a GPU, for the steps and the dev batches alike
        buckets = ShapeBuckets() if on_for(speed.shape_buckets, self.device.type) else None
        self.loss_settings = self.device_setup.loss_settings(module, tc.label_smoothing, self.mcfg.pad_id)
        self.dev_loss = (DevLoss(load_corpus(spec.dev_dir), self.mcfg, speed.max_tokens_per_batch, self.loss_settings,
                                 self.rank, self.world, self.device, buckets) if spec.dev_dir else None)
        self.optimizer = make_optimizer(module, betas=(tc.adam_beta1, tc.adam_beta2), eps=tc.adam_eps)
        self.scheduler = make_scheduler(self.optimizer, self.mcfg.d_model, tc.warmup_steps, tc.lr_scale)
        self.model = TrainedModel(module, self.device_setup.compile(module))  # the one handle to it
        why = self.device_setup.choose_attention(self.mcfg.n_heads, module.decoder_layers[0].self_attn.heads.hs)
        if self.rank == 0:
            log.info("%s", why)
        # This worker's host batches; it counts the shapes it made.
        self.batcher = HostBatcher(self.train_data, self.mcfg, self.rank, self.world, speed.max_tokens_per_batch,
                                   self.device, self.device_setup.row_multiple, buckets)
        self.state = LoopState()
        self.cadence = Cadence(tc.max_steps, self.cfg.metrics, self.cfg.checkpoint, validates=self.dev_loss is not None)
        state = {"model": module, "optimizer": self.optimizer, "scheduler": self.scheduler,
                 "scaler": self.loss_settings.scaler}
        extra = {"seed": tc.seed, "world_size": self.world, "num_dropped": self.plan.num_dropped}
        self.checkpoints = Checkpointer(session, self.rank, self.device, self.cfg.checkpoint, state, tc.max_steps,
                                        spec.model_config, extra)
        self.early_stop = EarlyStopDecision.for_loop(tc, self.dev_loss is not None, spec.dev_bleu_dir, self.rank)
        self.metrics = TrainLog(self.state.progress, tc.max_steps, self.rank, spec.tracking_uri, spec.run_id,
                                self.cfg.tracking.buffer_s, spool_dir_for(self.cfg))

    @property
    def progress(self) -> Progress:
        """Where training stands (read by tests and benchmarks while `run` trains)."""
        return self.state.progress

    def restore(self) -> None:
        progress = self.checkpoints.restore()
        if progress is None:
            return
        self.state.progress = self.metrics.progress = progress
        if self.early_stop is not None:  # continue the count from what was logged up to here
            self.early_stop.resume(progress)

    def run(self) -> dict[str, Any]:
        self.restore()
        s = self.state
        s.start_step = s.progress.step
        self.cadence.checkpointed()  # the checkpoint clock starts with the loop
        model = self.model
        model.distribute(self.device, self.world, self.speed.grad_compression)
        log_start(self)
        s.begin()
        feeder = Feeder(self.batcher, prefetch=self.speed.prefetch)
        agreement = StepAgreement(self.world)
        grace_s = self.cfg.workers.preemption_grace_s
        notice = preemption.Notice(grace_s, self.rank) if grace_s else None
        try:
            while s.progress.step < self.tc.max_steps and not s.progress.early_stop:
                started = time.perf_counter()
                p = s.progress
                group, nxt = self.plan.at(p.epoch, p.step_in_epoch)
                if group is None:  # the epoch is over
                    p.epoch, p.step_in_epoch = p.epoch + 1, 0
                    continue
                if self.session.before_step is not None:  # a wrapper's hook (faults, stamps)
                    self.session.before_step(p.step + 1)
                host = feeder.take(group)
                micro = self._on_device(model, host)
                feeder.ahead(nxt)  # the next step's batches, built while this step's kernels run
                s.advance(self._train_step(model, micro, host, started))
                # The step's one collective: what the ranks must share, then what it decides.
                agreed = agreement.exchange(local_side(self, model, notice, started),
                                            blocking=self.cadence.syncs(p.step))
                stop = self._early_stop_record(agreed)
                carry_out(self, decide(agreed, p.step, self.cadence, stop is not None), agreed, stop, notice)
        finally:
            feeder.close()
            agreement.close()
            if notice is not None:
                notice.close()
            self.metrics.close()
        return summary(self)

    def _on_device(self, model: TrainedModel, host: StepBatch) -> list[MicroBatch]:
        """The step's micro-batches uploaded, its dropout seed set, the model in training mode."""
        micro = [upload(mb, self.device) for mb in host.micro_batches]
        torch.manual_seed(step_seed(self.tc.seed, self.rank, self.state.progress.step + 1))
        model.train()
        return micro

    def _train_step(self, model: TrainedModel, micro: list[MicroBatch], host: StepBatch, started: float
                    ) -> StepResult:
        """One optimizer step on the uploaded `micro` batches of `host`: what it did."""
        with self.device_setup.attention():
            loss, nll = accumulate_gradients(model, micro, host.tgt_tokens, self.world, self.loss_settings)
        lr = self.optimizer.param_groups[0]["lr"]
        norm = optimizer_step(model, self.optimizer, self.scheduler, self.loss_settings.scaler, self.tc.clip_norm,
                              self.cadence.logs(self.state.progress.step + 1))
        return StepResult(loss=loss, nll=nll, lr=lr, grad_norm=norm, src_tokens=host.src_tokens,
                          tgt_tokens=host.tgt_tokens, started=started)

    def _early_stop_record(self, agreed: Agreed | None) -> dict[str, Any] | None:
        """The early-stop rule's verdict at this step (its record), from the agreed dev loss or wish."""
        if self.early_stop is None or agreed is None:
            return None
        m = DevLoss.metrics(agreed.dev_sums) if agreed.dev_sums is not None else None
        return self.early_stop.decide(self.state.progress.step, agreed.stop, m["val/loss"] if m else None)

    def _checkpoint(self, sync: bool = False) -> float:
        """The checkpoint of this step; the seconds the loop waited (`sync`: the upload included)."""
        self.metrics.spool_pending()  # rank 0: every point up to this step delivered or on disk
        waited = self.checkpoints.write(self.state.progress, self.metrics.last, sync)
        self.cadence.checkpointed()
        if self.rank == 0:
            self.metrics.log({"train/checkpoint_stall_s": waited})
        return waited


def carry_out(t: Trainer, actions: list[Action], agreed: Agreed | None, stop: dict[str, Any] | None,
              notice: preemption.Notice | None) -> None:
    """Do what `decide` said, in its order. `stop`: the early stop's record (on EARLY_STOP)."""
    s = t.state
    for action in actions:
        if action is Action.LOG:
            log_window(t, s.window, agreed.log_sums)
            s.window = Window()
        elif action is Action.DEV_LOSS:
            record_dev_loss(t, agreed.dev_sums)
        elif action is Action.EARLY_STOP:
            s.progress.early_stop = stop
            if t.rank == 0:
                t.early_stop.announce(s.progress.step)
                t.metrics.log(t.early_stop.metrics(s.progress.step))
        elif action in (Action.STOP_PREEMPTED_AFTER_CHECKPOINT, Action.STOP_PREEMPTED):
            stop_preempted(t, agreed, fits=action is Action.STOP_PREEMPTED_AFTER_CHECKPOINT)
        elif action is Action.CHECKPOINT:
            save_s = t._checkpoint()
            if notice is not None:
                notice.save_s = save_s


def stop_preempted(t: Trainer, agreed: Agreed, fits: bool) -> None:
    """At the step agreed on after a SIGTERM to any worker: a synchronous checkpoint if it fits, then `Preempted`."""
    step = t.state.progress.step
    if t.rank == 0:
        preemption.announce(agreed, step, fits)
    if fits:
        t._checkpoint(sync=True)
        flush = getattr(t.session, "flush_reports", None)  # Ray: registered before the group stops
        if flush is not None:
            flush(timeout_s=10.0)
    raise preemption.Preempted(f"preemption notice (SIGTERM): stopped at step {step} "
                               f"{'after a checkpoint' if fits else 'without a checkpoint'}")


def local_side(t: Trainer, model: TrainedModel, notice: preemption.Notice | None, started: float) -> Local:
    """This rank's side of the step's agreement: the sums of a log or validation step, rank 0's
    wishes (a time-based checkpoint, an early stop on dev BLEU), the preemption notice."""
    p, c = t.state.progress, t.cadence
    local = Local()
    if c.logs(p.step):
        local.log_sums = torch.stack([t.state.window.loss, t.state.window.nll])
    if c.validates_at(p.step):
        with t.device_setup.attention():
            local.dev_sums = t.dev_loss.sums(model)
    if t.rank == 0:
        local.checkpoint_due = c.time_due(p.step)
        local.stop = t.early_stop is not None and t.early_stop.wish(p.step, c.logs(p.step))
    if notice is not None:
        # What a checkpoint at the next step costs: this step (up to its agreement, so a validation
        # step's dev loss counts) and a save; the grace left, once a SIGTERM came.
        local.step_and_save_s, local.save_s = time.perf_counter() - started + notice.save_s, notice.save_s
        if notice.received:
            local.grace_left_s = notice.grace_left(p.step)
    return local


def log_window(t: Trainer, window: Window, sums: list[float]) -> None:
    """The log line of `window`'s steps (rank 0: its history row, the batch shapes, compiled graphs)."""
    m = t.metrics.log_window(window, sums)
    if t.rank == 0:
        p, compiler = t.state.progress, t.device_setup.compiler
        p.history_train.append([float(p.step), m["train/loss"], m["train/nll"], m["train/lr"]])
        t.metrics.log({"train/batch_shapes": float(len(t.batcher.shapes)), **(
            {"train/compiled_graphs": float(compiler.num_graphs)} if compiler is not None else {})})


def record_dev_loss(t: Trainer, sums: list[float]) -> float | None:
    """The dev loss of the workers' added sums, logged and kept in the history; None without one."""
    m = DevLoss.metrics(sums)
    if m is None:
        return None
    p = t.state.progress
    p.history_val.append([float(p.step), m["val/loss"], m["val/nll"]])
    t.metrics.log(m)
    if t.rank == 0:
        log.info("step %d/%d | val loss %.4f | val ppl %.2f", p.step, t.tc.max_steps, m["val/loss"],
                 m["val/ppl"])
    return m["val/loss"]


def log_start(t: Trainer) -> None:
    """World size and accumulation at the resume step (elastic runs change them), and where it starts."""
    p, tc = t.state.progress, t.tc
    previous_world, p.world_size = p.world_size or None, t.world
    group, _ = t.plan.at(p.epoch, p.step_in_epoch)
    if group is not None:
        accum = t.plan.accum(group, t.world, t.speed.max_tokens_per_batch)
        elastic.log_start(t.metrics.tracker, t.rank, p.step, t.world, accum, previous_world)
    if t.rank == 0:
        log.info("training from step %d to %d on %d worker(s), %s; %d pairs kept, %d dropped "
                 "(> train.max_len=%d pieces); %d steps in epoch %d", p.step, tc.max_steps, t.world,
                 t.device_setup.precision, len(t.plan.rows), t.plan.num_dropped, tc.max_len,
                 len(t.plan.groups(p.epoch)), p.epoch)


def summary(t: Trainer) -> dict[str, Any]:
    """What a worker returns at the end (rank 0's is the stage's): where it stopped, what it saw."""
    p, compiler = t.state.progress, t.device_setup.compiler
    return {"final_step": p.step, "start_step": t.state.start_step, "epoch": p.epoch,
            "tokens_seen": {"src": p.tokens_src, "tgt": p.tokens_tgt},
            "train_time_s": p.train_time_s, "num_dropped_too_long": t.plan.num_dropped,
            "num_pairs": len(t.plan.rows), "precision": t.device_setup.precision, "world_size": t.world,
            "history_train": p.history_train, "history_val": p.history_val, "last_metrics": t.metrics.last,
            "early_stop": p.early_stop or None,
            "compiled_graphs": compiler.num_graphs if compiler is not None else None,
            "batch_shapes": len(t.batcher.shapes)}


def train_worker(spec: dict[str, Any], session: Session) -> dict[str, Any]:
    """Entry point of a worker: build, resume, train; the summary (rank 0's is the stage's)."""
    loop_spec = LoopSpec(**spec)
    return Trainer(loop_spec, wrap(session, loop_spec.session_wrapper)).run()
