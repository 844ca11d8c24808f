//! Thin PyO3 binding over mbd-core, split as the core is: `convert` (Python values to the kinds parameter specs
//! name, serde values back), `engine` (`CoreEngine` wraps [`mbd_core::Engine`]), `stream` (`CoreStream`); this file
//! holds the module, the exceptions and the one mapping of core errors onto them (`to_py`). No engine logic lives
//! here: parameter names, kinds and ranges come from [`mbd_core::params`].

mod convert;
mod engine;
mod stream;

use mbd_core::error::catch_panic;
use mbd_core::generate::plan::DEFAULT_MAX_TOKENS;
use mbd_core::model::info::MODEL_INFO_FIELDS;
use mbd_core::params::load::ALL_LOAD_PARAMS;
use mbd_core::params::request::{
    GENERATION_PARAMS, KERNEL_SWITCHES, LOAD_PARAMS, LOGITS_PARAMS, PROFILE_OVERRIDES, SCORE_PARAMS,
};
use mbd_core::util::Cancel;
use mbd_core::Error;
use pyo3::exceptions::PyTypeError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

pyo3::import_exception!(mbd_rs.errors, MbdError);
pyo3::import_exception!(mbd_rs.errors, ModelLoadError);
pyo3::import_exception!(mbd_rs.errors, ModelFileNotFoundError);
pyo3::import_exception!(mbd_rs.errors, ConfigError);
pyo3::import_exception!(mbd_rs.errors, UnsupportedArchitectureError);
pyo3::import_exception!(mbd_rs.errors, InvalidRequestError);
pyo3::import_exception!(mbd_rs.errors, ContextLengthError);
pyo3::import_exception!(mbd_rs.errors, InternalError);
pyo3::import_exception!(mbd_rs.errors, RequestCancelledError);

fn to_py(e: Error) -> PyErr {
    match e {
        Error::FileNotFound { path, what } => {
            ModelFileNotFoundError::new_err((2, format!("no such file ({what})"), path.display().to_string()))
        }
        Error::ModelLoad(m) => ModelLoadError::new_err(m),
        Error::Config(m) => ConfigError::new_err(m),
        Error::Unsupported(m) => UnsupportedArchitectureError::new_err(m),
        Error::InvalidRequest(m) => InvalidRequestError::new_err(m),
        Error::UnknownParameter(m) => PyTypeError::new_err(m),
        Error::ContextLength(m) => ContextLengthError::new_err(m),
        Error::Cancelled(m) => RequestCancelledError::new_err(m),
        Error::Backend(b) => MbdError::new_err(format!("tensor backend error: {b}")),
        Error::Internal(m) => InternalError::new_err(format!("internal error (please report): {m}")),
    }
}

/// Run a core call with the GIL released, converting panics and errors.
fn run<T: Send>(py: Python<'_>, f: impl FnOnce() -> mbd_core::Result<T> + Send) -> PyResult<T> {
    py.detach(|| catch_panic(f)).map_err(to_py)
}

/// How often a waiting call looks at Python's signals (Ctrl-C).
const SIGNAL_POLL: std::time::Duration = std::time::Duration::from_millis(50);

/// Run a long core call that `cancel` can stop (between its chunks and a forward's layers) on a thread of its own,
/// while this thread waits without the GIL and looks at Python's signals every `SIGNAL_POLL`: an interrupt
/// (KeyboardInterrupt, or any exception a signal handler raises) cancels the call, waits for it to stop and is
/// raised.
fn run_cancellable<T: Send>(
    py: Python<'_>,
    cancel: Cancel,
    f: impl FnOnce(&Cancel) -> mbd_core::Result<T> + Send,
) -> PyResult<T> {
    std::thread::scope(|scope| {
        let (tx, mut rx) = std::sync::mpsc::channel();
        let worker = cancel.clone();
        scope.spawn(move || {
            let _ = tx.send(catch_panic(|| f(&worker)));
        });
        let waiting = &mut rx; // (a Receiver is Send, not Sync: the GIL-free wait borrows it mutably)
        let got = wait_interruptibly(py, move || match waiting.recv_timeout(SIGNAL_POLL) {
            Ok(r) => Some(r),
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                Some(Err(Error::Internal("a core call ended without a result".into())))
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => None,
        });
        match got {
            Ok(r) => r.map_err(to_py),
            Err(interrupt) => {
                cancel.cancel();
                let _ = py.detach(move || rx.recv());
                Err(interrupt)
            }
        }
    })
}

/// Call `poll` without the GIL (each call waits at most about `SIGNAL_POLL`) until it gives a value, looking at
/// Python's signals between calls: an interrupt (KeyboardInterrupt, or any exception a signal handler raises) is
/// returned as the error, for the caller to cancel its work.
pub(crate) fn wait_interruptibly<R: Send>(py: Python<'_>, mut poll: impl FnMut() -> Option<R> + Send) -> PyResult<R> {
    loop {
        if let Some(r) = py.detach(&mut poll) {
            return Ok(r);
        }
        py.check_signals()?;
    }
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<engine::CoreEngine>()?;
    m.add_class::<stream::CoreStream>()?;
    m.add_class::<stream::CoreWaker>()?;
    m.add_class::<engine::CancelToken>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add("cuda_available", cfg!(feature = "cuda"))?;
    // a development build (`maturin develop` without --release: the project's crates at opt-level 1, debug
    // assertions on) runs its kernels several times slower: benchmarks say so
    m.add("debug_build", cfg!(debug_assertions))?;
    m.add("PARAMS", convert::params_dict(py)?)?;
    m.add("GENERATION_PARAMS", PyTuple::new(py, GENERATION_PARAMS)?)?;
    m.add("PROFILE_OVERRIDES", PyTuple::new(py, PROFILE_OVERRIDES)?)?;
    m.add("LOGITS_PARAMS", PyTuple::new(py, LOGITS_PARAMS)?)?;
    m.add("SCORE_PARAMS", PyTuple::new(py, SCORE_PARAMS)?)?;
    m.add("LOAD_PARAMS", PyTuple::new(py, LOAD_PARAMS)?)?;
    m.add("KERNEL_SWITCHES", PyTuple::new(py, KERNEL_SWITCHES)?)?;
    m.add("LOAD_OPTIONS", PyTuple::new(py, ALL_LOAD_PARAMS)?)?;
    m.add("MODEL_INFO_FIELDS", PyTuple::new(py, MODEL_INFO_FIELDS)?)?;
    m.add("DEFAULT_MAX_TOKENS", DEFAULT_MAX_TOKENS)?;
    // At import, before any stream runs: pin the CPU thread count once (see mbd_core::cpu_pool).
    m.add("cpu_threads", mbd_core::cpu_pool::pin_thread_count())?;
    Ok(())
}
