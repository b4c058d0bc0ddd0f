"""The prepared GPU check: every Triton kernel against its reference on the device, then timings.

    python benchmarks/gpu_check.py                  # on a CUDA machine; about 3 minutes on one H200
    python benchmarks/gpu_check.py --write-configs  # also tune moe_gemv blocks and the gemv/grouped crossover
    python benchmarks/gpu_check.py --smoke          # tiny shapes on a CPU (Triton interpreter): checks the script

1. Correctness on the device (relative error to a float64 reference): moe_gemv (bf16, int8), decode
   attention (absolute, window + sinks, rolling), append attention.
2. MoE at T = 1, 2, 4, 8 for Qwen3-30B-A3B shapes (E 128, top-8, D 2048, I 768) and Mixtral shapes
   (E 8, top-2, D 4096, I 14336), bf16: moe_gemv vs the torch grouped path vs the torch gather path, as
   GB/s of expert weights read and as a fraction of the measured device-to-device copy bandwidth
   (target >= 0.70 at T = 1).
3. Decode attention GB/s (keys + values read) at 1k / 8k / 32k windows, bf16, 32 query / 4 KV heads, hd 128.
4. End to end: decode tokens/s of a random Qwen3-30B-A3B-shaped model cut to 8 layers (the full 48
   layers do not change per-layer figures and would take most of the time budget to build):
   kernels="triton" with and without CUDA graphs, and kernels="torch", at batch 1 (one session) and
   batch 2, 4, 8 (sessions decoding in the same engine steps; aggregate tokens/s).
Prints a table and one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:  # the interpreter must be chosen before triton compiles anything
    os.environ.setdefault("TRITON_INTERPRET", "1")

from streamserve.kernels import reference as ref  # noqa: E402
from streamserve.kernels.append_attention import append_attention  # noqa: E402
from streamserve.kernels.decode_attention import decode_attention  # noqa: E402
from streamserve.kernels.moe_gemv import moe_gemv, quantize_int8  # noqa: E402

MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}  # E, k, D, I
SMOKE_MOE = {"tiny": (8, 2, 64, 48)}
# relative error allowed, by the last word of a check's name (bf16 / int8 ones vs fp32 ones)
TOLERANCE = {"bf16": 3e-2, "int8": 3e-2, "attention": 1e-4, "window": 1e-4, "rolling": 1e-4}


def timeit(fn, reps: int, device: torch.device) -> float:
    """Median seconds per call."""
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


def copy_bandwidth(device: torch.device, reps: int) -> float:
    """Device-to-device copy GB/s (bytes read + written) of a 1 GiB buffer (4 MiB in smoke mode)."""
    n = (4 << 20) if SMOKE else (1 << 30)
    a = torch.empty(n, dtype=torch.uint8, device=device)
    b = torch.empty_like(a)
    return 2 * n / timeit(lambda: b.copy_(a), reps, device) / 1e9


def check_correctness(device: torch.device) -> dict[str, float]:
    g = torch.Generator().manual_seed(0)
    out: dict[str, float] = {}
    E, k, D, inter = 64, 8, 257, 100
    x = torch.randn(3, D, generator=g)
    w_gu, w_d = torch.randn(E, 2 * inter, D, generator=g) / D**0.5, torch.randn(E, D, inter, generator=g) / inter**0.5
    weights, ids = ref.moe_route(torch.randn(3, E, generator=g), k, True)
    exp = ref.moe_experts_gather(x.double(), weights.double(), ids, w_gu.double(), w_d.double())
    dev = {n: t.to(device) for n, t in dict(x=x, w=weights, ids=ids, gu=w_gu, d=w_d).items()}
    out["moe_gemv_bf16"] = rel(moe_gemv(dev["x"].bfloat16(), dev["w"], dev["ids"], dev["gu"].bfloat16(),
                                        dev["d"].bfloat16()).cpu(), exp)
    (q_gu, s_gu), (q_d, s_d) = quantize_int8(dev["gu"]), quantize_int8(dev["d"])
    out["moe_gemv_int8"] = rel(moe_gemv(dev["x"], dev["w"], dev["ids"], q_gu, q_d, scale_gate_up=s_gu,
                                        scale_down=s_d).cpu(), exp)
    S, H, KVH, hd, P = 1025, 8, 2, 128, 16
    k_pool, v_pool = torch.randn(S + P, KVH, hd, generator=g), torch.randn(S + P, KVH, hd, generator=g)
    for name, sinks, window, dt in (("decode_attention", 0, None, torch.float32),
                                    ("decode_attention_window", 4, 256, torch.float32),
                                    ("decode_attention_bf16", 4, 256, torch.bfloat16)):
        first = 0 if window is None else max(sinks, S - window)
        k_pos = torch.cat([torch.arange(min(sinks, first)), torch.arange(first, S)])
        q = torch.randn(H, hd, generator=g)
        exp = ref.attention(q[None].double(), k_pool[k_pos].transpose(0, 1).double(),
                            v_pool[k_pos].transpose(0, 1).double(), torch.tensor([S - 1]), k_pos, hd**-0.5, None,
                            sinks, window)[0]
        got = decode_attention(q.to(device, dt), k_pool.to(device, dt), v_pool.to(device, dt), k_pos.to(device),
                               k_pos.to(device), torch.tensor([S - 1], device=device), hd**-0.5, None, sinks, window)
        out[name] = rel(got.cpu(), exp)
    from streamserve.kernels.triton_backend import paged_attention_rolling

    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    T = 7
    q_pos = torch.arange(S - T, S)
    k_pos = torch.cat([torch.arange(4), torch.arange(S - T - 255, S)])
    q = torch.randn(T, H, hd, generator=g)
    rope = ref.rolling_rope(q_pos, k_pos, inv, 1.0, 4, 256, torch.float64)
    exp = ref.attention_rolling(q.double(), k_pool[k_pos].transpose(0, 1).double(),
                                v_pool[k_pos].transpose(0, 1).double(), q_pos, k_pos, rope, hd**-0.5, 4, 256)
    rope_d = ref.rolling_rope(q_pos.to(device), k_pos.to(device), inv.to(device), 1.0, 4, 256, torch.float32)
    paged = ref.PagedKeys(k_pool.to(device), v_pool.to(device), k_pos.to(device), k_pos.to(device))
    out["append_attention_rolling"] = rel(
        paged_attention_rolling(q.to(device), paged, q_pos.to(device), rope_d, hd**-0.5, 4, 256).cpu(), exp)
    q_abs = q.to(device)
    got = append_attention(q_abs, paged.k_pool, paged.v_pool, paged.slots, paged.k_pos, q_pos.to(device), hd**-0.5)
    exp = ref.attention(q.double(), k_pool[k_pos].transpose(0, 1).double(), v_pool[k_pos].transpose(0, 1).double(),
                        q_pos, k_pos, hd**-0.5)
    out["append_attention"] = rel(got.cpu(), exp)
    return out


def bench_moe(device: torch.device, copy_gbs: float, reps: int, shapes: dict) -> dict:
    res = {}
    for name, (E, k, D, inter) in shapes.items():
        g = torch.Generator(device=device).manual_seed(0)
        w_gu = torch.randn(E, 2 * inter, D, generator=g, device=device, dtype=torch.bfloat16) * 0.02
        w_d = torch.randn(E, D, inter, generator=g, device=device, dtype=torch.bfloat16) * 0.02
        for t in (1, 2, 4, 8):
            x = torch.randn(t, D, generator=g, device=device, dtype=torch.bfloat16)
            weights, ids = ref.moe_route(torch.randn(t, E, generator=g, device=device), k, True)
            read = ids.unique().numel() * 3 * D * inter * 2  # bytes of the experts these tokens use
            row = {}
            for path, fn in (("moe_gemv", moe_gemv), ("grouped", ref.moe_experts_grouped),
                             ("gather", ref.moe_experts_gather)):
                s = timeit(partial(fn, x, weights, ids, w_gu, w_d), reps, device)
                row[f"{path}_us"] = round(1e6 * s, 1)
                row[f"{path}_gbs"] = round(read / s / 1e9, 1)
            row["moe_gemv_of_copy_bw"] = round(row["moe_gemv_gbs"] / copy_gbs, 3)
            res[f"{name}_T{t}"] = row
            print(f"moe {name} T={t}: {row}", file=sys.stderr)
    return res


def bench_attention(device: torch.device, reps: int, windows: tuple[int, ...]) -> dict:
    H, KVH, hd = 32, 4, 128
    res = {}
    for w in windows:
        g = torch.Generator(device=device).manual_seed(w)
        k_pool = torch.randn(w + 16, KVH, hd, generator=g, device=device, dtype=torch.bfloat16)
        v_pool = torch.randn_like(k_pool)
        slots = torch.randperm(w + 16, generator=g, device=device)[:w]
        k_pos = torch.arange(w, device=device)
        q = torch.randn(H, hd, generator=g, device=device, dtype=torch.bfloat16)
        s = timeit(partial(decode_attention, q, k_pool, v_pool, slots, k_pos, k_pos[-1:], hd**-0.5), reps, device)
        res[str(w)] = {"us": round(1e6 * s, 1), "gbs": round(2 * w * KVH * hd * 2 / s / 1e9, 1)}
        print(f"decode attention window {w}: {res[str(w)]}", file=sys.stderr)
    return res


def bench_end_to_end(device: torch.device, layers: int, new: int) -> dict:
    from streamserve import Engine
    from streamserve.tools.random_checkpoint import make_random_checkpoint

    shape = dict(vocab_size=151936, hidden_size=2048, num_hidden_layers=layers, num_attention_heads=32,
                 num_key_value_heads=4, head_dim=128, num_experts=128, num_experts_per_tok=8,
                 moe_intermediate_size=768, norm_topk_prob=True, intermediate_size=6144,
                 max_position_embeddings=4096, initializer_range=0.02)
    if SMOKE:
        shape.update(vocab_size=512, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                     num_experts=8, moe_intermediate_size=32, intermediate_size=64)
    res: dict = {"layers": layers}
    tokens: dict[str, list] = {}
    with tempfile.TemporaryDirectory() as tmp:
        make_random_checkpoint(Path(tmp), "qwen3_moe", **shape)
        for label, kernels, graphs in (("triton_graphs", "triton", "on"), ("triton", "triton", "off"),
                                       ("torch", "torch", "off")):
            engine = Engine.from_pretrained(tmp, device=device, dtype="bfloat16", kernels=kernels, cuda_graphs=graphs,
                                            kv_memory="64MiB" if SMOKE else "2GiB")
            for batch in BATCHES:
                tok_s, tokens[f"{label}_b{batch}"] = batched_decode(engine, batch, new)
                key = f"{label}_decode_tok_s" if batch == 1 else f"{label}_b{batch}_decode_tok_s"
                res[key] = round(tok_s, 1)
            engine.shutdown()
            del engine
    res["triton_over_torch"] = round(res["triton_decode_tok_s"] / res["torch_decode_tok_s"], 2)
    res["graphs_over_eager"] = round(res["triton_graphs_decode_tok_s"] / res["triton_decode_tok_s"], 2)
    for b in BATCHES[1:]:
        res[f"graphs_over_eager_b{b}"] = round(res[f"triton_graphs_b{b}_decode_tok_s"] /
                                                res[f"triton_b{b}_decode_tok_s"], 2)
    # must hold: same kernels, with and without graphs, at every batch size
    res["graphs_tokens_equal_eager"] = all(tokens[f"triton_graphs_b{b}"] == tokens[f"triton_b{b}"]
                                           for b in BATCHES)
    res["triton_tokens_equal_torch"] = tokens["triton_b1"] == tokens["torch_b1"]  # bf16 rounding may differ
    print(f"end to end: {res}", file=sys.stderr)
    return res


BATCHES = (1, 2) if SMOKE else (1, 2, 4, 8)  # the interpreter is slow: the smoke run checks two sizes


def batched_decode(engine, batch: int, new: int) -> tuple[float, list[list[int]]]:
    """`batch` sessions (128-token prompts) decode `new` tokens each in the same engine steps;
    -> aggregate tokens/s and each session's tokens."""
    sessions = [engine.open_session() for _ in range(batch)]
    for i, s in enumerate(sessions):
        s.append(token_ids=[(7 * i + j) % 1000 + 1 for j in range(128)])

    def together(n: int) -> list:
        with engine.guard:  # every reply queued before the first step: they decode batched throughout
            streams = [s.stream(max_tokens=n, stop_token_ids=()) for s in sessions]
        for st in streams:
            st.wait()
        return streams

    together(4)  # warm-up: compiles, and captures this batch size's graphs
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    streams = together(new)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    for s in sessions:
        s.close()
    return batch * new / seconds, [st.token_ids for st in streams]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU under the Triton interpreter")
    p.add_argument("--write-configs", action="store_true", help="sweep moe_gemv blocks and write launch.json")
    p.add_argument("--reps", type=int, default=20)
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA device; run with --smoke to check the script on a CPU")
    device = torch.device("cpu" if args.smoke else "cuda")
    reps = 2 if args.smoke else args.reps
    t0 = time.perf_counter()
    res: dict = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(device),
                 "torch": torch.__version__}
    res["correctness_rel_err"] = check_correctness(device)
    print(f"correctness: {res['correctness_rel_err']}", file=sys.stderr)
    res["copy_gbs"] = round(copy_bandwidth(device, reps), 1)
    res["moe"] = bench_moe(device, res["copy_gbs"], reps, SMOKE_MOE if args.smoke else MOE_SHAPES)
    res["decode_attention"] = bench_attention(device, reps, (64,) if args.smoke else (1024, 8192, 32768))
    res["end_to_end"] = bench_end_to_end(device, 2 if args.smoke else 8, 4 if args.smoke else 64)
    if args.write_configs:
        res["tuned"] = write_configs(device, reps)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    failed = [k for k, v in res["correctness_rel_err"].items() if not v < TOLERANCE[k.split("_")[-1]]]
    if not res["end_to_end"]["graphs_tokens_equal_eager"]:
        failed.append("graphs_tokens_equal_eager")
    res["failed_checks"] = failed
    print(json.dumps(res))
    if failed:
        sys.exit(f"gpu_check: failed checks: {failed}")


def write_configs(device: torch.device, reps: int) -> dict:
    """Measure the moe_gemv / grouped crossover and sweep moe_gemv block sizes at T = 1 for each MoE shape;
    write both into launch.json."""
    from streamserve.kernels import launch_config as lc

    table = json.loads(lc.CONFIG_FILE.read_text())
    per_device = table["moe_gemv"].setdefault(lc.device_name(device), {}).setdefault("bfloat16", {})
    chosen: dict = {}
    # the crossover: the most tokens for which moe_gemv still beats the grouped path on every MoE shape
    crossover = 16
    for E, k, D, inter in (SMOKE_MOE if SMOKE else MOE_SHAPES).values():
        w_gu = torch.randn(E, 2 * inter, D, device=device, dtype=torch.bfloat16) * 0.02
        w_d = torch.randn(E, D, inter, device=device, dtype=torch.bfloat16) * 0.02
        for t in (1, 2, 4, 8, 16):
            x = torch.randn(t, D, device=device, dtype=torch.bfloat16)
            weights, ids = ref.moe_route(torch.randn(t, E, device=device), k, True)
            gemv = timeit(partial(moe_gemv, x, weights, ids, w_gu, w_d), reps, device)
            grouped = timeit(partial(ref.moe_experts_grouped, x, weights, ids, w_gu, w_d), reps, device)
            if gemv > grouped:  # the last width where gemv won (0: never)
                crossover = min(crossover, t // 2)
                break
    table["moe_dispatch"].setdefault(lc.device_name(device), {})["bfloat16"] = {"any": {"gemv_max_tokens": crossover}}
    chosen["gemv_max_tokens"] = crossover
    for name, (E, k, D, inter) in (SMOKE_MOE if SMOKE else MOE_SHAPES).items():
        w_gu = torch.randn(E, 2 * inter, D, device=device, dtype=torch.bfloat16) * 0.02
        w_d = torch.randn(E, D, inter, device=device, dtype=torch.bfloat16) * 0.02
        x = torch.randn(1, D, device=device, dtype=torch.bfloat16)
        weights, ids = ref.moe_route(torch.randn(1, E, device=device), k, True)
        best = min((timeit(partial(moe_gemv, x, weights, ids, w_gu, w_d, block_i=bi, block_d=bd), reps, device), bi, bd)
                   for bi in (16, 32, 64) for bd in (64, 128, 256))
        per_device[f"D{D}_I{inter}"] = {"block_i": best[1], "block_d": best[2]}
        chosen[name] = per_device[f"D{D}_I{inter}"]
    # a smoke run checks the writing without touching the shipped table
    target = Path(tempfile.gettempdir()) / "launch.smoke.json" if SMOKE else lc.CONFIG_FILE
    target.write_text(json.dumps(table, indent=2) + "\n")
    return {**chosen, "written_to": str(target)}


if __name__ == "__main__":
    main()
