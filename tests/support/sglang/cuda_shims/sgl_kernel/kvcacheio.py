"""Test scaffolding: ``sgl_kernel.kvcacheio``, the host-memory KV cache's copy kernels (hierarchical cache,
``--enable-hierarchical-cache``), imported when the memory pools load; the GPU check never turns that cache on."""

from __future__ import annotations

from sgl_kernel import _not_shimmed

transfer_kv_all_layer = _not_shimmed("kvcacheio.transfer_kv_all_layer")
transfer_kv_all_layer_direct_lf_pf = _not_shimmed("kvcacheio.transfer_kv_all_layer_direct_lf_pf")
transfer_kv_all_layer_lf_pf = _not_shimmed("kvcacheio.transfer_kv_all_layer_lf_pf")
transfer_kv_all_layer_lf_ph = _not_shimmed("kvcacheio.transfer_kv_all_layer_lf_ph")
transfer_kv_all_layer_mla = _not_shimmed("kvcacheio.transfer_kv_all_layer_mla")
transfer_kv_all_layer_mla_lf_pf = _not_shimmed("kvcacheio.transfer_kv_all_layer_mla_lf_pf")
transfer_kv_direct = _not_shimmed("kvcacheio.transfer_kv_direct")
transfer_kv_per_layer = _not_shimmed("kvcacheio.transfer_kv_per_layer")
transfer_kv_per_layer_direct_pf_lf = _not_shimmed("kvcacheio.transfer_kv_per_layer_direct_pf_lf")
transfer_kv_per_layer_mla = _not_shimmed("kvcacheio.transfer_kv_per_layer_mla")
transfer_kv_per_layer_mla_pf_lf = _not_shimmed("kvcacheio.transfer_kv_per_layer_mla_pf_lf")
transfer_kv_per_layer_pf_lf = _not_shimmed("kvcacheio.transfer_kv_per_layer_pf_lf")
transfer_kv_per_layer_ph_lf = _not_shimmed("kvcacheio.transfer_kv_per_layer_ph_lf")
