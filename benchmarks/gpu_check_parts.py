"""Sections of `gpu_check.py` for the quantized GEMV, the batched attention launch and the batched sampler.

Each function runs on `device` (CUDA, or the CPU under Triton's interpreter in smoke mode, with tiny shapes) and
returns a JSON-ready dict; `gpu_check.py` prints them in its last line. Imported after `gpu_check.py` has chosen
the interpreter (TRITON_INTERPRET=1) in smoke mode.
"""

from __future__ import annotations

import itertools
import statistics
import sys
import time
from collections.abc import Callable
from functools import partial
from typing import NamedTuple

import torch

from streamserve.kernels import reference as ref
from streamserve.kernels.batch_attention import BlockBatch, batch_attention, batch_attention_reference, block_batch
from streamserve.kernels.batch_attention import block_slots as session_slots
from streamserve.kernels.moe_gemv import moe_gemv
from streamserve.kernels.quant_gemv import DEFAULT_CONFIG, quant_linear, quant_linear_reference

SMOKE = "--smoke" in sys.argv
# weights cycled through by the bandwidth timings so that no call finds its weights in L2 (about 50 MiB on an
# H100/H200): each copy is read again only after this many other bytes
ROTATE_BYTES = 0 if SMOKE else 512 << 20
INT4_GROUP = 32
# [N, K] (out, in) of dense projections: SmolLM2-1.7B (hidden 2048, MLP 8192) and a 7B Llama (4096, 11008)
DENSE_SHAPES = {"smollm2-1.7b_qo": (2048, 2048), "smollm2-1.7b_up": (8192, 2048), "smollm2-1.7b_down": (2048, 8192),
                "7b_qo": (4096, 4096), "7b_up": (11008, 4096), "7b_down": (4096, 11008)}
SMOKE_DENSE = {"tiny": (48, 128)}
# (block_n, block_k, split_k) tried per shape by --write-configs (split_k 0: the launcher's choice from the SMs)
QUANT_SWEEP = [(bn, bk, sk) for bn, bk in ((16, 256), (32, 128), (32, 256), (64, 128), (64, 64), (128, 64))
               for sk in (0, 1, 4)]
SMOKE_SWEEP = [(16, 64, 0), (32, 32, 2)]


def timeit(fn: Callable[[], object], reps: int, device: torch.device) -> float:
    """Median seconds per call (CUDA events on a GPU: launch gaps count, as they do in a step)."""
    fn()
    times = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize()
            times.append(start.elapsed_time(end) / 1e3)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def rel(out: torch.Tensor, expected: torch.Tensor) -> float:
    return float((out.double() - expected.double()).norm() / expected.double().norm())


def quant_weights(bits: int, n: int, k: int, device: torch.device, seed: int) -> tuple:
    """Random codes in quant_gemv's storage format -> (qweight, scale, zero, group): int8 [N, K] with one scale
    per output channel (group K), or packed int4 uint8 [N, K / 2] with scale and zero per 32 columns."""
    g = torch.Generator(device=device).manual_seed(seed)
    if bits == 8:
        q = torch.randint(-127, 128, (n, k), generator=g, device=device, dtype=torch.int8)
        scale = (torch.rand(n, 1, generator=g, device=device) + 0.5) / (100 * k**0.5)
        return q, scale, None, k
    q = torch.randint(0, 256, (n, k // 2), generator=g, device=device, dtype=torch.int16).to(torch.uint8)
    scale = (torch.rand(n, k // INT4_GROUP, generator=g, device=device) + 0.5) / (8 * k**0.5)
    zero = torch.randn(n, k // INT4_GROUP, generator=g, device=device) / (4 * k**0.5)
    return q, scale, zero, INT4_GROUP


def check_quant_gemv(device: torch.device) -> dict[str, float]:
    """quant_linear on bf16 rows (M = 1, 4, 16) against quant_linear_reference in float64 ("int8": per channel,
    "int4": groups of 32), on an odd N so the last output block is partial."""
    n, k = (33, 128) if SMOKE else (1000, 4096)
    out: dict[str, float] = {}
    for bits in (8, 4):
        q, scale, zero, group = quant_weights(bits, n, k, device, seed=bits)
        for m in (1, 4, 16):
            x = torch.randn(m, k, generator=torch.Generator(device=device).manual_seed(m), device=device).bfloat16()
            expected = quant_linear_reference(x.double(), q, scale, zero, group)  # float64 products of the same x
            got = quant_linear(x, q, scale, zero, group)
            out[f"quant_gemv_int{bits}_m{m}_bf16"] = rel(got, expected)
    return out


class Spec(NamedTuple):
    kv_len: int  # keys after the step (its own included)
    q_len: int  # the step's queries
    sinks: int = 0
    window: int | None = None
    rolling: bool = False


# a mixed decode / verify batch: absolute and rolling, windows with sinks, lengths 1 .. 10^6
MIXED = [Spec(1, 1), Spec(37, 1), Spec(3000, 1, 4, 1024, True), Spec(3000, 1, 4, 512), Spec(2500, 1),
         Spec(1500, 4, 4, 256, True), Spec(10**6 + 7, 1, 4, 256, True), Spec(777, 8)]
SMOKE_MIXED = [Spec(1, 1), Spec(40, 1, 4, 16, True), Spec(120, 1, 2, 32), Spec(90, 1), Spec(10**6 + 7, 1, 4, 16, True),
               Spec(60, 4, 4, 24, True)]


class Paged(NamedTuple):
    q: torch.Tensor  # [N, H, hd]
    k_pool: torch.Tensor  # [pages, P, KVH, hd]
    v_pool: torch.Tensor
    batch: BlockBatch
    reads: list[tuple[torch.Tensor, torch.Tensor]]  # per session (k_pos [S], flat slots [S]), sinks first


def paged_sessions(specs: list[Spec], h: int, kvh: int, hd: int, page: int, dtype: torch.dtype,
                   device: torch.device, seed: int) -> Paged:
    """Sessions whose kept pages sit at shuffled rows of one pool, their block tables built as the engine's
    `GroupKV` tables are (sink pages, then the window's), one query row block per session."""
    g = torch.Generator(device=device).manual_seed(seed)
    firsts, sinks, wanted = [], [], []
    for s in specs:
        start = s.kv_len - s.q_len
        first = min(s.kv_len, 0 if s.window is None else max(s.sinks, start - s.window + 1))
        sink = s.sinks if s.window is not None else 0
        n_sink = min(sink, first)
        firsts.append(first)
        sinks.append(sink)
        wanted.append([*range(-(-n_sink // page)), *range(first // page, -(-s.kv_len // page))])
    order = torch.randperm(sum(map(len, wanted)), generator=torch.Generator().manual_seed(seed)).tolist()
    tables, at = [], 0
    for w in wanted:
        tables.append({j: order[at + i] for i, j in enumerate(w)})
        at += len(w)
    k_pool = torch.randn(len(order), page, kvh, hd, generator=g, device=device, dtype=dtype)
    v_pool = torch.randn(len(order), page, kvh, hd, generator=g, device=device, dtype=dtype)
    q = torch.randn(sum(s.q_len for s in specs), h, hd, generator=g, device=device, dtype=dtype)
    batch = block_batch(tables, [s.kv_len for s in specs], firsts, sinks, [s.window for s in specs],
                        [s.rolling for s in specs], [s.q_len for s in specs], page, device=device)
    reads = [session_slots(batch.block_table[b], s.kv_len, firsts[b], sinks[b], page) for b, s in enumerate(specs)]
    return Paged(q, k_pool, v_pool, batch, reads)


def inv_freq(hd: int, device: torch.device) -> torch.Tensor:
    return 1.0 / (10000 ** (torch.arange(0, hd, 2, device=device).float() / hd))


def check_batch_attention(device: torch.device) -> dict[str, float]:
    """One batch_attention launch over MIXED against batch_attention_reference (fp32 inputs), page sizes 1 and
    16, bf16 and fp32."""
    h, kvh, hd = (4, 2, 32) if SMOKE else (32, 8, 128)
    out: dict[str, float] = {}
    for page in (1, 16):
        for dtype, label in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
            c = paged_sessions(SMOKE_MIXED if SMOKE else MIXED, h, kvh, hd, page, dtype, device, seed=page)
            freq = inv_freq(hd, device)
            expected = batch_attention_reference(c.q.float(), c.k_pool.float(), c.v_pool.float(), c.batch, hd**-0.5,
                                                 inv_freq=freq)
            got = batch_attention(c.q, c.k_pool, c.v_pool, c.batch, hd**-0.5, inv_freq=freq)
            out[f"batch_attention_p{page}_{label}"] = rel(got, expected)
    return out


def check_sampler(device: torch.device) -> dict[str, bool | str]:
    """The counter-based race noise on the device equals the CPU's bit for bit; sample_rows draws the CPU's tokens
    and, on CUDA, queues its rows without one host synchronisation (sync debug mode "error")."""
    from streamserve.engine.sampling import sample_rows

    vocab, rows = (4096, 8) if SMOKE else (151936, 16)
    gen = torch.Generator().manual_seed(1)
    seeds = torch.randint(0, 1 << 62, (rows,), generator=gen)
    seeds[:2] = torch.tensor([0, (1 << 63) - 1])
    positions = torch.randint(0, 1 << 40, (rows,), generator=gen)
    res: dict[str, bool | str] = {"noise_equal": torch.equal(ref.race_noise(seeds, positions, 3, vocab, device).cpu(),
                                                             ref.race_noise(seeds, positions, 3, vocab))}
    logits = torch.randn(rows, vocab, generator=gen) * 4
    temps = [[0.0, 0.7, 1.0, 1.3][i % 4] for i in range(rows)]
    args = (temps, [[1.0, 0.95, 0.5][i % 3] for i in range(rows)], [[0, 50, 1][i % 3] for i in range(rows)],
            seeds.tolist(), positions.tolist())
    on_dev = logits.to(device)
    if device.type == "cuda":
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            drawn = sample_rows(on_dev, *args)
            res["sync_free"] = True
        except RuntimeError as e:  # a synchronising call raised: name it, then draw again to compare tokens
            res["sync_free"] = False
            res["sync_error"] = str(e)[:300]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        if not res["sync_free"]:
            drawn = sample_rows(on_dev, *args)
    else:
        drawn = sample_rows(on_dev, *args)
        res["sync_free"] = "not checked (no CUDA device)"
    res["tokens_equal"] = drawn.tolist() == sample_rows(logits, *args).tolist()
    return res


def _rotating(make: Callable[[int], tuple], nbytes: int) -> list[tuple]:
    """Enough copies of a call's weights (`make(seed)`) that cycling through them reads ROTATE_BYTES between two
    uses of one copy."""
    return [make(i) for i in range(max(1, -(-ROTATE_BYTES // max(1, nbytes))))]


def _cycled(fn: Callable, copies: list[tuple], x: torch.Tensor) -> Callable[[], object]:
    it = itertools.cycle(copies)
    return lambda: fn(x, *next(it))


def bench_quant_gemv(device: torch.device, copy_gbs: float, reps: int) -> dict:
    """M = 1 dense projections: int8 (per channel) and int4 (group 32) quant_linear vs a bf16 matmul, as GB/s of
    weight bytes read (codes + scales (+ zeros)) and as a fraction of the device-to-device copy rate."""
    res = {}
    for name, (n, k) in (SMOKE_DENSE if SMOKE else DENSE_SHAPES).items():
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        row: dict[str, float] = {}
        for label in ("int8", "int4", "bf16"):
            if label == "bf16":  # w [N, K] as nn.Linear stores it; x @ w.T
                nbytes = n * k * 2
                copies = _rotating(lambda i, n=n, k=k: (torch.randn(n, k, device=device, dtype=torch.bfloat16),),
                                   nbytes)
                fn = _cycled(lambda x, w: torch.matmul(x, w.T), copies, x)
            else:  # codes + fp32 scales (+ fp32 zeros for int4)
                bits = int(label[3:])
                nbytes = n * k + n * 4 if bits == 8 else n * k // 2 + 2 * n * (k // INT4_GROUP) * 4
                copies = _rotating(lambda i, bits=bits, n=n, k=k: quant_weights(bits, n, k, device, i), nbytes)
                fn = _cycled(quant_linear, copies, x)
            s = timeit(fn, reps, device)
            row[f"{label}_us"] = round(1e6 * s, 1)
            row[f"{label}_gbs"] = round(nbytes / s / 1e9, 1)
            row[f"{label}_of_copy_bw"] = round(nbytes / s / 1e9 / copy_gbs, 3)
            del copies, fn
        row["int8_speedup_over_bf16"] = round(row["bf16_us"] / row["int8_us"], 2)
        row["int4_speedup_over_bf16"] = round(row["bf16_us"] / row["int4_us"], 2)
        res[f"{name}_N{n}_K{k}"] = row
        print(f"quant gemv {name} [{n}, {k}] M=1: {row}", file=sys.stderr)
    return res


def bench_moe_int8(device: torch.device, copy_gbs: float, reps: int, shapes: dict) -> dict:
    """moe_gemv on int8 experts (per-channel fp32 scales) at T = 1 and 8: GB/s of the used experts' codes +
    scales and the fraction of the copy rate."""
    res = {}
    for name, (e, top, d, inter) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        w_gu = torch.randint(-127, 128, (e, 2 * inter, d), generator=g, device=device, dtype=torch.int8)
        w_d = torch.randint(-127, 128, (e, d, inter), generator=g, device=device, dtype=torch.int8)
        s_gu = torch.rand(e, 2 * inter, generator=g, device=device) / (100 * d**0.5)
        s_d = torch.rand(e, d, generator=g, device=device) / (100 * inter**0.5)
        for t in (1, 8):
            x = torch.randn(t, d, generator=g, device=device, dtype=torch.bfloat16)
            weights, ids = ref.moe_route(torch.randn(t, e, generator=g, device=device), top, True)
            read = ids.unique().numel() * (3 * d * inter + (2 * inter + d) * 4)  # int8 codes + fp32 scales
            s = timeit(partial(moe_gemv, x, weights, ids, w_gu, w_d, scale_gate_up=s_gu, scale_down=s_d), reps, device)
            gbs = read / s / 1e9
            res[f"{name}_T{t}"] = {"us": round(1e6 * s, 1), "gbs": round(gbs, 1),
                                   "of_copy_bw": round(gbs / copy_gbs, 3)}
            print(f"moe int8 {name} T={t}: {res[f'{name}_T{t}']}", file=sys.stderr)
        del w_gu, w_d
    return res


def bench_batch_attention(device: torch.device, reps: int) -> dict:
    """Decode (one query per session, absolute positions, bf16, 32 q / 8 KV heads, hd 128, pages of 16) for B
    sessions of 1k..8k keys: one batch_attention launch vs B launches of the per-session Triton decode kernel
    (`triton_backend.paged_attention`, what the engine runs per session today); per layer. (B = 1's 4k keys,
    16 MiB, stay in L2 between repetitions: its GB/s is an upper bound.)"""
    from streamserve.kernels.triton_backend import paged_attention

    h, kvh, hd, page = (4, 2, 32, 16) if SMOKE else (32, 8, 128, 16)
    lo, hi = (16, 80) if SMOKE else (1024, 8192)
    res = {}
    for b in (1, 2) if SMOKE else (1, 8, 32, 64):
        lens = [lo + (hi - lo) * i // (b - 1) for i in range(b)] if b > 1 else [hi // 2]
        c = paged_sessions([Spec(n, 1) for n in lens], h, kvh, hd, page, torch.bfloat16, device, seed=b)
        kf, vf = c.k_pool.view(-1, kvh, hd), c.v_pool.view(-1, kvh, hd)
        per = [(ref.PagedKeys(kf, vf, slots, k_pos), k_pos[-1:]) for k_pos, slots in c.reads]

        def loop(c: Paged = c, per: list = per) -> torch.Tensor:
            return torch.cat([paged_attention(c.q[i:i + 1], keys, q_pos, hd**-0.5) for i, (keys, q_pos) in
                              enumerate(per)])

        one = partial(batch_attention, c.q, c.k_pool, c.v_pool, c.batch, hd**-0.5)
        t_one, t_loop = timeit(one, reps, device), timeit(loop, reps, device)
        read = sum(lens) * kvh * hd * 2 * 2  # keys + values, bf16
        res[f"B{b}"] = {"keys": sum(lens), "batched_us": round(1e6 * t_one, 1),
                        "per_session_us": round(1e6 * t_loop, 1), "per_session_over_batched": round(t_loop / t_one, 2),
                        "batched_gbs": round(read / t_one / 1e9, 1), "rel_err_vs_per_session": rel(one(), loop())}
        print(f"batch attention B={b}: {res[f'B{b}']}", file=sys.stderr)
        del c, per, kf, vf
    return res


def tune_quant_gemv(device: torch.device, reps: int, table: dict, device_key: str) -> dict:
    """Time QUANT_SWEEP's launch configs at M = 1 (bf16 rows) for each dense shape, int8 and int4; write the
    fastest into `table` (launch.json's dict) under quant_gemv / device / bfloat16 / quant_gemv's shape key."""
    entry = table.setdefault("quant_gemv", {"default": dict(DEFAULT_CONFIG)})
    per_device = entry.setdefault(device_key, {}).setdefault("bfloat16", {})
    chosen = {}
    for n, k in (SMOKE_DENSE if SMOKE else DENSE_SHAPES).values():
        x = torch.randn(1, k, device=device, dtype=torch.bfloat16)
        for bits in (8, 4):
            q, scale, zero, group = quant_weights(bits, n, k, device, seed=0)
            expected = quant_linear_reference(x.float(), q, scale, zero, group)
            timed = []
            for bn, bk, sk in SMOKE_SWEEP if SMOKE else QUANT_SWEEP:
                call = partial(quant_linear, x, q, scale, zero, group, block_n=bn, block_k=bk, split_k=sk)
                if rel(call(), expected) > 3e-2:  # a config that computes the wrong thing is never chosen
                    continue
                timed.append((timeit(call, reps, device), bn, bk, sk))
            best = min(timed)
            key = f"N{n}_K{k}_b{bits}_g{'K' if group == k else group}"  # quant_linear's launch_config key
            per_device[key] = {"block_n": best[1], "block_k": best[2], "split_k": best[3]}
            chosen[key] = {**per_device[key], "us": round(1e6 * best[0], 1)}
            del q, scale, zero
    return chosen
