"""The OpenAI-compatible routes, served by the same Router as the native ones (docs/openai.md).

    POST /v1/chat/completions   chat; `stream: true` answers with server-sent events
    POST /v1/completions        text or token-id prompt; streams too
    GET  /v1/models             the served model name(s), with max_model_len (as vLLM lists them)
    POST /tokenize, /detokenize as vLLM serves them (a replica's tokenizer does the work)
    GET  /v1/captures/{id}      a capture too large to inline: safetensors, readable once, until it expires

`OpenAIRoutes` is a mixin of `deploy.http.HttpRouter`: its routes sit on `openai_api`, which
`deploy.http` includes into the app, so the app-wide bearer-key dependency guards them, and
Serve's class-based views resolve `self` to the Router. Generation goes through the Router's own
`generate` / `open_stream`: the same validation, queue bound, deadline, cost-aware balancing and
retries as the native API. The translation is `deploy.openai_translate` (requests) and
`deploy.openai_responses` (answers, chunks, errors).

Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`: 400 for a request
capserve cannot honour (naming the field), 401, 404 (unknown model, capture gone), 413, 429 with
Retry-After when the Router's queue is full (checked before the body is read), 503/504 as on the
native routes. A failure after a stream has begun arrives as an error event, then `[DONE]`.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from replicas.api import GenerateResult
from replicas.api.streaming import CallOptions, StreamEnd

from deploy.admission import within
from deploy.capture_store import CaptureGone, CaptureStore, CaptureTooLarge
from deploy.http_parts import SAFETENSORS_MEDIA, check_declared_size, parse_json_object, payload_bytes, read_body, to_safetensors
from deploy.openai_responses import (
    ChatStream,
    CompletionStream,
    capserve_field,
    chat_completion,
    completion,
    model_list,
    needed_token_ids,
    openai_error,
    openai_error_response,
    sse,
)
from deploy.openai_translate import (
    OpenAIRequestError,
    Translated,
    translate_chat,
    translate_completion,
    translate_detokenize,
    translate_tokenize,
)

__all__ = ["OPENAI_PATHS", "OpenAIRoutes", "openai_api", "openai_error_response"]

openai_api = APIRouter()
OPENAI_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize"})
CAPTURES_PATH = "/v1/captures"
KEEPALIVE = ": keep-alive\n\n"  # an SSE comment: traffic for proxies and clients, skipped by SSE parsers


class OpenAIRoutes:
    """Mixin of HttpRouter; uses the Router's generate, open_stream, info, queue, pool and config."""

    _config: Any
    _queue: Any
    _pool: Any
    _codec: Any  # deploy.http_parts.Codec

    def _start_openai(self) -> None:
        options = self._config.openai
        self._captures = CaptureStore(options.capture_store_bytes, options.capture_ttl_s)
        self._created = int(time.time())

    # ------------------------------------------------------------ routes

    @openai_api.post("/v1/chat/completions")
    async def openai_chat(self, request: Request) -> Response:
        return await self._openai_call(request, translate_chat)

    @openai_api.post("/v1/completions")
    async def openai_completions(self, request: Request) -> Response:
        return await self._openai_call(request, translate_completion)

    @openai_api.get("/v1/models")
    async def openai_models(self) -> Response:
        try:
            info = await self.info()  # type: ignore[attr-defined]
        except Exception as exc:
            return openai_error_response(exc)
        return JSONResponse(model_list(self._config.served_model_names, info, self._created))

    @openai_api.post("/tokenize")
    async def openai_tokenize(self, request: Request) -> Response:
        try:
            prompt, special, strs = translate_tokenize(await self._openai_body(request), self._config.served_model_names)
            async with within(self._deadline()):  # type: ignore[attr-defined]
                out = await self._pool.call_any("tokenize", prompt, special, strs)
        except Exception as exc:
            return openai_error_response(exc)
        return JSONResponse({"count": len(out["tokens"]), "max_model_len": out["max_model_len"], "tokens": out["tokens"],
                             "token_strs": out["token_strs"]})

    @openai_api.post("/detokenize")
    async def openai_detokenize(self, request: Request) -> Response:
        try:
            ids = translate_detokenize(await self._openai_body(request), self._config.served_model_names)
            async with within(self._deadline()):  # type: ignore[attr-defined]
                text = await self._pool.call_any("detokenize", ids)
        except Exception as exc:
            return openai_error_response(exc)
        return JSONResponse({"prompt": text})

    @openai_api.get(CAPTURES_PATH + "/{capture_id}", responses={200: {"content": {SAFETENSORS_MEDIA: {}}}})
    async def openai_capture_download(self, capture_id: str) -> Response:
        """A capture too large to inline, as safetensors (tensors by hook name, plus "logits"; the
        other result fields in `__metadata__["capserve"]`). Once: then 404, as after its TTL."""
        try:
            data = self._captures.take(capture_id)
        except CaptureGone as exc:
            return openai_error_response(OpenAIRequestError(str(exc), "capture_id", 404, "capture_not_found"))
        return Response(data, media_type=SAFETENSORS_MEDIA,
                        headers={"Content-Disposition": f'attachment; filename="{capture_id}.safetensors"'})

    # ------------------------------------------------------------ generation

    async def _openai_call(self, request: Request, translate: Any) -> Response:
        try:
            check_declared_size(request, self._config.max_request_bytes)
            self._queue.check()  # full: 429 now, without reading a body that would only wait
            raw = await read_body(request, self._config.max_request_bytes)
            info = await self.info()  # type: ignore[attr-defined]
            t: Translated = await self._codec.run(len(raw), _translated, translate, raw, self._config.served_model_names,
                                                  info.max_model_len)
            id = f"{'chatcmpl' if t.kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
            created = int(time.time())
            if t.stream:
                return await self._openai_stream(request, t, id, created)
            result = await self.generate(t.request, options=_options(t.options))  # type: ignore[attr-defined]
            text = await self._token_texts(needed_token_ids(t, result))
            capserve = await self._capserve(request, result)
            if t.kind == "chat":
                answer = chat_completion(t, result, id, created, capserve, text)
            else:
                prompt = await self._prompt_text(t) if t.echo else ""
                answer = completion(t, result, id, created, capserve, text, prompt)
            inline = payload_bytes(result) if capserve.get("download") is None else 0
            return await self._codec.run(inline, JSONResponse, answer)  # renders (json.dumps) as it is built
        except Exception as exc:
            return openai_error_response(exc)

    async def _openai_stream(self, request: Request, t: Translated, id: str, created: int) -> Response:
        stream = self.open_stream(t.request, _options(t.options))  # type: ignore[attr-defined]
        try:
            await stream.first()  # errors before the first token keep their status code (and retries)
            prompt = await self._prompt_text(t) if t.echo else ""
        except Exception as exc:
            await stream.aclose()
            return openai_error_response(exc)
        chunks = ChatStream(t, id, created) if t.kind == "chat" else CompletionStream(t, id, created, prompt)
        return StreamingResponse(self._events(request, stream, chunks), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache"})

    async def _events(self, request: Request, stream: Any, chunks: Any) -> AsyncIterator[str]:
        """The stream's SSE events. When nothing went out for openai.keepalive_s (a tool call's
        content is held back to the end; a long prefill) a comment goes out instead."""
        error = None
        loop = asyncio.get_running_loop()
        keepalive_s = self._config.openai.keepalive_s
        try:
            for chunk in chunks.opening():
                yield sse(chunk)
            sent_at = loop.time()
            while True:
                timer = asyncio.timeout_at(sent_at + keepalive_s)
                try:
                    async with timer:
                        item = await anext(stream)  # RouterStream's queue loses no item to a timeout
                except StopAsyncIteration:
                    break
                except TimeoutError:
                    if not timer.expired():
                        raise
                    item = None
                if isinstance(item, StreamEnd):
                    capserve = await self._capserve(request, item.result)
                    events = [sse(chunk) for chunk in chunks.closing(item.result, capserve)]
                else:
                    events = [sse(chunk) for chunk in chunks.delta(item)] if item is not None else []
                if not events and loop.time() >= sent_at + keepalive_s:
                    events = [KEEPALIVE]
                for event in events:
                    yield event
                if events:
                    sent_at = loop.time()
        except Exception as exc:  # the status line went out already: an error event, then [DONE]
            error = exc
        finally:
            await stream.aclose()  # the client went away too: the request is cancelled in the engine
        if error is not None:
            yield sse(openai_error(error)[1])
        yield sse("[DONE]")

    # ------------------------------------------------------------ pieces

    async def _openai_body(self, request: Request) -> dict[str, Any]:
        check_declared_size(request, self._config.max_request_bytes)
        raw = await read_body(request, self._config.max_request_bytes)
        return await self._codec.run(len(raw), parse_json_object, raw)

    async def _capserve(self, request: Request, result: GenerateResult) -> dict[str, Any]:
        """The `capserve` field: arrays inline up to openai.inline_bytes, else a download link."""
        size = payload_bytes(result)
        if size <= self._config.openai.inline_bytes:
            return await self._codec.run(size, capserve_field, result)
        data = await self._codec.run(size, to_safetensors, result)
        try:
            stored = self._captures.put(data)
        except CaptureTooLarge as exc:
            raise OpenAIRequestError(str(exc), "capture", 413) from None
        path = f"{CAPTURES_PATH}/{stored.id}"
        download = {"id": stored.id, "path": path, "url": str(request.base_url).rstrip("/") + path,
                    "bytes": stored.bytes, "format": "safetensors", "expires_at": stored.expires_at}
        return capserve_field(result, download)

    async def _token_texts(self, ids: list[int]) -> dict[int, str]:
        if not ids:
            return {}
        async with within(self._deadline()):  # type: ignore[attr-defined]
            texts = await self._pool.call_any("token_strings", ids)
        return dict(zip(ids, texts))

    async def _prompt_text(self, t: Translated) -> str:
        prompt = t.request.prompt
        if isinstance(prompt, str):
            return prompt
        async with within(self._deadline()):  # type: ignore[attr-defined]
            return await self._pool.call_any("detokenize", list(prompt))


def _translated(translate: Any, raw: bytes, served: list[str], max_model_len: int) -> Translated:
    return translate(parse_json_object(raw), served, max_model_len)


def _options(options: CallOptions) -> CallOptions | None:
    """None when nothing differs from the defaults, so the replica call keeps its plain form."""
    return options if options != CallOptions() else None
