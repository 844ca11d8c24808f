//! GGUF files (llama.cpp's single-file format): a model given as one `.gguf` file instead of a directory.
//!
//! What is read from the file, and what it becomes:
//! - the metadata (`general.architecture` = `qwen2`, `qwen3`, `qwen3moe`, `qwen35`, `qwen35moe` or `dream`;
//!   `<arch>.block_count`, `.embedding_length`, ...) becomes the config.json fields of the same model (`hf_config`),
//!   which then go through the one config parser
//!   ([`config::ModelConfig::from_json`](crate::load::config::ModelConfig::from_json),
//!   [`profile::detect_family`](crate::params::profile::detect_family),
//!   [`Profile::resolve`](crate::params::profile::Profile::resolve));
//! - the tokenizer (`tokenizer.ggml.*`: a byte-level BPE vocabulary, its merges, token types, the pre-tokenizer's
//!   name) becomes a Hugging Face tokenizer.json (`tokenizer_json`), and `tokenizer.chat_template` the chat template;
//! - the tensors (llama.cpp's names: `blk.N.attn_q.weight`, ...) are renamed to the Hugging Face names the model
//!   loader asks for (`tensors`), with their shapes in PyTorch order and their element type (`GgmlDType`: floats, or a
//!   block format), and read by [`weights::Weights`](crate::load::weights::Weights) like a safetensors shard.
//!
//! The file is untrusted input: every length and count is checked against the bytes the file holds before anything is
//! allocated from it; only the values of the keys the loader reads are built (`read_key`: every other value, a gigabyte
//! array or string included, is skipped unread), under caps on each string (`MAX_STRING`, the chat template
//! `MAX_CHAT_TEMPLATE_BYTES`) and on the memory of all of them (`MAX_METADATA_BYTES`, counted before allocating);
//! strings must be UTF-8, floats finite; tensors must lie inside the data section, aligned and not overlapping. A file
//! that is not GGUF is called that without echoing its bytes.
//!
//! `container`: the file as stored (the untrusted header, the metadata the loader keeps, the tensor table); `config`:
//! the metadata as config.json fields; `tensors`: llama.cpp's tensor names as Hugging Face's; `vocab`: the vocabulary
//! as a tokenizer.json, and the chat template.

mod config;
mod container;
mod tensors;
mod vocab;

pub use container::{dtype_name, GgufFile, GgufTensor};
