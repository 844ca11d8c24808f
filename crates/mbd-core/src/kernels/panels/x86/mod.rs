//! The packed AVX2+FMA product (x86-64 CPUs with AVX2, FMA and F16C): the BLIS scheme with a 6 × 16 register tile,
//! or with AVX-512 (`Zmm`) a 6 × 64 one (32 registers: a group of 16 columns in one, 4 groups per tile).
//!
//! x is packed once per call into `MR`-row micro-panels (`KC` columns deep); the output columns are cut into
//! parallel tasks, each packing its weight rows `KC` columns at a time into `NR`-column micro-panels (widening bf16,
//! or from a dequantized copy of its rows; a `PackedMatrix` is read as it is) and running the tile over every x
//! micro-panel, `MC` rows of x at a time.
//!
//! Numerics: every y element is one f32 fused-multiply-add chain over k in order, starting from 0 (a tile continues
//! the chain of the previous `KC` block from the stored value). So a row's result depends only on x's row and W — not
//! on m, the tiling, the task split, the thread count or the register width (each lane of an AVX-512 tile is the
//! chain of an AVX2 one) — and equals `acc = x[i].mul_add(w[i], acc)` for i = 0..k.
//!
//! `driver`: packing x, the tasks and the sweep over row panels; `tiles`: the register tiles of each instruction set
//! (`Ymm`: AVX2, `Zmm`: AVX-512); `formats`: how a tile reads each weight format (`Panel`).

mod driver;
mod formats;
mod tiles;

pub(super) use driver::matmul_t;

/// Register tile: `MR` x rows × `NR` output columns (12 of the 16 ymm registers hold it).
const MR: usize = 6;
const NR: usize = crate::kernels::records::GROUP;
