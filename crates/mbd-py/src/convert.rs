//! Python values to the core's kinds and back: each parameter's value converted to the `Value` kind its spec names
//! (type conversion only: ranges and names are the core's rules), requests built from dicts, and serde values (the
//! core's `ModelInfo`) as Python objects.

use crate::to_py;
use crate::InvalidRequestError;
use mbd_core::params::request::{self, ParamKind, Params, Value};
use mbd_core::Error;
use pyo3::exceptions::PyOverflowError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyDict, PyList, PyString, PyTuple};

pub(crate) fn invalid(msg: String) -> PyErr {
    InvalidRequestError::new_err(msg)
}

/// A short repr of a value for error messages.
pub(crate) fn show(v: &Bound<'_, PyAny>) -> String {
    let r = v.repr().map(|r| r.to_string()).unwrap_or_else(|_| format!("a {}", type_name(v)));
    if r.chars().count() > 80 {
        format!("{}...", r.chars().take(77).collect::<String>())
    } else {
        r
    }
}

pub(crate) fn type_name(v: &Bound<'_, PyAny>) -> String {
    v.get_type().name().map(|n| n.to_string()).unwrap_or_else(|_| "object".into())
}

pub(crate) fn int(name: &str, v: &Bound<'_, PyAny>) -> PyResult<i64> {
    if v.is_instance_of::<PyBool>() {
        return Err(invalid(format!("{name} must be an integer, got {}", show(v))));
    }
    v.extract::<i64>().map_err(|e| {
        if e.is_instance_of::<PyOverflowError>(v.py()) {
            invalid(format!("{name} must be an integer that fits in 64 bits, got {}", show(v)))
        } else {
            invalid(format!("{name} must be an integer, got {}", show(v)))
        }
    })
}

pub(crate) fn string(name: &str, v: &Bound<'_, PyAny>) -> PyResult<String> {
    let s = v.cast::<PyString>().map_err(|_| invalid(format!("{name} must be a string, got {}", show(v))))?;
    s.to_str().map(|s| s.to_string()).map_err(|_| {
        invalid(format!(
            "{name} must be valid text: it contains characters that are not Unicode scalar values (lone surrogates)"
        ))
    })
}

pub(crate) fn ids(name: &str, v: &Bound<'_, PyAny>) -> PyResult<Vec<i64>> {
    if v.is_instance_of::<PyString>() || v.is_instance_of::<PyBytes>() {
        return Err(invalid(format!("{name} must be a sequence of token ids (ints), got a {}", type_name(v))));
    }
    let items =
        v.try_iter().map_err(|_| invalid(format!("{name} must be a sequence of token ids (ints), got {}", show(v))))?;
    items
        .enumerate()
        .map(|(i, t)| {
            let t = t?;
            if t.is_instance_of::<PyBool>() || t.is_instance_of::<PyString>() {
                return Err(invalid(format!(
                    "{name} must be a sequence of token ids (ints): item {i} is {}",
                    show(&t)
                )));
            }
            t.extract::<i64>().map_err(|_| invalid(format!("{name}: item {i} is not a token id: {}", show(&t))))
        })
        .collect()
}

/// A Python bool or a numpy bool (`numpy.bool_`, which is not a subclass of bool); None for anything else (ints
/// included: 1 is not True here).
fn boolean(v: &Bound<'_, PyAny>) -> PyResult<Option<bool>> {
    if v.is_instance_of::<PyBool>() {
        return Ok(Some(v.extract()?));
    }
    let t = v.get_type();
    let numpy = t.module().is_ok_and(|m| m.to_str().is_ok_and(|m| m == "numpy"));
    if numpy && t.name().is_ok_and(|n| n.to_str().is_ok_and(|n| n == "bool" || n == "bool_")) {
        return Ok(Some(v.is_truthy()?));
    }
    Ok(None)
}

/// Convert a Python value to the kind of `Value` a parameter takes (type conversion only).
pub(crate) fn to_value(name: &str, kind: ParamKind, v: &Bound<'_, PyAny>) -> PyResult<Value> {
    Ok(match kind {
        ParamKind::Int => Value::Int(int(name, v)?),
        ParamKind::Float => {
            if v.is_instance_of::<PyBool>() || v.is_instance_of::<PyString>() {
                return Err(invalid(format!("{name} must be a number, got {}", show(v))));
            }
            Value::Float(
                v.extract::<f64>().map_err(|_| invalid(format!("{name} must be a finite number, got {}", show(v))))?,
            )
        }
        ParamKind::Bool => match boolean(v)? {
            Some(b) => Value::Bool(b),
            None => return Err(invalid(format!("{name} must be True or False, got {}", show(v)))),
        },
        ParamKind::Str | ParamKind::Text | ParamKind::Source => Value::Str(string(name, v)?),
        // a JSON value: its text as given, or a Python value (dict, list, ...) written as JSON
        ParamKind::Json => {
            if v.is_instance_of::<PyString>() {
                Value::Str(string(name, v)?)
            } else {
                let dumps = v.py().import("json")?.getattr("dumps")?;
                let text = dumps.call1((v,)).map_err(|_| {
                    invalid(format!(
                        "{name} must be a JSON value (a dict, a list, ...) or its JSON text, got {}",
                        show(v)
                    ))
                })?;
                Value::Str(string(name, &text)?)
            }
        }
        ParamKind::Strings => {
            if v.is_instance_of::<PyString>() {
                Value::Str(string(name, v)?)
            } else if v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>() {
                let items: PyResult<Vec<String>> = v
                    .try_iter()?
                    .map(|s| {
                        let s = s?;
                        if !s.is_instance_of::<PyString>() {
                            return Err(invalid(format!(
                                "{name} must be a string or a list of strings, got {}",
                                show(v)
                            )));
                        }
                        string(name, &s)
                    })
                    .collect();
                Value::Strings(items?)
            } else {
                return Err(invalid(format!("{name} must be a string or a list of strings, got {}", show(v))));
            }
        }
        ParamKind::Ids => Value::Ids(ids(name, v)?),
        ParamKind::Floats => {
            if !(v.is_instance_of::<PyList>() || v.is_instance_of::<PyTuple>()) {
                return Err(invalid(format!("{name} must be a list of numbers, got {}", show(v))));
            }
            let items: PyResult<Vec<f64>> = v
                .try_iter()?
                .enumerate()
                .map(|(i, x)| {
                    let x = x?;
                    if x.is_instance_of::<PyBool>() || x.is_instance_of::<PyString>() {
                        return Err(invalid(format!("{name}: item {i} is not a number: {}", show(&x))));
                    }
                    x.extract::<f64>().map_err(|_| invalid(format!("{name}: item {i} is not a number: {}", show(&x))))
                })
                .collect();
            Value::Floats(items?)
        }
        ParamKind::BoolOrStr => {
            if let Some(b) = boolean(v)? {
                Value::Bool(b)
            } else if v.is_instance_of::<PyString>() {
                Value::Str(string(name, v)?)
            } else {
                return Err(invalid(format!("{name} must be True, False or a string, got {}", show(v))));
            }
        }
    })
}

pub(crate) fn messages_value(json: &str) -> mbd_core::Result<serde_json::Value> {
    serde_json::from_str(json).map_err(|e| Error::invalid(format!("messages: not valid JSON: {e}")))
}

/// What a chat template renders besides the messages: {"tools": [...]} (`tools_json`: JSON text of a list), or
/// nothing.
pub(crate) fn template_extra(tools_json: Option<&str>) -> mbd_core::Result<serde_json::Value> {
    let Some(t) = tools_json else { return Ok(serde_json::Value::Null) };
    let tools: serde_json::Value =
        serde_json::from_str(t).map_err(|e| Error::invalid(format!("tools: not valid JSON: {e}")))?;
    if !tools.is_array() {
        return Err(Error::invalid("tools must be a list of {\"type\": \"function\", \"function\": {...}}"));
    }
    Ok(serde_json::json!({ "tools": tools }))
}

/// Build a request from a dict of Python values (None = the default).
pub(crate) fn request<R: Params>(params: Option<&Bound<'_, PyDict>>) -> PyResult<R> {
    let mut r = R::default();
    for (k, v) in params.map(|d| d.iter().collect::<Vec<_>>()).unwrap_or_default() {
        let name = string("parameter name", &k)?;
        let spec = R::param(&name).map_err(to_py)?;
        if !v.is_none() {
            r.set(&name, to_value(&name, spec.kind, &v)?).map_err(to_py)?;
        }
    }
    Ok(r)
}

/// name -> {"kind", "help"} for every parameter ([`mbd_core::params::request::PARAMS`]), and a text field's bounds
/// ("max_chars", "max_tokens").
pub(crate) fn params_dict<'py>(py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    for s in request::PARAMS {
        let e = PyDict::new(py);
        e.set_item("kind", s.kind.name())?;
        e.set_item("help", s.help)?;
        if let request::Rule::Text { chars, tokens } = s.rule {
            e.set_item("max_chars", chars)?;
            e.set_item("max_tokens", tokens)?;
        }
        d.set_item(s.name, e)?;
    }
    Ok(d)
}

/// A serde value (the core's `ModelInfo`, serialized) as Python objects: objects as dicts, arrays as lists.
pub(crate) fn json_to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    Ok(match v {
        serde_json::Value::Null => py.None().into_bound(py),
        serde_json::Value::Bool(b) => PyBool::new(py, *b).to_owned().into_any(),
        serde_json::Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        serde_json::Value::String(s) => PyString::new(py, s).into_any(),
        serde_json::Value::Array(a) => {
            PyList::new(py, a.iter().map(|x| json_to_py(py, x)).collect::<PyResult<Vec<_>>>()?)?.into_any()
        }
        serde_json::Value::Object(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(k, json_to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}
