"""Test scaffolding: ``sgl_kernel.mamba``'s CPU kernels, which SGLang's linear-attention backends (GDN, KDA) import
when its CPU engine is on. The tests serve only full-attention models, so these are importable names that raise if
called (see the package docstring). Nothing here is part of streamserve."""

from __future__ import annotations

from sgl_kernel import _not_shimmed

causal_conv1d_fn_cpu = _not_shimmed("mamba.causal_conv1d_fn_cpu")
causal_conv1d_update_cpu = _not_shimmed("mamba.causal_conv1d_update_cpu")
chunk_gated_delta_rule_cpu = _not_shimmed("mamba.chunk_gated_delta_rule_cpu")
