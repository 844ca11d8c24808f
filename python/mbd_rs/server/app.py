"""The HTTP side of the server: the routes over one engine (`_Routes`: auth, body limits, the generation routes and
their server-sent events, the tokenizer routes, the web view), the access log, and `create_app` that assembles
them. Protocol shapes are `openai`'s, admission `slots`', the connection level (timeouts, caps, Host) `net`'s.

Bounded work (docs/security.md): a request's body must arrive within `body_timeout` of its headers (else 408, the
connection closed; a Content-Length over `max_body_bytes` gets 413 before any of the body is read); a request spans
at most `max_prompt_tokens` positions (prompt + max_tokens; over it: 400 context_length_exceeded before any work); its
work is cancelled when its client leaves (a non-streaming request's client is polled while it waits; Starlette
watches a streaming one's), when its deadline (`request_timeout`) passes, and when the server shuts down. A
cancelled request's streams end with finish_reason "cancelled"; a non-streaming request past its deadline gets 504
(code "request_timeout"), one cut by shutdown 503."""
from __future__ import annotations

import asyncio
import concurrent.futures
import hmac
import html
import importlib.resources
import json
import logging
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .. import __version__, tools
from ..engine import Engine
from ..errors import ContextLengthError, InvalidRequestError, RequestCancelledError
from ..types import StreamChunk, Usage
from . import net, openai, protocol
from .limits import BODY_TIMEOUT, KEEPALIVE, MAX_BODY_BYTES, MAX_PROMPT_TOKENS, PROGRESS_EVERY, REQUEST_TIMEOUT
from .metrics import Metrics, fingerprint
from .openai import (REFUSALS, Body, BodyTimeout, BodyTooLarge, ClientGone, Echo, Shapes, TextOffsets, UnknownModel,
                     body_params, entries_of, error, is_id, refusal, scored_only, tool_calls_json, usage_json)
from .slots import Item, Lease, Slots

_log = logging.getLogger("mbd_rs.server")


class _Watch:
    """What ends a request's work early: its client leaving (`client`: polled here, where Starlette does not watch
    it) and its deadline. `check` (at most every 0.1 s) cancels the lease's work on either and remembers which."""

    def __init__(self, request: Request, lease: Lease, t0: float, deadline: float):
        self.request, self.lease, self.t0, self.deadline = request, lease, t0, deadline
        self.gone = self.expired = False
        self._next = 0.0

    async def check(self, client: bool = True) -> None:
        now = time.monotonic()
        if now < self._next:
            return
        self._next = now + 0.1
        if client and not self.gone and await self.request.is_disconnected():
            self.gone = True
            self.lease.cancel()
        if not self.expired and now > self.deadline:
            self.expired = True
            self.lease.cancel()

    async def in_thread(self, fn: Callable[[], Any]) -> Any:
        """fn() on a worker thread, checking the client and the deadline while it runs (a cancel stops the lease's
        scoring and streams, so fn returns or raises soon)."""
        outcome: list[Any] = []
        async with anyio.create_task_group() as tg:
            async def watch() -> None:
                while True:
                    await anyio.sleep(0.1)
                    await self.check()

            tg.start_soon(watch)
            try:
                outcome.append(await anyio.to_thread.run_sync(fn))
            except Exception as e:  # raised below, outside the task group (not wrapped in an ExceptionGroup)
                outcome.append(e)
            tg.cancel_scope.cancel()
        if isinstance(outcome[0], Exception):
            raise outcome[0]
        return outcome[0]


class _Routes:
    """The routes of one app: `engine` served as `name`, `slots` admitting its generations; the limits:
    max_body_bytes, body_timeout, max_prompt_tokens and request_timeout."""

    def __init__(self, engine: Engine, name: str, api_key: str | None, batch: int, queue: int, max_body_bytes: int,
                 max_prompt_tokens: int, request_timeout: float, body_timeout: float = BODY_TIMEOUT,
                 keepalive: float = KEEPALIVE):
        self.engine, self.name, self.api_key = engine, name, api_key
        self.keepalive = keepalive
        self.batch, self.queue, self.max_body_bytes = batch, queue, max_body_bytes
        self.max_prompt_tokens, self.request_timeout = max_prompt_tokens, request_timeout
        self.body_timeout = body_timeout
        self.slots = Slots(batch + queue)
        self.metrics = Metrics(engine, self.slots, batch)
        # the system_fingerprint hashes the model's files: on a worker thread from the start, awaited once
        self._fingerprint = concurrent.futures.ThreadPoolExecutor(1, "mbd-fingerprint").submit(
            fingerprint, engine.info.path)
        self.fingerprint = ""
        self.created = int(time.time())
        self.shapes = Shapes(engine)
        self.tok_info: dict[str, Any] = {}
        self._page: str | None = None
        self._longest_token = 0

    def shutdown(self) -> None:
        """Stop admitting requests and cancel the work of every request in flight (they end at once)."""
        self.slots.cancel_all()

    @property
    def stopping(self) -> bool:
        """The server is shutting down: its slots are closed."""
        return self.slots.closed

    def check_auth(self, request: Request) -> JSONResponse | None:
        if self.api_key is None:
            return None
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        # header values arrive as latin-1 text: back to their bytes, compared in constant time with the key's
        if scheme.lower() != "bearer" or not hmac.compare_digest(
                given.strip().encode("latin-1"), self.api_key.encode("utf-8", "surrogateescape")):
            return error(401, "invalid or missing API key", "invalid_request_error", code="invalid_api_key")
        return None

    async def read_body(self, request: Request, deadline: float) -> dict[str, Any]:
        """The request's JSON object, for the model this server serves (else BodyTooLarge, UnknownModel,
        BodyTimeout, ClientGone or InvalidRequestError), arrived within `body_timeout` and before `deadline`
        (time.monotonic(): the request's). A Content-Length over `max_body_bytes` is refused before any byte of
        the body is read (a body without one, chunked, once it passes the cap)."""
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise InvalidRequestError("the request body must be JSON with Content-Type: application/json")
        too_large = f"request body is over this server's limit of {self.max_body_bytes} bytes (--max-body-bytes)"
        declared = request.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > self.max_body_bytes:  # the protocol has checked its syntax
            raise BodyTooLarge(f"{too_large}: Content-Length is {declared}")
        now = time.monotonic()
        own = now + self.body_timeout < deadline
        raw = bytearray()
        try:
            with anyio.move_on_after(min(deadline, now + self.body_timeout) - now) as scope:
                async for piece in request.stream():
                    raw += piece
                    if len(raw) > self.max_body_bytes:
                        raise BodyTooLarge(too_large)
        except ClientDisconnect:
            raise ClientGone("the client closed the connection before its request body arrived") from None
        if scope.cancelled_caught:
            limit = f"{self.body_timeout:g} s (--body-timeout)" if own else f"{self.request_timeout:g} s " \
                "(--request-timeout)"
            raise BodyTimeout(f"the request body did not arrive within this server's limit of {limit}; "
                              f"{len(raw)} bytes came")
        try:
            body = await anyio.to_thread.run_sync(json.loads, bytes(raw))  # large bodies parse off the event loop
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise InvalidRequestError("request body is not valid JSON") from None
        except ValueError as e:  # Python's limit on int conversion: a literal of over 4300 digits
            raise InvalidRequestError(f"request body has a number this server cannot read ({e})") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
        if body.get("model") not in (None, self.name):
            raise UnknownModel(f"model '{body.get('model')}' does not exist; this server serves '{self.name}'")
        return body

    async def system_fingerprint(self) -> str:
        if not self.fingerprint:
            self.fingerprint = await asyncio.wrap_future(self._fingerprint)
        return self.fingerprint

    async def health(self, request: Request) -> JSONResponse:
        # open without the API key: load balancers and probes must reach it (it says nothing secret)
        positions = min(self.max_prompt_tokens, self.engine.info.max_context)
        return JSONResponse({"status": "stopping" if self.stopping else "ok", "model": self.name,
                             "active": self.slots.active, "capacity": self.slots.capacity, "batch": self.batch,
                             "queue": self.queue, "max_prompt_tokens": positions - 1, "max_positions": positions,
                             "request_timeout": self.request_timeout, "body_timeout": self.body_timeout,
                             "pid": os.getpid()})

    async def openapi(self, request: Request) -> JSONResponse:
        """GET /openapi.json: the routes and their request bodies (open, like /health: the schema is public)."""
        return JSONResponse(protocol.openapi(__version__))

    async def models(self, request: Request) -> JSONResponse:
        if (r := self.check_auth(request)) is not None:
            return r
        return JSONResponse({"object": "list", "data": [self.model_json()]})

    def model_json(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "created": self.created, "owned_by": "mbd-rs",
                "max_model_len": self.engine.info.max_context}

    async def model(self, request: Request) -> JSONResponse:
        """GET /v1/models/{id}: this server's one model, or 404 naming the one it serves."""
        if (r := self.check_auth(request)) is not None:
            return r
        asked = request.path_params["model"]
        if asked != self.name:
            return error(404, f"model '{asked}' does not exist; this server serves '{self.name}'",
                         code="model_not_found", param="model")
        return JSONResponse(self.model_json())

    async def metrics_page(self, request: Request) -> Response:
        """GET /metrics: Prometheus' text format (open without the API key, as /health: scrapers reach it)."""
        body, media = self.metrics.page()
        return Response(body, media_type=media.split(";")[0], headers={"Content-Type": media})

    def too_long_to_tokenize(self, prompt: Any) -> None:
        """ContextLengthError for a text (or chat contents) too long to fit the cap whatever its tokens: over
        max_prompt_tokens x the longest token's bytes (refused without tokenizing megabytes)."""
        if not self._longest_token:
            vocab = self.engine.token_bytes(list(range(self.engine.info.vocab_size)))
            self._longest_token = max(1, max(map(len, vocab), default=1))
        texts: list[Any] = ([prompt] if isinstance(prompt, str)
                            else [m.get("content") for m in prompt if isinstance(m, dict)])
        size = sum(len(t.encode("utf-8", "surrogatepass")) for t in texts if isinstance(t, str))
        if size > self.max_prompt_tokens * self._longest_token:
            raise ContextLengthError(f"the prompt has {size} bytes of text: more than this server's limit of "
                                     f"{self.max_prompt_tokens} tokens per request can hold (--max-prompt-tokens)")

    def start(self, lease: Lease, req: Body, chat: bool) -> "list[Echo | None]":
        """Start every (prompt, i) stream of a request on its lease, the echoed prompts scored first (stopped by the
        lease's cancel, checked between prompts); returns each prompt's echo (None without echo). Every prompt is
        tokenized and checked against the cap on positions per request, and the generation parameters by the
        engine, before any work."""
        plans: list[tuple[list[int], dict[str, Any]]] = []
        for prompt in req.prompts:
            if chat or isinstance(prompt, str):
                self.too_long_to_tokenize(prompt)
            ids = self.shapes.prompt_ids(prompt, chat, req.tools.tools if req.tools is not None else None)
            plans.append((ids, openai.fit_positions(len(ids), req.params, self.max_prompt_tokens,
                                                    self.engine.info.max_context)))
        if not req.generates:  # only scored: the generation fields are still checked (a 1-token stream, dropped)
            probe = self.engine.stream(plans[0][0][:1], **dict(req.params, max_tokens=1))
            probe.cancel()
            probe.close()
        echoes: list[Echo | None] = []
        seed: Any = req.params.get("seed")
        for prompt, (ids, params) in zip(req.prompts, plans):
            lease.check()
            echoes.append(self.shapes.echo_of(prompt, ids, req.logprobs, lease.token) if req.echo else None)
            if not req.generates:
                continue
            for i in range(req.n):
                # choice i samples with seed + i; a bad seed is left for the engine to refuse
                lease.add(self.engine.stream(ids, **(dict(params, seed=seed + i) if is_id(seed) else params)))
        return echoes

    def cut_short(self, watch: _Watch) -> Response | None:
        """The response of a request whose work was cancelled: its client left, the server is stopping, or its
        deadline passed (None: it was not)."""
        if watch.gone:
            return error(499, "the client closed the connection; the request was cancelled", code="client_closed")
        if self.stopping:
            return error(503, "the server is shutting down; the request was cancelled", "server_error",
                         code="shutting_down")
        if watch.expired:
            return error(504, f"the request ran past this server's limit of {self.request_timeout:g} s "
                         "(--request-timeout); its generations were cancelled", "server_error",
                         code="request_timeout")
        return None

    async def handle(self, request: Request, chat: bool) -> Response:
        """POST /v1/completions and /v1/chat/completions: the body checked, k = prompts x n slots taken, the streams
        started; then server-sent events (`sse`) or, once every stream has finished, one JSON response."""
        if (r := self.check_auth(request)) is not None:
            return r
        t0 = time.monotonic()
        deadline = t0 + self.request_timeout
        lease = None
        try:
            body = await self.read_body(request, deadline)
            req = body_params(body, chat, self.engine)
            k = len(req.prompts) * req.n
            if k > self.slots.capacity:
                raise InvalidRequestError(f"this request asks for {k} choices ({len(req.prompts)} prompt(s) x "
                                          f"n={req.n}); this server runs at most {self.slots.capacity} generations "
                                          "at once")
            lease = self.slots.try_acquire(k)
            if lease is None:
                if self.stopping:
                    return error(503, "the server is shutting down", "server_error", code="shutting_down")
                return error(503, f"server is at its limit of {self.batch} batched and {self.queue} queued "
                             "generations; retry later", "server_error", code="server_busy")
            held, watch = lease, _Watch(request, lease, t0, deadline)
            try:
                echoes = await watch.in_thread(lambda: self.start(held, req, chat))
            except RequestCancelledError:
                return self.cut_short(watch) or error(500, "the request was cancelled", "server_error")
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            fp = await self.system_fingerprint()
            choice_echo = [echoes[i // req.n] for i in range(k)]
            if req.stream is not None:
                # the lease is released by the stream's end, or after the response if the client left first
                events = self.sse(lease, req, req.stream, choice_echo, rid, chat, request, watch, fp)
                response: Response = StreamingResponse(events, media_type="text/event-stream",
                                                       headers={"Cache-Control": "no-cache"},
                                                       background=BackgroundTask(lease.release))
                lease = None
                return response
            finals: list[StreamChunk | None] = [None] * k
            if req.generates:
                q: asyncio.Queue[Item] = asyncio.Queue()
                lease.pump(q)
                async for i, ch in self.chunks(q, k, watch, client=True):
                    if ch is not None and ch.finish_reason:
                        finals[i] = ch
            else:
                finals = [StreamChunk("", [], "length", scored_only(e), None) for e in choice_echo if e is not None]
            if (cut := self.cut_short(watch)) is not None:
                return cut
            streams = lease.streams
        except REFUSALS as e:
            return refusal(e)
        finally:
            if lease is not None:
                lease.release()
        return self.completion(request, req, finals, streams, choice_echo, rid, chat, fp)

    def completion(self, request: Request, req: Body, finals: "list[StreamChunk | None]", streams: list[Any],
                   choice_echo: "list[Echo | None]", rid: str, chat: bool, fp: str) -> Response:
        """The non-streaming response: every choice's text, finish reason and log-probabilities, and the usage."""
        usages = [f.usage for f in finals if f is not None and f.usage is not None]
        request.state.tokens = sum(u.completion_tokens for u in usages)
        choices: list[Any] = []
        for i, f in enumerate(finals):
            st = streams[i] if req.generates else None
            fin = f.finish_reason if f is not None else "cancelled"
            echo = choice_echo[i]
            text = (echo.text if echo is not None else "") + (st.text if st is not None else "")
            lp: Any = None if req.logprobs is None else self.shapes.logprobs_json(
                entries_of(st.logprobs if st else None, len(st.token_ids) if st else 0, chat), echo, chat)
            if chat:
                message = protocol.ChatMessage(content=text)
                if req.tools is not None and req.tools.format is not None:
                    content, calls = tools.parse(req.tools.format, text)
                    if calls:
                        message = protocol.ChatMessage(content=content, tool_calls=tool_calls_json(calls))
                        fin = "tool_calls" if fin == "stop" else fin
                choices.append(protocol.ChatChoice(index=i, message=message, finish_reason=fin, logprobs=lp))
            else:
                choices.append(protocol.CompletionChoice(index=i, text=text, finish_reason=fin, logprobs=lp))
        kind = protocol.ChatCompletion if chat else protocol.Completion
        answer = kind(id=rid, created=int(time.time()), model=self.name, system_fingerprint=fp, choices=choices,
                      usage=usage_json(usages, req.n))
        return Response(answer.model_dump_json(), media_type="application/json")

    async def chunks(self, q: "asyncio.Queue[Item]", k: int, watch: _Watch, client: bool,
                     idle: float | None = None) -> AsyncIterator[tuple[int, StreamChunk | None]]:
        """(choice index, chunk) from k reader tasks, as they come, until every stream has ended; `watch` checked
        at least every 0.1 s in between (its cancel ends the streams "cancelled"). With `idle`, (-1, None) when
        that many seconds pass with nothing to yield (a keep-alive's turn). Each chunk is metered."""
        live, getter = k, None
        meter = self.metrics.request(watch.t0)
        quiet_since = time.monotonic()
        try:
            while live:
                if getter is None:
                    getter = asyncio.ensure_future(q.get())
                done, _ = await asyncio.wait({getter}, timeout=0.1)
                await watch.check(client)
                if not done:
                    if idle is not None and time.monotonic() - quiet_since >= idle:
                        quiet_since = time.monotonic()
                        yield -1, None
                    continue
                i, item = getter.result()
                getter = None
                if item is None:
                    live -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    meter.chunk(i, item)
                    quiet_since = time.monotonic()
                    yield i, item
        finally:
            if getter is not None:
                getter.cancel()

    async def sse(self, lease: Lease, req: Body, opts: protocol.StreamOptions, choice_echo: "list[Echo | None]",
                  rid: str, chat: bool, request: Request, watch: _Watch, fp: str) -> AsyncIterator[str]:
        """A streaming response's server-sent events: the echoed prompts, every stream's chunks as they come (with
        "trace", one event per forward), the usage with include_usage, then [DONE]; a comment line (": keep-alive")
        whenever `keepalive` seconds pass without an event (a long prefill, a wait in the queue), so proxies with an
        idle timeout keep the connection. With include_progress, an "mbd_progress" event (no choices) whenever the
        prompts' prefill has moved, looked at every `PROGRESS_EVERY` s while no chunk comes. Past the deadline the
        streams end with finish_reason "cancelled"."""
        kind = protocol.ChatCompletionChunk if chat else protocol.CompletionChunk
        now, k, shapes = int(time.time()), len(choice_echo), self.shapes

        def event(choices: list[Any], usage: protocol.Usage | None = None, step: protocol.Step | None = None,
                  progress: list[protocol.Progress] | None = None) -> str:
            d = kind(id=rid, created=now, model=self.name, system_fingerprint=fp, choices=choices, usage=usage,
                     mbd_step=step, mbd_progress=progress)
            return f"data: {d.model_dump_json()}\n\n"

        last_progress: list[protocol.Progress] | None = None

        def progress() -> list[protocol.Progress] | None:
            """The prompts' prefill per choice, if it moved since it was last sent (None: it did not)."""
            nonlocal last_progress
            now_p = [protocol.Progress(index=i, prompt_tokens=t, computed_tokens=d)
                     for i, (d, t) in enumerate(s.prompt_progress for s in lease.streams)]
            if now_p == last_progress:
                return None
            last_progress = now_p
            return now_p

        # per choice: the text offsets of its next tokens (/v1/completions' text_offset)
        offsets = [TextOffsets() for _ in range(k)]

        def choice(i: int, text: str, finish: str | None = None, role: bool = False,
                   lps: Any = None, n_tokens: int = 0) -> "protocol.ChatChunkChoice | protocol.CompletionChoice":
            lp: Any = None
            entries = entries_of(lps, n_tokens, chat) if req.logprobs is not None else []
            if entries:
                lp = shapes.chat_logprobs(entries) if chat else shapes.legacy_logprobs(entries, offsets[i])
            if chat:
                delta = protocol.ChatDelta(role="assistant", content=text) if role else protocol.ChatDelta(
                    content=text or None)
                return protocol.ChatChunkChoice(index=i, delta=delta, finish_reason=finish, logprobs=lp)
            return protocol.CompletionChoice(index=i, text=text, finish_reason=finish, logprobs=lp)

        usages: list[Usage | None] = [None] * k
        try:
            if chat:
                for i in range(k):
                    yield event([choice(i, "", role=True)])
            for i, e in enumerate(choice_echo):
                if e is not None:  # the prompt first, with its scores
                    lp = None if req.logprobs is None else shapes.legacy_logprobs(e.entries or [], TextOffsets())
                    offsets[i] = TextOffsets(len(e.text))
                    fin = None if req.generates else "length"
                    yield event([protocol.CompletionChoice(index=i, text=e.text, finish_reason=fin, logprobs=lp)])
                    if not req.generates:
                        usages[i] = scored_only(e)
            if req.generates:
                q: asyncio.Queue[Item] = asyncio.Queue()
                lease.pump(q)
                # Starlette watches the client of a streaming response (and cancels this generator when it leaves)
                fmt = req.tools.format if req.tools is not None else None
                parsers = [tools.StreamParser(fmt) if fmt is not None else None for _ in range(k)]
                tick = min(self.keepalive, PROGRESS_EVERY) if opts.include_progress else self.keepalive
                sent = time.monotonic()
                async for i, ch in self.chunks(q, k, watch, client=False, idle=tick):
                    if ch is None:  # nothing came for `tick` s
                        if opts.include_progress and (p := progress()) is not None:
                            yield event([], progress=p)
                            sent = time.monotonic()
                        elif not opts.include_progress or time.monotonic() - sent >= self.keepalive:
                            yield ": keep-alive\n\n"
                            sent = time.monotonic()
                        continue
                    sent = time.monotonic()
                    if (parser := parsers[i]) is not None:  # a reply that may call tools: its deltas as OpenAI's
                        for d in self.tool_deltas(parser, ch, i):
                            yield event([d], step=shapes.step_json(ch.step) if ch.step is not None else None)
                        if ch.finish_reason:
                            usages[i] = ch.usage
                        continue
                    lps = ch.logprobs if req.logprobs is not None else None
                    c = choice(i, ch.text, ch.finish_reason, lps=lps, n_tokens=len(ch.token_ids))
                    if ch.step is not None:
                        yield event([c], step=shapes.step_json(ch.step))
                    elif ch.text or ch.finish_reason or c.logprobs is not None:
                        yield event([c])
                    if ch.finish_reason:
                        usages[i] = ch.usage
            request.state.tokens = sum(len(s.token_ids) for s in lease.streams)
            if opts.include_usage:
                done = [u for u in usages if u is not None]
                assert len(done) == k  # the last chunk of each stream carries its usage
                yield event([], usage_json(done, req.n))
            yield "data: [DONE]\n\n"
        finally:
            lease.release()  # cancels the generations first if the client went away mid-stream

    @staticmethod
    def tool_deltas(parser: "tools.StreamParser", ch: StreamChunk, i: int) -> list[protocol.ChatChunkChoice]:
        """A chunk of a reply that may call tools, as OpenAI streams it: content deltas, a call's index, id and name
        once its name is out, then its arguments in fragments; the last chunk's finish_reason ("tool_calls" after
        calls) on a delta of its own. A trace step without text is one empty delta (its event carries the step)."""
        events = parser.feed(ch.text)
        fin = ch.finish_reason
        if fin:
            if tail := parser.finish():
                events.append(("content", tail))
            fin = "tool_calls" if parser.calls and fin == "stop" else fin
        deltas: list[protocol.ChatChunkChoice] = []
        for kind, v in events:
            if kind == "content":
                delta = protocol.ChatDelta(content=v)
            elif kind == "call":
                j, cid, name = v
                delta = protocol.ChatDelta(tool_calls=[protocol.ToolCallDelta(
                    index=j, id=cid, type="function", function={"name": name, "arguments": ""})])
            else:
                j, frag = v
                delta = protocol.ChatDelta(tool_calls=[protocol.ToolCallDelta(index=j, function={"arguments": frag})])
            deltas.append(protocol.ChatChunkChoice(index=i, delta=delta))
        if fin or (ch.step is not None and not deltas):
            deltas.append(protocol.ChatChunkChoice(index=i, delta=protocol.ChatDelta(), finish_reason=fin))
        return deltas

    def page(self) -> str:
        """The web view for this server, rendered on the first visit and kept."""
        if self._page is None:
            page = (importlib.resources.files("mbd_rs") / "web" / "index.html").read_text(encoding="utf-8")
            i = self.engine.info
            # the family's defaults, shown in the fields a request may leave empty; a script literal ("<" escaped:
            # no "</script>" can end it)
            defaults = {"family": i.family, "block_size": i.block_size, "acceptance": i.default_acceptance,
                        "threshold": i.default_threshold, "block_add_threshold": i.default_block_add_threshold,
                        "decoded_token_threshold": i.default_decoded_token_threshold}
            self._page = page.replace("{{MODEL}}", html.escape(self.name)).replace(
                "{{KEY_NEEDED}}", "true" if self.api_key else "false").replace(
                "{{DEFAULTS}}", json.dumps(defaults).replace("<", "\\u003c"))
        return self._page

    async def index(self, request: Request) -> Response:
        return HTMLResponse(self.page())

    async def completions(self, request: Request) -> Response:
        return await self.handle(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self.handle(request, chat=True)

    def tokenizer_info_json(self) -> dict[str, Any]:
        if not self.tok_info:
            self.tok_info.update(openai.tokenizer_info(self.engine))
        return self.tok_info

    async def tokenizer_info(self, request: Request) -> Response:
        if (r := self.check_auth(request)) is not None:
            return r
        return JSONResponse(await anyio.to_thread.run_sync(self.tokenizer_info_json))

    @staticmethod
    async def not_routed(request: Request, exc: Exception) -> Response:
        """404 and 405 as OpenAI error JSON (the openai client shows the message), naming what the server has."""
        status = getattr(exc, "status_code", 500)
        path = request.url.path
        if status == 405:
            allow = ((getattr(exc, "headers", None) or {}).get("Allow") or "").replace(" ", "").split(",")
            takes = " or ".join(sorted(m for m in allow if m and not (m == "HEAD" and "GET" in allow))) or "another"
            return error(405, f"{request.method} is not allowed on {path}; it takes {takes}", code="method_not_allowed")
        if status == 404:
            return error(404, f"this server has no route {path} (it serves /v1/models, /v1/completions, "
                         "/v1/chat/completions, /tokenize, /detokenize, /tokenizer_info, /health, /metrics)",
                         code="not_found")
        return error(status, str(getattr(exc, "detail", "")) or "error", "server_error" if status >= 500 else
                     "invalid_request_error")

    async def tokenizer_route(self, request: Request, encode: bool) -> Response:
        if (r := self.check_auth(request)) is not None:
            return r
        try:
            body = await self.read_body(request, time.monotonic() + self.request_timeout)
            route = openai.tokenize if encode else openai.detokenize
            return JSONResponse(await anyio.to_thread.run_sync(route, self.shapes, body))
        except REFUSALS as e:
            return refusal(e)

    async def tokenize(self, request: Request) -> Response:
        return await self.tokenizer_route(request, encode=True)

    async def detokenize(self, request: Request) -> Response:
        return await self.tokenizer_route(request, encode=False)


def create_app(engine: Engine, *, model_name: str | None = None, api_key: str | None = None,
               max_concurrency: int = 4, max_queue: int | None = None, max_body_bytes: int = MAX_BODY_BYTES,
               max_prompt_tokens: int = MAX_PROMPT_TOKENS, request_timeout: float = REQUEST_TIMEOUT,
               body_timeout: float = BODY_TIMEOUT, allowed_hosts: Sequence[str] | None = None,
               keepalive: float = KEEPALIVE) -> Starlette:
    """The app serving `engine`. `max_concurrency` becomes the engine's batch (`Engine.set_batching(max_batch=)`):
    generations stepped together; `max_queue` (default: `max_concurrency`) more wait in the engine's queue.
    `max_prompt_tokens`: the most positions one request spans (prompt + max_tokens); `request_timeout`: seconds
    before a request's work is cancelled; `body_timeout`: seconds a request's body has to arrive once its headers
    are in (then 408, the connection closed); `allowed_hosts`: the Host names served (`net.allowed_hosts`; None: any);
    `keepalive`: seconds without an event before a stream sends a keep-alive comment.
    `app.state.routes.shutdown()` cancels the work in flight (`mbd-rs serve` calls it on SIGTERM)."""
    name = model_name or os.path.basename(os.path.normpath(engine.info.path))
    engine.set_batching(max_batch=max_concurrency)
    queue = max_concurrency if max_queue is None else max_queue
    if isinstance(queue, bool) or not isinstance(queue, int) or queue < 0:
        raise InvalidRequestError(f"max_queue must be an integer >= 0, got {queue!r}")
    if isinstance(max_prompt_tokens, bool) or not isinstance(max_prompt_tokens, int) or max_prompt_tokens < 1:
        raise InvalidRequestError(f"max_prompt_tokens must be an integer >= 1, got {max_prompt_tokens!r}")
    for key, t in (("request_timeout", request_timeout), ("body_timeout", body_timeout), ("keepalive", keepalive)):
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 < t < float("inf"):
            raise InvalidRequestError(f"{key} must be a number of seconds > 0, got {t!r}")
    r = _Routes(engine, name, api_key, max_concurrency, queue, max_body_bytes, max_prompt_tokens,
                float(request_timeout), float(body_timeout), float(keepalive))
    app = Starlette(exception_handlers={HTTPException: r.not_routed}, routes=[
        Route("/", r.index, methods=["GET"]),
        Route("/health", r.health, methods=["GET"]),
        Route("/metrics", r.metrics_page, methods=["GET"]),
        Route("/openapi.json", r.openapi, methods=["GET"]),
        Route("/v1/models", r.models, methods=["GET"]),
        Route("/v1/models/{model:path}", r.model, methods=["GET"]),
        Route("/v1/completions", r.completions, methods=["POST"]),
        Route("/v1/chat/completions", r.chat_completions, methods=["POST"]),
        Route("/tokenizer_info", r.tokenizer_info, methods=["GET"]),
        Route("/tokenize", r.tokenize, methods=["POST"]),
        Route("/detokenize", r.detokenize, methods=["POST"]),
    ])
    app.state.slots = r.slots
    app.state.routes = r
    app.add_middleware(net.HostGuard, allowed=None if allowed_hosts is None else list(allowed_hosts))
    app.add_middleware(_AccessLog, metrics=r.metrics)
    return app


class _AccessLog:
    """One log line per request (logger "mbd_rs.server", INFO): client, method, route, status, completion tokens, ms
    and its request id; streaming requests are logged when their stream ends. The request id is the client's
    `X-Request-Id` when it sent a usable one (1-128 visible ASCII characters), else a new one; every response
    carries it back in `X-Request-Id`. Each answer is counted in the metrics by route and status."""

    def __init__(self, app: Any, metrics: Metrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = [0]
        given = dict(scope.get("headers") or []).get(b"x-request-id", b"")
        rid = given if 0 < len(given) <= 128 and all(0x21 <= b <= 0x7E for b in given) else uuid.uuid4().hex.encode()

        async def send_status(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = dict(message, headers=[*message.get("headers", []), (b"x-request-id", rid)])
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            state = scope.get("state") or {}
            client = scope.get("client") or ("-", 0)
            self.metrics.answered(scope["path"], status[0])
            _log.info("%s %s %s %d tokens=%s %.1fms id=%s", client[0], scope["method"], scope["path"], status[0],
                      state.get("tokens", "-"), 1e3 * (time.perf_counter() - t0), rid.decode())


def serve(args: Any, load: dict[str, Any], engine: Engine | None = None) -> int:
    """`mbd-rs serve`: load the model (`load`: Engine.load's options), unless `engine` is the model loaded already,
    and serve it with uvicorn until interrupted (SIGTERM or Ctrl-C: the work in flight is cancelled, and the process
    exits within seconds)."""
    eng = engine if engine is not None else Engine.load(args.model, **load)
    hosts = net.allowed_hosts(args.host, args.allowed_hosts or [])
    app = create_app(eng, model_name=args.model_name, api_key=args.api_key, max_concurrency=args.max_concurrency,
                     max_queue=args.max_queue, max_body_bytes=args.max_body_bytes,
                     max_prompt_tokens=args.max_prompt_tokens, request_timeout=args.request_timeout,
                     body_timeout=args.body_timeout, allowed_hosts=hosts, keepalive=args.sse_keepalive)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the access log, on stderr
    server = net.make_server(app, args.host, args.port, header_timeout=args.header_timeout,
                             limit_concurrency=args.limit_concurrency, on_shutdown=app.state.routes.shutdown)
    name = app.state.routes.name
    print(f"mbd-rs: serving {eng.info.path} as '{name}' on http://{args.host}:{args.port}/v1; "
          f"live view of decoding: http://{args.host}:{args.port}/", flush=True)
    server.run()
    return 0
