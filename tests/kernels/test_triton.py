"""Triton kernels under the interpreter against float64 references, on random odd shapes."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from streamserve.kernels import reference as ref
from streamserve.kernels.decode_attention import decode_attention
from streamserve.kernels.moe_gemv import moe_gemv, quantize_int8

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "an output element was never written (still NaN)"
    return ((out.double() - expected).norm() / expected.norm()).item()


def naive_moe64(x, weights, ids, w_gate_up, w_down) -> torch.Tensor:
    x, w_gate_up, w_down, weights = x.double(), w_gate_up.double(), w_down.double(), weights.double()
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            g, u = (w_gate_up[e] @ x[t]).chunk(2)
            out[t] += weights[t, j] * (w_down[e] @ (torch.nn.functional.silu(g) * u))
    return out


@pytest.mark.parametrize(("T", "E", "k", "D", "inter"), [
    (1, 8, 2, 100, 257), (3, 64, 8, 257, 100), (7, 128, 1, 64, 33), (16, 8, 8, 31, 17), (1, 128, 8, 128, 96)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_moe_gemv(T, E, k, D, inter, dtype) -> None:
    g = torch.Generator().manual_seed(T * 1000 + E + k)
    x = torch.randn(T, D, generator=g).to(dtype)
    w_gu = (torch.randn(E, 2 * inter, D, generator=g) / D**0.5).to(dtype)
    w_d = (torch.randn(E, D, inter, generator=g) / inter**0.5).to(dtype)
    weights, ids = ref.moe_route(torch.randn(T, E, generator=g), k, normalize=k > 1)
    out = torch.full((T, D), float("nan"), dtype=dtype)
    moe_gemv(x, weights, ids, w_gu, w_d, out=out)
    assert rel_err(out, naive_moe64(x, weights, ids, w_gu, w_d)) < TOL[dtype]


def paged_case(S, KVH, hd, P, sinks, window, dtype, seed):
    """A session's keys scattered over shuffled pages of a pool; -> pool tensors, slots and positions."""
    g = torch.Generator().manual_seed(seed)
    n_pages = (S + P - 1) // P + 2
    k_pool = torch.randn(n_pages * P, KVH, hd, generator=g).to(dtype)
    v_pool = torch.randn(n_pages * P, KVH, hd, generator=g).to(dtype)
    pages = torch.randperm(n_pages, generator=g)
    qpos = S - 1
    first = 0 if window is None else max(sinks, qpos - window + 1)
    k_pos = torch.cat([torch.arange(min(sinks, first)), torch.arange(first, S)])
    slots = pages[k_pos // P] * P + k_pos % P
    return k_pool, v_pool, slots, k_pos, torch.tensor([qpos]), g


ATTN = [  # S, H, KVH, hd, P, sliding, sinks, window
    (1, 4, 2, 64, 16, None, 0, None), (17, 8, 2, 80, 1, None, 0, None), (1025, 4, 1, 128, 16, None, 0, None),
    (300, 6, 2, 64, 16, 50, 0, None), (300, 4, 2, 80, 1, None, 4, 100), (1025, 8, 4, 64, 16, None, 4, 256),
]


@pytest.mark.parametrize(("S", "H", "KVH", "hd", "P", "sliding", "sinks", "window"), ATTN)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_decode_attention_absolute(S, H, KVH, hd, P, sliding, sinks, window, dtype) -> None:
    k_pool, v_pool, slots, k_pos, q_pos, g = paged_case(S, KVH, hd, P, sinks, window, dtype, S + hd)
    q = torch.randn(H, hd, generator=g).to(dtype)
    k, v = k_pool[slots].transpose(0, 1).double(), v_pool[slots].transpose(0, 1).double()
    expected = ref.attention(q[None].double(), k, v, q_pos, k_pos, hd**-0.5, sliding, sinks, window)[0]
    out = decode_attention(q, k_pool, v_pool, slots, k_pos, q_pos, hd**-0.5, sliding, sinks, window)
    assert rel_err(out, expected) < TOL[dtype]


@pytest.mark.parametrize(("S", "hd", "P", "sinks", "window", "sliding"), [
    (300, 64, 16, 4, 100, None), (60, 80, 1, 0, 16, None), (1025, 128, 16, 4, 256, None), (9, 64, 16, 4, 16, None),
    (300, 64, 16, 4, 100, 40)])
def test_decode_attention_rolling_rotates_keys_in_registers(S, hd, P, sinks, window, sliding) -> None:
    H, KVH = 4, 2
    k_pool, v_pool, slots, k_pos, q_pos, g = paged_case(S, KVH, hd, P, sinks, window, torch.float32, S)
    q = torch.randn(1, H, hd, generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    rope = ref.rolling_rope(q_pos, k_pos, inv, 1.0, sinks, window, torch.float64)
    k, v = k_pool[slots].transpose(0, 1).double(), v_pool[slots].transpose(0, 1).double()
    expected = ref.attention_rolling(q.double(), k, v, q_pos, k_pos, rope, hd**-0.5, sinks, window, sliding)[0]
    from streamserve.kernels.triton_backend import paged_attention_rolling

    rope32 = ref.rolling_rope(q_pos, k_pos, inv, 1.0, sinks, window, torch.float32)
    out = paged_attention_rolling(q, ref.PagedKeys(k_pool, v_pool, slots, k_pos), q_pos, rope32, hd**-0.5,
                                  sinks, window, sliding)[0]
    assert rel_err(out, expected) < 1e-5


def test_learned_sinks_add_to_the_denominator() -> None:
    k_pool, v_pool, slots, k_pos, q_pos, g = paged_case(40, 2, 64, 16, 0, None, torch.float32, 7)
    q = torch.randn(4, 64, generator=g)
    sink_logits = torch.randn(4, generator=g)
    k, v = k_pool[slots].transpose(0, 1), v_pool[slots].transpose(0, 1)
    scores = torch.einsum("hd,hsd->hs", q, k.repeat_interleave(2, 0)) * 64**-0.5
    p = torch.softmax(torch.cat([scores, sink_logits[:, None]], 1), 1)[:, :-1]
    expected = torch.einsum("hs,hsd->hd", p, v.repeat_interleave(2, 0)).reshape(-1)
    out = decode_attention(q, k_pool, v_pool, slots, k_pos, q_pos, 64**-0.5, sink_logits=sink_logits)
    assert rel_err(out, expected.double()) < 1e-5


def test_launchers_name_the_bad_tensor() -> None:
    x, w, ids = torch.randn(2, 32), torch.rand(2, 2), torch.zeros(2, 2, dtype=torch.long)
    gu, d = torch.randn(4, 16, 32), torch.randn(4, 32, 8)
    with pytest.raises(ValueError, match="w_down has shape"):
        moe_gemv(x, w, ids, gu, torch.randn(4, 32, 9))
    with pytest.raises(ValueError, match="weights has dtype"):
        moe_gemv(x, w.double(), ids, gu, d)
    with pytest.raises(ValueError, match="w_gate_up must be contiguous"):
        moe_gemv(x, w, ids, gu.transpose(1, 2).contiguous().transpose(1, 2), d)
    with pytest.raises(ValueError, match=r"1\.\.16 tokens"):
        moe_gemv(torch.randn(17, 32), torch.rand(17, 2), torch.zeros(17, 2, dtype=torch.long), gu, d)
    pool = torch.randn(32, 2, 64)
    with pytest.raises(ValueError, match="k_pool has dtype"):
        decode_attention(torch.randn(4, 64), pool.half(), pool, torch.arange(3), torch.arange(3),
                         torch.tensor([2]), 0.1)
    with pytest.raises(ValueError, match="k_pos has shape"):
        decode_attention(torch.randn(4, 64), pool, pool, torch.arange(3), torch.arange(4), torch.tensor([2]), 0.1)


APPEND = [  # T, S, H, KVH, hd, P, sliding, sinks, window, rolling
    (3, 17, 4, 2, 64, 1, None, 0, None, False), (7, 300, 6, 2, 80, 16, 50, 0, None, False),
    (16, 1025, 4, 1, 128, 16, None, 4, 256, False), (5, 40, 8, 4, 64, 16, None, 4, 9, True),
    (7, 300, 4, 2, 64, 1, 40, 2, 100, True), (16, 16, 4, 2, 64, 16, None, 0, None, False),
]


@pytest.mark.parametrize(("T", "S", "H", "KVH", "hd", "P", "sliding", "sinks", "window", "rolling"), APPEND)
def test_append_attention(T, S, H, KVH, hd, P, sliding, sinks, window, rolling) -> None:
    from streamserve.kernels.triton_backend import paged_attention, paged_attention_rolling

    g = torch.Generator().manual_seed(T * S)
    n_pages = (S + P - 1) // P + 2
    k_pool, v_pool = torch.randn(n_pages * P, KVH, hd, generator=g), torch.randn(n_pages * P, KVH, hd, generator=g)
    pages = torch.randperm(n_pages, generator=g)
    q_pos = torch.arange(S - T, S)
    first = 0 if window is None else max(sinks, S - T - window + 1)
    k_pos = torch.cat([torch.arange(min(sinks, first)), torch.arange(first, S)])
    paged = ref.PagedKeys(k_pool, v_pool, pages[k_pos // P] * P + k_pos % P, k_pos)
    q = torch.randn(T, H, hd, generator=g)
    k, v = ref.gather(paged)
    if rolling:
        inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
        rope64 = ref.rolling_rope(q_pos, k_pos, inv, 1.0, sinks, window, torch.float64)
        expected = ref.attention_rolling(q.double(), k.double(), v.double(), q_pos, k_pos, rope64, hd**-0.5, sinks,
                                         window, sliding)
        rope = ref.rolling_rope(q_pos, k_pos, inv, 1.0, sinks, window, torch.float32)
        out = paged_attention_rolling(q, paged, q_pos, rope, hd**-0.5, sinks, window, sliding)
    else:
        expected = ref.attention(q.double(), k.double(), v.double(), q_pos, k_pos, hd**-0.5, sliding, sinks, window)
        out = paged_attention(q, paged, q_pos, hd**-0.5, sliding, sinks, window)
    assert rel_err(out, expected) < 1e-5


@pytest.mark.parametrize(("T", "E", "k", "D", "inter"), [(1, 8, 2, 100, 257), (7, 64, 8, 64, 33)])
def test_moe_gemv_int8_matches_the_dequantized_reference(T, E, k, D, inter) -> None:
    g = torch.Generator().manual_seed(T + E)
    x = torch.randn(T, D, generator=g)
    q_gu, s_gu = quantize_int8(torch.randn(E, 2 * inter, D, generator=g) / D**0.5)
    q_d, s_d = quantize_int8(torch.randn(E, D, inter, generator=g) / inter**0.5)
    weights, ids = ref.moe_route(torch.randn(T, E, generator=g), k, normalize=True)
    expected = naive_moe64(x, weights, ids, q_gu.double() * s_gu[..., None], q_d.double() * s_d[..., None])
    out = torch.full((T, D), float("nan"))
    moe_gemv(x, weights, ids, q_gu, q_d, out=out, scale_gate_up=s_gu, scale_down=s_d)
    assert rel_err(out, expected) < 1e-5
    with pytest.raises(ValueError, match="scale_down has shape"):
        moe_gemv(x, weights, ids, q_gu, q_d, scale_gate_up=s_gu, scale_down=s_d[:, :-1])


def test_launch_configs_have_safe_defaults_and_tuned_overrides(monkeypatch) -> None:
    from streamserve.kernels import launch_config as lc

    cpu = torch.device("cpu")
    for kernel in ("moe_gemv", "decode_attention", "append_attention", "moe_dispatch"):
        assert lc.launch_config(kernel, cpu, torch.float32, "any") == lc._table()[kernel]["default"]
    table = {"moe_gemv": {"default": {"block_i": 32, "block_d": 64},
                          "cpu": {"bfloat16": {"D64_I32": {"block_d": 16}}}}}
    monkeypatch.setattr(lc, "_table", lambda: table)
    assert lc.launch_config("moe_gemv", cpu, torch.bfloat16, "D64_I32") == {"block_i": 32, "block_d": 16}
    assert lc.launch_config("moe_gemv", cpu, torch.float32, "D64_I32") == {"block_i": 32, "block_d": 64}


@pytest.mark.parametrize(("rows", "n"), [(1, 64), (3, 100), (17, 257), (2, 2048)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_row_ops(rows, n, dtype) -> None:
    from streamserve.kernels import elementwise as ew

    g = torch.Generator().manual_seed(rows * n)
    x, delta = torch.randn(rows, n, generator=g).to(dtype), torch.randn(rows, n, generator=g).to(dtype)
    w = (1 + 0.1 * torch.randn(n, generator=g)).to(dtype)
    assert rel_err(ew.rms_norm(x, w, 1e-6), ref.rms_norm(x.double(), w.double(), 1e-6)) < TOL[dtype]
    h, y = ew.add_rms_norm(x, delta, w, 1e-6)
    h_ref, y_ref = ref.add_rms_norm(x.double(), delta.double(), w.double(), 1e-6)
    assert rel_err(h, h_ref) < TOL[dtype] and rel_err(y, y_ref) < TOL[dtype]
    gu = torch.randn(rows, 2 * n, generator=g).to(dtype)
    assert rel_err(ew.silu_mul(gu), ref.silu_mul(gu.double())) < TOL[dtype]
    hd = n - n % 2
    x3 = torch.randn(rows, 3, hd, generator=g).to(dtype)
    inv = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    cos, sin = ref.rope_cos_sin(torch.arange(5, 5 + rows), inv, 1.0, dtype)
    assert rel_err(ew.apply_rope(x3, cos, sin), ref.apply_rope(x3.double(), cos.double(), sin.double())) < TOL[dtype]
    with pytest.raises(ValueError, match="odd last dimension"):
        ew.silu_mul(torch.randn(2, 7))
    with pytest.raises(ValueError, match="x has last dimension"):
        ew.rms_norm(torch.randn(2, 7), torch.ones(8), 1e-6)


@pytest.mark.parametrize(("rows", "n"), [(1, 9), (3, 100), (17, 257), (2, 1500)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gelu_tanh_mul_matches_the_reference(rows, n, dtype) -> None:
    """GeGLU (Gemma 3's MLP), gates spread over [-12, 12] so both tails of the tanh are exercised."""
    from streamserve.kernels import elementwise as ew

    g = torch.Generator().manual_seed(rows + n)
    gu = (4 * torch.randn(rows, 2 * n, generator=g)).to(dtype)
    gu[0, :3] = torch.tensor([-12.0, 0.0, 12.0], dtype=dtype)
    out = ew.gelu_tanh_mul(gu)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert rel_err(out, ref.gelu_tanh_mul(gu.double())) < TOL[dtype]
    with pytest.raises(ValueError, match="odd last dimension"):
        ew.gelu_tanh_mul(torch.randn(2, 7))
