"""`Session`: a persistent conversation whose KV cache stays on the device between chunks.

Each `append` runs only the new tokens against the cached prefix. Generated tokens join the session
too; the last one enters the KV lazily, with the next append or generate, so a reply costs exactly one
forward per generated token.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING

import torch

from streamserve.config import SAMPLING_DEFAULTS as SD
from streamserve.engine.sampling import check_sampling, sample
from streamserve.errors import (
    ContextLengthError,
    EmptyAppendError,
    InvalidInputError,
    SessionClosedError,
    TokenOutOfRangeError,
)
from streamserve.sessions import ContiguousKVCache

if TYPE_CHECKING:
    from streamserve.engine.engine import Engine


class Session:
    def __init__(self, engine: Engine, kv: ContiguousKVCache) -> None:
        self.id = secrets.token_urlsafe(16)
        self.engine = engine
        self.kv = kv
        self.token_ids: list[int] = []  # everything appended or generated, in order
        self._pending: list[int] = []  # the tail of token_ids not yet in the KV cache
        self._logits: torch.Tensor | None = None  # [V] after the last token in the KV (if nothing pending)
        self._generator = torch.Generator(device=engine.device)
        self._generator.seed()
        self.closed = False

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.token_ids)

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open a new one")

    def append(self, text: str | None = None, token_ids: Sequence[int] | None = None) -> int:
        """Append a chunk of text or token ids; returns the number of tokens appended.

        The first text chunk of a session is encoded with the tokenizer's special tokens (e.g. BOS).
        """
        self._check_open()
        if (text is None) == (token_ids is None):
            raise InvalidInputError("append takes exactly one of text= or token_ids=")
        if text is not None:
            if not isinstance(text, str):
                raise InvalidInputError(f"text must be a str, got {type(text).__name__}")
            ids = self.engine.tokenizer.encode(text, add_special_tokens=not self.token_ids)
        else:
            ids = self._check_ids(token_ids)
        if not ids:
            raise EmptyAppendError("append got an empty chunk; send at least one token or character")
        self._run(ids)
        return len(ids)

    def _check_ids(self, token_ids: Sequence[int] | None) -> list[int]:
        if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
            raise InvalidInputError("token_ids must be a sequence of ints")
        vocab = self.engine.config.vocab_size
        ids = []
        for i in token_ids:
            if isinstance(i, bool) or not isinstance(i, int):
                raise InvalidInputError(f"token_ids must be ints, got {type(i).__name__}")
            if not 0 <= i < vocab:
                raise TokenOutOfRangeError(f"token id {i} is out of range: the vocabulary has {vocab} ids")
            ids.append(i)
        return ids

    def _run(self, ids: list[int]) -> None:
        """Forward pending + ids; on success they are committed and the logits of the last one kept."""
        chunk = self._pending + ids
        limit = self.engine.config.max_position_embeddings
        if self.kv.length + len(chunk) > limit:
            raise ContextLengthError(f"appending {len(ids)} tokens to a session of {len(self.token_ids)} "
                                     f"would exceed the model's context of {limit}; rewind or open a new session")
        self._logits = self.engine.forward(self.kv, chunk)
        self.token_ids.extend(ids)
        self._pending = []

    def iter_generate(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature,
                      top_p: float = SD.top_p, seed: int | None = SD.seed,
                      stop_token_ids: Sequence[int] | None = None) -> Iterator[int]:
        """Yield generated token ids one by one. Stops after `max_tokens`, at a stop token (yielded), or
        at the model's context. `stop_token_ids=None` means the model's EOS ids; `()` never stops early."""
        self._check_open()
        check_sampling(max_tokens, temperature, top_p)
        if not self.token_ids:
            raise InvalidInputError("generate needs at least one appended token first")
        stops = set(self.engine.eos_token_ids if stop_token_ids is None else stop_token_ids)
        gen = self._generator if seed is None else torch.Generator(device=self.engine.device).manual_seed(seed)
        return self._generate(max_tokens, temperature, top_p, gen, stops)

    def _generate(self, max_tokens: int, temperature: float, top_p: float, gen: torch.Generator,
                  stops: set[int]) -> Iterator[int]:
        limit = self.engine.config.max_position_embeddings
        for _ in range(max_tokens):
            if len(self.token_ids) >= limit:  # the context is full: the reply ends here
                return
            if self._pending:
                self._check_open()
                self._logits = self.engine.forward(self.kv, self._pending)
                self._pending = []
            assert self._logits is not None
            tok = sample(self._logits, temperature, top_p, gen)
            self.token_ids.append(tok)
            self._pending = [tok]
            yield tok
            if tok in stops:
                return

    def generate(self, max_tokens: int = SD.max_tokens, temperature: float = SD.temperature,
                 top_p: float = SD.top_p, seed: int | None = SD.seed,
                 stop_token_ids: Sequence[int] | None = None) -> list[int]:
        """Generate a reply; the tokens are returned and also become part of the session."""
        return list(self.iter_generate(max_tokens, temperature, top_p, seed, stop_token_ids))

    def close(self) -> None:
        """Free the session's KV memory. Closing twice is harmless."""
        if not self.closed:
            self.closed = True
            self.kv.free()
            self.engine._release(self)
