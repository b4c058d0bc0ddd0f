"""The SGLang backend's pieces that need no SGLang (the backend itself is tested against a real SGLang in
tests/sglang, `make test-sglang`): how a reply's parameters map onto SGLang's, version checks, the launcher's
refusals, and the backend choice's errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from streamserve.config import EngineConfig
from streamserve.engine.remote.engine import MIN_SGLANG, version_tuple
from streamserve.engine.remote.launch import LaunchedSGLang
from streamserve.engine.remote.serve import sampling_params
from streamserve.engine.work import Response
from streamserve.errors import InvalidInputError, ModelLoadError
from streamserve.server.service.backends import backend_loader


def response(**kw: object) -> Response:
    base = dict(session_id="s", max_tokens=8, temperature=0.0, top_p=1.0, top_k=0, stop_token_ids=frozenset({2}),
                stop=(), draws=None, arrival=0.0)
    return Response(**{**base, **kw})  # type: ignore[arg-type]


def test_a_reply_maps_onto_sglangs_sampling_params() -> None:
    p = sampling_params(response(), 5, None)
    assert p == {"max_new_tokens": 5, "temperature": 0.0, "top_p": 1.0, "top_k": -1, "skip_special_tokens": False,
                 "stop_token_ids": [2]}
    # never stop early: SGLang ignores EOS (and with it every stop id)
    p = sampling_params(response(stop_token_ids=frozenset(), top_k=40, stop=("\n\n",)), 8, 7)
    assert p["ignore_eos"] is True and "stop_token_ids" not in p
    assert (p["top_k"], p["stop"], p["sampling_seed"]) == (40, ["\n\n"], 7)


def test_versions() -> None:
    assert version_tuple("0.5.21") == (0, 5, 21) and version_tuple("0.5.18.post1") == (0, 5, 18)
    assert version_tuple("0.5.15") < MIN_SGLANG <= version_tuple("0.5.18") and version_tuple("") < MIN_SGLANG


def test_launch_refuses_the_flags_streamserve_sets(tmp_path: Path) -> None:
    for args in ("--port 1", "--tp 2 --host=0.0.0.0", "--model-path x", "--enable-streaming-session"):
        with pytest.raises(ModelLoadError, match="may not set"):
            LaunchedSGLang(tmp_path, args, "python3")
    child = LaunchedSGLang(tmp_path, "--tp 2", "python3")
    assert child.cmd[-2:] == ["--tp", "2"] and "127.0.0.1" in child.cmd and child.url.startswith("http://127.0.0.1:")


def test_launch_of_a_python_without_sglang_is_a_load_error(tmp_path: Path) -> None:
    child = LaunchedSGLang(tmp_path, "", "/nonexistent/python")
    with pytest.raises(ModelLoadError, match="could not start SGLang"):
        child.start(lambda code: None)


def test_the_backend_choice_is_checked() -> None:
    with pytest.raises(InvalidInputError, match="need --backend sglang"):
        backend_loader(EngineConfig(sglang_url="http://127.0.0.1:1"))
    load = backend_loader(EngineConfig(backend="sglang"))
    with pytest.raises(InvalidInputError, match="exactly one of --sglang-url"):
        load()
