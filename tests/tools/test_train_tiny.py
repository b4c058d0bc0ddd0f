"""The training script of the default model, end to end on a small text, and the KJV text extraction."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from streamserve import Engine
from streamserve.tools import train_tiny


def test_train_tiny_writes_a_loadable_checkpoint(tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(f"And the {w} said unto the {v}, Let there be light." for w in
                                ("man", "king", "people", "prophet") for v in ("sea", "earth", "land")) * 4)
    out = tmp_path / "model"
    train_tiny.main(["--out", str(out), "--text", str(text), "--vocab", "300", "--hidden", "32", "--layers", "2",
                     "--heads", "2", "--kv-heads", "1", "--experts", "4", "--top-k", "2", "--moe-intermediate",
                     "16", "--seq", "16", "--batch", "4", "--steps", "3", "--save-dtype", "float32"])
    report = json.loads((out / "training.json").read_text())
    assert report["steps"] == 3 and report["validation_loss"] > 0
    engine = Engine.from_pretrained(out, device="cpu")
    assert engine.config.architecture == "Qwen3MoeForCausalLM" and engine.config.moe.num_experts == 4
    with engine.open_session() as s:
        s.append(text="And the king")
        assert len(s.generate(max_tokens=5, stop_token_ids=())) == 5


@pytest.mark.skipif(shutil.which("bible") is None, reason="Debian's bible-kjv is not installed")
def test_kjv_text_is_plain_verses() -> None:
    text = train_tiny.kjv_text()
    assert text.startswith("In the beginning God created the heaven and the earth.\n")
    assert text.count("\n\n") == 1188  # 1,189 chapters
    assert "1 Kings" not in text[:100] and not any(line[:1].isdigit() for line in text.splitlines()[:50])
