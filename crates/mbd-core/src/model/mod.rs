//! The model wing: a loaded model (`Model`: weights, tokenizer, profile, chat template) and its calls. Stateless
//! between calls: each sequence owns its own `KvCache`, so one `Model` serves any number of sequences.
//! `load`: the load checklist; `text`: tokens and chat prompts; `score`: logits and scores outside a generation.

pub mod info;
pub mod load;
pub mod score;
pub mod text;

use crate::error::{Error, Result};
use crate::load::chat::ChatTemplate;
use crate::load::config::ModelConfig;
use crate::net::kv_cache::KvCache;
use crate::net::mask::{chunks, BlockGrid};
use crate::net::qwen::QwenModel;
use crate::params::profile::Profile;
use candle_core::Tensor;
use std::path::PathBuf;

pub struct Model {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub profile: Profile,
    pub net: QwenModel,
    pub tokenizer: tokenizers::Tokenizer,
    pub num_parameters: usize,
    /// Bytes of the weights as held in memory (a bf16 checkpoint's matrices stay bf16 on the CPU).
    pub weight_bytes: usize,
    /// How the weight matrices are held: the block formats held, then the dtypes of the matrices held unquantized,
    /// joined by '+' ("q8_0", "q4_k+q8_0": q4_k layers and q8_0 tables; "bfloat16" for a bf16 checkpoint on the
    /// CPU, else the compute dtype).
    pub weight_format: String,
    /// What the load warns about (a `quantize` option that quantized nothing); Python's Engine.load warns each.
    pub load_warnings: Vec<String>,
    /// The quantized matrices multiply activations rounded to 8 bits (`LoadOptions::int8_activations`).
    pub int8_activations: bool,
    pub chat_template: Option<ChatTemplate>,
    /// UTF-8 bytes of the longest token string (bounds the text a prompt can have and still fit the context).
    pub max_token_bytes: usize,
    /// The special added tokens' strings (control tokens such as `<|im_end|>`).
    pub special_tokens: Vec<String>,
}

impl Model {
    pub fn new_cache(&self) -> Result<KvCache> {
        self.net.new_cache()
    }

    /// Forward `ids` (at positions `cache.len()..`) under `grid` into the cache and commit them (on the caller's
    /// thread: run it on the engine's pool, as `Generation::step` does), in chunks of
    /// about `PREFILL_CHUNK` positions that end on block boundaries (a block's positions see each other, so a
    /// block is never split). Returns the logits of the last position, (1, V) f32.
    pub fn fill_cache(&self, cache: &mut KvCache, ids: &[u32], grid: &BlockGrid) -> Result<Tensor> {
        if ids.is_empty() {
            return Err(Error::Internal("fill_cache: no tokens".into()));
        }
        let base = cache.len();
        let mut last = None;
        for (start, end) in chunks(grid, base, base + ids.len()) {
            let window = &ids[start - base..end - base];
            last = Some(self.net.forward(cache, window, grid, Some(&[end - start - 1]), None)?);
            cache.commit(end - start)?;
        }
        last.ok_or_else(|| Error::Internal("fill_cache: no chunk".into()))
    }
}
