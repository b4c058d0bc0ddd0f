"""Test scaffolding: ``sgl_kernel.quantization``, the GGUF quantized kernels, imported by SGLang's quantization
registry (loaded for every model); the GPU check serves an unquantized checkpoint."""

from __future__ import annotations

from sgl_kernel import _not_shimmed

ggml_dequantize = _not_shimmed("quantization.ggml_dequantize")
ggml_moe_a8 = _not_shimmed("quantization.ggml_moe_a8")
ggml_moe_a8_vec = _not_shimmed("quantization.ggml_moe_a8_vec")
ggml_moe_get_block_size = _not_shimmed("quantization.ggml_moe_get_block_size")
ggml_mul_mat_a8 = _not_shimmed("quantization.ggml_mul_mat_a8")
ggml_mul_mat_vec_a8 = _not_shimmed("quantization.ggml_mul_mat_vec_a8")
