"""Checkpoint loading: shards, expert layouts, dtype conversion, and the errors for bad checkpoints."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers import make_checkpoint, random_ids
from safetensors.torch import load_file, save_file

from streamserve import Engine
from streamserve.errors import (
    MissingTensorError,
    ModelLoadError,
    TensorShapeError,
    UnsupportedArchitectureError,
)


def logits_of(engine: Engine, ids: list[int]) -> torch.Tensor:
    with engine.open_session() as s:
        return engine.forward(s.kv, ids, all_logits=True)


def copy_ckpt(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_sharded_checkpoint_with_index(tmp_path: Path, engines) -> None:
    hf = make_checkpoint(tmp_path / "one", "qwen3_moe")
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="40KB")
    shutil.copy(tmp_path / "one" / "tokenizer.json", tmp_path / "sharded")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").exists()
    assert len(list((tmp_path / "sharded").glob("*.safetensors"))) > 3
    ids = random_ids(20, seed=3)
    a = logits_of(Engine.from_pretrained(tmp_path / "one", device="cpu"), ids)
    b = logits_of(Engine.from_pretrained(tmp_path / "sharded", device="cpu"), ids)
    assert torch.equal(a, b)


def test_fused_expert_layout_loads_the_same(tmp_path: Path, checkpoints) -> None:
    """transformers 5 keeps experts as [E, 2I, D] / [E, D, I] tensors; both layouts must load alike."""
    src = checkpoints["qwen3_moe"][0]
    dst = copy_ckpt(src, tmp_path / "fused")
    tensors = load_file(dst / "model.safetensors")
    cfg = json.loads((dst / "config.json").read_text())
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}.mlp.experts."
        if f"{p}0.gate_proj.weight" not in tensors:
            continue
        E = cfg["num_local_experts"] if "num_local_experts" in cfg else cfg["num_experts"]
        gu = [torch.cat([tensors.pop(f"{p}{e}.gate_proj.weight"), tensors.pop(f"{p}{e}.up_proj.weight")])
              for e in range(E)]
        down = [tensors.pop(f"{p}{e}.down_proj.weight") for e in range(E)]
        tensors[p + "gate_up_proj"] = torch.stack(gu)
        tensors[p + "down_proj"] = torch.stack(down)
    save_file(tensors, dst / "model.safetensors")
    ids = random_ids(17, seed=4)
    a = logits_of(Engine.from_pretrained(src, device="cpu"), ids)
    b = logits_of(Engine.from_pretrained(dst, device="cpu"), ids)
    assert torch.equal(a, b)


def test_bf16_checkpoint_converts_on_load(tmp_path: Path) -> None:
    hf = make_checkpoint(tmp_path / "ck", "llama")
    hf.to(torch.bfloat16).save_pretrained(tmp_path / "ck")
    assert load_file(tmp_path / "ck" / "model.safetensors")["model.norm.weight"].dtype == torch.bfloat16
    cpu = Engine.from_pretrained(tmp_path / "ck", device="cpu")
    assert cpu.dtype == torch.float32  # 16-bit checkpoints compute in fp32 on a CPU by default
    bf = Engine.from_pretrained(tmp_path / "ck", device="cpu", dtype="bfloat16")
    assert bf.dtype == torch.bfloat16
    ids = random_ids(9, seed=5)
    assert (logits_of(cpu, ids) - logits_of(bf, ids)).abs().max() < 0.1


def test_missing_tensor_is_named(tmp_path: Path, checkpoints) -> None:
    dst = copy_ckpt(checkpoints["qwen3"][0], tmp_path / "m")
    tensors = load_file(dst / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(MissingTensorError, match=r"model\.layers\.1\.self_attn\.k_proj\.weight"):
        Engine.from_pretrained(dst, device="cpu")


def test_misshaped_tensor_names_both_shapes(tmp_path: Path, checkpoints) -> None:
    dst = copy_ckpt(checkpoints["mixtral"][0], tmp_path / "s")
    tensors = load_file(dst / "model.safetensors")
    tensors["model.layers.0.block_sparse_moe.experts.2.w2.weight"] = torch.zeros(64, 7)
    save_file(tensors, dst / "model.safetensors")
    with pytest.raises(TensorShapeError, match=r"experts\.2\.w2\.weight has shape \[64, 7\].*\[64, 40\]"):
        Engine.from_pretrained(dst, device="cpu")


def test_unknown_architecture_lists_supported(tmp_path: Path, checkpoints) -> None:
    dst = copy_ckpt(checkpoints["llama"][0], tmp_path / "u")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match=r"GPT2LMHeadModel.*Qwen3MoeForCausalLM.*LlamaForCausalLM"):
        Engine.from_pretrained(dst, device="cpu")


def test_missing_weights_and_missing_folder(tmp_path: Path, checkpoints) -> None:
    dst = copy_ckpt(checkpoints["llama"][0], tmp_path / "w")
    (dst / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no safetensors"):
        Engine.from_pretrained(dst, device="cpu")
    with pytest.raises(ModelLoadError, match="not found"):
        Engine.from_pretrained(tmp_path / "nowhere", device="cpu")


def test_unsupported_rope_type_is_refused(tmp_path: Path, checkpoints) -> None:
    dst = copy_ckpt(checkpoints["llama"][0], tmp_path / "r")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["rope_parameters"] = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="rope type 'dynamic'"):
        Engine.from_pretrained(dst, device="cpu")


@pytest.mark.parametrize("rope_scaling", [
    {"type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 8192},
    {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024},
    {"type": "linear", "factor": 2.0},
])
def test_legacy_rope_scaling_keys_match_transformers(rope_scaling) -> None:
    """Configs written before transformers 5 keep rope_theta and rope_scaling at the top level."""
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from streamserve.models.rope import RopeConfig

    raw = {"rope_theta": 500000.0, "rope_scaling": rope_scaling, "max_position_embeddings": 8192}
    ours, scaling = RopeConfig.from_hf(raw, head_dim=64).inv_freq()
    hf_cfg = LlamaConfig(hidden_size=256, num_attention_heads=4, head_dim=64, **raw)
    theirs, hf_scaling = ROPE_INIT_FUNCTIONS[rope_scaling["type"]](hf_cfg, "cpu")
    assert torch.allclose(ours, theirs) and scaling == pytest.approx(hf_scaling)


def test_large_loads_show_a_progress_bar(monkeypatch, capsys, checkpoints) -> None:
    from streamserve.models import loader

    Engine.from_pretrained(checkpoints["llama"][0], device="cpu")
    assert "loading" not in capsys.readouterr().err  # small: silent
    monkeypatch.setattr(loader, "PROGRESS_MIN_BYTES", 0)
    Engine.from_pretrained(checkpoints["llama"][0], device="cpu")
    assert "loading llama" in capsys.readouterr().err


def test_quantized_checkpoints_are_refused(tmp_path: Path, checkpoints) -> None:
    dst = copy_ckpt(checkpoints["qwen3"][0], tmp_path / "q")
    cfg = json.loads((dst / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    (dst / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ModelLoadError, match="quantized checkpoints \\(fp8\\)"):
        Engine.from_pretrained(dst, device="cpu")


def test_config_gaps_get_transformers_defaults_or_a_typed_error() -> None:
    from streamserve.models import ModelConfig

    base = {"architectures": ["MixtralForCausalLM"], "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
            "num_attention_heads": 4, "intermediate_size": 40, "num_local_experts": 4, "num_experts_per_tok": 2}
    cfg = ModelConfig.from_hf(base)
    assert cfg.rms_norm_eps == 1e-5 and cfg.rope.theta == 1e6  # Mixtral's own defaults, not Llama's
    del base["num_experts_per_tok"]
    with pytest.raises(ModelLoadError, match="num_experts_per_tok"):
        ModelConfig.from_hf(base)
    llama3 = {"architectures": ["LlamaForCausalLM"], "vocab_size": 300, "hidden_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "intermediate_size": 40, "max_position_embeddings": 512,
              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}}
    assert ModelConfig.from_hf(llama3).rope.params["original_max_position_embeddings"] == 512
