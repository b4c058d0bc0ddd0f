"""Weight-only quantization (models/quant.py, models/quantize.py, models/gguf/grids.py): the canonical forms'
error bounds, the CPU kernels against the dequantized product, GGUF 4-bit files kept with their own codes, the
MoE experts, and whole engines (greedy agreement with the float model, stats, snapshot fingerprints)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from gguf import GGMLQuantizationType as Q
from helpers import make_checkpoint, random_ids
from test_gguf import K_QUANT_CONFIGS, k_quantizer

from streamserve import Engine
from streamserve.errors import InvalidInputError, SnapshotError
from streamserve.kernels import reference as ref
from streamserve.models.gguf.writer import write_gguf
from streamserve.models.quant import QuantLinear, quantize_int4, quantize_int8
from streamserve.models.quantize import QuantExperts, weight_bytes


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


@pytest.mark.parametrize(("n", "k"), [(1, 64), (17, 96), (100, 320), (48, 33)])
def test_roundtrip_error_is_half_a_step(n: int, k: int) -> None:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n * k)) * 0.1
    q8 = quantize_int8(w)
    assert q8.qweight.dtype == torch.int8 and q8.scale.shape == (n, 1)
    assert ((q8.dequantize() - w).abs() <= q8.scale / 2 + 1e-7).all()
    if k % 32:
        with pytest.raises(ValueError, match="divisible"):
            quantize_int4(w)
        return
    q4 = quantize_int4(w)
    assert q4.qweight.shape == (n, k // 2) and q4.scale.shape == (n, k // 32)
    err = (q4.dequantize() - w).abs().view(n, k // 32, 32)
    assert (err <= q4.scale[..., None] / 2 + 1e-6).all()
    # each group's min and max are codes 0 and 15: the grid spans the values
    codes = q4.codes().view(n, k // 32, 32)
    assert (codes.amin(-1) == 0).all() and (codes.amax(-1) == 15).all()


def test_nibble_order_low_is_even_column() -> None:
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = -1.0, 1.0  # the group's min (code 0) at column 0, max (15) at column 1
    q = quantize_int4(w)
    assert q.qweight[0, 0].item() == 0 | (15 << 4)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "k", "m"), [(17, 64, 1), (48, 96, 3), (1, 32, 5), (100, 256, 16), (24, 64, 40)])
def test_quant_linear_cpu_matches_the_dequantized_product(bits: int, n: int, k: int, m: int) -> None:
    g = torch.Generator().manual_seed(bits * 1000 + n + k + m)
    lin = torch.nn.Linear(k, n, bias=True)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
        lin.bias.copy_(torch.randn(n, generator=g))
    q = QuantLinear.from_linear(lin, bits)
    x = torch.randn(2, m, k, generator=g)  # any leading dims, as nn.Linear
    expected = F.linear(x.double(), q.canonical().dequantize().double(), lin.bias.double())
    out = q(x)
    assert out.shape == (2, m, n) and out.dtype == torch.float32
    # the CPU kernels take bfloat16 activations: bounded by its rounding, not by the weights'
    assert rel(out, expected) < 1e-2
    assert q.weight_bytes < n * k * 4 / (3.5 if bits == 8 else 5)  # codes + fp32 scales (and zeros)


@pytest.mark.parametrize(("n", "k", "m"), [(40, 72, 1), (40, 72, 16), (24, 33, 5), (17, 136, 40), (8, 88, 2)])
def test_int8_input_widths_off_the_kernels_multiple_of_16(n: int, k: int, m: int) -> None:
    """torch's int8 kernel reads past rows whose width is not a multiple of 16 (NaNs at one row, a segfault at more):
    such weights are padded, so a model with intermediate size 72 (or an int4 fallback at width 33) works."""
    g = torch.Generator().manual_seed(n + k + m)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) / k**0.5)
    q = QuantLinear.from_linear(lin, 8)
    x = torch.randn(m, k, generator=g)
    out = q(x)
    assert bool(torch.isfinite(out).all())
    assert rel(out, F.linear(x.double(), q.canonical().dequantize().double())) < 1e-2


def test_quant_linear_odd_width_int4_falls_back_to_int8() -> None:
    from streamserve.models.quant import quantize_linear

    assert quantize_linear(torch.nn.Linear(33, 16), 4).bits == 8
    assert quantize_linear(torch.nn.Linear(64, 16), 4).bits == 4


@pytest.mark.parametrize("bits", [8, 4])
def test_quantized_experts_match_the_dequantized_reference(bits: int) -> None:
    g = torch.Generator().manual_seed(bits)
    e, d, inter, t, k = 6, 64, 96, 5, 2
    gu, dn = torch.randn(e, 2 * inter, d, generator=g) / d**0.5, torch.randn(e, d, inter, generator=g) / inter**0.5
    qz = quantize_int4 if bits == 4 else quantize_int8
    experts = QuantExperts([qz(w) for w in gu], [qz(w) for w in dn])
    x = torch.randn(t, d, generator=g)
    weights, ids = ref.moe_route(torch.randn(t, e, generator=g), k, normalize=True)
    deq_gu = torch.stack([m.canonical().dequantize() for m in experts.gate_up])
    deq_dn = torch.stack([m.canonical().dequantize() for m in experts.down])
    expected = ref.moe_experts_topk_loop(x.double(), weights.double(), ids, deq_gu.double(), deq_dn.double())
    assert rel(experts(x, weights, ids), expected) < 2e-2


def q4_mix(name: str) -> Q:
    """Every 4-bit block type streamserve keeps: Q4_0 attention, Q4_1 gate/up, Q4_K down; Q8_0 elsewhere."""
    if "attn_" in name and "norm" not in name:
        return Q.Q4_0
    if "ffn_gate" in name or "ffn_up" in name:
        return Q.Q4_1
    return Q.Q4_K if "ffn_down" in name else Q.Q8_0 if name == "token_embd.weight" else Q.F32


@pytest.fixture(scope="module")
def q4_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("q4")
    make_checkpoint(folder, "llama", **K_QUANT_CONFIGS["llama"])
    return write_gguf(folder, folder / "q4.gguf", q4_mix, quantizer=k_quantizer)


def test_auto_keeps_a_q4_files_codes(q4_gguf: Path) -> None:
    float_engine = Engine.from_pretrained(q4_gguf, device="cpu", kv_memory="16MiB", quantize="none")
    engine = Engine.from_pretrained(q4_gguf, device="cpu", kv_memory="16MiB")  # auto
    try:
        assert engine.stats()["quantization"] == "auto" and float_engine.stats()["quantization"] == "none"
        assert engine.stats()["parameters"] == float_engine.stats()["parameters"]
        for layer_f, layer_q in zip(float_engine.model.layers, engine.model.layers, strict=True):
            for fl, ql in ((layer_f.self_attn.qkv_proj, layer_q.self_attn.qkv_proj),
                           (layer_f.mlp.gate_up_proj, layer_q.mlp.gate_up_proj),
                           (layer_f.mlp.down_proj, layer_q.mlp.down_proj)):
                assert isinstance(ql, QuantLinear) and ql.bits == 4, ql
                w = fl.weight
                # the file's codes on the file's grid: the same values up to fp32 rounding of the affine map ...
                assert (ql.canonical().dequantize() - w).abs().max() <= 1e-6 * w.abs().max()
                # ... where re-rounding the values onto a grid of their own would be off by up to half a step
                # (Q4_0's symmetric grid and Q4_K's sub-block scales; Q4_1's min..max grid is the one we would make)
                if fl is not layer_f.mlp.gate_up_proj:
                    assert (quantize_int4(w).dequantize() - w).abs().max() > 1e-3 * w.abs().max()
        head = engine.model.lm_head  # Q8_0 embedding, tied: int8 per channel; the lookup table stays float
        assert isinstance(head, QuantLinear) and head.bits == 8
        assert engine.model.embed_tokens.weight.dtype == torch.float32
        sizes = weight_bytes(engine.model)
        assert sizes["float"] == 0 and sizes["quantized"] < weight_bytes(float_engine.model)["float"] / 4
        ids = random_ids(12, seed=3)
        hits = forced_agreement(engine, ids, greedy(float_engine, ids, 16))
        print(f"\nQ4 file, auto vs float: {hits}/16 greedy tokens agree")
        assert hits >= 12  # random weights: near-ties happen
    finally:
        engine.shutdown()
        float_engine.shutdown()


def greedy(engine: Engine, ids: list[int], n: int) -> list[int]:
    with engine.open_session() as s:
        s.append(token_ids=ids)
        return s.generate(max_tokens=n, temperature=0.0, stop_token_ids=())


def forced_agreement(engine: Engine, prompt: list[int], reference: list[int]) -> int:
    """How many of `reference`'s tokens `engine` picks greedily when fed the reference's prefix each time
    (teacher forcing: one near-tie does not shift every later position)."""
    hits = 0
    with engine.open_session() as s:
        s.append(token_ids=prompt)
        for t in reference:
            n = len(s.token_ids)
            hits += s.generate(max_tokens=1, temperature=0.0, stop_token_ids=())[0] == t
            s.rewind(to=n)
            s.append(token_ids=[t])
    return hits


@pytest.fixture(scope="module")
def default_float() -> Engine:
    engine = Engine.from_pretrained("default", device="cpu", kv_memory="32MiB", quantize="none")
    yield engine
    engine.shutdown()


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_default_model_quantized_greedy_agrees(mode: str, default_float: Engine) -> None:
    """The embedded Qwen3-MoE with every projection, expert and the LM head quantized: its greedy KJV
    continuation agrees with the float model's, token by token."""
    engine = Engine.from_pretrained("default", device="cpu", kv_memory="32MiB", quantize=mode)
    try:
        st = engine.stats()
        assert st["quantization"] == mode and st["parameters"] == default_float.stats()["parameters"]
        assert engine.fingerprint == f"{default_float.fingerprint}-{mode}"
        assert all(layer.mlp.quant is not None and layer.mlp.experts_gate_up is None for layer in engine.model.layers)
        prompt = engine.tokenizer.encode("In the beginning God created the heaven and the earth. And the earth")
        hits = forced_agreement(engine, prompt, greedy(default_float, prompt, 32))
        print(f"\ndefault model, {mode} vs float: {hits}/32 greedy tokens agree")
        assert hits >= 28
        with engine.open_session() as s:  # a quantized session's KV is not the float model's: refused
            s.append(token_ids=prompt)
            snap = s.snapshot()
        with pytest.raises(SnapshotError):
            default_float.restore(snap)
    finally:
        engine.shutdown()


def test_unknown_mode_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="quantize must be one of"):
        Engine.from_pretrained("default", device="cpu", quantize="int3")


@pytest.mark.parametrize("bits", [8, 4])
def test_the_cuda_kernel_reads_the_same_canonical_form(bits: int) -> None:
    """QuantLinear hands its canonical buffers to the Triton gemv on CUDA (run here in the interpreter): the
    kernel and the CPU path compute the same product from them."""
    pytest.importorskip("triton")
    from streamserve.kernels.quant_gemv import quant_linear

    g = torch.Generator().manual_seed(bits + 7)
    lin = torch.nn.Linear(96, 40, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(40, 96, generator=g) / 10)
    q = QuantLinear.from_linear(lin, bits)
    x = torch.randn(3, 96, generator=g)
    kernel = quant_linear(x, q.qweight, q.scale, q.zero, q.group)
    expected = F.linear(x.double(), q.canonical().dequantize().double())
    assert rel(kernel, expected) < 1e-5 and rel(q(x), expected) < 1e-2
