//! `PackedMatrix`: a weight matrix packed once at load for the packed product (`x86`), its layout (groups of
//! `GROUP` output columns, k-major; bf16 slots; a block format's values and scale records), and reading its values
//! back (`rows_into`, `block_value`).

use crate::kernels::blocks::{QMatrix, QuantFormat};
use crate::kernels::cpu::Cpu;
use crate::kernels::records::*;
use half::bf16;
use rayon::prelude::*;

/// Where column c's 4-bit value sits among a depth's 16 nibbles (of its 8 bytes read as a little-endian u64):
/// columns 2i and 2i + 1 are nibble i of the low and of the high 32-bit half, so that one 64-bit broadcast and a
/// shift per 32-bit lane bring column j's nibble to the bottom of lane j.
pub(super) fn nibble(c: usize) -> usize {
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
/// tile forms each value in registers exactly as the format's dequantization does ([`QMatrix::dequantize_rows`]), so
/// a quantized matrix computes exactly as its dequantized f32 matrix packed.
pub struct PackedMatrix {
    pub n: usize,
    pub k: usize,
    pub(super) data: PackedData,
}

pub(super) enum PackedData {
    F32(Vec<f32>),
    /// bf16 bit patterns in the slot order above
    Bf16(Vec<u16>),
    /// A block format: its values ([`Layout::step`] bytes per depth of a group, group g's from g · k · step) and
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
/// [`Layout::step`] bytes per depth) and its scale record (`s`, `pack_record`).
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
