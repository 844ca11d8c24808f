//! The prefix cache in a file: saved by one engine, loaded by another at its start (a long system prompt computed
//! once for every process that serves it, as llama.cpp's slot save and restore).
//!
//! The file is a safetensors file: each page's K/V per layer (`{page}.k.{layer}`, `{page}.v.{layer}`) and a hybrid's
//! snapshot (`{page}.state.{layer}`, `{page}.conv.{layer}`), with the tree in its metadata (`mbd_rs.prefix_cache`:
//! the format, the model's fingerprint, and per page its tree, parent and tokens).
//!
//! Exact or refused. Cached K/V are exact only for the engine that would compute the same ones: the same weights,
//! the same load options that change the arithmetic (dtype, quantization, 8-bit activations) and the same kernels.
//! The fingerprint is a hash of what matters, computed rather than described: the K/V (and a hybrid's recurrent
//! states) this engine writes for a fixed probe of [`PROBE`] tokens, every layer's. Every layer's K/V depend on
//! every weight that K/V depend on, and on nothing else. A file whose fingerprint is not this engine's is refused
//! with a message that says so; every tensor is checked against the shape this model's cache holds.

use crate::error::{Error, Result};
use crate::generate::prefix::{PageRecord, PrefixCache};
use crate::load::weights::Weights;
use crate::model::Model;
use crate::net::mask::{BlockGrid, MaskSpec};
use crate::net::segment::Segment;
use candle_core::{DType, Tensor};
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::path::Path;

/// The file format's name and version (in the metadata).
pub const FORMAT: &str = "mbd-rs prefix cache 1";
/// The metadata key that holds the tree.
pub const META_KEY: &str = "mbd_rs.prefix_cache";
/// Tokens of the fingerprint's probe.
pub const PROBE: usize = 32;
/// Tokens a page may hold at most in a file (a page is a few grid blocks: `PAGE_TOKENS` or a block size).
const MAX_PAGE: usize = 1 << 16;

#[derive(Serialize, Deserialize)]
struct Meta {
    format: String,
    model: String,
    pages: Vec<PageMeta>,
}

#[derive(Serialize, Deserialize)]
struct PageMeta {
    root: String,
    parent: Option<usize>,
    tokens: Vec<u32>,
    snapshot: bool,
}

/// The model's fingerprint: the SHA-256 of the K/V (and recurrent states) it computes for a fixed probe of
/// [`PROBE`] tokens under causal attention, in hex.
pub fn fingerprint(model: &Model) -> Result<String> {
    let mut cache = model.new_cache()?;
    let v = model.config.vocab_size.max(1) as u64;
    let ids: Vec<u32> = (0..PROBE as u64).map(|i| ((i * 7919 + 13) % v) as u32).collect();
    let seg = Segment {
        cache: &mut cache,
        ids: &ids,
        positions: (0..PROBE).collect(),
        mask: MaskSpec::Grid(BlockGrid::causal()),
        rows: vec![],
        cancel: None,
    };
    crate::cpu_pool::on_device_pool(model.device(), || model.forward_segments(&mut [seg]))?;
    cache.commit(PROBE)?;
    let mut h = Sha256::new();
    h.update(FORMAT.as_bytes());
    for (k, v) in cache.copy_rows(0, PROBE)? {
        hash_tensor(&mut h, &k)?;
        hash_tensor(&mut h, &v)?;
    }
    for (state, conv) in cache.recurrent_snapshot() {
        hash_tensor(&mut h, &state)?;
        hash_tensor(&mut h, &conv)?;
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

fn hash_tensor(h: &mut Sha256, t: &Tensor) -> Result<()> {
    h.update(format!("{:?}{:?}", t.dims(), t.dtype()).as_bytes());
    let vals = t.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
    let bytes: Vec<u8> = vals.iter().flat_map(|x| x.to_le_bytes()).collect();
    h.update(&bytes);
    Ok(())
}

/// Write every page of `cache` to `path` (through a temporary file beside it, renamed: a reader never sees half a
/// file). Returns the pages written.
pub fn save(cache: &PrefixCache, model: &Model, path: &Path) -> Result<usize> {
    let records = cache.records();
    let mut tensors: Vec<(String, Tensor)> = vec![];
    let mut pages = Vec::with_capacity(records.len());
    for (i, r) in records.iter().enumerate() {
        for (l, (k, v)) in r.rows.iter().enumerate() {
            tensors.push((format!("{i}.k.{l}"), k.clone()));
            tensors.push((format!("{i}.v.{l}"), v.clone()));
        }
        for (l, (state, conv)) in r.snapshot.iter().flatten().enumerate() {
            tensors.push((format!("{i}.state.{l}"), state.clone()));
            tensors.push((format!("{i}.conv.{l}"), conv.clone()));
        }
        pages.push(PageMeta {
            root: r.root.clone(),
            parent: r.parent,
            tokens: r.tokens.clone(),
            snapshot: r.snapshot.is_some(),
        });
    }
    let meta = Meta { format: FORMAT.into(), model: fingerprint(model)?, pages };
    let json = serde_json::to_string(&meta).map_err(|e| Error::Internal(format!("prefix cache metadata: {e}")))?;
    let info = HashMap::from([(META_KEY.to_string(), json)]);
    let name = path.file_name().ok_or_else(|| Error::invalid(format!("{}: not a file path", path.display())))?;
    let tmp = path.with_file_name(format!(".{}.partial", name.to_string_lossy()));
    let written = safetensors::serialize_to_file(tensors.iter().map(|(n, t)| (n.as_str(), t)), Some(info), &tmp)
        .map_err(|e| Error::invalid(format!("{}: cannot write the prefix cache: {e}", path.display())));
    if let Err(e) = written.and_then(|_| {
        std::fs::rename(&tmp, path)
            .map_err(|e| Error::invalid(format!("{}: cannot write the prefix cache: {e}", path.display())))
    }) {
        let _ = std::fs::remove_file(&tmp);
        return Err(e);
    }
    Ok(records.len())
}

/// Add the pages of the file at `path` (written by `save`) to `cache`, within its cap (least recently used pages
/// make room; pages that do not fit are left out). Refused, with the reason, when the file is not a prefix cache
/// file, was written by an engine that computes other K/V (another model, build or load options), or holds a
/// tensor of another shape than this model's cache. Returns the pages added.
pub fn load(cache: &PrefixCache, model: &Model, path: &Path) -> Result<usize> {
    let bad =
        |what: String| Error::invalid(format!("{}: not a prefix cache file of this model: {what}", path.display()));
    if !path.is_file() {
        return Err(Error::FileNotFound { path: path.to_path_buf(), what: "a prefix cache file".into() });
    }
    let probe = model.new_cache()?;
    let dtype = probe.dtype();
    // the file's own faults are the caller's input, not the model's
    let ours_err = |e: Error| match e {
        Error::ModelLoad(m) => Error::invalid(m),
        e => e,
    };
    let file = Weights::open(&[path.to_path_buf()], model.device(), dtype, false).map_err(ours_err)?;
    let json = file.metadata(META_KEY).ok_or_else(|| bad(format!("its metadata has no '{META_KEY}' entry")))?;
    let meta: Meta = serde_json::from_str(json).map_err(|e| {
        bad(format!("its '{META_KEY}' entry is not the tree of pages (line {}, column {})", e.line(), e.column()))
    })?;
    if meta.format != FORMAT {
        return Err(bad(format!("its format is '{}', this engine reads '{FORMAT}'", meta.format)));
    }
    let ours = fingerprint(model)?;
    if meta.model != ours {
        return Err(Error::invalid(format!(
            "{}: its K/V were computed by another model, engine build or load options (fingerprint {}, this \
             engine's {}); a prefix cache loads only into an engine that computes the same K/V",
            path.display(),
            short(&meta.model),
            short(&ours)
        )));
    }
    let (n_layers, n_kv, head_dim) = probe.row_shape();
    let snap = probe.recurrent_snapshot();
    let vocab = model.config.vocab_size;
    let mut page_of_root: HashMap<&str, usize> = HashMap::new();
    let mut records = Vec::with_capacity(meta.pages.len());
    for (i, p) in meta.pages.iter().enumerate() {
        let n = p.tokens.len();
        if n == 0 || n > MAX_PAGE {
            return Err(bad(format!("page {i} holds {n} tokens (1 to {MAX_PAGE})")));
        }
        if let Some(&t) = p.tokens.iter().find(|&&t| t as usize >= vocab) {
            return Err(bad(format!("page {i} holds token {t}, outside the vocabulary of {vocab}")));
        }
        if *page_of_root.entry(p.root.as_str()).or_insert(n) != n {
            return Err(bad(format!("page {i} holds {n} tokens, other pages of its tree another number")));
        }
        if let Some(q) = p.parent {
            if q >= i || meta.pages[q].root != p.root {
                return Err(bad(format!("page {i}'s parent {q} is not an earlier page of its tree")));
            }
        }
        if p.snapshot && snap.is_empty() {
            return Err(bad(format!("page {i} has recurrent states; this model has none")));
        }
        let rows = (0..n_layers)
            .map(|l| {
                let shape = [n_kv, n, head_dim];
                let get = |name: String| file.get(&name, &shape).map_err(ours_err);
                Ok((get(format!("{i}.k.{l}"))?, get(format!("{i}.v.{l}"))?))
            })
            .collect::<Result<Vec<_>>>()?;
        let snapshot = if p.snapshot {
            Some(
                snap.iter()
                    .enumerate()
                    .map(|(l, (s, c))| {
                        let state = file.get(&format!("{i}.state.{l}"), s.dims()).map_err(ours_err)?;
                        Ok((state, file.get(&format!("{i}.conv.{l}"), c.dims()).map_err(ours_err)?))
                    })
                    .collect::<Result<Vec<_>>>()?,
            )
        } else {
            None
        };
        records.push(PageRecord { root: p.root.clone(), parent: p.parent, tokens: p.tokens.clone(), rows, snapshot });
    }
    let (per_position, snap_bytes) = (probe.bytes_per_position(), probe.recurrent_bytes());
    Ok(cache.restore(records, |r| per_position * r.tokens.len() + if r.snapshot.is_some() { snap_bytes } else { 0 }))
}

fn short(h: &str) -> &str {
    h.get(..12).unwrap_or(h)
}
