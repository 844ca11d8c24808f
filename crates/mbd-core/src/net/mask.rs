//! Attention masks as a function of a block id per position: query p sees key q iff blk(q) <= blk(p).
//! Causal attention is blocks of size 1, full attention is one block.

use crate::error::{Error, Result};

crate::util::string_enum! {
    /// Which keys a query sees.
    pub enum AttentionKind ("attention") {
        Causal = "causal",
        BlockCausal = "block_causal",
        Full = "full",
    }
}

crate::util::string_enum! {
    /// How block-causal blocks are laid over positions.
    pub enum Alignment ("alignment") {
        /// blk(p) = floor(p / B): SDAR, Fast-dLLM v2 (the prompt is block-causal too).
        Absolute = "absolute",
        /// The whole prompt is block 0, then blocks of B from the prompt's end (Open-dLLM / D2F).
        Prompt = "prompt",
    }
}

/// A concrete block grid over absolute positions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockGrid {
    pub kind: AttentionKind,
    pub block_size: usize,
    pub alignment: Alignment,
    /// End of the prompt block (only used with [`Alignment::Prompt`]).
    pub prompt_len: usize,
    /// A second grid from a boundary on (TCCF's answer phase): blocks of `block_size` from `at`.
    pub then: Option<Then>,
}

/// The grid from a boundary `at` of the first one on: blocks of `block_size` from `at`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Then {
    pub at: usize,
    pub block_size: usize,
}

impl BlockGrid {
    pub fn new(kind: AttentionKind, block_size: usize, alignment: Alignment, prompt_len: usize) -> Result<Self> {
        if kind == AttentionKind::BlockCausal && block_size == 0 {
            return Err(Error::Internal("a block-causal grid needs blocks of at least one position".into()));
        }
        Ok(BlockGrid { kind, block_size, alignment, prompt_len, then: None })
    }

    pub fn causal() -> Self {
        BlockGrid {
            kind: AttentionKind::Causal,
            block_size: 1,
            alignment: Alignment::Absolute,
            prompt_len: 0,
            then: None,
        }
    }

    /// This grid up to `at` (one of its boundaries), then blocks of `block_size` from `at` (TCCF's switch from
    /// thinking to answering).
    pub fn then(self, at: usize, block_size: usize) -> Result<BlockGrid> {
        if self.then.is_some() || !self.is_boundary(at) || block_size == 0 || self.kind == AttentionKind::Full {
            return Err(Error::Internal(format!("cannot switch grids at {at}")));
        }
        Ok(BlockGrid { then: Some(Then { at, block_size }), ..self })
    }

    /// Block id of absolute position `p`.
    pub fn block_of(&self, p: usize) -> usize {
        match self.then {
            Some(t) if p >= t.at => {
                let first = if t.at == 0 { 0 } else { self.base_block_of(t.at - 1) + 1 };
                first + (p - t.at) / t.block_size
            }
            _ => self.base_block_of(p),
        }
    }

    fn base_block_of(&self, p: usize) -> usize {
        match self.kind {
            AttentionKind::Causal => p,
            AttentionKind::Full => 0,
            AttentionKind::BlockCausal => match self.alignment {
                Alignment::Absolute => p / self.block_size,
                Alignment::Prompt => {
                    if p < self.prompt_len {
                        0
                    } else {
                        1 + (p - self.prompt_len) / self.block_size
                    }
                }
            },
        }
    }

    /// End (exclusive) of the block of position `p`: the keys [0, block_end(p)) are the ones `p` sees.
    pub fn block_end(&self, p: usize) -> usize {
        match self.then {
            Some(t) if p >= t.at => t.at + ((p - t.at) / t.block_size + 1) * t.block_size,
            _ => self.base_block_end(p),
        }
    }

    fn base_block_end(&self, p: usize) -> usize {
        match self.kind {
            AttentionKind::Causal => p + 1,
            AttentionKind::Full => usize::MAX,
            AttentionKind::BlockCausal => match self.alignment {
                Alignment::Absolute => (p / self.block_size + 1) * self.block_size,
                Alignment::Prompt if p < self.prompt_len => self.prompt_len,
                Alignment::Prompt => self.prompt_len + ((p - self.prompt_len) / self.block_size + 1) * self.block_size,
            },
        }
    }

    /// Whether the K/V this grid gives positions [0, n), for every boundary n, depend only on the tokens [0, n): then
    /// a later sequence that begins with the same n tokens has the same K/V there (the prefix cache's condition,
    /// [`generate::prefix`](crate::generate::prefix)). Err says why not.
    pub fn prefix_stable(&self) -> std::result::Result<(), &'static str> {
        match (self.kind, self.alignment) {
            _ if self.then.is_some() => Err("the grid switches block sizes (TCCF's answer)"),
            (AttentionKind::Causal, _) | (AttentionKind::BlockCausal, Alignment::Absolute) => Ok(()),
            (AttentionKind::BlockCausal, Alignment::Prompt) => {
                Err("blocks aligned at the prompt's end: the prompt is one block")
            }
            (AttentionKind::Full, _) => Err("full attention: a prompt's K/V depend on the masks after it"),
        }
    }

    /// Whether keys before `p` never attend to keys at or after `p`, i.e. whether K/V of [0, p) can be
    /// computed (and cached) without knowing anything at positions >= p.
    pub fn is_boundary(&self, p: usize) -> bool {
        p == 0 || self.block_of(p - 1) < self.block_of(p)
    }

    /// Additive mask (row-major W x (start+W)) for queries [start, start+W) over keys [0, start+W):
    /// 0 where visible, -inf where not. `None` when every query sees every key.
    pub fn additive_mask(&self, start: usize, w: usize) -> Option<Vec<f32>> {
        self.additive_mask_rows(start, w, start + w)
    }

    /// Additive mask (row-major n x s) for queries [q0, q0 + n) over keys [0, s) (s >= q0 + n): the rows of a
    /// query chunk. `None` when every query sees every key.
    pub fn additive_mask_rows(&self, q0: usize, n: usize, s: usize) -> Option<Vec<f32>> {
        if n == 0 || s == 0 {
            return None;
        }
        // Keys are visible iff blk(key) <= blk(query); block ids are non-decreasing in position, so the
        // smallest query block deciding visibility is the first query's.
        if self.block_of(s - 1) <= self.block_of(q0) {
            return None;
        }
        let mut m = vec![0f32; n * s];
        let mut end = q0 + 1;
        for i in 0..n {
            let bq = self.block_of(q0 + i);
            // Keys in blocks <= bq form a prefix [0, end) because block ids are monotone (and end only grows).
            end = end.max(q0 + i + 1);
            while end < s && self.block_of(end) <= bq {
                end += 1;
            }
            for x in m[i * s + end..(i + 1) * s].iter_mut() {
                *x = f32::NEG_INFINITY;
            }
        }
        Some(m)
    }
}

/// Whether window rows at `positions` over `p` cached keys sit at positions p, p + 1, ..: then a key's index is
/// its position, and a grid's rows see prefixes of the keys.
fn at_slots(p: usize, positions: &[usize]) -> bool {
    positions.iter().enumerate().all(|(i, &x)| x == p + i)
}

/// Which keys each query row of a forward segment sees. Keys are the segment's cache slots [0, p) (slot i holds
/// position i) followed by its window rows [p, p + w); queries are the window rows at their explicit positions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MaskSpec {
    /// The block-id rule of a grid over the rows' positions: query at position a sees key at position b iff
    /// blk(b) <= blk(a) (causal and full are grids too).
    Grid(BlockGrid),
    /// Explicit: per window row, the key index ranges (over [0, p + w)) it sees, e.g. a verification window
    /// whose second half sees the first half strictly causally and itself only.
    Custom(Vec<Vec<std::ops::Range<usize>>>),
}

impl MaskSpec {
    /// Additive mask (row-major n x (p + w)) for window rows [r0, r0 + n) of a segment whose window rows sit at
    /// `positions` over `p` cached keys: 0 where visible (`visible_row`), -inf elsewhere; `None` when every row
    /// sees every key.
    pub fn additive_rows(&self, p: usize, positions: &[usize], r0: usize, n: usize) -> Option<Vec<f32>> {
        let s = p + positions.len();
        if let MaskSpec::Grid(g) = self {
            if at_slots(p, positions) {
                return g.additive_mask_rows(p + r0, n, s);
            }
        }
        let mut m = vec![f32::NEG_INFINITY; n * s];
        for i in 0..n {
            for r in self.visible_row(p, positions, r0 + i) {
                let (a, b) = (r.start.min(s), r.end.min(s));
                for x in m[i * s + a..i * s + b.max(a)].iter_mut() {
                    *x = 0.0;
                }
            }
        }
        Some(m)
    }

    /// Per window row, the key index ranges it sees (over [0, p + w)), for a segment whose window rows sit at
    /// `positions` over `p` cached keys.
    pub fn visible(&self, p: usize, positions: &[usize]) -> Vec<Vec<std::ops::Range<usize>>> {
        if let MaskSpec::Grid(g) = self {
            let s = p + positions.len();
            if at_slots(p, positions) {
                // key index = position: a row sees the keys of its block and before, a prefix (O(rows), where the
                // general rule below walks every window key per row)
                return (0..positions.len()).map(|i| std::iter::once(0..g.block_end(p + i).min(s)).collect()).collect();
            }
        }
        (0..positions.len()).map(|i| self.visible_row(p, positions, i)).collect()
    }

    /// The key index ranges window row `i` sees: the one statement of the rule that `additive_rows` and
    /// `visible` both apply.
    fn visible_row(&self, p: usize, positions: &[usize], i: usize) -> Vec<std::ops::Range<usize>> {
        match self {
            MaskSpec::Custom(rows) => rows.get(i).into_iter().flatten().filter(|r| !r.is_empty()).cloned().collect(),
            MaskSpec::Grid(g) => {
                let bq = g.block_of(positions[i]);
                // cached keys: slot j is position j, block ids are monotone, so the visible ones are a prefix
                let (mut e, mut hi) = (0, p);
                while e < hi {
                    let mid = (e + hi) / 2;
                    if g.block_of(mid) <= bq {
                        e = mid + 1;
                    } else {
                        hi = mid;
                    }
                }
                let mut out: Vec<std::ops::Range<usize>> = Vec::with_capacity(2);
                if e > 0 {
                    out.push(0..e);
                }
                for (j, &kp) in positions.iter().enumerate() {
                    if g.block_of(kp) <= bq {
                        let k = p + j;
                        match out.last_mut() {
                            Some(r) if r.end == k => r.end = k + 1,
                            _ => out.push(k..k + 1),
                        }
                    }
                }
                out
            }
        }
    }

    /// Check the spec against a segment of `w` rows over `p` cached keys.
    pub fn check(&self, p: usize, w: usize) -> Result<()> {
        if let MaskSpec::Custom(rows) = self {
            if rows.len() != w {
                return Err(Error::Internal(format!("custom mask has {} rows for a window of {w}", rows.len())));
            }
            for (i, rs) in rows.iter().enumerate() {
                if rs.iter().any(|r| r.start > r.end || r.end > p + w) {
                    return Err(Error::Internal(format!("custom mask row {i}: a range is outside keys 0..{}", p + w)));
                }
                if rs.iter().all(|r| r.is_empty()) {
                    return Err(Error::Internal(format!("custom mask row {i} sees no key")));
                }
            }
        }
        Ok(())
    }
}

/// Positions forwarded at once when filling a cache with a prompt (more when a block is longer). Bounds the
/// transient memory: a chunk's attention scores are heads x chunk x prefix floats (for a 0.5B model and an 8K
/// prompt: 0.23 GB per chunk of 512 against 3.8 GB for the whole prompt at once).
pub const PREFILL_CHUNK: usize = 512;

/// [start, stop) cut into pieces of about `PREFILL_CHUNK` positions that end on block boundaries of `grid` (a
/// block's positions see each other, so a block is never split; full attention is one piece).
pub fn chunks(grid: &BlockGrid, start: usize, stop: usize) -> Vec<(usize, usize)> {
    let mut out = vec![];
    let mut s = start;
    while s < stop {
        let mut e = (s + PREFILL_CHUNK).min(stop);
        while e < stop && !grid.is_boundary(e) {
            e += 1;
        }
        out.push((s, e));
        s = e;
    }
    out
}

#[cfg(test)]
#[allow(clippy::needless_range_loop)] // indices mirror the visibility rule being tested
mod tests {
    use super::*;

    fn visible(g: &BlockGrid, start: usize, w: usize) -> Vec<Vec<bool>> {
        let s = start + w;
        match g.additive_mask(start, w) {
            None => vec![vec![true; s]; w],
            Some(m) => (0..w).map(|i| (0..s).map(|j| m[i * s + j] == 0.0).collect()).collect(),
        }
    }

    #[test]
    fn causal_is_lower_triangular() {
        let g = BlockGrid::causal();
        let v = visible(&g, 2, 3);
        for i in 0..3 {
            for j in 0..5 {
                assert_eq!(v[i][j], j <= 2 + i, "q{i} k{j}");
            }
        }
    }

    #[test]
    fn block_causal_absolute_matches_definition() {
        let g = BlockGrid::new(AttentionKind::BlockCausal, 4, Alignment::Absolute, 0).unwrap();
        let (start, w) = (3, 9);
        let v = visible(&g, start, w);
        for i in 0..w {
            for j in 0..start + w {
                assert_eq!(v[i][j], j / 4 <= (start + i) / 4, "q{} k{j}", start + i);
            }
        }
        assert!(g.is_boundary(8) && !g.is_boundary(9));
    }

    #[test]
    fn block_causal_prompt_grid() {
        let g = BlockGrid::new(AttentionKind::BlockCausal, 3, Alignment::Prompt, 5).unwrap();
        assert_eq!((0..12).map(|p| g.block_of(p)).collect::<Vec<_>>(), vec![0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2, 3]);
        let v = visible(&g, 0, 12);
        assert!(v[0][4] && !v[0][5] && v[5][7] && !v[5][8]);
        assert!(g.is_boundary(5) && !g.is_boundary(4));
    }

    #[test]
    fn row_chunks_are_the_rows_of_the_whole_mask() {
        for g in [
            BlockGrid::causal(),
            BlockGrid::new(AttentionKind::BlockCausal, 3, Alignment::Prompt, 5).unwrap(),
            BlockGrid::new(AttentionKind::BlockCausal, 4, Alignment::Absolute, 0).unwrap(),
        ] {
            let (start, w) = (2, 11);
            let s = start + w;
            let whole = g.additive_mask(start, w).unwrap();
            for (q0, n) in [(2, 4), (6, 5), (11, 2)] {
                let rows = g.additive_mask_rows(q0, n, s).unwrap_or_else(|| vec![0.0; n * s]);
                assert_eq!(rows, whole[(q0 - start) * s..(q0 - start + n) * s], "{g:?} rows {q0}..{}", q0 + n);
            }
        }
    }

    #[test]
    fn mask_spec_grid_with_explicit_positions_and_custom() {
        let g = BlockGrid::new(AttentionKind::BlockCausal, 4, Alignment::Absolute, 0).unwrap();
        // contiguous positions: the grid's own rows
        let pos: Vec<usize> = (6..13).collect();
        let spec = MaskSpec::Grid(g);
        assert_eq!(spec.additive_rows(6, &pos, 2, 3), g.additive_mask_rows(8, 3, 13));
        // explicit positions (a window that revisits positions 8..10 after 8..10): blk(key) <= blk(query)
        let pos = [8usize, 9, 10, 8, 9, 10];
        let m = spec.additive_rows(8, &pos, 0, 6).unwrap();
        let s = 14;
        for i in 0..6 {
            for j in 0..s {
                let kp = if j < 8 { j } else { pos[j - 8] };
                assert_eq!(m[i * s + j] == 0.0, kp / 4 <= pos[i] / 4, "row {i} key {j}");
            }
        }
        // custom: row i sees the prefix and key 8 + i only
        let rows: Vec<Vec<std::ops::Range<usize>>> = (0..3).map(|i| vec![0..8, 8 + i..9 + i]).collect();
        let c = MaskSpec::Custom(rows);
        assert!(c.check(8, 3).is_ok() && c.check(8, 4).is_err());
        let m = c.additive_rows(8, &[8, 9, 10], 1, 2).unwrap();
        let vis: Vec<usize> = (0..11).filter(|&j| m[j] == 0.0).collect();
        assert_eq!(vis, [0, 1, 2, 3, 4, 5, 6, 7, 9]);
        assert!(MaskSpec::Custom(vec![vec![0..0]]).check(0, 1).is_err());
    }

    #[test]
    fn visible_ranges_are_the_mask_rows() {
        let grids = [
            BlockGrid::causal(),
            BlockGrid::new(AttentionKind::BlockCausal, 3, Alignment::Prompt, 5).unwrap(),
            BlockGrid::new(AttentionKind::BlockCausal, 4, Alignment::Absolute, 0).unwrap(),
            BlockGrid::new(AttentionKind::Full, 1, Alignment::Absolute, 0).unwrap(),
        ];
        let custom: Vec<Vec<std::ops::Range<usize>>> = (0..4).map(|i| vec![0..3, 4 + i..5 + i, 2..2]).collect();
        let mut specs: Vec<(MaskSpec, Vec<usize>)> = vec![];
        for g in grids {
            specs.push((MaskSpec::Grid(g), (7..11).collect()));
            specs.push((MaskSpec::Grid(g), vec![8, 9, 8, 10]));
        }
        specs.push((MaskSpec::Custom(custom), (7..11).collect()));
        for (spec, pos) in specs {
            let (p, s) = (7usize, 11usize);
            let vis = spec.visible(p, &pos);
            let m = spec.additive_rows(p, &pos, 0, 4).unwrap_or_else(|| vec![0.0; 4 * s]);
            for i in 0..4 {
                let want: Vec<usize> = (0..s).filter(|&j| m[i * s + j] == 0.0).collect();
                let got: Vec<usize> = vis[i].iter().flat_map(|r| r.clone()).collect();
                assert_eq!(got, want, "{spec:?} {pos:?} row {i}");
            }
        }
    }

    #[test]
    fn full_needs_no_mask() {
        let g = BlockGrid::new(AttentionKind::Full, 1, Alignment::Absolute, 0).unwrap();
        assert!(g.additive_mask(0, 7).is_none());
        // One block in the window over a prefix needs no mask either.
        let b = BlockGrid::new(AttentionKind::BlockCausal, 4, Alignment::Absolute, 0).unwrap();
        assert!(b.additive_mask(8, 4).is_none());
        assert!(b.additive_mask(8, 5).is_some());
    }

    #[test]
    fn a_switched_grid_is_the_first_up_to_its_boundary_then_the_second() {
        let g = BlockGrid::new(AttentionKind::BlockCausal, 4, Alignment::Absolute, 0).unwrap().then(8, 3).unwrap();
        let ids: Vec<usize> = (0..15).map(|p| g.block_of(p)).collect();
        assert_eq!(ids, vec![0, 0, 0, 0, 1, 1, 1, 1, 2, 2, 2, 3, 3, 3, 4]);
        let ends: Vec<usize> = (0..15).map(|p| g.block_end(p)).collect();
        assert_eq!(ends, vec![4, 4, 4, 4, 8, 8, 8, 8, 11, 11, 11, 14, 14, 14, 17]);
        // the mask is the block-id rule over the switched ids
        let v = visible(&g, 0, 15);
        for i in 0..15 {
            for j in 0..15 {
                assert_eq!(v[i][j], ids[j] <= ids[i], "q{i} k{j}");
            }
        }
        assert!(g.is_boundary(8) && g.is_boundary(11) && !g.is_boundary(10));
        // a switch off a boundary, or twice, is refused
        let b = BlockGrid::new(AttentionKind::BlockCausal, 4, Alignment::Absolute, 0).unwrap();
        assert!(b.then(6, 1).is_err() && g.then(11, 1).is_err());
        let c = BlockGrid::causal().then(3, 2).unwrap();
        assert_eq!((0..7).map(|p| c.block_of(p)).collect::<Vec<_>>(), vec![0, 1, 2, 3, 3, 4, 4]);
    }
}
