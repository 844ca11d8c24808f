//! The engine: a loaded model and the scheduler that runs its generations, batched (what Python calls `Engine`;
//! the binding only wraps it). Model calls that need no scheduler (tokenize, logits, scores) are the `Model`'s.

use crate::error::Result;
use crate::generate::generation::Generation;
use crate::generate::scheduler::{Scheduler, StreamHandle};
use crate::model::Model;
use crate::params::load::{BatchLimits, LoadOptions};
use crate::params::request::GenRequest;
use std::path::Path;
use std::sync::Arc;

/// A model and its scheduler: every generation submitted here shares the model's forwards with the others running
/// (continuous batching), each getting exactly the tokens it gets alone.
pub struct Engine {
    model: Arc<Model>,
    scheduler: Scheduler,
}

impl Engine {
    /// Load a model directory or GGUF file ([`Model::load`]) and start its scheduler with batching caps `limits`.
    pub fn load(path: &Path, opts: &LoadOptions, limits: BatchLimits) -> Result<Engine> {
        Engine::new(Model::load(path, opts)?, limits)
    }

    /// An engine over a loaded model.
    pub fn new(model: Model, limits: BatchLimits) -> Result<Engine> {
        let model = Arc::new(model);
        let scheduler = Scheduler::new(model.clone(), limits)?;
        Ok(Engine { model, scheduler })
    }

    /// The model (shared: calls on it may run beside the scheduler's forwards).
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// The scheduler: its batching caps and counters.
    pub fn scheduler(&self) -> &Scheduler {
        &self.scheduler
    }

    /// Start a generation of `prompt` (token ids) under `req`; the scheduler runs it from then on. Its outputs
    /// arrive on the handle; dropping the handle cancels it.
    pub fn submit(&self, prompt: Vec<u32>, req: &GenRequest) -> Result<StreamHandle> {
        self.scheduler.submit(Generation::new(self.model.clone(), prompt, req)?)
    }
}
