"""One connection's standing with the session service (split from service.py, which uses it).

Per connection: the sessions it holds (the registry), the KV pages their page caps reserve (`max_pages_per_connection`),
the tokens it submitted that are not acked yet (`max_queued_tokens_per_connection`), its reply-forwarding tasks, its
authorization (`Grant`), and the client address it connects from (server/transports/clients.py; the registry counts
sessions per address with it).
"""

from __future__ import annotations

import asyncio
import math
from typing import Any

from streamserve.server.service.auth import Grant
from streamserve.server.service.results import ResultListener

MAX_PENDING_ACKS = 256  # appends in flight per connection; past it the adapter's read loop waits (backpressure)


class ClientContext:
    """One connection's standing with the service."""

    def __init__(self, listener: ResultListener, grant: Grant, address: str | None = None) -> None:
        self.listener, self.grant = listener, grant
        self.address = address  # None: an in-process caller, not counted per address
        self.tasks: set[asyncio.Task] = set()  # reply forwarders: cancelled when the connection ends
        self.pending_acks = asyncio.Semaphore(MAX_PENDING_ACKS)
        self.queued_tokens = 0  # submitted, not acked yet, over all its sessions
        self.opening_pages = 0  # reserved by opens still in flight
        self.gone = False  # the connection ended (service.disconnect)

    def spawn(self, coro: Any) -> None:
        task = asyncio.create_task(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)


def page_reservation(page_size: int, context: int, step_tokens: int, window: int | None, sinks: int,
                     page_cap: int | None) -> int:
    """The most KV pages a session can ever hold. With a window: the sinks' pages, plus the window and one step's
    tokens (the pages outside the window go back only after the step), plus one for page alignment. Without: the
    model's context. The session's own page_cap lowers either."""
    if window is not None:
        pages = math.ceil(sinks / page_size) + math.ceil((window + step_tokens) / page_size) + 1
    else:
        pages = math.ceil(context / page_size)
    return pages if page_cap is None else min(pages, page_cap)
