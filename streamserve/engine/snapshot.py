"""Session snapshots: everything a session is, on the host or in a file, restorable on the same model.

File format (version 1): `torch.save` of a plain dict of str/int/float/list/tensor (loaded with
`weights_only=True`, so a file can carry no code): format, version, model fingerprint and name, page
size, window policy, token ids, timeline, committed KV length, the held pages' keys/values per layer
`[n, P, KVH, hd]` with their logical page numbers (`logical_pages`: a list of ints for a model with one layer
group, as before groups existed; one such list per group for models that mix native windows, whose layers'
n follow their group), the last logits, the next chunk seq, the page cap, and
the vectors of embedding chunks still kept (`vector_positions` [n] and `vectors` [n, hidden]; absent in
files written before embedding chunks existed, which read as none). An endless session's token ids are the
kept ones only (`token_ids`, in position order) with the forgotten positions `token_gap` [lo, hi) (absent or
None: none forgotten; engine/token_log.py).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from streamserve.engine.token_log import TokenLog
from streamserve.errors import SnapshotError
from streamserve.sessions import HostPages, WindowPolicy

FORMAT = "streamserve.session"
VERSION = 1


@dataclass(frozen=True)
class ChunkRecord:
    """One entry of a session's timeline: an appended chunk (with its seq) or a generated reply."""

    kind: str  # "input" or "reply"
    seq: int | None
    start: int  # token range [start, end) in the session
    end: int
    capture_time: float | None = None
    deadline: float | None = None


@dataclass
class Snapshot:
    model: str  # fingerprint of the model it was taken on
    model_name: str
    page_size: int
    policy: WindowPolicy
    token_ids: TokenLog  # by absolute position; an endless session's forgotten positions are not in the file
    timeline: list[ChunkRecord]
    kv_length: int
    pages: HostPages
    logits: torch.Tensor | None  # [V] after the first `logits_at` tokens
    logits_at: int
    next_seq: int
    page_cap: int | None = None
    vector_positions: list[int] = field(default_factory=list)  # positions whose input was a vector
    vectors: torch.Tensor | None = None  # [len(vector_positions), hidden] on the host

    def __post_init__(self) -> None:
        if not isinstance(self.token_ids, TokenLog):  # a list of ids: nothing forgotten
            self.token_ids = TokenLog(self.token_ids)

    @property
    def nbytes(self) -> int:
        return self.pages.nbytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT, "version": VERSION, "model": self.model, "model_name": self.model_name,
            "page_size": self.page_size,
            "policy": {"window": self.policy.window, "sinks": self.policy.sinks, "mode": self.policy.mode},
            "token_ids": self.token_ids.kept(),
            "token_gap": None if self.token_ids.gap is None else list(self.token_ids.gap),
            "timeline": [asdict(r) for r in self.timeline],
            "kv_length": self.kv_length,
            "logical_pages": list(self.pages.logical[0]) if len(self.pages.logical) == 1
            else [list(g) for g in self.pages.logical],
            "k": list(self.pages.k), "v": list(self.pages.v),
            "logits": self.logits, "logits_at": self.logits_at, "next_seq": self.next_seq, "page_cap": self.page_cap,
            "vector_positions": list(self.vector_positions), "vectors": self.vectors,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Snapshot:
        if not isinstance(d, dict) or d.get("format") != FORMAT:
            raise SnapshotError("not a streamserve session snapshot")
        if d.get("version") != VERSION:
            raise SnapshotError(f"snapshot format version {d.get('version')} is not supported (this build reads "
                                f"version {VERSION})")
        try:
            return cls(model=d["model"], model_name=d["model_name"], page_size=int(d["page_size"]),
                       policy=WindowPolicy(**d["policy"]),
                       token_ids=TokenLog([int(i) for i in d["token_ids"]], _read_gap(d.get("token_gap"))),
                       timeline=[ChunkRecord(**r) for r in d["timeline"]], kv_length=int(d["kv_length"]),
                       pages=HostPages(_groups(d["logical_pages"]), list(d["k"]), list(d["v"])),
                       logits=d["logits"], logits_at=int(d["logits_at"]), next_seq=int(d["next_seq"]),
                       page_cap=d.get("page_cap"),
                       vector_positions=[int(p) for p in d.get("vector_positions", [])], vectors=d.get("vectors"))
        except (KeyError, TypeError, ValueError) as e:  # (a bad token_gap: InvalidInputError, a ValueError)
            raise SnapshotError(f"damaged snapshot: {e}") from None

    def save(self, path: str | Path) -> Path:
        path = Path(path)
        tmp = path.with_suffix(path.suffix + ".tmp")
        try:
            torch.save(self.to_dict(), tmp)
            tmp.replace(path)  # never a half-written snapshot under the real name
        except OSError as e:  # a full disk, a read-only folder...: typed, and nothing half-written left behind
            tmp.unlink(missing_ok=True)
            raise SnapshotError(f"cannot write snapshot {path}: {e.strerror or e}; free space or choose another "
                                "folder (the session is unchanged)") from None
        return path

    @classmethod
    def load(cls, path: str | Path) -> Snapshot:
        try:
            data = torch.load(Path(path), map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise SnapshotError(f"snapshot file {path} not found") from None
        except Exception as e:  # a truncated or foreign file: say so, whatever torch raised
            raise SnapshotError(f"cannot read snapshot {path}: {e}") from None
        return cls.from_dict(data)


def _groups(logical: list) -> list[list[int]]:
    """`logical_pages` of a file -> per layer group the logical page numbers (one group: a flat list)."""
    if logical and all(isinstance(g, list) for g in logical):
        return [[int(j) for j in g] for g in logical]
    return [[int(j) for j in logical]]


def _read_gap(gap: object) -> tuple[int, int] | None:
    """A file's `token_gap` -> the forgotten positions [lo, hi) (None: none)."""
    if gap is None:
        return None
    if not isinstance(gap, (list, tuple)) or len(gap) != 2:
        raise ValueError(f"token_gap must be [lo, hi], got {gap!r}")
    return int(gap[0]), int(gap[1])


def snapshot_vectors(snap: Snapshot, hidden: int, device: torch.device, dtype: torch.dtype) -> dict[int, torch.Tensor]:
    """The snapshot's embedding vectors by position, as rows [hidden] on `device` (SnapshotError when they do not
    fit a session of its tokens)."""
    pos, vec = snap.vector_positions, snap.vectors
    if not pos:
        return {}
    if (not isinstance(vec, torch.Tensor) or not vec.is_floating_point() or tuple(vec.shape) != (len(pos), hidden)
            or len(set(pos)) != len(pos) or not all(0 <= p < len(snap.token_ids) for p in pos)):
        raise SnapshotError(f"damaged snapshot: vectors for positions {pos[:4]}... do not fit "
                            f"[{len(pos)}, {hidden}] in a session of {len(snap.token_ids)} tokens")
    rows = vec.to(device=device, dtype=dtype, copy=True)  # never the caller's tensor
    if not bool(torch.isfinite(rows).all()):
        raise SnapshotError("damaged snapshot: its vectors hold NaN or infinite values")
    return {p: rows[i] for i, p in enumerate(pos)}
