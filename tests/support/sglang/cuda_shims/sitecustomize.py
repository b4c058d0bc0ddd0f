"""Test scaffolding: installs the SGLang CUDA shims' import hook (sglang_cuda_shims) in every Python started with
this folder on PYTHONPATH, then runs the sitecustomize this one shadows, if the image has one."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import os
import sys

import sglang_cuda_shims  # noqa: F401  (installs the hook)

_here = os.path.dirname(os.path.abspath(__file__))
_rest = [p for p in sys.path if os.path.abspath(p or ".") != _here]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _rest)
if _spec is not None and _spec.loader is not None:
    _chained = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_chained)
