"""The SGLang GPU check's probe and parity run (benchmarks/sglang_gpu_check.sh runs it on the GPU machine).

    python benchmarks/sglang_gpu/probe.py --out DIR                 # CUDA: SGLang with Triton attention
    python benchmarks/sglang_gpu/probe.py --out DIR --cpu \\
        --sglang-python .venv-sglang/bin/python                     # this CPU: the CPU recipe, to prove the logic

1. Writes a tiny random Qwen3 checkpoint (transformers, float32: 3 layers, hidden 128, 4 query / 2 KV heads of 64,
   byte tokenizer). float32 because the parity check compares greedy tokens of two different stacks: in bfloat16
   their kernels round differently and near-tied logits of random weights flip; SGLang is told `--dtype float32`
   too (its `auto` would halve a float32 checkpoint).
2. Starts SGLang on 127.0.0.1 with `--enable-streaming-session` (CUDA: `--attention-backend triton`, CUDA graphs up
   to batch 8, then once more without graphs if that start fails; CPU: tests/support/sglang's recipe), its output
   in DIR/sglang.log, and waits for /health.
3. Session probe over SGLang's HTTP API: open a streaming session, appends with max_new_tokens 0, a reply, a
   streamed reply, an abort mid-stream (the turn rolls back), close (then 400); prompt_tokens and cached_tokens per
   turn, checked against "the session's KV stays": cached >= context - 1 after the first turn (the turn right
   after an abort is reported, not checked).
4. Parity: streamserve's own engine (this process, the same device) vs streamserve on the SGLang backend
   (SGLangEngine over that server): greedy tokens of several turns, each turn's ids appended then 12 tokens.
5. Stops SGLang. DIR/probe.log holds every step; DIR/result.json and the last line printed: one JSON object
   (`ok` is true when every check passed). `--deadline-s` bounds the whole run: a step that would start after it
   is skipped and reported as such.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
CUDA_SHIMS = ROOT / "tests/support/sglang/cuda_shims"
CPU_ARGS = ["--device", "cpu", "--attention-backend", "torch_native", "--disable-overlap-schedule",
            "--sleep-on-idle"]  # the CPU recipe of tests/support/sglang/README.md
GPU_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--cuda-graph-max-bs", "8",
            "--mem-fraction-static", "0.2", "--disable-flashinfer-autotune"]  # no FlashInfer here (cuda_shims)
COMMON_ARGS = ["--dtype", "float32", "--max-total-tokens", "16384", "--grammar-backend", "none",
               "--enable-streaming-session", "--host", "127.0.0.1"]
TURNS = ([5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30],
         [40, 41, 42], [77] * 17, [1], list(range(100, 160)), [200, 201, 202, 203])
T0 = time.monotonic()


class Log:
    """Every step to DIR/probe.log (and stderr), and the checks that make `ok`."""

    def __init__(self, path: Path) -> None:
        self.file = path.open("a", buffering=1)
        self.checks: dict[str, bool] = {}

    def __call__(self, msg: str) -> None:
        line = f"[{time.monotonic() - T0:7.1f}s] {msg}"
        self.file.write(line + "\n")
        print(line, file=sys.stderr, flush=True)

    def check(self, name: str, passed: bool, detail: Any = "") -> None:
        self.checks[name] = bool(passed)
        self(f"CHECK {name}: {'PASS' if passed else 'FAIL'} {detail}")


def make_checkpoint(folder: Path) -> Path:
    from streamserve.tools.random_checkpoint import make_random_checkpoint

    make_random_checkpoint(folder, "qwen3", seed=0, hidden_size=128, num_hidden_layers=3, num_attention_heads=4,
                           num_key_value_heads=2, head_dim=64, intermediate_size=256, max_position_embeddings=4096)
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http(url: str, body: dict[str, Any] | None = None, timeout: float = 60.0) -> tuple[int, Any]:
    """POST body as JSON (GET without one) -> (status, parsed JSON or text or None)."""
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            status, raw = r.status, r.read()
    except urllib.error.HTTPError as e:
        status, raw = e.code, e.read()
    text = raw.decode(errors="replace")
    try:
        return status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return status, text


class SGLang:
    """The SGLang server, a child in a process group of its own (its scheduler and detokenizer die with it)."""

    def __init__(self, python: str, ckpt: Path, args: list[str], cpu: bool, log_path: Path) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        if cpu:
            env["SGLANG_USE_CPU_ENGINE"] = "1"
        else:  # the CUDA shims' sitecustomize must load in SGLang's every process (its children are spawned)
            paths = env.get("PYTHONPATH", "").split(os.pathsep)
            if str(CUDA_SHIMS) not in paths:
                env["PYTHONPATH"] = os.pathsep.join([str(CUDA_SHIMS), *[p for p in paths if p]])
            env.update(SGLANG_IS_FLASHINFER_AVAILABLE="false", SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK="1")
            # float32 dots in SGLang's Triton attention exact (Triton's default on Hopper is TF32, ~1e-3 relative),
            # as streamserve's own float32 kernels are: the parity check compares greedy tokens
            env.setdefault("TRITON_F32_DEFAULT", "ieee")
        python = os.path.abspath(python) if os.sep in python else python  # SGLang runs in another cwd (below)
        self.cmd = [python, "-m", "sglang.launch_server", "--model-path", str(ckpt), "--port", str(self.port),
                    *COMMON_ARGS, *args]
        self.out = log_path.open("ab")
        self.out.write(f"\n==== {' '.join(self.cmd)}\n".encode())
        self.out.flush()
        # cwd: not the repository root, which `python -m` would put first on SGLang's path, where this repository's
        # top-level `kernels/` shadows the `kernels` package transformers 5.17 probes by importing it
        self.proc = subprocess.Popen(self.cmd, stdout=self.out, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, cwd=log_path.parent)

    def wait_ready(self, timeout: float) -> bool:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.proc.poll() is not None:
                return False
            try:
                if http(self.url + "/health", timeout=5)[0] == 200:
                    return True
            except OSError:
                pass
            time.sleep(1.0)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self.out.close()


def generate(url: str, sid: str, ids: list[int], max_new: int, **extra: Any) -> dict[str, Any]:
    status, body = http(url + "/generate", {"input_ids": ids, "session_params": {"id": sid},
                                            "sampling_params": {"temperature": 0, "max_new_tokens": max_new},
                                            **extra})
    if status != 200:
        raise RuntimeError(f"/generate -> {status}: {body}")
    return body


def stream(url: str, body: dict[str, Any], on_chunk: Any = None) -> tuple[list[dict[str, Any]], bool]:
    """A streamed /generate: -> (its data chunks, whether `data: [DONE]` came)."""
    req = urllib.request.Request(url + "/generate", data=json.dumps({**body, "stream": True}).encode(),
                                 headers={"Content-Type": "application/json"})
    chunks: list[dict[str, Any]] = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data:"):
                continue
            if line[5:].strip() == "[DONE]":
                return chunks, True
            chunks.append(json.loads(line[5:]))
            if on_chunk is not None:
                on_chunk(chunks)
    return chunks, False


def probe(url: str, log: Log) -> dict[str, Any]:
    """SGLang's streaming sessions, directly: -> per-turn (kind, new ids, prompt_tokens, cached_tokens)."""
    sid = "gpu-check-1"
    status, opened = http(url + "/open_session", {"capacity_of_str_len": 65536, "streaming": True,
                                                  "session_id": sid})
    log.check("open_session", status == 200 and opened == sid, f"{status} {opened!r}")
    turns: list[dict[str, Any]] = []
    context = 0

    def record(kind: str, n_new: int, meta: dict[str, Any], n_out: int) -> None:
        nonlocal context
        turns.append(dict(kind=kind, new=n_new, prompt=meta["prompt_tokens"], cached=meta.get("cached_tokens"),
                          out=n_out, finish=meta.get("finish_reason")))
        log(f"turn {len(turns)} {kind}: +{n_new} ids, prompt {meta['prompt_tokens']}, cached "
            f"{meta.get('cached_tokens')}, {n_out} out, finish {meta.get('finish_reason')}")
        context = meta["prompt_tokens"] + n_out

    for ids in (TURNS[0], TURNS[1]):  # appends without a reply
        r = generate(url, sid, ids, 0)
        record("append", len(ids), r["meta_info"], len(r["output_ids"]))
    r = generate(url, sid, TURNS[2], 8)
    record("reply", len(TURNS[2]), r["meta_info"], len(r["output_ids"]))
    chunks, done = stream(url, {"input_ids": TURNS[3], "session_params": {"id": sid},
                                "sampling_params": {"temperature": 0, "max_new_tokens": 8}})
    record("streamed", len(TURNS[3]), chunks[-1]["meta_info"], len(chunks[-1]["output_ids"]))
    log.check("streamed reply ends with [DONE]", done and len(chunks) >= 2, f"{len(chunks)} chunks")
    before_abort = context

    def abort_after_3(got: list[dict[str, Any]]) -> None:
        if len(got) == 3:
            threading.Thread(target=http, args=(url + "/abort_request", {"rid": "gpu-check-abort"})).start()

    chunks, done = stream(url, {"input_ids": [9, 9], "session_params": {"id": sid}, "rid": "gpu-check-abort",
                                "sampling_params": {"temperature": 0, "max_new_tokens": 2000,
                                                    "ignore_eos": True}}, abort_after_3)
    finish = chunks[-1]["meta_info"].get("finish_reason") if chunks else None
    log.check("abort ends the stream as aborted", bool(finish) and finish.get("type") == "abort",
              f"{len(chunks)} chunks, finish {finish}")
    r = generate(url, sid, [12, 13], 0)
    record("after abort", 2, r["meta_info"], 0)
    log.check("an aborted turn rolls back whole", turns[-1]["prompt"] == before_abort + 2,
              f"context before abort {before_abort}, next prompt {turns[-1]['prompt']}")
    # the session's KV stays in SGLang: after the first turn only the new ids run (and the last token again where
    # the previous turn sampled it, since a sampled token's KV is not computed until it is fed back)
    # (the turn after an abort is reported, not checked: on the CPU recipe its cached_tokens was 0 when it came
    # right after the abort, i.e. SGLang re-ran the whole context, and 77 of 78 in the research notes' probe)
    reuse = [t["cached"] is not None and t["cached"] >= t["prompt"] - t["new"] - 1 for t in turns[1:]
             if t["kind"] != "after abort"]
    log.check("cached_tokens >= context - 1 on every later turn", all(reuse),
              [(t["kind"], t["prompt"], t["cached"]) for t in turns])
    status, _ = http(url + "/close_session", {"session_id": sid})
    status_after, body = http(url + "/generate", {"input_ids": [1], "session_params": {"id": sid},
                                                  "sampling_params": {"max_new_tokens": 1}})
    log.check("close_session, then the session is gone", status == 200 and status_after == 400,
              f"close {status}, generate after close {status_after} {str(body)[:120]}")
    return {"turns": turns, "cached_after_abort": turns[4]["cached"], "context_after_abort": turns[4]["prompt"]}


def parity(url: str, ckpt: Path, device: str, log: Log) -> dict[str, Any]:
    """Greedy replies turn by turn: streamserve's engine vs streamserve over SGLang."""
    import torch

    from streamserve.engine import Engine
    from streamserve.engine.remote import SGLangEngine

    t = time.monotonic()
    # no CUDA graphs: their capture would cost the check's minutes and does not change the tokens
    own = Engine.from_pretrained(ckpt, device=device, dtype=torch.float32, kv_memory="256MiB", cuda_graphs="off")
    log(f"streamserve engine on {device} loaded in {time.monotonic() - t:.1f}s")
    remote = SGLangEngine.start(ckpt, url=url)
    replies: dict[str, list[list[int]]] = {}
    try:
        for name, engine in (("engine", own), ("sglang", remote)):
            s = engine.open_session()
            try:
                out = []
                for ids in TURNS:
                    s.append(token_ids=ids)
                    out.append(list(s.generate(12, stop_token_ids=())))
                replies[name] = out
            finally:
                s.close()
            log(f"{name}: {replies[name]}")
    finally:
        remote.shutdown()
        own.shutdown()
    same = [a == b for a, b in zip(replies["engine"], replies["sglang"], strict=True)]
    log.check("greedy tokens: streamserve engine == streamserve on --backend sglang", all(same),
              f"{sum(same)}/{len(same)} turns equal")
    return {"turns_equal": sum(same), "turns": len(same), "replies": replies}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--ckpt", type=Path, help="where to write the checkpoint (default: OUT/ckpt)")
    p.add_argument("--cpu", action="store_true", help="run SGLang with the CPU recipe (proves this script's logic)")
    p.add_argument("--sglang-python", default=sys.executable, help="the Python with SGLang (default: this one)")
    p.add_argument("--deadline-s", type=float, default=400.0, help="skip any step that would start after this")
    p.add_argument("--start-timeout-s", type=float, default=180.0)
    args = p.parse_args()
    # a `timeout` around this script sends SIGTERM: exit through the finally below, which stops SGLang's process group
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    args.out.mkdir(parents=True, exist_ok=True)
    log = Log(args.out / "probe.log")
    result: dict[str, Any] = {"device": "cpu" if args.cpu else "cuda", "skipped": []}
    log(f"argv {sys.argv}; python {sys.version.split()[0]}")
    ckpt = make_checkpoint(args.ckpt or args.out / "ckpt")
    log(f"checkpoint {ckpt} written")
    server = None
    for attempt, extra in enumerate([CPU_ARGS] if args.cpu else [GPU_ARGS, [*GPU_ARGS, "--disable-cuda-graph"]]):
        left = args.deadline_s - (time.monotonic() - T0)
        if left < 60:
            result["skipped"].append(f"SGLang start {attempt + 1}: {left:.0f}s left")
            break
        t = time.monotonic()
        try:
            server = SGLang(args.sglang_python, ckpt, extra, args.cpu, args.out / "sglang.log")
        except OSError as e:
            log(f"SGLang start {attempt + 1}: {type(e).__name__}: {e}")
            break
        ready = server.wait_ready(min(args.start_timeout_s, left - 30))
        log(f"SGLang start {attempt + 1} ({' '.join(extra)}): {'ready' if ready else 'FAILED'} after "
            f"{time.monotonic() - t:.1f}s")
        if ready:
            result["sglang_args"] = extra
            result["sglang_start_s"] = round(time.monotonic() - t, 1)
            break
        server.stop()
        server = None
    log.check("SGLang serves", server is not None)
    save(result, log, args.out)
    try:
        if server is not None:
            for name, step in (("probe", lambda: probe(server.url, log)),
                               ("parity", lambda: parity(server.url, ckpt, "cpu" if args.cpu else "cuda", log))):
                left = args.deadline_s - (time.monotonic() - T0)
                if left < 30:
                    result["skipped"].append(f"{name}: {left:.0f}s left")
                    log.check(name, False, "skipped: out of time")
                    continue
                t = time.monotonic()
                try:
                    result[name] = step()
                except Exception as e:  # one failed step is reported; the next still runs
                    log.check(name, False, f"{type(e).__name__}: {e}")
                    import traceback

                    log(traceback.format_exc())
                result[f"{name}_s"] = round(time.monotonic() - t, 1)
                save(result, log, args.out)
    finally:
        if server is not None:
            server.stop()
            log("SGLang stopped")
    save(result, log, args.out, final=True)
    print(json.dumps({k: v for k, v in result.items() if k not in ("probe", "parity")}))


def save(result: dict[str, Any], log: Log, out: Path, final: bool = False) -> None:
    """DIR/result.json as it stands (written after each step, so a run stopped from outside still leaves one; `ok`
    only once every step has run)."""
    result.update(ok=final and bool(log.checks) and all(log.checks.values()), checks=log.checks, final=final,
                  seconds=round(time.monotonic() - T0, 1))
    (out / "result.json").write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
