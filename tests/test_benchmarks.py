"""Every benchmark script stays runnable: a quick run of each ends with one JSON line, and no correctness flag in
it says the figures come from wrong results (`wrong_flags`)."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from streamserve.media import VOICE_EXTRA, VOICE_MODELS
from streamserve.models.store import installed

ROOT = Path(__file__).resolve().parent.parent
NEEDS_VOICE = pytest.mark.skipif(
    not all(map(importlib.util.find_spec, ("onnxruntime", "faster_whisper", "soxr", "espeakng_loader")))
    or None in map(installed, VOICE_MODELS),
    reason=f"needs the voice extra ({VOICE_EXTRA}) and the voice models "
           f"(streamserve models pull {' '.join(VOICE_MODELS)})")


# A script's own correctness flags, wherever they sit in its JSON line: tokens equal to the reference's (a drafter's
# to no drafter's, a compiled step's to the eager one's, batched attention's to per-session), timed steps that ran
# compiled, and every session greedy-identical whatever the batch.
MUST_BE_TRUE = ("identical_to_none", "same_tokens_as_eager", "same_tokens", "same_tokens_as_shipped")
MUST_BE_ZERO = ("timed_steps_eager",)


def wrong_flags(node: object, where: str = "") -> list[str]:
    """The flags in `node` (a script's JSON) that say its results are wrong, by path."""
    if isinstance(node, list):
        return [w for i, item in enumerate(node) for w in wrong_flags(item, f"{where}[{i}]")]
    if not isinstance(node, dict):
        return []
    wrong = [f"{where}.{k}={v!r}" for k, v in node.items()
             if (k in MUST_BE_TRUE and v is not True) or (k in MUST_BE_ZERO and v != 0)]
    if "greedy_identical_sessions" in node and node["greedy_identical_sessions"] != node.get("sessions"):
        wrong.append(f"{where}.greedy_identical_sessions={node['greedy_identical_sessions']} of {node.get('sessions')}")
    return wrong + [w for k, v in node.items() for w in wrong_flags(v, f"{where}.{k}")]


def test_wrong_flags_are_found() -> None:
    good = {"a": {"identical_to_none": True, "timed_steps_eager": 0}, "levels": [{"same_tokens": True}],
            "float32": {"greedy_identical_sessions": 4, "sessions": 4}}
    assert wrong_flags(good) == []
    bad = {"a": {"identical_to_none": False, "timed_steps_eager": 3}, "levels": [{"same_tokens": True},
                                                                                 {"same_tokens": False}],
           "x": {"compile": {"timed_steps_eager": 1}}, "float32": {"greedy_identical_sessions": 3, "sessions": 4}}
    assert sorted(wrong_flags(bad)) == sorted([".a.identical_to_none=False", ".a.timed_steps_eager=3",
                                               ".levels[1].same_tokens=False", ".x.compile.timed_steps_eager=1",
                                               ".float32.greedy_identical_sessions=3 of 4"])


@pytest.mark.parametrize("script", [["decode.py", "--quick"], ["session_append.py", "--quick"],
                                    ["moe_cpu.py", "--quick"], ["concurrency.py", "--quick"],
                                    ["batch_invariance.py", "--quick"], ["ws_overhead.py", "--quick"],
                                    ["speculative.py", "--quick"], ["step_costs.py", "--quick"],
                                    ["gpu_check.py", "--smoke"], ["robot_loop.py", "--quick"],
                                    ["cpu_decode.py", "--quick"], ["quant_accuracy.py", "--quick"],
                                    ["cpu_linear.py", "--quick"], ["cpu_compile_options.py", "--quick"],
                                    ["soak.py", "--quick"], ["rolling_batch.py", "--quick"],
                                    ["sessions_held.py", "--quick"], ["handoff_pause.py", "2", "200"],
                                    ["compile_background.py", "--quick"],
                                    pytest.param(["responses_chain.py", "--smoke"], marks=pytest.mark.skipif(
                                        installed("smollm2-135m-instruct") is None,
                                        reason="needs `streamserve models pull smollm2-135m-instruct`"),
                                                 id="responses_chain"),
                                    pytest.param(["voice_latency.py", "--quick"], marks=NEEDS_VOICE,
                                                 id="voice_latency"),
                                    pytest.param(["stt_wer.py", "--quick"], marks=NEEDS_VOICE, id="stt_wer"),
                                    pytest.param(["webrtc_latency.py", "--quick"], marks=pytest.mark.skipif(
                                        not all(map(importlib.util.find_spec, ("onnxruntime", "faster_whisper",
                                                                               "soxr", "espeakng_loader", "aiortc")))
                                        or None in map(installed, VOICE_MODELS),
                                        reason=f"needs the voice and webrtc extras ({VOICE_EXTRA}, aiortc) and "
                                               f"the voice models (streamserve models pull {' '.join(VOICE_MODELS)})"),
                                                 id="webrtc_latency")],
                         ids=lambda script: script[0].removesuffix(".py"))
def test_benchmark_runs_and_prints_json_last(script: list[str]) -> None:
    if script[0] == "gpu_check.py":
        pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script[0]), *script[1:]], capture_output=True,
                         text=True, timeout=300, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    assert isinstance(last, dict) and last
    wrong = wrong_flags(last)
    assert not wrong, f"{script[0]}'s own correctness flags: {wrong}"
    if script[0] == "stt_wer.py":  # its own correctness figures: a batch hears what one pass at a time hears
        assert last["batched_same_words"] == last["utterances"] and last["wer_batched"] == last["wer_held"], last


@pytest.mark.models
def test_real_models_benchmark_runs_on_smollm2() -> None:
    from streamserve.models.store import installed

    if installed("smollm2-135m-instruct") is None:
        pytest.skip("needs `streamserve models pull smollm2-135m-instruct`")
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "real_models.py"), "--quick", "--models",
                          "smollm2-135m-instruct"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    last = json.loads(out.stdout.strip().splitlines()[-1])
    res = last["smollm2-135m-instruct"]
    assert res["decode_ours_over_hf"] > 0 and res["kv_bytes"]["1000"] > 0
    assert res["session_workload"]["turns"] == 12


def test_benchmarks_doc_is_what_the_kept_results_give() -> None:
    """docs/benchmarks.md's generated sections are exactly benchmarks/report.py's rendering of
    benchmarks/results/ (a figure edited by hand, or a result kept without `python benchmarks/report.py`, fails)."""
    out = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "report.py"), "--check"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    for result in (ROOT / "benchmarks" / "results").glob("*.json"):  # every kept result is shown
        assert f"<!-- results:{result.stem} -->" in doc, result.name


def test_the_small_step_thread_rule_is_the_kept_measurement() -> None:
    """`CPU_SMALL_STEP_TOKENS` is the step size from which all threads paid in the kept step_costs run."""
    from streamserve.engine.batch import CPU_SMALL_STEP_TOKENS

    kept = json.loads((ROOT / "benchmarks" / "results" / "step_costs.json").read_text())["result"]
    assert kept["threads_pay_from_tokens"] == CPU_SMALL_STEP_TOKENS


def test_every_doc_section_has_a_renderer_and_every_result_a_section() -> None:
    """A `<!-- results:NAME -->` marker with no renderer would keep whatever text it holds; a kept result with no
    marker is shown nowhere."""
    sys.path.insert(0, str(ROOT / "benchmarks"))  # report.py imports its renderers from its own folder
    try:
        import report

        renderers, training = set(report.renderers()), set(report.TRAINING)
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    doc = (ROOT / "docs" / "benchmarks.md").read_text()
    markers = set(re.findall(r"<!-- results:(\w+) -->", doc))
    assert markers <= renderers, markers - renderers
    kept = {p.stem for p in (ROOT / "benchmarks" / "results").glob("*.json")} | training
    assert kept <= markers, kept - markers  # every kept result and training record is shown


def test_llamacpp_is_built_with_what_the_cpu_has_and_never_amx() -> None:
    """benchmarks/llamacpp_flags.py: the peer at full strength on this CPU, without an extension it lacks (SIGILL)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import llamacpp_flags
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    flags = llamacpp_flags.cmake_flags({"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_tile"})
    assert flags[0] == "-DGGML_NATIVE=OFF" and "-DGGML_AVX512_VNNI=ON" in flags and "-DGGML_AVX2=ON" in flags
    assert "-DGGML_AVX_VNNI=OFF" in flags and "-DGGML_AVX512_BF16=OFF" in flags  # not in that CPU's flags
    assert not any("AMX" in f for f in flags)
