"""The page allocator and window policy on their own."""

from __future__ import annotations

import pytest

from streamserve.errors import CapacityError, InvalidInputError
from streamserve.sessions import PageAllocator, WindowPolicy


def test_alloc_release_and_integrity() -> None:
    a = PageAllocator(5)
    x = a.alloc(3)
    assert len(set(x)) == 3 and a.free_count == 2
    a.check([x])
    with pytest.raises(CapacityError):
        a.alloc(3)
    assert a.free_count == 2  # a refused request takes nothing
    a.share(x[:1])
    a.check([x, x[:1]])
    a.release(x)
    assert a.used_count == 1
    a.check([x[:1]])
    a.release(x[:1])
    assert a.free_count == 5
    a.check([])
    with pytest.raises(RuntimeError, match="released twice"):
        a.release(x[:1])


def test_integrity_check_catches_a_leak_and_a_double_hold() -> None:
    a = PageAllocator(4)
    x = a.alloc(2)
    with pytest.raises(AssertionError, match="reference counts"):
        a.check([x[:1]])  # one page held by nobody: a leak
    with pytest.raises(AssertionError, match="reference counts"):
        a.check([x, x[:1]])  # listed twice with one reference


def test_window_policy_validation_and_defaults() -> None:
    assert WindowPolicy().mode == "absolute" and not WindowPolicy().rolling
    assert WindowPolicy(window=64, sinks=4).mode == "rolling"
    assert WindowPolicy(window=64, sinks=4, mode="absolute").mode == "absolute"
    with pytest.raises(InvalidInputError, match="smaller than the sinks"):
        WindowPolicy(window=3, sinks=4)
    with pytest.raises(InvalidInputError):
        WindowPolicy(window=0)
    with pytest.raises(InvalidInputError):
        WindowPolicy(sinks=-1)
    with pytest.raises(InvalidInputError, match="rolling positions need a window"):
        WindowPolicy(mode="rolling")
    with pytest.raises(InvalidInputError):
        WindowPolicy(window=8, mode="sideways")  # type: ignore[arg-type]
