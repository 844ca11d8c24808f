//! Many-row products y = x · Wᵀ on the CPU (a prefill chunk, a long window).
//!
//! On x86-64 with AVX2 and FMA: `packed`, a BLIS-style product with a 6 × 16 register tile (6 × 64 with AVX-512)
//! that packs x once and each task's weight rows a block at a time, widening bf16 or dequantizing as it packs (or
//! reads a matrix packed at load, `PackedMatrix`, as it is). Every y element is the in-order f32 fused-multiply-add
//! chain over k, so a row's bits do not depend on m, the tiling, the threads or the instruction set.
//!
//! Elsewhere: W is taken in panels of weight rows (about `PANEL_VALUES` values); each panel is widened (bf16) or
//! dequantized (quantized) into a reused f32 scratch, in parallel, then the gemm crate (the one candle's CPU matmul
//! calls, with its own parallel split) multiplies every x row by it, writing the panel's columns of y. An f32 matrix
//! is one panel, as in candle. There a row's result depends on x's row, W and m (through gemm's blocking).
//!
//! Why not candle's matmul: on a bf16 matrix it needs an f32 copy of the whole matrix per call (on the 0.5B shape
//! 2 GB of fresh pages per forward, the head alone 545 MB), and a quantized matrix has no many-row path there.
//! (Panels as single-threaded parallel tasks were tried first: slower than gemm's own split, which packs x once.)
//!
//! The engine sends a long window here alone, never stacked with other sequences' rows (`models::qwen::Groups`).

use crate::kernels::blocks::{QMatrix, QuantFormat};
use crate::kernels::cpu::Cpu;
use crate::kernels::records::*;
use crate::kernels::unpack::dequantize_rows;
use half::bf16;
use rayon::prelude::*;

/// A weight matrix (n × k) as the panels read it: row-major f32 or bf16, quantized, or packed at load.
#[derive(Clone, Copy)]
pub enum Source<'a> {
    F32(&'a [f32]),
    Bf16(&'a [bf16]),
    Quant(&'a QMatrix),
    Packed(&'a PackedMatrix),
}

/// Where column c's 4-bit value sits among a depth's 16 nibbles (of its 8 bytes read as a little-endian u64):
/// columns 2i and 2i + 1 are nibble i of the low and of the high 32-bit half, so that one 64-bit broadcast and a
/// shift per 32-bit lane bring column j's nibble to the bottom of lane j.
fn nibble(c: usize) -> usize {
    (c & 1) * 8 + (c >> 1)
}

/// Column c's nibble among a depth's 8 bytes.
fn get_nibble(bytes: &[u8], c: usize) -> u8 {
    let i = nibble(c);
    (bytes[i / 2] >> (4 * (i % 2))) & 0xF
}

fn put_nibble(bytes: &mut [u8], c: usize, q: u8) {
    let i = nibble(c);
    bytes[i / 2] |= (q & 0xF) << (4 * (i % 2));
}

/// A weight matrix (n × k: f32, bf16, or a block format, each with its `Layout`) packed once at load for the packed
/// product: its rows (output columns) in groups of `GROUP`, each group k-major (depth p of group g: `GROUP` values
/// at (g · k + p) · `GROUP`), n padded with zero rows to a whole group. The product then reads W as it streams,
/// with no packing per call, for every window: a one-row decode window, a few-row window and a prefill alike, so
/// that every output element is the same in-order f32 fused-multiply-add chain over k whatever the window (see
/// `packed`). Only CPUs with the packed product (x86-64 with AVX2 and FMA) hold matrices this way.
///
/// bf16 is kept as bf16 (half the bytes) and widened in registers: within a depth's 16 values, slot 2i holds
/// column i and slot 2i + 1 column 8 + i, so that one 32-byte load widens to columns 0-7 (each 32-bit lane's low
/// half shifted up) and 8-15 (its high half masked) in two integer instructions. A block format keeps its bits
/// per value and its scales (`Layout`: the values of a group depth by depth, the scales in records per block); a
/// tile forms each value in registers exactly as the format's dequantization does (`QMatrix::dequantize_rows`), so
/// a quantized matrix computes exactly as its dequantized f32 matrix packed.
pub struct PackedMatrix {
    pub n: usize,
    pub k: usize,
    data: PackedData,
}

enum PackedData {
    F32(Vec<f32>),
    /// bf16 bit patterns in the slot order above
    Bf16(Vec<u16>),
    /// A block format: its values (`Layout::step` bytes per depth of a group, group g's from g · k · step) and
    /// its scale records (group g's from g · k / sblock · sbytes).
    Block {
        format: QuantFormat,
        w: Vec<u8>,
        s: Vec<u8>,
    },
}

impl PackedMatrix {
    /// Whether this CPU multiplies packed matrices (otherwise they are never made).
    pub fn available() -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            Cpu::get().avx2()
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    }

    /// A contiguous 2-D f32 or bf16 CPU tensor, packed; None where packed matrices are not available or the tensor
    /// is not of that kind.
    pub fn from_tensor(t: &candle_core::Tensor) -> candle_core::Result<Option<PackedMatrix>> {
        use candle_core::{CpuStorage, Device, Storage};
        if !Self::available() || !matches!(t.device(), Device::Cpu) || t.rank() != 2 {
            return Ok(None);
        }
        let (n, k) = t.dims2()?;
        let (storage, layout) = t.storage_and_layout();
        let (Storage::Cpu(s), Some((o0, o1))) = (&*storage, layout.contiguous_offsets()) else { return Ok(None) };
        Ok(Some(match s {
            CpuStorage::F32(w) => Self::pack(&w[o0..o1], n, k, |v: &f32| *v, PackedData::F32)?,
            CpuStorage::BF16(w) => Self::pack(&w[o0..o1], n, k, |v: &bf16| v.to_bits(), PackedData::Bf16)?,
            _ => return Ok(None),
        }))
    }

    /// A quantized matrix, packed (the same values, in groups of `GROUP` columns); None where packed matrices are not
    /// available; an error when the copy cannot be allocated.
    pub fn from_quant(m: &QMatrix) -> candle_core::Result<Option<PackedMatrix>> {
        if !Self::available() {
            return Ok(None);
        }
        let l = layout(m.format);
        let (n, k, format) = (m.n, m.k, m.format);
        let (rb, bb, bv) = (m.row_bytes(), format.block_bytes(), format.block_values());
        // bytes per group
        let (gw, gs) = (k * l.step, k / l.sblock * l.sbytes);
        let groups = n.div_ceil(GROUP);
        let (mut w, mut s) = (Vec::new(), Vec::new());
        if w.try_reserve_exact(groups * gw).is_err() || s.try_reserve_exact(groups * gs).is_err() {
            candle_core::bail!("cannot allocate the packed copy of a {n}x{k} {} matrix", format.name());
        }
        w.resize(groups * gw, 0u8);
        s.resize(groups * gs, 0u8);
        let bytes = m.bytes();
        w.par_chunks_mut(gw.max(1)).zip(s.par_chunks_mut(gs.max(1))).enumerate().for_each(|(g, (w, s))| {
            for c in 0..GROUP.min(n - g * GROUP) {
                let row = &bytes[(g * GROUP + c) * rb..(g * GROUP + c + 1) * rb];
                for (b, block) in row.chunks_exact(bb).enumerate() {
                    let w = &mut w[b * bv * l.step..(b + 1) * bv * l.step];
                    pack_block(format, block, c, w, &mut s[b * l.sbytes..(b + 1) * l.sbytes]);
                }
            }
        });
        Ok(Some(PackedMatrix { n, k, data: PackedData::Block { format, w, s } }))
    }

    /// Pack row-major W (n × k) in parallel, a group per task (an error, not an abort, when the copy cannot be
    /// allocated).
    fn pack<E: Sync, T: Copy + Default + Send>(
        w: &[E],
        n: usize,
        k: usize,
        f: impl Fn(&E) -> T + Sync,
        wrap: fn(Vec<T>) -> PackedData,
    ) -> candle_core::Result<PackedMatrix> {
        assert_eq!(w.len(), n * k);
        let groups = n.div_ceil(GROUP);
        let mut data = Vec::new();
        if data.try_reserve_exact(groups * GROUP * k).is_err() {
            candle_core::bail!("cannot allocate the packed copy of a {n}x{k} matrix");
        }
        data.resize(groups * GROUP * k, T::default());
        let bf16 = std::mem::size_of::<T>() == 2;
        if k > 0 {
            data.par_chunks_mut(GROUP * k).enumerate().for_each(|(g, dst)| {
                // the group's rows read side by side, its values written in order
                let rows: Vec<(usize, &[E])> = (0..GROUP.min(n - g * GROUP))
                    .map(|c| (slot(c, bf16), &w[(g * GROUP + c) * k..(g * GROUP + c + 1) * k]))
                    .collect();
                for (p, out) in dst.chunks_exact_mut(GROUP).enumerate() {
                    for &(s, row) in &rows {
                        out[s] = f(&row[p]);
                    }
                }
            });
        }
        Ok(PackedMatrix { n, k, data: wrap(data) })
    }

    /// The dtype the values are held in (None: a block format).
    pub fn dtype(&self) -> Option<candle_core::DType> {
        match self.data {
            PackedData::F32(_) => Some(candle_core::DType::F32),
            PackedData::Bf16(_) => Some(candle_core::DType::BF16),
            PackedData::Block { .. } => None,
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        match &self.data {
            PackedData::F32(d) => d.len() * 4,
            PackedData::Bf16(d) => d.len() * 2,
            PackedData::Block { w, s, .. } => w.len() + s.len(),
        }
    }

    /// Rows [first, first + count) of W (exact, f32) into `dst` (count × k).
    pub fn rows_into(&self, first: usize, count: usize, dst: &mut [f32]) {
        let k = self.k;
        assert!(first + count <= self.n && dst.len() == count * k);
        for (i, out) in dst.chunks_mut(k.max(1)).enumerate() {
            let (g, c) = ((first + i) / GROUP, (first + i) % GROUP);
            let base = g * GROUP * k;
            match &self.data {
                PackedData::F32(d) => {
                    for (p, o) in out.iter_mut().enumerate() {
                        *o = d[base + p * GROUP + c];
                    }
                }
                PackedData::Bf16(d) => {
                    let s = slot(c, true);
                    for (p, o) in out.iter_mut().enumerate() {
                        *o = f32::from_bits((d[base + p * GROUP + s] as u32) << 16);
                    }
                }
                PackedData::Block { format, w, s } => {
                    let l = layout(*format);
                    let (w, s) = (&w[g * k * l.step..], &s[g * (k / l.sblock) * l.sbytes..]);
                    for (p, o) in out.iter_mut().enumerate() {
                        *o = block_value(*format, w, s, c, p);
                    }
                }
            }
        }
    }

    /// Matrices of the same width and element stacked (their rows one after another), when every one but the last
    /// has whole groups; None otherwise; an error when the stacked copy cannot be allocated.
    pub fn stack(parts: &[&PackedMatrix]) -> candle_core::Result<Option<PackedMatrix>> {
        let Some(first) = parts.first() else { return Ok(None) };
        let whole = parts[..parts.len() - 1].iter().all(|p| p.n.is_multiple_of(GROUP));
        let alike = |p: &&PackedMatrix| match (&p.data, &first.data) {
            (PackedData::Block { format: a, .. }, PackedData::Block { format: b, .. }) => a == b,
            (a, b) => std::mem::discriminant(a) == std::mem::discriminant(b),
        };
        if !whole || parts.iter().any(|p| p.k != first.k || !alike(p)) {
            return Ok(None);
        }
        fn cat<T: Copy>(parts: &[&PackedMatrix], get: fn(&PackedData) -> &[T]) -> candle_core::Result<Vec<T>> {
            let len = parts.iter().map(|p| get(&p.data).len()).sum();
            let mut out = Vec::new();
            if out.try_reserve_exact(len).is_err() {
                candle_core::bail!("cannot allocate a stacked packed matrix of {len} values");
            }
            for p in parts {
                out.extend_from_slice(get(&p.data));
            }
            Ok(out)
        }
        let data = match first.data {
            PackedData::F32(_) => PackedData::F32(cat(parts, PackedData::f32s)?),
            PackedData::Bf16(_) => PackedData::Bf16(cat(parts, PackedData::bf16s)?),
            PackedData::Block { format, .. } => {
                PackedData::Block { format, w: cat(parts, |d| d.block().0)?, s: cat(parts, |d| d.block().1)? }
            }
        };
        Ok(Some(PackedMatrix { n: parts.iter().map(|p| p.n).sum(), k: first.k, data }))
    }
}

impl PackedData {
    /// The values if held as f32 (else none).
    fn f32s(&self) -> &[f32] {
        if let PackedData::F32(d) = self {
            d
        } else {
            &[]
        }
    }
    /// The bf16 bit patterns if held as bf16 (else none).
    fn bf16s(&self) -> &[u16] {
        if let PackedData::Bf16(d) = self {
            d
        } else {
            &[]
        }
    }
    /// A block format's values and scale records (else none).
    fn block(&self) -> (&[u8], &[u8]) {
        if let PackedData::Block { w, s, .. } = self {
            (w, s)
        } else {
            (&[], &[])
        }
    }
}

/// Column c's values of one block of a row (`block`: its bytes) into the block's depths of a packed group (`w`,
/// `Layout::step` bytes per depth) and its scale record (`s`, `pack_record`).
fn pack_block(format: QuantFormat, block: &[u8], c: usize, w: &mut [u8], s: &mut [u8]) {
    pack_record(format, block, c, s);
    match format {
        QuantFormat::Q8_0 => {
            for (i, &q) in block[2..].iter().enumerate() {
                w[i * Q8_0_LAYOUT.step + c] = q;
            }
        }
        QuantFormat::Q5_0 => {
            let step = Q5_0_LAYOUT.step;
            for j in 0..32 {
                let q = crate::kernels::blocks::q5_0_value(block, j);
                let depth = &mut w[j * step..(j + 1) * step];
                depth[c / 8] |= (q >> 4) << (c % 8);
                put_nibble(&mut depth[Q5_NIBBLES..], c, q);
            }
        }
        QuantFormat::Q4_0 => {
            for j in 0..32 {
                let q = crate::kernels::blocks::q4_0_value(block, j);
                put_nibble(&mut w[j * Q4_0_LAYOUT.step..(j + 1) * Q4_0_LAYOUT.step], c, q);
            }
        }
        QuantFormat::Q4K | QuantFormat::Q5K => {
            let l = layout(format);
            for v in 0..256 {
                let depth = &mut w[v * l.step..(v + 1) * l.step];
                if format == QuantFormat::Q5K {
                    let q = crate::kernels::blocks::q5k_value(&block[48..176], &block[16..48], v / 32, v % 32);
                    depth[c / 8] |= (q >> 4) << (c % 8);
                    put_nibble(&mut depth[Q5_NIBBLES..], c, q);
                } else {
                    put_nibble(depth, c, crate::kernels::blocks::q4k_value(block, v));
                }
            }
        }
        QuantFormat::Q6K => {
            for v in 0..256 {
                let q = (crate::kernels::blocks::q6k_value(block, v) + 32) as u8;
                let depth = &mut w[v * Q6K_LAYOUT.step..(v + 1) * Q6K_LAYOUT.step];
                put_nibble(depth, c, q);
                depth[Q6K_HIGH + c / 4] |= (q >> 4) << (2 * (c % 4));
            }
        }
        QuantFormat::Q3K => {
            for v in 0..256 {
                let u = (crate::kernels::blocks::q3k_value(block, v) + 4) as u8; // 0..7: the pair, and the high bit
                let depth = &mut w[v * Q3K_LAYOUT.step..(v + 1) * Q3K_LAYOUT.step];
                depth[c / 8] |= (u >> 2) << (c % 8);
                depth[Q3K_PAIRS + c / 4] |= (u & 3) << (2 * (c % 4));
            }
        }
        QuantFormat::Q2K => {
            for v in 0..256 {
                w[v * Q2K_LAYOUT.step + c / 4] |= crate::kernels::blocks::q2k_value(block, v) << (2 * (c % 4));
            }
        }
    }
}

/// Column c's value at depth p of a packed group in a block format (`w`: the group's values, `s`: its scale
/// records), exactly as the format's dequantization forms it.
fn block_value(format: QuantFormat, w: &[u8], s: &[u8], c: usize, p: usize) -> f32 {
    let f16 = |b: &[u8], i: usize| half::f16::from_le_bytes([b[i], b[i + 1]]).to_f32();
    match format {
        QuantFormat::Q8_0 => {
            let l = Q8_0_LAYOUT;
            (w[p * l.step + c] as i8) as f32 * f16(s, p / l.sblock * l.sbytes + 2 * c)
        }
        QuantFormat::Q5_0 => {
            let l = Q5_0_LAYOUT;
            let depth = &w[p * l.step..(p + 1) * l.step];
            let q = get_nibble(&depth[Q5_NIBBLES..], c) | (((depth[c / 8] >> (c % 8)) & 1) << 4);
            (q as i32 - 16) as f32 * f16(s, p / l.sblock * l.sbytes + 2 * c)
        }
        QuantFormat::Q4_0 => {
            let l = Q4_0_LAYOUT;
            (get_nibble(&w[p * l.step..(p + 1) * l.step], c) as i32 - 8) as f32
                * f16(s, p / l.sblock * l.sbytes + 2 * c)
        }
        QuantFormat::Q4K | QuantFormat::Q5K => {
            let l = layout(format);
            let r = &s[p / l.sblock * l.sbytes..];
            let j = p % l.sblock / 32;
            let (d1, m1) = (
                f16(r, 2 * c) * r[Q4K_SCALES + GROUP * j + c] as f32,
                f16(r, Q4K_DMIN + 2 * c) * r[Q4K_MINS + GROUP * j + c] as f32,
            );
            let depth = &w[p * l.step..(p + 1) * l.step];
            let q = match format {
                QuantFormat::Q5K => get_nibble(&depth[Q5_NIBBLES..], c) | (((depth[c / 8] >> (c % 8)) & 1) << 4),
                _ => get_nibble(depth, c),
            };
            d1 * q as f32 - m1
        }
        QuantFormat::Q6K => {
            let l = Q6K_LAYOUT;
            let r = &s[p / l.sblock * l.sbytes..];
            let d1 = f16(r, 2 * c) * (r[Q6K_SCALES + GROUP * (p % l.sblock / 16) + c] as i8) as f32;
            let depth = &w[p * l.step..(p + 1) * l.step];
            let q = get_nibble(depth, c) | (((depth[Q6K_HIGH + c / 4] >> (2 * (c % 4))) & 3) << 4);
            d1 * (q as i32 - 32) as f32
        }
        QuantFormat::Q3K => {
            let l = Q3K_LAYOUT;
            let r = &s[p / l.sblock * l.sbytes..];
            let d1 = f16(r, 2 * c) * (r[Q6K_SCALES + GROUP * (p % l.sblock / 16) + c] as i8) as f32;
            let depth = &w[p * l.step..(p + 1) * l.step];
            let pair = (depth[Q3K_PAIRS + c / 4] >> (2 * (c % 4))) & 3;
            let high = (depth[c / 8] >> (c % 8)) & 1;
            d1 * (pair as i32 - 4 + 4 * high as i32) as f32
        }
        QuantFormat::Q2K => {
            let l = Q2K_LAYOUT;
            let r = &s[p / l.sblock * l.sbytes..];
            let sm = r[Q2K_SCALES + GROUP * (p % l.sblock / 16) + c];
            let (d1, m1) = (f16(r, 2 * c) * (sm & 0xF) as f32, f16(r, Q4K_DMIN + 2 * c) * (sm >> 4) as f32);
            d1 * ((w[p * l.step + c / 4] >> (2 * (c % 4))) & 3) as f32 - m1
        }
    }
}

/// Where column c (0..`GROUP`) of a group sits among a depth's values (see `PackedMatrix`).
fn slot(c: usize, bf16: bool) -> usize {
    match (bf16, c < GROUP / 2) {
        (false, _) => c,
        (true, true) => 2 * c,
        (true, false) => 2 * (c - GROUP / 2) + 1,
    }
}

/// y (m × n) = x (m × k) · Wᵀ, parallel on the calling pool from `par_min_macs` multiply-adds, with the widest
/// tiles this CPU has.
pub fn matmul_t(x: &[f32], m: usize, k: usize, w: Source<'_>, n: usize, par_min_macs: usize) -> Vec<f32> {
    matmul_t_with(x, m, k, w, n, par_min_macs, true)
}

/// `matmul_t`; `avx512`: the packed product's AVX-512 tiles where the CPU has them (false: its AVX2 tiles, for A/B
/// runs and tests; the same bits either way).
pub fn matmul_t_with(
    x: &[f32],
    m: usize,
    k: usize,
    w: Source<'_>,
    n: usize,
    par_min_macs: usize,
    avx512: bool,
) -> Vec<f32> {
    assert_eq!(x.len(), m * k);
    #[cfg(target_arch = "x86_64")]
    if Cpu::get().avx2() {
        return packed::matmul_t(x, m, k, w, n, par_min_macs, avx512 && Cpu::get().avx512());
    }
    let _ = avx512;
    thread_local! {
        static SCRATCH: std::cell::RefCell<Vec<f32>> = const { std::cell::RefCell::new(Vec::new()) };
    }
    let mut y = vec![0f32; m * n];
    let out = y.as_mut_ptr();
    let threads = rayon::current_num_threads();
    // f32 weights need no conversion: one panel, the whole matrix
    let rows = if let Source::F32(_) = w { n.max(1) } else { panel_rows(n, k) };
    SCRATCH.with(|s| {
        let mut s = s.borrow_mut();
        for n0 in (0..n).step_by(rows) {
            let nw = rows.min(n - n0);
            let panel: &[f32] = match w {
                Source::F32(w) => &w[n0 * k..(n0 + nw) * k],
                Source::Bf16(w) => {
                    fill(&mut s, nw * k, |r0, dst| widen(&w[(n0 + r0) * k..(n0 + r0) * k + dst.len()], dst), k);
                    &s[..nw * k]
                }
                Source::Quant(q) => {
                    fill(&mut s, nw * k, |r0, dst| dequantize_rows(q, n0 + r0, dst.len() / k, dst), k);
                    &s[..nw * k]
                }
                Source::Packed(p) => {
                    fill(&mut s, nw * k, |r0, dst| p.rows_into(n0 + r0, dst.len() / k, dst), k);
                    &s[..nw * k]
                }
            };
            let par = if threads > 1 && m * nw * k >= par_min_macs {
                gemm::Parallelism::Rayon(threads)
            } else {
                gemm::Parallelism::None
            };
            // SAFETY: columns [n0, n0 + nw) of y (m × n, row stride n); x is m × k and the panel nw × k, both
            // row-major and in bounds; this call is the only writer.
            unsafe { gemm_panel(x, m, k, panel, nw, out, n0, n, par) }
        }
    });
    y
}

/// Fill the first `len` values of `scratch` (rows of `k`) with `f(first_row, rows' values)`, in parallel chunks.
fn fill(scratch: &mut Vec<f32>, len: usize, f: impl Fn(usize, &mut [f32]) + Sync, k: usize) {
    if len == 0 {
        return;
    }
    if scratch.len() < len {
        scratch.resize(len, 0.0);
    }
    let chunk_rows = (FILL_CHUNK / k.max(1)).max(1);
    scratch[..len].par_chunks_mut(chunk_rows * k).enumerate().for_each(|(i, dst)| f(i * chunk_rows, dst));
}

/// Values widened or dequantized per parallel task.
const FILL_CHUNK: usize = 1 << 15;

/// Weight rows per panel: about `PANEL_VALUES` values (16-row multiples, gemm's tile), at most all n.
fn panel_rows(n: usize, k: usize) -> usize {
    ((PANEL_VALUES / k.max(1)).div_ceil(16) * 16).max(16).min(n.max(1))
}

/// Values of W converted to f32 at a time (the scratch: 8 MB, about the last-level cache).
const PANEL_VALUES: usize = 2 << 20;

/// bf16 → f32 (exact: a bf16 is the high half of an f32), vectorised by the compiler.
fn widen(src: &[bf16], dst: &mut [f32]) {
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32::from_bits((s.to_bits() as u32) << 16);
    }
}

/// y[:, n0..n0 + nw] = x · panelᵀ with the gemm crate.
///
/// # Safety
/// `y` points at an m × n row-major matrix whose columns [n0, n0 + nw) nothing else writes meanwhile.
#[allow(clippy::too_many_arguments)]
unsafe fn gemm_panel(
    x: &[f32],
    m: usize,
    k: usize,
    panel: &[f32],
    nw: usize,
    y: *mut f32,
    n0: usize,
    n: usize,
    par: gemm::Parallelism,
) {
    debug_assert_eq!(panel.len(), nw * k);
    gemm::gemm(
        m,
        nw,
        k,
        y.add(n0),
        1,          // dst column stride
        n as isize, // dst row stride
        false,      // do not read dst (alpha is ignored)
        x.as_ptr(),
        1,
        k as isize,
        // rhs = panelᵀ (k × nw): element (i, j) is panel[j·k + i]
        panel.as_ptr(),
        k as isize,
        1,
        0.0,
        1.0,
        false,
        false,
        false,
        par,
    );
}

/// The packed AVX2+FMA product (x86-64 CPUs with AVX2, FMA and F16C): the BLIS scheme with a 6 × 16 register tile,
/// or with AVX-512 (`Zmm`) a 6 × 64 one (32 registers: a group of 16 columns in one, 4 groups per tile).
///
/// x is packed once per call into `MR`-row micro-panels (`KC` columns deep); the output columns are cut into
/// parallel tasks, each packing its weight rows `KC` columns at a time into `NR`-column micro-panels (widening bf16,
/// or from a dequantized copy of its rows; a `PackedMatrix` is read as it is) and running the tile over every x
/// micro-panel, `MC` rows of x at a time.
///
/// Numerics: every y element is one f32 fused-multiply-add chain over k in order, starting from 0 (a tile continues
/// the chain of the previous `KC` block from the stored value). So a row's result depends only on x's row and W — not
/// on m, the tiling, the task split, the thread count or the register width (each lane of an AVX-512 tile is the
/// chain of an AVX2 one) — and equals `acc = x[i].mul_add(w[i], acc)` for i = 0..k.
#[cfg(target_arch = "x86_64")]
mod packed {
    use super::{PackedData, QuantFormat, Source};
    use crate::kernels::cpu::Cpu;
    use crate::kernels::simd::{load8, transpose8, with_buf, Out, WeightElem};
    use crate::kernels::unpack::dequantize_rows;
    use half::bf16;
    use rayon::prelude::*;
    use std::arch::x86_64::*;
    use std::cell::Cell;

    /// Register tile: `MR` x rows × `NR` output columns (12 of the 16 ymm registers hold it).
    const MR: usize = 6;
    const NR: usize = super::GROUP;
    /// Depth of a packed block: a weight micro-panel (`KC` × `NR`, 16 KB) stays in L1 while the x micro-panels stream.
    const KC: usize = 256;
    /// x rows per block (`MC` × `KC` f32: 144 KB, in L2 with the task's weight block).
    const MC: usize = 144;
    /// `NR`-column groups per task at most (the task's packed weight block: `KC` × 128 f32, 128 KB).
    const MAX_TASK_GROUPS: usize = 8;
    /// Bytes ahead in each group's weights that a tile asks the memory for at every depth (software prefetch). A
    /// matrix packed at load streams from memory in the first row panel of each depth block; the hardware
    /// prefetcher picks up each of the tile's groups only after some misses.
    const PREFETCH: usize = 1024;

    /// Ask for the line `PREFETCH` bytes after each group's current weights (past the matrix's end: a prefetch
    /// never faults).
    #[inline(always)]
    unsafe fn prefetch<E, const P: usize>(w: &[*const E; P]) {
        for w in w {
            _mm_prefetch::<_MM_HINT_T0>((*w as *const i8).wrapping_add(PREFETCH));
        }
    }

    thread_local! {
        static A: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
        static B: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
        static ROWS: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    }

    /// `wide`: the AVX-512 tiles (`Zmm`; the caller checked `Cpu::avx512`), else the AVX2 ones.
    pub(super) fn matmul_t(
        x: &[f32],
        m: usize,
        k: usize,
        w: Source<'_>,
        n: usize,
        par_min_macs: usize,
        wide: bool,
    ) -> Vec<f32> {
        assert!(
            Cpu::get().avx2() && (!wide || Cpu::get().avx512()),
            "packed::matmul_t needs AVX2 and FMA (AVX-512: wide)"
        );
        // every element is stored by its first depth block before anything reads it (no zero fill needed)
        let mut y: Vec<f32> = Vec::with_capacity(m * n);
        if m == 0 || n == 0 || k == 0 {
            y.resize(m * n, 0.0);
            return y;
        }
        let par = rayon::current_num_threads() > 1 && m * n * k >= par_min_macs;
        let m_pad = m.div_ceil(MR) * MR;
        with_buf(&A, m_pad * k, |a| {
            pack_x(x, m, k, m_pad, a, par);
            let a: &[f32] = a;
            let groups = n.div_ceil(NR);
            let tasks = task_count(groups, if par { rayon::current_num_threads() } else { 1 });
            let out = Out(y.as_mut_ptr());
            let task = |t: usize| {
                // task t: groups [t·groups/tasks, (t+1)·groups/tasks) of NR columns (sizes differ by at most one)
                let (j0, j1) = (t * groups / tasks * NR, ((t + 1) * groups / tasks * NR).min(n));
                // SAFETY: the task writes columns [j0, j1) of y (m × n) only; x is packed m_pad × k in `a`.
                let t = Task { a, m, m_pad, k, j0, nt: j1 - j0, n, y: out };
                unsafe {
                    if wide {
                        columns::<Zmm>(t, w)
                    } else {
                        columns::<Ymm>(t, w)
                    }
                }
            };
            if par {
                (0..tasks).into_par_iter().for_each(task);
            } else {
                (0..tasks).for_each(task);
            }
            // SAFETY: the tasks wrote all m × n elements (first depth block of every tile)
            unsafe { y.set_len(m * n) };
        });
        y
    }

    /// Tasks over `groups` column groups of `NR`: at most `MAX_TASK_GROUPS` groups each, at least 2 per thread where
    /// there are enough groups, and a multiple of the threads, so that the threads get equal work.
    fn task_count(groups: usize, threads: usize) -> usize {
        let tasks = groups.div_ceil(MAX_TASK_GROUPS).max(2 * threads).div_ceil(threads) * threads;
        tasks.min(groups)
    }

    /// x (m × k) into `a`: per `KC` block (at offset kc0 · m_pad), `MR`-row micro-panels of kc × `MR` values
    /// (row r of panel i at [p · MR + r]), rows past m zero.
    fn pack_x(x: &[f32], m: usize, k: usize, m_pad: usize, a: &mut [f32], par: bool) {
        // each panel's values lie in every block: split the work by panel over raw offsets
        let panels = m_pad / MR;
        let a_ptr = Out(a.as_mut_ptr());
        let one = |i: usize| {
            for kc0 in (0..k).step_by(KC) {
                let kc = KC.min(k - kc0);
                // SAFETY: panel i of block kc0 is [kc0·m_pad + i·MR·kc, + MR·kc), inside `a` (m_pad × k) and
                // written by this call only.
                let dst = unsafe { std::slice::from_raw_parts_mut(a_ptr.offset(kc0 * m_pad + i * MR * kc).0, MR * kc) };
                for r in 0..MR {
                    let row = i * MR + r;
                    if row < m {
                        let src = &x[row * k + kc0..row * k + kc0 + kc];
                        for (p, &v) in src.iter().enumerate() {
                            dst[p * MR + r] = v;
                        }
                    } else {
                        for p in 0..kc {
                            dst[p * MR + r] = 0.0;
                        }
                    }
                }
            }
        };
        if par && panels > 1 {
            (0..panels).into_par_iter().for_each(one);
        } else {
            (0..panels).for_each(one);
        }
    }

    /// One task's share of a product: columns [j0, j0 + nt) of y (m × n, row-major) from x packed by `pack_x`
    /// (m_pad × k in `a`).
    #[derive(Clone, Copy)]
    struct Task<'a> {
        a: &'a [f32],
        m: usize,
        m_pad: usize,
        k: usize,
        j0: usize,
        nt: usize,
        n: usize,
        y: Out,
    }

    /// The task's columns of y.
    ///
    /// # Safety
    /// `t.y` is m × n; only this call writes the task's columns.
    unsafe fn columns<T: Tiles>(t: Task<'_>, w: Source<'_>) {
        let (k, j0, nt) = (t.k, t.j0, t.nt);
        match w {
            Source::F32(w) => columns_of::<T, f32>(t, &w[j0 * k..(j0 + nt) * k]),
            Source::Bf16(w) => columns_of::<T, bf16>(t, &w[j0 * k..(j0 + nt) * k]),
            Source::Quant(q) => with_buf(&ROWS, nt * k, |rows| {
                dequantize_rows(q, j0, nt, rows);
                columns_of::<T, f32>(t, rows)
            }),
            Source::Packed(p) => {
                // the task's groups (j0 is a multiple of NR)
                let g = (j0 / NR, (j0 + nt).div_ceil(NR));
                match &p.data {
                    PackedData::F32(d) => columns_packed::<T, f32>(t, d, &[], g),
                    PackedData::Bf16(d) => columns_packed::<T, u16>(t, d, &[], g),
                    PackedData::Block { format, w, s } => match format {
                        QuantFormat::Q8_0 => columns_packed::<T, i8>(t, bytes_as(w), s, g),
                        QuantFormat::Q6K => columns_packed::<T, Q6>(t, bytes_as(w), s, g),
                        QuantFormat::Q5K => columns_packed::<T, Q5K>(t, bytes_as(w), s, g),
                        QuantFormat::Q5_0 => columns_packed::<T, Q5>(t, bytes_as(w), s, g),
                        QuantFormat::Q4K => columns_packed::<T, Q4>(t, bytes_as(w), s, g),
                        QuantFormat::Q4_0 => columns_packed::<T, Q40>(t, bytes_as(w), s, g),
                        QuantFormat::Q3K => columns_packed::<T, Q3K>(t, bytes_as(w), s, g),
                        QuantFormat::Q2K => columns_packed::<T, Q2K>(t, bytes_as(w), s, g),
                    },
                }
            }
        }
    }

    /// Bytes as the one-byte element `E` a `Panel` reads them as.
    fn bytes_as<E: Panel>(w: &[u8]) -> &[E] {
        assert_eq!(std::mem::size_of::<E>(), 1);
        // SAFETY: E is one byte with no invalid bit patterns (i8 or a `repr(transparent)` struct over u8)
        unsafe { std::slice::from_raw_parts(w.as_ptr() as *const E, w.len()) }
    }

    /// The task's columns from its groups [g0, g1) (`groups`) of a `PackedMatrix`'s values `w` and scale records
    /// `scales`, `KC` deep at a time as x is packed. (A window of one row panel taking the whole depth at once, each
    /// group streamed in one pass, measured the same.)
    unsafe fn columns_packed<T: Tiles, E: Panel>(t: Task<'_>, w: &[E], scales: &[u8], groups: (usize, usize)) {
        // a block format's scale records: group g's after g's (KC is a multiple of `sblock`, so every depth block
        // starts a record)
        let l = E::LAYOUT;
        let records = if E::BLOCK > 0 { t.k / l.sblock } else { 0 };
        let (g0, g1) = groups;
        let w = &w[g0 * t.k * l.step..g1 * t.k * l.step];
        let scales = &scales[g0 * records * l.sbytes..g1 * records * l.sbytes];
        let at = |g: usize, kc0: usize| Cursor {
            fetch: false,
            w: w.as_ptr().add((g * t.k + kc0) * l.step),
            s: if E::BLOCK > 0 {
                scales.as_ptr().add((g * records + kc0 / l.sblock) * l.sbytes)
            } else {
                std::ptr::null()
            },
        };
        if E::BLOCK > 0 && t.m >= E::DECODE_ROWS {
            let groups = t.nt.div_ceil(NR);
            with_buf(&B, KC * groups * NR, |b| {
                for kc0 in (0..t.k).step_by(KC) {
                    let kc = KC.min(t.k - kc0);
                    for g in 0..groups {
                        T::decode::<E>(kc, at(g, kc0), &mut b[g * NR * kc..(g + 1) * NR * kc]);
                    }
                    let b: &[f32] = b;
                    sweep::<T, f32>(t, kc0, kc, |g| Cursor::dense(b.as_ptr().add(g * NR * kc)));
                }
            });
            return;
        }
        for kc0 in (0..t.k).step_by(KC) {
            let kc = KC.min(t.k - kc0);
            sweep::<T, E>(t, kc0, kc, |g| at(g, kc0));
        }
    }

    /// A group's `kc` depths from `b` on, as f32 (`NR` per depth, column order) into `dst` (`Ymm::decode`).
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn decode<E: Panel>(kc: usize, b: Cursor<E>, dst: &mut [f32]) {
        assert!(dst.len() >= kc * NR && E::SLOTS.is_none());
        let (mut w, b) = (b.w, [b]);
        let mut d = [[_mm256_setzero_ps(); 4]];
        for p in 0..kc {
            next_scales(p, &b, &mut d, |r, j| E::scales(r, j));
            let (lo, hi) = E::load(w, &d[0]);
            _mm256_storeu_ps(dst.as_mut_ptr().add(p * NR), lo);
            _mm256_storeu_ps(dst.as_mut_ptr().add(p * NR + 8), hi);
            w = w.add(E::LAYOUT.step);
        }
    }

    /// `decode` with AVX-512 (`Zmm::decode`): the same values.
    #[target_feature(enable = "avx512f")]
    unsafe fn decode512<E: Panel>(kc: usize, b: Cursor<E>, dst: &mut [f32]) {
        assert!(dst.len() >= kc * NR && E::SLOTS.is_none());
        let (mut w, b) = (b.w, [b]);
        let mut d = [[_mm512_setzero_ps(); 2]];
        for p in 0..kc {
            next_scales(p, &b, &mut d, |r, j| E::scales16(r, j));
            _mm512_storeu_ps(dst.as_mut_ptr().add(p * NR), E::load16(w, &d[0]));
            w = w.add(E::LAYOUT.step);
        }
    }

    /// The task's columns from its weight rows `w` (nt × k), packed here `KC` deep at a time.
    unsafe fn columns_of<T: Tiles, E: WeightElem>(t: Task<'_>, w: &[E]) {
        let groups = t.nt.div_ceil(NR);
        with_buf(&B, KC * groups * NR, |b| {
            for kc0 in (0..t.k).step_by(KC) {
                let kc = KC.min(t.k - kc0);
                pack_w(w, t.k, t.nt, kc0, kc, b);
                let b: &[f32] = b;
                sweep::<T, f32>(t, kc0, kc, |g| Cursor::dense(b.as_ptr().add(g * NR * kc)));
            }
        });
    }

    /// One depth block [kc0, kc0 + kc) of the task's columns: `b(g)` points at group g's `NR`-wide values at depth
    /// kc0, consecutive depths `NR` apart. Full row panels take the `MR`-row tile (over up to `T::FULL` whole groups
    /// at once, a partial last group alone), `MC` rows of x at a time over each group; the last rows (fewer than `MR`)
    /// a tile as wide as its accumulators allow (`Tiles::last_rows`).
    unsafe fn sweep<T: Tiles, E: Panel>(t: Task<'_>, kc0: usize, kc: usize, b: impl Fn(usize) -> Cursor<E>) {
        let Task { a, m, m_pad, j0, nt, n, y, .. } = t;
        let groups = nt.div_ceil(NR);
        let full = m / MR * MR;
        let acc = kc0 > 0;
        // tall tiles take the full panels two at a time from each block's start (`MC` is a multiple of 2 · `MR`), so
        // with an odd count the last full panel is left alone: it takes the last rows with it (a shorter tall tile)
        let rest_tall = T::TALL && E::BLOCK == 0 && m > full && (full / MR) % 2 == 1;
        for i0 in (0..full).step_by(MC) {
            let i1 = (i0 + MC).min(full);
            let mut g = 0;
            while g < groups {
                // whole groups this tile covers (none: a partial last group)
                let count = (nt / NR - g).min(T::full_groups::<E>());
                let mut i = i0;
                while i < i1 {
                    let ap = a.as_ptr().add(kc0 * m_pad + i * kc);
                    let c = y.offset(i * n + j0 + g * NR).0;
                    // the first row panel reads the weights from memory (the others from the cache)
                    let b = |g| Cursor { fetch: i == 0, ..b(g) };
                    // two panels, the last one with the last rows, or one panel
                    let rows = if T::TALL && E::BLOCK == 0 && count > 0 && i + 2 * MR <= i1 {
                        2 * MR
                    } else if rest_tall && count > 0 && i + MR == full {
                        MR + m - full
                    } else {
                        MR
                    };
                    if count > 0 {
                        T::full(rows, kc, ap, &b, g, count, c, n, acc);
                    } else {
                        edge_tile::<T, E, MR>(kc, ap, b(g), c, n, nt - g * NR, acc);
                    }
                    i += if rows == 2 * MR { 2 * MR } else { MR };
                }
                g += count.max(1);
            }
        }
        if m > full {
            let ap = a.as_ptr().add(kc0 * m_pad + full * kc);
            // with `rest_tall` the whole groups' last rows are done: only a partial last group is left
            let g0 = if rest_tall { nt / NR } else { 0 };
            let b = |g| Cursor { fetch: full == 0, ..b(g0 + g) };
            if g0 * NR < nt {
                T::last_rows(m - full, kc, ap, &b, nt - g0 * NR, y.offset(full * n + j0 + g0 * NR).0, n, acc);
            }
        }
    }

    /// The register tiles of one instruction set.
    pub(super) trait Tiles {
        /// Whole groups the full `MR`-row tile covers at once, at most.
        const FULL: usize;
        /// Whole groups the full tile takes at once for weights `E` (fewer where their scales take registers).
        fn full_groups<E: Panel>() -> usize {
            Self::FULL.min(E::FULL512)
        }
        /// Whether `full` takes tall tiles: `rows` from `MR` + 1 to 2 · `MR` (a full row panel and rows of the
        /// next), for dense weights (f32 or bf16, no block format's scales). Each group's weights are then formed
        /// once for all the rows, where an `MR`-row tile forms them once per `MR`.
        const TALL: bool = false;
        /// The `rows`-row tile over groups [g, g + count) (count: 1 to `FULL`): `MR` rows, or a tall tile (`TALL`).
        #[allow(clippy::too_many_arguments)]
        unsafe fn full<E: Panel>(
            rows: usize,
            kc: usize,
            a: *const f32,
            b: &impl Fn(usize) -> Cursor<E>,
            g: usize,
            count: usize,
            c: *mut f32,
            ldc: usize,
            acc: bool,
        );
        /// c (`R` rows × `P` groups) as `tile` describes.
        unsafe fn tile<E: Panel, const R: usize, const P: usize>(
            kc: usize,
            a: *const f32,
            b: [Cursor<E>; P],
            c: *mut f32,
            ldc: usize,
            acc: bool,
        );
        /// `R` rows over some of the `left` whole groups from group g (fewer than `last_rows` takes at once); returns
        /// how many.
        #[allow(clippy::too_many_arguments)]
        unsafe fn rest<E: Panel, const R: usize>(
            left: usize,
            kc: usize,
            a: *const f32,
            b: &impl Fn(usize) -> Cursor<E>,
            g: usize,
            c: *mut f32,
            n: usize,
            acc: bool,
        ) -> usize;
        /// A block format's group, `kc` depths from `b` on, as f32 into `dst` (`NR` per depth, column order).
        unsafe fn decode<E: Panel>(kc: usize, b: Cursor<E>, dst: &mut [f32]);
        /// The last `rows` (1 to `MR` − 1) rows over every group (`last_rows` with this set's widths).
        #[allow(clippy::too_many_arguments)]
        unsafe fn last_rows<E: Panel>(
            rows: usize,
            kc: usize,
            a: *const f32,
            b: &impl Fn(usize) -> Cursor<E>,
            nt: usize,
            c: *mut f32,
            n: usize,
            acc: bool,
        );
    }

    /// AVX2: 16 ymm registers, a group in two; the 6-row tile over one group (12 accumulators).
    pub(super) struct Ymm;
    /// AVX-512: 32 zmm registers, a group in one; the 6-row tile over 4 groups (24 accumulators), the last rows over
    /// up to 8. Each lane is the same in-order chain as in `Ymm`'s tiles: the same bits.
    pub(super) struct Zmm;

    impl Tiles for Ymm {
        const FULL: usize = 1;
        unsafe fn decode<E: Panel>(kc: usize, b: Cursor<E>, dst: &mut [f32]) {
            decode::<E>(kc, b, dst)
        }
        unsafe fn full<E: Panel>(
            rows: usize,
            kc: usize,
            a: *const f32,
            b: &impl Fn(usize) -> Cursor<E>,
            g: usize,
            _count: usize,
            c: *mut f32,
            ldc: usize,
            acc: bool,
        ) {
            debug_assert_eq!(rows, MR);
            tile::<E, MR, 1>(kc, a, [b(g)], c, ldc, acc)
        }
        unsafe fn tile<E: Panel, const R: usize, const P: usize>(
            kc: usize,
            a: *const f32,
            b: [Cursor<E>; P],
            c: *mut f32,
            ldc: usize,
            acc: bool,
        ) {
            tile::<E, R, P>(kc, a, b, c, ldc, acc)
        }
        unsafe fn rest<E: Panel, const R: usize>(
            left: usize,
            kc: usize,
            a: *const f32,
            b: &impl Fn(usize) -> Cursor<E>,
            g: usize,
            c: *mut f32,
            n: usize,
            acc: bool,
        ) -> usize {
            match left {
                1 => tile::<E, R, 1>(kc, a, [b(g)], c, n, acc),
                2 => tile::<E, R, 2>(kc, a, [b(g), b(g + 1)], c, n, acc),
                _ => tile::<E, R, 3>(kc, a, [b(g), b(g + 1), b(g + 2)], c, n, acc),
            }
            left.min(3)
        }
        unsafe fn last_rows<E: Panel>(
            rows: usize,
            kc: usize,
            a: *const f32,
            b: &impl Fn(usize) -> Cursor<E>,
            nt: usize,
            c: *mut f32,
            n: usize,
            acc: bool,
        ) {
            match rows {
                1 => last_rows::<Self, E, 1, 4>(kc, a, b, nt, c, n, acc),
                2 => last_rows::<Self, E, 2, 2>(kc, a, b, nt, c, n, acc),
                3 => last_rows::<Self, E, 3, 2>(kc, a, b, nt, c, n, acc),
                4 => last_rows::<Self, E, 4, 1>(kc, a, b, nt, c, n, acc),
                _ => last_rows::<Self, E, 5, 1>(kc, a, b, nt, c, n, acc),
            }
        }
    }

    impl Tiles for Zmm {
        const FULL: usize = 4;
        const TALL: bool = true;
        unsafe fn decode<E: Panel>(kc: usize, b: Cursor<E>, dst: &mut [f32]) {
            decode512::<E>(kc, b, dst)
        }
        unsafe fn full<E: Panel>(
            rows: usize,
            kc: usize,
            a: *const f32,
            b: &impl Fn(usize) -> Cursor<E>,
            g: usize,
            count: usize,
            c: *mut f32,
            ldc: usize,
            acc: bool,
        ) {
            // tall: up to 12 rows over 2 groups, 24 accumulators; at 12 rows 4 widening uops for bf16 per 24 FMAs
            // (the 6-row tile over 4 groups: 8)
            match rows {
                7 => return last_rows::<Self, E, 7, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
                8 => return last_rows::<Self, E, 8, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
                9 => return last_rows::<Self, E, 9, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
                10 => return last_rows::<Self, E, 10, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
                11 => return last_rows::<Self, E, 11, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
                12 => return last_rows::<Self, E, { 2 * MR }, 2>(kc, a, &|q| b(g + q), count * NR, c, ldc, acc),
                _ => debug_assert_eq!(rows, MR),
            }
            match count {
                1 => tile512::<E, MR, 1>(kc, a, [b(g)], c, ldc, acc),
                2 => tile512::<E, MR, 2>(kc, a, [b(g), b(g + 1)], c, ldc, acc),
                3 => tile512::<E, MR, 3>(kc, a, [b(g), b(g + 1), b(g + 2)], c, ldc, acc),
                _ => tile512::<E, MR, 4>(kc, a, [b(g), b(g + 1), b(g + 2), b(g + 3)], c, ldc, acc),
            }
        }
        unsafe fn tile<E: Panel, const R: usize, const P: usize>(
            kc: usize,
            a: *const f32,
            b: [Cursor<E>; P],
            c: *mut f32,
            ldc: usize,
            acc: bool,
        ) {
            tile512::<E, R, P>(kc, a, b, c, ldc, acc)
        }
        unsafe fn rest<E: Panel, const R: usize>(
            left: usize,
            kc: usize,
            a: *const f32,
            b: &impl Fn(usize) -> Cursor<E>,
            g: usize,
            c: *mut f32,
            n: usize,
            acc: bool,
        ) -> usize {
            // all that is left in one tile (at least 8 accumulators while R · left allows: FMA latency × ports)
            let bs = |q: usize| b(g + q);
            match left {
                1 => tile512::<E, R, 1>(kc, a, [bs(0)], c, n, acc),
                2 => tile512::<E, R, 2>(kc, a, std::array::from_fn(bs), c, n, acc),
                3 => tile512::<E, R, 3>(kc, a, std::array::from_fn(bs), c, n, acc),
                4 => tile512::<E, R, 4>(kc, a, std::array::from_fn(bs), c, n, acc),
                5 => tile512::<E, R, 5>(kc, a, std::array::from_fn(bs), c, n, acc),
                6 => tile512::<E, R, 6>(kc, a, std::array::from_fn(bs), c, n, acc),
                _ => tile512::<E, R, 7>(kc, a, std::array::from_fn(bs), c, n, acc),
            }
            left.min(7)
        }
        unsafe fn last_rows<E: Panel>(
            rows: usize,
            kc: usize,
            a: *const f32,
            b: &impl Fn(usize) -> Cursor<E>,
            nt: usize,
            c: *mut f32,
            n: usize,
            acc: bool,
        ) {
            match rows {
                // a block format's scales take registers too: fewer groups at once (spills otherwise)
                1 if E::BLOCK > 0 => last_rows::<Self, E, 1, 4>(kc, a, b, nt, c, n, acc),
                1 => last_rows::<Self, E, 1, 8>(kc, a, b, nt, c, n, acc),
                2 => last_rows::<Self, E, 2, 6>(kc, a, b, nt, c, n, acc),
                3 => last_rows::<Self, E, 3, 4>(kc, a, b, nt, c, n, acc),
                4 => last_rows::<Self, E, 4, 4>(kc, a, b, nt, c, n, acc),
                _ => last_rows::<Self, E, 5, 4>(kc, a, b, nt, c, n, acc),
            }
        }
    }

    /// `R` rows over every group: `P` groups per tile (`R · P` accumulator groups), then what is left
    /// (`Tiles::rest`). The last rows (R < `MR`), and the tall tiles (`Tiles::TALL`, P = 2).
    #[allow(clippy::too_many_arguments)]
    unsafe fn last_rows<T: Tiles, E: Panel, const R: usize, const P: usize>(
        kc: usize,
        a: *const f32,
        b: &impl Fn(usize) -> Cursor<E>,
        nt: usize,
        c: *mut f32,
        n: usize,
        acc: bool,
    ) {
        let whole = nt / NR;
        let mut g = 0;
        while g + P <= whole {
            T::tile::<E, R, P>(kc, a, std::array::from_fn(|q| b(g + q)), c.add(g * NR), n, acc);
            g += P;
        }
        while g < whole {
            g += T::rest::<E, R>(whole - g, kc, a, b, g, c.add(g * NR), n, acc);
        }
        if whole * NR < nt {
            edge_tile::<T, E, R>(kc, a, b(whole), c.add(whole * NR), n, nt - whole * NR, acc);
        }
    }

    /// Weight rows `w` (nt × k), columns [kc0, kc0 + kc), into `NR`-column micro-panels: group g's value for
    /// column c at depth p is at [g · NR · kc + p · NR + c]; columns past nt zero. 8 × 8 blocks are transposed in
    /// registers (bf16 widened as they load), the last kc % 8 depths one by one.
    #[target_feature(enable = "avx2,fma")]
    unsafe fn pack_w<E: WeightElem>(w: &[E], k: usize, nt: usize, kc0: usize, kc: usize, b: &mut [f32]) {
        let kc8 = kc / 8 * 8;
        for g in 0..nt.div_ceil(NR) {
            let dst = &mut b[g * NR * kc..(g + 1) * NR * kc];
            for h in 0..NR / 8 {
                let c0 = g * NR + h * 8;
                // the 8 rows' starts at depth kc0 (None: past nt)
                let rows: [Option<*const E>; 8] =
                    std::array::from_fn(|r| (c0 + r < nt).then(|| w[(c0 + r) * k + kc0..].as_ptr()));
                for p0 in (0..kc8).step_by(8) {
                    let v: [__m256; 8] =
                        std::array::from_fn(|r| rows[r].map_or(_mm256_setzero_ps(), |q| load8(q.add(p0))));
                    for (j, t) in transpose8(v).into_iter().enumerate() {
                        _mm256_storeu_ps(dst.as_mut_ptr().add((p0 + j) * NR + h * 8), t);
                    }
                }
                for p in kc8..kc {
                    for (r, row) in rows.iter().enumerate() {
                        dst[p * NR + h * 8 + r] = row.map_or(0.0, |q| (*q.add(p)).to_f32());
                    }
                }
            }
        }
    }

    /// How a tile reads `NR` weights of one depth: packed f32 (two loads), a `PackedMatrix`'s bf16 pairs (one load,
    /// widened: each 32-bit lane's low half shifted up is column i, its high half masked column 8 + i), or a block
    /// format's values (q8_0: signed bytes; the others nibbles, with fifth bits or bit pairs: `Q6`, `Q5K`, `Q5`,
    /// `Q4`, `Q40`) formed with the scales of their block exactly as the format's dequantization forms them.
    ///
    /// With AVX-512 (`load16`) a depth's `NR` values fill one register: f32 and the block formats in column order;
    /// bf16 zero-extended slot by slot, so lane j holds slot j's column (`SLOTS`), which `Zmm`'s tile maps back when
    /// it loads and stores.
    pub(super) trait Panel: Copy {
        /// Lane j of `load16` holds column `SLOTS[j]` (None: column j).
        const SLOTS: Option<[u32; NR]>;
        /// Elements per depth of a group (`Layout::step`), and for a block format its scale records.
        const LAYOUT: super::Layout = super::Layout { step: NR, sblock: 0, sbytes: 0 };
        /// Depths per set of scales (0: none).
        const BLOCK: usize = 0;
        /// Groups the full AVX-512 tile takes at once (its scales take registers too).
        const FULL512: usize = 4;
        /// A block format: windows of this many rows or more take its values decoded into f32 once per depth block
        /// (`Tiles::decode`), then the f32 tiles; fewer form them in the tile, once per `MR` rows. The same values
        /// either way, so the same bits. (`benches/quant_kernel.rs` with `MBD_BENCH_PACKED=1` on Zen 4, time over
        /// bf16's at 8 / 12 / 18 / 32 rows, in the tile | decoded first: q8_0 1.02 / 1.05 / 1.11 / 1.14 | 1.44 /
        /// 1.38 / 1.28 / 1.15; q5_0 1.25 / 1.26 / 1.34 / 1.40 | 1.31 / 1.27 / 1.20 / 1.10; q4_k 1.08 / 1.10 / 1.15 /
        /// 1.20 | 1.24 / 1.22 / 1.17 / 1.09; q6_k, 1.7B gate/up, at 8 / 12 / 16 rows: 1.39 / 1.29-1.37 / 1.36-1.40 |
        /// 1.49 / 1.41 / 1.31, and 1.13 decoded at 32.)
        const DECODE_ROWS: usize = usize::MAX;
        /// The scales of set j of a record (a block format only): AVX2 (columns 0-7, 8-15; a second pair where the
        /// format has one, e.g. q4_k's mins) and AVX-512.
        #[inline(always)]
        unsafe fn scales(_rec: *const u8, _j: usize) -> [__m256; 4] {
            [_mm256_setzero_ps(); 4]
        }
        #[inline(always)]
        unsafe fn scales16(_rec: *const u8, _j: usize) -> [__m512; 2] {
            [_mm512_setzero_ps(); 2]
        }
        unsafe fn load(p: *const Self, d: &[__m256; 4]) -> (__m256, __m256);
        unsafe fn load16(p: *const Self, d: &[__m512; 2]) -> __m512;
    }

    /// A group's weights from some depth on: `Panel::LAYOUT.step` elements per depth at `w`, and for a block format
    /// its scale records at `s`, starting with the record of `w`'s depth (a multiple of `Layout::sblock`).
    #[derive(Clone, Copy)]
    pub(super) struct Cursor<E> {
        w: *const E,
        s: *const u8,
        /// Whether the tile that reads these weights is their first since memory (it prefetches, `PREFETCH`).
        fetch: bool,
    }

    impl<E: Panel> Cursor<E> {
        pub(super) fn dense(w: *const E) -> Self {
            Cursor { w, s: std::ptr::null(), fetch: false }
        }
        /// The scale record of depth p (counted from the cursor's first depth).
        #[inline(always)]
        unsafe fn record(&self, p: usize) -> *const u8 {
            self.s.add(p / E::LAYOUT.sblock.max(1) * E::LAYOUT.sbytes)
        }
    }

    /// The scales of depth p's set, for each of a tile's groups, where p starts a set.
    #[inline(always)]
    unsafe fn next_scales<E: Panel, S: Copy, const P: usize>(
        p: usize,
        b: &[Cursor<E>; P],
        d: &mut [S; P],
        get: impl Fn(*const u8, usize) -> S,
    ) {
        if E::BLOCK > 0 && p.is_multiple_of(E::BLOCK.max(1)) {
            let j = p % E::LAYOUT.sblock.max(1) / E::BLOCK.max(1);
            for (d, b) in d.iter_mut().zip(b) {
                *d = get(b.record(p), j);
            }
        }
    }

    /// A `Panel`'s `scales` and `scales16`: those of format `$of`, whose scale records it shares.
    macro_rules! scales_of {
        ($of:ty) => {
            #[inline(always)]
            unsafe fn scales(rec: *const u8, j: usize) -> [__m256; 4] {
                <$of as Panel>::scales(rec, j)
            }
            #[inline(always)]
            unsafe fn scales16(rec: *const u8, j: usize) -> [__m512; 2] {
                <$of as Panel>::scales16(rec, j)
            }
        };
    }

    impl Panel for f32 {
        const SLOTS: Option<[u32; NR]> = None;
        #[inline(always)]
        unsafe fn load(p: *const f32, _: &[__m256; 4]) -> (__m256, __m256) {
            (_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)))
        }
        #[inline(always)]
        unsafe fn load16(p: *const f32, _: &[__m512; 2]) -> __m512 {
            _mm512_loadu_ps(p)
        }
    }

    impl Panel for u16 {
        // slot 2i: column i, slot 2i + 1: column 8 + i (`super::slot`)
        const SLOTS: Option<[u32; NR]> = Some([0, 8, 1, 9, 2, 10, 3, 11, 4, 12, 5, 13, 6, 14, 7, 15]);
        #[inline(always)]
        unsafe fn load(p: *const u16, _: &[__m256; 4]) -> (__m256, __m256) {
            let v = _mm256_loadu_si256(p as *const __m256i);
            let lo = _mm256_slli_epi32::<16>(v);
            let hi = _mm256_and_si256(v, _mm256_set1_epi32(0xFFFF_0000u32 as i32));
            (_mm256_castsi256_ps(lo), _mm256_castsi256_ps(hi))
        }
        #[inline(always)]
        unsafe fn load16(p: *const u16, _: &[__m512; 2]) -> __m512 {
            let v = _mm512_cvtepu16_epi32(_mm256_loadu_si256(p as *const __m256i));
            _mm512_castsi512_ps(_mm512_slli_epi32::<16>(v))
        }
    }

    /// A record's 16 f16 scales at byte `at` (columns 0-7, 8-15).
    #[inline(always)]
    unsafe fn f16x16(rec: *const u8, at: usize) -> (__m256, __m256) {
        (
            _mm256_cvtph_ps(_mm_loadu_si128(rec.add(at) as *const __m128i)),
            _mm256_cvtph_ps(_mm_loadu_si128(rec.add(at + 16) as *const __m128i)),
        )
    }

    /// A record's 16 6-bit scales (or mins) at byte `at`, as f32 (columns 0-7, 8-15).
    #[inline(always)]
    unsafe fn u8x16(rec: *const u8, at: usize) -> (__m256, __m256) {
        let v = _mm_loadu_si128(rec.add(at) as *const __m128i);
        (_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v))))
    }

    /// A depth's 16 nibbles (`super::nibble`'s order) in the low 4 bits of each 32-bit lane, columns 0-7 and 8-15
    /// (higher bits: other nibbles).
    #[inline(always)]
    unsafe fn nibbles8(p: *const u8) -> (__m256i, __m256i) {
        let v = _mm256_set1_epi64x((p as *const i64).read_unaligned());
        (
            _mm256_srlv_epi32(v, _mm256_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12)),
            _mm256_srlv_epi32(v, _mm256_setr_epi32(16, 16, 20, 20, 24, 24, 28, 28)),
        )
    }

    /// `nibbles8` with AVX-512: column j's nibble in the low 4 bits of lane j.
    #[inline(always)]
    unsafe fn nibbles16(p: *const u8) -> __m512i {
        let v = _mm512_set1_epi64((p as *const i64).read_unaligned());
        _mm512_srlv_epi32(v, _mm512_setr_epi32(0, 0, 4, 4, 8, 8, 12, 12, 16, 16, 20, 20, 24, 24, 28, 28))
    }

    impl Panel for i8 {
        const SLOTS: Option<[u32; NR]> = None;
        const LAYOUT: super::Layout = super::Q8_0_LAYOUT;
        const BLOCK: usize = 32;
        const FULL512: usize = 3;
        #[inline(always)]
        unsafe fn scales(rec: *const u8, _: usize) -> [__m256; 4] {
            let (a, b) = f16x16(rec, 0);
            [a, b, _mm256_setzero_ps(), _mm256_setzero_ps()]
        }
        #[inline(always)]
        unsafe fn scales16(rec: *const u8, _: usize) -> [__m512; 2] {
            [_mm512_cvtph_ps(_mm256_loadu_si256(rec as *const __m256i)), _mm512_setzero_ps()]
        }
        #[inline(always)]
        unsafe fn load(p: *const i8, d: &[__m256; 4]) -> (__m256, __m256) {
            let q = _mm_loadu_si128(p as *const __m128i);
            let lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
            let hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(q)));
            (_mm256_mul_ps(lo, d[0]), _mm256_mul_ps(hi, d[1]))
        }
        #[inline(always)]
        unsafe fn load16(p: *const i8, d: &[__m512; 2]) -> __m512 {
            let q = _mm512_cvtepi8_epi32(_mm_loadu_si128(p as *const __m128i));
            _mm512_mul_ps(_mm512_cvtepi32_ps(q), d[0])
        }
    }

    /// A packed q5_0 byte (`super::Q5_0_LAYOUT`): value (q − 16) · d, q's low 4 bits from the depth's nibbles, its
    /// fifth from the 16 bits before them.
    #[derive(Clone, Copy)]
    #[repr(transparent)]
    pub(super) struct Q5(#[allow(dead_code)] u8);

    impl Panel for Q5 {
        const SLOTS: Option<[u32; NR]> = None;
        const LAYOUT: super::Layout = super::Q5_0_LAYOUT;
        const BLOCK: usize = 32;
        const DECODE_ROWS: usize = 3 * MR;
        scales_of!(i8);
        #[inline(always)]
        unsafe fn load(p: *const Q5, d: &[__m256; 4]) -> (__m256, __m256) {
            let q = |q: __m256i, d: __m256| {
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(16))), d)
            };
            let (lo, hi) = fives8(p as *const u8);
            (q(lo, d[0]), q(hi, d[1]))
        }
        #[inline(always)]
        unsafe fn load16(p: *const Q5, d: &[__m512; 2]) -> __m512 {
            // q − 16
            let table =
                _mm512_setr_ps(-16., -15., -14., -13., -12., -11., -10., -9., -8., -7., -6., -5., -4., -3., -2., -1.);
            _mm512_mul_ps(fives16(p as *const u8, table), d[0])
        }
    }

    /// A q5_0 or q5_k depth's 16 5-bit values (`super::Q5_NIBBLES`: 2 bytes of fifth bits, bit c column c, then the
    /// nibbles), columns 0-7 and 8-15.
    #[inline(always)]
    unsafe fn fives8(p: *const u8) -> (__m256i, __m256i) {
        let (lo, hi) = nibbles8(p.add(super::Q5_NIBBLES));
        // the fifth bits (and 2 nibble bytes above them) in every lane; bit c shifted to bit 4 of lane c
        let h = _mm256_set1_epi32((p as *const i32).read_unaligned());
        let h_lo = _mm256_srlv_epi32(_mm256_slli_epi32::<4>(h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
        let h_hi = _mm256_srlv_epi32(h, _mm256_setr_epi32(4, 5, 6, 7, 8, 9, 10, 11));
        let q = |n: __m256i, h: __m256i| {
            _mm256_or_si256(_mm256_and_si256(n, _mm256_set1_epi32(0xF)), _mm256_and_si256(h, _mm256_set1_epi32(0x10)))
        };
        (q(lo, h_lo), q(hi, h_hi))
    }

    /// `fives8` with AVX-512, as floats offset by `table`: lane j is table[low 4 bits of column j's value], plus 16
    /// where its fifth bit is set (exact for integral tables of magnitude under 2^23).
    #[inline(always)]
    unsafe fn fives16(p: *const u8, table: __m512) -> __m512 {
        // the low 4 bits (bits above ignored) index the table
        let v = _mm512_permutexvar_ps(nibbles16(p.add(super::Q5_NIBBLES)), table);
        _mm512_mask_add_ps(v, (p as *const u16).read_unaligned(), v, _mm512_set1_ps(16.))
    }

    /// A packed q4_0 nibble pair (`super::Q4_0_LAYOUT`): value (q − 8) · d.
    #[derive(Clone, Copy)]
    #[repr(transparent)]
    pub(super) struct Q40(#[allow(dead_code)] u8);

    impl Panel for Q40 {
        const SLOTS: Option<[u32; NR]> = None;
        const LAYOUT: super::Layout = super::Q4_0_LAYOUT;
        const BLOCK: usize = 32;
        const DECODE_ROWS: usize = 4 * MR;
        scales_of!(i8);
        #[inline(always)]
        unsafe fn load(p: *const Q40, d: &[__m256; 4]) -> (__m256, __m256) {
            let (lo, hi) = nibbles8(p as *const u8);
            let v = |n: __m256i, d: __m256| {
                let q = _mm256_sub_epi32(_mm256_and_si256(n, _mm256_set1_epi32(0xF)), _mm256_set1_epi32(8));
                _mm256_mul_ps(_mm256_cvtepi32_ps(q), d)
            };
            (v(lo, d[0]), v(hi, d[1]))
        }
        #[inline(always)]
        unsafe fn load16(p: *const Q40, d: &[__m512; 2]) -> __m512 {
            // the nibble (bits above ignored) indexes q − 8
            let table = _mm512_setr_ps(-8., -7., -6., -5., -4., -3., -2., -1., 0., 1., 2., 3., 4., 5., 6., 7.);
            _mm512_mul_ps(_mm512_permutexvar_ps(nibbles16(p as *const u8), table), d[0])
        }
    }

    /// A packed q5_k byte (`super::Q5K_LAYOUT`): value (d · sc) · q − dmin · m as q4_k's, q of 5 bits as q5_0's.
    #[derive(Clone, Copy)]
    #[repr(transparent)]
    pub(super) struct Q5K(#[allow(dead_code)] u8);

    impl Panel for Q5K {
        const SLOTS: Option<[u32; NR]> = None;
        const LAYOUT: super::Layout = super::Q5K_LAYOUT;
        const BLOCK: usize = 32;
        const DECODE_ROWS: usize = 3 * MR;
        scales_of!(Q4);
        #[inline(always)]
        unsafe fn load(p: *const Q5K, d: &[__m256; 4]) -> (__m256, __m256) {
            let (lo, hi) = fives8(p as *const u8);
            let v = |q: __m256i, d: __m256, m: __m256| _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(q)), m);
            (v(lo, d[0], d[2]), v(hi, d[1], d[3]))
        }
        #[inline(always)]
        unsafe fn load16(p: *const Q5K, d: &[__m512; 2]) -> __m512 {
            let table = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
            _mm512_sub_ps(_mm512_mul_ps(d[0], fives16(p as *const u8, table)), d[1])
        }
    }

    /// A packed q4_k nibble pair (`super::Q4K_LAYOUT`): value (d · sc) · q − dmin · m, sc and m those of its
    /// sub-block of 32 depths.
    #[derive(Clone, Copy)]
    #[repr(transparent)]
    pub(super) struct Q4(#[allow(dead_code)] u8);

    impl Panel for Q4 {
        const SLOTS: Option<[u32; NR]> = None;
        const LAYOUT: super::Layout = super::Q4K_LAYOUT;
        const BLOCK: usize = 32;
        const DECODE_ROWS: usize = 4 * MR;
        #[inline(always)]
        unsafe fn scales(rec: *const u8, j: usize) -> [__m256; 4] {
            let ((d0, d1), (n0, n1)) = (f16x16(rec, 0), f16x16(rec, super::Q4K_DMIN));
            let ((s0, s1), (m0, m1)) = (u8x16(rec, super::Q4K_SCALES + NR * j), u8x16(rec, super::Q4K_MINS + NR * j));
            [_mm256_mul_ps(d0, s0), _mm256_mul_ps(d1, s1), _mm256_mul_ps(n0, m0), _mm256_mul_ps(n1, m1)]
        }
        #[inline(always)]
        unsafe fn scales16(rec: *const u8, j: usize) -> [__m512; 2] {
            let f16s = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(at) as *const __m256i));
            let u8s =
                |at: usize| _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(at) as *const __m128i)));
            let (dmin, sc, m) = (super::Q4K_DMIN, super::Q4K_SCALES + NR * j, super::Q4K_MINS + NR * j);
            [_mm512_mul_ps(f16s(0), u8s(sc)), _mm512_mul_ps(f16s(dmin), u8s(m))]
        }
        #[inline(always)]
        unsafe fn load(p: *const Q4, d: &[__m256; 4]) -> (__m256, __m256) {
            let (lo, hi) = nibbles8(p as *const u8);
            let v = |n: __m256i, d: __m256, m: __m256| {
                _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(n, _mm256_set1_epi32(0xF)))), m)
            };
            (v(lo, d[0], d[2]), v(hi, d[1], d[3]))
        }
        #[inline(always)]
        unsafe fn load16(p: *const Q4, d: &[__m512; 2]) -> __m512 {
            // the nibble (bits above ignored) indexes 0.0..15.0
            let table = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
            let q = _mm512_permutexvar_ps(nibbles16(p as *const u8), table);
            _mm512_sub_ps(_mm512_mul_ps(d[0], q), d[1])
        }
    }

    /// A packed q6_k byte (`super::Q6K_LAYOUT`): value (d · sc) · (q − 32), sc that of its sub-block of 16 depths,
    /// q's low 4 bits from the depth's nibbles, its high 2 from the bit pairs after them.
    #[derive(Clone, Copy)]
    #[repr(transparent)]
    pub(super) struct Q6(#[allow(dead_code)] u8);

    impl Panel for Q6 {
        const SLOTS: Option<[u32; NR]> = None;
        const LAYOUT: super::Layout = super::Q6K_LAYOUT;
        const BLOCK: usize = 16;
        const FULL512: usize = 3;
        const DECODE_ROWS: usize = 4 * MR;
        #[inline(always)]
        unsafe fn scales(rec: *const u8, j: usize) -> [__m256; 4] {
            let (d0, d1) = f16x16(rec, 0);
            let sc = _mm_loadu_si128(rec.add(super::Q6K_SCALES + NR * j) as *const __m128i);
            let s0 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc));
            let s1 = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128::<8>(sc)));
            [_mm256_mul_ps(d0, s0), _mm256_mul_ps(d1, s1), _mm256_setzero_ps(), _mm256_setzero_ps()]
        }
        #[inline(always)]
        unsafe fn scales16(rec: *const u8, j: usize) -> [__m512; 2] {
            let d = _mm512_cvtph_ps(_mm256_loadu_si256(rec as *const __m256i));
            let sc = _mm_loadu_si128(rec.add(super::Q6K_SCALES + NR * j) as *const __m128i);
            [_mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc))), _mm512_setzero_ps()]
        }
        #[inline(always)]
        unsafe fn load(p: *const Q6, d: &[__m256; 4]) -> (__m256, __m256) {
            let p = p as *const u8;
            let (lo, hi) = nibbles8(p);
            let (h_lo, h_hi) = pairs8(p.add(super::Q6K_HIGH));
            let q = |n: __m256i, h: __m256i, d: __m256| {
                let q = _mm256_or_si256(
                    _mm256_and_si256(n, _mm256_set1_epi32(0xF)),
                    _mm256_slli_epi32::<4>(_mm256_and_si256(h, _mm256_set1_epi32(3))),
                );
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(q, _mm256_set1_epi32(32))), d)
            };
            (q(lo, h_lo, d[0]), q(hi, h_hi, d[1]))
        }
        #[inline(always)]
        unsafe fn load16(p: *const Q6, d: &[__m512; 2]) -> __m512 {
            let p = p as *const u8;
            // the nibble (bits above ignored) indexes 0..15, the bit pair (the 2 bits above it: the next column's,
            // ignored) 16 · pair − 32; their sum is q − 32 (exact)
            let low = _mm512_setr_ps(0., 1., 2., 3., 4., 5., 6., 7., 8., 9., 10., 11., 12., 13., 14., 15.);
            let high =
                _mm512_setr_ps(-32., -16., 0., 16., -32., -16., 0., 16., -32., -16., 0., 16., -32., -16., 0., 16.);
            let h = pairs16(p.add(super::Q6K_HIGH));
            let q = _mm512_add_ps(_mm512_permutexvar_ps(nibbles16(p), low), _mm512_permutexvar_ps(h, high));
            _mm512_mul_ps(q, d[0])
        }
    }

    /// A depth's 16 bit pairs (4 bytes, column c at bits 2c, 2c + 1) at the bottom of each 32-bit lane, columns 0-7
    /// and 8-15 (higher bits: other columns' pairs).
    #[inline(always)]
    unsafe fn pairs8(p: *const u8) -> (__m256i, __m256i) {
        let h = _mm256_set1_epi32((p as *const i32).read_unaligned());
        (
            _mm256_srlv_epi32(h, _mm256_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14)),
            _mm256_srlv_epi32(h, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30)),
        )
    }

    /// `pairs8` with AVX-512: column j's pair at the bottom of lane j.
    #[inline(always)]
    unsafe fn pairs16(p: *const u8) -> __m512i {
        let h = _mm512_set1_epi32((p as *const i32).read_unaligned());
        _mm512_srlv_epi32(h, _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30))
    }

    /// A packed q3_k byte (`super::Q3K_LAYOUT`): value (d · sc) · (pair − 4 + 4 · high), sc that of its sub-block of
    /// 16 depths.
    #[derive(Clone, Copy)]
    #[repr(transparent)]
    pub(super) struct Q3K(#[allow(dead_code)] u8);

    impl Panel for Q3K {
        const SLOTS: Option<[u32; NR]> = None;
        const LAYOUT: super::Layout = super::Q3K_LAYOUT;
        const BLOCK: usize = 16;
        const DECODE_ROWS: usize = 3 * MR;
        scales_of!(Q6);
        #[inline(always)]
        unsafe fn load(p: *const Q3K, d: &[__m256; 4]) -> (__m256, __m256) {
            let p = p as *const u8;
            let (lo, hi) = pairs8(p.add(super::Q3K_PAIRS));
            // the high bits (and 2 pair bytes above them) in every lane; bit c moved to bit 2 of lane c
            let h = _mm256_set1_epi32((p as *const i32).read_unaligned());
            let h_lo = _mm256_srlv_epi32(_mm256_slli_epi32::<2>(h), _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7));
            let h_hi = _mm256_srlv_epi32(h, _mm256_setr_epi32(6, 7, 8, 9, 10, 11, 12, 13));
            let q = |n: __m256i, h: __m256i, d: __m256| {
                let u = _mm256_or_si256(
                    _mm256_and_si256(n, _mm256_set1_epi32(3)),
                    _mm256_and_si256(h, _mm256_set1_epi32(4)),
                );
                _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_sub_epi32(u, _mm256_set1_epi32(4))), d)
            };
            (q(lo, h_lo, d[0]), q(hi, h_hi, d[1]))
        }
        #[inline(always)]
        unsafe fn load16(p: *const Q3K, d: &[__m512; 2]) -> __m512 {
            let p = p as *const u8;
            // the pair (the 2 bits above it ignored) indexes pair − 4; a set high bit adds 4 (exact)
            let table = _mm512_setr_ps(-4., -3., -2., -1., -4., -3., -2., -1., -4., -3., -2., -1., -4., -3., -2., -1.);
            let v = _mm512_permutexvar_ps(pairs16(p.add(super::Q3K_PAIRS)), table);
            let v = _mm512_mask_add_ps(v, (p as *const u16).read_unaligned(), v, _mm512_set1_ps(4.));
            _mm512_mul_ps(v, d[0])
        }
    }

    /// A packed q2_k byte (`super::Q2K_LAYOUT`): value (d · sc) · q − dmin · m, sc and m those of its sub-block of 16
    /// depths.
    #[derive(Clone, Copy)]
    #[repr(transparent)]
    pub(super) struct Q2K(#[allow(dead_code)] u8);

    impl Panel for Q2K {
        const SLOTS: Option<[u32; NR]> = None;
        const LAYOUT: super::Layout = super::Q2K_LAYOUT;
        const BLOCK: usize = 16;
        const DECODE_ROWS: usize = 4 * MR;
        #[inline(always)]
        unsafe fn scales(rec: *const u8, j: usize) -> [__m256; 4] {
            let ((d0, d1), (n0, n1)) = (f16x16(rec, 0), f16x16(rec, super::Q4K_DMIN));
            let v = _mm_loadu_si128(rec.add(super::Q2K_SCALES + NR * j) as *const __m128i);
            let (lo, hi) = (_mm256_cvtepu8_epi32(v), _mm256_cvtepu8_epi32(_mm_srli_si128::<8>(v)));
            let sc = |b: __m256i| _mm256_cvtepi32_ps(_mm256_and_si256(b, _mm256_set1_epi32(0xF)));
            let m = |b: __m256i| _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(b));
            [_mm256_mul_ps(d0, sc(lo)), _mm256_mul_ps(d1, sc(hi)), _mm256_mul_ps(n0, m(lo)), _mm256_mul_ps(n1, m(hi))]
        }
        #[inline(always)]
        unsafe fn scales16(rec: *const u8, j: usize) -> [__m512; 2] {
            let f16s = |at: usize| _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(at) as *const __m256i));
            let b = _mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(super::Q2K_SCALES + NR * j) as *const __m128i));
            let sc = _mm512_cvtepi32_ps(_mm512_and_si512(b, _mm512_set1_epi32(0xF)));
            let m = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(b));
            [_mm512_mul_ps(f16s(0), sc), _mm512_mul_ps(f16s(super::Q4K_DMIN), m)]
        }
        #[inline(always)]
        unsafe fn load(p: *const Q2K, d: &[__m256; 4]) -> (__m256, __m256) {
            let (lo, hi) = pairs8(p as *const u8);
            let v = |n: __m256i, d: __m256, m: __m256| {
                _mm256_sub_ps(_mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_and_si256(n, _mm256_set1_epi32(3)))), m)
            };
            (v(lo, d[0], d[2]), v(hi, d[1], d[3]))
        }
        #[inline(always)]
        unsafe fn load16(p: *const Q2K, d: &[__m512; 2]) -> __m512 {
            // the pair (the 2 bits above it ignored) indexes 0.0..3.0
            let table = _mm512_setr_ps(0., 1., 2., 3., 0., 1., 2., 3., 0., 1., 2., 3., 0., 1., 2., 3.);
            let q = _mm512_permutexvar_ps(pairs16(p as *const u8), table);
            _mm512_sub_ps(_mm512_mul_ps(d[0], q), d[1])
        }
    }

    /// `tile` with AVX-512: a group in one register (lanes in `E::SLOTS` order), the x value of a row broadcast once
    /// per depth for all `P` groups. Each lane is the same in-order FMA chain as `tile`'s, so the same bits. `R` up to
    /// 2 · `MR` (`Tiles::TALL`): rows past `MR` are read from the next row panel of `a`.
    #[inline]
    #[target_feature(enable = "avx512f")]
    unsafe fn tile512<E: Panel, const R: usize, const P: usize>(
        kc: usize,
        a: *const f32,
        b: [Cursor<E>; P],
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        // lanes → columns (store) and columns → lanes (load) where the lanes are not in column order
        let (to_cols, to_lanes) = match E::SLOTS {
            Some(slots) => {
                let mut inv = [0u32; NR];
                for (j, &col) in slots.iter().enumerate() {
                    inv[col as usize] = j as u32;
                }
                let v = |x: [u32; NR]| _mm512_loadu_si512(x.as_ptr() as *const __m512i);
                (Some(v(inv)), Some(v(slots)))
            }
            None => (None, None),
        };
        let mut s = [[_mm512_setzero_ps(); P]; R];
        if acc {
            for (r, s) in s.iter_mut().enumerate() {
                for (q, s) in s.iter_mut().enumerate() {
                    let v = _mm512_loadu_ps(c.add(r * ldc + q * NR));
                    *s = match to_lanes {
                        Some(i) => _mm512_permutexvar_ps(i, v),
                        None => v,
                    };
                }
            }
        }
        // rows past `MR` (a tall tile) lie in the next row panel, MR · kc on (`x_at`)
        let (mut a, mut a1) = (a, a.wrapping_add(MR * kc));
        let (mut w0, fetch) = (b.map(|b| b.w), b.iter().any(|b| b.fetch));
        let mut d = [[_mm512_setzero_ps(); 2]; P];
        for p in 0..kc {
            next_scales(p, &b, &mut d, |r, j| E::scales16(r, j));
            if fetch {
                prefetch(&w0);
            }
            if R < MR {
                // few rows: each group's weights formed and used in turn (fewer live registers)
                let x: [__m512; R] = std::array::from_fn(|r| _mm512_set1_ps(x_at(a, a1, r)));
                for q in 0..P {
                    let w = E::load16(w0[q], &d[q]);
                    for (s, x) in s.iter_mut().zip(&x) {
                        s[q] = _mm512_fmadd_ps(*x, w, s[q]);
                    }
                }
            } else {
                let w: [__m512; P] = std::array::from_fn(|q| E::load16(w0[q], &d[q]));
                for (r, s) in s.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(x_at(a, a1, r));
                    for q in 0..P {
                        s[q] = _mm512_fmadd_ps(x, w[q], s[q]);
                    }
                }
            }
            a = a.add(MR);
            a1 = a1.wrapping_add(MR);
            for w in w0.iter_mut() {
                *w = w.add(E::LAYOUT.step);
            }
        }
        for (r, s) in s.iter().enumerate() {
            for (q, &v) in s.iter().enumerate() {
                let v = match to_cols {
                    Some(i) => _mm512_permutexvar_ps(i, v),
                    None => v,
                };
                _mm512_storeu_ps(c.add(r * ldc + q * NR), v);
            }
        }
    }

    /// Row r's x value at a depth of a tile's row panels: the panel at `a`, then (r >= `MR`) the next at `a1`.
    #[inline(always)]
    unsafe fn x_at(a: *const f32, a1: *const f32, r: usize) -> f32 {
        if r < MR {
            *a.add(r)
        } else {
            *a1.add(r - MR)
        }
    }

    /// A tile with fewer than `NR` valid columns (`R` rows, one group), through a full-width copy.
    #[allow(clippy::too_many_arguments)]
    unsafe fn edge_tile<T: Tiles, E: Panel, const R: usize>(
        kc: usize,
        a: *const f32,
        b: Cursor<E>,
        c: *mut f32,
        ldc: usize,
        cols: usize,
        acc: bool,
    ) {
        let mut t = [[0f32; NR]; R];
        if acc {
            for (r, t) in t.iter_mut().enumerate() {
                for (j, t) in t.iter_mut().enumerate().take(cols) {
                    *t = *c.add(r * ldc + j);
                }
            }
        }
        T::tile::<E, R, 1>(kc, a, [b], t.as_mut_ptr() as *mut f32, NR, acc);
        for (r, t) in t.iter().enumerate() {
            for (j, t) in t.iter().enumerate().take(cols) {
                *c.add(r * ldc + j) = *t;
            }
        }
    }

    /// c (`R` rows × `P` groups of `NR` columns, row stride ldc) = (acc ? c : 0) + Σ_p a_p ⊗ b_p over kc depths, one
    /// FMA per element and depth in order. `a`: packed x (`MR` values per depth, the first `R` used); `b[q]`: group
    /// q's weights, `NR` per depth. Whatever `R` and `P`, each element is the same chain.
    #[inline]
    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn tile<E: Panel, const R: usize, const P: usize>(
        kc: usize,
        a: *const f32,
        b: [Cursor<E>; P],
        c: *mut f32,
        ldc: usize,
        acc: bool,
    ) {
        let mut s = [[[_mm256_setzero_ps(); 2]; P]; R];
        if acc {
            for (r, s) in s.iter_mut().enumerate() {
                for (q, s) in s.iter_mut().enumerate() {
                    s[0] = _mm256_loadu_ps(c.add(r * ldc + q * NR));
                    s[1] = _mm256_loadu_ps(c.add(r * ldc + q * NR + 8));
                }
            }
        }
        let (mut a, mut w0, fetch) = (a, b.map(|b| b.w), b.iter().any(|b| b.fetch));
        let mut d = [[_mm256_setzero_ps(); 4]; P];
        for p in 0..kc {
            next_scales(p, &b, &mut d, |r, j| E::scales(r, j));
            if fetch {
                prefetch(&w0);
            }
            if P == 1 {
                let (b0, b1) = E::load(w0[0], &d[0]);
                for (r, s) in s.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*a.add(r));
                    s[0][0] = _mm256_fmadd_ps(x, b0, s[0][0]);
                    s[0][1] = _mm256_fmadd_ps(x, b1, s[0][1]);
                }
            } else {
                // few rows, several groups: each x value broadcast once per depth
                let x: [__m256; R] = std::array::from_fn(|r| _mm256_broadcast_ss(&*a.add(r)));
                for q in 0..P {
                    let (b0, b1) = E::load(w0[q], &d[q]);
                    for (r, s) in s.iter_mut().enumerate() {
                        s[q][0] = _mm256_fmadd_ps(x[r], b0, s[q][0]);
                        s[q][1] = _mm256_fmadd_ps(x[r], b1, s[q][1]);
                    }
                }
            }
            a = a.add(MR);
            for w in w0.iter_mut() {
                *w = w.add(E::LAYOUT.step);
            }
        }
        for (r, s) in s.iter().enumerate() {
            for (q, s) in s.iter().enumerate() {
                _mm256_storeu_ps(c.add(r * ldc + q * NR), s[0]);
                _mm256_storeu_ps(c.add(r * ldc + q * NR + 8), s[1]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::blocks::QuantFormat;

    fn randn(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E3779B97F4A7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    /// Products in f64 of the same operands: every path must be within f32 rounding of it.
    fn reference(x: &[f32], m: usize, k: usize, w: &[f32], n: usize) -> Vec<f64> {
        let mut y = vec![0f64; m * n];
        for r in 0..m {
            for c in 0..n {
                y[r * n + c] = (0..k).map(|i| x[r * k + i] as f64 * w[c * k + i] as f64).sum();
            }
        }
        y
    }

    fn close(got: &[f32], want: &[f64], k: usize) {
        assert_eq!(got.len(), want.len());
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            assert!((*g as f64 - w).abs() <= 1e-5 * k as f64, "element {i}: {g} vs {w}");
        }
    }

    #[test]
    fn panels_match_a_reference_for_every_weight_form_and_split() {
        // n not a multiple of the panel width, several panels, serial and parallel splits; and tiny matrices
        // (8300 rows of 256: two panels)
        for (m, k, n) in [(67usize, 256usize, 530usize), (5, 256, 8300), (70, 32, 5), (3, 32, 1)] {
            one_shape(m, k, n);
        }
    }

    fn one_shape(m: usize, k: usize, n: usize) {
        let x = randn(m * k, 1);
        let w = randn(n * k, 2);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wb32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let format = if k.is_multiple_of(256) { QuantFormat::Q4K } else { QuantFormat::Q8_0 };
        let q = QMatrix::quantize(
            &candle_core::Tensor::from_vec(w.clone(), (n, k), &candle_core::Device::Cpu).unwrap(),
            format,
        )
        .unwrap();
        let mut wq = vec![0f32; n * k];
        q.dequantize_rows(0, n, &mut wq);
        for par in [usize::MAX, 1] {
            close(&matmul_t(&x, m, k, Source::F32(&w), n, par), &reference(&x, m, k, &w, n), k);
            close(&matmul_t(&x, m, k, Source::Bf16(&wb), n, par), &reference(&x, m, k, &wb32, n), k);
            close(&matmul_t(&x, m, k, Source::Quant(&q), n, par), &reference(&x, m, k, &wq, n), k);
        }
    }

    #[test]
    fn bf16_and_quantized_panels_equal_the_f32_path_on_the_same_values() {
        // widening and dequantizing are exact, so the products are those of the f32 matrix holding the same values
        let (m, k, n) = (100, 512, 300);
        let x = randn(m * k, 3);
        let w = randn(n * k, 4);
        let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
        let wb32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
        let par = 1;
        assert_eq!(matmul_t(&x, m, k, Source::Bf16(&wb), n, par), matmul_t(&x, m, k, Source::F32(&wb32), n, par));
        let q = QMatrix::quantize(
            &candle_core::Tensor::from_vec(w, (n, k), &candle_core::Device::Cpu).unwrap(),
            QuantFormat::Q8_0,
        )
        .unwrap();
        let mut wq = vec![0f32; n * k];
        q.dequantize_rows(0, n, &mut wq);
        assert_eq!(matmul_t(&x, m, k, Source::Quant(&q), n, par), matmul_t(&x, m, k, Source::F32(&wq), n, par));
    }

    /// The packed product's tile sets this CPU runs: AVX2 (false), and AVX-512 (true) where it has it.
    fn widths() -> impl Iterator<Item = bool> + Clone {
        #[cfg(target_arch = "x86_64")]
        let wide = Cpu::get().avx512();
        #[cfg(not(target_arch = "x86_64"))]
        let wide = false;
        [false, true].into_iter().filter(move |&w| !w || wide)
    }

    /// The packed product's contract: each element is the in-order f32 fused-multiply-add chain over k from 0; the
    /// AVX2 and AVX-512 tiles alike.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn packed_elements_are_the_in_order_fma_chain_whatever_the_rows_and_split() {
        if !Cpu::get().avx2() {
            return;
        }
        // tails in every dimension (m not a multiple of 6 or of the 144-row block, n of 16 or of a task, k of 256),
        // several depth blocks, serial and parallel
        for (m, k, n) in [(151usize, 600usize, 141usize), (1, 257, 16), (7, 31, 3), (13, 512, 300)] {
            let x = randn(m * k, 5);
            let w = randn(n * k, 6);
            let want: Vec<f32> = (0..m * n)
                .map(|e| {
                    let (r, c) = (e / n, e % n);
                    (0..k).fold(0f32, |acc, i| x[r * k + i].mul_add(w[c * k + i], acc))
                })
                .collect();
            for (par, wide) in [usize::MAX, 1].into_iter().flat_map(|p| widths().map(move |w| (p, w))) {
                let mm = |x: &[f32], m: usize| matmul_t_with(x, m, k, Source::F32(&w), n, par, wide);
                assert_eq!(mm(&x, m), want, "{m}x{k}x{n} par {par} avx512 {wide}");
                // a row alone gives its bits in the stacked product
                let r = m / 2;
                assert_eq!(mm(&x[r * k..(r + 1) * k], 1), want[r * n..(r + 1) * n]);
            }
        }
    }

    fn tensor<T: candle_core::WithDType>(v: Vec<T>, n: usize, k: usize) -> candle_core::Tensor {
        candle_core::Tensor::from_vec(v, (n, k), &candle_core::Device::Cpu).unwrap()
    }

    /// A matrix packed at load gives every element as the in-order FMA chain, for every row count (each tile
    /// shape: the 6-row tile, the last 1-5 rows over 1-4 groups, partial groups), alone or stacked, serial or in
    /// parallel; and the same bits as the row-major matrix packed per call.
    #[test]
    fn packed_at_load_is_the_in_order_chain_for_every_window() {
        if !PackedMatrix::available() {
            return;
        }
        for (k, n) in [(300usize, 141usize), (64, 16), (257, 200), (31, 7), (512, 1030), (96, 37), (256, 45)] {
            let w = randn(n * k, 7);
            let wb: Vec<bf16> = w.iter().map(|&v| bf16::from_f32(v)).collect();
            let wb32: Vec<f32> = wb.iter().map(|v| v.to_f32()).collect();
            let pf = PackedMatrix::from_tensor(&tensor(w.clone(), n, k)).unwrap().unwrap();
            let pb = PackedMatrix::from_tensor(&tensor(wb.clone(), n, k)).unwrap().unwrap();
            assert_eq!((pf.dtype(), pb.dtype()), (Some(candle_core::DType::F32), Some(candle_core::DType::BF16)));
            // the block formats (rows of whole blocks): the chain over their dequantized values
            let quants: Vec<(QuantFormat, PackedMatrix, Vec<f32>)> = [
                QuantFormat::Q8_0,
                QuantFormat::Q5_0,
                QuantFormat::Q4K,
                QuantFormat::Q6K,
                QuantFormat::Q4_0,
                QuantFormat::Q5K,
                QuantFormat::Q3K,
                QuantFormat::Q2K,
            ]
            .into_iter()
            .filter(|f| k.is_multiple_of(f.block_values()))
            .map(|f| {
                let q = QMatrix::quantize(&tensor(w.clone(), n, k), f).unwrap();
                let mut wq = vec![0f32; n * k];
                q.dequantize_rows(0, n, &mut wq);
                (f, PackedMatrix::from_quant(&q).unwrap().expect("the format packs"), wq)
            })
            .collect();
            let x = randn(31 * k, 8);
            let chain = |w: &[f32], m: usize| -> Vec<f32> {
                (0..m * n)
                    .map(|e| {
                        let (r, c) = (e / n, e % n);
                        (0..k).fold(0f32, |acc, i| x[r * k + i].mul_add(w[c * k + i], acc))
                    })
                    .collect()
            };
            // (from `Panel::DECODE_ROWS` rows on, the 4- to 6-bit formats are decoded before the tiles run)
            for m in (1..=13).chain([20, 24, 31]) {
                let (want_f, want_b) = (chain(&w, m), chain(&wb32, m));
                let want_q: Vec<Vec<f32>> = quants.iter().map(|(_, _, wq)| chain(wq, m)).collect();
                for (par, wide) in [usize::MAX, 1].into_iter().flat_map(|p| widths().map(move |w| (p, w))) {
                    let mm = |x: &[f32], m: usize, w| matmul_t_with(x, m, k, w, n, par, wide);
                    let xs = &x[..m * k];
                    let at = format!("{m}x{k}x{n} par {par} avx512 {wide}");
                    assert_eq!(mm(xs, m, Source::Packed(&pf)), want_f, "f32 {at}");
                    assert_eq!(mm(xs, m, Source::Packed(&pb)), want_b, "bf16 {at}");
                    assert_eq!(mm(xs, m, Source::Bf16(&wb)), want_b, "per call {at}");
                    let r = m - 1;
                    assert_eq!(mm(&x[r * k..(r + 1) * k], 1, Source::Packed(&pb)), want_b[r * n..(r + 1) * n]);
                    for ((f, pq, _), want_q) in quants.iter().zip(&want_q) {
                        let f = f.name();
                        assert_eq!(mm(xs, m, Source::Packed(pq)), *want_q, "{f} {at}");
                        let one = &want_q[r * n..(r + 1) * n];
                        assert_eq!(mm(&x[r * k..(r + 1) * k], 1, Source::Packed(pq)), one, "{f} row {r} alone, {at}");
                    }
                }
            }
        }
    }

    #[test]
    fn packed_block_formats_rows_stacks_and_bytes() {
        if !PackedMatrix::available() {
            return;
        }
        let k = 512;
        for (f, bytes_per_256) in [
            (QuantFormat::Q8_0, 8 * 34),
            (QuantFormat::Q5_0, 8 * 22),
            (QuantFormat::Q4K, 128 + 20),
            (QuantFormat::Q6K, 210),
            (QuantFormat::Q4_0, 8 * 18),
            (QuantFormat::Q5K, 176 + 4),
            (QuantFormat::Q3K, 110 + 4),
            (QuantFormat::Q2K, 84),
        ] {
            let q = |n: usize, seed: u64| QMatrix::quantize(&tensor(randn(n * k, seed), n, k), f).unwrap();
            let (a, b) = (q(32, 11), q(21, 12));
            let (pa, pb) =
                (PackedMatrix::from_quant(&a).unwrap().unwrap(), PackedMatrix::from_quant(&b).unwrap().unwrap());
            assert_eq!(pb.dtype(), None);
            // per 256 values: q8_0, q6_k, q5_0, q4_0 and q2_k their blocks' bytes; q5_k, q4_k and q3_k theirs and 4
            // more (their 6-bit scales, and mins, a byte each), for the rows padded to a whole group
            assert_eq!(pb.bytes(), 32 * k / 256 * bytes_per_256, "{}", f.name());
            let mut want = vec![0f32; 53 * k];
            a.dequantize_rows(0, 32, &mut want[..32 * k]);
            b.dequantize_rows(0, 21, &mut want[32 * k..]);
            let st = PackedMatrix::stack(&[&pa, &pb]).unwrap().expect("whole groups stack");
            let mut got = vec![0f32; 53 * k];
            st.rows_into(0, 53, &mut got);
            assert_eq!(got, want, "{}", f.name());
            // not with another kind or format, nor after a partial group
            let dense = PackedMatrix::from_tensor(&tensor(randn(32 * k, 13), 32, k)).unwrap().unwrap();
            assert!(PackedMatrix::stack(&[&pa, &dense]).unwrap().is_none());
            assert!(PackedMatrix::stack(&[&pb, &pa]).unwrap().is_none());
            let other = if f == QuantFormat::Q8_0 { QuantFormat::Q5_0 } else { QuantFormat::Q8_0 };
            let po = PackedMatrix::from_quant(&QMatrix::quantize(&tensor(randn(32 * k, 15), 32, k), other).unwrap());
            assert!(PackedMatrix::stack(&[&pa, &po.unwrap().unwrap()]).unwrap().is_none());
        }
    }

    #[test]
    fn packed_rows_and_stacks_are_exact() {
        if !PackedMatrix::available() {
            return;
        }
        let k = 40;
        let (a, b) = (randn(32 * k, 9), randn(21 * k, 10));
        let ab: Vec<bf16> = a.iter().chain(&b).map(|&v| bf16::from_f32(v)).collect();
        for bf in [false, true] {
            let t = |v: &[f32], n: usize| {
                let t = tensor(v.to_vec(), n, k);
                if bf {
                    t.to_dtype(candle_core::DType::BF16).unwrap()
                } else {
                    t
                }
            };
            let (pa, pb) = (
                PackedMatrix::from_tensor(&t(&a, 32)).unwrap().unwrap(),
                PackedMatrix::from_tensor(&t(&b, 21)).unwrap().unwrap(),
            );
            let want: Vec<f32> =
                if bf { ab.iter().map(|v| v.to_f32()).collect() } else { a.iter().chain(&b).copied().collect() };
            let st = PackedMatrix::stack(&[&pa, &pb]).unwrap().expect("whole groups stack");
            assert_eq!((st.n, st.k), (53, k));
            let mut got = vec![0f32; 53 * k];
            st.rows_into(0, 53, &mut got);
            assert_eq!(got, want);
            let mut one = vec![0f32; k];
            pb.rows_into(20, 1, &mut one);
            assert_eq!(one, want[52 * k..]);
            // a first part of 21 rows has a partial group: no stack
            assert!(PackedMatrix::stack(&[&pb, &pa]).unwrap().is_none());
            assert_eq!(st.bytes(), 64 * k * if bf { 2 } else { 4 });
        }
    }
}
