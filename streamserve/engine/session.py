"""`Session`: a persistent conversation whose KV cache stays on the device between chunks.

Each `append` runs only the new tokens against the cached prefix. Generated tokens join the session
too; the last one enters the KV lazily, with the next append or generate, so a reply costs exactly one
forward per generated token. `token_ids` is the one record of the session; the tokens not yet in the
KV are always `token_ids[kv.length:]`, so an exception or interrupt anywhere leaves the two consistent.
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
    def __init__(self, engine: Engine, kv: ContiguousKVCache, seed: int | None = None) -> None:
        self.id = secrets.token_urlsafe(16)
        self.engine = engine
        self.kv = kv
        self.token_ids: list[int] = []  # everything appended or generated, in order
        self._logits: torch.Tensor | None = None  # [V] after the first `_logits_at` tokens
        self._logits_at = -1
        self._generator = torch.Generator(device=engine.device)
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self.closed = False

    @property
    def _pending(self) -> list[int]:
        """The tokens of the session not yet in the KV cache (at most the last generated one)."""
        return self.token_ids[self.kv.length:]

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.token_ids)

    def _check_open(self) -> None:
        if self.closed:
            raise SessionClosedError(f"session {self.id} is closed; open a new one")

    def append(self, text: str | None = None, token_ids: Sequence[int] | None = None,
               add_special_tokens: bool | None = None) -> int:
        """Append a chunk of text or token ids; returns the number of tokens appended.

        `add_special_tokens` (text only): run the tokenizer's post-processor (e.g. add BOS). None means
        yes for the first chunk of a session and no after it; pass False for chat-templated text, which
        carries its own special tokens.
        """
        self._check_open()
        if (text is None) == (token_ids is None):
            raise InvalidInputError("append takes exactly one of text= or token_ids=")
        if text is not None:
            if not isinstance(text, str):
                raise InvalidInputError(f"text must be a str, got {type(text).__name__}")
            special = not self.token_ids if add_special_tokens is None else add_special_tokens
            ids = self.engine.tokenizer.encode(text, add_special_tokens=special)
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
        """Forward pending + ids; on success they join the session and the logits of the last one are kept."""
        chunk = self._pending + ids
        limit = self.engine.config.max_position_embeddings
        if self.kv.length + len(chunk) > limit:
            raise ContextLengthError(f"appending {len(ids)} tokens to a session of {len(self.token_ids)} "
                                     f"would exceed the model's context of {limit}; rewind or open a new session")
        logits = self.engine.forward(self.kv, chunk)
        self.token_ids.extend(ids)
        self._logits, self._logits_at = logits, self.kv.length

    def _catch_up(self) -> torch.Tensor:
        """The logits after the whole session, running the pending token first if there is one."""
        if not self._pending and self._logits_at != len(self.token_ids):
            # an interrupt landed between a forward and its bookkeeping: run the last token again
            self.kv.truncate(self.kv.length - 1)
        if self._pending:
            self._logits = self.engine.forward(self.kv, self._pending)
            self._logits_at = self.kv.length
        assert self._logits is not None
        return self._logits

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
            self._check_open()
            if len(self.token_ids) >= limit:  # the context is full: the reply ends here
                return
            tok = sample(self._catch_up(), temperature, top_p, gen)
            self.token_ids.append(tok)  # pending from here on: it enters the KV with the next forward
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
