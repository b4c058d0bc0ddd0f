"""`Engine`: a loaded model + tokenizer that opens persistent sessions."""

from __future__ import annotations

import json
import logging
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import torch

from streamserve.config import ENGINE_DEFAULTS
from streamserve.engine.session import Session
from streamserve.errors import InvalidInputError, ModelLoadError
from streamserve.models import CausalLM, ModelConfig, Tokenizer, load_model
from streamserve.sessions import ContiguousKVCache

log = logging.getLogger("streamserve")

DEFAULT_MODEL_DIR = Path(__file__).resolve().parent.parent / "assets" / "default"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_model_path(model: str | Path) -> Path:
    if str(model) == "default":
        return DEFAULT_MODEL_DIR
    path = Path(model).expanduser()
    if not (path / "config.json").exists():
        raise ModelLoadError(f"model {str(model)!r} not found: pass 'default' or a folder holding config.json, "
                             "safetensors weights and tokenizer.json (models are never downloaded)")
    return path


def resolve_device(device: str | torch.device) -> torch.device:
    if str(device) == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidInputError("device 'cuda' was asked for but torch sees no CUDA device; use --device cpu")
    return dev


def resolve_dtype(dtype: str | torch.dtype | None, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype is not None:
        if dtype not in _DTYPES:
            raise InvalidInputError(f"dtype {dtype!r} is not one of {sorted(_DTYPES)}")
        return _DTYPES[dtype]
    chosen = _DTYPES.get(checkpoint_dtype, torch.float32)
    # 16-bit matmuls on a CPU are slow and round differently from the GPU kernels: compute in fp32 there
    return torch.float32 if device.type == "cpu" else chosen


class Engine:
    """Holds the model and tokenizer; sessions share them. Thread-safe: one forward at a time."""

    def __init__(self, model: CausalLM, tokenizer: Tokenizer, path: Path, eos_token_ids: tuple[int, ...]) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config: ModelConfig = model.cfg
        self.path = path
        self.name = "default" if path == DEFAULT_MODEL_DIR else path.name
        self.eos_token_ids = eos_token_ids
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self._lock = threading.Lock()
        # weak: a session dropped without close() is garbage-collected with its KV memory, never leaked
        self._sessions: weakref.WeakValueDictionary[str, Session] = weakref.WeakValueDictionary()
        self._counters = {"prefill_tokens": 0, "decode_tokens": 0, "forward_calls": 0,
                          "prefill_seconds": 0.0, "decode_seconds": 0.0}

    @classmethod
    def from_pretrained(cls, model: str | Path = ENGINE_DEFAULTS.model, device: str | torch.device =
                        ENGINE_DEFAULTS.device, dtype: str | torch.dtype | None = ENGINE_DEFAULTS.dtype) -> Engine:
        """Load "default" (the embedded model) or a Hugging Face checkpoint folder."""
        path = resolve_model_path(model)
        cfg = ModelConfig.from_file(path / "config.json")
        dev = resolve_device(device)
        dt = resolve_dtype(dtype, cfg.dtype, dev)
        tokenizer = Tokenizer.from_dir(path)
        t0 = time.perf_counter()
        net = load_model(path, cfg, dev, dt)
        log.info("loaded %s (%s) on %s as %s in %.1fs", path, cfg.architecture, dev, dt, time.perf_counter() - t0)
        eos = list(cfg.eos_token_ids)
        gen_cfg = path / "generation_config.json"
        if gen_cfg.exists():
            g = json.loads(gen_cfg.read_text()).get("eos_token_id")
            eos += g if isinstance(g, list) else [g] if g is not None else []
        eos += tokenizer.eos_token_ids
        eos_ids = tuple(dict.fromkeys(i for i in eos if 0 <= i < cfg.vocab_size))
        return cls(net, tokenizer, path, eos_ids)

    def open_session(self, seed: int | None = None) -> Session:
        """A new persistent session. `seed` seeds its sampling for the whole session (reproducible runs)."""
        cfg = self.config
        kv = ContiguousKVCache(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, cfg.max_position_embeddings,
                               self.dtype, self.device)
        s = Session(self, kv, seed)
        self._sessions[s.id] = s
        return s

    def _release(self, session: Session) -> None:
        self._sessions.pop(session.id, None)

    def forward(self, kv: ContiguousKVCache, ids: list[int], all_logits: bool = False) -> torch.Tensor:
        """Run `ids` after the session's committed tokens; commit them only if the forward succeeds.

        -> logits [V] of the last token (fp32), or [T, V] with `all_logits`.
        """
        n = len(ids)
        with self._lock:
            t0 = time.perf_counter()
            kv.begin(n)
            try:
                ids_t = torch.tensor(ids, dtype=torch.long, device=self.device)
                pos = torch.arange(kv.length, kv.length + n, device=self.device)
                logits = self.model(ids_t, pos, kv, all_logits=all_logits)
                kind = "decode" if n == 1 else "prefill"
                self._counters[f"{kind}_tokens"] += n
                self._counters[f"{kind}_seconds"] += time.perf_counter() - t0
                self._counters["forward_calls"] += 1
            except BaseException:
                kv.abort()
                raise
            kv.commit()  # last: nothing after it can fail between the cache and the caller's bookkeeping
        return logits

    def stats(self) -> dict[str, Any]:
        c = self._counters
        return {
            "model": self.name,
            "architecture": self.config.architecture,
            "parameters": sum(p.numel() for p in self.model.parameters()),
            "device": str(self.device),
            "dtype": str(self.dtype).removeprefix("torch."),
            "sessions_open": len(self._sessions),
            "kv_bytes": sum(s.kv.nbytes for s in list(self._sessions.values())),
            **c,
            "prefill_tokens_per_s": c["prefill_tokens"] / c["prefill_seconds"] if c["prefill_seconds"] else 0.0,
            "decode_tokens_per_s": c["decode_tokens"] / c["decode_seconds"] if c["decode_seconds"] else 0.0,
        }
