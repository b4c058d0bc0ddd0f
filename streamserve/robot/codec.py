"""The policy codec: how a robot's observations and actions become token ids on a session, and back.

A checkpoint that is a robot policy carries `policy.json` beside its config.json; `PolicyCodec.load` reads it.
One control tick on an episode's session is

    [<obs>, s_1 .. s_Ds, <act>]   appended (state_ids: one token per state dimension)
    a_1 .. a_(H*D)                 the reply, constrained to the action ids, step-major: step 0's D dims first

and the episode's first tick (and any tick whose instruction changed) is preceded by `[<task>, *prompt tokens]`.
Camera images (`image_keys`, served by the policy endpoint only) come between the prompt and the state, one chunk of
kind "image" per key in `image_keys` order: what the server's vision path makes of it (server/service/images.py), a text
note of its ImageNet labels for a text-only model (only when the labels changed: an unchanged scene adds 0 tokens),
or the model's own image encoder's embeddings when the checkpoint ships `image_projector.safetensors`.

With `"state_encoding": "projector"` the state is not binned: the checkpoint's `state_projector.safetensors`
(`weight` [hidden, Ds], `bias` [hidden]) maps the state, clipped and scaled into [-1, 1] by its ranges, to ONE
embedding vector, and the tick appends `[<obs>]`, that vector, `[<act>]` (three chunks of kind "state", the
vector an `embeds` chunk [1, hidden]): 3 positions per observation instead of Ds + 2 (`state_parts`).
Values are discretised the OpenVLA way: per dimension `bins` uniform bins over [low, high], a value is clipped into
the range and mapped to its bin, a bin decodes to its centre. All dimensions share one block of token ids
(`offset + bin`), so the vocabulary holds `state_bins` state ids and `action_bins` action ids.

This module needs NumPy only (no torch, nothing from the engine or server): robot-side code may import it.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import numpy as np

from streamserve.robot.errors import PolicyConfigError, PolicyInputError
from streamserve.robot.normalize import Normalization, parse_norm_stats
from streamserve.robot.projector import StateProjector

POLICY_FILE = "policy.json"
POLICY_FORMAT = 1  # policy.json's "format": bumped when the layout changes incompatibly
STATE_ENCODINGS = ("bins", "projector")


def _floats(name: str, value: Any) -> tuple[float, ...]:
    if not isinstance(value, (list, tuple)) or not value:
        raise PolicyConfigError(f"policy.json: {name} must be a non-empty list of numbers, got {value!r}")
    out = []
    for v in value:
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise PolicyConfigError(f"policy.json: {name} must hold finite numbers, got {v!r}")
        out.append(float(v))
    return tuple(out)


def _int(name: str, value: Any, least: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise PolicyConfigError(f"policy.json: {name} must be an integer >= {least}, got {value!r}")
    return value


@dataclass(frozen=True)
class PolicyCodec:
    state_key: str  # observation key of the state vector, e.g. "observation/state"
    state_low: tuple[float, ...]  # [Ds] per-dimension range of the state bins
    state_high: tuple[float, ...]
    state_bins: int
    state_token_offset: int  # the id of state bin 0; bin b is offset + b
    action_dims: int  # D
    action_horizon: int  # H: steps in one chunk
    action_low: tuple[float, ...]  # [D]
    action_high: tuple[float, ...]
    action_bins: int
    action_token_offset: int
    obs_token: int  # marker ids: <obs> opens a state, <act> asks for the actions, <task> opens an instruction
    act_token: int
    task_token: int
    prompt_key: str = "prompt"
    default_prompt: str = ""
    image_keys: tuple[str, ...] = ()  # camera images (uint8 [H, W, 3] or JPEG/PNG bytes) for the server's vision path
    state_encoding: str = "bins"  # "bins": Ds state tokens; "projector": one vector (state_projector.safetensors)
    window: int = 256  # an episode's session keeps `sinks` first tokens + the last `window` (rolling positions)
    sinks: int = 8
    control_hz: float = 50.0
    # observation keys concatenated, in order, into the state (e.g. joints then gripper); () : state_key alone.
    # When given, state_key is its first
    state_keys: tuple[str, ...] = ()
    # {"state": {mean, std} | {q01, q99}, "actions": ...} (robot/normalize.py): the ranges above are then in
    # normalised units; None: values are binned as they come
    norm_stats: dict[str, Any] | None = field(default=None, hash=False)

    def __post_init__(self) -> None:
        self.validate()

    # ---- configuration ------------------------------------------------------------------------------
    def validate(self, vocab_size: int | None = None) -> None:
        """PolicyConfigError unless the fields make a usable codec (and its ids fit `vocab_size` when given)."""
        for name in ("state_key", "prompt_key", "default_prompt"):
            if not isinstance(getattr(self, name), str):
                raise PolicyConfigError(f"policy.json: {name} must be a string")
        if not self.state_key or not self.prompt_key:
            raise PolicyConfigError("policy.json: state_key and prompt_key must not be empty")
        if not all(isinstance(k, str) and k for k in self.state_keys) or len(set(self.state_keys)) != len(
                self.state_keys) or (self.state_keys and self.state_keys[0] != self.state_key):
            raise PolicyConfigError("policy.json: state_keys must be distinct non-empty strings, state_key the first")
        if not all(isinstance(k, str) and k for k in self.image_keys):
            raise PolicyConfigError("policy.json: image_keys must be a list of non-empty strings")
        if self.state_encoding not in STATE_ENCODINGS:
            raise PolicyConfigError(f"policy.json: state_encoding must be one of {list(STATE_ENCODINGS)}, got "
                                    f"{self.state_encoding!r}")
        _int("state_bins", self.state_bins, 2)
        _int("action_bins", self.action_bins, 2)
        _int("action_dims", self.action_dims, 1)
        _int("action_horizon", self.action_horizon, 1)
        for kind, dims in (("state", len(self.state_low)), ("action", self.action_dims)):
            low, high = getattr(self, f"{kind}_low"), getattr(self, f"{kind}_high")
            if len(low) != dims or len(high) != dims:
                raise PolicyConfigError(f"policy.json: {kind}_low and {kind}_high must both have {dims} values")
            if not all(lo < hi for lo, hi in zip(low, high, strict=True)):
                raise PolicyConfigError(f"policy.json: every {kind}_low must be below its {kind}_high")
        parse_norm_stats(self.norm_stats, len(self.state_low), self.action_dims)
        _int("sinks", self.sinks, 0)
        if _int("window", self.window, 1) < self.sinks:
            raise PolicyConfigError(f"policy.json: window ({self.window}) must be at least sinks ({self.sinks})")
        if isinstance(self.control_hz, bool) or not isinstance(self.control_hz, (int, float)) \
                or not math.isfinite(self.control_hz) or self.control_hz <= 0:
            raise PolicyConfigError(f"policy.json: control_hz must be a number > 0, got {self.control_hz!r}")
        # the id ranges: state bins, action bins and the three markers must not overlap
        spans = [(_int("state_token_offset", self.state_token_offset, 0), self.state_bins, "state bins"),
                 (_int("action_token_offset", self.action_token_offset, 0), self.action_bins, "action bins")]
        spans += [(_int(f"{m}_token", getattr(self, f"{m}_token"), 0), 1, f"<{m}>") for m in ("obs", "act", "task")]
        spans.sort()
        for (a, n, what), (b, _, other) in itertools.pairwise(spans):
            if a + n > b:
                raise PolicyConfigError(f"policy.json: the token ids of {what} and {other} overlap")
        top = spans[-1][0] + spans[-1][1]
        if vocab_size is not None and top > vocab_size:
            raise PolicyConfigError(f"policy.json: token ids run to {top - 1}, past the model's vocabulary of "
                                    f"{vocab_size}")

    @classmethod
    def from_dict(cls, data: Any) -> PolicyCodec:
        """The codec from policy.json's object (its field names are the dataclass's, plus "format")."""
        if not isinstance(data, dict):
            raise PolicyConfigError("policy.json must hold a JSON object")
        if data.get("format") != POLICY_FORMAT:
            raise PolicyConfigError(f"policy.json: format must be {POLICY_FORMAT}, got {data.get('format')!r}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - names - {"format"})
        if unknown:
            raise PolicyConfigError(f"policy.json: unknown fields {unknown}")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = sorted(n for n in required if n not in data)
        if missing:
            raise PolicyConfigError(f"policy.json: missing fields {missing}")
        kw = {k: v for k, v in data.items() if k != "format"}
        for name in ("state_low", "state_high", "action_low", "action_high"):
            kw[name] = _floats(name, kw[name])
        for name in ("image_keys", "state_keys"):
            if name in kw:
                if not isinstance(kw[name], list):
                    raise PolicyConfigError(f"policy.json: {name} must be a list of strings")
                kw[name] = tuple(kw[name])
        return cls(**kw)

    @classmethod
    def load(cls, checkpoint_dir: str | Path) -> PolicyCodec | None:
        """The codec of a checkpoint folder; None when it has no policy.json (not a policy). A malformed file,
        or ids past config.json's vocab_size, raise PolicyConfigError."""
        folder = Path(checkpoint_dir)
        path = folder / POLICY_FILE
        if not folder.is_dir() or not path.is_file():
            return None
        try:
            data = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
            raise PolicyConfigError(f"{path} is not readable JSON: {e}") from e
        codec = cls.from_dict(data)
        config = folder / "config.json"
        hidden = None
        if config.is_file():
            try:
                cfg = json.loads(config.read_text(encoding="utf-8"))
                vocab, hidden = cfg.get("vocab_size"), cfg.get("hidden_size")
            except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError):
                vocab = None  # the model loader reports a broken config.json in its own words
            if isinstance(vocab, int) and not isinstance(vocab, bool):
                codec.validate(vocab)
        if codec.state_encoding == "projector":  # the file must exist and fit: checked at load, not at a tick
            StateProjector.load(folder, codec, hidden if isinstance(hidden, int) else None)
        return codec

    def to_dict(self) -> dict[str, Any]:
        """policy.json's object (`from_dict` reads it back)."""
        d = asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return {"format": POLICY_FORMAT, **d}

    def save(self, checkpoint_dir: str | Path) -> Path:
        path = Path(checkpoint_dir) / POLICY_FILE
        path.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return path

    # ---- observations -----------------------------------------------------------------------------------
    @property
    def state_dims(self) -> int:
        return len(self.state_low)

    def state_of(self, obs: Mapping[str, Any]) -> np.ndarray:
        """The state vector [Ds] float64 of an observation dict, raw (PolicyInputError when missing or malformed):
        its state key's, or its state keys' values flattened and concatenated in order."""
        if not isinstance(obs, Mapping):
            raise PolicyInputError(f"an observation must be a dict, got {type(obs).__name__}")
        keys = self.state_keys or (self.state_key,)
        missing = [k for k in keys if k not in obs]
        if missing:
            raise PolicyInputError(f"the observation has no {', '.join(map(repr, missing))} (keys: "
                                   f"{sorted(map(str, obs))})")
        if len(keys) == 1:
            return self._vector(obs[keys[0]], (self.state_dims,), keys[0])
        parts = [self._vector(obs[k], None, k).reshape(-1) for k in keys]
        if sum(p.size for p in parts) != self.state_dims:
            sizes = ", ".join(f"{k!r} {p.size}" for k, p in zip(keys, parts, strict=True))
            raise PolicyInputError(f"the state keys hold {sizes} values: together they must be {self.state_dims}")
        return np.concatenate(parts)

    @functools.cached_property
    def norms(self) -> dict[str, Normalization]:
        """The normalisations of norm_stats ({"state"?, "actions"?}; empty without)."""
        return parse_norm_stats(self.norm_stats, self.state_dims, self.action_dims)

    def normalized_state(self, state: Any) -> np.ndarray:
        """A raw state [Ds] -> in the units of state_low/state_high (norm_stats' "state" applied, if any)."""
        x = self._vector(state, (self.state_dims,), "state")
        norm = self.norms.get("state")
        return x if norm is None else norm.apply(x)

    def prompt_of(self, obs: Mapping[str, Any]) -> str:
        """The instruction of an observation (its prompt key; the codec's default when absent)."""
        prompt = obs.get(self.prompt_key, self.default_prompt) if isinstance(obs, Mapping) else None
        if not isinstance(prompt, str):
            raise PolicyInputError(f"{self.prompt_key!r} must be a string, got {type(prompt).__name__}")
        return prompt

    def state_ids(self, state: Any) -> list[int]:
        """[<obs>, s_1 .. s_Ds, <act>] for a state vector [Ds]; values outside the ranges are clipped."""
        bins = _bin(self.normalized_state(state), self.state_low, self.state_high, self.state_bins)
        return [self.obs_token, *(self.state_token_offset + bins).tolist(), self.act_token]

    def state_parts(self, state: Any, projector: StateProjector | None = None) -> list[list[int] | np.ndarray]:
        """What a tick appends for a state vector [Ds], in order, each part one chunk of kind "state": token ids
        (a list) or embedding vectors (float32 [1, hidden]). "bins": [state_ids]; "projector": [[<obs>], the
        projected state [1, hidden], [<act>]] (`projector` is the checkpoint's, StateProjector.load)."""
        if self.state_encoding == "bins":
            return [self.state_ids(state)]
        if projector is None:
            raise PolicyConfigError("this policy encodes its state with a projector, and none was loaded")
        return [[self.obs_token], projector.embed(self.normalized_state(state)), [self.act_token]]

    def prompt_ids(self, prompt_tokens: Sequence[int]) -> list[int]:
        """[<task>, *prompt_tokens] (the text tokenized by the checkpoint's own tokenizer)."""
        toks = list(prompt_tokens)
        if not all(isinstance(t, (int, np.integer)) and not isinstance(t, bool) and t >= 0 for t in toks):
            raise PolicyInputError("prompt tokens must be non-negative integers")
        return [self.task_token, *(int(t) for t in toks)]

    # ---- actions --------------------------------------------------------------------------------------
    @property
    def action_ids(self) -> list[int]:
        """Every action token id: the allowed set of a reply."""
        return list(range(self.action_token_offset, self.action_token_offset + self.action_bins))

    @property
    def n_action_tokens(self) -> int:
        """H * D: the tokens of one reply."""
        return self.action_horizon * self.action_dims

    def actions(self, ids: Sequence[int]) -> np.ndarray:
        """H*D action ids (step-major) -> the chunk [H, D] float32 of bin centres."""
        arr = np.asarray(list(ids))
        if arr.shape != (self.n_action_tokens,) or not np.issubdtype(arr.dtype, np.integer):
            raise PolicyInputError(f"an action reply must be {self.n_action_tokens} integer ids, got {arr.shape}")
        bins = arr - self.action_token_offset
        if bins.min() < 0 or bins.max() >= self.action_bins:
            raise PolicyInputError("an action reply holds ids outside the action vocabulary")
        low, high = np.asarray(self.action_low), np.asarray(self.action_high)
        width = (high - low) / self.action_bins  # [D]
        centres = low + (bins.reshape(self.action_horizon, self.action_dims) + 0.5) * width
        norm = self.norms.get("actions")
        return (centres if norm is None else norm.invert(centres)).astype(np.float32)

    def draft_ids(self, last: Sequence[int], shift: int) -> list[int]:
        """The last chunk's H*D ids moved `shift` control steps on (the rows executed since dropped, its last row
        held for the steps past its end) -> a draft of the next chunk: a robot's next chunk mostly continues it."""
        d, h = self.action_dims, self.action_horizon
        ids = list(last)
        if len(ids) != h * d:
            raise PolicyInputError(f"a chunk to draft from must be {h * d} ids, got {len(ids)}")
        shift = min(max(0, shift), h)
        return ids[shift * d:] + ids[-d:] * shift

    def action_tokens(self, actions: Any) -> list[int]:
        """A chunk [H, D] -> its H*D ids (step-major); values outside the ranges are clipped."""
        return self._action_ids(self._vector(actions, (self.action_horizon, self.action_dims), "actions"))

    def prefix_ids(self, rows: Any) -> list[int]:
        """Real-time chunking: the actions [k, D] (0 <= k < H) a robot executes from the observation's step on while
        the next chunk is computed -> their k*D ids, forced as that chunk's first rows (only the rest is decoded)."""
        x = self._vector(rows, None, "action_prefix")
        if x.size == 0:
            return []
        if x.ndim != 2 or x.shape[1] != self.action_dims or x.shape[0] >= self.action_horizon:
            raise PolicyInputError(f"action_prefix must have shape [k, {self.action_dims}] with k < "
                                   f"{self.action_horizon} (the chunk's horizon), got {list(x.shape)}")
        return self._action_ids(x)

    def _action_ids(self, x: np.ndarray) -> list[int]:
        norm = self.norms.get("actions")
        bins = _bin(x if norm is None else norm.apply(x), self.action_low, self.action_high, self.action_bins)
        return (self.action_token_offset + bins).reshape(-1).tolist()

    def metadata(self) -> dict[str, Any]:
        """What a client is told about the policy (JSON- and msgpack-able)."""
        return {"state_key": self.state_key, "state_dims": self.state_dims, "state_low": list(self.state_low),
                "state_high": list(self.state_high), "state_bins": self.state_bins,
                "action_dims": self.action_dims, "action_horizon": self.action_horizon,
                "action_low": list(self.action_low), "action_high": list(self.action_high),
                "action_bins": self.action_bins, "prompt_key": self.prompt_key,
                "default_prompt": self.default_prompt, "image_keys": list(self.image_keys),
                "state_encoding": self.state_encoding,
                "control_hz": float(self.control_hz), "window": self.window, "sinks": self.sinks,
                "state_keys": list(self.state_keys or (self.state_key,)), "norm_stats": self.norm_stats}

    # ---- helpers ------------------------------------------------------------------------------------------
    @staticmethod
    def _vector(value: Any, shape: tuple[int, ...] | None, name: str) -> np.ndarray:
        try:
            x = np.asarray(value)
        except (TypeError, ValueError) as e:
            raise PolicyInputError(f"{name} is not an array of numbers: {e}") from e
        if x.dtype == np.bool_ or not (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)):
            raise PolicyInputError(f"{name} must hold numbers, got dtype {x.dtype}")
        if shape is not None and x.shape != shape:
            raise PolicyInputError(f"{name} must have shape {list(shape)}, got {list(x.shape)}")
        x = x.astype(np.float64)
        if not np.isfinite(x).all():
            raise PolicyInputError(f"{name} holds NaN or infinite values")
        return x


def _bin(x: np.ndarray, low: tuple[float, ...], high: tuple[float, ...], bins: int) -> np.ndarray:
    """Values [..., D] -> bin indices [..., D] int64: clipped into [low, high], `bins` uniform bins per dim."""
    lo, hi = np.asarray(low), np.asarray(high)
    frac = (np.clip(x, lo, hi) - lo) / (hi - lo)
    return np.minimum((frac * bins).astype(np.int64), bins - 1)
