//! How a block format is held in groups of `GROUP` columns: the depth layouts of the packed product
//! ([`panels::PackedMatrix`](crate::kernels::panels::PackedMatrix)) and the scale records that both it and the integer
//! dot products ([`qdot::DotMatrix`](crate::kernels::qdot::DotMatrix)) use, one record per block of the format.

use crate::kernels::blocks::QuantFormat;

/// Output columns per group of a packed matrix (the register tile's width).
pub(crate) const GROUP: usize = 16;

/// How a block format is held packed (in a [`PackedMatrix`](crate::kernels::panels::PackedMatrix)), per group of
/// `GROUP` columns: `step` bytes per depth (the group's values at that depth), and the scales in records of `sbytes`
/// bytes, one per `sblock` depths (one per block of the format).
#[derive(Clone, Copy)]
pub(crate) struct Layout {
    pub(crate) step: usize,
    pub(crate) sblock: usize,
    pub(crate) sbytes: usize,
}

/// q8_0: a signed byte per value (column order); a record is the 16 columns' f16 scales.
pub(crate) const Q8_0_LAYOUT: Layout = Layout { step: GROUP, sblock: 32, sbytes: 2 * GROUP };
/// q5_0: 2 bytes of fifth bits (bit c: column c), then 8 bytes of nibbles (column c at nibble `nibble(c)`, from
/// byte `Q5_NIBBLES` of the depth); a record is the 16 columns' f16 scales.
pub(crate) const Q5_0_LAYOUT: Layout = Layout { step: Q5_NIBBLES + GROUP / 2, sblock: 32, sbytes: 2 * GROUP };
/// Where a q5_0 or q5_k depth's nibbles start (after its 2 bytes of fifth bits).
pub(crate) const Q5_NIBBLES: usize = 2;
/// q4_0: 8 bytes of nibbles (as q4_k); a record is the 16 columns' f16 scales.
pub(crate) const Q4_0_LAYOUT: Layout = Layout { step: GROUP / 2, sblock: 32, sbytes: 2 * GROUP };
/// q4_k: 8 bytes of nibbles (as q5_0); a record (a super-block of 256 depths) is the 16 columns' f16 d, their f16
/// dmin (at `Q4K_DMIN`), then per sub-block j of 32 depths their 6-bit scales (16 bytes at `Q4K_SCALES` + 16j) and
/// their 6-bit mins (16 bytes at `Q4K_MINS` + 16j).
pub(crate) const Q4K_LAYOUT: Layout = Layout { step: GROUP / 2, sblock: 256, sbytes: Q4K_MINS + 8 * GROUP };
pub(crate) const Q4K_DMIN: usize = 2 * GROUP;
pub(crate) const Q4K_SCALES: usize = 4 * GROUP;
pub(crate) const Q4K_MINS: usize = Q4K_SCALES + 8 * GROUP;
/// q5_k: a depth as q5_0's (fifth bits, then nibbles from `Q5_NIBBLES`), a record as q4_k's.
pub(crate) const Q5K_LAYOUT: Layout = Layout { step: Q5_0_LAYOUT.step, ..Q4K_LAYOUT };
/// q6_k: 8 bytes of low nibbles (as q4_k), then 4 bytes of high bit pairs (column c at bits 2c, 2c + 1 of them
/// read as a little-endian u32, from byte `Q6K_HIGH` of the depth); a record (a super-block of 256 depths) is the 16
/// columns' f16 d, then per sub-block j of 16 depths their signed 8-bit scales (16 bytes at `Q6K_SCALES` + 16j).
/// 210 bytes per 256 values and column, as the format's blocks.
pub(crate) const Q6K_LAYOUT: Layout =
    Layout { step: Q6K_HIGH + GROUP / 4, sblock: 256, sbytes: Q6K_SCALES + 16 * GROUP };
pub(crate) const Q6K_HIGH: usize = GROUP / 2;
pub(crate) const Q6K_SCALES: usize = 2 * GROUP;
/// q3_k: 2 bytes of high bits (as q5_0's fifth bits), then 4 bytes of 2-bit pairs (as q6_k's high pairs, from byte
/// `Q3K_PAIRS` of the depth): the value q − 4 + 4·high in [−4, 3]; a record as q6_k's (16 f16 d, then per sub-block
/// of 16 depths the 16 signed scales sc − 32). 114 bytes per 256 values and column against 110.
pub(crate) const Q3K_LAYOUT: Layout = Layout { step: Q3K_PAIRS + GROUP / 4, ..Q6K_LAYOUT };
pub(crate) const Q3K_PAIRS: usize = 2;
/// q2_k: 4 bytes of 2-bit pairs (as q6_k's high pairs); a record is the 16 columns' f16 d, their f16 dmin (at
/// `Q4K_DMIN`), then per sub-block j of 16 depths a byte per column as the format holds it, the 4-bit scale in the
/// low nibble and the min in the high one (at `Q2K_SCALES` + 16j). 84 bytes per 256 values and column, as the format.
pub(crate) const Q2K_LAYOUT: Layout = Layout { step: GROUP / 4, sblock: 256, sbytes: Q2K_SCALES + 16 * GROUP };
pub(crate) const Q2K_SCALES: usize = 4 * GROUP;

/// The packed layout of a block format.
pub(crate) fn layout(format: QuantFormat) -> Layout {
    match format {
        QuantFormat::Q8_0 => Q8_0_LAYOUT,
        QuantFormat::Q5_0 => Q5_0_LAYOUT,
        QuantFormat::Q4_0 => Q4_0_LAYOUT,
        QuantFormat::Q4K => Q4K_LAYOUT,
        QuantFormat::Q5K => Q5K_LAYOUT,
        QuantFormat::Q6K => Q6K_LAYOUT,
        QuantFormat::Q3K => Q3K_LAYOUT,
        QuantFormat::Q2K => Q2K_LAYOUT,
    }
}

/// Column c's scales of one block of a row (`block`: its bytes) into the block's scale record `s` ([`Layout::sbytes`]
/// bytes: the record of every block format's packed layout, and of `qdot`'s integer-product layout).
pub(crate) fn pack_record(format: QuantFormat, block: &[u8], c: usize, s: &mut [u8]) {
    match format {
        QuantFormat::Q8_0 | QuantFormat::Q5_0 | QuantFormat::Q4_0 => s[2 * c..2 * c + 2].copy_from_slice(&block[..2]),
        QuantFormat::Q4K | QuantFormat::Q5K => {
            s[2 * c..2 * c + 2].copy_from_slice(&block[..2]);
            s[Q4K_DMIN + 2 * c..Q4K_DMIN + 2 * c + 2].copy_from_slice(&block[2..4]);
            for j in 0..8 {
                let (sc, m) = crate::kernels::blocks::scale_min_k4(j, &block[4..16]);
                s[Q4K_SCALES + GROUP * j + c] = sc;
                s[Q4K_MINS + GROUP * j + c] = m;
            }
        }
        QuantFormat::Q6K => {
            s[2 * c..2 * c + 2].copy_from_slice(&block[208..210]);
            for j in 0..16 {
                s[Q6K_SCALES + GROUP * j + c] = block[192 + j];
            }
        }
        QuantFormat::Q3K => {
            s[2 * c..2 * c + 2].copy_from_slice(&block[108..110]);
            for (j, sc) in crate::kernels::blocks::q3k_scales(block).into_iter().enumerate() {
                s[Q6K_SCALES + GROUP * j + c] = sc as u8;
            }
        }
        QuantFormat::Q2K => {
            s[2 * c..2 * c + 2].copy_from_slice(&block[80..82]);
            s[Q4K_DMIN + 2 * c..Q4K_DMIN + 2 * c + 2].copy_from_slice(&block[82..84]);
            for j in 0..16 {
                s[Q2K_SCALES + GROUP * j + c] = block[j];
            }
        }
    }
}

/// Bytes of a block format's scale record (`pack_record`).
pub(crate) fn record_bytes(format: QuantFormat) -> usize {
    layout(format).sbytes
}
