//! The load wing: files to typed values, as stored. JSON files and their fields (`json`), the Qwen dimensions
//! (`config`), safetensors and GGUF tensors (`weights`, `gguf`), the tokenizer (`tokenizer`) and the chat template
//! (`chat`). It never chooses a kernel: how a matrix is held is [`net::linear`](crate::net::linear)'s rule.

pub mod chat;
pub mod config;
pub mod gguf;
pub mod json;
pub mod tokenizer;
pub mod weights;
