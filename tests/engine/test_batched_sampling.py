"""Batched sampling: every plain decode of a step draws in one call with counter-based noise.

The race noise of a row is a pure function of (seed, position, stream, token id) (`kernels.reference.race_noise`),
so a seeded reply gives the same tokens alone or sharing its steps with other sessions, run after run, and
speculation with n-gram drafts still samples the tokens plain decoding does. The noise itself is checked
against a pure-Python statement of the hash (the seed semantics are a contract) and for uniformity and
independence with fixed counters (deterministic: these bounds cannot flake)."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch
from helpers import greedy

from streamserve.engine.sampling import Draws, sample_rows
from streamserve.errors import InvalidInputError
from streamserve.kernels import reference as ref

M32 = 0xFFFFFFFF


def py_mix32(x: int) -> int:
    x ^= x >> 16
    x = (x * 0x7FEB352D) & M32
    x ^= x >> 15
    x = (x * 0x846CA68B) & M32
    return x ^ (x >> 16)


def py_uniform(seed: int, position: int, stream: int, index: int) -> float:
    """The counter hash in plain Python integers: what `race_uniform` must compute on any device."""
    k = 0x6A09E667
    for word in (seed & M32, seed >> 32, position & M32, position >> 32, stream):
        k = py_mix32(k ^ word)
    x = py_mix32(py_mix32((index + 0x9E3779B9) & M32) ^ k)
    return ((x >> 8) + 0.5) * 2.0 ** -24


def test_the_noise_is_the_documented_hash_of_its_counters() -> None:
    rng = random.Random(0)
    seeds = [0, 1, (1 << 63) - 1, *(rng.randrange(1 << 63) for _ in range(5))]
    positions = [0, 7, (1 << 40) + 3, *(rng.randrange(1 << 20) for _ in range(5))]
    u = ref.race_uniform(torch.tensor(seeds), torch.tensor(positions), 2, 50)
    want = torch.tensor([[py_uniform(s, p, 2, i) for i in range(50)] for s, p in zip(seeds, positions, strict=True)])
    assert torch.equal(u, want)
    noise = ref.race_noise(torch.tensor(seeds), torch.tensor(positions), 2, 50, torch.device("cpu"))
    assert torch.equal(noise, -torch.log(want))


def test_a_row_of_noise_does_not_depend_on_the_other_rows() -> None:
    seeds, positions = torch.tensor([5, 9, 5, 1 << 62, 3]), torch.tensor([10, 10, 11, 0, 10])
    batch = ref.race_noise(seeds, positions, 0, 301)
    for b in range(5):
        assert torch.equal(batch[b], ref.race_noise(seeds[b:b + 1], positions[b:b + 1], 0, 301)[0])
    d = Draws(5, torch.device("cpu"))
    assert torch.equal(d.noise(10, 2, 301), batch[[0, 2]])  # a reply's positions 10 and 11
    for stream in (1, 2, 3):  # every stream its own numbers
        assert not torch.equal(d.noise(10, 1, 301, stream)[0], batch[0])
    assert not torch.equal(batch[0], batch[1]) and not torch.equal(batch[0], batch[2])


def chi2(counts: torch.Tensor) -> float:
    expected = counts.sum() / counts.numel()
    return float(((counts - expected) ** 2 / expected).sum())


def chi2_bound(dof: int) -> float:
    """About the 1e-6 upper tail of chi-square with `dof` degrees of freedom (Wilson-Hilferty, z = 4.75)."""
    return dof * (1 - 2 / (9 * dof) + 4.75 * math.sqrt(2 / (9 * dof))) ** 3


def test_the_noise_is_uniform_and_independent_across_tokens_rows_positions_and_streams() -> None:
    seeds = torch.tensor([3] * 64 + [4] * 64)  # two replies, 64 consecutive positions each
    positions = torch.cat([torch.arange(64), torch.arange(64)])
    u = ref.race_uniform(seeds, positions, 0, 4096)  # [128, 4096]
    bins = 64
    assert chi2(torch.bincount((u * bins).long().flatten(), minlength=bins).float()) < chi2_bound(bins - 1)

    def joint(a: torch.Tensor, b: torch.Tensor, n: int = 16) -> float:
        cells = (a * n).long().flatten() * n + (b * n).long().flatten()
        return chi2(torch.bincount(cells, minlength=n * n).float())

    bound = chi2_bound(16 * 16 - 1)
    assert joint(u[:, :-1], u[:, 1:]) < bound  # neighbouring token ids of a row
    assert joint(u[:63], u[1:64]) < bound  # neighbouring positions of a reply
    assert joint(u[:64], u[64:]) < bound  # two seeds at the same positions
    other = ref.race_uniform(seeds, positions, 1, 4096)
    assert joint(u, other) < bound  # two streams at the same counters
    e = ref.race_noise(seeds, positions, 0, 4096)
    assert abs(float(e.mean()) - 1) < 0.01 and abs(float(e.var()) - 1) < 0.02  # Exp(1): mean 1, variance 1
    assert float(u.min()) > 0 and float(u.max()) < 1


def test_one_batch_honours_each_rows_temperature_top_k_and_top_p() -> None:
    """Three parameter sets interleaved in one call, each row its own position: every set's frequencies
    follow its own filtered distribution; the greedy rows in the same batch take the argmax."""
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    cases = [(1.0, 0, 1.0), (0.7, 3, 1.0), (1.3, 0, 0.8), (0.0, 0, 1.0)]
    n = 12000
    rows = len(cases) * n
    params = [cases[i % len(cases)] for i in range(rows)]
    drawn = sample_rows(logits.repeat(rows, 1), [c[0] for c in params], [c[2] for c in params],
                        [c[1] for c in params], [11] * rows, range(rows))
    for j, (temperature, top_k, top_p) in enumerate(cases):
        toks = drawn[j::len(cases)]
        if temperature == 0.0:
            assert bool((toks == 0).all())
            continue
        p = torch.softmax(logits / temperature, -1)
        keep = torch.ones(6, dtype=torch.bool)
        if top_k:
            keep[top_k:] = False
        keep &= (torch.cumsum(p, -1) - p) < top_p  # the logits are sorted already
        target = torch.where(keep, p, 0) / p[keep].sum()
        freq = torch.bincount(toks, minlength=6).float() / n
        assert (freq - target).abs().max() < 0.015, (temperature, top_k, top_p, freq, target)
        assert freq[~keep].sum() == 0
    ties = sample_rows(torch.tensor([[0.0, 3.0, 3.0], [1.0, 0.0, 1.0]]), [0.0, 0.0], [1.0, 1.0], [0, 0], [1, 2],
                       [0, 0])
    assert ties.tolist() == [1, 0]  # greedy: lowest id on ties


PARAMS: list[dict[str, Any]] = [dict(temperature=0.9), dict(temperature=1.3, top_p=0.9), dict(temperature=0.7, top_k=5),
                                dict(temperature=0.0), dict(temperature=1.0, top_k=40, top_p=0.95)]


def prompts(n: int, vocab: int) -> list[list[int]]:
    return [[random.Random(i).randrange(vocab) for _ in range(17 + 3 * i)] for i in range(n)]


def alone(engine: Any, prompt: list[int], max_tokens: int, **kw: Any) -> list[int]:
    with engine.open_session() as s:
        s.append(token_ids=prompt)
        return s.generate(max_tokens=max_tokens, stop_token_ids=(), **kw)


def lockstep(engine: Any, ps: list[list[int]], kws: list[dict[str, Any]], max_tokens: int,
             monkeypatch: pytest.MonkeyPatch, **session_kw: Any) -> tuple[list[list[int]], list[int]]:
    """All replies started together and stepped from here, so they share every decode step -> the replies'
    tokens, and the width of each batched sampling call."""
    widths: list[int] = []
    sample = engine.runner._sample

    def recording(rows: list[Any]) -> list[int]:
        widths.append(len(rows))
        return sample(rows)

    monkeypatch.setattr(engine.runner, "_sample", recording)
    sessions = [engine.open_session(**session_kw) for _ in ps]
    try:
        for s, p in zip(sessions, ps, strict=True):
            s.append(token_ids=p)
        with engine.guard:  # the loop thread waits: these steps are the only ones
            streams = [s.stream(max_tokens=max_tokens, stop_token_ids=(), **kw)
                       for s, kw in zip(sessions, kws, strict=True)]
            while not all(st.finished for st in streams):
                engine.loop.step()
        for st in streams:
            st.wait()
        return [st.token_ids for st in streams], widths
    finally:
        monkeypatch.undo()
        for s in sessions:
            s.close()


def test_seeded_replies_are_the_same_alone_or_batched_and_run_after_run(default_engine, monkeypatch) -> None:
    engine = default_engine
    ps = prompts(5, engine.config.vocab_size)
    kws = [{**kw, "seed": 100 + i} for i, kw in enumerate(PARAMS)]
    solo = [alone(engine, p, 24, **kw) for p, kw in zip(ps, kws, strict=True)]
    together, widths = lockstep(engine, ps, kws, 24, monkeypatch)
    assert together == solo
    assert widths == [5] * 24  # every token of every reply came from a 5-row call
    assert lockstep(engine, ps, kws, 24, monkeypatch)[0] == solo  # and again
    assert solo[3] == greedy(engine, ps[3], 24)  # the greedy row is plain greedy decoding
    other = alone(engine, ps[0], 24, **{**kws[0], "seed": 101})
    assert other != solo[0]  # another seed, another reply
    engine.check_integrity()


def counting(read: Any, name: str, reads: list[str]) -> Any:
    def counted(self: torch.Tensor, *a: Any, **k: Any) -> Any:
        reads.append(name)
        return read(self, *a, **k)
    return counted


def test_a_step_of_five_decoding_sessions_reads_the_device_once(default_engine, monkeypatch) -> None:
    """Every read of a tensor's value on the host during the step is counted: sampling five sessions is one."""
    engine = default_engine
    sessions = [engine.open_session() for _ in range(5)]
    reads: list[str] = []
    try:
        for s, p in zip(sessions, prompts(5, engine.config.vocab_size), strict=True):
            s.append(token_ids=p)
        with engine.guard:
            streams = [s.stream(max_tokens=8, seed=i, stop_token_ids=(), **kw)
                       for i, (s, kw) in enumerate(zip(sessions, PARAMS, strict=True))]
            engine.loop.step()  # the first tokens, from the appends' logits
            for name in ("tolist", "item", "__int__", "__index__", "__float__", "__bool__"):
                monkeypatch.setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), name, reads))
            before = engine.runner.sample_reads
            engine.loop.step()  # five pending tokens run, five more are sampled
            monkeypatch.undo()
            assert engine.runner.sample_reads - before == 1
            assert reads == ["tolist"]
            assert all(st.unread for st in streams)  # each reply got its tokens
        for st in streams:
            st.cancel()
            st.wait()
    finally:
        monkeypatch.undo()
        for s in sessions:
            s.close()


def test_a_fault_in_the_batched_call_fails_only_its_session(default_engine, monkeypatch) -> None:
    """The batched call fails (here: a row with seed 66 makes it raise); the runner samples row by row, the
    faulty session fails and is closed, and the others' tokens are exactly what they would be anyway."""
    import streamserve.engine.runner as runner_module

    engine = default_engine
    ps = prompts(3, engine.config.vocab_size)
    kws = [dict(temperature=0.8, seed=7), dict(temperature=0.8, seed=66), dict(temperature=0.0)]
    solo = [alone(engine, p, 6, **kw) for p, kw in zip(ps, kws, strict=True)]
    real = runner_module.sample_rows

    def faulty(logits: torch.Tensor, *args: Any) -> torch.Tensor:
        if 66 in args[3]:
            raise RuntimeError("injected sampling fault")
        return real(logits, *args)

    monkeypatch.setattr(runner_module, "sample_rows", faulty)
    sessions = [engine.open_session() for _ in ps]
    try:
        for s, p in zip(sessions, ps, strict=True):
            s.append(token_ids=p)
        with engine.guard:
            streams = [s.stream(max_tokens=6, stop_token_ids=(), **kw) for s, kw in zip(sessions, kws, strict=True)]
            while not all(st.finished for st in streams):
                engine.loop.step()
        assert streams[0].wait() == "length" and streams[2].wait() == "length"
        assert [streams[0].token_ids, streams[2].token_ids] == [solo[0], solo[2]]
        with pytest.raises(Exception, match="injected sampling fault"):
            streams[1].wait()
        assert sessions[1].closed and not sessions[0].closed
    finally:
        monkeypatch.undo()
        for s in sessions:
            s.close()
    engine.check_integrity()


def test_ngram_speculation_in_a_batch_samples_what_plain_decoding_alone_does(engines, monkeypatch) -> None:
    """Seeded sampled replies with n-gram drafting, sharing steps with plain sampled replies: each reply is
    what it is plain and alone (verification draws each position with the noise plain decoding uses)."""
    engine = engines["qwen3"]
    base = [random.Random(50).randrange(engine.config.vocab_size) for _ in range(9)]
    ps = [(base * 5)[:40], *prompts(2, engine.config.vocab_size)]
    kws = [dict(temperature=0.8, top_k=20, seed=5), dict(temperature=0.9, seed=6), dict(temperature=0.6, seed=7)]
    solo = [alone(engine, p, 30, **kw) for p, kw in zip(ps, kws, strict=True)]
    verified = engine.stats()["speculative"].get("ngram", {}).get("verifications", 0)
    together, _ = lockstep(engine, ps, kws, 30, monkeypatch, drafter="ngram")
    assert together == solo
    assert engine.stats()["speculative"]["ngram"]["verifications"] > verified  # it did speculate


def test_unseeded_replies_take_their_seed_from_a_python_generator(default_engine) -> None:
    """Drawing a reply's seed never touches torch (the caller may be the server's event loop): a seeded session's
    unseeded replies repeat, and a reply refused at submission takes no draw."""
    with default_engine.open_session() as s:
        assert isinstance(s.core.generator, random.Random)
        state = s.core.generator.getstate()
        with pytest.raises(InvalidInputError):
            s.stream(max_tokens=4)  # nothing appended yet: refused, no draw taken
        assert s.core.generator.getstate() == state
    with default_engine.open_session(seed=9) as a, default_engine.open_session(seed=9) as b:
        for s in (a, b):
            s.append(token_ids=prompts(1, default_engine.config.vocab_size)[0])
        assert a.generate(max_tokens=12, temperature=1.0) == b.generate(max_tokens=12, temperature=1.0)


@pytest.mark.gpu
def test_on_cuda_the_draws_are_the_cpus_and_sampling_never_waits_for_the_device() -> None:
    """The hash is exact integer arithmetic: CUDA's noise equals the CPU's bit for bit, so do the tokens of
    well-separated logits; building the inputs and sampling B rows queue work without one synchronisation."""
    cuda = torch.device("cuda")
    seeds, positions = torch.tensor([0, 5, (1 << 63) - 1, 12345]), torch.tensor([0, 99, 7, 1 << 33])
    assert torch.equal(ref.race_noise(seeds, positions, 3, 151936, cuda).cpu(), ref.race_noise(seeds, positions, 3,
                                                                                                   151936))
    logits = torch.randn(4, 151936, generator=torch.Generator().manual_seed(0)) * 4
    args = ([0.8, 1.0, 0.0, 1.3], [0.95, 1.0, 1.0, 0.5], [0, 50, 0, 0], seeds.tolist(), positions.tolist())
    on_cuda = logits.to(cuda)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        drawn = sample_rows(on_cuda, *args)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert drawn.tolist() == sample_rows(logits, *args).tolist()
