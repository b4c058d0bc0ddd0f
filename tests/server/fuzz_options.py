"""The fuzz tests' budget: CI-sized and derandomized by default (the same inputs every run), or with
`--fuzz-minutes N` a time budget of N minutes per fuzz test, in fresh random batches, for long runs outside CI.
Either way the count of inputs tried is written to the terminal. Registered by tests/server/conftest.py
(`pytest_addoption`); a fuzz test calls `fuzz(...)` from a worker thread (hypothesis is synchronous)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

T = TypeVar("T")
BATCH = 50  # examples per hypothesis run under --fuzz-minutes (each run draws from a fresh random seed)
QUIET = [HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example,
         HealthCheck.filter_too_much]


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--fuzz-minutes", type=float, default=None, metavar="N",
                     help="run each fuzz test for N minutes of random inputs instead of its CI-sized derandomized "
                          "set, and report the count of inputs tried")


def fuzz_minutes(config: pytest.Config) -> float | None:
    # default=None too: under `pytest tests/` this conftest loads after the command line is parsed
    return config.getoption("fuzz_minutes", default=None)


def report(config: pytest.Config, line: str) -> None:
    capture = config.pluginmanager.get_plugin("capturemanager")
    if capture is None:
        print(line)
        return
    with capture.global_and_fixture_disabled():  # shown without -s
        print(line)


def fuzz(config: pytest.Config, name: str, strategy: st.SearchStrategy[T], body: Callable[[T], Any],
         ci_examples: int, pinned: Sequence[T] = ()) -> int:
    """Run `body` on inputs drawn from `strategy`: `ci_examples` derandomized ones, or for --fuzz-minutes N fresh
    random batches until N minutes have passed; the `pinned` inputs (regressions the fuzz found) run first in every
    batch. -> the count of inputs tried (shrinking included), also reported."""
    count = 0

    def once(x: T) -> None:
        nonlocal count
        count += 1
        body(x)

    def test() -> Callable[[], None]:  # a new hypothesis test per run (one takes one settings object)
        def run(x: T) -> None:
            once(x)

        t = given(strategy)(run)
        for x in pinned:
            t = example(x)(t)
        return t

    minutes = fuzz_minutes(config)
    started = time.monotonic()
    if minutes is None:
        settings(max_examples=ci_examples, deadline=None, derandomize=True, database=None,
                 suppress_health_check=QUIET)(test())()
    else:
        while time.monotonic() - started < minutes * 60:
            settings(max_examples=BATCH, deadline=None, database=None,
                     suppress_health_check=QUIET)(test())()
    report(config, f"\nfuzz {name}: {count} inputs in {time.monotonic() - started:.1f} s")
    return count
