//! A generation in progress as Python sees it (`CoreStream`): each output waited for with the GIL released and
//! handed over as a dict.

use crate::{to_py, wait_interruptibly, SIGNAL_POLL};
use mbd_core::error::catch_panic;
use mbd_core::generate::generation::StepOutput;
use mbd_core::generate::scheduler::{Canceller, Progress, StreamHandle, Waiting};
use mbd_core::generate::wake::WakeLine;
use mbd_core::{Error, TokenLogprob};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use std::sync::Arc;
use std::sync::Mutex;

/// (token, logprob, [(id, logprob), ...]): a `TokenLogprob` as Python receives it.
pub(crate) type LogprobTuple = (u32, f32, Vec<(u32, f32)>);

pub(crate) fn logprob_tuple(t: TokenLogprob) -> LogprobTuple {
    (t.token, t.logprob, t.top)
}

/// One generation in progress, run by the model's scheduler; `step()` waits for its next output with the GIL
/// released.
#[pyclass(frozen, module = "mbd_rs._core")]
pub(crate) struct CoreStream {
    handle: Mutex<Option<StreamHandle>>,
    canceller: Canceller,
    progress: Progress,
}

fn output_dict<'py>(py: Python<'py>, o: StepOutput) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("token_ids", o.token_ids)?;
    d.set_item("text", o.text)?;
    d.set_item("finish_reason", o.finish_reason.map(|f| f.name()))?;
    if let Some(u) = o.usage {
        let ud = PyDict::new(py);
        ud.set_item("prompt_tokens", u.prompt_tokens)?;
        ud.set_item("completion_tokens", u.completion_tokens)?;
        ud.set_item("forward_passes", u.forward_passes)?;
        ud.set_item("tokens_per_forward", u.tokens_per_forward)?;
        ud.set_item("ttft_ms", u.ttft_ms)?;
        ud.set_item("prefill_ms", u.prefill_ms)?;
        ud.set_item("decode_ms", u.decode_ms)?;
        ud.set_item("tokens_per_second", u.tokens_per_second)?;
        ud.set_item("positions_forwarded", u.positions_forwarded)?;
        ud.set_item("verifications", u.verifications)?;
        ud.set_item("drafts_proposed", u.drafts_proposed)?;
        ud.set_item("drafts_accepted", u.drafts_accepted)?;
        ud.set_item("forced_tokens", u.forced_tokens)?;
        ud.set_item("cached_tokens", u.cached_tokens)?;
        ud.set_item("head_ms", u.head_ms)?;
        d.set_item("usage", ud)?;
    } else {
        d.set_item("usage", py.None())?;
    }
    if let Some(e) = o.event {
        let ed = PyDict::new(py);
        ed.set_item("index", e.index)?;
        ed.set_item("decoded", e.decoded)?;
        ed.set_item("tokens", e.tokens)?;
        let blocks: Vec<(usize, usize, &str)> = e.blocks.iter().map(|(a, b, s)| (*a, *b, s.name())).collect();
        ed.set_item("blocks", blocks)?;
        ed.set_item("tokens_per_forward", e.tokens_per_forward)?;
        ed.set_item("positions_per_forward", e.positions_per_forward)?;
        ed.set_item("canvas", e.canvas)?;
        ed.set_item("end", e.end)?;
        d.set_item("step", ed)?;
    } else {
        d.set_item("step", py.None())?;
    }
    d.set_item("logprobs", o.logprobs.into_iter().map(logprob_tuple).collect::<Vec<_>>())?;
    Ok(d)
}

impl CoreStream {
    pub(crate) fn new(h: StreamHandle) -> Self {
        CoreStream { canceller: h.canceller(), progress: h.progress(), handle: Mutex::new(Some(h)) }
    }
}

/// A file descriptor that becomes readable when one of the streams it was set on has an output or has ended:
/// what an asyncio event loop watches (`loop.add_reader(waker.fileno(), ...)`) in place of a thread per stream.
/// Both ends live as long as this object and every stream it was set on.
#[pyclass(frozen, module = "mbd_rs._core")]
pub(crate) struct CoreWaker {
    line: Arc<WakeLine>,
}

#[pymethods]
impl CoreWaker {
    #[new]
    fn new() -> PyResult<Self> {
        let line = WakeLine::new().map_err(|e| to_py(Error::Internal(format!("cannot open a socket pair: {e}"))))?;
        Ok(CoreWaker { line: Arc::new(line) })
    }

    /// The descriptor to watch for reading.
    fn fileno(&self) -> i32 {
        self.line.fd()
    }

    /// Read what is pending (call it when the descriptor is readable, before polling the streams): later outputs
    /// wake again.
    fn drain(&self) {
        self.line.drain();
    }
}

#[pymethods]
impl CoreStream {
    /// Make `waker`'s descriptor readable after every output of this stream from now on and when it ends.
    fn set_waker(&self, waker: &CoreWaker) -> PyResult<()> {
        let guard = self.handle.lock().map_err(|_| to_py(Error::Internal("stream lock poisoned".into())))?;
        if let Some(h) = guard.as_ref() {
            h.set_waker(waker.line.waker());
        }
        Ok(())
    }

    /// The next output if there is one, without waiting: (True, dict), (True, None) once the generation has
    /// finished or was closed, or (False, None) while nothing has come yet.
    fn poll<'py>(&self, py: Python<'py>) -> PyResult<(bool, Option<Bound<'py, PyDict>>)> {
        let got = catch_panic(|| {
            let mut guard = self.handle.lock().map_err(|_| Error::Internal("stream lock poisoned".into()))?;
            Ok(match guard.as_mut().map(|h| h.try_next()) {
                Some(Ok(Some(r))) => Some(Some(r?)),
                Some(Ok(None)) | None => Some(None),
                Some(Err(Waiting)) => None,
            })
        })
        .map_err(to_py)?;
        match got {
            Some(o) => Ok((true, o.map(|o| output_dict(py, o)).transpose()?)),
            None => Ok((false, None)),
        }
    }

    /// The next output: a dict (token_ids, text, finish_reason, usage, step), or None when the generation has
    /// finished or was closed.
    /// Waits without the GIL, looking at Python's signals every `SIGNAL_POLL`: an interrupt (Ctrl-C) cancels the
    /// generation (its forward stops between layers) and is raised.
    fn step<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let next = || {
            catch_panic(|| {
                let mut guard = self.handle.lock().map_err(|_| Error::Internal("stream lock poisoned".into()))?;
                match guard.as_mut().map(|h| h.next_within(SIGNAL_POLL)) {
                    Some(Ok(Some(r))) => r.map(|o| Some(Some(o))),
                    Some(Ok(None)) | None => Ok(Some(None)),
                    Some(Err(Waiting)) => Ok(None),
                }
            })
            .transpose() // None: nothing yet
        };
        match wait_interruptibly(py, next) {
            Ok(out) => out.map_err(to_py)?.map(|o| output_dict(py, o)).transpose(),
            Err(interrupt) => {
                self.canceller.cancel();
                Err(interrupt)
            }
        }
    }

    /// How far the prompt's forwards have come: (positions computed, the prompt's length); thread-safe, never
    /// waits.
    fn prompt_progress(&self) -> (usize, usize) {
        self.progress.prompt()
    }

    /// Ask the generation to stop; thread-safe. Its next output is the final one, finish_reason "cancelled".
    fn cancel(&self) {
        self.canceller.cancel();
    }

    /// Free the generation's state (KV cache) now.
    fn close(&self, py: Python<'_>) {
        self.canceller.cancel();
        py.detach(|| {
            if let Ok(mut h) = self.handle.lock() {
                *h = None;
            }
        });
    }
}
