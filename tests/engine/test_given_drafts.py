"""A caller's draft of a reply (`Session.stream(draft_token_ids=...)`, a robot's last chunk shifted) and the reply that
starts in the forward of the chunks appended just before it: the tokens never change, only the forwards they take
(counted by the reply's `usage["forwards"]`, not timed)."""

from __future__ import annotations

from typing import Any

import pytest
from helpers import random_ids

from streamserve.errors import TokenOutOfRangeError

H_D = 8  # a chunk of actions: H steps x D dimensions


def reply(s: Any, draft: list[int] | None, allowed: list[int], temperature: float = 0.0,
          seed: int | None = None) -> tuple[list[int], dict[str, int]]:
    st = s.stream(max_tokens=H_D, temperature=temperature, seed=seed, stop_token_ids=(), allowed_token_ids=allowed,
                  draft_token_ids=draft, detokenize=False)
    got = [t for d in st for t in d.token_ids]
    assert st.finish_reason == "length" and st.text == ""  # ids only
    return got, st.usage


@pytest.mark.parametrize("arch", ["llama", "qwen3_moe"])
def test_a_right_draft_makes_the_chunk_in_the_appends_own_forward(engines, arch: str) -> None:
    engine = engines[arch]
    prompt, allowed = random_ids(19, seed=5), sorted(set(random_ids(13, seed=6)))
    with engine.open_session() as plain:
        plain.submit_chunk(token_ids=prompt)  # not waited for: the reply queues right behind the chunk
        want, used = reply(plain, None, allowed)
        assert used["forwards"] == H_D  # the first token from the append's forward, then one forward per token
        held = list(plain.token_ids)
    with engine.open_session() as drafted:
        drafted.submit_chunk(token_ids=prompt)
        got, used = reply(drafted, want, allowed)
        assert got == want and list(drafted.token_ids) == held
        assert used["forwards"] == 1 and used["accepted_tokens"] == used["draft_tokens"] == H_D - 1
    # after a blocking append the reply starts one step later (a step that only samples): two forwards
    for s in (plain, drafted):
        s.close()
    with engine.open_session() as a, engine.open_session() as b:
        a.append(token_ids=prompt)
        want, _ = reply(a, None, allowed)
        b.append(token_ids=prompt)
        got, used = reply(b, want, allowed)
        assert got == want and used["forwards"] == 2 and used["accepted_tokens"] == H_D - 2


def test_wrong_and_partial_drafts_change_nothing_on_a_rolling_episode(engines) -> None:
    """A recorded episode on a rolling window (the policy endpoint's session): each tick appends a state chunk and
    asks for a constrained chunk, drafted with the last chunk shifted by one step. Every reply, and the session,
    equal the undrafted run's, greedy and sampled; the forwards never exceed the undrafted ones."""
    engine = engines["llama"]
    allowed = sorted(set(random_ids(9, seed=11)))
    ticks = [random_ids(7, seed=100 + t) for t in range(14)]
    for temperature, seed in ((0.0, None), (0.9, 3)):
        runs, forwards = [], []
        for drafting in (False, True):
            with engine.open_session(window=48, sinks=4, positions="rolling", seed=seed) as s:
                out, fw, last = [], 0, None
                for state in ticks:
                    s.submit_chunk(token_ids=state, kind="state")
                    draft = None if not drafting or last is None else last[2:] + last[-2:]  # shifted a step (D=2)
                    got, used = reply(s, draft, allowed, temperature)
                    out.append(got)
                    fw += used["forwards"]
                    last = got
                runs.append((out, list(s.token_ids)))
                forwards.append(fw)
        assert runs[0] == runs[1], f"temperature {temperature}"
        assert forwards[1] < forwards[0] == H_D * len(ticks)  # some drafts were right (deterministic: seeded)


def test_a_bad_draft_is_refused(engines) -> None:
    engine = engines["llama"]
    with engine.open_session() as s:
        s.append(token_ids=random_ids(5, seed=1))
        with pytest.raises(TokenOutOfRangeError):
            s.stream(max_tokens=2, draft_token_ids=[engine.config.vocab_size])
        assert len(s.generate(max_tokens=3, stop_token_ids=())) == 3
