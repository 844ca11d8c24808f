"""The OpenAI protocol (and vLLM's tokenizer routes): request bodies (typed in `protocol`) turned into engine parameters
(`body_params`), the engine's results shaped as OpenAI's JSON (log-probabilities in the legacy and the chat
shapes, usage), and the refusals as OpenAI error objects. No HTTP here: the routes are `app`'s."""
from __future__ import annotations

import codecs
import json
import os
from typing import Any

from starlette.responses import JSONResponse

from .. import _core
from ..engine import CancelToken, Engine
from ..errors import ContextLengthError, InvalidRequestError, MbdError
from ..tools import ToolPlan
from ..types import StepEvent, TokenLogprob, ToolCall, Usage
from . import protocol

# OpenAI fields this server does not support, with the values that mean "off" (sent by many clients by default);
# any other value is refused by name, "not supported by this server", never as an unknown field.
_UNSUPPORTED_UNLESS: dict[str, tuple[Any, ...]] = {
    "suffix": (None, ""), "best_of": (None, 1), "store": (None, False), "metadata": (None, {}), "service_tier": (None, "auto", "default"),
    "modalities": (None, ["text"]), "audio": (None,), "prediction": (None,), "reasoning_effort": (None,),
    "web_search_options": (None,), "functions": (None,), "function_call": (None,), "verbosity": (None,),
    "prompt_cache_key": (None,), "safety_identifier": (None,)}
# Fields of the other route: what a request that sends one on this route is told (indexed by "is it chat").
_ELSEWHERE = {True: {"echo": "echo applies to /v1/completions only"},
              False: {k: "tools, tool_choice and parallel_tool_calls apply to /v1/chat/completions"
                      for k in ("tools", "tool_choice", "parallel_tool_calls")}
              | {"top_logprobs": "top_logprobs applies to /v1/chat/completions; on /v1/completions logprobs is the "
                 "number of alternatives"}}
# Why, where a word helps.
_INSTEAD = {"functions": "use tools", "function_call": "use tool_choice", "audio": "this server writes text only",
            "modalities": "this server writes text only", "reasoning_effort": "the models served here do not reason "
            "in a separate channel", "prompt_cache_key": "the prefix cache matches prompts by their tokens"}
# With "trace" (streaming only), every forward pass is also an SSE event carrying "mbd_step": the blocks, the
# positions it decoded and the canvas as token pieces (what the live web view at / draws).


# (token id, logprob or None for a prompt's first token, alternatives or None)
Entry = tuple[int, "float | None", "list[tuple[int, float]] | None"]


class Echo:
    """A prompt as echo returns it: text, token ids, and (with logprobs) its tokens' scores."""

    def __init__(self, text: str, ids: list[int], entries: "list[Entry] | None"):
        self.text, self.ids, self.entries = text, ids, entries


class BodyTooLarge(Exception):
    pass


class UnknownModel(Exception):
    pass


class BodyTimeout(Exception):
    pass


class ClientGone(Exception):
    """The client closed its connection before its request body arrived."""


def error(status: int, message: str, type_: str = "invalid_request_error", code: str | None = None,
           param: str | None = None) -> JSONResponse:
    body = protocol.ErrorResponse(error=protocol.ErrorBody(message=message, type=type_, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status)


#: What a POST route answers for a refused request (each route catches these and passes them to `refusal`).
REFUSALS = (BodyTooLarge, BodyTimeout, ClientGone, UnknownModel, InvalidRequestError, TypeError, MbdError)


def refusal(e: Exception) -> JSONResponse:
    """The error response for a refused request. A body left unread (too large, too slow) closes the connection
    after the response (`Connection: close`): what is left of it would otherwise be read as the next request. A
    client gone gets 499, which nobody reads (it is the access log's line)."""
    if isinstance(e, (BodyTooLarge, BodyTimeout)):
        r = error(413, str(e)) if isinstance(e, BodyTooLarge) else error(408, str(e), code="request_timeout")
        r.headers["connection"] = "close"
        return r
    if isinstance(e, ClientGone):
        return error(499, str(e), code="client_closed")
    if isinstance(e, UnknownModel):
        return error(404, str(e), code="model_not_found")
    if isinstance(e, ContextLengthError):
        return error(400, str(e), code="context_length_exceeded")
    if isinstance(e, (InvalidRequestError, TypeError)):
        return error(400, str(e), param=getattr(e, "param", None))
    return error(500, str(e), "server_error")


class Body:
    """A validated request: the engine's parameters, the prompts (chat: the one message list), n, echo, and
    `logprobs` (alternatives per token, None = off); for a chat, `tools` (mbd_rs.tools.ToolPlan: the tools for the
    template, the call format the output is read in; the grammar is in `params`); `stream`, the stream options of
    a streaming request (None: not streaming)."""

    def __init__(self, params: dict[str, Any], prompts: list[Any], n: int, echo: bool, logprobs: int | None,
                 tools: "ToolPlan | None" = None, stream: "protocol.StreamOptions | None" = None):
        self.params, self.prompts, self.n, self.echo, self.logprobs = params, prompts, n, echo, logprobs
        self.tools = tools
        #: server-sent events (None: one JSON response), with their options
        self.stream = stream

    @property
    def generates(self) -> bool:
        """False for echo with max_tokens 0: the prompt is scored, nothing generated."""
        return not (self.echo and self.params.get("max_tokens") == 0)


def body_params(body: dict[str, Any], chat: bool, engine: Engine) -> Body:
    """Validate the whole body (before any slot is taken) against its route's model (`protocol`), then the rules
    between fields: the engine's parameters, the prompts (chat: the one message list), n, echo, logprobs and (chat)
    the tools, as `engine` takes them. Parameter values are checked by the engine."""
    for k, off in _UNSUPPORTED_UNLESS.items():
        if k in body and not any(body[k] == v and isinstance(body[k], bool) == isinstance(v, bool) for v in off):
            why = f"; {_INSTEAD[k]}" if k in _INSTEAD else ""
            e = InvalidRequestError(f"{k} is not supported by this server (got {json.dumps(body[k])[:80]}){why}")
            e.param = k
            raise e
    body = {k: v for k, v in body.items() if k not in _UNSUPPORTED_UNLESS}
    for k in _ELSEWHERE[chat]:
        if body.get(k) is not None:
            raise InvalidRequestError(_ELSEWHERE[chat][k])
    req: Any = protocol.validate(body, chat)
    if req.stream_options is not None and not req.stream:
        raise InvalidRequestError("stream_options needs stream: true")
    if req.trace not in (None, False) and not req.stream:
        raise InvalidRequestError("trace needs stream: true (its events are server-sent)")
    stream = (req.stream_options or protocol.StreamOptions()) if req.stream else None
    p = protocol.set_fields(req)
    if req.max_completion_tokens is not None:
        p["max_tokens"] = req.max_completion_tokens
    n = req.n
    if chat:
        if req.top_logprobs is not None and not req.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        logprobs = (0 if req.top_logprobs is None else req.top_logprobs) if req.logprobs else None
        prompts = [req.messages]
        if req.tools is not None:
            if logprobs is not None and req.tool_choice != "none":
                raise InvalidRequestError("tools (with tool_choice other than 'none') do not combine with logprobs in "
                                          "this version")
            plan = engine.tool_plan(req.tools, req.tool_choice, req.parallel_tool_calls,
                                    p if logprobs is None else {**p, "logprobs": logprobs})
            return Body(plan.params, prompts, n, False, logprobs, plan, stream)
        if req.tool_choice not in (None, "none", "auto") or req.parallel_tool_calls is not None:
            raise InvalidRequestError("tool_choice and parallel_tool_calls need tools")
        echo = False
    else:
        echo = req.echo
        logprobs = req.logprobs
        prompts = _prompts(req.prompt)
    if logprobs is not None:
        p["logprobs"] = logprobs  # its range is the engine's rule
    return Body(p, prompts, n, echo, logprobs, stream=stream)


def is_id(x: Any) -> bool:
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
    if all(is_id(t) for t in prompt):
        return [prompt]
    if all(isinstance(x, str) for x in prompt):
        return list(prompt)
    if all(isinstance(x, list) for x in prompt):
        for i, x in enumerate(prompt):
            if not x or not all(is_id(t) for t in x):
                raise InvalidRequestError(f"prompt[{i}] must be a non-empty list of token ids")
        return list(prompt)
    raise InvalidRequestError(f"prompt must be {shapes}; lists may not mix these")


def flag(body: dict[str, Any], key: str, default: bool) -> bool:
    v = body.get(key)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise InvalidRequestError(f"{key} must be true or false")
    return v


def tokenize(shapes: Shapes, body: dict[str, Any]) -> dict[str, Any]:
    """POST /tokenize, vLLM's shape: {"prompt": text, "add_special_tokens": true} or {"messages": [...],
    "add_generation_prompt": true, "add_special_tokens": false} -> {"tokens", "count", "max_model_len",
    "token_strs"} (token_strs with "return_token_strs": true, else null). Messages give exactly the ids a chat
    generation runs on (`Engine.chat_ids`: contents stay text), with add_special_tokens the tokenizer's own
    special tokens (a BOS) around them."""
    allowed = {"model", "prompt", "messages", "add_special_tokens", "add_generation_prompt", "return_token_strs"}
    if unknown := sorted(set(body) - allowed):
        raise InvalidRequestError(f"unknown request field(s) {unknown}")
    if isinstance(body.get("prompt"), list) and "messages" not in body:
        # lm-eval's local-completions with --apply_chat_template sends the message list as "prompt"
        body = {**{k: v for k, v in body.items() if k != "prompt"}, "messages": body["prompt"]}
    if ("prompt" in body) == ("messages" in body):
        raise InvalidRequestError("give exactly one of prompt (a string) or messages (a list)")
    engine = shapes.engine
    if "prompt" in body:
        if not isinstance(body["prompt"], str):
            raise InvalidRequestError("prompt must be a string")
        ids = engine.tokenize(body["prompt"], add_special_tokens=flag(body, "add_special_tokens", True))
    else:
        if not isinstance(body["messages"], list) or not body["messages"]:
            raise InvalidRequestError("messages must be a non-empty list")
        ids = engine.chat_ids(body["messages"], add_generation_prompt=flag(body, "add_generation_prompt", True))
        if flag(body, "add_special_tokens", False):
            before, after = shapes.special_tokens_around()
            ids = before + ids + after
    strs = [shapes.piece(t) for t in ids] if flag(body, "return_token_strs", False) else None
    return {"tokens": ids, "count": len(ids), "max_model_len": engine.info.max_context, "token_strs": strs}


def special_tokens_around(engine: Engine) -> tuple[list[int], list[int]]:
    """The ids the tokenizer adds before and after a text with add_special_tokens (a BOS; none for Qwen's)."""
    bare = engine.tokenize("a", add_special_tokens=False)
    full = engine.tokenize("a", add_special_tokens=True)
    for i in range(len(full) - len(bare) + 1):
        if full[i:i + len(bare)] == bare:
            return full[:i], full[i + len(bare):]
    return [], []


def detokenize(shapes: Shapes, body: dict[str, Any]) -> dict[str, Any]:
    """POST /detokenize, vLLM's shape: {"tokens": [ids]} -> {"prompt": text}. Special tokens are kept (as vLLM
    and a tokenizer's decode do) unless "skip_special_tokens": true."""
    if unknown := sorted(set(body) - {"model", "tokens", "skip_special_tokens"}):
        raise InvalidRequestError(f"unknown request field(s) {unknown}")
    ids = body.get("tokens")
    if not isinstance(ids, list) or not all(is_id(t) for t in ids):
        raise InvalidRequestError("tokens must be a list of token ids")
    skip = flag(body, "skip_special_tokens", False)
    return {"prompt": shapes.engine.detokenize(ids, skip_special_tokens=skip)}


def tokenizer_info(engine: Engine) -> dict[str, Any]:
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




class TextOffsets:
    """/v1/completions' text_offset, token by token: where in the text each token's first character starts. Offsets
    advance by the characters a token's bytes complete, so the tokens of a character split across tokens share its
    offset and the offsets spell the text."""

    def __init__(self, start: int = 0):
        self.at = start
        self._utf8 = codecs.getincrementaldecoder("utf-8")("replace")

    def next(self, token_bytes: bytes) -> int:
        at = self.at
        self.at += len(self._utf8.decode(token_bytes))
        return at


class Shapes:
    """The engine's results in OpenAI's shapes, for one server: token texts and bytes (special tokens included,
    cached per server), log-probability objects, usage and the web view's step events."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self._pieces: dict[int, str] = {}
        self._bytes: dict[int, bytes] = {}
        self._around: tuple[list[int], list[int]] | None = None

    def special_tokens_around(self) -> tuple[list[int], list[int]]:
        """`special_tokens_around` of this server's engine, found once."""
        if self._around is None:
            self._around = special_tokens_around(self.engine)
        return self._around

    def piece(self, t: int) -> str:
        """A token's text as the web view and /tokenize's token_strs show it (special tokens included)."""
        if t not in self._pieces:
            self._pieces[t] = self.engine.detokenize([t], skip_special_tokens=False)
        return self._pieces[t]

    def token_bytes(self, t: int) -> bytes:
        if t not in self._bytes:
            self._bytes[t] = self.engine.token_bytes([t])[0]
        return self._bytes[t]

    def token_str(self, t: int, legacy: bool) -> str:
        """A token as the logprobs show it: its text; a token whose bytes are not UTF-8 alone (part of a character)
        as OpenAI shows it, its bytes escaped: "\\xe2\\x80" in chat (beside its `bytes`), "bytes:\\xe2\\x80" in the
        legacy completions shape."""
        b = self.token_bytes(t)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            escaped = b.decode("utf-8", "backslashreplace")
            return "bytes:" + escaped if legacy else escaped

    def prompt_ids(self, prompt: Any, chat: bool, tools: "list[Any] | None" = None) -> list[int]:
        """The ids a prompt generates from: a chat's message list rendered (`Engine.chat_ids`, exactly what
        `stream_chat` runs on; with the tool definitions `tools`), a text tokenized as `stream` does, token ids as
        given."""
        if chat:
            return self.engine.chat_ids(prompt, tools=tools)
        if isinstance(prompt, str):
            return self.engine.tokenize(prompt)
        return list(prompt)

    def echo_of(self, prompt: Any, ids: list[int], logprobs: int | None, cancel: CancelToken) -> Echo:
        """A prompt as echo returns it: its text (a token-id prompt detokenized as given), its ids, and with
        logprobs its tokens' left-to-right scores (stopped by `cancel`: RequestCancelledError)."""
        text = prompt if isinstance(prompt, str) else self.engine.detokenize(ids, skip_special_tokens=False)
        entries: list[Entry] | None = None
        if logprobs is not None:
            scores = self.engine.prompt_logprobs(ids, logprobs=logprobs, cancel=cancel)
            entries = [(ids[0], None, None)]
            entries += [(t.token_id, t.logprob, t.top_logprobs) for t in scores[1:] if t]
        return Echo(text, ids, entries)

    def legacy_logprobs(self, entries: list[Entry], offsets: TextOffsets) -> protocol.CompletionLogprobs:
        """/v1/completions' logprobs object for these tokens, their text offsets from `offsets` (which advances)."""
        out = protocol.CompletionLogprobs(tokens=[], token_logprobs=[], top_logprobs=[], text_offset=[])
        for t, lp, top in entries:
            out.tokens.append(self.token_str(t, legacy=True))
            out.token_logprobs.append(lp)
            alts: dict[str, float] | None = None
            if top is not None:
                alts = {}
                for a, b in top:  # most likely first; two ids with one text keep the likelier
                    alts.setdefault(self.token_str(a, legacy=True), b)
            out.top_logprobs.append(alts)
            out.text_offset.append(offsets.next(self.token_bytes(t)))
        return out

    def chat_logprobs(self, entries: list[Entry]) -> protocol.ChatLogprobs:
        """/v1/chat/completions' logprobs object for these tokens: each token's text and its real bytes."""
        def item(t: int, lp: float | None) -> dict[str, Any]:
            return {"token": self.token_str(t, legacy=False), "logprob": lp, "bytes": list(self.token_bytes(t))}
        return protocol.ChatLogprobs(content=[protocol.ChatTokenLogprob(
            **item(t, lp), top_logprobs=[protocol.TopLogprob(**item(a, b)) for a, b in top or []])
            for t, lp, top in entries])

    def logprobs_json(self, entries: list[Entry], echo: "Echo | None",
                      chat: bool) -> "protocol.ChatLogprobs | protocol.CompletionLogprobs":
        if chat:
            return self.chat_logprobs(entries)
        offsets = TextOffsets()
        if echo is None:
            return self.legacy_logprobs(entries, offsets)
        head = self.legacy_logprobs(echo.entries or [], offsets)
        tail = self.legacy_logprobs(entries, TextOffsets(len(echo.text)))
        return protocol.CompletionLogprobs(tokens=head.tokens + tail.tokens,
                                           token_logprobs=head.token_logprobs + tail.token_logprobs,
                                           top_logprobs=head.top_logprobs + tail.top_logprobs,
                                           text_offset=head.text_offset + tail.text_offset)

    def step_json(self, ev: StepEvent) -> protocol.Step:
        """A forward pass as the web view's "mbd_step" event; `end` is where the text ends (the first end-of-text
        token: EOS or the request's stop_token_ids; None while there is none), and what the decoder wrote after it
        is fill the view collapses."""
        return protocol.Step(index=ev.index, decoded=ev.decoded, blocks=ev.blocks,
                             tokens_per_forward=ev.tokens_per_forward, positions_per_forward=ev.positions_per_forward,
                             end=ev.end, canvas=None if ev.canvas is None else [
                                 None if t < 0 else self.piece(t) for t in ev.canvas])


def fit_positions(n_prompt: int, params: dict[str, Any], cap: int, context: int) -> dict[str, Any]:
    """A request's parameters for a prompt of `n_prompt` tokens under the server's cap on the positions one request
    spans (prompt + max_tokens <= cap): ContextLengthError when it cannot fit, before any work; an absent
    max_tokens becomes what the cap leaves when the engine's default (up to 256, what the context leaves) would
    pass it."""
    raw = params.get("max_tokens")
    mt = raw if isinstance(raw, int) and not isinstance(raw, bool) and 0 <= raw < 1 << 64 else None
    if n_prompt > cap or n_prompt == cap and mt != 0:
        raise ContextLengthError(f"the prompt has {n_prompt} tokens; this server takes at most {cap} tokens per "
                                 "request, prompt and completion (--max-prompt-tokens)")
    if mt is None:  # absent, or bad (the engine refuses it, naming it)
        default = max(1, min(_core.DEFAULT_MAX_TOKENS, context - n_prompt))
        return params if raw is not None or n_prompt + default <= cap else dict(params, max_tokens=cap - n_prompt)
    if n_prompt + mt > cap:
        raise ContextLengthError(f"this server takes at most {cap} tokens per request, prompt and completion "
                                 f"(--max-prompt-tokens); requested {n_prompt + mt} ({n_prompt} prompt + {mt} "
                                 "completion)")
    return params


def entries_of(lps: "list[TokenLogprob] | None", n_tokens: int, chat: bool) -> list[Entry]:
    """The engine's log-probabilities of `n_tokens` tokens as entries. The engine adds the EOS that ended a
    generation: /v1/completions lists it (loglikelihood clients count on the generated token being there),
    chat's content entries stay the content's tokens."""
    return [(x.token_id, x.logprob, x.top_logprobs) for x in (lps or [])[:n_tokens if chat else None]]


def scored_only(e: Echo) -> Usage:
    """The usage of an echo with max_tokens 0: the prompt, nothing generated."""
    return Usage(prompt_tokens=len(e.ids), completion_tokens=0, forward_passes=0, tokens_per_forward=0.0,
                 ttft_ms=0.0, prefill_ms=0.0, decode_ms=0.0, tokens_per_second=0.0, positions_forwarded=0)


def tool_calls_json(calls: "list[ToolCall]") -> list[protocol.ToolCall]:
    """A message's `tool_calls`, OpenAI's shape."""
    return [protocol.ToolCall(id=c.id, function=protocol.FunctionCall(name=c.name, arguments=c.arguments))
            for c in calls]


def usage_json(usages: list[Usage], n: int) -> protocol.Usage:
    """Usage of all choices: completion tokens and counters summed, each prompt counted once (its n choices
    share it)."""
    prompt = sum(u.prompt_tokens for u in usages[::n])
    comp = sum(u.completion_tokens for u in usages)
    fwd = sum(u.forward_passes for u in usages)
    return protocol.Usage(
        prompt_tokens=prompt, completion_tokens=comp, total_tokens=prompt + comp, forward_passes=fwd,
        tokens_per_forward=comp / fwd if fwd else 0.0, verifications=sum(u.verifications for u in usages),
        drafts_proposed=sum(u.drafts_proposed for u in usages), drafts_accepted=sum(u.drafts_accepted for u in usages),
        forced_tokens=sum(u.forced_tokens for u in usages),
        # OpenAI's field: prompt tokens read from the prefix cache (each prompt once, as prompt_tokens)
        prompt_tokens_details=protocol.PromptTokensDetails(cached_tokens=sum(u.cached_tokens for u in usages[::n])))
