//! [`Model::load`]: a model directory or GGUF file through the load wing (config, tokenizer, weights, chat
//! template), the profile it implies, and the network built from its weights.

use crate::error::{Error, Result};
use crate::load::chat::ChatTemplate;
use crate::load::config::{refuse_internal_fields, ModelConfig};
use crate::load::gguf::GgufFile;
use crate::load::json::{read_json, Fields};
use crate::load::tokenizer::{load_tokenizer, tokenizer_from_json, tokenizer_mask_id};
use crate::load::weights::{checkpoint_files, Weights};
use crate::model::Model;
use crate::net::forward::Runner;
use crate::net::linear::{int8_activations, HeldMatrices, HoldPolicy, Holder};
use crate::net::mask::AttentionKind;
use crate::net::qwen::QwenNet;
use crate::params::load::{dtype_name, LoadOptions};
use crate::params::profile::{detect_family, Profile};
use serde_json::{Map, Value};
use std::path::Path;

/// Hand the heap memory freed during a load back to the system. Reading, quantizing and rearranging the weights
/// frees many large temporary buffers among the held ones; glibc keeps such holes in its heap, so the process's RSS
/// after a load stood well above the weights it holds (quantized models: benches/results/quantization.md).
/// Elsewhere a no-op.
fn release_freed_heap() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim only returns free heap pages to the system; it takes no pointers of ours.
    unsafe {
        libc::malloc_trim(0);
    }
}

/// Where a model comes from: a directory of HF files, or one GGUF file (metadata, vocabulary and tensors).
enum Source {
    Dir,
    Gguf(GgufFile),
}

impl Source {
    fn open(dir: &Path) -> Result<Source> {
        if dir.is_file() {
            Ok(Source::Gguf(GgufFile::read(dir)?))
        } else if dir.is_dir() {
            Ok(Source::Dir)
        } else if dir.exists() {
            // a FIFO, a socket, a device: something is there, but not a file this loader can read
            Err(Error::load(format!(
                "{}: not a regular file or a directory (a pipe, socket or device); a model is a directory or a GGUF \
                 file",
                dir.display()
            )))
        } else {
            Err(Error::FileNotFound {
                path: dir.to_path_buf(),
                what: "no such model directory (expected config.json, tokenizer.json and *.safetensors) or GGUF file"
                    .into(),
            })
        }
    }

    fn gguf(&self) -> Option<&GgufFile> {
        match self {
            Source::Gguf(g) => Some(g),
            Source::Dir => None,
        }
    }

    /// config.json's fields (a GGUF file's metadata as those fields) and the file to name in errors.
    fn config(&self, dir: &Path) -> Result<(Map<String, Value>, String)> {
        Ok(match self {
            Source::Gguf(g) => (g.hf_config()?, format!("{} (GGUF metadata as config.json)", dir.display())),
            Source::Dir => {
                let p = dir.join("config.json");
                (read_json(&p)?, p.display().to_string())
            }
        })
    }

    /// generation_config.json's fields, where the directory has one.
    fn generation_config(&self, dir: &Path) -> Result<Option<(Map<String, Value>, String)>> {
        let p = dir.join("generation_config.json");
        Ok(match self {
            Source::Dir if p.exists() => Some((read_json(&p)?, p.display().to_string())),
            _ => None,
        })
    }

    fn tokenizer(&self, dir: &Path) -> Result<tokenizers::Tokenizer> {
        match self {
            Source::Gguf(g) => {
                tokenizer_from_json(&g.tokenizer_json()?.to_string(), &format!("{} (GGUF tokenizer)", dir.display()))
            }
            Source::Dir => load_tokenizer(dir),
        }
    }

    fn weights(&self, dir: &Path, opts: &LoadOptions) -> Result<Weights> {
        let (dev, dt, keep) = (&opts.device, opts.dtype, opts.keep_bf16_weights);
        Ok(match self {
            Source::Gguf(g) => Weights::open_gguf(g, dev, dt, keep)?,
            Source::Dir => Weights::open(&checkpoint_files(dir)?, dev, dt, keep)?,
        }
        .with_progress(opts.progress.clone()))
    }

    fn chat_template(&self, dir: &Path) -> Result<Option<ChatTemplate>> {
        match self {
            Source::Gguf(g) => match g.chat_template()? {
                Some((src, bos, eos)) => {
                    Ok(Some(ChatTemplate::new(src, bos, eos, &format!("{} (GGUF metadata)", dir.display()))?))
                }
                None => Ok(None),
            },
            Source::Dir => ChatTemplate::from_dir(dir),
        }
    }
}

/// A multimodal checkpoint's config (Qwen3.5's `Qwen3_5ForConditionalGeneration`) keeps the language model's
/// fields in `text_config`: they are read over the top level's (whose `architectures`, block-diffusion fields and
/// token ids stay where the text config has none). The vision tower is not loaded.
fn text_config(mut map: Map<String, Value>, file: &str) -> Result<Map<String, Value>> {
    match map.remove("text_config") {
        None | Some(Value::Null) => Ok(map),
        Some(Value::Object(text)) => {
            map.remove("vision_config");
            for (k, v) in text {
                map.insert(k, v);
            }
            Ok(map)
        }
        Some(v) => Err(Error::config(format!(
            "{file}: field 'text_config' must be an object, found {}",
            crate::load::json::type_name(&v)
        ))),
    }
}

/// The profile's block size, mask token and end-of-sequence tokens checked against the checkpoint's dimensions
/// (`gen`: generation_config.json, whose eos_token_id adds to config.json's).
fn check_profile(
    profile: &Profile,
    config: &ModelConfig,
    opts: &LoadOptions,
    cfg: &Fields,
    gen: Option<&Fields>,
) -> Result<()> {
    let cfg_file = cfg.file;
    if let Some(m) = profile.mask_token_id {
        if m as usize >= config.vocab_size {
            return Err(Error::config(format!(
                "mask_token_id {m} is outside the vocabulary of {} tokens",
                config.vocab_size
            )));
        }
    }
    // An end-of-sequence id no token has would never end a sequence: refused where it is named.
    if let Some(&e) = profile.eos_token_ids.iter().find(|&&e| e as usize >= config.vocab_size) {
        let vocab = config.vocab_size;
        return Err(if opts.overrides.eos_token_ids.is_some() {
            Error::invalid(format!("eos_token_ids: token id {e} is outside the vocabulary of {vocab} tokens"))
        } else {
            let file = match gen {
                Some(g) if !cfg.ids("eos_token_id")?.contains(&e) => g.file,
                _ => cfg_file,
            };
            Error::config(format!(
                "{file}: field 'eos_token_id': token id {e} is outside the vocabulary of {vocab} tokens"
            ))
        });
    }
    if profile.block_size > config.max_position_embeddings {
        let msg = format!(
            "block_size {} is larger than the context (max_position_embeddings {} in {cfg_file})",
            profile.block_size, config.max_position_embeddings
        );
        return Err(if opts.overrides.block_size.is_some() { Error::invalid(msg) } else { Error::config(msg) });
    }
    Ok(())
}

/// How the matrices are held, for `info`, from what the holder held: the block formats (sorted), then the dtypes
/// of the matrices held unquantized, joined by '+' ("q4_k+q8_0": q4_k linear layers and the q8_0 tables a
/// `quantize="q4_k"` load holds; "float32" or "bfloat16": nothing quantized).
fn weight_format(held: &HeldMatrices) -> Result<String> {
    let parts: Vec<&str> = held.formats.iter().copied().chain(held.dense.iter().map(|&d| dtype_name(d))).collect();
    if parts.is_empty() {
        return Err(Error::Internal("a model without weight matrices".into()));
    }
    Ok(parts.join("+"))
}

/// The load's warnings ([`ModelInfo::warnings`](crate::model::info::ModelInfo::warnings)): a `quantize` option that
/// quantized no matrix; a hybrid under full attention.
fn load_warnings(
    opts: &LoadOptions,
    held: &HeldMatrices,
    format: &str,
    config: &ModelConfig,
    p: &Profile,
) -> Vec<String> {
    let mut out = vec![];
    if let Some(q) = opts.quantize.filter(|_| held.quantized == 0) {
        out.push(format!(
            "quantize='{}' quantized no matrix: the weights are held as {format} (a matrix is quantized when its rows \
             split into whole blocks of the format or of a fallback's, and a GGUF file's blocks stay as stored)",
            q.name()
        ));
    }
    // a hybrid's Gated DeltaNet layers are causal whatever the mask: only its softmax layers see the whole canvas
    if config.linear.is_some() && p.attention == AttentionKind::Full {
        out.push(
            "attention='full' on a Qwen3.5 hybrid: only its softmax layers attend to the whole canvas; its Gated \
             DeltaNet layers stay causal (they read positions in order), so this is not full attention throughout"
                .into(),
        );
    }
    out
}

impl Model {
    /// Load a model directory (config.json, tokenizer.json, safetensors) or a GGUF file
    /// ([`load::gguf`](crate::load::gguf)): the checklist, each step owned by its wing.
    pub fn load(dir: &Path, opts: &LoadOptions) -> Result<Model> {
        let src = Source::open(dir)?;
        let (cfg_map, cfg_file) = src.config(dir)?;
        let cfg_map = text_config(cfg_map, &cfg_file)?;
        let cfg_fields = Fields { file: &cfg_file, map: &cfg_map };
        if src.gguf().is_none() {
            refuse_internal_fields(&cfg_fields)?;
        }
        let (family, architecture) = detect_family(&cfg_fields)?;
        let config = ModelConfig::from_json(&cfg_fields, family.arch())?;
        let gen = src.generation_config(dir)?;
        let gen_fields = gen.as_ref().map(|(m, f)| Fields { file: f, map: m });
        let tokenizer = src.tokenizer(dir)?;
        let mask = tokenizer_mask_id(&tokenizer);
        let profile = Profile::resolve(family, architecture, &cfg_fields, gen_fields.as_ref(), mask, &opts.overrides)?;
        check_profile(&profile, &config, opts, &cfg_fields, gen_fields.as_ref())?;
        let (quantize, int8) = (opts.quantize, opts.int8_activations);
        let policy =
            HoldPolicy::resolve(&opts.device, opts.dtype, quantize, int8, &opts.kernels, src.gguf().is_some())?;
        let ws = src.weights(dir, opts)?.language_model();
        let holder = Holder::new(&ws, &policy);
        let net = QwenNet::load(&config, &holder, &opts.device, opts.dtype, opts.kernels)?;
        let held = holder.finish()?;
        let format = weight_format(&held)?;
        let max_token_bytes = tokenizer.get_vocab(true).keys().map(|t| t.len()).max().unwrap_or(1);
        let mut special_tokens: Vec<String> =
            tokenizer.get_added_tokens_decoder().into_values().filter(|t| t.special).map(|t| t.content).collect();
        special_tokens.sort();
        let model = Model {
            dir: dir.to_path_buf(),
            num_parameters: ws.num_parameters(),
            weight_bytes: ws.loaded_bytes(),
            load_warnings: load_warnings(opts, &held, &format, &config, &profile),
            weight_format: format,
            int8_activations: int8_activations(&policy, &held),
            chat_template: src.chat_template(dir)?,
            config,
            profile,
            net,
            runner: Runner::new(opts.attention_score_bytes),
            tokenizer,
            max_token_bytes,
            special_tokens,
            literal_tokenizer: std::sync::OnceLock::new(),
            grammars: std::sync::OnceLock::new(),
        };
        release_freed_heap();
        Ok(model)
    }
}
