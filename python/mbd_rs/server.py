"""OpenAI-compatible HTTP server (`mbd-rs serve`; needs the [server] extra: starlette + uvicorn).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, with `stream: true`
as server-sent events in OpenAI's chunk format. Diffusion knobs are accepted as extra body fields.
The engine batches concurrent generations (continuous batching: one forward carries the next step of up to
`max_concurrency` of them); up to `max_queue` more wait for a place, and beyond that new requests get 503. A
client that disconnects mid-stream cancels its generation and frees its slot.

Limits: bodies must be `application/json` (so a web page cannot post to a local server without CORS) and at most
`max_body_bytes`; the whole body is validated before a generation slot is taken, and the slot is released on
every path (finish, error, cancel, disconnect). Fields we do not support are refused with 400, never ignored.
"""
from __future__ import annotations

import argparse
import html
import importlib.resources
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import GENERATION_PARAMS, Engine, Stream
from .errors import ContextLengthError, InvalidRequestError, MbdError
from .types import StepEvent, Usage

# OpenAI body fields passed to the engine as generation parameters, and the server's own fields.
_OPENAI_PARAMS = {"max_tokens", "temperature", "top_p", "stop", "seed"}
_OWN = {"model", "prompt", "messages", "stream", "stream_options", "max_completion_tokens", "n", "user"}
# OpenAI fields we do not support yet, with the values that mean "off" (sent by many clients by default).
_UNSUPPORTED_UNLESS = {"logprobs": (None, False, 0), "top_logprobs": (None, 0), "echo": (None, False),
                       "presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
                       "suffix": (None, ""), "best_of": (None, 1), "response_format": (None, {"type": "text"})}
# Diffusion knobs and the rest of the engine's parameters, accepted as extra body fields.
_EXTENSIONS = set(GENERATION_PARAMS) - _OPENAI_PARAMS
# With "trace" (streaming only), every forward pass is also an SSE event carrying "mbd_step": the blocks, the
# positions it decoded and the canvas as token pieces (what the live web view at / draws).
_log = logging.getLogger("mbd_rs.server")
#: Default cap on a request body.
MAX_BODY_BYTES = 4 << 20


class _BodyTooLarge(Exception):
    pass


def _error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


class _Slots:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.active = 0
        self._lock = threading.Lock()

    def try_acquire(self) -> "_Lease | None":
        with self._lock:
            if self.active >= self.capacity:
                return None
            self.active += 1
            return _Lease(self)

    def _release(self) -> None:
        with self._lock:
            self.active -= 1


class _Lease:
    """One generation's slot: `release` frees it once, however many paths call it."""

    def __init__(self, slots: _Slots):
        self._slots: _Slots | None = slots
        self.stream: Stream | None = None

    def release(self) -> None:
        slots, self._slots = self._slots, None
        if slots is not None:
            if self.stream is not None:
                self.stream.cancel()
                self.stream.close()  # frees the KV cache now
            slots._release()


def _body_params(body: dict[str, Any], chat: bool) -> tuple[dict[str, Any], Any]:
    """Validate the whole body (before any slot is taken): the engine's parameters and the prompt or messages.
    Parameter values are checked by the engine; this checks the shape of the OpenAI fields."""
    unknown = sorted(set(body) - _OWN - _OPENAI_PARAMS - _EXTENSIONS - set(_UNSUPPORTED_UNLESS))
    if unknown:
        raise InvalidRequestError(f"unknown request field(s) {unknown}")
    for k, off in _UNSUPPORTED_UNLESS.items():
        if k in body and not any(body[k] == v and isinstance(body[k], bool) == isinstance(v, bool) for v in off):
            raise InvalidRequestError(f"{k} is not supported by this server (got {json.dumps(body[k])[:80]})")
    body = {k: v for k, v in body.items() if v is not None}  # null = the field's default, as OpenAI treats it
    if body.get("n", 1) != 1 or isinstance(body.get("n"), bool):
        raise InvalidRequestError("n must be 1 (one completion per request)")
    if not isinstance(body.get("stream", False), bool):
        raise InvalidRequestError("stream must be true or false")
    so = body.get("stream_options")
    if so is not None and not (isinstance(so, dict) and set(so) <= {"include_usage"}
                               and isinstance(so.get("include_usage", False), bool)):
        raise InvalidRequestError("stream_options must be an object like {\"include_usage\": true}")
    if not isinstance(body.get("user", ""), str):
        raise InvalidRequestError("user must be a string")
    if body.get("trace") not in (None, False) and not body.get("stream"):
        raise InvalidRequestError("trace needs stream: true (its events are server-sent)")
    p = {k: body[k] for k in _EXTENSIONS | _OPENAI_PARAMS if body.get(k) is not None}
    if body.get("max_completion_tokens") is not None:
        p["max_tokens"] = body["max_completion_tokens"]
    if chat:
        prompt = body.get("messages")
        if not isinstance(prompt, list) or not prompt:
            raise InvalidRequestError("messages must be a non-empty list")
    else:
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if not isinstance(prompt, (str, list)):
            raise InvalidRequestError("prompt must be a string or a list of token ids")
    return p, prompt


def create_app(engine: Engine, *, model_name: str | None = None, api_key: str | None = None,
               max_concurrency: int = 4, max_queue: int | None = None,
               max_body_bytes: int = MAX_BODY_BYTES) -> Starlette:
    """The app serving `engine`. `max_concurrency` becomes the engine's batch (`Engine.set_batching(max_batch=)`):
    generations stepped together; `max_queue` (default: `max_concurrency`) more wait in the engine's queue."""
    name = model_name or os.path.basename(os.path.normpath(engine.info.path))
    engine.set_batching(max_batch=max_concurrency)
    queue = max_concurrency if max_queue is None else max_queue
    if isinstance(queue, bool) or not isinstance(queue, int) or queue < 0:
        raise InvalidRequestError(f"max_queue must be an integer >= 0, got {queue!r}")
    slots = _Slots(max_concurrency + queue)
    created = int(time.time())

    def check_auth(request: Request) -> JSONResponse | None:
        if api_key is None:
            return None
        if request.headers.get("authorization", "") != f"Bearer {api_key}":
            return _error(401, "invalid or missing API key", "invalid_request_error", code="invalid_api_key")
        return None

    async def read_json(request: Request) -> Any:
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise InvalidRequestError("the request body must be JSON with Content-Type: application/json")
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > max_body_bytes:
                raise _BodyTooLarge(f"request body is over this server's limit of {max_body_bytes} bytes")
        try:
            return await anyio.to_thread.run_sync(json.loads, bytes(raw))  # large bodies parse off the event loop
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise InvalidRequestError("request body is not valid JSON") from None

    async def health(request: Request) -> JSONResponse:
        # open without the API key: load balancers and probes must reach it (it says nothing secret)
        return JSONResponse({"status": "ok", "model": name, "active": slots.active, "capacity": slots.capacity,
                             "batch": max_concurrency, "queue": queue})

    async def models(request: Request) -> JSONResponse:
        if (r := check_auth(request)) is not None:
            return r
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "mbd-rs"}]})

    async def handle(request: Request, chat: bool) -> Response:
        if (r := check_auth(request)) is not None:
            return r
        lease = None
        try:
            body = await read_json(request)
            if not isinstance(body, dict):
                raise InvalidRequestError("request body must be a JSON object")
            if body.get("model") not in (None, name):
                return _error(404, f"model '{body.get('model')}' does not exist; this server serves '{name}'",
                              code="model_not_found")
            params, prompt = _body_params(body, chat)
            lease = slots.try_acquire()
            if lease is None:
                return _error(503, f"server is at its limit of {max_concurrency} batched and {queue} queued "
                              "generations; retry later", "server_error", code="server_busy")
            start = (lambda: engine.stream_chat(prompt, **params)) if chat else (lambda: engine.stream(prompt, **params))
            lease.stream = stream = await anyio.to_thread.run_sync(start)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                # the lease is released by the stream's end, or after the response if the client left first
                response: Response = StreamingResponse(sse(stream, rid, chat, include_usage, lease, request),
                                                       media_type="text/event-stream",
                                                       headers={"Cache-Control": "no-cache"},
                                                       background=BackgroundTask(lease.release))
                lease = None
                return response
            comp = await anyio.to_thread.run_sync(stream.result)
            request.state.tokens = comp.usage.completion_tokens
        except _BodyTooLarge as e:
            return _error(413, str(e))
        except ContextLengthError as e:
            return _error(400, str(e), code="context_length_exceeded")
        except (InvalidRequestError, TypeError) as e:
            return _error(400, str(e))
        except MbdError as e:
            return _error(500, str(e), "server_error")
        finally:
            if lease is not None:
                lease.release()
        usage = usage_json(comp.usage)
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": comp.text},
                      "finish_reason": comp.finish_reason, "logprobs": None}
            obj = "chat.completion"
        else:
            choice = {"index": 0, "text": comp.text, "finish_reason": comp.finish_reason, "logprobs": None}
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": [choice],
                             "usage": usage})

    def usage_json(u: Usage) -> dict[str, int | float]:
        return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens, "total_tokens": u.total_tokens,
                "forward_passes": u.forward_passes, "tokens_per_forward": u.tokens_per_forward,
                "verifications": u.verifications, "drafts_proposed": u.drafts_proposed,
                "drafts_accepted": u.drafts_accepted}

    async def sse(stream: Stream, rid: str, chat: bool, include_usage: bool, lease: _Lease,
                  request: Request) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        now = int(time.time())

        def event(choices: list[dict[str, Any]], usage: dict[str, int | float] | None = None,
                  step: dict[str, Any] | None = None) -> str:
            d: dict[str, Any] = {"id": rid, "object": obj, "created": now, "model": name, "choices": choices}
            if usage is not None:
                d["usage"] = usage
            if step is not None:
                d["mbd_step"] = step
            return f"data: {json.dumps(d)}\n\n"

        def step_json(ev: StepEvent) -> dict[str, Any]:
            return {"index": ev.index, "decoded": ev.decoded, "blocks": ev.blocks,
                    "tokens_per_forward": ev.tokens_per_forward,
                    "canvas": None if ev.canvas is None else [None if t < 0 else piece(t) for t in ev.canvas]}

        def choice(text: str, finish: str | None = None, role: bool = False) -> dict[str, Any]:
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
                return {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
            return {"index": 0, "text": text, "finish_reason": finish, "logprobs": None}

        try:
            if chat:
                yield event([choice("", role=True)])
            while True:
                ch = await anyio.to_thread.run_sync(next, stream, None)
                if ch is None:
                    break
                if ch.step is not None:
                    yield event([choice(ch.text, ch.finish_reason)], step=step_json(ch.step))
                elif ch.text or ch.finish_reason:
                    yield event([choice(ch.text, ch.finish_reason)])
                if ch.finish_reason:
                    request.state.tokens = len(stream.token_ids)
                    if include_usage:
                        assert ch.usage is not None  # the last chunk carries usage
                        yield event([], usage_json(ch.usage))
            yield "data: [DONE]\n\n"
        finally:
            lease.release()  # cancels the generation first if the client went away mid-stream

    pieces: dict[int, str] = {}

    def piece(t: int) -> str:
        """A token's text as the web view shows it (special tokens included)."""
        if t not in pieces:
            pieces[t] = engine.detokenize([t], skip_special_tokens=False)
        return pieces[t]

    async def index(request: Request) -> Response:
        page = (importlib.resources.files("mbd_rs") / "web" / "index.html").read_text(encoding="utf-8")
        return HTMLResponse(page.replace("{{MODEL}}", html.escape(name)).replace(
            "{{KEY_NEEDED}}", "true" if api_key else "false"))

    async def completions(request: Request) -> Response:
        return await handle(request, chat=False)

    async def chat_completions(request: Request) -> Response:
        return await handle(request, chat=True)

    app = Starlette(routes=[
        Route("/", index, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
    ])
    app.state.slots = slots
    app.add_middleware(_AccessLog)
    return app


class _AccessLog:
    """One log line per request (logger "mbd_rs.server", INFO): client, method, route, status, completion tokens, ms.
    Streaming requests are logged when their stream ends."""

    def __init__(self, app: Any):
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            state = scope.get("state") or {}
            client = scope.get("client") or ("-", 0)
            _log.info("%s %s %s %d tokens=%s %.1fms", client[0], scope["method"], scope["path"], status[0],
                      state.get("tokens", "-"), 1e3 * (time.perf_counter() - t0))


def serve(args: argparse.Namespace) -> int:
    import uvicorn

    eng = Engine.load(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize)
    app = create_app(eng, model_name=args.model_name, api_key=args.api_key, max_concurrency=args.max_concurrency,
                     max_queue=args.max_queue, max_body_bytes=args.max_body_bytes)
    print(f"mbd-rs: serving {eng.info.path} as '{args.model_name or os.path.basename(os.path.normpath(eng.info.path))}' "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the access log, on stderr
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0

