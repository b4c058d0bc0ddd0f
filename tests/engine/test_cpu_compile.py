"""cpu_compile="on" (engine/compiled.py): decode steps compiled into AOTInductor packages by a child process (the
compile worker, engine/compile_worker.py) give the eager engine's greedy tokens (int8, int4; a window/sinks session,
two sessions batched, a key-bucket crossing; a float MoE model), switch from eager to compiled once ready, load from
the cache on a second start (no worker), stay eager when a compile fails (or its code fails on a real step: that
step reruns eagerly), stop with the engine (its worker killed), and never compile more than MAX_COMPILED shapes.

The checkpoint is a 2-layer tiny Qwen3 so that each compile is small (tens of seconds, most of it the worker's
start and the C++ build), with an intermediate size of 64: torch 2.13's `_weight_int8pack_mm` crashes the process
on 16 or more rows when the input width is not a multiple of 16 (the test sizes' 72), eager or compiled. The tests
share one package cache (a module-scoped Inductor cache directory): a shape compiled with the same options is built
once. The mechanism tests that need no real package run a stand-in worker (`fake_worker`)."""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers import make_checkpoint, random_ids

from streamserve import Engine
from streamserve.engine import compiled as compiled_module
from streamserve.engine import worker_process
from streamserve.engine.compiled import CompiledSteps
from streamserve.engine.compiled_ops import COMPILED_CPU_OPS
from streamserve.engine.inductor_setup import step_cache_dir, step_digest
from streamserve.errors import InvalidInputError
from streamserve.kernels import reference as ref
from streamserve.models.ops import TORCH_OPS
from streamserve.tools.batched import replies_together

WINDOW = {"window": 24, "sinks": 4}  # rolling positions (the default with a window)
WAIT = 600.0  # seconds a test waits for compiles (an event, never a sleep: the wait ends when they are done)
PLAIN = {"freezing": True}  # frozen, not autotuned: the mechanism tests' options (one shared package)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("compile") / "qwen3"
    make_checkpoint(path, "qwen3", num_hidden_layers=2, intermediate_size=64)
    return path


@pytest.fixture(scope="module", autouse=True)
def package_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One Inductor cache (and so one package cache) for the module's real compiles."""
    with pytest.MonkeyPatch.context() as mp:
        path = tmp_path_factory.mktemp("inductor")
        mp.setenv("TORCHINDUCTOR_CACHE_DIR", str(path))
        yield path


def load(path: Path, quantize: str = "none", cpu_compile: str = "off") -> Engine:
    return Engine.from_pretrained(path, device="cpu", quantize=quantize, cpu_compile=cpu_compile, kv_memory="16MiB")


def compiled_of(engine: Engine) -> CompiledSteps:
    assert engine.graphs is not None and engine.graphs.compiled is not None
    return engine.graphs.compiled


def greedy(engine: Engine, prompt: list[int], n: int, **kw: object) -> list[int]:
    with engine.open_session(**kw) as s:
        s.append(token_ids=prompt)
        return s.generate(max_tokens=n, stop_token_ids=())


def fake_worker(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, code: str) -> None:
    """A stand-in worker running `code` (`request`: the compile request; its own cache directory, so that nothing
    it writes is ever loaded by another test)."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    script = f"import json, pathlib, sys, time\nrequest = json.loads(pathlib.Path(sys.argv[1]).read_text())\n{code}"
    monkeypatch.setattr(worker_process, "WORKER", [sys.executable, "-c", script])


# Real compiles, the start-up shape autotuning its quantized matmul shapes (INDUCTOR_OPTIONS): int8 two shapes,
# int4 one; the int8 batched shape is not autotuned. The quantized formats are what a CPU compiles for (issue 16);
# unquantized weights take the same graph with plain linears (CI's time)
@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_compiled_greedy_equals_eager(tiny: Path, quantize: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_module, "COMPILE_AFTER_STEPS", 1)  # a new shape is queued on its first step
    eager, engine = load(tiny, quantize), load(tiny, quantize, "on")
    compiled = compiled_of(engine)
    try:
        assert compiled.wait_idle(WAIT) and not compiled.failed  # the start-up shape: W 1, batch 1
        assert compiled.ready == 1 and compiled.builds == 1
        prompt = random_ids(40, seed=5)
        # 40 + 40 tokens: key buckets 64 then 128, one package (dynamic key reads)
        assert greedy(engine, prompt, 40) == greedy(eager, prompt, 40)
        assert compiled.steps >= 39
        if quantize == "int4":  # the batched shape's compile once, in int8 (CI's time)
            return
        # the batched shape is about batching and padding, not the matmul choice: frozen, not autotuned (CI's time)
        monkeypatch.setattr(compiled_module, "INDUCTOR_OPTIONS", PLAIN)
        prompts = [random_ids(30, seed=6), random_ids(45, seed=7)]
        kws = [WINDOW, WINDOW]  # rolling positions, 4 sinks, a 24-token window: keys past it are dropped
        want = replies_together(eager, prompts, 30, kws)
        assert replies_together(engine, prompts, 30, kws) == want  # eager steps: the batched shape compiles
        assert compiled.wait_idle(WAIT) and not compiled.failed and compiled.ready == 2
        before = compiled.steps
        assert replies_together(engine, prompts, 30, kws) == want  # now compiled
        assert compiled.steps >= before + 29
        engine.check_integrity()
    finally:
        engine.shutdown()
        eager.shutdown()


@pytest.mark.slow
def test_compiled_moe_equals_eager(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float MoE model compiles (its experts gathered inside the graph, `compiled_ops.moe_experts`) and gives the
    eager engine's greedy tokens. Frozen but not autotuned: the matmul choice is the test above's (CI's time)."""
    monkeypatch.setattr(compiled_module, "INDUCTOR_OPTIONS", PLAIN)
    path = tmp_path / "moe"
    make_checkpoint(path, "qwen3_moe", num_hidden_layers=2)
    eager, engine = load(path), load(path, cpu_compile="on")
    compiled = compiled_of(engine)
    try:
        assert compiled.wait_idle(WAIT) and not compiled.failed and compiled.ready == 1
        prompt = random_ids(20, seed=8)
        assert greedy(engine, prompt, 24) == greedy(eager, prompt, 24)
        assert compiled.steps >= 23
    finally:
        engine.shutdown()
        eager.shutdown()


@pytest.mark.slow
def test_a_verification_step_compiles(tiny: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A step that keeps every row's logits (a drafter's verification: its rows are None, which is no input of the
    library) compiles, runs compiled and gives the eager step's logits. Its own package cache: the other tests
    expect the start-up shape it compiles not to be there."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    monkeypatch.setattr(compiled_module, "COMPILE_AFTER_STEPS", 1)
    monkeypatch.setattr(compiled_module, "INDUCTOR_OPTIONS", PLAIN)
    eager, engine = load(tiny), load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)

    def verify(e: Engine) -> torch.Tensor:  # [4, vocab]: a draft of 4 tokens checked
        with e.open_session() as s:
            s.append(token_ids=random_ids(30, seed=9))
            return e.run_step([(s, [5, 6, 7, 8])], [True])[0]

    try:
        assert compiled.wait_idle(WAIT) and not compiled.failed  # the start-up shape
        want = verify(eager)
        verify(engine)  # eager: its shape is queued
        assert compiled.wait_idle(WAIT) and not compiled.failed, compiled.failed
        before = compiled.steps
        got = verify(engine)
        assert compiled.steps == before + 1
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    finally:
        engine.shutdown()
        eager.shutdown()


def test_background_switch_then_a_second_start_loads_from_the_cache(tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    tmp_path: Path) -> None:
    """The real worker, held until the test has decoded eagerly (it waits for a file, then runs): steps switch to
    compiled once its package is there. A second engine of the same model and options loads that package without a
    worker; other options name another package."""
    monkeypatch.setattr(compiled_module, "INDUCTOR_OPTIONS", PLAIN)
    gate = tmp_path / "go"
    held = (f"import pathlib, runpy, sys, time\nwhile not pathlib.Path({str(gate)!r}).exists(): time.sleep(0.05)\n"
            "sys.argv = ['compile_worker', sys.argv[1]]\nrunpy.run_module('streamserve.engine.compile_worker', "
            "run_name='__main__')")
    monkeypatch.setattr(worker_process, "WORKER", [sys.executable, "-c", held])
    eager, engine = load(tiny), load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)
    prompt = random_ids(20, seed=8)
    want = greedy(eager, prompt, 12)
    assert greedy(engine, prompt, 12) == want  # served while the worker waits: every step eager
    assert compiled.steps == 0 and compiled.eager_steps >= 11 and not compiled.idle.is_set()
    gate.touch()
    assert compiled.wait_idle(WAIT) and compiled.ready == 1 and not compiled.failed
    assert greedy(engine, prompt, 12) == want
    assert compiled.steps >= 11  # switched
    assert len(list(step_cache_dir().glob("*.so"))) >= 1
    thread = compiled.thread
    engine.shutdown()
    assert thread is not None
    thread.join(WAIT)  # the idle thread ends at once
    assert not thread.is_alive()

    again = load(tiny, cpu_compile="on")  # the same model and options: from the cache
    compiled = compiled_of(again)
    try:
        assert compiled.wait_idle(WAIT) and compiled.ready == 1
        assert compiled.builds == 0 and len(compiled.from_cache) == 1
        assert again.stats()["compiled_step"]["shapes_from_cache"] == 1
        assert greedy(again, prompt, 12) == want and compiled.steps >= 11
    finally:
        again.shutdown()
        eager.shutdown()
    request = {"recipe": {"path": str(tiny)}, "options": PLAIN}
    assert step_digest(request) != step_digest({**request, "options": {"freezing": False}})
    assert step_digest(request) == step_digest(json.loads(json.dumps(request)))


def test_failed_compile_serves_eagerly(tiny: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                       caplog: pytest.LogCaptureFixture) -> None:
    fake_worker(monkeypatch, tmp_path, "print('compile failed: on purpose', file=sys.stderr)\nsys.exit(1)")
    eager, engine = load(tiny), load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)
    try:
        with caplog.at_level(logging.WARNING, logger="streamserve"):
            assert compiled.wait_idle(WAIT)
            prompt = random_ids(30, seed=9)
            assert greedy(engine, prompt, 20) == greedy(eager, prompt, 20)
            assert greedy(engine, prompt, 20) == greedy(eager, prompt, 20)
        assert compiled.ready == 0 and compiled.steps == 0 and compiled.builds == 1
        assert len(compiled.failed) == 1 and "on purpose" in next(iter(compiled.failed.values()))
        assert engine.stats()["compiled_step"]["state"] == "failed"
        assert len([r for r in caplog.records if "runs eagerly" in r.getMessage()]) == 1  # logged once
        assert not list(step_cache_dir().glob("*.so"))  # nothing cached: a restart tries again
    finally:
        engine.shutdown()
        eager.shutdown()


def test_compiled_code_that_raises_on_a_real_step_falls_back(tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                                              tmp_path: Path,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """A package whose step raises on the engine thread: that step is run again eagerly (the same tokens), the
    shape stays eager, logged once."""
    fake_worker(monkeypatch, tmp_path, "pathlib.Path(request['out']).write_bytes(b'')")

    def flaky(path: Path) -> object:
        def run(*args: object) -> object:
            raise RuntimeError("a fault at run time")

        return run

    monkeypatch.setattr(compiled_module, "load_package", flaky)
    eager, engine = load(tiny), load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)
    try:
        assert compiled.wait_idle(WAIT) and compiled.ready == 1
        prompt = random_ids(25, seed=10)
        with caplog.at_level(logging.WARNING, logger="streamserve"):
            assert greedy(engine, prompt, 12) == greedy(eager, prompt, 12)
        assert compiled.steps == 0 and compiled.ready == 0 and len(compiled.failed) == 1
        assert len([r for r in caplog.records if "runs eagerly" in r.getMessage()]) == 1
        engine.check_integrity()
    finally:
        engine.shutdown()
        eager.shutdown()


def test_a_damaged_library_is_removed_and_its_shape_serves_eagerly(tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                                                  tmp_path: Path) -> None:
    """A file that does not load (here a worker that wrote garbage; on a user's disk, a damaged cache): the shape
    runs eagerly and the file is deleted, so that the next start compiles it again instead of failing for ever."""
    fake_worker(monkeypatch, tmp_path, "pathlib.Path(request['out']).write_bytes(b'not a library')")
    eager, engine = load(tiny), load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)
    try:
        assert compiled.wait_idle(WAIT) and compiled.ready == 0 and len(compiled.failed) == 1
        prompt = random_ids(20, seed=11)
        assert greedy(engine, prompt, 8) == greedy(eager, prompt, 8)
        assert not list(step_cache_dir().glob("*.so"))
    finally:
        engine.shutdown()
        eager.shutdown()


def test_shape_count_is_bounded(tiny: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    fake_worker(monkeypatch, tmp_path, "sys.exit(1)")
    monkeypatch.setattr(compiled_module, "COMPILE_AFTER_STEPS", 1)
    monkeypatch.setattr(compiled_module, "MAX_COMPILED", 3)
    eager, engine = load(tiny), load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)
    try:
        windows = [{}, WINDOW, {"window": 24, "sinks": 4, "positions": "absolute"}]
        for _ in range(2):  # batch buckets 1 and 2 of three policies: 6 shapes asked for, each twice
            for n in (1, 2):
                for kw in windows:
                    prompts = [random_ids(12 + i, seed=20 + i) for i in range(n)]
                    want = replies_together(eager, prompts, 4, [kw] * n)
                    assert replies_together(engine, prompts, 4, [kw] * n) == want
                    assert compiled.wait_idle(WAIT)
        assert compiled.builds == 3  # MAX_COMPILED workers, no more
        over = [why for why in compiled.failed.values() if why.startswith("over the limit")]
        assert len(compiled.failed) == 6 and len(over) == 3
    finally:
        engine.shutdown()
        eager.shutdown()


def test_shutdown_kills_the_worker_at_once(tiny: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A worker that would run for ten minutes is ended (its process group) by the engine's shutdown, which does
    not wait for it; the compile thread ends too, logging no failure."""
    marker = tmp_path / "pid"
    fake_worker(monkeypatch, tmp_path, f"pathlib.Path({str(marker)!r}).write_text(str(__import__('os').getpid()))\n"
                                       "time.sleep(600)")
    engine = load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)
    deadline = time.monotonic() + WAIT
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(marker.read_text())
    thread = compiled.thread
    engine.shutdown()
    assert thread is not None
    thread.join(WAIT)
    assert not thread.is_alive() and not compiled.failed
    assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="SCHED_IDLE is Linux's")
def test_no_effect_off_cpu_torch(tiny: Path) -> None:
    if importlib_triton():
        engine = Engine.from_pretrained(tiny, device="cpu", kernels="triton", cpu_compile="on", kv_memory="16MiB")
        assert engine.graphs is None  # triton kernels: nothing to compile
        engine.shutdown()
    with pytest.raises(InvalidInputError, match="cpu_compile"):
        load(tiny, cpu_compile="yes")


def importlib_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def test_gathered_moe_experts_equal_the_reference() -> None:
    g = torch.Generator().manual_seed(3)
    x, w_gate_up, w_down = (torch.randn(*shape, generator=g) for shape in ((5, 24), (7, 2 * 10, 24), (7, 24, 10)))
    weights, ids = ref.moe_route(torch.randn(5, 7, generator=g), 3, True)
    want = ref.moe_experts_gather(x, weights, ids, w_gate_up, w_down)
    assert torch.allclose(COMPILED_CPU_OPS.moe_experts(x, weights, ids, w_gate_up, w_down), want, atol=1e-5)


@pytest.mark.parametrize("sliding", [None, 5])
def test_matmul_softmax_attention_equals_the_references(sliding: int | None) -> None:
    """engine/compiled_ops.py's attention against the torch references (GQA, windows, sinks, rolling, batches)."""
    g = torch.Generator().manual_seed(0)
    kvh, h, hd, slots = 2, 6, 8, 64
    k_pool, v_pool = torch.randn(slots, kvh, hd, generator=g), torch.randn(slots, kvh, hd, generator=g)
    q = torch.randn(3, h, hd, generator=g)
    read = torch.randperm(slots, generator=g)[:20]
    k_pos = torch.cat([torch.arange(4), torch.arange(30, 46)])  # 4 sinks, then a window's keys
    q_pos = torch.tensor([43, 44, 45])
    paged = ref.PagedKeys(k_pool, v_pool, read, k_pos)
    for kw in ({}, {"sinks": 4, "window": 10}):
        assert torch.allclose(COMPILED_CPU_OPS.attention(q, paged, q_pos, 0.3, sliding, **kw),
                              TORCH_OPS.attention(q, paged, q_pos, 0.3, sliding, **kw), atol=1e-5)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    rope = ref.rolling_rope(q_pos, k_pos, inv_freq, 1.0, 4, 16, torch.float32)
    assert torch.allclose(COMPILED_CPU_OPS.attention_rolling(q, paged, q_pos, rope, 0.3, 4, 16, sliding),
                          TORCH_OPS.attention_rolling(q, paged, q_pos, rope, 0.3, 4, 16, sliding), atol=1e-5)
    batch = ref.AttentionBatch(torch.tensor([[0, 1], [2, 2]]), torch.tensor([[44, 45], [45, 45]]),
                               torch.stack([read, read.flip(0)]), torch.stack([k_pos, k_pos]),
                               torch.tensor([4, 0]), torch.tensor([10, 1 << 40]), torch.tensor([0, 1, 2]))
    assert torch.allclose(COMPILED_CPU_OPS.attention_batch(q, k_pool, v_pool, batch, 0.3, sliding),
                          TORCH_OPS.attention_batch(q, k_pool, v_pool, batch, 0.3, sliding), atol=1e-5)
