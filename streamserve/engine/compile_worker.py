"""The compile worker: a child process that compiles one decode step shape of an engine's model into an
AOTInductor package (engine/compiled.py starts it; `python -m streamserve.engine.compile_worker REQUEST.json`).

Why a process: tracing and lowering a step is minutes of Python on a cold cache. In the engine's process it held
Python's GIL against the engine thread's hundreds of torch calls a token, and a real-time loop on two cores missed
half its 200 ms deadlines however the compile yielded (benchmarks/compile_background.py). Here it shares nothing
with the engine but the CPUs, and takes those only when the engine leaves them (`idle_priority`): the engine then
loads the finished package, which runs without Python in its step (no Dynamo guards, C++ calling the kernels).

The request (JSON): the model's recipe (`ModelRecipe`), the step shape (width, all rows, per part its window policy
and batch), the thread count its kernels are generated for, the pool's tensor shapes, Inductor's options, where the
package goes, and the priority. The worker loads the model as the engine did, runs the step eagerly on scratch
buffers, exports it (`torch.export`, the key counts dynamic), compiles and packages it, loads the package and checks
its logits against the eager ones, and only then moves it into place (a failed or killed worker leaves nothing).
Exit status 0: the package is there; else the last stderr line says why."""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

CHECK_TOLERANCE = 0.05  # compiled vs eager logits on the scratch step: max |diff| <= this * (1 + max |logit|)


def idle_priority() -> str:
    """Run this process (and the threads and compilers it starts, which inherit it) only on CPU time nothing else
    wants: Linux's SCHED_IDLE, else the lowest niceness -> which one it got."""
    if hasattr(os, "sched_setscheduler") and hasattr(os, "SCHED_IDLE"):
        try:
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
            return "idle"
        except OSError:
            pass
    try:
        os.nice(19)
        return "nice 19"
    except OSError:
        return "normal"


def die_with_parent(parent: int | None) -> None:
    """End this worker if the engine's process ends first (Linux: the kernel sends SIGKILL when the thread that
    started it ends; that thread waits for this process): a compile nobody will load is minutes of CPU for nothing."""
    if sys.platform == "linux":
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if parent is not None and os.getppid() != parent:  # it ended before the line above ran
        sys.exit(1)


def compile_step(request: dict[str, Any]) -> float:
    """Build the package `request["out"]` -> the max |compiled - eager| logit on the scratch step."""
    import torch
    from torch._inductor import aoti_compile_and_package

    from streamserve.engine.compiled_ops import COMPILED_CPU_OPS
    from streamserve.engine.exported_step import (
        ExportedStep,
        dynamic_shapes,
        flat_inputs,
        load_step_library,
        policy_from_spec,
        pool_from_spec,
        step_inputs,
    )
    from streamserve.engine.graphs import policy_key
    from streamserve.engine.static_step import Part, build_entry
    from streamserve.models import get_ops, load_model, open_pretrained
    from streamserve.models.quantize import check_mode

    torch.set_num_threads(request["threads"])  # Inductor generates its OpenMP kernels for this count
    recipe = request["recipe"]
    pretrained = open_pretrained(Path(recipe["path"]))
    model = load_model(pretrained.checkpoint, pretrained.config, torch.device("cpu"), getattr(torch, recipe["dtype"]),
                       get_ops("torch", "cpu"), check_mode(recipe["quantize"]))
    model.ops = COMPILED_CPU_OPS  # attention as matmul + masked softmax (engine/compiled_ops.py)
    pool = pool_from_spec(request["pool"])
    policies = [policy_from_spec(p["policy"]) for p in request["parts"]]
    n_groups = len(pool.groups)
    # distinct key sizes per (part, group): equal example sizes would be unified into one symbol
    parts = tuple(Part(policy_key(policy), p["batch"], tuple(64 << (i * n_groups + g) for g in range(n_groups)))
                  for i, (policy, p) in enumerate(zip(policies, request["parts"], strict=True)))
    entry = build_entry((request["width"], request["all_rows"], parts), pool,
                        {part.policy: policy for part, policy in zip(parts, policies, strict=True)})
    inputs = step_inputs(entry)
    step = ExportedStep(model, entry)
    with torch.inference_mode():
        expect = step(*inputs).clone()  # eagerly: also packs the quantized weights before the export reads them
    t0 = time.perf_counter()
    exported = torch.export.export(step, inputs, dynamic_shapes=dynamic_shapes(entry))
    print(f"exported in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
    out = Path(request["out"])  # the library (.so) the engine loads
    package = out.with_name(f".{out.stem}.{os.getpid()}.tmp.pt2")  # AOTInductor wants the suffix
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp.so")
    try:
        t0 = time.perf_counter()
        aoti_compile_and_package(exported, package_path=str(package), inductor_configs=request["options"])
        print(f"compiled in {time.perf_counter() - t0:.1f}s", file=sys.stderr, flush=True)
        with zipfile.ZipFile(package) as z:  # the library, weights inside: the engine loads it without unpacking
            (member,) = [n for n in z.namelist() if n.endswith(".so")]
            with z.open(member) as src, tmp.open("wb") as dst:
                shutil.copyfileobj(src, dst, 1 << 20)
        with torch.inference_mode():
            got = load_step_library(tmp)(flat_inputs(entry))
        diff = (got - expect).abs().max().item()
        if not diff <= CHECK_TOLERANCE * (1 + expect.abs().max().item()):  # NaN fails too
            raise RuntimeError(f"compiled logits differ from eager ones by {diff:.3g}")
        os.replace(tmp, out)
        return diff
    finally:
        package.unlink(missing_ok=True)
        tmp.unlink(missing_ok=True)


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m streamserve.engine.compile_worker REQUEST.json", file=sys.stderr)
        return 2
    request = json.loads(Path(argv[1]).read_text())
    die_with_parent(request.get("parent"))
    got = idle_priority() if request.get("idle", True) else "normal"
    print(f"compile worker {os.getpid()} at {got} priority: {request['out']}", file=sys.stderr, flush=True)
    try:
        diff = compile_step(request)
    except Exception as e:  # the parent reads the last line
        import traceback

        traceback.print_exc()
        first = next(iter(str(e).strip().splitlines()), "")
        print(f"compile failed: {type(e).__name__}: {first}"[:300], file=sys.stderr, flush=True)
        return 1
    print(f"package checked against eager (max |diff| {diff:.3g}): {request['out']}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
