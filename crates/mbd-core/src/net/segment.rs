//! The forward's contract: one sequence's part of a forward (`Segment`: its cache, window ids, positions, mask
//! and the rows whose logits it wants) and what it gets back (`Logits`: those rows' logits and the head's time).

use crate::net::kv_cache::KvCache;
use crate::net::mask::MaskSpec;
use crate::util::Cancel;
use candle_core::Tensor;

/// One sequence's part of a forward ([`Model::forward_segments`](crate::model::Model::forward_segments)).
pub struct Segment<'a> {
    /// The sequence's cache: its committed positions are the keys before the window; the window's K/V are
    /// written after them.
    pub cache: &'a mut KvCache,
    /// Window token ids.
    pub ids: &'a [u32],
    /// Absolute position of each window row (RoPE, and the grid rule of `mask`).
    pub positions: Vec<usize>,
    /// Which keys each window row sees.
    pub mask: MaskSpec,
    /// Window rows whose logits are wanted, in the order they are returned.
    pub rows: Vec<usize>,
    /// The work this segment belongs to may be cancelled: a forward whose segments are all cancelled stops between
    /// layers ([`Error::Cancelled`](crate::error::Error::Cancelled)). None: never.
    pub cancel: Option<Cancel>,
}

impl Segment<'_> {
    /// The same segment, borrowing this one's cache (to run it again, e.g. alone).
    pub fn reborrow<'b>(s: &'b mut Segment<'_>) -> Segment<'b> {
        Segment {
            cache: &mut *s.cache,
            ids: s.ids,
            positions: s.positions.clone(),
            mask: s.mask.clone(),
            rows: s.rows.clone(),
            cancel: s.cancel.clone(),
        }
    }
}

/// What a forward gives one segment back: its rows' logits and the time the head spent on them.
pub struct Logits {
    /// (rows, vocab) f32, in the order of the segment's `rows`.
    pub rows: Tensor,
    /// Milliseconds of the head (the final norm and the vocabulary product; on a GPU, its launches queued), this
    /// segment's share by logits rows of a forward that stacked other segments' rows with its own: the usage's
    /// `head_ms`.
    pub head_ms: f64,
}
