//! One batch call's plumbing: which keys are usable, their targets in
//! caller memory, and the per-key results put back in the caller's order;
//! `PendingCall` for calls that run while Python goes on.

use crate::backend::Backend;
use crate::convert::{check_lengths, get_codes, put_codes, to_py_err, CallOutcome, Key};
use crate::registry::{
    as_mut_slices, as_slices, overlapping, raw_slices, Buffers, Registered, Registration,
};
use kvtier::ErrorKind;
use kvtier::PutOptions;
use kvtier_wire::protocol::code;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

/// Where a batch's values come from or go to: raw pointers checked
/// against the registered ranges, or buffer-protocol objects.
pub(crate) struct Targets {
    /// `(address, length)` per key; meaningful where `usable`.
    pub(crate) ranges: Vec<(usize, usize)>,
    /// Per key: the key is valid and its range usable.
    pub(crate) usable: Vec<bool>,
    /// Keeps buffer views (and their memory) alive for the call.
    pub(crate) _buffers: Option<Buffers>,
    /// Keeps registered ranges from being unregistered during the call.
    pub(crate) _pins: Vec<Arc<Registration>>,
}

impl Targets {
    pub(crate) fn resolve(
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
    pub(crate) fn picked(&self) -> Vec<usize> {
        usable_indices(&self.usable)
    }
}

pub(crate) fn usable_indices(usable: &[bool]) -> Vec<usize> {
    (0..usable.len()).filter(|&i| usable[i]).collect()
}

/// The keys at `picked`, for the backend call.
pub(crate) fn pick_keys(keys: &[Vec<u8>], picked: &[usize]) -> Vec<Vec<u8>> {
    picked.iter().map(|&i| keys[i].clone()).collect()
}

/// A result per key: the backend's for the picked keys, in order, and
/// `INVALID_ARGUMENT` for the keys that were not sent.
pub(crate) fn per_key<T: Copy + From<i32>>(n: usize, picked: &[usize], results: Vec<T>) -> Vec<T> {
    let mut out = vec![T::from(code::INVALID_ARGUMENT); n];
    for (&i, c) in picked.iter().zip(results) {
        out[i] = c;
    }
    out
}

/// A `batch_put_from` resolved against its values, to run with the GIL
/// released, here or on a background thread. Holds the buffer views and
/// registration pins that keep the values valid until it is dropped.
pub(crate) struct PutCall {
    pub(crate) keys: Vec<Vec<u8>>,
    pub(crate) options: PutOptions,
    pub(crate) targets: Targets,
}

impl PutCall {
    pub(crate) fn prepare(
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

    /// A code per key (0 = stored). The call's buffer views are released
    /// when it drops, which takes the GIL: drop it with the GIL held (or
    /// after a background call has said it is done).
    pub(crate) fn run(&self, backend: &Backend) -> kvtier::Result<Vec<i32>> {
        let picked = self.targets.picked();
        let pick_keys = pick_keys(&self.keys, &picked);
        let pick_ranges: Vec<(usize, usize)> =
            picked.iter().map(|&i| self.targets.ranges[i]).collect();
        // SAFETY: registered ranges pinned, or buffer views held, by
        // `self.targets` for as long as `self` lives.
        let values = unsafe { as_slices(&pick_ranges) };
        let results = backend.put(&pick_keys, &values, &self.options)?;
        Ok(per_key(self.keys.len(), &picked, put_codes(results)))
    }
}

/// A `batch_get_into` resolved against its destinations (checked not to
/// overlap), to run with the GIL released, here or on a background thread.
pub(crate) struct GetCall {
    pub(crate) keys: Vec<Vec<u8>>,
    pub(crate) picked: Vec<usize>,
    pub(crate) pick_ranges: Vec<(usize, usize)>,
    /// Keeps the destinations valid until the call is dropped.
    pub(crate) _targets: Targets,
}

impl GetCall {
    pub(crate) fn prepare(
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

    /// Per key the bytes read, or a negative code. (Drop as `PutCall`'s.)
    pub(crate) fn run(&self, backend: &Backend) -> kvtier::Result<Vec<i64>> {
        let pick_keys = pick_keys(&self.keys, &self.picked);
        // SAFETY: registered or live, writable, non-overlapping (checked in
        // `prepare`), held by `_targets` for as long as `self` lives; no
        // other reference to them is made while `run` borrows `self`.
        let mut bufs = unsafe { as_mut_slices(&self.pick_ranges) };
        let results = backend.get(&pick_keys, &mut bufs)?;
        Ok(per_key(self.keys.len(), &self.picked, get_codes(results)))
    }
}

/// The registered segments of a multi-buffer batch, pinned for the call.
pub(crate) struct SegmentTargets {
    /// Per key, `(address, length)` per segment; meaningful where `usable`.
    pub(crate) ranges: Vec<Vec<(usize, usize)>>,
    pub(crate) usable: Vec<bool>,
    pub(crate) _pins: Vec<Arc<Registration>>,
}

impl SegmentTargets {
    pub(crate) fn resolve(
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

    pub(crate) fn picked(&self) -> Vec<usize> {
        usable_indices(&self.usable)
    }
}

/// A finished background call: its result, and the buffer views and pins
/// it held, to be released by the thread that waits for it (see
/// `PendingCall::spawn`).
type Finished = (kvtier::Result<Vec<i64>>, Box<dyn Send>);

/// A batch call running in the background (`batch_get_into_async`,
/// `batch_put_from_async`).
#[pyclass(module = "kvtier._native")]
pub(crate) struct PendingCall {
    ending: Arc<Ending>,
    /// Someone is waiting for the call (`wait()` by two threads at once:
    /// the second is refused, as it cannot take the result too).
    waited: AtomicBool,
    /// The outcome once waited for: the codes, or the error's kind and text.
    outcome: Mutex<Option<CallOutcome>>,
}

/// Where a background call leaves its end.
struct Ending {
    finished: AtomicBool,
    result: Mutex<Option<Finished>>,
    ready: std::sync::Condvar,
}

impl Ending {
    fn put(&self, finished: Finished) {
        *self
            .result
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner) = Some(finished);
        self.ready.notify_all();
    }

    fn take(&self) -> Finished {
        let mut result = self
            .result
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        loop {
            if let Some(finished) = result.take() {
                return finished;
            }
            result = self
                .ready
                .wait(result)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
        }
    }
}

impl PendingCall {
    /// Runs `call` on a background thread of its own (an idle kept one or a
    /// new one: `kvtier_client::kept_threads::run`). With `notify`, an
    /// eventfd (or
    /// any descriptor that takes an 8-byte count) that stays open until the
    /// call is done: 1 is written to it then, with no GIL taken, so a
    /// caller's event loop learns of the completion without a Python thread
    /// waiting for it.
    ///
    /// `held` (the buffer views and pins) is not released on the call's
    /// thread: releasing a view takes the GIL, which a busy Python thread
    /// holds for up to its switch interval, and neither the completion nor
    /// the thread's next call may wait for that. It goes back with the
    /// result and `wait()` releases it, holding the GIL already. (A call
    /// dropped unwaited releases it with the last reference to its end.)
    pub(crate) fn spawn<C: Send + 'static>(
        held: C,
        call: impl FnOnce(&C) -> kvtier::Result<Vec<i64>> + Send + 'static,
        notify: Option<std::os::fd::RawFd>,
    ) -> PyResult<PendingCall> {
        let ending = Arc::new(Ending {
            finished: AtomicBool::new(false),
            result: Mutex::new(None),
            ready: std::sync::Condvar::new(),
        });
        let end = Arc::clone(&ending);
        kvtier_client::kept_threads::run(Box::new(move || {
            let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| call(&held)))
                .unwrap_or_else(|_| Err(kvtier::Error::new(ErrorKind::Io, "the call panicked")));
            // Done, then notified, then the result: `done()` is true by the
            // time the notification is read (the reader looks at `done()`),
            // and `wait()` returns only after the write, so the caller may
            // close the descriptor then.
            end.finished.store(true, Ordering::Release);
            if let Some(fd) = notify {
                notify_done(fd);
            }
            end.put((result, Box::new(held)));
        }))
        .map_err(|e| PyRuntimeError::new_err(format!("starting a background call: {e}")))?;
        Ok(PendingCall {
            ending,
            waited: AtomicBool::new(false),
            outcome: Mutex::new(None),
        })
    }
}

/// Writes 1 to `fd` (a completion to an eventfd).
fn notify_done(fd: std::os::fd::RawFd) {
    use std::io::Write;
    use std::os::fd::FromRawFd;
    // SAFETY: the caller keeps `fd` open until the call is done
    // (`notify_fd`'s contract); not closed here.
    let file = std::mem::ManuallyDrop::new(unsafe { std::fs::File::from_raw_fd(fd) });
    // A full eventfd counter (2^64 - 2 completions unread) is the only
    // refusal, and the reader drains it anyway.
    let _ = (&*file).write(&1u64.to_ne_bytes());
}

#[pymethods]
impl PendingCall {
    /// Whether the call has finished (`wait()` then returns as soon as the
    /// call's `notify_fd` write is made).
    pub(crate) fn done(&self) -> bool {
        self.ending.finished.load(Ordering::Acquire)
    }

    /// Waits for the call (without holding the GIL) and returns what the
    /// synchronous form returns, or raises what it raises. Later calls
    /// return the same.
    pub(crate) fn wait(&self, py: Python<'_>) -> PyResult<Vec<i64>> {
        if !self.waited.swap(true, Ordering::AcqRel) {
            let (result, held) = py.detach(|| self.ending.take());
            drop(held);
            *self.outcome.lock().unwrap() = Some(result.map_err(|e| (e.kind(), e.to_string())));
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
