//! Reading a JSON object file (config.json, generation_config.json, tokenizer_config.json, a shard index) and its
//! typed fields, every error naming the file and the field (`Fields`).

use crate::error::{Error, Result};
use serde_json::{Map, Value};
use std::path::Path;

/// The largest JSON object file read (config.json, generation_config.json, tokenizer_config.json, a shard index: real
/// ones are kilobytes; a tokenizer_config.json listing a large vocabulary's added tokens a few megabytes).
pub const MAX_JSON_BYTES: u64 = 64 << 20;
/// The largest chat template accepted (chat_template.jinja, tokenizer_config.json's, a GGUF file's): real ones are
/// a few kilobytes to a few hundred.
pub const MAX_CHAT_TEMPLATE_BYTES: usize = 4 << 20;

/// Read and parse a JSON object file, naming the file in every error. The file must be a regular file (a FIFO
/// would block the load, a device such as /dev/zero never ends) of at most `MAX_JSON_BYTES`.
pub fn read_json(path: &Path) -> Result<Map<String, Value>> {
    let bytes = crate::util::read_model_file(path, MAX_JSON_BYTES, "required by the model directory")?;
    let text = String::from_utf8(bytes)
        .map_err(|_| Error::config(format!("{}: not a JSON file (not UTF-8 text)", path.display())))?;
    let v: Value =
        serde_json::from_str(&text).map_err(|e| Error::config(format!("{}: malformed JSON: {e}", path.display())))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(Error::config(format!(
            "{}: expected a JSON object at the top level, found {}",
            path.display(),
            type_name(&other)
        ))),
    }
}

/// A JSON value as an error message quotes it: at most 120 characters (a file may hold megabytes).
pub fn shown(v: &Value) -> String {
    let s = v.to_string();
    match s.char_indices().nth(120) {
        Some((i, _)) => format!("{}...", &s[..i]),
        None => s,
    }
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "a list",
        Value::Object(_) => "an object",
    }
}

/// Typed access to a JSON object with errors that name the file and the field.
pub struct Fields<'a> {
    pub file: &'a str,
    pub map: &'a Map<String, Value>,
}

impl<'a> Fields<'a> {
    pub fn get(&self, key: &str) -> Option<&'a Value> {
        match self.map.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }
    fn wrong(&self, key: &str, expected: &str, v: &Value) -> Error {
        Error::config(format!("{}: field '{key}' must be {expected}, found {} ({v})", self.file, type_name(v)))
    }
    fn missing(&self, key: &str, expected: &str) -> Error {
        Error::config(format!("{}: field '{key}' is missing (expected {expected})", self.file))
    }
    pub fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_u64().map(|x| Some(x as usize)).ok_or_else(|| self.wrong(key, "a non-negative integer", v)),
        }
    }
    pub fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?.ok_or_else(|| self.missing(key, "a non-negative integer"))
    }
    /// A size that must be at least 1 (a dimension or a count).
    pub fn positive(&self, key: &str) -> Result<usize> {
        let n = self.opt_usize(key)?.ok_or_else(|| self.missing(key, "a positive integer"))?;
        if n == 0 {
            return Err(Error::config(format!("{}: field '{key}' must be at least 1, found 0", self.file)));
        }
        Ok(n)
    }
    /// A token id: a non-negative integer that fits 32 bits (ids are u32 everywhere; a larger one is refused,
    /// never truncated).
    pub fn opt_id(&self, key: &str) -> Result<Option<u32>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => self.id_value(key, v).map(Some),
        }
    }
    fn id_value(&self, key: &str, v: &Value) -> Result<u32> {
        let n = v.as_u64().ok_or_else(|| self.wrong(key, "a token id (a non-negative integer)", v))?;
        u32::try_from(n).map_err(|_| {
            Error::config(format!(
                "{}: field '{key}': token id {n} does not fit 32 bits (ids are below 2^32)",
                self.file
            ))
        })
    }
    /// A positive, finite number (as the f32 the kernels use when `as_f32`).
    pub fn positive_f64(&self, key: &str, default: f64, as_f32: bool) -> Result<f64> {
        let x = self.f64_or(key, default)?;
        let ok = if as_f32 { (x as f32) > 0.0 && (x as f32).is_finite() } else { x > 0.0 && x.is_finite() };
        if !ok {
            let kind = if as_f32 {
                "a positive number representable as a finite, non-zero f32"
            } else {
                "a positive finite number"
            };
            return Err(Error::config(format!(
                "{}: field '{key}' must be {kind}, found {}",
                self.file,
                crate::util::show_f64(x)
            )));
        }
        Ok(x)
    }
    pub fn opt_f64(&self, key: &str) -> Result<Option<f64>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(Some).ok_or_else(|| self.wrong(key, "a number", v)),
        }
    }
    pub fn f64_or(&self, key: &str, default: f64) -> Result<f64> {
        Ok(self.opt_f64(key)?.unwrap_or(default))
    }
    pub fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| self.wrong(key, "true or false", v)),
        }
    }
    pub fn opt_str(&self, key: &str) -> Result<Option<&'a str>> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v.as_str().map(Some).ok_or_else(|| self.wrong(key, "a string", v)),
        }
    }
    /// An id field that may be one integer or a list of integers (eos_token_id). Ids must fit 32 bits.
    pub fn ids(&self, key: &str) -> Result<Vec<u32>> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a.iter().map(|x| self.id_value(key, x)).collect(),
            Some(v) => Ok(vec![self.id_value(key, v)?]),
        }
    }
    pub fn opt_usize_list(&self, key: &str) -> Result<Vec<usize>> {
        match self.get(key) {
            None => Ok(vec![]),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| x.as_u64().map(|i| i as usize).ok_or_else(|| self.wrong(key, "a list of integers", x)))
                .collect(),
            Some(v) => Err(self.wrong(key, "a list of integers", v)),
        }
    }
}
