"""`streamserve bench` against real servers on loopback (tests/serving.py): the command runs as a subprocess and its
last stdout line is the JSON report. Latencies are reported, never asserted: what is checked is the report's
structure, that every session ran its duration with no error, and that held / missed deadlines agree."""

from __future__ import annotations

import importlib.util
import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
from helpers import json_of_subprocess
from serving import serve

from streamserve.cli import main
from streamserve.config import ServerConfig
from streamserve.engine import Engine
from streamserve.errors import InvalidInputError
from streamserve.media import VOICE_EXTRA
from streamserve.tools.bench.config import check_url

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent.parent
SPREAD = ("n", "p50", "p90", "p99", "max")


async def bench(*args: str) -> dict[str, Any]:
    """`streamserve bench ARGS --no-progress` -> its report (the last stdout line); the exit status must be 0."""
    env = {k: v for k, v in os.environ.items() if k != "STREAMSERVE_API_KEY"}
    return await json_of_subprocess(sys.executable, "-m", "streamserve", "bench", *args, "--no-progress", env=env,
                                    cwd=ROOT)


def check_kind(report: dict[str, Any], kind: str, sessions: int, measures: tuple[str, ...]) -> dict[str, Any]:
    """Every session of `kind` ran its whole duration without an error; held agrees with the missed deadlines."""
    k = report["kinds"][kind]
    assert "skipped" not in k, k.get("skipped")
    assert k["sessions"] == sessions and k["completed"] == sessions
    assert k["errors"] == {}, k["errors"]
    assert k["held"] == sessions - k["sessions_missing_deadlines"] == report["held"][kind]
    assert (k["missed_deadlines"] == 0) == (k["sessions_missing_deadlines"] == 0)
    assert report["missed_deadlines"][kind] == k["missed_deadlines"]
    for m in measures:
        spread = k["latency_ms"][m]
        assert set(spread) == set(SPREAD) and spread["n"] > 0, (m, spread)
        assert spread["p50"] <= spread["p90"] <= spread["p99"] <= spread["max"]
    return k


def voice_missing() -> str | None:
    """Why voice sessions cannot run here (a voice extra module or model missing), or None."""
    from streamserve.models.store import installed

    modules = [m for m in ("onnxruntime", "soxr", "faster_whisper") if importlib.util.find_spec(m) is None]
    models = [m for m in ("piper-joe", "whisper-base", "silero-vad") if installed(m) is None]
    needs = ([f"the voice extra ({VOICE_EXTRA}: {', '.join(modules)} missing)"] if modules else []) + \
        ([f"the voice models (streamserve models pull {' '.join(models)})"] if models else [])
    return f"the voice part did not run: it needs {' and '.join(needs)}" if needs else None


@pytest.mark.asyncio
async def test_a_minute_of_mixed_load_has_no_errors_and_leaks_no_pages() -> None:
    """Issue 17's CI load: 60 s of 2 text sessions (with replies), 1 voice session and 1 policy loop (against a
    default-policy server) at once: the smallest mix with every kind. Whether it is held depends on the machine:
    on a 2-core CPU, the voice models, two engines and the bench sharing it, most deadlines are missed (the
    figures of the sessions held on this CPU are in docs/benchmarks.md, Load testing).

    Checked: no errors, every session ran its whole duration, the counts its clock implies, held == sessions -
    sessions_missing_deadlines per kind, and no leaked pages: each server's KV pages in use are back to 0 once the
    bench's sessions closed (the report's after_close, sampled by the bench, and the engine itself asked after the
    bench exited). Deadlines are NOT asserted: CI runs on shared 2-core machines where another job can make any
    session late, and a timed assertion there fails for reasons that are not the code's. The deadline figures are
    printed (pytest -s) and the whole report is written to build/artifacts/bench/mixed.json
    ($STREAMSERVE_ARTIFACTS/bench/mixed.json) for whoever wants to read them.

    Without the voice extra or models the test runs text and policy only, then skips naming what is missing."""
    no_voice = voice_missing()

    def policy_engine() -> Engine:
        return Engine.from_pretrained("default-policy", device="cpu", kv_memory="64MiB")

    out = Path(os.environ.get("STREAMSERVE_ARTIFACTS", ROOT / "build" / "artifacts")) / "bench" / "mixed.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    async with serve(ServerConfig(), voice=no_voice is None) as text_srv, \
            serve(ServerConfig(), policy_engine) as policy_srv:
        # --turn-timeout 120: a call past it is an error, which is asserted against; with the machine busy (load
        # average 9) a voice turn here took 20 s of the default 30, and a slow machine is no failure of the code
        report = await bench("--url", text_srv.url, "--policy-url", policy_srv.url, "--text", "2",
                             "--voice", "0" if no_voice else "1", "--policy", "1", "--duration", "60",
                             "--reply-every", "10", "--reply-tokens", "8", "--turn-timeout", "120",
                             "--report", str(out))
        pages_left = [srv.engine.stats()["kv_pages_used"] for srv in (text_srv, policy_srv)]
    kinds = {"text", "policy"} | (set() if no_voice else {"voice"})
    print(f"\nmixed load, wall {report['wall_s']} s, load average {report['load_avg_1m']}: held {report['held']}, "
          f"missed deadlines {report['missed_deadlines']}")
    for kind in sorted(kinds):
        print(f"  {kind}: " + ", ".join(f"{m} p50/p99 {v['p50']}/{v['p99']} ms"
                                        for m, v in report["kinds"][kind]["latency_ms"].items()))
    assert report["benchmark"] == "streamserve bench" and report["settings"]["text"] == 2
    assert report["errors"] == {} and set(report["kinds"]) == kinds
    assert report["all_held"] == (report["held"] == {"text": 2, "policy": 1} | ({} if no_voice else {"voice": 1}))

    text = check_kind(report, "text", 2, ("append_ms", "reply_first_token_ms", "reply_total_ms"))
    assert 2 * 299 <= text["counts"]["chunks"] <= 2 * 300  # 60 s at 5 chunks a second, each session, late or not
    assert text["counts"]["replies"] >= 2 and text["counts"]["tokens_appended"] > 0
    policy = check_kind(report, "policy", 1, ("action_ms", "server_infer_ms"))
    assert 2999 <= policy["counts"]["ticks"] <= 3000  # 60 s at 50 Hz, late or not
    assert policy["counts"]["replies"] > 0 and policy["counts"]["episodes"] >= 1
    assert policy["missed_deadlines"] + policy["counts"]["startup_ticks"] == policy["counts"]["held_ticks"]
    if not no_voice:
        voice = check_kind(report, "voice", 1, ("speech_stopped_ms", "stop_lag_ms", "reply_done_ms"))
        counts = voice["counts"]
        assert counts["frames"] >= 2700  # 90% of 60 s of 20 ms frames at least (more: a turn asked is answered)
        assert counts["turns"] >= 1 and counts["turns_answered"] == counts["turns"]  # no error: every turn answered
        with_audio = counts.get("replies_with_audio", 0)
        assert with_audio + counts.get("replies_without_audio", 0) == counts["turns"]
        assert voice["latency_ms"].get("turn_ms", {"n": 0})["n"] == with_audio

    assert [s["url"] for s in report["servers"]] == [text_srv.url, policy_srv.url]
    assert [s["model"] for s in report["servers"]] == ["default", "default-policy"]
    for s in report["servers"]:
        assert s["stats_error"] is None and s["pid"] == os.getpid()  # the servers run in this process
        assert len(s["samples"]) >= 50 and all(x["rss_mb"] > 0 and x["kv_pages_used"] >= 0 for x in s["samples"])
        assert s["kv_pages_used"]["max"] > 0 and s["chunks_shed"] == 0 and s["rss_mb"]["max"] > 0
        assert s["kv_pages_used"]["after_close"] == 0, s["kv_pages_used"]  # no leaked pages
    assert pages_left == [0, 0]
    assert report["shed_chunks"] == {"acked_as_shed": 0, "server": [0, 0]}
    assert json.loads(out.read_text()) == report
    if no_voice:
        pytest.skip(f"text and policy passed; {no_voice}")


@pytest.mark.asyncio
async def test_policy_sessions_are_skipped_with_the_reason_when_the_model_is_no_policy() -> None:
    async with serve(ServerConfig()) as srv:
        report = await bench("--url", srv.url, "--text", "1", "--policy", "1", "--duration", "2",
                             "--reply-every", "0")
    assert report["kinds"]["policy"]["skipped"].startswith("no_policy:")
    assert report["held"]["policy"] == 0 and report["missed_deadlines"]["policy"] is None
    assert not report["all_held"]
    check_kind(report, "text", 1, ("append_ms",))


@pytest.mark.parametrize("url", ["ws://192.0.2.1:8000", "ws://example.com:8000", "ws://[2001:db8::1]:8000",
                                 "ws://0.0.0.0:8000"])
def test_a_url_off_loopback_is_refused(url: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["bench", "--url", url, "--text", "1"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "is not a loopback address" in err and "--allow-remote" in err
    with pytest.raises(SystemExit):  # the policy server's URL too
        main(["bench", "--policy-url", url, "--policy", "1"])
    assert "is not a loopback address" in capsys.readouterr().err
    check_url(url, allow_remote=True)  # allowed when asked for (nothing is connected here)


@pytest.mark.parametrize("url", ["ws://127.0.0.1:8000", "ws://127.0.0.2:9", "ws://localhost:8000",
                                 "ws://[::1]:8000/v1/stream", "wss://127.0.0.1:443"])
def test_loopback_urls_are_accepted(url: str) -> None:
    check_url(url, allow_remote=False)


def test_a_url_that_is_not_a_websocket_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="ws://HOST:PORT"):
        check_url("http://127.0.0.1:8000", allow_remote=True)


def test_without_the_client_sdk_the_command_says_what_to_install(monkeypatch: pytest.MonkeyPatch,
                                                                 capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setitem(sys.modules, "streamserve_client", None)  # import and find_spec now see it missing
    with pytest.raises(SystemExit) as e:
        main(["bench", "--text", "1"])
    assert e.value.code == 1
    err = capsys.readouterr().err
    assert "streamserve_client not installed" in err and "pip install streamserve-client" in err
