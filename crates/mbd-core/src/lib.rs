//! mbd-core: block-diffusion LLM inference on candle. The crate is a house of wings along the path the data takes
//! (docs/dev/architecture.md has the floor plan; `scripts/check_layers.py` enforces it: imports run only downward):
//!
//! - ground: `error` (the one error type), `util` (string-named enums, shared orderings, allocation checks),
//!   `cpu_pool` (the engine's CPU threads);
//! - `kernels`: arithmetic on slices — block formats, the one CPU probe, per-ISA products, attention, vector math,
//!   CUDA kernels;
//! - `load`: files to typed values as stored — JSON fields, config, safetensors/GGUF tensors, tokenizer, chat
//!   template;
//! - `decode`: pure policy over logits rows — the multi-block decoder, sampling, S2D2 routing, cache policy names;
//! - `net`: one forward over segments — masks, KV cache, linear layers (how a matrix is held and multiplied),
//!   attention backends, the Qwen architecture;
//! - `params`: every name a caller can pass — request parameters, load options, the decoding profile;
//! - `model`: a loaded model and its calls (load, text, scores);
//! - `generate`: one generation (plan → window → forward → predict → apply → emit) and the batch scheduler;
//! - `engine`: the façade — a model and its scheduler.
//!
//! The docs are written for whoever works on the crate: `cargo doc --document-private-items` shows every item, and
//! doc comments link the private items they rely on (`scripts/lint.sh` fails on a link that does not resolve).

#![allow(rustdoc::private_intra_doc_links)]

pub mod cpu_pool;
pub mod error;
pub mod util;

pub mod decode;
pub mod engine;
pub mod generate;
pub mod kernels;
pub mod load;
pub mod model;
pub mod net;
pub mod params;

pub use decode::sampling::TokenLogprob;
pub use engine::Engine;
pub use error::{Error, Result};
pub use generate::generation::{FinishReason, Generation, StepEvent, StepOutput, Usage};
pub use generate::scheduler::{Scheduler, StreamHandle};
pub use model::Model;
pub use net::mask::{Alignment, AttentionKind, BlockGrid};
pub use params::load::{BatchLimits, LoadOptions, LoadParams};
pub use params::profile::Profile;
pub use params::request::{GenRequest, LogitsRequest, ProfileOverrides, ScoreRequest};
