"""OpenAI-compatible HTTP server (`mbd-rs serve`; needs the [server] extra: starlette, uvicorn, prometheus_client).
A package: `app` (the routes, auth, body limits, server-sent events, the access log), `openai` (request bodies to
engine parameters, results to OpenAI's shapes), `slots` (admission), `net` (connections: header timeout, connection
cap, open-files limit, shutdown, the Host check and framing headers), `metrics` (/metrics, system_fingerprint),
`limits` (the defaults, importable without the extra).

Endpoints: GET /health, GET /metrics, GET /v1/models, GET /v1/models/{id}, POST /v1/completions,
POST /v1/chat/completions, with `stream: true` as server-sent events in OpenAI's chunk format (a ": keep-alive"
comment when no event has gone out for `keepalive` seconds). Every response carries `X-Request-Id` (the client's,
when it sent one); unknown routes and methods get OpenAI error JSON (404, 405). Diffusion knobs are accepted as extra body fields. Tokenizer
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

Limits: bodies must be `application/json` (so a web page cannot post to a local server without CORS), at most
`max_body_bytes` (413, on a Content-Length before the body is read) and arrive within `body_timeout` of their
headers (408); the whole body is validated before a generation slot is taken, and the slot is released on
every path (finish, error, cancel, disconnect). Fields we do not support are refused with 400, never ignored.
A request spans at most `max_prompt_tokens` positions (prompt + max_tokens: 400 context_length_exceeded before
any work), runs at most `request_timeout` seconds, and is cancelled when its client leaves or the server stops
(SIGTERM). Responses may not be framed (X-Frame-Options, CSP frame-ancestors), and `mbd-rs serve` answers only to
the Host names of its bound address (--allowed-hosts for more).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .limits import BODY_TIMEOUT, MAX_BODY_BYTES, MAX_N, MAX_PROMPT_TOKENS, REQUEST_TIMEOUT

if TYPE_CHECKING:
    from .app import create_app, serve

__all__ = ["create_app", "serve", "BODY_TIMEOUT", "MAX_BODY_BYTES", "MAX_N", "MAX_PROMPT_TOKENS", "REQUEST_TIMEOUT"]


def __getattr__(name: str) -> Any:
    """create_app and serve, imported on first use (they need starlette; the limits do not)."""
    if name in ("create_app", "serve"):
        from . import app
        return getattr(app, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
