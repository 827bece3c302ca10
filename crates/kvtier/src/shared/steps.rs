//! Bounded steps of a follow pass: one writer's step (or the listing of
//! the writers) runs on a worker thread and the pass waits for it as long
//! as it makes progress (a read returns, a batch or a thousand checkpoint
//! entries are applied: `io::progress`), giving up once none came for
//! the storage deadline. A writer whose files hang (a mount under its
//! directory that stopped answering, a link planted to one) then costs a
//! pass that long instead of stopping the follower, and the first pass at
//! open, for good; a large log or checkpoint that reads steadily is waited
//! for whole. A step given up on keeps its thread and finishes on its own,
//! applying what it read as any step does; the pass goes on with a fresh
//! worker, so at most one thread per hanging step is held.

use crate::io::progress::Reporting;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;

type Job = Box<dyn FnOnce() + Send>;

/// The worker thread steps run on, replaced when one overruns.
#[derive(Debug, Default)]
pub(crate) struct StepRunner {
    worker: Mutex<Option<mpsc::Sender<Job>>>,
}

impl StepRunner {
    /// Runs `step` on the worker and returns its result, or `None` if it
    /// went `deadline` without progress (it then finishes on its own
    /// thread, whose result is dropped). A step that panics is `None`.
    pub(crate) fn run<T: Send + 'static>(
        &self,
        deadline: Duration,
        step: impl FnOnce() -> T + Send + 'static,
    ) -> Option<T> {
        let (done, result) = mpsc::sync_channel::<T>(1);
        let progress = Arc::new(AtomicU64::new(0));
        let reported = Arc::clone(&progress);
        let job: Job = Box::new(move || {
            let _reporting = Reporting::to(reported);
            // A step that panics drops `done` unsent (its result is `None`)
            // and leaves the worker serving: a worker thread that died
            // could take the next job, sent before its receiver dropped,
            // with it.
            if let Ok(value) = std::panic::catch_unwind(std::panic::AssertUnwindSafe(step)) {
                let _ = done.send(value);
            }
        });
        let mut worker = self.worker.lock().unwrap_or_else(|p| p.into_inner());
        // A worker whose thread is gone (it could not start a step) refuses
        // the job.
        let job = match worker.as_ref() {
            Some(tx) => match tx.send(job) {
                Ok(()) => None,
                Err(mpsc::SendError(job)) => Some(job),
            },
            None => Some(job),
        };
        if let Some(job) = job {
            let (tx, rx) = mpsc::channel::<Job>();
            let spawned = std::thread::Builder::new()
                .name("kvtier-follow-step".into())
                .spawn(move || {
                    // Ends when the runner drops its sender (replaced
                    // after an overrun) and the queue is empty.
                    for job in rx {
                        job();
                    }
                });
            match spawned {
                Ok(_) => {
                    tx.send(job).expect("the new worker holds its receiver");
                    *worker = Some(tx);
                }
                Err(e) => {
                    // No thread to spare: run it here, unbounded, rather
                    // than not at all.
                    tracing::warn!(error = %e, "cannot start a follow step thread; running the step unbounded");
                    drop(worker);
                    job();
                    return result.try_recv().ok();
                }
            }
        }
        drop(worker);
        let mut seen = 0;
        loop {
            match result.recv_timeout(deadline) {
                Ok(value) => return Some(value),
                Err(mpsc::RecvTimeoutError::Timeout) => {
                    let now = progress.load(Ordering::Relaxed);
                    if now != seen {
                        seen = now;
                        continue;
                    }
                    // That worker is busy for as long as the step hangs:
                    // the next step gets a new one, and it exits once done.
                    *self.worker.lock().unwrap_or_else(|p| p.into_inner()) = None;
                    return None;
                }
                Err(mpsc::RecvTimeoutError::Disconnected) => return None,
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::AtomicUsize;

    #[test]
    fn steps_return_their_results_and_an_overrun_does_not_hold_the_next() {
        let runner = StepRunner::default();
        assert_eq!(runner.run(Duration::from_secs(60), || 7), Some(7));
        // A step that waits on a gate the test opens only later: past its
        // deadline (1 ms here; the gate keeps it there however slow the
        // machine is), then the next step runs on a fresh worker.
        let (open, gate) = mpsc::channel::<()>();
        let finished = Arc::new(AtomicUsize::new(0));
        let seen = Arc::clone(&finished);
        let hung = runner.run(Duration::from_millis(1), move || {
            gate.recv().unwrap();
            seen.fetch_add(1, Ordering::SeqCst);
        });
        assert_eq!(hung, None);
        assert_eq!(runner.run(Duration::from_secs(60), || "next"), Some("next"));
        // The overrun step finishes on its own once the gate opens.
        open.send(()).unwrap();
        while finished.load(Ordering::SeqCst) == 0 {
            std::thread::yield_now();
        }
        // A step that panics is None, and the runner goes on.
        assert_eq!(
            runner.run(Duration::from_secs(60), || -> u8 {
                panic!("a step panicked")
            }),
            None
        );
        assert_eq!(runner.run(Duration::from_secs(60), || 9), Some(9));
    }
}
