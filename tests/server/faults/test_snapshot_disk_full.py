"""Fault injection: the disk fills up while a session snapshot is written (`Session.snapshot(path)`).

The write is made to fail with ENOSPC halfway through (torch.save writes half the file, then raises as a full disk
makes it). What must hold: the file under the snapshot's name is never a half-written one (an earlier snapshot
there still restores, and nothing new appears), the session goes on exactly as before, no KV page is lost; and
the caller gets a typed error (SnapshotError) with nothing left behind."""

from __future__ import annotations

import errno
import io
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import greedy, make_checkpoint, random_ids

import streamserve.engine.snapshot as snapshot_module
from streamserve.errors import SnapshotError, StreamserveError

IDS = random_ids(24, seed=1700)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from streamserve import Engine

    folder = tmp_path_factory.mktemp("snapshot-disk-full")
    make_checkpoint(folder, "qwen3")
    return Engine.from_pretrained(folder, device="cpu", kv_memory="16MiB")


def disk_full(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """From now on torch.save writes half of what it would, then fails as a full disk does; -> the files it
    wrote to."""
    real = torch.save
    written: list[Path] = []

    def save(obj: Any, f: Any, *args: Any, **kw: Any) -> None:
        buf = io.BytesIO()
        real(obj, buf, *args, **kw)
        Path(f).write_bytes(buf.getvalue()[: buf.tell() // 2])
        written.append(Path(f))
        raise OSError(errno.ENOSPC, "No space left on device", str(f))

    monkeypatch.setattr(snapshot_module.torch, "save", save)
    return written


def test_a_full_disk_never_leaves_a_half_snapshot_under_its_name_and_the_session_goes_on(
        engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    expected = greedy(engine, [*IDS, 7, 8, 9], 6)
    s = engine.open_session()
    s.append(token_ids=IDS)
    earlier = s.snapshot(tmp_path / "session.pt")  # a good snapshot of the session as it was
    s.append(token_ids=[7, 8, 9])
    pages = engine.stats()["kv_pages_used"]
    written = disk_full(monkeypatch)
    with pytest.raises(SnapshotError):
        s.snapshot(tmp_path / "session.pt")
    assert written and written[0] != earlier  # it wrote beside the earlier snapshot, not over it
    with pytest.raises(SnapshotError):
        s.snapshot(tmp_path / "fresh.pt")
    assert not (tmp_path / "fresh.pt").exists()  # no half file under a name a restore would be pointed at
    monkeypatch.undo()
    assert engine.stats()["kv_pages_used"] == pages
    back = engine.restore(earlier)  # the earlier snapshot is whole: it restores and continues as it should
    assert back.generate(max_tokens=4, stop_token_ids=()) == greedy(engine, IDS, 4)
    back.close()
    assert s.generate(max_tokens=6, stop_token_ids=()) == expected  # the session itself never noticed
    s.close()
    assert engine.stats()["kv_pages_used"] == 0
    engine.check_integrity()


def test_a_full_disk_is_a_typed_error_and_leaves_no_file(engine: Any, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    with engine.open_session() as s:
        s.append(token_ids=IDS)
        disk_full(monkeypatch)
        with pytest.raises(StreamserveError):
            s.snapshot(tmp_path / "session.pt")
        monkeypatch.undo()
        assert list(tmp_path.iterdir()) == []
