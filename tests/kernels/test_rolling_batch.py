"""Several rolling sessions' attention in one call (kernels/rolling_batch.py) against the trusted per-session
reference (`reference.paged_attention_rolling` with its own `rolling_rope`), on random odd shapes: sessions short
of their sinks and far past their window, 1 to 7 queries, GQA, the model's own sliding window or none."""

from __future__ import annotations

import pytest
import torch

from streamserve.kernels import reference as ref
from streamserve.kernels.rolling_batch import RollingBatch, paged_attention_rolling_batch, rolling_batch_rope

NO_POSITION = 1 << 62


def inv_freq(hd: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))


def reads(kv_len: int, q_len: int, sinks: int, window: int, sliding: int | None) -> torch.Tensor:
    """The positions a rolling session's step reads (sinks first), as `GroupKV.plan` lists them."""
    start = kv_len - q_len
    first = max(sinks, start - window + 1)
    if sliding is not None:
        first = max(first, start - sliding + 1)
    return torch.tensor([*range(min(sinks, kv_len)), *range(min(first, kv_len), kv_len)], dtype=torch.long)


# (keys after the step, queries, sinks, window): short of the sinks, inside the window, far past it; a cache
# shorter than the sliding window (its sinks stay inside it)
SESSIONS = [(3, 1, 4, 16), (9, 5, 2, 30), (1000, 1, 4, 21), (77, 7, 3, 13), (500_007, 2, 1, 40), (60, 3, 4, 5)]


@pytest.mark.parametrize(("h", "kvh", "hd", "sliding"), [(6, 2, 14, 0), (4, 4, 8, 9), (9, 3, 10, 0)])
def test_one_call_matches_each_session_alone(h: int, kvh: int, hd: int, sliding: int) -> None:
    torch.manual_seed(hd + h)
    slide = sliding or None
    pages = 64
    k_pool, v_pool = torch.randn(pages * 8, kvh, hd), torch.randn(pages * 8, kvh, hd)
    positions = [reads(n, t, s, w, slide) for n, t, s, w in SESSIONS]
    q = torch.randn(sum(t for _, t, _, _ in SESSIONS), h, hd)
    free = torch.randperm(pages * 8)
    slot_of, used = [], 0
    for p in positions:
        slot_of.append(free[used:used + p.shape[0]])
        used += p.shape[0]
    scale, freq = hd ** -0.5, inv_freq(hd)
    expected, start = [], 0
    for (n, t, sinks, window), k_pos, slots in zip(SESSIONS, positions, slot_of, strict=True):
        q_pos = torch.arange(n - t, n)
        rope = ref.rolling_rope(q_pos, k_pos, freq, 1.0, sinks, window, torch.float32)
        paged = ref.PagedKeys(k_pool, v_pool, slots, k_pos)
        expected.append(ref.paged_attention_rolling(q[start:start + t], paged, q_pos, rope, scale, sinks, window,
                                                    slide))
        start += t
    # the batch, padded: queries to the most, keys to the longest read (padding at NO_POSITION)
    b, tq, longest = len(SESSIONS), max(t for _, t, _, _ in SESSIONS), max(p.shape[0] for p in positions)
    starts = [0]
    for _, t, _, _ in SESSIONS:
        starts.append(starts[-1] + t)
    q_rows = torch.tensor([[starts[i] + min(j, t - 1) for j in range(tq)] for i, (_, t, _, _) in enumerate(SESSIONS)])
    q_pos = torch.tensor([[n - t + min(j, t - 1) for j in range(tq)] for n, t, _, _ in SESSIONS])
    slots = torch.zeros(b, longest, dtype=torch.long)
    k_pos = torch.full((b, longest), NO_POSITION, dtype=torch.long)
    for i, (p, sl) in enumerate(zip(positions, slot_of, strict=True)):
        slots[i, :p.shape[0]], k_pos[i, :p.shape[0]] = sl, p
    sinks = torch.tensor([s for _, _, s, _ in SESSIONS])
    windows = torch.tensor([w for _, _, _, w in SESSIONS])
    out_rows = torch.tensor([i * tq + j for i, (_, t, _, _) in enumerate(SESSIONS) for j in range(t)])
    rot = rolling_batch_rope(q_pos, k_pos, sinks, windows, freq, 1.0, torch.float32, NO_POSITION)
    batch = RollingBatch(q_rows, q_pos, slots, k_pos, sinks, windows, out_rows, *rot)
    got = paged_attention_rolling_batch(q, k_pool, v_pool, batch, scale, slide)
    want = torch.cat(expected)
    assert got.shape == want.shape and torch.isfinite(got).all()
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
