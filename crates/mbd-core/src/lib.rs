//! mbd-core: block-diffusion LLM inference on candle. The path of a request, top to bottom
//! (docs/architecture.md has the page):
//!
//! - `generate`: one generation — plan (decoder) → window (`window`) → forward → predict (`sampling`) →
//!   apply (decoder) → emit (`output`).
//! - `request`: every request parameter (name, kind, range, help), written once; `GenRequest` and friends.
//! - `engine`: a loaded model directory (`Model`: weights, tokenizer, profile, chat template) and its calls.
//! - `models::qwen`: the Qwen2/Qwen3/Qwen3-MoE forward over a prefix KV cache (`kv_cache`).
//! - `weights`: safetensors checkpoints (and GGUF files' tensors), read tensor by tensor into the model's buffers.
//! - `gguf`: a model as one GGUF file: its metadata as config fields, its tokenizer, its tensors' names.
//! - `config`: model directory JSON → dimensions (`ModelConfig`), decoding profile (`Profile`), family defaults.
//! - `chat`: the model's chat template (minijinja).
//! - `window`: which positions a step forwards and which K/V it commits (exact prefix cache or recompute).
//! - `output`: the completion a generation emits: stable tokens, streamed text, finish reason, usage.
//! - `decoder`: the multi-block decoding state machine, pure logic.
//! - `sampling`: logits rows → predictions (token, entropy, max probability).
//! - `speculative`: S2D2 self-speculative verification: when to verify, which drafts to accept.
//! - `mask`: block ids per position and the attention masks built from them.
//! - `attention`: the CPU attention of small windows, every segment of a forward in one pass.
//! - `kv_cache`: the per-sequence K/V buffers.
//! - `text`: incremental detokenisation and stop strings.
//! - `skinny`: the CPU few-row matmul kernel (f32, bf16 and quantized weights).
//! - `quant`: quantized weight matrices (q8_0, q4_k) made at load.
//! - `scheduler`: continuous batching: one forward per tick over the segments of every active generation.
//! - `cpu_pool`: the engine's CPU thread pool.
//! - `util`, `error`: string-named enums, shared ordering; the one error type.

pub mod error;
pub mod util;

pub mod engine;
pub mod generate;
pub mod request;
pub mod models {
    pub mod qwen;
}
pub mod attention;
pub mod chat;
pub mod config;
pub mod cpu_pool;
pub mod cuda;
pub mod decoder;
pub mod gguf;
pub mod kv_cache;
pub mod mask;
pub mod output;
pub mod panels;
pub mod qdot;
pub mod quant;
pub mod sampling;
pub mod scheduler;
pub mod skinny;
pub mod speculative;
pub mod text;
pub mod vmath;
pub mod weights;
pub mod window;

pub use config::Profile;
pub use engine::{LoadOptions, Model};
pub use error::{Error, Result};
pub use mask::{Alignment, AttentionKind, BlockGrid};
pub use request::{GenRequest, LogitsRequest, ProfileOverrides, ScoreRequest};
pub use sampling::TokenLogprob;
