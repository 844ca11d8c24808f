//! The model wing: a loaded model (`Model`: weights, tokenizer, profile, chat template) and its calls. Stateless
//! between calls: each sequence owns its own `KvCache`, so one `Model` serves any number of sequences.
//! `load`: the load checklist; `text`: tokens and chat prompts; `score`: logits and scores outside a generation.

pub mod grammar;
pub mod info;
pub mod load;
pub mod score;
pub mod text;

use crate::error::{Error, Result};
use crate::load::chat::ChatTemplate;
use crate::load::config::ModelConfig;
use crate::net::forward::Runner;
use crate::net::graph::GraphStats;
use crate::net::kv_cache::KvCache;
use crate::net::mask::MaskSpec;
use crate::net::mask::{chunks, BlockGrid};
use crate::net::qwen::QwenNet;
use crate::net::segment::{Logits, Segment};
use crate::params::profile::Profile;
use crate::util::Cancel;
use candle_core::{DType, Device, Tensor};
use std::path::PathBuf;

pub struct Model {
    pub dir: PathBuf,
    pub config: ModelConfig,
    pub profile: Profile,
    /// The network built from the weights: reached through `Model`'s calls (`forward_segments`, `new_cache`, ...).
    pub(crate) net: QwenNet,
    /// What the forwards keep between calls: the step buffers and the CUDA graphs
    /// ([`net::forward`](crate::net::forward)).
    runner: Runner,
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
    /// The quantized matrices multiply activations rounded to 8 bits
    /// ([`LoadOptions::int8_activations`](crate::params::load::LoadOptions::int8_activations)).
    pub int8_activations: bool,
    pub chat_template: Option<ChatTemplate>,
    /// UTF-8 bytes of the longest token string (bounds the text a prompt can have and still fit the context).
    pub max_token_bytes: usize,
    /// The special added tokens' strings (control tokens such as `<|im_end|>`).
    pub special_tokens: Vec<String>,
    /// `tokenizer` reading control tokens as text, made the first time a text spells one
    /// ([`Model::literal_ids`]).
    pub(crate) literal_tokenizer: std::sync::OnceLock<tokenizers::Tokenizer>,
    /// The grammar compiler over this vocabulary, made on the first constrained request ([`Model::constraint`]).
    pub(crate) grammars: std::sync::OnceLock<crate::decode::grammar::compile::Grammars>,
}

impl Model {
    /// A fresh, empty cache for one sequence.
    pub fn new_cache(&self) -> Result<KvCache> {
        self.net.new_cache()
    }

    /// One forward over several sequences' windows
    /// ([`net::forward::Runner::forward_segments`](crate::net::forward::Runner::forward_segments)): per segment, in
    /// order, its rows' logits ((rows, vocab) f32) and its share of the head's time. Each window's K/V are left in its
    /// cache's scratch area.
    pub fn forward_segments(&self, segs: &mut [Segment<'_>]) -> Result<Vec<Logits>> {
        self.runner.forward_segments(&self.net, segs)
    }

    /// Forward one window of tokens at positions [cache.len(), cache.len() + ids.len()) under `grid`: a forward
    /// of one segment. `rows`: window rows whose logits are returned (None = all); `cancel`: stops the forward
    /// between layers once set.
    pub fn forward(
        &self,
        cache: &mut KvCache,
        ids: &[u32],
        grid: &BlockGrid,
        rows: Option<&[usize]>,
        cancel: Option<&Cancel>,
    ) -> Result<Tensor> {
        let p = cache.len();
        let seg = Segment {
            cache,
            ids,
            positions: (p..p + ids.len()).collect(),
            mask: MaskSpec::Grid(*grid),
            rows: rows.map(|r| r.to_vec()).unwrap_or_else(|| (0..ids.len()).collect()),
            cancel: cancel.cloned(),
        };
        let mut out = self.forward_segments(&mut [seg])?;
        Ok(out.pop().expect("one segment").rows)
    }

    pub fn device(&self) -> &Device {
        self.net.device()
    }

    pub fn dtype(&self) -> DType {
        self.net.dtype()
    }

    /// Whether some layer is a recurrence (Qwen3.5's Gated DeltaNet): such a model's windows run in order from
    /// the cache's frontier, and its cache only moves forward.
    pub fn is_hybrid(&self) -> bool {
        self.net.is_hybrid()
    }

    /// Whether every window row's logits and K/V are the same bits however a window is cut into forwards
    /// ([`QwenNet::rows_independent`]).
    pub fn rows_independent(&self) -> bool {
        self.net.rows_independent()
    }

    /// Keys that cost one row's products ([`QwenNet::key_equivalent`]).
    pub fn key_equivalent(&self) -> usize {
        self.net.key_equivalent()
    }

    /// Counts of the CUDA graphs of this model's forwards
    /// ([`Kernels::cuda_graphs`](crate::kernels::Kernels::cuda_graphs); zeros elsewhere).
    pub fn graph_stats(&self) -> GraphStats {
        self.runner.graph_stats()
    }

    /// Forward `ids` (at positions `cache.len()..`) under `grid` into the cache and commit them (on the caller's
    /// thread: run it on the engine's pool, as [`Generation::step`](crate::generate::generation::Generation::step)
    /// does), in chunks of about `PREFILL_CHUNK` positions that end on block boundaries (a block's positions see each
    /// other, so a block is never split). Returns the logits of the last position, (1, V) f32.
    pub fn fill_cache(&self, cache: &mut KvCache, ids: &[u32], grid: &BlockGrid) -> Result<Tensor> {
        if ids.is_empty() {
            return Err(Error::Internal("fill_cache: no tokens".into()));
        }
        let base = cache.len();
        let mut last = None;
        for (start, end) in chunks(grid, base, base + ids.len()) {
            let window = &ids[start - base..end - base];
            last = Some(self.forward(cache, window, grid, Some(&[end - start - 1]), None)?);
            cache.commit(end - start)?;
        }
        last.ok_or_else(|| Error::Internal("fill_cache: no chunk".into()))
    }
}
