//! Conversions between Python values and kvtier's: keys, sizes, errors
//! and their codes, JSON, put options.

use crate::KvtierError;
use kvtier::{PutOptions, PutTier};
use kvtier_wire::protocol::code;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

/// A key from Python: `bytes` as is, `str` as UTF-8.
pub(crate) struct Key(pub(crate) Vec<u8>);

impl<'py> FromPyObject<'_, 'py> for Key {
    type Error = PyErr;

    fn extract(obj: Borrowed<'_, 'py, PyAny>) -> PyResult<Self> {
        if let Ok(s) = obj.extract::<String>() {
            return Ok(Key(s.into_bytes()));
        }
        if let Ok(b) = obj.extract::<Vec<u8>>() {
            return Ok(Key(b));
        }
        Err(PyValueError::new_err("keys must be str or bytes"))
    }
}

pub(crate) fn code_of(e: &kvtier::Error) -> i32 {
    code::of(e.kind())
}

pub(crate) fn to_py_err(e: kvtier::Error) -> PyErr {
    KvtierError::new_err(e.to_string())
}

pub(crate) fn parse_size(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(n) = value.extract::<u64>() {
        return Ok(n);
    }
    let text: String = value.extract()?;
    kvtier::parse_size(&text).map_err(PyValueError::new_err)
}

pub(crate) fn get_codes(results: Vec<kvtier::Result<Option<usize>>>) -> Vec<i64> {
    results
        .into_iter()
        .map(|r| match r {
            Ok(Some(n)) => n as i64,
            Ok(None) => i64::from(code::NOT_FOUND),
            Err(e) => i64::from(code_of(&e)),
        })
        .collect()
}

pub(crate) fn put_codes(results: Vec<kvtier::Result<()>>) -> Vec<i32> {
    results
        .into_iter()
        .map(|r| r.map_or_else(|e| code_of(&e), |()| code::OK))
        .collect()
}

pub(crate) fn check_lengths(keys: usize, other: usize, what: &str) -> PyResult<()> {
    if keys != other {
        return Err(PyValueError::new_err(format!(
            "{keys} keys but {other} {what}: one per key is required"
        )));
    }
    Ok(())
}

pub(crate) fn json_to_py(py: Python<'_>, value: &serde_json::Value) -> PyResult<Py<PyAny>> {
    Ok(match value {
        serde_json::Value::Null => py.None(),
        serde_json::Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any().unbind(),
        serde_json::Value::Number(n) => match n.as_u64() {
            Some(u) => u.into_pyobject(py)?.into_any().unbind(),
            None => n
                .as_f64()
                .unwrap_or(0.0)
                .into_pyobject(py)?
                .into_any()
                .unbind(),
        },
        serde_json::Value::String(s) => s.into_pyobject(py)?.into_any().unbind(),
        serde_json::Value::Array(items) => {
            let list = PyList::empty(py);
            for item in items {
                list.append(json_to_py(py, item)?)?;
            }
            list.into_any().unbind()
        }
        serde_json::Value::Object(map) => {
            let dict = PyDict::new(py);
            for (k, v) in map {
                dict.set_item(k, json_to_py(py, v)?)?;
            }
            dict.into_any().unbind()
        }
    })
}

pub(crate) fn put_options(memory_only: bool, skip_existing: bool, durable: bool) -> PutOptions {
    PutOptions {
        skip_existing,
        tier: if memory_only {
            PutTier::MemoryOnly
        } else {
            PutTier::MemoryAndDisk
        },
        durable,
    }
}

/// Per-key codes, or the error's kind and text.
pub(crate) type CallOutcome = Result<Vec<i64>, (kvtier::ErrorKind, String)>;
