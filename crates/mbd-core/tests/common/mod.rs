//! Helpers shared by the hostile-input tests and the fuzz harness: temporary model directories copied from the
//! fixtures, JSON edits, and a minimal safetensors reader/writer (header + data section).
#![allow(dead_code)]

pub mod fuzz;
pub mod gguf;

use mbd_core::error::catch_panic;
use mbd_core::{LoadOptions, Model};
use serde_json::{json, Map, Value};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};

pub fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

pub fn parity(name: &str) -> PathBuf {
    repo_root().join("tests/fixtures/parity").join(name)
}

pub fn tiny() -> PathBuf {
    repo_root().join("python/mbd_rs/models/mbd-tiny")
}

/// A directory under the system temp dir, removed when dropped.
pub struct TmpDir(pub PathBuf);

impl TmpDir {
    pub fn new(tag: &str) -> TmpDir {
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "mbd-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TmpDir(p)
    }
    pub fn path(&self) -> &Path {
        &self.0
    }
}

impl Drop for TmpDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Copy the regular files of `src` (not recursive) into a fresh temp dir; returns it and the model dir in it.
pub fn model_copy(src: &Path) -> (TmpDir, PathBuf) {
    let t = TmpDir::new("model");
    let d = t.path().join("model");
    std::fs::create_dir_all(&d).unwrap();
    for e in std::fs::read_dir(src).unwrap() {
        let e = e.unwrap();
        if e.file_type().unwrap().is_file() {
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
    }
    (t, d)
}

pub fn read_json(p: &Path) -> Value {
    serde_json::from_slice(&std::fs::read(p).unwrap()).unwrap()
}

pub fn write_json(p: &Path, v: &Value) {
    std::fs::write(p, serde_json::to_vec_pretty(v).unwrap()).unwrap();
}

pub fn edit_json(p: &Path, f: impl FnOnce(&mut Map<String, Value>)) {
    let mut v = read_json(p);
    f(v.as_object_mut().unwrap());
    write_json(p, &v);
}

/// A safetensors file split into its header (as JSON) and data section.
pub fn read_st(p: &Path) -> (Map<String, Value>, Vec<u8>) {
    let b = std::fs::read(p).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    (h.as_object().unwrap().clone(), b[8 + n..].to_vec())
}

pub fn st_bytes(header: &Map<String, Value>, data: &[u8]) -> Vec<u8> {
    let h = serde_json::to_vec(header).unwrap();
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(data);
    out
}

pub fn write_st(p: &Path, header: &Map<String, Value>, data: &[u8]) {
    std::fs::write(p, st_bytes(header, data)).unwrap();
}

/// Load a model directory on the CPU in f32 with no overrides; a panic becomes `Error::Internal`.
pub fn load(dir: &Path) -> mbd_core::Result<Model> {
    catch_panic(|| Model::load(dir, &LoadOptions::default()))
}

/// Load and return the error's kind and message (panics if the load succeeded).
pub fn load_err(dir: &Path) -> (String, String) {
    match load(dir) {
        Ok(_) => panic!("{} loaded, expected an error", dir.display()),
        Err(e) => (kind(&e).to_string(), e.to_string()),
    }
}

pub fn kind(e: &mbd_core::Error) -> &'static str {
    use mbd_core::Error::*;
    match e {
        FileNotFound { .. } => "FileNotFound",
        ModelLoad(_) => "ModelLoad",
        Config(_) => "Config",
        Unsupported(_) => "Unsupported",
        InvalidRequest(_) => "InvalidRequest",
        UnknownParameter(_) => "UnknownParameter",
        ContextLength(_) => "ContextLength",
        Cancelled(_) => "Cancelled",
        Backend(_) => "Backend",
        Internal(_) => "Internal",
    }
}

/// Split a directory's model.safetensors into two shards (layer 1 and the rest) plus an index; returns the
/// weight map.
pub fn shard_into_two(d: &Path) -> Map<String, Value> {
    // Split model.safetensors into two shards plus an index.
    let (h, data) = read_st(&d.join("model.safetensors"));
    std::fs::remove_file(d.join("model.safetensors")).unwrap();
    let mut parts = [Map::new(), Map::new()];
    let mut bufs = [Vec::new(), Vec::new()];
    let mut wm = Map::new();
    for (k, v) in &h {
        if k == "__metadata__" {
            continue;
        }
        let i = if k.contains("layers.1.") { 1 } else { 0 };
        let (s, e) = (v["data_offsets"][0].as_u64().unwrap() as usize, v["data_offsets"][1].as_u64().unwrap() as usize);
        let mut v = v.clone();
        v["data_offsets"] = json!([bufs[i].len(), bufs[i].len() + e - s]);
        bufs[i].extend_from_slice(&data[s..e]);
        parts[i].insert(k.clone(), v);
        wm.insert(k.clone(), json!(format!("model-0000{}-of-00002.safetensors", i + 1)));
    }
    for i in 0..2 {
        write_st(&d.join(format!("model-0000{}-of-00002.safetensors", i + 1)), &parts[i], &bufs[i]);
    }
    write_json(&d.join("model.safetensors.index.json"), &json!({"metadata": {}, "weight_map": wm}));
    wm
}
