"""What weight-only quantization costs in accuracy: the quantized engine against the float one, side by side.

    python benchmarks/quant_accuracy.py [--models default smollm2-135m-instruct] [--quick]

For each model and each mode (none = float32 reference, int8, int4, and auto for a GGUF file: its own 4-bit
codes), in one run:
- perplexity on a fixed KJV passage (Ecclesiastes 3:1-8 and Psalm 23; public domain) and on a fixed English
  text (written for this benchmark), teacher-forced in one forward over the whole text;
- greedy agreement: the float model's greedy continuation of a prompt, and the share of its positions where the
  quantized model (fed the same prefix) picks the same token (top-1 agreement; one near-tie does not shift the
  rest as free-running generation would);
- weight bytes a decode token reads (models/quantize.weight_bytes).
The default model was trained on the whole KJV less a random 2% of chapters, so the passage is in-domain text,
not necessarily held out: the figure that matters is the quantized model's perplexity next to the float one's.
The last line printed is one JSON object with every figure.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

import torch

from streamserve import Engine
from streamserve.models import store
from streamserve.models.quantize import weight_bytes

KJV = ("To every thing there is a season, and a time to every purpose under the heaven: A time to be born, and a "
       "time to die; a time to plant, and a time to pluck up that which is planted; A time to kill, and a time to "
       "heal; a time to break down, and a time to build up; A time to weep, and a time to laugh; a time to mourn, "
       "and a time to dance; A time to cast away stones, and a time to gather stones together; a time to embrace, "
       "and a time to refrain from embracing; A time to get, and a time to lose; a time to keep, and a time to "
       "cast away; A time to rend, and a time to sew; a time to keep silence, and a time to speak; A time to love, "
       "and a time to hate; a time of war, and a time of peace.\n\nThe LORD is my shepherd; I shall not want. He "
       "maketh me to lie down in green pastures: he leadeth me beside the still waters. He restoreth my soul: he "
       "leadeth me in the paths of righteousness for his name's sake. Yea, though I walk through the valley of "
       "the shadow of death, I will fear no evil: for thou art with me; thy rod and thy staff they comfort me.")
ENGLISH = ("The morning train was late again, so Maria walked the last two miles to the workshop along the canal. "
           "She liked the quiet: a heron standing in the reeds, the smell of wet stone, a boat engine coughing "
           "somewhere behind the bridge. At the workshop the kettle was already on. Tom had laid out the parts "
           "for the new pump on the long bench, each bolt in its own tray, and he was reading the drawings with "
           "a pencil behind his ear. They spent the morning fitting the housing and the afternoon chasing a leak "
           "that turned out to be a cracked washer worth less than a cup of tea. By six the pump ran smoothly, and "
           "they sat outside on the step, tired and pleased, watching the light go orange over the water.")
PROMPTS = {"default": "And God said, Let there be light: and there was light. And God saw the light,",
           "other": "User: Tell me about the history of bridges.\nAssistant:"}


def perplexity(engine: Engine, text: str) -> float:
    ids = engine.tokenizer.encode(text)
    with engine.open_session() as s:
        logits = engine.forward(s.kv, ids, all_logits=True)  # [T, V] fp32
    nll = torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:]))
    return math.exp(nll.item())


def greedy(engine: Engine, prompt: list[int], n: int) -> list[int]:
    with engine.open_session() as s:
        s.append(token_ids=prompt)
        return s.generate(max_tokens=n, temperature=0.0, stop_token_ids=())


def picks(engine: Engine, prompt: list[int], reference: list[int]) -> list[int]:
    """The model's greedy pick at each position of `reference`, given the prompt and the reference before it."""
    ids = prompt + reference
    with engine.open_session() as s:
        logits = engine.forward(s.kv, ids, all_logits=True)
    return logits[len(prompt) - 1:-1].argmax(dim=-1).tolist()


def run_model(name: str, modes: list[str], tokens: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    ref_tokens: list[int] = []
    prompt: list[int] = []
    for mode in modes:
        engine = Engine.from_pretrained(name, device="cpu", kv_memory="256MiB", quantize=mode, offline=True,
                                        cpu_compile="off")  # the weight format's accuracy, not the compiled step's
        try:
            if mode == "none":
                prompt = engine.tokenizer.encode(PROMPTS.get(name, PROMPTS["other"]))
                ref_tokens = greedy(engine, prompt, tokens)
            got = picks(engine, prompt, ref_tokens)
            agree = sum(a == b for a, b in zip(got, ref_tokens, strict=True)) / len(ref_tokens)
            wb = weight_bytes(engine.model)
            row = {"ppl_kjv": round(perplexity(engine, KJV), 3), "ppl_english": round(perplexity(engine, ENGLISH), 3),
                   "greedy_agreement": round(agree, 4), "weight_mb": round((wb["quantized"] + wb["float"]) / 1e6, 1),
                   "quantization": engine.stats()["quantization"]}
        finally:
            engine.shutdown()
        out[mode] = row
        print(f"{name:24s} {mode:5s} ppl KJV {row['ppl_kjv']:8.3f}  ppl English {row['ppl_english']:8.3f}  "
              f"greedy agreement {row['greedy_agreement']:.3f}  weights {row['weight_mb']} MB", flush=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["default", "smollm2-135m-instruct"])
    p.add_argument("--tokens", type=int, default=64, help="greedy tokens compared")
    p.add_argument("--quick", action="store_true", help="the default model only, 16 tokens (tests)")
    args = p.parse_args()
    models = ["default"] if args.quick else args.models
    tokens = 16 if args.quick else args.tokens
    result: dict[str, Any] = {"benchmark": "quant_accuracy", "tokens": tokens, "models": {}}
    for name in models:
        gguf = name != "default" and str(store.resolve_model(name, offline=True) or "").endswith(".gguf")
        if name != "default" and store.installed(name) is None:
            print(f"{name} is not pulled (streamserve models pull {name}): left out", file=sys.stderr)
            continue
        modes = ["none", "int8", "int4"] + (["auto"] if gguf else [])
        result["models"][name] = run_model(name, modes, tokens)
    for rows in result["models"].values():  # the ratios a reader wants: quantized ppl over float ppl
        base = rows["none"]
        for row in rows.values():
            row["ppl_kjv_ratio"] = round(row["ppl_kjv"] / base["ppl_kjv"], 4)
            row["ppl_english_ratio"] = round(row["ppl_english"] / base["ppl_english"], 4)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
