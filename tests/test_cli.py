"""The `streamserve` command, run as a user would run it."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import make_checkpoint


def run(*args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "streamserve", *args], input=stdin, capture_output=True,
                          text=True, timeout=120)


def test_help_explains_every_command() -> None:
    out = run("--help")
    assert out.returncode == 0
    assert "generate" in out.stdout and "info" in out.stdout and "default model" in out.stdout
    gen = run("generate", "--help").stdout
    for flag in ("--model", "--device", "--dtype", "--prompt", "--max-tokens", "--temperature", "--top-p", "--seed"):
        assert flag in gen


def test_generate_with_a_prompt_streams_text(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3_moe")
    out = run("generate", "--model", str(tmp_path), "--prompt", "abc", "--max-tokens", "6", "--seed", "1",
              "--temperature", "0.9")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("abc") and len(out.stdout) > len("abc\n")
    assert "Qwen3MoeForCausalLM" in out.stderr


def test_interactive_mode_reads_lines_into_one_session(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama")
    one = run("generate", "--model", str(tmp_path), "--max-tokens", "4", stdin="first line\n")
    two = run("generate", "--model", str(tmp_path), "--max-tokens", "4", stdin="first line\n\nsecond line\n")
    assert one.returncode == 0 and two.returncode == 0, (one.stderr, two.stderr)
    # the second reply continues the same session: the first reply is unchanged, another one follows
    assert two.stdout.startswith(one.stdout) and len(two.stdout) > len(one.stdout), (one.stdout, two.stdout)


def test_errors_are_one_clear_line() -> None:
    out = run("generate", "--model", "/nonexistent/model", "--prompt", "x")
    assert out.returncode == 1
    assert "error" in out.stderr and "not found" in out.stderr and "Traceback" not in out.stderr
    bad = run("generate", "--device", "tpu")
    assert bad.returncode == 2 and "invalid choice" in bad.stderr


def test_info_prints_json(tmp_path: Path) -> None:
    import json

    make_checkpoint(tmp_path, "olmoe")
    out = run("info", "--model", str(tmp_path))
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["architecture"] == "OlmoeForCausalLM" and info["experts"] == 8 and info["experts_per_token"] == 3


def test_serve_starts_answers_and_stops_gracefully_on_sigterm(tmp_path: Path) -> None:
    import json
    import re
    import signal
    import urllib.error
    import urllib.request

    key_file = tmp_path / "key"
    key_file.write_text("k3y-from-a-file\n")  # the key never appears on the command line
    proc = subprocess.Popen([sys.executable, "-m", "streamserve", "serve", "--port", "0", "--kv-memory", "64MiB",
                             "--api-key-file", str(key_file)], stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stderr is not None
        port = None
        for line in proc.stderr:
            m = re.search(r"listening on http://127\.0\.0\.1:(\d+)", line)
            port = int(m.group(1)) if m else port
            if "ready:" in line:
                break
        assert port is not None
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=10) as r:
            assert json.load(r) == {"status": "ok"}  # a stranger learns only that it is ready
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10)
        assert info.value.code == 401
        keyed = urllib.request.Request(f"http://127.0.0.1:{port}/metrics",
                                       headers={"Authorization": "Bearer k3y-from-a-file"})
        with urllib.request.urlopen(keyed, timeout=10) as r:
            assert b"streamserve_connections" in r.read()
        proc.send_signal(signal.SIGTERM)
        rest = proc.stderr.read()
        assert proc.wait(30) == 0 and "shutting down" in rest
    finally:
        if proc.poll() is None:
            proc.kill()


def test_server_limits_that_cannot_work_are_refused_up_front() -> None:
    """A zero rate would divide by zero on every connection's first frame; a zero count would refuse everyone."""
    from streamserve.config import ServerConfig
    from streamserve.errors import InvalidInputError

    for bad in ({"messages_per_second": 0.0}, {"bytes_per_second": -1.0}, {"messages_per_second": float("nan")},
                {"max_connections": 0}, {"max_frame_bytes": 0}, {"max_pages_per_connection": 0},
                {"resume_ttl": -1.0}, {"min_deadline_ms": float("inf")}, {"port": 70000}):
        with pytest.raises(InvalidInputError):
            ServerConfig(**bad)  # type: ignore[arg-type]
    ServerConfig(max_pages_per_connection=None, max_queued_tokens_per_connection=None, resume_ttl=0.0, port=0)
