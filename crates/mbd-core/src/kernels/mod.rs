//! The kernels wing: arithmetic on slices. Block formats (`blocks`, `records`), one CPU feature probe (`cpu`),
//! per-ISA products (`skinny`: few rows; `panels`: many rows and matrices packed at load; `qdot`: integer dot
//! products on 8-bit activations), the blocked CPU attention (`attention`), the gated delta rule and its
//! convolution (`delta_rule`), vector math (`vmath`), a decode step's statistics of the logits rows on the
//! host or the GPU (`stats`) and mbd-rs's CUDA kernels (`cuda`). It knows block formats and instruction sets, never
//! layers, requests or files: nothing here imports from another wing (docs/dev/architecture.md).

pub mod attention;
pub mod blocks;
pub mod cpu;
pub mod cuda;
pub mod delta_rule;
pub mod panels;
pub mod qdot;
pub mod records;
pub mod simd;
pub mod skinny;
pub mod stats;
pub mod unpack;
pub mod vmath;

/// Kernel choices of a loaded model (load options; benchmarks and tests load with other values for A/B runs).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Kernels {
    /// The few-row CPU kernel ([`skinny`]) at all (false: candle's matmul everywhere).
    pub skinny: bool,
    /// Products smaller than this many multiply-adds run on the calling thread. Called from the engine's pool
    /// (forwards run there) splitting costs a few µs, so only the smallest products stay serial; called from
    /// outside a pool waking the workers costs tens of µs. Chosen with benches/kernels/ab_kernels.py
    /// (benches/results/cpu-forward.md).
    pub par_min_macs: usize,
    /// Windows of at most this many rows take the few-row kernel ([`crate::kernels::skinny`]); longer ones
    /// (prefill) go to gemm. 64 is about where the two meet on the tiny model and the 0.5B shape
    /// (crates/mbd-core/benches/forward.rs and benches/kernels/ab_kernels.py measure both sides:
    /// benches/results/cpu-forward.md).
    pub max_rows: usize,
    /// Attention on the CPU (f32, AVX2 + FMA) in [`attention::attend`]: blocked over keys, mask-aware,
    /// an online softmax with a vectorised exp, no score matrix. false: candle's ops (scores per query chunk, a
    /// host-built additive mask, softmax, a second matmul).
    pub blocked_attention: bool,
    /// Long windows' products on the CPU through `panels` (a packed AVX2 product widening or dequantizing W as
    /// it packs; gemm per widened panel on other CPUs). false: candle's matmul (a bf16 W widened whole per call; a
    /// quantized W through the few-row kernel).
    pub panels: bool,
    /// Dense f32 / bf16 and quantized matrices packed at load ([`panels::PackedMatrix`]) on CPUs with the packed
    /// product (x86-64 with AVX2, FMA and F16C), so that every window, from one row to a prefill chunk, runs the packed
    /// product on them with no packing per call (and every row the same arithmetic, alone or stacked). false: held
    /// row-major (quantized ones in their blocks), few-row windows through the few-row kernel (for A/B runs).
    pub packed_weights: bool,
    /// The packed product's AVX-512 tiles ([`panels::matmul_t_with`]) where the CPU has AVX-512. false: its AVX2 tiles
    /// (the same bits; for A/B runs).
    pub packed_avx512: bool,
    /// Linear layers of one input held as one matrix (q/k/v, gate/up:
    /// [`layers::Stacked`](crate::net::layers::Stacked)), one product instead of several. false: each its own product
    /// (the same bits; for A/B runs).
    pub stack: bool,
    /// On CUDA, mbd-rs's own kernels (`cuda`): a window's q/k norms, RoPE and K/V cache write in one launch,
    /// its attention in two (f32 scores, key ranges from the mask spec, no score matrix), silu·mul in one.
    /// false: candle's ops (for A/B runs).
    pub cuda_fused: bool,
    /// On CUDA with `cuda_fused`, a forward runs every segment's `prep` and attention in one launch per kernel
    /// ([`cuda::prep_segments`], [`cuda::attend_segments`]: a segment table in the forward's upload,
    /// [`net::step`](crate::net::step)), so that launches per forward do not grow with the streams batched, and no
    /// launch takes a committed length as an argument or sizes its grid by one (what a captured CUDA graph needs). Each
    /// segment's arithmetic is the same as in its own launches. Off by default until a GPU run has proven it
    /// (benches/gpu/run.sh); false: a launch per segment.
    pub cuda_segments: bool,
    /// On CUDA with `cuda_segments`, a forward of a shape seen before replays a CUDA graph of its layers' launches
    /// ([`net::graph`](crate::net::graph): captured on a shape's second forward, checked bit for bit against a forward
    /// without it on its first replay). Off by default until a GPU run has proven it (benches/gpu/run.sh graphs);
    /// false: every forward launch by launch.
    pub cuda_graphs: bool,
    /// Quantized linear layers on the CPU held as candle's quantized tensors and multiplied by candle's quantized
    /// matmul ([`Matrix::Candle`](crate::net::linear::Matrix::Candle)), as they always are on CUDA: tests and A/B runs
    /// of that path on the CPU.
    pub candle_quant: bool,
}

impl Default for Kernels {
    fn default() -> Self {
        Kernels {
            skinny: true,
            par_min_macs: 1 << 14,
            max_rows: 64,
            blocked_attention: true,
            panels: true,
            packed_weights: true,
            packed_avx512: true,
            stack: true,
            cuda_fused: true,
            cuda_segments: false,
            cuda_graphs: false,
            candle_quant: false,
        }
    }
}

impl Kernels {
    /// Whether a CPU f32 model holds its dense matrices packed (`packed_weights`, with the few-row kernel and the
    /// panels on: with either off the products go elsewhere).
    pub fn packs(&self) -> bool {
        self.packed_weights && self.skinny && self.panels
    }
}
