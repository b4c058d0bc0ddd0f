"""Models really pulled into the cache ($STREAMSERVE_HOME or ~/.cache/streamserve). Marked `models`: each
test skips when its model is not there (`make models` pulls SmolLM2; CI runs it before the tests)."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

import pytest

from streamserve.models.catalog import CATALOG, GEMMA_CHAT_TEMPLATE
from streamserve.models.store import Store, entry_for_path, fallback_chat_template, resolve_model

pytestmark = pytest.mark.models

SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types -> bytes
STRING, ARRAY = 8, 9


def _skip_value(f: BinaryIO, kind: int) -> None:
    if kind in SCALAR_SIZES:
        f.seek(SCALAR_SIZES[kind], 1)
    elif kind == STRING:
        f.seek(struct.unpack("<Q", f.read(8))[0], 1)
    elif kind == ARRAY:
        item, count = struct.unpack("<IQ", f.read(12))
        if item in SCALAR_SIZES:
            f.seek(SCALAR_SIZES[item] * count, 1)
        else:
            for _ in range(count):
                _skip_value(f, item)
    else:
        raise AssertionError(f"GGUF value type {kind} is not in the format")


def gguf_keys(path: Path) -> set[str]:
    """The metadata keys of a GGUF file (header: magic, version, tensor count, key count; then the keys), read
    without the tensor index: the gguf package's reader takes seconds on Gemma's 262k-token vocabulary."""
    with path.open("rb") as f:
        magic, _version, _tensors, n_kv = struct.unpack("<4sIQQ", f.read(24))
        assert magic == b"GGUF"
        keys = set()
        for _ in range(n_kv):
            keys.add(f.read(struct.unpack("<Q", f.read(8))[0]).decode())
            _skip_value(f, struct.unpack("<I", f.read(4))[0])
    return keys


def pulled(name: str) -> Path:
    path = Store().installed(name)
    if path is None:
        pytest.skip(f"{name} is not in the model cache; `streamserve models pull {name}` (or `make models`)")
    return path


def test_smollm2_in_the_cache_is_the_pinned_file_with_a_chat_template() -> None:
    path = pulled("smollm2-135m-instruct")
    assert Store().verify("smollm2-135m-instruct", progress=False)
    assert path.stat().st_size == CATALOG["smollm2-135m-instruct"].size
    assert resolve_model("smollm2-135m-instruct", offline=True) == path
    keys = gguf_keys(path)
    assert "tokenizer.chat_template" in keys and "llama.block_count" in keys
    assert entry_for_path(path) == CATALOG["smollm2-135m-instruct"] and fallback_chat_template(path) is None
    assert "Apache License" in (path.parent / "LICENSE").read_text()


def test_gemma3_in_the_cache_has_no_template_so_the_catalog_supplies_one() -> None:
    path = pulled("gemma3-270m")
    assert Store().verify("gemma3-270m", progress=False)
    keys = gguf_keys(path)
    assert "gemma3.block_count" in keys and "tokenizer.chat_template" not in keys  # the base model's file
    assert fallback_chat_template(path) == GEMMA_CHAT_TEMPLATE
    assert (path.parent / "GEMMA_TERMS.html").stat().st_size > 0 and Store().accepted("gemma3-270m")


def test_efficientnet_lite0_in_the_cache_is_the_pinned_state_dict_with_its_licence() -> None:
    import torch

    from streamserve.models.catalog import VISION_MODELS, VOICE_MODELS

    assert VISION_MODELS == ("efficientnet-lite0",) and "efficientnet-lite0" not in VOICE_MODELS
    path = pulled("efficientnet-lite0")
    entry = CATALOG["efficientnet-lite0"]
    assert entry.kind == "vision" and path.name == entry.filename and path.stat().st_size == entry.size
    assert Store().verify("efficientnet-lite0", progress=False)
    assert (path.parent / "LICENSE").read_text().startswith("Apache Software License 2.0")
    state = torch.load(path, map_location="cpu", weights_only=True)  # tensors only: no pickled code runs
    assert state["_fc.weight"].shape == (1000, 1280) and state["_conv_stem.weight"].shape == (32, 3, 3, 3)
