//! mbd-rs's own CUDA kernels (`src/kernels/cuda/kernels.cu`, built to PTX by build.rs with the `cuda` feature): a
//! decode window's attention in three launches per segment and layer (`prep`, then `attend`'s two), each residual add
//! and the norm after it in one (`add_rms_norm`), `silu_mul` in one, and the logits rows' statistics (`row_stats`, for
//! [`kernels::stats`](crate::kernels::stats)) in one, where candle's ops took tens of launches per layer and the
//! forward was bound by the host launching them (the first GPU run: benches/results/cuda.md).
//! [`Kernels::cuda_fused`](crate::kernels::Kernels::cuda_fused) turns them off for A/B runs. Without the `cuda`
//! feature, `available` is false and nothing else is reachable.

use crate::error::Result;
use candle_core::{DType, Device, Tensor};

/// Whether the kernels run on `dev` in `dtype` at all: a CUDA device (in a build with the `cuda` feature),
/// f32 / bf16 / f16. Enough for the row-wise ones (`add_rms_norm`, `silu_mul`).
pub fn runs_on(dev: &Device, dtype: DType) -> bool {
    cfg!(feature = "cuda") && dev.is_cuda() && matches!(dtype, DType::F32 | DType::BF16 | DType::F16)
}

/// Whether the attention kernels (`prep`, `attend`) run for a model on `dev` in `dtype` with this head shape:
/// `runs_on`, head_dim a multiple of 32 up to 256, query heads a multiple of kv heads.
pub fn available(dev: &Device, dtype: DType, heads: usize, kv_heads: usize, head_dim: usize) -> bool {
    runs_on(dev, dtype)
        && head_dim.is_multiple_of(32)
        && head_dim <= 256
        && kv_heads > 0
        && heads.is_multiple_of(kv_heads)
}

/// Whether a segment's attention runs in `attend` (else in candle's matmuls over `prep`'s output): `attend` reads every
/// visible key once per (row, head), so its work grows as rows × keys × heads × head_dim, while candle's path pays its
/// launches and the K cache's cast, a fixed cost per layer, and grows slowly with the window. On an H100 at the
/// SDAR-1.7B shape (16 heads of 128) the two meet near 48k row-keys, where `FUSED_ATTENTION_WORK` sits
/// (benches/results/cuda.md, "Measurements that stood in code comments"). Decided per segment, never per forward, so a
/// segment computes the same way whatever shares its forward (batch invariance).
pub fn fused_attention(rows: usize, keys: usize, heads: usize, head_dim: usize) -> bool {
    rows.saturating_mul(keys).saturating_mul(heads).saturating_mul(head_dim) <= FUSED_ATTENTION_WORK
}

/// rows × keys × heads × head_dim up to which `attend` runs: 48k row-keys at 16 heads of 128.
const FUSED_ATTENTION_WORK: usize = 48 * 1024 * 16 * 128;

/// Per window row, the key ranges it sees, in the layout the attention kernel reads: w + 1 offsets into the
/// (lo, hi) pairs that follow them.
pub fn ranges_layout(visible: &[Vec<std::ops::Range<usize>>]) -> Result<Vec<u32>> {
    let pairs: usize = visible.iter().map(|r| r.len()).sum();
    let mut out = Vec::with_capacity(visible.len() + 1 + 2 * pairs);
    let mut n = 0usize;
    for r in visible {
        out.push(u32::try_from(n).map_err(|_| too_long())?);
        n += r.len();
    }
    out.push(u32::try_from(n).map_err(|_| too_long())?);
    for r in visible.iter().flatten() {
        out.push(u32::try_from(r.start).map_err(|_| too_long())?);
        out.push(u32::try_from(r.end).map_err(|_| too_long())?);
    }
    Ok(out)
}

/// Threads of an attention block and keys per tile (kernels.cu's THREADS / TILE).
const THREADS: usize = 128;
/// Blocks an attention launch aims for (two waves of an H100's 132 multiprocessors): a window of few rows is split
/// over key chunks until it has about this many.
const TARGET_BLOCKS: usize = 264;

/// How `attend` splits a segment's keys: (keys per chunk, chunks) for a window of `w` rows and `heads` query heads
/// over `keys` keys: chunks of whole tiles until the launch has about TARGET_BLOCKS blocks. A segment's chunking
/// depends on its own shape only, alone or beside others (`segment_table`): its arithmetic is the same either way.
pub fn chunking(w: usize, heads: usize, keys: usize) -> (usize, usize) {
    let want = chunk_bound(w, heads);
    let chunk = keys.div_ceil(want).div_ceil(THREADS).max(1) * THREADS;
    (chunk, keys.div_ceil(chunk).max(1))
}

/// The most chunks `chunking` gives a window of `w` rows and `heads` query heads, whatever its key count: the chunks
/// it wants. A launch sized by it (`segment_table`'s `most`) stays valid as the cache grows, as a captured CUDA graph
/// needs; blocks past a segment's own chunks return at once.
pub fn chunk_bound(w: usize, heads: usize) -> usize {
    TARGET_BLOCKS.div_ceil((w * heads).max(1)).max(1)
}

/// One segment of a forward whose attention runs in one launch for all segments (`prep_segments`,
/// `attend_segments`): its rows `row0..row0 + w` of the stacked rows, its committed length `p`, its cache's
/// capacity, and the key ranges each of its rows sees.
pub struct SegmentRows<'a> {
    pub row0: usize,
    pub w: usize,
    pub p: usize,
    pub capacity: usize,
    pub visible: &'a [Vec<std::ops::Range<usize>>],
}

/// u32 words per segment in a segment table (kernels.cu's SEG_WORDS): row0, w, p, keys per chunk, chunks, where its
/// key ranges start, its cache's capacity, and one unused.
pub const SEG_WORDS: usize = 8;

/// The segment table the `*_segments` kernels read, built on the host and copied to the device once per forward:
/// `SEG_WORDS` words per segment, then the segment of each stacked row, then each segment's key ranges
/// (`ranges_layout`). `most`: the launch's third grid dimension, the most chunks any segment could take at its window
/// (`chunk_bound`): it depends on the windows and heads only, never on a committed length.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentTable {
    pub words: Vec<u32>,
    pub rows: usize,
    pub most: usize,
}

/// The segment table of `segs` for `heads` query heads. The segments' rows must tile the stacked rows (0..rows, in
/// any order of segments); each window must fit its cache (p + w ≤ capacity) and see only keys below p + w; every
/// number must fit the kernels' 32-bit words.
pub fn segment_table(segs: &[SegmentRows<'_>], heads: usize) -> Result<SegmentTable> {
    let rows: usize = segs.iter().map(|s| s.w).sum();
    let u = |x: usize| u32::try_from(x).map_err(|_| too_long());
    let mut words = vec![0u32; segs.len() * SEG_WORDS + rows];
    let mut owner = vec![u32::MAX; rows];
    let mut most = 1;
    for (i, s) in segs.iter().enumerate() {
        let keys = s.p + s.w;
        if keys > s.capacity || s.visible.len() != s.w || s.row0 + s.w > rows {
            return Err(crate::error::Error::Internal(format!(
                "a segment table's segment {i} does not fit: rows {}..{} of {rows}, {} key-range lists, {keys} keys \
                 in a cache of {}",
                s.row0,
                s.row0 + s.w,
                s.visible.len(),
                s.capacity
            )));
        }
        if s.visible.iter().flatten().any(|r| r.start > r.end || r.end > keys) {
            return Err(crate::error::Error::Internal(format!(
                "a segment table's segment {i} sees keys past its {keys}"
            )));
        }
        for o in &mut owner[s.row0..s.row0 + s.w] {
            if *o != u32::MAX {
                return Err(crate::error::Error::Internal("two segments of a segment table share a row".into()));
            }
            *o = u(i)?;
        }
        let (chunk, chunks) = chunking(s.w, heads, keys);
        most = most.max(chunk_bound(s.w, heads));
        let base = words.len();
        words.extend(ranges_layout(s.visible)?);
        let head = [s.row0, s.w, s.p, chunk, chunks, base, s.capacity, 0];
        for (k, v) in head.into_iter().enumerate() {
            words[i * SEG_WORDS + k] = u(v)?;
        }
    }
    words[segs.len() * SEG_WORDS..segs.len() * SEG_WORDS + rows].copy_from_slice(&owner);
    u(words.len())?;
    Ok(SegmentTable { words, rows, most })
}

/// Whether `gdn_scan` takes a Gated DeltaNet layer's heads (`k_heads` key heads of `dk`, `v_heads` value heads of
/// `dv`): key head dims of 16, 32, 64 or 128 (`gdn_split` threads keep a column of a head's state in registers),
/// value head dims a multiple of 32 (whole warps) with at most GDN_SCAN_THREADS threads per head. Qwen3.5's 128 x
/// 128 heads fit.
pub fn gdn_scan_fits(dk: usize, dv: usize, k_heads: usize, v_heads: usize) -> bool {
    gdn_split(dk).is_some_and(|split| dv * split <= GDN_SCAN_THREADS)
        && dv.is_multiple_of(32)
        && k_heads > 0
        && v_heads.is_multiple_of(k_heads)
}

/// What a forward's `gdn_scan` needs besides the recurrence: the projected rows (rows, width) f32 (z at columns
/// conv_dim.. of each), the gated norm's weight (dv) f32 and eps.
pub struct GdnOut<'a> {
    pub p: &'a Tensor,
    pub conv_dim: usize,
    pub norm_w: &'a Tensor,
    pub eps: f32,
}

/// Whether `gdn_rows` takes a convolution of `conv_dim` channels: a row's activations in 48 KiB of shared memory
/// (12k channels; Qwen3.5's have 6-10k).
pub fn gdn_rows_fit(conv_dim: usize) -> bool {
    conv_dim * 4 <= GDN_SMEM
}

/// Threads per state column of `gdn_scan` for key heads of `dk` (kernels.cu's GDN_ENTRY): 64 values in registers
/// at most. None: no kernel for that size.
fn gdn_split(dk: usize) -> Option<usize> {
    match dk {
        16 | 32 | 64 => Some(1),
        128 => Some(2),
        _ => None,
    }
}

/// Shared memory `gdn_rows` may take per block (the default limit without opting in).
const GDN_SMEM: usize = 48 * 1024;
/// Threads of a `gdn_scan` block at most (kernels.cu's GDN_SCAN_THREADS, its launch bound).
const GDN_SCAN_THREADS: usize = 256;

fn too_long() -> crate::error::Error {
    crate::error::Error::Internal("a window's key ranges do not fit the CUDA kernel's 32-bit indices".into())
}

#[cfg(feature = "cuda")]
pub use imp::{
    add_rms_norm, attend, attend_segments, capture, device_address, gdn_rows, gdn_scan, prep, prep_segments, row_stats,
    silu_mul, with_upload_cache, write_words, Graph,
};

#[cfg(not(feature = "cuda"))]
pub use off::{
    add_rms_norm, attend, attend_segments, capture, device_address, gdn_rows, gdn_scan, prep, prep_segments, row_stats,
    silu_mul, with_upload_cache, Graph,
};

/// The signatures without the `cuda` feature (never called: `available` is false).
#[cfg(not(feature = "cuda"))]
mod off;

#[cfg(feature = "cuda")]
mod imp {
    use super::*;
    use crate::error::Error;
    use candle_core::cuda_backend::cudarc;
    use candle_core::cuda_backend::cudarc::driver::{DevicePtr, LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::{CudaDevice, CudaStorage, CudaStorageSlice, WrapErr};
    use candle_core::Storage;

    const PTX: &str = include_str!(concat!(env!("OUT_DIR"), "/mbd_kernels.ptx"));
    const MODULE: &str = "mbd_kernels";
    /// Threads of an add + RMSNorm block (kernels.cu's ADD_THREADS).
    const ADD_THREADS: usize = 256;
    /// Threads of a row-statistics block (kernels.cu's STAT_THREADS).
    const STAT_THREADS: usize = 512;

    fn suffix(dtype: DType) -> Result<&'static str> {
        Ok(match dtype {
            DType::F32 => "f32",
            DType::BF16 => "bf16",
            DType::F16 => "f16",
            d => return Err(Error::Internal(format!("the CUDA kernels do not take {d:?}"))),
        })
    }

    /// The device address of a CUDA tensor's first element, and its device. The memory stays the tensor's: the
    /// launches that use the address are queued on the device's one stream, before any later free.
    fn ptr(t: &Tensor, align: usize) -> Result<(u64, CudaDevice)> {
        let (st, l) = t.storage_and_layout();
        let Storage::Cuda(cs) = &*st else {
            return Err(Error::Internal("a CUDA kernel got a tensor that is not on the GPU".into()));
        };
        let stream = cs.device.cuda_stream();
        let (base, size) = match &cs.slice {
            CudaStorageSlice::F32(s) => (s.device_ptr(&stream).0, 4),
            CudaStorageSlice::F64(s) => (s.device_ptr(&stream).0, 8),
            CudaStorageSlice::BF16(s) => (s.device_ptr(&stream).0, 2),
            CudaStorageSlice::F16(s) => (s.device_ptr(&stream).0, 2),
            CudaStorageSlice::U32(s) => (s.device_ptr(&stream).0, 4),
            CudaStorageSlice::I64(s) => (s.device_ptr(&stream).0, 8),
            _ => return Err(Error::Internal("a CUDA kernel got a tensor of an unexpected dtype".into())),
        };
        let addr = base + (l.start_offset() * size) as u64;
        if !addr.is_multiple_of(align as u64) {
            return Err(Error::Internal(format!("a CUDA kernel's operand is not {align}-byte aligned")));
        }
        Ok((addr, cs.device.clone()))
    }

    fn contiguous(t: &Tensor, what: &str) -> Result<()> {
        if t.is_contiguous() {
            Ok(())
        } else {
            Err(Error::Internal(format!("the CUDA kernels need a contiguous {what}")))
        }
    }

    /// A new tensor of `shape` in `dtype` over a fresh device allocation that the launch fills.
    fn output(dev: &CudaDevice, dtype: DType, shape: &[usize]) -> Result<(Tensor, u64)> {
        let n: usize = shape.iter().product();
        // SAFETY: every element is written by the kernels launched next (each caller says which).
        let slice = unsafe {
            match dtype {
                DType::F32 => CudaStorageSlice::F32(dev.alloc::<f32>(n)?),
                DType::F64 => CudaStorageSlice::F64(dev.alloc::<f64>(n)?),
                DType::BF16 => CudaStorageSlice::BF16(dev.alloc::<half::bf16>(n)?),
                DType::F16 => CudaStorageSlice::F16(dev.alloc::<half::f16>(n)?),
                d => return Err(Error::Internal(format!("the CUDA kernels do not write {d:?}"))),
            }
        };
        let storage = CudaStorage { slice, device: dev.clone() };
        let t = Tensor::from_storage(Storage::Cuda(storage), shape, candle_core::op::BackpropOp::none(), false);
        let (addr, _) = ptr(&t, 1)?;
        Ok((t, addr))
    }

    fn dims(grid: (usize, usize, usize), block: usize) -> Result<LaunchConfig> {
        let c = |x: usize, max: usize| {
            u32::try_from(x)
                .ok()
                .filter(|&v| v >= 1 && v as usize <= max)
                .ok_or_else(|| Error::Internal(format!("a CUDA launch dimension of {x} is out of range")))
        };
        Ok(LaunchConfig {
            grid_dim: (c(grid.0, (1 << 31) - 1)?, c(grid.1, 65535)?, c(grid.2, 65535)?),
            block_dim: (c(block, 1024)?, 1, 1),
            shared_mem_bytes: 0,
        })
    }

    fn i32_of(x: usize) -> Result<i32> {
        i32::try_from(x).map_err(|_| Error::Internal(format!("{x} does not fit a CUDA kernel's int argument")))
    }

    /// The device addresses `prep` and `prep_segments` read besides the caches: the stacked q/k/v product, the RoPE
    /// tables, the q and k norms' weights (a null address: no norm on that side), and the norms' eps.
    struct PrepOperands {
        qkv: u64,
        cos: u64,
        sin: u64,
        qn: u64,
        kn: u64,
        eps: f32,
        dev: CudaDevice,
    }

    impl PrepOperands {
        fn of(
            qkv: &Tensor,
            (cos, sin): (&Tensor, &Tensor),
            norms: (Option<&Tensor>, Option<&Tensor>, f32),
        ) -> Result<Self> {
            let d = qkv.dim(2)?;
            let norm = |t: Option<&Tensor>| -> Result<u64> {
                match t {
                    Some(t) if t.dims() == [d] && t.dtype() == qkv.dtype() => Ok(ptr(t, 1)?.0),
                    Some(_) => Err(Error::Internal("CUDA prep: a q/k norm weight of another shape or dtype".into())),
                    None => Ok(0),
                }
            };
            let (qkv_p, dev) = ptr(qkv, 1)?;
            Ok(PrepOperands {
                qkv: qkv_p,
                cos: ptr(cos, 1)?.0,
                sin: ptr(sin, 1)?.0,
                qn: norm(norms.0)?,
                kn: norm(norms.1)?,
                eps: norms.2,
                dev,
            })
        }
    }

    /// The window's q/k/v from the stacked product: `qkv` (rows, heads + 2 kv_heads, D) contiguous, this segment's rows
    /// `rows` = (first, count). q/k RMSNorm where `norms` = (q weight, k weight, eps) has a weight, RoPE from the f32
    /// tables `cos`/`sin` (rows, D/2) of the same stacked rows, K and V written into `cache` (each layer's (kv_heads,
    /// capacity, D)) at slots p.. (the window's scratch). Returns q, (count, heads, D) f32.
    #[allow(clippy::too_many_arguments)]
    pub fn prep(
        qkv: &Tensor,
        cos: &Tensor,
        sin: &Tensor,
        norms: (Option<&Tensor>, Option<&Tensor>, f32),
        rows: (usize, usize),
        heads: (usize, usize),
        cache: (&Tensor, &Tensor),
        p: usize,
    ) -> Result<Tensor> {
        let (row0, w) = rows;
        let (nh, nkv) = heads;
        let (total, slots, d) = qkv.dims3()?;
        let (ckv, cap, cd) = cache.0.dims3()?;
        if slots != nh + 2 * nkv || cd != d || ckv != nkv || row0 + w > total || p + w > cap {
            return Err(Error::Internal("CUDA prep: operand shapes disagree".into()));
        }
        if cos.dims() != [total, d / 2] || sin.dims() != [total, d / 2] || cos.dtype() != DType::F32 {
            return Err(Error::Internal("CUDA prep: RoPE tables must be (rows, head_dim / 2) f32".into()));
        }
        for (t, what) in
            [(qkv, "q/k/v product"), (cos, "cos"), (sin, "sin"), (cache.0, "K cache"), (cache.1, "V cache")]
        {
            contiguous(t, what)?;
        }
        let name = format!("mbd_prep_{}", suffix(qkv.dtype())?);
        let o = PrepOperands::of(qkv, (cos, sin), norms)?;
        let (k_p, _) = ptr(cache.0, 1)?;
        let (v_p, _) = ptr(cache.1, 1)?;
        // every element of q is written: one thread per (row, head, dim)
        let (q, q_p) = output(&o.dev, DType::F32, &[w, nh, d])?;
        let f = o.dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut b = f.builder();
        let (row0, nh_, nkv_, d_, cap_, p_) =
            (i32_of(row0)?, i32_of(nh)?, i32_of(nkv)?, i32_of(d)?, i32_of(cap)?, i32_of(p)?);
        b.arg(&o.qkv).arg(&o.cos).arg(&o.sin).arg(&o.qn).arg(&o.kn).arg(&o.eps).arg(&q_p).arg(&k_p).arg(&v_p);
        b.arg(&row0).arg(&nh_).arg(&nkv_).arg(&d_).arg(&cap_).arg(&p_);
        // SAFETY: the arguments match mbd_prep_*'s parameters; the shapes were checked above.
        unsafe { b.launch(dims((w, slots, 1), d)?) }.w()?;
        Ok(q)
    }

    /// Attention of a window's rows: `q` (w, heads, D) f32 from `prep`, over `cache` (K, V: (kv_heads, capacity,
    /// D)) at the key ranges of `ranges` (`ranges_layout`, on the device), all below `keys`. Returns (w, heads·D) in
    /// the cache's dtype.
    pub fn attend(
        q: &Tensor,
        cache: (&Tensor, &Tensor),
        ranges: &Tensor,
        kv_heads: usize,
        keys: usize,
        scale: f32,
    ) -> Result<Tensor> {
        let (w, nh, d) = q.dims3()?;
        let (ckv, cap, cd) = cache.0.dims3()?;
        if ckv != kv_heads || cd != d || keys > cap || q.dtype() != DType::F32 || ranges.dtype() != DType::U32 {
            return Err(Error::Internal("CUDA attention: operand shapes disagree".into()));
        }
        for (t, what) in [(q, "query"), (cache.0, "K cache"), (cache.1, "V cache"), (ranges, "key ranges")] {
            contiguous(t, what)?;
        }
        let dtype = cache.0.dtype();
        let sfx = suffix(dtype)?;
        let (q_p, dev) = ptr(q, 4)?;
        // key rows are read 16 bytes at a time
        let (k_p, _) = ptr(cache.0, 16)?;
        let (v_p, _) = ptr(cache.1, 1)?;
        let (r_p, _) = ptr(ranges, 4)?;
        let (chunk, chunks) = chunking(w, nh, keys);
        // every (row, head, chunk) block writes its (m, l, acc) record
        let (ws, ws_p) = output(&dev, DType::F32, &[w, nh, chunks, d + 2])?;
        let f = dev.get_or_load_custom_func(&format!("mbd_attn_partial_{sfx}"), MODULE, PTX)?;
        let mut b = f.builder();
        let (w_, rep, cap_, d_, chunk_) =
            (i32_of(w)?, i32_of(nh / kv_heads)?, i32_of(cap)?, i32_of(d)?, i32_of(chunk)?);
        b.arg(&q_p).arg(&k_p).arg(&v_p).arg(&r_p).arg(&ws_p);
        b.arg(&w_).arg(&rep).arg(&cap_).arg(&d_).arg(&chunk_).arg(&scale);
        // SAFETY: the arguments match mbd_attn_partial_*'s parameters; the shapes were checked above.
        unsafe { b.launch(dims((w, nh, chunks), THREADS)?) }.w()?;
        // every (row, head, dim) of the output is written by one combine thread
        let (out, out_p) = output(&dev, dtype, &[w, nh * d])?;
        let f = dev.get_or_load_custom_func(&format!("mbd_attn_combine_{sfx}"), MODULE, PTX)?;
        let mut b = f.builder();
        let chunks_ = i32_of(chunks)?;
        b.arg(&ws_p).arg(&out_p).arg(&chunks_).arg(&d_);
        // SAFETY: as above; `ws` lives until this launch is queued, and frees are ordered on the same stream.
        unsafe { b.launch(dims((w, nh, 1), d)?) }.w()?;
        drop(ws);
        Ok(out)
    }

    /// (x + a, RMSNorm(x + a) · w) for x, a (rows, n) contiguous in one launch: the sum rounded to the dtype as
    /// candle's add rounds it, the norm computed in f32 from the rounded sum as candle's rms_norm does.
    pub fn add_rms_norm(x: &Tensor, a: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
        let (rows, n) = x.dims2()?;
        if a.dims() != [rows, n] || w.dims() != [n] || a.dtype() != x.dtype() || w.dtype() != x.dtype() {
            return Err(Error::Internal("CUDA add + RMSNorm: operand shapes or dtypes disagree".into()));
        }
        for (t, what) in [(x, "residual"), (a, "addend"), (w, "norm weight")] {
            contiguous(t, what)?;
        }
        let sfx = suffix(x.dtype())?;
        let (x_p, dev) = ptr(x, 1)?;
        let (a_p, _) = ptr(a, 1)?;
        let (w_p, _) = ptr(w, 1)?;
        // every element of both outputs is written (one block per row, a strided loop over its n values)
        let (xo, xo_p) = output(&dev, x.dtype(), &[rows, n])?;
        let (ho, ho_p) = output(&dev, x.dtype(), &[rows, n])?;
        if rows == 0 || n == 0 {
            return Ok((xo, ho));
        }
        let f = dev.get_or_load_custom_func(&format!("mbd_add_rms_norm_{sfx}"), MODULE, PTX)?;
        let mut b = f.builder();
        let n_ = i32_of(n)?;
        b.arg(&x_p).arg(&a_p).arg(&w_p).arg(&eps).arg(&xo_p).arg(&ho_p).arg(&n_);
        // SAFETY: the arguments match mbd_add_rms_norm_*'s parameters; the shapes were checked above.
        unsafe { b.launch(dims((rows, 1, 1), ADD_THREADS)?) }.w()?;
        Ok((xo, ho))
    }

    /// The device address of a CUDA tensor's first element (for a table of addresses a kernel reads; the tensor
    /// must outlive the launches that use it).
    pub fn device_address(t: &Tensor) -> Result<u64> {
        Ok(ptr(t, 1)?.0)
    }

    /// A forward's launches, captured once (`capture`) and replayed (`launch`): a CUDA graph ([`net::graph`],
    /// docs/dev/cuda.md).
    pub struct Graph(cudarc::driver::CudaGraph);

    // SAFETY: cudarc's graph is not Send because it holds the driver's raw handles, which must not be used by two
    // threads at once; net::graph runs a graph only on the thread that captured it, and takes it out of its map
    // while it runs. Dropping it from another thread (with its model) destroys the handles once.
    unsafe impl Send for Graph {}

    impl Graph {
        /// Queues the captured launches on the stream they were captured on (the capturing thread's).
        pub fn launch(&self) -> Result<()> {
            Ok(self.0.launch().w()?)
        }
    }

    fn cuda_device(dev: &Device) -> Result<&CudaDevice> {
        match dev {
            Device::Cuda(d) => Ok(d),
            _ => Err(Error::Internal("a CUDA graph of a forward on another device".into())),
        }
    }

    /// Runs `body` with candle's small host-to-device copies (the shapes, strides and parameters its kernels take)
    /// cached on the device by content, on this thread: the pass before a capture, so that the captured pass finds
    /// every such copy already on the device (candle refuses an uncached one while capturing).
    pub fn with_upload_cache<T>(dev: &Device, body: impl FnOnce() -> Result<T>) -> Result<T> {
        let _cache = cuda_device(dev)?.enable_cuda_graph_htod_cache();
        body()
    }

    /// Captures the launches `body` queues on the device's stream (this thread's) into a graph; nothing runs. The
    /// caller ran the same body under `with_upload_cache` just before, on this thread. `body` must copy nothing to
    /// the host (candle refuses) and drop every tensor it allocates (each allocation and free becomes a node of
    /// the graph); what it computes goes into buffers allocated before. Instantiated to free anything left
    /// allocated when launched again, and uploaded, so that the first launch costs what every launch does.
    pub fn capture(dev: &Device, body: impl FnOnce() -> Result<()>) -> Result<Graph> {
        use cudarc::driver::sys::{CUgraphInstantiate_flags as Flags, CUstreamCaptureMode as Mode};
        let d = cuda_device(dev)?;
        let stream = d.cuda_stream();
        let _cache = d.enable_cuda_graph_htod_cache();
        stream.synchronize().w()?;
        // thread-local: other threads' forwards (on their own streams) go on while this one captures
        stream.begin_capture(Mode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL).w()?;
        let ran = std::panic::catch_unwind(std::panic::AssertUnwindSafe(body))
            .unwrap_or_else(|_| Err(Error::Internal("a forward panicked while its CUDA graph was captured".into())));
        // always end the capture, so that the thread's stream is usable again whatever the body did. cudarc keeps
        // an error a free met while capturing (its drops cannot return one) and hands it to the next call, which
        // would then return before ending the capture: take it first
        let recorded = stream.context().check_err();
        let graph = stream.end_capture(Flags::CUDA_GRAPH_INSTANTIATE_FLAG_AUTO_FREE_ON_LAUNCH);
        ran?;
        recorded.w()?;
        let graph = graph.w()?.ok_or_else(|| Error::Internal("the CUDA graph capture recorded nothing".into()))?;
        graph.upload().w()?;
        Ok(Graph(graph))
    }

    /// Writes `words` into a u32 CUDA storage from element `at` on: one host-to-device copy on the device's stream
    /// (queued after the launches before it that read those elements). A forward's one upload ([`net::step`]).
    pub fn write_words(s: &mut CudaStorage, at: usize, words: &[u32]) -> candle_core::Result<()> {
        let dev = s.device.clone();
        let slice = s.as_cuda_slice_mut::<u32>()?;
        let n = slice.len();
        let Some(mut dst) = slice.try_slice_mut(at..at + words.len()) else {
            candle_core::bail!("{} words at {at} of a {n}-word buffer", words.len())
        };
        dev.memcpy_htod(words, &mut dst)
    }

    /// The device addresses of a segment table (`segment_table`'s words, u32, covering `n_segs` segments and `rows`
    /// stacked rows) and of one layer's K/V address table (2 · n_segs 8-byte addresses, as 4 · n_segs u32 words),
    /// checked for what the `*_segments` kernels read; `what` names the caller in the errors.
    fn segment_tables((table, kv): (&Tensor, &Tensor), n_segs: usize, rows: usize, what: &str) -> Result<(u64, u64)> {
        if kv.dims() != [4 * n_segs] || kv.dtype() != DType::U32 {
            return Err(Error::Internal(format!("CUDA {what}: a K/V address table of another shape or dtype")));
        }
        if table.dtype() != DType::U32 || table.elem_count() < n_segs * SEG_WORDS + rows {
            return Err(Error::Internal(format!("CUDA {what}: a segment table of another size")));
        }
        contiguous(table, "segment table")?;
        contiguous(kv, "cache table")?;
        Ok((ptr(table, 4)?.0, ptr(kv, 8)?.0))
    }

    /// `prep` for every segment of a forward in one launch: `tables` = (the segment table's words, u32, and this
    /// layer's K and V cache addresses of each segment, 2 · n_segs 8-byte addresses as u32 words) on the device
    /// (`segment_table`); the other operands as `prep`'s. Returns q, (rows, heads, D) f32, for all the stacked rows.
    pub fn prep_segments(
        qkv: &Tensor,
        tables: (&Tensor, &Tensor),
        (cos, sin): (&Tensor, &Tensor),
        norms: (Option<&Tensor>, Option<&Tensor>, f32),
        heads: (usize, usize),
        n_segs: usize,
    ) -> Result<Tensor> {
        let (nh, nkv) = heads;
        let (rows, slots, d) = qkv.dims3()?;
        if slots != nh + 2 * nkv || rows == 0 {
            return Err(Error::Internal("CUDA prep over segments: operand shapes disagree".into()));
        }
        let (t_p, kv_p) = segment_tables(tables, n_segs, rows, "prep over segments")?;
        if cos.dims() != [rows, d / 2] || sin.dims() != [rows, d / 2] || cos.dtype() != DType::F32 {
            return Err(Error::Internal(
                "CUDA prep over segments: RoPE tables must be (rows, head_dim / 2) f32".into(),
            ));
        }
        for (t, what) in [(qkv, "q/k/v product"), (cos, "cos"), (sin, "sin")] {
            contiguous(t, what)?;
        }
        let name = format!("mbd_prep_segments_{}", suffix(qkv.dtype())?);
        let o = PrepOperands::of(qkv, (cos, sin), norms)?;
        // every element of q is written: one thread per (row, head, dim)
        let (q, q_p) = output(&o.dev, DType::F32, &[rows, nh, d])?;
        let f = o.dev.get_or_load_custom_func(&name, MODULE, PTX)?;
        let mut b = f.builder();
        let (n_, nh_, nkv_, d_) = (i32_of(n_segs)?, i32_of(nh)?, i32_of(nkv)?, i32_of(d)?);
        b.arg(&o.qkv).arg(&o.cos).arg(&o.sin).arg(&o.qn).arg(&o.kn).arg(&o.eps).arg(&q_p);
        b.arg(&t_p).arg(&n_).arg(&kv_p).arg(&nh_).arg(&nkv_).arg(&d_);
        // SAFETY: the arguments match mbd_prep_segments_*'s parameters; the table was checked by segment_table.
        unsafe { b.launch(dims((rows, slots, 1), d)?) }.w()?;
        Ok(q)
    }

    /// `attend` for every segment of a forward in one launch per kernel: `q` (rows, heads, D) f32 from
    /// `prep_segments`, `tables` as there, `most` the table's chunk bound, `dtype` the caches'. Returns (rows,
    /// heads · D) in `dtype`.
    pub fn attend_segments(
        q: &Tensor,
        tables: (&Tensor, &Tensor),
        n_segs: usize,
        kv_heads: usize,
        most: usize,
        scale: f32,
        dtype: DType,
    ) -> Result<Tensor> {
        let (rows, nh, d) = q.dims3()?;
        if q.dtype() != DType::F32 || kv_heads == 0 || nh % kv_heads != 0 {
            return Err(Error::Internal("CUDA attention over segments: operand shapes disagree".into()));
        }
        let (t_p, kv_p) = segment_tables(tables, n_segs, rows, "attention over segments")?;
        contiguous(q, "query")?;
        let sfx = suffix(dtype)?;
        let (q_p, dev) = ptr(q, 4)?;
        // each segment's (row, head, chunk) blocks write their records; the combine reads only those
        let (ws, ws_p) = output(&dev, DType::F32, &[rows, nh, most, d + 2])?;
        let f = dev.get_or_load_custom_func(&format!("mbd_attn_partial_segments_{sfx}"), MODULE, PTX)?;
        let mut b = f.builder();
        let (n_, rep, d_) = (i32_of(n_segs)?, i32_of(nh / kv_heads)?, i32_of(d)?);
        b.arg(&q_p).arg(&t_p).arg(&n_).arg(&kv_p).arg(&ws_p).arg(&rep).arg(&d_).arg(&scale);
        // SAFETY: the arguments match mbd_attn_partial_segments_*'s parameters; key rows are 16-byte aligned as the
        // caches are whole allocations of D-wide rows (D a multiple of 32, `available`).
        unsafe { b.launch(dims((rows, nh, most), THREADS)?) }.w()?;
        let (out, out_p) = output(&dev, dtype, &[rows, nh * d])?;
        let f = dev.get_or_load_custom_func(&format!("mbd_attn_combine_segments_{sfx}"), MODULE, PTX)?;
        let mut b = f.builder();
        let most_ = i32_of(most)?;
        b.arg(&ws_p).arg(&t_p).arg(&n_).arg(&out_p).arg(&most_).arg(&d_);
        // SAFETY: as above; `ws` lives until this launch is queued, and frees are ordered on the same stream.
        unsafe { b.launch(dims((rows, nh, 1), d)?) }.w()?;
        drop(ws);
        Ok(out)
    }

    /// Per row of `logits` (rows, V): (argmax, entropy, max probability) of softmax(row) as [`stats::row_stats`]
    /// defines them, in one launch (a block per row). Returns (rows, 3) f64; the argmax is exact as an f64.
    /// Threads of a `gdn_rows` block (kernels.cu's GDN_THREADS).
    const GDN_THREADS: usize = 256;

    fn f32_operand(t: &Tensor, dims: &[usize], what: &str) -> Result<()> {
        if t.dims() != dims || t.dtype() != DType::F32 {
            return Err(Error::Internal(format!("CUDA Gated DeltaNet: {what} of another shape or dtype")));
        }
        contiguous(t, what)
    }

    /// [`delta_rule::window_rows`] on the GPU: `p` (rows, width) f32 projected rows, `tail` (kernel - 1, conv_dim) f32
    /// the convolution's history, `conv` = (weight (conv_dim · kernel), -exp(A_log), dt_bias (v_heads)) f32, `heads`
    /// = (k_heads, dk, v_heads, dv) -> (rows, row_width) f32, one launch (a block per row).
    pub fn gdn_rows(
        p: &Tensor,
        tail: &Tensor,
        (cw, na, dt): (&Tensor, &Tensor, &Tensor),
        (hk, dk, hv, dv): (usize, usize, usize, usize),
    ) -> Result<Tensor> {
        let (taps, c) = tail.dims2()?;
        let (kernel, width) = (taps + 1, c + hv * dv + 2 * hv);
        let n = p.dim(0)?;
        f32_operand(p, &[n, width], "projected rows")?;
        f32_operand(tail, &[taps, c], "convolution history")?;
        f32_operand(cw, &[c * kernel], "convolution weight")?;
        f32_operand(na, &[hv], "decay")?;
        f32_operand(dt, &[hv], "dt bias")?;
        if c != 2 * hk * dk + hv * dv || !gdn_rows_fit(c) {
            return Err(Error::Internal("CUDA Gated DeltaNet: a layer the kernels do not take".into()));
        }
        let (p_p, dev) = ptr(p, 4)?;
        let (out, out_p) = output(&dev, DType::F32, &[n, c + 2 * hv])?;
        if n == 0 {
            return Ok(out);
        }
        let t_p = if tail.elem_count() > 0 { ptr(tail, 4)?.0 } else { 0 };
        let (cw_p, na_p, dt_p) = (ptr(cw, 4)?.0, ptr(na, 4)?.0, ptr(dt, 4)?.0);
        let f = dev.get_or_load_custom_func("mbd_gdn_rows", MODULE, PTX)?;
        let mut b = f.builder();
        let ints = [c, kernel, width, hk, dk, hv, dv].map(i32_of).into_iter().collect::<Result<Vec<i32>>>()?;
        b.arg(&p_p).arg(&t_p).arg(&cw_p).arg(&na_p).arg(&dt_p).arg(&out_p);
        for v in &ints {
            b.arg(v);
        }
        let mut cfg = dims((n, 1, 1), GDN_THREADS)?;
        cfg.shared_mem_bytes = (c * 4) as u32;
        // SAFETY: the arguments match mbd_gdn_rows' parameters; the shapes were checked above, and every element
        // of `out` is written (a block per row writes its whole row).
        unsafe { b.launch(cfg) }.w()?;
        Ok(out)
    }

    /// The recurrence on the GPU from `state` ((v_heads, dk, dv) f32) over the first `n` rows of `rows`
    /// (`gdn_rows`' layout), `keys` = (k_heads, tiled value heads): with `out`, the window's gated outputs
    /// (n, v_heads·dv) f32 and the state left as it was ([`delta_rule::window_out`]); without, the state after the n
    /// rows ([`delta_rule::advance`]). One launch: a block per value head, one or two threads per state column.
    pub fn gdn_scan(
        state: &Tensor,
        rows: &Tensor,
        out: Option<GdnOut<'_>>,
        n: usize,
        (hk, tiled): (usize, bool),
    ) -> Result<Tensor> {
        let (hv, dk, dv) = state.dims3()?;
        let rw = 2 * hk * dk + hv * dv + 2 * hv;
        f32_operand(state, &[hv, dk, dv], "recurrent state")?;
        if rows.dims2()?.1 != rw || rows.dim(0)? < n {
            return Err(Error::Internal("CUDA Gated DeltaNet: recurrence rows of another shape".into()));
        }
        f32_operand(rows, rows.dims(), "recurrence rows")?;
        let split = match gdn_split(dk) {
            Some(split) if gdn_scan_fits(dk, dv, hk, hv) => split,
            _ => return Err(Error::Internal("CUDA Gated DeltaNet: a layer the kernels do not take".into())),
        };
        let (s_p, dev) = ptr(state, 4)?;
        let (r_p, _) = ptr(rows, 4)?;
        let (result, y_p, so_p, p_p, w_p, eps, conv_dim, width) = match out {
            Some(o) => {
                let width = o.conv_dim + hv * dv + 2 * hv;
                f32_operand(o.p, &[n, width], "projected rows")?;
                f32_operand(o.norm_w, &[dv], "gated norm weight")?;
                let (y, y_p) = output(&dev, DType::F32, &[n, hv * dv])?;
                (y, y_p, 0u64, ptr(o.p, 4)?.0, ptr(o.norm_w, 4)?.0, o.eps, o.conv_dim, width)
            }
            None => {
                if n == 0 {
                    return Ok(state.copy()?);
                }
                let (so, so_p) = output(&dev, DType::F32, state.dims())?;
                (so, 0u64, so_p, 0u64, 0u64, 0f32, 0, 0)
            }
        };
        if n == 0 {
            return Ok(result);
        }
        let f = dev.get_or_load_custom_func(&format!("mbd_gdn_scan_{dk}"), MODULE, PTX)?;
        let mut b = f.builder();
        let ints =
            [n, conv_dim, width, hk, hv, dv, tiled as usize].map(i32_of).into_iter().collect::<Result<Vec<i32>>>()?;
        b.arg(&s_p).arg(&r_p).arg(&p_p).arg(&w_p).arg(&eps).arg(&y_p).arg(&so_p);
        for v in &ints {
            b.arg(v);
        }
        // SAFETY: the arguments match mbd_gdn_scan_<dk>'s parameters; the shapes were checked above. A forward
        // writes every element of y (each head's dv columns of each row), a commit every element of the state.
        unsafe { b.launch(dims((hv, 1, 1), dv * split)?) }.w()?;
        Ok(result)
    }

    pub fn row_stats(logits: &Tensor) -> Result<Tensor> {
        let logits = if logits.is_contiguous() { logits.clone() } else { logits.contiguous()? };
        let (rows, v) = logits.dims2()?;
        let sfx = suffix(logits.dtype())?;
        if rows == 0 || v == 0 {
            return Err(Error::Internal("CUDA row statistics of an empty logits matrix".into()));
        }
        let (x_p, dev) = ptr(&logits, 1)?;
        // every row's three values are written by its block's first thread
        let (out, out_p) = output(&dev, DType::F64, &[rows, 3])?;
        let f = dev.get_or_load_custom_func(&format!("mbd_row_stats_{sfx}"), MODULE, PTX)?;
        let mut b = f.builder();
        let v_ = i32_of(v)?;
        b.arg(&x_p).arg(&out_p).arg(&v_);
        // SAFETY: the arguments match mbd_row_stats_*'s parameters; the shape was read above.
        unsafe { b.launch(dims((rows, 1, 1), STAT_THREADS)?) }.w()?;
        Ok(out)
    }

    /// silu(g) · u of `gu` = (rows, 2I) (g its first I columns), computed in f32, rounded once.
    pub fn silu_mul(gu: &Tensor) -> Result<Tensor> {
        let gu = if gu.is_contiguous() { gu.clone() } else { gu.contiguous()? };
        let (rows, two_i) = gu.dims2()?;
        let i = two_i / 2;
        let sfx = suffix(gu.dtype())?;
        let (g_p, dev) = ptr(&gu, 1)?;
        // every element is written (a grid-stride loop over rows · I)
        let (out, out_p) = output(&dev, gu.dtype(), &[rows, i])?;
        let n = rows * i;
        if n == 0 {
            return Ok(out);
        }
        let f = dev.get_or_load_custom_func(&format!("mbd_silu_mul_{sfx}"), MODULE, PTX)?;
        let mut b = f.builder();
        let (n_, i_) = (n, i32_of(i)?);
        b.arg(&g_p).arg(&out_p).arg(&n_).arg(&i_);
        // SAFETY: the arguments match mbd_silu_mul_*'s parameters.
        unsafe { b.launch(dims((n.div_ceil(256).min(1 << 20), 1, 1), 256)?) }.w()?;
        Ok(out)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_layout_is_offsets_then_pairs() {
        let visible = vec![vec![0..5], vec![], vec![0..3, 7..9]];
        assert_eq!(ranges_layout(&visible).unwrap(), vec![0, 1, 1, 3, 0, 5, 0, 3, 7, 9]);
        let too_far = u32::MAX as usize + 1;
        assert!(ranges_layout(&[vec![0..2, too_far - 1..too_far]]).is_err());
    }

    #[test]
    fn chunking_fills_about_two_waves_with_whole_tiles() {
        // one row of 16 heads: 17 chunks wanted (264 blocks), of whole tiles of 128 keys
        assert_eq!(chunking(1, 16, 2048), (128, 16));
        assert_eq!(chunking(1, 16, 2049), (128, 17));
        assert_eq!(chunking(1, 16, 4096), (256, 16));
        // enough rows for the blocks: one chunk of every key
        assert_eq!(chunking(32, 16, 544), (640, 1));
        for (w, h, keys) in [(1, 1, 1), (3, 7, 100_000), (64, 32, 512), (2, 16, 129)] {
            let (chunk, chunks) = chunking(w, h, keys);
            assert!(chunk.is_multiple_of(128) && chunks * chunk >= keys && (chunks - 1) * chunk < keys);
        }
    }

    #[test]
    fn the_chunk_bound_holds_for_every_key_count_and_is_reached() {
        for (w, h) in [(1, 1), (1, 16), (2, 16), (3, 7), (8, 32), (32, 16), (1, 264), (1, 1000)] {
            let bound = chunk_bound(w, h);
            let mut reached = false;
            for keys in (0..40_000).step_by(37).chain([1 << 20, 1 << 24]) {
                let (_, chunks) = chunking(w, h, keys);
                assert!(chunks <= bound, "{w} rows x {h} heads over {keys} keys: {chunks} chunks past {bound}");
                reached |= chunks == bound;
            }
            assert!(reached, "{w} rows x {h} heads: the bound {bound} is never used");
        }
        // a table's launch size does not move with the committed lengths
        let vis = |w: usize, keys: usize| vec![vec![0..keys]; w];
        let (va, vb) = (vis(1, 5), vis(1, 3000));
        let most = |p: usize, v: &Vec<Vec<std::ops::Range<usize>>>| {
            let segs = [SegmentRows { row0: 0, w: 1, p, capacity: 4096, visible: v }];
            segment_table(&segs, 16).unwrap().most
        };
        assert_eq!(most(4, &va), most(2999, &vb));
    }

    #[test]
    fn segment_table_layout() {
        let a = vec![vec![0..5], vec![0..6]]; // 2 rows over p 4
        let b = vec![vec![0..1, 1..2]]; // 1 row over p 1
        let segs = [
            SegmentRows { row0: 1, w: 2, p: 4, capacity: 64, visible: &a },
            SegmentRows { row0: 0, w: 1, p: 1, capacity: 8, visible: &b },
        ];
        let t = segment_table(&segs, 16).unwrap();
        let (c0, n0) = chunking(2, 16, 6);
        let (c1, n1) = chunking(1, 16, 2);
        assert_eq!((t.rows, t.most), (3, chunk_bound(1, 16)));
        assert!(n0.max(n1) < t.most);
        let base0 = 2 * SEG_WORDS + 3;
        let base1 = base0 + ranges_layout(&a).unwrap().len();
        let head0 = [1, 2, 4, c0, n0, base0, 64, 0].map(|x| x as u32);
        let head1 = [0, 1, 1, c1, n1, base1, 8, 0].map(|x| x as u32);
        assert_eq!(t.words[..SEG_WORDS], head0);
        assert_eq!(t.words[SEG_WORDS..2 * SEG_WORDS], head1);
        assert_eq!(t.words[2 * SEG_WORDS..base0], [1, 0, 0], "row 0 is segment 1's, rows 1-2 segment 0's");
        assert_eq!(t.words[base0..base1], ranges_layout(&a).unwrap()[..]);
        assert_eq!(t.words[base1..], ranges_layout(&b).unwrap()[..]);
    }

    /// The `*_segments` kernels' reading of a segment table, line for line from kernels.cu (`attn_partial_segments`
    /// and `attn_combine_segments` over `attn_chunk` / `combine_row`, in f64): for each stacked row and head, the
    /// row's segment, its key ranges inside each of its chunks, one (m, l, acc) record per chunk, then the merge.
    fn attend_as_the_kernels_read(
        t: &SegmentTable,
        n_segs: usize,
        q: &[f64],
        caches: &[(Vec<f64>, Vec<f64>)],
        (heads, kv_heads, d): (usize, usize, usize),
    ) -> Vec<f64> {
        let w = &t.words;
        let mut out = vec![0f64; t.rows * heads * d];
        for g in 0..t.rows {
            let seg = w[n_segs * SEG_WORDS + g] as usize;
            let sg = &w[seg * SEG_WORDS..(seg + 1) * SEG_WORDS];
            let (row0, rows, chunk, chunks, base, cap) =
                (sg[0] as usize, sg[1] as usize, sg[3] as usize, sg[4] as usize, sg[5] as usize, sg[6] as usize);
            assert!(chunks <= t.most);
            let (i, ranges) = (g - row0, &w[base..]);
            let pairs = &ranges[rows + 1..];
            for h in 0..heads {
                let kvh = h / (heads / kv_heads);
                let qp = &q[(g * heads + h) * d..][..d];
                let mut recs = vec![];
                for c in 0..chunks {
                    let (c_lo, c_hi) = (c * chunk, (c + 1) * chunk);
                    let (mut m, mut l, mut acc) = (f64::NEG_INFINITY, 0f64, vec![0f64; d]);
                    for ri in ranges[i] as usize..ranges[i + 1] as usize {
                        let (lo, hi) = ((pairs[2 * ri] as usize).max(c_lo), (pairs[2 * ri + 1] as usize).min(c_hi));
                        for key in lo..hi {
                            let kr = &caches[seg].0[(kvh * cap + key) * d..][..d];
                            let s = qp.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt();
                            let mn = m.max(s);
                            let corr = (m - mn).exp();
                            let p = (s - mn).exp();
                            let vr = &caches[seg].1[(kvh * cap + key) * d..][..d];
                            for (a, v) in acc.iter_mut().zip(vr) {
                                *a = *a * corr + p * v;
                            }
                            l = l * corr + p;
                            m = mn;
                        }
                    }
                    recs.push((m, l, acc));
                }
                let big = recs.iter().map(|r| r.0).fold(f64::NEG_INFINITY, f64::max);
                let o = &mut out[(g * heads + h) * d..][..d];
                if big > f64::NEG_INFINITY {
                    let lsum: f64 =
                        recs.iter().filter(|r| r.0 > f64::NEG_INFINITY).map(|r| r.1 * (r.0 - big).exp()).sum();
                    for (j, oj) in o.iter_mut().enumerate() {
                        let a: f64 =
                            recs.iter().filter(|r| r.0 > f64::NEG_INFINITY).map(|r| r.2[j] * (r.0 - big).exp()).sum();
                        *oj = a / lsum;
                    }
                }
            }
        }
        out
    }

    #[test]
    fn the_segment_kernels_reading_of_a_table_is_each_segments_own_attention() {
        // three segments of different windows, caches and masks, stacked out of order, GQA 4:2
        let (heads, kv_heads, d) = (4, 2, 8);
        let mut x = 0x2545F4914F6CDD1Du64;
        let mut rnd = move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x % 2001) as f64 / 1000.0 - 1.0
        };
        // (row0, w, p, capacity, visible): a causal row over a long cache (several chunks), a block-causal pair, and
        // a window of three rows with gaps in what they see
        let vis_a = vec![vec![0..300]];
        let vis_b = vec![vec![0..6], vec![0..6]];
        let vis_c = vec![vec![0..2, 5..8], vec![1..9], vec![]];
        let specs = [(5, 1, 299, 320, &vis_a), (0, 2, 4, 64, &vis_b), (2, 3, 6, 16, &vis_c)];
        let segs: Vec<SegmentRows<'_>> = specs
            .iter()
            .map(|&(row0, w, p, capacity, visible)| SegmentRows { row0, w, p, capacity, visible })
            .collect();
        let t = segment_table(&segs, heads).unwrap();
        assert!(t.most > 1, "the long segment takes several chunks");
        let caches: Vec<(Vec<f64>, Vec<f64>)> = specs
            .iter()
            .map(|s| {
                let n = kv_heads * s.3 * d;
                ((0..n).map(|_| rnd()).collect(), (0..n).map(|_| rnd()).collect())
            })
            .collect();
        let q: Vec<f64> = (0..t.rows * heads * d).map(|_| rnd()).collect();
        let got = attend_as_the_kernels_read(&t, segs.len(), &q, &caches, (heads, kv_heads, d));
        // each segment's rows attended directly over the keys its rows see (softmax in f64)
        for (s, spec) in specs.iter().enumerate() {
            let (row0, _, _, cap, visible) = *spec;
            for (i, seen) in visible.iter().enumerate() {
                for h in 0..heads {
                    let (g, kvh) = (row0 + i, h / (heads / kv_heads));
                    let qp = &q[(g * heads + h) * d..][..d];
                    let keys: Vec<usize> = seen.iter().flat_map(|r| r.clone()).collect();
                    let sc: Vec<f64> = keys
                        .iter()
                        .map(|&k| {
                            let kr = &caches[s].0[(kvh * cap + k) * d..][..d];
                            qp.iter().zip(kr).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                        })
                        .collect();
                    let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let z: f64 = sc.iter().map(|s| (s - m).exp()).sum();
                    for j in 0..d {
                        let want = if keys.is_empty() {
                            0.0
                        } else {
                            let vv = &caches[s].1;
                            keys.iter()
                                .zip(&sc)
                                .map(|(&k, x)| (x - m).exp() / z * vv[(kvh * cap + k) * d + j])
                                .sum::<f64>()
                        };
                        let have = got[(g * heads + h) * d + j];
                        assert!((have - want).abs() < 1e-9, "segment {s} row {i} head {h} dim {j}: {have} vs {want}");
                    }
                }
            }
        }
    }

    #[test]
    fn segment_table_refuses_what_the_kernels_cannot_read() {
        let one = vec![vec![0..3]];
        let seg = |row0, w, p, capacity, visible| SegmentRows { row0, w, p, capacity, visible };
        // the window past its cache's capacity
        assert!(segment_table(&[seg(0, 1, 3, 3, &one)], 8).is_err());
        // a key range past the window's end
        let far = vec![vec![0..9]];
        assert!(segment_table(&[seg(0, 1, 2, 16, &far)], 8).is_err());
        // two segments on one row, and a row list of another length
        assert!(segment_table(&[seg(0, 1, 2, 16, &one), seg(0, 1, 2, 16, &one)], 8).is_err());
        assert!(segment_table(&[seg(0, 2, 2, 16, &one)], 8).is_err());
        // rows past the stacked rows
        assert!(segment_table(&[seg(1, 1, 2, 16, &one)], 8).is_err());
        assert!(segment_table(&[seg(0, 1, 2, 16, &one)], 8).is_ok());
    }

    #[test]
    fn not_available_on_the_cpu() {
        assert!(!runs_on(&Device::Cpu, DType::F32));
        assert!(!available(&Device::Cpu, DType::F32, 16, 8, 128));
    }

    #[test]
    fn fused_attention_bound_follows_the_measured_crossover() {
        // SDAR-1.7B shape (16 heads of 128): W 16 over P 2048 and W 64 over P 512 in the kernel, W 32 and W 64
        // over P 2048 in candle's matmuls
        assert!(fused_attention(16, 2048 + 16, 16, 128));
        assert!(fused_attention(64, 512 + 64, 16, 128));
        assert!(!fused_attention(32, 2048 + 32, 16, 128));
        assert!(!fused_attention(64, 2048 + 64, 16, 128));
        // Qwen3-8B shape (32 heads of 128): W 32 over P 512 in the kernel, over P 2048 not
        assert!(fused_attention(32, 512 + 32, 32, 128));
        assert!(!fused_attention(32, 2048 + 32, 32, 128));
        assert!(!fused_attention(usize::MAX, 2, 1, 1));
    }
}
