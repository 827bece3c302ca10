//! The `kvtier._native` extension module: `Store` (embedded) and `Client`
//! (server over `unix://` or `tcp://`) with the batch API inference engines
//! use (Mooncake's `register_buffer`, `batch_put_from`, `batch_get_into`,
//! `batch_is_exist`, ...). The GIL is released around every store or
//! network call. The Python package `kvtier` wraps this module.

use kvtier::{Config, EvictionPolicy, IoEngineKind, PutOptions, PutTier, Store};
use kvtier_client::{Client, ClientOptions, ClientPool};
use kvtier_wire::protocol::code;
use kvtier_wire::shm::SharedRegion;
use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict, PyList};
use std::os::raw::c_int;
use std::sync::{Arc, Mutex};

pyo3::create_exception!(_native, KvtierError, pyo3::exceptions::PyException);

/// A key from Python: `bytes` as is, `str` as UTF-8.
struct Key(Vec<u8>);

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

fn code_of(e: &kvtier::Error) -> i32 {
    code::of(e.kind())
}

fn to_py_err(e: kvtier::Error) -> PyErr {
    KvtierError::new_err(e.to_string())
}

fn parse_size(value: &Bound<'_, PyAny>) -> PyResult<u64> {
    if let Ok(n) = value.extract::<u64>() {
        return Ok(n);
    }
    let text: String = value.extract()?;
    kvtier::parse_size(&text).map_err(PyValueError::new_err)
}

/// One range registered with `register_buffer`. Calls that use it hold an
/// `Arc` on it for their whole duration, so `unregister_buffer` can wait
/// until no call writes into it any more.
struct Registration {
    ptr: usize,
    size: usize,
    /// The object whose memory this is, when Python passed one: kept (with
    /// its buffer view, so it cannot be resized) while registered.
    _owner: Option<PyUntypedBuffer>,
}

/// Memory ranges the caller registered: raw pointers are only dereferenced
/// inside them.
#[derive(Default)]
struct Registered(Mutex<Vec<Arc<Registration>>>);

impl Registered {
    fn add(&self, ptr: usize, size: usize, owner: Option<PyUntypedBuffer>) -> PyResult<()> {
        if ptr == 0 || size == 0 || ptr.checked_add(size).is_none() {
            return Err(PyValueError::new_err(
                "register_buffer needs a non-null address and a size above 0",
            ));
        }
        if owner.is_none() {
            mapped_writable(ptr, size)?;
        }
        let mut ranges = self.0.lock().unwrap();
        if ranges
            .iter()
            .any(|r| ptr < r.ptr + r.size && r.ptr < ptr + size)
        {
            return Err(PyValueError::new_err(format!(
                "[{ptr:#x}, {:#x}) overlaps a registered range",
                ptr + size
            )));
        }
        ranges.push(Arc::new(Registration {
            ptr,
            size,
            _owner: owner,
        }));
        Ok(())
    }

    /// Takes the range out of the registry; the caller waits for calls
    /// still using it (see `wait_unused`).
    fn take(&self, ptr: usize) -> Option<Arc<Registration>> {
        let mut ranges = self.0.lock().unwrap();
        let i = ranges.iter().position(|r| r.ptr == ptr)?;
        Some(ranges.swap_remove(i))
    }

    /// The registration holding `[ptr, ptr + size)`, pinned for a call.
    fn pin(&self, ptr: usize, size: usize) -> Option<Arc<Registration>> {
        let end = ptr.checked_add(size)?;
        self.0
            .lock()
            .unwrap()
            .iter()
            .find(|r| ptr >= r.ptr && end <= r.ptr + r.size)
            .cloned()
    }
}

/// Blocks until no call holds `registration` any more (the GIL must be
/// released: those calls may be waiting for it to finish).
fn wait_unused(registration: &Arc<Registration>) {
    while Arc::strong_count(registration) > 1 {
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// Checks that `[ptr, ptr + size)` lies wholly in readable and writable
/// mappings of this process, so a typo'd or freed address is refused at
/// registration instead of crashing the first call.
fn mapped_writable(ptr: usize, size: usize) -> PyResult<()> {
    let maps = std::fs::read_to_string("/proc/self/maps")
        .map_err(|e| PyValueError::new_err(format!("reading /proc/self/maps: {e}")))?;
    let mut covered = ptr;
    let end = ptr + size;
    let mut spans: Vec<(usize, usize, bool)> = maps
        .lines()
        .filter_map(|line| {
            let mut fields = line.split_whitespace();
            let (lo, hi) = fields.next()?.split_once('-')?;
            let perms = fields.next()?;
            let lo = usize::from_str_radix(lo, 16).ok()?;
            let hi = usize::from_str_radix(hi, 16).ok()?;
            Some((lo, hi, perms.starts_with("rw")))
        })
        .collect();
    spans.sort_unstable();
    for (lo, hi, writable) in spans {
        if hi <= covered || lo > covered {
            continue;
        }
        if !writable {
            break;
        }
        covered = hi;
        if covered >= end {
            return Ok(());
        }
    }
    Err(PyValueError::new_err(format!(
        "[{ptr:#x}, {end:#x}) is not wholly mapped readable and writable in this process \
         (first gap at {covered:#x}): register memory you own, for example a numpy array or \
         a tensor's data_ptr() range"
    )))
}

/// A raw `(address, length)` range and the registration it lies in.
type PinnedRange = ((usize, usize), Arc<Registration>);

/// Raw destinations or sources for a batch, each pinned in the registry
/// for the call; `None` where a range is not registered.
fn raw_slices(
    registered: &Registered,
    ptrs: &[usize],
    sizes: &[usize],
) -> Vec<Option<PinnedRange>> {
    ptrs.iter()
        .zip(sizes)
        .map(|(&p, &s)| {
            if s == 0 {
                return None;
            }
            registered.pin(p, s).map(|r| ((p, s), r))
        })
        .collect()
}

/// Python buffers for a batch, kept alive (and their views) for the call.
struct Buffers {
    views: Vec<PyUntypedBuffer>,
}

impl Buffers {
    fn get(items: &Bound<'_, PyAny>, writable: bool) -> PyResult<Buffers> {
        let mut views = Vec::new();
        for item in items.try_iter()? {
            let item = item?;
            let view = PyUntypedBuffer::get(&item)
                .map_err(|_| PyValueError::new_err("buffers must support the buffer protocol (bytes, bytearray, memoryview, numpy arrays)"))?;
            if !view.is_c_contiguous() {
                return Err(PyValueError::new_err("buffers must be C-contiguous"));
            }
            if writable && view.readonly() {
                return Err(PyValueError::new_err(
                    "buffers to read into must be writable (bytes objects are read-only)",
                ));
            }
            views.push(view);
        }
        Ok(Buffers { views })
    }

    fn ranges(&self) -> Vec<(usize, usize)> {
        self.views
            .iter()
            .map(|v| (v.buf_ptr() as usize, v.len_bytes()))
            .collect()
    }
}

/// # Safety
/// Each range must be valid, writable memory for the whole call, and no
/// two ranges may overlap.
unsafe fn as_mut_slices<'a>(ranges: &[(usize, usize)]) -> Vec<&'a mut [u8]> {
    ranges
        .iter()
        // SAFETY: the caller's contract.
        .map(|&(p, s)| unsafe { std::slice::from_raw_parts_mut(p as *mut u8, s) })
        .collect()
}

/// # Safety
/// Each range must be valid memory for the whole call.
unsafe fn as_slices<'a>(ranges: &[(usize, usize)]) -> Vec<&'a [u8]> {
    ranges
        .iter()
        // SAFETY: the caller's contract.
        .map(|&(p, s)| unsafe { std::slice::from_raw_parts(p as *const u8, s) })
        .collect()
}

fn overlapping(ranges: &[(usize, usize)]) -> bool {
    let mut sorted: Vec<(usize, usize)> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
    sorted.sort_unstable();
    sorted.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0)
}

fn get_codes(results: Vec<kvtier::Result<Option<usize>>>) -> Vec<i64> {
    results
        .into_iter()
        .map(|r| match r {
            Ok(Some(n)) => n as i64,
            Ok(None) => i64::from(code::NOT_FOUND),
            Err(e) => i64::from(code_of(&e)),
        })
        .collect()
}

fn put_codes(results: Vec<kvtier::Result<()>>) -> Vec<i32> {
    results
        .into_iter()
        .map(|r| r.map_or_else(|e| code_of(&e), |()| code::OK))
        .collect()
}

fn check_lengths(keys: usize, other: usize, what: &str) -> PyResult<()> {
    if keys != other {
        return Err(PyValueError::new_err(format!(
            "{keys} keys but {other} {what}: one per key is required"
        )));
    }
    Ok(())
}

/// Where a batch's values come from or go to: raw pointers checked
/// against the registered ranges, or buffer-protocol objects.
struct Targets {
    /// `(address, length)` per key; meaningful where `usable`.
    ranges: Vec<(usize, usize)>,
    /// Per key: the key is valid and its range usable.
    usable: Vec<bool>,
    /// Keeps buffer views (and their memory) alive for the call.
    _buffers: Option<Buffers>,
    /// Keeps registered ranges from being unregistered during the call.
    _pins: Vec<Arc<Registration>>,
}

impl Targets {
    fn resolve(
        registered: &Registered,
        keys: &[Vec<u8>],
        items: &Bound<'_, PyAny>,
        sizes: Option<Vec<usize>>,
        writable: bool,
    ) -> PyResult<Targets> {
        let mut pins = Vec::new();
        let (ranges, buffers, mut usable) = match sizes {
            Some(sizes) => {
                let ptrs: Vec<usize> = items.extract()?;
                check_lengths(keys.len(), ptrs.len(), "pointers")?;
                check_lengths(keys.len(), sizes.len(), "sizes")?;
                let raw = raw_slices(registered, &ptrs, &sizes);
                let usable = raw.iter().map(Option::is_some).collect();
                let ranges = raw
                    .into_iter()
                    .map(|r| match r {
                        Some((range, pin)) => {
                            pins.push(pin);
                            range
                        }
                        None => (0, 0),
                    })
                    .collect();
                (ranges, None, usable)
            }
            None => {
                let buffers = Buffers::get(items, writable)?;
                check_lengths(keys.len(), buffers.views.len(), "buffers")?;
                let ranges = buffers.ranges();
                let n = ranges.len();
                (ranges, Some(buffers), vec![true; n])
            }
        };
        // Invalid keys and unregistered ranges fail alone, per key.
        for (ok, key) in usable.iter_mut().zip(keys) {
            *ok &= kvtier::validate_key(key).is_ok();
        }
        Ok(Targets {
            ranges,
            usable,
            _buffers: buffers,
            _pins: pins,
        })
    }

    /// Indices of the usable keys.
    fn picked(&self) -> Vec<usize> {
        usable_indices(&self.usable)
    }
}

fn usable_indices(usable: &[bool]) -> Vec<usize> {
    (0..usable.len()).filter(|&i| usable[i]).collect()
}

/// The keys at `picked`, for the backend call.
fn pick_keys(keys: &[Vec<u8>], picked: &[usize]) -> Vec<Vec<u8>> {
    picked.iter().map(|&i| keys[i].clone()).collect()
}

/// A result per key: the backend's for the picked keys, in order, and
/// `INVALID_ARGUMENT` for the keys that were not sent.
fn per_key<T: Copy + From<i32>>(n: usize, picked: &[usize], results: Vec<T>) -> Vec<T> {
    let mut out = vec![T::from(code::INVALID_ARGUMENT); n];
    for (&i, c) in picked.iter().zip(results) {
        out[i] = c;
    }
    out
}

/// A `batch_put_from` resolved against its values, to run with the GIL
/// released, here or on a background thread. Holds the buffer views and
/// registration pins that keep the values valid until it is dropped.
struct PutCall {
    keys: Vec<Vec<u8>>,
    options: PutOptions,
    targets: Targets,
}

impl PutCall {
    fn prepare(
        registered: &Registered,
        keys: Vec<Key>,
        items: &Bound<'_, PyAny>,
        sizes: Option<Vec<usize>>,
        options: PutOptions,
    ) -> PyResult<PutCall> {
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        let targets = Targets::resolve(registered, &keys, items, sizes, false)?;
        Ok(PutCall {
            keys,
            options,
            targets,
        })
    }

    /// A code per key (0 = stored).
    fn run(self, backend: &Backend) -> kvtier::Result<Vec<i32>> {
        let picked = self.targets.picked();
        let pick_keys = pick_keys(&self.keys, &picked);
        let pick_ranges: Vec<(usize, usize)> =
            picked.iter().map(|&i| self.targets.ranges[i]).collect();
        // SAFETY: registered ranges pinned, or buffer views held, by
        // `self.targets` until `self` drops on return.
        let values = unsafe { as_slices(&pick_ranges) };
        let results = backend.put(&pick_keys, &values, &self.options)?;
        Ok(per_key(self.keys.len(), &picked, put_codes(results)))
    }
}

/// A `batch_get_into` resolved against its destinations (checked not to
/// overlap), to run with the GIL released, here or on a background thread.
struct GetCall {
    keys: Vec<Vec<u8>>,
    picked: Vec<usize>,
    pick_ranges: Vec<(usize, usize)>,
    /// Keeps the destinations valid until the call is dropped.
    _targets: Targets,
}

impl GetCall {
    fn prepare(
        registered: &Registered,
        keys: Vec<Key>,
        items: &Bound<'_, PyAny>,
        sizes: Option<Vec<usize>>,
    ) -> PyResult<GetCall> {
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        let targets = Targets::resolve(registered, &keys, items, sizes, true)?;
        let picked = targets.picked();
        let pick_ranges: Vec<(usize, usize)> = picked.iter().map(|&i| targets.ranges[i]).collect();
        if overlapping(&pick_ranges) {
            return Err(PyValueError::new_err("destination buffers overlap"));
        }
        Ok(GetCall {
            keys,
            picked,
            pick_ranges,
            _targets: targets,
        })
    }

    /// Per key the bytes read, or a negative code.
    fn run(self, backend: &Backend) -> kvtier::Result<Vec<i64>> {
        let pick_keys = pick_keys(&self.keys, &self.picked);
        // SAFETY: registered or live, writable, non-overlapping (checked in
        // `prepare`), held by `_targets` until `self` drops on return.
        let mut bufs = unsafe { as_mut_slices(&self.pick_ranges) };
        let results = backend.get(&pick_keys, &mut bufs)?;
        Ok(per_key(self.keys.len(), &self.picked, get_codes(results)))
    }
}

/// The registered segments of a multi-buffer batch, pinned for the call.
struct SegmentTargets {
    /// Per key, `(address, length)` per segment; meaningful where `usable`.
    ranges: Vec<Vec<(usize, usize)>>,
    usable: Vec<bool>,
    _pins: Vec<Arc<Registration>>,
}

impl SegmentTargets {
    fn resolve(
        registered: &Registered,
        keys: &[Vec<u8>],
        ptrs: &[Vec<usize>],
        sizes: &[Vec<usize>],
    ) -> PyResult<SegmentTargets> {
        check_lengths(keys.len(), ptrs.len(), "pointer lists")?;
        check_lengths(keys.len(), sizes.len(), "size lists")?;
        let mut pins = Vec::new();
        let mut ranges = Vec::with_capacity(keys.len());
        let mut usable = Vec::with_capacity(keys.len());
        for ((key, p), s) in keys.iter().zip(ptrs).zip(sizes) {
            if p.len() != s.len() {
                return Err(PyValueError::new_err(format!(
                    "{} pointers but {} sizes for one key: one size per pointer is required",
                    p.len(),
                    s.len()
                )));
            }
            let raw = raw_slices(registered, p, s);
            let ok = !raw.is_empty()
                && raw.iter().all(Option::is_some)
                && kvtier::validate_key(key).is_ok();
            let mut key_ranges = Vec::with_capacity(raw.len());
            for (range, pin) in raw.into_iter().flatten() {
                key_ranges.push(range);
                pins.push(pin);
            }
            ranges.push(key_ranges);
            usable.push(ok);
        }
        Ok(SegmentTargets {
            ranges,
            usable,
            _pins: pins,
        })
    }

    fn picked(&self) -> Vec<usize> {
        usable_indices(&self.usable)
    }
}

/// The backend a Python object drives: an embedded store or a client.
enum Backend {
    Store(Arc<Store>),
    Client(Box<ClientPool>),
}

impl Backend {
    fn put(
        &self,
        keys: &[Vec<u8>],
        values: &[&[u8]],
        options: &PutOptions,
    ) -> kvtier::Result<Vec<kvtier::Result<()>>> {
        match self {
            Backend::Store(store) => Ok(store.batch_put_with(keys, values, options)),
            Backend::Client(client) => with_client(client, |c| {
                // Values inside the registered shared region are read by
                // the server in place, as gets are written there.
                if let Some(segments) = shm_segments(c, values.iter().map(|v| std::iter::once(*v)))
                {
                    let ranges: Vec<(u64, u64)> = segments.into_iter().map(|s| s[0]).collect();
                    return c.batch_put_registered(keys, &ranges, options);
                }
                c.batch_put_with(keys, values, options)
            }),
        }
    }

    fn get(
        &self,
        keys: &[Vec<u8>],
        bufs: &mut [&mut [u8]],
    ) -> kvtier::Result<Vec<kvtier::Result<Option<usize>>>> {
        match self {
            Backend::Store(store) => Ok(store.batch_get_into(keys, bufs)),
            Backend::Client(client) => with_client(client, |c| {
                // Destinations inside the registered shared region go
                // through it (the server writes there directly).
                let in_shm = shm_segments(c, bufs.iter().map(|b| std::iter::once(&b[..])));
                if let Some(segments) = in_shm {
                    let ranges: Vec<(u64, u64)> = segments.into_iter().map(|s| s[0]).collect();
                    return c.batch_get_registered(keys, &ranges);
                }
                c.batch_get_into(keys, bufs)
            }),
        }
    }

    fn put_segments(
        &self,
        keys: &[Vec<u8>],
        values: &[&[&[u8]]],
        options: &PutOptions,
    ) -> kvtier::Result<Vec<kvtier::Result<()>>> {
        match self {
            Backend::Store(store) => Ok(store.batch_put_segments(keys, values, options)),
            Backend::Client(client) => with_client(client, |c| {
                // Segments inside the registered shared region are read by
                // the server in place; others travel in the frame.
                if let Some(segments) = shm_segments(c, values.iter().map(|v| v.iter().copied())) {
                    return c.batch_put_registered_segments(keys, &segments, options);
                }
                c.batch_put_segments(keys, values, options)
            }),
        }
    }

    fn get_segments(
        &self,
        keys: &[Vec<u8>],
        bufs: &mut [&mut [&mut [u8]]],
    ) -> kvtier::Result<Vec<kvtier::Result<Option<usize>>>> {
        match self {
            Backend::Store(store) => Ok(store.batch_get_segments(keys, bufs)),
            Backend::Client(client) => with_client(client, |c| {
                let in_shm = shm_segments(c, bufs.iter().map(|b| b.iter().map(|s| &s[..])));
                if let Some(segments) = in_shm {
                    return c.batch_get_registered_segments(keys, &segments);
                }
                c.batch_get_segments(keys, bufs)
            }),
        }
    }

    fn exists(&self, keys: &[Vec<u8>]) -> kvtier::Result<Vec<bool>> {
        match self {
            Backend::Store(store) => Ok(store.batch_exists(keys)),
            Backend::Client(client) => with_client(client, |c| c.batch_exists(keys)),
        }
    }

    fn prefix_len(&self, keys: &[Vec<u8>]) -> kvtier::Result<usize> {
        match self {
            Backend::Store(store) => Ok(store.prefix_len(keys)),
            Backend::Client(client) => with_client(client, |c| c.prefix_len(keys)),
        }
    }

    fn remove(&self, key: &[u8]) -> kvtier::Result<bool> {
        match self {
            Backend::Store(store) => store.remove(key),
            Backend::Client(client) => with_client(client, |c| c.remove(key)),
        }
    }

    fn flush(&self) -> kvtier::Result<()> {
        match self {
            Backend::Store(store) => store.flush(),
            Backend::Client(client) => with_client(client, |c| c.flush()),
        }
    }

    /// One whole value, or `None` for a miss.
    fn get_one(&self, key: &[u8]) -> kvtier::Result<Option<Vec<u8>>> {
        match self {
            Backend::Store(store) => store.get(key),
            Backend::Client(client) => with_client(client, |c| c.get(key)),
        }
    }

    fn close(&self) -> kvtier::Result<()> {
        match self {
            Backend::Store(store) => store.close(),
            Backend::Client(pool) => {
                pool.close();
                Ok(())
            }
        }
    }

    fn stats(&self) -> kvtier::Result<serde_json::Value> {
        match self {
            Backend::Store(store) => Ok(kvtier_wire::stats::stats_json(&store.stats())),
            Backend::Client(client) => with_client(client, |c| c.stats()),
        }
    }
}

/// Every value's segments as `(offset, len)` in the client's registered
/// shared region, or `None` if any segment lies outside it.
fn shm_segments<'a, V, S>(client: &Client, values: V) -> Option<Vec<Vec<(u64, u64)>>>
where
    V: Iterator<Item = S>,
    S: Iterator<Item = &'a [u8]>,
{
    let region = client.registered_region()?;
    let base = region.as_ptr() as usize;
    let end = base + region.len();
    values
        .map(|segments| {
            segments
                .map(|s| {
                    let p = s.as_ptr() as usize;
                    (p >= base && p + s.len() <= end).then(|| ((p - base) as u64, s.len() as u64))
                })
                .collect()
        })
        .collect()
}

fn with_client<T>(
    pool: &ClientPool,
    f: impl FnOnce(&mut Client) -> kvtier::Result<T>,
) -> kvtier::Result<T> {
    pool.with(f)
}

fn json_to_py(py: Python<'_>, value: &serde_json::Value) -> PyResult<Py<PyAny>> {
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

fn put_options(memory_only: bool, skip_existing: bool, durable: bool) -> PutOptions {
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
type CallOutcome = Result<Vec<i64>, (kvtier::ErrorKind, String)>;

/// A batch call running in the background (`batch_get_into_async`,
/// `batch_put_from_async`).
#[pyclass(module = "kvtier._native")]
struct PendingCall {
    call: Mutex<Option<std::thread::JoinHandle<kvtier::Result<Vec<i64>>>>>,
    /// The outcome once waited for: the codes, or the error's kind and text.
    outcome: Mutex<Option<CallOutcome>>,
    finished: Arc<std::sync::atomic::AtomicBool>,
}

impl PendingCall {
    fn spawn(
        call: impl FnOnce() -> kvtier::Result<Vec<i64>> + Send + 'static,
    ) -> PyResult<PendingCall> {
        let finished = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&finished);
        let handle = std::thread::Builder::new()
            .name("kvtier-async".into())
            .spawn(move || {
                let result = call();
                flag.store(true, std::sync::atomic::Ordering::Release);
                result
            })
            .map_err(|e| PyRuntimeError::new_err(format!("starting a background call: {e}")))?;
        Ok(PendingCall {
            call: Mutex::new(Some(handle)),
            outcome: Mutex::new(None),
            finished,
        })
    }
}

#[pymethods]
impl PendingCall {
    /// Whether the call has finished (`wait()` then returns at once).
    fn done(&self) -> bool {
        self.finished.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Waits for the call (without holding the GIL) and returns what the
    /// synchronous form returns, or raises what it raises. Later calls
    /// return the same.
    fn wait(&self, py: Python<'_>) -> PyResult<Vec<i64>> {
        let handle = self.call.lock().unwrap().take();
        if let Some(handle) = handle {
            let result = py.detach(|| handle.join());
            let outcome = match result {
                Ok(Ok(codes)) => Ok(codes),
                Ok(Err(e)) => Err((e.kind(), e.to_string())),
                Err(_) => Err((kvtier::ErrorKind::Io, "the background call panicked".into())),
            };
            *self.outcome.lock().unwrap() = Some(outcome);
        }
        match self.outcome.lock().unwrap().clone() {
            Some(Ok(codes)) => Ok(codes),
            Some(Err((kind, message))) => Err(to_py_err(kvtier::Error::new(kind, message))),
            None => Err(PyRuntimeError::new_err(
                "another thread is waiting for this call",
            )),
        }
    }
}

/// Shared by `Store` and `Client`: every method of the engine-facing API.
#[pyclass(subclass, module = "kvtier._native")]
struct Engine {
    backend: Arc<Backend>,
    registered: Registered,
}

#[pymethods]
impl Engine {
    fn __enter__(slf: Bound<'_, Self>) -> Bound<'_, Self> {
        slf
    }

    /// Closes on leaving a `with` block; exceptions propagate.
    fn __exit__(
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
    fn register_buffer(&self, target: &Bound<'_, PyAny>, size: Option<usize>) -> PyResult<i32> {
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
    fn unregister_buffer(&self, py: Python<'_>, ptr: usize) -> i32 {
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
    fn batch_put_from(
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
        py.detach(move || call.run(backend)).map_err(to_py_err)
    }

    /// Reads each value into its destination. With `sizes`, `items` are raw
    /// pointers into registered memory; without, writable buffers. Returns
    /// per key the bytes read, or a negative code (`NOT_FOUND` for a miss,
    /// `BUFFER_TOO_SMALL`, `INVALID_ARGUMENT` for an unregistered range).
    #[pyo3(signature = (keys, items, sizes=None))]
    fn batch_get_into(
        &self,
        py: Python<'_>,
        keys: Vec<Key>,
        items: &Bound<'_, PyAny>,
        sizes: Option<Vec<usize>>,
    ) -> PyResult<Vec<i64>> {
        let call = GetCall::prepare(&self.registered, keys, items, sizes)?;
        let backend = &self.backend;
        py.detach(move || call.run(backend)).map_err(to_py_err)
    }

    /// `batch_put_from` in the background: returns at once with a
    /// `PendingCall` whose `wait()` gives the per-key codes. The values must
    /// stay unchanged until then (buffer objects are kept alive, registered
    /// ranges cannot be unregistered meanwhile).
    #[pyo3(signature = (keys, items, sizes=None, *, memory_only=false, skip_existing=false, durable=false))]
    fn batch_put_from_async(
        &self,
        keys: Vec<Key>,
        items: &Bound<'_, PyAny>,
        sizes: Option<Vec<usize>>,
        memory_only: bool,
        skip_existing: bool,
        durable: bool,
    ) -> PyResult<PendingCall> {
        let call = PutCall::prepare(
            &self.registered,
            keys,
            items,
            sizes,
            put_options(memory_only, skip_existing, durable),
        )?;
        let backend = Arc::clone(&self.backend);
        PendingCall::spawn(move || {
            let codes = call.run(&backend)?;
            Ok(codes.into_iter().map(i64::from).collect())
        })
    }

    /// `batch_get_into` in the background: returns at once with a
    /// `PendingCall` whose `wait()` gives per key the bytes read or a
    /// negative code. Leave the destinations alone until then.
    #[pyo3(signature = (keys, items, sizes=None))]
    fn batch_get_into_async(
        &self,
        keys: Vec<Key>,
        items: &Bound<'_, PyAny>,
        sizes: Option<Vec<usize>>,
    ) -> PyResult<PendingCall> {
        let call = GetCall::prepare(&self.registered, keys, items, sizes)?;
        let backend = Arc::clone(&self.backend);
        PendingCall::spawn(move || call.run(&backend))
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
    fn batch_put_from_multi_buffers(
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
    fn batch_get_into_multi_buffers(
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
    fn get_into(&self, py: Python<'_>, key: Key, buffer: &Bound<'_, PyAny>) -> PyResult<i64> {
        let list = PyList::new(py, [buffer])?;
        Ok(self.batch_get_into(py, vec![key], list.as_any(), None)?[0])
    }

    /// 1 if present, 0 if not, per key.
    fn batch_is_exist(&self, py: Python<'_>, keys: Vec<Key>) -> PyResult<Vec<i32>> {
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        let present = py
            .detach(|| self.backend.exists(&keys))
            .map_err(to_py_err)?;
        Ok(present.into_iter().map(i32::from).collect())
    }

    fn is_exist(&self, py: Python<'_>, key: Key) -> PyResult<i32> {
        Ok(self.batch_is_exist(py, vec![key])?[0])
    }

    /// How many leading keys are present: the cached prefix.
    fn prefix_len(&self, py: Python<'_>, keys: Vec<Key>) -> PyResult<usize> {
        let keys: Vec<Vec<u8>> = keys.into_iter().map(|k| k.0).collect();
        py.detach(|| self.backend.prefix_len(&keys))
            .map_err(to_py_err)
    }

    /// Stores one value (write-through). Returns 0 or a negative code.
    fn put(&self, py: Python<'_>, key: Key, value: &Bound<'_, PyAny>) -> PyResult<i32> {
        let list = PyList::new(py, [value])?;
        Ok(self.batch_put_from(py, vec![key], list.as_any(), None, false, false, false)?[0])
    }

    /// The value under `key`, or empty bytes on a miss.
    fn get<'py>(&self, py: Python<'py>, key: Key) -> PyResult<Bound<'py, PyBytes>> {
        let key = key.0;
        let value = py
            .detach(|| self.backend.get_one(&key))
            .map_err(to_py_err)?
            .unwrap_or_default();
        Ok(PyBytes::new(py, &value))
    }

    /// Removes `key` (durable on return). 0 if removed, NOT_FOUND if absent.
    fn remove(&self, py: Python<'_>, key: Key) -> PyResult<i32> {
        match py.detach(|| self.backend.remove(&key.0)) {
            Ok(true) => Ok(code::OK),
            Ok(false) => Ok(code::NOT_FOUND),
            Err(e) => Ok(code_of(&e)),
        }
    }

    /// Returns once everything put so far is durable.
    fn flush(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.backend.flush()).map_err(to_py_err)
    }

    /// Flushes and releases the store (or the connection).
    fn close(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.backend.close()).map_err(to_py_err)
    }

    /// Entries, bytes and hits per tier, misses, evictions, ... as a dict.
    fn stats(&self, py: Python<'_>) -> PyResult<Py<PyAny>> {
        let value = py.detach(|| self.backend.stats()).map_err(to_py_err)?;
        json_to_py(py, &value)
    }
}

/// The embedded store, in this process: `Store(path, memory="1GiB",
/// disk="16GiB", *, namespace="", region_size=None, io_engine="uring",
/// eviction="s3fifo", max_value_size="128MiB")`. Sizes are bytes or strings
/// like "64MiB". Every key lives in `namespace`.
#[pyclass(extends = Engine, name = "Store", module = "kvtier._native")]
struct Store_;

#[pymethods]
impl Store_ {
    #[new]
    #[pyo3(signature = (path, memory=None, disk=None, *, namespace="", region_size=None, io_engine=None, eviction=None, max_value_size=None))]
    #[expect(
        clippy::too_many_arguments,
        reason = "the store's settings as keyword arguments"
    )]
    fn new(
        py: Python<'_>,
        path: std::path::PathBuf,
        memory: Option<&Bound<'_, PyAny>>,
        disk: Option<&Bound<'_, PyAny>>,
        namespace: &str,
        region_size: Option<&Bound<'_, PyAny>>,
        io_engine: Option<String>,
        eviction: Option<String>,
        max_value_size: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<PyClassInitializer<Self>> {
        // The defaults are the core's, as `kvtier serve`'s are (1 GiB of
        // memory, 16 GiB of disk): a directory opened by either keeps its
        // capacity instead of being reclaimed down to the other's default.
        let mut config = Config::new(path).namespace(namespace);
        if let Some(memory) = memory {
            config = config.memory_capacity(parse_size(memory)?);
        }
        if let Some(disk) = disk {
            config = config.disk_capacity(parse_size(disk)?);
        }
        if let Some(r) = region_size {
            config = config.region_size(parse_size(r)?);
        }
        if let Some(e) = io_engine {
            config = config.io_engine(IoEngineKind::parse(&e).map_err(to_py_err)?);
        }
        if let Some(p) = eviction {
            config = config.eviction(EvictionPolicy::parse(&p).map_err(to_py_err)?);
        }
        if let Some(v) = max_value_size {
            config = config.max_value_size(parse_size(v)?);
        }
        let store = py.detach(|| Store::open(config)).map_err(to_py_err)?;
        log_recovery(py, &store)?;
        let engine = Engine {
            backend: Arc::new(Backend::Store(Arc::new(store))),
            registered: Registered::default(),
        };
        Ok(PyClassInitializer::from(engine).add_subclass(Store_))
    }
}

/// Says through Python's `logging` (logger "kvtier", level WARNING) what
/// the open found and decided that an operator must know: the server logs
/// the same through its own log, and `stats()` carries the counts.
fn log_recovery(py: Python<'_>, store: &Store) -> PyResult<()> {
    let report = store.recovery_report();
    let stats = store.stats();
    let mut findings = Vec::new();
    let mut note = |n: u64, what: &str| {
        if n > 0 {
            findings.push(format!("{n} {what}"));
        }
    };
    note(
        report.quarantined_regions,
        "region file(s) moved to quarantine/ (unreadable, not regular files, twins or keyed with another secret)",
    );
    note(
        report.damaged_regions,
        "region(s) with damaged pages skipped",
    );
    note(
        report.damaged_headers,
        "region(s) kept despite a damaged header",
    );
    note(
        report.skipped_files,
        "file(s) under region names neither used nor movable",
    );
    note(
        report.buffered_regions,
        "region file(s) that refuse O_DIRECT, read buffered",
    );
    note(
        report.regions_behind_gap,
        "region(s) not indexed because a newer region is missing",
    );
    note(
        report.scrub_dropped,
        "value(s) lost by the device before an unclean shutdown, not indexed",
    );
    if stats.io_engine != "none" && !stats.direct_io {
        findings.push("the data directory's file system refuses O_DIRECT: buffered I/O".into());
    }
    if findings.is_empty() {
        return Ok(());
    }
    let message = format!(
        "kvtier store {}: recovery found {}",
        store.config().data_dir().display(),
        findings.join("; ")
    );
    py.import("logging")?
        .call_method1("getLogger", ("kvtier",))?
        .call_method1("warning", (message,))?;
    Ok(())
}

/// A connection to `kvtier serve`: `Client(url, *, namespace="",
/// auth_token=None, timeout=60.0, shm_size="256MiB")` with
/// `unix:///path/kvtier.sock` (adds a shared-memory buffer registered with
/// the server), `tcp://host:port` or `tls://host:port` (with `tls_ca`, a
/// PEM file, default KVTIER_TLS_CA). The token defaults to
/// KVTIER_AUTH_TOKEN; TCP needs it. Every key lives in `namespace`.
/// `route=True`: in cluster mode, send each key straight to the members
/// that own it (one hop) instead of through this server.
#[pyclass(extends = Engine, name = "Client", module = "kvtier._native")]
struct Client_ {
    region: Option<Arc<SharedRegion>>,
    next: Mutex<usize>,
}

#[pymethods]
impl Client_ {
    #[new]
    #[pyo3(signature = (url, *, namespace="", auth_token=None, tls_ca=None, timeout=60.0, shm_size=None, connections=kvtier_client::pool::DEFAULT_CONNECTIONS, route=false))]
    #[expect(
        clippy::too_many_arguments,
        reason = "keyword options of the Python constructor"
    )]
    fn new(
        py: Python<'_>,
        url: String,
        namespace: &str,
        auth_token: Option<String>,
        tls_ca: Option<std::path::PathBuf>,
        timeout: f64,
        shm_size: Option<&Bound<'_, PyAny>>,
        connections: usize,
        route: bool,
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
        };
        let client = py
            .detach(|| Client::connect_with(&url, options))
            .map_err(to_py_err)?;
        let region = client.registered_region();
        let engine = Engine {
            backend: Arc::new(Backend::Client(Box::new(
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
    fn alloc_buffer(slf: PyRef<'_, Self>, size: usize) -> PyResult<SharedBuffer> {
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
struct SharedBuffer {
    region: Arc<SharedRegion>,
    offset: usize,
    len: usize,
}

#[pymethods]
impl SharedBuffer {
    fn __len__(&self) -> usize {
        self.len
    }

    /// The address of the first byte (for raw-pointer calls).
    #[getter]
    fn ptr(&self) -> usize {
        self.region.as_ptr() as usize + self.offset
    }

    unsafe fn __getbuffer__(
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

    unsafe fn __releasebuffer__(&self, _view: *mut pyo3::ffi::Py_buffer) {}
}

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
    for (name, value) in [
        ("OK", code::OK),
        ("INVALID_ARGUMENT", code::INVALID_ARGUMENT),
        ("BUFFER_TOO_SMALL", code::BUFFER_TOO_SMALL),
        ("NO_SPACE", code::NO_SPACE),
        ("CLOSED", code::CLOSED),
        ("IO", code::IO),
        ("NOT_FOUND", code::NOT_FOUND),
        ("UNAUTHORIZED", code::UNAUTHORIZED),
        ("UNSUPPORTED", code::UNSUPPORTED),
        ("PROTOCOL", code::PROTOCOL),
        ("LIMIT", code::LIMIT),
        ("TIMEOUT", code::TIMEOUT),
        ("CORRUPTION", code::CORRUPTION),
        ("LOCKED", code::LOCKED),
    ] {
        m.add(name, value)?;
    }
    Ok(())
}
