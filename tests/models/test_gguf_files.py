"""GGUF files in the engine: the config a file's metadata gives, bad files and unsupported contents as typed
errors, `--model x.gguf` in the CLI, snapshot fingerprints, a GGUF draft model."""

from __future__ import annotations

import dataclasses
import json
import math
import struct
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
from gguf import GGMLQuantizationType as Q
from helpers import greedy, make_checkpoint, random_ids

from streamserve import Engine
from streamserve.engine.loading import model_fingerprint
from streamserve.errors import ModelLoadError, SnapshotError, UnsupportedArchitectureError
from streamserve.models.config import ModelConfig
from streamserve.models.gguf import BadGGUFError, UnsupportedTensorTypeError, gguf_config, open_gguf
from streamserve.models.gguf.writer import write_gguf
from streamserve.models.tokenizer import byte_level_chars

# configs a GGUF file can state in full (Gemma 3: every 6th layer global, local RoPE base 10000, query scale
# by head_dim; Qwen2: no windows; Qwen3-MoE: every layer sparse); the others' rope scalings are in ARCH_CONFIGS
FULL_CONFIGS = {
    "llama": {},  # llama3 RoPE: stored by llama.cpp as the rope_freqs tensor, read back into its parameters
    "qwen3": {},  # yarn
    "qwen3_moe": dict(mlp_only_layers=[]),
    "qwen2": dict(use_sliding_window=False),
    "gemma3": dict(num_hidden_layers=7, layer_types=None, query_pre_attn_scalar=16,
                   rope_parameters={"full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                                    "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0}}),
}


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("llama")
    make_checkpoint(folder, "llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    return write_gguf(folder, folder / "model.gguf", Q.Q8_0)


@pytest.mark.parametrize("arch", list(FULL_CONFIGS))
def test_metadata_gives_the_config_json_config(arch: str, tmp_path: Path) -> None:
    """One config path: the file's metadata becomes the ModelConfig its config.json gives (the epsilon is a
    float32 in the file)."""
    make_checkpoint(tmp_path, arch, **FULL_CONFIGS[arch])
    want = ModelConfig.from_file(tmp_path / "config.json")
    got = gguf_config(open_gguf(write_gguf(tmp_path, tmp_path / "m.gguf")))
    assert math.isclose(got.rms_norm_eps, want.rms_norm_eps, rel_tol=1e-6)
    assert dataclasses.replace(got, rms_norm_eps=want.rms_norm_eps) == want


def test_wrong_magic_and_missing_files_are_typed_errors(tmp_path: Path) -> None:
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"GGML" + bytes(100))
    for call in (lambda: open_gguf(fake), lambda: Engine.from_pretrained(fake, device="cpu")):
        with pytest.raises(BadGGUFError, match="not a GGUF file"):
            call()
    with pytest.raises(ModelLoadError, match="not found") as missing:
        Engine.from_pretrained(tmp_path / "absent.gguf", device="cpu")
    # catalog models are downloaded, so the message points at them rather than saying nothing ever is
    assert "streamserve models list" in str(missing.value) and "never downloaded" not in str(missing.value)


@pytest.mark.parametrize("keep", [0.5, 0.999, 100 / 1e9])
def test_truncated_files_are_typed_errors(keep: float, llama_gguf: Path, tmp_path: Path) -> None:
    """Cut in the tensor data, just before the end, or inside the metadata."""
    data = llama_gguf.read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[:max(8, int(len(data) * keep))])
    with pytest.raises(BadGGUFError, match=r"truncated|damaged"):
        Engine.from_pretrained(cut, device="cpu")


def tensor_type_offset(path: Path, name: str) -> int:
    """Where the ggml type id of tensor `name` sits in the file's tensor table."""
    t = next(t for t in gguf.GGUFReader(path).tensors if t.name == name)
    return t.field.offset + 8 + len(name.encode()) + 4 + 8 * len(t.shape)


def test_unknown_tensor_type_is_a_typed_error(llama_gguf: Path, tmp_path: Path) -> None:
    data = bytearray(llama_gguf.read_bytes())
    at = tensor_type_offset(llama_gguf, "blk.0.attn_q.weight")
    assert struct.unpack_from("<I", data, at)[0] == Q.Q8_0
    struct.pack_into("<I", data, at, 99)
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(bytes(data))
    with pytest.raises(UnsupportedTensorTypeError, match="tensor type"):
        Engine.from_pretrained(bad, device="cpu")


def test_unsupported_tensor_type_names_the_tensor_and_type(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama", hidden_size=256, head_dim=64, rope_parameters={"rope_type": "default",
                                                                                       "rope_theta": 10000.0})

    def q2_k_blocks(values: np.ndarray, qtype: Q) -> np.ndarray:  # IQ/Q2_K-style files: streamserve refuses them
        block, size = gguf.GGML_QUANT_SIZES[Q.Q2_K]
        return np.zeros((values.shape[0], values.shape[1] // block * size), dtype=np.uint8)

    path = write_gguf(tmp_path, tmp_path / "q2k.gguf", Q.Q2_K, quantizer=q2_k_blocks)
    with pytest.raises(UnsupportedTensorTypeError, match=r"tensor token_embd\.weight is stored as Q2_K"):
        Engine.from_pretrained(path, device="cpu")


def test_unknown_architecture_is_a_typed_error(tmp_path: Path) -> None:
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(UnsupportedArchitectureError, match="'mamba'"):
        Engine.from_pretrained(tmp_path / "mamba.gguf", device="cpu")


def test_info_on_a_gguf_file(llama_gguf: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "streamserve", "info", "--model", str(llama_gguf)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    info = json.loads(out.stdout)
    assert info["architecture"] == "LlamaForCausalLM" and info["path"] == str(llama_gguf)
    assert info["vocab_size"] == 300 and info["layers"] == 3


def test_fingerprint_tells_gguf_files_apart(llama_gguf: Path, tmp_path: Path) -> None:
    """Snapshots carry it: stable for one file, different for another model of the same config."""
    make_checkpoint(tmp_path, "llama", seed=1, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    other = write_gguf(tmp_path, tmp_path / "other.gguf", Q.Q8_0)
    assert model_fingerprint(llama_gguf) == model_fingerprint(llama_gguf) != model_fingerprint(other)
    engine = Engine.from_pretrained(llama_gguf, device="cpu", kv_memory="16MiB")
    with engine.open_session() as s:
        s.append(token_ids=random_ids(9, seed=1))
        snap = s.snapshot()
    with engine.restore(snap) as s:
        assert s.token_ids == random_ids(9, seed=1)
    with pytest.raises(SnapshotError):
        Engine.from_pretrained(other, device="cpu", kv_memory="16MiB").restore(snap)


def test_a_gguf_draft_model_is_lossless(llama_gguf: Path, tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3", seed=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    target = Engine.from_pretrained(write_gguf(tmp_path, tmp_path / "target.gguf"), device="cpu", kv_memory="32MiB")
    prompt = [7, 8, 9, 10] * 6
    plain = greedy(target, prompt, 24)
    with target.open_session(drafter=f"draft:{llama_gguf}") as s:
        s.append(token_ids=prompt)
        assert s.generate(max_tokens=24, stop_token_ids=()) == plain
    assert target.drafters.totals[f"draft:{llama_gguf.name}"]["proposed"] > 0


def test_end_of_turn_tokens_stop_generation(tmp_path: Path) -> None:
    """llama.cpp stops at eos and at the file's end-of-turn / end-of-message tokens: so does the engine."""
    make_checkpoint(tmp_path, "llama", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    tokens = [*byte_level_chars(), "<|endoftext|>"]
    meta = {"model": "gpt2", "pre": "default", "tokens": tokens, "token_type": [1] * 256 + [3], "merges": [],
            "eos_token_id": 256, "eot_token_id": 10, "eom_token_id": 11}
    engine = Engine.from_pretrained(write_gguf(tmp_path, tmp_path / "m.gguf", tokenizer=meta), device="cpu",
                                    kv_memory="16MiB")
    assert engine.eos_token_ids == (256, 10, 11)
