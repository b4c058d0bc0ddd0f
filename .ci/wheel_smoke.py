"""What a user gets from the built wheels, run by `make wheel-check` from a fresh virtual environment
that holds only those wheels and their dependencies, outside the repository, with `python -I` (so no
source tree can be imported by accident).

    python -I wheel_smoke.py server   # the streamserve wheel: every module imports, one greedy generation
    python -I wheel_smoke.py voice    # the voice extra: speech synthesised, then transcribed back (pulled models)
    python -I wheel_smoke.py serve    # `streamserve serve` from the wheel answers the client's wheel
    python -I wheel_smoke.py client   # the streamserve-client wheel: imports without torch
"""

from __future__ import annotations

import importlib
import importlib.metadata
import pkgutil
import re
import signal
import socket
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.request
from pathlib import Path

SITE = Path(sysconfig.get_paths()["purelib"]).resolve()


def installed(module: object) -> Path:
    path = Path(str(getattr(module, "__file__", ""))).resolve()
    assert path.is_relative_to(SITE), f"{module} comes from {path}, not from the installed wheel in {SITE}"
    return path


def optional_imports(distribution: str) -> set[str]:
    """The import names of the distribution's extras (`pip install streamserve[dev]`), which a plain
    install lacks; a module that needs anything else must find it installed."""
    names = set()
    for requirement in importlib.metadata.requires(distribution) or []:
        if "extra ==" in requirement:
            names.add(re.split(r"[\s;<>=!~\[(]", requirement, maxsplit=1)[0].lower().replace("-", "_"))
    return names


def import_every_module(package: object, prefix: str, distribution: str) -> int:
    """Import every module the wheel holds: a module or dependency missing from the wheel fails; only the
    optional extras' packages may be absent."""
    optional, count = optional_imports(distribution), 0
    for info in pkgutil.walk_packages(package.__path__, prefix):  # type: ignore[attr-defined]
        if info.name.endswith(".__main__"):
            continue  # `python -m` entry points run on import
        try:
            installed(importlib.import_module(info.name))
        except ModuleNotFoundError as e:
            if (e.name or "").split(".")[0] not in optional:
                raise
            print(f"  {info.name}: needs {e.name} (an optional extra)")
        count += 1
    return count


def check_server() -> None:
    import streamserve
    from streamserve import Engine

    installed(streamserve)
    n = import_every_module(streamserve, "streamserve.", "streamserve")
    with Engine.from_pretrained("default", device="cpu", kv_memory="64MiB") as engine:
        replies = []
        for _ in range(2):
            with engine.open_session() as s:
                s.append(text="In the beginning")
                replies.append(s.generate(max_tokens=8, temperature=0.0))
        assert len(replies[0]) == 8 and replies[0] == replies[1], replies
        text = engine.tokenizer.decode(replies[0])
    print(f"streamserve wheel: {n} modules import; greedy generation from the packaged default model: {text!r}")
    # the packaged robot policy drives the simulated arm to its target through the engine (one session, rolling)
    from streamserve.robot import arm
    from streamserve.robot.rollout import EnginePolicy

    with Engine.from_pretrained("default-policy", device="cpu", kv_memory="64MiB") as engine, \
            EnginePolicy(engine) as policy:
        episode = arm.run_episode(arm.EVAL_SEEDS[0], policy, replan_every=policy.codec.action_horizon)
    assert episode.success, episode
    print(f"the packaged default-policy reached its target in {episode.ticks} ticks")


def check_voice() -> None:
    """The voice extra as installed from the index, with the voice models in the cache (`make models` pulled
    them): the Piper voice speaks a sentence, Whisper hears it, the VAD finds speech in it."""
    import numpy as np

    from streamserve.media.audio import Resampler
    from streamserve.media.vad import TurnDetector, VADConfig
    from streamserve.server.media.voice.runtime import VoiceRuntime

    runtime = VoiceRuntime.load(threads=2)
    try:
        import streamserve.media.stt as stt

        installed(stt)
        audio = runtime.voice.synthesize("Hello world, this is a test.")
        speech = Resampler(runtime.voice.sample_rate, 16000).process(audio.astype(np.float32))
        text = runtime.whisper.transcribe(speech)
        assert "hello" in text.lower() and "test" in text.lower(), text
        silence = np.zeros(16000, np.float32)
        events = TurnDetector(runtime.vad, VADConfig()).feed(np.concatenate([silence, speech, silence, silence]))
        assert [type(e).__name__ for e in events] == ["SpeechStarted", "SpeechStopped"], events
    finally:
        runtime.close()
    print(f"voice extra: synthesised {len(audio) / runtime.voice.sample_rate:.1f} s of speech, heard {text!r}")


def wait_until_ready(server: subprocess.Popen[bytes], port: int, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        assert server.poll() is None and time.monotonic() < deadline, "the server did not become ready"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=2) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError):
            time.sleep(0.2)


def check_serve() -> None:
    import streamserve_client as sc

    with socket.socket() as s:  # a free port (the server binds it right after)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [str(Path(sys.executable).parent / "streamserve"), "serve", "--port", str(port), "--kv-memory", "64MiB"]
    with Path("serve.log").open("w+") as log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT) as server:
        try:
            wait_until_ready(server, port)
            with sc.SyncClient(f"ws://127.0.0.1:{port}", timeout=60) as client:
                session = client.open_session()
                assert session.append(text="In the beginning").tokens > 0
                text = "".join(d.text for d in session.respond(max_tokens=8, temperature=0.0))
                assert session.finish_reason == "length" and text, (session.finish_reason, text)
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:  # the demo, from the wheel
                page = r.read().decode()
            assert r.status == 200 and "<html" in page.lower(), page[:200]
            server.send_signal(signal.SIGTERM)
            assert server.wait(60) == 0, f"the server exited with {server.returncode}"
        except BaseException:
            server.kill()
            log.seek(0)
            print(log.read()[-4000:], file=sys.stderr)
            raise
    print(f"streamserve serve from the wheel answered the client's wheel over /v1/stream: {text!r}, and served the "
          "browser demo at /")


def check_client() -> None:
    import streamserve_client

    installed(streamserve_client)
    n = import_every_module(streamserve_client, "streamserve_client.", "streamserve-client")
    heavy = sorted(m for m in ("torch", "streamserve") if m in sys.modules)
    assert not heavy, f"the client imported {heavy}"
    print(f"streamserve-client wheel: {n} modules import, without torch")


if __name__ == "__main__":
    {"server": check_server, "voice": check_voice, "serve": check_serve, "client": check_client}[sys.argv[1]]()
