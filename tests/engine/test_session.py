"""Sessions: chunked appends equal one-shot appends, generated tokens join the session, typed errors."""

from __future__ import annotations

import random
import time

import pytest
import torch
from helpers import greedy, make_checkpoint, random_ids

from streamserve.errors import (
    ContextLengthError,
    EmptyAppendError,
    InvalidInputError,
    ResponseInProgressError,
    SessionClosedError,
    StepError,
    TokenOutOfRangeError,
)


def random_chunks(ids: list[int], rng: random.Random) -> list[list[int]]:
    cuts = sorted(rng.sample(range(1, len(ids)), rng.randint(1, min(8, len(ids) - 1))))
    return [ids[a:b] for a, b in zip([0, *cuts], [*cuts, len(ids)], strict=True)]


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "olmoe"])
def test_chunked_appends_equal_one_shot(arch: str, engines) -> None:
    engine = engines[arch]
    prompt = random_ids(61, seed=7)
    expected = greedy(engine, prompt, 24)
    rng = random.Random(0)
    for _ in range(4):
        chunks = random_chunks(prompt, rng)
        with engine.open_session() as s:
            assert sum(s.append(token_ids=c) for c in chunks) == len(prompt)
            assert s.generate(max_tokens=24, stop_token_ids=()) == expected, [len(c) for c in chunks]


def test_one_token_chunks_and_interleaved_generation(engines) -> None:
    """append/generate/append/generate == one session fed the same tokens in one go."""
    engine = engines["qwen3_moe"]
    a, b = random_ids(12, seed=8), random_ids(9, seed=9)
    with engine.open_session() as s:
        for t in a:
            s.append(token_ids=[t])
        r1 = s.generate(max_tokens=5, stop_token_ids=())
        s.append(token_ids=b)
        r2 = s.generate(max_tokens=5, stop_token_ids=())
        assert s.token_ids == a + r1 + b + r2
    with engine.open_session() as s:
        s.append(token_ids=a + r1 + b)
        assert s.generate(max_tokens=5, stop_token_ids=()) == r2


def test_text_append_and_stop_at_eos(engines, monkeypatch) -> None:
    engine = engines["llama"]
    with engine.open_session() as s:
        n = s.append(text="hello")
        assert n == len("hello") and s.token_ids == engine.tokenizer.encode("hello")
        free = s.generate(max_tokens=12, stop_token_ids=())
    stop = free[5]
    first = free.index(stop)
    monkeypatch.setattr(engine, "eos_token_ids", (stop,))
    with engine.open_session() as s:
        s.append(text="hello")
        assert s.generate(max_tokens=12) == free[: first + 1]  # stops at the model's EOS, which it includes


def test_closing_a_session_ends_its_running_reply(engines) -> None:
    engine = engines["qwen3"]
    s = engine.open_session(window=16)  # rolling: the reply could run for ever
    s.append(token_ids=[1, 2, 3])
    stream = s.stream(max_tokens=100_000, stop_token_ids=())
    next(stream)
    with engine.guard:  # between two steps
        produced = len(s.token_ids) - 3
        s.close()
    rest = list(stream)  # what was produced before the close, then the end
    assert stream.finish_reason == "closed" and len(stream.token_ids) == produced
    assert len(rest) <= produced and s.closed and not s.kv.page_table
    engine.check_integrity()


def test_ctrl_c_while_reading_a_reply_cancels_it_and_the_session_goes_on(engines) -> None:
    engine = engines["qwen3_moe"]
    prompt = random_ids(12, seed=15)
    expected = greedy(engine, prompt, 10)
    with engine.open_session() as s:
        s.append(token_ids=prompt)
        got = []
        with pytest.raises(KeyboardInterrupt):
            for tok in s.iter_generate(max_tokens=10, stop_token_ids=()):
                got.append(tok)
                if len(got) == 3:
                    raise KeyboardInterrupt  # the consumer is interrupted; the reply may have run ahead
        assert s.state.value == "open"  # closing the iterator cancelled the reply and waited for its end
        got = s.token_ids[12:]
        assert 3 <= len(got) <= 10 and got == expected[:len(got)]
        got += s.generate(max_tokens=10 - len(got), stop_token_ids=()) if len(got) < 10 else []
        assert got == expected and s.kv.length == len(s.token_ids) - 1


def test_session_seed_makes_a_whole_session_reproducible(engines) -> None:
    engine = engines["qwen3"]

    def run() -> list[int]:
        with engine.open_session(seed=9) as s:
            s.append(token_ids=[5, 6, 7])
            a = s.generate(max_tokens=6, temperature=1.0, stop_token_ids=())
            s.append(token_ids=[8])
            return a + s.generate(max_tokens=6, temperature=1.0, stop_token_ids=())

    assert run() == run()


def test_a_refused_reply_takes_no_draw_of_the_sessions_seed(engines) -> None:
    """A seeded session repeats even when a reply was refused on the way (the refused one drew no seed)."""
    engine = engines["qwen3"]

    def run(refuse: bool) -> list[int]:
        with engine.open_session(seed=11) as s:
            s.append(token_ids=random_ids(8, seed=16))
            s.generate(max_tokens=3, temperature=1.0, stop_token_ids=())
            if refuse:
                with engine.guard:  # the first reply is still queued: the second is refused
                    first = s.stream(max_tokens=2, stop_token_ids=())
                    with pytest.raises(ResponseInProgressError):
                        s.stream(max_tokens=2)
                first.wait()
            else:
                s.stream(max_tokens=2, stop_token_ids=()).wait()
            s.rewind(to=8)
            return s.generate(max_tokens=8, temperature=1.0, stop_token_ids=())

    assert run(refuse=True) == run(refuse=False)


def test_only_seeded_replies_draft_by_acceptance_alone(engines) -> None:
    """`Response.seeded` (fixed draft costs, so a seeded reply repeats) is for seeded sessions or replies;
    any other reply drafts by measured costs."""
    engine = engines["qwen3"]
    for session_seed, reply_seed, seeded in ((None, None, False), (None, 5, True), (3, None, True)):
        with engine.open_session(seed=session_seed) as s:
            s.append(token_ids=[1, 2, 3])
            with engine.guard:  # the reply stays queued while we look at it
                st = s.stream(max_tokens=2, seed=reply_seed, stop_token_ids=())
                with engine.loop.cv:
                    r = engine.loop.scheduler.open_response(s.id)
            assert r is not None and r.seeded is seeded
            st.wait()


def test_special_tokens_only_on_the_first_text_chunk(tmp_path) -> None:
    from tokenizers import processors

    from streamserve import Engine
    from streamserve.models import Tokenizer

    make_checkpoint(tmp_path, "llama")
    tok = Tokenizer.from_dir(tmp_path)._tok
    tok.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A",
                                                       special_tokens=[("<|endoftext|>", 256)])
    tok.save(str(tmp_path / "tokenizer.json"))
    engine = Engine.from_pretrained(tmp_path, device="cpu")
    with engine.open_session() as s:
        s.append(text="ab")
        s.append(text="c")
        assert s.token_ids[0] == 256 and s.token_ids.count(256) == 1
    with engine.open_session() as s:  # chat-templated text brings its own BOS
        s.append(text="ab", add_special_tokens=False)
        assert 256 not in s.token_ids


def test_sampling_is_seeded_and_top_p_tiny_is_greedy(engines) -> None:
    engine = engines["qwen3"]
    prompt = random_ids(10, seed=10)

    def run(**kw) -> list[int]:
        with engine.open_session() as s:
            s.append(token_ids=prompt)
            return s.generate(max_tokens=12, stop_token_ids=(), **kw)

    assert run(temperature=1.0, seed=3) == run(temperature=1.0, seed=3)
    assert run(temperature=1.0, top_p=1e-6, seed=4) == run(temperature=0.0)
    assert run(temperature=2.0, top_k=1, seed=5) == run(temperature=0.0)


def test_bad_input_is_typed(engines) -> None:
    engine = engines["qwen3_moe"]
    s = engine.open_session()
    with pytest.raises(EmptyAppendError):
        s.append(token_ids=[])
    with pytest.raises(EmptyAppendError):
        s.append(text="")
    with pytest.raises(InvalidInputError, match="exactly one"):
        s.append(text="a", token_ids=[1])
    with pytest.raises(InvalidInputError, match="exactly one"):
        s.append()
    with pytest.raises(TokenOutOfRangeError, match="300"):
        s.append(token_ids=[5, 300])
    with pytest.raises(TokenOutOfRangeError):
        s.append(token_ids=[-1])
    with pytest.raises(InvalidInputError, match="ints"):
        s.append(token_ids=[1.5])
    with pytest.raises(InvalidInputError):
        s.append(token_ids="abc")
    with pytest.raises(InvalidInputError, match="at least one appended token"):
        s.generate(max_tokens=3)
    s.append(token_ids=[1, 2, 3])
    for kw in ({"max_tokens": 0}, {"temperature": -1.0}, {"temperature": float("nan")}, {"top_p": 0.0},
               {"top_p": 1.5}, {"max_tokens": True}, {"top_k": -1}):
        with pytest.raises(InvalidInputError):
            s.generate(**kw)
    assert s.token_ids == [1, 2, 3]  # nothing above changed the session
    s.close()
    s.close()
    with pytest.raises(SessionClosedError):
        s.append(token_ids=[1])
    with pytest.raises(SessionClosedError):
        s.generate()


def test_context_limit_is_a_typed_error_and_generation_stops_there(tmp_path) -> None:
    from streamserve import Engine

    make_checkpoint(tmp_path, "qwen3", max_position_embeddings=20)
    engine = Engine.from_pretrained(tmp_path, device="cpu")
    with engine.open_session() as s:
        with pytest.raises(ContextLengthError, match="context of 20"):
            s.append(token_ids=list(range(21)))
        assert s.token_ids == []
        s.append(token_ids=list(range(15)))
        out = s.generate(max_tokens=50, stop_token_ids=())
        assert len(out) == 5 and len(s.token_ids) == 20
        assert s.generate(max_tokens=5, stop_token_ids=()) == []
        with pytest.raises(ContextLengthError):
            s.append(token_ids=[1])


def test_a_fault_in_a_step_fails_only_that_session_and_frees_its_pages(engines, monkeypatch) -> None:
    engine = engines["mixtral"]
    prompt = random_ids(20, seed=11)
    expected = greedy(engine, prompt, 8)
    used = engine.stats()["kv_pages_used"]
    s = engine.open_session()
    s.append(token_ids=prompt[:10])
    layer = engine.model.layers[1].mlp
    real = type(layer).forward

    def boom(self, x, ops):
        raise RuntimeError("injected fault")

    monkeypatch.setattr(type(layer), "forward", boom)
    with pytest.raises(StepError, match="injected") as info:
        s.append(token_ids=prompt[10:])
    assert isinstance(info.value.__cause__, RuntimeError)
    monkeypatch.setattr(type(layer), "forward", real)
    assert s.closed and engine.stats()["kv_pages_used"] == used  # the failed session's pages came back
    with pytest.raises(SessionClosedError):
        s.append(token_ids=[1])
    engine.check_integrity()
    assert greedy(engine, prompt, 8) == expected  # the engine goes on serving


def test_stats_and_close_release_memory(engines) -> None:
    engine = engines["olmoe"]
    before = engine.stats()["sessions_open"]
    sessions = [engine.open_session() for _ in range(3)]
    for s in sessions:
        s.append(token_ids=random_ids(30, seed=12))
    st = engine.stats()
    assert st["sessions_open"] == before + 3 and st["kv_bytes"] > 0
    assert st["architecture"] == "OlmoeForCausalLM" and st["parameters"] > 0
    for s in sessions:
        s.close()
    st = engine.stats()
    assert st["sessions_open"] == before
    assert all(not s.kv.page_table for s in sessions)
    engine.check_integrity()


def test_generate_with_a_full_context_window_of_sliding_attention(engines) -> None:
    """Mixtral's test config has a 24-token sliding window: a long session still matches a fresh run."""
    engine = engines["mixtral"]
    ids = random_ids(70, seed=13)
    with engine.open_session() as a:
        a.append(token_ids=ids)
        la = a.core.logits
    with engine.open_session() as b:
        for i in range(0, 70, 7):
            b.append(token_ids=ids[i:i + 7])
        assert torch.allclose(la, b.core.logits, atol=1e-5)


def test_a_dropped_session_is_collected_with_its_memory(engines) -> None:
    import gc
    import weakref

    engine = engines["qwen3"]
    before = engine.stats()["sessions_open"]
    used = engine.stats()["kv_pages_used"]
    s = engine.open_session()
    s.append(token_ids=random_ids(50, seed=14))
    kv = weakref.ref(s.kv)
    assert engine.stats()["sessions_open"] == before + 1 and engine.stats()["kv_pages_used"] > used
    del s
    gc.collect()
    assert engine.stats()["sessions_open"] == before and kv() is None
    assert engine.stats()["kv_pages_used"] == used
    engine.check_integrity()


def test_an_append_racing_a_rewind_never_gets_a_seq_behind_a_later_one(engines, monkeypatch) -> None:
    """A rewind renumbers the next chunk seq; an append submitted meanwhile (after the rewind's check for queued
    chunks) kept its old seq, and the next append got a smaller one: seqs on the timeline went backwards."""
    import threading

    engine = engines["qwen3"]
    with engine.open_session() as s:
        for i in range(3):
            s.append(token_ids=[1 + i, 2 + i])
        acks, real = [], engine.admission.unpark

        def racing_unpark(state, busy=()):  # another thread appends in the middle of the rewind
            t = threading.Thread(target=lambda: acks.append(s.append_chunk(token_ids=[9])))
            t.start()
            t.join(1.0)
            return real(state, busy)

        monkeypatch.setattr(engine.admission, "unpark", racing_unpark)
        s.rewind(to_seq=0)
        monkeypatch.undo()
        deadline = time.monotonic() + 30
        while not acks and time.monotonic() < deadline:
            time.sleep(0.01)
        later = s.append_chunk(token_ids=[7])
        seqs = [r.seq for r in s.timeline if r.kind == "input"]
        assert acks and acks[0].seq < later.seq and seqs == sorted(seqs) and len(set(seqs)) == len(seqs)


def test_snapshot_and_park_racing_a_close_fail_cleanly(engines) -> None:
    """A close on another thread between the open check and the guard: the snapshot copied a released KV (a
    snapshot whose restore fails at its first step) and park parked a closed session."""
    import threading

    engine = engines["qwen3"]
    for op in ("snapshot", "park"):
        s = engine.open_session()
        s.append(token_ids=random_ids(20, seed=25))
        out: list[object] = []

        def call(s=s, op=op, out=out) -> None:
            try:
                out.append(getattr(s, op)())
            except SessionClosedError as e:
                out.append(e)

        with engine.guard:  # the call passes its open check (if outside the guard) and waits here
            t = threading.Thread(target=call)
            t.start()
            t.join(0.3)
            s.close()  # the guard is re-entrant: closed under it
        t.join(30)
        assert len(out) == 1 and isinstance(out[0], SessionClosedError), out
        assert s.kv.parked is None and not s.kv.page_table
    engine.check_integrity()
