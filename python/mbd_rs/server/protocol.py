"""The OpenAI request bodies as typed models (pydantic v2): the fields of /v1/completions and /v1/chat/completions,
each route's own, and the engine's parameters as fields generated from the core's `PARAMS` (name and help), so that
registry still owns every parameter's name and its rule. The models check the protocol's shapes (n, stream,
stream_options, user, messages, logprobs on chat); a parameter's value is the engine's to check, with the range in
its message. `openapi()` is the schema of the routes, served at /openapi.json."""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, ValidationError, create_model

from .. import _core
from ..engine import GENERATION_PARAMS
from ..errors import InvalidRequestError
from .limits import MAX_N

# OpenAI's own names among the engine's parameters ("logprobs" is OpenAI's field, typed per route below).
OPENAI_PARAMS = ("max_tokens", "temperature", "top_p", "stop", "seed", "response_format", "presence_penalty",
                 "frequency_penalty", "logit_bias")
# The engine's parameters a body may carry besides OpenAI's: the diffusion knobs and the rest (docs/parameters.md).
EXTENSIONS = tuple(k for k in GENERATION_PARAMS if k not in OPENAI_PARAMS and k != "logprobs")


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: StrictBool = False


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
    echo=(Any, Field(None, description="prepend the prompt to each completion (true or false)")),
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
          "user": "user must be a string", "model": "model must be a string",
          "messages": "messages must be a non-empty list",
          "logprobs": "logprobs must be true or false on /v1/chat/completions (top_logprobs: how many alternatives)",
          "parallel_tool_calls": "parallel_tool_calls must be true or false", "tools": "tools must be a list"}


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
    err = InvalidRequestError(_RULES.get(field) or f"{path}: {first['msg']}")
    err.param = field or None
    raise err


def set_fields(req: BaseModel) -> dict[str, Any]:
    """The engine's parameters the request set."""
    return {k: getattr(req, k) for k in OPENAI_PARAMS + EXTENSIONS if getattr(req, k) is not None}


def openapi(version: str) -> dict[str, Any]:
    """OpenAPI 3.1 for the routes: the request bodies from the models; responses are OpenAI's objects (an error
    object on every refusal)."""
    schemas: dict[str, Any] = {}
    for m in (CompletionRequest, ChatCompletionRequest):
        s = m.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(s.pop("$defs", {}))
        schemas[m.__name__] = s
    schemas["Error"] = {"type": "object", "properties": {"error": {"type": "object", "properties": {
        "message": {"type": "string"}, "type": {"type": "string"}, "param": {"type": ["string", "null"]},
        "code": {"type": ["string", "null"]}}}}}
    err = {"description": "refused: an OpenAI error object",
           "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}

    def post(name: str, summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{name}"}}}}, "responses": {
                "200": {"description": "the completion, or server-sent events with stream: true"},
                "400": err, "401": err, "404": err, "413": err, "429": err, "503": err}}}

    def get(summary: str) -> dict[str, Any]:
        return {"get": {"summary": summary, "responses": {"200": {"description": "OK"}, "404": err}}}

    def vllm(summary: str) -> dict[str, Any]:
        return {"post": {"summary": summary, "requestBody": {"required": True, "content": {"application/json": {
            "schema": {"type": "object"}}}}, "responses": {"200": {"description": "OK"}, "400": err}}}

    return {"openapi": "3.1.0", "info": {"title": "mbd-rs", "version": version,
                                         "description": "OpenAI-compatible routes of `mbd-rs serve` (docs/server.md)"},
            "paths": {"/v1/completions": post("CompletionRequest", "a completion of each prompt"),
                      "/v1/chat/completions": post("ChatCompletionRequest", "the next turn of a conversation"),
                      "/v1/models": get("the served model"), "/v1/models/{model}": get("one model by name"),
                      "/tokenize": vllm("text or messages to token ids (vLLM's route)"),
                      "/detokenize": vllm("token ids to text (vLLM's route)"),
                      "/tokenizer_info": get("the tokenizer's special tokens and chat template (vLLM's route)"),
                      "/health": get("status, limits and load"), "/metrics": get("Prometheus metrics")},
            "components": {"schemas": schemas}}
