"""The sections of benchmarks/gpu_check.py that probe the device: host syncs, checkpoint stall,
the largest micro-batch that fits, DDP on one GPU, beam-4 decoding. Each returns (figures, text).
Imports torch, numpy and this project's model/ and pipeline/train/ only (see gpu_check.py)."""

from __future__ import annotations

import socket
import time
import warnings
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from model import ModelConfig, Transformer, beam_search, make_optimizer, make_scheduler
from pipeline.plan.flops import OpCounter
from pipeline.train import checkpoint as train_checkpoint
from pipeline.train import feeder
from pipeline.train.corpus import Corpus
from pipeline.train.feeder import BatchLayout, HostBatcher, to_device
from pipeline.train.loop import LoopState, Trainer
from pipeline.train.step import LossSettings, TrainedModel, accumulate_gradients, optimizer_step


def count_syncs(trainer: Trainer, device: str, steps: int = 10) -> tuple[float, int]:
    """(host syncs per plain step, syncs of the final step, which logs and checkpoints) of a short
    continued run; each step's count runs from its start to the next step's start."""
    trainer.tc.max_steps = trainer.progress.step + steps
    trainer.cfg.metrics.log_interval_steps = trainer.cfg.checkpoint.interval_steps = steps
    starts: list[int] = []
    original = trainer._train_step

    def marked(*a, **kw):
        starts.append(len(caught))
        return original(*a, **kw)

    trainer._train_step = marked
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.run()
            end = len(caught)
    finally:
        if cuda:
            torch.cuda.set_sync_debug_mode("default")
        trainer._train_step = original
    per_step = np.diff(starts + [end])
    return float(per_step[:-1].mean()), int(per_step[-1])


def step_profile(trainer: Trainer, device: str, steps: int = 6) -> dict:
    """What one training step costs the host and the device, over `steps` continued plain steps:
    aten ops dispatched per step (a TorchDispatchMode, forward + backward + Adam; on a compiled
    model only what runs outside its graphs), wall ms per step, and on a GPU (torch.profiler)
    kernel launches per step and device-busy ms per step (the kernels' summed durations)."""
    trainer.cfg.metrics.log_interval_steps = trainer.cfg.checkpoint.interval_steps = 10**9
    trainer.tc.max_steps = trainer.progress.step + 2
    trainer.run()  # warm: these steps' shapes and kernels seen once
    cuda = device.startswith("cuda")
    trainer.tc.max_steps = trainer.progress.step + steps
    with OpCounter() as ops:
        trainer.run()
    trainer.tc.max_steps = trainer.progress.step + steps
    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=activities) as prof:
        t0 = time.perf_counter()
        trainer.run()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    out = {"aten_ops_per_step": ops.count / steps, "wall_ms_per_step": 1e3 * wall / steps}
    if cuda:
        kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        out["launches_per_step"] = len(kernels) / steps
        out["device_ms_per_step"] = sum(e.device_time_total for e in kernels) / 1e3 / steps
        out["top_device_ops"] = prof.key_averages().table(sort_by="device_time_total", row_limit=15)
    else:
        out["top_host_ops"] = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15)
    return out


def checkpoint_stall(trainer: Trainer, folder: Path) -> dict:
    folder.mkdir()
    t1 = time.perf_counter()
    train_checkpoint.save(folder, model=trainer.model.module, optimizer=trainer.optimizer, scheduler=trainer.scheduler,
                          scaler=None, progress=trainer.progress, model_config=trainer.mcfg.to_dict())
    return {"checkpoint_stall_s": time.perf_counter() - t1,
            "checkpoint_bytes": sum(f.stat().st_size for f in folder.iterdir())}


def largest_fitting(fits: Callable[[int], bool], lo: int, hi: int, rel_tol: float = 0.05) -> tuple[int, int | None]:
    """(largest n tried that fits, smallest n tried that does not, or None if `hi` fits), growing
    n from `lo` by doubling, then bisecting until the two are within `rel_tol`. (0, lo): none fits."""
    if not fits(lo):
        return 0, lo
    good, bad = lo, None
    while bad is None and good < hi:
        n = min(2 * good, hi)
        if fits(n):
            good = n
        else:
            bad = n
    while bad is not None and bad - good > rel_tol * good:
        mid = (good + bad) // 2
        good, bad = (mid, bad) if fits(mid) else (good, mid)
    return good, bad


def fit_probe(pr: Any, mc: ModelConfig) -> Callable[[int], bool]:
    """fits(n): one fwd + bwd + Adam step of a micro-batch of n padded tokens of pairs at
    train.max_len (attention's worst case) in bf16 on the device, without running out of memory."""
    device = torch.device(pr.device)
    torch.manual_seed(0)
    model = Transformer(mc).to(device)
    opt = make_optimizer(model)
    sched = make_scheduler(opt, mc.d_model, 4000)
    L = pr.max_len
    rng = np.random.default_rng(0)
    autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16)  # noqa: E731

    def fits(n: int) -> bool:
        rows = max(1, n // (L + 1))  # + 1: eos (source) / bos (target input)
        offsets = np.arange(rows + 1, dtype=np.int64) * L
        values = rng.integers(4, mc.vocab_size, size=rows * L).astype(np.int32)
        try:
            b = feeder.collate(np.arange(rows),
                                      Corpus(src_values=values, src_offsets=offsets, tgt_values=values,
                                             tgt_offsets=offsets),
                                      BatchLayout(pad_id=mc.pad_id, bos_id=mc.bos_id, eos_id=mc.eos_id))
            mb = to_device(b, device)
            accumulate_gradients(model, [mb], b.num_tgt_tokens, 1,
                                 LossSettings(label_smoothing=0.1, pad_id=mc.pad_id, autocast=autocast))
            optimizer_step(model, opt, sched, None, 0.0, want_norm=False)
            if device.type == "cuda":
                torch.cuda.synchronize()
            return True
        except torch.OutOfMemoryError:
            return False
        finally:
            opt.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()

    return fits


def fit_section(pr: Any, size: str) -> tuple[dict, str]:
    fits = fit_probe(pr, pr.model(size))
    good, bad = largest_fitting(fits, *pr.fit_range)
    del fits
    if pr.device.startswith("cuda"):
        torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory if pr.device.startswith("cuda") else 0
    advice = int(0.9 * good) // 1000 * 1000  # headroom: fragmentation, the prefetch thread's batches
    res = {"largest_fitting": good, "first_failing": bad, "suggested_max_tokens_per_batch": advice,
           "pair_len": pr.max_len, "device_memory_bytes": total}
    bound = f"<{bad:,}" if bad is not None else f">= {good:,} (the search's ceiling)"
    accum = -(-pr.tokens_per_step // max(advice, 1)) if advice else None
    return res, (f"largest fitting {good:,} padded tokens ({bound}); speed.max_tokens_per_batch = {advice:,} "
                 f"-> accum {accum} at {pr.tokens_per_step:,} tokens/step")


def ddp_section(pr: Any, trainer: Trainer, plain_tps: float) -> tuple[dict, str]:
    """The loop's step through DDP (NCCL on a GPU, gloo for --smoke), world size 1, bf16 hook."""
    import torch.distributed as dist

    backend = "nccl" if pr.device.startswith("cuda") else "gloo"
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        # bf16_compress_hook needs NCCL (CUDA) or XCCL: the smoke's gloo DDP runs without it.
        hook = "bf16" if backend == "nccl" else "none"
        ddp = TrainedModel(trainer.model.module, trainer.model.compiled)
        ddp.distribute(trainer.device, 1, hook, always=True)
        plan = trainer.plan.groups(1)[: pr.train_steps["base"]]
        host = HostBatcher(trainer.train_data, trainer.mcfg, 0, 1, trainer.speed.max_tokens_per_batch, trainer.device)
        counted = LoopState()  # the loop's counting; its window restarts at the measured half
        for i, group in enumerate(plan):
            if i == len(plan) // 2:  # the second half is measured (warm)
                if pr.device.startswith("cuda"):
                    torch.cuda.synchronize()
                counted.begin()
            batch = host(group)
            counted.advance(trainer._train_step(ddp, trainer._on_device(ddp, batch), batch, time.perf_counter()))
        window = counted.window
        loss = float(window.loss) / window.tokens_tgt
        if pr.device.startswith("cuda"):
            torch.cuda.synchronize()
        tps = window.tokens_tgt / (time.perf_counter() - window.start)
        # gloo's worker thread frees its last finished work shortly after DDP saw it complete, and
        # that needs the GIL; the group's destructor joins that thread holding the GIL. Seen once
        # (a hung --smoke, py-spy: ~ProcessGroupGloo in join, the worker in gil_scoped_acquire):
        # let the worker finish first (sleep releases the GIL), then drop DDP, then the group.
        time.sleep(0.2)
        del ddp
    finally:
        dist.destroy_process_group()
    if not np.isfinite(loss):
        raise RuntimeError(f"DDP steps gave a non-finite loss ({loss})")
    return ({"backend": backend, "grad_compression": hook, "tgt_tokens_per_s": tps, "vs_plain": tps / plain_tps,
             "loss": loss},
            f"{backend}, world 1, {hook} compression hook: {tps:,.0f} tgt tok/s = {tps / plain_tps:.2f}x the plain model; "
            f"loss {loss:.3f}")


def decode_section(pr: Any, rng: np.random.Generator, words: np.ndarray) -> tuple[dict, str]:
    mc = pr.model("base")
    torch.manual_seed(0)
    model = Transformer(mc).to(pr.device).eval()
    n = pr.decode_sentences
    lens = (words[rng.integers(0, len(words), n), 0] * 1.3).astype(int).clip(1, 200)
    srcs = [rng.integers(4, mc.vocab_size, size=k).tolist() + [mc.eos_id] for k in lens]
    order = np.argsort([len(s) for s in srcs])
    device_type = pr.device.split(":")[0]
    batches = []
    for i in range(0, n, 64):
        batch = [srcs[j] for j in order[i:i + 64]]
        width = max(len(s) for s in batch)
        batches.append(torch.tensor([s + [mc.pad_id] * (width - len(s)) for s in batch], device=pr.device))
    autocast = torch.autocast(device_type, dtype=torch.bfloat16, enabled=not pr.smoke)
    t0 = time.perf_counter()
    with torch.no_grad(), autocast:
        for src in batches:
            beam_search(model, src, beam_size=4, alpha=0.6)
    if device_type == "cuda":
        torch.cuda.synchronize()
    sps = n / (time.perf_counter() - t0)
    # What a decoding step costs the host, on one batch (not timed): aten ops and waits for the device.
    steps = [0]
    decode_step = model.decode_step

    def counted(prev_ids, state):
        steps[0] += 1
        return decode_step(prev_ids, state)

    model.decode_step = counted
    try:
        with torch.no_grad(), autocast, OpCounter() as ops:
            beam_search(model, batches[len(batches) // 2], beam_size=4, alpha=0.6)
    finally:
        del model.decode_step
    per_step = {"aten_ops_per_decode_step": ops.count / steps[0], "device_waits_per_decode_step": ops.waits / steps[0]}
    return ({"sentences": n, "sentences_per_s": sps, **per_step},
            f"{n} sentences, random base model: {sps:.1f} sentences/s; per decoding step "
            f"{per_step['aten_ops_per_decode_step']:.0f} aten ops, {per_step['device_waits_per_decode_step']:.1f} waits")
