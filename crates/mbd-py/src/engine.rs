//! `CoreEngine`: the core's `Engine` (a model and its scheduler) as a Python class. Each method converts its
//! arguments (`convert`), calls the core with the GIL released (`run`) and converts the result.

use crate::convert::{ids, int, json_to_py, messages_value, request, string, template_extra};
use crate::stream::{logprob_tuple, CoreStream, LogprobTuple};
use crate::{run, run_cancellable, to_py};
use mbd_core::load::weights::Progress;
use mbd_core::model::info::MODEL_INFO_FIELDS;
use mbd_core::params::load::{BatchLimits, LoadParams};
use mbd_core::params::request::{GenRequest, LogitsRequest, ScoreRequest};
use mbd_core::util::Cancel;
use mbd_core::{Engine, Error, Model};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyString};
use std::path::PathBuf;
use std::sync::Arc;

/// Stops a long call (`logits`, `prompt_logprobs`) from another thread: between its chunks and its forwards'
/// layers; the call then raises `RequestCancelledError`.
#[pyclass(frozen, module = "mbd_rs._core")]
pub(crate) struct CancelToken {
    inner: Cancel,
}

#[pymethods]
impl CancelToken {
    #[new]
    fn new() -> Self {
        CancelToken { inner: Cancel::default() }
    }

    /// Ask the call to stop (thread-safe; calls that start later with this token stop at once).
    fn cancel(&self) {
        self.inner.cancel();
    }

    #[getter]
    fn cancelled(&self) -> bool {
        self.inner.is_cancelled()
    }
}

/// The token a call stops on: the caller's, or one of its own (an interrupt sets it).
fn token(cancel: Option<&Bound<'_, CancelToken>>) -> Cancel {
    cancel.map(|c| c.get().inner.clone()).unwrap_or_default()
}

#[pyclass(frozen, module = "mbd_rs._core")]
pub(crate) struct CoreEngine {
    inner: Engine,
}

impl CoreEngine {
    fn model(&self) -> Arc<Model> {
        self.inner.model().clone()
    }

    /// Start a generation: the request from `params`, the prompt's ids from `prompt_ids` (in the core, without the
    /// GIL); the scheduler runs it from then on, batched with the model's other streams.
    fn begin(
        &self,
        py: Python<'_>,
        params: Option<&Bound<'_, PyDict>>,
        prompt_ids: impl FnOnce(&Model) -> mbd_core::Result<Vec<u32>> + Send,
    ) -> PyResult<CoreStream> {
        let req: GenRequest = request(params)?;
        let engine = &self.inner;
        run(py, move || engine.submit(prompt_ids(engine.model())?, &req)).map(CoreStream::new)
    }
}

#[pymethods]
impl CoreEngine {
    /// Load a model directory or GGUF file. `options`: load options by name (`LOAD_OPTIONS`: the load options, the
    /// profile overrides and the kernel switches; None values = defaults); `progress(bytes_read, bytes_total)` is
    /// called after each tensor (its exceptions are the caller's to handle: ignored).
    #[staticmethod]
    #[pyo3(signature = (path, options=None, progress=None))]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        options: Option<&Bound<'_, PyDict>>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let params: LoadParams = request(options)?;
        let progress = progress.filter(|p| !p.is_none(py)).map(|cb| {
            Progress(Arc::new(move |done: u64, total: u64| {
                Python::attach(|py| {
                    let _ = cb.call1(py, (done, total));
                })
            }))
        });
        let inner = run(py, || {
            let (opts, limits) = params.resolve(progress)?;
            Engine::load(&path, &opts, limits)
        })?;
        Ok(CoreEngine { inner })
    }

    /// (max_batch, max_batch_rows): the caps on what one forward batches.
    fn batch_limits(&self) -> (usize, usize) {
        let l = self.inner.scheduler().limits();
        (l.max_seqs, l.max_rows)
    }

    /// (forwards, segments, rows): forwards the scheduler has run, the stream steps they carried, their rows.
    fn batch_stats(&self) -> (usize, usize, usize) {
        self.inner.scheduler().stats()
    }

    /// (captured, replayed, refused): the model's CUDA graphs (`_kernels=dict(cuda_graphs=True)`): graphs captured,
    /// forwards replayed from one, forward shapes left without one.
    fn graph_stats(&self) -> (usize, usize, usize) {
        let s = self.inner.model().graph_stats();
        (s.captured, s.replayed, s.refused)
    }

    /// The prefix cache's counters, as a dict of `PrefixStats`' fields.
    fn prefix_cache_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let s = self.inner.prefix_cache().stats();
        let d = PyDict::new(py);
        d.set_item("capacity_bytes", s.capacity_bytes)?;
        d.set_item("bytes", s.bytes)?;
        d.set_item("pages", s.pages)?;
        d.set_item("lookups", s.lookups)?;
        d.set_item("hits", s.hits)?;
        d.set_item("hit_tokens", s.hit_tokens)?;
        d.set_item("inserted_pages", s.inserted_pages)?;
        d.set_item("evicted_pages", s.evicted_pages)?;
        Ok(d)
    }

    /// Drop every cached prefix.
    fn clear_prefix_cache(&self) {
        self.inner.prefix_cache().clear()
    }

    /// Write the prefix cache's pages to `path` (a safetensors file); returns the pages written.
    fn save_prefix_cache(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<usize> {
        let e = &self.inner;
        run(py, || e.save_prefix_cache(&path))
    }

    /// Add the pages of a file `save_prefix_cache` wrote to the prefix cache, within its cap; returns the pages
    /// added.
    fn load_prefix_cache(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<usize> {
        let e = &self.inner;
        run(py, || e.load_prefix_cache(&path))
    }

    /// Change the batching caps (None: unchanged).
    #[pyo3(signature = (max_batch=None, max_batch_rows=None))]
    fn set_batch_limits(
        &self,
        max_batch: Option<&Bound<'_, PyAny>>,
        max_batch_rows: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let limits = batch_limits(self.inner.scheduler().limits(), max_batch, max_batch_rows)?;
        self.inner.scheduler().set_limits(limits).map_err(to_py)
    }

    /// Everything known about the loaded model ([`mbd_core::model::info::ModelInfo`]), as a dict in the struct's
    /// field order (`MODEL_INFO_FIELDS`).
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let v = serde_json::to_value(self.inner.model().info()).map_err(|e| to_py(Error::Internal(e.to_string())))?;
        // the table names exactly the struct's fields (a field left off it would never reach Python)
        let names: std::collections::BTreeSet<&str> =
            v.as_object().into_iter().flatten().map(|(k, _)| k.as_str()).collect();
        if names != MODEL_INFO_FIELDS.iter().map(|(n, _)| *n).collect() {
            return Err(to_py(Error::Internal(format!(
                "ModelInfo's fields {names:?} are not MODEL_INFO_FIELDS (crates/mbd-core/src/model/info.rs)"
            ))));
        }
        let d = PyDict::new(py);
        for (name, _) in MODEL_INFO_FIELDS {
            d.set_item(name, json_to_py(py, &v[*name])?)?;
        }
        Ok(d)
    }

    #[pyo3(signature = (text, add_special_tokens=true))]
    fn tokenize(&self, py: Python<'_>, text: &Bound<'_, PyAny>, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let text = string("text", text)?;
        let m = self.model();
        run(py, move || m.tokenize(&text, add_special_tokens))
    }

    #[pyo3(signature = (ids, skip_special_tokens=true))]
    fn detokenize(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = crate::convert::ids("ids", ids)?;
        let m = self.model();
        run(py, move || m.detokenize(&ids, skip_special_tokens))
    }

    /// Logits (len(ids), vocab) f32 as numpy; `params`: `LOGITS_PARAMS`. `cancel` (or Ctrl-C) stops it between
    /// chunks and layers.
    #[pyo3(signature = (ids, params=None, cancel=None))]
    fn logits<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
        params: Option<&Bound<'py, PyDict>>,
        cancel: Option<&Bound<'py, CancelToken>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids = crate::convert::ids("ids", ids)?;
        let req: LogitsRequest = request(params)?;
        let m = self.model();
        let (n, v) = (ids.len(), m.config.vocab_size);
        let out = run_cancellable(py, token(cancel), move |c| m.logits(&m.token_ids("ids", &ids)?, &req, c))?;
        let arr = PyArray1::from_vec(py, out).reshape([n, v]).map_err(|e| PyValueError::new_err(e.to_string()))?;
        Ok(arr.into_any())
    }

    /// Seconds per decode forward of `window` tokens over a `prefix`-token cache (benchmarks).
    #[pyo3(signature = (prefix, window, reps, last_row=false))]
    fn bench_forward(
        &self,
        py: Python<'_>,
        prefix: usize,
        window: usize,
        reps: usize,
        last_row: bool,
    ) -> PyResult<Vec<f64>> {
        let m = self.model();
        run(py, move || m.bench_forward(prefix, window, reps, last_row))
    }

    /// Render chat messages (JSON text of a list of {role, content}) with the model's template.
    #[pyo3(signature = (messages_json, add_generation_prompt=true, extra_json=None))]
    fn apply_chat_template(
        &self,
        py: Python<'_>,
        messages_json: &Bound<'_, PyAny>,
        add_generation_prompt: bool,
        extra_json: Option<String>,
    ) -> PyResult<String> {
        let messages_json = string("messages", messages_json)?;
        let m = self.model();
        run(py, move || {
            let msgs = messages_value(&messages_json)?;
            let extra = match extra_json {
                Some(e) => serde_json::from_str(&e).map_err(|e| Error::invalid(e.to_string()))?,
                None => serde_json::Value::Null,
            };
            m.render_chat(&msgs, add_generation_prompt, &extra)
        })
    }

    /// Start a generation of `prompt` (a str, tokenized here, or token ids); `params`: `GENERATION_PARAMS`
    /// (None values = defaults).
    #[pyo3(signature = (prompt, params=None, add_special_tokens=true))]
    fn start(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyDict>>,
        add_special_tokens: bool,
    ) -> PyResult<CoreStream> {
        let prompt = Prompt::from_py(prompt)?;
        self.begin(py, params, move |m| prompt.ids(m, add_special_tokens))
    }

    /// Each token of `prompt` (a str, tokenized here, or token ids) scored given the ones before it
    /// ([`Model::prompt_logprobs`]): a list of None (the first token) or (token, logprob, [(id, logprob), ...]);
    /// `params`: `SCORE_PARAMS`.
    /// `cancel` (or Ctrl-C) stops it between chunks and layers.
    #[pyo3(signature = (prompt, params=None, add_special_tokens=true, cancel=None))]
    fn prompt_logprobs(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyDict>>,
        add_special_tokens: bool,
        cancel: Option<&Bound<'_, CancelToken>>,
    ) -> PyResult<Vec<Option<LogprobTuple>>> {
        let prompt = Prompt::from_py(prompt)?;
        let req: ScoreRequest = request(params)?;
        let m = self.model();
        let out = run_cancellable(py, token(cancel), move |c| {
            m.prompt_logprobs(&prompt.ids(&m, add_special_tokens)?, &req, c)
        })?;
        Ok(out.into_iter().map(|t| t.map(logprob_tuple)).collect())
    }

    /// Start a generation answering chat `messages` (JSON text of a list of {role, content}), rendered with the
    /// model's template (`tools_json`: the tool definitions it renders, JSON text of a list); contents stay text
    /// unless `special_tokens_in_content`.
    #[pyo3(signature = (messages_json, params=None, special_tokens_in_content=false, tools_json=None))]
    fn start_chat(
        &self,
        py: Python<'_>,
        messages_json: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyDict>>,
        special_tokens_in_content: bool,
        tools_json: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<CoreStream> {
        let messages_json = string("messages", messages_json)?;
        let tools_json = tools_json.map(|t| string("tools", t)).transpose()?;
        self.begin(py, params, move |m| {
            let msgs = messages_value(&messages_json)?;
            m.chat_prompt_ids(&msgs, true, &template_extra(tools_json.as_deref())?, special_tokens_in_content)
        })
    }

    /// The token ids of a chat prompt exactly as a chat generation runs on them ([`Model::chat_prompt_ids`]).
    #[pyo3(signature = (messages_json, add_generation_prompt=true, special_tokens_in_content=false, tools_json=None))]
    fn chat_ids(
        &self,
        py: Python<'_>,
        messages_json: &Bound<'_, PyAny>,
        add_generation_prompt: bool,
        special_tokens_in_content: bool,
        tools_json: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Vec<u32>> {
        let messages_json = string("messages", messages_json)?;
        let tools_json = tools_json.map(|t| string("tools", t)).transpose()?;
        let m = self.model();
        run(py, move || {
            let msgs = messages_value(&messages_json)?;
            let extra = template_extra(tools_json.as_deref())?;
            m.chat_prompt_ids(&msgs, add_generation_prompt, &extra, special_tokens_in_content)
        })
    }

    /// Each token's bytes before UTF-8 decoding ([`Model::token_bytes`]): a token holding part of a character gives
    /// its bytes.
    fn token_bytes<'py>(&self, py: Python<'py>, ids: &Bound<'py, PyAny>) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let ids = crate::convert::ids("ids", ids)?;
        let m = self.model();
        let out = run(py, move || m.token_bytes(&ids))?;
        Ok(out.iter().map(|b| PyBytes::new(py, b)).collect())
    }
}

/// A prompt as a caller passes it: text (tokenized by the core) or token ids (checked against the vocabulary).
enum Prompt {
    Text(String),
    Ids(Vec<i64>),
}

impl Prompt {
    fn from_py(prompt: &Bound<'_, PyAny>) -> PyResult<Prompt> {
        Ok(if prompt.is_instance_of::<PyString>() {
            Prompt::Text(string("prompt", prompt)?)
        } else {
            Prompt::Ids(ids("prompt", prompt)?)
        })
    }

    fn ids(&self, m: &Model, add_special_tokens: bool) -> mbd_core::Result<Vec<u32>> {
        match self {
            Prompt::Text(t) => m.prompt_ids(t, add_special_tokens),
            Prompt::Ids(ids) => m.token_ids("prompt", ids),
        }
    }
}

/// `base` with the caller's batching caps (None: unchanged); the range rule is [`BatchLimits::with`]'s.
fn batch_limits(
    base: BatchLimits,
    max_batch: Option<&Bound<'_, PyAny>>,
    max_batch_rows: Option<&Bound<'_, PyAny>>,
) -> PyResult<BatchLimits> {
    let seqs = max_batch.filter(|v| !v.is_none()).map(|v| int("max_batch", v)).transpose()?;
    let rows = max_batch_rows.filter(|v| !v.is_none()).map(|v| int("max_batch_rows", v)).transpose()?;
    base.with(seqs, rows).map_err(to_py)
}
