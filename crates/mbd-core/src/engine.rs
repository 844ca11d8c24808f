//! The engine: a loaded model and the scheduler that runs its generations, batched (what Python calls `Engine`;
//! the binding only wraps it). Model calls that need no scheduler (tokenize, logits, scores) are the `Model`'s.

use crate::error::Result;
use crate::generate::generation::Generation;
use crate::generate::prefix::PrefixCache;
use crate::generate::scheduler::{Scheduler, StreamHandle};
use crate::model::Model;
use crate::params::load::{default_prefix_cache, BatchLimits, LoadOptions};
use crate::params::request::GenRequest;
use std::path::Path;
use std::sync::Arc;

/// A model and its scheduler: every generation submitted here shares the model's forwards with the others running
/// (continuous batching), each getting exactly the tokens it gets alone.
pub struct Engine {
    model: Arc<Model>,
    scheduler: Scheduler,
    /// The K/V of earlier requests' prompts and answers ([`generate::prefix`](crate::generate::prefix)).
    prefix: Arc<PrefixCache>,
}

impl Engine {
    /// Load a model directory or GGUF file ([`Model::load`]) and start its scheduler with batching caps `limits`.
    /// The prefix cache holds `opts.prefix_cache` bytes at most.
    pub fn load(path: &Path, opts: &LoadOptions, limits: BatchLimits) -> Result<Engine> {
        Engine::new(Model::load(path, opts)?, limits, opts.prefix_cache)
    }

    /// An engine over a loaded model, its prefix cache holding at most `prefix_cache` bytes (None: the default).
    pub fn new(model: Model, limits: BatchLimits, prefix_cache: Option<usize>) -> Result<Engine> {
        let model = Arc::new(model);
        let scheduler = Scheduler::new(model.clone(), limits)?;
        let prefix = Arc::new(PrefixCache::new(prefix_cache.unwrap_or_else(default_prefix_cache)));
        Ok(Engine { model, scheduler, prefix })
    }

    /// The prefix cache: its counters, and `clear`.
    pub fn prefix_cache(&self) -> &PrefixCache {
        &self.prefix
    }

    /// Write the prefix cache's pages to `path` ([`generate::prefix_file`](crate::generate::prefix_file)); returns
    /// the pages written.
    pub fn save_prefix_cache(&self, path: &Path) -> Result<usize> {
        crate::generate::prefix_file::save(&self.prefix, &self.model, path)
    }

    /// Add the pages of a file `save_prefix_cache` wrote (by an engine computing the same K/V) to the prefix
    /// cache, within its cap; returns the pages added.
    pub fn load_prefix_cache(&self, path: &Path) -> Result<usize> {
        crate::generate::prefix_file::load(&self.prefix, &self.model, path)
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
        self.scheduler.submit(Generation::with_prefix(self.model.clone(), prompt, req, Some(self.prefix.clone()))?)
    }
}
