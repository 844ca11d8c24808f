//! A linear layer's weight matrix as the model holds it (`Matrix`) and the products it takes: the candle ops over
//! the CPU kernels (`DenseMatmulT`: `skinny` for few-row windows, `panels` for long ones; `HeldMatmulT`: matrices
//! held outside candle, packed, quantized or for integer dot products), candle's own matmul elsewhere, and candle's
//! quantized matmul for [`Matrix::Candle`].
//!
//! `HoldPolicy` is the one owner of how a loaded matrix is held: from the device, the compute dtype, the `quantize`
//! and `int8_activations` options and the kernel switches, which `Matrix` variant each matrix becomes (and where
//! quantized products can run at all: a CPU computing in f32, or CUDA). `Holder` applies it to a checkpoint's
//! matrices as the model is built.

use crate::error::{Error, Result};
use crate::kernels::blocks::{QMatrix, QuantFormat};
use crate::kernels::panels::{PackedMatrix, Source};
use crate::kernels::qdot::DotMatrix;
use crate::kernels::skinny::{matmul_q, matmul_t};
use crate::kernels::Kernels;
use crate::load::weights::{Stored, Weights};
use candle_core::quantized::QTensor;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, DType, Device, Layout, Shape, Tensor};
use std::cell::RefCell;
use std::collections::BTreeSet;
use std::sync::Arc;

/// A weight matrix (n, k) as the model holds it: as loaded (f32, or bf16 on the CPU), packed at load for the packed
/// product ([`panels::PackedMatrix`](crate::kernels::panels::PackedMatrix): dense f32 or bf16 on a CPU that has it),
/// quantized, quantized and held for integer dot products on 8-bit activations
/// ([`qdot::DotMatrix`](crate::kernels::qdot::DotMatrix), the `int8_activations` option), or quantized as candle's
/// tensor on the device (`Candle`: CUDA's quantized weights).
#[derive(Clone)]
pub enum Matrix {
    Dense(Tensor),
    Packed(Arc<PackedMatrix>),
    Quant(Arc<QMatrix>),
    Dot(Arc<DotMatrix>),
    /// candle's quantized tensor (the same GGUF blocks) on the model's device, multiplied by candle's quantized
    /// matmul: on CUDA its MMVQ / MMQ kernels (llama.cpp's, which round the activations to 8 bits per block of 32,
    /// q8_1); on the CPU ([`Kernels::candle_quant`], tests) its CPU kernels.
    Candle(Arc<QTensor>),
}

impl Matrix {
    /// A dense matrix as the model holds it: packed where `pack` ([`Kernels::packs`]) and the tensor is a CPU f32 or
    /// bf16 matrix on a CPU with the packed product, else as it is.
    pub fn dense(t: Tensor, pack: bool) -> Result<Matrix> {
        if pack {
            if let Some(p) = PackedMatrix::from_tensor(&t)? {
                return Ok(Matrix::Packed(Arc::new(p)));
            }
        }
        Ok(Matrix::Dense(t))
    }

    /// A quantized matrix as the model holds it: packed where `pack` ([`Kernels::packs`]) and the CPU has the packed
    /// product ([`panels::PackedMatrix::from_quant`](crate::kernels::panels::PackedMatrix::from_quant): the same
    /// values, regrouped, multiplied like a packed dense matrix), else as it is.
    pub fn quant(q: QMatrix, pack: bool) -> Result<Matrix> {
        if pack {
            if let Some(p) = PackedMatrix::from_quant(&q)? {
                return Ok(Matrix::Packed(Arc::new(p)));
            }
        }
        Ok(Matrix::Quant(Arc::new(q)))
    }

    /// A quantized matrix as candle's quantized tensor on `dev` ([`Matrix::Candle`]), its bytes as they are.
    pub fn quant_candle(q: &QMatrix, dev: &Device) -> Result<Matrix> {
        let t = candle_core::quantized::ggml_file::qtensor_from_ggml(q.format.ggml(), q.bytes(), vec![q.n, q.k], dev)?;
        Ok(Matrix::Candle(Arc::new(t)))
    }

    /// A quantized matrix for integer dot products on 8-bit activations (`qdot`) where its format has them, else
    /// as `quant` holds it.
    pub fn quant_int8(q: QMatrix, pack: bool) -> Result<Matrix> {
        match DotMatrix::from_quant(&q)? {
            Some(d) => Ok(Matrix::Dot(Arc::new(d))),
            None => Self::quant(q, pack),
        }
    }

    /// `x · wᵀ` (`few`: the rows are few-row windows, see [`linear::few_rows`](crate::net::linear::few_rows); a packed
    /// matrix computes every window the same way).
    pub fn linear(&self, x: &Tensor, k: &Kernels, few: bool) -> candle_core::Result<Tensor> {
        match self {
            Matrix::Dense(w) => linear(x, w, k, few),
            Matrix::Packed(p) => linear_packed(x, p, k),
            Matrix::Quant(q) => linear_q(x, q, k, few),
            Matrix::Dot(d) => linear_dot(x, d, k),
            Matrix::Candle(q) => {
                // its CUDA kernels take f32, f16 or bf16 x, its fallbacks and the CPU's f32 only
                let dt = x.dtype();
                x.to_dtype(DType::F32)?.contiguous()?.apply_op1_no_bwd(q.as_ref())?.to_dtype(dt)
            }
        }
    }

    /// Matrices with the same input width stacked into one (their rows one after another), when they are held
    /// alike: all dense in one dtype, or all quantized in one format. None otherwise (e.g. a GGUF file whose
    /// q/k/v tensors were written in different formats).
    pub fn stack(parts: &[Matrix]) -> Result<Option<Matrix>> {
        match parts {
            [] => Ok(None),
            [one] => Ok(Some(one.clone())),
            [Matrix::Dense(first), ..] => {
                let mut ts = Vec::with_capacity(parts.len());
                for m in parts {
                    match m {
                        Matrix::Dense(t) if t.dtype() == first.dtype() && t.dim(1)? == first.dim(1)? => ts.push(t),
                        _ => return Ok(None),
                    }
                }
                Ok(Some(Matrix::Dense(Tensor::cat(&ts, 0)?)))
            }
            [Matrix::Packed(_), ..] => {
                let ps: Option<Vec<&PackedMatrix>> =
                    parts.iter().map(|m| if let Matrix::Packed(p) = m { Some(&**p) } else { None }).collect();
                let Some(ps) = ps else { return Ok(None) };
                Ok(PackedMatrix::stack(&ps)?.map(|p| Matrix::Packed(Arc::new(p))))
            }
            // candle's quantized tensors are multiplied one by one
            [Matrix::Candle(_), ..] => Ok(None),
            [Matrix::Dot(_), ..] => {
                let ds: Option<Vec<&DotMatrix>> =
                    parts.iter().map(|m| if let Matrix::Dot(d) = m { Some(&**d) } else { None }).collect();
                let Some(ds) = ds else { return Ok(None) };
                Ok(DotMatrix::stack(&ds)?.map(|d| Matrix::Dot(Arc::new(d))))
            }
            [Matrix::Quant(_), ..] => {
                let qs: Option<Vec<&QMatrix>> =
                    parts.iter().map(|m| if let Matrix::Quant(q) = m { Some(&**q) } else { None }).collect();
                let Some(qs) = qs else { return Ok(None) };
                Ok(QMatrix::stack(&qs)?.map(|q| Matrix::Quant(Arc::new(q))))
            }
        }
    }

    /// Whether a product's row is the same bits whatever rows share the call and however the rows are cut (few or long
    /// windows): true for matrices packed at load and those held for integer dot products, whose every element is
    /// computed alone (see [`kernels::panels`](crate::kernels::panels) and [`kernels::qdot`](crate::kernels::qdot)).
    pub fn row_invariant(&self) -> bool {
        matches!(self, Matrix::Packed(_) | Matrix::Dot(_))
    }

    /// Rows `ids` (an embedding lookup), in the dtype they are held in (quantized: f32): `on_device` holds the same
    /// ids (u32) on the model's device (for a table held there; the others read `ids`).
    pub fn rows(&self, ids: &[u32], on_device: &Tensor) -> Result<Tensor> {
        let dev = on_device.device();
        Ok(match self {
            Matrix::Dense(w) => w.index_select(on_device, 0)?,
            Matrix::Packed(p) => held_rows(ids, p.n, p.k, dev, |id, dst| p.rows_into(id, 1, dst))?,
            Matrix::Quant(q) => Tensor::from_vec(q.rows(ids)?, (ids.len(), q.k), dev)?,
            Matrix::Dot(d) => held_rows(ids, d.n, d.k, dev, |id, dst| d.rows_into(id, 1, dst))?,
            // never a table (`Weights::quantize_as`)
            Matrix::Candle(_) => return Err(Error::Internal("a row lookup in a quantized device matrix".into())),
        })
    }
}

/// Rows `ids` of an n × k matrix held outside candle, each written by `row(id, dst)` (f32).
fn held_rows(ids: &[u32], n: usize, k: usize, dev: &Device, row: impl Fn(usize, &mut [f32])) -> Result<Tensor> {
    let mut out = vec![0f32; ids.len() * k];
    for (&id, dst) in ids.iter().zip(out.chunks_mut(k.max(1))) {
        if id as usize >= n {
            return Err(Error::Internal(format!("row {id} of a {n}-row matrix")));
        }
        row(id as usize, dst);
    }
    Ok(Tensor::from_vec(out, (ids.len(), k), dev)?)
}

/// How the model holds its matrices, resolved once per load ([`HoldPolicy::resolve`]).
#[derive(Debug, Clone)]
pub struct HoldPolicy {
    device: Device,
    dtype: DType,
    /// The `quantize` load option: the format of the matrices quantized at load.
    quantize: Option<QuantFormat>,
    /// Dense and quantized matrices packed for the CPU's packed product ([`Kernels::packs`], f32 compute).
    pack: bool,
    /// Quantized matrices held for integer dot products on 8-bit activations where their format has them.
    int8: bool,
    /// Quantized linear-layer matrices held as candle's quantized tensors on the device: always on CUDA; on the CPU
    /// only under [`Kernels::candle_quant`] (tests and A/B runs of that path).
    candle_quant: bool,
    /// `int8_activations=False` asked on CUDA: an error if any matrix ends up quantized ([`Holder::finish`]).
    exact_on_cuda: bool,
}

/// Where our CPU kernels multiply quantized matrices: a CPU computing in f32.
fn cpu_kernels_run(device: &Device, dtype: DType) -> bool {
    device.is_cpu() && dtype == DType::F32
}

/// Where quantized products run at all: our CPU kernels (`cpu_kernels_run`), or candle's on CUDA. The one spelling
/// of the rule; `quantize`, `int8_activations` and which matrices stay quantized all ask it.
fn quantized_products_run(device: &Device, dtype: DType) -> bool {
    device.is_cuda() || cpu_kernels_run(device, dtype)
}

/// `int8_activations=False` for quantized weights on CUDA.
fn exact_on_cuda_error() -> Error {
    Error::invalid(
        "int8_activations=False: on CUDA the quantized products always round the activations to 8 bits (candle's \
         kernels); the exact products of quantized weights run on the CPU (device='cpu')"
            .to_string(),
    )
}

impl HoldPolicy {
    /// The policy of a load: `quantize` and `int8_activations` (None: on wherever it runs) checked against the
    /// device and dtype, and the kernel switches that say how matrices are held. `gguf`: the checkpoint is a GGUF
    /// file (its matrices may be stored quantized).
    pub fn resolve(
        device: &Device,
        dtype: DType,
        quantize: Option<QuantFormat>,
        int8_activations: Option<bool>,
        kernels: &Kernels,
        gguf: bool,
    ) -> Result<HoldPolicy> {
        let runs = quantized_products_run(device, dtype);
        if let (Some(q), false) = (quantize, runs) {
            return Err(Error::invalid(format!(
                "quantize='{}': quantized weights run on the CPU in float32 or on CUDA in this version; load with \
                 device='cpu' (and dtype None or 'float32') or device='cuda'",
                q.name()
            )));
        }
        // 8-bit activations: CUDA's quantized products (candle's kernels) always round them; the CPU's integer dot
        // products need float32 compute and AVX2. Off where nothing ends up quantized (`Holder::finish`).
        let int8_here = device.is_cuda() || cpu_kernels_run(device, dtype) && crate::kernels::qdot::available();
        let int8 = match int8_activations {
            None => int8_here,
            Some(false) => false,
            Some(true) => {
                let why = if !runs {
                    Some("it runs on the CPU in float32 or on CUDA in this version; load with device='cpu' (and dtype None or 'float32') or device='cuda'")
                } else if quantize.is_none() && !gguf {
                    Some("it multiplies quantized matrices: pass quantize='q8_0', 'q4_k', ... or load a GGUF file")
                } else if !int8_here {
                    Some(
                        "this CPU lacks AVX2, which its integer dot products need (x86-64; AVX-512 VNNI where present)",
                    )
                } else {
                    None
                };
                if let Some(why) = why {
                    return Err(Error::invalid(format!("int8_activations=True: {why}")));
                }
                true
            }
        };
        let exact_on_cuda = device.is_cuda() && int8_activations == Some(false);
        if exact_on_cuda && quantize.is_some() {
            return Err(exact_on_cuda_error());
        }
        Ok(HoldPolicy {
            device: device.clone(),
            dtype,
            quantize,
            pack: kernels.packs() && dtype == DType::F32,
            int8,
            candle_quant: !device.is_cpu() || kernels.candle_quant,
            exact_on_cuda,
        })
    }

    /// Whether candle's quantized tensors hold this matrix (`candle_quant`): never a table (the embedding or the
    /// head), since candle's quantized kernels multiply and do not look rows up.
    fn candle_holds(&self, table: bool) -> bool {
        self.candle_quant && !table
    }

    /// Whether a matrix stays quantized (a block format as stored, or the `quantize` option): where our CPU kernels
    /// run (f32 compute), elsewhere where candle holds it; otherwise it is dequantized to the compute dtype.
    fn quantized_here(&self, table: bool) -> bool {
        cpu_kernels_run(&self.device, self.dtype) || self.candle_holds(table)
    }

    /// A quantized matrix as held: candle's quantized tensor (`candle_holds`), for integer dot products (`int8`),
    /// packed (`pack`) or in its blocks.
    fn hold(&self, q: QMatrix, table: bool) -> Result<Matrix> {
        if self.candle_holds(table) {
            return Matrix::quant_candle(&q, &self.device);
        }
        if self.int8 {
            Matrix::quant_int8(q, self.pack)
        } else {
            Matrix::quant(q, self.pack)
        }
    }
}

/// A checkpoint's matrices as the model holds them: the file reader (`Weights`) under a `HoldPolicy`, counting the
/// block formats and dtypes it holds.
pub struct Holder<'a> {
    ws: &'a Weights,
    policy: &'a HoldPolicy,
    formats: RefCell<BTreeSet<&'static str>>,
    /// The dtypes of the matrices held dense (unquantized), in the order first seen.
    dense: RefCell<Vec<DType>>,
    /// Matrices quantized under the `quantize` option.
    quantized: std::cell::Cell<usize>,
}

/// What a `Holder` held, once the model is built ([`Holder::finish`]).
#[derive(Debug, Clone, PartialEq)]
pub struct HeldMatrices {
    /// The block formats held (sorted): a GGUF file's as stored, the `quantize` option's and their fallbacks.
    pub formats: Vec<&'static str>,
    /// The dtypes of the matrices held unquantized.
    pub dense: Vec<DType>,
    /// How many matrices the `quantize` option quantized (0 with the option: it had nothing to act on).
    pub quantized: usize,
}

impl<'a> Holder<'a> {
    pub fn new(ws: &'a Weights, policy: &'a HoldPolicy) -> Self {
        Holder { ws, policy, formats: RefCell::default(), dense: RefCell::default(), quantized: Default::default() }
    }

    /// The file reader (tensors that are not matrices: norms, biases, a MoE router).
    pub fn weights(&self) -> &'a Weights {
        self.ws
    }

    /// A linear layer's weight matrix: quantized under the `quantize` option (in the format [`QuantFormat::for_matrix`]
    /// picks), a stored block format kept where quantized products run, else as [`Weights::get_matrix`] reads it.
    pub fn weight(&self, name: &str, shape: &[usize]) -> Result<Matrix> {
        self.matrix(name, shape, false)
    }

    /// The embedding table or the head: as `weight`, in the format a table gets (see
    /// [`kernels::blocks`](crate::kernels::blocks)).
    pub fn table(&self, name: &str, shape: &[usize]) -> Result<Matrix> {
        self.matrix(name, shape, true)
    }

    fn matrix(&self, name: &str, shape: &[usize], table: bool) -> Result<Matrix> {
        match self.ws.matrix(name, shape, self.policy.quantized_here(table))? {
            Stored::Blocks(q) => {
                // kept as stored: the kernels multiply this format
                self.formats.borrow_mut().insert(q.format.name());
                self.policy.hold(q, table)
            }
            // a block format the kernels lack: held as q8_0 (or the `quantize` format)
            Stored::Dequantized(t) => {
                self.quantize_as(t, table, Some(self.policy.quantize.unwrap_or(QuantFormat::Q8_0)), name)
            }
            Stored::Dense(t) => self.quantize_as(t, table, self.policy.quantize, name),
        }
    }

    /// A matrix already read from this checkpoint (e.g. one expert's slice of a fused tensor; `name` says which,
    /// for errors) as a linear layer's weight (`table`: the embedding or the head): quantized under the `quantize`
    /// option, its bytes counted as held.
    pub fn to_weight(&self, t: Tensor, table: bool, name: &str) -> Result<Matrix> {
        self.quantize_as(t, table, self.policy.quantize, name)
    }

    fn quantize_as(&self, t: Tensor, table: bool, quantize: Option<QuantFormat>, name: &str) -> Result<Matrix> {
        let quantize = quantize.filter(|_| self.policy.quantized_here(table));
        let Some(format) = quantize.and_then(|f| f.for_matrix(t.dim(1).unwrap_or(0), table)) else {
            // counted as loaded (a packed matrix's padding to whole groups, under 16 rows, is not)
            let mut dense = self.dense.borrow_mut();
            if !dense.contains(&t.dtype()) {
                dense.push(t.dtype());
            }
            return Matrix::dense(t, self.policy.pack);
        };
        let q = QMatrix::quantize(&t, format)?;
        if let Some((_, row)) = q.first_non_finite_scale() {
            return Err(self.overflow(&t, row, format, name));
        }
        self.ws.recount(t.elem_count() * t.dtype().size_in_bytes(), q.bytes().len());
        self.formats.borrow_mut().insert(format.name());
        if self.policy.quantize.is_some() {
            self.quantized.set(self.quantized.get() + 1);
        }
        self.policy.hold(q, table)
    }

    /// The error for a matrix whose values overflow a block's f16 scale in `format` (row `row`): at load, naming
    /// the tensor and the format; the checkpoint's own values are fine.
    fn overflow(&self, t: &Tensor, row: usize, format: QuantFormat, name: &str) -> Error {
        let largest = t
            .get(row)
            .and_then(|r| r.abs()?.max(0)?.to_dtype(DType::F32)?.to_scalar::<f32>())
            .map(|m| format!(" (its largest |value| is {m:e})"))
            .unwrap_or_default();
        let f = format.name();
        let fix = match self.policy.quantize {
            Some(q) => format!(
                "load it without quantize='{}' (the checkpoint's own values are fine), or in a format whose block \
                 scales reach further",
                q.name()
            ),
            None => "this file's block format is held as q8_0 here; a float (f16/f32) file of the model would load"
                .to_string(),
        };
        Error::invalid(format!(
            "tensor '{name}' cannot be held as {f}: row {row}{largest} overflows the f16 scale of a {f} block; {fix}"
        ))
    }

    /// What was held, once the model is built; with `int8_activations=False` on CUDA, an error if any matrix is
    /// quantized (a GGUF file's blocks: `quantize=` was refused before the load).
    pub fn finish(self) -> Result<HeldMatrices> {
        let formats: Vec<&'static str> = self.formats.into_inner().into_iter().collect();
        if self.policy.exact_on_cuda && !formats.is_empty() {
            return Err(exact_on_cuda_error());
        }
        Ok(HeldMatrices { formats, dense: self.dense.into_inner(), quantized: self.quantized.get() })
    }
}

/// Whether the quantized matrices of a model held under `policy` (`held`) multiply 8-bit activations (what
/// [`ModelInfo::int8_activations`](crate::model::info::ModelInfo::int8_activations) reports).
pub fn int8_activations(policy: &HoldPolicy, held: &HeldMatrices) -> bool {
    policy.int8 && !held.formats.is_empty()
}

/// The candle op for a dense W: (x: (m, k) f32, w: (n, k) f32 or bf16) -> (m, n), both contiguous on the CPU; the
/// few-row kernel ([`skinny`](crate::kernels::skinny)`::matmul_t`), or
/// [`panels::matmul_t`](crate::kernels::panels::matmul_t) for a long window (`panels`).
pub struct DenseMatmulT {
    pub par_min_macs: usize,
    pub panels: bool,
    /// [`Kernels::packed_avx512`]
    pub avx512: bool,
}

impl CustomOp2 for DenseMatmulT {
    fn name(&self) -> &'static str {
        "dense-matmul-t"
    }
    fn cpu_fwd(
        &self,
        s1: &CpuStorage,
        l1: &Layout,
        s2: &CpuStorage,
        l2: &Layout,
    ) -> candle_core::Result<(CpuStorage, Shape)> {
        let ((m, k), (n, k2)) = (l1.shape().dims2()?, l2.shape().dims2()?);
        if k != k2 {
            candle_core::bail!("dense-matmul-t: inner dimensions differ ({k} vs {k2})");
        }
        let (Some((a0, a1)), Some((b0, b1))) = (l1.contiguous_offsets(), l2.contiguous_offsets()) else {
            candle_core::bail!("dense-matmul-t: operands must be contiguous");
        };
        let (CpuStorage::F32(x), w) = (s1, s2) else { candle_core::bail!("dense-matmul-t: x must be f32") };
        let (x, par) = (&x[a0..a1], self.par_min_macs);
        let panels = |w: Source<'_>| crate::kernels::panels::matmul_t_with(x, m, k, w, n, par, self.avx512);
        let y = match (w, self.panels) {
            (CpuStorage::F32(w), false) => matmul_t(x, m, k, &w[b0..b1], n, par),
            (CpuStorage::BF16(w), false) => matmul_t(x, m, k, &w[b0..b1], n, par),
            (CpuStorage::F32(w), true) => panels(Source::F32(&w[b0..b1])),
            (CpuStorage::BF16(w), true) => panels(Source::Bf16(&w[b0..b1])),
            _ => candle_core::bail!("dense-matmul-t: w must be f32 or bf16"),
        };
        Ok((CpuStorage::F32(y), Shape::from((m, n))))
    }
}

/// Whether the few-row kernel can compute `x · wᵀ`: the operands fit `DenseMatmulT` and the kernel is switched on.
pub fn supports(x: &Tensor, w: &Tensor, k: &Kernels) -> bool {
    k.skinny && dense_operands(x, w)
}

/// Whether `DenseMatmulT` takes these operands: CPU, x f32 2-D contiguous, w f32 or bf16 2-D contiguous.
fn dense_operands(x: &Tensor, w: &Tensor) -> bool {
    x.device().is_cpu()
        && x.dtype() == DType::F32
        && matches!(w.dtype(), DType::F32 | DType::BF16)
        && x.rank() == 2
        && w.rank() == 2
        && x.is_contiguous()
        && w.is_contiguous()
}

/// Whether a sequence's window of `rows` rows takes the few-row kernel (1 to `max_rows` rows) rather than gemm.
/// The choice is made per sequence, never from the total rows of a batched forward: the kernel computes each
/// row the same way whatever rows share the call, so stacking the few-row windows of many sequences into one
/// call (any total) gives every row exactly what it gets alone; a long window (prefill) goes to gemm on its own.
pub fn few_rows(rows: usize, k: &Kernels) -> bool {
    k.skinny && (1..=k.max_rows).contains(&rows)
}

/// `x · wᵀ` for x (m, k) and w (n, k): the skinny kernel when `few` (the rows are few-row windows, see `few_rows`)
/// and it `supports` the operands; otherwise (a long window) `panels` on the CPU, candle's matmul elsewhere (or
/// with [`Kernels::panels`] off; a bf16 w is then widened to f32 for the call).
pub fn linear(x: &Tensor, w: &Tensor, k: &Kernels, few: bool) -> candle_core::Result<Tensor> {
    // bf16 weights exist only on the CPU and only the few-row kernel reads them: give it a contiguous x
    let x = if w.dtype() == DType::BF16 && !x.is_contiguous() { x.contiguous()? } else { x.clone() };
    if few && supports(&x, w, k) {
        x.apply_op2_no_bwd(w, &DenseMatmulT { par_min_macs: k.par_min_macs, panels: false, avx512: k.packed_avx512 })
    } else if k.panels && dense_operands(&x, w) {
        x.apply_op2_no_bwd(w, &DenseMatmulT { par_min_macs: k.par_min_macs, panels: true, avx512: k.packed_avx512 })
    } else if w.dtype() == DType::BF16 {
        x.matmul(&w.to_dtype(x.dtype())?.t()?)
    } else {
        x.matmul(&w.t()?)
    }
}

/// A matrix `HeldMatmulT` multiplies: through the panels (or the few-row kernel), or by integer dot products (`qdot`).
#[derive(Clone, Copy)]
enum Held<'a> {
    Panels(Source<'a>),
    Dot(&'a crate::kernels::qdot::DotMatrix),
}

/// The candle op for a quantized or packed W held outside candle: x (m, k) contiguous f32 on the CPU -> (m, n). A
/// quantized W's few-row windows take the few-row kernel (`skinny::matmul_q`); everything else
/// [`panels::matmul_t`](crate::kernels::panels::matmul_t).
struct HeldMatmulT<'a> {
    w: Held<'a>,
    n: usize,
    k: usize,
    par_min_macs: usize,
    /// a quantized W's few-row window: the few-row kernel rather than the panels
    few: bool,
    /// [`Kernels::packed_avx512`]
    avx512: bool,
}

impl HeldMatmulT<'_> {
    /// The op on x, converted to contiguous f32 first.
    fn apply(&self, x: &Tensor) -> candle_core::Result<Tensor> {
        let x = if x.dtype() == DType::F32 { x.contiguous()? } else { x.to_dtype(DType::F32)?.contiguous()? };
        x.apply_op1_no_bwd(self)
    }
}

impl CustomOp1 for HeldMatmulT<'_> {
    fn name(&self) -> &'static str {
        "held-matmul-t"
    }
    fn cpu_fwd(&self, s: &CpuStorage, l: &Layout) -> candle_core::Result<(CpuStorage, Shape)> {
        let (m, k) = l.shape().dims2()?;
        if k != self.k {
            candle_core::bail!("held-matmul-t: x has rows of {k}, the matrix of {}", self.k);
        }
        let (CpuStorage::F32(x), Some((a0, a1))) = (s, l.contiguous_offsets()) else {
            candle_core::bail!("held-matmul-t: x must be contiguous f32");
        };
        let x = &x[a0..a1];
        let y = match self.w {
            Held::Panels(Source::Quant(q)) if self.few => matmul_q(x, m, q, self.par_min_macs),
            Held::Panels(w) => {
                crate::kernels::panels::matmul_t_with(x, m, k, w, self.n, self.par_min_macs, self.avx512)
            }
            Held::Dot(d) => {
                use crate::kernels::qdot::Isa;
                let isa = if self.avx512 { Isa::best() } else { Isa::best().min(Isa::Avx2) };
                crate::kernels::qdot::matmul(x, m, d, self.par_min_macs, isa)
            }
        };
        Ok((CpuStorage::F32(y), Shape::from((m, self.n))))
    }
}

/// `x · wᵀ` for a packed w (CPU): every window, a one-row decode window or a prefill chunk, through the packed
/// product, so each row's result is the same whatever window it is in.
pub fn linear_packed(x: &Tensor, p: &PackedMatrix, k: &Kernels) -> candle_core::Result<Tensor> {
    let w = Held::Panels(Source::Packed(p));
    HeldMatmulT { w, n: p.n, k: p.k, par_min_macs: k.par_min_macs, few: false, avx512: k.packed_avx512 }.apply(x)
}

/// `x · wᵀ` for a quantized w (CPU): few-row windows (`few`) take the few-row kernel (`skinny::matmul_q`), long windows
/// `panels` (each panel dequantized once, then gemm), or the few-row kernel too with [`Kernels::panels`] off (it
/// streams the weights once per ROW_BLOCK rows, each time dequantizing them again).
pub fn linear_q(x: &Tensor, q: &QMatrix, k: &Kernels, few: bool) -> candle_core::Result<Tensor> {
    let w = Held::Panels(Source::Quant(q));
    let few = few || !k.panels;
    HeldMatmulT { w, n: q.n, k: q.k, par_min_macs: k.par_min_macs, few, avx512: k.packed_avx512 }.apply(x)
}

/// `x · wᵀ` for a matrix held for integer dot products (CPU): every window through
/// [`qdot::matmul`](crate::kernels::qdot::matmul), its AVX-512 VNNI kernels where the CPU has them (and
/// [`Kernels::packed_avx512`] is on), else its AVX2 ones, else the scalar ones (the same bits on each).
pub fn linear_dot(x: &Tensor, d: &crate::kernels::qdot::DotMatrix, k: &Kernels) -> candle_core::Result<Tensor> {
    HeldMatmulT { w: Held::Dot(d), n: d.n, k: d.k, par_min_macs: k.par_min_macs, few: false, avx512: k.packed_avx512 }
        .apply(x)
}

/// How the stacked rows of a forward are cut for matrix products: the few-row windows first, as one product
/// (the skinny kernel, whose rows do not depend on each other), then each long window alone (gemm). See the
/// module's note on batch invariance.
pub(crate) struct Groups {
    /// Rows of few-row windows at the top of the stack.
    few: usize,
    /// (start, rows) of each long window after them.
    long: Vec<(usize, usize)>,
}

impl Groups {
    /// How segments with these row counts are stacked: few-row ones first, then long ones, each in given order.
    /// Returns the stack order, each segment's (first row, rows) in the stack, and the groups.
    pub(crate) fn stack(counts: &[usize], kn: &Kernels) -> (Vec<usize>, Vec<(usize, usize)>, Groups) {
        let few = |i: &usize| few_rows(counts[*i], kn);
        let order: Vec<usize> = (0..counts.len()).filter(few).chain((0..counts.len()).filter(|i| !few(i))).collect();
        let mut spans = vec![(0, 0); counts.len()];
        let mut g = Groups { few: 0, long: vec![] };
        let mut off = 0;
        for &i in &order {
            let r = counts[i];
            spans[i] = (off, r);
            if few(&i) {
                g.few += r;
            } else if r > 0 {
                g.long.push((off, r));
            }
            off += r;
        }
        (order, spans, g)
    }

    /// `f` over each group of rows of `x` (`few`: whether they are few-row windows), stacked back.
    pub(crate) fn apply(&self, x: &Tensor, f: impl Fn(&Tensor, bool) -> Result<Tensor>) -> Result<Tensor> {
        if self.long.is_empty() {
            return f(x, true);
        }
        let mut parts = Vec::with_capacity(self.long.len() + 1);
        if self.few > 0 {
            parts.push(f(&x.narrow(0, 0, self.few)?, true)?);
        }
        for &(o, n) in &self.long {
            parts.push(f(&x.narrow(0, o, n)?, false)?);
        }
        if parts.len() == 1 {
            return Ok(parts.pop().expect("one part"));
        }
        Ok(Tensor::cat(&parts, 0)?)
    }

    /// Cut ascending stacked row indices into (lo, hi, few) parts the same way: rows of few-row windows
    /// together, each long window's rows alone (few when they are few themselves, as they would be alone).
    pub(crate) fn parts(&self, rows: &[u32]) -> Vec<(usize, usize, bool)> {
        let mut out = vec![];
        let cut = rows.partition_point(|&r| (r as usize) < self.few);
        if cut > 0 {
            out.push((0, cut, true));
        }
        let mut lo = cut;
        for &(o, n) in &self.long {
            let hi = lo + rows[lo..].partition_point(|&r| (r as usize) < o + n);
            if hi > lo {
                out.push((lo, hi, false));
            }
            lo = hi;
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn op_agrees_with_candle_matmul() {
        let dev = candle_core::Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (6, 40), &dev).unwrap();
        let w = Tensor::randn(0f32, 1.0, (30, 40), &dev).unwrap();
        let kn = Kernels::default();
        assert!(supports(&x, &w, &kn) && few_rows(6, &kn) && few_rows(1, &kn) && !few_rows(65, &kn));
        let a = linear(&x, &w, &kn, true).unwrap();
        let b = x.matmul(&w.t().unwrap()).unwrap();
        assert_eq!(a.dims(), &[6, 30]);
        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
        assert!(d < 1e-4, "{d}");
        // a transposed (non-contiguous) x falls back to candle's matmul
        let xt = Tensor::randn(0f32, 1.0, (40, 6), &dev).unwrap().t().unwrap();
        assert!(!supports(&xt, &w, &kn));
        assert_eq!(linear(&xt, &w, &kn, true).unwrap().dims(), &[6, 30]);
    }

    #[test]
    fn bf16_weights_through_candle_match_its_matmul() {
        // one row and many rows (the latter widens w and uses candle's matmul)
        let dev = candle_core::Device::Cpu;
        let w = Tensor::randn(0f32, 1.0, (50, 24), &dev).unwrap().to_dtype(DType::BF16).unwrap();
        let wf = w.to_dtype(DType::F32).unwrap();
        for m in [1usize, 3, 64, 65, 200] {
            let x = Tensor::randn(0f32, 1.0, (m, 24), &dev).unwrap();
            let a = linear(&x, &w, &Kernels::default(), few_rows(m, &Kernels::default())).unwrap();
            let b = x.matmul(&wf.t().unwrap()).unwrap();
            let d = (a - b).unwrap().abs().unwrap().max_all().unwrap().to_scalar::<f32>().unwrap();
            assert!(d < 1e-4, "m{m}: {d}");
        }
    }

    #[test]
    fn quantized_rows_through_candle_equal_the_row_alone() {
        // through candle, rows of a stacked call equal the row alone
        let q = QMatrix::quantize(
            &Tensor::randn(0f32, 1.0, (70, 64), &candle_core::Device::Cpu).unwrap(),
            crate::kernels::blocks::QuantFormat::Q8_0,
        )
        .unwrap();
        let x = Tensor::randn(0f32, 1.0, (9, 64), &candle_core::Device::Cpu).unwrap();
        let all = linear_q(&x, &q, &Kernels::default(), true).unwrap();
        let one = linear_q(&x.narrow(0, 4, 1).unwrap(), &q, &Kernels::default(), true).unwrap();
        assert_eq!(all.narrow(0, 4, 1).unwrap().to_vec2::<f32>().unwrap(), one.to_vec2::<f32>().unwrap());
    }
}
