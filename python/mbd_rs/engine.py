"""The Python face of the engine: `Engine.load(path)` and its methods. The Rust core (`mbd_rs._core`) owns
every parameter's name, kind and range and does the work; this module only shapes calls and results."""
from __future__ import annotations

import errno
import json
import os
import re
import sys
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Union

import numpy as np

from . import _core, _cuda_libs
from .errors import InvalidRequestError, ModelFileNotFoundError, UnsupportedArchitectureError
from .types import Completion, StepEvent, StreamChunk, TokenLogprob, Usage

#: The model shipped inside the package (mbd-tiny v3, trained here by training/train.py --family tiny): used when no
#: path is given.
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "mbd-tiny")

#: Parameter names, from the core: generation parameters, load-time profile overrides, logits options.
GENERATION_PARAMS: "tuple[str, ...]" = _core.GENERATION_PARAMS
PROFILE_OVERRIDES: "tuple[str, ...]" = _core.PROFILE_OVERRIDES
LOGITS_PARAMS: "tuple[str, ...]" = _core.LOGITS_PARAMS
SCORE_PARAMS: "tuple[str, ...]" = _core.SCORE_PARAMS
#: name -> {"kind": ..., "help": ...} for every parameter above.
PARAMS: "dict[str, dict[str, str]]" = _core.PARAMS

Prompt = Union[str, Sequence[int]]
#: Engine.load's progress: None (a bar for large checkpoints on a terminal), True, False, or a callable.
LoadProgress = Union[bool, Callable[[int, int], None], None]
#: With progress=None, checkpoints smaller than this load without a bar.
LOAD_BAR_MIN_BYTES = 256 << 20
Message = Mapping[str, Any]


@dataclass(frozen=True)
class ModelInfo:
    path: str
    family: str
    architecture: str
    arch: str
    num_parameters: int
    weight_bytes: int  # the weights as held in memory
    weight_format: str  # how the matrices are held: "q8_0" / "q4_k" when quantized, else a dtype name
    int8_activations: bool  # the quantized matrices multiply activations rounded to 8 bits (Engine.load's option)
    chat_template: Optional[str]  # the Jinja source chat() renders (chat_template.jinja, tokenizer_config, GGUF)
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_context: int
    num_experts: Optional[int]
    num_experts_per_tok: Optional[int]
    mask_token_id: Optional[int]
    block_size: int
    eos_token_ids: List[int]
    attention: str
    alignment: str
    logits_shift: bool
    dtype: str
    stored_dtype: Optional[str]
    device: str


# The files a model directory is read from (the rest of a Hub repo, e.g. *.bin or *.gguf, is never downloaded).
HUB_ALLOW_PATTERNS = ["config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
                      "chat_template.jinja", "*.safetensors", "model.safetensors.index.json"]
_HUB_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9._-]+")


def is_hub_id(path: "str | os.PathLike[str]") -> bool:
    """True when `path` names no existing file or directory and has the shape of a Hub repo id ("org/name": one
    slash, not starting with "." or "/")."""
    text = os.fspath(path)
    return bool(_HUB_ID.fullmatch(text)) and not os.path.exists(text)


def resolve_model_path(path: "Optional[str | os.PathLike[str]]", revision: Optional[str] = None) -> str:
    """The local model directory for `path`: the embedded model for None, `path` itself for a local path, and for
    a Hub id ("org/name") its snapshot in the Hugging Face cache, fetched with huggingface_hub.snapshot_download
    (which honours HF_HOME, HF_HUB_CACHE, HF_HUB_OFFLINE and HF_TOKEN, and shows its own progress bars)."""
    if path is None:
        path = DEFAULT_MODEL
    text = os.fspath(path)
    if not is_hub_id(text):
        if revision is not None:
            raise InvalidRequestError(f"revision={revision!r} applies only to Hugging Face Hub ids (org/name); "
                                      f"{text!r} is a local path")
        return text
    what = repr(text) if revision is None else f"{text!r} (revision {revision!r})"
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:
        raise ModelFileNotFoundError(
            errno.ENOENT, f"{what} is not a local directory, and loading a Hugging Face Hub id needs huggingface_hub: "
            f"pip install huggingface_hub (or pip install 'mbd-rs[hub]')", text) from None
    try:
        return str(snapshot_download(text, revision=revision, allow_patterns=HUB_ALLOW_PATTERNS))
    except Exception as e:  # offline and not cached, no network, unknown repo or revision, no access: all "not found"
        reason = (str(e).strip().splitlines() or [""])[0][:300]
        raise ModelFileNotFoundError(
            errno.ENOENT, f"{what} is neither a local directory nor in the Hugging Face cache "
            f"({constants.HF_HUB_CACHE}), and the Hub could not provide it ({type(e).__name__}: {reason})",
            text) from e


class _LoadBar:
    """Engine.load's progress (see its docstring): a tqdm bar over the checkpoint's bytes, created at the first
    report (when the total is known), or the caller's callable."""

    def __init__(self, progress: LoadProgress):
        self.bar: Any = None
        self.decided = False
        self.user = progress if callable(progress) else None
        self.tqdm: Any = None
        if progress is False or self.user is not None:
            return
        if progress is None and not (hasattr(sys.stderr, "isatty") and sys.stderr.isatty()):
            return
        try:
            from tqdm import tqdm  # type: ignore[import-untyped,import-not-found,unused-ignore]
        except ImportError:  # tqdm is optional (huggingface_hub brings it)
            return
        self.tqdm, self.forced = tqdm, progress is True

    @property
    def callback(self) -> Optional[Callable[[int, int], None]]:
        return self.user if self.user is not None else (self.update if self.tqdm is not None else None)

    def update(self, done: int, total: int) -> None:
        if not self.decided:
            self.decided = True
            if self.forced or total >= LOAD_BAR_MIN_BYTES:
                self.bar = self.tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc="loading weights",
                                     leave=False, file=sys.stderr)
        if self.bar is not None:
            self.bar.update(done - self.bar.n)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


class Engine:
    """A loaded block-diffusion (or plain causal) Qwen2/Qwen3/Qwen3-MoE model."""

    def __init__(self, core: "_core.CoreModel"):
        self._core = core
        self.info = ModelInfo(**core.info())

    @classmethod
    def load(cls, path: "Optional[str | os.PathLike[str]]" = None, *, revision: Optional[str] = None,
             device: str = "auto", dtype: Optional[str] = None, quantize: Optional[str] = None,
             int8_activations: Optional[bool] = None, max_batch: Optional[int] = None, max_batch_rows: Optional[int] = None,
             progress: LoadProgress = None, _kernels: Optional[Dict[str, Any]] = None,
             **profile_overrides: Any) -> "Engine":
        """Load an HF-format model directory (default: the embedded mbd-tiny model), a GGUF file (llama.cpp's
        format: qwen2, qwen3, qwen3moe and dream architectures; see the README), or a Hugging Face Hub id
        ("org/name", at `revision`: a branch, tag or commit; default "main") through the local Hub cache,
        downloading what is missing (see resolve_model_path).

        device: "auto" (CUDA/Metal when this build has it and a device answers, else CPU), "cpu", "cuda[:N]", "metal".
        dtype: None/"auto" (float32 on CPU, bfloat16 on GPUs), "float32", "bfloat16", "float16".
        quantize: None, "q8_0" (8-bit blocks of 32), "q6_k", "q5_k", "q4_k", "q3_k", "q2_k" (6- to 2-bit k-quant
        super-blocks of 256), "q5_0" or "q4_0" (5- and 4-bit blocks of 32): quantize the weight matrices at load
        (CPU, float32 compute; 8.5, 6.56, 5.5, 4.5, 3.44, 2.63, 5.5 and 4.5 bits per weight; the embedding table and
        the head get q8_0; a matrix whose rows do not split into whole super-blocks gets q4_k → q5_0, q3_k and q2_k
        → q4_0, q5_k and q6_k → q8_0). `info.weight_format`
        and `info.weight_bytes` report what is held.
        int8_activations: how the quantized matrices (of `quantize` or a GGUF file) multiply. True: integer dot
        products on activations rounded to 8 bits per block of 32 values, as llama.cpp does (x86-64 CPUs with AVX2,
        AVX-512 VNNI where present; on CUDA candle's quantized kernels always do this): about 2x faster forwards
        than the exact products, at every window size, for q8_0, q6_k, q5_k, q5_0, q4_k and q4_0 matrices (q3_k
        and q2_k ones keep float32 activations). False: the exact products of the quantized weights with float32
        activations, bit for bit the dequantized checkpoint's (CPU only). None (default): True wherever it runs
        (CUDA; a CPU with AVX2, in float32), else False. `info.int8_activations` says what was chosen.
        max_batch, max_batch_rows: caps on continuous batching (see `set_batching`); default 16 streams, 1024 rows.
        progress: None (default: a tqdm bar on stderr while the weights are read, when stderr is a terminal, tqdm is
        installed and the checkpoint is over 256 MB), True (a bar whenever tqdm is installed), False (none), or a
        callable(bytes_read, bytes_total) called after each tensor. Hub downloads show huggingface_hub's bars.
        profile_overrides: any of PROFILE_OVERRIDES: mask_token_id, block_size, attention
        ("causal"|"block_causal"|"full"), alignment ("absolute"|"prompt"), logits_shift (bool), eos_token_ids.
        _kernels: benchmark switches (keep_bf16_weights, skinny, par_min_macs, max_rows, blocked_attention,
            panels, packed_weights, packed_avx512, stack, cuda_fused, candle_quant), not a stable API.
        """
        path = resolve_model_path(path, revision)
        bar = _LoadBar(progress)
        try:
            core = _core.CoreModel.load(path, device, dtype, profile_overrides, max_batch=max_batch,
                                        max_batch_rows=max_batch_rows, quantize=quantize,
                                        int8_activations=int8_activations, progress=bar.callback,
                                        **(_kernels or {}))
        except UnsupportedArchitectureError as e:  # the core's "no CUDA in this build", said of the CPU fallback
            if _cuda_libs.cuda_unavailable and isinstance(device, str) and device.startswith("cuda"):
                raise UnsupportedArchitectureError(f"device {device!r}: this is the CUDA build of mbd-rs, but its "
                                                   f"CUDA core could not be loaded: {_cuda_libs.cuda_unavailable}") from e
            raise
        finally:
            bar.close()
        return cls(core)

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

    def logits(self, ids: Sequence[int], **params: Any) -> np.ndarray:
        """Logits (len(ids) x vocab, float32) for every position of `ids`. Parameters (LOGITS_PARAMS):

        attention/block_size/alignment default to the model's profile; `prompt_len` ends the prompt block for
        alignment="prompt". With prefix_len > 0 the first prefix_len tokens go through the KV-cache path and the
        rest are forwarded as a window over that cache (the result is the same; prefix_len must sit on a block
        boundary of the chosen attention)."""
        return self._core.logits(ids, params)

    def prompt_logprobs(self, prompt: Prompt, **params: Any) -> List[Optional[TokenLogprob]]:
        """The log-probability of each token of `prompt` (a str or a list of token ids) given the tokens before it,
        one per token (None for the first, which has no context): the model's left-to-right likelihood at block
        size 1 (for unshifted models such as SDAR, a mask token at each position seeing the tokens before it and
        itself; for shifted ones the previous position's logits under causal attention). `logprobs=k` (0..20) adds
        the k most likely tokens at each position. Full-attention models (Dream) have no left-to-right
        likelihood and raise InvalidRequestError."""
        return [None if t is None else _token_logprob(t) for t in self._core.prompt_logprobs(prompt, params)]

    def stream(self, prompt: Prompt, **params: Any) -> "Stream":
        """Stream a completion of `prompt` (a str or a list of token ids). Parameters: GENERATION_PARAMS."""
        return Stream(self._core.start(prompt, params), trace=bool(params.get("trace")))

    def generate(self, prompt: Prompt, **params: Any) -> Completion:
        """Generate a completion of `prompt` (a str or a list of token ids)."""
        return self.stream(prompt, **params).result()

    def apply_chat_template(self, messages: Sequence[Message], *, add_generation_prompt: bool = True,
                            **template_kwargs: Any) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template."""
        try:
            extra = json.dumps(template_kwargs) if template_kwargs else None
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"template arguments must be JSON-serialisable: {e}") from None
        return self._core.apply_chat_template(_messages_json(messages), add_generation_prompt, extra)

    def stream_chat(self, messages: Sequence[Message], *, special_tokens_in_content: bool = False,
                    **params: Any) -> "Stream":
        """Stream the assistant's reply to `messages` (rendered with the chat template). Message contents stay
        text: a content that spells a control token (e.g. "<|im_end|>") is tokenized as plain text unless
        special_tokens_in_content=True."""
        return Stream(self._core.start_chat(_messages_json(messages), params, special_tokens_in_content),
                      trace=bool(params.get("trace")))

    def chat(self, messages: Sequence[Message], *, special_tokens_in_content: bool = False, **params: Any) -> Completion:
        return self.stream_chat(messages, special_tokens_in_content=special_tokens_in_content, **params).result()


def _messages_json(messages: Sequence[Message]) -> str:
    if isinstance(messages, (str, bytes)):
        raise InvalidRequestError("messages must be a list of {'role': ..., 'content': ...} dicts, got a string")
    try:
        return json.dumps(list(messages), ensure_ascii=False)
    except (TypeError, ValueError, RecursionError) as e:
        raise InvalidRequestError(f"messages must be JSON-serialisable dicts: {e}") from None


def _usage(d: Optional[Dict[str, Any]]) -> Optional[Usage]:
    return None if d is None else Usage(**d)


def _step(d: Optional[Dict[str, Any]]) -> Optional[StepEvent]:
    return None if d is None else StepEvent(**d)


def _token_logprob(t: "tuple[int, float, list[tuple[int, float]]]") -> TokenLogprob:
    return TokenLogprob(t[0], t[1], t[2])


class Stream:
    """Iterator of StreamChunk: text streams token by token as the left-to-right prefix becomes stable.
    The last chunk has finish_reason and usage. Thread-safe cancel(); close() frees the KV cache now."""

    def __init__(self, core_stream: "_core.CoreStream", trace: bool):
        self._s = core_stream
        self._trace = trace
        self._done = False
        self.text = ""
        self.token_ids: List[int] = []
        #: with logprobs=k: one TokenLogprob per token id so far (and the EOS that ended the generation)
        self.logprobs: List[TokenLogprob] = []
        self.finish_reason: Optional[str] = None
        self.usage: Optional[Usage] = None

    def __iter__(self) -> Iterator[StreamChunk]:
        return self

    def __next__(self) -> StreamChunk:
        while not self._done:
            d = self._s.step()
            if d is None:
                self._done = True
                break
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
        raise StopIteration

    def cancel(self) -> None:
        self._s.cancel()

    def close(self) -> None:
        self._done = True
        self._s.close()

    def result(self) -> Completion:
        """Drain the stream and return the Completion."""
        for _ in self:
            pass
        if self.finish_reason is None or self.usage is None:
            raise InvalidRequestError("stream was closed before it finished")
        return Completion(self.text, list(self.token_ids), self.finish_reason, self.usage, list(self.logprobs))

    def __enter__(self) -> "Stream":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._s.close()
        except Exception:
            pass
