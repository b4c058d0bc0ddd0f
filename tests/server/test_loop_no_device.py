"""The event loop of `streamserve serve` never calls into torch (issue 16): all model work runs on the engine thread,
and the loop only hands work over and takes results back. On CUDA any tensor op, `.item()`, `.tolist()`, `.cpu()` or
`torch.cuda.*` on the loop would block every connection on the device; this test proves the rule on a CPU.

While real traffic runs (native protocol through the Python SDK; /v1/realtime through the `openai` SDK, text only),
two watchers sit on the loop's thread only, both thread-local by construction:
- a `sys.setprofile` function: every 'c_call' of a callable that belongs to torch (its module, or the object it is
  bound to, is torch's) and every Python 'call' into a file under torch's package directory;
- a `TorchDispatchMode`: every aten op dispatched on the thread, which also catches what the profiler cannot see
  (operators and slots such as `a + b`, `t[0]`, `int(t)`, which run no CALL instruction).
Each finding names the first frame outside torch that made it (file:line), so a failure points at the culprit.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import threading
from collections.abc import Iterator
from types import FrameType, ModuleType
from typing import Any, NamedTuple

import pytest
import torch
from openai import AsyncOpenAI
from serving import RunningServer
from torch.utils._python_dispatch import TorchDispatchMode

import streamserve_client as sc

pytestmark = pytest.mark.asyncio(loop_scope="module")  # the module's server runs in the test's own event loop

TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
class Call(NamedTuple):
    what: str  # "c_call Tensor.item", "aten op aten.add.Tensor", "call is_available (.../torch/cuda/...)"
    site: str  # file:line of the first frame outside torch that made the call
    function: str  # that frame's function (qualified name)
    devices: frozenset[str] = frozenset()  # an aten op's tensors' device types (in and out)

    def __str__(self) -> str:
        return f"{self.what} at {self.site} in {self.function}" + (f" on {sorted(self.devices)}" if self.devices
                                                                     else "")


def _site(frame: FrameType | None) -> tuple[str, str]:
    """(file:line, function) of the first frame at or above `frame` that is not torch's own code."""
    while frame is not None and frame.f_code.co_filename.startswith(TORCH_DIR):
        frame = frame.f_back
    return ("?", "?") if frame is None else (f"{frame.f_code.co_filename}:{frame.f_lineno}", frame.f_code.co_qualname)


def _is_torch_callable(fn: Any) -> bool:
    """A C callable of torch: `torch.zeros` (module torch), `t.item` (bound to a Tensor), `torch._C._cuda_*`."""
    owner = getattr(fn, "__self__", None)
    owner_module = owner.__name__ if isinstance(owner, ModuleType) else type(owner).__module__
    return (getattr(fn, "__module__", None) or "").startswith("torch") or (owner_module or "").startswith("torch")


HANDLER = (__file__, "LoopTorchWatch.__torch_dispatch__")


class LoopTorchWatch(TorchDispatchMode):
    """Records every call into torch on the thread that enters it (the mode's stack and the profiler are per
    thread: the engine thread and worker threads go unseen)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[Call] = []
        self.thread = threading.get_ident()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        tensors = [t for t in (*args, *(kwargs or {}).values(), *(out if isinstance(out, tuple) else (out,)))
                   if isinstance(t, torch.Tensor)]
        self.calls.append(Call(f"aten op {func}", *_site(sys._getframe(1)), frozenset(t.device.type for t in tensors)))
        return out

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        caller = frame if event == "c_call" else frame.f_back
        if caller is None or (caller.f_code.co_filename, caller.f_code.co_qualname) == HANDLER:
            return  # the dispatch mode running and describing the op it records
        if event == "c_call" and not frame.f_code.co_filename.startswith(TORCH_DIR) and _is_torch_callable(arg):
            self.calls.append(Call(f"c_call {getattr(arg, '__qualname__', arg)}", *_site(frame)))
        elif event == "call" and frame.f_code.co_filename.startswith(TORCH_DIR) and \
                not caller.f_code.co_filename.startswith(TORCH_DIR):  # the entry into torch, not torch's own calls
            self.calls.append(Call(f"call {frame.f_code.co_qualname} ({frame.f_code.co_filename})", *_site(caller)))


@contextlib.contextmanager
def torch_calls_on_this_thread() -> Iterator[LoopTorchWatch]:
    """Watch the current thread (here: the event loop's, since the test coroutine runs on it) for calls into torch;
    the profiler is set after the mode is entered and removed before it exits, so neither records the other."""
    watch, previous = LoopTorchWatch(), sys.getprofile()
    with watch:
        sys.setprofile(watch.profile)
        try:
            yield watch
        finally:
            sys.setprofile(previous)


async def native_traffic(srv: RunningServer) -> None:
    """Open, append text chunks, a streamed reply, a cancelled reply, close: the native protocol end to end."""
    async with sc.connect(srv.url) as client:
        s = await client.open_session()
        for text in ("In the beginning God created", " the heaven and the earth.", " And the earth was"):
            ack = await s.append(text=text)
            assert ack.tokens > 0
        r = s.respond(max_tokens=12, temperature=0.0)
        assert "".join([d.text async for d in r]) and r.finish_reason == "length"
        await s.append(text=" And God said")
        r = s.respond(max_tokens=1000, temperature=0.8, seed=3)
        async for _ in r:  # the first delta: the reply is running in the engine
            await s.cancel()
            break
        async for _ in r:  # what was already on its way
            pass
        assert r.finish_reason == "cancelled"
        await s.close()


async def realtime_traffic(srv: RunningServer) -> None:
    """A text turn to its end, then a turn cancelled after its first delta, through the official `openai` SDK."""
    client = AsyncOpenAI(api_key="unused", base_url=f"{srv.http}/v1")
    async with client.realtime.connect(model="default") as conn:
        assert (await conn.recv()).type == "session.created"
        await conn.session.update(session={"type": "realtime", "output_modalities": ["text"]})
        for cancel in (False, True):
            await conn.conversation.item.create(item={"type": "message", "role": "user",
                                                      "content": [{"type": "input_text", "text": "The LORD is"}]})
            await conn.response.create(response={"max_output_tokens": 400 if cancel else 12})
            sent_cancel = False
            async for ev in conn:
                assert ev.type != "error", ev
                if ev.type == "response.output_text.delta" and cancel and not sent_cancel:
                    await conn.response.cancel()
                    sent_cancel = True
                elif ev.type == "response.done":
                    assert ev.response.status in (("cancelled",) if cancel else ("completed", "incomplete")), ev
                    break
            assert sent_cancel == cancel


async def test_the_event_loop_never_calls_into_torch(served: RunningServer) -> None:
    with torch_calls_on_this_thread() as watch:
        await asyncio.wait_for(native_traffic(served), 120)
        await asyncio.wait_for(realtime_traffic(served), 120)
        assert sys.getprofile() == watch.profile  # nothing replaced the watch meanwhile
    engine_thread = served.engine.loop.thread
    assert engine_thread is not None and engine_thread.ident != watch.thread  # the model work ran off this thread
    assert watch.calls == [], "torch on the event loop's thread:\n" + "\n".join(dict.fromkeys(map(str, watch.calls)))


async def test_the_watch_sees_torch_called_on_the_loop() -> None:
    """The control: the same watch records an `.item()` run by the loop, by each of its two means, naming the line
    (a loop callback, as a server's result handler is), and nothing a worker thread (as the engine's) does."""
    def on_loop() -> None:
        torch.zeros(1).item()  # a factory op and a host sync: what must never run on the loop

    with torch_calls_on_this_thread() as watch:
        await asyncio.to_thread(on_loop)  # another thread: unseen
        assert watch.calls == []
        asyncio.get_running_loop().call_soon(on_loop)
        await asyncio.sleep(0)
    seen = {c.what for c in watch.calls}
    assert {"c_call _VariableFunctionsClass.zeros", "c_call Tensor.item", "aten op aten.zeros.default",
            "aten op aten._local_scalar_dense.default"} <= seen, seen
    assert {(c.site, c.function) for c in watch.calls} == {(f"{__file__}:{on_loop.__code__.co_firstlineno + 1}",
                                                            on_loop.__code__.co_qualname)}  # the culprit, named
