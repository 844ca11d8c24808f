//! The net wing: one forward over segments. The forward's contract (`segment`), attention visibility (`mask`),
//! the per-sequence K/V (`kv_cache`), the linear layers' matrices and their products (`linear`: the one owner of
//! how a matrix is held and which kernel multiplies it), the attention backends (`attention`: the one owner of
//! which backend a forward takes), a forward's one upload to the device (`step`), when a forward replays a CUDA graph
//! (`graph`), and the Qwen architecture built from them (`qwen`).

pub mod attention;
pub mod forward;
pub mod gdn;
pub mod graph;
pub mod kv_cache;
pub mod layers;
pub mod linear;
pub mod mask;
pub mod qwen;
pub mod segment;
pub mod step;
