"""GGUF checkpoints: tiny random models of every architecture written as llama.cpp lays them out, loaded by
streamserve and by transformers (`gguf_file=`): logits within float tolerance, greedy tokens identical;
and each tensor type dequantized as `gguf.quants` does."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from helpers import make_checkpoint, random_ids
from transformers import AutoModelForCausalLM, GenerationConfig

from streamserve import Engine
from streamserve.models.gguf import SUPPORTED_TYPES, GGUFCheckpoint, open_gguf
from streamserve.models.gguf.writer import write_gguf

DEFAULT_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
# What a GGUF file says and transformers' GGUF reader hears: no rope scaling (it drops the file's), no sliding
# windows but Gemma's, every layer of a Qwen3-MoE sparse. transformers also ignores Qwen3's
# key_length and Qwen3-MoE's expert width (its config defaults stand: head_dim 128, experts 768 wide),
# and uses Gemma 3's default query scale (256): the tiny models take those sizes.
GGUF_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(rope_parameters=DEFAULT_ROPE),
    "qwen2": dict(use_sliding_window=False),
    "qwen3": dict(head_dim=128, rope_parameters=DEFAULT_ROPE),
    "qwen3_moe": dict(mlp_only_layers=[], moe_intermediate_size=768),
    "gemma3": dict(head_dim=256, num_hidden_layers=6, query_pre_attn_scalar=256, layer_types=None, sliding_window=8,
                   rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 50000.0},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}
# K-quants need rows of 256 values: these models have them (other tensors fall back to Q8_0, as llama.cpp's do)
K_QUANT_CONFIGS: dict[str, dict[str, Any]] = {
    "llama": dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                  rope_parameters=DEFAULT_ROPE),
    "qwen2": dict(GGUF_CONFIGS["qwen2"], hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=64),
    "qwen3": dict(GGUF_CONFIGS["qwen3"], hidden_size=256, intermediate_size=512),
    "qwen3_moe": dict(GGUF_CONFIGS["qwen3_moe"], hidden_size=256, head_dim=128),
    "gemma3": dict(GGUF_CONFIGS["gemma3"], hidden_size=256, intermediate_size=512),
}
# the fp16 scale fields of each block type (byte offsets): random bytes elsewhere are valid blocks
SCALE_OFFSETS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q4_K: (0, 2),
                 Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def random_blocks(qtype: Q, rows: int, cols: int, seed: int, scale: float = 1e-4) -> np.ndarray:
    """Valid blocks of `qtype` for a [rows, cols] tensor: random quants, finite fp16 scales in [0, scale)."""
    block, size = gguf.GGML_QUANT_SIZES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows * cols // block, size), dtype=np.uint8)
    for off in SCALE_OFFSETS[qtype]:
        d = (rng.random(blocks.shape[0]) * scale).astype(np.float16)
        blocks[:, off:off + 2] = d.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, cols // block * size)


def k_quantizer(values: np.ndarray, qtype: Q) -> np.ndarray:
    """gguf's numpy quantizer where it has one; random valid blocks for the K-quants it lacks."""
    if qtype in (Q.Q4_K, Q.Q5_K, Q.Q6_K):
        return random_blocks(qtype, values.shape[0], values.shape[1], seed=values.shape[0] * 7 + values.shape[1])
    return gguf.quants.quantize(values, qtype)


def q4_k_m(name: str) -> Q:
    """A Q4_K_M-like mix: Q6_K for the FFN down projections, Q5_K for v, Q4_K elsewhere."""
    return Q.Q6_K if "ffn_down" in name else Q.Q5_K if "attn_v" in name else Q.Q4_K


@pytest.fixture(scope="module")
def gguf_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, torch.nn.Module]]:
    root = tmp_path_factory.mktemp("gguf")
    out = {arch: (root / arch, make_checkpoint(root / arch, arch, **cfg)) for arch, cfg in GGUF_CONFIGS.items()}
    for arch, cfg in K_QUANT_CONFIGS.items():
        out[arch + "-k"] = (root / (arch + "-k"), make_checkpoint(root / (arch + "-k"), arch, **cfg))
    return out


def both_loads(folder: Path, name: str) -> tuple[Engine, torch.nn.Module]:
    ours = Engine.from_pretrained(folder / name, device="cpu", kv_memory="64MiB", quantize="none")
    theirs = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32).eval()
    return ours, theirs


def assert_same_model(ours: Engine, theirs: torch.nn.Module, tol: float = 1e-4) -> None:
    ids = random_ids(41, seed=5)
    with torch.no_grad():
        ref = theirs(torch.tensor([ids])).logits[0]
    with ours.open_session() as s:
        logits = ours.forward(s.kv, ids, all_logits=True)
    assert logits.shape == ref.shape
    assert (logits - ref).abs().max().item() <= tol
    prompt = random_ids(13, seed=6)
    gen = GenerationConfig(max_new_tokens=24, do_sample=False, eos_token_id=None, pad_token_id=0)
    with torch.no_grad():
        ref_tokens = theirs.generate(torch.tensor([prompt]), generation_config=gen)[0, len(prompt):].tolist()
    with ours.open_session() as s:
        s.append(token_ids=prompt)
        assert s.generate(max_tokens=24, stop_token_ids=()) == ref_tokens


@pytest.mark.parametrize("qtype", [Q.F32, Q.F16, Q.Q8_0], ids=lambda q: q.name)
@pytest.mark.parametrize("arch", list(GGUF_CONFIGS))
def test_gguf_loads_as_transformers_loads_it(arch: str, qtype: Q, gguf_models) -> None:
    folder, original = gguf_models[arch]
    write_gguf(folder, folder / f"{qtype.name}.gguf", qtype)
    ours, theirs = both_loads(folder, f"{qtype.name}.gguf")
    assert ours.config.architecture == original.config.architectures[0]
    assert_same_model(ours, theirs)
    if qtype == Q.F32:  # lossless: also the checkpoint it was written from
        assert_same_model(ours, original)


@pytest.mark.parametrize("arch", list(K_QUANT_CONFIGS))
def test_k_quant_mix_gguf_loads_as_transformers_loads_it(arch: str, gguf_models) -> None:
    folder, _ = gguf_models[arch + "-k"]
    path = write_gguf(folder, folder / "Q4_K_M.gguf", q4_k_m, quantizer=k_quantizer)
    types = {t.ggml_type for t in open_gguf(path).tensors.values()}
    assert {Q.Q4_K, Q.Q5_K, Q.Q6_K} <= types
    assert_same_model(*both_loads(folder, "Q4_K_M.gguf"))


def test_llama_qk_rows_are_unpermuted_and_gemma_norms_added_once(gguf_models) -> None:
    for arch, tensor in (("llama", "model.layers.0.self_attn.q_proj.weight"),
                         ("gemma3", "model.layers.0.pre_feedforward_layernorm.weight")):
        folder, original = gguf_models[arch]
        path = write_gguf(folder, folder / "check.gguf", Q.F32)
        # (Gemma: w went through fp32's 1 + w and back, which keeps 2^-24 absolute precision)
        torch.testing.assert_close(GGUFCheckpoint(open_gguf(path)).get(tensor), original.state_dict()[tensor],
                                   atol=1e-7 if arch == "gemma3" else 0.0, rtol=0.0)
    engine = Engine.from_pretrained(path, device="cpu", kv_memory="16MiB")  # the model holds 1 + w once
    norm = engine.model.state_dict()["layers.0.pre_feedforward_layernorm"]
    assert torch.allclose(norm, 1 + original.state_dict()["model.layers.0.pre_feedforward_layernorm.weight"])


@pytest.mark.parametrize("qtype", sorted(SUPPORTED_TYPES), ids=lambda q: q.name)
def test_dequantization_of_every_type_matches_gguf_quants(qtype: Q, tmp_path: Path) -> None:
    """Each supported type, written as a [3, 512] tensor (non-square: a transposed read shows), reads back as
    gguf.quants dequantizes the same bytes."""
    rows, cols = 3, 512
    rng = np.random.default_rng(int(qtype))
    if qtype in SCALE_OFFSETS:
        stored = random_blocks(qtype, rows, cols, seed=int(qtype), scale=1.0)
        expect = gguf.quants.dequantize(stored, qtype)
    else:
        values = rng.standard_normal((rows, cols)).astype(np.float32)
        stored = gguf.quants.quantize(values, qtype)
        expect = gguf.quants.dequantize(stored, qtype)
        if qtype != Q.BF16:
            stored = values.astype(np.float16 if qtype == Q.F16 else np.float32)
    w = gguf.GGUFWriter(str(tmp_path / "t.gguf"), "llama")
    w.add_tensor("token_embd.weight", stored, raw_dtype=qtype if stored.dtype == np.uint8 else None)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    ckpt = GGUFCheckpoint(open_gguf(tmp_path / "t.gguf"))
    got = ckpt.get("model.embed_tokens.weight")
    assert ckpt.shape("model.embed_tokens.weight") == (rows, cols) == tuple(got.shape)
    assert np.isfinite(expect).all()
    np.testing.assert_array_equal(got.numpy(), expect)
    np.testing.assert_array_equal(ckpt.head("model.embed_tokens.weight", 2).numpy(), expect[:2])


def test_a_quantized_file_whose_weights_are_large_shows_a_progress_bar(monkeypatch, capsys, gguf_models) -> None:
    """The bar follows the weights' loaded size, not the file's: Gemma 3 270M's Q4_K_M file is under the
    threshold, yet dequantizing it into 1 GB of fp32 weights is the slowest part of its load."""
    from streamserve.models import loader

    folder, _ = gguf_models["llama-k"]
    path = write_gguf(folder, folder / "bar.gguf", q4_k_m, quantizer=k_quantizer)
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", path.stat().st_size)  # above the file, below fp32 weights
    Engine.from_pretrained(path, device="cpu", kv_memory="16MiB")
    assert "loading bar.gguf" in capsys.readouterr().err
