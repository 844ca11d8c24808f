"""The Python face of the engine: `Engine.load(path)` and its methods. The Rust core (`mbd_rs._core`) owns
every parameter's name, kind and range and does the work; this module only shapes calls and results."""
from __future__ import annotations

import asyncio
import json
import os
import textwrap
import warnings
import weakref
from typing import TYPE_CHECKING, Any, AsyncIterator, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple, Union

import numpy as np

from . import _core, _cuda_libs
from .errors import InvalidRequestError, UnsupportedArchitectureError
from .hub import LoadProgress, PathArg, _LoadBar, resolve_model_path
from .params import GenerationParams, LoadParams, LogitsParams, ScoreParams
from . import tools as tools_mod
from .tools import ToolChoice
from .types import Completion, ModelInfo, PrefixCacheStats, StepEvent, StreamChunk, TokenLogprob, ToolCall, Usage

if TYPE_CHECKING:  # typed **params (PEP 692); typing.Unpack is in the standard library from 3.11
    from typing_extensions import Unpack

#: Parameter names, from the core: generation parameters, load-time profile overrides, logits options.
GENERATION_PARAMS: "tuple[str, ...]" = _core.GENERATION_PARAMS
PROFILE_OVERRIDES: "tuple[str, ...]" = _core.PROFILE_OVERRIDES
LOGITS_PARAMS: "tuple[str, ...]" = _core.LOGITS_PARAMS
SCORE_PARAMS: "tuple[str, ...]" = _core.SCORE_PARAMS
#: Engine.load's options by name: the load options (LOAD_PARAMS), the profile overrides and the kernel switches.
LOAD_PARAMS: "tuple[str, ...]" = _core.LOAD_PARAMS
KERNEL_SWITCHES: "tuple[str, ...]" = _core.KERNEL_SWITCHES
LOAD_OPTIONS: "tuple[str, ...]" = _core.LOAD_OPTIONS
#: The load options that cap continuous batching: a server sets them from its own concurrency (`serve`'s
#: --max-concurrency, Ray's max_concurrency), so they are not load flags or config keys.
BATCH_CAPS: "tuple[str, ...]" = ("max_batch", "max_batch_rows")
#: Stops a long call (Engine.logits, Engine.prompt_logprobs) from another thread: `token.cancel()`.
CancelToken = _core.CancelToken
#: name -> {"kind": ..., "help": ...} for every parameter above; a "text" one also has "max_chars" and "max_tokens".
PARAMS: "dict[str, dict[str, Any]]" = _core.PARAMS

Prompt = Union[str, Sequence[int]]
Message = Mapping[str, Any]


def _kernel_switches(kernels: Any) -> Dict[str, Any]:
    """Engine.load's `_kernels`: a dict of kernel switches (KERNEL_SWITCHES), checked here so that a refusal names
    `_kernels` (merged with the other options, a list was "'list' object is not a mapping")."""
    if kernels is None:
        return {}
    if not isinstance(kernels, Mapping):
        raise TypeError(f"_kernels must be a dict of kernel switches, such as dict(stack=False), got "
                        f"{type(kernels).__name__} {kernels!r:.80}; the switches are {', '.join(KERNEL_SWITCHES)}")
    for k in kernels:
        if k not in KERNEL_SWITCHES:
            raise TypeError(f"_kernels: {k!r:.80} is not a kernel switch; the switches are "
                            f"{', '.join(KERNEL_SWITCHES)} (other load options are Engine.load's own arguments)")
    return dict(kernels)


class Engine:
    """A loaded block-diffusion (or plain causal) Qwen2/Qwen3/Qwen3-MoE model."""

    def __init__(self, core: "_core.CoreEngine"):
        self._marker: Optional[str] = None
        self._marker_known = False
        self._core = core
        self.info = ModelInfo(**core.info())

    @classmethod
    def load(cls, path: Optional[PathArg] = None, *, revision: Optional[str] = None,
             progress: LoadProgress = None, _kernels: Optional[Dict[str, Any]] = None,
             **options: Unpack[LoadParams]) -> "Engine":
        """Load an HF-format model directory (default: the embedded mbd-tiny model), a GGUF file (llama.cpp's
        format: qwen2, qwen3, qwen3moe, qwen35, qwen35moe and dream architectures; see docs/quantization.md), or a
        Hugging Face Hub id ("org/name", at `revision`: a branch, tag or commit; default "main") through the local
        Hub cache, downloading what is missing (see `hub.resolve_model_path`).

        progress: None (default: a tqdm bar on stderr while the weights are read, when stderr is a terminal, tqdm is
        installed and the checkpoint is over 256 MB), True (a bar whenever tqdm is installed), False (none), or a
        callable(bytes_read, bytes_total) called after each tensor. Hub downloads show huggingface_hub's bars.

        options: any of LOAD_OPTIONS (the core's registry; `mbd_rs.PARAMS[name]["help"]` says what each does):

        {options}
        quantize's formats: the embedding table and the head get q8_0; a matrix whose rows do not split into whole
        super-blocks falls back (q4_k → q5_0, q3_k and q2_k → q4_0, q5_k and q6_k → q8_0); `info.weight_format` ("q4_k+q8_0":
        the formats, then the dtypes of unquantized matrices) and `info.weight_bytes` report what is held,
        `info.int8_activations` what int8_activations chose; a quantize= that quantized no matrix is warned about. max_batch and
        max_batch_rows can be changed later (`set_batching`).
        _kernels: the kernel switches as a dict ({switches}): benchmarks' A/B runs, not a stable API.
        """
        path = resolve_model_path(path, revision)
        given: Dict[str, Any] = {**_kernel_switches(_kernels), **options}
        bar = _LoadBar(progress)
        try:
            core = _core.CoreEngine.load(path, given, bar.callback)
        except UnsupportedArchitectureError as e:  # the core's "no CUDA in this build", said of the CPU fallback
            device = given.get("device")
            if _cuda_libs.cuda_unavailable and isinstance(device, str) and device.startswith("cuda"):
                raise UnsupportedArchitectureError(f"device {device!r}: this is the CUDA build of mbd-rs, but its "
                                                   f"CUDA core could not be loaded: {_cuda_libs.cuda_unavailable}") from e
            raise
        finally:
            bar.close()
        eng = cls(core)
        for w in eng.info.warnings:  # the core's: e.g. a quantize= option that quantized no matrix
            warnings.warn(f"{eng.info.path}: {w}", UserWarning, stacklevel=2)
        return eng

    def __repr__(self) -> str:
        i = self.info
        return (f"Engine({i.family}, {i.num_parameters / 1e6:.2f}M params, {i.attention} attention, "
                f"block {i.block_size}, {i.dtype} on {i.device}, path={i.path!r})")

    @property
    def batching(self) -> "tuple[int, int]":
        """(max_batch, max_batch_rows): the caps on continuous batching."""
        return self._core.batch_limits()

    @property
    def batch_stats(self) -> "tuple[int, int, int]":
        """(forwards, segments, rows): forwards run for this engine's streams, the stream steps they carried (a
        ratio above 1 means streams were batched) and the window rows they computed."""
        return self._core.batch_stats()

    @property
    def graph_stats(self) -> "tuple[int, int, int]":
        """(captured, replayed, refused): CUDA graphs of this engine's forwards (the `cuda_graphs` kernel switch,
        off by default): graphs captured, forwards replayed from one, forward shapes left to run launch by launch
        (a failed capture, or a replay that differed from the forward without it). Zeros on the CPU."""
        return self._core.graph_stats()

    def prefix_cache_stats(self) -> PrefixCacheStats:
        """The prefix cache's counters: its cap and the bytes and pages it holds, the requests that looked a prefix up
        and those that found one, the tokens found, the pages added and evicted (docs/prefix-cache.md)."""
        return PrefixCacheStats(**self._core.prefix_cache_stats())

    def clear_prefix_cache(self) -> None:
        """Drop every cached prefix (requests running keep what they took)."""
        self._core.clear_prefix_cache()

    def save_prefix_cache(self, path: "str | os.PathLike[str]") -> int:
        """Write the prefix cache's pages (their tokens, K/V and a hybrid's recurrent snapshots) to `path`, a
        safetensors file, through a temporary file beside it; returns the pages written. `load_prefix_cache` in
        another process of the same model reads it back (docs/prefix-cache.md)."""
        return self._core.save_prefix_cache(os.fspath(path))

    def load_prefix_cache(self, path: "str | os.PathLike[str]") -> int:
        """Add the pages of a file `save_prefix_cache` wrote to this engine's prefix cache, within its cap (pages
        that do not fit are left out); returns the pages added. `InvalidRequestError` when the file was written by
        an engine that computes other K/V (another model, engine build or load options that change the
        arithmetic), or is not such a file; `FileNotFoundError` when it is missing."""
        return self._core.load_prefix_cache(os.fspath(path))

    def set_batching(self, *, max_batch: Optional[int] = None, max_batch_rows: Optional[int] = None) -> None:
        """Concurrent streams of this engine (from any threads) are batched: each forward runs the next step of
        up to `max_batch` streams together (later ones wait their turn), at most `max_batch_rows` window rows
        (a long prompt's prefill chunk runs alone when it is longer). Batching never changes outputs: every
        stream gets exactly the tokens it gets alone."""
        self._core.set_batch_limits(max_batch, max_batch_rows)

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> List[int]:
        return self._core.tokenize(text, add_special_tokens)

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._core.detokenize(ids, skip_special_tokens)

    def logits(self, ids: Sequence[int], *, cancel: Optional[CancelToken] = None,
               **params: Unpack[LogitsParams]) -> np.ndarray:
        """Logits (len(ids) x vocab, float32) for every position of `ids`. `cancel.cancel()` from another thread (or
        Ctrl-C) stops the call between its chunks and its forwards' layers (RequestCancelledError; KeyboardInterrupt).
        Parameters (LOGITS_PARAMS):

        attention/block_size/alignment default to the model's profile; `prompt_len` ends the prompt block for
        alignment="prompt". With prefix_len > 0 the first prefix_len tokens go through the KV-cache path and the
        rest are forwarded as a window over that cache (the result is the same; prefix_len must sit on a block
        boundary of the chosen attention)."""
        return self._core.logits(ids, params, cancel)

    def prompt_logprobs(self, prompt: Prompt, *, cancel: Optional[CancelToken] = None,
                        **params: Unpack[ScoreParams]) -> List[Optional[TokenLogprob]]:
        """The log-probability of each token of `prompt` (a str or a list of token ids) given the tokens before it,
        one per token (None for the first, which has no context): the model's left-to-right likelihood at block
        size 1 (for unshifted models such as SDAR, a mask token at each position seeing the tokens before it and
        itself; for shifted ones the previous position's logits under causal attention). `logprobs=k` (0..20) adds
        the k most likely tokens at each position. Full-attention models (Dream) have no left-to-right
        likelihood and raise InvalidRequestError. `cancel` (or Ctrl-C) stops it between chunks, as for `logits`."""
        scores = self._core.prompt_logprobs(prompt, params, True, cancel)
        return [None if t is None else _token_logprob(t) for t in scores]

    def chat_ids(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                 special_tokens_in_content: bool = False, tools: Optional[Sequence[Mapping[str, Any]]] = None) -> List[int]:
        """The token ids of `messages` rendered with the chat template (with `tools`, their definitions too), exactly
        as `stream_chat` runs on them (contents kept as text, roles checked)."""
        plan = self.tool_plan(tools, "none") if tools is not None else None
        msgs = plan.messages(messages) if plan is not None else tools_mod.messages_for_template(messages)
        return self._core.chat_ids(_messages_json(msgs), add_generation_prompt, special_tokens_in_content,
                                   plan.tools_json if plan is not None else None)

    def token_bytes(self, ids: Sequence[int]) -> List[bytes]:
        """Each token's bytes before UTF-8 decoding: a token that holds part of a character (whose text alone
        would be U+FFFD) gives its bytes."""
        return self._core.token_bytes(ids)

    def stream(self, prompt: Prompt, *, raw: bool = False, **params: Unpack[GenerationParams]) -> "Stream":
        """Stream a completion of `prompt` (a str or a list of token ids). Chat by default: a str is the user's
        message, rendered with the model's chat template (as `stream_chat` does), when the model has one, unless
        `raw=True` or the prompt is already templated (it holds the control token that opens the template's turns,
        e.g. "<|im_start|>"). Token ids are always completed as they are. Parameters: GENERATION_PARAMS."""
        if self.chats(prompt, raw=raw):
            return self.stream_chat([{"role": "user", "content": prompt}], **params)
        return Stream(self._core.start(prompt, _core_params(params)), trace=bool(params.get("trace")))

    def generate(self, prompt: Prompt, *, raw: bool = False, **params: Unpack[GenerationParams]) -> Completion:
        """Generate a completion of `prompt` (a str or a list of token ids; a str is a chat message unless raw=True
        or already templated: see `stream`)."""
        return self.stream(prompt, raw=raw, **params).result()

    def chats(self, prompt: Prompt, *, raw: bool = False) -> bool:
        """Whether `generate`/`stream` send `prompt` as a chat message: a str, not raw, the model has a chat
        template, and the prompt does not already hold the control token that opens the template's turns."""
        if raw or not isinstance(prompt, str) or not prompt:  # an empty prompt stays an error, not an empty message
            return False
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError:  # lone surrogates: the prompt's own error says so
            return False
        marker = self._turn_marker()
        return marker is not None and marker not in prompt

    def _turn_marker(self) -> Optional[str]:
        """The text the chat template writes before a turn's role (e.g. "<|im_start|>"), or its whole lead-in before
        a user message's content when it writes none; None without a template (computed once)."""
        if not self._marker_known:
            marker = None
            if self.info.chat_template is not None:
                sentinel = "\u2063mbd\u2063"
                lead = self.apply_chat_template([{"role": "user", "content": sentinel}]).split(sentinel)[0]
                at = lead.rfind("user")
                marker = (lead[:at] if at > 0 else lead).strip() or None
            self._marker, self._marker_known = marker, True
        return self._marker

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template."""
        try:
            extra = json.dumps(template_kwargs) if template_kwargs else None
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"template arguments must be JSON-serialisable: {e}") from None
        return self._core.apply_chat_template(_messages_json(messages), add_generation_prompt, extra)

    def stream_chat(self, messages: Sequence[Message], *, special_tokens_in_content: bool = False,
                    tools: Optional[Sequence[Mapping[str, Any]]] = None, tool_choice: ToolChoice = None,
                    parallel_tool_calls: Optional[bool] = None, **params: Unpack[GenerationParams]) -> "Stream":
        """Stream the assistant's reply to `messages` (rendered with the chat template). Message contents stay
        text: a content that spells a control token (e.g. "<|im_end|>") is tokenized as plain text unless
        special_tokens_in_content=True.

        `tools` (OpenAI's function definitions), `tool_choice` ("auto", the default with tools; "none", "required",
        or {"type": "function", "function": {"name": ...}}) and `parallel_tool_calls` (default True): the template
        renders the tools, the output keeps to the model's call format (see mbd_rs.tools), and the Completion's
        `tool_calls` holds the calls it made."""
        plan = self.tool_plan(tools, tool_choice, parallel_tool_calls, params)
        msgs = _messages_json(plan.messages(messages))
        return Stream(self._core.start_chat(msgs, _core_params(plan.params), special_tokens_in_content,
                                            plan.tools_json), trace=bool(params.get("trace")), tools=plan.format)

    def chat(self, messages: Sequence[Message], *, special_tokens_in_content: bool = False,
             tools: Optional[Sequence[Mapping[str, Any]]] = None, tool_choice: ToolChoice = None,
             parallel_tool_calls: Optional[bool] = None, **params: Unpack[GenerationParams]) -> Completion:
        return self.stream_chat(messages, special_tokens_in_content=special_tokens_in_content, tools=tools,
                                tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **params).result()

    async def astream(self, prompt: Prompt, *, raw: bool = False, **params: Unpack[GenerationParams]) -> "Stream":
        """`stream`, started off the event loop (tokenizing and rendering a long prompt take a while); iterate the
        Stream with `async for`."""
        return await _started_off_loop(lambda: self.stream(prompt, raw=raw, **params))

    async def agenerate(self, prompt: Prompt, *, raw: bool = False, **params: Unpack[GenerationParams]) -> Completion:
        """`generate` for asyncio: the event loop runs on while the generation does (many at once are batched);
        cancelling the awaiting task cancels the generation and frees its place at once."""
        s = await self.astream(prompt, raw=raw, **params)
        return await s.aresult()

    async def astream_chat(self, messages: Sequence[Message], *, special_tokens_in_content: bool = False,
                           tools: Optional[Sequence[Mapping[str, Any]]] = None, tool_choice: ToolChoice = None,
                           parallel_tool_calls: Optional[bool] = None, **params: Unpack[GenerationParams]) -> "Stream":
        """`stream_chat`, started off the event loop; iterate the Stream with `async for`."""
        return await _started_off_loop(lambda: self.stream_chat(
            messages, special_tokens_in_content=special_tokens_in_content, tools=tools, tool_choice=tool_choice,
            parallel_tool_calls=parallel_tool_calls, **params))

    async def achat(self, messages: Sequence[Message], *, special_tokens_in_content: bool = False,
                    tools: Optional[Sequence[Mapping[str, Any]]] = None, tool_choice: ToolChoice = None,
                    parallel_tool_calls: Optional[bool] = None, **params: Unpack[GenerationParams]) -> Completion:
        """`chat` for asyncio (see `agenerate`)."""
        s = await self.astream_chat(messages, special_tokens_in_content=special_tokens_in_content, tools=tools,
                                    tool_choice=tool_choice, parallel_tool_calls=parallel_tool_calls, **params)
        return await s.aresult()

    def tool_plan(self, tools: Any, tool_choice: ToolChoice = None, parallel_tool_calls: Optional[bool] = None,
                  params: Optional[Mapping[str, Any]] = None) -> "tools_mod.ToolPlan":
        """What `tools` / `tool_choice` / `parallel_tool_calls` make of a chat request on this model: the tools as
        its template takes them, the call format its output is read in, and `params` with the grammar the choice
        implies (mbd_rs.tools.plan)."""
        return tools_mod.plan(self.info.chat_template, self._is_control, tools, tool_choice, parallel_tool_calls,
                              dict(params or {}))

    def _is_control(self, text: str) -> bool:
        """Whether `text` is one of the vocabulary's control tokens."""
        ids = self.tokenize(text, add_special_tokens=False)
        return len(ids) == 1 and self.detokenize(ids, skip_special_tokens=True) == ""


def _core_params(params: Mapping[str, Any]) -> Dict[str, Any]:
    """Generation parameters as the core takes them: a pydantic model class as `response_format` becomes OpenAI's
    strict json_schema format of its JSON Schema (as the openai SDK's `parse` sends it: no object takes properties
    its model does not declare)."""
    rf = params.get("response_format")
    if isinstance(rf, type) and hasattr(rf, "model_json_schema"):
        schema = tools_mod.strict_schema(rf.model_json_schema())
        return {**params, "response_format": {"type": "json_schema",
                                              "json_schema": {"name": rf.__name__, "schema": schema, "strict": True}}}
    return dict(params)




def _messages_json(messages: Sequence[Message]) -> str:
    if isinstance(messages, (str, bytes)):
        raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} dicts, got a string")
    try:
        return json.dumps(list(messages), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidRequestError(f"messages must be JSON-serialisable dicts: {e}") from None


async def _started_off_loop(start: "Any") -> "Stream":
    """start() on a worker thread; a stream started after its caller was cancelled is closed at once."""
    task = asyncio.ensure_future(asyncio.to_thread(start))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        task.add_done_callback(lambda t: t.cancelled() or t.exception() is not None or t.result().close())
        raise


class _LoopWaker:
    """One event loop's wake line: a descriptor the loop watches, readable when a stream set on it has an output
    (the scheduler writes it); every stream waiting on this loop then polls its own."""

    _of_loop: "weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _LoopWaker]" = weakref.WeakKeyDictionary()

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.core = _core.CoreWaker()
        self._loop = loop
        self._ready: "Optional[asyncio.Future[None]]" = None
        loop.add_reader(self.core.fileno(), self._readable)
        weakref.finalize(self, _remove_reader, weakref.ref(loop), self.core.fileno())

    @classmethod
    def of_running_loop(cls) -> "_LoopWaker":
        loop = asyncio.get_running_loop()
        w = cls._of_loop.get(loop)
        if w is None:
            w = cls._of_loop[loop] = cls(loop)
        return w

    def _readable(self) -> None:
        self.core.drain()
        ready, self._ready = self._ready, None
        if ready is not None and not ready.done():
            ready.set_result(None)

    async def wait(self) -> None:
        """Until some stream of this loop has news (shielded: one waiter's cancel leaves the others waiting)."""
        if self._ready is None:
            self._ready = self._loop.create_future()
        await asyncio.shield(self._ready)


def _remove_reader(loop_ref: "weakref.ref[asyncio.AbstractEventLoop]", fd: int) -> None:
    loop = loop_ref()
    if loop is not None and not loop.is_closed():
        try:
            loop.remove_reader(fd)
        except Exception:
            pass


def _usage(d: Optional[Dict[str, Any]]) -> Optional[Usage]:
    return None if d is None else Usage(**d)


def _step(d: Optional[Dict[str, Any]]) -> Optional[StepEvent]:
    return None if d is None else StepEvent(**d)


def _token_logprob(t: "tuple[int, float, list[tuple[int, float]]]") -> TokenLogprob:
    return TokenLogprob(t[0], t[1], t[2])


class Stream:
    """Iterator of StreamChunk: text streams token by token as the left-to-right prefix becomes stable.
    The last chunk has finish_reason and usage. Thread-safe cancel(); close() frees the KV cache now.
    `async for` iterates it on an asyncio event loop without a thread: the loop waits on a descriptor the scheduler
    makes readable; a task cancelled while it waits closes the stream (the generation leaves at once)."""

    def __init__(self, core_stream: "_core.CoreStream", trace: bool, tools: "Optional[tools_mod.Format]" = None):
        self._s = core_stream
        self._trace = trace
        #: the tool-call format the output's calls are read in (None: no tools, or tool_choice "none")
        self.tool_format = tools
        self._done = False
        self.text = ""
        self.token_ids: List[int] = []
        #: with logprobs=k: one TokenLogprob per token id so far (and the EOS that ended the generation)
        self.logprobs: List[TokenLogprob] = []
        self.finish_reason: Optional[str] = None
        self.usage: Optional[Usage] = None
        self._waker: Optional[_LoopWaker] = None

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        while not self._done:
            chunk = self._take(self._s.step())
            if chunk is not None:
                return chunk
        raise StopIteration

    def __aiter__(self) -> AsyncIterator[StreamChunk]:
        return self

    async def __anext__(self) -> StreamChunk:
        waker = _LoopWaker.of_running_loop()
        if self._waker is not waker:
            self._waker = waker
            self._s.set_waker(waker.core)  # before polling: an output that comes in between wakes too
        try:
            while not self._done:
                ready, d = self._s.poll()
                if not ready:
                    await waker.wait()
                    continue
                chunk = self._take(d)
                if chunk is not None:
                    return chunk
        except asyncio.CancelledError:
            self.close()
            raise
        raise StopAsyncIteration

    def _take(self, d: Optional[Dict[str, Any]]) -> Optional[StreamChunk]:
        """One output of the core as a chunk (None: nothing to show, or the end)."""
        if d is None:
            self._done = True
            return None
        fin = d["finish_reason"]
        if fin is not None:
            self._done = True
            self.finish_reason = fin
            self.usage = _usage(d["usage"])
        if d["text"] or d["token_ids"] or fin is not None or (self._trace and d["step"] is not None):
            self.text += d["text"]
            self.token_ids.extend(d["token_ids"])
            lps = [_token_logprob(t) for t in d["logprobs"]]
            self.logprobs.extend(lps)
            return StreamChunk(d["text"], d["token_ids"], fin, _usage(d["usage"]), _step(d["step"]), lps)
        return None

    @property
    def prompt_progress(self) -> Tuple[int, int]:
        """(prompt positions computed, prompt length): how far the prompt's prefill has come, updated after each
        forward and readable from any thread while another reads the stream (a long prompt's progress line);
        positions read from the prefix cache count as computed. It equals the prompt's length once the first
        decoding step has run."""
        return self._s.prompt_progress()

    def cancel(self) -> None:
        self._s.cancel()

    def close(self) -> None:
        self._done = True
        self._s.close()

    def result(self) -> Completion:
        """Drain the stream and return the Completion."""
        for _ in self:
            pass
        return self._completion()

    async def aresult(self) -> Completion:
        """`result` with `async for`."""
        async for _ in self:
            pass
        return self._completion()

    def _completion(self) -> Completion:
        if self.finish_reason is None or self.usage is None:
            raise InvalidRequestError("stream was closed before it finished")
        calls: List[ToolCall] = []
        content: Optional[str] = self.text
        finish = self.finish_reason
        if self.tool_format is not None:
            content, calls = tools_mod.parse(self.tool_format, self.text)
            if calls and finish == "stop":
                finish = "tool_calls"
        return Completion(self.text, list(self.token_ids), finish, self.usage, list(self.logprobs), calls, content)

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._s.close()
        except Exception:
            pass


def _options_doc() -> str:
    """Engine.load's options, one line each, from the core's registry (so the docstring cannot drift)."""
    lines = []
    for name in LOAD_PARAMS + PROFILE_OVERRIDES:
        lines += textwrap.wrap(f"{name}: {PARAMS[name]['help']}", 108, subsequent_indent="    ")
    return "\n        ".join(lines)


if Engine.load.__doc__:  # None under python -OO
    Engine.load.__func__.__doc__ = Engine.load.__doc__.format(options=_options_doc(),  # type: ignore[attr-defined]
                                                              switches=", ".join(KERNEL_SWITCHES))
