//! Quantized matrices multiplied with integer dot products on 8-bit activations (the `int8_activations` load
//! option), as llama.cpp multiplies its block formats.
//!
//! The default quantized path (`panels`) forms every weight in f32 and multiplies it with the f32 activation: exact,
//! but a one-row product then costs 4-7 vector instructions per 16 weights and runs below the memory's speed
//! (benches/RESULTS.md, issue #18). Here each row of x is rounded to 8 bits per block of 32 values (`Acts`: a scale
//! `amax / 127` and the nearest integers, ties to even), and each block of a weight column is multiplied with it
//! by AVX-512 VNNI (`vpdpbusd`: 64 products of unsigned and signed bytes summed into 16 32-bit lanes per
//! instruction; on CPUs with AVX2 only, `vpmaddubsw` + `vpmaddwd` do the same per 8 lanes: `Isa`), the block's
//! integer sum then scaled in f32. This changes the numbers: a product is the dot product
//! of the dequantized weights with the *rounded* activations (relative error about 2⁻⁹ per activation), not with
//! x itself, so it is opt-in.
//!
//! Numerics (what is computed, and why it is the same everywhere): for output column c and row r, over the row's
//! 32-value blocks b (k order), with `xq` the rounded activations, `dx_b` the block's scale and the format's
//! integer weights `q` (stored unsigned, with the format's offset applied through the block sums of `xq`):
//! - q8_0 / q4_0 / q5_0: `acc = fma(f32(Σ (q − o)·xq), d_c·dx_b, acc)` (o = 128, 8, 16; q8_0's bytes held + 128)
//! - q4_k / q5_k (sub-block j = b's place in its super-block): `acc = fma(f32(Σ q·xq), (d_c·sc_cj)·dx_b, acc)`,
//!   then `acc = fma(−(dmin_c·m_cj), dx_b·f32(Σ xq), acc)`
//! - q6_k, per 16-value sub-block j: `acc = fma(f32(Σ (q − 32)·xq), (d_c·sc_cj)·dx_b, acc)`
//!
//! The integer sums are exact, so a row's result depends on its own values and W only: not on the other rows of
//! the window, the tiling, the threads or the instruction set (`dot_scalar` is the same arithmetic without SIMD; the
//! tests hold the two bit for bit). Formats without such a kernel (q3_k, q2_k) stay on the f32 path.
//!
//! Layout (`DotMatrix`): output columns in groups of 16 (one per 32-bit lane), each group a run of records, one per
//! scale block of the format (32 values for q8_0 / q4_0 / q5_0, 256 for the k-quants): the record's scales (as
//! `panels`' packed records: 16 f16 d, then dmin, 6-bit scales and mins, or 8-bit signed scales), then its values
//! arranged so that one 64-byte load gives each lane 4 consecutive depths of its column:
//! - q8_0: per 4 depths a 64-byte "quad" (lane c: column c's 4 bytes + 128).
//! - nibbles: per 8 depths a 64-byte "octet" (lane c's byte i: depth i in the low nibble, depth 4 + i in the high).
//! - q5_0 / q5_k: per 32 depths, 4 octets of low nibbles and 64 bytes of fifth bits (lane c's byte i, bit u: depth
//!   4u + i).
//! - q6_k: per 16 depths, 2 octets of low nibbles and 64 bytes of high pairs (lane c's byte i, bits 2u, 2u + 1:
//!   depth 4u + i).
//!
//! The bytes are the format's own (q4_k and q5_k: 4 bytes more per 256 values and column, the scales a byte each).

// Output columns per group (the lanes of a 512-bit register of 32-bit sums): `panels`' groups, whose scale records
// these matrices share (`records::pack_record`: d at 0, then q4_k's dmin, 6-bit scales and mins, or q6_k's signed
// scales).
use crate::kernels::blocks::{QMatrix, QuantFormat};
use crate::kernels::cpu::Cpu;
use crate::kernels::records::{pack_record, record_bytes, GROUP, Q4K_DMIN as DMIN, Q4K_MINS as K4_MINS};
use crate::kernels::records::{Q4K_SCALES as K4_SCALES, Q6K_SCALES as K6_SCALES};
use crate::kernels::simd::Out;
use half::f16;
use rayon::prelude::*;

/// Values per activation block (one scale each).
const ABLOCK: usize = 32;
/// x rows per register tile.
const MAX_TILE: usize = 8;
/// Column groups per parallel task at most.
const MAX_TASK_GROUPS: usize = 8;

/// Where a record's f16 d sit (bytes from the record's start).
const D: usize = 0;
/// Bytes of one 64-byte arrangement (a quad, an octet, a plane of fifth bits or of high pairs).
const VEC: usize = 64;

/// How a format is held: depths per record, bytes of its scales, bytes of its values.
#[derive(Clone, Copy)]
struct Shape {
    depths: usize,
    scales: usize,
    values: usize,
}

impl Shape {
    fn bytes(self) -> usize {
        self.scales + self.values
    }
}

/// The formats multiplied here, and how each is held (a record: `panels`' scale record, then the values).
fn shape(format: QuantFormat) -> Option<Shape> {
    let values = match format {
        QuantFormat::Q8_0 => 8 * VEC,
        QuantFormat::Q4_0 => 4 * VEC,
        QuantFormat::Q5_0 => 5 * VEC,
        QuantFormat::Q4K => 32 * VEC,
        QuantFormat::Q5K => 40 * VEC,
        QuantFormat::Q6K => 48 * VEC,
        QuantFormat::Q3K | QuantFormat::Q2K => return None,
    };
    Some(Shape { depths: format.block_values(), scales: record_bytes(format), values })
}

/// `$rows!(kernel)` with the kernel of `$format`: each instruction set's module has one per format, named after it.
#[cfg(target_arch = "x86_64")]
macro_rules! per_format {
    ($format:expr, $rows:ident) => {
        match $format {
            QuantFormat::Q8_0 => $rows!(q8_0),
            QuantFormat::Q4_0 => $rows!(q4_0),
            QuantFormat::Q5_0 => $rows!(q5_0),
            QuantFormat::Q4K => $rows!(q4_k),
            QuantFormat::Q5K => $rows!(q5_k),
            QuantFormat::Q6K => $rows!(q6_k),
            QuantFormat::Q3K | QuantFormat::Q2K => unreachable!("no integer layout"),
        }
    };
}

/// `$v` shifted by `$by` bits within 16-bit lanes (left where positive, right where negative; -6 to 4: the moves of
/// a fifth bit or a high pair to bits 4-5), with the instruction set's shift intrinsics.
#[cfg(target_arch = "x86_64")]
macro_rules! shift16 {
    ($v:expr, $by:expr, $slli:ident, $srli:ident) => {
        match $by {
            4 => $slli::<4>($v),
            3 => $slli::<3>($v),
            2 => $slli::<2>($v),
            1 => $slli::<1>($v),
            0 => $v,
            -1 => $srli::<1>($v),
            -2 => $srli::<2>($v),
            -3 => $srli::<3>($v),
            -4 => $srli::<4>($v),
            -5 => $srli::<5>($v),
            -6 => $srli::<6>($v),
            _ => unreachable!("a shift of {} bits", $by),
        }
    };
}

/// The integer offset of a format's stored values (its value is q − offset before the scales).
fn offset(format: QuantFormat) -> i32 {
    match format {
        QuantFormat::Q8_0 => 128,
        QuantFormat::Q4_0 => 8,
        QuantFormat::Q5_0 => 16,
        QuantFormat::Q6K => 32,
        _ => 0,
    }
}

/// A quantized matrix (n × k) held for integer dot products (see the module's layout).
pub struct DotMatrix {
    pub n: usize,
    pub k: usize,
    pub format: QuantFormat,
    data: Vec<u8>,
}

/// The instruction sets the products run on: the same bits on each.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Isa {
    /// `dot_scalar`: any CPU (the reference; slow)
    Scalar,
    /// AVX2 (+ FMA, F16C): `vpmaddubsw` + `vpmaddwd`, 8 columns per register
    Avx2,
    /// AVX-512 F, BW and VNNI: `vpdpbusd`, 16 columns per register
    Vnni,
}

impl Isa {
    /// The best this CPU runs.
    pub fn best() -> Isa {
        let cpu = Cpu::get();
        if cpu.vnni() {
            Isa::Vnni
        } else if cpu.avx2() {
            Isa::Avx2
        } else {
            Isa::Scalar
        }
    }

    /// Whether this CPU runs it.
    pub fn runs(self) -> bool {
        match self {
            Isa::Scalar => true,
            Isa::Avx2 => Isa::best() != Isa::Scalar,
            Isa::Vnni => Isa::best() == Isa::Vnni,
        }
    }

    /// x rows per register tile (AVX2 has 16 registers, AVX-512 32).
    fn tile(self) -> usize {
        match self {
            Isa::Avx2 => 4,
            Isa::Vnni | Isa::Scalar => MAX_TILE,
        }
    }
}

/// Whether this CPU runs the integer dot products at a usable speed (AVX2 or AVX-512 VNNI; `dot_scalar` runs
/// anywhere, but streams a model at a fraction of the memory's speed).
pub fn available() -> bool {
    Isa::best() != Isa::Scalar
}

/// Where depth p (within a record) of column c sits, for the arrangements above: (byte, bit shift, bits).
fn place(format: QuantFormat, c: usize, p: usize) -> [(usize, u32, u8); 2] {
    let lane = 4 * c + p % 4;
    // low part: a byte of a quad, or a nibble of an octet
    let nibble = |base: usize, p: usize| (base + p / 8 * VEC + lane, 4 * ((p % 8 / 4) as u32), 0xF);
    match format {
        QuantFormat::Q8_0 => [(p / 4 * VEC + lane, 0, 0xFF), (0, 0, 0)],
        QuantFormat::Q4_0 | QuantFormat::Q4K => [nibble(0, p), (0, 0, 0)],
        QuantFormat::Q5_0 | QuantFormat::Q5K => {
            let base = p / 32 * 5 * VEC;
            [nibble(base, p % 32), (base + 4 * VEC + lane, (p % 32 / 4) as u32, 1)]
        }
        QuantFormat::Q6K => {
            let base = p / 16 * 3 * VEC;
            [nibble(base, p % 16), (base + 2 * VEC + lane, 2 * (p % 16 / 4) as u32, 3)]
        }
        QuantFormat::Q3K | QuantFormat::Q2K => unreachable!("no integer layout"),
    }
}

/// The stored (unsigned) value at depth p of column c among a record's values.
fn get(format: QuantFormat, values: &[u8], c: usize, p: usize) -> i32 {
    let [(b0, s0, m0), (b1, s1, m1)] = place(format, c, p);
    let low = ((values[b0] >> s0) & m0) as i32;
    if m1 == 0 {
        low
    } else {
        low | ((((values[b1] >> s1) & m1) as i32) << 4)
    }
}

fn put(format: QuantFormat, values: &mut [u8], c: usize, p: usize, q: u8) {
    let [(b0, s0, m0), (b1, s1, m1)] = place(format, c, p);
    values[b0] |= (q & m0) << s0;
    if m1 != 0 {
        values[b1] |= ((q >> 4) & m1) << s1;
    }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_le_bytes([b[i], b[i + 1]]).to_f32()
}

impl DotMatrix {
    /// A quantized matrix rearranged for the integer dot products; None for a format without them; an error when
    /// the copy cannot be allocated.
    pub fn from_quant(m: &QMatrix) -> crate::error::Result<Option<DotMatrix>> {
        let (format, n, k) = (m.format, m.n, m.k);
        let Some(sh) = shape(format) else { return Ok(None) };
        let (bb, rb) = (format.block_bytes(), m.row_bytes());
        let per_group = k / sh.depths * sh.bytes();
        let groups = n.div_ceil(GROUP);
        let mut data = Vec::new();
        if data.try_reserve_exact(groups * per_group).is_err() {
            return Err(crate::error::Error::load(format!(
                "cannot allocate the integer-product copy of a {n}x{k} {} matrix",
                format.name()
            )));
        }
        data.resize(groups * per_group, 0u8);
        let src = m.bytes();
        data.par_chunks_mut(per_group.max(1)).enumerate().for_each(|(g, dst)| {
            for c in 0..GROUP.min(n - g * GROUP) {
                let row = &src[(g * GROUP + c) * rb..(g * GROUP + c + 1) * rb];
                for (b, block) in row.chunks_exact(bb).enumerate() {
                    let rec = &mut dst[b * sh.bytes()..(b + 1) * sh.bytes()];
                    let (s, v) = rec.split_at_mut(sh.scales);
                    pack_block(format, block, c, s, v);
                }
            }
        });
        Ok(Some(DotMatrix { n, k, format, data }))
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.data.len()
    }

    fn shape(&self) -> Shape {
        shape(self.format).expect("a DotMatrix has a shape")
    }

    /// Group g's records.
    fn group(&self, g: usize) -> &[u8] {
        let per_group = self.k / self.shape().depths * self.shape().bytes();
        &self.data[g * per_group..(g + 1) * per_group]
    }

    /// Rows [first, first + count) of W dequantized (f32, as the format's dequantization forms them) into `dst`.
    pub fn rows_into(&self, first: usize, count: usize, dst: &mut [f32]) {
        let (k, sh) = (self.k, self.shape());
        assert!(first + count <= self.n && dst.len() == count * k);
        for (i, out) in dst.chunks_mut(k.max(1)).enumerate() {
            let (g, c) = ((first + i) / GROUP, (first + i) % GROUP);
            for (rec, out) in self.group(g).chunks_exact(sh.bytes()).zip(out.chunks_mut(sh.depths)) {
                let (s, v) = rec.split_at(sh.scales);
                for (p, o) in out.iter_mut().enumerate() {
                    *o = value(self.format, s, v, c, p);
                }
            }
        }
    }

    /// Matrices of one format and width stacked (rows one after another), when every one but the last has whole
    /// groups; None otherwise.
    pub fn stack(parts: &[&DotMatrix]) -> crate::error::Result<Option<DotMatrix>> {
        let Some(first) = parts.first() else { return Ok(None) };
        let whole = parts[..parts.len() - 1].iter().all(|p| p.n.is_multiple_of(GROUP));
        if !whole || parts.iter().any(|p| p.k != first.k || p.format != first.format) {
            return Ok(None);
        }
        let len = parts.iter().map(|p| p.data.len()).sum();
        let mut data = Vec::new();
        if data.try_reserve_exact(len).is_err() {
            return Err(crate::error::Error::load(format!("cannot allocate a stacked matrix of {len} bytes")));
        }
        for p in parts {
            data.extend_from_slice(&p.data);
        }
        Ok(Some(DotMatrix { n: parts.iter().map(|p| p.n).sum(), k: first.k, format: first.format, data }))
    }
}

/// Column c's block of a row (`block`: the format's bytes) into a record's scales `s` (`panels::pack_record`) and
/// values `v`.
fn pack_block(format: QuantFormat, block: &[u8], c: usize, s: &mut [u8], v: &mut [u8]) {
    pack_record(format, block, c, s);
    for p in 0..format.block_values() {
        let q = match format {
            QuantFormat::Q8_0 => (block[2 + p] as i8 as i32 + 128) as u8,
            QuantFormat::Q4_0 => crate::kernels::blocks::q4_0_value(block, p),
            QuantFormat::Q5_0 => crate::kernels::blocks::q5_0_value(block, p),
            QuantFormat::Q4K => crate::kernels::blocks::q4k_value(block, p),
            QuantFormat::Q5K => crate::kernels::blocks::q5k_value(&block[48..176], &block[16..48], p / 32, p % 32),
            QuantFormat::Q6K => (crate::kernels::blocks::q6k_value(block, p) + 32) as u8,
            QuantFormat::Q3K | QuantFormat::Q2K => unreachable!("no integer layout"),
        };
        put(format, v, c, p, q);
    }
}

/// Column c's weight at depth p of a record (scales `s`, values `v`), as the format's dequantization forms it.
fn value(format: QuantFormat, s: &[u8], v: &[u8], c: usize, p: usize) -> f32 {
    let q = get(format, v, c, p);
    let d = f16_at(s, D + 2 * c);
    match format {
        QuantFormat::Q4K | QuantFormat::Q5K => {
            let j = p / 32;
            let d1 = d * s[K4_SCALES + GROUP * j + c] as f32;
            let m1 = f16_at(s, DMIN + 2 * c) * s[K4_MINS + GROUP * j + c] as f32;
            d1 * q as f32 - m1
        }
        QuantFormat::Q6K => d * (s[K6_SCALES + GROUP * (p / 16) + c] as i8) as f32 * (q - 32) as f32,
        _ => (q - offset(format)) as f32 * d,
    }
}

/// Rows of x rounded to 8 bits per block of `ABLOCK` values: for row r and block b, the scale `d[r·kb + b]`
/// (amax / 127), the integers `q[r·k ..]` (x / d to nearest, ties to even; 0 where amax is 0), the sums of the
/// integers per 16 values `s16` and per block `s32`, and `dx_b · f32(s32)` (`xs`).
pub struct Acts {
    k: usize,
    q: Vec<i8>,
    d: Vec<f32>,
    s16: Vec<i32>,
    s32: Vec<i32>,
    xs: Vec<f32>,
}

impl Acts {
    /// x (m × k, k a multiple of `ABLOCK`) rounded with `isa`'s instructions (which the CPU must run:
    /// `Isa::runs`; the same values on each).
    pub fn new(x: &[f32], m: usize, k: usize, isa: Isa) -> Acts {
        assert!(isa.runs());
        assert!(k.is_multiple_of(ABLOCK) && x.len() == m * k);
        let kb = k / ABLOCK;
        let mut a = Acts {
            k,
            q: vec![0; m * k],
            d: vec![0.0; m * kb],
            s16: vec![0; m * k / 16],
            s32: vec![0; m * kb],
            xs: vec![0.0; m * kb],
        };
        for (i, (xb, qb)) in x.chunks_exact(ABLOCK).zip(a.q.chunks_exact_mut(ABLOCK)).enumerate() {
            let (d, lo, hi) = match isa {
                // SAFETY: the CPU runs `isa` (asserted above); the blocks are ABLOCK values
                #[cfg(target_arch = "x86_64")]
                Isa::Vnni => unsafe { vnni::round_block(xb, qb) },
                #[cfg(target_arch = "x86_64")]
                Isa::Avx2 => unsafe { avx2::round_block(xb, qb) },
                _ => round_block(xb, qb),
            };
            a.d[i] = d;
            a.s16[2 * i] = lo;
            a.s16[2 * i + 1] = hi;
            a.s32[i] = lo + hi;
            a.xs[i] = d * (lo + hi) as f32;
        }
        a
    }

    /// A block's scale and its reciprocal (0 for a block of zeros) from its largest magnitude.
    fn scale_of(amax: f32) -> (f32, f32) {
        (amax / 127.0, if amax > 0.0 { 127.0 / amax } else { 0.0 })
    }

    fn row(&self, r: usize) -> Row {
        let kb = self.k / ABLOCK;
        // SAFETY (of the later reads): each pointer covers row r's k values, kb blocks or 2·kb halves
        Row {
            q: self.q[r * self.k..].as_ptr(),
            d: self.d[r * kb..].as_ptr(),
            s16: self.s16[2 * r * kb..].as_ptr(),
            s32: self.s32[r * kb..].as_ptr(),
            xs: self.xs[r * kb..].as_ptr(),
        }
    }
}

/// One block of `ABLOCK` values rounded into `q`: (its scale, the sums of the integers of its two halves).
fn round_block(x: &[f32], q: &mut [i8]) -> (f32, i32, i32) {
    let (d, id) = Acts::scale_of(x.iter().fold(0f32, |m, v| m.max(v.abs())));
    let (mut lo, mut hi) = (0i32, 0i32);
    for (p, (&v, q)) in x.iter().zip(q.iter_mut()).enumerate() {
        *q = (v * id).round_ties_even() as i8;
        if p < 16 {
            lo += *q as i32;
        } else {
            hi += *q as i32;
        }
    }
    (d, lo, hi)
}

/// One rounded row, as the kernels read it (the SIMD kernels start their integer sums from the offset times
/// `s16` / `s32`; `dot_scalar` subtracts the offset per value instead).
#[derive(Clone, Copy)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
struct Row {
    q: *const i8,
    d: *const f32,
    s16: *const i32,
    s32: *const i32,
    xs: *const f32,
}

// SAFETY: a Row only reads `Acts` it borrows from, which outlives the product's tasks
unsafe impl Send for Row {}
unsafe impl Sync for Row {}

/// y (m × n) = x (m × k) · Wᵀ with x rounded to 8 bits (`Acts`), parallel on the calling pool from
/// `par_min_macs` multiply-adds, with the kernels of `isa` (which the CPU must run: `Isa::runs`; the same bits on
/// each).
pub fn matmul(x: &[f32], m: usize, w: &DotMatrix, par_min_macs: usize, isa: Isa) -> Vec<f32> {
    let (n, k) = (w.n, w.k);
    assert!(x.len() == m * k && isa.runs());
    let mut y = vec![0f32; m * n];
    if m == 0 || n == 0 {
        return y;
    }
    let acts = Acts::new(x, m, k, isa);
    let rows: Vec<Row> = (0..m).map(|r| acts.row(r)).collect();
    let groups = n.div_ceil(GROUP);
    let par = rayon::current_num_threads() > 1 && m * n * k >= par_min_macs;
    let threads = if par { rayon::current_num_threads() } else { 1 };
    let tasks = groups.div_ceil(MAX_TASK_GROUPS).max(2 * threads).div_ceil(threads) * threads;
    let tasks = tasks.min(groups);
    let out = Out(y.as_mut_ptr());
    let task = |t: usize| {
        for g in t * groups / tasks..(t + 1) * groups / tasks {
            let cols = GROUP.min(n - g * GROUP);
            let data = w.group(g);
            for r0 in (0..m).step_by(isa.tile()) {
                let tile = &rows[r0..(r0 + isa.tile()).min(m)];
                let mut acc = [[0f32; GROUP]; MAX_TILE];
                // SAFETY: the CPU runs `isa` (checked above); `data` is one group's records and each row covers k
                // values
                match isa {
                    #[cfg(target_arch = "x86_64")]
                    Isa::Vnni => unsafe { vnni::group(w.format, data, k, tile, &mut acc) },
                    #[cfg(target_arch = "x86_64")]
                    Isa::Avx2 => unsafe { avx2::group(w.format, data, k, tile, &mut acc) },
                    _ => dot_scalar(w.format, data, k, tile, &mut acc),
                }
                for (i, a) in acc.iter().take(tile.len()).enumerate() {
                    for (c, &v) in a.iter().take(cols).enumerate() {
                        // SAFETY: y is m × n; this task alone writes group g's columns
                        unsafe { *out.offset((r0 + i) * n + g * GROUP + c).0 = v };
                    }
                }
            }
        }
    };
    if par {
        (0..tasks).into_par_iter().for_each(task);
    } else {
        (0..tasks).for_each(task);
    }
    y
}

/// One group's 16 columns for the rows `tile` (`acc[r][c]`), the module's arithmetic one value at a time.
fn dot_scalar(format: QuantFormat, data: &[u8], k: usize, tile: &[Row], acc: &mut [[f32; GROUP]; MAX_TILE]) {
    let sh = shape(format).expect("a format with integer products");
    let o = offset(format);
    for (rec_i, rec) in data.chunks_exact(sh.bytes()).enumerate().take(k / sh.depths) {
        let (s, v) = rec.split_at(sh.scales);
        let p0 = rec_i * sh.depths;
        for (row, acc) in tile.iter().zip(acc.iter_mut()) {
            // SAFETY: the row covers k values (`Acts::row`)
            let at = |i: usize| unsafe { *row.q.add(p0 + i) as i32 };
            let blk = |p: usize| (p0 + p) / ABLOCK;
            for (c, a) in acc.iter_mut().enumerate() {
                let d = f16_at(s, D + 2 * c);
                let isum = |from: usize, len: usize, off: i32| -> i32 {
                    (from..from + len).map(|p| (get(format, v, c, p) - off) * at(p)).sum()
                };
                // SAFETY (the reads of d, s16, s32, xs): block indices below k / ABLOCK
                unsafe {
                    match format {
                        QuantFormat::Q4K | QuantFormat::Q5K => {
                            for j in 0..8 {
                                let b = blk(32 * j);
                                let ds = d * s[K4_SCALES + GROUP * j + c] as f32;
                                let dm = f16_at(s, DMIN + 2 * c) * s[K4_MINS + GROUP * j + c] as f32;
                                *a = (isum(32 * j, 32, 0) as f32).mul_add(ds * *row.d.add(b), *a);
                                *a = (-dm).mul_add(*row.xs.add(b), *a);
                            }
                        }
                        QuantFormat::Q6K => {
                            for j in 0..16 {
                                let ds = d * (s[K6_SCALES + GROUP * j + c] as i8) as f32;
                                *a = (isum(16 * j, 16, 32) as f32).mul_add(ds * *row.d.add(blk(16 * j)), *a);
                            }
                        }
                        _ => {
                            *a = (isum(0, 32, o) as f32).mul_add(d * *row.d.add(blk(0)), *a);
                        }
                    }
                }
            }
        }
    }
}

/// The bits above a weight's nibble, per depth quad u, for the kernels' `octets`: none (q4_0, q4_k), a plane of
/// fifth bits (q5_0, q5_k: bit u of each byte, to bit 4) or q6_k's plane of high pairs (bits 2u and 2u + 1, to bits
/// 4-5). Data rather than a closure: a closure is its own function, without the kernel's target features, and the
/// compiler may leave it (and the intrinsics in it) un-inlined — as it did in the AVX2 kernels, which ran q5_0
/// windows 2-3x slower than the exact path.
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
enum High<P> {
    None,
    Fifth(P),
    Pairs(P),
}

#[cfg(target_arch = "x86_64")]
impl<P: Copy> High<P> {
    /// For depth quad u: the plane, the bit of each byte that goes to bit 4 (a pair: its lower bit), and the mask
    /// that keeps what lands there; None where there are no such bits.
    #[inline(always)]
    fn at(self, u: usize) -> Option<(P, usize, i8)> {
        match self {
            High::None => None,
            High::Fifth(plane) => Some((plane, u, 0x10)),
            High::Pairs(plane) => Some((plane, 2 * u, 0x30)),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod vnni {
    use super::*;
    use std::arch::x86_64::*;

    /// `dot_scalar` with AVX-512 VNNI: the same bits.
    ///
    /// # Safety
    /// The CPU has AVX-512 F, BW and VNNI; `data` holds one group's k / depths records; each row covers k values.
    pub(super) unsafe fn group(
        format: QuantFormat,
        data: &[u8],
        k: usize,
        tile: &[Row],
        acc: &mut [[f32; GROUP]; MAX_TILE],
    ) {
        macro_rules! rows {
            ($f:ident) => {
                match tile.len() {
                    1 => store(&$f::<1>(data, k, tile), acc),
                    2 => store(&$f::<2>(data, k, tile), acc),
                    3 => store(&$f::<3>(data, k, tile), acc),
                    4 => store(&$f::<4>(data, k, tile), acc),
                    5 => store(&$f::<5>(data, k, tile), acc),
                    6 => store(&$f::<6>(data, k, tile), acc),
                    7 => store(&$f::<7>(data, k, tile), acc),
                    _ => store(&$f::<8>(data, k, tile), acc),
                }
            };
        }
        per_format!(format, rows)
    }

    /// `round_block` with AVX-512: the same values (the maximum and the integer sums are exact in any order, and
    /// the conversion rounds to nearest, ties to even, as `round_ties_even`).
    #[target_feature(enable = "avx512f,avx512bw")]
    pub(super) unsafe fn round_block(x: &[f32], q: &mut [i8]) -> (f32, i32, i32) {
        assert!(x.len() == ABLOCK && q.len() == ABLOCK);
        let (a, b) = (_mm512_loadu_ps(x.as_ptr()), _mm512_loadu_ps(x.as_ptr().add(16)));
        let amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
        let (d, id) = Acts::scale_of(amax);
        let id = _mm512_set1_ps(id);
        let (qa, qb) = (_mm512_cvtps_epi32(_mm512_mul_ps(a, id)), _mm512_cvtps_epi32(_mm512_mul_ps(b, id)));
        _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, _mm512_cvtepi32_epi8(qa));
        _mm_storeu_si128(q.as_mut_ptr().add(16) as *mut __m128i, _mm512_cvtepi32_epi8(qb));
        (d, _mm512_reduce_add_epi32(qa), _mm512_reduce_add_epi32(qb))
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn store<const R: usize>(v: &[__m512; R], acc: &mut [[f32; GROUP]; MAX_TILE]) {
        for r in 0..R {
            _mm512_storeu_ps(acc[r].as_mut_ptr(), v[r]);
        }
    }

    /// Bytes ahead of the current weights that each 64-byte load asks the memory for (software prefetch: a
    /// one-row product streams the weights once, with little else to hide the memory's latency behind).
    const PREFETCH: usize = 1024;

    /// A 64-byte load of weights at `p` in a tile of R rows, asking for the line `PREFETCH` bytes on where R > 1.
    /// (Measured on a 64 MB q6_k matrix, alternating in one process: 4 rows 2.73 ms with it, 3.36 without; one row
    /// 1.66 with, 1.55 without. On the 255 MB q6_k head 151936 x 2048, one row: 8.15 ms without, 8.25 / 8.59 / 9.00
    /// with 1 / 4 / 16 KB ahead (31 GB/s without: the memory's speed on this host). Huge pages for the matrix
    /// (madvise) gained 1-2%: not kept.)
    #[inline(always)]
    unsafe fn load<const R: usize>(p: *const u8) -> __m512i {
        if R > 1 {
            _mm_prefetch::<_MM_HINT_T0>(p.add(PREFETCH) as *const i8);
        }
        _mm512_loadu_si512(p as *const _)
    }

    /// Whether a tile of R rows keeps two integer sums per row (the second for every other 4 depths): one row's
    /// chain of dependent `vpdpbusd`s is then half as long; the sums are exact, so their split changes no bit.
    /// Wider tiles have chains enough (and would run out of registers).
    const fn split(r: usize) -> bool {
        r <= 4
    }

    /// isum (or, `second` in a split tile, isum2) += the 4-byte dot products of `w` with row r's values at i.
    #[inline(always)]
    unsafe fn dot<const R: usize>(
        isum: &mut [__m512i; R],
        isum2: &mut [__m512i; R],
        second: bool,
        w: __m512i,
        x: &[Row],
        i: usize,
    ) {
        for r in 0..R {
            if second && split(R) {
                isum2[r] = _mm512_dpbusd_epi32(isum2[r], w, quad(&x[r], i));
            } else {
                isum[r] = _mm512_dpbusd_epi32(isum[r], w, quad(&x[r], i));
            }
        }
    }

    /// isum + isum2 per row.
    #[inline(always)]
    unsafe fn join<const R: usize>(isum: [__m512i; R], isum2: [__m512i; R]) -> [__m512i; R] {
        if split(R) {
            std::array::from_fn(|r| _mm512_add_epi32(isum[r], isum2[r]))
        } else {
            isum
        }
    }

    /// 4 bytes of row x from value i, broadcast.
    #[inline(always)]
    unsafe fn quad(x: &Row, i: usize) -> __m512i {
        _mm512_set1_epi32(std::ptr::read_unaligned(x.q.add(i) as *const i32))
    }

    /// A record's 16 f16 at byte `at`, as f32.
    #[inline(always)]
    unsafe fn f16s(rec: *const u8, at: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(rec.add(at) as *const __m256i))
    }

    /// 16 unsigned (signed: `_mm512_cvtepi8_epi32`) bytes at `at` as f32.
    #[inline(always)]
    unsafe fn u8s(rec: *const u8, at: usize) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(_mm_loadu_si128(rec.add(at) as *const __m128i)))
    }
    #[inline(always)]
    unsafe fn i8s(rec: *const u8, at: usize) -> __m512 {
        _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(rec.add(at) as *const __m128i)))
    }

    /// acc = fma(f32(isum + isum2), scale·dx, acc) per row.
    #[inline(always)]
    unsafe fn scale<const R: usize>(
        acc: &mut [__m512; R],
        isum: [__m512i; R],
        isum2: [__m512i; R],
        scale: __m512,
        x: &[Row],
        b: usize,
    ) {
        let isum = join(isum, isum2);
        for r in 0..R {
            let s = _mm512_mul_ps(scale, _mm512_set1_ps(*x[r].d.add(b)));
            acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), s, acc[r]);
        }
    }

    /// The sums of `count` octets (64 bytes each at `v`: depths p0 + 8o + 0..8), the low nibbles OR'd with
    /// `high`'s bits for depth quad u, added into `isum` (the high nibbles' into `isum2`, see `split`).
    #[inline(always)]
    #[allow(clippy::too_many_arguments)]
    unsafe fn octets<const R: usize>(
        v: *const u8,
        count: usize,
        x: &[Row],
        p0: usize,
        isum: &mut [__m512i; R],
        isum2: &mut [__m512i; R],
        high: High<__m512i>,
    ) {
        let m4 = _mm512_set1_epi8(0x0F);
        for o in 0..count {
            let b = load::<R>(v.add(o * VEC));
            let lo = _mm512_or_si512(_mm512_and_si512(b, m4), high_bits(high, 2 * o));
            let hi = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16::<4>(b), m4), high_bits(high, 2 * o + 1));
            dot(isum, isum2, false, lo, x, p0 + 8 * o);
            dot(isum, isum2, true, hi, x, p0 + 8 * o + 4);
        }
    }

    /// `high`'s bits for depth quad u, in place over the nibbles (bit 4, bits 4-5).
    #[inline(always)]
    unsafe fn high_bits(high: High<__m512i>, u: usize) -> __m512i {
        match high.at(u) {
            Some((plane, bit, mask)) => bit_to(plane, bit, 4, mask),
            None => _mm512_setzero_si512(),
        }
    }

    /// Bits u (depth quad u) of each byte of a plane, moved to bit `to` (only that bit kept).
    #[inline(always)]
    unsafe fn bit_to(plane: __m512i, u: usize, to: usize, mask: i8) -> __m512i {
        _mm512_and_si512(
            shift16!(plane, to as i32 - u as i32, _mm512_slli_epi16, _mm512_srli_epi16),
            _mm512_set1_epi8(mask),
        )
    }

    /// Per row, the integer sums start at −offset · (the block's sum of xq).
    #[inline(always)]
    unsafe fn start<const R: usize>(x: &[Row], sums: impl Fn(&Row) -> i32, off: i32) -> [__m512i; R] {
        std::array::from_fn(|r| _mm512_set1_epi32(-off * sums(&x[r])))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    unsafe fn q8_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
        let sh = shape(QuantFormat::Q8_0).unwrap();
        let mut acc = [_mm512_setzero_ps(); R];
        let mut rec = data.as_ptr();
        for b in 0..k / 32 {
            let (mut isum, mut isum2) = (start::<R>(x, |row| *row.s32.add(b), 128), [_mm512_setzero_si512(); R]);
            let v = rec.add(sh.scales);
            for t in 0..8 {
                dot(&mut isum, &mut isum2, t % 2 == 1, load::<R>(v.add(t * VEC)), x, 32 * b + 4 * t);
            }
            scale(&mut acc, isum, isum2, f16s(rec, D), x, b);
            rec = rec.add(sh.bytes());
        }
        acc
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    unsafe fn q4_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
        let sh = shape(QuantFormat::Q4_0).unwrap();
        let mut acc = [_mm512_setzero_ps(); R];
        let mut rec = data.as_ptr();
        let zero = _mm512_setzero_si512();
        for b in 0..k / 32 {
            let (mut isum, mut isum2) = (start::<R>(x, |row| *row.s32.add(b), 8), [zero; R]);
            octets(rec.add(sh.scales), 4, x, 32 * b, &mut isum, &mut isum2, High::None);
            scale(&mut acc, isum, isum2, f16s(rec, D), x, b);
            rec = rec.add(sh.bytes());
        }
        acc
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    unsafe fn q5_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
        let sh = shape(QuantFormat::Q5_0).unwrap();
        let mut acc = [_mm512_setzero_ps(); R];
        let mut rec = data.as_ptr();
        for b in 0..k / 32 {
            let (mut isum, mut isum2) = (start::<R>(x, |row| *row.s32.add(b), 16), [_mm512_setzero_si512(); R]);
            let v = rec.add(sh.scales);
            let fifth = load::<R>(v.add(4 * VEC));
            octets(v, 4, x, 32 * b, &mut isum, &mut isum2, High::Fifth(fifth));
            scale(&mut acc, isum, isum2, f16s(rec, D), x, b);
            rec = rec.add(sh.bytes());
        }
        acc
    }

    /// q4_k and q5_k (`FIFTH`): per sub-block of 32, the scaled sum, then the min times the block's sum.
    #[inline(always)]
    unsafe fn k4<const R: usize, const FIFTH: bool>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
        let format = if FIFTH { QuantFormat::Q5K } else { QuantFormat::Q4K };
        let sh = shape(format).unwrap();
        let per = if FIFTH { 5 * VEC } else { 4 * VEC };
        let mut acc = [_mm512_setzero_ps(); R];
        let mut rec = data.as_ptr();
        let zero = _mm512_setzero_si512();
        for sb in 0..k / 256 {
            let (d, dmin) = (f16s(rec, D), f16s(rec, DMIN));
            let v = rec.add(sh.scales);
            for j in 0..8 {
                let b = 8 * sb + j;
                let (mut isum, mut isum2) = ([zero; R], [zero; R]);
                let vj = v.add(j * per);
                if FIFTH {
                    let fifth = load::<R>(vj.add(4 * VEC));
                    octets(vj, 4, x, 32 * b, &mut isum, &mut isum2, High::Fifth(fifth));
                } else {
                    octets(vj, 4, x, 32 * b, &mut isum, &mut isum2, High::None);
                }
                scale(&mut acc, isum, isum2, _mm512_mul_ps(d, u8s(rec, K4_SCALES + GROUP * j)), x, b);
                let dm = _mm512_mul_ps(dmin, u8s(rec, K4_MINS + GROUP * j));
                for r in 0..R {
                    acc[r] = _mm512_fnmadd_ps(dm, _mm512_set1_ps(*x[r].xs.add(b)), acc[r]);
                }
            }
            rec = rec.add(sh.bytes());
        }
        acc
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    unsafe fn q4_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
        k4::<R, false>(data, k, x)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    unsafe fn q5_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
        k4::<R, true>(data, k, x)
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,f16c")]
    unsafe fn q6_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [__m512; R] {
        let sh = shape(QuantFormat::Q6K).unwrap();
        let mut acc = [_mm512_setzero_ps(); R];
        let mut rec = data.as_ptr();
        let zero = _mm512_setzero_si512();
        for sb in 0..k / 256 {
            let d = f16s(rec, D);
            let v = rec.add(sh.scales);
            for j in 0..16 {
                let p0 = 256 * sb + 16 * j;
                let (mut isum, mut isum2) = (start::<R>(x, |row| *row.s16.add(p0 / 16), 32), [zero; R]);
                let vj = v.add(j * 3 * VEC);
                let high = load::<R>(vj.add(2 * VEC));
                octets(vj, 2, x, p0, &mut isum, &mut isum2, High::Pairs(high));
                scale(&mut acc, isum, isum2, _mm512_mul_ps(d, i8s(rec, K6_SCALES + GROUP * j)), x, p0 / 32);
            }
            rec = rec.add(sh.bytes());
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// A group's 16 columns as two registers of 8 (columns 0-7 from the low 32 bytes of each 64-byte vector, 8-15
    /// from the high ones).
    type Pair = [__m256i; 2];

    /// `dot_scalar` with AVX2: the same bits. The 4-byte products go through `vpmaddubsw` (pairs into 16 bits,
    /// saturating: the stored values are at most 63 there, so a pair stays within 2·63·127; q8_0's signed bytes
    /// are multiplied as |w| times x with w's sign, at most 2·128·127) and `vpmaddwd` (pairs of those into 32
    /// bits), which gives `vpdpbusd`'s sums.
    ///
    /// # Safety
    /// The CPU has AVX2, FMA and F16C; `data` holds one group's k / depths records; each row covers k values;
    /// the tile has at most `Isa::Avx2.tile()` rows.
    pub(super) unsafe fn group(
        format: QuantFormat,
        data: &[u8],
        k: usize,
        tile: &[Row],
        acc: &mut [[f32; GROUP]; MAX_TILE],
    ) {
        macro_rules! rows {
            ($f:ident) => {
                match tile.len() {
                    1 => store(&$f::<1>(data, k, tile), acc),
                    2 => store(&$f::<2>(data, k, tile), acc),
                    3 => store(&$f::<3>(data, k, tile), acc),
                    _ => store(&$f::<4>(data, k, tile), acc),
                }
            };
        }
        per_format!(format, rows)
    }

    /// `round_block` with AVX2: the same values (the maximum and the integer sums are exact in any order, and the
    /// conversion rounds to nearest, ties to even, as `round_ties_even`).
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn round_block(x: &[f32], q: &mut [i8]) -> (f32, i32, i32) {
        assert!(x.len() == ABLOCK && q.len() == ABLOCK);
        let p = x.as_ptr();
        let v = [_mm256_loadu_ps(p), _mm256_loadu_ps(p.add(8)), _mm256_loadu_ps(p.add(16)), _mm256_loadu_ps(p.add(24))];
        let abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        let m = _mm256_max_ps(
            _mm256_max_ps(_mm256_and_ps(v[0], abs), _mm256_and_ps(v[1], abs)),
            _mm256_max_ps(_mm256_and_ps(v[2], abs), _mm256_and_ps(v[3], abs)),
        );
        let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps::<1>(m));
        let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
        let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_shuffle_ps::<0b01>(m, m)));
        let (d, id) = Acts::scale_of(amax);
        let id = _mm256_set1_ps(id);
        let r = [
            _mm256_cvtps_epi32(_mm256_mul_ps(v[0], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[1], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[2], id)),
            _mm256_cvtps_epi32(_mm256_mul_ps(v[3], id)),
        ];
        // the packs work per 128-bit lane: 4-value pieces come out as r0a r1a r2a r3a r0b r1b r2b r3b
        let bytes = _mm256_packs_epi16(_mm256_packs_epi32(r[0], r[1]), _mm256_packs_epi32(r[2], r[3]));
        let bytes = _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
        _mm256_storeu_si256(q.as_mut_ptr() as *mut __m256i, bytes);
        (d, hsum(_mm256_add_epi32(r[0], r[1])), hsum(_mm256_add_epi32(r[2], r[3])))
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256i) -> i32 {
        let s = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256::<1>(v));
        let s = _mm_add_epi32(s, _mm_shuffle_epi32::<0b01_00_11_10>(s));
        _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32::<0b10_11_00_01>(s)))
    }

    #[target_feature(enable = "avx2")]
    unsafe fn store<const R: usize>(v: &[[__m256; 2]; R], acc: &mut [[f32; GROUP]; MAX_TILE]) {
        for r in 0..R {
            _mm256_storeu_ps(acc[r].as_mut_ptr(), v[r][0]);
            _mm256_storeu_ps(acc[r].as_mut_ptr().add(8), v[r][1]);
        }
    }

    #[inline(always)]
    unsafe fn load(p: *const u8) -> Pair {
        [_mm256_loadu_si256(p as *const __m256i), _mm256_loadu_si256(p.add(32) as *const __m256i)]
    }

    #[inline(always)]
    unsafe fn quad(x: &Row, i: usize) -> __m256i {
        _mm256_set1_epi32(std::ptr::read_unaligned(x.q.add(i) as *const i32))
    }

    /// isum += the 4-byte dot products of unsigned `w` (each value ≤ 63) with row r's values at i.
    #[inline(always)]
    unsafe fn dot<const R: usize>(isum: &mut [Pair; R], w: Pair, x: &[Row], i: usize) {
        let ones = _mm256_set1_epi16(1);
        for r in 0..R {
            let xq = quad(&x[r], i);
            for h in 0..2 {
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(w[h], xq), ones);
                isum[r][h] = _mm256_add_epi32(isum[r][h], p);
            }
        }
    }

    /// isum += the 4-byte dot products of q8_0's stored bytes (w + 128) with row r's values at i, as |w| · (x with
    /// w's sign).
    #[inline(always)]
    unsafe fn dot_signed<const R: usize>(isum: &mut [Pair; R], stored: Pair, x: &[Row], i: usize) {
        let ones = _mm256_set1_epi16(1);
        let flip = _mm256_set1_epi8(-128);
        let w = [_mm256_xor_si256(stored[0], flip), _mm256_xor_si256(stored[1], flip)];
        let a = [_mm256_sign_epi8(w[0], w[0]), _mm256_sign_epi8(w[1], w[1])];
        for r in 0..R {
            let xq = quad(&x[r], i);
            for h in 0..2 {
                let p = _mm256_madd_epi16(_mm256_maddubs_epi16(a[h], _mm256_sign_epi8(xq, w[h])), ones);
                isum[r][h] = _mm256_add_epi32(isum[r][h], p);
            }
        }
    }

    #[inline(always)]
    unsafe fn f16s(rec: *const u8, at: usize) -> [__m256; 2] {
        let p = rec.add(at) as *const __m128i;
        [_mm256_cvtph_ps(_mm_loadu_si128(p)), _mm256_cvtph_ps(_mm_loadu_si128(p.add(1)))]
    }

    #[inline(always)]
    unsafe fn u8s(rec: *const u8, at: usize) -> [__m256; 2] {
        let (a, b) = (rec.add(at) as *const __m128i, rec.add(at + 8) as *const __m128i);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(a))),
            _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(b))),
        ]
    }

    #[inline(always)]
    unsafe fn i8s(rec: *const u8, at: usize) -> [__m256; 2] {
        let (a, b) = (rec.add(at) as *const __m128i, rec.add(at + 8) as *const __m128i);
        [
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(a))),
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(b))),
        ]
    }

    #[inline(always)]
    unsafe fn mul(a: [__m256; 2], b: [__m256; 2]) -> [__m256; 2] {
        [_mm256_mul_ps(a[0], b[0]), _mm256_mul_ps(a[1], b[1])]
    }

    /// acc = fma(f32(isum), scale·dx, acc) per row.
    #[inline(always)]
    unsafe fn scale<const R: usize>(
        acc: &mut [[__m256; 2]; R],
        isum: &[Pair; R],
        scale: [__m256; 2],
        x: &[Row],
        b: usize,
    ) {
        for r in 0..R {
            let dx = _mm256_set1_ps(*x[r].d.add(b));
            for h in 0..2 {
                acc[r][h] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(isum[r][h]), _mm256_mul_ps(scale[h], dx), acc[r][h]);
            }
        }
    }

    #[inline(always)]
    unsafe fn start<const R: usize>(x: &[Row], sums: impl Fn(&Row) -> i32, off: i32) -> [Pair; R] {
        std::array::from_fn(|r| [_mm256_set1_epi32(-off * sums(&x[r])); 2])
    }

    /// `high`'s bits for depth quad u, in place over the nibbles (bit 4, bits 4-5), per half.
    #[inline(always)]
    unsafe fn high_bits(high: High<Pair>, u: usize) -> Pair {
        match high.at(u) {
            Some((plane, bit, mask)) => bit_to(plane, bit, 4, mask),
            None => ZERO,
        }
    }

    /// Bits u of each byte moved to bit `to` (only that bit kept), per half.
    #[inline(always)]
    unsafe fn bit_to(plane: Pair, u: usize, to: usize, mask: i8) -> Pair {
        [shift_and(plane[0], to as i32 - u as i32, mask), shift_and(plane[1], to as i32 - u as i32, mask)]
    }

    /// v shifted left by `by` bits (right where negative) within 16-bit lanes, ANDed with `mask` per byte.
    #[inline(always)]
    unsafe fn shift_and(v: __m256i, by: i32, mask: i8) -> __m256i {
        _mm256_and_si256(shift16!(v, by, _mm256_slli_epi16, _mm256_srli_epi16), _mm256_set1_epi8(mask))
    }

    /// `count` octets from `v` (depths p0 + 8o ..), low nibbles OR'd with `high(u)` for depth quad u, into isum.
    #[inline(always)]
    unsafe fn octets<const R: usize>(
        v: *const u8,
        count: usize,
        x: &[Row],
        p0: usize,
        isum: &mut [Pair; R],
        high: High<Pair>,
    ) {
        let m4 = _mm256_set1_epi8(0x0F);
        for o in 0..count {
            let b = load(v.add(o * VEC));
            let (hl, hh) = (high_bits(high, 2 * o), high_bits(high, 2 * o + 1));
            let lo = [
                _mm256_or_si256(_mm256_and_si256(b[0], m4), hl[0]),
                _mm256_or_si256(_mm256_and_si256(b[1], m4), hl[1]),
            ];
            let hi = [
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b[0]), m4), hh[0]),
                _mm256_or_si256(_mm256_and_si256(_mm256_srli_epi16::<4>(b[1]), m4), hh[1]),
            ];
            dot(isum, lo, x, p0 + 8 * o);
            dot(isum, hi, x, p0 + 8 * o + 4);
        }
    }

    const ZERO: Pair = unsafe { std::mem::zeroed() };

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q8_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
        let sh = shape(QuantFormat::Q8_0).unwrap();
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut rec = data.as_ptr();
        for b in 0..k / 32 {
            let mut isum = [ZERO; R];
            let v = rec.add(sh.scales);
            for t in 0..8 {
                dot_signed(&mut isum, load(v.add(t * VEC)), x, 32 * b + 4 * t);
            }
            scale(&mut acc, &isum, f16s(rec, D), x, b);
            rec = rec.add(sh.bytes());
        }
        acc
    }

    /// q4_0 and q5_0 (`FIFTH`).
    #[inline(always)]
    unsafe fn b32<const R: usize, const FIFTH: bool>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
        let sh = shape(if FIFTH { QuantFormat::Q5_0 } else { QuantFormat::Q4_0 }).unwrap();
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut rec = data.as_ptr();
        for b in 0..k / 32 {
            let mut isum = start::<R>(x, |row| *row.s32.add(b), if FIFTH { 16 } else { 8 });
            let v = rec.add(sh.scales);
            if FIFTH {
                let fifth = load(v.add(4 * VEC));
                octets(v, 4, x, 32 * b, &mut isum, High::Fifth(fifth));
            } else {
                octets(v, 4, x, 32 * b, &mut isum, High::None);
            }
            scale(&mut acc, &isum, f16s(rec, D), x, b);
            rec = rec.add(sh.bytes());
        }
        acc
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
        b32::<R, false>(data, k, x)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_0<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
        b32::<R, true>(data, k, x)
    }

    /// q4_k and q5_k (`FIFTH`).
    #[inline(always)]
    unsafe fn k4<const R: usize, const FIFTH: bool>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
        let sh = shape(if FIFTH { QuantFormat::Q5K } else { QuantFormat::Q4K }).unwrap();
        let per = if FIFTH { 5 * VEC } else { 4 * VEC };
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut rec = data.as_ptr();
        for sb in 0..k / 256 {
            let (d, dmin) = (f16s(rec, D), f16s(rec, DMIN));
            let v = rec.add(sh.scales);
            for j in 0..8 {
                let b = 8 * sb + j;
                let mut isum = [ZERO; R];
                let vj = v.add(j * per);
                if FIFTH {
                    let fifth = load(vj.add(4 * VEC));
                    octets(vj, 4, x, 32 * b, &mut isum, High::Fifth(fifth));
                } else {
                    octets(vj, 4, x, 32 * b, &mut isum, High::None);
                }
                scale(&mut acc, &isum, mul(d, u8s(rec, K4_SCALES + GROUP * j)), x, b);
                let dm = mul(dmin, u8s(rec, K4_MINS + GROUP * j));
                for r in 0..R {
                    let xs = _mm256_set1_ps(*x[r].xs.add(b));
                    for h in 0..2 {
                        acc[r][h] = _mm256_fnmadd_ps(dm[h], xs, acc[r][h]);
                    }
                }
            }
            rec = rec.add(sh.bytes());
        }
        acc
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q4_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
        k4::<R, false>(data, k, x)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q5_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
        k4::<R, true>(data, k, x)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn q6_k<const R: usize>(data: &[u8], k: usize, x: &[Row]) -> [[__m256; 2]; R] {
        let sh = shape(QuantFormat::Q6K).unwrap();
        let mut acc = [[_mm256_setzero_ps(); 2]; R];
        let mut rec = data.as_ptr();
        for sb in 0..k / 256 {
            let d = f16s(rec, D);
            let v = rec.add(sh.scales);
            for j in 0..16 {
                let p0 = 256 * sb + 16 * j;
                let mut isum = start::<R>(x, |row| *row.s16.add(p0 / 16), 32);
                let vj = v.add(j * 3 * VEC);
                let high = load(vj.add(2 * VEC));
                octets(vj, 2, x, p0, &mut isum, High::Pairs(high));
                scale(&mut acc, &isum, mul(d, i8s(rec, K6_SCALES + GROUP * j)), x, p0 / 32);
            }
            rec = rec.add(sh.bytes());
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{Device, Tensor};

    fn uniform_values(len: usize, seed: u64) -> Vec<f32> {
        std::iter::repeat_with(crate::util::uniform(seed)).take(len).collect()
    }

    const FORMATS: [QuantFormat; 6] =
        [QuantFormat::Q8_0, QuantFormat::Q4_0, QuantFormat::Q5_0, QuantFormat::Q4K, QuantFormat::Q5K, QuantFormat::Q6K];

    fn matrix(n: usize, k: usize, f: QuantFormat, seed: u64) -> (QMatrix, DotMatrix, Vec<f32>) {
        let t = Tensor::from_vec(uniform_values(n * k, seed), (n, k), &Device::Cpu).unwrap();
        let q = QMatrix::quantize(&t, f).unwrap();
        let mut wq = vec![0f32; n * k];
        q.dequantize_rows(0, n, &mut wq);
        let d = DotMatrix::from_quant(&q).unwrap().expect("the format has integer products");
        (q, d, wq)
    }

    /// The rows a DotMatrix gives back are the format's dequantization, and its bytes the format's (k-quants with
    /// a byte per scale and min: 4 more per 256 values and column).
    #[test]
    fn rearranged_values_are_the_formats() {
        let (n, k) = (37, 512);
        for f in FORMATS {
            let (q, d, wq) = matrix(n, k, f, 3);
            let mut got = vec![0f32; n * k];
            d.rows_into(0, n, &mut got);
            assert!(got.iter().zip(&wq).all(|(a, b)| a.to_bits() == b.to_bits()), "{}", f.name());
            let extra = if matches!(f, QuantFormat::Q4K | QuantFormat::Q5K) { 4 * k / 256 } else { 0 };
            assert_eq!(d.bytes(), n.div_ceil(GROUP) * GROUP * (q.row_bytes() + extra), "{}", f.name());
        }
    }

    /// The product is the dot product of the dequantized weights with the rounded activations (against f64 on
    /// both), the SIMD kernels give the scalar one's bits, and a row's bits do not depend on the other rows.
    #[test]
    fn integer_products_match_the_rounded_reference_and_every_tiling() {
        let (n, k) = (45, 768);
        for f in FORMATS {
            let (_, d, wq) = matrix(n, k, f, 11);
            for m in [1usize, 3, 8, 11] {
                let x = uniform_values(m * k, 5 + m as u64);
                let acts = Acts::new(&x, m, k, Isa::Scalar);
                for isa in [Isa::Avx2, Isa::Vnni].into_iter().filter(|i| i.runs()) {
                    let simd = Acts::new(&x, m, k, isa);
                    assert_eq!((&simd.q, &simd.s16), (&acts.q, &acts.s16), "{isa:?}");
                    assert!(simd.d.iter().zip(&acts.d).all(|(a, b)| a.to_bits() == b.to_bits()));
                }
                let scalar = matmul(&x, m, &d, usize::MAX, Isa::Scalar);
                for r in 0..m {
                    for c in 0..n {
                        let want: f64 = (0..k)
                            .map(|p| {
                                let xr = acts.q[r * k + p] as f64 * acts.d[r * k / 32 + p / 32] as f64;
                                xr * wq[c * k + p] as f64
                            })
                            .sum();
                        let got = scalar[r * n + c] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{} {m} {r} {c}: {got} {want}",
                            f.name()
                        );
                    }
                    // alone, the same bits
                    let one = matmul(&x[r * k..(r + 1) * k], 1, &d, usize::MAX, Isa::Scalar);
                    assert_eq!(&one[..], &scalar[r * n..(r + 1) * n], "{} row {r} alone", f.name());
                }
                for isa in [Isa::Avx2, Isa::Vnni].into_iter().filter(|i| i.runs()) {
                    for par in [usize::MAX, 0] {
                        let simd = matmul(&x, m, &d, par, isa);
                        let same = simd.iter().zip(&scalar).all(|(a, b)| a.to_bits() == b.to_bits());
                        assert!(same, "{} m {m}: {isa:?} differs from scalar", f.name());
                    }
                }
            }
        }
    }

    /// Rounding: a block's largest magnitude becomes ±127, zeros stay zero, ties go to even.
    #[test]
    fn activations_round_per_block() {
        let mut x = vec![0f32; 64];
        x[3] = -2.0;
        x[4] = 1.0; // 1 · 127/2 = 63.5: the tie goes to 64
        let a = Acts::new(&x, 1, 64, Isa::Scalar);
        assert_eq!((a.q[3], a.q[4], a.d[1], a.q[40]), (-127, 64, 0.0, 0));
        assert_eq!(a.d[0], 2.0 / 127.0);
        assert_eq!(a.s32[1], 0);
        assert_eq!(a.s32[0], a.q[..32].iter().map(|&q| q as i32).sum::<i32>());
        for isa in [Isa::Avx2, Isa::Vnni].into_iter().filter(|i| i.runs()) {
            let v = Acts::new(&x, 1, 64, isa);
            assert_eq!((v.q, v.d, v.s16), (a.q.clone(), a.d.clone(), a.s16.clone()), "{isa:?}");
        }
    }

    /// q8_0's extreme bytes (-128 and 127, which AVX2 multiplies as |w| with x's sign flipped) against full-scale
    /// activations: every instruction set gives the scalar bits, and the exact integer sums.
    #[test]
    fn q8_0_extremes_are_exact_on_every_instruction_set() {
        let (n, k) = (16, 64);
        let mut bytes = Vec::new();
        for c in 0..n {
            for b in 0..k / 32 {
                bytes.extend_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
                bytes.extend((0..32).map(|i| if (i + c + b) % 3 == 0 { 0x80u8 } else { 127 }));
            }
        }
        let q = QMatrix::from_bytes(QuantFormat::Q8_0, n, k, bytes).unwrap();
        let d = DotMatrix::from_quant(&q).unwrap().unwrap();
        let x: Vec<f32> = (0..2 * k).map(|i| if i % 5 == 0 { -1.0 } else { 1.0 }).collect();
        let want = matmul(&x, 2, &d, usize::MAX, Isa::Scalar);
        let mut wq = vec![0f32; n * k];
        q.dequantize_rows(0, n, &mut wq);
        for r in 0..2 {
            for c in 0..n {
                // x rounds to exactly ±127 · (1/127): the sum is exact
                let exact: f32 = (0..k).map(|p| wq[c * k + p] * x[r * k + p]).sum();
                assert_eq!(want[r * n + c], exact, "row {r} column {c}");
            }
        }
        for isa in [Isa::Avx2, Isa::Vnni].into_iter().filter(|i| i.runs()) {
            assert_eq!(matmul(&x, 2, &d, usize::MAX, isa), want, "{isa:?}");
        }
    }

    #[test]
    fn stacks_keep_rows() {
        let k = 256;
        let (_, a, wa) = matrix(32, k, QuantFormat::Q4K, 1);
        let (_, b, wb) = matrix(21, k, QuantFormat::Q4K, 2);
        let s = DotMatrix::stack(&[&a, &b]).unwrap().unwrap();
        let mut got = vec![0f32; 53 * k];
        s.rows_into(0, 53, &mut got);
        assert_eq!(&got[..32 * k], &wa[..]);
        assert_eq!(&got[32 * k..], &wb[..]);
        assert!(DotMatrix::stack(&[&b, &a]).unwrap().is_none(), "21 rows are not whole groups");
    }
}
