//! Quantized matrices multiplied with integer dot products on 8-bit activations (the `int8_activations` load
//! option), as llama.cpp multiplies its block formats.
//!
//! The default quantized path (`panels`) forms every weight in f32 and multiplies it with the f32 activation: exact,
//! but a one-row product then costs 4-7 vector instructions per 16 weights and runs below the memory's speed
//! (benches/results/quantization.md). Here each row of x is rounded to 8 bits per block of 32 values (`Acts`: a scale
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

/// Column c's block of a row (`block`: the format's bytes) into a record's scales `s`
/// ([`records::pack_record`](crate::kernels::records::pack_record)) and values `v`.
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
    /// [`Isa::runs`]; the same values on each).
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
/// `par_min_macs` multiply-adds, with the kernels of `isa` (which the CPU must run: [`Isa::runs`]; the same bits on
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
mod vnni;

#[cfg(target_arch = "x86_64")]
mod avx2;

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
