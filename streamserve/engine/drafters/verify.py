"""Lossless speculative verification: which drafted tokens a target forward accepts, and the token after.

The target ran one forward over [pending token, d_1 .. d_k] and gave logits [k+1, V]: row i is the target's
distribution for the token after d_i (row 0: after the pending token). The result is the tokens to
emit: the accepted drafts, then one more from the target (a correction where a draft was rejected, the
bonus token when all were accepted), so every verification emits at least one token.

- Greedy (temperature 0): accept while the draft equals the target's argmax; emit the argmax after.
  The output is exactly what plain greedy decoding gives.
- Sampled, drafter without probabilities (n-gram): draw x_i from each row's target distribution and emit
  them while each equals the draft; stop after the first that differs. Each emitted token is a draw from
  the target given the accepted prefix, so the output follows the target distribution.
- Sampled, drafter with probabilities q (a draft model): accept d_i with probability min(1, p(d_i)/q(d_i));
  on rejection draw from the normalised residual max(0, p - q); when all are accepted, draw the bonus
  from row k. This is the standard rejection scheme: the output follows the target distribution.

p is the target's distribution after temperature, top-k and top-p, the same filtering `sample` applies.
"""

from __future__ import annotations

import torch

from streamserve.engine.sampling import Draws, sample_rows
from streamserve.kernels.reference import MIN_TEMPERATURE, argmax_last, keep_mask


def target_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """logits [R, V] fp32 -> the distributions `sample` draws from, [R, V] (rows sum to 1)."""
    probs = torch.softmax(logits / max(temperature, MIN_TEMPERATURE), dim=-1)
    sorted_p, order = torch.sort(probs, dim=-1, descending=True)
    r = logits.shape[0]
    keep = keep_mask(sorted_p, torch.full((r,), top_k, device=logits.device),
                     torch.full((r,), float(top_p), device=logits.device))
    kept = torch.zeros_like(probs).scatter_(1, order, torch.where(keep, sorted_p, torch.zeros_like(sorted_p)))
    return kept / kept.sum(dim=-1, keepdim=True)


def verify(logits: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None, temperature: float,
           top_p: float, top_k: int, draws: Draws, position: int) -> list[int]:
    """logits [k+1, V] of the target over the drafts' positions; drafts [k]; draft_probs [k, V] or None;
    `draws` the reply's randomness, `position` the session position of the first token to emit -> the tokens
    to emit (1 to k+1): the accepted drafts, then the target's own next token."""
    k = len(drafts)
    assert logits.shape[0] == k + 1
    if temperature < MIN_TEMPERATURE:
        target = argmax_last(logits).tolist()
        out = []
        for i, d in enumerate(drafts):
            if target[i] != d:
                return [*out, target[i]]
            out.append(d)
        return [*out, target[k]]
    dev = logits.device
    if draft_probs is None:  # deterministic drafts: sample from the target, keep going while it matches
        # each position's own draw, all rows in one call: the very tokens plain decoding would sample there
        drawn = sample_rows(logits, [temperature] * (k + 1), [top_p] * (k + 1), [top_k] * (k + 1),
                            [draws.seed] * (k + 1), range(position, position + k + 1)).tolist()
        out = []
        for i, x in enumerate(drawn):
            out.append(x)
            if i == k or x != drafts[i]:
                return out
    p = target_probs(logits, temperature, top_k, top_p)  # [k+1, V]
    q = draft_probs.to(p.dtype)
    idx = torch.tensor(drafts, device=dev)
    ratio = p[:k].gather(1, idx[:, None])[:, 0] / q.gather(1, idx[:, None])[:, 0].clamp_min(1e-30)
    accept = (draws.uniform(position, k, 1) < ratio.clamp_max(1.0)).tolist()  # [k] with one read back
    for i in range(k):
        if accept[i]:
            continue
        residual = (p[i] - q[i]).clamp_min(0)
        dist = residual if bool(residual.sum() > 0) else p[i]  # q == p on every token: any draw from p is right
        return [*drafts[:i], int(draws.pick(dist[None], position + i, 2)[0])]
    return [*drafts, int(draws.pick(p[k:], position + k, 0)[0])]
