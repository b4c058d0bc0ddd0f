"""The 4-bit grids of a GGUF tensor: per group of 32 columns, the scale and zero on which its values lie.

Q4_0, Q4_1 and Q4_K store every group of 32 values as 4-bit codes c with one affine map, so that
value = (c - 8) * scale + zero exactly (in fp32):

    Q4_0  [d fp16, 16 bytes of codes]                  value = d * (c - 8)        scale d, zero 0
    Q4_1  [d fp16, m fp16, 16 bytes]                   value = d * c + m          scale d, zero m + 8d
    Q4_K  [d, dmin fp16, 12 bytes of 6-bit (sc, m)
           for 8 sub-blocks, 128 bytes of codes]       value = d*sc * c - dmin*m  scale d*sc, zero 8*d*sc - dmin*m

Handing the grid to `models.quant.quantize_int4` with the dequantized values recovers the file's codes bit for
bit, so a Q4 GGUF file is kept as the 4-bit weights it is instead of being re-rounded.
"""

from __future__ import annotations

import numpy as np
import torch
from gguf import GGMLQuantizationType as Q
from gguf.quants import Q4_K

from streamserve.models.gguf.reader import TensorEntry

GRID_TYPES = frozenset({Q.Q4_0, Q.Q4_1, Q.Q4_K})
_BLOCK_BYTES = {Q.Q4_0: 18, Q.Q4_1: 20, Q.Q4_K: 144}


def grid(t: TensorEntry) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(scale, zero) fp32 [N, K / 32] of a 2-D Q4_0/Q4_1/Q4_K tensor in torch order [N, K]; None for other types."""
    if t.ggml_type not in GRID_TYPES or len(t.shape) != 2:
        return None
    n = t.shape[0]
    blocks = np.asarray(t.data).reshape(-1, _BLOCK_BYTES[t.ggml_type])  # [n_blocks, bytes], row-major over [N, K]
    d = blocks[:, 0:2].copy().view(np.float16).astype(np.float32)  # [n_blocks, 1]
    if t.ggml_type == Q.Q4_0:
        scale, zero = d, np.zeros_like(d)
    elif t.ggml_type == Q.Q4_1:
        m = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        scale, zero = d, m + 8 * d
    else:  # Q4_K: 256 values a block, 8 sub-blocks of 32 with 6-bit scales and mins
        dmin = blocks[:, 2:4].copy().view(np.float16).astype(np.float32)
        sc, mins = Q4_K.get_scale_min(blocks[:, 4:16].copy())  # [n_blocks, 8] each
        scale = d * sc.astype(np.float32)
        zero = 8 * scale - dmin * mins.astype(np.float32)
    return (torch.from_numpy(np.ascontiguousarray(scale.reshape(n, -1), dtype=np.float32)),
            torch.from_numpy(np.ascontiguousarray(zero.reshape(n, -1), dtype=np.float32)))
