//! How K/V survive between the steps of a generation: the policies (`CachePolicy`) and the names a request gives them
//! (`CacheMode`, `PrefixWindow`). Which one a request gets is [`generate::plan`](crate::generate::plan)'s rule; what
//! each one forwards and commits is [`generate::window`](crate::generate::window)'s.

/// How K/V survive between steps.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CachePolicy {
    /// Completed blocks are committed exactly; each step forwards from the first uncommitted position.
    Exact,
    /// Nothing is kept; each step forwards from position 0 (the reference semantics).
    Recompute,
    /// d3LLM's approximate prefix cache for full attention: a block (the prompt first) is committed once it has
    /// been complete for `delay` steps, from a forward over [cache end, canvas end); while a complete block
    /// waits, and every `refresh` steps, the step recomputes the whole canvas and rebuilds the cached K/V.
    /// `window` says where the forwards end: the canvas end (d3LLM) or the last created block's end.
    Prefix { delay: usize, refresh: Option<usize>, window: PrefixWindow },
    /// Fast-dLLM v1's dual cache for full attention: the K/V before and after the active region (from the first
    /// incomplete created block to the end of the last created block) are cached from a forward over the whole
    /// canvas, taken whenever the region changes; other steps forward only the region.
    Dual,
}

crate::util::string_enum! {
    /// The `cache` request parameter.
    pub enum CacheMode ("cache") {
        /// exact prefix cache of completed blocks (block-causal and causal attention)
        Exact = "exact",
        /// recompute every step
        None = "none",
        /// d3LLM's approximate prefix cache with delayed commits and refreshes (full attention)
        Prefix = "prefix",
        /// Fast-dLLM v1's dual cache: prefix and suffix K/V, only the active blocks recomputed (full attention)
        Dual = "dual",
    }
}

crate::util::string_enum! {
    /// The `prefix_window` request parameter: where the prefix cache's forwards end.
    pub enum PrefixWindow ("prefix_window") {
        /// the canvas end (prompt + max_tokens): every trailing mask is seen, as d3LLM does
        Canvas = "canvas",
        /// the end of the last created block: the masks of blocks not yet created are not attended to
        Created = "created",
    }
}

impl CachePolicy {
    /// Whether K/V are kept between steps (in the generation's cache).
    pub fn keeps(&self) -> bool {
        *self != CachePolicy::Recompute
    }
}

/// d3LLM's `cache_delay_iter` in its Dream evaluation scripts.
pub const DEFAULT_CACHE_DELAY: usize = 1;
