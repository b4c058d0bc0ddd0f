"""Test scaffolding: ``sgl_kernel.utils`` (the Triton attention backend imports ``is_arch_support_pdl``)."""

from __future__ import annotations


def is_arch_support_pdl() -> bool:
    """Whether kernels may use programmatic dependent launch (Hopper and later). False: SGLang's Triton kernels then
    launch the ordinary way, which is correct on every GPU (PDL only overlaps a kernel's prologue with the last)."""
    return False
