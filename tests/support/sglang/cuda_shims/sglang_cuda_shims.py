"""Test scaffolding: lets SGLang 0.5.15 serve a plain Qwen3/Llama model on one CUDA GPU from the carried wheels
alone (benchmarks/sglang_gpu_check.sh), without the ``sglang-kernel`` and ``flashinfer-python`` wheels (hundreds of
MB each) and without building SGLang's JIT CUDA kernels (``sglang.jit_kernel``: nvcc + apache-tvm-ffi at run time).

Loaded at interpreter start by this folder's ``sitecustomize.py`` (the GPU check puts this folder on PYTHONPATH,
so ``sgl_kernel`` and ``flashinfer`` here are found too, and SGLang's scheduler processes, started by spawn, load
it as well; a .pth file would not do: Python reads those only in site directories, not on PYTHONPATH).
Each patch is applied right after its module is first imported (an import hook), and each turns a CUDA-only
kernel call into SGLang's own torch code or a torch equivalent; attention stays SGLang's Triton backend (what the
check tests):

* ``MultiPlatformOp`` (RMSNorm, SiluAndMul, RotaryEmbedding, ...): on CUDA its ``forward_cuda`` calls sgl_kernel
  or JIT kernels; an op that has a ``forward_native`` (SGLang's torch path, what its CPU engine runs) takes that.
* ``sglang.jit_kernel.norm.can_use_fused_inplace_qknorm`` -> False: Qwen3's q/k norms go through RMSNorm instead
  of the fused JIT kernel.
* ``sglang.jit_kernel.kvcache.can_use_store_cache`` -> False: KV writes take SGLang's torch indexing fallback.
* ``sglang.jit_kernel.clamp_position.clamp_position_cuda`` -> ``clamp(seq_lens - 1, min=0)`` in torch.

And one behaviour backported from SGLang 0.5.18+ (not a kernel): a streaming-session request with no new input ids
is accepted (``_session_turn_without_new_ids``); streamserve's backend relies on it.

Nothing here is part of streamserve. Environment the GPU check sets beside it: ``SGLANG_IS_FLASHINFER_AVAILABLE=
false`` (no FlashInfer path is chosen), ``SGLANG_SKIP_SGL_KERNEL_VERSION_CHECK=1`` (SGLang checks the installed
``sglang-kernel`` version on CUDA; this stand-in has none).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # torch is not imported at interpreter start: most processes that load this never need it
    import torch


def clamp_position(seq_lens: torch.Tensor) -> torch.Tensor:
    """positions [B] = max(seq_lens - 1, 0), in seq_lens' dtype (what the JIT kernel writes into empty_like)."""
    return (seq_lens - 1).clamp(min=0)


def _never(*args: Any, **kwargs: Any) -> bool:
    return False


def _native_dispatch(module: ModuleType) -> None:
    cls = module.MultiPlatformOp
    original = cls.dispatch_forward

    def dispatch_forward(self: Any) -> Callable[..., Any]:
        chosen = original(self)
        has_native = type(self).forward_native is not cls.forward_native
        if has_native and getattr(chosen, "__func__", None) is type(self).forward_cuda:
            return self.forward_native
        return chosen

    cls.dispatch_forward = dispatch_forward


def _patch_norm(module: ModuleType) -> None:
    module.can_use_fused_inplace_qknorm = _never


def _patch_kvcache(module: ModuleType) -> None:
    module.can_use_store_cache = _never


def _patch_clamp(module: ModuleType) -> None:
    module.clamp_position_cuda = clamp_position


def _session_turn_without_new_ids(module: ModuleType) -> None:
    """SGLang 0.5.14-0.5.17 refuse ``input_ids: []`` ("input_ids cannot be empty"), also in a streaming session,
    where the session's history supplies the prompt; streamserve's backend sends exactly that for a reply after
    appends. SGLang 0.5.18+ accept it for a request with a session id (io_struct's ``_determine_batch_size``: the
    scheduler still refuses a request that is empty after the history is prepended). This backports that check."""
    cls = module.GenerateReqInput
    original = cls._determine_batch_size

    def _determine_batch_size(self: Any) -> None:
        session = self.session_params.get("id") if isinstance(self.session_params, dict) else None
        if self.text is None and self.input_ids is not None and len(self.input_ids) == 0 and session:
            self.is_single, self.batch_size, self.input_embeds = True, 1, None
            return
        original(self)

    cls._determine_batch_size = _determine_batch_size


PATCHES: dict[str, Callable[[ModuleType], None]] = {
    "sglang.srt.managers.io_struct": _session_turn_without_new_ids,
    "sglang.srt.layers.utils.multi_platform": _native_dispatch,
    "sglang.jit_kernel.norm": _patch_norm,
    "sglang.jit_kernel.kvcache": _patch_kvcache,
    "sglang.jit_kernel.clamp_position": _patch_clamp,
}
applied: list[str] = []  # module names patched so far in this process (the GPU check logs them)


class _AfterImport(importlib.abc.MetaPathFinder):
    """Finds a patched module with the regular path finder, and runs its patch right after the module executes
    (before any importer reads a name from it)."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        patch = PATCHES.get(fullname)
        if patch is None:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run(module)
            patch(module)
            applied.append(fullname)

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


if not any(isinstance(f, _AfterImport) for f in sys.meta_path):
    sys.meta_path.insert(0, _AfterImport())
