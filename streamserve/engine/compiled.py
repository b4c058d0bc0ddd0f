"""Compiled CPU decode steps (`cpu_compile` "auto", the default, or "on"): the fixed-shape steps of engine/graphs.py
run from code that `torch.compile` (Inductor) generated, compiled in a background thread at the lowest CPU priority
while the same steps run eagerly.

What is compiled: `CausalLM.forward_batch` over a step's static buffers (engine/static_step.py), one graph with no
breaks (`fullgraph=True`), attention as matmul + masked softmax (engine/compiled_ops.py). One compiled callable
per `CompileKey` = (width W, any all-rows session, per part its window policy and batch bucket, intra-op threads):
the key-read lengths are marked dynamic, so one graph serves every key bucket of a shape (a long chat crosses
64, 128, 256, ... keys without a new compile). Threads are part of the key because Inductor bakes the thread
count into its OpenMP kernels: each shape is compiled on a thread set to the count its steps run with
(`threads_for`). Every callable has its own code object, so Dynamo's per-code cache holds exactly its one graph.

Bounded: a shape is queued after it ran `COMPILE_AFTER_STEPS` times (the start-up shape, W 1 batch 1 of the
default policy, at once), and at most `MAX_COMPILED` shapes are ever compiled per engine (ready or failed);
the rest run eagerly. Graph keys are bucketed already (graphs.py), so no client can grow either number.

Never waits, never wrong: a step whose shape is not ready runs eagerly. The compile thread never takes the
engine's step guard: it compiles against scratch buffers over a scratch KV pool (same tensor shapes as the
engine's, allocated lazily: only the page its warm-up writes is touched), checks the compiled logits against
the eager ones on those buffers, then publishes the callable; the engine thread switches on its next step of
that shape. A compile that raises (or disagrees) is logged once and its shape stays eager. The backend refuses
to compile anywhere but the compile thread: a guard that failed on a real step would otherwise recompile on
the engine thread for a minute; such a step runs eagerly and its shape stays eager. Dynamo checks only the guards
on a step's arguments and on global state before each call (`input_guards`), not the thousands on the traced
model, which never changes while the engine runs. Inductor's on-disk cache
lives under the streamserve cache home (unless TORCHINDUCTOR_CACHE_DIR is set; `streamserve models pull` warms
it): a restart compiles from it. `close()` (engine shutdown) never waits: the thread ends after the compile in
progress. Setup (what `auto` decides, the options, the cache, the priority): engine/inductor_setup.py.

Frozen and autotuned (`INDUCTOR_OPTIONS`): the weights, and the quantized projections' CPU-packed forms, are
constants of the graph, and each matmul shape is timed at compile time between aten's packed kernel and Inductor's
CPP GEMM template over a weight it reblocks (a second copy of the weights that choose it: int8's, at ~1x their
bytes). At batch 1 the template times 1.2-1.7x faster than aten's int8 kernel per shape, which is compute-bound.
The code that calls the kernels is C++ (`cpp_wrapper`), and small kernels run on one thread (`cpp.min_chunk_size`):
benchmarks/cpu_compile_options.py measures both against the step without them.

MoE layers compile with float experts (`compiled_ops.moe_experts` gathers the chosen experts inside the graph).
Quantized experts loop over the chosen ones on the host: their compile fails at once and the engine stays eager.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
import types
from collections import deque
from collections.abc import Callable
from typing import Any

import torch

from streamserve.engine.batch import threads_for
from streamserve.engine.compiled_ops import COMPILED_CPU_OPS
from streamserve.engine.graphs import MIN_BUCKET, DecodeGraphs, policy_key
from streamserve.engine.inductor_setup import (
    INDUCTOR_OPTIONS,
    CompileAborted,
    EngineFirst,
    cpu_compile_wanted,
    guard_fx_traces,
    inductor,
    inductor_cache_dir,
    input_guards,
    lower_priority,
    stop_at_exit,
)
from streamserve.engine.openmp import release_openmp_threads
from streamserve.engine.static_step import Entry, GraphKey, Part, PolicyKey, build_entry
from streamserve.errors import InvalidInputError
from streamserve.models import CausalLM
from streamserve.sessions import KVPool, WindowPolicy

log = logging.getLogger("streamserve")

MAX_COMPILED = 8  # step shapes compiled per engine (ready or failed); others always run eagerly
COMPILE_AFTER_STEPS = 16  # a shape is queued for compiling once it ran this many steps
SEEN_LIMIT = 256  # shapes whose steps are counted at a time (the count restarts when full)
CHECK_TOLERANCE = 0.05  # compiled vs eager logits on the scratch step: max |diff| <= this * (1 + max |logit|)

CompileKey = tuple[int, bool, tuple[tuple[PolicyKey, int], ...], int]  # W, all rows, (policy, batch)..., threads
def traced_model(model: CausalLM) -> CausalLM:
    """The model the compiled steps trace: the same layers and weights (a shallow copy) with its own op table
    (attention as matmul + softmax)."""
    traced = copy.copy(model)
    traced.ops = COMPILED_CPU_OPS
    return traced


def compile_key(key: GraphKey, threads: int) -> CompileKey:
    width, all_rows, parts = key
    return width, all_rows, tuple((p.policy, p.batch) for p in parts), threads


class CompileRefused(RuntimeError):
    """A compile outside the compile thread (a guard failed on a real step): that step runs eagerly."""


def scratch_pool(pool: KVPool) -> KVPool:
    """A pool of the same tensor shapes as `pool` (so compiled guards hold for both) that shares nothing with it:
    uninitialized, so the system maps only what is touched; page 0, which a scratch step writes and reads, is
    zeroed (freed heap memory may hold NaNs)."""
    scratch = copy.copy(pool)
    scratch.k = [torch.empty_like(t) for t in pool.k]
    scratch.v = [torch.empty_like(t) for t in pool.v]
    for t in (*scratch.k, *scratch.v):
        t[0].zero_()
    scratch.k_slots = [t.view(-1, pool.num_kv_heads, pool.head_dim) for t in scratch.k]
    scratch.v_slots = [t.view(-1, pool.num_kv_heads, pool.head_dim) for t in scratch.v]
    return scratch


def decode_graphs(model: CausalLM, pool: KVPool, max_batch: int, ops: str, cuda_graphs: str, cpu_compile: str,
                  wide: bool, quiet: threading.Event | None = None) -> DecodeGraphs | None:
    """The engine's fixed-shape decode steps (`Engine.from_pretrained`): CUDA graphs with `cuda_graphs` "on"
    (or "auto" on CUDA with Triton kernels); on a CPU with torch kernels `cpu_compile` "auto" (the default, where a
    compiler is there: `cpu_compile_wanted`) or "on" runs the same steps compiled (elsewhere it has no effect).
    None: every step runs eagerly. `wide`: `BatchForward.wide`. `quiet`: set while the engine has no work (the
    compile yields to it otherwise: `EngineFirst`)."""
    if cuda_graphs not in ("auto", "on", "off"):
        raise InvalidInputError(f"cuda_graphs must be auto, on or off, got {cuda_graphs!r}")
    dev = pool.device
    compiled = cpu_compile_wanted(cpu_compile, dev.type, ops)
    if not (compiled or cuda_graphs == "on" or (cuda_graphs == "auto" and dev.type == "cuda" and ops == "triton")):
        return None
    graphs = DecodeGraphs.start(model, pool, max_batch, dev.type == "cuda")
    if compiled:
        start_compiled_steps(graphs, pool, wide, quiet)
    return graphs


def compile_note(graphs: DecodeGraphs | None, tell: Callable[[str], None]) -> str:
    """For a command's ready line: what the decode step runs as now ("" with no compiled steps); `tell` gets a
    line once the compiled step serves."""
    compiled = graphs.compiled if graphs is not None else None
    if not isinstance(compiled, CompiledSteps):
        return ""
    compiled.when_ready(lambda message: tell(f"streamserve: {message}"))
    if compiled.ready_after is not None:
        return "; decode step compiled"
    return "; the decode step compiles in the background (eager until ready; --cpu-compile off to skip)"


def start_compiled_steps(graphs: DecodeGraphs, pool: KVPool, wide: bool,
                         quiet: threading.Event | None = None) -> CompiledSteps:
    """Compile `graphs`' CPU steps from now on (`wide`: the model's steps use every thread, `BatchForward.wide`);
    the start-up shape (W 1, batch 1, the default policy) is queued at once."""
    compiled = graphs.compiled = CompiledSteps(graphs.model, pool, quiet)
    with threads_for(pool.device, 1, wide):  # the count a one-token step runs with
        threads = torch.get_num_threads()
    policy = WindowPolicy()
    pk = policy_key(policy)
    compiled.request((1, False, (Part(pk, 1, (MIN_BUCKET,) * len(pool.groups)),)), {pk: policy}, threads)
    return compiled


class CompiledSteps:
    def __init__(self, model: CausalLM, pool: KVPool, quiet: threading.Event | None = None) -> None:
        self.model, self.pool = model, pool
        if quiet is None:  # no engine loop to yield to: always quiet
            quiet = threading.Event()
            quiet.set()
        self.engine_first = EngineFirst(quiet)  # the compile's GIL slices while the engine steps
        self.traced = traced_model(model)
        self._fns: dict[CompileKey, Callable[..., torch.Tensor]] = {}  # ready
        self.failed: dict[CompileKey, str] = {}  # shape -> why it stays eager
        self.compile_seconds: dict[CompileKey, float] = {}
        self._queued: set[CompileKey] = set()  # queued, compiling, ready or failed: never queued again
        self._seen: dict[CompileKey, int] = {}  # steps run per shape not queued yet
        self._queue: deque[tuple[CompileKey, GraphKey, dict[PolicyKey, WindowPolicy]]] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self._scratch: KVPool | None = None
        self.idle = threading.Event()  # set while nothing is queued or compiling
        self.idle.set()
        self.steps = 0  # steps served from compiled code
        self.eager_steps = 0  # steps of these shapes that ran eagerly (not ready, failed, refused)
        self.started = time.perf_counter()
        self.ready_after: float | None = None  # seconds from the start to the first compiled shape's publication
        self._on_ready: list[Callable[[str], None]] = []  # told once, when the first shape serves compiled

    # ---- the engine thread ----------------------------------------------------------------------------------
    def run(self, entry: Entry, key: GraphKey, reload: Callable[[], object]) -> torch.Tensor:
        """The logits of the loaded entry: compiled when its shape is ready, else eagerly (queuing its compile)."""
        ck = compile_key(key, torch.get_num_threads())
        fn = self._fns.get(ck)
        if fn is None:
            self._count(ck, key, entry)
            self.eager_steps += 1
            return entry.forward(self.model)
        try:
            with torch.inference_mode():
                out = fn(entry.ids, entry.kvs, entry.rows)
        except Exception as e:  # a recompile refused, or a fault: this shape runs eagerly for good
            self._fail(ck, e)
            reload()  # the buffers are only read by a step, but the step is run again from scratch
            self.eager_steps += 1
            return entry.forward(self.model)
        self.steps += 1
        return out

    def request(self, key: GraphKey, policies: dict[PolicyKey, WindowPolicy], threads: int) -> None:
        """Queue shape `key` (run on `threads` intra-op threads) for compiling now (start-up)."""
        self._enqueue(compile_key(key, threads), key, policies)

    def _count(self, ck: CompileKey, key: GraphKey, entry: Entry) -> None:
        if ck in self._queued:
            return
        n = self._seen.get(ck, 0) + 1
        if n < COMPILE_AFTER_STEPS:
            if n == 1 and len(self._seen) >= SEEN_LIMIT:
                self._seen.clear()
            self._seen[ck] = n
            return
        self._seen.pop(ck, None)
        self._enqueue(ck, key, {part.policy: static.slots[0].policy
                                for part, static in zip(key[2], entry.parts, strict=True)})

    def _enqueue(self, ck: CompileKey, key: GraphKey, policies: dict[PolicyKey, WindowPolicy]) -> None:
        with self._cv:
            if self._closed or ck in self._queued:
                return
            self._queued.add(ck)
            if len(self._queued) > MAX_COMPILED:
                self.failed[ck] = f"over the limit of {MAX_COMPILED} compiled shapes"
                return
            self._queue.append((ck, key, policies))
            self.idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._work, name="streamserve-compile", daemon=True)
                stop_at_exit(self)
                self._thread.start()
            self._cv.notify()

    def _fail(self, ck: CompileKey, e: BaseException) -> None:
        self._fns.pop(ck, None)
        if ck not in self.failed:  # the first line says what (Dynamo's messages run to pages)
            self.failed[ck] = f"{type(e).__name__}: {next(iter(str(e).strip().splitlines()), '')}"[:300]
            log.warning("cpu_compile: the step shape %s runs eagerly: %s", ck, self.failed[ck])

    @property
    def thread(self) -> threading.Thread | None:
        """The compile thread (None until the first compile is queued)."""
        return self._thread

    @property
    def ready(self) -> int:
        return len(self._fns)

    def when_ready(self, tell: Callable[[str], None]) -> None:
        """`tell(message)` once the first shape serves compiled (on the compile thread; now if one does)."""
        with self._cv:
            if self.ready_after is None:
                self._on_ready.append(tell)
                return
        tell(self._ready_message())

    def _ready_message(self) -> str:
        return (f"the compiled decode step serves from now on ({self.ready_after:.0f}s after start; compiled in "
                f"{min(self.compile_seconds.values(), default=0.0):.0f}s)")

    def describe(self) -> dict[str, Any]:
        """For the engine's stats: `state` is "compiling" (nothing compiled yet, steps run eagerly), "active" (at
        least one shape serves compiled) or "failed" (every compile failed: eager for good)."""
        state = "active" if self._fns else "failed" if self.failed and self.idle.is_set() else "compiling"
        return {"state": state, "ready_after_s": self.ready_after, "shapes_ready": len(self._fns),
                "shapes_failed": len(self.failed), "compile_seconds": sum(self.compile_seconds.values()),
                "steps_compiled": self.steps, "steps_eager": self.eager_steps}

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or compiling -> whether that happened within `timeout`."""
        return self.idle.wait(timeout)

    def close(self) -> None:
        """Stop: nothing more is compiled or published. Never waits: a compile in progress (minutes, cold) cannot
        be interrupted, so the thread (a daemon, at the lowest priority) ends when it is done, its result
        dropped; a process that exits first does not wait for it."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify()
        self.idle.set()

    # ---- the compile thread ---------------------------------------------------------------------------------
    def _work(self) -> None:
        try:
            self._compile_queued()
        except CompileAborted:  # the interpreter exits (inductor_setup.stop_compiles_at_exit)
            log.info("cpu_compile: a compile was stopped by the interpreter's exit")

    def _compile_queued(self) -> None:
        lower_priority()  # the engine's steps first: a serving engine keeps its deadlines while this compiles
        guard_fx_traces()  # an FX trace and an eager engine step never overlap
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self.idle.set()
                    self._cv.wait()
                if self._closed:
                    return
                ck, key, policies = self._queue.popleft()
            try:
                t0 = time.perf_counter()
                with self.engine_first:  # imports, the trace, the lowering: the engine's steps go first
                    fn = self._compile(ck, key, policies)
                self.compile_seconds[ck] = time.perf_counter() - t0
                tell: list[Callable[[str], None]] = []
                with self._cv:
                    if not self._closed:
                        self._fns[ck] = fn
                        if self.ready_after is None:  # the first: who waits for it is told
                            self.ready_after = time.perf_counter() - self.started
                            tell, self._on_ready = self._on_ready, []
                for t in tell:
                    try:
                        t(self._ready_message())
                    except Exception:  # a listener's fault is not the compile's
                        log.exception("cpu_compile: telling that the compiled step serves failed")
                log.info("cpu_compile: the compiled decode step serves shape %s (compiled in %.1fs, %.1fs after "
                         "start)", ck, self.compile_seconds[ck], time.perf_counter() - self.started)
            except Exception as e:  # logged once; the shape stays eager
                self._fail(ck, e)
            finally:  # this thread's OpenMP workers (autotuning, the check): not kept while it waits
                release_openmp_threads()

    def _backend(self, gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
        if threading.current_thread() is not self._thread:
            raise CompileRefused("a compile was asked for outside the compile thread (a guard failed)")
        return inductor(gm, example_inputs)

    def _compile(self, ck: CompileKey, key: GraphKey, policies: dict[PolicyKey, WindowPolicy]
                 ) -> Callable[..., torch.Tensor]:
        """Compile shape `ck` on scratch buffers and check it against eager -> the compiled callable."""
        inductor_cache_dir()
        from torch._dynamo import mark_dynamic  # (importing torch._dynamo writes Inductor's default cache dir)

        torch.set_num_threads(ck[3])  # this thread's own setting: Inductor's kernels are generated for it
        if self._scratch is None:
            self._scratch = scratch_pool(self.pool)
        # distinct key buckets per (part, layer group): equal sizes would be unified into one symbol, and a real
        # step whose buckets differ would then fail the guard
        n_groups = len(key[2][0].keys)
        parts = tuple(Part(p.policy, p.batch, tuple(64 << (i * n_groups + g) for g in range(n_groups)))
                      for i, p in enumerate(key[2]))
        entry = build_entry((key[0], key[1], parts), self._scratch, policies)
        for static in entry.parts:  # one graph for every key bucket: the read length is symbolic
            for t in (*static.k_pos, *static.read_slots):
                mark_dynamic(t, 1)
            for slot in static.slots:
                for grp in slot.groups:
                    mark_dynamic(grp.k_pos, 0)
                    mark_dynamic(grp.read_slots, 0)
        expect = entry.forward(self.model)  # eagerly: also packs quantized weights before tracing reads them
        fn = torch.compile(self._step_function(len(self.compile_seconds) + len(self.failed)),
                           backend=self._backend, fullgraph=True, dynamic=False,
                           options={"guard_filter_fn": input_guards})
        import torch._inductor.config as inductor_config

        with torch.inference_mode(), inductor_config.patch(INDUCTOR_OPTIONS):  # the trace and compile happen here
            got = fn(entry.ids, entry.kvs, entry.rows)
        diff = (got - expect).abs().max().item()
        if not diff <= CHECK_TOLERANCE * (1 + expect.abs().max().item()):  # NaN fails too
            raise RuntimeError(f"compiled logits differ from eager ones by {diff:.3g}")
        return fn

    def _step_function(self, n: int) -> Callable[..., torch.Tensor]:
        """forward_batch on the traced model, as a function with its own code object (Dynamo caches per code)."""
        traced, raw = self.traced, CausalLM.forward_batch.__wrapped__  # type: ignore[attr-defined]

        def step(ids: torch.Tensor, kvs: list[Any], rows: torch.Tensor | None) -> torch.Tensor:
            return raw(traced, ids, kvs, rows)

        code = step.__code__.replace(co_name=f"decode_step_{n}")
        return types.FunctionType(code, step.__globals__, code.co_name, step.__defaults__, step.__closure__)
