"""Tokenizer: round trips, UTF-8-safe incremental detokenization, chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import write_byte_tokenizer

from streamserve.errors import ChatTemplateError
from streamserve.models import Tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture()
def tok(tmp_path: Path) -> Tokenizer:
    write_byte_tokenizer(tmp_path)
    return Tokenizer.from_dir(tmp_path)


def test_round_trip_and_eos(tok: Tokenizer) -> None:
    text = "In the beginning — Ωμέγα 🙂 終わり"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_token_ids == (256,)


def test_incremental_detokenizer_never_emits_broken_utf8(tok: Tokenizer) -> None:
    text = "a🙂b€ç終\n 🇫🇷!"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode())  # one id a byte: multi-byte characters span several tokens
    d = tok.detokenizer()
    pieces = [d.push([i]) for i in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + d.flush() == text
    assert sum(1 for p in pieces if p) < len(ids)  # some tokens had to wait for the rest of a character


def test_flush_reports_an_incomplete_character(tok: Tokenizer) -> None:
    d = tok.detokenizer()
    ids = tok.encode("x🙂")
    assert d.push(ids[:1]) == "x"
    assert d.push(ids[1:3]) == ""  # half a character: held back
    assert d.flush() == "\ufffd"


def test_detokenizer_keeps_bounded_memory(tok: Tokenizer) -> None:
    d = tok.detokenizer()
    for _ in range(5000):
        d.push(tok.encode("ab"))
    assert len(d._ids) < 8


def test_chat_template_renders(tmp_path: Path) -> None:
    write_byte_tokenizer(tmp_path)
    cfg = json.loads((tmp_path / "tokenizer_config.json").read_text())
    cfg["chat_template"] = CHATML
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    tok = Tokenizer.from_dir(tmp_path)
    out = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"


def with_jinja_template(folder: Path, template: str) -> Tokenizer:
    """The byte tokenizer with a chat template in chat_template.jinja (where transformers 5 saves it)."""
    write_byte_tokenizer(folder)
    (folder / "chat_template.jinja").write_text(template)
    return Tokenizer.from_dir(folder)


def test_chat_template_from_jinja_file_and_raise_exception(tmp_path: Path) -> None:
    tok = with_jinja_template(tmp_path, (
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be user') }}{% endif %}"
        "{{ messages[0]['content'] | tojson }}"))
    assert tok.apply_chat_template([{"role": "user", "content": "é"}]) == '"é"'
    with pytest.raises(ChatTemplateError, match="first message must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])


def test_no_chat_template_is_a_typed_error(tok: Tokenizer) -> None:
    with pytest.raises(ChatTemplateError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


def test_detokenizer_context_keeps_sentencepiece_spaces(tmp_path: Path) -> None:
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers

    raw = HFTokenizer(models.WordLevel({"▁In": 0, "▁the": 1, "▁beginning": 2, "<unk>": 3}, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Metaspace()
    raw.decoder = decoders.Metaspace()
    raw.save(str(tmp_path / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path)
    assert tok.decode([1]) == "the"  # alone, the decoder strips the leading space
    d = tok.detokenizer(context=[0])
    assert d.push([1]) + d.push([2]) == " the beginning"


def test_chat_templates_may_use_loop_controls_and_tojson_options(tmp_path: Path) -> None:
    tok = with_jinja_template(tmp_path, (
        "{% for m in messages %}{% if m['role'] == 'system' %}{% continue %}{% endif %}{{ m['content'] }}"
        "{% if loop.index > 2 %}{% break %}{% endif %}{% endfor %}{{ {'b': 1, 'a': 2} | tojson(sort_keys=True) }}"))
    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "u1"},
            {"role": "assistant", "content": "a1"}, {"role": "user", "content": "u2"}]
    assert tok.apply_chat_template(msgs) == 'u1a1{"a": 2, "b": 1}'
