"""A "projector" policy's state encoding: its state_projector.safetensors maps the state vector, clipped and scaled
into [-1, 1] by the codec's ranges, to ONE embedding vector the model reads in place of a token embedding
(robot/codec.py, `state_encoding: "projector"`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Protocol

import numpy as np

from streamserve.robot.errors import PolicyConfigError

STATE_PROJECTOR_FILE = "state_projector.safetensors"


class StateRanges(Protocol):
    """What the projector reads of a codec (robot/codec.py's PolicyCodec)."""

    @property
    def state_dims(self) -> int: ...

    @property
    def state_low(self) -> tuple[float, ...]: ...

    @property
    def state_high(self) -> tuple[float, ...]: ...


class StateProjector:
    """The linear map of a "projector" policy's state: clip into [low, high], scale into [-1, 1], then
    `weight @ x + bias` -> one embedding [hidden] the model reads in place of a token embedding."""

    def __init__(self, weight: np.ndarray, bias: np.ndarray, low: tuple[float, ...], high: tuple[float, ...]) -> None:
        self.weight = weight.astype(np.float32)  # [hidden, Ds]
        self.bias = bias.astype(np.float32)  # [hidden]
        self.low, self.high = np.asarray(low), np.asarray(high)  # [Ds]
        self.hidden_size = int(weight.shape[0])

    @classmethod
    def load(cls, checkpoint_dir: str | Path, codec: StateRanges, hidden_size: int | None = None) -> StateProjector:
        """The checkpoint's state_projector.safetensors (float32 or float16 `weight` [hidden, Ds] and `bias`
        [hidden], finite); PolicyConfigError when it is missing, damaged or of other sizes than the codec's Ds
        and the model's hidden size (config.json's when `hidden_size` is None)."""
        folder = Path(checkpoint_dir)
        path = folder / STATE_PROJECTOR_FILE
        if not path.is_file():
            raise PolicyConfigError(f"policy.json says state_encoding \"projector\" but {path} does not exist")
        from safetensors import safe_open  # imported here: bins-only robot code needs numpy alone

        try:
            with safe_open(str(path), framework="numpy") as f:
                names = set(f.keys())
                if names != {"weight", "bias"}:
                    raise PolicyConfigError(f"{path} must hold exactly 'weight' [hidden, Ds] and 'bias' [hidden], "
                                            f"got {sorted(names)}")
                weight, bias = f.get_tensor("weight"), f.get_tensor("bias")
        except PolicyConfigError:
            raise
        except Exception as e:  # safetensors raises its own errors (and numpy TypeErrors) for damaged or bf16 files
            raise PolicyConfigError(f"cannot read {path} ({e}); it must be safetensors holding float32 or float16 "
                                    "'weight' and 'bias'") from None
        if hidden_size is None and (folder / "config.json").is_file():
            try:
                hidden_size = json.loads((folder / "config.json").read_text(encoding="utf-8")).get("hidden_size")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                hidden_size = None
        for name, a in (("weight", weight), ("bias", bias)):
            if not np.issubdtype(a.dtype, np.floating) or not np.isfinite(a).all():
                raise PolicyConfigError(f"{path}: '{name}' must hold finite floating-point numbers")
        if weight.ndim != 2 or weight.shape[1] != codec.state_dims:
            raise PolicyConfigError(f"{path}: 'weight' must be [hidden, {codec.state_dims}] (the state's dims), got "
                                    f"{list(weight.shape)}")
        if bias.shape != (weight.shape[0],):
            raise PolicyConfigError(f"{path}: 'bias' must be [{weight.shape[0]}], got {list(bias.shape)}")
        if isinstance(hidden_size, int) and weight.shape[0] != hidden_size:
            raise PolicyConfigError(f"{path} projects to {weight.shape[0]} values, but the model's hidden size is "
                                    f"{hidden_size}: it belongs to another model")
        return cls(weight, bias, codec.state_low, codec.state_high)

    def embed(self, state: np.ndarray) -> np.ndarray:
        """A state [Ds] (finite) -> float32 [1, hidden]."""
        x = 2.0 * (np.clip(state, self.low, self.high) - self.low) / (self.high - self.low) - 1.0  # [Ds] in [-1, 1]
        return (self.weight @ x.astype(np.float32) + self.bias)[None, :].astype(np.float32)


def save_state_projector(checkpoint_dir: str | Path, weight: np.ndarray, bias: np.ndarray) -> Path:
    """Write a checkpoint's state_projector.safetensors (`weight` [hidden, Ds], `bias` [hidden], float32)."""
    from safetensors.numpy import save_file

    path = Path(checkpoint_dir) / STATE_PROJECTOR_FILE
    save_file({"weight": np.ascontiguousarray(weight, np.float32), "bias": np.ascontiguousarray(bias, np.float32)},
              str(path))
    return path
