"""`POST /v1/chat/completions`, streamed (`stream_options.include_usage`) or not, with session reuse.

Every request carries the whole conversation; the turn (turns.py `reuse`) runs on the owner's idle session whose
transcript is the longest prefix of the request's messages and whose tokens are a prefix of the request's rendered
token ids, so only the new messages are computed; `usage.prompt_tokens_details.cached_tokens` is what was not.
`n` must be 1; `logprobs`, tools, `response_format` other than text and non-zero penalties are refused (400).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from streamserve.engine.chat import Message
from streamserve.server.adapters.openai_http.errors import bad, from_exception, read_json
from streamserve.server.adapters.openai_http.host import Api
from streamserve.server.adapters.openai_http.items import content_text, new_id
from streamserve.server.adapters.openai_http.params import integer, number, sampling
from streamserve.server.adapters.openai_http.sse import EventStream
from streamserve.server.adapters.openai_http.turns import TurnResult

ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
FINISH = {"stop": "stop", "length": "length", "context": "length", "cancelled": "stop"}
IGNORED = {"model", "messages", "stream", "stream_options", "n", "stop", "max_tokens", "max_completion_tokens",
           "temperature", "top_p", "seed", "logprobs", "top_logprobs", "user", "presence_penalty",
           "frequency_penalty", "response_format", "store", "metadata", "service_tier", "parallel_tool_calls",
           "tools", "tool_choice", "logit_bias", "modalities", "reasoning_effort", "prompt_cache_key",
           "safety_identifier", "verbosity"}


def parse_messages(value: Any) -> list[Message]:
    if not isinstance(value, list) or not value:
        raise bad("'messages' must be a non-empty list.", "messages", "invalid_type")
    out: list[Message] = []
    for i, m in enumerate(value):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise bad(f"'{at}' must be an object.", at, "invalid_type")
        if m.get("role") not in ROLES:
            raise bad(f"'{at}.role' must be one of {sorted(ROLES)}; tool messages are not supported.",
                      f"{at}.role")
        if m.get("tool_calls"):
            raise bad("Tool calls are not supported by this server.", f"{at}.tool_calls", "unsupported_value")
        content = m.get("content")
        if content is None and m["role"] == "assistant":
            content = ""
        out.append({"role": ROLES[m["role"]], "content": content_text(content, f"{at}.content")})
    return out


def request_sampling(body: dict[str, Any]) -> dict[str, Any]:
    if unknown := sorted(set(body) - IGNORED):
        raise bad(f"Unrecognized request argument supplied: {unknown[0]}", unknown[0], "unknown_parameter")
    if integer(body, "n", 1) not in (None, 1):
        raise bad("'n' must be 1 on this server.", "n", "unsupported_value")
    if body.get("logprobs"):
        raise bad("'logprobs' is not supported by this server.", "logprobs", "unsupported_parameter")
    if body.get("tools"):
        raise bad("Tools are not supported by this server.", "tools", "unsupported_parameter")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise bad("Only response_format {'type': 'text'} is supported by this server.", "response_format",
                  "unsupported_value")
    for key in ("presence_penalty", "frequency_penalty"):
        if number(body, key, -2.0, 2.0) not in (None, 0.0):
            raise bad(f"'{key}' is not supported by this server (0 only).", key, "unsupported_value")
    params = sampling(body, ("max_completion_tokens", "max_tokens"))
    seed = body.get("seed")
    if seed is not None:
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise bad("'seed' must be a non-negative integer.", "seed")
        params["seed"] = seed
    if body.get("stop") is not None:
        params["stop"] = body["stop"]
    return params


class ChatCompletions:
    def __init__(self, api: Api) -> None:
        self.api = api

    def table(self) -> list[tuple[str, str, Any]]:
        return [("POST", "/v1/chat/completions", self.create)]

    async def create(self, request: web.Request) -> web.StreamResponse:
        api, owner_key = self.api, self.api.host.owner(request)
        body = await read_json(request)
        api.host.service()
        api.host.check_model(body.get("model"))
        if "messages" not in body:
            raise bad("Missing required parameter: 'messages'.", "messages", "missing_required_parameter")
        messages, params = parse_messages(body["messages"]), request_sampling(body)
        options = body.get("stream_options") or {}
        if not isinstance(options, dict):
            raise bad("'stream_options' must be an object.", "stream_options", "invalid_type")
        cid, created, model = new_id("chatcmpl"), int(time.time()), api.host.model_name()
        api.host.service().check_sampling(dict(params))  # refused before anything is taken or sent
        if not body.get("stream"):
            result = await api.turns.run(owner_key, messages, [], params, nothing)
            return web.json_response({"id": cid, "object": "chat.completion", "created": created, "model": model,
                                      "choices": [{"index": 0, "finish_reason": finish(result), "logprobs": None,
                                                   "message": {"role": "assistant", "content": result.text,
                                                               "refusal": None}}],
                                      "usage": usage(result), "system_fingerprint": None})
        events = EventStream(request)
        head = {"id": cid, "object": "chat.completion.chunk", "created": created, "model": model,
                "system_fingerprint": None}

        async def on_text(text: str) -> None:
            if not events.response.prepared:  # the role first, with the first text
                await events.data(head | {"choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                                       "finish_reason": None, "logprobs": None}]})
            await events.data(head | {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None,
                                                   "logprobs": None}]})
        try:
            result = await api.turns.run(owner_key, messages, [], params, on_text)
        except ConnectionError:
            return events.response
        except Exception as e:  # after the head is sent, an error is an event of the stream
            if not events.response.prepared:
                raise
            await events.data(from_exception(e).body())
            return await events.end()
        if not events.response.prepared:
            await on_text("")
        await events.data(head | {"choices": [{"index": 0, "delta": {}, "finish_reason": finish(result),
                                               "logprobs": None}]})
        if options.get("include_usage"):
            await events.data(head | {"choices": [], "usage": usage(result)})
        await events.data("[DONE]")
        return await events.end()


async def nothing(text: str) -> None:
    return None


def finish(result: TurnResult) -> str:
    return FINISH.get(result.finish_reason, "stop")


def usage(result: TurnResult) -> dict[str, Any]:
    return {"prompt_tokens": result.input_tokens, "completion_tokens": result.output_tokens,
            "total_tokens": result.input_tokens + result.output_tokens,
            "prompt_tokens_details": {"cached_tokens": result.cached_tokens, "audio_tokens": 0},
            "completion_tokens_details": {"reasoning_tokens": 0, "audio_tokens": 0,
                                          "accepted_prediction_tokens": 0, "rejected_prediction_tokens": 0}}
