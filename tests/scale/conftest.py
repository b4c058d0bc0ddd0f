"""Fixtures of the scale-out tests: two instances and nginx in front of them, shared by a module's tests."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from scale_support import NGINX, Instance, Nginx, instances, start_nginx


@pytest.fixture(scope="module")
def pair() -> Iterator[list[Instance]]:
    """Two `streamserve serve` instances (their hellos say max_reply_tokens 1000 and 1001)."""
    if NGINX is None:  # the nginx tests skip before paying for two model loads
        pytest.skip("needs Debian's nginx: apt-get install nginx-light")
    with instances(2) as started:
        yield started


@pytest.fixture(scope="module")
def proxy(pair: list[Instance], tmp_path_factory: pytest.TempPathFactory) -> Iterator[Nginx]:
    """nginx (a `proxy-config --standalone` configuration) in front of `pair`."""
    nginx = start_nginx(Path(tmp_path_factory.mktemp("nginx")), tuple(i.address for i in pair))
    try:
        yield nginx
    finally:
        nginx.stop()
