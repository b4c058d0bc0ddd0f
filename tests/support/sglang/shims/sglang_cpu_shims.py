"""Test scaffolding: lets the pinned SGLang release import on a CPU-only machine without CUDA wheels.

Loaded at interpreter start by ``sglang_cpu_shims.pth``, which ``install.sh`` writes into the SGLang virtual
environment's site-packages (with this folder on the path, so ``sgl_kernel`` here is found too). Nothing here is
part of streamserve: it exists so the SGLang backend tests can run a real SGLang server on a machine that has the
CPU torch and no GPU.

What it patches, lazily (an import hook, so interpreter start-up stays cheap):

* ``torchvision``: the only torchvision wheel for torch 2.13 on the index is a CUDA build, whose ``_C.so`` cannot
  load against the CPU torch. torchvision then runs without its compiled ops (its pure-torch transforms still work),
  except that ``torchvision._meta_registrations`` unconditionally registers fake kernels for ``torchvision::nms`` and
  ``torchvision::qnms``, which raises when the ops were never defined. The hook defines those two schemas (without
  kernels: calling them raises, as on any torchvision built without ops) before torchvision loads. SGLang needs
  torchvision importable because transformers 5's ``AutoImageProcessor`` and some of SGLang's config modules
  import it at module load, even for a text-only model.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

_TORCHVISION_SCHEMAS: tuple[str, ...] = (
    "nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
    "qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor",
)
# Kept alive for the whole process: a torch.library.Library drops its definitions when it is collected.
_libraries: list[object] = []


def _define_torchvision_ops() -> None:
    import torch

    if hasattr(torch.ops.torchvision, "nms"):  # a torchvision whose ops did load (a CPU build): nothing to do
        return
    lib = torch.library.Library("torchvision", "DEF")
    for schema in _TORCHVISION_SCHEMAS:
        lib.define(schema)
    _libraries.append(lib)


class _BeforeImport(importlib.abc.MetaPathFinder):
    """Runs a preparation step the first time a given top-level module is imported, then steps aside: the
    regular finders still load the module itself."""

    def __init__(self, steps: dict[str, Callable[[], None]]) -> None:
        self._pending = dict(steps)

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        prepare = self._pending.pop(fullname, None)
        if prepare is not None:
            prepare()
        return None


sys.meta_path.insert(0, _BeforeImport({"torchvision": _define_torchvision_ops}))
