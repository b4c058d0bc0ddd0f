"""One MoE layer for one token on a CPU: the engine's torch paths against transformers' MoE block.

    python benchmarks/moe_cpu.py [--shape qwen3-30b-a3b|moe64] [--reps 30] [--quick]

Same weights in both (transformers' Qwen3MoeSparseMoeBlock, whose experts are stored like ours:
gate_up [E, 2I, D], down [E, D, I]), same input, outputs checked equal. Paths timed at T = 1, 2, 4, 8:
- topk_loop: one matmul pair per chosen expert, weights read in place (one host sync for the ids);
- grouped: tokens sorted by expert, torch's grouped GEMM;
- gather: the sync-free reference that copies the chosen experts' weights;
- transformers: the block's forward with its default experts implementation.
The fastest torch path per T is what the CPU dispatch uses (streamserve/models/ops.py). Prints a table
and one JSON line last, with each path's time and its ratio to transformers.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch

from streamserve.kernels import reference as ref

SHAPES = {
    "qwen3-30b-a3b": dict(hidden_size=2048, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8),
    "moe64": dict(hidden_size=512, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8),
}


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-30b-a3b")
    p.add_argument("--reps", type=int, default=30)
    p.add_argument("--quick", action="store_true", help="a small run to check the script works")
    args = p.parse_args()
    if args.quick:
        args.shape, args.reps = "moe64", 3
    shape = SHAPES[args.shape]
    torch.manual_seed(0)
    cfg = Qwen3MoeConfig(**shape, norm_topk_prob=True)
    block = Qwen3MoeSparseMoeBlock(cfg).eval()
    with torch.no_grad():  # transformers initialises experts with empty(): give every weight real values
        for t in block.parameters():
            t.normal_(0, 0.02)
    gate_w, w_gu, w_d = block.gate.weight, block.experts.gate_up_proj, block.experts.down_proj  # our layout
    k = shape["num_experts_per_tok"]
    res: dict = {"shape": args.shape, **shape, "torch": torch.__version__, "threads": torch.get_num_threads(),
                 "tokens": {}}
    paths = {"topk_loop": ref.moe_experts_topk_loop, "grouped": ref.moe_experts_grouped,
             "gather": ref.moe_experts_gather}
    for t in (1, 2, 4, 8):
        x = torch.randn(t, shape["hidden_size"])
        with torch.inference_mode():
            expected = block(x[None])[0]
            row = {"transformers_ms": round(median_ms(lambda x=x: block(x[None]), args.reps), 3)}
            for name, fn in paths.items():
                def ours(x=x, fn=fn) -> torch.Tensor:
                    weights, ids = ref.moe_route(torch.nn.functional.linear(x, gate_w), k, True)
                    return fn(x, weights, ids, w_gu, w_d)

                assert torch.allclose(ours(), expected, atol=1e-5, rtol=1e-4), name
                row[f"{name}_ms"] = round(median_ms(ours, args.reps), 3)
                row[f"{name}_speedup"] = round(row["transformers_ms"] / row[f"{name}_ms"], 2)
        res["tokens"][str(t)] = row
        print(f"T={t}: " + ", ".join(f"{k_}={v}" for k_, v in row.items()), file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
