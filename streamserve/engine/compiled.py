"""Compiled CPU decode steps (`cpu_compile` "auto", the default, or "on"): the fixed-shape steps of engine/graphs.py
run from code that AOTInductor generated, compiled in a child process at the lowest CPU priority while the same
steps run eagerly.

What is compiled: `CausalLM.forward_batch` over a step's static buffers (engine/static_step.py), exported whole
(`torch.export`, engine/exported_step.py) with attention as matmul + masked softmax (engine/compiled_ops.py) and
compiled into a package (a shared library and its constants) by the compile worker (engine/compile_worker.py). One
package per `CompileKey` = (width W, any all-rows session, per part its window policy and batch bucket, intra-op
threads): the key-read lengths are dynamic, so one package serves every key bucket of a shape (a long chat crosses
64, 128, 256, ... keys without a new compile). Threads are part of the key because Inductor bakes the thread count
into its OpenMP kernels.

Why a child process: tracing and lowering are minutes of Python (cold), and in the engine's process they held the
GIL against the engine thread: a 2-core real-time loop missed about half its deadlines while a compile ran, however
the compile thread yielded (benchmarks/compile_background.py). The worker shares only the CPUs, at SCHED_IDLE, and
is stopped while the engine has work (engine/worker_process.py). The engine's compile thread only waits for it, then
loads the library between two steps (`quiet`: loading holds the GIL for ~0.1 s) and publishes it. The library's
step has no Python inside (no guards, C++ calling the kernels).

Cached: packages live under Inductor's cache directory (`inductor_setup.step_cache_dir`; the streamserve cache home
unless TORCHINDUCTOR_CACHE_DIR is set), named by a digest of everything they depend on (the model's fingerprint,
dtype and quantize mode, the shape, the pool's tensor shapes, Inductor's options, torch's version, the CPU, the
source of the model code: `inductor_setup.step_digest`). A restart, or `streamserve models pull` before it, loads
the package in well under a second; no worker runs.

Bounded: a shape is queued after it ran `COMPILE_AFTER_STEPS` times (the start-up shape, W 1 batch 1 of the
default policy, at once), and at most `MAX_COMPILED` shapes are ever compiled per engine (ready or failed);
the rest run eagerly. Graph keys are bucketed already (graphs.py), so no client can grow either number. Each
loaded package holds its own copy of the model's weights as its constants (frozen; SmolLM2-135M's is 240 MB).

Never waits, never wrong: a step whose shape is not ready runs eagerly. The worker checks the compiled logits
against the eager ones on scratch buffers before the package is moved into place; a compile that fails (or
disagrees) is logged once and its shape stays eager; a package that raises on a real step makes that step rerun
eagerly and its shape stay eager. `close()` (engine shutdown) never waits: it kills the worker (its process group:
the C++ compilers it started too).

Frozen and autotuned (`INDUCTOR_OPTIONS`): the weights, and the quantized projections' CPU-packed forms, are
constants of the package, and each matmul shape is timed at compile time between aten's packed kernel and
Inductor's CPP GEMM template over a weight it reblocks. At batch 1 the template times 1.2-1.7x faster than aten's
int8 kernel per shape, which is compute-bound. Small kernels run on one thread (`cpp.min_chunk_size`):
benchmarks/cpu_compile_options.py measures the options against the step without them.

MoE layers compile with float experts (`compiled_ops.moe_experts` gathers the chosen experts inside the graph).
Quantized experts loop over the chosen ones on the host: their export fails and the engine stays eager.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamserve.engine.batch import threads_for
from streamserve.engine.exported_step import ModelRecipe, flat_inputs, load_step_library, policy_spec, pool_spec
from streamserve.engine.graphs import MIN_BUCKET, DecodeGraphs, policy_key
from streamserve.engine.inductor_setup import (
    INDUCTOR_OPTIONS,
    cpu_compile_wanted,
    source_digest,
    step_cache_dir,
    step_digest,
    stop_at_exit,
)
from streamserve.engine.static_step import Entry, GraphKey, Part, PolicyKey
from streamserve.engine.worker_process import WorkerProcess
from streamserve.errors import InvalidInputError
from streamserve.models import CausalLM
from streamserve.sessions import KVPool, WindowPolicy

log = logging.getLogger("streamserve")

MAX_COMPILED = 8  # step shapes compiled per engine (ready or failed); others always run eagerly
COMPILE_AFTER_STEPS = 16  # a shape is queued for compiling once it ran this many steps
SEEN_LIMIT = 256  # shapes whose steps are counted at a time (the count restarts when full)
LOAD_WAIT_S = 2.0  # the most a finished package waits for a moment the engine has no work, to load then
CompileKey = tuple[int, bool, tuple[tuple[PolicyKey, int], ...], int]  # W, all rows, (policy, batch)..., threads
StepFn = Callable[[Entry], torch.Tensor]


def compile_key(key: GraphKey, threads: int) -> CompileKey:
    width, all_rows, parts = key
    return width, all_rows, tuple((p.policy, p.batch) for p in parts), threads


def load_package(path: Path) -> Callable[[list[torch.Tensor]], torch.Tensor]:
    """A compiled step's library (its inputs: exported_step.flat_inputs)."""
    return load_step_library(path)


def decode_graphs(model: CausalLM, pool: KVPool, max_batch: int, ops: str, cuda_graphs: str, cpu_compile: str,
                  wide: bool, recipe: ModelRecipe | None = None, quiet: threading.Event | None = None
                  ) -> DecodeGraphs | None:
    """The engine's fixed-shape decode steps (`Engine.from_pretrained`): CUDA graphs with `cuda_graphs` "on"
    (or "auto" on CUDA with Triton kernels); on a CPU with torch kernels `cpu_compile` "auto" (the default, where a
    compiler is there: `cpu_compile_wanted`) or "on" runs the same steps compiled (elsewhere it has no effect;
    `recipe`: how the compile worker loads the model again, None: never compiled). None: every step runs eagerly.
    `wide`: `BatchForward.wide`. `quiet`: set while the engine has no work (a package loads then)."""
    if cuda_graphs not in ("auto", "on", "off"):
        raise InvalidInputError(f"cuda_graphs must be auto, on or off, got {cuda_graphs!r}")
    dev = pool.device
    compiled = cpu_compile_wanted(cpu_compile, dev.type, ops) and recipe is not None
    if not (compiled or cuda_graphs == "on" or (cuda_graphs == "auto" and dev.type == "cuda" and ops == "triton")):
        return None
    graphs = DecodeGraphs.start(model, pool, max_batch, dev.type == "cuda")
    if compiled:
        assert recipe is not None
        start_compiled_steps(graphs, pool, wide, recipe, quiet)
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


def start_compiled_steps(graphs: DecodeGraphs, pool: KVPool, wide: bool, recipe: ModelRecipe,
                         quiet: threading.Event | None = None) -> CompiledSteps:
    """Compile `graphs`' CPU steps from now on (`wide`: the model's steps use every thread, `BatchForward.wide`);
    the start-up shape (W 1, batch 1, the default policy) is queued at once. Imports torch._inductor and reads the
    model code's digest here, on the caller's thread (a second of Python, which on the compile thread would hold the
    GIL against the engine's first steps)."""
    step_cache_dir()
    source_digest()
    compiled = graphs.compiled = CompiledSteps(graphs.model, pool, recipe, quiet)
    with threads_for(pool.device, 1, wide):  # the count a one-token step runs with
        threads = torch.get_num_threads()
    policy = WindowPolicy()
    pk = policy_key(policy)
    compiled.request((1, False, (Part(pk, 1, (MIN_BUCKET,) * len(pool.groups)),)), {pk: policy}, threads)
    return compiled


class CompiledSteps:
    def __init__(self, model: CausalLM, pool: KVPool, recipe: ModelRecipe,
                 quiet: threading.Event | None = None) -> None:
        self.model, self.pool, self.recipe = model, pool, recipe
        if quiet is None:  # no engine loop to wait for: always quiet
            quiet = threading.Event()
            quiet.set()
        self.quiet = quiet
        self.process = WorkerProcess(quiet)  # the compile worker, paused while the engine has work
        self._fns: dict[CompileKey, StepFn] = {}  # ready
        self.failed: dict[CompileKey, str] = {}  # shape -> why it stays eager
        self.compile_seconds: dict[CompileKey, float] = {}  # the worker's time (0 for a package from the cache)
        self.from_cache: set[CompileKey] = set()  # shapes whose package was in the cache
        self._queued: set[CompileKey] = set()  # queued, compiling, ready or failed: never queued again
        self._seen: dict[CompileKey, int] = {}  # steps run per shape not queued yet
        self._queue: deque[tuple[CompileKey, GraphKey, dict[PolicyKey, WindowPolicy]]] = deque()
        self._cv = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closed = False
        self.idle = threading.Event()  # set while nothing is queued or compiling
        self.idle.set()
        self.steps = 0  # steps served from compiled code
        self.eager_steps = 0  # steps of these shapes that ran eagerly (not ready, failed)
        self.started = time.perf_counter()
        self.ready_after: float | None = None  # seconds from the start to the first compiled shape's publication
        self._on_ready: list[Callable[[str], None]] = []  # told once, when the first shape serves compiled

    # ---- the engine thread ----------------------------------------------------------------------------------
    def serves(self, key: GraphKey, policies: dict[PolicyKey, WindowPolicy]) -> bool:
        """Whether shape `key` runs compiled now. If not, the caller runs the plain eager step (not the padded
        static one: it reads every key of its bucket, padding included, so it is the slower of the two), and the
        step is counted: a shape seen COMPILE_AFTER_STEPS times is queued for compiling."""
        ck = compile_key(key, torch.get_num_threads())
        if ck in self._fns:
            return True
        self._count(ck, key, policies)
        self.eager_steps += 1
        return False

    def run(self, entry: Entry, key: GraphKey, reload: Callable[[], object]) -> torch.Tensor:
        """The logits of the loaded entry, whose shape it `serves`: compiled, or eagerly if its code fails."""
        ck = compile_key(key, torch.get_num_threads())
        fn = self._fns.get(ck)
        if fn is None:  # not ready (a caller that did not ask): eagerly over the entry
            self.eager_steps += 1
            return entry.forward(self.model)
        try:
            with torch.inference_mode():
                out = fn(entry)
        except Exception as e:  # a fault: this shape runs eagerly for good
            self._fail(ck, e)
            reload()  # the step may have written some layers' keys: it is run again from scratch
            self.eager_steps += 1
            return entry.forward(self.model)
        self.steps += 1
        return out

    def request(self, key: GraphKey, policies: dict[PolicyKey, WindowPolicy], threads: int) -> None:
        """Queue shape `key` (run on `threads` intra-op threads) for compiling now (start-up)."""
        self._enqueue(compile_key(key, threads), key, policies)

    def _count(self, ck: CompileKey, key: GraphKey, policies: dict[PolicyKey, WindowPolicy]) -> None:
        if ck in self._queued:
            return
        n = self._seen.get(ck, 0) + 1
        if n < COMPILE_AFTER_STEPS:
            if n == 1 and len(self._seen) >= SEEN_LIMIT:
                self._seen.clear()
            self._seen[ck] = n
            return
        self._seen.pop(ck, None)
        self._enqueue(ck, key, policies)

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
        if ck not in self.failed:  # the first line says what
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
        how = ("loaded from the cache" if self.from_cache and not self.builds else
               f"compiled in {min(self.compile_seconds.values(), default=0.0):.0f}s")
        return f"the compiled decode step serves from now on ({self.ready_after:.0f}s after start; {how})"

    def describe(self) -> dict[str, Any]:
        """For the engine's stats: `state` is "compiling" (nothing compiled yet, steps run eagerly), "active" (at
        least one shape serves compiled) or "failed" (every compile failed: eager for good)."""
        state = "active" if self._fns else "failed" if self.failed and self.idle.is_set() else "compiling"
        return {"state": state, "ready_after_s": self.ready_after, "shapes_ready": len(self._fns),
                "shapes_failed": len(self.failed), "shapes_from_cache": len(self.from_cache),
                "compile_seconds": sum(self.compile_seconds.values()), "steps_compiled": self.steps,
                "steps_eager": self.eager_steps}

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is queued or compiling -> whether that happened within `timeout`."""
        return self.idle.wait(timeout)

    def close(self) -> None:
        """Stop: nothing more is compiled or published, and the worker running now is killed. Never waits."""
        with self._cv:
            self._closed = True
            self._queue.clear()
            self._cv.notify()
        self.process.close()
        self.idle.set()

    @property
    def builds(self) -> int:
        """Compile workers started (a package loaded from the cache starts none)."""
        return self.process.runs

    # ---- the compile thread ---------------------------------------------------------------------------------
    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self.idle.set()
                    self._cv.wait()
                if self._closed:
                    return
                ck, key, policies = self._queue.popleft()
            try:
                fn = self._compile(ck, key, policies)
                tell: list[Callable[[str], None]] = []
                with self._cv:
                    if self._closed:
                        return
                    self._fns[ck] = fn
                    if self.ready_after is None:  # the first: who waits for it is told
                        self.ready_after = time.perf_counter() - self.started
                        tell, self._on_ready = self._on_ready, []
                for t in tell:
                    try:
                        t(self._ready_message())
                    except Exception:  # a listener's fault is not the compile's
                        log.exception("cpu_compile: telling that the compiled step serves failed")
                log.info("cpu_compile: the compiled decode step serves shape %s (%s, %.1fs after start)", ck,
                         "from the cache" if ck in self.from_cache else f"compiled in {self.compile_seconds[ck]:.1f}s",
                         time.perf_counter() - self.started)
            except Exception as e:  # logged once; the shape stays eager
                if self._closed:  # the worker was killed by close()
                    return
                self._fail(ck, e)

    def _compile(self, ck: CompileKey, key: GraphKey, policies: dict[PolicyKey, WindowPolicy]) -> StepFn:
        """The package of shape `ck`, from the cache or built by the worker now, loaded -> its step function."""
        request = {"recipe": self.recipe.__dict__, "width": key[0], "all_rows": key[1], "threads": ck[3],
                   "parts": [{"policy": policy_spec(policies[p.policy]), "batch": p.batch} for p in key[2]],
                   "pool": pool_spec(self.pool), "options": dict(INDUCTOR_OPTIONS)}
        out = step_cache_dir() / f"{step_digest(request)}.so"
        if out.is_file():
            self.from_cache.add(ck)
            self.compile_seconds[ck] = 0.0
        else:
            t0 = time.perf_counter()
            self.process.run({**request, "out": str(out)})
            self.compile_seconds[ck] = time.perf_counter() - t0
        self.quiet.wait(LOAD_WAIT_S)  # between two steps: the load holds the GIL (~0.1 s for SmolLM2-135M)
        with self._cv:
            if self._closed:
                raise RuntimeError("closed")
        try:
            step = load_package(out)
        except Exception:  # a damaged file: gone, so that the next start compiles it again
            out.unlink(missing_ok=True)
            raise
        return lambda entry: step(flat_inputs(entry))
