//! The forward runner: one forward over segments for any architecture (`Network`), the one place that checks a
//! forward's segments, stacks their rows, uploads what the device reads, decides whether a CUDA graph runs the layers
//! ([`crate::net::graph`]), and runs the head over the rows whose logits are wanted.
//!
//! An architecture ([`net::qwen::QwenNet`](crate::net::qwen::QwenNet), and any file beside it) gives the runner its
//! layers and its head through [`Network`]; what is the same for every architecture lives here:
//! - the checks of each segment (a non-empty window, its positions, its logits rows, its mask), before anything is
//!   allocated, and the activations' memory for long forwards ([`crate::util::check_alloc`]);
//! - the stacking: few-row windows first (one product for all of them), then each long window alone
//!   ([`Groups::stack`]), and the logits rows cut the same way;
//! - the step: the ids, positions, attention tables and logits rows in one upload ([`crate::net::step`]);
//! - the head: the rows asked for gathered, then the architecture's final norm and vocabulary product, split back into
//!   each segment's logits.

use crate::error::{Error, Result};
use crate::kernels::Kernels;
use crate::load::config::ModelConfig;
use crate::net::attention::{AttnPath, ForwardAttention};
use crate::net::graph::{GraphStats, Graphs, Shape};
use crate::net::linear::Groups;
use crate::net::segment::{Logits, Segment};
use crate::net::step::{Section, Step, StepBuffers, StepWords};
use crate::util::Cancel;
use candle_core::{DType, Device, Tensor};

/// What an architecture gives the runner: its dimensions, its checks, its layers and its head.
pub(crate) trait Network: Send + Sync {
    fn config(&self) -> &ModelConfig;
    fn kernels(&self) -> &Kernels;
    fn device(&self) -> &Device;
    fn dtype(&self) -> DType;
    /// A segment this architecture cannot take (a hybrid's window that is not the next positions in order).
    fn check_segment(&self, seg: &Segment<'_>) -> Result<()>;
    /// Bytes of the activations alive at once in a forward of `rows` stacked rows; None where such a forward
    /// needs no check (see [`RECURRENT_CHECK_ROWS`] and [`LARGE_WINDOW`]).
    fn activation_bytes(&self, rows: usize) -> Option<usize>;
    /// The attention backend every segment of a forward takes.
    fn attention_path(&self) -> AttnPath;
    /// Whether a CUDA graph may capture this architecture's layers (every launch reads what changes from the step).
    fn graphable(&self) -> bool;
    /// The layers, from the embedding of the stacked ids to the last hidden states of every stacked row (what a
    /// graph captures and replays): `att` attends each segment over its own cache.
    fn layers(
        &self,
        step: &Step<'_>,
        stack: &Stack,
        segs: &mut [Segment<'_>],
        att: &ForwardAttention,
    ) -> Result<Tensor>;
    /// The head over the hidden states of the rows asked for (cut into products by `groups`): the final norm and
    /// the vocabulary product, (rows, vocab) in any float dtype.
    fn head(&self, x: &Tensor, groups: &Groups) -> Result<Tensor>;
}

/// A forward's rows as stacked: the segments in stack order, each one's rows, how products cut them, and where its
/// inputs lie in the step.
pub(crate) struct Stack {
    /// Segment indices in stack order.
    pub(crate) order: Vec<usize>,
    /// Per segment (in the caller's order): its first stacked row and its window's length.
    pub(crate) spans: Vec<(usize, usize)>,
    /// How the products cut the stacked rows (few-row windows together, each long window alone).
    pub(crate) groups: Groups,
    /// The token ids in stack order.
    pub(crate) ids: Vec<u32>,
    /// The ids and the positions in the step.
    pub(crate) ids_at: Section,
    pub(crate) pos_at: Section,
    /// The attention backend of every segment.
    pub(crate) path: AttnPath,
}

impl Stack {
    pub(crate) fn rows(&self) -> usize {
        self.ids.len()
    }
}

/// Windows longer than this check that their activations can be allocated before computing.
pub(crate) const LARGE_WINDOW: usize = 4096;
/// A hybrid's windows longer than this check too (its recurrent layers keep about 1 MiB per row at 0.8B's shape).
pub(crate) const RECURRENT_CHECK_ROWS: usize = 256;

/// Every segment cancelled (its generation or call given up): the forward stops, before its set-up and between
/// layers.
pub(crate) fn all_cancelled(segs: &[Segment<'_>]) -> Result<()> {
    if segs.iter().all(|s| s.cancel.as_ref().is_some_and(Cancel::is_cancelled)) {
        return Err(Error::Cancelled("the forward was cancelled".into()));
    }
    Ok(())
}

/// The runner's state, kept between forwards: the buffers a forward's inputs are uploaded into
/// ([`crate::net::step`]) and the CUDA graphs of the forward shapes ([`Kernels::cuda_graphs`]).
pub struct Runner {
    step_buffers: StepBuffers,
    graphs: Graphs,
    /// The cap on a query chunk's attention scores (`LoadOptions::attention_score_bytes`).
    score_bytes: usize,
}

impl Runner {
    /// `score_bytes`: the cap on a query chunk's f32 attention scores (a long window is attended in chunks of
    /// query rows under it).
    pub fn new(score_bytes: usize) -> Self {
        Runner { step_buffers: StepBuffers::new(), graphs: Graphs::default(), score_bytes }
    }

    /// Counts of the CUDA graphs ([`Kernels::cuda_graphs`]; zeros elsewhere).
    pub fn graph_stats(&self) -> GraphStats {
        self.graphs.stats()
    }

    /// One forward of `net` over several sequences' windows. Returns, per segment (in order), its rows' logits ((rows,
    /// vocab) f32, in the order of `rows`) and its share of the head's time. Each window's K/V are left in its
    /// cache's scratch area. Run it on the engine's CPU pool on the CPU
    /// ([`cpu_pool::on_device_pool`](crate::cpu_pool::on_device_pool)); ids are in the vocabulary (the caller checked
    /// them: [`request::token_ids`](crate::params::request::token_ids)).
    pub(crate) fn forward_segments(&self, net: &impl Network, segs: &mut [Segment<'_>]) -> Result<Vec<Logits>> {
        if segs.is_empty() {
            return Ok(vec![]);
        }
        all_cancelled(segs)?;
        let cfg = net.config();
        for s in segs.iter() {
            let (p, w) = (s.cache.len(), s.ids.len());
            if w == 0 {
                return Err(Error::Internal("empty window".into()));
            }
            debug_assert!(s.ids.iter().all(|&t| (t as usize) < cfg.vocab_size));
            if s.positions.len() != w {
                return Err(Error::Internal(format!("{} positions for a window of {w} tokens", s.positions.len())));
            }
            if let Some(&bad) = s.rows.iter().find(|&&i| i >= w) {
                return Err(Error::Internal(format!("logits row {bad} is outside the window of {w} tokens")));
            }
            s.mask.check(p, w)?;
            net.check_segment(s)?;
        }
        let total: usize = segs.iter().map(|s| s.ids.len()).sum();
        if let Some(bytes) = net.activation_bytes(total) {
            crate::util::check_alloc(bytes, || format!("activations of a {total}-position forward"))?;
        }
        let (kn, dev) = (net.kernels(), net.device());
        // stack order: few-row windows first (one skinny product for all of them), then each long window
        let (order, spans, groups) = Groups::stack(&segs.iter().map(|s| s.ids.len()).collect::<Vec<_>>(), kn);
        let mut ids = Vec::with_capacity(total);
        let mut pos = Vec::with_capacity(total);
        for &i in &order {
            ids.extend_from_slice(segs[i].ids);
            for &x in &segs[i].positions {
                pos.push(u32::try_from(x).map_err(|_| Error::Internal(format!("position {x} past 32 bits")))?);
            }
        }
        // the logits rows, stacked the same way (cut by each segment's own count of logits rows)
        let (lm_order, lm_spans, lm_groups) = Groups::stack(&segs.iter().map(|s| s.rows.len()).collect::<Vec<_>>(), kn);
        let pick: Vec<u32> = lm_order
            .iter()
            .flat_map(|&i| {
                let base = spans[i].0;
                segs[i].rows.iter().map(move |&r| (base + r) as u32)
            })
            .collect();
        // every row in stack order (a logits call, a lone window asking for all its rows): no gather needed
        let identity = pick.len() == total && pick.iter().enumerate().all(|(i, &r)| r as usize == i);
        let heads = (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim);
        // every segment of a forward takes the same attention backend
        let path = net.attention_path();
        for s in segs.iter_mut() {
            s.cache.begin_window(s.ids.len())?;
        }
        // what the device reads of this forward, in one upload (net::step): the layers' words, then the head's
        let mut words = StepWords::new();
        let ids_at = words.push(ids.iter().copied());
        let pos_at = words.push(pos);
        let att_words = ForwardAttention::plan(segs, path, &spans, heads, kn, &mut words)?;
        let layer_words = words.len();
        let pick_at = words.push(pick.iter().copied().filter(|_| !identity));
        // a CUDA graph of the layers per forward shape (net::graph) where every launch reads what changes from
        // the upload
        let graphed = kn.cuda_graphs
            && att_words.together()
            && net.graphable()
            && crate::kernels::cuda::runs_on(dev, net.dtype());
        let shape = graphed.then(|| Shape { windows: segs.iter().map(|s| s.ids.len()).collect(), words: layer_words });
        let stack = Stack { order, spans, groups, ids, ids_at, pos_at, path };
        let mut layers = |step: &Step<'_>| -> Result<Tensor> {
            let (spans, order) = (stack.spans.clone(), stack.order.clone());
            let att = ForwardAttention::new(segs, path, spans, order, heads, self.score_bytes, &att_words, step, dev)?;
            net.layers(step, &stack, segs, &att)
        };
        // the head: the rows asked for, then the network's final norm and vocabulary product; each segment's rows
        let vocab = cfg.vocab_size;
        let no_rows = || Ok(Tensor::zeros((0, vocab), DType::F32, dev)?);
        // the head's wall time (on a GPU: its launches queued), shared among the segments by their logits rows
        let head_ms = std::cell::Cell::new(0.0f64);
        let head = |x: &Tensor, step: &Step<'_>| -> Result<Vec<Tensor>> {
            if pick.is_empty() {
                return lm_spans.iter().map(|_| no_rows()).collect();
            }
            let t0 = std::time::Instant::now();
            let x = if identity { x.clone() } else { x.index_select(&step.view(pick_at)?, 0)? };
            let logits = net.head(&x, &lm_groups)?.to_dtype(DType::F32)?;
            let out =
                lm_spans.iter().map(|&(o, n)| if n == 0 { no_rows() } else { Ok(logits.narrow(0, o, n)?) }).collect();
            head_ms.set(t0.elapsed().as_secs_f64() * 1e3);
            out
        };
        let out = match shape {
            Some(shape) => self.graphs.run(shape, words, &self.step_buffers, dev, layers, head),
            None => {
                let step = self.step_buffers.upload(words, dev)?;
                let x = layers(&step)?;
                head(&x, &step)
            }
        }?;
        let per_row = if pick.is_empty() { 0.0 } else { head_ms.get() / pick.len() as f64 };
        Ok(out
            .into_iter()
            .zip(segs.iter())
            .map(|(rows, s)| Logits { rows, head_ms: per_row * s.rows.len() as f64 })
            .collect())
    }
}
