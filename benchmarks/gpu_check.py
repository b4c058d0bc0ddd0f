"""The prepared GPU check: every Triton kernel against its reference on the device, then timings.

    python benchmarks/gpu_check.py                  # on a CUDA machine; about 6 minutes on one H200
    python benchmarks/gpu_check.py --write-configs  # also tune launch configs (about 1.5 minutes more)
    python benchmarks/gpu_check.py --smoke          # tiny shapes on a CPU (Triton interpreter): checks the script
    python benchmarks/gpu_check.py --sections correctness,quant_gemv   # a rerun of some sections only
    python benchmarks/gpu_check.py --json-out $OUT/gpu_check.json     # results kept after every section

Sections (estimated H200 seconds, Triton compiles included; each section's measured time is in the JSON's
"section_seconds", and a section that raises is recorded in "errors" and "failed_checks" while the rest run):
1. correctness (~20 s): relative error to a float64 / fp32 reference on the device: moe_gemv (bf16, int8),
   decode attention (absolute, window + sinks, rolling), append attention. correctness_quant_gemv (~10 s):
   quant_linear (int8 per channel, int4 group 32; M = 1, 4, 16, bf16 rows) against quant_linear_reference in
   float64. correctness_batch_attention (~10 s): one batch_attention launch over a mixed batch (absolute +
   rolling, windows + sinks, 1..10^6 positions, 1..8 queries; pages of 1 and 16; bf16, fp32) against
   batch_attention_reference. sampler (~5 s): the race noise on CUDA equals the CPU's bit for bit, sample_rows
   draws the CPU's tokens, and queues its rows with no host sync (sync debug mode "error").
2. moe (~30 s): MoE at T = 1, 2, 4, 8 for Qwen3-30B-A3B shapes (E 128, top-8, D 2048, I 768) and Mixtral shapes
   (E 8, top-2, D 4096, I 14336), bf16: moe_gemv vs the torch grouped path vs the torch gather path, as
   GB/s of expert weights read and as a fraction of the measured device-to-device copy bandwidth
   (target >= 0.70 at T = 1); moe_int8: moe_gemv on int8 experts + scales at T = 1, 8, likewise.
3. quant_gemv (~25 s): M = 1 dense projections of SmolLM2-1.7B ([2048, 2048], [8192, 2048], [2048, 8192]) and
   a 7B Llama ([4096, 4096], [11008, 4096], [4096, 11008]): int8 and int4 quant_linear vs a bf16 matmul, GB/s
   of weight bytes (codes + scales) and fraction of the copy bandwidth (weights cycled so L2 holds none).
4. decode_attention (~10 s): GB/s (keys + values read) at 1k / 8k / 32k windows, bf16, 32 q / 4 KV heads, hd 128.
   batch_attention (~25 s): one launch for B = 1, 8, 32, 64 decoding sessions (1k..8k keys, bf16, 32 q / 8 KV
   heads, hd 128, pages of 16) vs B launches of the per-session decode kernel (the engine today), per layer.
5. end_to_end (~240 s): decode tokens/s of a random Qwen3-30B-A3B-shaped model cut to 8 layers (the full 48
   layers do not change per-layer figures and would take most of the time budget to build):
   kernels="triton" with and without CUDA graphs, and kernels="torch", at batch 1 (one session) and
   batch 2, 4, 8, 32, 64 (sessions decoding in the same engine steps; aggregate tokens/s); the same with
   quantize="int8" (Triton, graphs) at batch 1 and 8. Steps served by graphs vs run eagerly are counted
   (graphs serve up to the scheduler's max_batch sessions, padded to batch buckets).
--write-configs (~90 s): moe_gemv blocks, the gemv/grouped crossover, and quant_gemv's block_n / block_k /
   split_k per dense shape (int8, int4; M = 1, bf16) into kernels/configs/launch.json.
Prints a table and one JSON line last; exits non-zero when a check failed.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

SMOKE = "--smoke" in sys.argv
if SMOKE:  # the interpreter must be chosen before triton compiles anything
    os.environ.setdefault("TRITON_INTERPRET", "1")

import gpu_check_parts as parts  # noqa: E402  (after the interpreter is chosen: it imports kernels)
from gpu_check_parts import rel, timeit  # noqa: E402

from streamserve.kernels import reference as ref  # noqa: E402
from streamserve.kernels.append_attention import append_attention  # noqa: E402
from streamserve.kernels.decode_attention import decode_attention  # noqa: E402
from streamserve.kernels.moe_gemv import moe_gemv, quantize_int8  # noqa: E402

MOE_SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "mixtral-8x7b": (8, 2, 4096, 14336)}  # E, k, D, I
SMOKE_MOE = {"tiny": (8, 2, 64, 48)}
# relative error allowed, by the last word of a check's name (bf16 / int8 ones vs fp32 ones)
TOLERANCE = {"bf16": 3e-2, "int8": 3e-2, "fp32": 1e-4, "attention": 1e-4, "window": 1e-4, "rolling": 1e-4}


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


BATCHES = (1, 2) if SMOKE else (1, 2, 4, 8, 32, 64)  # the interpreter is slow: the smoke run checks two sizes
INT8_BATCHES = (1, 2) if SMOKE else (1, 8)
PROMPT = 8 if SMOKE else 128  # tokens per session's prompt (a 128-token prefill takes ~20 s in the interpreter)


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
    res: dict = {"layers": layers, "prompt_tokens": PROMPT, "new_tokens": new, "steps": {}}
    tokens: dict[str, list] = {}
    runs = (("triton_graphs", "triton", "on", "none", BATCHES), ("triton", "triton", "off", "none", BATCHES),
            ("torch", "torch", "off", "none", BATCHES), ("int8_triton_graphs", "triton", "on", "int8", INT8_BATCHES))
    with tempfile.TemporaryDirectory() as tmp:
        make_random_checkpoint(Path(tmp), "qwen3_moe", **shape)
        for label, kernels, graphs, quantize, batches in runs:
            engine = Engine.from_pretrained(tmp, device=device, dtype="bfloat16", kernels=kernels, cuda_graphs=graphs,
                                            quantize=quantize, kv_memory="64MiB" if SMOKE else "2GiB")
            for batch in batches:
                tok_s, tokens[f"{label}_b{batch}"], res["steps"][f"{label}_b{batch}"] = batched_decode(
                    engine, batch, new)
                key = f"{label}_decode_tok_s" if batch == 1 else f"{label}_b{batch}_decode_tok_s"
                res[key] = round(tok_s, 1)
                print(f"end to end {label} batch {batch}: {res[key]} tok/s, steps "
                      f"{res['steps'][f'{label}_b{batch}']}", file=sys.stderr)
            if engine.graphs is not None:
                res[f"{label}_graphs_captured"] = engine.graphs.captured
            engine.shutdown()
            del engine
            if device.type == "cuda":
                torch.cuda.empty_cache()
    res["triton_over_torch"] = round(res["triton_decode_tok_s"] / res["torch_decode_tok_s"], 2)
    res["graphs_over_eager"] = round(res["triton_graphs_decode_tok_s"] / res["triton_decode_tok_s"], 2)
    for b in BATCHES[1:]:
        res[f"graphs_over_eager_b{b}"] = round(res[f"triton_graphs_b{b}_decode_tok_s"] /
                                                res[f"triton_b{b}_decode_tok_s"], 2)
        res[f"triton_over_torch_b{b}"] = round(res[f"triton_b{b}_decode_tok_s"] / res[f"torch_b{b}_decode_tok_s"], 2)
    for b in INT8_BATCHES:
        suffix = "" if b == 1 else f"_b{b}"
        res[f"int8_over_bf16{suffix}"] = round(res[f"int8_triton_graphs{suffix}_decode_tok_s"] /
                                               res[f"triton_graphs{suffix}_decode_tok_s"], 2)
    # must hold: same kernels, with and without graphs, at every batch size
    res["graphs_tokens_equal_eager"] = all(tokens[f"triton_graphs_b{b}"] == tokens[f"triton_b{b}"]
                                           for b in BATCHES)
    res["triton_tokens_equal_torch"] = tokens["triton_b1"] == tokens["torch_b1"]  # bf16 rounding may differ
    return res


def batched_decode(engine, batch: int, new: int) -> tuple[float, list[list[int]], dict[str, int]]:
    """`batch` sessions (PROMPT-token prompts) decode `new` tokens each in the same engine steps;
    -> aggregate tokens/s, each session's tokens, and the timed steps: "graph" (served by the engine's CUDA
    graphs: replayed on CUDA, on a CPU the same static-buffer step run eagerly; a shape whose capture failed
    also counts here but runs eagerly: see "<label>_graphs_captured") and "eager" (the model's own forward)."""
    sessions = [engine.open_session() for _ in range(batch)]
    for i, s in enumerate(sessions):
        s.append(token_ids=[(7 * i + j) % 1000 + 1 for j in range(PROMPT)])

    def together(n: int) -> list:
        with engine.guard:  # every reply queued before the first step: they decode batched throughout
            streams = [s.stream(max_tokens=n, stop_token_ids=()) for s in sessions]
        for st in streams:
            st.wait()
        return streams

    together(1 if SMOKE else 4)  # warm-up: compiles, and captures this batch size's graphs
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    calls, graph_runs = engine.stats()["forward_calls"], engine.graphs.runs if engine.graphs is not None else 0
    t0 = time.perf_counter()
    streams = together(new)
    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    # every session shares the default window policy, so graphs refuse no graphable step: runs = served
    graph = (engine.graphs.runs if engine.graphs is not None else 0) - graph_runs
    steps = {"graph": graph, "eager": engine.stats()["forward_calls"] - calls - graph}
    for s in sessions:
        s.close()
    return batch * new / seconds, [st.token_ids for st in streams], steps


def run_sections(sections: list[tuple[str, Callable[[], object]]], res: dict, json_out: Path | None) -> None:
    """Each section into res[name], timed into res["section_seconds"]; one that raises is recorded in
    res["errors"] (the device time of the others is not lost). With json_out, the results so far are written
    there after every section (what a run killed by a time limit had measured)."""
    for name, fn in sections:
        t0 = time.perf_counter()
        try:
            res[name] = fn()
        except Exception as e:  # reported in the JSON and as a failed check
            traceback.print_exc()
            res.setdefault("errors", {})[name] = f"{type(e).__name__}: {e}"[:500]
        res.setdefault("section_seconds", {})[name] = round(time.perf_counter() - t0, 1)
        print(f"{name}: {res.get(name)} ({res['section_seconds'][name]} s)", file=sys.stderr)
        if json_out is not None:
            json_out.with_suffix(".partial").write_text(json.dumps(res) + "\n")
            json_out.with_suffix(".partial").replace(json_out)


CHECKS = ("correctness", "correctness_quant_gemv", "correctness_batch_attention")  # {name: relative error}
SECTIONS = (*CHECKS, "sampler", "copy_gbs", "moe", "moe_int8", "quant_gemv", "decode_attention",
            "batch_attention", "end_to_end")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--smoke", action="store_true", help="tiny shapes on a CPU under the Triton interpreter")
    p.add_argument("--write-configs", action="store_true",
                   help="sweep moe_gemv and quant_gemv launch configs and write launch.json")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--sections", default=",".join(SECTIONS),
                   help=f"comma-separated sections to run (default all: {','.join(SECTIONS)}; copy_gbs is measured "
                        "whenever a bandwidth section needs it)")
    p.add_argument("--json-out", type=Path, help="also write the results to this file, after every section")
    args = p.parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("gpu_check needs a CUDA device; run with --smoke to check the script on a CPU")
    wanted = args.sections.split(",")
    if unknown := [w for w in wanted if w not in SECTIONS]:
        sys.exit(f"unknown sections {unknown}; choose from {','.join(SECTIONS)}")
    device = torch.device("cpu" if args.smoke else "cuda")
    reps = 2 if args.smoke else args.reps
    t0 = time.perf_counter()
    res: dict = {"device": "cpu (smoke)" if args.smoke else torch.cuda.get_device_name(device),
                 "torch": torch.__version__}

    def copy_gbs() -> float:
        return round(copy_bandwidth(device, reps), 1)

    moe_shapes = SMOKE_MOE if args.smoke else MOE_SHAPES
    sections = {
        "correctness": partial(check_correctness, device),
        "correctness_quant_gemv": partial(parts.check_quant_gemv, device),
        "correctness_batch_attention": partial(parts.check_batch_attention, device),
        "sampler": partial(parts.check_sampler, device),
        "copy_gbs": copy_gbs,
        "moe": lambda: bench_moe(device, res["copy_gbs"], reps, moe_shapes),
        "moe_int8": lambda: parts.bench_moe_int8(device, res["copy_gbs"], reps, moe_shapes),
        "quant_gemv": lambda: parts.bench_quant_gemv(device, res["copy_gbs"], reps),
        "decode_attention": partial(bench_attention, device, reps, (64,) if args.smoke else (1024, 8192, 32768)),
        "batch_attention": partial(parts.bench_batch_attention, device, reps),
        "end_to_end": partial(bench_end_to_end, device, 2 if args.smoke else 8, 2 if args.smoke else 64),
    }
    if {"moe", "moe_int8", "quant_gemv"} & set(wanted) and "copy_gbs" not in wanted:
        wanted.append("copy_gbs")
    order = [(name, fn) for name, fn in sections.items() if name in wanted]
    if args.write_configs:
        order.append(("tuned", partial(write_configs, device, reps)))
    run_sections(order, res, args.json_out)
    res["seconds"] = round(time.perf_counter() - t0, 1)
    failed = [k for c in CHECKS for k, v in res.get(c, {}).items() if not v < TOLERANCE[k.split("_")[-1]]]
    failed += [f"sampler_{k}" for k in ("noise_equal", "tokens_equal", "sync_free")
               if res.get("sampler", {}).get(k) is False]
    if res.get("end_to_end", {}).get("graphs_tokens_equal_eager") is False:
        failed.append("graphs_tokens_equal_eager")
    failed += [f"error_in_{name}" for name in res.get("errors", {})]
    res["failed_checks"] = failed
    if args.json_out is not None:
        args.json_out.write_text(json.dumps(res) + "\n")
    print(json.dumps(res))
    if failed:
        sys.exit(f"gpu_check: failed checks: {failed}")


def write_configs(device: torch.device, reps: int) -> dict:
    """Measure the moe_gemv / grouped crossover and sweep moe_gemv block sizes at T = 1 for each MoE shape, and
    quant_gemv's launch configs per dense shape; write them all into launch.json."""
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
    chosen["quant_gemv"] = parts.tune_quant_gemv(device, reps, table, lc.device_name(device))
    # a smoke run checks the writing without touching the shipped table
    target = Path(tempfile.gettempdir()) / "launch.smoke.json" if SMOKE else lc.CONFIG_FILE
    target.write_text(json.dumps(table, indent=2) + "\n")
    return {**chosen, "written_to": str(target)}


if __name__ == "__main__":
    main()
