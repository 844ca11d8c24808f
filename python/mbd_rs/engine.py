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

PROFILE_OVERRIDES = ("mask_token_id", "block_size", "attention", "alignment", "logits_shift", "eos_token_ids")


@dataclass(frozen=True)
class ModelInfo:
    path: str
    family: str
    architecture: str
    arch: str
    num_parameters: int
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
    def load(cls, path: "str | os.PathLike[str]", *, device: str = "auto", dtype: Optional[str] = None,
             **profile_overrides: Any) -> "Engine":
        """Load an HF-format model directory.

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
