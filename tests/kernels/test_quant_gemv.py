"""The weight-only quantized GEMV (int8 and packed int4) under the interpreter, against float64 products of the
dequantized weights on random odd shapes; the reference against hand-made bytes; the launcher's ValueErrors."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from streamserve.kernels.quant_gemv import dequantize, quant_linear, quant_linear_reference

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def rel_err(out: torch.Tensor, expected: torch.Tensor) -> float:
    assert torch.isfinite(out).all(), "an output element was never written (still NaN)"
    return ((out.double() - expected).norm() / expected.norm()).item()


def random_weights(bits: int, n: int, k: int, group: int, seed: int) -> tuple[torch.Tensor, ...]:
    """Random codes in the storage format: int8 [N, K] or packed uint8 [N, K // 2]; scales ~ 1 / sqrt(K) rows."""
    g = torch.Generator().manual_seed(seed)
    if bits == 8:
        q = torch.randint(-128, 128, (n, k), generator=g, dtype=torch.int8)
        scale = (torch.rand(n, k // group, generator=g) + 0.5) / (100 * k**0.5)
        return q, scale, None
    q = torch.randint(0, 256, (n, k // 2), generator=g, dtype=torch.int16).to(torch.uint8)
    scale = (torch.rand(n, k // group, generator=g) + 0.5) / (8 * k**0.5)
    zero = torch.randn(n, k // group, generator=g) / (4 * k**0.5)
    return q, scale, zero


def expected64(x, q, scale, zero, group, bias) -> torch.Tensor:
    y = x.double() @ dequantize(q, scale, zero, group).double().T
    return y if bias is None else y + bias.double()


def run_case(bits, M, N, K, group, dtype, with_bias, **launch) -> None:
    q, scale, zero = random_weights(bits, N, K, group, seed=M * 1000 + N + K + group)
    g = torch.Generator().manual_seed(N + K)
    x = torch.randn(M, K, generator=g).to(dtype)
    bias = torch.randn(N, generator=g).to(dtype) if with_bias else None
    out = torch.full((M, N), float("nan"), dtype=dtype)
    res = quant_linear(x, q, scale, zero, group, bias, out=out, **launch)
    assert res is out and out.dtype == dtype
    expected = expected64(x, q, scale, zero, group, bias)
    assert rel_err(out, expected) < TOL[dtype]
    assert rel_err(quant_linear_reference(x, q, scale, zero, group, bias), expected) < TOL[dtype]


INT4 = [  # M, N, K, group, bias
    (1, 17, 64, 32, False), (3, 100, 96, 32, True), (16, 257, 320, 64, False), (1, 257, 320, 64, True),
    (16, 1, 64, 64, True), (3, 17, 256, 128, False), (1, 100, 100, 100, True),  # the last: one group per row
]


@pytest.mark.parametrize(("M", "N", "K", "group", "with_bias"), INT4)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int4(M, N, K, group, with_bias, dtype) -> None:
    run_case(4, M, N, K, group, dtype, with_bias)


INT8 = [  # M, N, K, group, bias; group == K is one scale per output channel
    (1, 17, 33, 33, True), (3, 257, 100, 100, False), (16, 100, 33, 33, False), (16, 17, 320, 64, True),
    (1, 100, 96, 32, False), (3, 1, 64, 32, True),
]


@pytest.mark.parametrize(("M", "N", "K", "group", "with_bias"), INT8)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8(M, N, K, group, with_bias, dtype) -> None:
    run_case(8, M, N, K, group, dtype, with_bias)


@pytest.mark.parametrize(("bits", "M", "K", "group"), [(4, 1, 320, 32), (4, 5, 320, 64), (8, 16, 100, 100),
                                                        (8, 1, 320, 64)])
def test_split_k_slices_add_up_in_fixed_order(bits, M, K, group) -> None:
    """K cut into 3 slices (fp32 partials + a summing kernel) gives the unsplit result; fp16 x on the way."""
    run_case(bits, M, 100, K, group, torch.float32, True, block_k=32, split_k=3)
    run_case(bits, M, 17, K, group, torch.float16, False, block_n=16, block_k=32, split_k=2)
    q, scale, zero = random_weights(bits, 40, K, group, seed=7)
    x = torch.randn(M, K)
    one = quant_linear(x, q, scale, zero, group, split_k=1)
    three = quant_linear(x, q, scale, zero, group, block_k=32, split_k=3)
    assert torch.equal(three, quant_linear(x, q, scale, zero, group, block_k=32, split_k=3))
    assert rel_err(three, one.double()) < 1e-6


def test_reference_on_hand_made_bytes() -> None:
    """Nibble order spelled out: byte j holds k = 2j in its low nibble, k = 2j + 1 in its high one; code 8 is 0."""
    q = torch.tensor([[0x21, 0xF0], [0x08, 0x7F]], dtype=torch.uint8)  # codes [1, 2, 0, 15], [8, 0, 15, 7]
    scale = torch.tensor([[1.0, 2.0], [0.5, 1.0]])  # group 2: k 0..1, k 2..3
    zero = torch.tensor([[0.0, 1.0], [0.0, -1.0]])
    w = torch.tensor([[-7.0, -6.0, -15.0, 15.0], [0.0, -4.0, 6.0, -2.0]])
    assert torch.equal(dequantize(q, scale, zero, 2), w)
    x, bias = torch.tensor([[1.0, 2.0, 3.0, 4.0]]), torch.tensor([0.5, -1.0])
    assert torch.equal(quant_linear_reference(x, q, scale, zero, 2, bias), torch.tensor([[-3.5, 1.0]]))
    # the same bytes per channel (group = K = 4) through the kernel
    s1, z1 = torch.tensor([[2.0], [0.5]]), torch.tensor([[1.0], [-1.0]])
    w1 = torch.tensor([[-13.0, -11.0, -15.0, 15.0], [-1.0, -5.0, 2.5, -1.5]])
    assert torch.equal(dequantize(q, s1, z1, 4), w1)
    x2 = torch.tensor([[1.0, 2.0, 3.0, 4.0], [0.0, 1.0, 0.0, -1.0]])
    assert torch.allclose(quant_linear(x2, q, s1, z1, 4, bias), x2 @ w1.T + bias, rtol=1e-6, atol=1e-6)
    q8 = torch.tensor([[1, -2, 3], [127, -128, 0]], dtype=torch.int8)
    w8 = torch.tensor([[2.0, -4.0, 6.0], [63.5, -64.0, 0.0]])
    assert torch.equal(dequantize(q8, torch.tensor([[2.0], [0.5]]), None, 3), w8)
    x8 = torch.tensor([[1.0, 1.0, 1.0]])
    assert torch.equal(quant_linear(x8, q8, torch.tensor([[2.0], [0.5]]), None, 3), torch.tensor([[4.0, -0.5]]))


def test_bad_inputs_are_value_errors_naming_the_problem() -> None:
    q4, s4, z4 = random_weights(4, 8, 64, 32, seed=1)
    q8, s8, _ = random_weights(8, 8, 64, 32, seed=2)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match=r"1\.\.16 rows"):
        quant_linear(torch.randn(17, 64), q4, s4, z4, 32)
    # the reference and dequantize take any M: the path for bigger batches
    big = torch.randn(17, 64)
    assert rel_err(quant_linear_reference(big, q4, s4, z4, 32), expected64(big, q4, s4, z4, 32, None)) < 1e-5
    with pytest.raises(ValueError, match="K % group"):
        quant_linear(x, q4, s4, z4, 48)
    with pytest.raises(ValueError, match="K % group"):
        dequantize(q8, s8, None, 0)
    with pytest.raises(ValueError, match="multiple of 32"):
        quant_linear(x, q4, s4.repeat_interleave(2, 1), z4.repeat_interleave(2, 1), 16)
    with pytest.raises(ValueError, match="qweight has dtype"):
        quant_linear(x, q8.to(torch.int32), s8, None, 32)
    with pytest.raises(ValueError, match="x has dtype"):
        quant_linear(x.double(), q8, s8, None, 32)
    with pytest.raises(ValueError, match="scale has dtype"):
        quant_linear(x, q8, s8.half(), None, 32)
    with pytest.raises(ValueError, match="scale has shape"):
        quant_linear(x, q8, s8[:, :1], None, 32)
    with pytest.raises(ValueError, match="x has shape"):
        quant_linear(torch.randn(2, 32), q4, s4, z4, 32)  # 32 bytes a row are K = 64 int4 codes
    with pytest.raises(ValueError, match="need a zero"):
        quant_linear(x, q4, s4, None, 32)
    with pytest.raises(ValueError, match="zero goes with int4"):
        quant_linear(x, q8, s8, s8, 32)
    with pytest.raises(ValueError, match="zero has shape"):
        quant_linear(x, q4, s4, z4[:1], 32)
    with pytest.raises(ValueError, match="bias has shape"):
        quant_linear(x, q8, s8, None, 32, bias=torch.randn(9))
    with pytest.raises(ValueError, match="out has dtype"):
        quant_linear(x, q8, s8, None, 32, out=torch.empty(2, 8, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="qweight must be contiguous"):
        quant_linear(x, q8.T.contiguous().T, s8, None, 32)
    with pytest.raises(ValueError, match="block_k must be a power of two"):
        quant_linear(x, q8, s8, None, 32, block_k=48)
