"""Test scaffolding: an importable ``zstandard`` for the SGLang GPU check, which does not carry the 5.5 MB wheel
(the working tree that travels to the GPU machine is limited to 64 MiB, and the product's files take 25 MB of it).

SGLang imports it at module load (``sglang.srt.entrypoints.http_request_decompression``) to decompress request
bodies a client sent with ``x-body-compressed: zstd``; the check's clients never compress. Decompressing raises.
Nothing here is part of streamserve.
"""

from __future__ import annotations

from typing import Any, NoReturn


class ZstdError(Exception):
    pass


class ZstdDecompressor:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    def _refuse(self, *args: Any, **kwargs: Any) -> NoReturn:
        raise ZstdError("zstd request bodies are not supported by streamserve's SGLang GPU-check stand-in")

    decompress = stream_reader = _refuse
