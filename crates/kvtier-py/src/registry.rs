//! The caller-memory trust boundary: raw pointers and Python buffers
//! (Mooncake's `register_buffer` / `batch_*_from` forms, buffer-protocol
//! objects) become slices only here. The safety contract, written once:
//! a raw range is used only inside a registration (checked mapped readable
//! and writable when registered) and pins that registration for the whole
//! call, so `unregister_buffer` waits for it; a Python buffer is held (with
//! its view, so it cannot be resized) for the whole call; the destination
//! ranges of one call never overlap ([`overlapping`] is checked first).

use pyo3::buffer::PyUntypedBuffer;
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use std::sync::{Arc, Mutex};

/// One range registered with `register_buffer`. Calls that use it hold an
/// `Arc` on it for their whole duration, so `unregister_buffer` can wait
/// until no call writes into it any more.
pub(crate) struct Registration {
    pub(crate) ptr: usize,
    pub(crate) size: usize,
    /// The object whose memory this is, when Python passed one: kept (with
    /// its buffer view, so it cannot be resized) while registered.
    pub(crate) _owner: Option<PyUntypedBuffer>,
}

/// Memory ranges the caller registered: raw pointers are only dereferenced
/// inside them.
#[derive(Default)]
pub(crate) struct Registered(pub(crate) Mutex<Vec<Arc<Registration>>>);

impl Registered {
    pub(crate) fn add(
        &self,
        ptr: usize,
        size: usize,
        owner: Option<PyUntypedBuffer>,
    ) -> PyResult<()> {
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
    pub(crate) fn take(&self, ptr: usize) -> Option<Arc<Registration>> {
        let mut ranges = self.0.lock().unwrap();
        let i = ranges.iter().position(|r| r.ptr == ptr)?;
        Some(ranges.swap_remove(i))
    }

    /// The registration holding `[ptr, ptr + size)`, pinned for a call.
    pub(crate) fn pin(&self, ptr: usize, size: usize) -> Option<Arc<Registration>> {
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
pub(crate) fn wait_unused(registration: &Arc<Registration>) {
    while Arc::strong_count(registration) > 1 {
        std::thread::sleep(std::time::Duration::from_micros(200));
    }
}

/// Checks that `[ptr, ptr + size)` lies wholly in readable and writable
/// mappings of this process, so a typo'd or freed address is refused at
/// registration instead of crashing the first call.
pub(crate) fn mapped_writable(ptr: usize, size: usize) -> PyResult<()> {
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
pub(crate) type PinnedRange = ((usize, usize), Arc<Registration>);

/// Raw destinations or sources for a batch, each pinned in the registry
/// for the call; `None` where a range is not registered.
pub(crate) fn raw_slices(
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
pub(crate) struct Buffers {
    pub(crate) views: Vec<PyUntypedBuffer>,
}

impl Buffers {
    pub(crate) fn get(items: &Bound<'_, PyAny>, writable: bool) -> PyResult<Buffers> {
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

    pub(crate) fn ranges(&self) -> Vec<(usize, usize)> {
        self.views
            .iter()
            .map(|v| (v.buf_ptr() as usize, v.len_bytes()))
            .collect()
    }
}

/// # Safety
/// Each range must be valid, writable memory for the whole call, and no
/// two ranges may overlap.
pub(crate) unsafe fn as_mut_slices<'a>(ranges: &[(usize, usize)]) -> Vec<&'a mut [u8]> {
    ranges
        .iter()
        // SAFETY: the caller's contract.
        .map(|&(p, s)| unsafe { std::slice::from_raw_parts_mut(p as *mut u8, s) })
        .collect()
}

/// # Safety
/// Each range must be valid memory for the whole call.
pub(crate) unsafe fn as_slices<'a>(ranges: &[(usize, usize)]) -> Vec<&'a [u8]> {
    ranges
        .iter()
        // SAFETY: the caller's contract.
        .map(|&(p, s)| unsafe { std::slice::from_raw_parts(p as *const u8, s) })
        .collect()
}

pub(crate) fn overlapping(ranges: &[(usize, usize)]) -> bool {
    let mut sorted: Vec<(usize, usize)> = ranges.iter().copied().filter(|r| r.1 > 0).collect();
    sorted.sort_unstable();
    sorted.windows(2).any(|w| w[0].0 + w[0].1 > w[1].0)
}
