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
use mbd_core::decoder::{Acceptance, ForcedProgress};
use mbd_core::generate::{GenRequest, Generation, StepOutput};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

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
        d.set_item("weight_bytes", m.weight_bytes)?;
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
    /// Seconds per decode forward of `window` tokens over a `prefix`-token cache (benchmarks).
    fn bench_forward(&self, py: Python<'_>, prefix: usize, window: usize, reps: usize) -> PyResult<Vec<f64>> {
        let m = self.inner.clone();
        run(py, move || m.bench_forward(prefix, window, reps))
    }

    #[pyo3(signature = (messages_json, add_generation_prompt=true, extra_json=None))]
    fn apply_chat_template(&self, messages_json: &str, add_generation_prompt: bool, extra_json: Option<&str>) -> PyResult<String> {
        let tmpl = self.inner.chat_template.as_ref().ok_or_else(|| {
            InvalidRequestError::new_err(format!(
                "{}: this model has no chat template (no chat_template.jinja and no 'chat_template' in tokenizer_config.json)",
                self.inner.dir.display()
            ))
        })?;
        let msgs: serde_json::Value = serde_json::from_str(messages_json).map_err(|e| InvalidRequestError::new_err(e.to_string()))?;
        let extra: serde_json::Value = match extra_json {
            Some(e) => serde_json::from_str(e).map_err(|e| InvalidRequestError::new_err(e.to_string()))?,
            None => serde_json::Value::Null,
        };
        tmpl.render(&msgs, add_generation_prompt, &extra).map_err(to_py)
    }

    #[pyo3(signature = (prompt_ids, max_tokens=None, temperature=None, top_k=None, top_p=None, seed=None, stop=None,
                        stop_token_ids=None, block_size=None, threshold=None, acceptance=None, block_add_threshold=None,
                        decoded_token_threshold=None, forced_progress=None, early_stop=None, use_cache=None,
                        max_forward_passes=None, trace=false, trace_canvas=false))]
    #[allow(clippy::too_many_arguments)]
    fn start(
        &self,
        py: Python<'_>,
        prompt_ids: Vec<i64>,
        max_tokens: Option<usize>,
        temperature: Option<f64>,
        top_k: Option<usize>,
        top_p: Option<f64>,
        seed: Option<u64>,
        stop: Option<Vec<String>>,
        stop_token_ids: Option<Vec<i64>>,
        block_size: Option<usize>,
        threshold: Option<f64>,
        acceptance: Option<String>,
        block_add_threshold: Option<f64>,
        decoded_token_threshold: Option<f64>,
        forced_progress: Option<String>,
        early_stop: Option<bool>,
        use_cache: Option<bool>,
        max_forward_passes: Option<usize>,
        trace: bool,
        trace_canvas: bool,
    ) -> PyResult<CoreStream> {
        let prompt = ids_u32(prompt_ids)?;
        let req = GenRequest {
            max_tokens,
            temperature,
            top_k,
            top_p,
            seed,
            stop: stop.unwrap_or_default(),
            stop_token_ids: stop_token_ids.map(ids_u32).transpose()?.unwrap_or_default(),
            block_size,
            threshold,
            acceptance: acceptance.as_deref().map(Acceptance::parse).transpose().map_err(to_py)?,
            block_add_threshold,
            decoded_token_threshold,
            forced_progress: forced_progress.as_deref().map(ForcedProgress::parse).transpose().map_err(to_py)?,
            early_stop,
            use_cache,
            max_forward_passes,
            trace,
            trace_canvas,
        };
        let m = self.inner.clone();
        let g = run(py, move || Generation::new(m, prompt, &req))?;
        Ok(CoreStream { generation: Mutex::new(Some(g)), cancelled: AtomicBool::new(false) })
    }
}

/// One generation in progress. `step()` advances it by one forward with the GIL released.
#[pyclass(frozen, module = "mbd_rs._core")]
struct CoreStream {
    generation: Mutex<Option<Generation>>,
    cancelled: AtomicBool,
}

fn output_dict<'py>(py: Python<'py>, o: StepOutput) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("token_ids", o.token_ids)?;
    d.set_item("text", o.text)?;
    d.set_item("finish_reason", o.finish_reason.map(|f| f.name()))?;
    if let Some(u) = o.usage {
        let ud = PyDict::new(py);
        ud.set_item("prompt_tokens", u.prompt_tokens)?;
        ud.set_item("completion_tokens", u.completion_tokens)?;
        ud.set_item("forward_passes", u.forward_passes)?;
        ud.set_item("tokens_per_forward", u.tokens_per_forward)?;
        ud.set_item("ttft_ms", u.ttft_ms)?;
        ud.set_item("prefill_ms", u.prefill_ms)?;
        ud.set_item("decode_ms", u.decode_ms)?;
        ud.set_item("tokens_per_second", u.tokens_per_second)?;
        ud.set_item("positions_forwarded", u.positions_forwarded)?;
        d.set_item("usage", ud)?;
    } else {
        d.set_item("usage", py.None())?;
    }
    if let Some(e) = o.event {
        let ed = PyDict::new(py);
        ed.set_item("index", e.index)?;
        ed.set_item("decoded", e.decoded)?;
        ed.set_item("tokens", e.tokens)?;
        let blocks: Vec<(usize, usize, &str)> = e.blocks.iter().map(|(a, b, s)| (*a, *b, s.name())).collect();
        ed.set_item("blocks", blocks)?;
        ed.set_item("tokens_per_forward", e.tokens_per_forward)?;
        ed.set_item("canvas", e.canvas)?;
        d.set_item("step", ed)?;
    } else {
        d.set_item("step", py.None())?;
    }
    Ok(d)
}

#[pymethods]
impl CoreStream {
    /// Advance by one forward. Returns a dict (token_ids, text, finish_reason, usage, step), or None when
    /// the generation has finished or was closed.
    fn step<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let out = py.detach(|| {
            catch_panic(|| {
                let mut guard = self.generation.lock().map_err(|_| Error::Internal("stream lock poisoned".into()))?;
                let Some(g) = guard.as_mut() else { return Ok(None) };
                if self.cancelled.load(Ordering::SeqCst) {
                    let o = g.cancel();
                    return Ok(if o.finish_reason.is_some() { Some(o) } else { None });
                }
                g.step()
            })
        });
        match out.map_err(to_py)? {
            Some(o) => Ok(Some(output_dict(py, o)?)),
            None => Ok(None),
        }
    }

    /// Ask the generation to stop; thread-safe. The next step returns finish_reason "cancelled".
    fn cancel(&self) {
        self.cancelled.store(true, Ordering::SeqCst);
    }

    /// Free the generation's state (KV cache) now.
    fn close(&self, py: Python<'_>) {
        self.cancelled.store(true, Ordering::SeqCst);
        py.detach(|| {
            if let Ok(mut g) = self.generation.lock() {
                *g = None;
            }
        });
    }
}

/// Benchmark switches for A/B runs in one process (not public API): the skinny kernel on/off and its
/// parallel threshold in multiply-adds, the row limit, bf16 weight storage on the CPU. Returns the settings now
/// in force; `bf16_weights` applies to models loaded afterwards.
#[pyfunction]
#[pyo3(signature = (skinny=None, par_min_macs=None, max_rows=None, bf16_weights=None))]
fn _tuning(skinny: Option<bool>, par_min_macs: Option<usize>, max_rows: Option<usize>, bf16_weights: Option<bool>) -> (bool, usize, usize, bool) {
    if let Some(b) = bf16_weights {
        mbd_core::skinny::set_keep_bf16_weights(b);
    }
    let (a, b, c) = mbd_core::skinny::set_tuning(skinny, par_min_macs, max_rows);
    (a, b, c, mbd_core::skinny::keep_bf16_weights())
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CoreModel>()?;
    m.add_class::<CoreStream>()?;
    m.add_function(wrap_pyfunction!(_tuning, m)?)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("cuda_available", cfg!(feature = "cuda"))?;
    // At import, before any stream runs: pin the CPU thread count once (see mbd_core::pin_thread_count).
    m.add("cpu_threads", mbd_core::pin_thread_count())?;
    Ok(())
}
