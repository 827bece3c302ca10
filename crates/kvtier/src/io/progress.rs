//! Progress of slow work on this thread, for whoever waits on it with a
//! deadline (a follow pass waiting on one writer's step, `shared::steps`):
//! reads of files another node writes and the batches applied from them
//! call `note`; a thread nobody waits on pays one thread-local lookup.

use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;

thread_local! {
    /// The counter of the work running on this thread, if any is watched.
    static PROGRESS: RefCell<Option<Arc<AtomicU64>>> = const { RefCell::new(None) };
}

/// Counts one sign of progress for whoever watches this thread.
pub(crate) fn note() {
    PROGRESS.with(|p| {
        if let Some(counter) = &*p.borrow() {
            counter.fetch_add(1, Ordering::Relaxed);
        }
    });
}

/// Sends this thread's progress to `counter` for the life of the guard.
pub(crate) struct Reporting;

impl Reporting {
    pub(crate) fn to(counter: Arc<AtomicU64>) -> Reporting {
        PROGRESS.with(|p| *p.borrow_mut() = Some(counter));
        Reporting
    }
}

impl Drop for Reporting {
    fn drop(&mut self) {
        PROGRESS.with(|p| *p.borrow_mut() = None);
    }
}
