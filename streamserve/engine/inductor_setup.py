"""How the compiled CPU decode steps (engine/compiled.py) are set up: whether `cpu_compile="auto"` compiles here,
Inductor's options and on-disk cache, the guard filter, and the compile thread's low priority."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import gc
import logging
import os
import shutil
import sys
import sysconfig
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from streamserve.errors import InvalidInputError
from streamserve.models.store import default_home

log = logging.getLogger("streamserve")

CPU_COMPILE_CHOICES = ("auto", "on", "off")
# `auto` everywhere in this process reads as `off` when this is "off" in the environment: for test suites (every
# engine they build would otherwise start a compile) and machines where background compiles are unwanted
CPU_COMPILE_ENV = "STREAMSERVE_CPU_COMPILE"
COMPILE_NICE = 19  # the compile thread's niceness (Linux): it takes the CPUs the engine leaves


def compiler_missing() -> str | None:
    """Why torch.compile cannot build CPU code here (None: it can): Inductor writes C++ that a C++ compiler builds
    against Python's headers (`cpp_wrapper`)."""
    if sys.platform not in ("linux", "darwin"):
        return f"Inductor's CPU code is not built on {sys.platform} by streamserve"
    names = [os.environ.get("CXX") or "", "g++", "clang++", "c++"]
    if not any(n and shutil.which(n) for n in names):
        return "no C++ compiler (g++ or clang++) on PATH"
    if not (Path(sysconfig.get_path("include")) / "Python.h").is_file():
        return f"no Python headers ({sysconfig.get_path('include')}/Python.h; install python3-dev)"
    return None


def cpu_compile_wanted(setting: str, device_type: str, ops: str) -> bool:
    """Whether decode steps run compiled: `on` on a CPU with torch kernels; `auto` (the default) the same where a
    compiler is there and STREAMSERVE_CPU_COMPILE is not "off"; `off` never. CUDA and Triton kernels never
    (CUDA graphs are their fixed-shape steps)."""
    if setting not in CPU_COMPILE_CHOICES:
        raise InvalidInputError(f"cpu_compile must be auto, on or off, got {setting!r}")
    if setting == "off" or device_type != "cpu" or ops != "torch":
        return False
    if setting == "on":
        return True
    if os.environ.get(CPU_COMPILE_ENV, "").strip().lower() == "off":
        return False
    why = compiler_missing()
    if why is not None:
        log.info("cpu_compile auto: decode steps run eagerly (%s)", why)
    return why is None


class TraceGate:
    """FX's symbolic tracer (`Tracer.trace`, run by Inductor's passes and pattern matcher) patches
    `torch.nn.Module.__call__` for every thread while it traces: an eager forward on the engine thread at that
    moment fails ("module is not installed as a submodule"). So the two never overlap: the engine's forwards go
    through `forward()`, a compile's traces through `trace()` (`guard_fx_traces`). The engine goes first: a trace
    starts only while no forward runs or waits, and a forward waits only for the trace in progress (a trace is never
    paused: `EngineFirst`). make_fx's tracer (AOT autograd's trace of a whole step, seconds long) is not gated: its
    `call_module` runs a foreign module as it is, so an engine forward under its patches works."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._tracer: int | None = None  # the thread whose trace runs
        self._depth = 0  # its nested traces
        self._forwards = 0  # engine forwards running
        self._waiting = 0  # engine forwards waiting for a trace to end

    @contextlib.contextmanager
    def forward(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cv:
            self._waiting += 1
            while self._tracer is not None and self._tracer != me:
                self._cv.wait()
            self._waiting -= 1
            self._forwards += 1
        _tracing.forwards = getattr(_tracing, "forwards", 0) + 1
        try:
            yield
        finally:
            _tracing.forwards -= 1
            with self._cv:
                self._forwards -= 1
                self._cv.notify_all()

    @contextlib.contextmanager
    def trace(self) -> Iterator[None]:
        me = threading.get_ident()
        with self._cv:
            if self._tracer != me:  # a trace inside this thread's own forward waits for the others' only
                mine = getattr(_tracing, "forwards", 0)
                while self._forwards - mine or self._waiting or self._tracer is not None:
                    self._cv.wait()
                self._tracer = me
            self._depth += 1
        _tracing.depth = getattr(_tracing, "depth", 0) + 1
        try:
            yield
        finally:
            _tracing.depth -= 1
            with self._cv:
                self._depth -= 1
                if not self._depth:
                    self._tracer = None
                    self._cv.notify_all()


FX_TRACES = TraceGate()
_tracing = threading.local()  # .depth: gated traces in progress on this thread; .forwards: its engine forwards


def guard_fx_traces() -> None:
    """Make every `torch.fx.Tracer.trace` but make_fx's go through FX_TRACES.trace() (once per process)."""
    from torch.fx import _symbolic_trace
    from torch.fx.experimental.proxy_tensor import PythonKeyTracer

    original = _symbolic_trace.Tracer.trace
    if getattr(original, "holds_fx_traces", False):
        return

    @functools.wraps(original)
    def trace(self: Any, *args: Any, **kwargs: Any) -> Any:
        if isinstance(self, PythonKeyTracer):
            return original(self, *args, **kwargs)
        with FX_TRACES.trace():
            return original(self, *args, **kwargs)

    trace.holds_fx_traces = True  # type: ignore[attr-defined]
    _symbolic_trace.Tracer.trace = trace  # type: ignore[method-assign]


class EngineFirst:
    """While the engine steps, the compile thread holds Python's GIL only in short slices.

    Tracing and lowering a step (Dynamo, Inductor) is Python: left alone it holds the GIL most of the time, and each
    of the engine thread's hundreds of torch calls per token, which give the GIL up and take it back, waits up to
    Python's switch interval (5 ms) to get it back: a 200 ms real-time tick took 2-4 s while a compile ran
    (benchmarks/compile_background.py). CPU priority (`lower_priority`) does not help: the kernel does not
    schedule the GIL. So the compile thread pauses itself: at the end of each garbage collection it triggers
    (`gc.callbacks`; tracing allocates, so they come every few hundred microseconds), while the engine is not
    `quiet` (engine/loop.py: work is queued or a step runs), after SLICE_S of running it waits PAUSE_S or until
    the engine is quiet. A profile hook (`sys.setprofile`) would pause it at every call, but tripled the compile's
    time even with the engine idle; a garbage collection's callback costs nothing measurable. Never a full stop: a
    lock the compile holds (Dynamo's compile lock, an import) may be what the engine waits for. Autotuning's timings
    take the median of many runs, which a pause within one does not move."""

    SLICE_S = 0.001
    PAUSE_S = 0.010

    def __init__(self, quiet: threading.Event) -> None:
        self.quiet = quiet
        self.thread: int | None = None  # the compile thread's ident while it is inside
        self.slice_end = 0.0
        self.paused_s = 0.0  # the compile's time spent waiting for the engine

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase != "stop" or threading.get_ident() != self.thread or self.quiet.is_set():
            return
        if getattr(_tracing, "depth", 0):  # inside an FX trace: the engine waits for it (FX_TRACES), so no pause
            return
        now = time.perf_counter()
        if now < self.slice_end:
            return
        # a garbage collection's callback cannot raise: an exit's CompileAborted is raised again elsewhere
        with contextlib.suppress(CompileAborted):
            self.quiet.wait(self.PAUSE_S)
        self.slice_end = time.perf_counter() + self.SLICE_S
        self.paused_s += self.slice_end - self.SLICE_S - now

    def __enter__(self) -> EngineFirst:
        self.thread = threading.get_ident()
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc: object) -> None:
        gc.callbacks.remove(self)
        self.thread = None


class CompileAborted(BaseException):
    """Raised inside a compile thread still compiling when the interpreter exits (`stop_compiles_at_exit`): a
    BaseException, which the compilers' own `except Exception` blocks let through."""


class Stoppable(Protocol):
    @property
    def thread(self) -> threading.Thread | None: ...

    def close(self) -> None: ...


EXIT_WAIT_S = 30.0  # the most the interpreter's exit waits for compile threads to stop
_COMPILERS: weakref.WeakSet[Stoppable] = weakref.WeakSet()


def stop_at_exit(compiler: Stoppable) -> None:
    """Stop `compiler`'s thread when the interpreter exits (`stop_compiles_at_exit`)."""
    _COMPILERS.add(compiler)


@atexit.register
def stop_compiles_at_exit() -> None:
    """A daemon thread still inside torch's C++ when Python finalizes is ended by pthread_exit, whose unwinding
    through C++ frames aborts the process ("terminate called without an active exception"): a script that ends
    while its engine compiles would die so. At exit each compile thread is closed (an idle one ends), then
    interrupted: `CompileAborted` is raised in it at its next Python instruction, again until it ends, within
    EXIT_WAIT_S (a compile waits at most for the C++ build in progress)."""
    deadline = time.monotonic() + EXIT_WAIT_S
    for compiler in list(_COMPILERS):
        compiler.close()
        thread = compiler.thread
        while thread is not None and thread.is_alive() and thread.ident is not None and time.monotonic() < deadline:
            ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(thread.ident), ctypes.py_object(CompileAborted))
            thread.join(0.05)


def lower_priority() -> None:
    """Give the calling thread the lowest CPU priority (Linux: niceness is per thread, and the threads and
    processes it starts, OpenMP workers and C++ compilers, inherit it), so that a serving engine's steps keep
    the CPUs while a compile runs. Elsewhere a no-op: other systems' PRIO_PROCESS would lower the whole process."""
    if sys.platform != "linux":
        return
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), COMPILE_NICE)
    except OSError as e:  # a sandbox may refuse: the compile still runs, at normal priority
        log.info("cpu_compile: could not lower the compile thread's priority: %s", e)


def inductor_cache_dir() -> str:
    """Inductor's on-disk cache: the user's TORCHINDUCTOR_CACHE_DIR, else <streamserve home>/inductor (set now,
    before the first compile reads it). Importing torch._dynamo writes Inductor's default (/tmp/torchinductor_USER)
    into the variable: that value counts as unset."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    current = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if current is None or os.path.abspath(current) == os.path.abspath(default_cache_dir()):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = current = str(default_home() / "inductor")
    return current


# Inductor's options for a decode step (set on the compile thread, around the trace: Dynamo reads `freezing` when it
# lifts the weights, Inductor when it lowers them):
# - freezing: the model's weights and packed quantized forms become constants of the graph (they are never written
#   while a step runs), which Inductor may fold and repack;
# - max_autotune with the CPP GEMM template next to aten: each quantized matmul shape is timed once per compile
#   (a few seconds each) between aten's packed kernel and Inductor's own micro-GEMM over a weight it reblocks at
#   compile time. At batch 1 the template reads int8 weights as a stream of blocks where aten's int8 kernel is
#   compute-bound: SmolLM2's compiled int8 step went from 41 to 63 tok/s (benchmarks/cpu_decode.py). Float
#   matmuls are tuned the same way.
# - cpp_wrapper: the code that calls the kernels is C++ too, not a Python function of ~25 statements a layer
#   (buffers, views, size asserts): without it SmolLM2's int4 forward took 1.12x as long
#   (benchmarks/cpu_compile_options.py).
# - cpp.min_chunk_size 32768 (Inductor's default: 512 elements a thread): a kernel parallelizes only with more work
#   than that. A decode step's norms, activations and key gathers are a few thousand elements: run by one thread,
#   they skip an OpenMP fork and join each (with Inductor's default of 512, 1.08x as long, the same benchmark).
#   A long context's key gather, and a batch's, still split.
INDUCTOR_OPTIONS: dict[str, Any] = {"freezing": True, "max_autotune": True, "max_autotune_gemm_backends": "CPP,ATEN",
                                    "cpp_wrapper": True, "cpp.min_chunk_size": 32768}


STEP_INPUTS = ("ids", "kvs", "rows")  # the compiled step function's arguments (`_step_function`)


def input_guards(entries: list[Any]) -> list[bool]:
    """Dynamo's guard filter (`torch.compile(options={"guard_filter_fn": ...})`, one flag per guard: kept?). Kept:
    the guards on the step's arguments (their tensors' shapes, dtypes and strides, the static buffers' structure
    and constants) and on global state (grad mode and the like: guards with no source). Dropped: those on the
    traced model (every module's hooks, attributes and ids) and on the code's globals (modules, functions). Those
    never change while an engine runs: the traced model is the engine's, nothing assigns to it after load, and its
    weights are constants of the graph (frozen) that no guard would compare anyway. A SmolLM2 step holds ~4,600
    guards, ~140 of them on its arguments: checking all of them took 1.1 ms a step, the kept ones 0.5
    (benchmarks/cpu_compile_options.py --variants all_guards)."""
    return [not e.name or e.name.split("[", 1)[0].split(".", 1)[0] in STEP_INPUTS for e in entries]


def inductor(gm: torch.fx.GraphModule, example_inputs: list[Any]) -> Callable[..., Any]:
    """The compile backend: Inductor (C++/OpenMP kernels on a CPU), under `INDUCTOR_OPTIONS` (set by the caller
    around the trace)."""
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs)
