//! Continuous batching: one engine-side worker owns the active generations of a model and runs them together. Each tick
//! it asks every ready generation for its next forward ([`Generation::prepare`]: a new request's prefill chunk or a
//! running request's decode window), runs ONE forward over all those segments
//! ([`Model::forward_segments`](crate::model::Model::forward_segments)) and hands each generation its logits
//! ([`Generation::consume`]); step outputs go to each stream's channel. Streams join and leave at any tick (finished,
//! cancelled, dropped).
//!
//! Limits: at most `max_seqs` generations are batched; later ones wait in arrival order for a free place. A tick takes
//! at most `max_rows` window rows (always at least one segment), so one long prefill chunk does not hold up everyone
//! else for long; the starting point rotates so that nobody is skipped twice in a row. A stream whose reader falls
//! `MAX_UNREAD` outputs behind is paused (not stepped) until it reads, so a slow reader neither stalls the others nor
//! piles up outputs.
//!
//! Batching never changes outputs: a segment's logits do not depend on the other segments of its forward
//! ([`net::qwen`](crate::net::qwen), batch invariance), and each generation's segments are the ones it would run alone,
//! so every stream gets the tokens it gets alone (tested by `tests/batching.rs` and `tests/test_batching.py`).

use crate::error::{catch_panic, Error, Result};
use crate::generate::generation::{Generation, Next, StepOutput};
use crate::model::Model;
use crate::net::segment::{Logits, Segment};
use crate::params::load::BatchLimits;
use crate::util::Cancel;
use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, Weak};
use std::time::Duration;

/// What a tick may cost beside other streams, in rows over no keys
/// ([`Window::limit_next`](crate::generate::window::Window::limit_next)): a small request's few steps then wait about
/// this much each behind a long prompt's prefill, and the long prompt takes a few more forwards
/// (`benches/serving/hostile_serve.py`: a small chat beside an 8000-token prefill;
/// benches/results/batching-serving.md).
const FAIR_TICK_ROWS: usize = 256;

/// Outputs a stream may have unread before its generation pauses.
pub const MAX_UNREAD: usize = 16;

/// What a stream and the worker share besides the channel.
#[derive(Default)]
struct Control {
    /// Set by [`Canceller::cancel`]; the generation's segments carry it, so a long forward stops between layers.
    cancelled: Cancel,
    /// The stream's handle is gone: drop the generation.
    gone: AtomicBool,
    unread: AtomicUsize,
    /// The prompt's positions computed so far ([`Generation::prompt_progress`] after each forward) and its length
    /// (set once, at submit).
    prompt_done: AtomicUsize,
    prompt_len: AtomicUsize,
    /// Called after each output is sent and when the generation leaves ([`StreamHandle::set_waker`]).
    waker: Mutex<Option<Waker>>,
}

impl Control {
    fn note_progress(&self, done: usize) {
        self.prompt_done.store(done, Ordering::Relaxed);
    }

    fn wake(&self) {
        let w = self.waker.lock().ok().and_then(|w| w.clone());
        if let Some(w) = w {
            w();
        }
    }
}

/// Tells a reader that does not block on its stream (an event loop) that [`StreamHandle::try_next`] has something
/// to give: called on the scheduler's thread, so it must be quick and must not wait for locks the reader holds.
pub type Waker = Arc<dyn Fn() + Send + Sync>;

struct Entry {
    gen: Generation,
    tx: Sender<Result<StepOutput>>,
    ctl: Arc<Control>,
}

struct State {
    limits: BatchLimits,
    /// Submitted, not yet taken by the worker.
    incoming: Vec<Entry>,
    worker_running: bool,
    /// Bumped by every event the worker may be waiting for (a read, a cancel, a dropped stream, new limits), so
    /// that it never sleeps through one that came while it was ticking.
    epoch: u64,
}

struct Shared {
    model: Arc<Model>,
    /// Forwards run and segments they carried (their ratio is the mean batch).
    forwards: AtomicUsize,
    segments: AtomicUsize,
    rows: AtomicUsize,
    state: Mutex<State>,
    wake: Condvar,
}

impl Shared {
    fn notify(&self) {
        if let Ok(mut st) = self.state.lock() {
            st.epoch = st.epoch.wrapping_add(1);
        }
        self.wake.notify_all();
    }
}

/// The batching scheduler of one model (one per `Engine`).
pub struct Scheduler {
    shared: Arc<Shared>,
}

/// A stream's end: the generation's outputs, in order.
pub struct StreamHandle {
    rx: Receiver<Result<StepOutput>>,
    /// The stream's control block and the scheduler it wakes.
    c: Canceller,
    done: bool,
    /// An output read ahead while merging, delivered next.
    held: Option<Result<StepOutput>>,
}

impl Iterator for StreamHandle {
    type Item = Result<StepOutput>;

    /// The next output, waiting for it; None once the generation has finished (its final output was read),
    /// failed (the error was read) or was dropped.
    fn next(&mut self) -> Option<Result<StepOutput>> {
        self.next_waiting(Wait::Block).unwrap_or(None)
    }
}

/// [`StreamHandle::next_within`] found no output in time; the stream goes on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Waiting;

/// How a read of the stream's channel waits: not at all, until an output (or the end) comes, or at most a while.
#[derive(Debug, Clone, Copy)]
enum Wait {
    Poll,
    Block,
    Within(Duration),
}

impl StreamHandle {
    /// `next` without waiting: `Err(Waiting)` while no output is there.
    pub fn try_next(&mut self) -> std::result::Result<Option<Result<StepOutput>>, Waiting> {
        if self.done {
            return Ok(None);
        }
        let r = match self.held.take() {
            Some(h) => h,
            None => match self.rx.try_recv() {
                Ok(r) => {
                    self.read_one();
                    r
                }
                Err(std::sync::mpsc::TryRecvError::Empty) => return Err(Waiting),
                Err(std::sync::mpsc::TryRecvError::Disconnected) => return Ok(None),
            },
        };
        Ok(Some(self.deliver(r)))
    }

    /// A view of how far the stream's generation has come, readable from any thread while another waits on the
    /// stream.
    pub fn progress(&self) -> Progress {
        Progress { ctl: self.c.ctl.clone() }
    }

    /// Call `waker` after every output sent to this stream from now on, and when its generation leaves (so that a
    /// reader polling with [`try_next`](Self::try_next) needs no thread of its own). Set it before polling: an
    /// output sent in between then wakes too.
    pub fn set_waker(&self, waker: Waker) {
        if let Ok(mut w) = self.c.ctl.waker.lock() {
            *w = Some(waker);
        }
    }

    /// `next`, waiting at most `timeout` for the next output (a caller that must stay responsive, e.g. to an
    /// interrupt, polls with this).
    pub fn next_within(&mut self, timeout: Duration) -> std::result::Result<Option<Result<StepOutput>>, Waiting> {
        self.next_waiting(Wait::Within(timeout))
    }

    fn next_waiting(&mut self, wait: Wait) -> std::result::Result<Option<Result<StepOutput>>, Waiting> {
        if self.done {
            return Ok(None);
        }
        Ok(self.recv(wait)?.map(|r| self.deliver(r)))
    }

    /// The output `r` as delivered: with the outputs that piled up behind it merged in, and the stream marked done
    /// after its last.
    fn deliver(&mut self, mut r: Result<StepOutput>) -> Result<StepOutput> {
        // Outputs that piled up while the reader was busy come out as one (tokens and text joined), so that a
        // slow reader catches up in one call; trace events are never merged (each is one forward's picture).
        while let Ok(o) = &mut r {
            if o.finish_reason.is_some() || o.event.is_some() {
                break;
            }
            match self.recv(Wait::Poll).unwrap_or(None) {
                Some(Ok(next)) if next.event.is_none() => o.absorb(next),
                Some(other) => {
                    // an event or an error: deliver what we have now, that one next time
                    self.held = Some(other);
                    break;
                }
                None => break,
            }
        }
        match &r {
            Ok(o) if o.finish_reason.is_none() => {}
            _ => {
                if self.held.is_none() {
                    self.done = true;
                }
            }
        }
        r
    }

    /// One output from the channel (or the one held back), waiting for it as `wait` says; None when there is none
    /// (the generation is gone, or nothing is there to poll).
    fn recv(&mut self, wait: Wait) -> std::result::Result<Option<Result<StepOutput>>, Waiting> {
        if let Some(h) = self.held.take() {
            return Ok(Some(h));
        }
        let r = match wait {
            Wait::Poll => self.rx.try_recv().ok(),
            Wait::Block => self.rx.recv().ok(),
            Wait::Within(t) => match self.rx.recv_timeout(t) {
                Ok(r) => Some(r),
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => return Err(Waiting),
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => None,
            },
        };
        if r.is_some() {
            self.read_one();
        }
        Ok(r)
    }

    /// Count one output read off the channel.
    fn read_one(&self) {
        if self.c.ctl.unread.fetch_sub(1, Ordering::SeqCst) == MAX_UNREAD {
            self.c.shared.notify(); // the generation was paused on this reader
        }
    }

    /// A handle that cancels this stream from any thread (while another waits on `next`).
    pub fn canceller(&self) -> Canceller {
        self.c.clone()
    }

    /// Ask the generation to stop: its next output is the final one, with finish_reason "cancelled".
    pub fn cancel(&self) {
        self.c.cancel();
    }
}

/// How far one stream's generation has come ([`StreamHandle::progress`]).
#[derive(Clone)]
pub struct Progress {
    ctl: Arc<Control>,
}

impl Progress {
    /// The prompt's forwards: (positions computed, the prompt's length), updated after each forward (what a
    /// progress line shows during a long prefill); positions read from the prefix cache count as computed.
    pub fn prompt(&self) -> (usize, usize) {
        (self.ctl.prompt_done.load(Ordering::Relaxed), self.ctl.prompt_len.load(Ordering::Relaxed))
    }
}

/// Cancels one stream ([`StreamHandle::canceller`]).
#[derive(Clone)]
pub struct Canceller {
    ctl: Arc<Control>,
    shared: Arc<Shared>,
}

impl Canceller {
    /// Ask the generation to stop: its next output is the final one, with finish_reason "cancelled".
    pub fn cancel(&self) {
        self.ctl.cancelled.cancel();
        self.shared.notify();
    }
}

impl Drop for StreamHandle {
    /// The client is gone: a forward running for it stops between layers (as a cancel), and it leaves with no
    /// output.
    fn drop(&mut self) {
        self.c.ctl.gone.store(true, Ordering::SeqCst);
        self.c.ctl.cancelled.cancel();
        self.c.shared.notify();
    }
}

impl Scheduler {
    pub fn new(model: Arc<Model>, limits: BatchLimits) -> Result<Scheduler> {
        limits.check()?;
        let state = State { limits, incoming: vec![], worker_running: false, epoch: 0 };
        let shared = Shared {
            model,
            forwards: AtomicUsize::new(0),
            segments: AtomicUsize::new(0),
            rows: AtomicUsize::new(0),
            state: Mutex::new(state),
            wake: Condvar::new(),
        };
        Ok(Scheduler { shared: Arc::new(shared) })
    }

    /// (forwards run, segments they carried, window rows they computed) since the scheduler started.
    pub fn stats(&self) -> (usize, usize, usize) {
        let s = &self.shared;
        (s.forwards.load(Ordering::Relaxed), s.segments.load(Ordering::Relaxed), s.rows.load(Ordering::Relaxed))
    }

    pub fn limits(&self) -> BatchLimits {
        self.shared.state.lock().map(|s| s.limits).unwrap_or_default()
    }

    /// Change the caps (they apply from the next tick).
    pub fn set_limits(&self, limits: BatchLimits) -> Result<()> {
        limits.check()?;
        self.lock()?.limits = limits;
        self.shared.notify();
        Ok(())
    }

    fn lock(&self) -> Result<std::sync::MutexGuard<'_, State>> {
        self.shared.state.lock().map_err(|_| Error::Internal("scheduler lock poisoned".into()))
    }

    /// Add a generation; its outputs arrive on the returned handle.
    pub fn submit(&self, gen: Generation) -> Result<StreamHandle> {
        let (tx, rx) = channel();
        let (done, len) = gen.prompt_progress();
        let ctl = Arc::new(Control { prompt_done: done.into(), prompt_len: len.into(), ..Control::default() });
        let mut st = self.lock()?;
        st.incoming.push(Entry { gen, tx, ctl: ctl.clone() });
        if !st.worker_running {
            st.worker_running = true;
            let weak = Arc::downgrade(&self.shared);
            std::thread::Builder::new()
                .name("mbd-scheduler".into())
                .spawn(move || worker(weak))
                .map_err(|e| Error::Internal(format!("cannot start the scheduler thread: {e}")))?;
        }
        drop(st);
        self.shared.wake.notify_all();
        let c = Canceller { ctl, shared: self.shared.clone() };
        Ok(StreamHandle { rx, c, done: false, held: None })
    }
}

/// The worker's own state: batched generations, the ones waiting for a place, the rotation.
#[derive(Default)]
struct Batch {
    active: Vec<Entry>,
    waiting: VecDeque<Entry>,
    start: usize,
}

/// The worker thread: it lives as long as the engine, so its forwards may replay CUDA graphs
/// ([`net::graph::on_lasting_thread`](crate::net::graph::on_lasting_thread)).
fn worker(weak: Weak<Shared>) {
    crate::net::graph::on_lasting_thread(|| work(weak))
}

fn work(weak: Weak<Shared>) {
    let mut batch = Batch::default();
    loop {
        // Hold the shared state only while working or waiting briefly: when the model and every stream are
        // gone, the worker ends.
        let Some(shared) = weak.upgrade() else { return };
        let (limits, epoch) = {
            let Ok(mut st) = shared.state.lock() else { return };
            batch.waiting.extend(st.incoming.drain(..));
            if batch.active.is_empty() && batch.waiting.is_empty() {
                let Ok((woken, _)) = shared.wake.wait_timeout(st, Duration::from_millis(200)) else { return };
                st = woken;
                batch.waiting.extend(st.incoming.drain(..));
                if batch.active.is_empty() && batch.waiting.is_empty() {
                    if Arc::strong_count(&shared) == 1 {
                        st.worker_running = false;
                        return;
                    }
                    continue;
                }
            }
            (st.limits, st.epoch)
        };
        let worked = match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| batch.tick(&shared, limits))) {
            Ok(w) => w,
            Err(_) => {
                // a bug in the bookkeeping: end the batched generations with an error rather than the worker
                for e in batch.active.drain(..) {
                    send(&e, Err(Error::Internal("the batching scheduler failed on this tick".into())));
                }
                true
            }
        };
        if !worked {
            // every generation is paused on its reader: sleep until something happens (unless it already did)
            if let Ok(st) = shared.state.lock() {
                if st.incoming.is_empty() && st.epoch == epoch {
                    let _ = shared.wake.wait_timeout(st, Duration::from_millis(200));
                }
            }
        }
    }
}

impl Entry {
    /// Whether the generation takes a step this tick: it has not finished and its reader is not `MAX_UNREAD`
    /// outputs behind.
    fn ready(&self) -> bool {
        self.ctl.unread.load(Ordering::SeqCst) < MAX_UNREAD && !self.gen.finished()
    }

    /// Whether the generation leaves now: its stream's handle is gone, or it was cancelled (then its final
    /// output, finish_reason "cancelled", is sent first).
    fn leaves(&mut self) -> bool {
        if self.ctl.gone.load(Ordering::SeqCst) {
            return true;
        }
        if self.ctl.cancelled.is_cancelled() {
            let o = self.gen.cancel();
            if o.finish_reason.is_some() {
                send(self, Ok(o));
            }
            return true;
        }
        false
    }
}

impl Drop for Entry {
    /// The generation leaves (finished, cancelled, failed or dropped): a reader waiting to be woken sees its end.
    fn drop(&mut self) {
        self.ctl.wake();
    }
}

fn send(e: &Entry, r: Result<StepOutput>) -> bool {
    e.ctl.unread.fetch_add(1, Ordering::SeqCst);
    let sent = e.tx.send(r).is_ok();
    e.ctl.wake();
    sent
}

impl Batch {
    /// One tick. Returns whether any generation moved.
    fn tick(&mut self, shared: &Shared, limits: BatchLimits) -> bool {
        let model = &shared.model;
        // leave: streams dropped; cancelled ones get their final output
        let mut moved = false;
        let mut stays = |e: &mut Entry| {
            let leaves = e.leaves();
            moved |= leaves;
            !leaves
        };
        self.active.retain_mut(&mut stays);
        self.waiting.retain_mut(&mut stays);
        // join: waiting generations take free places in arrival order
        while self.active.len() < limits.max_seqs {
            match self.waiting.pop_front() {
                Some(e) => self.active.push(e),
                None => break,
            }
        }
        if self.active.is_empty() {
            return moved;
        }
        let device = model.device().clone();
        let n = self.active.len();
        let start = self.start % n;
        self.start = self.start.wrapping_add(1);
        let (outputs, ran, failed) = crate::cpu_pool::on_device_pool(&device, || {
            let r = catch_panic(|| Ok(run_tick(shared, &mut self.active, start, limits)));
            r.map(|(o, ran)| (o, ran, None)).unwrap_or_else(|e| (vec![], false, Some(e)))
        });
        // a forward that emitted nothing (a prefill chunk) is progress too
        moved |= ran;
        if let Some(err) = failed {
            // a panic inside the tick: the generations' states cannot be trusted; end them all with the error
            for e in self.active.drain(..) {
                send(&e, Err(Error::Internal(format!("{err}"))));
            }
            return true;
        }
        // deliver; drop generations that finished, failed, or whose stream is gone
        let mut leave = vec![false; n];
        for (i, r) in outputs {
            moved = true;
            let e = &self.active[i];
            let last = !matches!(&r, Ok(o) if o.finish_reason.is_none());
            // a step that made nothing new visible (no stable token, no trace event) is not sent
            let empty =
                matches!(&r, Ok(o) if o.token_ids.is_empty() && o.text.is_empty() && o.event.is_none() && !last);
            if (!empty && !send(e, r)) || last {
                leave[i] = true;
            }
        }
        let mut i = 0;
        self.active.retain(|e| {
            let keep = !leave[i] && !e.gen.finished();
            i += 1;
            keep
        });
        moved
    }
}

/// The forward of one tick over the ready generations (from `start`, rotating): (index, output) pairs to
/// deliver, and whether a forward ran.
fn run_tick(
    shared: &Shared,
    active: &mut [Entry],
    start: usize,
    limits: BatchLimits,
) -> (Vec<(usize, Result<StepOutput>)>, bool) {
    let mut outputs = vec![];
    let mut segs = vec![];
    let mut who = vec![];
    let mut rows = 0usize;
    // fairness: beside other streams, a long prompt or recompute chunk is cut so that no tick costs much more than
    // `FAIR_TICK_ROWS` rows over no keys (where that changes no output: `Model::rows_independent`)
    let model = &shared.model;
    let ready = active.iter().filter(|e| e.ready()).count();
    let limit = (ready > 1 && model.rows_independent()).then(|| (FAIR_TICK_ROWS, model.key_equivalent()));
    // split the slice so that each generation can lend out its segment at once
    let (head, tail) = active.split_at_mut(start);
    let order = tail.iter_mut().enumerate().map(|(j, e)| (start + j, e)).chain(head.iter_mut().enumerate());
    for (i, e) in order {
        if segs.len() >= limits.max_seqs {
            break;
        }
        if !e.ready() {
            continue;
        }
        match e.gen.prepare_within(limit) {
            Ok(Next::Forward(mut seg)) => {
                seg.cancel = Some(e.ctl.cancelled.clone());
                let w = seg.ids.len();
                if !segs.is_empty() && rows + w > limits.max_rows {
                    continue; // next tick (the rotation puts it first soon)
                }
                rows += w;
                segs.push(seg);
                who.push(i);
            }
            Ok(Next::Output(o)) => outputs.push((i, Ok(o))),
            Ok(Next::Finished) => {}
            Err(err) => outputs.push((i, Err(err))),
        }
    }
    if segs.is_empty() {
        return (outputs, false);
    }
    let model = &shared.model;
    shared.forwards.fetch_add(1, Ordering::Relaxed);
    shared.segments.fetch_add(segs.len(), Ordering::Relaxed);
    shared.rows.fetch_add(rows, Ordering::Relaxed);
    let results: Vec<Result<Logits>> = match model.forward_segments(&mut segs) {
        Ok(ls) => ls.into_iter().map(Ok).collect(),
        // every segment was cancelled: each ends so, with no forward of its own
        Err(Error::Cancelled(m)) => segs.iter().map(|_| Err(Error::Cancelled(m.clone()))).collect(),
        Err(_) if segs.len() > 1 => {
            // one segment's failure (e.g. memory) must not fail the others: run each alone to tell them apart
            segs.iter_mut()
                .map(|s| {
                    let mut one = [Segment::reborrow(s)];
                    model.forward_segments(&mut one).map(|mut v| v.pop().expect("one segment"))
                })
                .collect()
        }
        Err(e) => vec![Err(e)],
    };
    drop(segs);
    // hand each generation its logits
    for (i, r) in who.into_iter().zip(results) {
        let r = r.and_then(|l| active[i].gen.consume(l));
        active[i].ctl.note_progress(active[i].gen.prompt_progress().0);
        match r {
            Ok(Some(o)) => outputs.push((i, Ok(o))),
            Ok(None) => {}
            // its forward stopped for the cancel: the next tick ends it with its "cancelled" output
            Err(Error::Cancelled(_)) if active[i].ctl.cancelled.is_cancelled() => {}
            Err(e) => outputs.push((i, Err(e))),
        }
    }
    (outputs, true)
}
