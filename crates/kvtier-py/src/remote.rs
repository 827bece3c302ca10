//! `Client` (a server over `unix://` or `tcp://`) and its `SharedBuffer`.

use crate::backend::Backend;
use crate::convert::{parse_size, to_py_err};
use crate::engine::Engine;
use crate::registry::Registered;
use kvtier_client::{Client, ClientOptions, ClientPool};
use kvtier_wire::shm::SharedRegion;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::os::raw::c_int;
use std::sync::{Arc, Mutex};

/// A connection to `kvtier serve`: `Client(url, *, namespace="",
/// auth_token=None, timeout=60.0, shm_size="256MiB")` with
/// `unix:///path/kvtier.sock` (adds a shared-memory buffer registered with
/// the server), `tcp://host:port` or `tls://host:port` (with `tls_ca`, a
/// PEM file, default KVTIER_TLS_CA). The token defaults to
/// KVTIER_AUTH_TOKEN; TCP needs it. Every key lives in `namespace`.
/// `route=True`: in cluster mode, send each key straight to the members
/// that own it (one hop) instead of through this server.
/// `cross_memory=True` (Unix sockets): the server reads and writes the
/// caller's own buffers directly where the kernel lets it (one copy, no
/// socket); `False` keeps values on the socket.
/// `map_pool=True` (Unix sockets, a client of the server's own user
/// without a tenant's token): values in the server's memory are copied
/// here out of a read-only mapping of its pool, leased for the copy.
#[pyclass(extends = Engine, name = "Client", module = "kvtier._native")]
pub(crate) struct Client_ {
    pub(crate) region: Option<Arc<SharedRegion>>,
    pub(crate) next: Mutex<usize>,
}

#[pymethods]
impl Client_ {
    #[new]
    #[pyo3(signature = (url, *, namespace="", auth_token=None, tls_ca=None, timeout=60.0, shm_size=None, connections=kvtier_client::pool::DEFAULT_CONNECTIONS, route=false, cross_memory=true, map_pool=true))]
    #[expect(
        clippy::too_many_arguments,
        reason = "keyword options of the Python constructor"
    )]
    pub(crate) fn new(
        py: Python<'_>,
        url: String,
        namespace: &str,
        auth_token: Option<String>,
        tls_ca: Option<std::path::PathBuf>,
        timeout: f64,
        shm_size: Option<&Bound<'_, PyAny>>,
        connections: usize,
        route: bool,
        cross_memory: bool,
        map_pool: bool,
    ) -> PyResult<PyClassInitializer<Self>> {
        if connections == 0 {
            return Err(PyValueError::new_err("connections must be at least 1"));
        }
        let shm_size = match shm_size {
            Some(s) => parse_size(s)? as usize,
            None => 256 << 20,
        };
        if !timeout.is_finite() || timeout <= 0.0 {
            return Err(PyValueError::new_err(
                "timeout must be a positive number of seconds",
            ));
        }
        let options = ClientOptions {
            auth_token: auth_token.or_else(|| std::env::var("KVTIER_AUTH_TOKEN").ok()),
            namespace: namespace.to_string(),
            tls_ca: tls_ca.or_else(|| std::env::var_os("KVTIER_TLS_CA").map(Into::into)),
            timeout: std::time::Duration::from_secs_f64(timeout),
            shm_size: if url.starts_with("unix://") {
                shm_size
            } else {
                0
            },
            local_only: false,
            route,
            member: None,
            cross_memory,
            map_pool,
        };
        let client = py
            .detach(|| Client::connect_with(&url, options))
            .map_err(to_py_err)?;
        let region = client.registered_region();
        let engine = Engine {
            backend: Arc::new(Backend::new(Arc::new(
                ClientPool::new(client, connections).map_err(to_py_err)?,
            ))),
            registered: Registered::default(),
        };
        Ok(PyClassInitializer::from(engine).add_subclass(Client_ {
            region,
            next: Mutex::new(0),
        }))
    }

    /// A writable buffer of `size` bytes inside the memory registered with
    /// the server (Unix sockets only). Values read into it, or put from it,
    /// move through shared memory: no copies over the socket. The buffer
    /// is also registered for raw-pointer calls.
    pub(crate) fn alloc_buffer(slf: PyRef<'_, Self>, size: usize) -> PyResult<SharedBuffer> {
        let Some(region) = slf.region.clone() else {
            return Err(PyRuntimeError::new_err(
                "alloc_buffer needs a unix:// connection with shm_size > 0",
            ));
        };
        let mut next = slf.next.lock().unwrap();
        let offset = next.div_ceil(4096) * 4096;
        if size == 0 || offset + size > region.len() {
            return Err(PyValueError::new_err(format!(
                "cannot allocate {size} bytes: {} of the {}-byte shared buffer are left (raise shm_size)",
                region.len().saturating_sub(offset),
                region.len()
            )));
        }
        *next = offset + size;
        let ptr = region.as_ptr() as usize + offset;
        slf.as_super().registered.add(ptr, size, None)?;
        Ok(SharedBuffer {
            region,
            offset,
            len: size,
        })
    }
}

/// A view of the client's shared memory; supports the buffer protocol
/// (`memoryview(buf)`, `numpy.frombuffer(buf, ...)`) and keeps the memory
/// mapped while it lives.
#[pyclass(module = "kvtier._native")]
pub(crate) struct SharedBuffer {
    pub(crate) region: Arc<SharedRegion>,
    pub(crate) offset: usize,
    pub(crate) len: usize,
}

#[pymethods]
impl SharedBuffer {
    pub(crate) fn __len__(&self) -> usize {
        self.len
    }

    /// The address of the first byte (for raw-pointer calls).
    #[getter]
    pub(crate) fn ptr(&self) -> usize {
        self.region.as_ptr() as usize + self.offset
    }

    pub(crate) unsafe fn __getbuffer__(
        slf: Bound<'_, Self>,
        view: *mut pyo3::ffi::Py_buffer,
        flags: c_int,
    ) -> PyResult<()> {
        let (ptr, len) = {
            let this = slf.borrow();
            (this.ptr(), this.len)
        };
        // SAFETY: the region stays mapped while this object (held by the
        // view through `obj`) lives; the memory is writable.
        let rc = unsafe {
            pyo3::ffi::PyBuffer_FillInfo(
                view,
                slf.as_ptr(),
                ptr as *mut std::ffi::c_void,
                len as pyo3::ffi::Py_ssize_t,
                0,
                flags,
            )
        };
        if rc != 0 {
            return Err(PyErr::fetch(slf.py()));
        }
        Ok(())
    }

    pub(crate) unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
}
