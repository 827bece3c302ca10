//! The `kvtier._native` extension module: `Store` (embedded) and `Client`
//! (server over `unix://` or `tcp://`) with the batch API inference engines
//! use (Mooncake's `register_buffer`, `batch_put_from`, `batch_get_into`,
//! `batch_is_exist`, ...). The GIL is released around every store or
//! network call. The Python package `kvtier` wraps this module.

use crate::calls::PendingCall;
use crate::embedded::Store_;
use crate::engine::Engine;
use crate::remote::{Client_, SharedBuffer};
mod backend;
mod calls;
mod convert;
mod embedded;
mod engine;
mod registry;
mod remote;

use kvtier_wire::protocol::code;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyBytes;

pyo3::create_exception!(_native, KvtierError, pyo3::exceptions::PyException);

/// Chained 256-bit BLAKE3 keys for each full block of `tokens`
/// (`kvtier::block_keys`).
#[pyfunction]
#[pyo3(signature = (tokens, block_size=256, salt=None))]
fn block_keys_blake3<'py>(
    py: Python<'py>,
    tokens: Vec<u32>,
    block_size: usize,
    salt: Option<Vec<u8>>,
) -> PyResult<Vec<Bound<'py, PyBytes>>> {
    if block_size == 0 {
        return Err(PyValueError::new_err("block_size must be at least 1"));
    }
    let salt = salt.unwrap_or_default();
    Ok(kvtier::block_keys(&tokens, block_size, &salt)
        .iter()
        .map(|k| PyBytes::new(py, &k.0))
        .collect())
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Engine>()?;
    m.add_class::<PendingCall>()?;
    m.add_class::<Store_>()?;
    m.add_class::<Client_>()?;
    m.add_class::<SharedBuffer>()?;
    m.add_function(wrap_pyfunction!(block_keys_blake3, m)?)?;
    m.add("KvtierError", m.py().get_type::<KvtierError>())?;
    for (name, value) in code::ALL {
        m.add(name, value)?;
    }
    Ok(())
}
