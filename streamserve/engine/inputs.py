"""Checks of what a caller appends, at the call (typed errors; nothing is taken or changed on failure):
token ids against the vocabulary, embedding chunks against the model's hidden size, times."""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from streamserve.errors import (
    ChunkTooLargeError,
    EmbeddingDtypeError,
    EmbeddingShapeError,
    EmptyAppendError,
    InvalidInputError,
    NonFiniteInputError,
    TokenOutOfRangeError,
)


def check_ids(token_ids: Sequence[int] | None, vocab: int) -> list[int]:
    """-> the ids as a list of ints in [0, vocab)."""
    if isinstance(token_ids, (str, bytes)) or not isinstance(token_ids, Sequence):
        raise InvalidInputError("token_ids must be a sequence of ints")
    ids = []
    for i in token_ids:
        if isinstance(i, bool) or not isinstance(i, int):
            raise InvalidInputError(f"token_ids must be ints, got {type(i).__name__}")
        if not 0 <= i < vocab:
            raise TokenOutOfRangeError(f"token id {i} is out of range: the vocabulary has {vocab} ids")
        ids.append(i)
    return ids


def check_embeds(embeds: object, hidden: int, device: torch.device, dtype: torch.dtype,
                 max_rows: int | None = None) -> torch.Tensor:
    """An embedding chunk [T, hidden] of finite floats -> a copy in the engine's dtype, on the host for a host tensor
    and on the engine's device otherwise (never the caller's tensor: the caller may change or free it while the
    chunk waits). Checked after the cast too, so values that overflow the engine's dtype (e.g. 1e6 in fp16) are
    refused as well."""
    if not isinstance(embeds, torch.Tensor):
        raise InvalidInputError(f"embeds must be a torch.Tensor [T, {hidden}], got {type(embeds).__name__}")
    if embeds.dim() != 2 or embeds.shape[1] != hidden:
        raise EmbeddingShapeError(f"embeds must have shape [T, {hidden}] (the model's hidden size), got "
                                  f"{list(embeds.shape)}")
    if not embeds.is_floating_point():
        raise EmbeddingDtypeError(f"embeds must be floating point, got {embeds.dtype}")
    if embeds.shape[0] == 0:
        raise EmptyAppendError("append got an empty chunk of embeddings; send at least one vector")
    if max_rows is not None and embeds.shape[0] > max_rows:
        raise ChunkTooLargeError(f"a chunk of {embeds.shape[0]} vectors is over the limit of {max_rows}; "
                                 "split it into smaller chunks")
    if not bool(torch.isfinite(embeds).all()):
        raise NonFiniteInputError("embeds hold NaN or infinite values")
    # a host tensor stays on the host (cast and copied there): the engine thread moves it to the device at the step
    # (`batch.flat_vectors`), so the caller's thread, the server's event loop, never waits for the device
    out = embeds.detach().to(device=embeds.device if embeds.device.type == "cpu" else device, dtype=dtype, copy=True)
    if not bool(torch.isfinite(out).all()):
        raise NonFiniteInputError(f"embeds overflow the engine's dtype {dtype}")
    return out


def check_time(name: str, t: float | None) -> None:
    if t is not None and (isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t)):
        raise InvalidInputError(f"{name} must be a finite number, got {t!r}")


def check_reply_ids(vocab: int, eos_ids: Sequence[int], max_tokens: int, stop_token_ids: Sequence[int] | None,
                    allowed_token_ids: Sequence[int] | None, draft_token_ids: Sequence[int] | None
                    ) -> tuple[frozenset[int], tuple[int, ...] | None, tuple[int, ...]]:
    """A reply's id arguments (`Session.stream`), checked -> (stop ids: default `eos_ids`; the allowed ids or None;
    the draft, at most max_tokens long)."""
    stop_ids = frozenset(eos_ids if stop_token_ids is None else check_ids(list(stop_token_ids), vocab))
    allowed = None
    if allowed_token_ids is not None:
        allowed = tuple(check_ids(list(allowed_token_ids), vocab))
        if not allowed:
            raise InvalidInputError("allowed_token_ids is empty: a constrained reply needs at least one id")
    return stop_ids, allowed, tuple(check_ids(list(draft_token_ids or ()), vocab))[:max_tokens]
