"""Batch-1 decode and prefill throughput: streamserve's Engine against transformers, side by side.

    python benchmarks/decode.py [--prompt 256] [--new 64] [--reps 3] [--quick]

Models: the embedded default model, and a random Qwen3-MoE with 64 experts, top-8 (built here with
transformers; nothing is downloaded). Both frameworks run the same checkpoint in float32 on the same
threads, alternating rep by rep, and the median of each is kept.

- prefill tok/s: one forward over a prompt of --prompt tokens into an empty cache.
- decode tok/s: greedy tokens after that prompt. transformers' `generate` includes its prefill, so its
  decode time is generate(N) - generate(1) over N - 1 tokens; the engine's is timed the same way.
It also times the two torch MoE paths (gather vs grouped) at several token counts on the 64-expert
shapes, which is why a CPU always takes the grouped path (streamserve/models/ops.py).
The last line printed is one JSON object with every figure and the engine/transformers ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from streamserve import Engine
from streamserve.engine.engine import DEFAULT_MODEL_DIR
from streamserve.engine.openmp import release_openmp_threads
from streamserve.kernels import reference as ref
from streamserve.tools.compiled import wait_compiled
from streamserve.tools.random_checkpoint import make_random_checkpoint

MOE64 = dict(vocab_size=4096, hidden_size=512, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=4,
             head_dim=64, num_experts=64, num_experts_per_tok=8, moe_intermediate_size=256, norm_topk_prob=True,
             intermediate_size=1024, max_position_embeddings=4096, initializer_range=0.02)


def timed(fn) -> float:
    # this thread's OpenMP workers (transformers' runs here) go first: sleeping pools next to the engine thread
    # make each of its parallel regions wake a worker (engine/openmp.py)
    release_openmp_threads()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def bench_model(name: str, path: Path, prompt_len: int, new: int, reps: int) -> dict:
    from transformers import AutoModelForCausalLM, GenerationConfig

    engine = Engine.from_pretrained(path, device="cpu", dtype="float32")
    wait_compiled(engine)  # its decode step as a user gets it once compiled (cpu_compile auto)
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    vocab = engine.config.vocab_size
    prompt = torch.randint(0, min(vocab, 4000), (prompt_len,), generator=torch.Generator().manual_seed(0)).tolist()
    x = torch.tensor([prompt])

    def hf_generate(n: int) -> None:
        cfg = GenerationConfig(max_new_tokens=n, min_new_tokens=n, do_sample=False, eos_token_id=None, pad_token_id=0)
        with torch.inference_mode():
            hf.generate(x, generation_config=cfg)

    def ours_generate(n: int) -> None:
        with engine.open_session() as s:
            s.append(token_ids=prompt)
            s.generate(max_tokens=n, stop_token_ids=())

    def ours_prefill() -> None:
        with engine.open_session() as s:
            s.append(token_ids=prompt)

    def hf_prefill() -> None:
        with torch.inference_mode():
            hf(x, use_cache=True)

    hf_generate(2), ours_generate(2)  # warm-up
    r: dict[str, list[float]] = {k: [] for k in ("ours_pre", "hf_pre", "ours_dec", "hf_dec")}
    for _ in range(reps):
        r["ours_pre"].append(timed(ours_prefill))
        r["hf_pre"].append(timed(hf_prefill))
        r["ours_dec"].append(timed(lambda: ours_generate(new)) - timed(lambda: ours_generate(1)))
        r["hf_dec"].append(timed(lambda: hf_generate(new)) - timed(lambda: hf_generate(1)))
    med = {k: statistics.median(v) for k, v in r.items()}
    out = {
        "model": name,
        "parameters": engine.stats()["parameters"],
        "hf_experts_implementation": getattr(hf.config, "_experts_implementation", None),
        "prefill_tokens": prompt_len,
        "engine_prefill_tok_s": round(prompt_len / med["ours_pre"], 1),
        "transformers_prefill_tok_s": round(prompt_len / med["hf_pre"], 1),
        "engine_decode_tok_s": round((new - 1) / med["ours_dec"], 1),
        "transformers_decode_tok_s": round((new - 1) / med["hf_dec"], 1),
    }
    out["prefill_ratio"] = round(out["engine_prefill_tok_s"] / out["transformers_prefill_tok_s"], 2)
    out["decode_ratio"] = round(out["engine_decode_tok_s"] / out["transformers_decode_tok_s"], 2)
    return out


def bench_moe_paths(reps: int) -> dict[str, dict[str, float]]:
    """Microseconds per call of the gather and grouped torch MoE paths on the 64-expert shapes."""
    g = torch.Generator().manual_seed(0)
    E, D, inter, k = MOE64["num_experts"], MOE64["hidden_size"], MOE64["moe_intermediate_size"], 8
    w_gu, w_d = torch.randn(E, 2 * inter, D, generator=g), torch.randn(E, D, inter, generator=g)
    result = {}
    for t in (1, 2, 4, 8, 16):
        x = torch.randn(t, D, generator=g)
        weights, ids = ref.moe_route(torch.randn(t, E, generator=g), k, True)
        row = {}
        args = (x, weights, ids, w_gu, w_d)
        for name, fn in (("gather_us", ref.moe_experts_gather), ("grouped_us", ref.moe_experts_grouped)):
            fn(*args)
            row[name] = round(1e6 * statistics.median(
                timed(lambda fn=fn, args=args: fn(*args)) for _ in range(reps * 10)), 1)
        result[str(t)] = row
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", type=int, default=256, help="prompt tokens (default 256)")
    p.add_argument("--new", type=int, default=64, help="generated tokens (default 64)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="tiny run to check the script works")
    args = p.parse_args()
    if args.quick:
        args.prompt, args.new, args.reps = 16, 4, 1
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    torch.manual_seed(0)
    results = {"torch": torch.__version__, "threads": torch.get_num_threads(), "models": []}
    with tempfile.TemporaryDirectory() as tmp:
        moe64 = Path(tmp) / "qwen3-moe-64e-top8"
        make_random_checkpoint(moe64, "qwen3_moe", **MOE64)
        for name, path in (("default", DEFAULT_MODEL_DIR), ("random-qwen3-moe-64e-top8", moe64)):
            row = bench_model(name, path, args.prompt, args.new, args.reps)
            print(f"{name}: decode {row['engine_decode_tok_s']} vs {row['transformers_decode_tok_s']} tok/s "
                  f"(x{row['decode_ratio']}), prefill {row['engine_prefill_tok_s']} vs "
                  f"{row['transformers_prefill_tok_s']} tok/s (x{row['prefill_ratio']})", file=sys.stderr)
            results["models"].append(row)
    results["moe_paths_us"] = bench_moe_paths(args.reps)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
