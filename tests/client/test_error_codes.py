"""Every error code the server can send maps to a typed client exception (not the bare base class)."""

from __future__ import annotations

import importlib
import pkgutil

import streamserve
import streamserve_client as sc
import streamserve_client.errors as ce
from streamserve.errors import StreamserveError

# raised while loading a model or by offline tools, never sent over the wire; internal_error is the base on purpose
NEVER_SENT = {"model_load_error", "missing_tensor", "unsupported_architecture", "tensor_shape_mismatch",
              "snapshot_mismatch", "draft_tokenizer_mismatch", "internal_error",
              # GGUF files and the model cache: the engine is loaded (and models pulled) before the port opens
              "bad_gguf_file", "unsupported_tensor_type", "unknown_model", "model_not_installed",
              "license_not_accepted", "model_pull_failed", "pip_missing", "checksum_mismatch",
              # a policy checkpoint's policy.json is checked when the model loads (clients are told `no_policy`)
              "invalid_policy_config"}


def all_codes() -> set[str]:
    for m in pkgutil.walk_packages(streamserve.__path__, "streamserve."):
        if not m.name.startswith(("streamserve.tools", "streamserve.__main__")):
            importlib.import_module(m.name)
    seen: set[str] = set()
    todo = [StreamserveError]
    while todo:
        cls = todo.pop()
        seen.add(cls.code)
        todo += cls.__subclasses__()
    return seen


def test_every_server_error_code_is_a_typed_client_error() -> None:
    codes = all_codes() - NEVER_SENT
    assert {"quota_exceeded", "window_too_large", "client_secret_used", "embedding_shape"} <= codes
    untyped = sorted(c for c in codes
                     if type(ce.from_message({"code": c, "message": "m"})) is sc.StreamserveClientError)
    assert not untyped, f"codes the client maps to no family: {untyped}"


def test_families() -> None:
    assert isinstance(ce.from_message({"code": "quota_exceeded"}), sc.CapacityError)
    assert isinstance(ce.from_message({"code": "window_too_large"}), sc.InvalidInputError)
    assert isinstance(ce.from_message({"code": "client_secret_used"}), sc.UnauthorizedError)
