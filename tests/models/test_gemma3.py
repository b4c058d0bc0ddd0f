"""Gemma 3 (text) and Qwen2 against transformers beyond a single prefill: sessions longer than the models'
sliding windows, rolling-position sessions, the embedding scale, logit softcapping, legacy config keys."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import assert_same, make_checkpoint, random_ids, vectors
from helpers import greedy as helpers_greedy
from transformers import GenerationConfig

from streamserve import Engine
from streamserve.errors import ModelLoadError
from streamserve.kernels.reference import visible
from streamserve.models import ModelConfig


def appended(session, ids: list[int], chunk: int) -> list[torch.Tensor]:
    """Append ids `chunk` at a time -> the last token's logits after each append."""
    out = []
    for i in range(0, len(ids), chunk):
        session.append(token_ids=ids[i:i + chunk])
        out.append(session.core.logits.clone())
    return out


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
def test_a_session_longer_than_the_sliding_window_matches_transformers(arch, checkpoints, engines) -> None:
    """Chunks of 7 across several 16/20-token windows, then a decode that runs far past them."""
    _, hf = checkpoints[arch]
    assert any(w is not None for w in engines[arch].config.sliding_windows)
    ids = random_ids(47, seed=31)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]  # [47, V]
        gen = hf.generate(torch.tensor([ids]), generation_config=GenerationConfig(
            max_new_tokens=40, do_sample=False, eos_token_id=None, pad_token_id=0))[0, len(ids):].tolist()
    with engines[arch].open_session() as s:
        for i, logits in zip(range(0, 47, 7), appended(s, ids, 7), strict=True):
            last = min(i + 7, 47) - 1
            assert (logits - ref[last]).abs().max().item() <= 1e-4, last
        assert s.generate(max_tokens=40, stop_token_ids=()) == gen


def sink_window_masks(n: int, sinks: int, window: int, sliding: int) -> dict[str, torch.Tensor]:
    """transformers' per-layer-kind masks [1, 1, n, n] (additive) for a session keeping [sinks | window]."""
    pos = torch.arange(n)

    def additive(mask: torch.Tensor) -> torch.Tensor:
        return torch.zeros(1, 1, n, n).masked_fill(~mask, float("-inf"))

    return {"full_attention": additive(visible(pos, pos, None, sinks, window)),
            "sliding_attention": additive(visible(pos, pos, sliding, sinks, window))}


@pytest.mark.parametrize("window", [24, 12])
def test_gemma3_rolling_session_without_sinks_matches_transformers_with_a_window_mask(window, checkpoints,
                                                                                      engines) -> None:
    """Rolling positions rotate a window key by its distance from the query, as absolute positions do: without
    sinks a rolling session is transformers with a [window] mask (and each local layer's own 16-token window),
    however far the stream runs past the session's window (wider, then narrower than the local layers')."""
    _, hf = checkpoints["gemma3"]
    ids = random_ids(80, seed=32)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), attention_mask=sink_window_masks(80, 0, window, 16)).logits[0]
    with engines["gemma3"].open_session(window=window, sinks=0, positions="rolling") as s:
        assert s.kv.rolling
        for i, logits in zip(range(0, 80, 9), appended(s, ids, 9), strict=True):
            last = min(i + 9, 80) - 1
            assert (logits - ref[last]).abs().max().item() <= 1e-4, last


def test_gemma3_absolute_sink_window_session_matches_transformers(checkpoints, engines) -> None:
    _, hf = checkpoints["gemma3"]
    ids = random_ids(70, seed=33)
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), attention_mask=sink_window_masks(70, 4, 20, 16)).logits[0]
    with engines["gemma3"].open_session(window=20, sinks=4, positions="absolute") as s:
        for i, logits in zip(range(0, 70, 11), appended(s, ids, 11), strict=True):
            last = min(i + 11, 70) - 1
            assert (logits - ref[last]).abs().max().item() <= 1e-4, last


def test_gemma3_rolling_session_with_sinks_does_not_depend_on_chunking(engines) -> None:
    """With sinks, rolling positions have no transformers counterpart: one token at a time is the reference."""
    engine = engines["gemma3"]
    ids = random_ids(75, seed=34)
    with engine.open_session(window=20, sinks=3) as one:
        one.append(token_ids=ids[:30])
        for t in ids[30:]:
            one.append(token_ids=[t])
        expected_logits = one.core.logits.clone()
        expected = one.generate(max_tokens=30, stop_token_ids=())
    with engine.open_session(window=20, sinks=3) as many:
        assert (appended(many, ids, 13)[-1] - expected_logits).abs().max().item() <= 1e-4
        assert many.generate(max_tokens=30, stop_token_ids=()) == expected
    engine.check_integrity()


def test_gemma3_embedding_chunks_are_scaled_like_ids(engines) -> None:
    """`embed_tokens` includes Gemma's sqrt(hidden) scale, so its vectors give exactly the ids' step."""
    engine = engines["gemma3"]
    table = engine.model.embed_tokens.weight
    ids = random_ids(20, seed=35, vocab=256)
    assert_same(vectors(engine, ids), table[torch.tensor(ids)] * engine.config.hidden_size ** 0.5)
    with engine.open_session() as ref, engine.open_session() as s:
        ref.append(token_ids=ids)
        s.append(token_ids=ids[:8])
        s.append(embeds=vectors(engine, ids[8:]), kind="audio")
        assert_same(s.core.logits, ref.core.logits)
        assert s.generate(max_tokens=8, stop_token_ids=()) == ref.generate(max_tokens=8, stop_token_ids=())


def test_gemma3_final_logit_softcapping_matches_transformers(tmp_path: Path) -> None:
    hf = make_checkpoint(tmp_path, "gemma3", final_logit_softcapping=1.5)
    engine = Engine.from_pretrained(tmp_path, device="cpu", kv_memory="16MiB")
    assert engine.config.final_logit_softcap == 1.5
    ids = random_ids(30, seed=36)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    with engine.open_session() as s:
        ours = engine.forward(s.kv, ids, all_logits=True)
    assert ref.abs().max().item() <= 1.5 and (ours - ref).abs().max().item() <= 1e-4


def test_gemma3_legacy_config_keys_give_transformers_rope_tables(checkpoints, tmp_path: Path) -> None:
    """Configs written before transformers 5: rope_theta / rope_local_base_freq / rope_scaling at the top level
    and sliding_window_pattern instead of layer_types (every 2nd layer global here)."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    raw = json.loads((checkpoints["gemma3"][0] / "config.json").read_text())
    for key in ("rope_parameters", "layer_types", "_sliding_window_pattern"):
        raw.pop(key)
    raw.update(rope_theta=40000.0, rope_local_base_freq=500.0, sliding_window_pattern=2,
               rope_scaling={"rope_type": "linear", "factor": 4.0})
    cfg = ModelConfig.from_hf(raw)
    assert cfg.sliding_windows == (16, None, 16, None)
    assert [cfg.rope_kind(i) for i in range(4)] == [1, 0, 1, 0]
    hf_rope = Gemma3RotaryEmbedding(Gemma3TextConfig(**{k: v for k, v in raw.items() if k != "architectures"}))
    assert hf_rope.layer_types == ["full_attention", "sliding_attention"]
    for rope, kind in zip(cfg.ropes, hf_rope.layer_types, strict=True):
        ours, scaling = rope.inv_freq()
        assert torch.equal(ours, getattr(hf_rope, f"{kind}_inv_freq"))
        assert scaling == getattr(hf_rope, f"{kind}_attention_scaling")
    # an engine loads it, its tables per kind on the model
    dst = tmp_path / "legacy"
    shutil.copytree(checkpoints["gemma3"][0], dst)
    (dst / "config.json").write_text(json.dumps(raw))
    model = Engine.from_pretrained(dst, device="cpu", kv_memory="16MiB").model
    assert torch.equal(model.rope_inv_freq, torch.stack([cfg.ropes[0].inv_freq()[0], cfg.ropes[1].inv_freq()[0]]))


@pytest.mark.parametrize(("key", "value", "match"), [
    ("attn_logit_softcapping", 50.0, "attn_logit_softcapping is not supported"),
    ("use_bidirectional_attention", True, "use_bidirectional_attention"),
    ("hidden_activation", "relu", "hidden activation 'relu' is not supported"),
    ("layer_types", ["sliding_attention"], "layer_types must list 4"),
])
def test_gemma3_unsupported_settings_are_typed_errors(checkpoints, key, value, match) -> None:
    raw = json.loads((checkpoints["gemma3"][0] / "config.json").read_text())
    with pytest.raises(ModelLoadError, match=match):
        ModelConfig.from_hf({**raw, key: value})


def test_gemma3_defaults_follow_transformers() -> None:
    """Keys a Gemma 3 config.json may omit get Gemma3TextConfig's defaults (head_dim is not hidden / heads)."""
    cfg = ModelConfig.from_hf({"architectures": ["Gemma3ForCausalLM"], "vocab_size": 300, "hidden_size": 64,
                               "num_hidden_layers": 7, "num_attention_heads": 4, "intermediate_size": 40})
    assert cfg.head_dim == 256 and cfg.attn_scale == 256 ** -0.5 and cfg.tie_word_embeddings
    assert cfg.sliding_windows == (4096,) * 5 + (None, 4096)
    assert (cfg.rope.theta, cfg.local_rope and cfg.local_rope.theta) == (1e6, 10000.0)
    assert cfg.eos_token_ids == (1,) and cfg.activation == "gelu_tanh" and cfg.embed_scale == 8.0


def test_qwen2_biases_q_k_v_but_not_o(checkpoints, engines) -> None:
    attn = engines["qwen2"].model.layers[0].self_attn
    assert attn.qkv_proj.bias is not None and attn.o_proj.bias is None
    hf_attn = checkpoints["qwen2"][1].model.layers[0].self_attn
    assert torch.equal(attn.qkv_proj.bias[:hf_attn.q_proj.bias.shape[0]], hf_attn.q_proj.bias)
    assert engines["qwen2"].config.sliding_windows == (None, 20, 20)


@pytest.mark.parametrize("window", [None, 24])
def test_gemma3_triton_greedy_equals_torch(window, checkpoints, engines) -> None:
    """kernels="triton" (the interpreter on a CPU: GeGLU, norms, RoPE, both attention kernels with each layer
    kind's RoPE table rotating keys in registers when rolling) gives the torch backend's tokens."""
    pytest.importorskip("triton")
    triton_engine = Engine.from_pretrained(checkpoints["gemma3"][0], device="cpu", kernels="triton",
                                           kv_memory="16MiB")
    assert triton_engine.model.ops.gelu_tanh_mul is not engines["gemma3"].model.ops.gelu_tanh_mul
    prompt = random_ids(40, seed=37)
    outs = []
    for engine in (engines["gemma3"], triton_engine):
        with engine.open_session(window=window, sinks=4) as s:
            s.append(token_ids=prompt)
            outs.append(s.generate(max_tokens=12, stop_token_ids=()))
    assert outs[0] == outs[1]


@pytest.mark.parametrize("arch", ["gemma3", "qwen2"])
@pytest.mark.parametrize("rolling", [True, False])
def test_sessions_sharing_a_step_get_what_they_get_alone(arch, rolling, engines) -> None:
    """One forward of several sessions (absolute ones share a padded attention call, and one rotation per RoPE
    kind when no session is rolling; rolling ones rotate alone) gives each session's logits of that step alone."""
    engine = engines[arch]
    mode = "rolling" if rolling else "absolute"
    policies = [{}, {"window": 20, "sinks": 2, "positions": "absolute"}, {"window": 24, "sinks": 4, "positions": mode},
                {}, {"window": 18, "sinks": 0, "positions": mode}]
    prefixes = [random_ids(n, seed=40 + n) for n in (3, 30, 41, 17, 26)]
    steps = [random_ids(n, seed=50 + n) for n in (1, 3, 2, 20, 5)]
    alone, shared = [], []
    for pol, prefix, step in zip(policies, prefixes, steps, strict=True):
        with engine.open_session(**pol) as s:
            s.append(token_ids=prefix)
            alone.append(engine.forward(s.kv, step, all_logits=True))
        shared.append(engine.open_session(**pol))
        shared[-1].append(token_ids=prefix)
    try:
        outs = engine.run_step(list(zip(shared, steps, strict=True)), all_rows=[True] * len(steps))
        for got, want in zip(outs, alone, strict=True):
            assert isinstance(got, torch.Tensor) and (got - want).abs().max().item() <= 1e-4
    finally:
        for s in shared:
            s.close()
    engine.check_integrity()


def test_gemma3_ngram_drafting_is_lossless(engines) -> None:
    """Draft verification runs several tokens per step through both layer kinds: greedy output is unchanged."""
    engine = engines["gemma3"]
    prompt = [5, 9, 11, 3] * 10
    for kw in ({}, {"window": 24, "sinks": 4}):
        plain = helpers_greedy(engine, prompt, 30, **kw)
        with engine.open_session(drafter="ngram", **kw) as s:
            s.append(token_ids=prompt)
            assert s.generate(max_tokens=30, stop_token_ids=()) == plain
    assert engine.stats()["speculative"]["ngram"]["accepted"] > 0
