"""Batch-1 CPU decode against memory bandwidth: the engine's weight formats, transformers and llama.cpp.

    python benchmarks/cpu_decode.py [--new 96] [--reps 5] [--with-llamacpp] [--no-compile] [--quick]

Batch-1 decode reads every weight once per token, so its speed is bounded by bytes read per token over the
memory's read rate. In one run, on torch's threads, for SmolLM2-135M-Instruct (its pulled GGUF file: Q4_1
linears, a Q8_0 embedding; left out and said so when not pulled) and the embedded default model:
- the engine with each weight format (`quantize`: "none" float32, "int8", "int4", and on the GGUF "auto", the
  file's own quantization), activations float32;
- the engine with `cpu_compile="on"` in int8 and int4 (`engine_int8_compiled`, `engine_int4_compiled`: the
  fixed-shape decode step compiled by AOTInductor, engine/compiled.py), on the GGUF in "auto" too
  (`engine_auto_compiled`: the file's own 4-bit codes and its Q8_0 head as int8, the bytes llama.cpp reads; "int4"
  re-rounds that head to 4 bits, fewer bytes at a perplexity cost, docs/quantization.md), and for the default
  model in float32 (`engine_none_compiled`: its float MoE experts compile, its quantized ones stay eager), side by
  side with the eager engines;
  the run waits until their background compiles are done before any rep (their seconds are reported, and the
  steps served compiled and eagerly: a timed rep must run compiled); --no-compile (and --quick) leaves them out;
- the engine at its defaults (`engine_defaults`: `Engine.from_pretrained(path)` with no argument: quantize "auto",
  cpu_compile "auto", a 1 GiB KV pool), its compile waited for like the others' (from Inductor's cache when
  `streamserve models pull` or an earlier run warmed it: `ready_after_s` is how long after its load it served
  compiled), its tokens compared with the eager "auto" engine's (the default model: "none");
- transformers float32 on the same weights (the GGUF through `gguf_file=`, the default model's safetensors);
- with --with-llamacpp, llama.cpp on the same GGUF file (benchmarks/llamacpp_peer.py in the virtual environment
  of `make llamacpp-venv`, as a subprocess that answers one rep per line asked).
Each contender decodes --new greedy tokens after a 32-token English prompt, reps interleaved contender by
contender (all see the same load), after a warm-up; the median rep is kept. Before each rep this thread hands its
OpenMP workers back (engine/openmp.py: the read rate's and transformers' pools would otherwise make every parallel
region of the engine thread wake a sleeping worker), so each contender runs with its own threads only. tok/s
counts forwards: the first token comes from the prompt's logits and is not timed, each later one is one forward
(the engine: from its first streamed token to its last).
The read rate is measured in the same run, between the rep rounds (`ReadRate`), and each contender is given as
tok/s and as the fraction of that rate (the median of the samples taken during its model's reps) it uses: bytes
of weights read per token (`weight_bytes_per_token`, llama.cpp: `gguf_bytes_per_token`) x tok/s / read rate.
The KV cache's reads (a few MB at these lengths) are not counted. A model whose weights fit in the CPU's caches
(the default model: 13 MB float32) is not bound by memory: its fraction says how far from that it is.
`matching_prefix`: leading greedy tokens equal to the float32 engine's (what a format's rounding costs).
Human lines go to stderr; the last line printed is one JSON object with every figure and the ratios.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from streamserve import Engine
from streamserve.engine.loading import resolve_model_path
from streamserve.engine.openmp import release_openmp_threads
from streamserve.models import store

ROOT = Path(__file__).resolve().parent.parent
LLAMACPP_PYTHON = ROOT / "build" / "llamacpp-venv" / "bin" / "python"
PEER = Path(__file__).with_name("llamacpp_peer.py")
PROMPT_TOKENS = 32
SMOLLM2 = "smollm2-135m-instruct"


def bench_module(name: str) -> Any:
    """A sibling benchmark script as a module (benchmarks/ is no package), for its helpers."""
    spec = importlib.util.spec_from_file_location(name, Path(__file__).with_name(f"{name}.py"))
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


real_models = bench_module("real_models")  # its English prompt TEXT and hf_model (transformers on a GGUF)
read_bandwidth = bench_module("read_bandwidth")  # the read rate and the bytes a token reads
ReadRate, timed = read_bandwidth.ReadRate, read_bandwidth.timed
weight_bytes_per_token = read_bandwidth.weight_bytes_per_token
gguf_bytes_per_token = read_bandwidth.gguf_bytes_per_token


class Contender:
    """One way of decoding: `rep()` -> (tok/s, the greedy tokens); `bytes_per_token` known after the warm-up."""

    def __init__(self, name: str, rep: Callable[[], tuple[float, list[int]]], bytes_per_token: Callable[[], int],
                 close: Callable[[], None] = lambda: None) -> None:
        self.name, self.rep, self.bytes_per_token, self.close = name, rep, bytes_per_token, close
        self.tok_s: list[float] = []
        self.tokens: list[int] = []
        self.build: dict[str, Any] | None = None  # a peer's build: what its binary was compiled with


COMPILED = "_compiled"  # a mode's suffix: the engine with cpu_compile="on"
COMPILE_TIMEOUT = 900.0  # seconds the run waits for an engine's background compiles


DEFAULTS = "defaults"  # the engine as a user gets it: `Engine.from_pretrained(path)`, no argument


def load_engine(path: Path, mode: str) -> Engine:
    """float32 activations whatever the weights' format; a small KV pool (a 32-token prompt and --new tokens).
    `mode`: a quantize mode, with COMPILED appended for cpu_compile="on"; or DEFAULTS."""
    if mode == DEFAULTS:
        return Engine.from_pretrained(path)
    return Engine.from_pretrained(path, device="cpu", dtype="float32", quantize=mode.removesuffix(COMPILED),
                                  kv_memory="256MiB", cpu_compile="on" if mode.endswith(COMPILED) else "off")


def eager_twin(mode: str, gguf: bool) -> str:
    """The eager engine of the same weights as `mode` (what its greedy tokens are compared with): the defaults
    quantize "auto" (a GGUF keeps its codes; safetensors stay as stored, the default model's float32)."""
    if mode == DEFAULTS:
        return "auto" if gguf else "none"
    return mode.removesuffix(COMPILED)


def wait_compiled(engines: list[Engine], modes: list[str]) -> dict[str, dict[str, Any]]:
    """Wait for the compiled engines' background compiles -> per mode the seconds each compile took (one shape:
    one-token steps of one session, any key count), the wait since the call, and what failed."""
    out: dict[str, dict[str, Any]] = {}
    t0 = time.perf_counter()
    for mode, engine in zip(modes, engines, strict=True):
        compiled = engine.graphs.compiled if engine.graphs is not None else None
        if compiled is None:
            continue
        if not compiled.wait_idle(COMPILE_TIMEOUT):
            raise SystemExit(f"engine_{mode}: still compiling after {COMPILE_TIMEOUT:.0f}s")
        out[mode] = {"compile_s": [round(v, 1) for v in compiled.compile_seconds.values()],
                     "waited_s": round(time.perf_counter() - t0, 1), "failed": list(compiled.failed.values()),
                     "ready_after_s": None if compiled.ready_after is None else round(compiled.ready_after, 1)}
        print(f"engine_{mode}: compiled in {out[mode]['compile_s']} s, failed: {out[mode]['failed']}",
              file=sys.stderr)
    return out


def compiled_steps(engine: Engine) -> tuple[int, int]:
    """(steps served compiled, steps of compiled shapes run eagerly) so far; (0, 0) for an eager engine."""
    compiled = engine.graphs.compiled if engine.graphs is not None else None
    return (compiled.steps, compiled.eager_steps) if compiled is not None else (0, 0)


def engine_contender(mode: str, engine: Engine, prompt: list[int], new: int, fraction: float) -> Contender:
    def rep() -> tuple[float, list[int]]:
        with engine.open_session() as s:
            s.append(token_ids=prompt)
            it = s.iter_generate(max_tokens=new + 1, stop_token_ids=())  # the reply runs ahead of the iteration
            tokens = [next(it)]  # sampled from the prompt's logits
            t0 = time.perf_counter()
            tokens += list(it)  # each one forward of the token before it
            dt = time.perf_counter() - t0
        return new / dt, tokens

    return Contender(f"engine_{mode}", rep, lambda: weight_bytes_per_token(engine.model, fraction),
                     engine.shutdown)


def transformers_contender(path: Path, prompt: list[int], new: int, fraction: float) -> Contender:
    from transformers import AutoModelForCausalLM

    if path.is_file():  # a GGUF: dequantized to float32 by transformers
        hf = real_models.hf_model(path)[0]
    else:
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()

    @torch.inference_mode()
    def rep() -> tuple[float, list[int]]:
        """Greedy with transformers' KV cache: one forward over the prompt (not timed), then one per token."""
        out = hf(torch.tensor([prompt]), use_cache=True)
        past, nxt = out.past_key_values, out.logits[0, -1].argmax()
        tokens = [int(nxt)]
        t0 = time.perf_counter()
        for _ in range(new):
            out = hf(nxt.view(1, 1), past_key_values=past, use_cache=True)
            past, nxt = out.past_key_values, out.logits[0, -1].argmax()
            tokens.append(int(nxt))
        return new / (time.perf_counter() - t0), tokens

    return Contender("transformers_fp32", rep, lambda: weight_bytes_per_token(hf, fraction))


def llamacpp_contender(path: Path, prompt: list[int], new: int, fraction: float) -> Contender:
    """llama.cpp in build/llamacpp-venv (`make llamacpp-venv`), one rep per line written to it."""
    if not LLAMACPP_PYTHON.exists():
        raise SystemExit(f"--with-llamacpp needs {LLAMACPP_PYTHON}: run `make llamacpp-venv` first")
    log = tempfile.TemporaryFile(mode="w+")  # noqa: SIM115 - the peer's stderr, open while it runs (closed in close)
    proc = subprocess.Popen([str(LLAMACPP_PYTHON), str(PEER), "--model", str(path), "--threads",
                             str(torch.get_num_threads()), "--new", str(new), "--prompt-ids",
                             ",".join(map(str, prompt))], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log,
                            text=True)
    assert proc.stdin is not None and proc.stdout is not None

    def answer() -> dict[str, Any]:
        line = proc.stdout.readline()
        if not line:
            log.seek(0)
            raise RuntimeError(f"llama.cpp peer exited ({proc.wait()}): {log.read()[-2000:]}")
        return json.loads(line)

    ready = answer()
    print(f"llama.cpp: llama-cpp-python {ready['llama_cpp_python']}, {ready['threads']} threads, "
          f"{ready['system_info']}", file=sys.stderr)

    def rep() -> tuple[float, list[int]]:
        proc.stdin.write("rep\n")
        proc.stdin.flush()
        r = answer()
        return r["tok_s"], r["tokens"]

    def close() -> None:
        proc.stdin.close()
        proc.wait(timeout=60)
        log.close()

    peer = Contender("llamacpp", rep, lambda: gguf_bytes_per_token(path, fraction), close)
    # the CPU features its ggml was built with ("AVX512_VNNI = 1 | ..."): a peer at full strength has every one
    # this CPU has but AMX (the Makefile's LLAMACPP_CMAKE)
    features = [f.split("=")[0].strip() for f in ready["system_info"].split("|")
                if f.strip().endswith("= 1")]
    peer.build = {"llama_cpp_python": ready["llama_cpp_python"], "features": [f.removeprefix("CPU : ")
                                                                               for f in features],
                  "system_info": ready["system_info"].strip()}
    return peer


def matching_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


def bench_model(name: str, path: Path, modes: list[str], args: argparse.Namespace, rate: ReadRate
                ) -> dict[str, Any]:
    engines: list[Engine] = []
    compile_info: dict[str, dict[str, Any]] = {}
    for m in modes:  # a compiled engine's compile is waited for before the next loads: each compiles alone
        engines.append(load_engine(path, m))
        compile_info.update(wait_compiled(engines[-1:], [m]))
    prompt = engines[0].tokenizer.encode(real_models.TEXT)[:PROMPT_TOKENS]
    moe = engines[0].config.moe
    fraction = 1.0 if moe is None else moe.top_k / moe.num_experts  # the share of expert weights a token reads
    contenders = [engine_contender(m, e, prompt, args.new, fraction) for m, e in zip(modes, engines, strict=True)]
    if not (args.quick and path.is_file()):  # quick: transformers' GGUF load (20 s) is real_models.py's, tested
        contenders.append(transformers_contender(path, prompt, args.new, fraction))
    if args.with_llamacpp and path.is_file():
        contenders.append(llamacpp_contender(path, prompt, args.new, fraction))
    try:
        for c in contenders:  # warm-up: first touch of pools and caches, the CPU kernels' packing
            release_openmp_threads()
            c.rep()
        since = len(rate.copy_s)
        steps_before = [compiled_steps(e) for e in engines]
        for _ in range(args.reps):  # interleaved: all, and the read rate, see the same load on the machine
            rate.sample(2)
            for c in contenders:
                # this thread's OpenMP workers (the read rate's, transformers') go before each rep: sleeping pools
                # next to the engine thread's make each of its parallel regions wake a worker (engine/openmp.py)
                release_openmp_threads()
                tok_s, tokens = c.rep()
                c.tok_s.append(tok_s)
                c.tokens = c.tokens or tokens
        rate.sample(2)
        res: dict[str, Any] = {"path": str(path), "prompt_tokens": len(prompt), "expert_fraction": fraction,
                               "read_rate": rate.figures(since)}  # sampled between this model's rep rounds
        gb_s, sum_gb_s = res["read_rate"]["copy_read_gb_s"], res["read_rate"]["sum_read_gb_s"]
        print(f"{name} read rate during its reps: {res['read_rate']}", file=sys.stderr)
        reference = contenders[0].tokens  # the float32 engine's greedy tokens ("none" comes first)
        for mode, engine, before in zip(modes, engines, steps_before, strict=True):
            if mode in compile_info:  # the timed reps' steps, compiled and eager (0: every one compiled)
                done, eager = (a - b for a, b in zip(compiled_steps(engine), before, strict=True))
                compile_info[mode].update(timed_steps_compiled=done, timed_steps_eager=eager)
        for c in contenders:
            tok_s, nbytes = statistics.median(c.tok_s), c.bytes_per_token()
            res[c.name] = {"tok_s": round(tok_s, 1), "tok_s_reps": [round(t, 1) for t in c.tok_s],
                           "weight_bytes_per_token": nbytes, "weight_gb_s": round(nbytes * tok_s / 1e9, 2),
                           "bandwidth_fraction": round(nbytes * tok_s / 1e9 / gb_s, 3),  # of the copy's rate
                           "read_only_fraction": round(nbytes * tok_s / 1e9 / sum_gb_s, 3),  # of the sum's
                           "matching_prefix": matching_prefix(c.tokens, reference), "tokens": len(c.tokens)}
            if c.build is not None:
                res[c.name]["build"] = c.build
            mode = c.name.removeprefix("engine_")
            if mode in compile_info:  # and its greedy tokens against the eager engine of the same weights
                res[c.name]["compile"] = compile_info[mode]
                twin = f"engine_{eager_twin(mode, path.is_file())}"
                res[c.name]["same_tokens_as_eager"] = c.tokens == next(d.tokens for d in contenders if d.name == twin)
            print(f"{name} {c.name}: {tok_s:.1f} tok/s, {nbytes / 2**20:.2f} MiB/token, "
                  f"{nbytes * tok_s / 1e9:.2f} GB/s = {res[c.name]['bandwidth_fraction']:.0%} of the copy's read rate "
                  f"({res[c.name]['read_only_fraction']:.0%} of the sum's), "
                  f"{res[c.name]['matching_prefix']}/{len(c.tokens)} greedy tokens as float32", file=sys.stderr)
    finally:
        for c in contenders:
            c.close()
    names = [c.name for c in contenders]
    peers = [n for n in ("transformers_fp32", "llamacpp") if n in names]
    res["ratios"] = {f"{a}_over_{b}": round(res[a]["tok_s"] / res[b]["tok_s"], 3)
                     for a in names if a.startswith("engine_") for b in [*peers, "engine_none"] if a != b}
    res["ratios"].update({f"{a}_over_{a.removesuffix(COMPILED)}": round(  # compiled over eager, same weights
        res[a]["tok_s"] / res[a.removesuffix(COMPILED)]["tok_s"], 3) for a in names if a.endswith(COMPILED)})
    print(f"{name} ratios: " + ", ".join(f"{k} x{v}" for k, v in res["ratios"].items()), file=sys.stderr)
    return res


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--new", type=int, default=96, help="greedy tokens timed per rep (default 96)")
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--bandwidth-mib", type=int, default=512, help="size of the tensor copied (default 512 MiB)")
    # llama.cpp's threads meet at spinning barriers: with more threads than free cores (a machine shared with other
    # work) a token waits for descheduled threads, and its tok/s drops many times over, torch's far less
    p.add_argument("--threads", type=int, default=torch.get_num_threads(),
                   help=f"torch's threads and llama.cpp's (default: torch's, {torch.get_num_threads()} here); "
                        "1 where other work shares the cores (see load_average in the JSON)")
    p.add_argument("--with-llamacpp", action="store_true", help="llama.cpp on the GGUF too (make llamacpp-venv)")
    p.add_argument("--no-compile", action="store_true",
                   help="leave out the compiled engines (cpu_compile; a cold compile takes about a minute each)")
    p.add_argument("--quick", action="store_true",
                   help="a small run to check the script works (no llama.cpp, no compiled engines, no "
                        "transformers on the GGUF)")
    args = p.parse_args()
    if args.quick:
        args.new, args.reps, args.bandwidth_mib, args.with_llamacpp, args.no_compile = 4, 1, 64, False, True
    torch.set_num_threads(args.threads)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    res: dict[str, Any] = {"torch": torch.__version__, "threads": torch.get_num_threads(), "new_tokens": args.new,
                           "reps": args.reps, "missing": [], "cpus": os.cpu_count(),
                           "load_average": [round(x, 2) for x in os.getloadavg()]}  # other work on the cores
    rate = ReadRate(args.bandwidth_mib)
    rate.sample(3 if args.quick else 10)
    res["read_rate_before"] = rate.figures()
    print(f"read rate before: {res['read_rate_before']}", file=sys.stderr)
    models: list[tuple[str, Path]] = [("default", resolve_model_path("default"))]
    if store.installed(SMOLLM2) is None:
        print(f"{SMOLLM2} is not pulled (streamserve models pull {SMOLLM2}): left out", file=sys.stderr)
        res["missing"].append(SMOLLM2)
    else:
        models.insert(0, (SMOLLM2, resolve_model_path(SMOLLM2, offline=True)))
    for name, path in models:
        modes = ["none", "int8", "int4", *(["auto"] if path.is_file() else [])]  # "auto" only changes a GGUF
        # float32 compiled on the default model only: its float MoE experts compile (its quantized ones do not yet),
        # and SmolLM2's float32 compile would add minutes and 0.5 GB for a format no CPU user decodes in
        compiled = [f"int8{COMPILED}", f"int4{COMPILED}", *([f"auto{COMPILED}"] if path.is_file() else []),
                    *([f"none{COMPILED}"] if name == "default" else [])]
        modes += [] if args.no_compile else [*compiled, DEFAULTS]  # the defaults compile too (cpu_compile auto)
        res[name] = bench_model(name, path, modes, args, rate)
    res["read_rate"] = rate.figures()  # every sample of the run
    res["load_average_after"] = [round(x, 2) for x in os.getloadavg()]
    print(f"read rate over the run: {res['read_rate']}", file=sys.stderr)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
