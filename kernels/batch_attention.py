"""Batched paged decode attention: the few queries (a decode token, or up to 16 draft tokens being verified)
of B sessions over their paged KV in one launch, absolute and rolling (StreamingLLM) sessions mixed.

Per-session tensors replace per-key slot lists (`BlockBatch`). A session reads its keys at positions
[0, n_sink) then [first, kv_len), n_sink = min(sinks, first): `GroupKV.plan`'s k_pos, sinks first, S keys.
Its block table holds the storage rows (page id - the group's base) of those keys' pages in a compact order
that stays bounded on an endless stream: the sink pages first (logical pages 0..sp-1, sp = ceil(n_sink / P)),
then the window pages from logical page w0 = max(first // P, sp) on; logical page j sits at entry j if j < sp,
else at sp + j - w0. Its queries are rows q_start..q_start+q_len-1 of q [N, H, hd], at positions
kv_len - q_len .. kv_len - 1 (a step's own keys are its last). Absolute sessions' rows come rotated (RoPE
applied, keys cached rotated); rolling sessions' rows come unrotated and are rotated here exactly as
`reference.rolling_rope` / `attention_rolling` do: keys by their place in the cache (a sink by its position,
a window key by its distance from the oldest window key), queries by p - oldest against window keys and by
min(p, sinks + window - 1) against sinks.

Split-KV (flash decoding): grid (B, KVH * row blocks, SPLITS); a program takes one session, one KV head (its
G = H / KVH query heads for the session's queries: rows (t, g), in blocks of at most TILE / (hd / 2) rows so
registers do not spill) and one share of the session's S keys, reading keys from their pages in place, and
writes a partial output and log-sum-exp; `_merge_kernel` combines the shares (one launch: grid (B, KVH * row
blocks)). A share is keys_per_split keys unless the session has more than SPLITS times that, so below
SPLITS * keys_per_split keys a session's result does not depend on the rest of the batch. Nothing
reads device values on the host: the launch is CUDA-graph capturable (fixed B, max_pages, SPLITS).
Reference: `batch_attention_reference` (per session `reference.paged_attention` / `paged_attention_rolling`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from streamserve.kernels import reference as ref
from streamserve.kernels.attention_common import _rotate_keys, _scores, _softmax_step, _split_result
from streamserve.kernels.checks import check_tensor

NO_WINDOW = 1 << 62  # a session without a window (the model's NO_POSITION)
MAX_QUERIES = 16  # the most queries of one session per launch
KEYS_PER_SPLIT = 256  # a program's share of a session's keys (multiple of BLOCK_N)
BLOCK_N = 32
TILE = 4096  # rows x head-dim halves one program holds (half that for rolling sessions of head dim 256, whose
# queries are kept rotated both ways): larger tiles spill registers (sm_90 bf16, ptxas -v on the compiled kernels)
MAX_SPLITS = 64
PARTIAL_BYTES = 64 << 20  # the most memory the split partials may take: fewer splits beyond it
_INTS = (torch.int32, torch.int64)


class BlockBatch(NamedTuple):
    """B sessions' reads of one layer group in a step (see the module's docstring), shared by its layers."""

    block_table: torch.Tensor  # [B, max_pages] int32 storage rows: sink pages, then window pages
    kv_len: torch.Tensor  # [B] int: keys at positions < kv_len (the step's own included)
    first: torch.Tensor  # [B] int: the oldest non-sink position read
    sinks: torch.Tensor  # [B] int: the group's sink count (the policy's with a window, else 0)
    window: torch.Tensor  # [B] int64: the session's window (NO_WINDOW: none)
    rolling: torch.Tensor | None  # [B] int32, 1 for rolling sessions; None when no session is rolling
    q_start: torch.Tensor  # [B] int: the session's first row of q
    q_len: torch.Tensor  # [B] int: its queries, 0..max_q (0: a padding session, nothing written)
    max_q: int  # the most queries of a session (1..16): the kernel's row padding
    page_size: int  # P, tokens per page


@triton.jit
def _rotate(x1, x2, pos, inv_freq, rope_scaling):
    """Rows [M, half] x2 rotated (rotate-half RoPE) by positions pos [M]."""
    ang = pos.to(tl.float32)[:, None] * inv_freq[None, :]
    c = tl.cos(ang) * rope_scaling
    s = tl.sin(ang) * rope_scaling
    return x1 * c - x2 * s, x2 * c + x1 * s


@triton.jit
def _batch_attn_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, kvlen_ptr, first_ptr, sinks_ptr, window_ptr, roll_ptr,
                       qstart_ptr, qlen_ptr, inv_freq_ptr, o_ptr, lse_ptr, max_pages, keys_per_split, scale,
                       rope_scaling, sliding, KVH: tl.constexpr, G: tl.constexpr, HALF: tl.constexpr,
                       PAGE: tl.constexpr, T: tl.constexpr, SPLITS: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                       BLOCK_M: tl.constexpr, BLOCK_HALF: tl.constexpr, BLOCK_N: tl.constexpr,
                       ROLLING: tl.constexpr, PRECISION: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1) // ROW_BLOCKS
    rb = tl.program_id(1) % ROW_BLOCKS
    split = tl.program_id(2)
    HD: tl.constexpr = 2 * HALF
    kv_len = tl.load(kvlen_ptr + b).to(tl.int64)
    first = tl.load(first_ptr + b).to(tl.int64)
    sinks = tl.load(sinks_ptr + b).to(tl.int64)
    window = tl.load(window_ptr + b).to(tl.int64)
    q_len = tl.load(qlen_ptr + b).to(tl.int64)
    q_start = tl.load(qstart_ptr + b).to(tl.int64)
    n_sink = tl.minimum(sinks, first)
    n_keys = n_sink + kv_len - first  # S
    sp = (n_sink + PAGE - 1) // PAGE  # sink pages at the head of the block table
    w0 = tl.maximum(first // PAGE, sp)  # the first window page's logical number
    per = tl.maximum(keys_per_split, (n_keys + SPLITS - 1) // SPLITS)
    per = (per + BLOCK_N - 1) // BLOCK_N * BLOCK_N
    start = (split * per).to(tl.int32)
    end = tl.minimum(split * per + per, n_keys).to(tl.int32)
    m = rb * BLOCK_M + tl.arange(0, BLOCK_M)  # rows: query t, head g of this KV head
    t = m // G
    m_ok = (m < T * G) & (t < q_len)
    qpos = kv_len - q_len + t  # [BLOCK_M]
    q_row = ((q_start + t) * (KVH * G) + kvh * G + m % G) * HD
    dh = tl.arange(0, BLOCK_HALF)
    d_ok = dh < HALF
    qm = m_ok[:, None] & d_ok[None, :]
    q1 = tl.load(q_ptr + q_row[:, None] + dh[None, :], mask=qm, other=0.0).to(tl.float32)
    q2 = tl.load(q_ptr + q_row[:, None] + HALF + dh[None, :], mask=qm, other=0.0).to(tl.float32)
    if ROLLING:
        roll = tl.load(roll_ptr + b) != 0
        inv_freq = tl.load(inv_freq_ptr + dh, mask=d_ok, other=0.0)
        oldest = tl.maximum(first, sinks)  # the oldest window key (0 without one), as `rolling_rope` finds it
        base = tl.where(oldest < kv_len, oldest, 0)
        cq = tl.minimum(qpos, sinks + window - 1)  # the query's place in its own cache, against sinks
        qs1, qs2 = q1, q2
        if roll:
            qs1, qs2 = _rotate(q1, q2, cq, inv_freq, rope_scaling)
            q1, q2 = _rotate(q1, q2, qpos - base, inv_freq, rope_scaling)
    m_i = tl.full((BLOCK_M,), float("-inf"), dtype=tl.float32)
    l_i = tl.zeros((BLOCK_M,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK_M, BLOCK_HALF), dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        n = n0 + tl.arange(0, BLOCK_N)  # the session's key index, sinks first
        n_ok = n < end
        kpos = tl.where(n < n_sink, n, first + n - n_sink)
        page = kpos // PAGE
        entry = tl.where(page < sp, page, sp + page - w0)
        row = tl.load(bt_ptr + b * max_pages + entry, mask=n_ok, other=0).to(tl.int64)
        kv_row = ((row * PAGE + kpos % PAGE) * KVH + kvh) * HD  # [BLOCK_N] this key's head in the pool
        km = n_ok[:, None] & d_ok[None, :]
        k1 = tl.load(k_ptr + kv_row[:, None] + dh[None, :], mask=km, other=0.0).to(tl.float32)
        k2 = tl.load(k_ptr + kv_row[:, None] + HALF + dh[None, :], mask=km, other=0.0).to(tl.float32)
        dist = qpos[:, None] - kpos[None, :]  # [BLOCK_M, BLOCK_N]
        if ROLLING:
            if roll:  # keys rotated by their place in the cache; against a sink the query sits at cq
                is_sink = kpos < sinks
                k1, k2 = _rotate_keys(k1, k2, kpos, sinks, base, inv_freq, rope_scaling)
                scores = tl.where(is_sink[None, :], _scores(qs1, qs2, k1, k2, PRECISION),
                                  _scores(q1, q2, k1, k2, PRECISION))
                dist = tl.where(is_sink[None, :], cq[:, None] - kpos[None, :], dist)
            else:
                scores = _scores(q1, q2, k1, k2, PRECISION)
        else:
            scores = _scores(q1, q2, k1, k2, PRECISION)
        ok = m_ok[:, None] & n_ok[None, :] & (kpos[None, :] <= qpos[:, None])
        ok = ok & ((sliding == 0) | (dist < sliding))
        ok = ok & ((kpos[None, :] < sinks) | (kpos[None, :] > qpos[:, None] - window))
        scores = tl.where(ok, scores * scale, float("-inf"))
        v1 = tl.load(v_ptr + kv_row[:, None] + dh[None, :], mask=km, other=0.0).to(tl.float32)
        v2 = tl.load(v_ptr + kv_row[:, None] + HALF + dh[None, :], mask=km, other=0.0).to(tl.float32)
        m_i, l_i, acc1, acc2 = _softmax_step(scores, m_i, l_i, acc1, acc2, v1, v2, PRECISION)
    inv_l, lse = _split_result(m_i, l_i)
    part = ((b * KVH + kvh) * SPLITS + split) * (T * G) + m  # partials [B, KVH, SPLITS, T * G, hd]
    pm = (m < T * G)[:, None] & d_ok[None, :]
    tl.store(o_ptr + part[:, None] * HD + dh[None, :], acc1 * inv_l[:, None], mask=pm)
    tl.store(o_ptr + part[:, None] * HD + HALF + dh[None, :], acc2 * inv_l[:, None], mask=pm)
    tl.store(lse_ptr + part, lse, mask=m < T * G)


@triton.jit
def _merge_kernel(o_ptr, lse_ptr, qstart_ptr, qlen_ptr, out_ptr, KVH: tl.constexpr, G: tl.constexpr,
                  HD: tl.constexpr, T: tl.constexpr, SPLITS: tl.constexpr, ROW_BLOCKS: tl.constexpr,
                  BLOCK_R: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    """Grid (B, KVH * row blocks): a block of a session's KV head's rows (t, g), its splits' partials combined
    by log-sum-exp."""
    b = tl.program_id(0)
    kvh = tl.program_id(1) // ROW_BLOCKS
    r = (tl.program_id(1) % ROW_BLOCKS) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_ok = r < T * G
    t = r // G
    q_len = tl.load(qlen_ptr + b).to(tl.int64)
    q_start = tl.load(qstart_ptr + b).to(tl.int64)
    s = tl.arange(0, BLOCK_S)
    first = (b * KVH + kvh) * SPLITS  # this (session, KV head)'s first split
    lse = tl.load(lse_ptr + (first + s[:, None]) * (T * G) + r[None, :], mask=(s < SPLITS)[:, None] & r_ok[None, :],
                  other=float("-inf"))  # [BLOCK_S, BLOCK_R]
    mx = tl.max(lse, axis=0)
    mx = tl.where(mx == float("-inf"), 0.0, mx)  # a row no split saw (padding)
    den = tl.sum(tl.exp(lse - mx[None, :]), axis=0)
    inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)
    d = tl.arange(0, BLOCK_D)
    om = r_ok[:, None] & (d < HD)[None, :]
    acc = tl.zeros((BLOCK_R, BLOCK_D), dtype=tl.float32)
    for sp in range(SPLITS):
        part = (first + sp) * (T * G) + r
        w = tl.exp(tl.load(lse_ptr + part, mask=r_ok, other=float("-inf")) - mx) * inv
        acc += w[:, None] * tl.load(o_ptr + part[:, None] * HD + d[None, :], mask=om, other=0.0)
    out_row = ((q_start + t) * (KVH * G) + kvh * G + r % G) * HD
    tl.store(out_ptr + out_row[:, None] + d[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=om & (t < q_len)[:, None])


def check_batch(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: BlockBatch) -> int:
    """ValueError unless the inputs have the shapes, dtypes and devices the kernel needs; -> KVH.
    Only what the host knows is checked (no device reads: the launch stays graph-capturable)."""
    check_tensor("q", q, dtypes=(torch.float32, torch.float16, torch.bfloat16))
    if q.dim() != 3:
        raise ValueError(f"q must have 3 dimensions [N, H, hd], got shape {list(q.shape)}")
    h, hd = q.shape[1:]
    check_tensor("k_pool", k_pool, dtypes=(q.dtype,), device=q.device, contiguous=True)
    page = batch.page_size
    if isinstance(page, bool) or not isinstance(page, int) or page < 1:
        raise ValueError(f"page_size must be an int >= 1, got {page!r}")
    if k_pool.dim() == 3 and k_pool.shape[0] % page == 0:  # flat slots (`PagedKeys.k_pool`)
        k_pool = k_pool.view(-1, page, *k_pool.shape[1:])
    if k_pool.dim() != 4 or k_pool.shape[1] != page or k_pool.shape[3] != hd or h % k_pool.shape[2] or hd % 2:
        raise ValueError(f"k_pool has shape {list(k_pool.shape)}: expected [pages, {page}, KVH, {hd}] or [pages * "
                         f"{page}, KVH, {hd}] with {h} % KVH == 0 and an even head dim")
    kvh = k_pool.shape[2]
    check_tensor("v_pool", v_pool, dtypes=(q.dtype,), device=q.device, contiguous=True)
    if v_pool.numel() != k_pool.numel() or v_pool.shape[-2:] != k_pool.shape[-2:]:
        raise ValueError(f"v_pool has shape {list(v_pool.shape)}, expected that of k_pool")
    check_tensor("block_table", batch.block_table, dims=2, dtypes=(torch.int32,), device=q.device, contiguous=True)
    b = batch.block_table.shape[0]
    for name in ("kv_len", "first", "sinks", "window", "q_start", "q_len"):
        check_tensor(name, getattr(batch, name), shape=(b,), dtypes=_INTS, device=q.device, contiguous=True)
    if batch.rolling is not None:
        check_tensor("rolling", batch.rolling, shape=(b,), dtypes=_INTS, device=q.device, contiguous=True)
    if isinstance(batch.max_q, bool) or not isinstance(batch.max_q, int) or not 1 <= batch.max_q <= MAX_QUERIES:
        raise ValueError(f"max_q must be an int in 1..{MAX_QUERIES} queries per session, got {batch.max_q!r}")
    return kvh


def batch_attention(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: BlockBatch, scale: float,
                    sliding: int | None = None, inv_freq: torch.Tensor | None = None, rope_scaling: float = 1.0,
                    splits: int | None = None, keys_per_split: int = KEYS_PER_SPLIT,
                    block_n: int = BLOCK_N) -> torch.Tensor:
    """B sessions' queries over their paged keys in one launch (+ one merge launch).

    q [N, H, hd] (absolute sessions' rows rotated, rolling ones' not); k_pool, v_pool [pages, P, KVH, hd] (a
    layer's storage, `KVPool.k[layer]`) or its flat view [pages * P, KVH, hd] (`PagedKeys.k_pool`);
    `sliding`: the layer's own sliding window (Gemma local layers); `inv_freq` [hd/2] fp32 and `rope_scaling`:
    the rotations of rolling sessions (needed when `batch.rolling` is given); `splits`: programs per (session,
    KV head) (default from the block table's capacity and PARTIAL_BYTES). -> [N, H * hd] in q's dtype: the
    sessions' rows filled, other rows zero.
    """
    kvh, page = check_batch(q, k_pool, v_pool, batch), batch.page_size
    n, h, hd = q.shape
    rolling = batch.rolling is not None
    if rolling:
        check_tensor("inv_freq", inv_freq, shape=(hd // 2,), dtypes=(torch.float32,), device=q.device,
                     contiguous=True)
    if block_n < 16 or block_n & (block_n - 1) or keys_per_split < block_n or keys_per_split % block_n:
        raise ValueError(f"block_n ({block_n}) must be a power of two >= 16 dividing keys_per_split "
                         f"({keys_per_split})")
    b, max_pages = batch.block_table.shape
    group, tq = h // kvh, batch.max_q
    if splits is None:
        fit = PARTIAL_BYTES // max(1, b * kvh * tq * group * hd * 4)
        splits = max(1, min(MAX_SPLITS, -(-max_pages * page // keys_per_split), fit))
    if isinstance(splits, bool) or not isinstance(splits, int) or not 1 <= splits <= MAX_SPLITS:
        raise ValueError(f"splits must be an int in 1..{MAX_SPLITS}, got {splits!r}")
    out = torch.zeros(n, h * hd, dtype=q.dtype, device=q.device)
    if b == 0 or n == 0:
        return out
    q = q.contiguous()
    o = torch.empty(b, kvh, splits, tq * group, hd, dtype=torch.float32, device=q.device)
    lse = torch.empty(b, kvh, splits, tq * group, dtype=torch.float32, device=q.device)
    block_half = max(16, triton.next_power_of_2(hd // 2))
    tile = TILE // 2 if rolling and block_half >= 128 else TILE
    block_m = max(16, min(triton.next_power_of_2(tq * group), tile // block_half))
    row_blocks = triton.cdiv(tq * group, block_m)
    _batch_attn_kernel[(b, kvh * row_blocks, splits)](
        q, k_pool, v_pool, batch.block_table, batch.kv_len, batch.first, batch.sinks, batch.window,
        batch.rolling if rolling else batch.q_len, batch.q_start, batch.q_len, inv_freq if rolling else q, o, lse,
        max_pages, keys_per_split, scale, rope_scaling, sliding or 0, KVH=kvh, G=group, HALF=hd // 2, PAGE=page,
        T=tq, SPLITS=splits, ROW_BLOCKS=row_blocks, BLOCK_M=block_m, BLOCK_HALF=block_half, BLOCK_N=block_n,
        ROLLING=rolling, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",  # 16-bit uses tensor cores
        num_warps=4 if block_m * block_half <= 1024 else 8)
    block_d = triton.next_power_of_2(hd)
    block_r = max(1, min(triton.next_power_of_2(tq * group), TILE // block_d))
    merge_blocks = triton.cdiv(tq * group, block_r)
    _merge_kernel[(b, kvh * merge_blocks)](o, lse, batch.q_start, batch.q_len, out, KVH=kvh, G=group, HD=hd, T=tq,
                                           SPLITS=splits, ROW_BLOCKS=merge_blocks, BLOCK_R=block_r,
                                           BLOCK_S=triton.next_power_of_2(splits), BLOCK_D=block_d)
    return out


def block_slots(table: torch.Tensor, kv_len: int, first: int, sinks: int,
                page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One session's compact block-table row [max_pages] -> (k_pos [S], flat slots [S]) of the keys it reads,
    sinks first, in the pool viewed as [pages * P, KVH, hd] (what `GroupKV.plan` gives as k_pos, read_slots)."""
    n_sink = min(sinks, first)
    sp = -(-n_sink // page_size)
    w0 = max(first // page_size, sp)
    k_pos = torch.cat([torch.arange(n_sink), torch.arange(first, kv_len)]).to(table.device)
    page = k_pos // page_size
    entry = torch.where(page < sp, page, sp + page - w0)
    return k_pos, table.long()[entry] * page_size + k_pos % page_size


def batch_attention_reference(q: torch.Tensor, k_pool: torch.Tensor, v_pool: torch.Tensor, batch: BlockBatch,
                              scale: float, sliding: int | None = None, inv_freq: torch.Tensor | None = None,
                              rope_scaling: float = 1.0) -> torch.Tensor:
    """`batch_attention` in torch: each session's keys gathered through its block table, then the trusted
    per-session references (`paged_attention`, `paged_attention_rolling` with `rolling_rope` in q's dtype).
    Reads the batch on the host (tests, CPU)."""
    kvh, page = check_batch(q, k_pool, v_pool, batch), batch.page_size
    n, h, hd = q.shape
    kf, vf = k_pool.view(-1, kvh, hd), v_pool.view(-1, kvh, hd)
    out = torch.zeros(n, h * hd, dtype=q.dtype, device=q.device)
    rows = zip(batch.kv_len.tolist(), batch.first.tolist(), batch.sinks.tolist(), batch.window.tolist(),
               batch.q_start.tolist(), batch.q_len.tolist(),
               batch.rolling.tolist() if batch.rolling is not None else [0] * len(batch.q_len), strict=True)
    for b, (kv_len, first, sinks, window, q_start, q_len, roll) in enumerate(rows):
        if q_len == 0:
            continue
        k_pos, slots = block_slots(batch.block_table[b], kv_len, first, sinks, page)
        paged = ref.PagedKeys(kf, vf, slots, k_pos)
        q_pos = torch.arange(kv_len - q_len, kv_len, device=q.device)
        qb = q[q_start:q_start + q_len]
        if roll:
            if inv_freq is None:
                raise ValueError("rolling sessions need inv_freq")
            rope = ref.rolling_rope(q_pos, k_pos, inv_freq, rope_scaling, sinks, window, q.dtype)
            res = ref.paged_attention_rolling(qb, paged, q_pos, rope, scale, sinks, window, sliding)
        else:
            res = ref.paged_attention(qb, paged, q_pos, scale, sliding, sinks, None if window >= NO_WINDOW else window)
        out[q_start:q_start + q_len] = res
    return out


def block_batch(tables: Sequence[Mapping[int, int]], kv_lens: Sequence[int], firsts: Sequence[int],
                sinks: Sequence[int], windows: Sequence[int | None], rolling: Sequence[bool], q_lens: Sequence[int],
                page_size: int, base: int = 0, max_pages: int | None = None, q_starts: Sequence[int] | None = None,
                device: torch.device | str = "cpu") -> BlockBatch:
    """The block-table form of B sessions' reads of one layer group, from plain per-session values.

    tables: each session's page table of the group (logical page -> page id, `GroupKV.table`); base: the group's
    first page id (`GroupKV.base`); kv_lens: positions < kv_len are keys (the step's end); firsts: the oldest
    non-sink position read (`GroupKV.plan`'s first); sinks: the group's sinks (`GroupKV.sinks`); windows: the
    sessions' windows (None: none); q_lens: the step's tokens per session (1..16, 0 for a padding session);
    q_starts: each session's first row of q (default: the rows in session order, one after the other);
    max_pages: the table's width (default the widest row; fix it for graphs).
    ValueError on inconsistent input (a read page not held, a row over max_pages, bad lengths).
    """
    b = len(tables)
    cols = (kv_lens, firsts, sinks, windows, rolling, q_lens)
    if any(len(c) != b for c in cols):
        raise ValueError(f"{b} page tables but per-session lists of lengths {[len(c) for c in cols]}")
    if page_size < 1:
        raise ValueError(f"page_size must be >= 1, got {page_size}")
    rows: list[list[int]] = []
    for i, (table, kv_len, first, sink, window, roll, q_len) in enumerate(zip(tables, *cols, strict=True)):
        if not 0 <= q_len <= MAX_QUERIES or q_len > kv_len or not 0 <= first <= kv_len or sink < 0:
            raise ValueError(f"session {i}: q_len {q_len}, kv_len {kv_len}, first {first}, sinks {sink}: expected "
                             f"0 <= q_len <= {MAX_QUERIES}, q_len <= kv_len, 0 <= first <= kv_len, sinks >= 0")
        if q_len and first > max(sink, kv_len - q_len):
            raise ValueError(f"session {i} does not read its own queries' keys: its first read position {first} "
                             f"is after its first query {kv_len - q_len}")
        if (window is not None and window < 1) or (roll and window is None):
            raise ValueError(f"session {i}: window {window} (rolling sessions need one, of at least 1 token)")
        n_sink = min(sink, first)
        sp = -(-n_sink // page_size)
        w0 = max(first // page_size, sp)
        logical = [*range(sp), *range(w0, -(-kv_len // page_size))]
        missing = [j for j in logical if j not in table]
        if missing:
            raise ValueError(f"session {i} reads logical pages {missing[:4]} it does not hold")
        rows.append([table[j] - base for j in logical])
    width = max([len(r) for r in rows] + [1]) if max_pages is None else max_pages
    if any(len(r) > width for r in rows):
        raise ValueError(f"a session reads {max(len(r) for r in rows)} pages, over max_pages = {width}")
    bt = torch.tensor([r + [0] * (width - len(r)) for r in rows], dtype=torch.int32).reshape(b, width)
    starts = [0]
    for q_len in q_lens[:-1]:
        starts.append(starts[-1] + q_len)
    if q_starts is not None:
        if len(q_starts) != b or any(s < 0 for s in q_starts):
            raise ValueError(f"q_starts {list(q_starts)[:8]} must be {b} rows >= 0")
        starts = list(q_starts)

    def ints(x: Sequence[int], dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(list(x), dtype=dtype, device=device)

    return BlockBatch(bt.to(device), ints(kv_lens), ints(firsts), ints(sinks),
                      ints([NO_WINDOW if w is None else w for w in windows], torch.int64),
                      ints([int(r) for r in rolling]) if any(rolling) else None, ints(starts), ints(q_lens),
                      max(1, *q_lens) if q_lens else 1, page_size)
