//! `Engine`: the batch API both `Store` and `Client` share.

use crate::backend::Backend;
use crate::calls::{per_key, pick_keys, GetCall, PendingCall, PutCall, SegmentTargets};
use crate::convert::{code_of, get_codes, json_to_py, put_codes, put_options, to_py_err, Key};
use crate::registry::{as_mut_slices, as_slices, overlapping, wait_unused, Registered};
use kvtier_wire::protocol::code;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyList};
use std::sync::Arc;

/// Shared by `Store` and `Client`: every method of the engine-facing API.
#[pyclass(subclass, module = "kvtier._native")]
pub(crate) struct Engine {
    pub(crate) backend: Arc<Backend>,
    pub(crate) registered: Registered,
}

#[pymethods]
impl Engine {
    pub(crate) fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Closes on leaving a `with` block; exceptions propagate.
    pub(crate) fn __exit__(
        &self,
        py: Python<'_>,
        _kind: Py<PyAny>,
        _value: Py<PyAny>,
        _traceback: Py<PyAny>,
    ) -> PyResult<bool> {
        self.close(py)?;
        Ok(false)
    }

    /// Registers memory so raw-pointer batch calls may use it: either
    /// `register_buffer(ptr, size)` (Mooncake's form; the range must lie in
    /// readable and writable mappings of this process), or
    /// `register_buffer(obj)` with a writable, C-contiguous buffer-protocol
    /// object (numpy array, bytearray, memoryview), which is kept alive and
    /// cannot be resized while registered; `obj`'s address is then the
    /// range's start for `unregister_buffer`. Returns 0; a null, empty,
    /// unmapped or overlapping range raises ValueError.
    #[pyo3(signature = (target, size=None))]
    pub(crate) fn register_buffer(
        &self,
        target: &Bound<'_, PyAny>,
        size: Option<usize>,
    ) -> PyResult<i32> {
        match size {
            Some(size) => {
                let ptr: usize = target.extract()?;
                self.registered.add(ptr, size, None)?;
            }
            None => {
                let view = PyUntypedBuffer::get(target).map_err(|_| {
                    PyValueError::new_err(
                        "register_buffer(obj) needs a buffer-protocol object, or use \
                         register_buffer(ptr, size)",
                    )
                })?;
                if !view.is_c_contiguous() || view.readonly() {
                    return Err(PyValueError::new_err(
                        "a registered buffer must be writable and C-contiguous",
                    ));
                }
                let (ptr, size) = (view.buf_ptr() as usize, view.len_bytes());
                self.registered.add(ptr, size, Some(view))?;
            }
        }
        Ok(code::OK)
    }

    /// Forgets the range registered at `ptr`, after waiting for every call
    /// still reading or writing it (the GIL is released meanwhile).
    /// Returns 0, or INVALID_ARGUMENT if no range starts at `ptr`.
    pub(crate) fn unregister_buffer(&self, py: Python<'_>, ptr: usize) -> i32 {
        match self.registered.take(ptr) {
            Some(registration) => {
                py.detach(|| wait_unused(&registration));
                drop(registration);
                code::OK
            }
            None => code::INVALID_ARGUMENT,
        }
    }

    /// Stores each value. With `sizes`, `items` are raw pointers into
    /// registered memory (Mooncake's form); without, they are objects
    /// supporting the buffer protocol. Returns a code per key (0 = stored).
    #[pyo3(signature = (keys, items, sizes=None, *, memory_only=false, skip_existing=false, durable=false))]
    #[expect(
        clippy::too_many_arguments,
        reason = "Mooncake's positional form plus keyword options"
    )]
    pub(crate) fn batch_put_from(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        items: &Bound<'_, PyAny>,
        sizes: Option<Vec<usize>>,
        memory_only: bool,
        skip_existing: bool,
        durable: bool,
    ) -> PyResult<Vec<i32>> {
        let call = PutCall::prepare(
            &self.registered,
            keys,
            items,
            sizes,
            put_options(memory_only, skip_existing, durable),
        )?;
        let backend = &self.backend;
        // `call` drops (releasing its views) after the GIL is back.
        py.detach(|| call.run(backend)).map_err(to_py_err)
    }

    /// Reads each value into its destination. With `sizes`, `items` are raw
    /// pointers into registered memory; without, writable buffers. Returns
    /// per key the bytes read, or a negative code (`NOT_FOUND` for a miss,
    /// `BUFFER_TOO_SMALL`, `INVALID_ARGUMENT` for an unregistered range).
    #[pyo3(signature = (keys, items, sizes=None))]
    pub(crate) fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        items: &Bound<'_, PyAny>,
        sizes: Option<Vec<usize>>,
    ) -> PyResult<Vec<i64>> {
        let call = GetCall::prepare(&self.registered, keys, items, sizes)?;
        let backend = &self.backend;
        // `call` drops (releasing its views) after the GIL is back.
        py.detach(|| call.run(backend)).map_err(to_py_err)
    }

    /// `batch_put_from` in the background: returns at once with a
    /// `PendingCall` whose `wait()` gives the per-key codes. The values must
    /// stay unchanged until then (buffer objects are kept alive, registered
    /// ranges cannot be unregistered meanwhile). `notify_fd`: an eventfd,
    /// open until the call is done, that gets 1 written to it then (no GIL
    /// taken), for event loops that poll one descriptor.
    #[pyo3(signature = (keys, items, sizes=None, *, memory_only=false, skip_existing=false, durable=false, notify_fd=None))]
    #[expect(
        clippy::too_many_arguments,
        reason = "the synchronous form's arguments plus the descriptor to notify"
    )]
    pub(crate) fn batch_put_from_async(
        &self,
        keys: Vec<Key>,
        items: &Bound<'_, PyAny>,
        sizes: Option<Vec<usize>>,
        memory_only: bool,
        skip_existing: bool,
        durable: bool,
        notify_fd: Option<std::os::fd::RawFd>,
    ) -> PyResult<PendingCall> {
        let call = PutCall::prepare(
            &self.registered,
            keys,
            items,
            sizes,
            put_options(memory_only, skip_existing, durable),
        )?;
        let backend = Arc::clone(&self.backend);
        PendingCall::spawn(
            call,
            move |call| {
                let codes = call.run(&backend)?;
                Ok(codes.into_iter().map(i64::from).collect())
            },
            notify_fd,
        )
    }

    /// `batch_get_into` in the background: returns at once with a
    /// `PendingCall` whose `wait()` gives per key the bytes read or a
    /// negative code. Leave the destinations alone until then.
    /// `notify_fd`: as `batch_put_from_async`'s.
    #[pyo3(signature = (keys, items, sizes=None, *, notify_fd=None))]
    pub(crate) fn batch_get_into_async(
        &self,
        keys: Vec<Key>,
        items: &Bound<'_, PyAny>,
        sizes: Option<Vec<usize>>,
        notify_fd: Option<std::os::fd::RawFd>,
    ) -> PyResult<PendingCall> {
        let call = GetCall::prepare(&self.registered, keys, items, sizes)?;
        let backend = Arc::clone(&self.backend);
        PendingCall::spawn(call, move |call| call.run(&backend), notify_fd)
    }

    /// Stores each key's value gathered from several registered ranges, laid
    /// end to end (Mooncake's multi-buffer put: one key for a block's pages
    /// scattered across layers). `ptrs_per_key[i]` and `sizes_per_key[i]`
    /// list key i's segments. A code per key (0 = stored); a key with an
    /// unregistered segment gets `INVALID_ARGUMENT` alone.
    #[pyo3(signature = (keys, ptrs_per_key, sizes_per_key, *, memory_only=false, skip_existing=false, durable=false))]
    #[expect(
        clippy::too_many_arguments,
        reason = "Mooncake's positional form plus keyword options"
    )]
    pub(crate) fn batch_put_from_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        ptrs_per_key: Vec<Vec<usize>>,
        sizes_per_key: Vec<Vec<usize>>,
        memory_only: bool,
        skip_existing: bool,
        durable: bool,
    ) -> PyResult<Vec<i32>> {
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        let options = put_options(memory_only, skip_existing, durable);
        let targets =
            SegmentTargets::resolve(&self.registered, &keys, &ptrs_per_key, &sizes_per_key)?;
        let picked = targets.picked();
        let pick_keys = pick_keys(&keys, &picked);
        // SAFETY: every range is registered and pinned by `targets`.
        let values: Vec<Vec<&[u8]>> = picked
            .iter()
            .map(|&i| unsafe { as_slices(&targets.ranges[i]) })
            .collect();
        let refs: Vec<&[&[u8]]> = values.iter().map(|v| &v[..]).collect();
        let results = py
            .detach(|| self.backend.put_segments(&pick_keys, &refs, &options))
            .map_err(to_py_err)?;
        Ok(per_key(keys.len(), &picked, put_codes(results)))
    }

    /// Reads each key's value scattered across several registered ranges, in
    /// order (the inverse of `batch_put_from_multi_buffers`). Per key: bytes
    /// read, or a negative code (`NOT_FOUND`, `BUFFER_TOO_SMALL` when the
    /// segments hold less than the value, `INVALID_ARGUMENT`).
    pub(crate) fn batch_get_into_multi_buffers(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        ptrs_per_key: Vec<Vec<usize>>,
        sizes_per_key: Vec<Vec<usize>>,
    ) -> PyResult<Vec<i64>> {
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        let targets =
            SegmentTargets::resolve(&self.registered, &keys, &ptrs_per_key, &sizes_per_key)?;
        let picked = targets.picked();
        let all: Vec<(usize, usize)> = picked
            .iter()
            .flat_map(|&i| targets.ranges[i].iter().copied())
            .collect();
        if overlapping(&all) {
            return Err(PyValueError::new_err("destination buffers overlap"));
        }
        let pick_keys = pick_keys(&keys, &picked);
        // SAFETY: registered, pinned, writable, and no two overlap (checked).
        let mut dests: Vec<Vec<&mut [u8]>> = picked
            .iter()
            .map(|&i| unsafe { as_mut_slices(&targets.ranges[i]) })
            .collect();
        let mut refs: Vec<&mut [&mut [u8]]> = dests.iter_mut().map(|d| &mut d[..]).collect();
        let results = py
            .detach(|| self.backend.get_segments(&pick_keys, &mut refs))
            .map_err(to_py_err)?;
        Ok(per_key(keys.len(), &picked, get_codes(results)))
    }

    /// Reads one value into a writable buffer: bytes read or a negative code.
    pub(crate) fn get_into(
        &self,
        py: Python<'_>,
        key: Key,
        buffer: &Bound<'_, PyAny>,
    ) -> PyResult<i64> {
        let list = PyList::new(py, [buffer])?;
        Ok(self.batch_get_into(py, vec![key], list.as_any(), None)?[0])
    }

    /// 1 if present, 0 if not, per key.
    pub(crate) fn batch_is_exist(&self, py: Python<'_>, keys: Vec<Key>) -> PyResult<Vec<i32>> {
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        let present = py
            .detach(|| self.backend.exists(&keys))
            .map_err(to_py_err)?;
        Ok(present.into_iter().map(i32::from).collect())
    }

    pub(crate) fn is_exist(&self, py: Python<'_>, key: Key) -> PyResult<i32> {
        Ok(self.batch_is_exist(py, vec![key])?[0])
    }

    /// How many leading keys are present: the cached prefix.
    pub(crate) fn prefix_len(&self, py: Python<'_>, keys: Vec<Key>) -> PyResult<usize> {
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        py.detach(|| self.backend.prefix_len(&keys))
            .map_err(to_py_err)
    }

    /// Stores one value (write-through). Returns 0 or a negative code.
    pub(crate) fn put(&self, py: Python<'_>, key: Key, value: &Bound<'_, PyAny>) -> PyResult<i32> {
        let list = PyList::new(py, [value])?;
        Ok(self.batch_put_from(py, vec![key], list.as_any(), None, false, false, false)?[0])
    }

    /// The value under `key`, or empty bytes on a miss.
    pub(crate) fn get<'py>(&self, py: Python<'py>, key: Key) -> PyResult<Bound<'py, PyBytes>> {
        let key = key.0;
        let value = py
            .detach(|| self.backend.get_one(&key))
            .map_err(to_py_err)?
            .unwrap_or_default();
        Ok(PyBytes::new(py, &value))
    }

    /// Removes `key` (durable on return). 0 if removed, NOT_FOUND if absent.
    pub(crate) fn remove(&self, py: Python<'_>, key: Key) -> PyResult<i32> {
        match py.detach(|| self.backend.remove(&key.0)) {
            Ok(true) => Ok(code::OK),
            Ok(false) => Ok(code::NOT_FOUND),
            Err(e) => Ok(code_of(&e)),
        }
    }

    /// Returns once everything put so far is durable.
    pub(crate) fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.backend.flush()).map_err(to_py_err)
    }

    /// Flushes and releases the store (or the connection).
    pub(crate) fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.backend.close()).map_err(to_py_err)
    }

    /// Entries, bytes and hits per tier, misses, evictions, ... as a dict.
    pub(crate) fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let value = py.detach(|| self.backend.stats()).map_err(to_py_err)?;
        json_to_py(py, &value)
    }

    /// The namespaces the store (or the server, within this client's
    /// credential) holds: ``{"node": ..., "namespaces": [{"name",
    /// "blocks", "bytes", "memory_only_blocks", "manifest",
    /// "last_used_unix_s"}, ...]}``. A census: it reads every batch
    /// record, about what a reopen costs.
    pub(crate) fn namespaces(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let value = py.detach(|| self.backend.namespaces()).map_err(to_py_err)?;
        json_to_py(py, &value)
    }

    /// Removes every block of this object's namespace (its manifest too),
    /// durable on return, on every member in cluster mode: ``{"blocks",
    /// "bytes", "tombstones"}``.
    pub(crate) fn retire_namespace(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let retired = py
            .detach(|| self.backend.retire_namespace())
            .map_err(to_py_err)?;
        json_to_py(
            py,
            &serde_json::json!({
                "blocks": retired.blocks,
                "bytes": retired.bytes,
                "tombstones": retired.tombstones,
            }),
        )
    }

    /// Stores this namespace's manifest: the readable fields behind its
    /// name (a dict, or its JSON text), at most 16 KiB; a server adds when
    /// it was first and last described.
    pub(crate) fn describe_namespace(
        &self,
        py: Python<'_>,
        manifest: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let text: String = if let Ok(text) = manifest.extract::<String>() {
            text
        } else if let Ok(bytes) = manifest.extract::<Vec<u8>>() {
            String::from_utf8(bytes).map_err(|_| {
                pyo3::exceptions::PyValueError::new_err("a manifest is UTF-8 JSON text")
            })?
        } else {
            py.import("json")?
                .call_method1("dumps", (manifest,))?
                .extract()?
        };
        py.detach(|| self.backend.describe_namespace(text.as_bytes()))
            .map_err(to_py_err)
    }
}
