//! Load options: every name a load takes, as one registry (`LoadParams`: the load options `LOAD_PARAMS`, the profile
//! overrides `PROFILE_OVERRIDES` and the kernel switches `KERNEL_SWITCHES`, each described once in
//! [`request::PARAMS`](crate::params::request::PARAMS)), resolved into what [`Model::load`](crate::model::Model::load)
//! and the scheduler take (`LoadOptions`, `BatchLimits`); the device and dtype names callers pass. The binding, the
//! CLI, the server and Ray all pass load options by these names, so a new option is one `PARAMS` line, one field in its
//! request and its use in [`LoadParams::resolve`].

use crate::error::{Error, Result};
use crate::kernels::blocks::QuantFormat;
use crate::kernels::Kernels;
use crate::load::weights::Progress;
use crate::net::attention::ATTENTION_SCORE_BYTES;
use crate::params::request::{
    KernelSwitches, LoadRequest, ParamSpec, Params, ProfileOverrides, Value, KERNEL_SWITCHES, LOAD_PARAMS,
    PROFILE_OVERRIDES,
};
use candle_core::{DType, Device};

/// Every load option's name: `LOAD_PARAMS`, then `PROFILE_OVERRIDES`, then `KERNEL_SWITCHES`.
pub const ALL_LOAD_PARAMS: [&str; LOAD_PARAMS.len() + PROFILE_OVERRIDES.len() + KERNEL_SWITCHES.len()] =
    concat3(LOAD_PARAMS, PROFILE_OVERRIDES, KERNEL_SWITCHES);

const fn concat3<const N: usize>(a: &[&'static str], b: &[&'static str], c: &[&'static str]) -> [&'static str; N] {
    let mut out = [""; N];
    let mut i = 0;
    while i < a.len() {
        out[i] = a[i];
        i += 1;
    }
    let mut j = 0;
    while j < b.len() {
        out[a.len() + j] = b[j];
        j += 1;
    }
    let mut k = 0;
    while k < c.len() {
        out[a.len() + b.len() + k] = c[k];
        k += 1;
    }
    out
}

/// A load's options by name (what bindings set one by one; None = the default).
#[derive(Debug, Clone, Default)]
pub struct LoadParams {
    pub load: LoadRequest,
    pub overrides: ProfileOverrides,
    pub kernels: KernelSwitches,
}

impl Params for LoadParams {
    const NAMES: &'static [&'static str] = &ALL_LOAD_PARAMS;

    fn param(name: &str) -> Result<&'static ParamSpec> {
        let found = if LOAD_PARAMS.contains(&name) {
            LoadRequest::param(name)
        } else if PROFILE_OVERRIDES.contains(&name) {
            ProfileOverrides::param(name)
        } else {
            KernelSwitches::param(name)
        };
        // an unknown name is taken for a misspelt profile override (the open-ended part of a load's options)
        found.map_err(|_| {
            Error::UnknownParameter(format!(
                "unexpected profile override '{name}'; valid profile overrides: {}; the other load options are {} \
                 and the kernel switches {}",
                PROFILE_OVERRIDES.join(", "),
                LOAD_PARAMS.join(", "),
                KERNEL_SWITCHES.join(", ")
            ))
        })
    }

    fn set(&mut self, name: &str, v: Value) -> Result<()> {
        Self::param(name)?;
        if LOAD_PARAMS.contains(&name) {
            self.load.set(name, v)
        } else if PROFILE_OVERRIDES.contains(&name) {
            self.overrides.set(name, v)
        } else {
            self.kernels.set(name, v)
        }
    }

    fn validate(&self) -> Result<()> {
        self.load.validate()?;
        self.overrides.validate()?;
        self.kernels.validate()
    }
}

impl LoadParams {
    /// The options resolved: the device and dtype parsed (`parse_device`, `parse_dtype`), the kernel switches over
    /// their defaults, the batching caps checked; `progress` hears of the weights read.
    pub fn resolve(self, progress: Option<Progress>) -> Result<(LoadOptions, BatchLimits)> {
        self.validate()?;
        let (l, k) = (self.load, self.kernels);
        let limits = BatchLimits::default().with(l.max_batch, l.max_batch_rows)?;
        let device = parse_device(l.device.as_deref().unwrap_or("auto"))?;
        let dtype = parse_dtype(l.dtype.as_deref(), &device)?;
        let d = Kernels::default();
        let kernels = Kernels {
            skinny: k.skinny.unwrap_or(d.skinny),
            par_min_macs: k.par_min_macs.unwrap_or(d.par_min_macs),
            max_rows: k.max_rows.unwrap_or(d.max_rows),
            blocked_attention: k.blocked_attention.unwrap_or(d.blocked_attention),
            panels: k.panels.unwrap_or(d.panels),
            packed_weights: k.packed_weights.unwrap_or(d.packed_weights),
            packed_avx512: k.packed_avx512.unwrap_or(d.packed_avx512),
            stack: k.stack.unwrap_or(d.stack),
            cuda_fused: k.cuda_fused.unwrap_or(d.cuda_fused),
            cuda_segments: k.cuda_segments.unwrap_or(d.cuda_segments),
            cuda_graphs: k.cuda_graphs.unwrap_or(d.cuda_graphs),
            candle_quant: k.candle_quant.unwrap_or(d.candle_quant),
        };
        if kernels.cuda_graphs && !kernels.cuda_segments {
            return Err(Error::invalid(
                "cuda_graphs needs cuda_segments (a graph replays the one launch per kernel that cuda_segments makes, \
                 whose inputs all come from the step's upload): pass _kernels=dict(cuda_segments=True, cuda_graphs=True)",
            ));
        }
        let opts = LoadOptions {
            device,
            dtype,
            overrides: self.overrides,
            keep_bf16_weights: k.keep_bf16_weights.unwrap_or(true),
            quantize: l.quantize,
            int8_activations: l.int8_activations,
            kernels,
            attention_score_bytes: ATTENTION_SCORE_BYTES,
            progress,
            prefix_cache: l.prefix_cache.map(|b| usize::try_from(b).unwrap_or(usize::MAX)),
        };
        Ok((opts, limits))
    }
}

/// Caps on what one forward batches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchLimits {
    /// Generations batched together (later ones wait).
    pub max_seqs: usize,
    /// Window rows per forward (a segment longer than this still runs, alone).
    pub max_rows: usize,
}

impl Default for BatchLimits {
    /// 16 sequences; 1024 rows: a 512-token prefill chunk plus the decode windows of the others.
    fn default() -> Self {
        BatchLimits { max_seqs: 16, max_rows: 1024 }
    }
}

impl BatchLimits {
    pub fn check(&self) -> Result<()> {
        Self::in_range("max_batch", self.max_seqs as i64, MAX_BATCH_SEQS)?;
        Self::in_range("max_batch_rows", self.max_rows as i64, MAX_BATCH_ROWS)?;
        Ok(())
    }

    /// These limits with the caller's values (None: unchanged), checked.
    pub fn with(self, max_batch: Option<i64>, max_batch_rows: Option<i64>) -> Result<BatchLimits> {
        let seqs = max_batch.map_or(Ok(self.max_seqs), |v| Self::in_range("max_batch", v, MAX_BATCH_SEQS))?;
        let rows = max_batch_rows.map_or(Ok(self.max_rows), |v| Self::in_range("max_batch_rows", v, MAX_BATCH_ROWS))?;
        Ok(BatchLimits { max_seqs: seqs, max_rows: rows })
    }

    fn in_range(name: &str, v: i64, max: usize) -> Result<usize> {
        if v < 1 || v as u64 > max as u64 {
            return Err(Error::invalid(format!("{name} must be an integer between 1 and {max}, got {v}")));
        }
        Ok(v as usize)
    }
}

const MAX_BATCH_SEQS: usize = 4096;

const MAX_BATCH_ROWS: usize = 1 << 20;

/// How to load a model: where, in which precision, with which profile overrides and kernel choices.
#[derive(Debug, Clone)]
pub struct LoadOptions {
    pub device: Device,
    pub dtype: DType,
    pub overrides: ProfileOverrides,
    /// CPU, f32 compute: a bf16 checkpoint's matrices stay bf16 in memory and are widened exactly inside the
    /// skinny kernel (half the memory and weight traffic). On by default; benchmarks turn it off for A/B runs.
    pub keep_bf16_weights: bool,
    /// Quantize the matrices at load ([`kernels::blocks`](crate::kernels::blocks); CPU, float32 compute).
    pub quantize: Option<QuantFormat>,
    /// Multiply the quantized matrices (of the `quantize` option or a GGUF file) with integer dot products on
    /// activations rounded to 8 bits ([`kernels::qdot`](crate::kernels::qdot); x86-64 CPUs with AVX2, AVX-512 VNNI
    /// where present): faster, not the exact product. `None` (the default): wherever the device can (see
    /// [`Model::load`](crate::model::Model::load)); `Some(false)`: the exact products (CPU only); `Some(true)`:
    /// required, an error where it cannot be had.
    pub int8_activations: Option<bool>,
    pub kernels: Kernels,
    /// Bytes of f32 attention scores (heads x query rows x keys) one query chunk may take: a long window (a
    /// recompute without cache, a full-attention canvas, a logits call) is attended in query chunks so that no
    /// forward allocates scores for every row at once (a 100k-token window would need 100k x 100k per head). A
    /// memory cap, not a kernel choice (tests lower it to check that chunked attention is the same).
    pub attention_score_bytes: usize,
    /// Told (bytes read, bytes in all) after each tensor of the checkpoint is read.
    pub progress: Option<Progress>,
    /// Bytes of K/V the engine's prefix cache keeps across requests (0: off; None: [`default_prefix_cache`]).
    pub prefix_cache: Option<usize>,
}

/// The prefix cache's default cap: a quarter of the machine's memory, at most 4 GiB (1 GiB where the memory is not
/// known).
pub fn default_prefix_cache() -> usize {
    const GIB: usize = 1 << 30;
    let total = std::fs::read_to_string("/proc/meminfo").ok().and_then(|m| {
        let line = m.lines().find(|l| l.starts_with("MemTotal:"))?;
        let kb: usize = line.split_whitespace().nth(1)?.parse().ok()?;
        kb.checked_mul(1024)
    });
    total.map_or(GIB, |t| (t / 4).min(4 * GIB))
}

impl Default for LoadOptions {
    /// CPU, f32, the checkpoint's own profile, default kernels.
    fn default() -> Self {
        LoadOptions {
            device: Device::Cpu,
            dtype: DType::F32,
            overrides: ProfileOverrides::default(),
            keep_bf16_weights: true,
            quantize: None,
            int8_activations: None,
            kernels: Kernels::default(),
            attention_score_bytes: ATTENTION_SCORE_BYTES,
            progress: None,
            prefix_cache: None,
        }
    }
}

/// Parse a device string: "auto", "cpu", "cuda", "cuda:N", "metal".
pub fn parse_device(s: &str) -> Result<Device> {
    let (kind, ordinal) = match s.split_once(':') {
        Some((k, n)) => {
            let n: usize =
                n.parse().map_err(|_| Error::invalid(format!("device '{s}': '{n}' is not a device number")))?;
            (k, n)
        }
        None => (s, 0),
    };
    match kind {
        "cpu" => Ok(Device::Cpu),
        "auto" => {
            if candle_core::utils::cuda_is_available() {
                if let Ok(d) = Device::new_cuda(0) {
                    return Ok(single_stream(d));
                }
            }
            if candle_core::utils::metal_is_available() {
                if let Ok(d) = Device::new_metal(0) {
                    return Ok(d);
                }
            }
            Ok(Device::Cpu)
        }
        "cuda" => {
            if !candle_core::utils::cuda_is_available() {
                return Err(Error::Unsupported(
                    "device 'cuda': this build of mbd-rs has no CUDA support (install the CUDA wheel)".into(),
                ));
            }
            Device::new_cuda(ordinal)
                .map(single_stream)
                .map_err(|e| Error::Unsupported(format!("device '{s}': no usable CUDA device or driver: {e}")))
        }
        "metal" => {
            if !candle_core::utils::metal_is_available() {
                return Err(Error::Unsupported("device 'metal': this build of mbd-rs has no Metal support".into()));
            }
            Device::new_metal(ordinal)
                .map_err(|e| Error::Unsupported(format!("device '{s}': no usable Metal device: {e}")))
        }
        _ => Err(Error::invalid(format!("device must be 'auto', 'cpu', 'cuda', 'cuda:N' or 'metal', got '{s}'"))),
    }
}

/// A CUDA device whose tensors skip cudarc's per-allocation events. cudarc records them only once its context has
/// streams of its own (`new_stream`), which candle's device and this engine never create; until then it still
/// creates two events per allocation and destroys them at the free: four driver calls per op's output, unused.
fn single_stream(d: Device) -> Device {
    #[cfg(feature = "cuda")]
    if let Device::Cuda(c) = &d {
        // SAFETY: no stream is created on this context, so the events would never be recorded or waited on.
        unsafe { c.disable_event_tracking() };
    }
    d
}

pub fn device_name(d: &Device) -> String {
    match d {
        Device::Cpu => "cpu".into(),
        Device::Cuda(_) => "cuda".into(),
        Device::Metal(_) => "metal".into(),
    }
}

/// Parse a dtype string; CPU computes in f32 only (candle has no fast half-precision matmul there).
pub fn parse_dtype(s: Option<&str>, device: &Device) -> Result<DType> {
    let dt = match s {
        None | Some("auto") => {
            if device.is_cpu() {
                DType::F32
            } else {
                DType::BF16
            }
        }
        Some("float32") | Some("f32") => DType::F32,
        Some("bfloat16") | Some("bf16") => DType::BF16,
        Some("float16") | Some("f16") => DType::F16,
        Some(o) => {
            return Err(Error::invalid(format!("dtype must be 'auto', 'float32', 'bfloat16' or 'float16', got '{o}'")))
        }
    };
    if device.is_cpu() && dt != DType::F32 {
        return Err(Error::invalid(format!(
            "dtype '{}' is not supported on the CPU, which computes in float32",
            s.unwrap_or("")
        )));
    }
    Ok(dt)
}

pub fn dtype_name(d: DType) -> &'static str {
    match d {
        DType::F32 => "float32",
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "other",
    }
}
