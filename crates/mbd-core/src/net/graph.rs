//! CUDA graphs of the decode forward (docs/dev/cuda.md): the one owner of when a forward is captured, replayed, checked
//! or left to run launch by launch.
//!
//! A forward's layers (the embedding, every layer, up to the last hidden states) launch the same kernels on the same
//! shapes for every forward of one shape (`Shape`: each segment's window, and the words they read), once everything
//! that changes from step to step is data in the forward's one upload ([`net::step`](crate::net::step): ids, positions,
//! the segment table with each committed length and key ranges, the caches' addresses). So one graph per shape replays
//! the layers of every later forward of that shape:
//! 1. the first forward of a shape runs without a graph (a prefill chunk or an odd window is not worth one);
//! 2. the second runs with candle's small uploads cached ([`cuda::with_upload_cache`]) on a buffer that stays the
//!    shape's ([`Step::fixed`]), and its launches are then captured (nothing runs twice); the captured pass copies the
//!    hidden states into an output buffer that stays the graph's too;
//! 3. the third is replayed (its words written into the graph's buffer, the graph launched) and then run again without
//!    the graph: the graph is kept only if the two agree bit for bit, which catches any host value a launch took as an
//!    argument (it would be the captured step's);
//! 4. later ones are replayed.
//!
//! The head (the logits rows gathered, the final norm, the vocabulary product) runs after, launch by launch, on
//! whichever hidden states the forward has: the rows asked for change every step, and a few launches are not worth a
//! graph per row count. A failed capture or a replay that differs leaves the shape to run launch by launch (`refused`);
//! neither fails the forward. Graphs belong to the thread that captured them (candle keeps its cached uploads, which a
//! graph reads, per thread, and launches on the thread's stream), and live as long as the model.

use crate::error::{Error, Result};
use crate::kernels::cuda;
use crate::net::step::{Step, StepBuffers, StepWords};
use candle_core::{DType, Device, Tensor};
use std::cell::Cell;
use std::collections::HashMap;
use std::sync::Mutex;
use std::thread::ThreadId;

/// Forwards of at most this many rows (all segments') are graphed: decode steps, which the launches' cost bounds.
/// A prefill chunk's products outlast its launches, and its graph would keep that many rows' activations.
const MAX_ROWS: usize = 256;
/// Graphs one model keeps at most (each holds its buffers and the memory its launches allocate).
const MAX_GRAPHS: usize = 32;
/// Shapes remembered at most (forwards of further shapes run without a graph).
const MAX_SHAPES: usize = 1024;

thread_local! {
    /// This thread's forwards may be graphed (`on_lasting_thread`).
    static LASTING: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with this thread's forwards allowed CUDA graphs: on threads that live as long as the models they run
/// (the batching scheduler's worker, which runs every generation's forwards) or for a benchmark's loop. A graph
/// belongs to the thread that captured it, so one captured on a short-lived thread (a server's pool thread asking
/// for logits) would keep its memory and its place under the caps after the thread ends.
pub fn on_lasting_thread<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            LASTING.with(|l| l.set(self.0));
        }
    }
    let _restore = Restore(LASTING.with(|l| l.replace(true)));
    f()
}

/// What fixes a forward's layers' launches once its step-to-step values are data in its upload.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Shape {
    /// Each segment's window rows, in the forward's order.
    pub(crate) windows: Vec<usize>,
    /// The words the layers read: the first this many of the forward's (the head's come after).
    pub(crate) words: usize,
}

/// How graphs are made and run: CUDA's (`Cuda`), or a test's.
pub(crate) trait Capture {
    type Graph: Send;
    /// Runs `body` so that a capture of it right after, on this thread, finds everything it uploads.
    fn warm(&self, dev: &Device, body: &mut dyn FnMut() -> Result<Tensor>) -> Result<Tensor>;
    /// Records `body`'s launches into a graph; they read the words from `step` and leave the hidden states in
    /// `out`.
    fn capture(
        &self,
        dev: &Device,
        step_out: (&Tensor, &Tensor),
        body: &mut dyn FnMut() -> Result<()>,
    ) -> Result<Self::Graph>;
    fn launch(&self, graph: &Self::Graph) -> Result<()>;
}

/// CUDA's graphs ([`kernels::cuda`](crate::kernels::cuda)).
#[derive(Debug, Default)]
pub(crate) struct Cuda;

impl Capture for Cuda {
    type Graph = cuda::Graph;
    fn warm(&self, dev: &Device, body: &mut dyn FnMut() -> Result<Tensor>) -> Result<Tensor> {
        cuda::with_upload_cache(dev, body)
    }
    fn capture(
        &self,
        dev: &Device,
        _: (&Tensor, &Tensor),
        body: &mut dyn FnMut() -> Result<()>,
    ) -> Result<cuda::Graph> {
        cuda::capture(dev, body)
    }
    fn launch(&self, graph: &cuda::Graph) -> Result<()> {
        graph.launch()
    }
}

/// A captured forward: the graph, the buffer its words are read from and the one its hidden states are left in.
struct Held<G> {
    graph: G,
    step: Tensor,
    out: Tensor,
}

enum Entry<G> {
    /// Ran once without a graph.
    Seen,
    /// Captured; its first replay is checked against a run without it.
    Captured(Held<G>),
    Checked(Held<G>),
    /// Runs without a graph: its capture failed or its replay differed.
    Refused,
    /// Taken out by the forward running it.
    Busy,
}

/// Counts of a model's graphs, for benchmarks and tests (Python: `Engine.graph_stats`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct GraphStats {
    /// Graphs captured (and kept until checked).
    pub captured: usize,
    /// Forwards whose layers ran by replaying a graph.
    pub replayed: usize,
    /// Shapes left to run without a graph (a failed capture, a replay that differed, a launch that failed).
    pub refused: usize,
}

/// One model's graphs, per thread and forward shape.
pub(crate) struct Graphs<C: Capture = Cuda> {
    capture: C,
    state: Mutex<State<C::Graph>>,
}

struct State<G> {
    entries: HashMap<(ThreadId, Shape), Entry<G>>,
    graphs: usize,
    stats: GraphStats,
}

impl<C: Capture + Default> Default for Graphs<C> {
    fn default() -> Self {
        Graphs::new(C::default())
    }
}

/// A forward's layers without a graph: its words in one of `pool`'s buffers.
fn eager<'p>(
    pool: &'p StepBuffers,
    words: StepWords,
    dev: &Device,
    body: &mut impl FnMut(&Step<'_>) -> Result<Tensor>,
) -> Result<(Tensor, Step<'p>)> {
    let step = pool.upload(words, dev)?;
    Ok((body(&step)?, step))
}

/// What a forward's layers left: the hidden states and the step whose words they read.
type Layers<'p> = Result<(Tensor, Step<'p>)>;

impl<C: Capture> Graphs<C> {
    pub(crate) fn new(capture: C) -> Self {
        let state = State { entries: HashMap::new(), graphs: 0, stats: GraphStats::default() };
        Graphs { capture, state: Mutex::new(state) }
    }

    pub(crate) fn stats(&self) -> GraphStats {
        self.state.lock().map(|s| s.stats).unwrap_or_default()
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State<C::Graph>>> {
        self.state.lock().map_err(|_| Error::Internal("a forward panicked while holding the CUDA graphs".into()))
    }

    /// Runs a forward of `shape` whose device inputs are `words`: its layers by `body` (the embedding and every
    /// layer: the hidden states), with or without its graph (see the module's comment), then `head` on the hidden
    /// states and the step holding the words (without a graph, one of `pool`'s buffers). A graph's buffer has room
    /// after the layers' words for twice the forward's rows of the head's.
    pub(crate) fn run<T>(
        &self,
        shape: Shape,
        words: StepWords,
        pool: &StepBuffers,
        dev: &Device,
        mut body: impl FnMut(&Step<'_>) -> Result<Tensor>,
        head: impl FnOnce(&Tensor, &Step<'_>) -> Result<T>,
    ) -> Result<T> {
        let rows: usize = shape.windows.iter().sum();
        if !LASTING.with(Cell::get) || rows > MAX_ROWS {
            let (x, step) = eager(pool, words, dev, &mut body)?;
            return head(&x, &step);
        }
        let room = StepWords::room_after(shape.words, 2 * rows);
        let key = (std::thread::current().id(), shape);
        let taken = {
            let mut st = self.lock()?;
            let new_room = st.entries.len() < MAX_SHAPES;
            match st.entries.get_mut(&key) {
                Some(e) => Some(std::mem::replace(e, Entry::Busy)),
                None => {
                    if new_room {
                        st.entries.insert(key.clone(), Entry::Seen);
                    }
                    None
                }
            }
        };
        let fits = |h: &Held<C::Graph>| words.len() <= h.step.elem_count();
        let (entry, layers): (_, Layers<'_>) = match taken {
            Some(Entry::Seen) if self.lock()?.graphs < MAX_GRAPHS && words.len() <= room => {
                self.first_capture(&words, room, dev, &mut body)
            }
            Some(Entry::Captured(h)) if fits(&h) => self.checked_replay(h, &words, &mut body),
            Some(Entry::Checked(h)) if fits(&h) => match self.replay(&h, &words) {
                Ok(done) => {
                    self.lock()?.stats.replayed += 1;
                    (Entry::Checked(h), Ok(done))
                }
                // a graph that cannot launch: dropped, and the forward runs without it
                Err(_) => (self.refuse(), eager(pool, words, dev, &mut body)),
            },
            // a shape seen once, refused, beyond the caps, or with more of the head's words than its buffer holds:
            // without a graph
            other => {
                let layers = eager(pool, words, dev, &mut body);
                match other {
                    Some(e) if !matches!(e, Entry::Busy) => (e, layers),
                    _ => {
                        let (x, step) = layers?;
                        return head(&x, &step);
                    }
                }
            }
        };
        if let Some(e) = self.lock()?.entries.get_mut(&key) {
            *e = entry;
        }
        let (x, step) = layers?;
        head(&x, &step)
    }

    /// The second forward of a shape: run on the shape's own buffer (of `room` words) with candle's small uploads
    /// cached, then captured. The run's hidden states are the forward's; a capture that fails leaves the shape
    /// refused, a cancelled one seen (to try again).
    fn first_capture(
        &self,
        words: &StepWords,
        room: usize,
        dev: &Device,
        body: &mut impl FnMut(&Step<'_>) -> Result<Tensor>,
    ) -> (Entry<C::Graph>, Layers<'static>) {
        let made = (|| -> Result<(Tensor, Step<'static>, Tensor)> {
            let buf = Step::buffer(room, dev)?;
            let step = Step::fixed(&buf, words)?;
            let x = self.capture.warm(dev, &mut || body(&step))?;
            Ok((x, step, buf))
        })();
        let (x, step, buf) = match made {
            Ok(m) => m,
            Err(e) => return (Entry::Seen, Err(e)),
        };
        let held = (|| -> Result<Held<C::Graph>> {
            let out = Tensor::zeros(x.shape(), x.dtype(), dev)?;
            // the captured pass's one op the run did not have, run once before (its kernels loaded)
            out.slice_set(&x, 0, 0)?;
            let graph = self.capture.capture(dev, (&buf, &out), &mut || {
                let t = body(&step)?;
                Ok(out.slice_set(&t, 0, 0)?)
            })?;
            Ok(Held { graph, step: buf, out })
        })();
        let Ok(mut st) = self.lock() else {
            return (Entry::Refused, Ok((x, step)));
        };
        match held {
            Ok(h) => {
                st.graphs += 1;
                st.stats.captured += 1;
                (Entry::Captured(h), Ok((x, step)))
            }
            Err(Error::Cancelled(_)) => (Entry::Seen, Ok((x, step))),
            Err(_) => {
                st.stats.refused += 1;
                (Entry::Refused, Ok((x, step)))
            }
        }
    }

    /// A replay: `words` into the graph's buffer, the graph launched. The hidden states are the graph's output
    /// buffer: the head's launches that read it are queued before any later replay writes it.
    fn replay(&self, h: &Held<C::Graph>, words: &StepWords) -> Layers<'static> {
        let step = Step::fixed(&h.step, words)?;
        self.capture.launch(&h.graph)?;
        Ok((h.out.clone(), step))
    }

    /// The first replay of a graph, then the same layers without it (on the same words: the window's K/V are
    /// written again with the same values): the graph is kept when the hidden states agree bit for bit. The
    /// forward goes on with the run's.
    fn checked_replay(
        &self,
        h: Held<C::Graph>,
        words: &StepWords,
        body: &mut impl FnMut(&Step<'_>) -> Result<Tensor>,
    ) -> (Entry<C::Graph>, Layers<'static>) {
        let replayed = self.replay(&h, words);
        let run = Step::fixed(&h.step, words).and_then(|step| Ok((body(&step)?, step)));
        let Ok((replayed, _)) = replayed else {
            return (self.refuse(), run);
        };
        let (x, step) = match run {
            Ok(r) => r,
            // cancelled (or failed) before the check: check on the next forward of this shape
            Err(e) => return (Entry::Captured(h), Err(e)),
        };
        match same_bits(&replayed, &x) {
            Ok(true) => {
                if let Ok(mut st) = self.lock() {
                    st.stats.replayed += 1;
                }
                (Entry::Checked(h), Ok((x, step)))
            }
            _ => (self.refuse(), Ok((x, step))),
        }
    }

    /// A captured graph dropped: its shape runs without one from now on.
    fn refuse(&self) -> Entry<C::Graph> {
        if let Ok(mut st) = self.lock() {
            st.graphs -= 1;
            st.stats.refused += 1;
        }
        Entry::Refused
    }
}

/// `a` and `b` hold the same values bit for bit (a NaN counts as different).
fn same_bits(a: &Tensor, b: &Tensor) -> Result<bool> {
    if a.shape() != b.shape() {
        return Ok(false);
    }
    let differ = a.ne(b)?.to_dtype(DType::U32)?.sum_all()?.to_scalar::<u32>()?;
    Ok(differ == 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// Graphs on the CPU for the tests: `capture` runs the body once (on the CPU a launch runs as it is queued) and
    /// keeps the buffers; a launch computes what the tests' forward computes (2 · the words) from the graph's
    /// buffer into its output, or, `stale`, leaves the output as the capture left it (a launch that took the
    /// captured step's values as arguments).
    #[derive(Default)]
    struct Fake {
        warmed: AtomicUsize,
        captured: AtomicUsize,
        launched: AtomicUsize,
        fail_capture: bool,
        stale: bool,
        /// Launches from this one on (counting from 1) fail.
        fail_launch: Option<usize>,
    }

    struct FakeGraph {
        step: Tensor,
        out: Tensor,
    }

    impl Capture for Fake {
        type Graph = FakeGraph;
        fn warm(&self, _dev: &Device, body: &mut dyn FnMut() -> Result<Tensor>) -> Result<Tensor> {
            self.warmed.fetch_add(1, Ordering::SeqCst);
            body()
        }
        fn capture(
            &self,
            _dev: &Device,
            (step, out): (&Tensor, &Tensor),
            body: &mut dyn FnMut() -> Result<()>,
        ) -> Result<FakeGraph> {
            self.captured.fetch_add(1, Ordering::SeqCst);
            if self.fail_capture {
                return Err(Error::Internal("capture refused".into()));
            }
            body()?;
            Ok(FakeGraph { step: step.clone(), out: out.clone() })
        }
        fn launch(&self, g: &FakeGraph) -> Result<()> {
            let k = self.launched.fetch_add(1, Ordering::SeqCst) + 1;
            if self.fail_launch.is_some_and(|from| k >= from) {
                return Err(Error::Internal("launch failed".into()));
            }
            if !self.stale {
                let n = g.out.elem_count();
                let x = (g.step.narrow(0, 0, n)?.to_dtype(DType::F32)? * 2.0)?;
                g.out.slice_set(&x.reshape((1, n))?, 0, 0)?;
            }
            Ok(())
        }
    }

    /// The tests' forward of `vals` with no head words (see `run_head`).
    fn run(g: &Graphs<Fake>, pool: &StepBuffers, vals: &[u32]) -> Result<(Vec<f32>, usize)> {
        run_with(g, pool, vals, &[], |_| None)
    }

    /// Runs the tests' forward through `g`: the layers' words are `vals`, the "layers" give 2 · vals as one row,
    /// and the head appends its own words (`head`, after the layers'). `fail(k)`: an error for the body's k-th run
    /// (from 0) in this forward. Returns what the head gave and how often the layers ran.
    fn run_with(
        g: &Graphs<Fake>,
        pool: &StepBuffers,
        vals: &[u32],
        head: &[u32],
        fail: impl Fn(usize) -> Option<Error>,
    ) -> Result<(Vec<f32>, usize)> {
        let mut w = StepWords::new();
        let sec = w.push(vals.iter().copied());
        let shape = Shape { windows: vec![vals.len()], words: w.len() };
        let head_sec = w.push(head.iter().copied());
        let calls = Cell::new(0);
        let out = on_lasting_thread(|| {
            g.run(
                shape,
                w,
                pool,
                &Device::Cpu,
                |step| {
                    let k = calls.get();
                    calls.set(k + 1);
                    if let Some(e) = fail(k) {
                        return Err(e);
                    }
                    Ok((step.view(sec)?.to_dtype(DType::F32)? * 2.0)?.unsqueeze(0)?)
                },
                |x, step| {
                    let mut v = x.flatten_all()?.to_vec1::<f32>()?;
                    v.extend(step.view(head_sec)?.to_vec1::<u32>()?.iter().map(|&h| h as f32));
                    Ok(v)
                },
            )
        })?;
        Ok((out, calls.get()))
    }

    fn doubled(vals: &[u32]) -> Vec<f32> {
        vals.iter().map(|&v| 2.0 * v as f32).collect()
    }

    fn counts(f: &Fake) -> [usize; 3] {
        [f.warmed.load(Ordering::SeqCst), f.captured.load(Ordering::SeqCst), f.launched.load(Ordering::SeqCst)]
    }

    #[test]
    fn a_shape_runs_once_then_is_captured_checked_and_replayed() {
        let (g, pool) = (Graphs::new(Fake::default()), StepBuffers::new());
        let steps: [&[u32]; 5] = [&[1, 2, 3], &[4, 5, 6], &[7, 8, 9], &[10, 11, 12], &[13, 14, 15]];
        // (body runs, [warmed, captured, launched]) after each forward
        let expect = [(1, [0, 0, 0]), (2, [1, 1, 0]), (1, [1, 1, 1]), (0, [1, 1, 2]), (0, [1, 1, 3])];
        for (vals, (runs, c)) in steps.iter().zip(expect) {
            let (out, n) = run(&g, &pool, vals).unwrap();
            assert_eq!(out, doubled(vals), "every forward's own logits");
            assert_eq!((n, counts(&g.capture)), (runs, c), "after {vals:?}");
        }
        assert_eq!(g.stats(), GraphStats { captured: 1, replayed: 3, refused: 0 });
        // another shape starts over; the first keeps its graph
        let (out, n) = run(&g, &pool, &[1, 2]).unwrap();
        assert_eq!((out, n, counts(&g.capture)), (doubled(&[1, 2]), 1, [1, 1, 3]));
        assert_eq!(run(&g, &pool, &[20, 21, 22]).unwrap(), (doubled(&[20, 21, 22]), 0));
    }

    #[test]
    fn the_head_reads_its_own_words_after_the_layers_whatever_their_count() {
        let (g, pool) = (Graphs::new(Fake::default()), StepBuffers::new());
        // one shape (a window of 3): the head's words change in count and value every forward; up to twice the
        // window's rows fit the graph's buffer, more run that forward without the graph
        let heads: [&[u32]; 6] = [&[9], &[8, 7], &[6, 5, 4, 3, 2, 1], &[], &[5, 5, 5, 5, 5, 5, 5], &[1, 2]];
        let runs = [1, 2, 1, 0, 1, 0];
        for (k, (head, n)) in heads.iter().zip(runs).enumerate() {
            let vals = [k as u32, 10 + k as u32, 20 + k as u32];
            let mut want = doubled(&vals);
            want.extend(head.iter().map(|&h| h as f32));
            assert_eq!(run_with(&g, &pool, &vals, head, |_| None).unwrap(), (want, n), "forward {k}");
        }
        assert_eq!(counts(&g.capture), [1, 1, 3]);
        assert_eq!(g.stats(), GraphStats { captured: 1, replayed: 3, refused: 0 });
    }

    #[test]
    fn a_replay_that_differs_from_the_run_is_refused_and_the_forward_keeps_the_run() {
        let (g, pool) = (Graphs::new(Fake { stale: true, ..Fake::default() }), StepBuffers::new());
        for vals in [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]] {
            assert_eq!(run(&g, &pool, &vals).unwrap().0, doubled(&vals));
        }
        // replayed once (the check), then never again
        assert_eq!(counts(&g.capture), [1, 1, 1]);
        assert_eq!(g.stats(), GraphStats { captured: 1, replayed: 0, refused: 1 });
        assert_eq!(g.lock().unwrap().graphs, 0);
        // a stale replay of the same words agrees, so the check passes for an unchanged step
        let (g, pool) = (Graphs::new(Fake { stale: true, ..Fake::default() }), StepBuffers::new());
        for _ in 0..4 {
            assert_eq!(run(&g, &pool, &[3, 4]).unwrap().0, doubled(&[3, 4]));
        }
        assert_eq!(g.stats(), GraphStats { captured: 1, replayed: 2, refused: 0 });
    }

    #[test]
    fn a_failed_capture_leaves_the_shape_without_a_graph() {
        let (g, pool) = (Graphs::new(Fake { fail_capture: true, ..Fake::default() }), StepBuffers::new());
        for vals in [[1, 2], [3, 4], [5, 6], [7, 8]] {
            assert_eq!(run(&g, &pool, &vals).unwrap().0, doubled(&vals));
        }
        assert_eq!(counts(&g.capture), [1, 1, 0]);
        assert_eq!(g.stats(), GraphStats { captured: 0, replayed: 0, refused: 1 });
    }

    #[test]
    fn a_graph_that_fails_to_launch_is_dropped_and_the_forward_runs_without_it() {
        for from in [1, 2] {
            // the check's launch fails (1), or a later replay's (2)
            let fake = Fake { fail_launch: Some(from), ..Fake::default() };
            let (g, pool) = (Graphs::new(fake), StepBuffers::new());
            for vals in [[1, 2], [3, 4], [5, 6], [7, 8], [9, 10]] {
                assert_eq!(run(&g, &pool, &vals).unwrap().0, doubled(&vals), "launches failing from {from}");
            }
            assert_eq!(counts(&g.capture), [1, 1, from], "launches failing from {from}");
            assert_eq!(g.stats(), GraphStats { captured: 1, replayed: from - 1, refused: 1 });
            assert_eq!(g.lock().unwrap().graphs, 0);
        }
    }

    #[test]
    fn a_cancelled_capture_is_tried_again_and_a_cancelled_check_checks_later() {
        let (g, pool) = (Graphs::new(Fake::default()), StepBuffers::new());
        let cancel = |at: usize| move |k: usize| (k == at).then(|| Error::Cancelled("stop".into()));
        run(&g, &pool, &[1, 2]).unwrap();
        // the second forward's run succeeds and its capture pass is cancelled: the run's logits, no graph yet
        assert_eq!(run_with(&g, &pool, &[3, 4], &[], cancel(1)).unwrap(), (doubled(&[3, 4]), 2));
        assert_eq!(g.stats().captured, 0);
        assert_eq!(run(&g, &pool, &[5, 6]).unwrap(), (doubled(&[5, 6]), 2));
        assert_eq!(g.stats().captured, 1);
        // the check's run is cancelled: the forward fails as cancelled, and the next one checks
        assert!(matches!(run_with(&g, &pool, &[7, 8], &[], cancel(0)), Err(Error::Cancelled(_))));
        assert_eq!(run(&g, &pool, &[9, 10]).unwrap(), (doubled(&[9, 10]), 1));
        assert_eq!(run(&g, &pool, &[11, 12]).unwrap(), (doubled(&[11, 12]), 0));
        assert_eq!(g.stats(), GraphStats { captured: 1, replayed: 2, refused: 0 });
    }

    #[test]
    fn graphs_belong_to_the_thread_that_captured_them() {
        let (g, pool) = (Graphs::new(Fake::default()), StepBuffers::new());
        for vals in [[1, 2], [3, 4], [5, 6]] {
            run(&g, &pool, &vals).unwrap();
        }
        std::thread::scope(|s| {
            s.spawn(|| {
                // a shape this thread has not run: once without a graph, whatever other threads hold
                assert_eq!(run(&g, &pool, &[7, 8]).unwrap(), (doubled(&[7, 8]), 1));
            });
        });
        assert_eq!(run(&g, &pool, &[9, 10]).unwrap(), (doubled(&[9, 10]), 0));
        assert_eq!(counts(&g.capture), [1, 1, 2]);
    }

    #[test]
    fn only_lasting_threads_graph_their_forwards() {
        let (g, pool) = (Graphs::new(Fake::default()), StepBuffers::new());
        let vals = [1u32, 2];
        let plain = |vals: &[u32]| {
            let mut w = StepWords::new();
            let sec = w.push(vals.iter().copied());
            let shape = Shape { windows: vec![vals.len()], words: w.len() };
            g.run(
                shape,
                w,
                &pool,
                &Device::Cpu,
                |step| Ok(step.view(sec)?.to_dtype(DType::F32)?),
                |x, _| Ok(x.to_vec1::<f32>()?),
            )
            .unwrap()
        };
        // outside `on_lasting_thread`: never captured, however often the shape runs, and nothing remembered
        for _ in 0..4 {
            assert_eq!(plain(&vals), [1.0, 2.0]);
        }
        assert_eq!(counts(&g.capture), [0, 0, 0]);
        assert_eq!(g.lock().unwrap().entries.len(), 0);
        // the mark is undone when the call ends
        on_lasting_thread(|| run(&g, &pool, &vals).unwrap());
        assert!(!LASTING.with(Cell::get));
    }

    #[test]
    fn graphs_and_shapes_are_capped() {
        let (g, pool) = (Graphs::new(Fake::default()), StepBuffers::new());
        // shapes of 1..=MAX_GRAPHS + 2 words, each run three times: only MAX_GRAPHS are captured
        for n in 1..=MAX_GRAPHS + 2 {
            let vals: Vec<u32> = (0..n as u32).collect();
            for _ in 0..3 {
                assert_eq!(run(&g, &pool, &vals).unwrap().0, doubled(&vals));
            }
        }
        assert_eq!(g.stats().captured, MAX_GRAPHS);
        let st = g.lock().unwrap();
        assert_eq!((st.graphs, st.entries.len()), (MAX_GRAPHS, MAX_GRAPHS + 2));
    }
}
