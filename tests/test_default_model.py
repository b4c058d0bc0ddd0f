"""The embedded default model: it ships with the package, loads offline and writes KJV-like English."""

from __future__ import annotations

import json
import re

from streamserve import Engine
from streamserve.engine.engine import DEFAULT_MODEL_DIR

# Frequent words of the King James Bible: a continuation made of real KJV words hits these often.
COMMON = set("""the and of to that in he shall unto for i his a lord they be is him not them it with all thou thy
was god which my me said but ye their have will thee from as are when this out were upon man by you israel king
son up there hath then people came had house into her come one we children s before your also day land men
against shalt if at let go hand us made went even no do now what saith every because or great therefore things so
on sons earth david own an over say our pass down hast name moses judah after away heart hundred among two brought
o did she servant sent father who city spake thus neither should jesus may set way put cast given till behold
called thousand place give forth should these whom how took say days offering any more priest brethren years
nor own kings egypt among words till same first word make voice eat hear know fire blood heaven water good
evil mine many jerusalem done taken art holy sin glory spirit christ saying servants life bring could
""".split())


def test_default_model_ships_and_loads_offline(monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "training.json"):
        assert (DEFAULT_MODEL_DIR / name).exists(), name
    size = sum(p.stat().st_size for p in DEFAULT_MODEL_DIR.iterdir())
    assert size <= 30 * 2**20
    engine = Engine.from_pretrained("default", device="cpu")
    cfg = engine.config
    assert cfg.architecture == "Qwen3MoeForCausalLM" and cfg.moe is not None and cfg.moe.num_experts >= 8
    assert json.loads((DEFAULT_MODEL_DIR / "training.json").read_text())["validation_loss"] < 4.0


def test_in_the_beginning_continues_in_kjv_words() -> None:
    engine = Engine.from_pretrained("default", device="cpu")
    with engine.open_session() as s:
        s.append(text="In the beginning")
        text = engine.tokenizer.decode(s.generate(max_tokens=40))
    words = re.findall(r"[A-Za-z]+", text)
    assert len(words) >= 15, text
    assert sum(w.lower() in COMMON for w in words) / len(words) >= 0.6, text
