"""Tiny checkpoints with chat templates, shared by the chat tests (engine, server, client, CLI).

(Helpers, not tests: test modules import them by this module's name, as tests/ is on the path.)

- CHATML: SmolLM2-135M-Instruct's template, which inserts a default system prompt on the first turn.
- GEMMA: Gemma 3's shape: `{{ bos_token }}` first, a system message folded into the first user turn,
  roles alternating, content `| trim`med, `<start_of_turn>model` for the assistant.

`chat_checkpoint(folder, template, script=...)` writes a random qwen3 checkpoint whose byte-level tokenizer
gains the template's special tokens. With `script` (a chain of token ids) the model is made deterministic:
every layer's attention and MLP output is zeroed, so the last hidden state is the current token's embedding,
and the output rows are set so that the greedy next token is a fixed function of the current one (each id of
the chain is followed by the next; every other id by itself). The generation prompt ends in "\\n", so a
script starting at "\\n" decides exactly what every reply says.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import torch
from helpers import make_checkpoint
from tokenizers import Tokenizer as HFTokenizer

from streamserve.tools.random_checkpoint import EOS_ID

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
          "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
          "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

GEMMA = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- set first_user_prefix = messages[0]['content'] + '\n\n' -%}
    {%- set loop_messages = messages[1:] -%}
{%- else -%}
    {%- set first_user_prefix = "" -%}
    {%- set loop_messages = messages -%}
{%- endif -%}
{%- for message in loop_messages -%}
    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}
        {{ raise_exception("Conversation roles must alternate user/assistant/user/assistant/...") }}
    {%- endif -%}
    {%- set role = "model" if message['role'] == 'assistant' else message['role'] -%}
    {{ '<start_of_turn>' + role + '\n' + (first_user_prefix if loop.first else "") }}
    {{- message['content'] | trim -}}
    {{ '<end_of_turn>\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\n' }}
{%- endif -%}"""

SPECIALS = {"chatml": ["<|im_start|>", "<|im_end|>"], "gemma": ["<bos>", "<start_of_turn>", "<end_of_turn>"]}
TEMPLATES = {"chatml": CHATML, "gemma": GEMMA}
IM_START, IM_END = 257, 258  # chatml's special ids (after the byte tokens and <|endoftext|> = 256)
BOS, START_OF_TURN, END_OF_TURN = 257, 258, 259  # gemma's
NL, SPACE, TAB = 10, 32, 9


def write_chat_tokenizer(folder: Path, kind: str, eos: str = "<|im_end|>") -> None:
    """Add the template's special tokens to the folder's byte tokenizer, and the template to its config."""
    tok = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    tok.add_special_tokens(SPECIALS[kind])
    tok.save(str(folder / "tokenizer.json"))
    cfg: dict[str, Any] = {"eos_token": eos, "chat_template": TEMPLATES[kind]}
    if kind == "gemma":
        cfg["bos_token"] = "<bos>"
    (folder / "tokenizer_config.json").write_text(json.dumps(cfg))


def chat_checkpoint(folder: Path, kind: str = "chatml", script: list[int] | None = None, seed: int = 0,
                    eos: str | None = None) -> Path:
    """A tiny qwen3 checkpoint with the `kind` template ("chatml" or "gemma"); `script`: see the docstring."""
    model = make_checkpoint(folder, "qwen3", seed=seed)
    if script is not None:
        with torch.no_grad():
            for layer in model.model.layers:
                layer.self_attn.o_proj.weight.zero_()
                layer.mlp.down_proj.weight.zero_()
            emb, gain = model.model.embed_tokens.weight, model.model.norm.weight
            succ = {t: t for t in range(emb.shape[0])}
            succ.update(itertools.pairwise(script))
            succ[script[-1]] = script[0]  # a permutation: each output row is written once
            for cur, nxt in succ.items():
                model.lm_head.weight[nxt] = 10.0 * gain * emb[cur]
        model.save_pretrained(folder)
    write_chat_tokenizer(folder, kind, eos or ("<|im_end|>" if kind == "chatml" else "<|endoftext|>"))
    return folder


def scripted(text: str) -> list[int]:
    """Byte ids of ASCII text (the byte tokenizer's ids are the byte values)."""
    return list(text.encode())


__all__ = ["BOS", "CHATML", "END_OF_TURN", "EOS_ID", "GEMMA", "IM_END", "IM_START", "NL", "SPACE", "TAB",
           "chat_checkpoint", "scripted", "write_chat_tokenizer"]
