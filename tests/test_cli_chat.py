"""`streamserve chat` in a subprocess, lines on stdin (not a terminal), replies on stdout."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from chat_checkpoints import IM_END, NL, SPACE, TAB, chat_checkpoint, scripted, write_chat_tokenizer
from helpers import make_checkpoint

from streamserve.models import Tokenizer

FLAGS = ["--device", "cpu", "--kv-memory", "32MiB", "--temperature", "0"]


def chat_command(model: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "streamserve", "chat", "--model", str(model), *FLAGS, *extra]


def run_chat(model: Path, lines: list[str], *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(chat_command(model, *extra), input="".join(f"{line}\n" for line in lines),
                          capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONUNBUFFERED": "1"})


def session_tokens(stdout: str) -> list[int]:
    return [int(line.split(":")[1]) for line in stdout.splitlines() if line.startswith("session tokens:")]


@pytest.fixture(scope="module")
def scripted_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return chat_checkpoint(tmp_path_factory.mktemp("cli-chat"), "chatml", [NL, SPACE, *scripted("hi"), TAB, IM_END])


def test_chat_answers_each_line_and_rewind_reset_stats_work(scripted_model: Path) -> None:
    done = run_chat(scripted_model, ["hello", "/stats", "again", "/stats", "/rewind", "/stats", "/help", "/reset",
                                     "/stats", "/nonsense"], "--system", "Be kind.")
    assert done.returncode == 0, done.stderr
    out = done.stdout.splitlines()
    assert out[0] == " hi\t"  # the scripted reply, streamed
    tokens = session_tokens(done.stdout)
    tok = Tokenizer.from_dir(scripted_model)

    def rendered(*turns: str) -> int:
        msgs = [{"role": "system", "content": "Be kind."}]
        for t in turns:
            msgs += [{"role": "user", "content": t}, {"role": "assistant", "content": " hi\t"}]
        return len(tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=False)))

    # after each exchange: the rendering but for the "\n" closing the reply's turn (it comes with the next
    # message); /rewind undoes the second exchange; /reset empties the session (the system prompt comes again
    # with the next message)
    assert tokens == [rendered("hello") - 1, rendered("hello", "again") - 1, rendered("hello"), 0]
    assert "last reply: 5 tokens" in done.stdout and "kv pages held:" in done.stdout
    stats = done.stdout.split("session tokens:")[1:]  # each /stats' lines
    assert ["last reply:" in block for block in stats] == [True, True, True, False]  # none after /reset
    assert "/rewind   undo the last exchange" in done.stdout and "unknown command /nonsense" in done.stdout


def default_sigint() -> None:
    """In the child before exec: SIGINT with its default action and unblocked, as a terminal's shell starts it."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])


def test_ctrl_c_stops_a_reply_and_the_chat_goes_on(tmp_path: Path) -> None:
    model = chat_checkpoint(tmp_path, "chatml", [NL, SPACE, *scripted("hi"), TAB])  # no end: " hi\t\n hi\t..."
    # In the whole suite (never alone) this test's SIGINT went unanswered in CI, as when the child inherits SIGINT
    # ignored or blocked from this process (both survive exec; Python then installs no KeyboardInterrupt handler).
    # What a user's terminal gives is the default, so the child starts from it; the parent's state is printed.
    print(f"parent: SIGINT handler {signal.getsignal(signal.SIGINT)!r}, "
          f"blocked {sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))}")
    proc = subprocess.Popen(chat_command(model, "--max-tokens", "300"), stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, preexec_fn=default_sigint)
    try:
        assert proc.stdin is not None and proc.stdout is not None
        # the whole reply streams in ~0.5 s: no collection of this (large) test process between reading its first
        # character and the signal, or the reply may end before the signal comes (seen once in CI)
        gc.disable()
        try:
            proc.stdin.write("hello\n")
            proc.stdin.flush()
            assert proc.stdout.read(1) == " "  # the reply is streaming
            proc.send_signal(signal.SIGINT)
        finally:
            gc.enable()
        out, err = proc.communicate("/stats\nagain\n/stats\n", timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err
    # one character a token: the reply ended before its 300 tokens (it has newlines of its own)
    assert " [stopped]\n" in out and out.index(" [stopped]") < 300
    before, after = session_tokens(out)
    assert after > before  # the next exchange ran on the same session, after the stopped reply


def test_a_refused_rewind_is_an_error_and_the_chat_goes_on(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "gemma3")  # sliding-window layers of 16 tokens, keeping 16 past it (the least chat takes)
    write_chat_tokenizer(tmp_path, "chatml")
    done = run_chat(tmp_path, ["hello", "and again, a message longer than the reach", "/rewind", "/stats", "third",
                               "/stats"], "--max-tokens", "4", "--rewind-reach", "16")
    assert done.returncode == 0, done.stderr
    assert "cannot rewind" in done.stderr and "rewind_reach" in done.stderr  # the second exchange is far back
    messages = [int(line.split(":")[1]) for line in done.stdout.splitlines() if line.startswith("messages:")]
    assert messages == [4, 6]  # nothing undone; the third exchange went on the same conversation


def test_chat_with_too_small_a_rewind_reach_is_refused_naming_the_flag(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "gemma3")
    write_chat_tokenizer(tmp_path, "chatml")
    done = run_chat(tmp_path, ["hello"], "--rewind-reach", "0")
    assert done.returncode == 1 and "--rewind-reach >= 16" in done.stderr


def test_a_model_without_a_chat_template_is_refused(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3")
    done = run_chat(tmp_path, ["hello"])
    assert done.returncode == 1 and "no chat template" in done.stderr and "streamserve generate" in done.stderr


@pytest.mark.models
def test_smollm2_knows_the_capital_of_france() -> None:
    from streamserve.models.store import installed

    path = installed("smollm2-135m-instruct")
    if path is None:
        pytest.skip("smollm2-135m-instruct is not in the model cache; `streamserve models pull smollm2-135m-instruct`")
    done = run_chat(path, ["What is the capital of France?", "/stats"], "--max-tokens", "32")
    assert done.returncode == 0, done.stderr
    answer, _, stats = done.stdout.partition("\n")
    assert "Paris" in answer and session_tokens(stats)[0] > 0
