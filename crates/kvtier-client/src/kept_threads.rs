//! Threads kept idle between the jobs they run: background calls (the
//! Python module's `*_async` calls) and a large batch's second copier. A
//! job starts without a thread being created and its caller does not join
//! a thread's exit (each cost 60-100 µs of a 2 ms batch load on the
//! machines we measure on).
//!
//! Every job gets a thread of its own, never a queue behind another job: a
//! call may wait on a slow server for its whole timeout, and the jobs
//! behind it must not. A job that finds no idle thread starts a new one.

use std::sync::mpsc;
use std::sync::{Mutex, PoisonError};

/// A job to run, with everything it needs moved in.
pub type Job = Box<dyn FnOnce() + Send + 'static>;

/// Idle threads kept at most; one that finishes its job with this many
/// idle ends instead.
pub const MAX_IDLE: usize = 4;

struct Idle {
    /// The process the threads belong to: a child forked from it has none
    /// of them (their senders would take a call that nothing runs).
    pid: u32,
    /// One sender per idle thread, which waits on its receiver.
    senders: Vec<mpsc::Sender<Job>>,
}

static IDLE: Mutex<Idle> = Mutex::new(Idle {
    pid: 0,
    senders: Vec::new(),
});

/// Runs `job` on an idle thread (named `kvtier-async`), or on a new one
/// when none is idle.
pub fn run(job: Job) -> std::io::Result<()> {
    let mut job = job;
    while let Some(sender) = take_idle() {
        match sender.send(job) {
            Ok(()) => return Ok(()),
            // Its thread has gone (it cannot, short of a panic in a job):
            // the next one, or a new thread.
            Err(mpsc::SendError(back)) => job = back,
        }
    }
    std::thread::Builder::new()
        .name("kvtier-async".into())
        .spawn(move || serve(job))?;
    Ok(())
}

fn take_idle() -> Option<mpsc::Sender<Job>> {
    let mut idle = IDLE.lock().unwrap_or_else(PoisonError::into_inner);
    let pid = std::process::id();
    if idle.pid != pid {
        idle.pid = pid;
        idle.senders.clear();
    }
    idle.senders.pop()
}

/// A kept thread: runs its first job, then waits idle for the next one
/// while fewer than `MAX_IDLE` others do.
fn serve(first: Job) {
    first();
    loop {
        let (sender, receiver) = mpsc::channel();
        {
            let mut idle = IDLE.lock().unwrap_or_else(PoisonError::into_inner);
            if idle.pid != std::process::id() || idle.senders.len() >= MAX_IDLE {
                return;
            }
            idle.senders.push(sender);
        }
        match receiver.recv() {
            Ok(job) => job(),
            Err(mpsc::RecvError) => return,
        }
    }
}

/// Runs `work` on the calling thread and on up to `helpers` kept threads at
/// once, and returns when every run has returned: the first error, if any
/// (a helper's panic is resumed here). `work` shares out what there is to
/// do (a counter, say), so a helper that could not be started only means
/// fewer hands. It may borrow from the caller's stack: no helper touches
/// it after its run returns, and this waits for every run, also while the
/// caller's own run unwinds.
pub fn run_scoped<F>(helpers: usize, work: &F) -> std::io::Result<()>
where
    F: Fn() -> std::io::Result<()> + Sync,
{
    type Work<'a> = dyn Fn() -> std::io::Result<()> + Sync + 'a;
    /// `work` with its lifetime erased, for a job (which must be
    /// `'static`); see the safety note where it is called.
    struct Borrowed(*const Work<'static>);
    // SAFETY: it points at a `Sync` closure, which any thread may call.
    unsafe impl Send for Borrowed {}

    let work: &Work<'_> = work;
    // SAFETY: the same fat pointer with a longer lifetime, which is only
    // dereferenced before the run's latch is set, and `Helpers` waits for
    // every latch before this function returns or unwinds.
    let erased = unsafe { std::mem::transmute::<*const Work<'_>, *const Work<'static>>(work) };
    let mut started = Helpers(Vec::new());
    for _ in 0..helpers {
        let latch = std::sync::Arc::new(Latch::default());
        let done = std::sync::Arc::clone(&latch);
        let borrowed = Borrowed(erased);
        let job = move || {
            let borrowed = borrowed;
            // SAFETY: see `erased`: the caller is waiting for `done`.
            let run = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| unsafe {
                (*borrowed.0)()
            }));
            done.set(run);
        };
        if run(Box::new(job)).is_ok() {
            started.0.push(latch);
        }
    }
    let mut result = work();
    for run in started.wait_all() {
        match run {
            Ok(run) => result = result.and(run),
            Err(panic) => std::panic::resume_unwind(panic),
        }
    }
    result
}

/// One helper's run, once it has returned (or panicked).
#[derive(Default)]
struct Latch {
    run: Mutex<Option<std::thread::Result<std::io::Result<()>>>>,
    ready: std::sync::Condvar,
}

impl Latch {
    fn set(&self, run: std::thread::Result<std::io::Result<()>>) {
        *self.run.lock().unwrap_or_else(PoisonError::into_inner) = Some(run);
        self.ready.notify_all();
    }

    fn wait(&self) -> std::thread::Result<std::io::Result<()>> {
        let mut run = self.run.lock().unwrap_or_else(PoisonError::into_inner);
        loop {
            if let Some(run) = run.take() {
                return run;
            }
            run = self.ready.wait(run).unwrap_or_else(PoisonError::into_inner);
        }
    }
}

/// The latches of the helpers started; waits for them all when dropped
/// (which is how a caller's panic still waits).
struct Helpers(Vec<std::sync::Arc<Latch>>);

impl Helpers {
    fn wait_all(&mut self) -> Vec<std::thread::Result<std::io::Result<()>>> {
        self.0.drain(..).map(|latch| latch.wait()).collect()
    }
}

impl Drop for Helpers {
    fn drop(&mut self) {
        self.wait_all();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::{Arc, Condvar};
    use std::time::{Duration, Instant};

    /// Jobs that each wait until all of them run, run side by side (none
    /// waits behind another), and threads are kept afterwards, at most
    /// `MAX_IDLE`.
    #[test]
    fn jobs_never_queue_and_idle_threads_are_kept() {
        let n = MAX_IDLE + 3;
        let running = Arc::new((Mutex::new(0usize), Condvar::new()));
        let (saw_all, results) = mpsc::channel();
        for _ in 0..n {
            let (running, saw_all) = (Arc::clone(&running), saw_all.clone());
            run(Box::new(move || {
                let (count, changed) = &*running;
                let mut count = count.lock().unwrap();
                *count += 1;
                changed.notify_all();
                // A job queued behind another never starts, and this one
                // gives up (a deadline against a hang, not a timing).
                let deadline = Instant::now() + Duration::from_secs(60);
                while *count < n && Instant::now() < deadline {
                    count = changed
                        .wait_timeout(count, Duration::from_secs(1))
                        .unwrap()
                        .0;
                }
                saw_all.send(*count == n).unwrap();
            }))
            .unwrap();
        }
        for _ in 0..n {
            assert!(results.recv().unwrap(), "a job waited behind another");
        }
        let kept = IDLE.lock().unwrap().senders.len();
        assert!(kept <= MAX_IDLE, "{kept} idle threads kept");
    }

    /// A sender whose thread has gone is skipped: the job still runs.
    #[test]
    fn a_gone_thread_is_skipped() {
        let (sender, receiver) = mpsc::channel::<Job>();
        drop(receiver);
        {
            let mut idle = IDLE.lock().unwrap();
            let pid = std::process::id();
            if idle.pid != pid {
                idle.pid = pid;
                idle.senders.clear();
            }
            idle.senders.push(sender);
        }
        let (done, finished) = mpsc::channel();
        run(Box::new(move || done.send(()).unwrap())).unwrap();
        finished.recv().unwrap();
    }

    /// Scoped runs share out borrowed work: every item is done exactly
    /// once, with the caller and helpers all taking part where the work
    /// waits for them.
    #[test]
    fn scoped_runs_share_borrowed_work_and_all_take_part() {
        for helpers in [0, 1, 3] {
            let items: Vec<AtomicUsize> = (0..1000).map(|_| AtomicUsize::new(0)).collect();
            let next = AtomicUsize::new(0);
            let hands = AtomicUsize::new(0);
            let arrived = (Mutex::new(0usize), Condvar::new());
            run_scoped(helpers, &|| {
                // Each run waits (up to a deadline) until all have arrived,
                // so every one of them does some of the work.
                {
                    let (count, changed) = &arrived;
                    let mut count = count.lock().unwrap();
                    *count += 1;
                    changed.notify_all();
                    let deadline = Instant::now() + Duration::from_secs(60);
                    while *count < helpers + 1 && Instant::now() < deadline {
                        count = changed
                            .wait_timeout(count, Duration::from_secs(1))
                            .unwrap()
                            .0;
                    }
                }
                hands.fetch_add(1, Ordering::SeqCst);
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    let Some(item) = items.get(i) else {
                        return Ok(());
                    };
                    item.fetch_add(1, Ordering::Relaxed);
                }
            })
            .unwrap();
            assert_eq!(hands.load(Ordering::SeqCst), helpers + 1);
            assert!(items.iter().all(|i| i.load(Ordering::Relaxed) == 1));
        }
    }

    /// A helper's error and a helper's panic reach the caller, after every
    /// run has returned.
    #[test]
    fn a_helpers_error_or_panic_reaches_the_caller() {
        let runs = AtomicUsize::new(0);
        let failed = run_scoped(2, &|| {
            if runs.fetch_add(1, Ordering::SeqCst) == 1 {
                return Err(std::io::Error::other("the second run failed"));
            }
            Ok(())
        });
        assert_eq!(failed.unwrap_err().to_string(), "the second run failed");
        assert_eq!(runs.load(Ordering::SeqCst), 3);
        let on_helper = std::thread::current().id();
        let panicked = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run_scoped(1, &|| {
                if std::thread::current().id() != on_helper {
                    panic!("a helper panicked");
                }
                Ok(())
            })
        }));
        let payload = panicked.unwrap_err();
        assert_eq!(payload.downcast_ref::<&str>(), Some(&"a helper panicked"));
    }
}
