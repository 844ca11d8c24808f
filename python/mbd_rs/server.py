"""OpenAI-compatible HTTP server (`mbd-rs serve`; needs the [server] extra: starlette + uvicorn).

Endpoints: GET /health, GET /v1/models, POST /v1/completions, POST /v1/chat/completions, with `stream: true`
as server-sent events in OpenAI's chunk format. Diffusion knobs are accepted as extra body fields. Tokenizer
routes (vLLM's shapes, which lm-evaluation-harness's remote tokenizer uses): GET /tokenizer_info, POST /tokenize,
POST /detokenize.

Log-probabilities: /v1/completions `logprobs: k` (0..20) gives each token's log-probability (log-softmax of the
raw logits of the forward that decided it) with the k most likely tokens, in the legacy shape (tokens,
token_logprobs, top_logprobs, text_offset); `echo: true` puts the prompt before the completion (text, and with
logprobs its tokens' left-to-right scores: `Engine.prompt_logprobs`, None for the first token), and with
`max_tokens: 0` only scores the prompt (lm-evaluation-harness's loglikelihood requests). /v1/chat/completions
takes `logprobs: true` and `top_logprobs: k` (OpenAI's chat shape: content entries with token, logprob, bytes
and top_logprobs). Full-attention models cannot score a prompt left to right: echo with logprobs is a 400 there.

Several choices per request: `n` (1..MAX_N) on both routes, and on /v1/completions a `prompt` that is a list of
strings or of token-id lists. Every (prompt, i) pair is one engine stream, all running concurrently (the engine
batches them); choice index = prompt_index * n + i, as OpenAI numbers them. With `seed`, choice i samples with
seed + i (so n > 1 samples differ yet are reproducible); without it every choice draws its own seed. Usage sums
completion tokens over all choices and counts each prompt once. A request with k choices takes k slots: k above
the server's capacity is a 400 (it could never run), k above the free slots a 503.
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
from queue import Empty, Queue
from typing import Any

import anyio
from starlette.applications import Starlette
from starlette.background import BackgroundTask
from starlette.requests import Request
from starlette.responses import HTMLResponse, JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from .engine import GENERATION_PARAMS, Engine, Stream
from .errors import ContextLengthError, InvalidRequestError, MbdError
from .types import StepEvent, StreamChunk, TokenLogprob, Usage

# OpenAI body fields passed to the engine as generation parameters, and the server's own fields.
_OPENAI_PARAMS = {"max_tokens", "temperature", "top_p", "stop", "seed"}
_OWN = {"model", "prompt", "messages", "stream", "stream_options", "max_completion_tokens", "n", "user", "logprobs",
        "top_logprobs", "echo"}
# OpenAI fields we do not support yet, with the values that mean "off" (sent by many clients by default).
_UNSUPPORTED_UNLESS = {"presence_penalty": (None, 0), "frequency_penalty": (None, 0), "logit_bias": (None, {}),
                       "suffix": (None, ""), "best_of": (None, 1), "response_format": (None, {"type": "text"})}
# Diffusion knobs and the rest of the engine's parameters, accepted as extra body fields ("logprobs" is OpenAI's
# field, shaped per route by _body_params).
_EXTENSIONS = set(GENERATION_PARAMS) - _OPENAI_PARAMS - {"logprobs"}
# With "trace" (streaming only), every forward pass is also an SSE event carrying "mbd_step": the blocks, the
# positions it decoded and the canvas as token pieces (what the live web view at / draws).
_log = logging.getLogger("mbd_rs.server")
#: Default cap on a request body.
MAX_BODY_BYTES = 4 << 20
#: Cap on `n` (choices per prompt).
MAX_N = 16


# (token id, logprob or None for a prompt's first token, alternatives or None)
_Entry = tuple[int, "float | None", "list[tuple[int, float]] | None"]


class _Echo:
    """A prompt as echo returns it: text, token ids, and (with logprobs) its tokens' scores."""

    def __init__(self, text: str, ids: list[int], entries: "list[_Entry] | None"):
        self.text, self.ids, self.entries = text, ids, entries


class _BodyTooLarge(Exception):
    pass


class _UnknownModel(Exception):
    pass


def _error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}}, status_code=status)


#: What a POST route answers for a refused request (each route catches these and passes them to _refusal).
_REFUSALS = (_BodyTooLarge, _UnknownModel, InvalidRequestError, TypeError, MbdError)


def _refusal(e: Exception) -> JSONResponse:
    if isinstance(e, _BodyTooLarge):
        return _error(413, str(e))
    if isinstance(e, _UnknownModel):
        return _error(404, str(e), code="model_not_found")
    if isinstance(e, ContextLengthError):
        return _error(400, str(e), code="context_length_exceeded")
    if isinstance(e, (InvalidRequestError, TypeError)):
        return _error(400, str(e))
    return _error(500, str(e), "server_error")


class _Slots:
    def __init__(self, capacity: int):
        self.capacity = capacity
        self.active = 0
        self._lock = threading.Lock()

    def try_acquire(self, k: int = 1) -> "_Lease | None":
        """k slots at once, or none."""
        with self._lock:
            if self.active + k > self.capacity:
                return None
            self.active += k
            return _Lease(self, k)

    def _release(self, k: int) -> None:
        with self._lock:
            self.active -= k


_Item = tuple[int, "StreamChunk | BaseException | None"]


class _Lease:
    """One request's k slots, one per generation. Every slot is freed exactly once: a stream handed to a reader
    thread (`pump`) is stepped and closed by that thread alone, which frees its slot when the stream ends;
    `release` (idempotent) cancels every stream, closes the ones no thread owns and frees their slots (and those
    of streams never started)."""

    def __init__(self, slots: _Slots, k: int):
        self._slots = slots
        self._lock = threading.Lock()
        self._unowned = k  # slots not handed to a reader thread
        self._released = False
        self.streams: list[Stream] = []

    def pump(self, q: "Queue[_Item]") -> None:
        """Start one reader thread per stream, putting (stream index, chunk) on q, then (index, None) at the end
        or (index, exception)."""
        with self._lock:
            if self._released:  # already cancelled and closed: the streams just end
                for i in range(len(self.streams)):
                    q.put((i, None))
                return
            self._unowned -= len(self.streams)
        for i, s in enumerate(self.streams):
            threading.Thread(target=self._read, args=(i, s, q), daemon=True, name=f"mbd-stream-{i}").start()

    def _read(self, i: int, s: Stream, q: "Queue[_Item]") -> None:
        end: BaseException | None = None
        try:
            for ch in s:
                q.put((i, ch))
        except BaseException as e:  # handed to the request's task, which raises it
            end = e
        finally:
            # the stream's KV cache and slot are freed before its end is signalled: a client that has its
            # response can send the next request into that slot at once
            try:
                s.close()
            finally:
                self._slots._release(1)
                q.put((i, end))

    def release(self) -> None:
        with self._lock:
            if self._released:
                return
            self._released = True
            unowned, self._unowned = self._unowned, 0
        try:
            for s in self.streams:
                try:
                    s.cancel()  # thread-safe; a reader thread then sees its stream end and frees its slot
                except Exception:
                    pass
            if unowned:  # no reader threads were started: this closes the streams
                for s in self.streams:
                    try:
                        s.close()
                    except Exception:
                        pass
        finally:
            self._slots._release(unowned)


class _Body:
    """A validated request: the engine's parameters, the prompts (chat: the one message list), n, echo, and
    `logprobs` (alternatives per token, None = off)."""

    def __init__(self, params: dict[str, Any], prompts: list[Any], n: int, echo: bool, logprobs: int | None):
        self.params, self.prompts, self.n, self.echo, self.logprobs = params, prompts, n, echo, logprobs

    @property
    def generates(self) -> bool:
        """False for echo with max_tokens 0: the prompt is scored, nothing generated."""
        return not (self.echo and self.params.get("max_tokens") == 0)


def _body_params(body: dict[str, Any], chat: bool) -> _Body:
    """Validate the whole body (before any slot is taken): the engine's parameters, the prompts (chat: the one
    message list), n, echo and logprobs. Parameter values are checked by the engine; this checks the shape of the
    OpenAI fields."""
    unknown = sorted(set(body) - _OWN - _OPENAI_PARAMS - _EXTENSIONS - set(_UNSUPPORTED_UNLESS))
    if unknown:
        raise InvalidRequestError(f"unknown request field(s) {unknown}")
    for k, off in _UNSUPPORTED_UNLESS.items():
        if k in body and not any(body[k] == v and isinstance(body[k], bool) == isinstance(v, bool) for v in off):
            raise InvalidRequestError(f"{k} is not supported by this server (got {json.dumps(body[k])[:80]})")
    body = {k: v for k, v in body.items() if v is not None}  # null = the field's default, as OpenAI treats it
    n = body.get("n", 1)
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_N:
        raise InvalidRequestError(f"n must be an integer from 1 to {MAX_N} (got {json.dumps(n)[:40]})")
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
        if "echo" in body:
            raise InvalidRequestError("echo applies to /v1/completions only")
        if not isinstance(body.get("logprobs", False), bool):
            raise InvalidRequestError("logprobs must be true or false on /v1/chat/completions (top_logprobs: how "
                                      "many alternatives)")
        top = body.get("top_logprobs")
        if top is not None and not body.get("logprobs"):
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        logprobs = (0 if top is None else top) if body.get("logprobs") else None
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise InvalidRequestError("messages must be a non-empty list")
        prompts, echo = [messages], False
    else:
        if "top_logprobs" in body:
            raise InvalidRequestError("top_logprobs applies to /v1/chat/completions; on /v1/completions logprobs "
                                      "is the number of alternatives")
        echo = _flag(body, "echo", False)
        logprobs = body.get("logprobs")
        prompts = _prompts(body.get("prompt"))
    if logprobs is not None:
        p["logprobs"] = logprobs  # its range is the engine's rule
    return _Body(p, prompts, n, echo, logprobs)


def _is_id(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _prompts(prompt: Any) -> list[Any]:
    """OpenAI's four prompt shapes -> a list of prompts (each a string or a list of token ids)."""
    shapes = "a string, a list of token ids, a list of strings or a list of token-id lists"
    if isinstance(prompt, str):
        return [prompt]
    if not isinstance(prompt, list):
        raise InvalidRequestError(f"prompt must be {shapes}")
    if not prompt:
        raise InvalidRequestError("prompt must not be an empty list")
    if all(_is_id(t) for t in prompt):
        return [prompt]
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)
    if all(isinstance(x, list) for x in prompt):
        for i, x in enumerate(prompt):
            if not x or not all(_is_id(t) for t in x):
                raise InvalidRequestError(f"prompt[{i}] must be a non-empty list of token ids")
        return list(prompt)
    raise InvalidRequestError(f"prompt must be {shapes}; lists may not mix these")


def _flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequestError(f"{key} must be true or false")
    return v


def _tokenize(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    """POST /tokenize, vLLM's shape: {"prompt": text, "add_special_tokens": true} or {"messages": [...],
    "add_generation_prompt": true, "add_special_tokens": false} -> {"tokens", "count", "max_model_len",
    "token_strs"} (token_strs with "return_token_strs": true, else null)."""
    allowed = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
    if unknown := sorted(set(body) - allowed):
        raise InvalidRequestError(f"unknown request field(s) {unknown}")
    if isinstance(body.get("prompt"), list) and "messages" not in body:
        # lm-eval's local-completions with --apply_chat_template sends the message list as "prompt"
        body = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": body["prompt"]}
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequestError("give exactly one of prompt (a string) or messages (a list)")
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise InvalidRequestError("prompt must be a string")
        ids = engine.tokenize(body["prompt"], add_special_tokens=_flag(body, "add_special_tokens", True))
    else:
        if not isinstance(body["messages"], list) or not body["messages"]:
            raise InvalidRequestError("messages must be a non-empty list")
        text = engine.apply_chat_template(body["messages"],
                                          add_generation_prompt=_flag(body, "add_generation_prompt", True))
        ids = engine.tokenize(text, add_special_tokens=_flag(body, "add_special_tokens", False))
    strs = ([engine.detokenize([t], skip_special_tokens=False) for t in ids]
            if _flag(body, "return_token_strs", False) else None)
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.info.max_context, "token_strs": strs}


def _detokenize(engine: Engine, body: dict[str, Any]) -> dict[str, Any]:
    """POST /detokenize, vLLM's shape: {"tokens": [ids]} -> {"prompt": text}. Special tokens are kept (as vLLM
    and a tokenizer's decode do) unless "skip_special_tokens": true."""
    if unknown := sorted(set(body) - {"model", "tokens", "skip_special_tokens"}):
        raise InvalidRequestError(f"unknown request field(s) {unknown}")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(_is_id(t) for t in ids):
        raise InvalidRequestError("tokens must be a list of token ids")
    return {"prompt": engine.detokenize(ids, skip_special_tokens=_flag(body, "skip_special_tokens", False))}


def _tokenizer_info(engine: Engine) -> dict[str, Any]:
    """GET /tokenizer_info: what lm-evaluation-harness's remote tokenizer reads (eos_token, bos_token, pad_token,
    chat_template) plus the context length: the chat template the engine renders (`info.chat_template`: from
    chat_template.jinja, tokenizer_config.json or a GGUF file's metadata), the tokens from the model directory's
    tokenizer_config.json; eos_token falls back to the text of the model's first EOS id."""
    path = engine.info.path
    cfg: dict[str, Any] = {}
    try:
        with open(os.path.join(path, "tokenizer_config.json"), encoding="utf-8") as f:
            loaded = json.load(f)
        if isinstance(loaded, dict):
            cfg = loaded
    except (OSError, ValueError):
        pass

    def token(key: str) -> str | None:
        v = cfg.get(key)
        if isinstance(v, dict):  # an AddedToken: {"content": ...}
            v = v.get("content")
        return v if isinstance(v, str) else None

    eos = token("eos_token")
    if eos is None and engine.info.eos_token_ids:
        eos = engine.detokenize(engine.info.eos_token_ids[:1], skip_special_tokens=False)
    return {"tokenizer_class": cfg.get("tokenizer_class") if isinstance(cfg.get("tokenizer_class"), str) else None,
            "eos_token": eos, "bos_token": token("bos_token"), "pad_token": token("pad_token"),
            "eos_token_ids": list(engine.info.eos_token_ids), "chat_template": engine.info.chat_template, "model_max_length": engine.info.max_context, "max_model_len": engine.info.max_context,
            "vocab_size": engine.info.vocab_size}


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

    async def read_body(request: Request) -> dict[str, Any]:
        """The request's JSON object, for the model this server serves (else _BodyTooLarge, _UnknownModel or
        InvalidRequestError)."""
        if request.headers.get("content-type", "").split(";")[0].strip().lower() != "application/json":
            raise InvalidRequestError("the request body must be JSON with Content-Type: application/json")
        raw = bytearray()
        async for piece in request.stream():
            raw += piece
            if len(raw) > max_body_bytes:
                raise _BodyTooLarge(f"request body is over this server's limit of {max_body_bytes} bytes")
        try:
            body = await anyio.to_thread.run_sync(json.loads, bytes(raw))  # large bodies parse off the event loop
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError):
            raise InvalidRequestError("request body is not valid JSON") from None
        if not isinstance(body, dict):
            raise InvalidRequestError("request body must be a JSON object")
        if body.get("model") not in (None, name):
            raise _UnknownModel(f"model '{body.get('model')}' does not exist; this server serves '{name}'")
        return body

    async def health(request: Request) -> JSONResponse:
        # open without the API key: load balancers and probes must reach it (it says nothing secret)
        return JSONResponse({"status": "ok", "model": name, "active": slots.active, "capacity": slots.capacity,
                             "batch": max_concurrency, "queue": queue, "pid": os.getpid()})

    async def models(request: Request) -> JSONResponse:
        if (r := check_auth(request)) is not None:
            return r
        return JSONResponse({"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "mbd-rs"}]})

    def echo_of(prompt: Any, logprobs: int | None) -> _Echo:
        """A prompt as echo returns it: its text (a token-id prompt detokenized as given), its ids, and with
        logprobs its tokens' left-to-right scores."""
        if isinstance(prompt, str):
            text, ids = prompt, engine.tokenize(prompt)
        else:
            text, ids = engine.detokenize(prompt, skip_special_tokens=False), list(prompt)
        entries: list[_Entry] | None = None
        if logprobs is not None:
            scores = engine.prompt_logprobs(ids, logprobs=logprobs)
            entries = [(ids[0], None, None)]
            entries += [(t.token_id, t.logprob, t.top_logprobs) for t in scores[1:] if t]
        return _Echo(text, ids, entries)

    def legacy_logprobs(entries: list[_Entry], offset: int) -> dict[str, list[Any]]:
        """/v1/completions' logprobs object for these tokens, their text offsets counted from `offset`."""
        out: dict[str, list[Any]] = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for t, lp, top in entries:
            s = piece(t)
            out["tokens"].append(s)
            out["token_logprobs"].append(lp)
            alts: dict[str, float] | None = None
            if top is not None:
                alts = {}
                for a, b in top:  # most likely first; two ids with one text keep the likelier
                    alts.setdefault(piece(a), b)
            out["top_logprobs"].append(alts)
            out["text_offset"].append(offset)
            offset += len(s)
        return out

    def chat_logprobs(entries: list[_Entry]) -> dict[str, Any]:
        """/v1/chat/completions' logprobs object for these tokens."""
        def item(t: int, lp: float | None) -> dict[str, Any]:
            s = piece(t)
            return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}
        return {"content": [dict(item(t, lp), top_logprobs=[item(a, b) for a, b in top or []])
                            for t, lp, top in entries], "refusal": None}

    def entries_of(lps: "list[TokenLogprob] | None", n_tokens: int, chat: bool) -> list[_Entry]:
        """The engine's log-probabilities of `n_tokens` tokens as entries. The engine adds the EOS that ended a
        generation: /v1/completions lists it (loglikelihood clients count on the generated token being there),
        chat's content entries stay the content's tokens."""
        return [(x.token_id, x.logprob, x.top_logprobs) for x in (lps or [])[:n_tokens if chat else None]]

    def logprobs_json(entries: list[_Entry], echo: "_Echo | None", chat: bool) -> dict[str, Any]:
        if chat:
            return chat_logprobs(entries)
        if echo is None:
            return legacy_logprobs(entries, 0)
        head = legacy_logprobs(echo.entries or [], 0)
        tail = legacy_logprobs(entries, len(echo.text))
        return {key: head[key] + tail[key] for key in head}

    def scored_only(e: _Echo) -> Usage:
        """The usage of an echo with max_tokens 0: the prompt, nothing generated."""
        return Usage(prompt_tokens=len(e.ids), completion_tokens=0, forward_passes=0, tokens_per_forward=0.0,
                     ttft_ms=0.0, prefill_ms=0.0, decode_ms=0.0, tokens_per_second=0.0, positions_forwarded=0)

    async def handle(request: Request, chat: bool) -> Response:
        if (r := check_auth(request)) is not None:
            return r
        lease = None
        try:
            body = await read_body(request)
            req = _body_params(body, chat)
            params, prompts, n = req.params, req.prompts, req.n
            k = len(prompts) * n
            if k > slots.capacity:
                raise InvalidRequestError(f"this request asks for {k} choices ({len(prompts)} prompt(s) x n={n}); "
                                          f"this server runs at most {slots.capacity} generations at once")
            lease = slots.try_acquire(k)
            if lease is None:
                return _error(503, f"server is at its limit of {max_concurrency} batched and {queue} queued "
                              "generations; retry later", "server_error", code="server_busy")
            seed: Any = params.get("seed")
            held = lease
            echoes: list[_Echo | None] = [None] * len(prompts)

            def start() -> None:
                for pi, prompt in enumerate(prompts):
                    if req.echo:
                        echo = echoes[pi] = echo_of(prompt, req.logprobs)
                        prompt = echo.ids  # the prompt generated from is the one scored
                    if not req.generates:
                        continue
                    for i in range(n):
                        # choice i samples with seed + i; a bad seed is left for the engine to refuse
                        ps = dict(params, seed=seed + i) if _is_id(seed) else params
                        held.streams.append(engine.stream_chat(prompt, **ps) if chat else engine.stream(prompt, **ps))

            await anyio.to_thread.run_sync(start)
            rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
            choice_echo = [echoes[i // n] for i in range(k)]
            if body.get("stream"):
                include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
                # the lease is released by the stream's end, or after the response if the client left first
                response: Response = StreamingResponse(sse(lease, req, choice_echo, rid, chat, include_usage, request),
                                                       media_type="text/event-stream",
                                                       headers={"Cache-Control": "no-cache"},
                                                       background=BackgroundTask(lease.release))
                lease = None
                return response
            finals: list[StreamChunk | None] = [None] * k
            if req.generates:
                q: Queue[_Item] = Queue()
                lease.pump(q)
                async for i, ch in chunks(q, k):
                    if ch.finish_reason:
                        finals[i] = ch
            else:
                finals = [StreamChunk("", [], "length", scored_only(e), None) for e in choice_echo if e is not None]
            streams = lease.streams
        except _REFUSALS as e:
            return _refusal(e)
        finally:
            if lease is not None:
                lease.release()
        usages = [f.usage for f in finals if f is not None and f.usage is not None]
        request.state.tokens = sum(u.completion_tokens for u in usages)
        choices: list[dict[str, Any]] = []
        for i, f in enumerate(finals):
            st = streams[i] if req.generates else None
            fin = f.finish_reason if f is not None else "cancelled"
            echo = choice_echo[i]
            text = (echo.text if echo is not None else "") + (st.text if st is not None else "")
            lp = None if req.logprobs is None else logprobs_json(
                entries_of(st.logprobs if st else None, len(st.token_ids) if st else 0, chat), echo, chat)
            if chat:
                choices.append({"index": i, "message": {"role": "assistant", "content": text},
                                "finish_reason": fin, "logprobs": lp})
            else:
                choices.append({"index": i, "text": text, "finish_reason": fin, "logprobs": lp})
        return JSONResponse({"id": rid, "object": "chat.completion" if chat else "text_completion",
                             "created": int(time.time()), "model": name, "choices": choices,
                             "usage": usage_json(usages, n)})

    async def chunks(q: "Queue[_Item]", k: int) -> AsyncIterator[tuple[int, StreamChunk]]:
        """(choice index, chunk) from k reader threads, as they come, until every stream has ended."""
        def get() -> _Item | None:
            try:  # a bounded wait, so a cancelled request stops waiting soon (works with any anyio)
                return q.get(timeout=0.25)
            except Empty:
                return None

        live = k
        while live:
            got = await anyio.to_thread.run_sync(get)
            if got is None:
                continue
            i, item = got
            if item is None:
                live -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item

    def usage_json(usages: list[Usage], n: int) -> dict[str, int | float]:
        """Usage of all choices: completion tokens and counters summed, each prompt counted once (its n choices
        share it)."""
        if len(usages) == 1:
            u = usages[0]
            return {"prompt_tokens": u.prompt_tokens, "completion_tokens": u.completion_tokens,
                    "total_tokens": u.total_tokens, "forward_passes": u.forward_passes,
                    "tokens_per_forward": u.tokens_per_forward, "verifications": u.verifications,
                    "drafts_proposed": u.drafts_proposed, "drafts_accepted": u.drafts_accepted}
        prompt = sum(u.prompt_tokens for u in usages[::n])
        comp = sum(u.completion_tokens for u in usages)
        fwd = sum(u.forward_passes for u in usages)
        return {"prompt_tokens": prompt, "completion_tokens": comp, "total_tokens": prompt + comp,
                "forward_passes": fwd, "tokens_per_forward": comp / fwd if fwd else 0.0,
                "verifications": sum(u.verifications for u in usages),
                "drafts_proposed": sum(u.drafts_proposed for u in usages),
                "drafts_accepted": sum(u.drafts_accepted for u in usages)}

    async def sse(lease: _Lease, req: _Body, choice_echo: "list[_Echo | None]", rid: str, chat: bool,
                  include_usage: bool, request: Request) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        now = int(time.time())
        k = len(choice_echo)

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

        # per choice: the text offset of its next token (/v1/completions' text_offset)
        offsets = [0] * k

        def choice(i: int, text: str, finish: str | None = None, role: bool = False,
                   lps: "list[TokenLogprob] | None" = None, n_tokens: int = 0) -> dict[str, Any]:
            lp = None
            entries = entries_of(lps, n_tokens, chat) if req.logprobs is not None else []
            if entries:
                lp = chat_logprobs(entries) if chat else legacy_logprobs(entries, offsets[i])
                if not chat:
                    offsets[i] += sum(len(t) for t in lp["tokens"])
            if chat:
                delta = {"role": "assistant", "content": text} if role else ({"content": text} if text else {})
                return {"index": i, "delta": delta, "finish_reason": finish, "logprobs": lp}
            return {"index": i, "text": text, "finish_reason": finish, "logprobs": lp}

        usages: list[Usage | None] = [None] * k
        try:
            if chat:
                for i in range(k):
                    yield event([choice(i, "", role=True)])
            for i, e in enumerate(choice_echo):
                if e is not None:  # the prompt first, with its scores
                    lp = None if req.logprobs is None else legacy_logprobs(e.entries or [], 0)
                    offsets[i] = len(e.text)
                    fin = None if req.generates else "length"
                    yield event([{"index": i, "text": e.text, "finish_reason": fin, "logprobs": lp}])
                    if not req.generates:
                        usages[i] = scored_only(e)
            if req.generates:
                q: Queue[_Item] = Queue()
                lease.pump(q)
                async for i, ch in chunks(q, k):
                    lps = ch.logprobs if req.logprobs is not None else None
                    c = choice(i, ch.text, ch.finish_reason, lps=lps, n_tokens=len(ch.token_ids))
                    if ch.step is not None:
                        yield event([c], step=step_json(ch.step))
                    elif ch.text or ch.finish_reason or c["logprobs"]:
                        yield event([c])
                    if ch.finish_reason:
                        usages[i] = ch.usage
            request.state.tokens = sum(len(s.token_ids) for s in lease.streams)
            if include_usage:
                done = [u for u in usages if u is not None]
                assert len(done) == k  # the last chunk of each stream carries its usage
                yield event([], usage_json(done, req.n))
            yield "data: [DONE]\n\n"
        finally:
            lease.release()  # cancels the generations first if the client went away mid-stream

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

    tok_info: dict[str, Any] = {}

    def tokenizer_info_json() -> dict[str, Any]:
        if not tok_info:
            tok_info.update(_tokenizer_info(engine))
        return tok_info

    async def tokenizer_info(request: Request) -> Response:
        if (r := check_auth(request)) is not None:
            return r
        return JSONResponse(await anyio.to_thread.run_sync(tokenizer_info_json))

    async def tokenizer_route(request: Request, encode: bool) -> Response:
        if (r := check_auth(request)) is not None:
            return r
        try:
            body = await read_body(request)
            if encode:
                return JSONResponse(await anyio.to_thread.run_sync(_tokenize, engine, body))
            return JSONResponse(await anyio.to_thread.run_sync(_detokenize, engine, body))
        except _REFUSALS as e:
            return _refusal(e)

    async def tokenize(request: Request) -> Response:
        return await tokenizer_route(request, encode=True)

    async def detokenize(request: Request) -> Response:
        return await tokenizer_route(request, encode=False)

    app = Starlette(routes=[
        Route("/", index, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
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

    eng = Engine.load(args.model, device=args.device, dtype=args.dtype, quantize=args.quantize,
                      int8_activations=args.int8_activations)
    app = create_app(eng, model_name=args.model_name, api_key=args.api_key, max_concurrency=args.max_concurrency,
                     max_queue=args.max_queue, max_body_bytes=args.max_body_bytes)
    print(f"mbd-rs: serving {eng.info.path} as '{args.model_name or os.path.basename(os.path.normpath(eng.info.path))}' "
          f"on http://{args.host}:{args.port}/v1", flush=True)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")  # the access log, on stderr
    uvicorn.run(app, host=args.host, port=args.port, log_level="warning")
    return 0

