"""One decode row through each CPU linear kernel at SmolLM2-135M's shapes: where quantized decode's time goes.

    python benchmarks/cpu_linear.py [--threads 1,2] [--reps 200] [--quick]

For each [N, K] projection of SmolLM2-135M (qkv 960x576, o 576x576, gate|up 3072x576, down 576x1536, the tied head
49152x576) and one activation row x [1, K] fp32, in one run, interleaved kernel by kernel:
- `fp32`: `F.linear` on the float32 weight (what `--quantize none` runs);
- `woq_int8`, `woq_int4`: the engine's `QuantLinear` (torch's weight-only `_weight_int8pack_mm` /
  `_weight_int4pack_mm_for_cpu`, activations rounded to bfloat16);
- `dyn_int8`: torch's dynamic quantized `Linear` (x86 engine: the activation row quantized to 8 bits per tensor,
  an integer GEMM), which the engine does not use (deprecated API, activation error) but which shows what an
  integer dot product gains at these shapes.
Each as microseconds per call (best of 5 rounds of --reps calls) and as GB/s of weight bytes (codes and scales),
and each kernel's error relative to `fp32` (max |y - y_fp32| / max |y_fp32|). Human lines go to stderr; the last
line is one JSON object with the figures and the ratios to `fp32` and to `woq_int8`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from streamserve.models.quant import QuantLinear

SHAPES = {"qkv": (960, 576), "o": (576, 576), "gate_up": (3072, 576), "down": (576, 1536), "head": (49152, 576)}


def best_us(fn: Callable[[], object], reps: int) -> float:
    for _ in range(max(3, reps // 10)):
        fn()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        best = min(best, (time.perf_counter() - t0) / reps * 1e6)
    return best


def dynamic_int8(lin: nn.Linear) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """torch's dynamic quantized Linear over `lin`'s weight (per-channel int8), or None where it is unavailable."""
    try:
        import torch.ao.nn.quantized.dynamic as nnqd

        torch.backends.quantized.engine = "x86"
        w = lin.weight.detach()
        n = w.shape[0]
        with warnings.catch_warnings():  # the quantized-tensor API is deprecated: named in the docstring
            warnings.simplefilter("ignore")
            q = torch.quantize_per_channel(w, (w.abs().amax(1) / 127).clamp(min=1e-12).double(),
                                           torch.zeros(n, dtype=torch.long), 0, torch.qint8)
            mod = nnqd.Linear(w.shape[1], n, bias_=False, dtype=torch.qint8)
            mod.set_weight_bias(q, None)
        return mod
    except (ImportError, RuntimeError) as e:
        print(f"dyn_int8 unavailable: {e}", file=sys.stderr)
        return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--threads", default="1,2", help="intra-op thread counts to run (comma separated)")
    p.add_argument("--reps", type=int, default=200, help="calls per timing round (the head takes a tenth)")
    p.add_argument("--quick", action="store_true", help="small shapes and few reps: checks the script runs")
    args = p.parse_args()
    shapes = {"small": (48, 64)} if args.quick else SHAPES
    reps = 5 if args.quick else args.reps
    threads_list = [int(t) for t in args.threads.split(",")]
    g = torch.Generator().manual_seed(0)
    res: dict[str, Any] = {"torch": torch.__version__, "shapes": {}}
    for name, (n, k) in shapes.items():
        lin = nn.Linear(k, n, bias=False)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
        x = torch.randn(1, k, generator=g)
        woq8, woq4 = QuantLinear.from_linear(lin, 8), QuantLinear.from_linear(lin, 4)
        kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
            "fp32": lambda t, w=lin.weight: F.linear(t, w), "woq_int8": woq8, "woq_int4": woq4}
        nbytes = {"fp32": n * k * 4, "woq_int8": woq8.weight_bytes, "woq_int4": woq4.weight_bytes,
                  "dyn_int8": n * k + n * 8}  # int8 codes and a float64 scale per channel
        dyn = dynamic_int8(lin)
        if dyn is not None:
            kernels["dyn_int8"] = dyn
        row: dict[str, Any] = {"n": n, "k": k}
        with torch.inference_mode():
            ref = kernels["fp32"](x)
            for kname, fn in kernels.items():
                err = float((fn(x) - ref).abs().max() / ref.abs().max())
                row[kname] = {"error": round(err, 5), "us": {}, "gb_s": {}}
            for threads in threads_list:
                torch.set_num_threads(threads)
                for kname, fn in kernels.items():  # interleaved: every kernel sees the same load
                    us = best_us(lambda fn=fn, x=x: fn(x), max(1, reps // 10) if n > 10000 else reps)
                    row[kname]["us"][threads] = round(us, 1)
                    row[kname]["gb_s"][threads] = round(nbytes[kname] / us / 1e3, 2)
                print(f"{name} [{n}x{k}] {threads} thread(s): "
                      + ", ".join(f"{kname} {row[kname]['us'][threads]} us" for kname in kernels), file=sys.stderr)
                us_of = {kname: row[kname]["us"][threads] for kname in kernels}
                ratios = {f"{kname}_speedup_over_fp32": round(us_of["fp32"] / us_of[kname], 3)
                          for kname in kernels if kname != "fp32"}
                if "dyn_int8" in kernels:
                    ratios["dyn_int8_speedup_over_woq_int8"] = round(us_of["woq_int8"] / us_of["dyn_int8"], 3)
                row[f"ratios_{threads}t"] = ratios
        res["shapes"][name] = row
    print(json.dumps(res))


if __name__ == "__main__":
    main()
