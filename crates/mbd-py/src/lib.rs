//! Thin PyO3 binding: converts Python values to mbd-core calls and core errors to the Python exception
//! hierarchy defined in `mbd_rs.errors`. No engine logic lives here: parameter names, kinds and ranges come
//! from `mbd_core::request`; this file only converts each Python value to the kind its spec names.

use mbd_core::engine::{device_name, dtype_name, parse_device, parse_dtype};
use mbd_core::error::catch_panic;
use mbd_core::generate::{Generation, StepOutput};
use mbd_core::quant::QuantFormat;
use mbd_core::request::{
    self, GenRequest, LogitsRequest, ParamKind, Params, ProfileOverrides, ScoreRequest, Value, GENERATION_PARAMS,
    LOGITS_PARAMS, PROFILE_OVERRIDES, SCORE_PARAMS,
};
use mbd_core::scheduler::{BatchLimits, Canceller, Scheduler, StreamHandle};
use mbd_core::skinny::Kernels;
use mbd_core::weights::Progress;
use mbd_core::{Error, LoadOptions, Model, TokenLogprob};
use numpy::{PyArray1, PyArrayMethods};
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyString, PyTuple};
use std::path::PathBuf;
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
        Error::UnknownParameter(m) => PyTypeError::new_err(m),
        Error::ContextLength(m) => ContextLengthError::new_err(m),
        Error::Backend(b) => MbdError::new_err(format!("tensor backend error: {b}")),
        Error::Internal(m) => InternalError::new_err(format!("internal error (please report): {m}")),
    }
}

/// Run a core call with the GIL released, converting panics and errors.
fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> mbd_core::Result<T> + Send) -> PyResult<T> {
    py.detach(|| catch_panic(f)).map_err(to_py)
}

fn invalid(msg: String) -> PyErr {
    InvalidRequestError::new_err(msg)
}

/// A short repr of a value for error messages.
fn show(v: &Bound<'_, PyAny>) -> String {
    let r = v.repr().map(|r| r.to_string()).unwrap_or_else(|_| format!("a {}", type_name(v)));
    if r.chars().count() > 80 {
        format!("{}...", r.chars().take(77).collect::<String>())
    } else {
        r
    }
}

fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "object".into())
}

fn int(name: &str, v: &Bound<'_, PyAny>) -> PyResult<i64> {
    if v.is_instance_of::<PyBool>() {
        return Err(invalid(format!("{name} must be an integer, got {}", show(v))));
    }
    v.extract::<i64>().map_err(|e| {
        if e.is_instance_of::<PyOverflowError>(v.py()) {
            invalid(format!("{name} must be an integer that fits in 64 bits, got {}", show(v)))
        } else {
            invalid(format!("{name} must be an integer, got {}", show(v)))
        }
    })
}

fn string(name: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    let s = v.cast::<PyString>().map_err(|_| invalid(format!("{name} must be a string, got {}", show(v))))?;
    s.to_str().map(|s| s.to_string()).map_err(|_| {
        invalid(format!(
            "{name} must be valid text: it contains characters that are not Unicode scalar values (lone surrogates)"
        ))
    })
}

fn ids(name: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if v.is_instance_of::<PyString>() || v.is_instance_of::<PyBytes>() {
        return Err(invalid(format!("{name} must be a sequence of token ids (ints), got a {}", type_name(v))));
    }
    let items =
        v.try_iter().map_err(|_| invalid(format!("{name} must be a sequence of token ids (ints), got {}", show(v))))?;
    items
        .enumerate()
        .map(|(i, t)| {
            let t = t?;
            if t.is_instance_of::<PyBool>() || t.is_instance_of::<PyString>() {
                return Err(invalid(format!(
                    "{name} must be a sequence of token ids (ints): item {i} is {}",
                    show(&t)
                )));
            }
            t.extract::<i64>().map_err(|_| invalid(format!("{name}: item {i} is not a token id: {}", show(&t))))
        })
        .collect()
}

/// Convert a Python value to the kind of `Value` a parameter takes (type conversion only).
fn to_value(name: &str, kind: ParamKind, v: &Bound<'_, PyAny>) -> PyResult<Value> {
    Ok(match kind {
        ParamKind::Int => Value::Int(int(name, v)?),
        ParamKind::Float => {
            if v.is_instance_of::<PyBool>() || v.is_instance_of::<PyString>() {
                return Err(invalid(format!("{name} must be a number, got {}", show(v))));
            }
            Value::Float(
                v.extract::<f64>().map_err(|_| invalid(format!("{name} must be a finite number, got {}", show(v))))?,
            )
        }
        ParamKind::Bool => {
            if !v.is_instance_of::<PyBool>() {
                return Err(invalid(format!("{name} must be True or False, got {}", show(v))));
            }
            Value::Bool(v.extract()?)
        }
        ParamKind::Str => Value::Str(string(name, v)?),
        ParamKind::Strings => {
            if v.is_instance_of::<PyString>() {
                Value::Str(string(name, v)?)
            } else if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
                let items: PyResult<Vec<String>> = v
                    .try_iter()?
                    .map(|s| {
                        let s = s?;
                        if !s.is_instance_of::<PyString>() {
                            return Err(invalid(format!(
                                "{name} must be a string or a list of strings, got {}",
                                show(v)
                            )));
                        }
                        string(name, &s)
                    })
                    .collect();
                Value::Strings(items?)
            } else {
                return Err(invalid(format!("{name} must be a string or a list of strings, got {}", show(v))));
            }
        }
        ParamKind::Ids => Value::Ids(ids(name, v)?),
        ParamKind::Floats => {
            if !(v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>()) {
                return Err(invalid(format!("{name} must be a list of numbers, got {}", show(v))));
            }
            let items: PyResult<Vec<f64>> = v
                .try_iter()?
                .enumerate()
                .map(|(i, x)| {
                    let x = x?;
                    if x.is_instance_of::<PyBool>() || x.is_instance_of::<PyString>() {
                        return Err(invalid(format!("{name}: item {i} is not a number: {}", show(&x))));
                    }
                    x.extract::<f64>().map_err(|_| invalid(format!("{name}: item {i} is not a number: {}", show(&x))))
                })
                .collect();
            Value::Floats(items?)
        }
        ParamKind::BoolOrStr => {
            if v.is_instance_of::<PyBool>() {
                Value::Bool(v.extract()?)
            } else if v.is_instance_of::<PyString>() {
                Value::Str(string(name, v)?)
            } else {
                return Err(invalid(format!("{name} must be True, False or a string, got {}", show(v))));
            }
        }
    })
}

fn messages_value(json: &str) -> mbd_core::Result<serde_json::Value> {
    serde_json::from_str(json).map_err(|e| Error::invalid(format!("messages: not valid JSON: {e}")))
}

/// Build a request from a dict of Python values (None = the default).
fn request<R: Params>(params: Option<&Bound<'_, PyDict>>) -> PyResult<R> {
    let mut r = R::default();
    for (k, v) in params.map(|d| d.iter().collect::<Vec<_>>()).unwrap_or_default() {
        let name = string("parameter name", &k)?;
        let spec = R::param(&name).map_err(to_py)?;
        if !v.is_none() {
            r.set(&name, to_value(&name, spec.kind, &v)?).map_err(to_py)?;
        }
    }
    Ok(r)
}

#[pyclass(frozen, module = "mbd_rs._core")]
struct CoreModel {
    inner: Arc<Model>,
    /// Runs every stream of this model, batched (continuous batching).
    scheduler: Scheduler,
}

#[pymethods]
impl CoreModel {
    /// Load a model directory. `overrides`: profile overrides (`PROFILE_OVERRIDES`); the kernel arguments are
    /// load options for benchmarks' A/B runs.
    #[staticmethod]
    #[pyo3(signature = (path, device="auto", dtype=None, overrides=None, keep_bf16_weights=true, skinny=true,
                        par_min_macs=None, max_rows=None, blocked_attention=true, panels=true, packed_weights=true,
                        packed_avx512=true, stack=true, cuda_fused=true, candle_quant=false, max_batch=None, max_batch_rows=None, quantize=None, int8_activations=None, progress=None))]
    #[allow(clippy::too_many_arguments)]
    fn load(
        py: Python<'_>,
        path: PathBuf,
        device: &str,
        dtype: Option<String>,
        overrides: Option<&Bound<'_, PyDict>>,
        keep_bf16_weights: bool,
        skinny: bool,
        par_min_macs: Option<usize>,
        max_rows: Option<usize>,
        blocked_attention: bool,
        panels: bool,
        packed_weights: bool,
        packed_avx512: bool,
        stack: bool,
        cuda_fused: bool,
        candle_quant: bool,
        max_batch: Option<&Bound<'_, PyAny>>,
        max_batch_rows: Option<&Bound<'_, PyAny>>,
        quantize: Option<String>,
        int8_activations: Option<bool>,
        progress: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let device = device.to_string();
        let quantize = quantize.as_deref().map(QuantFormat::parse).transpose().map_err(to_py)?;
        let overrides: ProfileOverrides = request(overrides)?;
        let d = Kernels::default();
        let kernels = Kernels {
            skinny,
            par_min_macs: par_min_macs.unwrap_or(d.par_min_macs),
            max_rows: max_rows.unwrap_or(d.max_rows),
            blocked_attention,
            panels,
            packed_weights,
            packed_avx512,
            stack,
            cuda_fused,
            candle_quant,
            ..d
        };
        let limits = batch_limits(BatchLimits::default(), max_batch, max_batch_rows)?;
        // progress(bytes_read, bytes_total) after each tensor; its exceptions are the caller's to handle (ignored)
        let progress = progress.filter(|p| !p.is_none(py)).map(|cb| {
            Progress(Arc::new(move |done: u64, total: u64| {
                Python::attach(|py| {
                    let _ = cb.call1(py, (done, total));
                })
            }))
        });
        let model = run(py, || {
            let dev = parse_device(&device)?;
            let dtype = parse_dtype(dtype.as_deref(), &dev)?;
            Model::load(
                &path,
                &LoadOptions {
                    device: dev,
                    dtype,
                    overrides,
                    keep_bf16_weights,
                    quantize,
                    int8_activations,
                    kernels,
                    progress,
                },
            )
        })?;
        let inner = Arc::new(model);
        let scheduler = Scheduler::new(inner.clone(), limits).map_err(to_py)?;
        Ok(CoreModel { inner, scheduler })
    }

    /// (max_batch, max_batch_rows): the caps on what one forward batches.
    fn batch_limits(&self) -> (usize, usize) {
        let l = self.scheduler.limits();
        (l.max_seqs, l.max_rows)
    }

    /// (forwards, segments, rows): forwards the scheduler has run, the stream steps they carried, their rows.
    fn batch_stats(&self) -> (usize, usize, usize) {
        self.scheduler.stats()
    }

    /// Change the batching caps (None: unchanged).
    #[pyo3(signature = (max_batch=None, max_batch_rows=None))]
    fn set_batch_limits(
        &self,
        max_batch: Option<&Bound<'_, PyAny>>,
        max_batch_rows: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let limits = batch_limits(self.scheduler.limits(), max_batch, max_batch_rows)?;
        self.scheduler.set_limits(limits).map_err(to_py)
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
        d.set_item("weight_format", &m.weight_format)?;
        d.set_item("int8_activations", m.int8_activations)?;
        d.set_item("chat_template", m.chat_template.as_ref().map(|t| t.source()))?;
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
    fn tokenize(&self, py: Python<'_>, text: &Bound<'_, PyAny>, add_special_tokens: bool) -> PyResult<Vec<u32>> {
        let text = string("text", text)?;
        let m = self.inner.clone();
        run(py, move || m.tokenize(&text, add_special_tokens))
    }

    #[pyo3(signature = (ids, skip_special_tokens=true))]
    fn detokenize(&self, py: Python<'_>, ids: &Bound<'_, PyAny>, skip_special_tokens: bool) -> PyResult<String> {
        let ids = self::ids("ids", ids)?;
        let m = self.inner.clone();
        run(py, move || m.detokenize(&ids, skip_special_tokens))
    }

    /// Logits (len(ids), vocab) f32 as numpy; `params`: `LOGITS_PARAMS`.
    #[pyo3(signature = (ids, params=None))]
    fn logits<'py>(
        &self,
        py: Python<'py>,
        ids: &Bound<'py, PyAny>,
        params: Option<&Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyAny>> {
        let ids = self::ids("ids", ids)?;
        let req: LogitsRequest = request(params)?;
        let m = self.inner.clone();
        let (n, v) = (ids.len(), m.config.vocab_size);
        let out = run(py, move || m.logits(&m.token_ids("ids", &ids)?, &req))?;
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
        let m = self.inner.clone();
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
        let m = self.inner.clone();
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
    /// (`Model::prompt_logprobs`): a list of None (the first token) or (token, logprob, [(id, logprob), ...]);
    /// `params`: `SCORE_PARAMS`.
    #[pyo3(signature = (prompt, params=None, add_special_tokens=true))]
    fn prompt_logprobs(
        &self,
        py: Python<'_>,
        prompt: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyDict>>,
        add_special_tokens: bool,
    ) -> PyResult<Vec<Option<LogprobTuple>>> {
        let prompt = Prompt::from_py(prompt)?;
        let req: ScoreRequest = request(params)?;
        let m = self.inner.clone();
        let out = run(py, move || m.prompt_logprobs(&prompt.ids(&m, add_special_tokens)?, &req))?;
        Ok(out.into_iter().map(|t| t.map(logprob_tuple)).collect())
    }

    /// Start a generation answering chat `messages` (JSON text of a list of {role, content}), rendered with the
    /// model's template; contents stay text unless `special_tokens_in_content`.
    #[pyo3(signature = (messages_json, params=None, special_tokens_in_content=false))]
    fn start_chat(
        &self,
        py: Python<'_>,
        messages_json: &Bound<'_, PyAny>,
        params: Option<&Bound<'_, PyDict>>,
        special_tokens_in_content: bool,
    ) -> PyResult<CoreStream> {
        let messages_json = string("messages", messages_json)?;
        self.begin(py, params, move |m| {
            m.chat_prompt_ids(&messages_value(&messages_json)?, &serde_json::Value::Null, special_tokens_in_content)
        })
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

/// (token, logprob, [(id, logprob), ...]): a `TokenLogprob` as Python receives it.
type LogprobTuple = (u32, f32, Vec<(u32, f32)>);

fn logprob_tuple(t: TokenLogprob) -> LogprobTuple {
    (t.token, t.logprob, t.top)
}

/// `base` with the caller's batching caps (None: unchanged); the range rule is `BatchLimits::with`'s.
fn batch_limits(
    base: BatchLimits,
    max_batch: Option<&Bound<'_, PyAny>>,
    max_batch_rows: Option<&Bound<'_, PyAny>>,
) -> PyResult<BatchLimits> {
    let seqs = max_batch.filter(|v| !v.is_none()).map(|v| int("max_batch", v)).transpose()?;
    let rows = max_batch_rows.filter(|v| !v.is_none()).map(|v| int("max_batch_rows", v)).transpose()?;
    base.with(seqs, rows).map_err(to_py)
}

impl CoreModel {
    /// Start a generation: the request from `params`, the prompt's ids from `prompt_ids` (in the core, without
    /// the GIL); the scheduler runs it from then on, batched with the model's other streams.
    fn begin(
        &self,
        py: Python<'_>,
        params: Option<&Bound<'_, PyDict>>,
        prompt_ids: impl FnOnce(&Model) -> mbd_core::Result<Vec<u32>> + Send,
    ) -> PyResult<CoreStream> {
        let req: GenRequest = request(params)?;
        let m = self.inner.clone();
        let sched = &self.scheduler;
        run(py, move || {
            let ids = prompt_ids(&m)?;
            sched.submit(Generation::new(m, ids, &req)?)
        })
        .map(CoreStream::new)
    }
}

/// One generation in progress, run by the model's scheduler; `step()` waits for its next output with the GIL
/// released.
#[pyclass(frozen, module = "mbd_rs._core")]
struct CoreStream {
    handle: Mutex<Option<StreamHandle>>,
    canceller: Canceller,
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
        ud.set_item("verifications", u.verifications)?;
        ud.set_item("drafts_proposed", u.drafts_proposed)?;
        ud.set_item("drafts_accepted", u.drafts_accepted)?;
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
    d.set_item("logprobs", o.logprobs.into_iter().map(logprob_tuple).collect::<Vec<_>>())?;
    Ok(d)
}

impl CoreStream {
    fn new(h: StreamHandle) -> Self {
        CoreStream { canceller: h.canceller(), handle: Mutex::new(Some(h)) }
    }
}

#[pymethods]
impl CoreStream {
    /// The next output: a dict (token_ids, text, finish_reason, usage, step), or None when the generation has
    /// finished or was closed.
    fn step<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let out = py.detach(|| {
            catch_panic(|| {
                let mut guard = self.handle.lock().map_err(|_| Error::Internal("stream lock poisoned".into()))?;
                match guard.as_mut().and_then(|h| h.next()) {
                    Some(r) => r.map(Some),
                    None => Ok(None),
                }
            })
        });
        match out.map_err(to_py)? {
            Some(o) => Ok(Some(output_dict(py, o)?)),
            None => Ok(None),
        }
    }

    /// Ask the generation to stop; thread-safe. Its next output is the final one, finish_reason "cancelled".
    fn cancel(&self) {
        self.canceller.cancel();
    }

    /// Free the generation's state (KV cache) now.
    fn close(&self, py: Python<'_>) {
        self.canceller.cancel();
        py.detach(|| {
            if let Ok(mut h) = self.handle.lock() {
                *h = None;
            }
        });
    }
}

/// name -> {"kind", "help"} for every parameter (`mbd_core::request::PARAMS`).
fn params_dict<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for s in request::PARAMS {
        let e = PyDict::new(py);
        e.set_item("kind", s.kind.name())?;
        e.set_item("help", s.help)?;
        d.set_item(s.name, e)?;
    }
    Ok(d)
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<CoreModel>()?;
    m.add_class::<CoreStream>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("cuda_available", cfg!(feature = "cuda"))?;
    m.add("PARAMS", params_dict(m.py())?)?;
    m.add("GENERATION_PARAMS", PyTuple::new(m.py(), GENERATION_PARAMS)?)?;
    m.add("PROFILE_OVERRIDES", PyTuple::new(m.py(), PROFILE_OVERRIDES)?)?;
    m.add("LOGITS_PARAMS", PyTuple::new(m.py(), LOGITS_PARAMS)?)?;
    m.add("SCORE_PARAMS", PyTuple::new(m.py(), SCORE_PARAMS)?)?;
    // At import, before any stream runs: pin the CPU thread count once (see mbd_core::cpu_pool).
    m.add("cpu_threads", mbd_core::cpu_pool::pin_thread_count())?;
    Ok(())
}
