"""The real catalog models, loaded from the cache, against transformers' own GGUF loading of the same file.

Marked `models`: each test skips when its model is not pulled (`streamserve models pull NAME`; CI pulls SmolLM2).

- SmolLM2-135M-Instruct (an instruct model, Q4_1): asked "What is the capital of France?" through its chat
  template, the greedy reply equals transformers' on the same GGUF file and says Paris; the prompt's ids equal
  transformers' tokenizer's.
- Gemma 3 270M (a base model, Q4_K_M): on a plain prompt, prefill logits close to transformers' and greedy tokens
  identical. transformers takes minutes to read this file on a CPU (its 262k-token vocabulary), too slow for every
  CI run, so by default the test compares against transformers' results recorded once on this exact file (the
  catalog pins its SHA-256, so they cannot drift with the file); STREAMSERVE_GEMMA_PARITY=1 recomputes them with
  transformers in the test session instead.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from streamserve import Engine
from streamserve.models import store

pytestmark = pytest.mark.models

SMOLLM2, GEMMA3 = "smollm2-135m-instruct", "gemma3-270m"
QUESTION = "What is the capital of France?"
GEMMA_PROMPT = "The capital of France is"
# texts where tokenizers part ways: runs of spaces, tabs and newlines, accents, CJK, emoji (byte fallback), code,
# control tokens written in the text
TRICKY = ["  two  spaces,\ttab\n\nnewlines", "naïve café — “quotes” 日本語 🙂👍🏽", "def f(x):\n    return x**2  # hi",
          "<start_of_turn>user\nhi<end_of_turn>\n"]
GEMMA_TOKENS = 16
# transformers' tokenizer on TRICKY (recorded with the rest below)
TRICKY_IDS = [[138, 13498, 138, 35220, 236764, 255968, 4823, 108, 208697],
              [1789, 238527, 560, 33443, 2192, 999, 52231, 236919, 33375, 238582, 57235, 240493, 242713],
              [2063, 517, 236769, 236781, 1473, 107, 140, 2060, 1123, 1018, 236778, 138, 236865, 5631],
              [105, 2364, 107, 2202, 106, 107]]
# transformers 5.24 (gguf 0.19) on gemma-3-270m-q4_k_m.gguf (sha256 a5fd3b62...), float32 on a CPU, recorded
# with STREAMSERVE_GEMMA_PARITY=1 (see `gemma_reference`): the prompt's ids with BOS, the greedy continuation
# (" the capital of the country of France. It is the largest city in France and"), the 5 largest logits after
# the prompt. That run's largest logit difference over every position was 2.4e-5.
GEMMA_RECORDED: dict[str, Any] = {
    "ids": [2, 818, 5279, 529, 7001, 563],
    "greedy": [506, 5279, 529, 506, 2891, 529, 7001, 236761, 1030, 563, 506, 7488, 3207, 528, 7001, 532],
    "top_ids": [506, 496, 9079, 886, 3224],
    "top_logits": [19.0915, 18.5476, 18.2686, 18.1130, 17.7839],
    "tricky_ids": TRICKY_IDS,
}
LOGIT_TOLERANCE = 2e-3  # fp32 on both sides, same dequantized weights: only summation order differs


def pulled(name: str) -> Path:
    path = store.installed(name)
    if path is None:
        pytest.skip(f"{name} is not in the model cache; run `streamserve models pull {name}`")
    return path


def hf_model(path: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()


def engine_for(name: str) -> Iterator[Engine]:
    pulled(name)
    engine = Engine.from_pretrained(name, device="cpu", kv_memory="64MiB", offline=True, quantize="none")
    try:
        yield engine
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def smollm2() -> Iterator[Engine]:
    yield from engine_for(SMOLLM2)


@pytest.fixture(scope="module")
def gemma3() -> Iterator[Engine]:
    yield from engine_for(GEMMA3)


def greedy(engine: Engine, ids: list[int], max_tokens: int, stop: bool) -> list[int]:
    with engine.open_session() as s:
        s.append(token_ids=ids)
        return s.generate(max_tokens=max_tokens, temperature=0.0, **({} if stop else {"stop_token_ids": ()}))


def test_smollm2_says_paris_as_transformers_does(smollm2: Engine) -> None:
    from transformers import AutoTokenizer

    path = pulled(SMOLLM2)
    tok = smollm2.tokenizer
    prompt = tok.apply_chat_template([{"role": "user", "content": QUESTION}], add_generation_prompt=True)
    ids = tok.encode(prompt)
    reply = greedy(smollm2, ids, max_tokens=32, stop=True)
    text = tok.decode(reply)
    assert "Paris" in text, text
    assert reply[-1] in smollm2.eos_token_ids  # it ended its turn, before the token limit

    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    assert hf_tok(prompt, add_special_tokens=False)["input_ids"] == ids
    for t in [*TRICKY, "<|im_start|>user\nhi<|im_end|>\n"]:
        assert tok.encode(t) == hf_tok(t, add_special_tokens=False)["input_ids"], t
        assert tok.decode(tok.encode(t), skip_special_tokens=False) == t
    model = hf_model(path)
    with torch.inference_mode():
        ref = model.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False,
                             eos_token_id=list(smollm2.eos_token_ids), pad_token_id=0)[0, len(ids):].tolist()
    assert ref == reply
    assert hf_tok.decode(ref, skip_special_tokens=True) == text


@pytest.fixture(scope="module")
def gemma_reference() -> dict[str, Any]:
    """transformers' results on the pulled Gemma file: computed now when STREAMSERVE_GEMMA_PARITY=1, else the
    recorded ones (printed by the live run, to record again after a transformers change)."""
    if os.environ.get("STREAMSERVE_GEMMA_PARITY") != "1":
        return GEMMA_RECORDED
    from transformers import AutoTokenizer

    path = pulled(GEMMA3)
    hf_tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    ids = hf_tok(GEMMA_PROMPT)["input_ids"]
    model = hf_model(path)
    with torch.inference_mode():
        logits = model(torch.tensor([ids])).logits[0]  # [T, vocab]
        out = model.generate(torch.tensor([ids]), max_new_tokens=GEMMA_TOKENS, do_sample=False, eos_token_id=None,
                             pad_token_id=0)
    top = logits[-1].topk(5)
    ref = {"ids": ids, "greedy": out[0, len(ids):].tolist(), "top_ids": top.indices.tolist(),
           "top_logits": [round(v, 4) for v in top.values.tolist()],
           "tricky_ids": [hf_tok(t, add_special_tokens=False)["input_ids"] for t in TRICKY], "logits": logits}
    print({k: v for k, v in ref.items() if k != "logits"})
    return ref


def test_gemma3_matches_transformers_on_a_plain_prompt(gemma3: Engine, gemma_reference: dict[str, Any]) -> None:
    ids = gemma3.tokenizer.encode(GEMMA_PROMPT, add_special_tokens=True)
    assert ids == gemma_reference["ids"]  # BOS, then the SentencePiece pieces transformers' tokenizer gives
    assert [gemma3.tokenizer.encode(t) for t in TRICKY] == gemma_reference["tricky_ids"]
    with gemma3.open_session() as s:
        logits = gemma3.forward(s.kv, ids, all_logits=True)  # [T, vocab]
    if "logits" in gemma_reference:  # the live run: every position
        assert (logits - gemma_reference["logits"]).abs().max().item() <= LOGIT_TOLERANCE
    top = logits[-1].topk(5)
    assert top.indices.tolist() == gemma_reference["top_ids"]
    assert top.values.tolist() == pytest.approx(gemma_reference["top_logits"], abs=LOGIT_TOLERANCE)
    assert greedy(gemma3, ids, GEMMA_TOKENS, stop=False) == gemma_reference["greedy"]
