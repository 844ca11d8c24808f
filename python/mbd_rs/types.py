"""Result types returned by the engine (frozen dataclasses)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    forward_passes: int
    tokens_per_forward: float  # completion tokens / decode forward passes
    ttft_ms: float  # time to the first stable token, prefill included
    prefill_ms: float
    decode_ms: float  # wall time of the whole generation
    tokens_per_second: float
    positions_forwarded: int  # token positions run through the model by decode steps (prefill excluded)
    verifications: int = 0  # S2D2 verification forwards, ISD steps that verified drafts (speculative=...)
    drafts_proposed: int = 0  # draft tokens put to the verifier
    drafts_accepted: int = 0  # draft tokens the verifier accepted
    forced_tokens: int = 0  # completion tokens a grammar forced (its only choice), written without a forward
    cached_tokens: int = 0  # prompt tokens whose K/V came from the prefix cache (not prefilled)
    head_ms: float = 0.0  # the head over the logits rows (vocabulary product + per-row statistics), part of decode_ms

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    @property
    def acceptance_rate(self) -> float:
        """S2D2 and ISD: accepted / proposed drafts (0.0 when nothing was verified)."""
        return self.drafts_accepted / self.drafts_proposed if self.drafts_proposed else 0.0


@dataclass(frozen=True)
class PrefixCacheStats:
    """The prefix cache's counters (`Engine.prefix_cache_stats()`)."""

    capacity_bytes: int  # the cap (the `prefix_cache` load option; 0 = off)
    bytes: int  # K/V bytes held
    pages: int  # pages held (whole blocks of the grid, at least 32 tokens)
    lookups: int  # requests that looked a prefix up (where the cache is exact for them)
    hits: int  # requests that found one
    hit_tokens: int  # prompt tokens found, summed
    inserted_pages: int
    evicted_pages: int

    @property
    def hit_rate(self) -> float:
        return self.hits / self.lookups if self.lookups else 0.0


@dataclass(frozen=True)
class StepEvent:
    """One forward pass of the decoder (trace=True)."""

    index: int  # forward pass number (1-based)
    decoded: List[int]  # offsets from the prompt's end decoded by this step
    tokens: List[int]  # the tokens written at those offsets
    blocks: List[Tuple[int, int, str]]  # (start, end, state) per block; state: inactive|activated|fully_activated|completed
    tokens_per_forward: float  # completion tokens so far per forward so far (usage's number, at the last step)
    canvas: Optional[List[int]]  # the generated region, -1 for masks (trace="canvas")
    end: Optional[int]  # offset of the first decoded end-of-text token (EOS or stop_token_ids), None while none
    # canvas positions decoded so far per forward so far (the decoder's parallelism: the end of text and the fill
    # after it count; completion tokens do not include them)
    positions_per_forward: float = 0.0


@dataclass(frozen=True)
class TokenLogprob:
    """A token's log-probability: log-softmax of the raw logits (temperature, top-k and top-p do not change it)
    of the forward that decided it, with the most likely tokens of that forward when asked for."""

    token_id: int
    logprob: float
    top_logprobs: List[Tuple[int, float]]  # (token id, logprob), most likely first (ties: lower id first)


@dataclass(frozen=True)
class StreamChunk:
    text: str  # newly stable text
    token_ids: List[int]  # newly stable token ids
    finish_reason: Optional[str]  # "stop" | "length" | "cancelled" on the last chunk
    usage: Optional[Usage]  # on the last chunk
    step: Optional[StepEvent]  # with trace=True
    # with logprobs=k: one per token id (+ the ending EOS, see Completion); empty without logprobs
    logprobs: List[TokenLogprob] = field(default_factory=list)


@dataclass(frozen=True)
class ToolCall:
    """One call the model made (with tools): `arguments` is the JSON text of the arguments object, as OpenAI's API
    gives it."""

    id: str
    name: str
    arguments: str
    type: str = "function"


@dataclass(frozen=True)
class Completion:
    text: str
    token_ids: List[int]
    finish_reason: str
    usage: Usage
    # with logprobs=k: one per token id, then, when the generation ended at an EOS token, that token's (the EOS is
    # never in token_ids or text; OpenAI-style APIs list it, and loglikelihood clients count on the generated token);
    # empty without logprobs
    logprobs: List[TokenLogprob] = field(default_factory=list)
    # with tools: the calls the output made (finish_reason "tool_calls" when it ended after them)
    tool_calls: List[ToolCall] = field(default_factory=list)
    # the text outside the calls (None when the output is calls alone); `text` without tools
    content: Optional[str] = None


@dataclass(frozen=True)
class ModelInfo:
    """What is known about a loaded model (`Engine.info`): the fields of the core's `ModelInfo`
    (crates/mbd-core/src/model/info.rs), which `_core.MODEL_INFO_FIELDS` lists and tests/test_api_surface.py checks
    these against."""

    path: str
    family: str
    architecture: str
    arch: str
    num_parameters: int
    weight_bytes: int  # the weights as held in memory
    weight_format: str  # how the matrices are held: block formats, then dtypes, joined by "+" ("q4_k+q8_0", "float32")
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
    # the family's decoding defaults: what a request that leaves acceptance, threshold (tau), block_add_threshold
    # (alpha), decoded_token_threshold (beta), forced_progress or sub_block_size unset decodes with
    default_acceptance: str
    default_threshold: float
    default_block_add_threshold: float
    default_decoded_token_threshold: float
    default_forced_progress: str
    default_sub_block_size: Optional[int]
    eos_token_ids: List[int]
    attention: str
    alignment: str
    logits_shift: bool
    prefix_cache: str  # "exact" where the prefix cache serves requests under the model's grid, else "off: " and why
    dtype: str
    stored_dtype: Optional[str]
    device: str
    warnings: List[str]  # what the load warns about (quantize= that quantized nothing); Engine.load warns each
