"""Speculative decoding: lossless against plain decoding, the sampled path's distribution, and the
session staying exact through rewind, cancel and snapshot in the middle of speculation."""

from __future__ import annotations

import pytest
import torch
from helpers import greedy, random_ids

from streamserve.engine.drafters import UnknownDrafterError
from streamserve.engine.drafters.ngram import NgramIndex
from streamserve.engine.drafters.verify import target_probs, verify
from streamserve.engine.sampling import Draws
from streamserve.errors import InvalidInputError


def repetitive(n: int, seed: int) -> list[int]:
    base = random_ids(9, seed=seed)
    return (base * (n // 9 + 1))[:n]


PROMPTS = [random_ids(30, seed=100), repetitive(40, 101), random_ids(7, seed=102) + repetitive(27, 103)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "llama"])
def test_greedy_output_with_the_ngram_drafter_is_identical(engines, arch: str) -> None:
    engine = engines[arch]
    for p in PROMPTS:
        plain = greedy(engine, p, 40)
        with engine.open_session(drafter="ngram") as s:
            s.append(token_ids=p)
            assert s.generate(max_tokens=40, stop_token_ids=()) == plain
    st = engine.stats()["speculative"]["ngram"]
    assert st["verifications"] > 0 and st["accepted"] > 0  # it did draft, and drafts were accepted


def test_windowed_and_stopping_replies_are_identical_too(engines) -> None:
    engine = engines["qwen3_moe"]
    p = repetitive(50, 104)
    for kw in ({"window": 24, "sinks": 4}, {"window": 24, "sinks": 4, "positions": "absolute"}):
        plain = greedy(engine, p, 60, **kw)
        with engine.open_session(drafter="ngram", **kw) as s:
            s.append(token_ids=p)
            assert s.generate(max_tokens=60, stop_token_ids=()) == plain
    stop = plain[17]
    with engine.open_session() as s:
        s.append(token_ids=p)
        expected = s.generate(max_tokens=60, stop_token_ids=[stop])
    with engine.open_session(drafter="ngram") as s:
        s.append(token_ids=p)
        assert s.generate(max_tokens=60, stop_token_ids=[stop]) == expected  # never past a stop token
        assert len(s.token_ids) == len(p) + len(expected) and s.kv.length == len(s.token_ids) - 1
    engine.check_integrity()


def test_seeded_sampling_repeats_and_ngram_drafts_sample_the_tokens_plain_decoding_does(engines) -> None:
    """Draws are keyed by position: a seeded reply repeats exactly whatever the drafting decisions (which
    follow timings), and with deterministic drafts it samples the same tokens as without drafting."""
    engine = engines["qwen3"]

    def run(drafter: str) -> list[int]:
        with engine.open_session(drafter=drafter, seed=5) as s:
            s.append(token_ids=repetitive(30, 105))
            return s.generate(max_tokens=40, temperature=0.8, top_k=20, stop_token_ids=())

    plain = run("none")
    assert run("ngram") == run("ngram") == plain


def tv(counts: torch.Tensor, p: torch.Tensor) -> float:
    return 0.5 * float((counts / counts.sum() - p).abs().sum())


@pytest.mark.parametrize("with_probs", [False, True])
def test_sampled_verification_follows_the_target_distribution(with_probs: bool) -> None:
    """On a 6-token vocabulary: the first emitted token is distributed as the target's row 0, and given that
    it is the first draft, the second as row 1; the distance to the target shrinks with more samples. Drafts
    are fixed (a deterministic drafter) or drawn from the drafter's own distributions q."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 6, generator=g) * 1.5  # target rows for k = 2 drafts
    q = torch.softmax(torch.randn(2, 6, generator=g), dim=-1) if with_probs else None
    p = target_probs(logits, 0.9, 0, 1.0)
    distances = []
    for n in (400, 6400):
        first, second = torch.zeros(6), torch.zeros(6)
        for j in range(n):
            drafts = [2, 4] if q is None else [int(torch.multinomial(row, 1, generator=g)) for row in q]
            out = verify(logits, drafts, q, 0.9, 1.0, 0, Draws(n * 100_000 + j, torch.device("cpu")), 0)
            first[out[0]] += 1
            if out[0] == drafts[0]:
                second[out[1]] += 1
        distances.append((tv(first, p[0]), tv(second, p[1])))
    (a0, _), (b0, b1) = distances
    assert b0 < 0.03 and b1 < 0.05 and b0 < a0 + 0.01


def test_greedy_verification_is_the_argmax_chain() -> None:
    logits = torch.full((4, 5), -10.0)
    for row, best in enumerate([1, 3, 0, 4]):
        logits[row, best] = 10.0
    d = Draws(0, torch.device("cpu"))
    assert verify(logits, [1, 3, 0], None, 0.0, 1.0, 0, d, 0) == [1, 3, 0, 4]  # all accepted, then the bonus
    assert verify(logits, [1, 2, 0], None, 0.0, 1.0, 0, d, 0) == [1, 3]  # the correction at the first miss
    assert verify(logits, [4, 3, 0], None, 0.0, 1.0, 0, d, 0) == [1]


def test_the_ngram_index_finds_the_longest_earlier_match_incrementally() -> None:
    idx = NgramIndex(max_n=3)
    history = [1, 2, 3, 4, 9, 2, 3, 4, 7, 1, 2, 3]
    idx.sync(history[:5], 0)
    idx.sync(history, 0)  # only the new tokens are indexed
    assert idx.lookup(3) == [4, 9, 2]  # the suffix "1 2 3" occurred at the start, followed by "4 9 2"
    idx.sync([*history, 4], 0)
    assert idx.lookup(2) == [7, 1]  # "3 4": its latest earlier occurrence (positions 6-7) wins
    idx.sync([5, 6, 5], 1)  # a rewind (new revision): rebuilt
    assert idx.lookup(2) == [6, 5]


def run_steps(engine, n: int) -> None:
    """Run n engine steps from the test thread; the caller holds the engine lock, so the loop thread waits."""
    for _ in range(n):
        engine.loop.step()


def test_rewind_cancel_and_snapshot_mid_speculation_leave_the_session_exact(engines) -> None:
    engine = engines["qwen3_moe"]
    p = repetitive(36, 106)
    plain = greedy(engine, p, 50)
    verified = engine.stats()["speculative"].get("ngram", {}).get("verifications", 0)
    with engine.open_session(drafter="ngram") as s:
        s.append(token_ids=p)
        with engine.guard:  # the steps run here, one by one: stop in the middle of the reply, for sure
            st = s.stream(max_tokens=50, stop_token_ids=())
            run_steps(engine, 6)
            assert engine.stats()["speculative"]["ngram"]["verifications"] > verified  # it is speculating
            n = len(s.token_ids) - len(p)
            assert 6 < n < 50 and s.token_ids[len(p):] == plain[:n]
            snap = s.snapshot()
            s.rewind(to=len(p) + n // 2)
        st.wait()
        cut = len(s.token_ids) - len(p)
        assert cut == n // 2
        rest = s.generate(max_tokens=50 - cut, stop_token_ids=())
        assert s.token_ids[len(p):] == plain[:cut] + rest == plain
        engine.check_integrity()
    restored = engine.restore(snap)  # a plain session restored from a speculative one continues exactly
    with restored:
        assert restored.generate(max_tokens=50 - n, stop_token_ids=()) == plain[n:]
    with engine.open_session(drafter="ngram") as s:
        s.append(token_ids=p)
        with engine.guard:
            st = s.stream(max_tokens=50, stop_token_ids=())
            run_steps(engine, 4)
            s.cancel()
        st.wait()
        got = s.token_ids[len(p):]
        assert 0 < len(got) < 50 and got == plain[:len(got)] and s.kv.length == len(s.token_ids) - 1
        assert st.finish_reason == "cancelled"
    assert engine.stats()["kv_pages_used"] == 0


def test_bad_drafter_settings_are_typed_errors(engines, checkpoints, tmp_path) -> None:
    engine = engines["qwen3"]
    for bad in ("ngramm", "draft", 7):
        with pytest.raises(UnknownDrafterError):
            engine.open_session(drafter=bad)  # type: ignore[arg-type]
    with pytest.raises(UnknownDrafterError, match="multi-token-prediction"):
        engine.open_session(drafter="mtp")
    for k in (0, 8, True):
        with pytest.raises(InvalidInputError, match="max_draft"):
            engine.set_drafter("ngram", k)  # type: ignore[arg-type]
    from streamserve import Engine
    from streamserve.engine.drafters.model import DraftTokenizerError

    with pytest.raises(DraftTokenizerError):  # the test checkpoints' byte tokenizer is not the default model's
        Engine.from_pretrained("default", kv_memory="64MiB", drafter=f"draft:{checkpoints['llama'][0]}")


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_draft_model_drafter_is_lossless_and_stays_in_step(engines, checkpoints, temperature: float) -> None:
    """The test checkpoints share one tokenizer, so a tiny llama drafts for the tiny qwen3-moe: greedy output is
    identical, and through rewinds and a second reply the draft's own cache follows the session."""
    engine = engines["qwen3_moe"]
    draft = f"draft:{checkpoints['llama'][0]}"
    p = repetitive(30, 107)
    for kw in ({}, {"window": 20, "sinks": 2}):
        plain = greedy(engine, p, 40, **kw)
        with engine.open_session(drafter=draft, seed=3, **kw) as s:
            s.append(token_ids=p)
            out = s.generate(max_tokens=30, temperature=temperature, stop_token_ids=())
            if temperature == 0.0:
                assert out == plain[:30]
            s.rewind(to=len(p) + 22)  # within the window
            more = s.generate(max_tokens=10, temperature=temperature, stop_token_ids=())
            if temperature == 0.0:
                assert more == plain[22:32]
            drafter = engine.drafters.make(draft)[0]
            with engine.guard:  # catches up lazily, before each proposal: then it holds the real history
                proposal = drafter.propose(s.core, 3)  # drafters work on the session state
            st = drafter.states[s.id]  # (a windowed session's draft views its last window only)
            assert st.tokens == s.token_ids[st.offset:] and len(proposal.tokens) == 3
            assert st.kv.length == len(s.token_ids) - st.offset  # the drafts left its cache
        assert s.id not in drafter.states  # closed: its draft cache is freed
    assert drafter.pool.allocator.used_count == 0
    assert engine.stats()["speculative"][drafter.name]["verifications"] > 0


def test_drafting_never_changes_what_a_reply_leaves_in_the_session(engines, checkpoints, monkeypatch) -> None:
    """Review regressions: stop strings, page caps, a failing drafter, a session dropped without close()."""
    import gc

    engine = engines["qwen3_moe"]
    p = repetitive(40, 108)
    # a page cap that a plain reply fits in (a verification may not take more pages than a plain step)
    plain = greedy(engine, p, 60, window=16, sinks=0, page_cap=3)
    with engine.open_session(drafter="ngram", window=16, sinks=0, page_cap=3) as s:
        s.append(token_ids=p)
        assert s.generate(max_tokens=60, stop_token_ids=()) == plain
    # a drafter that raises drafts nothing; the reply goes on
    from streamserve.engine.drafters.ngram import NgramDrafter

    def broken(self, session, k, reply=None):
        raise RuntimeError("drafter bug")

    monkeypatch.setattr(NgramDrafter, "propose", broken)
    with engine.open_session(drafter="ngram") as s, engine.open_session() as other:
        s.append(token_ids=p)
        other.append(token_ids=p)
        with engine.guard:
            a, b = s.stream(max_tokens=20, stop_token_ids=()), other.stream(max_tokens=20, stop_token_ids=())
        assert a.wait() == b.wait() == "length" and a.token_ids == b.token_ids == greedy(engine, p, 20)
    monkeypatch.undo()
    # a garbage-collected session gives its draft-model pages back too
    draft = f"draft:{checkpoints['llama'][0]}"
    s = engine.open_session(drafter=draft)
    s.append(token_ids=p)
    s.generate(max_tokens=12, stop_token_ids=())
    drafter = engine.drafters.make(draft)[0]
    assert drafter.pool.allocator.used_count > 0
    del s
    gc.collect()
    engine.check_integrity()  # frees what collected sessions held
    assert drafter.pool.allocator.used_count == 0 and not drafter.states


def test_stop_strings_with_drafting_leave_the_session_as_plain_decoding_does() -> None:
    from streamserve import Engine

    with Engine.from_pretrained("default", kv_memory="64MiB") as engine:
        prompt = "and the God of Israel, " * 6
        ends = []
        for drafter in ("none", "ngram"):
            with engine.open_session(drafter=drafter) as s:
                s.append(text=prompt)
                st = s.stream(max_tokens=40, stop=["of Is"], stop_token_ids=())
                text = "".join(d.text for d in st)
                ends.append((text, st.finish_reason, list(s.token_ids), s.kv.length, s.timeline[-1]))
        assert ends[0] == ends[1] and ends[0][1] == "stop"


def test_one_draft_model_object_however_many_threads_open_sessions(engines, checkpoints) -> None:
    import threading

    engine = engines["qwen3"]
    draft = f"draft:{checkpoints['olmoe'][0]}"
    sessions: list = []
    threads = [threading.Thread(target=lambda: sessions.append(engine.open_session(drafter=draft)))
               for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len({id(s.spec.current) for s in sessions}) == 1
    for s in sessions:
        s.close()
