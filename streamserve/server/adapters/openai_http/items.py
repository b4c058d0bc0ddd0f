"""Items of the Responses and Conversations APIs <-> the chat messages a session's transcript holds.

An input is a string (one user message) or a list of message items: `{"type": "message"?, "role": "user" |
"system" | "developer" | "assistant", "content": str | [{"type": "input_text" | "output_text", "text"}]}`. A
developer message is rendered as a system message (the chat templates know no developer role). Other item and part
types (images, files, audio, tool calls) are refused with the field at fault as `param`.
"""

from __future__ import annotations

import secrets
from typing import Any

from streamserve.engine.chat import Message
from streamserve.server.adapters.openai_http.errors import bad

ROLES = {"user": "user", "system": "system", "developer": "system", "assistant": "assistant"}
TEXT_PARTS = ("input_text", "output_text", "text")
MAX_ITEMS = 1024


def new_id(prefix: str) -> str:
    sep = "-" if prefix == "chatcmpl" else "_"  # OpenAI's spelling of each
    return f"{prefix}{sep}{secrets.token_hex(24)}"


def parse_input(value: Any, param: str = "input") -> tuple[list[dict[str, Any]], list[Message]]:
    """-> (the items as stored, with ids; the chat messages they append). ApiError 400 naming the field."""
    if isinstance(value, str):
        value = [{"role": "user", "content": value}]
    if not isinstance(value, list):
        raise bad(f"'{param}' must be a string or a list of items.", param, "invalid_type")
    if len(value) > MAX_ITEMS:
        raise bad(f"'{param}' has {len(value)} items; at most {MAX_ITEMS}.", param, "array_above_max_length")
    items, messages = [], []
    for i, item in enumerate(value):
        at = f"{param}[{i}]"
        if not isinstance(item, dict):
            raise bad(f"'{at}' must be an object.", at, "invalid_type")
        kind = item.get("type", "message")
        if kind != "message":
            raise bad(f"Item type '{kind}' is not supported by this server: send message items.", f"{at}.type",
                      "unsupported_value")
        role = item.get("role")
        if role not in ROLES:
            raise bad(f"'{at}.role' must be one of {sorted(ROLES)}.", f"{at}.role", "invalid_value")
        text = content_text(item.get("content"), f"{at}.content")
        messages.append({"role": ROLES[role], "content": text})
        part = "output_text" if role == "assistant" else "input_text"
        items.append(message_item(role, text, part, item.get("id") if isinstance(item.get("id"), str) else None))
    return items, messages


def content_text(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad(f"'{param}' must be a string or a list of content parts.", param, "invalid_type")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise bad(f"Content part type {kind!r} is not supported by this server: send text.",
                      f"{param}[{j}].type", "unsupported_value")
        if not isinstance(part.get("text"), str):
            raise bad(f"'{param}[{j}].text' must be a string.", f"{param}[{j}].text", "invalid_type")
        texts.append(part["text"])
    return "".join(texts)


def message_item(role: str, text: str, part: str = "input_text", item_id: str | None = None,
                 status: str = "completed") -> dict[str, Any]:
    content: dict[str, Any] = {"type": part, "text": text}
    if part == "output_text":
        content |= {"annotations": [], "logprobs": []}
    return {"id": item_id or new_id("msg"), "type": "message", "role": role, "status": status, "content": [content]}


def item_message(item: dict[str, Any]) -> Message:
    """A stored item -> its chat message."""
    return {"role": ROLES[item["role"]], "content": "".join(p["text"] for p in item["content"])}


def metadata(value: Any, param: str = "metadata") -> dict[str, str]:
    """OpenAI's metadata: at most 16 pairs of strings, keys up to 64 characters, values up to 512."""
    if value is None:
        return {}
    if not isinstance(value, dict) or len(value) > 16:
        raise bad(f"'{param}' must be an object of at most 16 string pairs.", param, "invalid_type")
    for k, v in value.items():
        if not isinstance(v, str) or len(k) > 64 or len(v) > 512:
            raise bad(f"'{param}' keys are strings up to 64 characters, values strings up to 512.", f"{param}.{k}",
                      "invalid_value")
    return dict(value)


def listing(items: list[dict[str, Any]], query: Any, param_prefix: str = "") -> dict[str, Any]:
    """A page of `items` as OpenAI lists them: `limit` (1..100, 20), `order` (asc | desc), `after` an item id."""
    try:
        limit = int(query.get("limit", 20))
    except ValueError:
        raise bad("'limit' must be an integer.", "limit", "invalid_type") from None
    if not 1 <= limit <= 100:
        raise bad("'limit' must be from 1 to 100.", "limit")
    order = query.get("order", "desc")
    if order not in ("asc", "desc"):
        raise bad("'order' must be 'asc' or 'desc'.", "order")
    seq = items if order == "asc" else items[::-1]
    after = query.get("after")
    if after is not None:
        ids = [it["id"] for it in seq]
        if after not in ids:
            raise bad(f"No item with id '{after}'.", "after", "not_found")
        seq = seq[ids.index(after) + 1:]
    page = seq[:limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": len(seq) > limit}
