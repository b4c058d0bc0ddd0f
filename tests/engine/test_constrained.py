"""Constrained decoding (`Session.stream(allowed_token_ids=...)`, the robot policy's action tokens): a logits mask in
the sampler, so a reply never emits another id — greedy, sampled, with a drafter on — and a greedy constrained reply
is the argmax over the allowed ids of the transformers model's logits."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from helpers import random_ids

from streamserve.errors import InvalidInputError, TokenOutOfRangeError


def tokens(stream: Any) -> list[int]:
    return [t for d in stream for t in d.token_ids]


def reference(hf: torch.nn.Module, ids: list[int], allowed: list[int], n: int) -> list[int]:
    """Greedy over `allowed` only, from the transformers model's full forward at each step."""
    out, keep = list(ids), torch.tensor(allowed)
    with torch.no_grad():
        for _ in range(n):
            logits = hf(torch.tensor([out])).logits[0, -1].float()
            out.append(int(keep[torch.argmax(logits[keep])]))
    return out[len(ids):]


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_greedy_constrained_reply_is_the_argmax_over_the_allowed_ids(engines, checkpoints, arch: str) -> None:
    engine, (_, hf) = engines[arch], checkpoints[arch]
    prompt = random_ids(23, seed=7)
    allowed = sorted(set(random_ids(11, seed=8)))  # odd-sized, unsorted draw
    with engine.open_session() as s:
        s.append(token_ids=prompt)
        got = tokens(s.stream(max_tokens=12, temperature=0.0, stop_token_ids=(), allowed_token_ids=allowed))
    assert got == reference(hf, prompt, allowed, 12)
    assert set(got) <= set(allowed)


def test_sampled_and_drafted_replies_stay_inside_the_allowed_ids(engines) -> None:
    engine = engines["qwen3_moe"]
    base = random_ids(9, seed=3)
    prompt = base * 5  # repetitive: the n-gram drafter would draft from it if it were allowed to
    allowed = [base[0], base[4], 5, 17, 31]
    with engine.open_session(drafter="ngram") as s:
        s.append(token_ids=prompt)
        for seed in range(4):
            toks = tokens(s.stream(max_tokens=20, temperature=1.5, top_p=1.0, seed=seed, stop_token_ids=(),
                                   allowed_token_ids=allowed))
            assert len(toks) == 20 and set(toks) <= set(allowed), toks
        # the same session still replies unconstrained afterwards (the mask belongs to one reply)
        free = s.generate(max_tokens=30, stop_token_ids=())
        assert not set(free) <= set(allowed)


def test_bad_allowed_ids_are_refused_and_change_nothing(engines) -> None:
    engine = engines["llama"]
    with engine.open_session() as s:
        s.append(token_ids=random_ids(5, seed=1))
        n = len(s)
        with pytest.raises(InvalidInputError):
            s.stream(max_tokens=2, allowed_token_ids=[])
        with pytest.raises(TokenOutOfRangeError):
            s.stream(max_tokens=2, allowed_token_ids=[engine.config.vocab_size])
        with pytest.raises(InvalidInputError):
            s.stream(max_tokens=2, allowed_token_ids=["a"])  # type: ignore[list-item]
        assert len(s) == n
        assert len(s.generate(max_tokens=3, stop_token_ids=())) == 3
