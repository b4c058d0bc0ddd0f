"""The SGLang CUDA test shims (cuda_shims/, used by benchmarks/sglang_gpu_check.sh) against their reference
formulas, on the CPU: the sgl_kernel norms, gated activations and top-k/top-p renormalisations, FlashInfer's two
samplers, the torch clamp that replaces a JIT kernel, the session-request backport, the zstandard stand-in, and the
import hook that patches SGLang's modules.

Needs only torch (the dev environment): SGLang itself is not imported here. The shims are loaded from their folder
for this module and unloaded after it, so nothing else in the test run sees an ``sgl_kernel`` or ``flashinfer``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType, SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

SHIMS = Path(__file__).parent / "cuda_shims"
NAMES = ("sgl_kernel", "flashinfer", "sglang_cuda_shims")


@pytest.fixture(scope="module")
def shims() -> Iterator[SimpleNamespace]:
    assert not any(n in sys.modules for n in NAMES), "a real sgl_kernel/flashinfer is loaded: cannot test the shims"
    sys.path.insert(0, str(SHIMS))
    before = list(sys.meta_path)
    try:
        yield SimpleNamespace(sk=importlib.import_module("sgl_kernel"),
                              sampling=importlib.import_module("flashinfer.sampling"),
                              hooks=importlib.import_module("sglang_cuda_shims"))
    finally:
        sys.path.remove(str(SHIMS))
        sys.meta_path[:] = before
        for name in [m for m in sys.modules if m.split(".")[0] in NAMES]:
            del sys.modules[name]


def rms_ref(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return (x64 / torch.sqrt(x64.pow(2).mean(-1, keepdim=True) + eps) * w.double()).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norms(shims: SimpleNamespace, dtype: torch.dtype) -> None:
    sk = shims.sk
    g = torch.Generator().manual_seed(0)
    x, r = (torch.randn(5, 32, generator=g).to(dtype) for _ in range(2))
    w = (1 + 0.3 * torch.randn(32, generator=g)).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(sk.rmsnorm(x, w, 1e-6), rms_ref(x, w, 1e-6), atol=tol, rtol=tol)
    out = torch.empty_like(x)
    assert sk.rmsnorm(x, w, 1e-5, out=out) is out
    torch.testing.assert_close(out, rms_ref(x, w, 1e-5), atol=tol, rtol=tol)
    torch.testing.assert_close(sk.gemma_rmsnorm(x, w, 1e-6), rms_ref(x, w.double() + 1, 1e-6), atol=tol, rtol=tol)
    xi, ri = x.clone(), r.clone()
    assert sk.fused_add_rmsnorm(xi, ri, w, 1e-6) is None  # in place, like the kernel
    torch.testing.assert_close(ri, x + r)
    torch.testing.assert_close(xi, rms_ref(x + r, w, 1e-6), atol=tol, rtol=tol)
    xi, ri = x.clone(), r.clone()
    sk.gemma_fused_add_rmsnorm(xi, ri, w, 1e-6)
    torch.testing.assert_close(xi, rms_ref(x + r, w.double() + 1, 1e-6), atol=tol, rtol=tol)


def test_gated_activations(shims: SimpleNamespace) -> None:
    sk = shims.sk
    x = torch.randn(2, 3, 16, generator=torch.Generator().manual_seed(1))
    gate, up = x[..., :8], x[..., 8:]
    torch.testing.assert_close(sk.silu_and_mul(x), gate * torch.sigmoid(gate) * up)
    torch.testing.assert_close(sk.gelu_and_mul(x), 0.5 * gate * (1 + torch.erf(gate / 2 ** 0.5)) * up)
    torch.testing.assert_close(sk.gelu_tanh_and_mul(x), F.gelu(gate, approximate="tanh") * up)
    out = torch.empty(2, 3, 8)
    assert sk.silu_and_mul(x, out) is out
    torch.testing.assert_close(out, F.silu(gate) * up)


PROBS = torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.25, 0.25, 0.25, 0.25]])


def test_top_k_renorm(shims: SimpleNamespace) -> None:
    got = shims.sk.top_k_renorm_prob(PROBS, torch.tensor([2, 0]))  # 0 = no top-k for that row
    torch.testing.assert_close(got, torch.tensor([[0, 0.625, 0, 0.375], [0.25, 0.25, 0.25, 0.25]]))
    torch.testing.assert_close(shims.sk.top_k_renorm_prob(PROBS[:1], 1), torch.tensor([[0.0, 1, 0, 0]]))


def test_top_p_renorm(shims: SimpleNamespace) -> None:
    # the smallest set of the largest probabilities whose sum reaches p: 0.5 + 0.3 >= 0.7; 0.5 alone >= 0.5
    got = shims.sk.top_p_renorm_prob(PROBS[:1].expand(2, 4), torch.tensor([0.7, 0.5]))
    torch.testing.assert_close(got, torch.tensor([[0, 0.625, 0, 0.375], [0.0, 1, 0, 0]]))
    torch.testing.assert_close(shims.sk.top_p_renorm_prob(PROBS, 1.0), PROBS)


def test_samplers_draw_only_what_the_filters_keep(shims: SimpleNamespace) -> None:
    s, g = shims.sampling, torch.Generator().manual_seed(2)
    rows = PROBS[:1].expand(400, 4).contiguous()
    ids = s.top_k_top_p_sampling_from_probs(rows, 3, 0.7, generator=g)  # top-3 {1,3,2}, renorm, top-p: {1,3}
    assert ids.dtype == torch.int32 and ids.shape == (400,) and set(ids.tolist()) == {1, 3}
    # joint: in the top-3 and in the original nucleus for p = 0.5 ({1}) -> only 1
    assert set(s.top_k_top_p_sampling_from_probs(rows, 3, 0.5, filter_apply_order="joint", generator=g).tolist()) \
        == {1}
    assert set(s.min_p_sampling_from_probs(rows, torch.full((400,), 0.5), generator=g).tolist()) == {1, 3}
    assert set(s.min_p_sampling_from_probs(rows, 0.05, generator=g).tolist()) == {0, 1, 2, 3}


def test_not_shimmed_kernels_raise(shims: SimpleNamespace) -> None:
    with pytest.raises(NotImplementedError, match="fp8_scaled_mm"):
        shims.sk.fp8_scaled_mm(torch.zeros(1))
    assert importlib.import_module("sgl_kernel.utils").is_arch_support_pdl() is False
    with pytest.raises(ImportError):
        importlib.import_module("flashinfer.decode")  # not stood in for: an import fails loudly


def test_clamp_position(shims: SimpleNamespace) -> None:
    for dtype in (torch.int32, torch.int64):
        got = shims.hooks.clamp_position(torch.tensor([0, 1, 7], dtype=dtype))
        assert got.dtype == dtype and got.tolist() == [0, 0, 6]


def test_native_dispatch_picks_forward_native_where_there_is_one(shims: SimpleNamespace) -> None:
    class MultiPlatformOp:
        def __init__(self) -> None:
            self._forward_method = self.dispatch_forward()

        def dispatch_forward(self):  # what SGLang does on CUDA
            return self.forward_cuda

        def forward_native(self) -> str:
            raise NotImplementedError

        def forward_cuda(self) -> str:
            return "cuda"

    class Norm(MultiPlatformOp):
        def forward_native(self) -> str:
            return "native"

    class CudaOnly(MultiPlatformOp):
        pass

    module = ModuleType("fake_multi_platform")
    module.MultiPlatformOp = MultiPlatformOp
    shims.hooks._native_dispatch(module)
    assert Norm()._forward_method() == "native" and CudaOnly()._forward_method() == "cuda"


def test_the_import_hook_patches_a_module_right_after_it_runs(shims: SimpleNamespace, tmp_path: Path,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "fake_jit_kvcache.py").write_text("def can_use_store_cache(size):\n    return True\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setitem(shims.hooks.PATCHES, "fake_jit_kvcache", shims.hooks._patch_kvcache)
    try:
        module = importlib.import_module("fake_jit_kvcache")
        assert module.can_use_store_cache(256) is False and "fake_jit_kvcache" in shims.hooks.applied
    finally:
        sys.modules.pop("fake_jit_kvcache", None)


def test_a_session_turn_without_new_ids_is_accepted(shims: SimpleNamespace) -> None:
    class GenerateReqInput:  # SGLang 0.5.15's check, reduced to the branch the backport changes
        def __init__(self, input_ids: list[int], session_params: dict | None = None) -> None:
            self.text, self.input_ids, self.session_params, self.input_embeds = None, input_ids, session_params, 0

        def _determine_batch_size(self) -> None:
            if len(self.input_ids) == 0:
                raise ValueError("input_ids cannot be empty.")
            self.is_single, self.batch_size, self.input_embeds = True, 1, None

    shims.hooks._session_turn_without_new_ids(SimpleNamespace(GenerateReqInput=GenerateReqInput))
    r = GenerateReqInput([], {"id": "s1"})
    r._determine_batch_size()
    assert (r.is_single, r.batch_size, r.input_embeds) == (True, 1, None)
    with pytest.raises(ValueError, match="cannot be empty"):
        GenerateReqInput([], None)._determine_batch_size()  # without a session: refused, as before
    GenerateReqInput([4, 5], {"id": "s1"})._determine_batch_size()


def test_zstandard_stand_in_imports_and_refuses_to_decompress() -> None:
    spec = importlib.util.spec_from_file_location("zstandard_stand_in", SHIMS / "zstandard" / "__init__.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)  # under its own name: a real zstandard elsewhere in the run is untouched
    with pytest.raises(module.ZstdError):
        module.ZstdDecompressor().stream_reader(b"")
