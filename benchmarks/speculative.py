"""Speculative decoding at batch 1 on the default model: tokens per second with and without each drafter.

    python benchmarks/speculative.py [--tokens 128] [--reps 3] [--quick]

Two workloads, each drafter side by side in one run (runs alternate, medians of --reps):
(a) a low-entropy continuation: the session is given a passage (Genesis 1:1-20), then its first words
    again, and asked to continue (greedy);
(b) free generation: a short prompt, continued (greedy).
Drafters: none, ngram, the shipped draft model (`streamserve/assets/default-draft`, when present) and auto
(on a CPU: n-gram only).
Per drafter: tokens/s, the speed-up over none, the mean accepted length per verification, and whether the
tokens equal plain decoding's (they must: greedy speculation is lossless).
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import time

from streamserve import Engine
from streamserve.engine.loading import DEFAULT_MODEL_DIR
from streamserve.tools.compiled import wait_compiled


def passage() -> str:
    try:
        raw = subprocess.run(["bible", "-f", "Genesis 1:1-1:20"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        raw = ""
    text = re.sub(r"Ge\d+:\d+ ", "", raw).strip()
    return text or "In the beginning God created the heaven and the earth. " * 20


def run(engine: Engine, drafter: str, prompt: list[str], tokens: int) -> tuple[float, list[int], dict]:
    before = {k: dict(v) for k, v in engine.stats()["speculative"].items()}
    with engine.open_session(drafter=drafter) as s:
        for text in prompt:
            s.append(text=text)
        t0 = time.perf_counter()
        out = s.generate(max_tokens=tokens, stop_token_ids=())
        seconds = time.perf_counter() - t0
    after = engine.stats()["speculative"]
    delta = {name: {k: after[name][k] - before.get(name, {}).get(k, 0) for k in ("verifications", "accepted")}
             for name in after}
    return len(out) / seconds, out, delta


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="16 tokens, one rep (CI smoke run)")
    args = ap.parse_args()
    tokens, reps = (16, 1) if args.quick else (args.tokens, args.reps)
    engine = Engine.from_pretrained("default", device="cpu", kv_memory="256MiB")
    drafters = ["none", "ngram"]
    shipped = DEFAULT_MODEL_DIR.parent / "default-draft"
    if (shipped / "config.json").exists():
        drafters += [f"draft:{shipped}", "auto"]
    text = passage()
    workloads = {"low_entropy": [text, "\n\n" + " ".join(text.split()[:40])], "free": ["In the beginning"]}
    # warm up: every drafter's step shapes run, then their compiled steps are waited for (the steps a user gets with
    # cpu_compile auto, not their compile); the quick run only warms up (a cold compile of each shape takes minutes)
    for _ in range(1 if args.quick else 2):
        for d in drafters:
            for prompt in workloads.values():
                run(engine, d, prompt, 8 if args.quick else tokens)
        if not args.quick:
            wait_compiled(engine)
    res: dict = {"benchmark": "speculative", "model": "default", "device": "cpu", "tokens": tokens, "reps": reps}
    for name, prompt in workloads.items():
        rates: dict[str, list[float]] = {d: [] for d in drafters}
        outs: dict[str, list[int]] = {}
        accepted: dict[str, tuple[int, int]] = {}
        for _ in range(reps):
            for d in drafters:
                rate, out, delta = run(engine, d, prompt, tokens)
                rates[d].append(rate)
                outs[d] = out
                v = sum(x["verifications"] for x in delta.values())
                a = sum(x["accepted"] for x in delta.values())
                accepted[d] = (accepted.get(d, (0, 0))[0] + v, accepted.get(d, (0, 0))[1] + a)
        base = statistics.median(rates["none"])
        res[name] = {d: {"tok_s": round(statistics.median(rates[d]), 1),
                         "speedup": round(statistics.median(rates[d]) / base, 2),
                         "mean_accepted": round(accepted[d][1] / max(1, accepted[d][0]), 2),
                         "identical_to_none": outs[d] == outs["none"]}
                     for d in drafters}
        for d, r in res[name].items():
            print(f"{name:12s} {d.split('/')[-1]:20s} {r['tok_s']:8.1f} tok/s  x{r['speedup']:<5}  "
                  f"accepted/verification {r['mean_accepted']:5}  identical {r['identical_to_none']}", file=sys.stderr)
    engine.shutdown()
    res["ngram_speedup_low_entropy"] = res["low_entropy"]["ngram"]["speedup"]
    print(json.dumps(res))


if __name__ == "__main__":
    main()
