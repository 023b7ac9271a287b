"""Stored responses (`store: true`, the Responses API's default): what `GET /v1/responses/{id}`
returns and what `previous_response_id` continues. Kept in the server's memory, bounded by a
count and by bytes; the least recently used goes first. A response is held with its whole
conversation (the chat messages before it, its input's and its reply), so a continuation reads
one entry; a chain of continuations costs each entry its own copy, which the byte bound caps.

Lives on the event loop: no locks. Nothing survives a restart.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any


@dataclass
class StoredResponse:
    response: dict[str, Any]  # the Response object as last sent
    messages: list[dict[str, Any]]  # the conversation after it, as chat messages (no system)
    input_items: list[dict[str, Any]]  # its input, as items with ids
    num_bytes: int = 0


class ResponseStore:
    def __init__(self, max_entries: int, max_bytes: int) -> None:
        self.max_entries, self.max_bytes = max_entries, max_bytes
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def put(self, entry: StoredResponse) -> bool:
        """Stores `entry` under its response's id (replacing one of that id), evicting the
        least recently used while over a bound. False: it alone is over the byte bound (or
        storing is off), and nothing was stored."""
        entry.num_bytes = len(json.dumps([entry.response, entry.messages, entry.input_items],
                                         ensure_ascii=False))
        if self.max_entries <= 0 or entry.num_bytes > self.max_bytes:
            return False
        self.delete(entry.response["id"])
        self._entries[entry.response["id"]] = entry
        self.num_bytes += entry.num_bytes
        while len(self._entries) > self.max_entries or self.num_bytes > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.num_bytes
        return True

    def get(self, response_id: str) -> StoredResponse | None:
        entry = self._entries.get(response_id)
        if entry is not None:
            self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> bool:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.num_bytes -= entry.num_bytes
        return entry is not None
