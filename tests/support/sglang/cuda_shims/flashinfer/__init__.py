"""Test scaffolding: the part of FlashInfer (``flashinfer-python``, its CUDA kernels JIT-built or in ~1 GB of
cubins) that SGLang 0.5.15 imports at module load on a CUDA machine with ``--attention-backend triton``:
``flashinfer.sampling`` (torch stand-ins in sampling.py) and one name of ``flashinfer.prefill``.

The GPU check also sets ``SGLANG_IS_FLASHINFER_AVAILABLE=false``, so SGLang's ``is_flashinfer_available()`` is
false and no layer chooses a FlashInfer path; the top-level package has no other names, so an import of one (all
of them sit in try/except ImportError blocks or in FlashInfer-only backends) fails loudly. Nothing here is part
of streamserve.
"""
