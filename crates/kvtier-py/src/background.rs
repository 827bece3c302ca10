//! The threads that run calls while Python goes on (`PendingCall`): kept
//! idle between calls, so a call starts without a thread being created and
//! its waiter does not join a thread's exit (each was 60-100 µs of a 2 ms
//! batch load on the machines we measure on).
//!
//! Every call gets a thread of its own, never a queue behind another call:
//! a call may wait on a slow server for its whole timeout, and the calls
//! behind it must not. A call that finds no idle thread starts a new one.

use std::sync::mpsc;
use std::sync::{Mutex, PoisonError};

/// A call to run, with everything it needs moved in.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

/// Idle threads kept at most; one that finishes its call with this many
/// idle ends instead.
const MAX_IDLE: usize = 4;

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

/// Runs `job` on an idle thread, or on a new one when none is idle.
pub(crate) fn run(job: Job) -> std::io::Result<()> {
    let mut job = job;
    while let Some(sender) = take_idle() {
        match sender.send(job) {
            Ok(()) => return Ok(()),
            // Its thread has gone (it cannot, short of a panic outside a
            // call): the next one, or a new thread.
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

/// A kept thread: runs its first call, then waits idle for the next one
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
