"""The Python face of the engine: `Engine.load(path)` and its methods. Argument checking and type
conversion only; the work happens in the Rust core (`mbd_rs._core`)."""
from __future__ import annotations

import operator
import os
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import numpy as np

from . import _core
from .errors import InvalidRequestError
from .types import Completion, StepEvent, StreamChunk, Usage

#: The model shipped inside the package (trained here by training/train_tiny.py): used when no path is given.
DEFAULT_MODEL = os.path.join(os.path.dirname(os.path.abspath(__file__)), "models", "mbd-tiny")

PROFILE_OVERRIDES = ("mask_token_id", "block_size", "attention", "alignment", "logits_shift", "eos_token_ids")


@dataclass(frozen=True)
class ModelInfo:
    path: str
    family: str
    architecture: str
    arch: str
    num_parameters: int
    weight_bytes: int  # the weights as held in memory
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
    eos_token_ids: list
    attention: str
    alignment: str
    logits_shift: bool
    dtype: str
    stored_dtype: Optional[str]
    device: str


def _token_ids(ids: Any, name: str = "ids") -> list:
    if isinstance(ids, (str, bytes)):
        raise InvalidRequestError(f"{name} must be a sequence of token ids (ints), got a {type(ids).__name__}")
    try:
        return [operator.index(t) for t in ids]
    except TypeError as e:
        raise InvalidRequestError(f"{name} must be a sequence of token ids (ints): {e}") from None


class Engine:
    """A loaded block-diffusion (or plain causal) Qwen2/Qwen3/Qwen3-MoE model."""

    def __init__(self, core: "_core.CoreModel"):
        self._core = core
        self.info = ModelInfo(**core.info())

    @classmethod
    def load(cls, path: "Optional[str | os.PathLike[str]]" = None, *, device: str = "auto", dtype: Optional[str] = None,
             **profile_overrides: Any) -> "Engine":
        """Load an HF-format model directory (default: the embedded mbd-tiny model).

        device: "auto" (CUDA/Metal when this build has it and a device answers, else CPU), "cpu", "cuda[:N]", "metal".
        dtype: None/"auto" (float32 on CPU, bfloat16 on GPUs), "float32", "bfloat16", "float16".
        profile_overrides: any of mask_token_id, block_size, attention ("causal"|"block_causal"|"full"),
        alignment ("absolute"|"prompt"), logits_shift (bool), eos_token_ids (list of ints).
        """
        unknown = sorted(set(profile_overrides) - set(PROFILE_OVERRIDES))
        if unknown:
            raise TypeError(f"Engine.load() got unexpected keyword argument(s) {unknown}; "
                            f"valid profile overrides: {list(PROFILE_OVERRIDES)}")
        ov = dict(profile_overrides)
        if ov.get("eos_token_ids") is not None:
            ov["eos_token_ids"] = _token_ids(ov["eos_token_ids"], "eos_token_ids")
        if path is None:
            path = DEFAULT_MODEL
        return cls(_core.CoreModel.load(os.fspath(path), device, dtype, **ov))

    def __repr__(self) -> str:
        i = self.info
        return (f"Engine({i.family}, {i.num_parameters / 1e6:.2f}M params, {i.attention} attention, "
                f"block {i.block_size}, {i.dtype} on {i.device}, path={i.path!r})")

    def tokenize(self, text: str, *, add_special_tokens: bool = True) -> list:
        if not isinstance(text, str):
            raise InvalidRequestError(f"text must be a str, got {type(text).__name__}")
        return self._core.tokenize(text, add_special_tokens)

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._core.detokenize(_token_ids(ids), skip_special_tokens)

    def logits(self, ids: Sequence[int], *, attention: Optional[str] = None, block_size: Optional[int] = None,
               alignment: Optional[str] = None, prompt_len: Optional[int] = None, prefix_len: int = 0) -> np.ndarray:
        """Logits (len(ids) x vocab, float32) for every position of `ids`.

        attention/block_size/alignment default to the model's profile; `prompt_len` ends the prompt block for
        alignment="prompt". With prefix_len > 0 the first prefix_len tokens go through the KV-cache path and the
        rest are forwarded as a window over that cache (the result is the same; prefix_len must sit on a block
        boundary of the chosen attention)."""
        return self._core.logits(_token_ids(ids), attention, block_size, alignment, prompt_len, prefix_len)


# Request parameters: name -> (kind, checker description). Values are converted and range-checked here;
# the Rust core checks them again.
_INT, _FLOAT, _BOOL, _STR = "int", "float", "bool", "str"
GENERATION_PARAMS = {
    "max_tokens": _INT, "temperature": _FLOAT, "top_k": _INT, "top_p": _FLOAT, "seed": _INT,
    "stop": "stop", "stop_token_ids": "ids", "block_size": _INT, "threshold": _FLOAT, "acceptance": _STR,
    "block_add_threshold": _FLOAT, "decoded_token_threshold": _FLOAT, "forced_progress": _STR,
    "early_stop": _BOOL, "use_cache": _BOOL, "max_forward_passes": _INT, "trace": "trace",
}
_MIN = {"max_tokens": 1, "top_k": 0, "seed": 0, "block_size": 1, "max_forward_passes": 1}


def _check_params(params: dict) -> dict:
    unknown = sorted(set(params) - set(GENERATION_PARAMS))
    if unknown:
        raise TypeError(f"unexpected generation parameter(s) {unknown}; valid parameters: {sorted(GENERATION_PARAMS)}")
    out = {}
    for k, v in params.items():
        kind = GENERATION_PARAMS[k]
        if v is None:
            continue
        if kind == _INT:
            if isinstance(v, bool) or not isinstance(v, int):
                raise InvalidRequestError(f"{k} must be an integer, got {v!r}")
            if v < _MIN[k]:
                raise InvalidRequestError(f"{k} must be >= {_MIN[k]}, got {v}")
        elif kind == _FLOAT:
            if isinstance(v, bool) or not isinstance(v, (int, float)):
                raise InvalidRequestError(f"{k} must be a number, got {v!r}")
            v = float(v)
            if v != v or v in (float("inf"), float("-inf")):
                raise InvalidRequestError(f"{k} must be finite, got {v}")
            if k == "threshold" and v < 0:
                raise InvalidRequestError(f"threshold must be >= 0, got {v}")
            if k in ("block_add_threshold", "decoded_token_threshold") and not 0 <= v <= 1:
                raise InvalidRequestError(f"{k} must be in [0, 1], got {v}")
            if k == "top_p" and not 0 < v <= 1:
                raise InvalidRequestError(f"top_p must be in (0, 1], got {v}")
            if k == "temperature" and v < 0:
                raise InvalidRequestError(f"temperature must be >= 0, got {v}")
        elif kind == _BOOL:
            if not isinstance(v, bool):
                raise InvalidRequestError(f"{k} must be True or False, got {v!r}")
        elif kind == _STR:
            if not isinstance(v, str):
                raise InvalidRequestError(f"{k} must be a string, got {v!r}")
        elif kind == "stop":
            v = [v] if isinstance(v, str) else list(v)
            if not all(isinstance(s, str) for s in v):
                raise InvalidRequestError(f"stop must be a string or a list of strings, got {params[k]!r}")
        elif kind == "ids":
            v = _token_ids(v, k)
        elif kind == "trace":
            if v not in (True, False, "steps", "canvas"):
                raise InvalidRequestError(f"trace must be True, False, 'steps' or 'canvas', got {v!r}")
            out["trace_canvas"] = v == "canvas"
            v = bool(v)
        out[k] = v
    return out


def _usage(d: Optional[dict]) -> Optional[Usage]:
    return None if d is None else Usage(**d)


def _step(d: Optional[dict]) -> Optional[StepEvent]:
    return None if d is None else StepEvent(**d)


class Stream:
    """Iterator of StreamChunk: text streams token by token as the left-to-right prefix becomes stable.
    The last chunk has finish_reason and usage. Thread-safe cancel(); close() frees the KV cache now."""

    def __init__(self, core_stream, trace: bool):
        self._s = core_stream
        self._trace = trace
        self._done = False
        self.text = ""
        self.token_ids: list = []
        self.finish_reason: Optional[str] = None
        self.usage: Optional[Usage] = None

    def __iter__(self):
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
                return StreamChunk(d["text"], d["token_ids"], fin, _usage(d["usage"]), _step(d["step"]))
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
        if self.finish_reason is None:
            raise InvalidRequestError("stream was closed before it finished")
        return Completion(self.text, list(self.token_ids), self.finish_reason, self.usage)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    def __del__(self):
        try:
            self._s.close()
        except Exception:
            pass


def _engine_methods():
    def _prompt_ids(self, prompt, add_special_tokens=True):
        if isinstance(prompt, str):
            ids = self._core.tokenize(prompt, add_special_tokens)
        else:
            ids = _token_ids(prompt, "prompt")
        if not ids:
            raise InvalidRequestError("prompt is empty (0 tokens); give at least one token")
        return ids

    def stream(self, prompt, **params) -> Stream:
        """Stream a completion of `prompt` (a str or a list of token ids). See GENERATION_PARAMS."""
        p = _check_params(params)
        return Stream(self._core.start(self._prompt_ids(prompt), **p), p.get("trace", False))

    def generate(self, prompt, **params) -> Completion:
        """Generate a completion of `prompt` (a str or a list of token ids)."""
        return self.stream(prompt, **params).result()

    def apply_chat_template(self, messages, *, add_generation_prompt: bool = True, **template_kwargs) -> str:
        """Render `messages` ([{"role": ..., "content": ...}, ...]) with the model's chat template."""
        import json
        try:
            msgs = json.dumps(list(messages))
            extra = json.dumps(template_kwargs) if template_kwargs else None
        except (TypeError, ValueError) as e:
            raise InvalidRequestError(f"messages must be JSON-serialisable dicts: {e}") from None
        return self._core.apply_chat_template(msgs, add_generation_prompt, extra)

    def stream_chat(self, messages, **params) -> Stream:
        text = self.apply_chat_template(messages)
        p = _check_params(params)
        return Stream(self._core.start(self._prompt_ids(text, add_special_tokens=False), **p), p.get("trace", False))

    def chat(self, messages, **params) -> Completion:
        return self.stream_chat(messages, **params).result()

    for f in (_prompt_ids, stream, generate, apply_chat_template, stream_chat, chat):
        setattr(Engine, f.__name__, f)


_engine_methods()
