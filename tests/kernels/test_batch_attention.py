"""batch_attention (B sessions' decode/verify queries over paged KV in one launch) under Triton's interpreter,
against the trusted per-session references, on random odd shapes; its block-table helper against the engine's
own sessions (sessions/paged_kv.py)."""

from __future__ import annotations

from typing import NamedTuple

import pytest
import torch

pytest.importorskip("triton")

from streamserve.kernels import reference as ref
from streamserve.kernels.batch_attention import (
    NO_WINDOW,
    BlockBatch,
    batch_attention,
    batch_attention_reference,
    block_batch,
    block_slots,
)

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(out).all()
    return ((out.double() - expected).norm() / expected.norm()).item()


def inv_freq(hd: int) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))


class Spec(NamedTuple):
    kv_len: int  # keys after the step (its own included)
    q_len: int  # the step's tokens
    sinks: int = 0
    window: int | None = None
    rolling: bool = False


def first_read(s: Spec, sliding: int | None) -> int:
    """`GroupKV.plan`'s first non-sink position read, for a group whose layers' own window is `sliding`."""
    start = s.kv_len - s.q_len
    first = 0 if s.window is None else max(s.sinks, start - s.window + 1)
    if sliding is not None:
        first = max(first, start - sliding + 1)
    return min(first, s.kv_len)


class Case(NamedTuple):
    q: torch.Tensor  # [N, H, hd]
    k_pool: torch.Tensor  # [pages, P, KVH, hd]
    v_pool: torch.Tensor
    batch: BlockBatch
    reads: list[tuple[torch.Tensor, torch.Tensor]]  # per session (k_pos, slots), built from its page table


def make_case(specs: list[Spec], h: int, kvh: int, hd: int, page: int, dtype: torch.dtype, sliding: int | None,
              seed: int, spare_pages: int = 3) -> Case:
    """Sessions whose read pages sit at shuffled rows of one pool (a row of another session, or none, next to
    them), each page table holding only the pages the session still keeps, as `GroupKV` does."""
    g = torch.Generator().manual_seed(seed)
    firsts = [first_read(s, sliding) for s in specs]
    sinks = [s.sinks if s.window is not None else 0 for s in specs]
    wanted = []
    for s, first, sink in zip(specs, firsts, sinks, strict=True):
        n_sink = min(sink, first)
        wanted.append(sorted({*range(-(-n_sink // page)), *range(first // page, -(-s.kv_len // page))}))
    n_pages = sum(len(w) for w in wanted) + spare_pages
    order = torch.randperm(n_pages, generator=g).tolist()
    base = 5  # page ids of this group start at 5 (a second layer group's ids, say)
    tables, at = [], 0
    for w in wanted:
        tables.append({j: base + order[at + i] for i, j in enumerate(w)})
        at += len(w)
    k_pool = torch.randn(n_pages, page, kvh, hd, generator=g).to(dtype)
    v_pool = torch.randn(n_pages, page, kvh, hd, generator=g).to(dtype)
    q = torch.randn(sum(s.q_len for s in specs), h, hd, generator=g).to(dtype)
    batch = block_batch(tables, [s.kv_len for s in specs], firsts, sinks, [s.window for s in specs],
                        [s.rolling for s in specs], [s.q_len for s in specs], page, base=base,
                        max_pages=max(len(w) for w in wanted) + 2)
    reads = []
    for table, s, first, sink in zip(tables, specs, firsts, sinks, strict=True):
        k_pos = torch.cat([torch.arange(min(sink, first)), torch.arange(first, s.kv_len)])
        rows = torch.tensor([table[int(j)] - base for j in k_pos // page], dtype=torch.long)
        reads.append((k_pos, rows * page + k_pos % page))
    return Case(q, k_pool, v_pool, batch, reads)


def per_session(case: Case, specs: list[Spec], scale: float, sliding: int | None, dtype: torch.dtype) -> torch.Tensor:
    """The sessions one by one through `reference.paged_attention` / `paged_attention_rolling` (the engine's
    CPU path) over their slot lists, in `dtype` -> [N, H * hd]."""
    kvh, hd = case.k_pool.shape[2:]
    kf, vf = case.k_pool.to(dtype).view(-1, kvh, hd), case.v_pool.to(dtype).view(-1, kvh, hd)
    outs, row = [], 0
    for s, (k_pos, slots) in zip(specs, case.reads, strict=True):
        q = case.q[row:row + s.q_len].to(dtype)
        row += s.q_len
        q_pos = torch.arange(s.kv_len - s.q_len, s.kv_len)
        paged = ref.PagedKeys(kf, vf, slots, k_pos)
        sinks = s.sinks if s.window is not None else 0
        if s.rolling:
            assert s.window is not None
            rope = ref.rolling_rope(q_pos, k_pos, inv_freq(hd), 1.0, sinks, s.window, dtype)
            outs.append(ref.paged_attention_rolling(q, paged, q_pos, rope, scale, sinks, s.window, sliding))
        else:
            outs.append(ref.paged_attention(q, paged, q_pos, scale, sliding, sinks, s.window))
    return torch.cat(outs)


def row_of(batch: BlockBatch, b: int) -> tuple[int, int, int]:
    """Session b's (kv_len, first, sinks) as ints."""
    return int(batch.kv_len[b]), int(batch.first[b]), int(batch.sinks[b])


MIXED = [  # one launch: lengths 1, 2, 17, 1027, 10^6; windows with sinks; rolling and absolute; 1..16 queries
    Spec(1, 1), Spec(2, 2), Spec(17, 3, 4, 8, True), Spec(1027, 1, 4, 300), Spec(1027, 16, 2, 500, True),
    Spec(1027, 5), Spec(40, 1, 4, 9, True), Spec(3, 1, 4, 8, True), Spec(17, 16, 3, 5),
    Spec(10**6 + 7, 2, 4, 64, True),  # an endless stream: its table stays a few pages, its rotations small
]


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("h", "kvh", "hd", "sliding"), [(4, 2, 32, None), (4, 1, 16, 50)])
def test_one_launch_matches_the_per_session_references(page, dtype, h, kvh, hd, sliding) -> None:
    case = make_case(MIXED, h, kvh, hd, page, dtype, sliding, seed=page * 7 + hd)
    scale = hd**-0.5
    for b, (k_pos, slots) in enumerate(case.reads):  # the compact table maps back to the session's slot list
        got_pos, got_slots = block_slots(case.batch.block_table[b], *row_of(case.batch, b), page)
        assert torch.equal(got_pos, k_pos) and torch.equal(got_slots, slots)
    # the batched reference is the per-session reference, exactly
    batch_ref = batch_attention_reference(case.q, case.k_pool, case.v_pool, case.batch, scale, sliding, inv_freq(hd))
    assert torch.equal(batch_ref, per_session(case, MIXED, scale, sliding, dtype))
    expected = per_session(case, MIXED, scale, sliding, torch.float64)
    out = batch_attention(case.q, case.k_pool, case.v_pool, case.batch, scale, sliding, inv_freq(hd))
    assert sliding is not None or case.batch.block_table.shape[1] * page > 1024  # several splits
    assert out.dtype == dtype and out.shape == (case.q.shape[0], h * hd)
    assert rel_err(out, expected) < TOL[dtype]
    assert rel_err(out, batch_ref.double()) < TOL[dtype]
    for row in range(case.q.shape[0]):  # every session's every row is right, not just the batch on average
        assert rel_err(out[row], expected[row]) < 4 * TOL[dtype]


def test_splits_row_blocks_and_neighbours_do_not_change_a_session(monkeypatch: pytest.MonkeyPatch) -> None:
    specs = [Spec(600, 16, 4, 400, True), Spec(300, 2), Spec(5, 1)]
    case = make_case(specs, 4, 2, 32, 16, torch.float32, None, seed=3)
    scale = 32**-0.5
    expected = per_session(case, specs, scale, None, torch.float64)
    outs = [batch_attention(case.q, case.k_pool, case.v_pool, case.batch, scale, inv_freq=inv_freq(32), splits=s,
                            keys_per_split=kps, block_n=bn) for s, kps, bn in ((1, 64, 64), (3, 64, 16), (8, 128, 64))]
    from streamserve.kernels import batch_attention as ba

    monkeypatch.setattr(ba, "TILE", 256)  # hd/2 = 16: 32 rows (16 queries x 2 heads) in 2 programs, merged in 4
    outs.append(batch_attention(case.q, case.k_pool, case.v_pool, case.batch, scale, inv_freq=inv_freq(32),
                                block_n=64))
    monkeypatch.setattr(ba, "TILE", 16)  # one row a merge program
    outs.append(batch_attention(case.q, case.k_pool, case.v_pool, case.batch, scale, inv_freq=inv_freq(32),
                                block_n=64))
    monkeypatch.undo()
    for out in outs:
        assert rel_err(out, expected) < TOL[torch.float32]
    # batch invariance: session 1 alone (same max_q) gives the same bits as in the batch
    b = case.batch
    alone = BlockBatch(b.block_table[1:2], b.kv_len[1:2], b.first[1:2], b.sinks[1:2], b.window[1:2], b.rolling[1:2],
                       torch.zeros(1, dtype=torch.int32), b.q_len[1:2], b.max_q, b.page_size)
    solo = batch_attention(case.q[16:18], case.k_pool, case.v_pool, alone, scale, inv_freq=inv_freq(32))
    together = batch_attention(case.q, case.k_pool, case.v_pool, case.batch, scale, inv_freq=inv_freq(32))
    assert torch.equal(solo, together[16:18])


def test_padding_sessions_write_nothing() -> None:
    """Fixed-size batches (CUDA graphs): sessions with no queries and no keys leave their rows alone; rows of
    no session come back zero."""
    specs = [Spec(9, 2, 0, None), Spec(20, 1, 2, 6, True)]
    case = make_case(specs, 4, 2, 16, 1, torch.float32, None, seed=11)
    b = case.batch
    pad = lambda t, v: torch.cat([t, torch.full((2, *t.shape[1:]), v, dtype=t.dtype)])  # noqa: E731
    padded = BlockBatch(pad(b.block_table, 0), pad(b.kv_len, 0), pad(b.first, 0), pad(b.sinks, 0),
                        pad(b.window, NO_WINDOW), pad(b.rolling, 0), pad(b.q_start, 3), pad(b.q_len, 0), b.max_q,
                        b.page_size)
    q = torch.cat([case.q, torch.randn(2, 4, 16)])
    out = batch_attention(q, case.k_pool, case.v_pool, padded, 0.25, inv_freq=inv_freq(16))
    expected = per_session(case, specs, 0.25, None, torch.float64)
    assert rel_err(out[:3], expected) < 1e-5
    assert torch.equal(out[3:], torch.zeros(2, 64))
    # sessions whose rows sit among others' (a long prefill chunk run on its own): q_starts place them
    shifted = b._replace(q_start=torch.tensor([3, 0], dtype=torch.int32))
    q2 = torch.cat([case.q[2:], torch.randn(2, 4, 16), case.q[:2]])  # [5, H, hd]: session 1, two others, session 0
    out = batch_attention(q2, case.k_pool.view(-1, 2, 16), case.v_pool.view(-1, 2, 16), shifted, 0.25,
                          inv_freq=inv_freq(16))  # the flat pool view (`PagedKeys.k_pool`) works the same
    assert rel_err(torch.cat([out[3:], out[:1]]), expected) < 1e-5
    assert torch.equal(out[1:3], torch.zeros(2, 64))
    rebuilt = block_batch([{0: 0}, {0: 1}], [1, 1], [0, 0], [0, 0], [None, None], [False, False], [1, 1], 1,
                          q_starts=[3, 0])
    assert rebuilt.q_start.tolist() == [3, 0]


def test_block_tables_from_engine_sessions() -> None:
    """Real sessions (window and rolling policies, a Gemma-style local layer group with its own page ids) after
    steps that dropped pages: the helper's tables read exactly `GroupKV.plan`'s slots, and the kernel over the
    pool's storage equals the per-session reference over what `update` returns."""
    from streamserve.sessions.groups import layer_groups
    from streamserve.sessions.paged_kv import PagedSessionKV
    from streamserve.sessions.policy import WindowPolicy
    from streamserve.sessions.pool import KVPool

    h, kvh, hd, page, local = 4, 2, 16, 4, 8
    groups = layer_groups([None, local], rewind_reach=2)  # layer 0 global, layer 1 local (window 8)
    pool = KVPool(2, kvh, hd, [64, 40], page_size=page, groups=groups)
    policies = [WindowPolicy(), WindowPolicy(window=12, sinks=3), WindowPolicy(window=10, sinks=2, mode="absolute"),
                WindowPolicy(window=6, sinks=4)]
    sessions = [PagedSessionKV(pool, p, max_tokens=1000) for p in policies]
    g = torch.Generator().manual_seed(5)
    for steps in ([7, 30, 2], [9, 1, 5, 30], [21, 3], [3, 1, 11]):  # interleaved growth: shuffled pages
        for kv, n in zip(sessions, steps, strict=False):
            kv.begin(n)
            for layer in range(2):
                kv.update(layer, torch.randn(n, kvh, hd, generator=g), torch.randn(n, kvh, hd, generator=g))
            kv.commit()
    q_lens = [1, 3, 16, 2]
    starts = [kv.length for kv in sessions]
    for kv, n in zip(sessions, q_lens, strict=True):
        kv.begin(n)
    q = torch.randn(sum(q_lens), h, hd, generator=g)
    for layer in range(2):
        grp_i = pool.layer_group[layer]
        sliding = groups[grp_i].window
        reads, expected, row = [], [], 0
        for kv, n in zip(sessions, q_lens, strict=True):
            paged = kv.update(layer, torch.randn(n, kvh, hd, generator=g), torch.randn(n, kvh, hd, generator=g))
            grp = kv.groups[grp_i]
            reads.append((paged.slots, grp.k_pos))
            qb, q_pos = q[row:row + n], kv.q_pos
            row += n
            if kv.rolling:
                rope = ref.rolling_rope(q_pos, grp.k_pos, inv_freq(hd), 1.0, grp.sinks, kv.policy.window,
                                        torch.float64)
                expected.append(ref.attention_rolling(qb.double(), *(t.double() for t in ref.gather(paged)), q_pos,
                                                      grp.k_pos, rope, hd**-0.5, grp.sinks, kv.policy.window,
                                                      sliding))
            else:
                expected.append(ref.attention(qb.double(), *(t.double() for t in ref.gather(paged)), q_pos,
                                              grp.k_pos, hd**-0.5, sliding, grp.sinks, kv.policy.window))
        grps = [kv.groups[grp_i] for kv in sessions]
        batch = block_batch([gr.table for gr in grps], [s + n for s, n in zip(starts, q_lens, strict=True)],
                            [min(gr.read_first(s), s + n) for gr, s, n in zip(grps, starts, q_lens, strict=True)],
                            [gr.sinks for gr in grps], [kv.policy.window for kv in sessions],
                            [kv.rolling for kv in sessions], q_lens, page, base=grps[0].base)
        for b, (slots, k_pos) in enumerate(reads):
            got_pos, got_slots = block_slots(batch.block_table[b], *row_of(batch, b), page)
            assert torch.equal(got_pos, k_pos) and torch.equal(got_slots, slots)
        pools = (pool.k[layer], pool.v[layer]) if layer == 0 else (paged.k_pool, paged.v_pool)  # 4-d or flat
        out = batch_attention(q, *pools, batch, hd**-0.5, sliding, inv_freq(hd))
        assert rel_err(out, torch.cat(expected)) < 1e-5
    for kv in sessions:
        kv.abort()
        kv.release()
    pool.allocator.check()


def test_bad_inputs_raise_value_errors() -> None:
    case = make_case([Spec(20, 2, 2, 6, True), Spec(5, 1)], 4, 2, 16, 4, torch.float32, None, seed=1)
    q, kp, vp, b = case.q, case.k_pool, case.v_pool, case.batch
    f = inv_freq(16)
    with pytest.raises(ValueError, match="k_pool has shape"):
        batch_attention(q, kp.view(-1, 16), vp, b, 0.25, inv_freq=f)
    with pytest.raises(ValueError, match=r"k_pool has shape .*expected \[pages, 2, KVH, 16\]"):
        batch_attention(q, kp, vp, b._replace(page_size=2), 0.25, inv_freq=f)
    with pytest.raises(ValueError, match="page_size must be"):
        batch_attention(q, kp, vp, b._replace(page_size=0), 0.25, inv_freq=f)
    with pytest.raises(ValueError, match="q must have 3 dimensions"):
        batch_attention(q[0], kp, vp, b, 0.25, inv_freq=f)
    with pytest.raises(ValueError, match="k_pool has dtype"):
        batch_attention(q, kp.double(), vp, b, 0.25, inv_freq=f)
    with pytest.raises(ValueError, match="k_pool has shape"):
        batch_attention(torch.randn(3, 3, 16), kp, vp, b, 0.25, inv_freq=f)
    with pytest.raises(ValueError, match="v_pool has shape"):
        batch_attention(q, kp, vp[:-1], b, 0.25, inv_freq=f)
    with pytest.raises(ValueError, match="block_table has dtype"):
        batch_attention(q, kp, vp, b._replace(block_table=b.block_table.long()), 0.25, inv_freq=f)
    with pytest.raises(ValueError, match="kv_len has shape"):
        batch_attention(q, kp, vp, b._replace(kv_len=b.kv_len[:1]), 0.25, inv_freq=f)
    with pytest.raises(ValueError, match="first has dtype"):
        batch_attention(q, kp, vp, b._replace(first=b.first.float()), 0.25, inv_freq=f)
    with pytest.raises(ValueError, match="max_q must be"):
        batch_attention(q, kp, vp, b._replace(max_q=17), 0.25, inv_freq=f)
    with pytest.raises(ValueError, match=r"inv_freq must be a torch\.Tensor"):
        batch_attention(q, kp, vp, b, 0.25)
    with pytest.raises(ValueError, match="splits must be"):
        batch_attention(q, kp, vp, b, 0.25, inv_freq=f, splits=0)
    with pytest.raises(ValueError, match="block_n"):
        batch_attention(q, kp, vp, b, 0.25, inv_freq=f, block_n=24)
    table = {0: 0, 1: 1, 2: 2}
    with pytest.raises(ValueError, match="does not hold"):
        block_batch([table], [20], [0], [0], [None], [False], [1], 4)
    with pytest.raises(ValueError, match="over max_pages"):
        block_batch([table], [12], [0], [0], [None], [False], [1], 4, max_pages=2)
    with pytest.raises(ValueError, match="rolling sessions need"):
        block_batch([table], [12], [0], [0], [None], [True], [1], 4)
    with pytest.raises(ValueError, match="q_len 17"):
        block_batch([table], [12], [0], [0], [None], [False], [17], 4)
    with pytest.raises(ValueError, match="own queries"):
        block_batch([table], [12], [11], [0], [20], [False], [2], 4)
    with pytest.raises(ValueError, match="q_starts"):
        block_batch([table], [12], [0], [0], [None], [False], [1], 4, q_starts=[0, 1])
    with pytest.raises(ValueError, match="per-session lists"):
        block_batch([table], [12, 3], [0], [0], [None], [False], [1], 4)


AOT = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from streamserve.kernels import batch_attention as ba

ptrs = ["q", "k", "v", "bt", "kvlen", "first", "sinks", "window", "roll", "qstart", "qlen", "inv_freq", "o", "lse"]
types = ["*bf16"] * 3 + ["*i32"] * 4 + ["*i64"] + ["*i32"] * 3 + ["*fp32"] * 3
sig = {f"{p}_ptr": t for p, t in zip(ptrs, types, strict=True)}
sig.update(max_pages="i32", keys_per_split="i32", scale="fp32", rope_scaling="fp32", sliding="i32")
for rolling in (False, True):
    const = dict(KVH=2, G=2, HALF=32, PAGE=16, T=4, SPLITS=4, ROW_BLOCKS=1, BLOCK_M=16, BLOCK_HALF=32,
                 BLOCK_N=ba.BLOCK_N, ROLLING=rolling, PRECISION="tf32")
    k = triton.compile(ASTSource(ba._batch_attn_kernel, {**sig, **dict.fromkeys(const, "constexpr")}, const),
                       target=GPUTarget("cuda", 90, 32))
    assert k.asm["cubin"]
msig = {"o_ptr": "*fp32", "lse_ptr": "*fp32", "qstart_ptr": "*i32", "qlen_ptr": "*i32", "out_ptr": "*bf16"}
const = dict(KVH=2, G=2, HD=64, T=4, SPLITS=4, ROW_BLOCKS=1, BLOCK_R=8, BLOCK_S=4, BLOCK_D=64)
m = triton.compile(ASTSource(ba._merge_kernel, {**msig, **dict.fromkeys(const, "constexpr")}, const),
                   target=GPUTarget("cuda", 90, 32))
assert m.asm["cubin"]
print("compiled")
"""


@pytest.mark.slow
def test_kernels_compile_for_sm90_without_a_gpu() -> None:
    """The interpreter does not type-check like the compiler (a runtime `if` on the rolling flag yields tensors):
    build both kernels for an sm_90 target with Triton's NVIDIA backend (ptxas ships with Triton; no device)."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    done = subprocess.run([sys.executable, "-c", AOT], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and "compiled" in done.stdout, done.stderr[-3000:]
