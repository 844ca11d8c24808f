//! The generate wing: one generation and the batch loop over many. `plan` resolves a request over the model,
//! `window` says what each step forwards and keeps, `prefix` keeps the K/V of prompts and answers across requests
//! (`prefix_file`: saved to a file and loaded back),
//! `output` turns decoded tokens into text and usage (`text`: incremental detokenization and stop strings),
//! `generation` runs the steps, `scheduler` batches the forwards of every active generation, `wake` is the
//! descriptor an event loop watches for their outputs.

pub mod generation;
pub mod output;
pub mod plan;
pub mod prefix;
pub mod prefix_file;
pub mod scheduler;
pub mod text;
#[cfg(unix)]
pub mod wake;
pub mod window;
