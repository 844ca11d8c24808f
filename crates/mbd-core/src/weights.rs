//! Memory-mapped safetensors checkpoints (single file or sharded with an index), with errors that name the
//! file, the tensor, the expected and the found shape.

use crate::error::{Error, Result};
use candle_core::safetensors::MmapedSafetensors;
use candle_core::{DType, Device, Tensor};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

pub struct Weights {
    files: Vec<(PathBuf, MmapedSafetensors)>,
    index: HashMap<String, usize>,
    device: Device,
    dtype: DType,
}

/// The safetensors files of a model directory: `model.safetensors`, or the shards listed by
/// `model.safetensors.index.json`.
pub fn checkpoint_files(dir: &Path) -> Result<Vec<PathBuf>> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        let m = crate::config::read_json(&index)?;
        let wm = m.get("weight_map").and_then(|v| v.as_object()).ok_or_else(|| {
            Error::config(format!("{}: field 'weight_map' is missing or not an object", index.display()))
        })?;
        let mut files: Vec<String> = Vec::new();
        for (name, f) in wm {
            let f = f.as_str().ok_or_else(|| {
                Error::config(format!("{}: weight_map['{name}'] must be a file name", index.display()))
            })?;
            if !files.iter().any(|x| x == f) {
                files.push(f.to_string());
            }
        }
        files.sort();
        return Ok(files.into_iter().map(|f| dir.join(f)).collect());
    }
    let single = dir.join("model.safetensors");
    if single.exists() {
        return Ok(vec![single]);
    }
    Err(Error::FileNotFound {
        path: single,
        what: "the model weights (model.safetensors or model.safetensors.index.json)".into(),
    })
}

impl Weights {
    pub fn open(paths: &[PathBuf], device: &Device, dtype: DType) -> Result<Self> {
        let mut files = Vec::new();
        let mut index = HashMap::new();
        for (i, p) in paths.iter().enumerate() {
            if !p.exists() {
                return Err(Error::FileNotFound { path: p.clone(), what: "a weights shard named by the index".into() });
            }
            // SAFETY: the file is mapped read-only; we never hand out references past the map's lifetime.
            let st = unsafe { MmapedSafetensors::new(p) }
                .map_err(|e| Error::load(format!("{}: not a readable safetensors file: {e}", p.display())))?;
            for (name, _) in st.tensors() {
                index.insert(name, i);
            }
            files.push((p.clone(), st));
        }
        Ok(Weights { files, index, device: device.clone(), dtype })
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn shape(&self, name: &str) -> Option<Vec<usize>> {
        let i = *self.index.get(name)?;
        self.files[i].1.get(name).ok().map(|v| v.shape().to_vec())
    }

    /// Total number of parameters stored.
    pub fn num_parameters(&self) -> usize {
        self.files.iter().flat_map(|(_, st)| st.tensors()).map(|(_, v)| v.shape().iter().product::<usize>()).sum()
    }

    fn where_(&self) -> String {
        match self.files.len() {
            1 => self.files[0].0.display().to_string(),
            n => format!("{} (and {} more shards)", self.files[0].0.display(), n - 1),
        }
    }

    /// Load a tensor, checking its shape, in the compute dtype on the compute device.
    pub fn get(&self, name: &str, shape: &[usize]) -> Result<Tensor> {
        let i = *self
            .index
            .get(name)
            .ok_or_else(|| Error::load(format!("{}: tensor '{name}' is missing (expected shape {shape:?})", self.where_())))?;
        let (path, st) = &self.files[i];
        let found = st.get(name).map_err(|e| Error::load(format!("{}: tensor '{name}': {e}", path.display())))?;
        if found.shape() != shape {
            return Err(Error::load(format!(
                "{}: tensor '{name}' has shape {:?}, expected {shape:?}",
                path.display(),
                found.shape()
            )));
        }
        let t = st
            .load(name, &Device::Cpu)
            .map_err(|e| Error::load(format!("{}: tensor '{name}': {e}", path.display())))?;
        Ok(t.to_dtype(self.dtype)?.to_device(&self.device)?)
    }

    pub fn get_opt(&self, name: &str, shape: &[usize]) -> Result<Option<Tensor>> {
        if self.contains(name) {
            self.get(name, shape).map(Some)
        } else {
            Ok(None)
        }
    }
}
