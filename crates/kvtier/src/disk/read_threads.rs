//! The threads bounded reads run on (`super::deadline`), kept between
//! batches: starting a thread for every batch costs its creation, its
//! first stack pages and a cold cache, which a single value read warm from
//! the page cache (a few milliseconds) does not hide. A thread that is done
//! waits idle for the next batch for a while, then leaves.
//!
//! A batch whose read is stuck in the kernel (a stalled FUSE daemon)
//! keeps its thread: only threads whose task returned are reused, so a
//! new batch never queues behind a stuck one; with none idle, a new thread
//! is started, as before. What bounds stuck threads is the caller's count
//! of batches held past their deadline (`MAX_STUCK_BATCHES`).

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError, SendError, Sender};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// A batch's work, run on one of the threads.
pub(crate) type Task = Box<dyn FnOnce() + Send>;

/// Threads kept idle at most; more leave as soon as their task is done.
const MAX_IDLE: usize = 8;
/// How long an idle thread waits for a task before it leaves (in unit
/// tests long enough that no stall of a busy machine makes one leave).
const IDLE_FOR: Duration = Duration::from_secs(if cfg!(test) { 600 } else { 10 });

/// The kept threads of one disk tier's bounded reads.
#[derive(Debug, Default)]
pub(crate) struct ReadThreads {
    /// Each idle thread's id and the sender of its next task. A thread is
    /// in here only while it waits; whoever takes its entry sends to it.
    idle: Mutex<Vec<(u64, Sender<Task>)>>,
    next_id: AtomicU64,
    /// Threads that left, for the tests.
    #[cfg(test)]
    left: AtomicU64,
}

impl ReadThreads {
    /// Runs `task` on an idle thread, or on a new one when none is idle.
    /// Fails only when no thread can be made (the task is dropped unrun).
    pub(crate) fn run(self: &Arc<Self>, task: Task) -> std::io::Result<()> {
        let mut task = task;
        loop {
            let Some((_, next)) = self.idle.lock().unwrap().pop() else {
                break;
            };
            match next.send(task) {
                Ok(()) => return Ok(()),
                // It left between its wait and its hang-up: try another.
                Err(SendError(back)) => task = back,
            }
        }
        let threads = Arc::clone(self);
        std::thread::Builder::new()
            .name("kvtier-bounded-read".into())
            .spawn(move || {
                threads.work(task);
                #[cfg(test)]
                threads.left.fetch_add(1, Ordering::Relaxed);
            })
            .map(|_| ())
    }

    /// Threads waiting for a task now.
    #[cfg(test)]
    fn idle(&self) -> usize {
        self.idle.lock().unwrap().len()
    }

    /// A thread's life: its first task, then any handed to it while idle.
    fn work(&self, first: Task) {
        let mut task = first;
        loop {
            // The tasks catch their own panics (a panic here would only
            // end this thread: nobody waits on it).
            task();
            let (next, tasks) = mpsc::channel::<Task>();
            let id = self.next_id.fetch_add(1, Ordering::Relaxed);
            {
                let mut idle = self.idle.lock().unwrap();
                if idle.len() >= MAX_IDLE {
                    return;
                }
                idle.push((id, next));
            }
            task = match tasks.recv_timeout(IDLE_FOR) {
                Ok(task) => task,
                Err(RecvTimeoutError::Timeout) => {
                    let mut idle = self.idle.lock().unwrap();
                    match idle.iter().position(|(waiting, _)| *waiting == id) {
                        Some(at) => {
                            // Still listed: nobody can send to it now.
                            idle.swap_remove(at);
                            return;
                        }
                        None => {
                            // Taken just now: its task is on the way.
                            drop(idle);
                            match tasks.recv() {
                                Ok(task) => task,
                                Err(_) => return,
                            }
                        }
                    }
                }
                Err(RecvTimeoutError::Disconnected) => return,
            };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::mpsc::channel;

    #[test]
    fn a_finished_thread_runs_the_next_task_and_a_busy_one_is_never_waited_for() {
        let threads = Arc::new(ReadThreads::default());
        let (done, finished) = channel();
        let first = done.clone();
        threads
            .run(Box::new(move || {
                first.send(std::thread::current().id()).unwrap();
            }))
            .unwrap();
        let ran_on = finished.recv().unwrap();
        // The thread lists itself as idle after its task: wait for that
        // (no timing: poll the list itself).
        while threads.idle() == 0 {
            std::thread::yield_now();
        }
        let second = done.clone();
        threads
            .run(Box::new(move || {
                second.send(std::thread::current().id()).unwrap();
            }))
            .unwrap();
        assert_eq!(
            finished.recv().unwrap(),
            ran_on,
            "the idle thread was reused"
        );

        // A task that blocks (a read stuck in the kernel) holds its
        // thread; the next task gets another thread and runs at once.
        let (release, blocked) = channel::<()>();
        threads
            .run(Box::new(move || {
                let _ = blocked.recv();
            }))
            .unwrap();
        let third = done.clone();
        threads
            .run(Box::new(move || {
                third.send(std::thread::current().id()).unwrap();
            }))
            .unwrap();
        finished.recv().unwrap();
        release.send(()).unwrap();
    }

    #[test]
    fn idle_threads_are_capped() {
        let threads = Arc::new(ReadThreads::default());
        let (release, gate) = channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let tasks = 2 * MAX_IDLE;
        for _ in 0..tasks {
            let gate = Arc::clone(&gate);
            // Each holds its thread until released, so all run at once.
            threads
                .run(Box::new(move || {
                    let _ = gate.lock().unwrap().recv();
                }))
                .unwrap();
        }
        for _ in 0..tasks {
            release.send(()).unwrap();
        }
        // Every task returns once each release is taken; each of the
        // threads (one per task: they all ran at once) then lists itself
        // or leaves. Wait until all have done one or the other.
        let settled = || {
            let listed = threads.idle() as u64;
            assert!(listed <= MAX_IDLE as u64, "{listed} idle threads kept");
            listed + threads.left.load(Ordering::Relaxed) == tasks as u64
        };
        while !settled() {
            std::thread::yield_now();
        }
        assert!(threads.left.load(Ordering::Relaxed) >= (tasks - MAX_IDLE) as u64);
    }
}
