//! Thin PyO3 binding: converts Python values to mbd-core calls and core errors to the Python exception
//! hierarchy defined in `mbd_rs.errors`. No engine logic lives here.

use mbd_core::config::ProfileOverrides;
use mbd_core::engine::{device_name, dtype_name, parse_device, parse_dtype};
use mbd_core::error::catch_panic;
use mbd_core::{Alignment, AttentionKind, BlockGrid, Error, Model};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::path::PathBuf;
use std::sync::Arc;

pyo3::import_exception!(mbd_rs.errors, MbdError);
pyo3::import_exception!(mbd_rs.errors, ModelLoadError);
pyo3::import_exception!(mbd_rs.errors, ModelFileNotFoundError);
pyo3::import_exception!(mbd_rs.errors, ConfigError);
pyo3::import_exception!(mbd_rs.errors, UnsupportedArchitectureError);
pyo3::import_exception!(mbd_rs.errors, InvalidRequestError);
pyo3::import_exception!(mbd_rs.errors, ContextLengthError);
pyo3::import_exception!(mbd_rs.errors, InternalError);

fn to_py(e: Error) -> PyErr {
    match e {
        Error::FileNotFound { path, what } => {
            ModelFileNotFoundError::new_err((2, format!("no such file ({what})"), path.display().to_string()))
        }
        Error::ModelLoad(m) => ModelLoadError::new_err(m),
        Error::Config(m) => ConfigError::new_err(m),
        Error::Unsupported(m) => UnsupportedArchitectureError::new_err(m),
        Error::InvalidRequest(m) => InvalidRequestError::new_err(m),
        Error::ContextLength(m) => ContextLengthError::new_err(m),
        Error::Backend(b) => MbdError::new_err(format!("tensor backend error: {b}")),
        Error::Internal(m) => InternalError::new_err(format!("internal error (please report): {m}")),
    }
}

/// Run a core call with the GIL released, converting panics and errors.
fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> mbd_core::Result<T> + Send) -> PyResult<T> {
    py.detach(|| catch_panic(f)).map_err(to_py)
}

fn ids_u32(ids: Vec<i64>) -> PyResult<Vec<u32>> {
    ids.iter()
        .enumerate()
        .map(|(i, &t)| {
            u32::try_from(t).map_err(|_| InvalidRequestError::new_err(format!("token id {t} at index {i} is not a valid id (must be >= 0)")))
        })
        .collect()
}

#[pyclass(frozen, module = "mbd_rs._core")]
struct CoreModel {
    inner: Arc<Model>,
}

#[pymethods]
impl CoreModel {
    #[staticmethod]
    #[pyo3(signature = (path, device="auto", dtype=None, mask_token_id=None, block_size=None, attention=None,
                        alignment=None, logits_shift=None, eos_token_ids=None))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        device: &str,
        dtype: Option<String>,
        mask_token_id: Option<i64>,
        block_size: Option<i64>,
        attention: Option<String>,
        alignment: Option<String>,
        logits_shift: Option<bool>,
        eos_token_ids: Option<Vec<i64>>,
    ) -> PyResult<Self> {
        let device = device.to_string();
        let ov = ProfileOverrides {
            mask_token_id: mask_token_id.map(|m| ids_u32(vec![m]).map(|v| v[0])).transpose()?,
            block_size: match block_size {
                Some(b) if b < 1 => return Err(InvalidRequestError::new_err(format!("block_size must be >= 1, got {b}"))),
                b => b.map(|b| b as usize),
            },
            attention: attention.as_deref().map(AttentionKind::parse).transpose().map_err(to_py)?,
            alignment: alignment.as_deref().map(Alignment::parse).transpose().map_err(to_py)?,
            logits_shift,
            eos_token_ids: eos_token_ids.map(ids_u32).transpose()?,
        };
        let model = run(py, || {
            let dev = parse_device(&device)?;
            let dt = parse_dtype(dtype.as_deref(), &dev)?;
            Model::load(&path, &dev, dt, &ov)
        })?;
        Ok(CoreModel { inner: Arc::new(model) })
    }

    /// Everything known about the loaded model, as a dict (the Python layer wraps it in ModelInfo).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let m = &self.inner;
        let (c, p) = (&m.config, &m.profile);
        let d = PyDict::new(py);
        d.set_item("path", m.dir.display().to_string())?;
        d.set_item("family", p.family.name())?;
        d.set_item("architecture", &p.architecture)?;
        d.set_item("arch", c.arch.name())?;
        d.set_item("num_parameters", m.num_parameters)?;
        d.set_item("vocab_size", c.vocab_size)?;
        d.set_item("hidden_size", c.hidden_size)?;
        d.set_item("intermediate_size", c.intermediate_size)?;
        d.set_item("num_layers", c.num_hidden_layers)?;
        d.set_item("num_attention_heads", c.num_attention_heads)?;
        d.set_item("num_key_value_heads", c.num_key_value_heads)?;
        d.set_item("head_dim", c.head_dim)?;
        d.set_item("max_context", c.max_position_embeddings)?;
        d.set_item("num_experts", c.moe.as_ref().map(|x| x.num_experts))?;
        d.set_item("num_experts_per_tok", c.moe.as_ref().map(|x| x.num_experts_per_tok))?;
        d.set_item("mask_token_id", p.mask_token_id)?;
        d.set_item("block_size", p.block_size)?;
        d.set_item("eos_token_ids", p.eos_token_ids.clone())?;
        d.set_item("attention", p.attention.name())?;
        d.set_item("alignment", p.alignment.name())?;
        d.set_item("logits_shift", p.logits_shift)?;
        d.set_item("dtype", dtype_name(m.net.dtype()))?;
        d.set_item("stored_dtype", p.stored_dtype.clone())?;
        d.set_item("device", device_name(m.net.device()))?;
        Ok(d)
    }

    #[pyo3(signature = (text, add_special_tokens=true))]
    fn tokenize(&self, py: Python<'_>, text: String, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let m = self.inner.clone();
        run(py, move || {
            let enc = m.tokenizer.encode(text, add_special_tokens).map_err(|e| Error::invalid(format!("cannot tokenize: {e}")))?;
            Ok(enc.get_ids().to_vec())
        })
    }

    #[pyo3(signature = (ids, skip_special_tokens=true))]
    fn detokenize(&self, py: Python<'_>, ids: Vec<i64>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = ids_u32(ids)?;
        let m = self.inner.clone();
        run(py, move || {
            m.check_ids(&ids)?;
            m.tokenizer.decode(&ids, skip_special_tokens).map_err(|e| Error::invalid(format!("cannot detokenize: {e}")))
        })
    }

    #[pyo3(signature = (ids, attention=None, block_size=None, alignment=None, prompt_len=None, prefix_len=0))]
    #[allow(clippy::too_many_arguments)]
    fn logits<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<i64>,
        attention: Option<String>,
        block_size: Option<i64>,
        alignment: Option<String>,
        prompt_len: Option<i64>,
        prefix_len: i64,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids = ids_u32(ids)?;
        let p = &self.inner.profile;
        let kind = match attention.as_deref() {
            Some(a) => AttentionKind::parse(a).map_err(to_py)?,
            None => p.attention,
        };
        let align = match alignment.as_deref() {
            Some(a) => Alignment::parse(a).map_err(to_py)?,
            None => p.alignment,
        };
        let bs = match block_size {
            Some(b) if b < 1 => return Err(InvalidRequestError::new_err(format!("block_size must be >= 1, got {b}"))),
            Some(b) => b as usize,
            None => p.block_size,
        };
        if prefix_len < 0 {
            return Err(InvalidRequestError::new_err(format!("prefix_len must be >= 0, got {prefix_len}")));
        }
        let plen = match (align, kind, prompt_len) {
            (_, _, Some(l)) if l < 0 || l as usize > ids.len() => {
                return Err(InvalidRequestError::new_err(format!(
                    "prompt_len must be between 0 and len(ids) = {}, got {l}",
                    ids.len()
                )))
            }
            (Alignment::Prompt, AttentionKind::BlockCausal, None) => {
                return Err(InvalidRequestError::new_err("prompt_len is required with alignment='prompt'"))
            }
            (_, _, l) => l.unwrap_or(0) as usize,
        };
        let grid = BlockGrid::new(kind, bs, align, plen).map_err(to_py)?;
        let n = ids.len();
        let m = self.inner.clone();
        let v = m.config.vocab_size;
        let prefix = prefix_len as usize;
        let out = run(py, move || m.logits(&ids, &grid, prefix))?;
        let arr = PyArray1::from_vec(py, out).reshape([n, v]).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(arr.into_any())
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CoreModel>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("cuda_available", cfg!(feature = "cuda"))?;
    Ok(())
}
