"""Captures too large to inline in an OpenAI response, kept in the Router's memory until read once.

    store = CaptureStore(max_bytes=1 << 30, ttl_s=600)
    entry = store.put(safetensors_bytes)      # -> StoredCapture(id, bytes, expires_at)
    data = store.take(entry.id)               # the bytes, once; then CaptureGone (HTTP 404)

Bounded: the unread captures together hold at most `max_bytes`. A new one first drops expired
entries, then evicts the oldest unread ones until it fits (logged, and their URLs say "evicted");
one larger than the whole store is refused (`CaptureTooLarge`, HTTP 413): the caller asks for
less, or the operator raises `openai.capture_store_bytes`. Expiry is checked whenever the store
is used, so no timer task runs. A read, an expiry or an eviction leaves a tombstone (the last
TOMBSTONES ids), so a late reader learns why the id is gone rather than a bare "not found".

Ids are 128-bit random (`secrets`): not guessable, though the routes are behind the bearer key too.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable

logger = logging.getLogger("capserve.captures")

TOMBSTONES = 4096


class CaptureGone(KeyError):
    """No capture under this id: never stored, already read, expired or evicted (HTTP 404)."""

    def __str__(self) -> str:  # KeyError's own str() quotes the message
        return str(self.args[0])


class CaptureTooLarge(ValueError):
    """A capture larger than the whole store (HTTP 413)."""


@dataclass(frozen=True)
class StoredCapture:
    id: str
    bytes: int
    expires_at: float  # wall-clock seconds since the epoch


class CaptureStore:
    def __init__(self, max_bytes: int, ttl_s: float, clock: Callable[[], float] = time.time) -> None:
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, tuple[bytes, float]] = OrderedDict()  # oldest first
        self._gone: OrderedDict[str, str] = OrderedDict()  # id -> why
        self.bytes = 0

    def put(self, data: bytes) -> StoredCapture:
        size = len(data)
        if size > self.max_bytes:
            raise CaptureTooLarge(
                f"capture: the result holds {size} bytes of activations and logits, more than the Router keeps for "
                f"download (openai.capture_store_bytes={self.max_bytes}); capture fewer hooks or positions, use a "
                "smaller dtype, or ask the native /v1/capture route for safetensors"
            )
        self._expire()
        while self.bytes + size > self.max_bytes:
            old, (old_data, _) = self._entries.popitem(last=False)
            self.bytes -= len(old_data)
            self._bury(old, f"evicted unread to make room for newer captures (openai.capture_store_bytes={self.max_bytes})")
            logger.warning("capture %s (%d bytes) evicted unread: the store is full", old[:8], len(old_data))
        key = secrets.token_urlsafe(16)
        expires_at = self._clock() + self.ttl_s
        self._entries[key] = (data, expires_at)
        self.bytes += size
        return StoredCapture(key, size, expires_at)

    def take(self, key: str) -> bytes:
        """The capture's bytes, and it is deleted; CaptureGone says why when there is none."""
        self._expire()
        entry = self._entries.pop(key, None)
        if entry is None:
            why = self._gone.get(key, "was never stored here")
            raise CaptureGone(f"capture {key!r} {why}; each capture can be downloaded once, within openai.capture_ttl_s")
        self.bytes -= len(entry[0])
        self._bury(key, "was already downloaded")
        return entry[0]

    def __len__(self) -> int:
        return len(self._entries)

    def _expire(self) -> None:
        now = self._clock()
        for key in [k for k, (_, at) in self._entries.items() if at <= now]:
            data, _ = self._entries.pop(key)
            self.bytes -= len(data)
            self._bury(key, f"expired unread after openai.capture_ttl_s={self.ttl_s:g} s")

    def _bury(self, key: str, why: str) -> None:
        self._gone[key] = why
        while len(self._gone) > TOMBSTONES:
            self._gone.popitem(last=False)
