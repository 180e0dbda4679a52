"""Greedy and beam search (§6.1: beam size 4, length penalty alpha = 0.6, max length input + 50).

Both functions only use the `DecodingModel` protocol (`Transformer` implements it with
model/incremental.py), so tests can plug in a stub with fixed tables. Search applies log_softmax
to the logits, so a stub may return log-probabilities directly.

Deviation: pad and bos get log-probability -inf (the paper does not describe its search)
because they never occur in a target; the rest is not renormalised (as fairseq does).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, fields
from typing import Any, Iterator, Protocol

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

# A decoding step's keys grow by one position every step, and its rows shrink as sentences finish,
# so nearly every attention call of a search has a new shape. cuDNN's SDPA, PyTorch's first choice
# on Hopper, builds a plan per new shape (docs/benchmarks.md): a search would pay it at every step.
# Flash and memory-efficient attention pick their kernel by rule and cost nothing per shape; flash
# takes no mask (the cross-attention's is a padding mask), so memory-efficient and math stay behind.
DECODING_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]


def decoding_attention(device: torch.device) -> contextlib.AbstractContextManager:
    """The SDPA kernels a search runs with on `device`: on a GPU `DECODING_BACKENDS` (never cuDNN's),
    elsewhere PyTorch's choice. PyTorch's backend switches are process-wide, not per thread (a
    server's concurrent searches set the same list)."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    return sdpa_kernel(DECODING_BACKENDS, set_priority=True)


class SearchConfig(Protocol):
    """The model's settings that search reads (`ModelConfig` has them)."""

    pad_id: int
    bos_id: int
    eos_id: int
    vocab_size: int
    max_positions: int | None  # bos + output tokens fit in it (None: no cap)


class SearchState(Protocol):
    """A decoding's caches for N = B * beam_size sentence-major rows (row b * beam_size + j is
    beam j of sentence b), updated in place by `DecodingModel.decode_step`."""

    # True: decode_step also takes prev_ids (B,) at step 0 (one row per sentence, copied to its
    # beams; returns (B, V)), so beam search feeds the shared bos once per sentence, not k times
    first_step_per_sentence: bool
    # True: reorder also takes `sentences`, so beam search stops feeding a sentence once it is
    # done instead of carrying it to the end of the batch's longest one
    drops_sentences: bool

    def reorder(self, indices: torch.Tensor, sentences: torch.Tensor | None = None) -> None:
        """Row r continues the history of row indices[r] (N,) long; indices never leave a
        sentence's block of rows. With `sentences` (B',) long, increasing (only when
        `drops_sentences`): only those sentences stay, and indices name rows of theirs, in their
        order."""


class DecodingModel(Protocol):
    """What search needs of a model; `Transformer` implements it."""

    cfg: SearchConfig

    def encode(self, src_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """src_ids (B, S) -> (memory, src_pad_mask (B, S) bool, True = pad)."""

    def init_decoder_state(self, memory: torch.Tensor, src_pad_mask: torch.Tensor, beam_size: int,
                           max_len: int) -> SearchState:
        """The state of B * beam_size rows holding up to max_len fed tokens (bos included)."""

    def decode_step(self, prev_ids: torch.Tensor, state: SearchState) -> torch.Tensor:
        """Feed one token per row: prev_ids (N,) long -> logits (N, V)."""


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
    max_positions = model.cfg.max_positions
    src_lens = src_ids.ne(model.cfg.pad_id).sum(dim=1).tolist()
    max_lens = [output_budget(n, max_len_a, max_len_b, max_positions) for n in src_lens]
    return torch.tensor(max_lens, device=src_ids.device)


def _topk_rows(x: torch.Tensor, n: int, block: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """x.topk(n, dim=1) for a wide (N, V) x, faster on CPU (docs/benchmarks.md): the n best entries
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


def _next_candidates(model: DecodingModel, prev_ids: torch.Tensor, state: SearchState, n_best: int,
                     forced: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The n_best most likely next tokens of every row: (log-probs (N, n) float32, ids (N, n)).

    pad and bos get -inf (2 extra candidates are kept so that n_best valid ones remain); rows
    where `forced` (N,) bool is True (they reached their max length) may only emit eos, with its
    log-prob (as fairseq). forced is None at the many steps where no row reaches its limit.
    """
    cfg = model.cfg
    all_lprobs = torch.log_softmax(model.decode_step(prev_ids, state).float(), dim=-1)  # (N, V)
    lprobs, ids = _topk_rows(all_lprobs, min(n_best + 2, all_lprobs.shape[1]))  # (N, n), sorted
    lprobs.masked_fill_(ids.eq(cfg.pad_id) | ids.eq(cfg.bos_id), -math.inf)
    if forced is not None:
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
            forced = max_lens.eq(t) if t in forced_steps else None
            lprobs, ids = _next_candidates(model, prev, state, 1, forced)  # (B, 3)
            nxt = ids.gather(1, lprobs.argmax(dim=-1, keepdim=True))[:, 0]  # (B,)
            tokens[:, t] = nxt.masked_fill(finished, cfg.pad_id)
            finished |= nxt.eq(cfg.eos_id)
            if bool(finished.all()):
                break
            prev = nxt
        return _to_lists(tokens, cfg.eos_id, cfg.pad_id)


@dataclass(kw_only=True)
class _Beams:
    """Beam search's state, one row per sentence still searched, k live hypotheses each; dropping
    the finished sentences is `select`.

    score(Y) = log P(Y|X) / lp(|Y|), |Y| counting the eos (as fairseq and tensor2tensor). Each
    step ranks the 2k best (beam, token) extensions; eos among the top k finishes a hypothesis
    (fairseq; tensor2tensor also finishes eos ranked k+1..2k), the k best non-eos ones stay live.

    Stopping: a sentence is done once no live hypothesis can beat its best finished one. Log-probs
    are <= 0, so a live hypothesis with cumulative score s <= 0 ends with a normalized score
    <= s / max lp(n) over the lengths n it can still reach, i.e. s / lp(max_len + 1) for
    alpha >= 0 (the bound tensor2tensor uses). This is exact for the returned top-1: beam_size 1
    equals greedy for alpha = 0, while for alpha > 0 it may find a longer hypothesis that
    greedy's first eos hides. fairseq's rule (stop at k finished hypotheses) is a heuristic that
    can miss such a hypothesis; waiting for k finished ones on top of the bound cannot change
    the top-1, so we do not.
    """

    sentence: torch.Tensor  # (B,) long: each row's sentence in the batch
    max_lens: torch.Tensor  # (B,) `output_budget`: eos is forced after that many tokens
    lp_longest: torch.Tensor  # (B,) lp(max_len + 1), the largest length penalty a sentence can reach
    tokens: torch.Tensor  # (B, k, L+1) the live hypotheses' tokens
    scores: torch.Tensor  # (B, k) their cumulative log P (-inf: no hypothesis)
    last: torch.Tensor  # (B, k) their last token, fed at the next step
    parent: torch.Tensor  # (B, k) the beam each continued at the last step
    best_tokens: torch.Tensor  # (B, L+1) the best finished hypothesis, eos included
    best_score: torch.Tensor  # (B,) its normalized score (-inf: none yet)
    done: torch.Tensor  # (B,) bool: no live hypothesis can beat best_score

    @classmethod
    def start(cls, src_ids: torch.Tensor, max_lens: torch.Tensor, k: int, alpha: float, pad_id: int) -> "_Beams":
        B, L, device = src_ids.shape[0], int(max_lens.max()), src_ids.device
        scores = torch.full((B, k), -math.inf, device=device)  # cumulative log P
        scores[:, 0] = 0.0  # one live hypothesis at start, so the k beams do not duplicate it
        return cls(sentence=torch.arange(B, device=device), max_lens=max_lens,
                   lp_longest=gnmt_length_penalty(max_lens.float() + 1, alpha),
                   tokens=src_ids.new_full((B, k, L + 1), pad_id), scores=scores, last=src_ids.new_full((B, k), pad_id),
                   parent=torch.zeros((B, k), dtype=torch.long, device=device),
                   best_tokens=src_ids.new_full((B, L + 1), pad_id),
                   best_score=torch.full((B,), -math.inf, device=device),
                   done=torch.zeros(B, dtype=torch.bool, device=device))

    def select(self, keep: torch.Tensor) -> "_Beams":
        """Only the rows (sentences) `keep` (B',) long."""
        return _Beams(**{f.name: getattr(self, f.name)[keep] for f in fields(self)})

    def extend(self, lprobs: torch.Tensor, ids: torch.Tensor, kt: int, t: int, eos_id: int, alpha: float) -> None:
        """Step t (output position t) from the candidates (log-probs, ids) (B * kt, c) of the kt
        rows fed per sentence (1 at a shared first step, else k)."""
        (B, k), c = self.scores.shape, lprobs.shape[1]
        top_scores, top_idx = (self.scores[:, :kt, None] + lprobs.view(B, kt, c)).view(B, kt * c).topk(2 * k, dim=1)
        top_beam, top_tok = top_idx // c, ids.view(B, kt * c).gather(1, top_idx)  # (B, 2k)
        is_eos = top_tok.eq(eos_id)
        if bool(is_eos.any()):
            self._finish(top_scores[:, :k], top_beam[:, :k], is_eos[:, :k], t, eos_id, alpha)
            # Continue: the k best non-eos extensions (sorted, so column 0 is the best).
            self.scores, order = top_scores.masked_fill(is_eos, -math.inf).topk(k, dim=1)  # (B, k)
            self.parent, self.last = top_beam.gather(1, order), top_tok.gather(1, order)
        else:  # nothing finishes; top_scores is sorted, so the k best are its first k
            self.scores, self.parent, self.last = top_scores[:, :k], top_beam[:, :k], top_tok[:, :k]
        self.tokens = self.tokens.gather(1, self.parent[:, :, None].expand(B, k, self.tokens.shape[2]))
        self.tokens[:, :, t] = self.last
        lp_reachable = self.lp_longest.clamp(min=gnmt_length_penalty(t + 2, alpha))  # max over reachable lengths
        self.done |= (self.best_score >= self.scores[:, 0] / lp_reachable) | self.max_lens.le(t)

    def _finish(self, scores: torch.Tensor, beams: torch.Tensor, is_eos: torch.Tensor, t: int, eos_id: int,
                alpha: float) -> None:
        """Candidates (B, k) that end in eos at output position t become finished hypotheses of
        length t + 1; keep each sentence's best normalized one."""
        B = scores.shape[0]
        normed = scores / gnmt_length_penalty(t + 1, alpha)  # (B, k)
        finishing = is_eos & (scores > -math.inf) & ~self.done[:, None]
        cand_score, cand_j = normed.masked_fill(~finishing, -math.inf).max(dim=1)  # (B,)
        improves = cand_score > self.best_score
        hist = self.tokens[torch.arange(B, device=scores.device), beams.gather(1, cand_j[:, None])[:, 0]]  # (B, L+1)
        hist[:, t] = eos_id
        self.best_tokens = torch.where(improves[:, None], hist, self.best_tokens)
        self.best_score = torch.where(improves, cand_score, self.best_score)


@torch.inference_mode()
def beam_search(model: DecodingModel, src_ids: torch.Tensor, beam_size: int = 4, alpha: float = 0.6,
                max_len_a: float = 1.0, max_len_b: int = 50, return_scores: bool = False):
    """Beam search (`_Beams`: scoring, ranking, stopping); src_ids (B, S) -> best hypothesis per
    sentence, without bos/eos (and, with return_scores, their scores as a list of floats).

    lp = `gnmt_length_penalty`. At most max_len_a * src_len + max_len_b tokens precede eos (src_len
    = unpadded source length, eos included; §6.1: input length + 50); at that length eos is forced.
    """
    with _eval_mode(model), decoding_attention(src_ids.device):
        cfg, k, B = model.cfg, beam_size, src_ids.shape[0]
        memory, src_pad_mask = model.encode(src_ids)
        beams = _Beams.start(src_ids, _max_lens(model, src_ids, max_len_a, max_len_b), k, alpha, cfg.pad_id)
        L = beams.tokens.shape[2] - 1
        state = model.init_decoder_state(memory, src_pad_mask, k, L + 1)
        forced_steps = set(beams.max_lens.tolist())  # rare: steps where some sentence reaches its limit
        out_tokens, out_score = beams.best_tokens.clone(), beams.best_score.clone()  # of dropped sentences
        # At step 0 a sentence's k beams are the same bos: a state that allows it computes one row
        # per sentence (its candidates then all come from beam 0).
        shared = k > 1 and state.first_step_per_sentence and cfg.vocab_size >= 2 * k
        prev = src_ids.new_full((B if shared else B * k,), cfg.bos_id)
        row_base = torch.arange(B, device=src_ids.device)[:, None] * k  # (B, 1) each sentence's first row
        for t in range(L + 1):
            kt = 1 if t == 0 and shared else k  # rows fed per sentence
            forced = beams.max_lens.eq(t).repeat_interleave(kt) if t in forced_steps else None
            # The global 2k best extensions are among each row's 2k best tokens.
            lprobs, ids = _next_candidates(model, prev, state, 2 * k, forced)  # (B * kt, c)
            beams.extend(lprobs, ids, kt, t, cfg.eos_id, alpha)
            num_done = int(beams.done.sum())  # one wait for the device tells both "all" and "any"
            if num_done == len(beams.done):
                break
            rows = beams.parent + row_base  # (B, k) the rows each next row continues
            if state.drops_sentences and num_done:  # stop computing the finished sentences
                done = beams.done
                out_tokens[beams.sentence[done]], out_score[beams.sentence[done]] = (
                    beams.best_tokens[done], beams.best_score[done])
                keep = (~done).nonzero()[:, 0]  # (B',)
                beams, rows, row_base = beams.select(keep), rows[keep], row_base[: len(keep)]
                state.reorder(rows.view(-1), keep)
            else:
                state.reorder(rows.view(-1))
            prev = beams.last.reshape(-1)
        out_tokens[beams.sentence], out_score[beams.sentence] = beams.best_tokens, beams.best_score
        hyps = _to_lists(out_tokens, cfg.eos_id, cfg.pad_id)
        return (hyps, out_score.tolist()) if return_scores else hyps
