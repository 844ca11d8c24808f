//! The CUDA kernels' signatures in a build without the `cuda` feature: never called (`available` is false), each
//! an error if it were.

use super::*;

fn unavailable<T>() -> Result<T> {
    Err(crate::error::Error::Internal("mbd-rs was built without its CUDA kernels".into()))
}
#[allow(clippy::too_many_arguments)]
pub fn prep(
    _qkv: &Tensor,
    _cos: &Tensor,
    _sin: &Tensor,
    _norms: (Option<&Tensor>, Option<&Tensor>, f32),
    _rows: (usize, usize),
    _heads: (usize, usize),
    _cache: (&Tensor, &Tensor),
    _p: usize,
) -> Result<Tensor> {
    unavailable()
}
pub fn attend(
    _q: &Tensor,
    _cache: (&Tensor, &Tensor),
    _ranges: &Tensor,
    _kv_heads: usize,
    _keys: usize,
    _scale: f32,
) -> Result<Tensor> {
    unavailable()
}
pub fn silu_mul(_gu: &Tensor) -> Result<Tensor> {
    unavailable()
}
pub fn add_rms_norm(_x: &Tensor, _a: &Tensor, _w: &Tensor, _eps: f32) -> Result<(Tensor, Tensor)> {
    unavailable()
}
pub fn row_stats(_logits: &Tensor) -> Result<Tensor> {
    unavailable()
}
pub fn device_address(_t: &Tensor) -> Result<u64> {
    unavailable()
}
pub fn prep_segments(
    _qkv: &Tensor,
    _tables: (&Tensor, &Tensor),
    _rope: (&Tensor, &Tensor),
    _norms: (Option<&Tensor>, Option<&Tensor>, f32),
    _heads: (usize, usize),
    _n_segs: usize,
) -> Result<Tensor> {
    unavailable()
}
pub fn attend_segments(
    _q: &Tensor,
    _tables: (&Tensor, &Tensor),
    _n_segs: usize,
    _kv_heads: usize,
    _most: usize,
    _scale: f32,
    _dtype: DType,
) -> Result<Tensor> {
    unavailable()
}
pub fn gdn_rows(
    _p: &Tensor,
    _tail: &Tensor,
    _conv: (&Tensor, &Tensor, &Tensor),
    _heads: (usize, usize, usize, usize),
) -> Result<Tensor> {
    unavailable()
}
pub fn gdn_scan(
    _state: &Tensor,
    _rows: &Tensor,
    _out: Option<GdnOut<'_>>,
    _n: usize,
    _keys: (usize, bool),
) -> Result<Tensor> {
    unavailable()
}
/// No graph exists without the `cuda` feature.
pub enum Graph {}
impl Graph {
    pub fn launch(&self) -> Result<()> {
        match *self {}
    }
}
pub fn capture(_dev: &Device, _body: impl FnOnce() -> Result<()>) -> Result<Graph> {
    unavailable()
}
pub fn with_upload_cache<T>(_dev: &Device, _body: impl FnOnce() -> Result<T>) -> Result<T> {
    unavailable()
}
