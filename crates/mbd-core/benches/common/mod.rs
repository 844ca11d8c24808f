//! Helpers shared by the Rust benchmarks (`mod common;` in each: a folder, so Cargo does not take it for a bench).

/// The median of timings (the upper one of an even count).
pub fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[v.len() / 2]
}
