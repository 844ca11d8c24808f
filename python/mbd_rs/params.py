"""The keyword arguments of the engine's calls, typed: generated from the core's registry (`mbd_rs.PARAMS`)
by scripts/gen_param_docs.py; do not edit. Every field is optional (None or absent: the default); ranges
are checked by the core."""
from __future__ import annotations

from typing import Any, Mapping, Optional, Sequence, TypedDict, Union


class GenerationParams(TypedDict, total=False):
    """The keyword arguments of Engine.generate / stream / chat / stream_chat."""

    max_tokens: Optional[int]
    """most tokens to generate (default: 256, or what the context has left)"""
    temperature: Optional[float]
    """0 = greedy (default); > 0 samples from softmax(logits / T)"""
    top_k: Optional[int]
    """sample among the k most likely tokens (0 = off, the default)"""
    top_p: Optional[float]
    """sample within this probability mass (1 = off, the default)"""
    min_p: Optional[float]
    """sample among the tokens at least this fraction as likely as the most likely one (0 = off, the default)"""
    presence_penalty: Optional[float]
    """subtracted from the logit of every token the completion holds already (OpenAI's; 0 = off)"""
    frequency_penalty: Optional[float]
    """times a token's count in the completion so far, subtracted from its logit (OpenAI's; 0 = off)"""
    repetition_penalty: Optional[float]
    """a token of the prompt or the completion so far: its positive logit divided by this, a negative one multiplied (transformers'; 1 = off)"""
    logit_bias: Optional[Union[str, Mapping[str, Any], type]]
    """added to the logits of the tokens named: {"token id": bias in [-100, 100], ...} (OpenAI's)"""
    seed: Optional[int]
    """random seed for sampling (default: from the OS)"""
    stop: Optional[Union[str, Sequence[str]]]
    """stop strings: the text ends before the first one found"""
    stop_token_ids: Optional[Sequence[int]]
    """token ids that end the generation like EOS"""
    block_size: Optional[int]
    """decoding block size (default: the model's)"""
    threshold: Optional[float]
    """tau: entropy bound, least probability, or EB gamma (default: the family's)"""
    acceptance: Optional[str]
    """which predictions a step accepts: entropy | confidence | eb | bacd (TDAR's bounded adaptive confidence) | credit (dInfer's CreditDecoding) | dus (dilated unmasking)"""
    bacd_lower: Optional[float]
    """acceptance='bacd': the lower bound on its confidence threshold (default 0.6)"""
    bacd_upper: Optional[float]
    """acceptance='bacd': the upper bound on its confidence threshold (default 0.9)"""
    credit_alpha: Optional[float]
    """acceptance='credit': the credit's fusion strength (default 0.7)"""
    credit_gamma: Optional[float]
    """acceptance='credit': the exponent on a step's max probability (default 0.2)"""
    credit_beta: Optional[float]
    """acceptance='credit': the credit's decay per step (default 0.8)"""
    block_add_threshold: Optional[float]
    """alpha: add a block when the last one is this decoded"""
    decoded_token_threshold: Optional[float]
    """beta: a block becomes fully active when its predecessor is this decoded"""
    forced_progress: Optional[str]
    """fully active blocks that must decode a token each step: first | every"""
    early_stop: Optional[bool]
    """stop at the first decoded EOS (default: true)"""
    use_cache: Optional[bool]
    """keep the exact KV cache of completed blocks (default: true)"""
    cache: Optional[str]
    """KV cache: exact (default where attention is block-causal or causal) | none (default for full attention) | prefix (full attention: d3LLM's approximate cache) | dual (full attention: Fast-dLLM v1's dual cache)"""
    cache_delay: Optional[int]
    """cache='prefix': steps a complete block waits before caching (default 1)"""
    refresh_interval: Optional[int]
    """cache='prefix': recompute the whole canvas every this many steps (default: never)"""
    prefix_window: Optional[str]
    """cache='prefix': forwards end at the canvas end (canvas, the default, as d3LLM) or at the end of the last created block (created)"""
    max_forward_passes: Optional[int]
    """stop after this many forward passes (default: 10000)"""
    sub_block_size: Optional[int]
    """Fast-dLLM v2 sub-blocks: each step decodes within the first sub-block of this size with masks (default: 8 for Fast-dLLM v2, whole blocks otherwise)"""
    speculative: Optional[str]
    """'s2d2': verify drafts with the same model at block size 1 | 'isd': I-DLM's introspective strided decoding (causal shifted models) (default: 'off')"""
    isd_stride: Optional[int]
    """speculative='isd': N, the most tokens a step writes; a step forwards up to 2N - 1 positions (default 4)"""
    tccf: Optional[bool]
    """TDAR's think coarse, critic fine: decode at block_size until tccf_trigger, then append tccf_check and answer at tccf_answer_block_size (default: off)"""
    tccf_trigger: Optional[str]
    """tccf: the one token that ends thinking (default '</think>')"""
    tccf_check: Optional[str]
    """tccf: the text put after the thinking (default "Let's check if there are any mistakes and give the final answer.")"""
    tccf_answer_block_size: Optional[int]
    """tccf: the answer's block size (default 1)"""
    response_format: Optional[Union[str, Mapping[str, Any], type]]
    """OpenAI's {"type": "text"} (the default), {"type": "json_object"}, or {"type": "json_schema", "json_schema": {"name": ..., "schema": {...}, "strict": true}}: the output is JSON, matching the schema"""
    grammar: Optional[str]
    """the output is a word of this grammar: Lark syntax (llguidance's, with %json{...} and regex terminals), or llguidance's grammar JSON"""
    regex: Optional[str]
    """the output matches this regular expression (Rust regex syntax), whole"""
    verify_policy: Optional[str]
    """when S2D2 verifies: always | min_span | score (default: E[K] - penalty >= threshold) | hysteresis"""
    verify_min_span: Optional[int]
    """min_span policy: verify spans of at least this many (default 8)"""
    verify_score_threshold: Optional[float]
    """score policy: verify iff E[K] - penalty >= this (default 0)"""
    verify_penalty: Optional[float]
    """the score's penalty coefficient c (default 1)"""
    verify_penalty_kind: Optional[str]
    """static: penalty c (default) | dynamic: c x tokens the step would accept without verifying"""
    verify_hysteresis: Optional[Sequence[float]]
    """hysteresis policy: (on, off) score thresholds (default (1, -5))"""
    logprobs: Optional[int]
    """report each token's log-probability (log-softmax of the raw logits) with this many most likely alternatives (0 = the token's own only; default: off)"""
    trace: Optional[Union[bool, str]]
    """True or 'steps': a StepEvent per forward; 'canvas': with the whole canvas"""
    cache_salt: Optional[str]
    """prefix cache: requests share cached prompts only with requests of the same salt (default: none, shared by all)"""

class LoadParams(TypedDict, total=False):
    """The keyword arguments of Engine.load."""

    device: Optional[str]
    """auto (CUDA or Metal when this build has it and a device answers, else the CPU) | cpu | cuda[:N] | metal"""
    dtype: Optional[str]
    """auto (float32 on the CPU, bfloat16 on GPUs) | float32 | bfloat16 | float16"""
    quantize: Optional[str]
    """quantize the weight matrices at load: q8_0 (8-bit) | q6_k | q5_k | q4_k | q3_k | q2_k (k-quants) | q5_0 | q4_0; CPU (float32) or CUDA"""
    int8_activations: Optional[bool]
    """quantized weights: integer dot products on activations rounded to 8 bits, as llama.cpp (default: where it runs, CUDA or a CPU with AVX2), or false for the exact float32 products (CPU)"""
    max_batch: Optional[int]
    """continuous batching: most streams one forward batches (default 16)"""
    max_batch_rows: Optional[int]
    """continuous batching: most window rows one forward batches (default 1024)"""
    prefix_cache: Optional[int]
    """bytes of K/V the prefix cache keeps across requests (0 = off; default: a quarter of the memory, at most 4 GiB, where decoding makes it exact)"""
    mask_token_id: Optional[int]
    """the mask token's id"""
    block_size: Optional[int]
    """decoding block size (default: the model's)"""
    attention: Optional[str]
    """causal | block_causal | full"""
    alignment: Optional[str]
    """block grid: absolute (blocks at multiples of B) | prompt (blocks from the prompt's end)"""
    logits_shift: Optional[bool]
    """whether the logit at position i-1 predicts token i"""
    eos_token_ids: Optional[Sequence[int]]
    """token ids that end a sequence"""
    keep_bf16_weights: Optional[bool]
    """CPU: a bf16 checkpoint's matrices stay bf16 in memory (default true)"""
    skinny: Optional[bool]
    """the few-row CPU kernel (default true; false: candle's matmul)"""
    par_min_macs: Optional[int]
    """products smaller than this many multiply-adds run on one thread"""
    max_rows: Optional[int]
    """windows of at most this many rows take the few-row kernel"""
    blocked_attention: Optional[bool]
    """the blocked CPU attention kernel (default true)"""
    panels: Optional[bool]
    """long windows' CPU products through the packed panels (default true)"""
    packed_weights: Optional[bool]
    """CPU matrices packed at load for the packed product (default true)"""
    packed_avx512: Optional[bool]
    """the packed product's AVX-512 tiles where the CPU has them (default true)"""
    stack: Optional[bool]
    """q/k/v and gate/up held as one matrix each (default true)"""
    cuda_fused: Optional[bool]
    """mbd-rs's own CUDA kernels (default true)"""
    cuda_segments: Optional[bool]
    """CUDA: a forward's segments in one attention launch (default false)"""
    cuda_graphs: Optional[bool]
    """CUDA with cuda_segments: replay a graph per forward shape (default false)"""
    candle_quant: Optional[bool]
    """CPU: quantized matrices as candle's quantized tensors (tests)"""

class LogitsParams(TypedDict, total=False):
    """The keyword arguments of Engine.logits."""

    attention: Optional[str]
    """causal | block_causal | full"""
    block_size: Optional[int]
    """decoding block size (default: the model's)"""
    alignment: Optional[str]
    """block grid: absolute (blocks at multiples of B) | prompt (blocks from the prompt's end)"""
    prompt_len: Optional[int]
    """end of the prompt block (alignment 'prompt')"""
    prefix_len: Optional[int]
    """tokens forwarded through the KV cache first (on a block boundary)"""

class ScoreParams(TypedDict, total=False):
    """The keyword arguments of Engine.prompt_logprobs."""

    logprobs: Optional[int]
    """report each token's log-probability (log-softmax of the raw logits) with this many most likely alternatives (0 = the token's own only; default: off)"""
