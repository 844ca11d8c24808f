//! mbd-core: block-diffusion LLM inference on candle.
//!
//! - `config`: model directory JSON → dimensions (`ModelConfig`) and decoding profile (`Profile`).
//! - `mask`: block ids per position and the additive attention masks built from them.
//! - `models::qwen`: the Qwen2/Qwen3/Qwen3-MoE forward over a prefix KV cache (`kv_cache`).
//! - `engine`: a loaded model directory (weights + tokenizer + profile).

pub mod config;
pub mod engine;
pub mod error;
pub mod kv_cache;
pub mod mask;
pub mod weights;
pub mod models {
    pub mod qwen;
}

pub use config::{Profile, ProfileOverrides};
pub use engine::Model;
pub use error::{Error, Result};
pub use mask::{Alignment, AttentionKind, BlockGrid};
pub mod decoder;
pub mod generate;
pub mod sampling;
pub mod text;
pub mod chat;
