"""cpu_compile="on" (engine/compiled.py): decode steps compiled by torch.compile in a background thread give the
eager engine's greedy tokens (int8, int4; a window/sinks session, two sessions batched, a key-bucket crossing; a
float MoE model), switch from eager to compiled once ready, stay eager when a compile fails (or its code fails on a real
step: that step reruns eagerly), never compile on the engine thread, stop with the engine, never compile more
than MAX_COMPILED shapes, and keep Dynamo's guards on the step's inputs only.

The checkpoint is a 2-layer tiny Qwen3 so that each Inductor compile is small (seconds; the first of a process
pays Inductor's start-up), with an intermediate size of 64: torch 2.13's `_weight_int8pack_mm` crashes the process
on 16 or more rows when the input width is not a multiple of 16 (the test sizes' 72), eager or compiled. The
mechanism tests that need no generated code compile with Dynamo's "eager" backend (`cheap_backend`): the same
tracing, guards and switching, without the C++ compile."""

from __future__ import annotations

import logging
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import make_checkpoint, random_ids

from streamserve import Engine
from streamserve.engine import compiled as compiled_module
from streamserve.engine.compiled import CompiledSteps
from streamserve.engine.compiled_ops import COMPILED_CPU_OPS
from streamserve.errors import InvalidInputError
from streamserve.kernels import reference as ref
from streamserve.models.ops import TORCH_OPS
from streamserve.models.quant import QuantLinear
from streamserve.tools.batched import replies_together

WINDOW = {"window": 24, "sinks": 4}  # rolling positions (the default with a window)
WAIT = 600.0  # seconds a test waits for compiles (an event, never a sleep: the wait ends when they are done)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("compile") / "qwen3"
    make_checkpoint(path, "qwen3", num_hidden_layers=2, intermediate_size=64)
    return path


def load(path: Path, quantize: str = "none", cpu_compile: str = "off") -> Engine:
    return Engine.from_pretrained(path, device="cpu", quantize=quantize, cpu_compile=cpu_compile, kv_memory="16MiB")


def compiled_of(engine: Engine) -> CompiledSteps:
    assert engine.graphs is not None and engine.graphs.compiled is not None
    return engine.graphs.compiled


def greedy(engine: Engine, prompt: list[int], n: int, **kw: object) -> list[int]:
    with engine.open_session(**kw) as s:
        s.append(token_ids=prompt)
        return s.generate(max_tokens=n, stop_token_ids=())


class CountingBackend:
    """Wraps the compile backend: counts compiles per thread; `fail` makes each raise."""

    def __init__(self, inner: object, fail: bool = False) -> None:
        self.inner, self.fail = inner, fail
        self.threads: list[str] = []
        self.constants: list[set[int]] = []  # per compile: the storages its graph holds as constants (frozen)

    def __call__(self, gm: torch.fx.GraphModule, inputs: list[object]) -> object:
        self.threads.append(threading.current_thread().name)
        self.constants.append({t.untyped_storage().data_ptr() for t in (*gm.parameters(), *gm.buffers())})
        if self.fail:
            raise RuntimeError("compile failed on purpose")
        return self.inner(gm, inputs)  # type: ignore[operator]


def cheap_backend(gm: torch.fx.GraphModule, inputs: list[object]) -> object:
    return gm.forward  # Dynamo's "eager" backend: the traced graph as it is


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> CountingBackend:
    counting = CountingBackend(compiled_module.inductor)
    monkeypatch.setattr(compiled_module, "inductor", counting)
    return counting


def packed_weights(engine: Engine) -> set[int]:
    """The storages of every quantized projection's CPU-packed weight (what the CPU kernels read)."""
    return {m.cpu_weight.untyped_storage().data_ptr() for m in engine.model.modules()
            if isinstance(m, QuantLinear) and m.cpu_weight is not None}


# Inductor compiles, the start-up shape's autotuning its quantized matmul shapes (INDUCTOR_OPTIONS): int8 two shapes,
# int4 one; the int8 batched shape is not autotuned. The quantized formats are what a CPU compiles for (issue 16);
# unquantized weights take the same graph with plain linears (CI's time)
@pytest.mark.slow
@pytest.mark.parametrize("quantize", ["int8", "int4"])
def test_compiled_greedy_equals_eager(tiny: Path, quantize: str, backend: CountingBackend,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(compiled_module, "COMPILE_AFTER_STEPS", 1)  # a new shape is queued on its first step
    eager, engine = load(tiny, quantize), load(tiny, quantize, "on")
    compiled = compiled_of(engine)
    try:
        assert compiled.wait_idle(WAIT) and not compiled.failed  # the start-up shape: W 1, batch 1
        assert compiled.ready == 1
        prompt = random_ids(40, seed=5)
        # 40 + 40 tokens: key buckets 64 then 128, one graph (dynamic key reads)
        assert greedy(engine, prompt, 40) == greedy(eager, prompt, 40)
        assert compiled.steps >= 39
        # frozen: the graph holds the packed weights as its constants (Inductor may reblock them), not as inputs
        assert packed_weights(engine) and packed_weights(engine) <= backend.constants[0]
        if quantize == "int4":  # the batched shape's compile once, in int8 (CI's time)
            return
        # the batched shape is about batching and padding, not the matmul choice: frozen, not autotuned (CI's time)
        monkeypatch.setattr(compiled_module, "INDUCTOR_OPTIONS",
                            {**compiled_module.INDUCTOR_OPTIONS, "max_autotune": False})
        prompts = [random_ids(30, seed=6), random_ids(45, seed=7)]
        kws = [WINDOW, WINDOW]  # rolling positions, 4 sinks, a 24-token window: keys past it are dropped
        want = replies_together(eager, prompts, 30, kws)
        assert replies_together(engine, prompts, 30, kws) == want  # eager steps: the batched shape compiles
        assert compiled.wait_idle(WAIT) and not compiled.failed and compiled.ready == 2
        before = compiled.steps
        assert replies_together(engine, prompts, 30, kws) == want  # now compiled
        assert compiled.steps >= before + 29
        # every compile ran on the compile thread, once per shape: no real step ever failed a guard
        assert not compiled.failed
        assert set(backend.threads) == {"streamserve-compile"} and len(backend.threads) == compiled.ready == 2
        engine.check_integrity()
    finally:
        engine.shutdown()
        eager.shutdown()


@pytest.mark.slow
def test_compiled_moe_equals_eager(tmp_path: Path, backend: CountingBackend, monkeypatch: pytest.MonkeyPatch) -> None:
    """A float MoE model compiles (its experts gathered inside the graph, `compiled_ops.moe_experts`) and gives the
    eager engine's greedy tokens. Frozen but not autotuned: the matmul choice is the test above's (CI's time)."""
    monkeypatch.setattr(compiled_module, "INDUCTOR_OPTIONS", {"freezing": True})
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


def test_background_switch_and_shutdown(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    gate = threading.Event()

    def held(gm: torch.fx.GraphModule, inputs: list[object]) -> object:
        assert gate.wait(WAIT)  # the compile is held until the test has decoded eagerly
        return cheap_backend(gm, inputs)

    monkeypatch.setattr(compiled_module, "inductor", held)
    eager, engine = load(tiny), load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)
    prompt = random_ids(20, seed=8)
    want = greedy(eager, prompt, 12)
    assert greedy(engine, prompt, 12) == want  # served while the compile waits: every step eager
    assert compiled.steps == 0 and compiled.eager_steps >= 11 and not compiled.idle.is_set()
    gate.set()
    assert compiled.wait_idle(WAIT) and compiled.ready == 1
    assert greedy(engine, prompt, 12) == want
    assert compiled.steps >= 11  # switched
    thread = next(t for t in threading.enumerate() if t.name == "streamserve-compile")
    engine.shutdown()
    eager.shutdown()
    thread.join(WAIT)  # the shutdown does not wait; the idle thread ends at once
    assert not thread.is_alive()


def test_guards_are_kept_on_the_step_inputs_only(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`input_guards`: Dynamo checks the guards on a step's arguments (inputs that no longer match the graph ask for
    a compile, which is refused off the compile thread: `run` then steps eagerly, the test below), not those on the
    traced model (a parameter swapped for an equal one would fail one: the steps stay compiled)."""
    monkeypatch.setattr(compiled_module, "inductor", cheap_backend)
    seen: list[Any] = []  # the entries of the compiled steps
    run = CompiledSteps.run

    def spy(self: CompiledSteps, entry: Any, key: Any, reload: Any) -> torch.Tensor:
        seen.append(entry)
        return run(self, entry, key, reload)

    monkeypatch.setattr(CompiledSteps, "run", spy)
    engine = load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)
    try:
        assert compiled.wait_idle(WAIT) and compiled.ready == 1
        prompt = random_ids(20, seed=3)
        want = greedy(engine, prompt, 8)
        steps = compiled.steps
        assert steps >= 7
        # the final norm's weight swapped for an equal copy (the engine never swaps one) fails a guard on the model
        # (on the parameter's id): none is checked
        engine.model.norm = torch.nn.Parameter(engine.model.norm.detach().clone(), requires_grad=False)
        assert greedy(engine, prompt, 8) == want and compiled.steps >= steps + 7 and not compiled.failed
        entry = seen[-1]
        step = next(iter(compiled._fns.values()))
        with pytest.raises(Exception, match="outside the compile thread"):  # an argument's guard failed
            step(entry.ids.to(torch.int32), entry.kvs, entry.rows)
    finally:
        engine.shutdown()


def test_failed_compile_serves_eagerly(tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                       caplog: pytest.LogCaptureFixture) -> None:
    failing = CountingBackend(cheap_backend, fail=True)
    monkeypatch.setattr(compiled_module, "inductor", failing)
    eager, engine = load(tiny), load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)
    try:
        with caplog.at_level(logging.WARNING, logger="streamserve"):
            assert compiled.wait_idle(WAIT)
            prompt = random_ids(30, seed=9)
            assert greedy(engine, prompt, 20) == greedy(eager, prompt, 20)
            assert greedy(engine, prompt, 20) == greedy(eager, prompt, 20)
        assert compiled.ready == 0 and compiled.steps == 0 and len(compiled.failed) == 1
        assert failing.threads == ["streamserve-compile"]  # tried once, on the compile thread
        assert len([r for r in caplog.records if "runs eagerly" in r.getMessage()]) == 1  # logged once
    finally:
        engine.shutdown()
        eager.shutdown()


def test_compiled_code_that_raises_on_a_real_step_falls_back(tiny: Path, monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    """Compiled code that passes its check on the scratch step but raises on the engine thread: that step is run
    again eagerly (the same tokens), the shape stays eager, logged once."""

    def flaky(gm: torch.fx.GraphModule, inputs: list[object]) -> object:
        def run(*args: object) -> object:
            if threading.current_thread().name != "streamserve-compile":
                raise RuntimeError("a fault at run time")
            return gm.forward(*args)

        return run

    monkeypatch.setattr(compiled_module, "inductor", flaky)
    eager, engine = load(tiny), load(tiny, cpu_compile="on")
    compiled = compiled_of(engine)
    try:
        assert compiled.wait_idle(WAIT) and compiled.ready == 1
        prompt = random_ids(25, seed=10)
        with caplog.at_level(logging.WARNING, logger="streamserve"):
            assert greedy(engine, prompt, 12) == greedy(eager, prompt, 12)
        assert compiled.steps == 0 and compiled.ready == 0 and len(compiled.failed) == 1
        assert len([r for r in caplog.records if "runs eagerly" in r.getMessage()]) == 1
    finally:
        engine.shutdown()
        eager.shutdown()


def test_shape_count_is_bounded(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    counting = CountingBackend(cheap_backend)
    monkeypatch.setattr(compiled_module, "inductor", counting)
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
        assert len(counting.threads) == compiled.ready == 3  # MAX_COMPILED compiles, no more
        assert len(compiled.failed) == 3 and all(why.startswith("over the limit") for why in compiled.failed.values())
        assert compiled.steps > 0
    finally:
        engine.shutdown()
        eager.shutdown()


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
