"""Test scaffolding: ``flashinfer.prefill``'s cuDNN prefill, imported by SGLang's attention utilities on CUDA and
used only by its FlashInfer/cuDNN attention backends (the GPU check runs ``--attention-backend triton``)."""

from __future__ import annotations

from typing import Any, NoReturn


def cudnn_batch_prefill_with_kv_cache(*args: Any, **kwargs: Any) -> NoReturn:
    raise NotImplementedError("flashinfer.prefill.cudnn_batch_prefill_with_kv_cache has no stand-in in "
                              "streamserve's SGLang CUDA test shims")
