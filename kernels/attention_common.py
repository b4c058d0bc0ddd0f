"""Pieces shared by the paged attention kernels (decode and append): head-vector dot products in two
halves, rolling-mode key rotation in registers, and one online-softmax step."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def _scores(q1, q2, k1, k2, PRECISION: tl.constexpr):
    """[M, half] x2 against [N, half] x2 -> [M, N]: the dot product of whole head vectors."""
    return tl.dot(q1, tl.trans(k1), input_precision=PRECISION) + tl.dot(q2, tl.trans(k2), input_precision=PRECISION)


@triton.jit
def _rotate_keys(k1, k2, kpos, sinks, base, inv_freq, rope_scaling):
    """Pre-RoPE keys [N, half] x2 rotated by their place in a StreamingLLM cache: a sink by its position,
    a window key by its distance from the oldest window key (`base`)."""
    rpos = tl.where(kpos < sinks, kpos, kpos - base).to(tl.float32)
    ang = rpos[:, None] * inv_freq[None, :]
    c = tl.cos(ang) * rope_scaling
    s = tl.sin(ang) * rope_scaling
    return k1 * c - k2 * s, k2 * c + k1 * s


@triton.jit
def _softmax_step(scores, m_i, l_i, acc1, acc2, v1, v2, PRECISION: tl.constexpr):
    """Fold a block of masked scores [M, N] (-inf where hidden) and values [N, half] x2 into the running
    max m_i [M], denominator l_i [M] and numerators acc [M, half] x2."""
    m_new = tl.maximum(m_i, tl.max(scores, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet
    p = tl.exp(scores - m_safe[:, None])
    alpha = tl.exp(m_i - m_safe)
    acc1 = acc1 * alpha[:, None] + tl.dot(p, v1, input_precision=PRECISION)
    acc2 = acc2 * alpha[:, None] + tl.dot(p, v2, input_precision=PRECISION)
    return m_new, l_i * alpha + tl.sum(p, axis=1), acc1, acc2


@triton.jit
def _split_result(m_i, l_i):
    """A split's finish: 1 / denominator [M] (0 for a row that saw no key) and its log-sum-exp [M] (-inf then),
    what the merge kernels weigh the splits' partial outputs by."""
    has = l_i > 0
    inv_l = tl.where(has, 1.0 / tl.where(has, l_i, 1.0), 0.0)
    lse = tl.where(has, m_i + tl.log(tl.where(has, l_i, 1.0)), float("-inf"))
    return inv_l, lse
