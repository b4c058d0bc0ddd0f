"""The Conversations API: a conversation is a stored list of items plus the resident session that holds them.

    POST   /v1/conversations                          {items?, metadata?} -> the conversation
    GET    /v1/conversations/{id}                     the conversation
    POST   /v1/conversations/{id}                     {metadata} -> updated
    DELETE /v1/conversations/{id}                     deleted (its session closes)
    GET    /v1/conversations/{id}/items               a page (limit, order, after)
    POST   /v1/conversations/{id}/items               {items} -> the items added
    GET    /v1/conversations/{id}/items/{item}        one item
    DELETE /v1/conversations/{id}/items/{item}        -> the conversation

Items added or deleted here change no session at once: the next response on the conversation brings its session
to the items (turns.py: what the session holds past the first changed item is rewound, the rest appended).
"""

from __future__ import annotations

import json
import time
from typing import Any

from aiohttp import web

from streamserve.server.adapters.openai_http.errors import ApiError, bad, not_found, read_json
from streamserve.server.adapters.openai_http.host import Api
from streamserve.server.adapters.openai_http.items import listing, metadata, new_id, parse_input
from streamserve.server.adapters.openai_http.store import StoredConversation

BASE = "/v1/conversations"


class Conversations:
    def __init__(self, api: Api) -> None:
        self.api = api

    def table(self) -> list[tuple[str, str, Any]]:
        one, items, item = f"{BASE}/{{id}}", f"{BASE}/{{id}}/items", f"{BASE}/{{id}}/items/{{item}}"
        return [("POST", BASE, self.create), ("GET", one, self.retrieve), ("POST", one, self.update),
                ("DELETE", one, self.delete), ("GET", items, self.list_items), ("POST", items, self.add_items),
                ("GET", item, self.item), ("DELETE", item, self.delete_item)]

    def conversation(self, request: web.Request, changing: bool = False) -> StoredConversation:
        owner = self.api.host.owner(request)
        cid = request.match_info["id"]
        found = self.api.store.get(owner, cid)
        if not isinstance(found, StoredConversation):
            raise not_found("conversation", cid)
        if changing and found.in_progress:
            raise ApiError(409, f"Conversation '{cid}' has a response in progress.", "conversation_locked")
        return found

    async def create(self, request: web.Request) -> web.Response:
        owner = self.api.host.owner(request)
        body = await read_json(request) if request.can_read_body else {}
        items, _ = parse_input(body.get("items") or [], "items")
        conv = StoredConversation(new_id("conv"), owner, int(time.time()), metadata(body.get("metadata")), items)
        self.check_size(conv)
        self.api.store.put(conv)
        return web.json_response(conv.body())

    async def retrieve(self, request: web.Request) -> web.Response:
        return web.json_response(self.conversation(request).body())

    async def update(self, request: web.Request) -> web.Response:
        conv = self.conversation(request)
        body = await read_json(request)
        if "metadata" not in body:
            raise bad("Missing required parameter: 'metadata'.", "metadata", "missing_required_parameter")
        conv.metadata = metadata(body["metadata"])
        self.api.store.put(conv)
        return web.json_response(conv.body())

    async def delete(self, request: web.Request) -> web.Response:
        conv = self.conversation(request, changing=True)
        self.api.store.drop(conv.id, forget_file=True)
        return web.json_response({"id": conv.id, "object": "conversation.deleted", "deleted": True})

    async def list_items(self, request: web.Request) -> web.Response:
        return web.json_response(listing(self.conversation(request).items, request.query))

    async def add_items(self, request: web.Request) -> web.Response:
        conv = self.conversation(request, changing=True)
        body = await read_json(request)
        if "items" not in body:
            raise bad("Missing required parameter: 'items'.", "items", "missing_required_parameter")
        items, _ = parse_input(body["items"], "items")
        if not items:
            raise bad("'items' must not be empty.", "items", "empty_array")
        self.check_size(conv, items)
        conv.items += items
        self.api.store.put(conv)
        return web.json_response({"object": "list", "data": items, "first_id": items[0]["id"],
                                  "last_id": items[-1]["id"], "has_more": False})

    def check_size(self, conv: StoredConversation, more: list[dict[str, Any]] | None = None) -> None:
        """400 when the conversation (with `more` items) alone would pass --max-stored-responses-bytes."""
        size = conv.size() + len(json.dumps(more or []))
        if size > self.api.store.max_bytes:
            raise bad(f"This conversation would hold {size} bytes, over the server's limit of "
                      f"{self.api.store.max_bytes} for stored state (--max-stored-responses-bytes).", "items",
                      "conversation_too_large")

    def find(self, conv: StoredConversation, item_id: str) -> int:
        for i, it in enumerate(conv.items):
            if it["id"] == item_id:
                return i
        raise not_found("item", item_id)

    async def item(self, request: web.Request) -> web.Response:
        conv = self.conversation(request)
        return web.json_response(conv.items[self.find(conv, request.match_info["item"])])

    async def delete_item(self, request: web.Request) -> web.Response:
        conv = self.conversation(request, changing=True)
        del conv.items[self.find(conv, request.match_info["item"])]
        self.api.store.put(conv)
        return web.json_response(conv.body())
