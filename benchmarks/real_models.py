"""Real small models at batch 1 on this machine: streamserve against transformers on the same GGUF files.

    python benchmarks/real_models.py [--models smollm2-135m-instruct gemma3-270m] [--turns 150] [--quick]

The models come from the cache of `streamserve models pull` (pull them first; a model not pulled is left
out and said so). For each, in one run:
1. load time: streamserve (GGUF dequantized at load) and transformers (`gguf_file=`), both float32;
2. prefill tokens/s of a 256-token English prompt and decode tokens/s of 64 greedy tokens after it,
   streamserve against transformers with its KV cache (each the median of 3 runs, interleaved, after a
   warm-up); streamserve's prefill is an append, run in the engine loop's steps (64 tokens on a CPU, so
   that other sessions' chunks are never stuck behind a long prompt), transformers' one forward;
3. KV bytes a session holds per 1,000 tokens, at 1,000 and at 4,000 tokens; for models with native
   sliding-window layers (Gemma 3) both with native window freeing (the engine's default) and without
   (a rewind reach beyond the stream, so that no local-layer page is ever freed);
4. on SmolLM2 only, the session workload of `session_append.py`: 8 sessions x 150 turns (16 tokens in,
   8 out), persistent sessions (last 10 / first 10 turns) and stateless re-prefill at the last turn.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from streamserve import Engine
from streamserve.engine.openmp import release_openmp_threads
from streamserve.models import store

TEXT = ("The history of the city begins on a small island in the river, where fishermen built their first "
        "houses of wood and reed. Over the centuries the settlement grew into a market town, then a walled "
        "city with bridges, churches and a university. Merchants came from every direction to trade wool, "
        "salt, wine and books, and the river carried their boats to the sea. ") * 8
PROMPT_TOKENS, DECODE_TOKENS = 256, 64
NO_FREEING_REACH = 1 << 30  # a rewind reach past any stream: local-layer pages are never freed


def session_append_module() -> Any:
    spec = importlib.util.spec_from_file_location("session_append", Path(__file__).with_name("session_append.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def hf_model(path: Path) -> tuple[Any, float]:
    from transformers import AutoModelForCausalLM

    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
    return model, time.perf_counter() - t0


def ours_prefill_decode(engine: Engine, ids: list[int]) -> tuple[float, float]:
    with engine.open_session() as s:
        t0 = time.perf_counter()
        s.append(token_ids=ids)
        t1 = time.perf_counter()
        out = s.generate(max_tokens=DECODE_TOKENS, stop_token_ids=())
        t2 = time.perf_counter()
    assert len(out) == DECODE_TOKENS
    return len(ids) / (t1 - t0), DECODE_TOKENS / (t2 - t1)


@torch.inference_mode()
def hf_prefill_decode(model: Any, ids: list[int]) -> tuple[float, float]:
    """Greedy with transformers' KV cache: one forward over the prompt, then one per token."""
    t0 = time.perf_counter()
    out = model(torch.tensor([ids]), use_cache=True)
    t1 = time.perf_counter()
    past, nxt = out.past_key_values, out.logits[0, -1].argmax()
    for _ in range(DECODE_TOKENS):
        out = model(nxt.view(1, 1), past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[0, -1].argmax()
    t2 = time.perf_counter()
    return len(ids) / (t1 - t0), DECODE_TOKENS / (t2 - t1)


def kv_bytes(engine: Engine, lengths: tuple[int, ...]) -> dict[str, int]:
    """KV bytes one session holds after `lengths` tokens (absolute positions, no session window)."""
    out: dict[str, int] = {}
    g = torch.Generator().manual_seed(0)
    with engine.open_session() as s:
        for n in lengths:
            while len(s.token_ids) < n:
                s.append(token_ids=torch.randint(10, 4000, (min(256, n - len(s.token_ids)),), generator=g).tolist())
            out[str(n)] = s.kv.held_bytes
    return out


def measure(name: str, path: Path, quick: bool) -> dict[str, Any]:
    t0 = time.perf_counter()
    engine = Engine.from_pretrained(path, device="cpu", kv_memory="2GiB", quantize="none",
                                    cpu_compile="off")  # float32 both sides, eager: compared with transformers
    res: dict[str, Any] = {"file": path.name, "load_s": round(time.perf_counter() - t0, 2)}
    hf, res["hf_load_s"] = hf_model(path)
    res["hf_load_s"] = round(res["hf_load_s"], 2)
    res["load_hf_over_ours"] = round(res["hf_load_s"] / res["load_s"], 2)
    ids = engine.tokenizer.encode(TEXT)[:PROMPT_TOKENS]
    runs: dict[str, list[tuple[float, float]]] = {"ours": [], "hf": []}
    if not quick:  # warm-up of both: first-touch of the pool, allocator and caches (a quick run checks the script)
        ours_prefill_decode(engine, ids[:32])
        hf_prefill_decode(hf, ids[:32])
    for _ in range(1 if quick else 3):  # interleaved: both see the same machine load
        release_openmp_threads()  # transformers' workers (this thread's) are not left next to the engine thread's
        runs["ours"].append(ours_prefill_decode(engine, ids))
        runs["hf"].append(hf_prefill_decode(hf, ids))
    for who, r in runs.items():
        res[f"{who}_prefill_tok_s"] = round(statistics.median(p for p, _ in r), 1)
        res[f"{who}_decode_tok_s"] = round(statistics.median(d for _, d in r), 2)
    res["prefill_ours_over_hf"] = round(res["ours_prefill_tok_s"] / res["hf_prefill_tok_s"], 3)
    res["decode_ours_over_hf"] = round(res["ours_decode_tok_s"] / res["hf_decode_tok_s"], 3)
    del hf
    lengths = (1000,) if quick else (1000, 4000)
    res["kv_bytes"] = kv_bytes(engine, lengths)
    res["kv_bytes_per_1k_tokens"] = res["kv_bytes"][str(lengths[-1])] * 1000 // lengths[-1]
    if any(w is not None for w in engine.config.sliding_windows):
        engine.shutdown()
        engine = Engine.from_pretrained(path, device="cpu", kv_memory="2GiB", rewind_reach=NO_FREEING_REACH,
                                        quantize="none", cpu_compile="off")
        res["kv_bytes_without_window_freeing"] = kv_bytes(engine, lengths)
        res["kv_without_over_with_freeing"] = round(
            res["kv_bytes_without_window_freeing"][str(lengths[-1])] / res["kv_bytes"][str(lengths[-1])], 2)
    engine.shutdown()
    print(f"{name}: {res}", file=sys.stderr)
    return res


def session_workload(path: Path, sessions: int, turns: int) -> dict[str, Any]:
    sa = session_append_module()
    engine = Engine.from_pretrained(path, device="cpu", kv_memory="2GiB", quantize="none", cpu_compile="off")
    inputs = sa.turn_inputs(sessions, turns)
    sa.persistent(engine, [ins[:2] for ins in inputs], None)  # warm-up
    lat, histories = sa.persistent(engine, inputs, None)
    stateless = statistics.mean(sa.stateless_turn(engine, h[: turns * (sa.TURN_IN + sa.TURN_OUT) - sa.TURN_OUT])
                                for h in histories[:2])
    engine.shutdown()
    return {"sessions": sessions, "turns": turns, "turn_ms_first10": round(1e3 * statistics.mean(lat[:10]), 2),
            "turn_ms_last10": round(1e3 * statistics.mean(lat[-10:]), 2),
            "last10_over_first10": round(statistics.mean(lat[-10:]) / statistics.mean(lat[:10]), 3),
            "stateless_turn_ms_last": round(1e3 * stateless, 2),
            "stateless_over_persistent_at_last_turn": round(stateless / lat[-1], 2)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--models", nargs="+", default=["smollm2-135m-instruct", "gemma3-270m"])
    p.add_argument("--sessions", type=int, default=8)
    p.add_argument("--turns", type=int, default=150)
    p.add_argument("--quick", action="store_true", help="a small run to check the script works")
    args = p.parse_args()
    if args.quick:
        args.sessions, args.turns = 2, 12
    res: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "missing": []}
    for name in args.models:
        path = store.installed(name)
        if path is None:
            print(f"{name} is not pulled: streamserve models pull {name}", file=sys.stderr)
            res["missing"].append(name)
            continue
        res[name] = measure(name, path, args.quick)
        if name.startswith("smollm2"):
            res[name]["session_workload"] = session_workload(path, args.sessions, args.turns)
            print(f"{name} sessions: {res[name]['session_workload']}", file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
