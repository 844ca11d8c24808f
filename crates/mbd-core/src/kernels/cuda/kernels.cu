// mbd-rs's own CUDA kernels: the attention of a decode window fused into few launches.
// Built to PTX by build.rs with the pinned nvcc when the `cuda` feature is on; loaded by src/kernels/cuda.rs.
//
// - mbd_prep_*: per (window row, head slot) of the stacked q/k/v product: the Qwen3 q/k RMSNorm (when given),
//   RoPE from f32 tables, q written as f32 (rows, heads, D), k and v written into the KV cache after its
//   committed prefix. Replaces the norms' copies, the transposes, the two RoPE launches and the cache writes.
// - mbd_attn_partial_* / mbd_attn_combine_*: attention of every window row over the key ranges it sees, scores and
//   softmax in f32, K/V read in the cache's dtype: each block takes one (row, head, key chunk) and keeps an
//   online softmax over tiles of keys; the combine kernel merges the chunks (split over keys so that a one-row
//   window still fills the GPU). Replaces the casts of q and of the whole K cache to f32, the score matmul, the
//   scale, the mask add, the softmax, the cast back, the value matmul and the transposes.
// - mbd_silu_mul_*: silu(g) * u of the stacked gate/up product in one pass.
// - mbd_add_rms_norm_*: the residual add and the next RMSNorm in one pass.
// - mbd_row_stats_*: a decode step's per-row statistics of the logits (argmax, entropy, max probability).
// - mbd_prep_segments_* / mbd_attn_partial_segments_* / mbd_attn_combine_segments_*: the same for every segment of
//   a forward in one launch each (a segment table says which rows are whose, with each one's cache and chunking).
// - mbd_gdn_rows / mbd_gdn_scan_*: Qwen3.5's Gated DeltaNet after its projections (kernels/delta_rule.rs): a
//   window's recurrence rows (causal convolution + SiLU, L2-normed q/k, decay and beta) in one launch, and the
//   recurrence from the committed state with the gated RMSNorm (a forward) or the state after n rows (a commit)
//   in one, so that the recurrent state never leaves the GPU.
// The key ranges of a row come from the mask spec (MaskSpec::visible on the host): ranges[0..=w] are offsets into
// the (lo, hi) pairs that follow them.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <limits.h>
#include <stdint.h>

#define THREADS 128
#define WARPS (THREADS / 32)
#define TILE THREADS
#define MAX_D 256
#define MAX_DPL (MAX_D / 32)

__device__ __forceinline__ float to_f(float x) { return x; }
__device__ __forceinline__ float to_f(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_f(__half x) { return __half2float(x); }

template <typename T> __device__ __forceinline__ T from_f(float x);
template <> __device__ __forceinline__ float from_f<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float x) { return __float2bfloat16(x); }
template <> __device__ __forceinline__ __half from_f<__half>(float x) { return __float2half(x); }

__device__ __forceinline__ float warp_sum(float x) {
  for (int o = 16; o > 0; o >>= 1) x += __shfl_xor_sync(0xffffffffu, x, o);
  return x;
}

__device__ __forceinline__ float warp_max(float x) {
  for (int o = 16; o > 0; o >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, o));
  return x;
}

__device__ __forceinline__ float2 to_f2(__nv_bfloat162 x) { return __bfloat1622float2(x); }
__device__ __forceinline__ float2 to_f2(__half2 x) { return __half22float2(x); }

// q (f32, in shared memory) . one key row of D 16-bit values (T2: a pair of them; D a multiple of 8, the row
// 16-byte aligned).
template <typename T2>
__device__ __forceinline__ float dot_row16(const float* qs, const void* r, int D) {
  float s = 0.f;
  const uint4* r4 = reinterpret_cast<const uint4*>(r);
  for (int c = 0; c < D / 8; ++c) {
    uint4 u = r4[c];
    const T2* p = reinterpret_cast<const T2*>(&u);
#pragma unroll
    for (int t = 0; t < 4; ++t) {
      float2 f = to_f2(p[t]);
      s = fmaf(qs[8 * c + 2 * t], f.x, s);
      s = fmaf(qs[8 * c + 2 * t + 1], f.y, s);
    }
  }
  return s;
}

__device__ __forceinline__ float dot_row(const float* qs, const __nv_bfloat16* r, int D) {
  return dot_row16<__nv_bfloat162>(qs, r, D);
}

__device__ __forceinline__ float dot_row(const float* qs, const __half* r, int D) {
  return dot_row16<__half2>(qs, r, D);
}

// The same for f32 rows (D a multiple of 4).
__device__ __forceinline__ float dot_row(const float* qs, const float* r, int D) {
  float s = 0.f;
  const float4* r4 = reinterpret_cast<const float4*>(r);
  for (int c = 0; c < D / 4; ++c) {
    float4 f = r4[c];
    s = fmaf(qs[4 * c], f.x, s);
    s = fmaf(qs[4 * c + 1], f.y, s);
    s = fmaf(qs[4 * c + 2], f.z, s);
    s = fmaf(qs[4 * c + 3], f.w, s);
  }
  return s;
}

// Grid (w, slots = heads + 2 kv_heads), block D threads (D even, at most 1024).
// qkv: (rows, slots, D) in the model dtype, this segment's rows from row0. cos/sin: (rows, D/2) f32, same rows.
// qn/kn: the q/k norm weights (D) or null. q_out: (w, heads, D) f32. k_cache/v_cache: (kv_heads, cap, D), the
// window's row j written at slot p + j.
// (prep_row: one row of it, for either grid: stacked row `row` of qkv and the tables, q written at row `qrow` of
// q_out, k/v at slot `slot` of the caches.)
template <typename T>
__device__ void prep_row(const T* __restrict__ qkv, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                         const T* __restrict__ qn, const T* __restrict__ kn, float eps, float* __restrict__ q_out,
                         T* __restrict__ k_cache, T* __restrict__ v_cache, int row, int qrow, int slot, int heads,
                         int kv_heads, int D, int cap) {
  __shared__ float xs[1024];
  __shared__ float red[32];
  const int s = blockIdx.y, t = threadIdx.x;
  const int slots = heads + 2 * kv_heads, half = D / 2;
  const T raw = qkv[((size_t)row * slots + s) * D + t];
  if (s >= heads + kv_heads) {  // v: copied as it is
    v_cache[((size_t)(s - heads - kv_heads) * cap + slot) * D + t] = raw;
    return;
  }
  float x = to_f(raw);
  const T* nw = s < heads ? qn : kn;
  if (nw != nullptr) {  // RMSNorm over the head's D values (block-uniform branch)
    float ss = warp_sum(x * x);
    if ((t & 31) == 0) red[t >> 5] = ss;
    __syncthreads();
    float tot = 0.f;
    for (int i = 0; i < (D + 31) / 32; ++i) tot += red[i];
    x = x * rsqrtf(tot / (float)D + eps) * to_f(nw[t]);
  }
  xs[t] = x;
  __syncthreads();
  const int i = t < half ? t : t - half;
  const float c = cos_t[(size_t)row * half + i], sn = sin_t[(size_t)row * half + i];
  const float y = t < half ? x * c - xs[t + half] * sn : x * c + xs[t - half] * sn;
  if (s < heads) {
    q_out[((size_t)qrow * heads + s) * D + t] = y;
  } else {
    k_cache[((size_t)(s - heads) * cap + slot) * D + t] = from_f<T>(y);
  }
}

template <typename T>
__device__ void prep(const T* __restrict__ qkv, const float* __restrict__ cos_t, const float* __restrict__ sin_t,
                     const T* __restrict__ qn, const T* __restrict__ kn, float eps, float* __restrict__ q_out,
                     T* __restrict__ k_cache, T* __restrict__ v_cache, int row0, int heads, int kv_heads, int D,
                     int cap, int p) {
  const int j = blockIdx.x;
  prep_row<T>(qkv, cos_t, sin_t, qn, kn, eps, q_out, k_cache, v_cache, row0 + j, j, p + j, heads, kv_heads, D, cap);
}

// The segment table of a forward whose segments are attended in one launch (cuda.rs, segment_table): SEG_WORDS
// words per segment, then the segment of every stacked row, then each segment's key ranges (ranges_layout).
#define SEG_WORDS 8
#define SEG_ROW0 0
#define SEG_W 1
#define SEG_P 2
#define SEG_CHUNK 3
#define SEG_CHUNKS 4
#define SEG_RANGES 5
#define SEG_CAP 6

// prep over every segment of a forward: grid (rows, slots), block D threads. Row g belongs to segment
// table[n_segs * SEG_WORDS + g]; kv holds each segment's K and V cache addresses for this layer.
template <typename T>
__device__ void prep_segments(const T* __restrict__ qkv, const float* __restrict__ cos_t,
                              const float* __restrict__ sin_t, const T* __restrict__ qn, const T* __restrict__ kn,
                              float eps, float* __restrict__ q_out, const uint32_t* __restrict__ table, int n_segs,
                              const unsigned long long* __restrict__ kv, int heads, int kv_heads, int D) {
  const int g = blockIdx.x;
  const uint32_t seg = table[n_segs * SEG_WORDS + g];
  const uint32_t* sg = table + seg * SEG_WORDS;
  T* k_cache = reinterpret_cast<T*>(kv[2 * seg]);
  T* v_cache = reinterpret_cast<T*>(kv[2 * seg + 1]);
  const int slot = (int)sg[SEG_P] + (g - (int)sg[SEG_ROW0]);
  prep_row<T>(qkv, cos_t, sin_t, qn, kn, eps, q_out, k_cache, v_cache, g, g, slot, heads, kv_heads, D,
              (int)sg[SEG_CAP]);
}

// Grid (w, heads, chunks), block THREADS. q: (w, heads, D) f32. k/v: (kv_heads, cap, D). Block (i, h, c) attends
// row i, head h over the keys of row i's ranges inside [c * chunk, (c + 1) * chunk) and writes (m, l, acc[D]) to
// ws[((i * heads + h) * chunks + c) * (D + 2)]: the running max of the scaled scores, the sum of exp(s - m) and
// the exp-weighted sum of value rows. A block reads every key of its chunk once for one query: the work grows
// with rows x keys, so long windows over long caches take candle's matmuls instead (cuda.rs, fused_attention).
// (attn_chunk: one block's work, for either grid: row i of a segment of w rows whose key ranges are `ranges`, its
// query head h at qp, key chunk c, the record written at o.)
template <typename T>
__device__ void attn_chunk(const float* __restrict__ qp, const T* __restrict__ k, const T* __restrict__ v,
                           const uint32_t* __restrict__ ranges, float* __restrict__ o, int i, int h, int c, int w,
                           int n_rep, int cap, int D, int chunk, float scale) {
  __shared__ float qs[MAX_D];
  __shared__ float sc[TILE];
  __shared__ float red[WARPS];
  __shared__ float part[WARPS][MAX_D];
  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int dpl = D / 32;
  for (int d = tid; d < D; d += THREADS) qs[d] = qp[d];
  __syncthreads();
  const int kvh = h / n_rep;
  const T* kb = k + (size_t)kvh * cap * D;
  const T* vb = v + (size_t)kvh * cap * D;
  float acc[MAX_DPL];
#pragma unroll
  for (int t = 0; t < MAX_DPL; ++t) acc[t] = 0.f;
  float m = -INFINITY, l = 0.f;
  const uint32_t c_lo = (uint32_t)c * (uint32_t)chunk, c_hi = c_lo + (uint32_t)chunk;
  const uint32_t* pairs = ranges + (w + 1);
  for (uint32_t ri = ranges[i]; ri < ranges[i + 1]; ++ri) {
    const uint32_t lo = max(pairs[2 * ri], c_lo), hi = min(pairs[2 * ri + 1], c_hi);
    for (uint32_t t0 = lo; t0 < hi; t0 += TILE) {  // block-uniform
      const int n = (int)min((uint32_t)TILE, hi - t0);
      float s = -INFINITY;
      if (tid < n) s = dot_row(qs, kb + (size_t)(t0 + tid) * D, D) * scale;
      float bm = warp_max(s);
      if (lane == 0) red[warp] = bm;
      __syncthreads();
      bm = red[0];
      for (int r = 1; r < WARPS; ++r) bm = fmaxf(bm, red[r]);
      const float mn = fmaxf(m, bm);  // finite: n >= 1
      const float corr = expf(m - mn);  // 0 while m is -inf
      const float pr = tid < n ? expf(s - mn) : 0.f;
      sc[tid] = pr;
      const float ps = warp_sum(pr);
      __syncthreads();  // every thread has read red
      if (lane == 0) red[warp] = ps;
      __syncthreads();
      float bs = 0.f;
      for (int r = 0; r < WARPS; ++r) bs += red[r];
      l = l * corr + bs;
      m = mn;
#pragma unroll
      for (int t = 0; t < MAX_DPL; ++t) acc[t] *= corr;
#pragma unroll 4
      for (int jj = warp; jj < n; jj += WARPS) {
        const float pj = sc[jj];
        const T* vr = vb + (size_t)(t0 + jj) * D + lane * dpl;
#pragma unroll
        for (int t = 0; t < MAX_DPL; ++t)
          if (t < dpl) acc[t] = fmaf(pj, to_f(vr[t]), acc[t]);
      }
      __syncthreads();  // sc and red are rewritten by the next tile
    }
  }
#pragma unroll
  for (int t = 0; t < MAX_DPL; ++t)
    if (t < dpl) part[warp][lane * dpl + t] = acc[t];
  __syncthreads();
  if (tid == 0) {
    o[0] = m;
    o[1] = l;
  }
  for (int d = tid; d < D; d += THREADS) {
    float a = 0.f;
    for (int r = 0; r < WARPS; ++r) a += part[r][d];
    o[2 + d] = a;
  }
}

template <typename T>
__device__ void attn_partial(const float* __restrict__ q, const T* __restrict__ k, const T* __restrict__ v,
                             const uint32_t* __restrict__ ranges, float* __restrict__ ws, int w, int n_rep, int cap,
                             int D, int chunk, float scale) {
  const int i = blockIdx.x, h = blockIdx.y, c = blockIdx.z;
  const int heads = gridDim.y, chunks = gridDim.z;
  attn_chunk<T>(q + ((size_t)i * heads + h) * D, k, v, ranges, ws + (((size_t)i * heads + h) * chunks + c) * (D + 2),
                i, h, c, w, n_rep, cap, D, chunk, scale);
}

// attn_partial over every segment of a forward: grid (rows, heads, the most chunks of any segment), block THREADS.
// Each segment keeps the chunking it would have alone (table: SEG_CHUNK, SEG_CHUNKS), so its arithmetic does not
// depend on what shares the forward; blocks past their segment's chunks return at once. ws: (rows, heads,
// gridDim.z, D + 2).
template <typename T>
__device__ void attn_partial_segments(const float* __restrict__ q, const uint32_t* __restrict__ table, int n_segs,
                                      const unsigned long long* __restrict__ kv, float* __restrict__ ws, int n_rep,
                                      int D, float scale) {
  const int g = blockIdx.x, h = blockIdx.y, c = blockIdx.z;
  const int heads = gridDim.y, most = gridDim.z;
  const uint32_t seg = table[n_segs * SEG_WORDS + g];
  const uint32_t* sg = table + seg * SEG_WORDS;
  if (c >= (int)sg[SEG_CHUNKS]) return;  // block-uniform
  const T* k = reinterpret_cast<const T*>(kv[2 * seg]);
  const T* v = reinterpret_cast<const T*>(kv[2 * seg + 1]);
  attn_chunk<T>(q + ((size_t)g * heads + h) * D, k, v, table + sg[SEG_RANGES],
                ws + (((size_t)g * heads + h) * most + c) * (D + 2), g - (int)sg[SEG_ROW0], h, c, (int)sg[SEG_W],
                n_rep, (int)sg[SEG_CAP], D, (int)sg[SEG_CHUNK], scale);
}

// (combine_row: merge the `chunks` records at b into out's element d.)
template <typename T>
__device__ void combine_row(const float* __restrict__ b, T* __restrict__ out, int chunks, int D, int d) {
  float M = -INFINITY;
  for (int c = 0; c < chunks; ++c) M = fmaxf(M, b[c * (D + 2)]);
  float L = 0.f, a = 0.f;
  if (M != -INFINITY) {
    for (int c = 0; c < chunks; ++c) {
      const float mc = b[c * (D + 2)];
      if (mc == -INFINITY) continue;
      const float e = expf(mc - M);
      L = fmaf(b[c * (D + 2) + 1], e, L);
      a = fmaf(b[c * (D + 2) + 2 + d], e, a);
    }
  }
  *out = from_f<T>(L > 0.f ? a / L : 0.f);
}

// Grid (w, heads), block D threads. out: (w, heads * D) in the model dtype.
template <typename T>
__device__ void attn_combine(const float* __restrict__ ws, T* __restrict__ out, int chunks, int D) {
  const int i = blockIdx.x, h = blockIdx.y, heads = gridDim.y, d = threadIdx.x;
  combine_row<T>(ws + ((size_t)i * heads + h) * chunks * (D + 2), out + (size_t)i * heads * D + (size_t)h * D + d,
                 chunks, D, d);
}

// attn_combine over every segment of a forward: grid (rows, heads), block D threads; `most`: ws's chunk stride.
template <typename T>
__device__ void attn_combine_segments(const float* __restrict__ ws, const uint32_t* __restrict__ table, int n_segs,
                                      T* __restrict__ out, int most, int D) {
  const int g = blockIdx.x, h = blockIdx.y, heads = gridDim.y, d = threadIdx.x;
  const uint32_t seg = table[n_segs * SEG_WORDS + g];
  combine_row<T>(ws + ((size_t)g * heads + h) * most * (D + 2), out + (size_t)g * heads * D + (size_t)h * D + d,
                 (int)table[seg * SEG_WORDS + SEG_CHUNKS], D, d);
}

// gu: (rows, 2 I) contiguous; out: (rows, I). n = rows * I.
template <typename T>
__device__ void silu_mul(const T* __restrict__ gu, T* __restrict__ out, size_t n, int inter) {
  for (size_t e = (size_t)blockIdx.x * blockDim.x + threadIdx.x; e < n; e += (size_t)gridDim.x * blockDim.x) {
    const size_t r = e / inter, col = e % inter;
    const float g = to_f(gu[r * 2 * inter + col]), u = to_f(gu[r * 2 * inter + inter + col]);
    out[e] = from_f<T>(g / (1.f + expf(-g)) * u);
  }
}

// Grid (rows), block ADD_THREADS. x, a: (rows, n). x_out = x + a (rounded to T), h_out = RMSNorm(x_out) * w: the
// residual add and the next norm in one pass (each was one launch). cuda.rs launches ADD_THREADS threads.
#define ADD_THREADS 256
template <typename T>
__device__ void add_rms_norm(const T* __restrict__ x, const T* __restrict__ a, const T* __restrict__ w, float eps,
                             T* __restrict__ x_out, T* __restrict__ h_out, int n) {
  __shared__ float red[ADD_THREADS / 32];
  const size_t base = (size_t)blockIdx.x * n;
  float ss = 0.f;
  for (int c = threadIdx.x; c < n; c += ADD_THREADS) {
    const T s = from_f<T>(to_f(x[base + c]) + to_f(a[base + c]));
    x_out[base + c] = s;
    const float v = to_f(s);
    ss = fmaf(v, v, ss);
  }
  ss = warp_sum(ss);
  if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
  __syncthreads();
  float tot = 0.f;
  for (int r = 0; r < ADD_THREADS / 32; ++r) tot += red[r];
  const float inv = rsqrtf(tot / (float)n + eps);
  for (int c = threadIdx.x; c < n; c += ADD_THREADS) h_out[base + c] = from_f<T>(to_f(x_out[base + c]) * inv * to_f(w[c]));
}

// Grid (rows), block STAT_THREADS. x: (rows, v). out: (rows, 3) f64: the argmax (ties -> lowest index), the
// entropy and the max probability of softmax(row), as kernels/stats.rs's row_stats computes them: the max m and its
// first index, then Z = sum e^(x - m) and S = sum e^(x - m) (x - m) with each term in f32 and the sums in f64;
// H = ln Z - S / Z, max p = 1 / Z. A NaN logit is never the argmax but makes Z (so the entropy) NaN, as on the host.
#define STAT_THREADS 512
__device__ __forceinline__ void better(float& m, int& i, float m2, int i2) {
  if (m2 > m || (m2 == m && i2 < i)) {
    m = m2;
    i = i2;
  }
}

template <typename T>
__device__ void row_stats(const T* __restrict__ x, double* __restrict__ out, int v) {
  __shared__ float sm[STAT_THREADS / 32];
  __shared__ int si[STAT_THREADS / 32];
  __shared__ double sz[STAT_THREADS / 32], ss[STAT_THREADS / 32];
  const T* r = x + (size_t)blockIdx.x * v;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  float m = -INFINITY;
  int idx = INT_MAX;  // INT_MAX: nothing seen (every value NaN so far)
  for (int c = threadIdx.x; c < v; c += STAT_THREADS) better(m, idx, to_f(r[c]), c);
  for (int o = 16; o > 0; o >>= 1) better(m, idx, __shfl_xor_sync(0xffffffffu, m, o), __shfl_xor_sync(0xffffffffu, idx, o));
  if (lane == 0) {
    sm[warp] = m;
    si[warp] = idx;
  }
  __syncthreads();
  m = sm[0];
  idx = si[0];
  for (int w = 1; w < STAT_THREADS / 32; ++w) better(m, idx, sm[w], si[w]);
  if (idx == INT_MAX) {  // an all-NaN row: index 0, and its NaN spreads into Z
    idx = 0;
    m = to_f(r[0]);
  }
  double z = 0.0, s = 0.0;
  for (int c = threadIdx.x; c < v; c += STAT_THREADS) {
    const float d = to_f(r[c]) - m;
    const float e = expf(d);
    z += (double)e;
    s += (double)(e * d);
  }
  for (int o = 16; o > 0; o >>= 1) {
    z += __shfl_xor_sync(0xffffffffu, z, o);
    s += __shfl_xor_sync(0xffffffffu, s, o);
  }
  if (lane == 0) {
    sz[warp] = z;
    ss[warp] = s;
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    double zt = 0.0, st = 0.0;
    for (int w = 0; w < STAT_THREADS / 32; ++w) {
      zt += sz[w];
      st += ss[w];
    }
    double* o = out + (size_t)blockIdx.x * 3;
    o[0] = (double)idx;
    o[1] = log(zt) - st / zt;
    o[2] = 1.0 / zt;
  }
}

// ---- Gated DeltaNet (kernels/delta_rule.rs's GdnParams::host_rows / host_out / advance, in f32)
// Grid (rows), block GDN_THREADS, dynamic shared memory conv_dim floats. p: (rows, width) projected rows (conv_dim |
// z | b | a), tail: (kernel - 1, conv_dim) the convolution's history, conv_w: (conv_dim, kernel). out: (rows,
// row_width) = q | k (k_heads x dk, L2-normed, q scaled by dk^-1/2) | v | g | beta. A warp per key head for the
// norms.
#define GDN_THREADS 256
extern "C" __global__ void __launch_bounds__(GDN_THREADS)
    mbd_gdn_rows(const float* __restrict__ p, const float* __restrict__ tail, const float* __restrict__ conv_w,
                 const float* __restrict__ neg_a, const float* __restrict__ dt_bias, float* __restrict__ out,
                 int conv_dim, int kernel, int width, int k_heads, int dk, int v_heads, int dv) {
  extern __shared__ float act[];
  const int t = blockIdx.x;
  const int kd = k_heads * dk, vd = v_heads * dv;
  const int rw = 2 * kd + vd + 2 * v_heads;
  float* o = out + (size_t)t * rw;
  for (int ch = threadIdx.x; ch < conv_dim; ch += GDN_THREADS) {
    float acc = 0.f;
    for (int j = 0; j < kernel; ++j) {
      const int r = t + j;  // row of (tail ++ p)
      const float u = r < kernel - 1 ? tail[(size_t)r * conv_dim + ch] : p[(size_t)(r - (kernel - 1)) * width + ch];
      acc = fmaf(conv_w[(size_t)ch * kernel + j], u, acc);
    }
    act[ch] = acc / (1.f + expf(-acc));
  }
  __syncthreads();
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const float scale = rsqrtf((float)dk);
  for (int hh = warp; hh < 2 * k_heads; hh += GDN_THREADS / 32) {
    const float* a = act + hh * dk;
    float ss = 0.f;
    for (int i = lane; i < dk; i += 32) ss = fmaf(a[i], a[i], ss);
    ss = warp_sum(ss);
    const float inv = rsqrtf(ss + 1e-6f) * (hh < k_heads ? scale : 1.f);
    for (int i = lane; i < dk; i += 32) o[hh * dk + i] = a[i] * inv;
  }
  for (int i = threadIdx.x; i < vd; i += GDN_THREADS) o[2 * kd + i] = act[2 * kd + i];
  const float* r = p + (size_t)t * width;
  for (int h = threadIdx.x; h < v_heads; h += GDN_THREADS) {
    const float b = r[conv_dim + vd + h], x = r[conv_dim + vd + v_heads + h] + dt_bias[h];
    const float sp = x > 20.f ? x : log1pf(expf(x));
    o[2 * kd + vd + h] = neg_a[h] * sp;
    o[2 * kd + vd + v_heads + h] = 1.f / (1.f + expf(-b));
  }
}

#define GDN_SCAN_THREADS 256
// Grid (v_heads), block dv x SPLIT threads (<= GDN_SCAN_THREADS): SPLIT threads (adjacent lanes) keep column j of their
// head's state in registers, DK / SPLIT values each, and run the recurrence over `n` rows of `rows` (mbd_gdn_rows'
// layout): S <- e^g S; delta = beta (v - S^T k); S <- S + k delta^T; o = S^T q. With `p` (a forward): y (n, v_heads
// x dv) = norm_w * o / rms(o) * silu(z) per head, z from p's rows; the state is not written. Without (a commit): the
// state after the n rows is written to state_out. key_head: h / (v_heads / k_heads), or h % k_heads when `tiled`.
template <int DK, int SPLIT>
__device__ void gdn_scan(const float* __restrict__ state, const float* __restrict__ rows, const float* __restrict__ p,
                         const float* __restrict__ norm_w, float eps, float* __restrict__ y,
                         float* __restrict__ state_out, int n, int conv_dim, int width, int k_heads, int v_heads,
                         int dv, int tiled) {
  constexpr int PART = DK / SPLIT;
  __shared__ float ks[DK], qs[DK];
  __shared__ float red[32];
  __shared__ float coef[2];
  const int h = blockIdx.x, j = threadIdx.x / SPLIT, part = threadIdx.x % SPLIT, i0 = part * PART;
  const int kh = tiled ? h % k_heads : h / (v_heads / k_heads);
  const int kd = k_heads * DK, vd = v_heads * dv;
  const int rw = 2 * kd + vd + 2 * v_heads;
  float s[PART];
  const float* s0 = state + (size_t)h * DK * dv;
#pragma unroll
  for (int i = 0; i < PART; ++i) s[i] = s0[(size_t)(i0 + i) * dv + j];
  for (int t = 0; t < n; ++t) {
    const float* r = rows + (size_t)t * rw;
    for (int i = threadIdx.x; i < DK; i += blockDim.x) {
      qs[i] = r[kh * DK + i];
      ks[i] = r[kd + kh * DK + i];
    }
    if (threadIdx.x == 0) {
      coef[0] = expf(r[2 * kd + vd + h]);
      coef[1] = r[2 * kd + vd + v_heads + h];
    }
    __syncthreads();
    const float decay = coef[0], beta = coef[1];
    float m = 0.f;
#pragma unroll
    for (int i = 0; i < PART; ++i) {
      s[i] *= decay;
      m = fmaf(s[i], ks[i0 + i], m);
    }
#pragma unroll
    for (int o = 1; o < SPLIT; o <<= 1) m += __shfl_xor_sync(0xffffffffu, m, o);
    const float delta = (r[2 * kd + h * dv + j] - m) * beta;
    float o = 0.f;
#pragma unroll
    for (int i = 0; i < PART; ++i) {
      s[i] = fmaf(ks[i0 + i], delta, s[i]);
      o = fmaf(s[i], qs[i0 + i], o);
    }
#pragma unroll
    for (int q = 1; q < SPLIT; q <<= 1) o += __shfl_xor_sync(0xffffffffu, o, q);
    if (p != nullptr) {
      const float ss = warp_sum(part == 0 ? o * o : 0.f);
      if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
      __syncthreads();
      float tot = 0.f;
      for (int w = 0; w < (int)(blockDim.x + 31) / 32; ++w) tot += red[w];
      if (part == 0) {
        const float inv = rsqrtf(tot / (float)dv + eps);
        const float z = p[(size_t)t * width + conv_dim + h * dv + j];
        y[(size_t)t * vd + h * dv + j] = norm_w[j] * (o * inv) * (z / (1.f + expf(-z)));
      }
    }
    __syncthreads();  // the next row's q/k and coefficients overwrite the shared ones
  }
  if (p == nullptr) {
    float* so = state_out + (size_t)h * DK * dv;
#pragma unroll
    for (int i = 0; i < PART; ++i) so[(size_t)(i0 + i) * dv + j] = s[i];
  }
}

#define GDN_ENTRY(DK, SPLIT)                                                                                     \
  extern "C" __global__ void __launch_bounds__(GDN_SCAN_THREADS)                                                 \
      mbd_gdn_scan_##DK(const float* state, const float* rows, const float* p, const float* norm_w, float eps,     \
                        float* y, float* state_out, int n, int conv_dim, int width, int k_heads, int v_heads,     \
                        int dv, int tiled) {                                                                     \
    gdn_scan<DK, SPLIT>(state, rows, p, norm_w, eps, y, state_out, n, conv_dim, width, k_heads, v_heads, dv,      \
                        tiled);                                                                                  \
  }
// threads per state column (cuda.rs's gdn_split): 64 state values in registers at most
GDN_ENTRY(16, 1)
GDN_ENTRY(32, 1)
GDN_ENTRY(64, 1)
GDN_ENTRY(128, 2)

#define ENTRY(NAME, T)                                                                                           \
  extern "C" __global__ void mbd_prep_##NAME(const T* qkv, const float* cos_t, const float* sin_t, const T* qn,   \
                                             const T* kn, float eps, float* q_out, T* k_cache, T* v_cache,        \
                                             int row0, int heads, int kv_heads, int D, int cap, int p) {          \
    prep<T>(qkv, cos_t, sin_t, qn, kn, eps, q_out, k_cache, v_cache, row0, heads, kv_heads, D, cap, p);           \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                          \
      mbd_attn_partial_##NAME(const float* q, const T* k, const T* v, const uint32_t* ranges, float* ws, int w,    \
                              int n_rep, int cap, int D, int chunk, float scale) {                               \
    attn_partial<T>(q, k, v, ranges, ws, w, n_rep, cap, D, chunk, scale);                                        \
  }                                                                                                              \
  extern "C" __global__ void mbd_attn_combine_##NAME(const float* ws, T* out, int chunks, int D) {                \
    attn_combine<T>(ws, out, chunks, D);                                                                         \
  }                                                                                                              \
  extern "C" __global__ void mbd_prep_segments_##NAME(const T* qkv, const float* cos_t, const float* sin_t,       \
                                                      const T* qn, const T* kn, float eps, float* q_out,          \
                                                      const uint32_t* table, int n_segs,                          \
                                                      const unsigned long long* kv, int heads, int kv_heads, int D) { \
    prep_segments<T>(qkv, cos_t, sin_t, qn, kn, eps, q_out, table, n_segs, kv, heads, kv_heads, D);               \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(THREADS)                                                          \
      mbd_attn_partial_segments_##NAME(const float* q, const uint32_t* table, int n_segs,                         \
                                       const unsigned long long* kv, float* ws, int n_rep, int D, float scale) {  \
    attn_partial_segments<T>(q, table, n_segs, kv, ws, n_rep, D, scale);                                         \
  }                                                                                                              \
  extern "C" __global__ void mbd_attn_combine_segments_##NAME(const float* ws, const uint32_t* table, int n_segs, \
                                                              T* out, int most, int D) {                          \
    attn_combine_segments<T>(ws, table, n_segs, out, most, D);                                                   \
  }                                                                                                              \
  extern "C" __global__ void mbd_silu_mul_##NAME(const T* gu, T* out, size_t n, int inter) {                      \
    silu_mul<T>(gu, out, n, inter);                                                                              \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(ADD_THREADS)                                                      \
      mbd_add_rms_norm_##NAME(const T* x, const T* a, const T* w, float eps, T* x_out, T* h_out, int n) {          \
    add_rms_norm<T>(x, a, w, eps, x_out, h_out, n);                                                              \
  }                                                                                                              \
  extern "C" __global__ void __launch_bounds__(STAT_THREADS) mbd_row_stats_##NAME(const T* x, double* out, int v) { \
    row_stats<T>(x, out, v);                                                                                     \
  }

ENTRY(f32, float)
ENTRY(bf16, __nv_bfloat16)
ENTRY(f16, __half)
