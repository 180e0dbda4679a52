"""Greedy and beam search (§6.1: beam size 4, length penalty alpha = 0.6, max length input + 50).

Both functions only use this protocol, so tests can plug in a stub with fixed tables:

    model.cfg.pad_id, .bos_id, .eos_id (and optionally .max_positions, which caps the length)
    model.encode(src_ids (B, S)) -> (memory, src_pad_mask (B, S) bool, True = pad)
    model.init_decoder_state(memory, src_pad_mask, beam_size, max_len) -> state
        state for N = B * beam_size sentence-major rows (row b * beam_size + j is beam j of
        sentence b), holding up to max_len fed tokens (bos included)
    model.decode_step(prev_ids (N,) long, state) -> logits (N, V); feeds one token per row
    state.reorder(indices (N,) long): row r continues the history of row indices[r]; indices
        never leave a sentence's block of rows
    optional: state.first_step_per_sentence = True means decode_step also takes prev_ids (B,) at
        step 0 (one row per sentence, copied to its beams; returns (B, V)); beam search then
        feeds the shared bos once per sentence instead of beam_size times
    optional: state.drops_sentences = True means reorder also takes sentences (B',) long, the
        sentences that stay (increasing; indices then name rows of theirs, in their order); beam
        search then stops feeding a sentence once it is done instead of carrying it to the end
        of the batch's longest one

Search applies log_softmax to the logits, so a stub may return log-probabilities directly.
Deviation: pad and bos get log-probability -inf (the paper does not describe its search)
because they never occur in a target; the rest is not renormalised (as fairseq does).
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Iterator, Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# A decoding step's keys grow by one position every step, and its rows shrink as sentences finish,
# so nearly every attention call of a search has a shape not seen before. cuDNN's SDPA, PyTorch's
# first choice on Hopper, builds a plan per new shape (issue 37: ~0.75 s per new training shape
# for base on an H200, counted with the GEMM choices): a search pays it at every step. Flash and
# memory-efficient attention pick their kernel by rule and cost nothing per shape; flash takes no
# mask (the cross-attention's is a padding mask), so memory-efficient and math stay behind it.
DECODING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decoding_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels a search runs with on `device`: on a GPU `DECODING_BACKENDS` (never cuDNN's),
    elsewhere PyTorch's choice. PyTorch's backend switches are process-wide, not per thread (a
    server's concurrent searches set the same list)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(DECODING_BACKENDS, set_priority=True)


class DecodingModel(Protocol):
    """What search needs; `Transformer` implements it (see the module docstring)."""

    cfg: Any

    def encode(self, src_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...

    def init_decoder_state(self, memory: torch.Tensor, src_pad_mask: torch.Tensor, beam_size: int,
                           max_len: int) -> Any: ...

    def decode_step(self, prev_ids: torch.Tensor, state: Any) -> torch.Tensor: ...


def gnmt_length_penalty(length: Any, alpha: float) -> Any:
    """lp(Y) = ((5 + |Y|) / 6) ** alpha (Wu et al., 2016, §7); works on numbers and tensors."""
    return ((5 + length) / 6) ** alpha


@contextlib.contextmanager
def _eval_mode(model: Any) -> Iterator[None]:
    was_training = isinstance(model, torch.nn.Module) and model.training
    if was_training:
        model.eval()
    try:
        yield
    finally:
        if was_training:
            model.train()


def output_budget(num_source_tokens: int, max_len_a: float, max_len_b: int, max_positions: int | None) -> int:
    """Most output tokens before eos for a source of ``num_source_tokens`` (eos included):
    floor(a * n + b) (§6.1: input length + 50), capped so that bos + tokens fit in
    ``max_positions`` (None: no cap). Python floats (float64), as one computes it by hand:
    float32 has 0.7 * 10 < 7. The one definition: our search, CTranslate2's and the server's."""
    cap = math.inf if max_positions is None else max_positions - 1
    return int(min(max(math.floor(max_len_a * num_source_tokens + max_len_b), 0), cap))


def max_source_len(max_positions: int, max_len_a: float, max_len_b: int) -> int:
    """Longest source (pieces + eos) whose whole output budget a * S + b (plus the fed bos) still
    fits ``max_positions``: the inverse of ``output_budget``'s cap; longer sources are truncated
    (translate) or refused (serve)."""
    if max_len_a <= 0:
        return max_positions
    return max(1, min(max_positions, int((max_positions - 1 - max_len_b) / max_len_a)))


def _max_lens(model: Any, src_ids: torch.Tensor, max_len_a: float, max_len_b: int) -> torch.Tensor:
    """(B,) ``output_budget`` per row, src_len = non-pad source tokens (eos included)."""
    max_positions = getattr(model.cfg, "max_positions", None)
    src_lens = src_ids.ne(model.cfg.pad_id).sum(dim=1).tolist()
    max_lens = [output_budget(n, max_len_a, max_len_b, max_positions) for n in src_lens]
    return torch.tensor(max_lens, device=src_ids.device)


def _topk_rows(x: torch.Tensor, n: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(n, dim=1) for a wide (N, V) x, ~2.5x faster on CPU at V = 8000: the n best entries
    of a row lie in the n blocks of `block` columns with the highest maxima, so only those blocks
    (and the last V % block columns) go through topk. Same values; among exactly equal values
    the indices may differ from torch.topk's. Small V, or not on CPU: plain topk."""
    N, V = x.shape
    n_blocks = V // block
    if n_blocks < 8 * n or x.device.type != "cpu":
        return x.topk(n, dim=1)
    best_blocks = x[:, : n_blocks * block].view(N, n_blocks, block).amax(dim=2).topk(n, dim=1).indices  # (N, n)
    cols = (best_blocks[:, :, None] * block + torch.arange(block, device=x.device)).view(N, n * block)
    if n_blocks * block < V:
        cols = torch.cat([cols, torch.arange(n_blocks * block, V, device=x.device).expand(N, -1)], dim=1)
    values, pos = x.gather(1, cols).topk(n, dim=1)
    return values, cols.gather(1, pos)


def _next_candidates(model: Any, prev_ids: torch.Tensor, state: Any, step: int, row_max_lens: torch.Tensor,
                     n_best: int, forced_steps: set[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """The n_best most likely next tokens of every row: (log-probs (N, n) float32, ids (N, n)).

    pad and bos get -inf (2 extra candidates are kept so that n_best valid ones remain); rows at
    their max length may only emit eos, with its log-prob (as fairseq).
    """
    cfg = model.cfg
    all_lprobs = torch.log_softmax(model.decode_step(prev_ids, state).float(), dim=-1)  # (N, V)
    lprobs, ids = _topk_rows(all_lprobs, min(n_best + 2, all_lprobs.shape[1]))  # (N, n), sorted
    lprobs.masked_fill_(ids.eq(cfg.pad_id) | ids.eq(cfg.bos_id), -math.inf)
    if step in forced_steps:  # rare: only steps where some sentence reaches its limit
        forced = row_max_lens.eq(step)  # (N,)
        lprobs.masked_fill_(forced[:, None], -math.inf)
        lprobs[:, 0] = torch.where(forced, all_lprobs[:, cfg.eos_id], lprobs[:, 0])
        ids[:, 0] = torch.where(forced, torch.full_like(ids[:, 0], cfg.eos_id), ids[:, 0])
    return lprobs, ids


def _to_lists(tokens: torch.Tensor, eos_id: int, pad_id: int) -> list[list[int]]:
    """(B, L) -> token lists cut before the first eos or pad."""
    out = []
    for row in tokens.tolist():
        end = next((i for i, tok in enumerate(row) if tok in (eos_id, pad_id)), len(row))
        out.append(row[:end])
    return out


@torch.inference_mode()
def greedy_search(model: DecodingModel, src_ids: torch.Tensor, max_len_a: float = 1.0,
                  max_len_b: int = 50) -> list[list[int]]:
    """Most likely next token at every step; src_ids (B, S) -> B token lists without bos/eos."""
    with _eval_mode(model), decoding_attention(src_ids.device):
        cfg = model.cfg
        memory, src_pad_mask = model.encode(src_ids)
        max_lens = _max_lens(model, src_ids, max_len_a, max_len_b)  # (B,)
        L = int(max_lens.max())
        state = model.init_decoder_state(memory, src_pad_mask, 1, L + 1)
        tokens = src_ids.new_full((src_ids.shape[0], L + 1), cfg.pad_id)  # (B, L+1) output incl. eos
        finished = torch.zeros_like(max_lens, dtype=torch.bool)  # (B,)
        prev = src_ids.new_full((src_ids.shape[0],), cfg.bos_id)
        forced_steps = set(max_lens.tolist())
        for t in range(L + 1):
            lprobs, ids = _next_candidates(model, prev, state, t, max_lens, 1, forced_steps)  # (B, 3)
            nxt = ids.gather(1, lprobs.argmax(dim=-1, keepdim=True))[:, 0]  # (B,)
            tokens[:, t] = nxt.masked_fill(finished, cfg.pad_id)
            finished |= nxt.eq(cfg.eos_id)
            if bool(finished.all()):
                break
            prev = nxt
        return _to_lists(tokens, cfg.eos_id, cfg.pad_id)


def _finish(scores: torch.Tensor, beams: torch.Tensor, is_eos: torch.Tensor, tokens: torch.Tensor, t: int,
            eos_id: int, alpha: float, done: torch.Tensor, best_tokens: torch.Tensor,
            best_score: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Candidates (B, k) that end in eos at output position t become finished hypotheses of
    length t + 1; keep each sentence's best normalized one. tokens (B, k, L+1) live histories."""
    B = scores.shape[0]
    normed = scores / gnmt_length_penalty(t + 1, alpha)  # (B, k)
    finishing = is_eos & (scores > -math.inf) & ~done[:, None]
    cand_score, cand_j = normed.masked_fill(~finishing, -math.inf).max(dim=1)  # (B,)
    improves = cand_score > best_score
    hist = tokens[torch.arange(B, device=tokens.device), beams.gather(1, cand_j[:, None])[:, 0]]  # (B, L+1)
    hist[:, t] = eos_id
    return torch.where(improves[:, None], hist, best_tokens), torch.where(improves, cand_score, best_score)


@torch.inference_mode()
def beam_search(model: DecodingModel, src_ids: torch.Tensor, beam_size: int = 4, alpha: float = 0.6,
                max_len_a: float = 1.0, max_len_b: int = 50, return_scores: bool = False):
    """Beam search; src_ids (B, S) -> best hypothesis per sentence, without bos/eos
    (and, with return_scores, their scores as a list of floats).

    score(Y) = log P(Y|X) / lp(|Y|), |Y| counting the eos (as fairseq and tensor2tensor), lp =
    `gnmt_length_penalty`. Each step ranks the 2k best (beam, token) extensions; eos among the
    top k finishes a hypothesis (fairseq; tensor2tensor also finishes eos ranked k+1..2k), the
    k best non-eos ones stay live. At most max_len_a * src_len + max_len_b tokens precede eos
    (src_len = unpadded source length, eos included; §6.1: input length + 50); at that length
    eos is forced.

    Stopping: a sentence is done once no live hypothesis can beat its best finished one. Log-probs
    are <= 0, so a live hypothesis with cumulative score s <= 0 ends with a normalized score
    <= s / max lp(n) over the lengths n it can still reach, i.e. s / lp(max_len + 1) for
    alpha >= 0 (the bound tensor2tensor uses). This is exact for the returned top-1: beam_size 1
    equals greedy for alpha = 0, while for alpha > 0 it may find a longer hypothesis that
    greedy's first eos hides. fairseq's rule (stop at k finished hypotheses) is a heuristic that
    can miss such a hypothesis; waiting for k finished ones on top of the bound cannot change
    the top-1, so we do not.
    """
    with _eval_mode(model), decoding_attention(src_ids.device):
        cfg, k = model.cfg, beam_size
        B = src_ids.shape[0]
        memory, src_pad_mask = model.encode(src_ids)
        max_lens = _max_lens(model, src_ids, max_len_a, max_len_b)  # (B,)
        L = int(max_lens.max())
        state = model.init_decoder_state(memory, src_pad_mask, k, L + 1)
        row_max_lens = max_lens.repeat_interleave(k)  # (N,)
        lp_longest = gnmt_length_penalty(max_lens.float() + 1, alpha)  # (B,)
        tokens = src_ids.new_full((B, k, L + 1), cfg.pad_id)  # live histories
        scores = torch.full((B, k), -math.inf, device=src_ids.device)  # cumulative log P
        scores[:, 0] = 0.0  # one live hypothesis at start, so the k beams do not duplicate it
        best_tokens = src_ids.new_full((B, L + 1), cfg.pad_id)
        best_score = torch.full((B,), -math.inf, device=src_ids.device)
        done = torch.zeros(B, dtype=torch.bool, device=src_ids.device)
        forced_steps = set(max_lens.tolist())
        # A state that can drop sentences (Transformer's) stops computing the finished ones: the
        # per-sentence tensors below then hold the live sentences only, `alive` their positions in
        # the batch, and out_tokens / out_score the results of those already dropped.
        drops = bool(getattr(state, "drops_sentences", False))
        alive = torch.arange(B, device=src_ids.device)
        out_tokens, out_score = best_tokens.clone(), best_score.clone()
        # At step 0 a sentence's k beams are the same bos: a state that allows it (Transformer's)
        # computes one row per sentence (its candidates then all come from beam 0).
        first_shared = (k > 1 and getattr(state, "first_step_per_sentence", False)
                        and getattr(cfg, "vocab_size", 0) >= 2 * k)
        prev = src_ids.new_full((B if first_shared else B * k,), cfg.bos_id)
        row_base = torch.arange(B, device=src_ids.device)[:, None] * k  # (B, 1)
        for t in range(L + 1):
            kt = 1 if t == 0 and first_shared else k  # rows fed per sentence
            # The global 2k best extensions are among each row's 2k best tokens.
            lprobs, ids = _next_candidates(model, prev, state, t, max_lens if kt == 1 else row_max_lens, 2 * k,
                                           forced_steps)  # (B * kt, c)
            c = lprobs.shape[1]
            top_scores, top_idx = (scores[:, :kt, None] + lprobs.view(B, kt, c)).view(B, kt * c).topk(2 * k, dim=1)
            top_beam, top_tok = top_idx // c, ids.view(B, kt * c).gather(1, top_idx)  # (B, 2k)
            is_eos = top_tok.eq(cfg.eos_id)
            if bool(is_eos.any()):
                best_tokens, best_score = _finish(top_scores[:, :k], top_beam[:, :k], is_eos[:, :k], tokens, t,
                                                  cfg.eos_id, alpha, done, best_tokens, best_score)
                # Continue: the k best non-eos extensions (sorted, so column 0 is the best).
                scores, order = top_scores.masked_fill(is_eos, -math.inf).topk(k, dim=1)  # (B, k)
                new_beam, new_tok = top_beam.gather(1, order), top_tok.gather(1, order)
            else:  # nothing finishes; top_scores is sorted, so the k best are its first k
                scores, new_beam, new_tok = top_scores[:, :k], top_beam[:, :k], top_tok[:, :k]
            tokens = tokens.gather(1, new_beam[:, :, None].expand(B, k, L + 1))
            tokens[:, :, t] = new_tok
            lp_reachable = lp_longest.clamp(min=gnmt_length_penalty(t + 2, alpha))  # max over reachable lengths
            done |= (best_score >= scores[:, 0] / lp_reachable) | max_lens.le(t)
            num_done = int(done.sum())  # one wait for the device tells both "all" and "any"
            if num_done == B:
                break
            rows = new_beam + row_base  # (B, k) the rows each next row continues
            if drops and num_done:
                out_tokens[alive[done]], out_score[alive[done]] = best_tokens[done], best_score[done]
                keep = (~done).nonzero()[:, 0]  # (B',)
                alive, B = alive[keep], len(keep)
                max_lens, lp_longest, best_tokens, best_score = (
                    max_lens[keep], lp_longest[keep], best_tokens[keep], best_score[keep])
                tokens, scores, new_tok, rows, done = tokens[keep], scores[keep], new_tok[keep], rows[keep], done[keep]
                row_max_lens = max_lens.repeat_interleave(k)
                row_base = torch.arange(B, device=src_ids.device)[:, None] * k
                state.reorder(rows.view(-1), keep)
            else:
                state.reorder(rows.view(-1))
            prev = new_tok.reshape(-1)
        out_tokens[alive], out_score[alive] = best_tokens, best_score
        hyps = _to_lists(out_tokens, cfg.eos_id, cfg.pad_id)
        return (hyps, out_score.tolist()) if return_scores else hyps
