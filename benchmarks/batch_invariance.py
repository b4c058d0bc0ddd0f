"""Is a session's output independent of what else runs in its step? Measured on the default model.

    python benchmarks/batch_invariance.py [--tokens 64] [--quick]

1. Logits: one decode step of a session run alone and batched with 1, 3 and 7 other sessions (one
   forward each), for float32 and bfloat16: the largest absolute difference of its logits.
2. Greedy tokens: 8 sessions reply --tokens tokens each, alone and all batched in the same steps;
   whether every session's tokens are identical.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import sys

from streamserve import Engine
from streamserve.tools.batched import replies_together

PROMPTS = ["In the beginning God", "And the LORD spake unto Moses, saying", "Blessed are the poor in spirit",
           "The LORD is my shepherd; I shall not", "For God so loved the world", "Now the serpent was more subtil",
           "Jesus wept.", "And God said, Let there be light"]


def logit_drift(engine: Engine, prompts: list[list[int]]) -> dict[int, float]:
    """Largest |logits(alone) - logits(in a batch of B)| of the first session's decode step."""
    out = {}
    for b in (1, 2, 4, 8):
        sessions = [engine.open_session() for _ in range(b)]
        for s, p in zip(sessions, prompts, strict=False):
            s.append(token_ids=p[:-1])
        logits = engine.run_step([(s, [p[-1]]) for s, p in zip(sessions, prompts, strict=False)])[0]
        out[b] = logits
        for s in sessions:
            s.close()
    return {b: float((v - out[1]).abs().max()) for b, v in out.items()}


def greedy_equal(engine: Engine, prompts: list[list[int]], tokens: int) -> list[bool]:
    alone = []
    for p in prompts:
        with engine.open_session() as s:
            s.append(token_ids=p)
            alone.append(s.generate(max_tokens=tokens, stop_token_ids=()))
    together = replies_together(engine, prompts, tokens)
    return [a == b for a, b in zip(alone, together, strict=True)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--quick", action="store_true", help="8 tokens, float32 only")
    args = ap.parse_args()
    res: dict[str, object] = {"benchmark": "batch_invariance", "model": "default", "device": "cpu"}
    for dtype in ("float32",) if args.quick else ("float32", "bfloat16"):
        # eager: a compiled step of one shape beside eager steps of others would not be the kernels' invariance
        engine = Engine.from_pretrained("default", device="cpu", dtype=dtype, kv_memory="256MiB", cpu_compile="off")
        prompts = [engine.tokenizer.encode(t) for t in PROMPTS]
        drift = logit_drift(engine, prompts)
        equal = greedy_equal(engine, prompts, 8 if args.quick else args.tokens)
        engine.shutdown()
        print(f"{dtype}: max |logit drift| by batch size {drift}; greedy tokens identical {sum(equal)}/{len(equal)}",
              file=sys.stderr)
        res[dtype] = {"max_logit_drift_by_batch": drift, "greedy_identical_sessions": sum(equal),
                      "sessions": len(equal)}
    print(json.dumps(res))


if __name__ == "__main__":
    main()
