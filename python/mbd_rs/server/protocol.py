"""The OpenAI request bodies as typed models (pydantic v2): the fields of /v1/completions and /v1/chat/completions,
each route's own, and the engine's parameters as fields generated from the core's `PARAMS` (name and help), so that
registry still owns every parameter's name and its rule. The models check the protocol's shapes (n, stream,
stream_options, user, messages, logprobs on chat); a parameter's value is the engine's to check, with the range in
its message. `openapi()` is the schema of the routes, served at /openapi.json."""
from __future__ import annotations

import json
from typing import Any, ClassVar, Literal

from pydantic import (BaseModel, ConfigDict, Field, SerializerFunctionWrapHandler, StrictBool, StrictInt, StrictStr,
                      ValidationError, create_model, model_serializer)

from .. import _core
from ..engine import GENERATION_PARAMS
from ..errors import InvalidRequestError
from .limits import MAX_N, PROGRESS_EVERY

# OpenAI's own names among the engine's parameters ("logprobs" is OpenAI's field, typed per route below).
OPENAI_PARAMS = ("max_tokens", "temperature", "top_p", "stop", "seed", "response_format", "presence_penalty",
                 "frequency_penalty", "logit_bias")
# The engine's parameters a body may carry besides OpenAI's: the diffusion knobs and the rest (docs/parameters.md).
EXTENSIONS = tuple(k for k in GENERATION_PARAMS if k not in OPENAI_PARAMS and k != "logprobs")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = Field(default=False, description="a last event with the usage of all choices")
    include_progress: StrictBool = Field(default=False, description="while a prompt's prefill runs, an event with "
                                         "\"mbd_progress\" (per choice: prompt tokens computed and in all) each "
                                         f"time it moves, looked at every {PROGRESS_EVERY:g} s (an mbd-rs extension)")


def _param_fields() -> dict[str, Any]:
    """A field per engine parameter, any JSON value (the engine checks it), documented by its PARAMS help."""
    return {k: (Any, Field(None, description=_core.PARAMS[k]["help"]
                           + ("" if k in OPENAI_PARAMS else " (an mbd-rs extension)")))
            for k in OPENAI_PARAMS + EXTENSIONS}


class _Request(BaseModel):
    """Fields both routes have. A field sent as null means its default, as OpenAI treats it (dropped before
    validation)."""
    model_config = ConfigDict(extra="forbid")
    model: StrictStr | None = Field(None, description="the served model's name (the only one this server has)")
    stream: StrictBool = Field(False, description="answer as server-sent events")
    stream_options: StreamOptions | None = None
    n: StrictInt = Field(1, ge=1, le=MAX_N, description=f"completions per prompt, 1 to {MAX_N}")
    user: StrictStr | None = None
    max_completion_tokens: Any = Field(None, description="OpenAI's newer name of max_tokens (wins over it)")


CompletionRequest = create_model(
    "CompletionRequest", __base__=_Request, __doc__="POST /v1/completions.",
    prompt=(Any, Field(None, description="a string, a list of token ids, a list of strings or a list of token-id lists")),
    echo=(StrictBool, Field(False, description="prepend the prompt to each completion")),
    logprobs=(Any, Field(None, description="alternatives per token, 0 to 20 (null: no log-probabilities)")),
    **_param_fields())

ChatCompletionRequest = create_model(
    "ChatCompletionRequest", __base__=_Request, __doc__="POST /v1/chat/completions.",
    messages=(list[Any], Field(min_length=1, description="the conversation; content a string or a list of text "
                               "parts")),
    logprobs=(StrictBool, Field(False, description="log-probabilities of the tokens (top_logprobs: how many "
                                "alternatives)")),
    top_logprobs=(Any, Field(None, description="alternatives per token, 0 to 20; needs logprobs: true")),
    tools=(list[Any] | None, Field(None, description="functions the model may call (OpenAI's shape)")),
    tool_choice=(Any, Field(None, description="'none', 'auto', 'required' or {\"type\": \"function\", ...}")),
    parallel_tool_calls=(StrictBool | None, Field(None, description="whether a turn may call several tools")),
    **_param_fields())

# What a refused field's message says, where the protocol has a rule of its own (else pydantic's words, with the
# field's path).
_RULES = {"n": f"n must be an integer from 1 to {MAX_N}", "stream": "stream must be true or false",
          "stream_options": "stream_options must be an object like {\"include_usage\": true}",
          "echo": "echo must be true or false",
          "user": "user must be a string", "model": "model must be a string",
          "messages": "messages must be a non-empty list",
          "logprobs": "logprobs must be true or false on /v1/chat/completions (top_logprobs: how many alternatives)",
          "parallel_tool_calls": "parallel_tool_calls must be true or false", "tools": "tools must be a list"}

# Rules whose message also shows the value sent.
_SHOW_VALUE = ("n",)


def validate(body: dict[str, Any], chat: bool) -> BaseModel:
    """The body as its route's model, or an InvalidRequestError naming the field (`param`) and its rule. Unknown
    fields are listed together, said to be neither OpenAI's nor this server's extensions."""
    model = ChatCompletionRequest if chat else CompletionRequest
    try:
        return model.model_validate({k: v for k, v in body.items() if v is not None})
    except ValidationError as e:
        errors = e.errors()
    extra = sorted(str(x["loc"][0]) for x in errors if x["type"] == "extra_forbidden")
    if extra:
        raise InvalidRequestError(f"unknown request field(s) {extra}: neither OpenAI's nor one of this server's "
                                  "extensions (docs/parameters.md)")
    first = errors[0]
    field = str(first["loc"][0]) if first["loc"] else ""
    path = ".".join(str(p) for p in first["loc"])
    rule = _RULES.get(field)
    if rule is not None and field in _SHOW_VALUE and "input" in first:
        rule += f" (got {json.dumps(first['input'], default=str)[:40]})"
    err = InvalidRequestError(rule or f"{path}: {first['msg']}")
    err.param = field or None
    raise err


def set_fields(req: BaseModel) -> dict[str, Any]:
    """The engine's parameters the request set."""
    return {k: getattr(req, k) for k in OPENAI_PARAMS + EXTENSIONS if getattr(req, k) is not None}


class _Out(BaseModel):
    """A response object: the fields in OpenAI's order; those named in `_omit` are left out when None (OpenAI
    sends them only when they say something), the others sent as null."""
    model_config = ConfigDict(extra="forbid")
    _omit: ClassVar[frozenset[str]] = frozenset()

    @model_serializer(mode="wrap")
    def _drop_absent(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        d: dict[str, Any] = handler(self)
        return {k: v for k, v in d.items() if not (v is None and k in self._omit)}


class ErrorBody(_Out):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Out):
    """Every refusal, on every route."""
    error: ErrorBody


class PromptTokensDetails(_Out):
    cached_tokens: int = Field(description="prompt tokens read from the prefix cache (each prompt once)")


class Usage(_Out):
    """The usage of all choices: completion tokens and counters summed, each prompt counted once."""
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    forward_passes: int = Field(description="forwards run (an mbd-rs extension, as the fields after it)")
    tokens_per_forward: float
    verifications: int
    drafts_proposed: int
    drafts_accepted: int
    forced_tokens: int = Field(description="tokens a grammar forced, written without a forward")
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(_Out):
    """/v1/completions' log-probabilities, token by token."""
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class TopLogprob(_Out):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Out):
    """/v1/chat/completions' log-probabilities: each content token's text, real bytes and alternatives."""
    content: list[ChatTokenLogprob]
    refusal: None = None


class FunctionCall(_Out):
    name: str
    arguments: str = Field(description="the arguments, a JSON object as a string")


class ToolCall(_Out):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Out):
    _omit = frozenset({"tool_calls"})
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class CompletionChoice(_Out):
    index: int
    text: str
    finish_reason: str | None
    logprobs: CompletionLogprobs | None = None


class ChatChoice(_Out):
    index: int
    message: ChatMessage
    finish_reason: str | None
    logprobs: ChatLogprobs | None = None


class _Response(_Out):
    id: str
    object: str
    created: int
    model: str
    system_fingerprint: str


class Completion(_Response):
    """POST /v1/completions' answer."""
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]
    usage: Usage


class ChatCompletion(_Response):
    """POST /v1/chat/completions' answer."""
    object: Literal["chat.completion"] = "chat.completion"
    choices: list[ChatChoice]
    usage: Usage


class ToolCallDelta(_Out):
    _omit = frozenset({"id", "type", "function"})
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: dict[str, str] | None = Field(None, description="the name (once, first), then arguments in fragments")


class ChatDelta(_Out):
    _omit = frozenset({"role", "content", "tool_calls"})
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(_Out):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChatLogprobs | None = None


class Step(_Out):
    """One forward pass, with "trace" (an mbd-rs extension; what the web view draws)."""
    index: int
    decoded: list[int] = Field(description="offsets from the prompt's end this forward decoded")
    blocks: list[Any] = Field(description="(start, end, state) per generation block")
    tokens_per_forward: float
    positions_per_forward: float
    end: int | None = Field(description="where the text ends (the first end-of-text token), null while none")
    canvas: list[str | None] | None = Field(description="the generated region's token texts, null for masks "
                                            "(trace \"canvas\")")


class Progress(_Out):
    """A choice's prompt prefill, with stream_options.include_progress (an mbd-rs extension)."""
    index: int
    prompt_tokens: int
    computed_tokens: int


class _Chunk(_Response):
    _omit = frozenset({"usage", "mbd_step", "mbd_progress"})
    usage: Usage | None = Field(None, description="the last event's, with stream_options.include_usage")
    mbd_step: Step | None = None
    mbd_progress: list[Progress] | None = None


class CompletionChunk(_Chunk):
    """An event of a streaming /v1/completions answer."""
    object: Literal["text_completion"] = "text_completion"
    choices: list[CompletionChoice]


class ChatCompletionChunk(_Chunk):
    """An event of a streaming /v1/chat/completions answer."""
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    choices: list[ChatChunkChoice]


#: The response objects, each a schema of /openapi.json.
RESPONSES = (ErrorResponse, Completion, ChatCompletion, CompletionChunk, ChatCompletionChunk)


def openapi(version: str) -> dict[str, Any]:
    """OpenAPI 3.1 for the routes: the request bodies and the response objects from the models (an error object on
    every refusal; a streaming answer's events are its route's chunk objects)."""
    schemas: dict[str, Any] = {}
    for m in (CompletionRequest, ChatCompletionRequest) + RESPONSES:
        sch = m.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(sch.pop("$defs", {}))
        schemas[m.__name__] = sch

    def ref(name: str) -> dict[str, Any]:
        return {"$ref": f"#/components/schemas/{name}"}
    err = {"description": "refused: an OpenAI error object", "content": {"application/json": {
        "schema": ref("ErrorResponse")}}}

    def post(name: str, answer: str, chunk: str, summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": ref(name)}}}, "responses": {
                "200": {"description": f"the answer; with stream: true, server-sent events, each data line a {chunk} "
                        "and the last \"[DONE]\"", "content": {"application/json": {"schema": ref(answer)},
                                                                "text/event-stream": {"schema": ref(chunk)}}},
                "400": err, "401": err, "404": err, "413": err, "429": err, "503": err}}}

    def get(summary: str) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}, "404": err}}}

    def vllm(summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"type": "object"}}}}, "responses": {"200": {"description": "OK"}, "400": err}}}

    return {"openapi": "3.1.0", "info": {"title": "mbd-rs", "version": version,
                                         "description": "OpenAI-compatible routes of `mbd-rs serve` (docs/server.md)"},
            "paths": {"/v1/completions": post("CompletionRequest", "Completion", "CompletionChunk",
                                              "a completion of each prompt"),
                      "/v1/chat/completions": post("ChatCompletionRequest", "ChatCompletion", "ChatCompletionChunk",
                                                   "the next turn of a conversation"),
                      "/v1/models": get("the served model"), "/v1/models/{model}": get("one model by name"),
                      "/tokenize": vllm("text or messages to token ids (vLLM's route)"),
                      "/detokenize": vllm("token ids to text (vLLM's route)"),
                      "/tokenizer_info": get("the tokenizer's special tokens and chat template (vLLM's route)"),
                      "/health": get("status, limits and load"), "/metrics": get("Prometheus metrics")},
            "components": {"schemas": schemas}}
