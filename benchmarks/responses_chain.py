"""A long conversation over the OpenAI HTTP APIs: a previous_response_id chain against a stateless client (issue 34).

    python benchmarks/responses_chain.py [--turns 50] [--max-tokens 32] [--model smollm2-135m-instruct]
    python benchmarks/responses_chain.py --smoke        # 4 turns of 8 tokens: checks the script runs

A server (streamserve.server.app.Server, CPU, the model from the local cache) runs in this process on a free loopback
port; the clients are the real `openai` SDK (AsyncOpenAI, max_retries=0). One conversation of --turns user messages
(a fixed list of short questions that make the model talk, cycled; temperature 0, replies of --max-tokens) runs two
ways, turn by turn alternately (turn i of the chain, then turn i of the baseline: both see the same machine load):
1. chain: `responses.create(input=<the user text>, previous_response_id=<the last id>)`; the server appends only the
   new input to the resident session that holds the conversation.
2. stateless baseline: `chat.completions.create(messages=<the whole conversation so far + the new message>)`, its
   own replies fed back; each turn under a fresh API key (the server keys its reusable sessions by the bearer; with
   no --api-key any is accepted), so the whole history is prefilled every turn: `prompt_tokens_details.cached_tokens`
   must be 0 on every baseline turn (reported).
Both stream; per turn the wall time to the first text and to the full reply are measured. Reported per way: ms per
turn over turns 1-10 (`first10_ms`) and over the last 10 (`last10_ms`), `last10_over_first10`, `last_ms` (the mean of
the last 3 turns), and `stateless_over_chain_at_last`, for the full reply and (`first_text`) for the first text; the
issue's targets as booleans `chain_flat` (chain last10/first10 <= 1.3) and `ten_x_cheaper` (baseline/chain at the last
turn >= 10), full replies, not asserted. Progress goes to stderr; the last line on
stdout is one JSON object with every figure, the machine and the commit.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import platform
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
QUESTIONS = ["Explain how a rainbow forms.", "Describe the water cycle in detail.",
             "Tell me about the history of Rome.", "How does a car engine work?",
             "Why is the sky blue? Explain it simply.",
             "Describe a day in the life of a farmer.", "What makes a good friend? Explain.",
             "How do plants make their food?", "Tell me a short story about a dragon.",
             "Explain how computers store numbers."]


def commit() -> str:
    """The checkout's commit, with "-dirty" when the work tree has changes."""
    def git(*a: str) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    head = git("rev-parse", "--short", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def machine() -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    with open("/proc/cpuinfo") as f:  # Linux: the model name is there, platform.processor() is often empty
        cpu = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), cpu)
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__}


def summary(ms: list[float]) -> dict[str, float]:
    first, last10, last = ms[:10], ms[-10:], ms[-3:]
    f, l10 = sum(first) / len(first), sum(last10) / len(last10)
    return {"first10_ms": round(f, 1), "last10_ms": round(l10, 1), "last10_over_first10": round(l10 / f, 3),
            "last_ms": round(sum(last) / len(last), 1)}


async def call(way: str, turn: int, request: dict[str, Any], create: Any, **extra: Any) -> tuple[Any, float, float]:
    """One streamed request -> (its final response or usage chunk, ms to the first text, ms to the full reply); an API
    error ends the run, naming the request."""
    import openai

    t0 = time.perf_counter()
    first, final, text = None, None, []
    try:
        stream = await create(**request, stream=True, **extra)
        async for ev in stream:
            delta = getattr(ev, "delta", None) if way == "chain" else (ev.choices[0].delta.content if ev.choices
                                                                       else None)
            if delta and first is None:
                first = time.perf_counter()
            if delta and way != "chain":
                text.append(delta)
            if way == "chain" and ev.type in ("response.completed", "response.incomplete"):
                final = ev.response
            if way != "chain" and ev.usage is not None:
                final = (ev.usage, "".join(text))
    except openai.APIError as e:
        shown = {k: (v if k != "messages" else f"<{len(v)} messages, last {v[-1]!r}>") for k, v in request.items()}
        print(f"{way} turn {turn}: {shown} -> {type(e).__name__}: {e}", file=sys.stderr, flush=True)
        raise SystemExit(1) from None
    end = time.perf_counter()
    return final, ((first or end) - t0) * 1000, (end - t0) * 1000


async def conversation(args: argparse.Namespace) -> dict[str, Any]:
    from openai import AsyncOpenAI

    from streamserve.config import ServerConfig
    from streamserve.engine import Engine
    from streamserve.server.app import Server, start
    from streamserve.tools.compiled import wait_compiled

    def load() -> Engine:
        engine = Engine.from_pretrained(args.model, device="cpu", kv_memory=args.kv_memory, offline=True)
        wait_compiled(engine)  # the compiled decode step a user gets (cpu_compile auto), not its compile
        return engine

    os.environ.pop("STREAMSERVE_API_KEY", None)  # no key: any bearer is accepted, each its own owner
    server = Server(ServerConfig(host="127.0.0.1", port=0, no_voice=True, no_vision=True,
                                 http_session_ttl=args.session_ttl), load)
    runner, port = await start(server)
    try:
        await asyncio.wait_for(server.ready.wait(), 300)
        if server.engine is None:
            raise SystemExit(f"{args.model} did not load: {server.load_error}")
        base = f"http://127.0.0.1:{port}/v1"
        chain = AsyncOpenAI(base_url=base, api_key="chain", max_retries=0)
        stateless = AsyncOpenAI(base_url=base, api_key="stateless", max_retries=0)  # the bearer is set per turn
        await stateless.chat.completions.create(model="default", messages=[{"role": "user", "content": "Hi."}],
                                                max_tokens=4, temperature=0)  # warm-up (its own key): not timed
        prev: str | None = None
        messages: list[dict[str, str]] = []
        rows: dict[str, list[dict[str, Any]]] = {"chain": [], "baseline": []}
        for i in range(args.turns):
            q = QUESTIONS[i % len(QUESTIONS)]
            r, ttft, ms = await call("chain", i + 1, {"model": "default", "input": q, "previous_response_id": prev,
                                                      "temperature": 0, "max_output_tokens": args.max_tokens},
                                     chain.responses.create)
            prev, u = r.id, r.usage
            rows["chain"].append({"ms": ms, "ttft": ttft, "input": u.input_tokens, "output": u.output_tokens,
                                  "cached": u.input_tokens_details.cached_tokens, "text": r.output_text})
            messages.append({"role": "user", "content": q})
            key = f"stateless-{uuid.uuid4().hex}"  # a new owner: none of its sessions holds this conversation
            (cu, text), bttft, bms = await call(
                "baseline", i + 1, {"model": "default", "messages": list(messages), "temperature": 0,
                                    "max_tokens": args.max_tokens, "stream_options": {"include_usage": True}},
                stateless.chat.completions.create, extra_headers={"Authorization": f"Bearer {key}"})
            messages.append({"role": "assistant", "content": text})
            rows["baseline"].append({"ms": bms, "ttft": bttft, "input": cu.prompt_tokens,
                                     "output": cu.completion_tokens, "cached": cu.prompt_tokens_details.cached_tokens,
                                     "text": text})
            ch, bl = rows["chain"][-1], rows["baseline"][-1]
            print(f"turn {i + 1:3d}: chain {ttft:7.1f} / {ms:7.1f} ms (input {ch['input']}, cached {ch['cached']}) | "
                  f"baseline {bttft:7.1f} / {bms:7.1f} ms (prompt {bl['input']}, cached {bl['cached']})",
                  file=sys.stderr, flush=True)
        await chain.close()
        await stateless.close()
        stats = server.engine.stats()
    finally:
        await runner.cleanup()
    return {"rows": rows, "engine": {k: stats[k] for k in ("dtype", "sessions_parked_total", "sessions_expired_total",
                                                           "prefill_tokens_per_s", "decode_tokens_per_s")}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--turns", type=int, default=None, help="user turns (default 50; --smoke 4)")
    ap.add_argument("--max-tokens", type=int, default=None, help="tokens per reply (default 32; --smoke 8)")
    ap.add_argument("--model", default="smollm2-135m-instruct", help="a model in the local cache")
    ap.add_argument("--kv-memory", default="6GiB", help="the KV pool (default 6GiB: the baseline's one-turn sessions, "
                    "resident until --session-ttl, fit without parking, which would cost both ways)")
    ap.add_argument("--session-ttl", type=float, default=600.0,
                    help="seconds an idle HTTP session stays resident (default 600): it must exceed a baseline turn, "
                         "or the chain's session goes too (chain.turns_continued < turns - 1 shows it); past "
                         "--kv-memory the engine parks the baseline's older idle one-turn sessions to host memory")
    ap.add_argument("--smoke", action="store_true", help="a short run that checks the script works (CI)")
    args = ap.parse_args()
    args.turns = args.turns or (4 if args.smoke else 50)
    args.max_tokens = args.max_tokens or (8 if args.smoke else 32)
    result: dict[str, Any] = {"benchmark": "responses_chain", "model": args.model, "turns": args.turns,
                              "max_tokens": args.max_tokens, "commit": commit()}
    from streamserve.models.store import installed

    if installed(args.model) is None:
        why = f"{args.model} is not in the model cache: `streamserve models pull {args.model}`"
        print(f"responses_chain: skipped: {why}", file=sys.stderr)
        print(json.dumps({**result, "skipped": why}))
        return
    result["machine"] = machine()
    result["load_avg_1m_at_start"] = round(os.getloadavg()[0], 2)
    run = asyncio.run(conversation(args))
    chain, base = run["rows"]["chain"], run["rows"]["baseline"]
    continued = sum(r["cached"] == p["input"] + p["output"] for p, r in itertools.pairwise(chain))
    c, b = summary([r["ms"] for r in chain]), summary([r["ms"] for r in base])
    ct, bt = summary([r["ttft"] for r in chain]), summary([r["ttft"] for r in base])
    result |= {
        "chain": c | {"cached_tokens_at_last": chain[-1]["cached"], "input_tokens_at_last": chain[-1]["input"],
                      # turns after the first whose cached_tokens was the previous turn's whole context
                      "turns_continued": continued,
                      "replies_full_length": sum(r["output"] == args.max_tokens for r in chain)},
        "baseline": b | {"prompt_tokens_at_last": base[-1]["input"],
                         "cached_tokens_all_zero": all(r["cached"] == 0 for r in base),
                         "cached_tokens_max": max(r["cached"] for r in base),
                         "replies_full_length": sum(r["output"] == args.max_tokens for r in base)},
        "stateless_over_chain_at_last": round(b["last_ms"] / c["last_ms"], 2),
        # time to the first text: the part of a turn a server that keeps the state can make flat (the rest is the
        # reply's decode, whose steps read the whole context's KV cache in either way)
        "first_text": {"chain": ct, "baseline": bt, "stateless_over_chain_at_last": round(bt["last_ms"] / ct["last_ms"],
                                                                                          2)},
        "same_replies": sum(x["text"] == y["text"] for x, y in zip(chain, base, strict=True)),
        "per_turn_ms": {"chain": [round(r["ms"], 1) for r in chain], "baseline": [round(r["ms"], 1) for r in base]},
        "first_text_ms": {"chain": [round(r["ttft"], 1) for r in chain],
                          "baseline": [round(r["ttft"], 1) for r in base]},
        "engine": run["engine"], "load_avg_1m_at_end": round(os.getloadavg()[0], 2)}
    result["chain_flat"] = c["last10_over_first10"] <= 1.3
    result["ten_x_cheaper"] = result["stateless_over_chain_at_last"] >= 10
    print(json.dumps(result))


if __name__ == "__main__":
    main()
