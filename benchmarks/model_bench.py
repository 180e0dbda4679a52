"""Throughput of our Transformer against Hugging Face MarianMTModel at the same sizes.

    python benchmarks/model_bench.py [--device cpu|cuda] [--dtype fp32|bf16] [--size tiny|small|base]
                                     [--batch-tokens N] [--peak-flops F] [--threads N] [--clock auto|wall|cpu]

Training step = forward + label-smoothed loss + backward + Adam step, reported in target tokens/s
for two variants of ours: `model.logits(model(src, tgt_in))` (logits at every position, like
Marian) and `model.logits(model(src, tgt_in, NonPad()))` (vocabulary projection and loss only at
real target tokens, what the trainer uses).
Both models get random weights, the same token ids, the same loss function
(`model.label_smoothed_nll`), Adam with the same settings, and the same dropout (0.1 on residuals
and embeddings, none in attention/FFN). Marian is built from a MarianConfig with our sizes: ReLU,
post-norm, sinusoidal positions, sqrt(d) embedding scale, shared embeddings, SDPA attention.

Decoding compares `beam_search(beam_size=4)` with `generate(num_beams=4)`. To make both do the same
number of decoder steps, the eos embedding row of both random models is zeroed (so eos never
ranks among the top candidates) and both are given the same budget: ours max_len_a=0,
max_len_b=L (L tokens then forced eos), Marian max_new_tokens=L+1 with forced eos; i.e. L+1
decoder steps per batch for both. The script prints the mean output length of each as a check.
bf16 means autocast to bfloat16 for both models (weights stay fp32).

Timing: the fastest of --repeats calls after one warm-up, contenders interleaved. On cpu the
clock is process CPU time by default, so other jobs on a shared machine distort less; on cuda
wall time. With --peak-flops on cuda, MFU = matmul FLOPs of the padded batch / step time / peak.
The defaults (size small, 1 thread) run in about 30 s on an idle core.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from model import ModelConfig, NonPad, Transformer, beam_search, label_smoothed_nll, make_optimizer  # noqa: E402
from pipeline.cpu_threads import use_threads  # noqa: E402

PAD, BOS, EOS = 0, 2, 3
SIZES = {  # vocab, d_model, d_ff, heads, layers (each side)
    "tiny": (1000, 64, 256, 4, 2),
    "small": (8000, 256, 1024, 4, 3),
    "base": (37000, 512, 2048, 8, 6),
}


def build_models(size: str, device: str) -> tuple[Transformer, torch.nn.Module]:
    from transformers import MarianConfig, MarianMTModel

    vocab, d, d_ff, heads, layers = SIZES[size]
    ours = Transformer(ModelConfig(vocab_size=vocab, d_model=d, d_ff=d_ff, n_heads=heads,
                                   n_encoder_layers=layers, n_decoder_layers=layers, max_positions=256))
    marian_cfg = MarianConfig(
        vocab_size=vocab, d_model=d, encoder_layers=layers, decoder_layers=layers, encoder_ffn_dim=d_ff,
        decoder_ffn_dim=d_ff, encoder_attention_heads=heads, decoder_attention_heads=heads,
        activation_function="relu", dropout=0.1, attention_dropout=0.0, activation_dropout=0.0,
        scale_embedding=True, max_position_embeddings=256, pad_token_id=PAD, eos_token_id=EOS,
        forced_eos_token_id=EOS, decoder_start_token_id=BOS, bos_token_id=None,
        share_encoder_decoder_embeddings=True, tie_word_embeddings=True)
    marian_cfg._attn_implementation = "sdpa"
    marian = MarianMTModel(marian_cfg)
    with torch.no_grad():  # eos never wins with random weights: both decode the full budget
        ours.src_embed.weight[EOS].zero_()
        marian.get_input_embeddings().weight[EOS].zero_()
    return ours.to(device), marian.to(device)


def make_batch(num_tokens: int, vocab: int, device: str, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """Sentences of 10-40 pieces, right-padded; returns src, tgt_in, tgt_out (B, T) long."""
    g = torch.Generator().manual_seed(seed)
    src_rows, tgt_rows, total = [], [], 0
    while total < num_tokens:
        n_src, n_tgt = (int(x) for x in torch.randint(10, 41, (2,), generator=g))
        src_rows.append(torch.randint(4, vocab, (n_src,), generator=g).tolist() + [EOS])
        tgt_rows.append(torch.randint(4, vocab, (n_tgt,), generator=g).tolist())
        total += n_tgt + 1

    def pad(rows: list[list[int]]) -> torch.Tensor:
        out = torch.full((len(rows), max(map(len, rows))), PAD)
        for i, r in enumerate(rows):
            out[i, : len(r)] = torch.tensor(r)
        return out.to(device)

    return pad(src_rows), pad([[BOS] + t for t in tgt_rows]), pad([t + [EOS] for t in tgt_rows])


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def train_step_fn(model: torch.nn.Module, kind: str, batch, autocast: torch.autocast):
    """kind: "marian", "ours" (logits at every position, as Marian) or "ours_nonpad"
    (`NonPad()`: vocabulary projection and loss only at real target tokens)."""
    src, tgt_in, tgt_out = batch
    opt = make_optimizer(model, lr=1e-4)
    n_tokens = int(tgt_out.ne(PAD).sum())
    real_targets = tgt_out[tgt_out.ne(PAD)]

    def step() -> None:
        with autocast:
            if kind == "marian":
                logits = model(input_ids=src, attention_mask=src.ne(PAD), decoder_input_ids=tgt_in).logits
                loss, _ = label_smoothed_nll(logits, tgt_out, epsilon=0.1, ignore_index=PAD)
            elif kind == "ours":
                loss, _ = label_smoothed_nll(model.logits(model(src, tgt_in)), tgt_out, epsilon=0.1, ignore_index=PAD)
            else:
                loss, _ = label_smoothed_nll(model.logits(model(src, tgt_in, NonPad())), real_targets, epsilon=0.1,
                                             ignore_index=PAD)
        opt.zero_grad(set_to_none=True)
        (loss / n_tokens).backward()
        opt.step()

    return step


def decode_fn(model: torch.nn.Module, is_marian: bool, src: torch.Tensor, max_len: int, autocast: torch.autocast):
    lengths: list[float] = []

    def run() -> None:
        with autocast, torch.inference_mode():
            if is_marian:
                out = model.generate(input_ids=src, attention_mask=src.ne(PAD), num_beams=4,
                                     max_new_tokens=max_len + 1, do_sample=False, length_penalty=1.0,
                                     early_stopping=False, num_return_sequences=1)
                lengths.append(float(((out[:, 1:] != PAD) & (out[:, 1:] != EOS)).sum(1).float().mean()))
            else:
                hyps = beam_search(model, src, beam_size=4, alpha=0.6, max_len_a=0.0, max_len_b=max_len)
                lengths.append(sum(map(len, hyps)) / len(hyps))

    return run, lengths


def time_interleaved(fns: dict[str, callable], repeats: int, device: str, clock: callable) -> dict[str, float]:
    """Fastest of `repeats` calls (timeit's advice: slower runs measure interference, not the
    code), alternating the contenders so background load hits them alike."""
    for fn in fns.values():  # warm-up (allocator, kernels, lazy init)
        fn()
    times = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync(device)
            t0 = clock()
            fn()
            _sync(device)
            times[name].append(clock() - t0)
    return {name: min(ts) for name, ts in times.items()}


def train_flops(cfg: ModelConfig, src: torch.Tensor, tgt_in: torch.Tensor) -> float:
    """Matmul FLOPs of one fwd+bwd step (3 x forward), counting padded positions and full T x T scores."""
    (B, S), T = src.shape, tgt_in.shape[1]
    d, f, V = cfg.d_model, cfg.d_ff, cfg.vocab_size
    enc = B * S * cfg.n_encoder_layers * 2 * (4 * d * d + 2 * d * f + 2 * S * d)
    dec = B * T * cfg.n_decoder_layers * 2 * (6 * d * d + 2 * d * f + 2 * T * d + 2 * S * d)
    cross_kv = B * S * cfg.n_decoder_layers * 2 * 2 * d * d
    return 3.0 * (enc + dec + cross_kv + B * T * 2 * d * V)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--size", choices=list(SIZES), default="small")
    p.add_argument("--batch-tokens", type=int, default=1024, help="target tokens per training batch")
    p.add_argument("--decode-sentences", type=int, default=8)
    p.add_argument("--decode-max-len", type=int, default=30, help="output tokens before the forced eos")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="CPU threads (1 by default: OpenMP spinning makes 2 threads erratic on a busy 2-core box)")
    p.add_argument("--clock", choices=["auto", "wall", "cpu"], default="auto",
                   help="auto: process CPU time on cpu (robust to other jobs on a shared box), wall on cuda")
    p.add_argument("--peak-flops", type=float, default=None, help="device peak FLOP/s, for MFU on cuda")
    args = p.parse_args()
    use_threads(args.threads)
    torch.set_flush_denormal(True)
    torch.manual_seed(0)
    device_type = torch.device(args.device).type
    autocast = torch.autocast(device_type, dtype=torch.bfloat16, enabled=args.dtype == "bf16")
    use_cpu_clock = args.clock == "cpu" or (args.clock == "auto" and device_type == "cpu")
    clock = time.process_time if use_cpu_clock else time.perf_counter
    ours, marian = build_models(args.size, args.device)
    batch = make_batch(args.batch_tokens, SIZES[args.size][0], args.device)
    n_tgt = int(batch[2].ne(PAD).sum())
    print(f"size={args.size} device={args.device} dtype={args.dtype} threads={args.threads} "
          f"clock={'process-cpu' if use_cpu_clock else 'wall'} "
          f"params(M) ours={ours.num_parameters() / 1e6:.2f} "
          f"marian={marian.num_parameters(only_trainable=True) / 1e6:.2f} "
          f"batch={tuple(batch[1].shape)} tgt_tokens={n_tgt}")

    ours.train(), marian.train()
    kinds = ("ours", "ours_nonpad", "marian")
    steps = {k: train_step_fn(marian if k == "marian" else ours, k, batch, autocast) for k in kinds}
    step_s = time_interleaved(steps, args.repeats, args.device, clock)
    for k in kinds[:2]:
        ours_tps, marian_tps = n_tgt / step_s[k], n_tgt / step_s["marian"]
        print(f"train step   {k + ':':12s} {ours_tps:8.0f} tgt tok/s | marian {marian_tps:8.0f} tgt tok/s "
              f"| ratio {step_s['marian'] / step_s[k]:.2f}x")
    if args.peak_flops and device_type == "cuda":
        flops = train_flops(ours.cfg, batch[0], batch[1])  # same count for all: MFU of the padded work
        print("MFU(%)       " + " | ".join(f"{k} {100 * flops / step_s[k] / args.peak_flops:.1f}" for k in kinds))

    ours.eval(), marian.eval()
    src = batch[0][: args.decode_sentences]
    run_ours, len_ours = decode_fn(ours, False, src, args.decode_max_len, autocast)
    run_marian, len_marian = decode_fn(marian, True, src, args.decode_max_len, autocast)
    dec_s = time_interleaved({"ours": run_ours, "marian": run_marian}, args.repeats, args.device, clock)
    n = src.shape[0]
    print(f"beam search  ours {n / dec_s['ours']:9.2f} sent/s    | marian {n / dec_s['marian']:9.2f} sent/s"
          f"    | ratio {dec_s['marian'] / dec_s['ours']:.2f}x  (beam 4, {n} sentences, mean output length "
          f"ours {statistics.mean(len_ours):.1f} marian {statistics.mean(len_marian):.1f})")


if __name__ == "__main__":
    main()
