"""The Responses API: `POST /v1/responses` (streamed as the SDK's events, or not; `background`), `GET` and
`DELETE /v1/responses/{id}`, `POST /v1/responses/{id}/cancel`, `GET /v1/responses/{id}/input_items`.

`previous_response_id` continues the session that ended that response (turns.py: continue, fork, restore or
prefill); `conversation` runs the turn on the conversation's session and adds its input and output to its items.
`instructions` are a system message before the turn's input, appended when they differ from those in effect (the
state is the session: earlier instructions stay in it, unlike OpenAI's, which replaces them each turn).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

from aiohttp import web

from streamserve.engine.chat import Message
from streamserve.server.adapters.openai_http.errors import ApiError, bad, from_exception, not_found, read_json
from streamserve.server.adapters.openai_http.host import Api
from streamserve.server.adapters.openai_http.items import (
    item_message,
    listing,
    message_item,
    metadata,
    new_id,
    parse_input,
)
from streamserve.server.adapters.openai_http.params import sampling
from streamserve.server.adapters.openai_http.sse import EventStream
from streamserve.server.adapters.openai_http.store import StoredConversation, StoredResponse
from streamserve.server.adapters.openai_http.turns import TurnResult

FIELDS = {"model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "store", "metadata",
          "previous_response_id", "conversation", "stream", "background", "text", "truncation", "user", "tools",
          "tool_choice", "parallel_tool_calls", "reasoning", "include", "service_tier", "prompt_cache_key",
          "safety_identifier", "stream_options", "top_logprobs", "max_tool_calls"}
INCOMPLETE = {"length": "max_output_tokens", "context": "max_output_tokens"}


class Responses:
    def __init__(self, api: Api) -> None:
        self.api = api
        self.tasks: dict[str, asyncio.Task] = {}  # background responses running, by id

    def table(self) -> list[tuple[str, str, Any]]:
        return [("POST", "/v1/responses", self.create), ("GET", "/v1/responses/{id}", self.retrieve),
                ("DELETE", "/v1/responses/{id}", self.delete), ("POST", "/v1/responses/{id}/cancel", self.cancel),
                ("GET", "/v1/responses/{id}/input_items", self.input_items)]

    # ---- create ----------------------------------------------------------------------------------------------
    async def create(self, request: web.Request) -> web.StreamResponse:
        api, owner_key = self.api, self.api.host.owner(request)
        body = await read_json(request)
        api.host.service()  # 503 while loading, before any state is looked at
        if unknown := sorted(set(body) - FIELDS):
            raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
        api.host.check_model(body.get("model"))
        if body.get("tools"):
            raise bad("Tools are not supported by this server.", "tools", "unsupported_parameter")
        if "input" not in body:
            raise bad("Missing required parameter: 'input'.", "input", "missing_required_parameter")
        items, messages = parse_input(body["input"])
        params = sampling(body, ("max_output_tokens",))
        api.host.service().check_sampling(dict(params))  # refused now, not as a failed stream
        instructions = body.get("instructions")
        if instructions is not None and not isinstance(instructions, str):
            raise bad("'instructions' must be a string.", "instructions", "invalid_type")
        store, background, stream = (flag(body, k, d) for k, d in (("store", True), ("background", False),
                                                                  ("stream", False)))
        if background and not store:
            raise bad("A background response must be stored: set 'store' to true.", "background")
        prev, conv = self.bases(owner_key, body)
        history = prev.history if prev is not None else [item_message(i) for i in conv.items] if conv else []
        in_effect = prev.instructions if prev is not None else conv.instructions if conv is not None else None
        new: list[Message] = ([{"role": "system", "content": instructions}]
                              if instructions and instructions != in_effect else []) + messages
        rid = new_id("resp")
        resp = StoredResponse(rid, owner_key, int(time.time()), {}, items, [*history, *new],  # until it ends
                              instructions or in_effect, in_progress=True)
        resp.body = self.body(resp, body, params, store, background, prev, conv)
        if store:
            api.store.put(resp)
        if conv is not None:
            conv.in_progress = True
        turn = self.turn(resp, history, new, params, prev, conv, store)
        if stream:
            return await self.streamed(request, resp, turn)
        if background:
            task = asyncio.create_task(self.finish(resp, turn, conv, None))
            self.tasks[rid] = task
            task.add_done_callback(lambda _: self.tasks.pop(rid, None))
            return web.json_response(resp.body)
        try:
            await self.finish(resp, turn, conv, None)
        except BaseException:  # refused (oversized input...) or the client went: nothing of it is kept
            self.api.store.drop(resp.id)
            raise
        return web.json_response(resp.body)

    def bases(self, owner_key: str, body: dict[str, Any]) -> tuple[StoredResponse | None, StoredConversation | None]:
        prev_id, conv_ref = body.get("previous_response_id"), body.get("conversation")
        if prev_id is not None and conv_ref is not None:
            raise bad("Give 'previous_response_id' or 'conversation', not both.", "conversation", "invalid_value")
        prev = conv = None
        if prev_id is not None:
            found = self.api.store.get(owner_key, prev_id) if isinstance(prev_id, str) else None
            if not isinstance(found, StoredResponse):
                raise not_found("response", str(prev_id), "previous_response_id")
            if found.in_progress:
                raise bad(f"Response '{prev_id}' is still in progress.", "previous_response_id", "response_in_progress")
            prev = found
        if conv_ref is not None:
            conv_id = conv_ref.get("id") if isinstance(conv_ref, dict) else conv_ref
            found = self.api.store.get(owner_key, conv_id) if isinstance(conv_id, str) else None
            if not isinstance(found, StoredConversation):
                raise not_found("conversation", str(conv_id), "conversation")
            if found.in_progress:
                raise ApiError(409, f"Conversation '{conv_id}' has a response in progress.", "conversation_locked",
                               "conversation")
            conv = found
        return prev, conv

    def body(self, resp: StoredResponse, req: dict[str, Any], params: dict[str, Any], store: bool, background: bool,
             prev: StoredResponse | None, conv: StoredConversation | None) -> dict[str, Any]:
        return {"id": resp.id, "object": "response", "created_at": resp.created_at,
                "status": "queued" if background else "in_progress", "background": background, "error": None,
                "incomplete_details": None, "instructions": req.get("instructions"),
                "max_output_tokens": req.get("max_output_tokens"), "max_tool_calls": None,
                "model": self.api.host.model_name(), "output": [], "parallel_tool_calls": True,
                "previous_response_id": None if prev is None else prev.id,
                "conversation": None if conv is None else {"id": conv.id}, "reasoning": {"effort": None,
                                                                                          "summary": None},
                "store": store, "temperature": params["temperature"], "text": {"format": {"type": "text"}},
                "tool_choice": "auto", "tools": [], "top_p": params["top_p"], "truncation": "disabled",
                "usage": None, "user": None, "metadata": metadata(req.get("metadata"))}

    def turn(self, resp: StoredResponse, history: list[Message], new: list[Message], params: dict[str, Any],
             prev: StoredResponse | None, conv: StoredConversation | None, store: bool) -> Any:
        """The turn, to be run with `on_text` (the text as it comes)."""
        base = prev if prev is not None else conv

        async def run(on_text: Any) -> TurnResult:
            result = await self.api.turns.run(resp.owner, history, new, params, on_text,
                                              prefer=None if base is None else base.session_id or "",
                                              resume=None if base is None else base.resume, rewind=conv is not None)
            if prev is not None:  # its state is in this session's head now (a parked record is used up)
                prev.resume, prev.session_id = None, result.session.id
            return result
        return run

    async def finish(self, resp: StoredResponse, turn: Any, conv: StoredConversation | None,
                     events: EventStream | None) -> None:
        """Run the turn; the response's body (and the conversation's items) as it ends."""
        item_id = new_id("msg")
        resp.body["status"] = "in_progress"

        async def on_text(text: str) -> None:
            if events is not None:
                await events.event("response.output_text.delta", item_id=item_id, output_index=0, content_index=0,
                                   delta=text, logprobs=[])
        try:
            result = await turn(on_text)
        except BaseException as e:
            err = from_exception(e) if isinstance(e, Exception) else None
            self.ended(resp, conv, "failed" if err is not None else "cancelled", None, item_id, "")
            if err is not None:
                resp.body["error"] = {"code": err.code or "server_error", "message": err.message}
            if not isinstance(e, Exception) or (events is None and not resp.body["background"]):
                raise
            return
        status = "completed" if result.finish_reason == "stop" else \
            "cancelled" if result.finish_reason == "cancelled" else \
            "incomplete" if result.finish_reason in INCOMPLETE else "failed"
        self.ended(resp, conv, status, result, item_id, result.text)

    def ended(self, resp: StoredResponse, conv: StoredConversation | None, status: str, result: TurnResult | None,
              item_id: str, text: str) -> None:
        item = message_item("assistant", text, "output_text", item_id,
                            "completed" if status == "completed" else "incomplete")
        b = resp.body
        b["status"], b["output"] = status, [item]
        if status == "incomplete":
            b["incomplete_details"] = {"reason": "max_output_tokens"}
        resp.in_progress = False
        if result is not None:
            b["usage"] = {"input_tokens": result.input_tokens,
                          "input_tokens_details": {"cached_tokens": result.cached_tokens},
                          "output_tokens": result.output_tokens, "output_tokens_details": {"reasoning_tokens": 0},
                          "total_tokens": result.input_tokens + result.output_tokens}
            resp.history, resp.session_id = result.history, result.session.id
            result.session.holder = conv.id if conv is not None else resp.id if b["store"] else None
        if conv is not None:
            conv.in_progress = False
            if result is not None:
                if resp.instructions and resp.instructions != conv.instructions:  # appended before the input
                    conv.items.append(message_item("system", resp.instructions))
                    conv.instructions = resp.instructions
                conv.items += [*resp.input_items, item]
                conv.session_id, conv.resume = result.session.id, None
                self.api.store.put(conv)
        if b["store"]:
            self.api.store.put(resp)  # charged its history now

    async def streamed(self, request: web.Request, resp: StoredResponse, turn: Any) -> web.StreamResponse:
        events = EventStream(request)
        conv_id = (resp.body.get("conversation") or {}).get("id")
        found = self.api.store.get(resp.owner, conv_id) if conv_id else None
        conv = found if isinstance(found, StoredConversation) else None
        item_id = new_id("msg")
        try:
            await events.start()
            await events.event("response.created", response=dict(resp.body))
            resp.body["status"] = "in_progress"
            await events.event("response.in_progress", response=dict(resp.body))
            await events.event("response.output_item.added", output_index=0, item=message_item(
                "assistant", "", "output_text", item_id, "in_progress") | {"content": []})
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            await events.event("response.content_part.added", item_id=item_id, output_index=0, content_index=0,
                               part=part)
        except BaseException:  # the client went away before the turn began: the response ends, cancelled
            self.ended(resp, conv, "cancelled", None, item_id, "")
            raise
        await self.finish(resp, turn, conv, events)
        with contextlib.suppress(ConnectionError):  # the client went away: the response is stored as it ended
            await self.closing(events, resp, item_id)
        return events.response

    async def closing(self, events: EventStream, resp: StoredResponse, item_id: str) -> None:
        out = resp.body["output"][0] | {"id": item_id}
        resp.body["output"] = [out]
        text = out["content"][0]["text"]
        await events.event("response.output_text.done", item_id=item_id, output_index=0, content_index=0, text=text,
                           logprobs=[])
        await events.event("response.content_part.done", item_id=item_id, output_index=0, content_index=0,
                           part=out["content"][0])
        await events.event("response.output_item.done", output_index=0, item=out)
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(resp.body["status"],
                                                                                           "response.failed")
        await events.event(kind, response=resp.body)
        await events.end()

    # ---- stored responses --------------------------------------------------------------------------------------
    def stored(self, request: web.Request) -> StoredResponse:
        owner_key = self.api.host.owner(request)
        rid = request.match_info["id"]
        found = self.api.store.get(owner_key, rid)
        if not isinstance(found, StoredResponse):
            raise not_found("response", rid)
        return found

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response(self.stored(request).body)

    async def delete(self, request: web.Request) -> web.Response:
        resp = self.stored(request)
        if resp.in_progress:
            raise bad(f"Response '{resp.id}' is in progress: cancel it first.", "response_id", "response_in_progress")
        self.api.store.drop(resp.id, forget_file=True)
        return web.json_response({"id": resp.id, "object": "response", "deleted": True})

    async def cancel(self, request: web.Request) -> web.Response:
        """A background response's turn is cancelled (its session closes: the response's history is its input);
        one that ended is answered as it is."""
        resp = self.stored(request)
        if not resp.body.get("background"):
            raise bad("Only a background response can be cancelled.", "response_id", "invalid_value")
        task = self.tasks.get(resp.id)
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        return web.json_response(resp.body)

    async def input_items(self, request: web.Request) -> web.Response:
        return web.json_response(listing(self.stored(request).input_items, request.query))


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise bad(f"'{key}' must be a boolean.", key, "invalid_type")
    return v
