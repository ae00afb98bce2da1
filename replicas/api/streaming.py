"""Streaming one request: text and tokens as the engine produces them, then the whole result.

    async for item in stream_generate(engine, request):
        StreamDelta(choices=[ChoiceDelta(index, text, token_ids, logprobs)], tokens={id: str})
        ...
        StreamEnd(result=GenerateResult)            # last: the same result generate() returns

`EngineReplica.generate_stream` serves this through Serve's streaming handles
(`handle.options(stream=True)`); the Router forwards the items (`Router.generate_stream`) and the
OpenAI routes turn them into SSE chunks. The deltas come from vLLM's cumulative outputs, taken
in the engine's own output loop (`CaptureEngine.generate(on_output=...)`), so a streamed request
runs exactly the code a plain one does: same validation, capture, interventions and result.
When the consumer is slower than the engine, pending deltas are merged into one item.

Light on purpose (no torch, no vLLM): the Router imports the item types.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable

from pydantic import BaseModel, ConfigDict, Field

from replicas.api import GenerateRequest, GenerateResult


class CallOptions(BaseModel):
    """How a replica runs one request beyond its GenerateRequest (set by the Router's OpenAI routes)."""

    model_config = ConfigDict(extra="forbid")

    fill_max_tokens: bool = Field(
        False,
        description="Set max_tokens to max_model_len minus the prompt's tokens (OpenAI chat's default when "
        "max_tokens is omitted); the request's own max_tokens is a placeholder.",
    )
    token_strs: bool = Field(False, description="Streaming: send the text of each token in the deltas' logprobs.")


@dataclass
class ChoiceDelta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, float]] | None = None  # one row per new token: the sampled one and the top-k
    finish_reason: str | None = None


@dataclass
class StreamDelta:
    choices: list[ChoiceDelta]
    tokens: dict[int, str] = field(default_factory=dict)  # text of the token ids in `choices` (token_strs)


@dataclass
class StreamEnd:
    result: GenerateResult


class DeltaTracker:
    """Turns vLLM's cumulative outputs into deltas. `feed` runs inside the engine's output loop
    (synchronously, so each step's state is read before the next step changes it); `drain` hands
    the consumer everything pending, merged per completion."""

    def __init__(self, token_texts: Callable[[list[int]], list[str]] | None = None) -> None:
        self._token_texts_of = token_texts  # ids -> their texts, for `StreamDelta.tokens`; None: none sent
        self._sent: dict[int, tuple[int, int]] = {}  # completion index -> (characters, tokens) sent
        self._finished: set[int] = set()
        self._pending: list[ChoiceDelta] = []
        self.changed = asyncio.Event()

    def feed(self, output: Any) -> None:
        for completion in output.outputs:
            index = completion.index
            if index in self._finished:
                continue
            chars, n = self._sent.get(index, (0, 0))
            text, ids = completion.text, list(completion.token_ids)
            chars = min(chars, len(text))
            if len(text) == chars and len(ids) <= n and completion.finish_reason is None:
                continue
            if completion.finish_reason is not None:
                self._finished.add(index)
            rows = None
            if completion.logprobs is not None:
                rows = [
                    {int(t): float(lp.logprob) for t, lp in (row or {}).items()}
                    for i, row in enumerate(completion.logprobs)
                    if n <= i < len(ids)
                ]
            self._pending.append(ChoiceDelta(index, text[chars:], ids[n:], rows, completion.finish_reason))
            self._sent[index] = (len(text), max(n, len(ids)))
        self.changed.set()

    def drain(self) -> StreamDelta | None:
        if not self._pending:
            return None
        merged: dict[int, ChoiceDelta] = {}
        for delta in self._pending:
            into = merged.get(delta.index)
            if into is None:
                merged[delta.index] = ChoiceDelta(delta.index, delta.text, list(delta.token_ids),
                                                  list(delta.logprobs) if delta.logprobs is not None else None,
                                                  delta.finish_reason)
                continue
            into.text += delta.text
            into.token_ids += delta.token_ids
            if delta.logprobs is not None:
                into.logprobs = (into.logprobs or []) + delta.logprobs
            into.finish_reason = delta.finish_reason or into.finish_reason
        self._pending = []
        choices = [merged[i] for i in sorted(merged)]
        return StreamDelta(choices, self._token_texts(choices))

    def _token_texts(self, choices: list[ChoiceDelta]) -> dict[int, str]:
        if self._token_texts_of is None:
            return {}
        ids = {t for c in choices for t in c.token_ids}
        ids |= {t for c in choices for row in c.logprobs or () for t in row}
        return dict(zip(sorted(ids), self._token_texts_of(sorted(ids))))


async def stream_generate(
    engine: Any, request: GenerateRequest, token_texts: Callable[[list[int]], list[str]] | None = None
) -> AsyncIterator[StreamDelta | StreamEnd]:
    """`engine.generate(request)` as a stream of deltas, then its result; `token_texts` (ids -> texts,
    replicas.engine.tokens.token_strings) sends the text of the deltas' tokens. Closing the stream
    early (the client went away) cancels the request in the engine, which frees its rows."""
    tracker = DeltaTracker(token_texts)
    task = asyncio.ensure_future(engine.generate(request, on_output=tracker.feed))
    task.add_done_callback(lambda _: tracker.changed.set())
    try:
        while True:
            await tracker.changed.wait()
            tracker.changed.clear()
            finished = task.done()  # read before draining: no output can follow a finished task
            delta = tracker.drain()
            if delta is not None:
                yield delta
            if finished:
                break
        yield StreamEnd(task.result())  # raises the request's error, if it failed
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
