//! The write log: sequence numbers, the flusher's queue, the durable
//! watermark and the record of failed writes, in one type with private
//! fields. The `Store` appends and waits through it; the flusher takes
//! batches from it and reports each batch's outcome to it. Nothing else
//! touches these, so the failure accounting lives in one place:
//!
//! - a batch that fails goes back to the front of the queue and is retried
//!   (in a new region) with a growing pause, for as long as the store is
//!   open; its values stay pinned in the pool meanwhile (so a disk that
//!   stays broken fills the pool, and puts then fail with `NoSpace` after
//!   their bounded wait), and its sequence numbers are *retrying* until an
//!   attempt succeeds;
//! - at close, a batch whose last attempt fails is *failed* for good, and
//!   `close` says so;
//! - a waiter for writes `low..=high` gets `Ok` once every one of them is
//!   durable, and an error as soon as any of them failed, or any write up
//!   to `high` is retrying (writes become durable in order), whoever else
//!   is waiting (nothing is "consumed" by the first caller);
//! - if the flusher dies, every waiter and every later write gets an error
//!   naming why, instead of waiting forever;
//! - write-through writes yield to reads (`ReadsFirst`): while gets keep
//!   coming, the flusher holds its next batch back for a bounded time, so
//!   loads on an engine's critical path do not share the memory bus and
//!   the disk's DMA with background writes. A flush, a durable put, a
//!   removal, pool pressure and close never wait for it.

use crate::error::{Error, ErrorKind, Result};
use crate::key::KeyDigest;
use crate::pool::PoolSlot;
use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// A write the flusher has yet to make durable: a put (its pool slot holds
/// the bytes) or a tombstone, in sequence order.
#[derive(Debug)]
pub(crate) enum QueuedWrite {
    Put {
        digest: KeyDigest,
        key: Box<[u8]>,
        seq: u64,
        slot: Arc<PoolSlot>,
        /// `value_checksum` of the slot's bytes, computed by the put while
        /// it copied them (so the flusher, which the disk paces, need not).
        checksum: u64,
    },
    Tombstone {
        digest: KeyDigest,
        key: Box<[u8]>,
        seq: u64,
    },
}

impl QueuedWrite {
    /// Pool bytes the write holds until it is written (0 for a tombstone).
    fn value_bytes(&self) -> u64 {
        match self {
            QueuedWrite::Put { slot, .. } => slot.len() as u64,
            QueuedWrite::Tombstone { .. } => 0,
        }
    }

    pub(crate) fn seq(&self) -> u64 {
        match self {
            QueuedWrite::Put { seq, .. } | QueuedWrite::Tombstone { seq, .. } => *seq,
        }
    }
}

/// Pause before retry `n` (1-based): 40 ms doubling, at most 1 s.
fn backoff(attempt: u32) -> Duration {
    Duration::from_millis(20u64 << attempt.min(6)).min(Duration::from_secs(1))
}

/// Closed sequence-number ranges, kept merged.
#[derive(Debug, Default)]
struct Ranges(Vec<(u64, u64)>);

impl Ranges {
    fn add(&mut self, low: u64, high: u64) {
        self.0.push((low, high));
        self.0.sort_unstable();
        let mut merged: Vec<(u64, u64)> = Vec::with_capacity(self.0.len());
        for (lo, hi) in self.0.drain(..) {
            match merged.last_mut() {
                Some(last) if lo <= last.1.saturating_add(1) => last.1 = last.1.max(hi),
                _ => merged.push((lo, hi)),
            }
        }
        self.0 = merged;
    }

    fn remove(&mut self, low: u64, high: u64) {
        let mut kept = Vec::with_capacity(self.0.len() + 1);
        for &(lo, hi) in &self.0 {
            if hi < low || lo > high {
                kept.push((lo, hi));
                continue;
            }
            if lo < low {
                kept.push((lo, low - 1));
            }
            if hi > high {
                kept.push((high + 1, hi));
            }
        }
        self.0 = kept;
    }

    fn intersects(&self, low: u64, high: u64) -> bool {
        self.0.iter().any(|&(lo, hi)| lo <= high && low <= hi)
    }

    fn count(&self) -> u64 {
        self.0.iter().map(|&(lo, hi)| hi - lo + 1).sum()
    }
}

#[derive(Debug)]
struct LogState {
    next_seq: u64,
    items: VecDeque<QueuedWrite>,
    /// Every write with a sequence number up to this one is durable,
    /// failed for good, or was never a disk write.
    processed_seq: u64,
    /// The highest number handed to a write of this log (`append`, the
    /// reclaimer's renumbering). `next_seq` can pass it without a write:
    /// the clock adopts other writers' numbers (`observe`).
    handed_out: u64,
    requested: bool,
    shutdown: bool,
    retrying: Ranges,
    /// Items of the batch the flusher holds now that were retrying when it
    /// took them (they are out of `items` while it writes them).
    retrying_in_flight: u64,
    failed: Ranges,
    /// The error behind `retrying` and `failed`, for messages.
    last_error: Option<Error>,
    /// Consecutive failed attempts at the batch at the queue's front.
    attempts: u32,
    retry_at: Option<Instant>,
    /// Set when the flusher thread died.
    dead: Option<String>,
    /// Since when (on `WriteLog::epoch`'s clock) the queue has held writes
    /// without emptying: the start of the wait `ReadsFirst::most` bounds.
    yielding_since: Option<Duration>,
    /// Value bytes of the puts in `items` (pool bytes not yet evictable).
    queued_bytes: u64,
}

/// How write-through writes yield to reads (`Config::flush_yield`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ReadsFirst {
    /// Reads count as paused once none has started for this long.
    pub quiet: Duration,
    /// The longest queued writes wait for reads to pause. Once they have
    /// waited this long the flusher writes until the queue is empty,
    /// whatever reads do, so write-back that fell behind catches up.
    pub most: Duration,
    /// Writes are held only while the queued puts' values take fewer bytes
    /// than this (of the memory pool, which they pin until written): past
    /// it the flusher writes, so held writes do not make puts wait for
    /// pool space.
    pub most_bytes: u64,
}

impl ReadsFirst {
    /// How much longer the flusher holds its next batch back, or `None` to
    /// write it now: `now`, the last read's start and when the queue began
    /// to hold writes are readings of the same clock.
    pub(crate) fn hold(
        self,
        now: Duration,
        last_read: Option<Duration>,
        since: Duration,
    ) -> Option<Duration> {
        let waited = now.saturating_sub(since);
        let quiet_for = now.saturating_sub(last_read?);
        if waited >= self.most || quiet_for >= self.quiet {
            return None;
        }
        Some((self.quiet - quiet_for).min(self.most - waited))
    }
}

/// How far ahead of this node's wall clock another writer's sequence
/// number may read and still be adopted and indexed: 5 minutes, far above
/// any skew NTP leaves, far below what a broken clock shows.
pub const MAX_CLOCK_AHEAD_NANOS: u64 = 300 * 1_000_000_000;
/// A node whose own clock reads before this (2020-01-01) or from
/// `LATEST_PLAUSIBLE_CLOCK_NANOS` (2250-01-01, twelve years before the
/// numbers run out at 2^63 ns) refuses to open a shared directory.
pub const EARLIEST_PLAUSIBLE_CLOCK_NANOS: u64 = 1_577_836_800 * 1_000_000_000;
pub const LATEST_PLAUSIBLE_CLOCK_NANOS: u64 = 8_835_984_000 * 1_000_000_000;

/// See the module documentation.
#[derive(Debug)]
pub(crate) struct WriteLog {
    state: Mutex<LogState>,
    /// The flusher waits on this for work.
    work: Condvar,
    /// Callers wait on this for the flusher's progress.
    progress: Condvar,
    write_through: bool,
    /// Shared-directory mode: sequence numbers are hybrid logical clock
    /// readings (docs/design.md, "Sequence numbers: a hybrid logical clock"): never below the
    /// wall clock in nanoseconds since the Unix epoch, and past every
    /// number `observe`d from other writers.
    clock: bool,
    /// Added to wall clock readings (a test seam; 0 otherwise).
    clock_offset_nanos: i64,
    /// The last plausible wall clock reading and when it was taken: while
    /// the clock reads past `LATEST_PLAUSIBLE_CLOCK_NANOS`, time goes on
    /// from it by the monotonic clock (`wall_nanos`).
    last_plausible: Mutex<Option<(u64, Instant)>>,
    said_implausible: std::sync::atomic::AtomicBool,
    /// Held by the flusher while it writes a batch, and by whoever needs
    /// the log still between batches (an index checkpoint).
    quiet: Mutex<()>,
    /// The longest `wait_durable` waits (`Config::io_deadline`; zero: no
    /// limit), and the waits that ended there.
    deadline: Duration,
    deadline_errors: std::sync::atomic::AtomicU64,
    /// Write-through writes yield to reads this way; `None`: never.
    reads_first: Option<ReadsFirst>,
    /// The clock `last_read` and `LogState::yielding_since` are read on.
    epoch: Instant,
    /// When the latest read started, in nanoseconds since `epoch` plus one
    /// (0: none yet).
    last_read: std::sync::atomic::AtomicU64,
}

/// What the flusher should do next.
pub(crate) enum Work {
    Batch(Vec<QueuedWrite>),
    Stop,
}

impl WriteLog {
    /// A write log handing out `next_seq` on; with `clock`, sequence
    /// numbers follow the clock (see the field).
    pub fn with_clock(next_seq: u64, write_through: bool, clock: bool) -> Self {
        WriteLog {
            state: Mutex::new(LogState {
                next_seq,
                items: VecDeque::new(),
                processed_seq: next_seq - 1,
                handed_out: next_seq - 1,
                requested: false,
                shutdown: false,
                retrying: Ranges::default(),
                retrying_in_flight: 0,
                failed: Ranges::default(),
                last_error: None,
                attempts: 0,
                retry_at: None,
                dead: None,
                yielding_since: None,
                queued_bytes: 0,
            }),
            work: Condvar::new(),
            progress: Condvar::new(),
            write_through,
            clock,
            clock_offset_nanos: 0,
            last_plausible: Mutex::new(None),
            said_implausible: std::sync::atomic::AtomicBool::new(false),
            quiet: Mutex::new(()),
            deadline: Duration::ZERO,
            deadline_errors: std::sync::atomic::AtomicU64::new(0),
            reads_first: None,
            epoch: Instant::now(),
            last_read: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// Has write-through writes yield to reads by `rule` (`None`, or a
    /// zero `most` or `quiet`: never).
    pub fn set_reads_first(&mut self, rule: Option<ReadsFirst>) {
        self.reads_first = rule.filter(|r| !r.most.is_zero() && !r.quiet.is_zero());
    }

    /// A read starts (a get of any kind): write-back yields to it.
    pub fn note_read(&self) {
        if self.reads_first.is_some() {
            let nanos = u64::try_from(self.epoch.elapsed().as_nanos()).unwrap_or(u64::MAX - 1);
            self.last_read
                .store(nanos + 1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// How much longer the flusher holds a write-through batch back for
    /// reads; `None` to write it now.
    fn read_hold(&self, state: &mut LogState) -> Option<Duration> {
        let rule = self.reads_first?;
        if !self.write_through
            || state.requested
            || state.shutdown
            || state.queued_bytes >= rule.most_bytes
        {
            return None;
        }
        let now = self.epoch.elapsed();
        let since = *state.yielding_since.get_or_insert(now);
        let last_read = match self.last_read.load(std::sync::atomic::Ordering::Relaxed) {
            0 => None,
            nanos => Some(Duration::from_nanos(nanos - 1)),
        };
        rule.hold(now, last_read, since)
    }

    /// Bounds every wait for durability by `deadline` (zero: none).
    pub fn set_deadline(&mut self, deadline: Duration) {
        self.deadline = deadline;
    }

    /// Waits for durability that ended at the deadline since open.
    pub fn deadline_errors(&self) -> u64 {
        self.deadline_errors
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// While held, the flusher writes no batch (it takes this around each
    /// one).
    pub fn hold_flusher(&self) -> MutexGuard<'_, ()> {
        self.quiet
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    /// Sets this log's clock `secs` seconds off the wall clock (a test
    /// seam: a node whose clock is wrong).
    #[cfg(feature = "test-util")]
    pub fn set_clock_offset(&mut self, secs: i64) {
        self.clock_offset_nanos = secs.saturating_mul(1_000_000_000);
    }

    /// The wall clock as it reads (nanoseconds since the Unix epoch, 0
    /// before it), for the plausibility check at open; numbering uses
    /// `wall_nanos`.
    pub fn raw_wall_nanos(&self) -> u64 {
        raw_clock_nanos(self.clock_offset_nanos)
    }

    /// This node's wall clock in nanoseconds since the Unix epoch (0
    /// before it). A reading past `LATEST_PLAUSIBLE_CLOCK_NANOS` (a clock
    /// stepped into the 2250s by a bad NTP answer while the node runs) is
    /// not used: time goes on from the last plausible reading by the
    /// monotonic clock, with one warning, until the clock reads plausibly
    /// again. Numbered from such a reading, every later put of this node
    /// (and of every node following it) ran out of sequence numbers.
    pub fn wall_nanos(&self) -> u64 {
        let raw = self.raw_wall_nanos();
        let mut last = self
            .last_plausible
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if raw < LATEST_PLAUSIBLE_CLOCK_NANOS {
            *last = Some((raw, Instant::now()));
            return raw;
        }
        if !self
            .said_implausible
            .swap(true, std::sync::atomic::Ordering::Relaxed)
        {
            tracing::warn!(
                clock_ns = raw,
                "this node's wall clock reads past 2250: sequence numbers go on from its last \
                 plausible reading by the monotonic clock until it reads plausibly again"
            );
        }
        match *last {
            Some((at, when)) => at
                .saturating_add(u64::try_from(when.elapsed().as_nanos()).unwrap_or(u64::MAX))
                .min(LATEST_PLAUSIBLE_CLOCK_NANOS - 1),
            None => LATEST_PLAUSIBLE_CLOCK_NANOS - 1,
        }
    }

    /// Whether `seq`, another writer's number, reads further ahead of this
    /// node's wall clock than `MAX_CLOCK_AHEAD`: such a number is neither
    /// adopted by the clock nor indexed (one node whose clock read the
    /// year 2262 used to exhaust every other node's numbers for good).
    pub fn ahead_of_clock(&self, seq: u64) -> bool {
        self.clock && seq > self.wall_nanos().saturating_add(MAX_CLOCK_AHEAD_NANOS)
    }

    /// Another writer's sequence number was read: later numbers of this
    /// log outrank it (a hybrid logical clock's receive step), unless it
    /// reads too far ahead of this node's clock (`ahead_of_clock`).
    pub fn observe(&self, seq: u64) {
        if !self.clock || self.ahead_of_clock(seq) {
            return;
        }
        let mut state = self.lock();
        if seq < crate::disk::format::MAX_SEQ && state.next_seq <= seq {
            state.next_seq = seq + 1;
        }
    }

    fn lock(&self) -> MutexGuard<'_, LogState> {
        self.state.lock().unwrap()
    }

    /// Runs `f` with the next sequence number, under the log's lock (so
    /// index updates made in `f` happen in sequence order), and queues the
    /// write it returns, if any. Returns the sequence number used.
    pub fn append(&self, f: impl FnOnce(u64) -> Option<QueuedWrite>) -> Result<u64> {
        let mut state = self.lock();
        if let Some(why) = &state.dead {
            return Err(dead_error(why));
        }
        if self.clock {
            // Physical time as the floor, so numbers of writers that never
            // read each other still order as their clocks do.
            state.next_seq = state.next_seq.max(self.wall_nanos());
        }
        let seq = state.next_seq;
        if seq > crate::disk::format::MAX_SEQ {
            return Err(crate::Error::new(
                crate::ErrorKind::Corruption,
                "sequence numbers exhausted (2^63 puts)",
            ));
        }
        state.next_seq += 1;
        state.handed_out = seq;
        if let Some(item) = f(seq) {
            state.queued_bytes += item.value_bytes();
            state.items.push_back(item);
        }
        Ok(seq)
    }

    /// Runs `f` with the next sequence number to hand out, which `f` may
    /// advance (the reclaimer renumbering carried entries).
    pub fn with_next_seq<R>(&self, f: impl FnOnce(&mut u64) -> R) -> R {
        let mut state = self.lock();
        let before = state.next_seq;
        let result = f(&mut state.next_seq);
        if state.next_seq > before {
            state.handed_out = state.handed_out.max(state.next_seq - 1);
        }
        result
    }

    pub fn next_seq(&self) -> u64 {
        self.lock().next_seq
    }

    /// The number below which this log will write no record from now on
    /// (what a shared-directory writer publishes, docs/design.md "The
    /// floor"): one past every write already durable, failed or never a
    /// disk write; every write queued, being written or being retried is
    /// at or above it. With nothing on its way (no write queued, every
    /// number handed to a write processed), every number below the next
    /// one is processed; with a clock, the clock is moved to now first (as
    /// the next `append` would), so an idle writer's floor follows time
    /// instead of its last write. Numbers the clock adopted from other
    /// writers (`observe`) are no writes of this log: before, they made a
    /// log that only follows look busy for good, and its floor froze at
    /// its last write (issue 61, finding 3).
    pub fn write_floor(&self) -> u64 {
        let mut state = self.lock();
        let idle = state.items.is_empty() && state.processed_seq >= state.handed_out;
        if idle {
            if self.clock {
                let now = self.wall_nanos();
                if now > state.next_seq && now <= crate::disk::format::MAX_SEQ {
                    state.next_seq = now;
                }
            }
            state.processed_seq = state.next_seq - 1;
        }
        state.processed_seq + 1
    }

    /// Wakes the flusher; with `request`, asks it to write even under the
    /// on-demand policy.
    pub fn wake(&self, request: bool) {
        let mut state = self.lock();
        if request {
            state.requested = true;
        }
        self.work.notify_one();
    }

    /// Waits until writes `low..=high` are durable; an error as soon as any
    /// of them is retrying or failed, or the flusher is dead, and an error
    /// of kind `TimedOut` once the deadline passes (the writes stay queued:
    /// a file system that stopped answering may come back).
    pub fn wait_durable(&self, low: u64, high: u64) -> Result<()> {
        self.wake(true);
        let until = (!self.deadline.is_zero()).then(|| Instant::now() + self.deadline);
        let mut state = self.lock();
        loop {
            if let Some(why) = &state.dead {
                return Err(dead_error(why));
            }
            if state.failed.intersects(low, high) {
                return Err(failure_error(&state, "could not be made durable"));
            }
            // Writes become durable in sequence order, so one stuck in
            // retries before `high` holds these back too: say so now
            // rather than wait for a disk that may not heal.
            if state.retrying.intersects(0, high) {
                return Err(failure_error(
                    &state,
                    "(or one queued before it) failed to reach the disk and is being retried",
                ));
            }
            if state.processed_seq >= high {
                return Ok(());
            }
            let Some(until) = until else {
                state = self.progress.wait(state).unwrap();
                continue;
            };
            let now = Instant::now();
            if now >= until {
                self.deadline_errors
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                return Err(Error::io(
                    format!(
                        "writes up to {high} were not durable within the storage deadline \
                         (io_deadline, {:?}): the file system is not answering. They stay \
                         queued, readable from memory, and are written when it answers; \
                         flush again to know",
                        self.deadline
                    ),
                    std::io::Error::from(std::io::ErrorKind::TimedOut),
                ));
            }
            state = self.progress.wait_timeout(state, until - now).unwrap().0;
        }
    }

    /// Waits until everything appended so far is durable (see
    /// `wait_durable`).
    pub fn flush(&self) -> Result<()> {
        let target = self.lock().next_seq - 1;
        if target == 0 {
            return Ok(());
        }
        self.wait_durable(1, target)
    }

    /// Waits at most `timeout` for the flusher to make progress (a put
    /// waiting for pool space).
    pub fn wait_progress(&self, timeout: Duration) {
        let state = self.lock();
        let _unused = self.progress.wait_timeout(state, timeout).unwrap();
    }

    /// Asks the flusher to drain the queue and stop.
    pub fn shut_down(&self) {
        let mut state = self.lock();
        state.shutdown = true;
        self.work.notify_all();
    }

    /// Called (once) when the flusher thread dies: every waiter and every
    /// later write gets an error naming why.
    pub fn mark_dead(&self, why: String) {
        let mut state = self.lock();
        state.dead = Some(why);
        self.progress.notify_all();
    }

    /// The state at close: an error if any write could not be made durable.
    pub fn close_result(&self) -> Result<()> {
        let state = self.lock();
        if let Some(why) = &state.dead {
            return Err(dead_error(why));
        }
        if state.failed.count() > 0 || !state.items.is_empty() {
            return Err(failure_error(&state, "could not be made durable"));
        }
        Ok(())
    }

    /// Writes that failed an attempt and are waiting for the next one.
    pub fn retrying_writes(&self) -> u64 {
        // Counted by item: sequence numbers may leave gaps (clock mode).
        let state = self.lock();
        let queued = state
            .items
            .iter()
            .filter(|item| state.retrying.intersects(item.seq(), item.seq()))
            .count() as u64;
        queued + state.retrying_in_flight
    }

    // ---- the flusher's side ----

    /// Blocks until there is a batch to write, and takes it: items from the
    /// front while `fits(item, taken)` says so (the first always). Publishes
    /// progress whenever the queue is empty. `Stop` once shut down and
    /// drained.
    pub fn next_batch(&self, mut fits: impl FnMut(&QueuedWrite, &[QueuedWrite]) -> bool) -> Work {
        let mut state = self.lock();
        loop {
            if state.items.is_empty() {
                state.processed_seq = state.next_seq - 1;
                state.requested = false;
                state.yielding_since = None;
                self.progress.notify_all();
                if state.shutdown {
                    return Work::Stop;
                }
            } else if self.write_through || state.requested || state.shutdown {
                let wait = state
                    .retry_at
                    .filter(|_| !state.shutdown)
                    .map(|at| at.saturating_duration_since(Instant::now()))
                    .filter(|d| !d.is_zero())
                    .or_else(|| self.read_hold(&mut state));
                match wait {
                    Some(wait) => {
                        state = self.work.wait_timeout(state, wait).unwrap().0;
                        continue;
                    }
                    None => {
                        let mut taken: Vec<QueuedWrite> = Vec::new();
                        while let Some(item) = state.items.front() {
                            if !taken.is_empty() && !fits(item, &taken) {
                                break;
                            }
                            let item = state.items.pop_front().expect("front exists");
                            state.queued_bytes -= item.value_bytes();
                            taken.push(item);
                        }
                        let retrying = &state.retrying;
                        state.retrying_in_flight = taken
                            .iter()
                            .filter(|item| retrying.intersects(item.seq(), item.seq()))
                            .count() as u64;
                        return Work::Batch(taken);
                    }
                }
            }
            state = self.work.wait(state).unwrap();
        }
    }

    /// Reports how a batch from `next_batch` went. On failure the batch
    /// goes back to the queue's front for another attempt, or, once the
    /// store is shutting down, is returned as given up (its writes count
    /// as failed).
    pub fn finish_batch(
        &self,
        batch: Vec<QueuedWrite>,
        outcome: std::result::Result<(), Error>,
    ) -> Vec<QueuedWrite> {
        let (Some(low), Some(high)) = (
            batch.first().map(QueuedWrite::seq),
            batch.last().map(QueuedWrite::seq),
        ) else {
            return Vec::new();
        };
        let mut state = self.lock();
        state.retrying_in_flight = 0;
        let given_up = match outcome {
            Ok(()) => {
                state.retrying.remove(low, high);
                state.attempts = 0;
                state.retry_at = None;
                Vec::new()
            }
            Err(error) => {
                state.attempts += 1;
                state.last_error = Some(error);
                if !state.shutdown {
                    state.retrying.add(low, high);
                    state.retry_at = Some(Instant::now() + backoff(state.attempts));
                    for item in batch.into_iter().rev() {
                        state.queued_bytes += item.value_bytes();
                        state.items.push_front(item);
                    }
                    Vec::new()
                } else {
                    state.retrying.remove(low, high);
                    state.failed.add(low, high);
                    state.attempts = 0;
                    state.retry_at = None;
                    batch
                }
            }
        };
        state.processed_seq = state
            .items
            .front()
            .map_or(state.next_seq - 1, |item| item.seq() - 1);
        if state.items.is_empty() {
            // A request to write what was queued is met: cleared here, with
            // the progress its waiter sees, so a write queued after that
            // waiter returns is not written as if it were asked for.
            state.requested = false;
            state.yielding_since = None;
        }
        self.progress.notify_all();
        given_up
    }
}

/// The wall clock as it reads, in nanoseconds since the Unix epoch (0
/// before it), moved by `offset_nanos` (a test seam; 0 otherwise): what the
/// plausibility check at open and a log's numbering both start from.
pub(crate) fn raw_clock_nanos(offset_nanos: i64) -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| u64::try_from(d.as_nanos()).unwrap_or(u64::MAX))
        .saturating_add_signed(offset_nanos)
}

fn dead_error(why: &str) -> Error {
    Error::new(
        ErrorKind::Io,
        format!("the flusher thread died ({why}): nothing more can be written to disk; reopen the store"),
    )
}

fn failure_error(state: &LogState, what: &str) -> Error {
    let last = state
        .last_error
        .as_ref()
        .map(|e| e.to_string())
        .unwrap_or_default();
    Error::new(
        ErrorKind::Io,
        format!("a write this call covers {what} (last error: {last})"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A log that only follows other writers: the numbers its clock
    /// adopts from them are no writes of its own, so its floor moves past
    /// them (it froze at its last write before: issue 61, finding 3); a
    /// write queued or in flight still holds it.
    #[test]
    fn a_following_logs_floor_passes_the_numbers_it_observed() {
        let log = WriteLog::with_clock(1, true, true);
        let now = log.wall_nanos();
        let seen = now + 1_000_000_000; // another writer's, a second ahead
        log.observe(seen);
        assert!(
            log.write_floor() > seen,
            "an idle floor passes what it observed"
        );
        // A put queued after that holds the floor at its number.
        let seq = log
            .append(|seq| {
                Some(QueuedWrite::Tombstone {
                    digest: crate::key::KeyDigest(1),
                    key: Box::from(&b"k"[..]),
                    seq,
                })
            })
            .unwrap();
        assert!(seq > seen);
        // At or below it whatever the clock did between the two calls (a
        // busy machine may pause between them), and still past `seen`.
        let held = log.write_floor();
        assert!(seen < held && held <= seq, "a queued write holds the floor");
        log.observe(seq + 1_000);
        assert_eq!(
            log.write_floor(),
            held,
            "observing does not release a queued write"
        );
    }
    use proptest::prelude::*;

    fn tombstone(seq: u64) -> Option<QueuedWrite> {
        Some(QueuedWrite::Tombstone {
            digest: crate::key::KeyDigest(u128::from(seq)),
            key: Box::from(&b"k"[..]),
            seq,
        })
    }

    /// Issue 39, finding 5: the clock stepped into the 2260s while the
    /// node runs. Its puts were numbered from that reading, past 2^63
    /// ("sequence numbers exhausted") for good; now numbering goes on from
    /// the last plausible reading, and follows the clock once it is back.
    #[cfg(feature = "test-util")]
    #[test]
    fn a_clock_stepped_past_2250_while_running_never_exhausts_the_numbers() {
        let mut log = WriteLog::with_clock(1, false, true);
        let before = log.append(tombstone).unwrap();
        let now_secs = (log.wall_nanos() / 1_000_000_000) as i64;
        // The year 2262 and a bit: past 2^63 ns.
        log.set_clock_offset(9_300_000_000 - now_secs);
        let during: Vec<u64> = (0..3).map(|_| log.append(tombstone).unwrap()).collect();
        assert!(during[0] > before && during[0] < LATEST_PLAUSIBLE_CLOCK_NANOS);
        assert!(during.windows(2).all(|w| w[1] > w[0]));
        assert!(!log.ahead_of_clock(before + 1_000_000_000));
        log.set_clock_offset(0);
        let after = log.append(tombstone).unwrap();
        assert!(after > during[2], "numbers never go back");
        assert!(after < LATEST_PLAUSIBLE_CLOCK_NANOS);
    }

    /// The published floor never passes a write that is queued, being
    /// written or being retried, and follows the clock once nothing is on
    /// its way.
    #[test]
    fn the_write_floor_stays_at_or_below_every_write_on_its_way() {
        let log = WriteLog::with_clock(1, false, true);
        let idle = log.write_floor();
        let now = log.wall_nanos();
        assert!(
            idle > 1 && idle <= now,
            "an idle writer's floor follows its clock"
        );
        let first = log.append(tombstone).unwrap();
        let second = log.append(tombstone).unwrap();
        assert!(first >= idle && second > first);
        let queued = log.write_floor();
        assert!(
            idle <= queued && queued <= first,
            "queued under on-demand flush"
        );
        log.wake(true);
        let Work::Batch(batch) = log.next_batch(|_, _| true) else {
            panic!("no batch")
        };
        assert_eq!(log.write_floor(), queued, "being written");
        let back = log.finish_batch(batch, Err(crate::Error::new(ErrorKind::Io, "disk gone")));
        assert!(back.is_empty());
        assert_eq!(
            log.write_floor(),
            first,
            "being retried: the batch is back at the front"
        );
        let third = log.append(tombstone).unwrap();
        let Work::Batch(batch) = log.next_batch(|_, _| true) else {
            panic!("no batch")
        };
        assert_eq!(batch.len(), 3);
        log.finish_batch(batch, Ok(()));
        let after = log.write_floor();
        assert!(after > third, "everything written: past the last write");
        let fourth = log.append(tombstone).unwrap();
        assert!(
            fourth >= after,
            "a later write is numbered at or above the floor"
        );
    }

    /// A write-through log that holds writes for reads for an hour: the
    /// flusher's side blocks behind a read until something that waits for
    /// the disk asks, or the log shuts down.
    #[test]
    fn a_held_batch_goes_at_once_when_asked_for_or_at_shutdown() {
        let hour = Duration::from_secs(3600);
        for release in ["request", "shutdown"] {
            let mut log = WriteLog::with_clock(1, true, false);
            log.set_reads_first(Some(ReadsFirst {
                quiet: hour,
                most: hour,
                most_bytes: u64::MAX,
            }));
            let log = Arc::new(log);
            log.note_read();
            log.append(tombstone).unwrap();
            let flusher = {
                let log = Arc::clone(&log);
                std::thread::spawn(move || match log.next_batch(|_, _| true) {
                    Work::Batch(batch) => batch.len(),
                    Work::Stop => 0,
                })
            };
            // Held: a later write joins the same batch.
            std::thread::sleep(Duration::from_millis(20));
            log.append(tombstone).unwrap();
            assert!(!flusher.is_finished(), "{release}: written behind a read");
            match release {
                "request" => log.wake(true),
                _ => log.shut_down(),
            }
            assert_eq!(flusher.join().unwrap(), 2, "{release}");
        }
    }

    /// Without a read, or with the rule off, a write-through batch is taken
    /// at once.
    #[test]
    fn writes_are_not_held_without_a_read_or_a_rule() {
        let hour = Duration::from_secs(3600);
        for (rule, read) in [
            (Some(hour), false),
            (Some(Duration::ZERO), true),
            (None, true),
        ] {
            let mut log = WriteLog::with_clock(1, true, false);
            log.set_reads_first(rule.map(|most| ReadsFirst {
                quiet: hour,
                most,
                most_bytes: u64::MAX,
            }));
            if read {
                log.note_read();
            }
            log.append(tombstone).unwrap();
            let Work::Batch(batch) = log.next_batch(|_, _| true) else {
                panic!("no batch")
            };
            assert_eq!(batch.len(), 1);
        }
    }

    proptest! {
        /// `ReadsFirst::hold` holds a batch only while a read started within
        /// `quiet` and the queue has waited less than `most`, never past
        /// either, and waiting out what it says releases the batch unless
        /// a read started meanwhile.
        #[test]
        fn the_read_hold_is_bounded_by_quiet_and_most(
            quiet in 1u64..1_000, most in 1u64..5_000, since in 0u64..10_000,
            read in proptest::option::of(0u64..10_000), later in 0u64..10_000,
        ) {
            let ms = Duration::from_millis;
            let rule = ReadsFirst { quiet: ms(quiet), most: ms(most), most_bytes: u64::MAX };
            let now = ms(since + later);
            let last_read = read.map(ms);
            let held = rule.hold(now, last_read, ms(since));
            let expect_held = later < most
                && read.is_some_and(|r| (since + later).saturating_sub(r) < quiet);
            prop_assert_eq!(held.is_some(), expect_held);
            if let Some(wait) = held {
                prop_assert!(!wait.is_zero());
                prop_assert!(wait <= ms(most - later));
                prop_assert!(wait <= ms(quiet));
                // (A read "after" `now` is one that started meanwhile.)
                if read.is_some_and(|r| r <= since + later) {
                    prop_assert_eq!(rule.hold(now + wait, last_read, ms(since)), None);
                }
            }
        }

        /// `Ranges` agrees with a plain set of numbers under any adds and
        /// removes.
        #[test]
        fn ranges_match_a_set(ops in proptest::collection::vec((any::<bool>(), 0u64..60, 0u64..8), 0..40)) {
            let mut ranges = Ranges::default();
            let mut set = std::collections::BTreeSet::new();
            for (add, lo, len) in ops {
                let hi = lo + len;
                if add {
                    ranges.add(lo, hi);
                    set.extend(lo..=hi);
                } else {
                    ranges.remove(lo, hi);
                    for n in lo..=hi {
                        set.remove(&n);
                    }
                }
                prop_assert_eq!(ranges.count(), set.len() as u64);
                for probe in 0..70u64 {
                    prop_assert_eq!(ranges.intersects(probe, probe), set.contains(&probe));
                }
            }
        }
    }
}
