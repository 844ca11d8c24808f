//! Quantized weight matrices (the `quantize` load option): a checkpoint's matrices are quantized at load into GGUF
//! block formats by candle's quantizer ([`candle_core::quantized::QTensor::quantize`]), and multiplied on the CPU by
//! the skinny kernel ([`skinny::matmul_q`](crate::kernels::skinny::matmul_q)), which dequantizes 4 weight rows at a
//! time into an f32 scratch and sweeps every x row over them: a quantized matrix computes exactly as its f32
//! dequantization held row-major would (a dense matrix packed at load,
//! [`panels::PackedMatrix`](crate::kernels::panels::PackedMatrix), sums in another order), with a quarter (q8_0) or
//! about a seventh (q4_k) of the bytes streamed from memory. On CPUs with the packed product every format is packed at
//! load instead ([`Matrix::quant`](crate::net::linear::Matrix::quant): the same values in groups of 16 columns, about
//! the same bytes) and computes exactly as its f32 dequantization packed.
//!
//! Why not candle's quantized matmul (`QMatMul`): it quantizes the activations to 8 bits per call (a second rounding),
//! it re-reads the weight matrix once per x row (a 32-row window streams the weights 32 times), and its SIMD dot
//! products are selected at compile time (`cfg(target_feature = "avx2")`), so a wheel built for every x86_64 CPU runs
//! them scalar. Our kernel selects AVX-512 / AVX2 at run time and streams the weights once per window; each row's
//! result does not depend on the other rows (batch invariance, [`net::qwen`](crate::net::qwen)).
//!
//! Which matrices: every linear layer (attention, MLP, MoE experts), the embedding table and the head. The router of a
//! MoE layer stays as loaded (a few rows; its top-k decides which experts run). The embedding and the head are q8_0 in
//! every format (the head's precision decides the logits; llama.cpp's q4_K_M keeps a 6-bit head for the same reason),
//! so a tied checkpoint keeps one quantized table for both. A matrix whose rows do not split into whole blocks falls
//! back to the next format down the chain that fits, as llama.cpp does for q4_K: q4_k (256 values) -> q5_0 (32) -> q8_0
//! (32); q5_0 -> q8_0; else it stays as loaded. (Qwen2.5's 896-wide 0.5B rows are 3.5 super-blocks: under q4_k its
//! matrices that take 896-value rows are q5_0.)

use crate::error::{Error, Result};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use half::f16;

crate::util::string_enum! {
    /// The `quantize` load option: the block format of the quantized matrices.
    pub enum QuantFormat ("quantize") {
        /// 8-bit: blocks of 32 values, an f16 scale each (34 bytes, 8.5 bits per weight)
        Q8_0 = "q8_0",
        /// 4-bit k-quant: super-blocks of 256 values in 8 sub-blocks with 6-bit scales and mins (144 bytes, 4.5
        /// bits per weight)
        Q4K = "q4_k",
        /// 5-bit: blocks of 32 values, an f16 scale, 4 bytes of fifth bits and 16 of nibbles (22 bytes, 5.5 bits
        /// per weight); q4_k's format for rows that do not split into super-blocks
        Q5_0 = "q5_0",
        /// 5-bit k-quant: q4_k's super-blocks with a fifth bit per value (176 bytes, 5.5 bits per weight);
        /// llama.cpp's Q5_K_M and Q5_K_S files hold it
        Q5K = "q5_k",
        /// 6-bit k-quant: super-blocks of 256 values, 16 signed 8-bit scales (one per 16 values) and an f16 scale
        /// (210 bytes, 6.56 bits per weight); llama.cpp's Q4_K_M and Q6_K files hold it
        Q6K = "q6_k",
        /// 4-bit: blocks of 32 values, an f16 scale and 16 bytes of nibbles (18 bytes, 4.5 bits per weight);
        /// llama.cpp's Q4_0 files, and q2_k's and q3_k's format for rows that do not split into super-blocks
        Q4_0 = "q4_0",
        /// 3-bit k-quant: super-blocks of 256 values, 2 low bits and a high bit each, 16 6-bit scales (one per 16
        /// values) and an f16 scale (110 bytes, 3.44 bits per weight); llama.cpp's Q3_K_* and Q2_K files hold it
        Q3K = "q3_k",
        /// 2-bit k-quant: super-blocks of 256 values in 16 sub-blocks with 4-bit scales and mins (84 bytes, 2.63
        /// bits per weight); llama.cpp's Q2_K files hold it
        Q2K = "q2_k",
    }
}

impl QuantFormat {
    /// Values per block.
    pub fn block_values(self) -> usize {
        match self {
            QuantFormat::Q8_0 | QuantFormat::Q5_0 | QuantFormat::Q4_0 => 32,
            QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K | QuantFormat::Q3K | QuantFormat::Q2K => 256,
        }
    }
    /// Bytes per block.
    pub fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q4K => 144,
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q5K => 176,
            QuantFormat::Q6K => 210,
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q3K => 110,
            QuantFormat::Q2K => 84,
        }
    }
    /// Byte offsets of a block's f16 scales (q4_k, q5_k: d and dmin; q6_k, q3_k: d, after the values and
    /// sub-scales; q2_k: d and dmin after them).
    fn scale_offsets(self) -> &'static [usize] {
        match self {
            QuantFormat::Q8_0 | QuantFormat::Q5_0 | QuantFormat::Q4_0 => &[0],
            QuantFormat::Q4K | QuantFormat::Q5K => &[0, 2],
            QuantFormat::Q6K => &[208],
            QuantFormat::Q3K => &[108],
            QuantFormat::Q2K => &[80, 82],
        }
    }
    /// Bytes of a row of `k` values (k a multiple of `block_values`).
    pub fn row_bytes(self, k: usize) -> usize {
        k / self.block_values() * self.block_bytes()
    }
    /// The format of a GGUF block type, when the kernel multiplies it.
    pub fn from_ggml(g: GgmlDType) -> Option<QuantFormat> {
        match g {
            GgmlDType::Q8_0 => Some(QuantFormat::Q8_0),
            GgmlDType::Q4K => Some(QuantFormat::Q4K),
            GgmlDType::Q5_0 => Some(QuantFormat::Q5_0),
            GgmlDType::Q5K => Some(QuantFormat::Q5K),
            GgmlDType::Q6K => Some(QuantFormat::Q6K),
            GgmlDType::Q4_0 => Some(QuantFormat::Q4_0),
            GgmlDType::Q3K => Some(QuantFormat::Q3K),
            GgmlDType::Q2K => Some(QuantFormat::Q2K),
            _ => None,
        }
    }
    pub fn ggml(self) -> GgmlDType {
        match self {
            QuantFormat::Q8_0 => GgmlDType::Q8_0,
            QuantFormat::Q4K => GgmlDType::Q4K,
            QuantFormat::Q5_0 => GgmlDType::Q5_0,
            QuantFormat::Q5K => GgmlDType::Q5K,
            QuantFormat::Q6K => GgmlDType::Q6K,
            QuantFormat::Q4_0 => GgmlDType::Q4_0,
            QuantFormat::Q3K => GgmlDType::Q3K,
            QuantFormat::Q2K => GgmlDType::Q2K,
        }
    }
    /// This format and the ones a matrix falls back to, in order, when its rows do not split into its blocks.
    fn chain(self) -> &'static [QuantFormat] {
        match self {
            QuantFormat::Q4K => &[QuantFormat::Q4K, QuantFormat::Q5_0, QuantFormat::Q8_0],
            QuantFormat::Q5_0 => &[QuantFormat::Q5_0, QuantFormat::Q8_0],
            QuantFormat::Q5K => &[QuantFormat::Q5K, QuantFormat::Q8_0],
            QuantFormat::Q6K => &[QuantFormat::Q6K, QuantFormat::Q8_0],
            QuantFormat::Q8_0 => &[QuantFormat::Q8_0],
            QuantFormat::Q4_0 => &[QuantFormat::Q4_0, QuantFormat::Q8_0],
            QuantFormat::Q3K => &[QuantFormat::Q3K, QuantFormat::Q4_0, QuantFormat::Q8_0],
            QuantFormat::Q2K => &[QuantFormat::Q2K, QuantFormat::Q4_0, QuantFormat::Q8_0],
        }
    }
    /// The format a matrix with rows of `k` values gets under this option (see the module note), None: it stays
    /// as loaded. `table`: the embedding table or the head.
    pub fn for_matrix(self, k: usize, table: bool) -> Option<QuantFormat> {
        let want = if table { QuantFormat::Q8_0 } else { self };
        want.chain().iter().copied().find(|f| k > 0 && k.is_multiple_of(f.block_values()))
    }
}

/// A weight matrix of `n` rows of `k` values, quantized row by row: row j is the bytes
/// [j·row_bytes, (j+1)·row_bytes), k / block_values blocks in the GGUF layout of its format.
pub struct QMatrix {
    pub format: QuantFormat,
    pub n: usize,
    pub k: usize,
    data: Vec<u8>,
}

/// Rows quantized at once while loading (bounds the f32 copy the quantizer makes).
const QUANTIZE_ROWS_BYTES: usize = 16 << 20;

impl QMatrix {
    /// Quantize a 2-D matrix (any float dtype, CPU) with candle's quantizer, a chunk of rows at a time.
    pub fn quantize(w: &Tensor, format: QuantFormat) -> Result<QMatrix> {
        let (n, k) = w.dims2()?;
        if k == 0 || !k.is_multiple_of(format.block_values()) {
            return Err(Error::Internal(format!(
                "quantize: rows of {k} values do not split into {} blocks",
                format.name()
            )));
        }
        let row_bytes = format.row_bytes(k);
        let mut data = Vec::new();
        data.try_reserve_exact(n * row_bytes).map_err(|_| {
            Error::load(format!("cannot allocate {} bytes for a {n}x{k} {} matrix", n * row_bytes, format.name()))
        })?;
        let chunk = (QUANTIZE_ROWS_BYTES / (4 * k)).max(1);
        for r0 in (0..n).step_by(chunk) {
            let rows = chunk.min(n - r0);
            // candle's quantizer reads the source's storage from its start, ignoring a view's offset: hand it an
            // f32 tensor of its own (a float32 chunk, or a slice such as one expert of a stacked tensor, is a
            // view into a larger storage, and neither to_dtype to its own dtype nor copy() drops the offset)
            let part = w.narrow(0, r0, rows)?.flatten_all()?.to_dtype(DType::F32)?.to_vec1::<f32>()?;
            let part = Tensor::from_vec(part, (rows, k), &Device::Cpu)?;
            let q = QTensor::quantize(&part, format.ggml())?;
            let bytes = q.data()?;
            if bytes.len() != rows * row_bytes {
                return Err(Error::Internal(format!(
                    "quantize: candle gave {} bytes for {rows} rows of {k} in {}, expected {}",
                    bytes.len(),
                    format.name(),
                    rows * row_bytes
                )));
            }
            data.extend_from_slice(&bytes);
        }
        Ok(QMatrix { format, n, k, data })
    }

    /// Matrices of one format and depth stacked (their rows one after another), as built (their scales were
    /// checked when each was); None when the parts differ in format or depth.
    pub fn stack(parts: &[&QMatrix]) -> Result<Option<QMatrix>> {
        let Some(first) = parts.first() else { return Ok(None) };
        if parts.iter().any(|p| p.k != first.k || p.format != first.format) {
            return Ok(None);
        }
        let n = parts.iter().map(|p| p.n).sum();
        let mut data = Vec::new();
        data.try_reserve_exact(parts.iter().map(|p| p.data.len()).sum()).map_err(|_| {
            Error::load(format!("cannot allocate a stacked {n}x{} {} matrix", first.k, first.format.name()))
        })?;
        for p in parts {
            data.extend_from_slice(&p.data);
        }
        Ok(Some(QMatrix { format: first.format, n, k: first.k, data }))
    }

    /// Build from GGUF block bytes (n rows of k values in `format`). Refuses blocks whose f16 scale (or q4_k's
    /// min scale) is NaN or infinite: such a matrix would only ever give NaN logits (q6_k's 8-bit sub-scales
    /// times a finite d stay finite).
    pub fn from_bytes(format: QuantFormat, n: usize, k: usize, data: Vec<u8>) -> Result<QMatrix> {
        if k == 0 || !k.is_multiple_of(format.block_values()) || data.len() != n * format.row_bytes(k) {
            return Err(Error::invalid(format!(
                "{} bytes are not {n} rows of {k} values in {} blocks",
                data.len(),
                format.name()
            )));
        }
        let q = QMatrix { format, n, k, data };
        if let Some((b, row)) = q.first_non_finite_scale() {
            return Err(Error::load(format!(
                "block {b} (row {row}) has a non-finite scale; refused (it would give NaN logits)"
            )));
        }
        Ok(q)
    }

    /// The first block whose f16 scale (or min scale) is NaN or infinite, as (block, row): blocks read from a
    /// file, or values too large for the format's scale when quantized (q8_0's d = max|w| / 127 overflows f16 above
    /// about 8.3e6).
    pub fn first_non_finite_scale(&self) -> Option<(usize, usize)> {
        let scales = self.format.scale_offsets();
        self.data.chunks_exact(self.format.block_bytes()).enumerate().find_map(|(b, block)| {
            let bad = scales.iter().any(|&o| !f16::from_le_bytes([block[o], block[o + 1]]).is_finite());
            bad.then(|| (b, b * self.format.block_values() / self.k))
        })
    }

    pub fn bytes(&self) -> &[u8] {
        &self.data
    }

    pub(crate) fn row_bytes(&self) -> usize {
        self.format.row_bytes(self.k)
    }

    /// Dequantize rows [j0, j0 + count) into `out` (count·k values, row-major), exactly as candle's (and
    /// ggml's) dequantization: q8_0 `q·d`; q4_k `(d·sc)·q − dmin·m` per sub-block of 32; q5_0 `(q − 16)·d` with
    /// q's fifth bit from `qh` (value j of the block: bit j, its low nibble in byte j % 16, high half for j ≥ 16);
    /// q5_k as q4_k with q's fifth bit (value 32·j + l of sub-block j: bit j of qh byte l); q6_k `(d·sc)·(q − 32)`
    /// per sub-block of 16 (see `q6k_value`); q4_0 `(q − 8)·d` (low nibbles the first 16 values, high the
    /// rest); q3_k `(d·(sc − 32))·q` per sub-block of 16 (`q3k_value`, `q3k_scales`); q2_k `(d·sc)·q − dmin·m`
    /// per sub-block of 16 (`q2k_value`, 4-bit sc and m).
    #[inline(always)]
    pub fn dequantize_rows(&self, j0: usize, count: usize, out: &mut [f32]) {
        let rb = self.row_bytes();
        let src = &self.data[j0 * rb..(j0 + count) * rb];
        let out = &mut out[..count * self.k];
        match self.format {
            QuantFormat::Q8_0 => {
                for (b, y) in src.chunks_exact(34).zip(out.chunks_exact_mut(32)) {
                    let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
                        *y = (q as i8) as f32 * d;
                    }
                }
            }
            QuantFormat::Q4K => {
                for (b, y) in src.chunks_exact(144).zip(out.chunks_exact_mut(256)) {
                    let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                    let dmin = f16::from_le_bytes([b[2], b[3]]).to_f32();
                    let scales = &b[4..16];
                    let qs = &b[16..144];
                    for g in 0..4 {
                        let q = &qs[32 * g..32 * g + 32];
                        let (sc1, m1) = scale_min_k4(2 * g, scales);
                        let (sc2, m2) = scale_min_k4(2 * g + 1, scales);
                        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
                        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
                        let (lo, hi) = y[64 * g..64 * g + 64].split_at_mut(32);
                        for ((yl, yh), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(q) {
                            *yl = d1 * (q & 0xF) as f32 - m1;
                            *yh = d2 * (q >> 4) as f32 - m2;
                        }
                    }
                }
            }
            QuantFormat::Q5_0 => {
                for (b, y) in src.chunks_exact(22).zip(out.chunks_exact_mut(32)) {
                    let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
                    let (lo, hi) = y.split_at_mut(16);
                    for (j, (&q, (yl, yh))) in b[6..22].iter().zip(lo.iter_mut().zip(hi.iter_mut())).enumerate() {
                        let h0 = ((qh >> j) << 4) & 0x10;
                        let h1 = (qh >> (j + 12)) & 0x10;
                        *yl = (((q & 0xF) as u32 | h0) as i32 - 16) as f32 * d;
                        *yh = (((q >> 4) as u32 | h1) as i32 - 16) as f32 * d;
                    }
                }
            }
            QuantFormat::Q5K => {
                for (b, y) in src.chunks_exact(176).zip(out.chunks_exact_mut(256)) {
                    let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                    let dmin = f16::from_le_bytes([b[2], b[3]]).to_f32();
                    let (scales, qh, qs) = (&b[4..16], &b[16..48], &b[48..176]);
                    for (j, y) in y.chunks_exact_mut(32).enumerate() {
                        let (sc, m) = scale_min_k4(j, scales);
                        let (d1, m1) = (d * sc as f32, dmin * m as f32);
                        for (l, y) in y.iter_mut().enumerate() {
                            *y = d1 * q5k_value(qs, qh, j, l) as f32 - m1;
                        }
                    }
                }
            }
            QuantFormat::Q6K => {
                for (b, y) in src.chunks_exact(210).zip(out.chunks_exact_mut(256)) {
                    let d = f16::from_le_bytes([b[208], b[209]]).to_f32();
                    for (v, y) in y.iter_mut().enumerate() {
                        *y = (d * (b[192 + v / 16] as i8) as f32) * q6k_value(b, v) as f32;
                    }
                }
            }
            QuantFormat::Q4_0 => {
                for (b, y) in src.chunks_exact(18).zip(out.chunks_exact_mut(32)) {
                    let d = f16::from_le_bytes([b[0], b[1]]).to_f32();
                    let (lo, hi) = y.split_at_mut(16);
                    for (&q, (yl, yh)) in b[2..18].iter().zip(lo.iter_mut().zip(hi.iter_mut())) {
                        *yl = ((q & 0xF) as i32 - 8) as f32 * d;
                        *yh = ((q >> 4) as i32 - 8) as f32 * d;
                    }
                }
            }
            QuantFormat::Q3K => {
                for (b, y) in src.chunks_exact(110).zip(out.chunks_exact_mut(256)) {
                    let d = f16::from_le_bytes([b[108], b[109]]).to_f32();
                    let sc = q3k_scales(b);
                    for (v, y) in y.iter_mut().enumerate() {
                        *y = (d * sc[v / 16] as f32) * q3k_value(b, v) as f32;
                    }
                }
            }
            QuantFormat::Q2K => {
                for (b, y) in src.chunks_exact(84).zip(out.chunks_exact_mut(256)) {
                    let d = f16::from_le_bytes([b[80], b[81]]).to_f32();
                    let dmin = f16::from_le_bytes([b[82], b[83]]).to_f32();
                    for (v, y) in y.iter_mut().enumerate() {
                        let s = b[v / 16]; // sub-block v / 16's scale (low nibble) and min (high)
                        *y = (d * (s & 0xF) as f32) * q2k_value(b, v) as f32 - dmin * (s >> 4) as f32;
                    }
                }
            }
        }
    }

    /// Rows `ids` dequantized, (ids.len(), k) f32 (an embedding lookup).
    pub fn rows(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let mut out = vec![0f32; ids.len() * self.k];
        for (i, &id) in ids.iter().enumerate() {
            let id = id as usize;
            if id >= self.n {
                return Err(Error::Internal(format!("row {id} of a {}-row quantized matrix", self.n)));
            }
            self.dequantize_rows(id, 1, &mut out[i * self.k..(i + 1) * self.k]);
        }
        Ok(out)
    }
}

/// Value l of sub-block j (0-7) of a q5_k super-block, 0-31: the low nibble (even j) or high nibble (odd j) of
/// byte 32·(j / 2) + l of `qs`, and bit j of byte l of `qh` as its fifth bit.
#[inline(always)]
pub(crate) fn q5k_value(qs: &[u8], qh: &[u8], j: usize, l: usize) -> u8 {
    let q = qs[32 * (j / 2) + l];
    let nib = if j.is_multiple_of(2) { q & 0xF } else { q >> 4 };
    nib | (((qh[l] >> j) & 1) << 4)
}

/// Value p (0-31) of a q4_0 block, 0..15: the low nibble of byte p of its 16 bytes of nibbles (after the f16 d)
/// for p < 16, the high one of byte p − 16 after.
#[inline(always)]
pub(crate) fn q4_0_value(block: &[u8], p: usize) -> u8 {
    let qs = &block[2..18];
    if p < 16 {
        qs[p] & 0xF
    } else {
        qs[p - 16] >> 4
    }
}

/// Value p (0-31) of a q5_0 block, 0..31: q4_0's nibble (from byte 6: after d and 4 bytes of fifth bits) with bit p
/// of the fifth bits as its bit 4.
#[inline(always)]
pub(crate) fn q5_0_value(block: &[u8], p: usize) -> u8 {
    let qh = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
    q4_0_value(&block[4..], p) | ((((qh >> p) & 1) as u8) << 4)
}

/// Value v (0-255) of a q4_k super-block, 0..15: sub-block j = v / 32 takes the low (even j) or high (odd j) nibble
/// of byte 32·(j / 2) + v % 32 of its 128 bytes of nibbles (after d, dmin and 12 bytes of scales).
#[inline(always)]
pub(crate) fn q4k_value(block: &[u8], v: usize) -> u8 {
    let byte = block[16 + 32 * (v / 64) + v % 32];
    if (v / 32).is_multiple_of(2) {
        byte & 0xF
    } else {
        byte >> 4
    }
}

/// Value v (0-255) of a q6_k super-block, q − 32 in [−32, 31]. The block holds 128 bytes of low nibbles
/// (`ql`), 64 bytes of 2-bit high pairs (`qh`), 16 signed sub-scales, then d. Each half of 128 values uses 64
/// bytes of `ql` and 32 of `qh`; its quarter g (32 values, l = 0..31) takes byte l of `ql` (g = 0, 2) or byte
/// 32 + l (g = 1, 3), the low nibble for g < 2 and the high one after, and bits 2g, 2g + 1 of `qh` byte l.
#[inline(always)]
pub(crate) fn q6k_value(b: &[u8], v: usize) -> i8 {
    let (half, g, l) = (v / 128, v % 128 / 32, v % 32);
    let ql = b[64 * half + 32 * (g % 2) + l];
    let nib = if g < 2 { ql & 0xF } else { ql >> 4 };
    let hi = (b[128 + 32 * half + l] >> (2 * g)) & 3;
    (nib | (hi << 4)) as i8 - 32
}

/// Value v (0-255) of a q3_k super-block, in [−4, 3]. The block holds 32 bytes of high bits (`hmask`), 64 of
/// 2-bit pairs (`qs`), 12 of packed scales, then d. Each half of 128 values uses 32 bytes of `qs`; its quarter g
/// (32 values, l = 0..31) takes bits 2g, 2g + 1 of `qs` byte 32·half + l, and bit 4·half + g of `hmask` byte l
/// (set: the value as is; clear: minus 4).
#[inline(always)]
pub(crate) fn q3k_value(b: &[u8], v: usize) -> i8 {
    let (half, g, l) = (v / 128, v % 128 / 32, v % 32);
    let q = ((b[32 + 32 * half + l] >> (2 * g)) & 3) as i8;
    let high = (b[l] >> (4 * half + g)) & 1;
    q - if high == 0 { 4 } else { 0 }
}

/// The 16 scales of a q3_k super-block, sc − 32 (6 bits each, signed after the shift): bytes 96-107 hold the low
/// nibbles of scales 0-7 (bytes 96-103: scale j's in the low nibble of byte j, scale 8 + j's in its high nibble)
/// and, in bytes 104-107, two high bits of each (scale 4·t + i: bits 2t, 2t + 1 of byte 104 + i).
#[inline(always)]
pub(crate) fn q3k_scales(b: &[u8]) -> [i8; 16] {
    let s = &b[96..108];
    std::array::from_fn(|j| {
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        (low | (high << 4)) as i8 - 32
    })
}

/// Value v (0-255) of a q2_k super-block, 0-3: each half of 128 values uses 32 bytes of `qs` (at byte 16); its
/// quarter g (32 values, l = 0..31) takes bits 2g, 2g + 1 of byte 32·half + l.
#[inline(always)]
pub(crate) fn q2k_value(b: &[u8], v: usize) -> u8 {
    let (half, g, l) = (v / 128, v % 128 / 32, v % 32);
    (b[16 + 32 * half + l] >> (2 * g)) & 3
}

/// The 6-bit scale and min of sub-block j of a q4_k super-block (GGUF's packing of 8 pairs into 12 bytes).
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        ((q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4), (q[j + 4] >> 4) | ((q[j] >> 6) << 4))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn randn(n: usize, k: usize, seed: u64) -> Tensor {
        let dev = Device::Cpu;
        let v: Vec<f32> = std::iter::repeat_with(crate::util::uniform(seed)).take(n * k).collect();
        Tensor::from_vec(v, (n, k), &dev).unwrap()
    }

    #[test]
    fn dequantization_equals_candles_and_stays_close_to_the_weights() {
        for (format, k, tol) in [
            (QuantFormat::Q8_0, 96, 0.005),
            (QuantFormat::Q4K, 512, 0.06),
            (QuantFormat::Q5_0, 96, 0.035),
            (QuantFormat::Q5K, 512, 0.035),
            (QuantFormat::Q6K, 512, 0.02),
            (QuantFormat::Q4_0, 96, 0.07),
            (QuantFormat::Q3K, 512, 0.2),
            (QuantFormat::Q2K, 512, 0.35),
        ] {
            let w = randn(37, k, 3);
            // several quantize chunks: force a small chunk through a tall matrix too
            let q = QMatrix::quantize(&w, format).unwrap();
            assert_eq!(q.bytes().len(), 37 * k / format.block_values() * format.block_bytes());
            let mut ours = vec![0f32; 37 * k];
            q.dequantize_rows(0, 37, &mut ours);
            let theirs = QTensor::quantize(&w, format.ggml()).unwrap().dequantize(&Device::Cpu).unwrap();
            let theirs: Vec<f32> = theirs.flatten_all().unwrap().to_vec1().unwrap();
            assert_eq!(ours, theirs, "{format:?}: our dequantization must be candle's, bit for bit");
            let w: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
            let err = w.iter().zip(&ours).map(|(a, b)| (a - b).abs()).fold(0f32, f32::max);
            assert!(err < tol, "{format:?}: max error {err}");
            // rows() = the matching slices; from_bytes round-trips
            let r = q.rows(&[5, 0, 36]).unwrap();
            assert_eq!(&r[..k], &ours[5 * k..6 * k]);
            assert_eq!(&r[2 * k..], &ours[36 * k..]);
            let again = QMatrix::from_bytes(format, 37, k, q.bytes().to_vec()).unwrap();
            assert_eq!(again.bytes(), q.bytes());
            assert!(QMatrix::from_bytes(format, 36, k, q.bytes().to_vec()).is_err());
        }
    }

    #[test]
    fn quantizing_in_chunks_equals_quantizing_whole() {
        // bf16 and f32 sources, and a view into a larger tensor (rows 3.. of it: a storage offset), quantized in
        // chunks, give candle's quantization of the same values as one fresh tensor
        let k = 8192; // QUANTIZE_ROWS_BYTES / (4k) = 512 rows per chunk: 1100 rows are 3 chunks
        let f = randn(1103, k, 9);
        for w in [f.to_dtype(DType::BF16).unwrap(), f.clone(), f.narrow(0, 3, 1100).unwrap()] {
            let q = QMatrix::quantize(&w, QuantFormat::Q8_0).unwrap();
            let fresh = Tensor::from_vec(
                w.flatten_all().unwrap().to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap(),
                w.dims(),
                &Device::Cpu,
            )
            .unwrap();
            let whole = QTensor::quantize(&fresh, GgmlDType::Q8_0).unwrap();
            assert!(q.bytes() == &whole.data().unwrap()[..], "{:?} {:?}", w.dtype(), w.dims());
        }
    }

    #[test]
    fn formats_fall_back_by_row_length() {
        assert_eq!(QuantFormat::Q4K.for_matrix(4864, false), Some(QuantFormat::Q4K));
        assert_eq!(QuantFormat::Q4K.for_matrix(896, false), Some(QuantFormat::Q5_0));
        assert_eq!(QuantFormat::Q5_0.for_matrix(896, false), Some(QuantFormat::Q5_0));
        assert_eq!(QuantFormat::Q5_0.for_matrix(896, true), Some(QuantFormat::Q8_0));
        assert_eq!(QuantFormat::Q4K.for_matrix(4864, true), Some(QuantFormat::Q8_0));
        assert_eq!(QuantFormat::Q8_0.for_matrix(40, false), None);
        assert_eq!(QuantFormat::parse("q4_k").unwrap(), QuantFormat::Q4K);
        let e = QuantFormat::parse("int4").unwrap_err().to_string();
        assert_eq!(QuantFormat::Q6K.for_matrix(512, false), Some(QuantFormat::Q6K));
        assert_eq!(QuantFormat::Q6K.for_matrix(896, false), Some(QuantFormat::Q8_0));
        assert_eq!(QuantFormat::Q5K.for_matrix(512, false), Some(QuantFormat::Q5K));
        assert_eq!(QuantFormat::Q5K.for_matrix(896, false), Some(QuantFormat::Q8_0));
        assert_eq!(QuantFormat::Q3K.for_matrix(896, false), Some(QuantFormat::Q4_0));
        assert_eq!(QuantFormat::Q2K.for_matrix(768, false), Some(QuantFormat::Q2K));
        assert_eq!(QuantFormat::Q4_0.for_matrix(896, true), Some(QuantFormat::Q8_0));
        assert_eq!(e, "quantize must be 'q8_0', 'q4_k', 'q5_0', 'q5_k', 'q6_k', 'q4_0', 'q3_k' or 'q2_k', got 'int4'");
    }
}
