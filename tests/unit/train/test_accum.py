"""Gradient accumulation: micro-batches (in one process, and across 2 DDP workers on gloo) leave
the gradient of one big batch of the same pairs, normalized by the step's target tokens."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from model import ModelConfig, Transformer, label_smoothed_nll
from pipeline.batch_plan import step_groups
from pipeline.train import feeder
from pipeline.train.corpus import Corpus
from pipeline.train.feeder import BatchLayout, MicroBatch, to_device
from pipeline.train.step import LossSettings, TrainedModel, accumulate_gradients

MC = ModelConfig(vocab_size=50, d_model=32, d_ff=64, n_heads=2, n_encoder_layers=1, n_decoder_layers=1,
                 dropout=0.0)


def fixed_rows(n: int = 16, seed: int = 0):
    """A flattened corpus of n pairs with lengths 2..9 (values, offsets per side)."""
    rng = np.random.default_rng(seed)
    lens = rng.integers(2, 10, size=n)
    offsets = np.concatenate(([0], np.cumsum(lens)))
    src = rng.integers(4, 50, size=offsets[-1]).astype(np.int32)
    tgt = rng.integers(4, 50, size=offsets[-1]).astype(np.int32)
    return src, offsets, tgt, offsets


def micro(data, rows) -> MicroBatch:
    b = feeder.collate(np.asarray(rows),
                              Corpus(**dict(zip(("src_values", "src_offsets", "tgt_values", "tgt_offsets"), data))),
                              BatchLayout(pad_id=0, bos_id=2, eos_id=3))
    return to_device(b, torch.device("cpu"))


def reference_grads(data, rows, n_tokens):
    """The textbook update: one padded batch, summed token loss / number of target tokens."""
    torch.manual_seed(0)
    model = Transformer(MC)
    b = micro(data, rows)
    loss, _ = label_smoothed_nll(model.logits(model(b.src, b.tgt_in)), b.tgt_out, epsilon=0.1, ignore_index=0)
    (loss / n_tokens).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def test_four_micro_batches_equal_one_big_batch():
    data = fixed_rows()
    rows = np.arange(16)
    n_tokens = int(step_groups.target_tokens(np.diff(data[3])[rows]).sum())
    want = reference_grads(data, rows, n_tokens)
    torch.manual_seed(0)
    model = Transformer(MC)
    chunks = [micro(data, rows[i:i + 4]) for i in range(0, 16, 4)]
    loss, nll = accumulate_gradients(model, chunks, n_tokens, world_size=1,
                                     settings=LossSettings(label_smoothing=0.1, pad_id=0))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-7, msg=name)
    assert loss.item() > nll.item() > 0


def test_a_zero_weight_stand_in_adds_nothing():
    data = fixed_rows()
    rows = np.arange(8)
    n_tokens = int(step_groups.target_tokens(np.diff(data[3])[rows]).sum())
    want = reference_grads(data, rows, n_tokens)
    torch.manual_seed(0)
    model = Transformer(MC)
    stand_in = micro(data, rows[:1])
    stand_in.weight = 0.0
    accumulate_gradients(model, [micro(data, rows), stand_in], n_tokens, world_size=1,
                         settings=LossSettings(label_smoothing=0.1, pad_id=0))
    for name, p in model.named_parameters():
        torch.testing.assert_close(p.grad, want[name], rtol=1e-5, atol=1e-7, msg=name)


def _ddp_worker(rank: int, world: int, port: int, out_dir: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        data = fixed_rows()
        rows = np.arange(16)
        n_tokens = int(step_groups.target_tokens(np.diff(data[3])[rows]).sum())
        chunks = [rows[i:i + 4] for i in range(0, 16, 4)]
        mine = chunks[rank::world]  # chunk j -> worker j % world, as step_groups.split_step assigns
        torch.manual_seed(0)
        model = TrainedModel(Transformer(MC))  # the loop's handle: its step's forward runs in DDP
        model.distribute(torch.device("cpu"), world, "none")
        accumulate_gradients(model, [micro(data, c) for c in mine], n_tokens, world_size=world,
                             settings=LossSettings(label_smoothing=0.1, pad_id=0))
        grads = {n: p.grad for n, p in model.module.named_parameters()}
        torch.save(grads, os.path.join(out_dir, f"grads_{rank}.pt"))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_ddp_workers_times_two_micro_batches_equal_one_big_batch(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    mp.spawn(_ddp_worker, args=(2, port, str(tmp_path)), nprocs=2, join=True)
    data = fixed_rows()
    rows = np.arange(16)
    want = reference_grads(data, rows, int(step_groups.target_tokens(np.diff(data[3])[rows]).sum()))
    for rank in range(2):
        got = torch.load(tmp_path / f"grads_{rank}.pt", weights_only=True)
        for name, g in want.items():
            torch.testing.assert_close(got[name], g, rtol=1e-5, atol=1e-7, msg=f"rank {rank}: {name}")
