"""Tokenizer of a checkpoint: `tokenizer.json` through the `tokenizers` package, the chat template of
`tokenizer_config.json` (or `chat_template.jinja`) rendered with jinja2, and incremental detokenization.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

from jinja2 import Template, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from streamserve.errors import ChatTemplateError, ModelLoadError


def _token_text(tok: Any) -> str | None:
    """tokenizer_config.json writes special tokens as a string or as {"content": ...}."""
    return tok.get("content") if isinstance(tok, dict) else tok


def byte_level_chars() -> list[str]:
    """The byte-level BPE character of each byte value 0..255 (GPT-2's printable remapping): printable Latin-1
    bytes stand for themselves, the others for the code points from 256 on, in byte order."""
    keep = {*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)}
    extra = iter(range(256, 512))
    return [chr(b) if b in keep else chr(next(extra)) for b in range(256)]


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


# the environment transformers renders chat templates in: loop controls, its tojson signature
_ENV = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
_ENV.filters["tojson"] = _tojson
_ENV.globals.update(raise_exception=_raise_exception, strftime_now=lambda fmt: datetime.now().strftime(fmt))


@functools.lru_cache(maxsize=16)
def _compiled(template: str) -> Template:
    """A chat template compiled once (~10 ms each time otherwise; a chat turn renders three times)."""
    return _ENV.from_string(template)


class Tokenizer:
    def __init__(self, tok: HFTokenizer, config: dict[str, Any], chat_template: str | None) -> None:
        self._tok = tok
        self.config = config
        self.chat_template = chat_template
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.eos_token_ids: tuple[int, ...] = tuple(
            i for i in (tok.token_to_id(self.eos_token),) if i is not None) if self.eos_token else ()

    @classmethod
    def from_dir(cls, folder: Path) -> Tokenizer:
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ModelLoadError(f"{folder} has no tokenizer.json (the `tokenizers` format is required)")
        tok = HFTokenizer.from_file(str(path))
        cfg_path = folder / "tokenizer_config.json"
        config = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = config.get("chat_template")
        if isinstance(template, list):  # [{"name": "default", "template": ...}, ...]
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.exists():
            template = jinja_file.read_text()
        return cls(tok, config, template)

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        """Text -> ids. `add_special_tokens` runs the tokenizer's post-processor (e.g. a BOS token)."""
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def vocab(self) -> dict[str, int]:
        """Every token (special ones included) and its id: two tokenizers are interchangeable iff equal."""
        return self._tok.get_vocab(with_added_tokens=True)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[dict[str, Any]], add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}]) with the checkpoint's chat template."""
        if not self.chat_template:
            raise ChatTemplateError("this checkpoint has no chat template (tokenizer_config.json has no "
                                    "chat_template); append plain text instead")
        try:
            return _compiled(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except TemplateError as e:
            raise ChatTemplateError(f"the chat template failed to render: {e}") from None

    def detokenizer(self, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> IncrementalDetokenizer:
        """A detokenizer for a stream that follows `context` (the ids before it, e.g. the session so far)."""
        return IncrementalDetokenizer(self, skip_special_tokens, context)


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character.

    A token may end in the middle of a multi-byte character (byte-level BPE); decoding then ends in
    U+FFFD, and the text is held back until the following tokens complete it. Decoding a short window
    of recent tokens (from `prefix` on) keeps each step O(1) and lets decoders that strip leading
    spaces (SentencePiece's Metaspace) see the context they need.
    """

    CONTEXT_TOKENS = 5  # context ids decoded with the first tokens, so decoders see what precedes them

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool = True, context: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context[-self.CONTEXT_TOKENS:]) if context else []
        self._prefix = 0  # start of the decode window
        self._read = len(self._ids)  # tokens before this have been emitted as text (or are context)

    def push(self, ids: Iterable[int]) -> str:
        """Add token ids; return the new complete text (possibly "")."""
        self._ids.extend(ids)
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        if len(text) > len(prefix_text) and not text.endswith("\ufffd"):
            self._prefix, self._read = self._read, len(self._ids)
            del self._ids[:self._prefix]  # keep only the window: bounded memory on endless streams
            self._read -= self._prefix
            self._prefix = 0
            return text[len(prefix_text):]
        return ""

    def flush(self) -> str:
        """At the end of a stream: whatever is held back, with U+FFFD for bytes that never completed."""
        prefix_text = self._tok.decode(self._ids[self._prefix:self._read], self._skip)
        text = self._tok.decode(self._ids[self._prefix:], self._skip)
        self._prefix = self._read = len(self._ids)
        return text[len(prefix_text):]
