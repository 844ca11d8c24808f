"""OpenAI-compatible HTTP server (`mbd-rs serve`; needs the [server] extra: starlette + uvicorn).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, with `stream: true`
as server-sent events in OpenAI's chunk format. Diffusion knobs are accepted as extra body fields.
Generation steps run in worker threads (the engine releases the GIL); a client that disconnects mid-stream
cancels its generation and frees its slot; at `max_concurrency` live generations new requests get 503.
"""
from __future__ import annotations

import argparse
import json
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import GENERATION_PARAMS, Engine, Stream
from .errors import ContextLengthError, InvalidRequestError, MbdError
from .types import Usage

# OpenAI body fields we read (besides model / prompt / messages / stream).
_STANDARD = {"max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed", "stream", "stream_options",
             "model", "prompt", "messages", "n", "user", "logprobs", "echo", "presence_penalty", "frequency_penalty",
             "logit_bias", "top_logprobs", "response_format", "suffix", "best_of"}
_EXTENSIONS = set(GENERATION_PARAMS) - {"trace", "max_tokens", "temperature", "top_p", "stop", "seed"}


def _error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


class _Slots:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.active = 0
        self._lock = threading.Lock()

    def try_acquire(self) -> bool:
        with self._lock:
            if self.active >= self.capacity:
                return False
            self.active += 1
            return True

    def release(self) -> None:
        with self._lock:
            self.active -= 1


def create_app(engine: Engine, *, model_name: str | None = None, api_key: str | None = None,
               max_concurrency: int = 4) -> Starlette:
    name = model_name or os.path.basename(os.path.normpath(engine.info.path))
    slots = _Slots(max_concurrency)
    created = int(time.time())

    def check_auth(request: Request) -> JSONResponse | None:
        if api_key is None:
            return None
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            return _error(401, "invalid or missing API key", "invalid_request_error", code="invalid_api_key")
        return None

    def params_from(body: dict[str, Any]) -> dict[str, Any]:
        unknown = sorted(set(body) - _STANDARD - _EXTENSIONS)
        if unknown:
            raise InvalidRequestError(f"unknown request field(s) {unknown}")
        if body.get("n", 1) != 1:
            raise InvalidRequestError("n must be 1 (one completion per request)")
        p = {k: body[k] for k in _EXTENSIONS if body.get(k) is not None}
        mt = body.get("max_completion_tokens", body.get("max_tokens"))
        if mt is not None:
            p["max_tokens"] = mt
        for k in ("temperature", "top_p", "stop", "seed"):
            if body.get(k) is not None:
                p[k] = body[k]
        return p

    async def health(request: Request) -> JSONResponse:
        if (r := check_auth(request)) is not None:
            return r
        return JSONResponse({"status": "ok", "model": name, "active": slots.active, "capacity": slots.capacity})

    async def models(request: Request) -> JSONResponse:
        if (r := check_auth(request)) is not None:
            return r
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "mbd-rs"}]})

    async def handle(request: Request, chat: bool) -> Response:
        if (r := check_auth(request)) is not None:
            return r
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "request body is not valid JSON")
        if not isinstance(body, dict):
            return _error(400, "request body must be a JSON object")
        if body.get("model") not in (None, name):
            return _error(404, f"model '{body.get('model')}' does not exist; this server serves '{name}'", code="model_not_found")
        try:
            params = params_from(body)
            if chat:
                msgs = body.get("messages")
                if not isinstance(msgs, list) or not msgs:
                    raise InvalidRequestError("messages must be a non-empty list")
                start = lambda: engine.stream_chat(msgs, **params)  # noqa: E731
            else:
                prompt = body.get("prompt")
                if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                    prompt = prompt[0]
                if not isinstance(prompt, (str, list)):
                    raise InvalidRequestError("prompt must be a string or a list of token ids")
                start = lambda: engine.stream(prompt, **params)  # noqa: E731
            if not slots.try_acquire():
                return _error(503, f"server is at its limit of {slots.capacity} concurrent generations; retry later",
                              "server_error", code="server_busy")
            try:
                stream = await anyio.to_thread.run_sync(start)
            except BaseException:
                slots.release()
                raise
        except ContextLengthError as e:
            return _error(400, str(e), code="context_length_exceeded")
        except (InvalidRequestError, TypeError) as e:
            return _error(400, str(e))
        except MbdError as e:
            return _error(500, str(e), "server_error")
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        if body.get("stream"):
            include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
            return StreamingResponse(sse(stream, rid, chat, include_usage), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            comp = await anyio.to_thread.run_sync(stream.result)
        finally:
            slots.release()
        usage = usage_json(comp.usage)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": comp.text}, "finish_reason": comp.finish_reason,
                      "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": comp.text, "finish_reason": comp.finish_reason, "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": [choice],
                             "usage": usage})

    def usage_json(u: Usage) -> dict[str, int | float]:
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
                "forward_passes": u.forward_passes, "tokens_per_forward": u.tokens_per_forward}

    async def sse(stream: Stream, rid: str, chat: bool, include_usage: bool) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        now = int(time.time())

        def event(choices: list[dict[str, Any]], usage: dict[str, int | float] | None = None) -> str:
            d = {"id": rid, "object": obj, "created": now, "model": name, "choices": choices}
            if usage is not None:
                d["usage"] = usage
            return f"data: {json.dumps(d)}\n\n"

        def choice(text: str, finish: str | None = None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        finished = False
        try:
            if chat:
                yield event([choice("", role=True)])
            while True:
                ch = await anyio.to_thread.run_sync(next, stream, None)
                if ch is None:
                    break
                if ch.text or ch.finish_reason:
                    yield event([choice(ch.text, ch.finish_reason)])
                if ch.finish_reason:
                    finished = True
                    if include_usage:
                        assert ch.usage is not None  # the last chunk carries usage
                        yield event([], usage_json(ch.usage))
            yield "data: [DONE]\n\n"
        finally:
            if not finished:
                stream.cancel()  # client went away: stop decoding at the next step
            slots.release()

    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    app = Starlette(routes=[
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ])
    app.state.slots = slots
    return app


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    eng = Engine.load(args.model, device=args.device, dtype=args.dtype)
    app = create_app(eng, model_name=args.model_name, api_key=args.api_key, max_concurrency=args.max_concurrency)
    print(f"mbd-rs: serving {eng.info.path} as '{args.model_name or os.path.basename(os.path.normpath(eng.info.path))}' "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0

