"""`streamserve chat` at its defaults (no --cpu-compile, no STREAMSERVE_CPU_COMPILE): the decode step compiles in
the background, the chat answers meanwhile, says on stderr when the compiled step serves, /stats shows it, and
the replies are the scripted ones before and after. Inductor for real, into a cache of the test's own."""

from __future__ import annotations

import os
import subprocess
import time
from pathlib import Path

import pytest
from chat_checkpoints import IM_END, NL, SPACE, TAB, chat_checkpoint, scripted
from test_cli_chat import chat_command

from streamserve.engine.inductor_setup import CPU_COMPILE_ENV, compiler_missing

WAIT = 600.0  # seconds the compile may take on a loaded 2-core machine (the loop ends as soon as it is done)


@pytest.mark.slow
@pytest.mark.skipif(compiler_missing() is not None, reason="torch.compile cannot build CPU code here")
def test_chat_at_defaults_serves_while_compiling_then_compiled(tmp_path: Path) -> None:
    model = chat_checkpoint(tmp_path, "chatml", [NL, SPACE, *scripted("hi"), TAB, IM_END])
    env = {k: v for k, v in os.environ.items() if k != CPU_COMPILE_ENV}
    env.update(PYTHONUNBUFFERED="1", TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    proc = subprocess.Popen(chat_command(model), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)
    assert proc.stdin is not None and proc.stdout is not None and proc.stderr is not None

    def send(line: str) -> None:
        proc.stdin.write(line + "\n")
        proc.stdin.flush()

    def decode_step() -> str:
        send("/stats")
        while not (line := proc.stdout.readline()).startswith("decode step:"):
            assert line, "the chat ended"
        return line

    try:
        send("hello")
        assert proc.stdout.readline() == " hi\t\n"  # answered (eagerly, or compiled if the compile was quick)
        deadline = time.monotonic() + WAIT
        while "compiled (" not in (step := decode_step()):
            assert "compiling in the background" in step, step
            assert time.monotonic() < deadline, "the compile did not finish"
            time.sleep(1)
        send("again")
        assert proc.stdout.readline() == " hi\t\n"
        steps = int(decode_step().split("compiled (")[1].split()[0])
        assert steps >= 4  # the second reply's steps ran compiled
        proc.stdin.close()
        assert proc.wait(timeout=120) == 0
        err = proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert "the decode step compiles in the background" in err
    assert "streamserve: the compiled decode step serves from now on" in err
