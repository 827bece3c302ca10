//! Reads with a deadline: values in files on a file system that can stall
//! (`super::mount`), read so that the caller's answer never waits longer
//! than `Config::io_deadline` and a read that outlives it can never land
//! in memory the caller has taken back.
//!
//! A bounded batch is read on a thread of its own, through `pread` (never
//! an io_uring ring, which a read stuck in the kernel would hold, and
//! with it every read sent to that ring), into buffers of the store's own;
//! the caller waits for it until the deadline. Done in time: the verified
//! values are copied into the caller's destinations. Past it: the caller
//! answers a miss for each value of the batch and forgets the batch; the
//! thread keeps the buffers until the kernel returns the reads (a FUSE or
//! NFS read cannot be cancelled), then frees them. Reads held past their
//! deadline are counted; while too many are, new bounded batches answer
//! misses at once instead of tying up a thread and buffers each.
//!
//! A batch of values in buffered files (network and FUSE file systems in
//! the default read mode) is **streamed** instead: its thread reads the
//! values one after another, in order, in pieces of `STREAM_PIECE` into a
//! buffer of its own, copies each piece into the caller's destination
//! (with non-temporal stores for a batch too large to stay in the caches,
//! `bulk_copy::worth_streaming`) and checksums it there while it is in
//! the core's cache, and gives each value its verdict when its last piece
//! is in. So a value's bytes cross memory as often as in a plain
//! program's `read` (the piece buffer stays in cache), on one core, and
//! the file is read as one sequential stream, as readahead likes it. The
//! bound is the same: a `pread` only ever writes the thread's buffer; the
//! thread copies into the caller's memory only while the caller waits
//! (the destinations are lent to it, and every copy holds the batch's
//! lock); a caller past its deadline takes the lock, gives the batch up,
//! zeroes what was copied of values without a verdict and answers them
//! as misses, and the thread, when its read returns, finds the batch
//! given up and leaves.

use super::read::{Destination, ReadOutcome, ValueRead, ValueReader};
use crate::error::Error;
use crate::io::{AlignedBuf, ReadOp};
use crate::key::ValueChecksum;
use crate::units::{page_round_up, PAGE_SIZE};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

/// Bytes per piece of a streamed value read: read into the thread's own
/// buffer, then copied out and checksummed while it is still in the
/// core's cache (a core's L2 is 512 KiB to 2 MiB). Measured on this
/// project's VM (2 cores, 2 MiB L2 each) with a probe program that does
/// what this thread does (one JuiceFS mount, one 16 MiB value, ratio to
/// one plain `pread`), warm: 64 KiB 0.89, 128 KiB 0.93, 256 KiB 0.95,
/// 512 KiB 0.96, 1 MiB 0.95; cold: 256 KiB 0.95, 512 KiB 0.98, 1 MiB 0.89,
/// 2 MiB 0.90.
const STREAM_PIECE: usize = 512 << 10;

/// Bounded batches that may be held past their deadline at once before
/// new ones answer misses without reading: each holds a thread (parked in
/// the kernel) and its buffers.
pub(crate) const MAX_STUCK_BATCHES: u64 = 64;
/// Buffer bytes that may be held by reads past their deadline before new
/// bounded batches answer misses without reading.
pub(crate) const MAX_STUCK_BYTES: u64 = 1 << 30;

/// What the disk tier's bounded reads have seen of stalls, for stats.
#[derive(Debug, Default)]
pub(crate) struct StallCounters {
    /// Values answered as a miss because their read passed the deadline
    /// (or was not started while too many were held past it).
    pub deadline_misses: AtomicU64,
    /// Times reads went from all answering to some held past the deadline.
    pub stalls: AtomicU64,
}

#[derive(Debug, Default)]
struct Stuck {
    batches: u64,
    bytes: u64,
    /// When the oldest batch still held past its deadline was given up.
    since: Option<Instant>,
}

/// The bounded reader of one disk tier.
#[derive(Debug)]
pub(crate) struct BoundedReads {
    reader: Arc<ValueReader>,
    deadline: Duration,
    stuck: Arc<Mutex<Stuck>>,
    pub counters: Arc<StallCounters>,
}

enum JobState {
    Running,
    Done(Vec<Option<ReadOutcome>>, Vec<Option<AlignedBuf>>),
    /// The caller gave up on it; the thread releases what it holds.
    Abandoned,
}

struct Job {
    state: Mutex<JobState>,
    finished: Condvar,
    /// Buffer bytes the batch holds.
    bytes: u64,
}

/// A bounded batch started by [`BoundedReads::start`].
pub(crate) struct Pending(Started);

enum Started {
    /// Nothing to read in this batch.
    Empty,
    Running {
        job: Arc<Job>,
        deadline: Instant,
        limit: Duration,
        stuck: Arc<Mutex<Stuck>>,
        counters: Arc<StallCounters>,
        reader: Arc<ValueReader>,
    },
    /// Values of buffered files, streamed piece by piece.
    Streaming {
        stream: Stream,
        deadline: Instant,
        limit: Duration,
    },
    /// Not started: too many reads are held past their deadline.
    Refused(Arc<StallCounters>),
    /// Not started: no thread could be made for it.
    Failed(String),
}

impl BoundedReads {
    pub(crate) fn new(reader: ValueReader, deadline: Duration) -> Self {
        BoundedReads {
            reader: Arc::new(reader),
            deadline,
            stuck: Arc::default(),
            counters: Arc::default(),
        }
    }

    /// Batches held past their deadline now, and their buffer bytes.
    pub(crate) fn stuck(&self) -> (u64, u64) {
        let stuck = self.stuck.lock().unwrap();
        (stuck.batches, stuck.bytes)
    }

    /// Starts reading every `Some` of `reads` on a thread of its own.
    pub(crate) fn start(&self, reads: &[Option<ValueRead>]) -> Pending {
        if reads.iter().all(Option::is_none) {
            return Pending(Started::Empty);
        }
        {
            let stuck = self.stuck.lock().unwrap();
            if stuck.batches >= MAX_STUCK_BATCHES || stuck.bytes >= MAX_STUCK_BYTES {
                return Pending(Started::Refused(Arc::clone(&self.counters)));
            }
        }
        if reads.iter().flatten().all(|r| !r.region.direct_io()) {
            return self.start_streamed(reads);
        }
        let mut bufs: Vec<Option<AlignedBuf>> = reads
            .iter()
            .map(|r| {
                r.as_ref().map(|r| {
                    self.reader
                        .bounce
                        .take(page_round_up(r.len as u64) as usize)
                })
            })
            .collect();
        let bytes = bufs.iter().flatten().map(|b| b.len() as u64).sum();
        let job = Arc::new(Job {
            state: Mutex::new(JobState::Running),
            finished: Condvar::new(),
            bytes,
        });
        let reads = reads.to_vec();
        let (thread_job, reader, stuck, counters) = (
            Arc::clone(&job),
            Arc::clone(&self.reader),
            Arc::clone(&self.stuck),
            Arc::clone(&self.counters),
        );
        let deadline = Instant::now() + self.deadline;
        let spawned = std::thread::Builder::new()
            .name("kvtier-bounded-read".into())
            .spawn(move || {
                let outcomes = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    let mut dests: Vec<&mut [u8]> = bufs
                        .iter_mut()
                        .map(|b| match b {
                            Some(b) => b.as_mut_slice(),
                            None => &mut [][..],
                        })
                        .collect();
                    // Memory no caller sees: the verdict is final.
                    reader.read_checked(&reads, &mut dests, false)
                }))
                .unwrap_or_else(|_| {
                    reads
                        .iter()
                        .map(|r| {
                            r.as_ref().map(|_| {
                                ReadOutcome::Failed(Error::io(
                                    "a bounded read",
                                    std::io::Error::other("the read thread panicked"),
                                ))
                            })
                        })
                        .collect()
                });
                let mut state = thread_job.state.lock().unwrap();
                match *state {
                    JobState::Running => {
                        *state = JobState::Done(outcomes, bufs);
                        thread_job.finished.notify_all();
                    }
                    JobState::Abandoned | JobState::Done(..) => {
                        drop(state);
                        for buf in bufs.into_iter().flatten() {
                            reader.bounce.give_back(buf);
                        }
                        release(&stuck, &counters, thread_job.bytes);
                    }
                }
            });
        match spawned {
            Ok(_) => Pending(Started::Running {
                job,
                deadline,
                limit: self.deadline,
                stuck: Arc::clone(&self.stuck),
                counters: Arc::clone(&self.counters),
                reader: Arc::clone(&self.reader),
            }),
            Err(e) => Pending(Started::Failed(format!(
                "could not start a read thread: {e}"
            ))),
        }
    }
}

impl BoundedReads {
    /// Starts streaming every `Some` of `reads` (values of buffered files)
    /// on a thread of its own.
    fn start_streamed(&self, reads: &[Option<ValueRead>]) -> Pending {
        let deadline = Instant::now() + self.deadline;
        match spawn_stream(&self.reader, &self.stuck, &self.counters, reads) {
            Ok(stream) => Pending(Started::Streaming {
                stream,
                deadline,
                limit: self.deadline,
            }),
            Err(why) => Pending(Started::Failed(why)),
        }
    }
}

/// Starts the thread of a streamed batch.
fn spawn_stream(
    reader: &Arc<ValueReader>,
    stuck: &Arc<Mutex<Stuck>>,
    counters: &Arc<StallCounters>,
    reads: &[Option<ValueRead>],
) -> Result<Stream, String> {
    let shared = Arc::new(StreamShared {
        state: Mutex::new(StreamState {
            phase: StreamPhase::Running,
            sink: None,
            outcomes: reads.iter().map(|_| None).collect(),
            copied: vec![0; reads.len()],
        }),
        changed: Condvar::new(),
    });
    let bytes = STREAM_PIECE as u64;
    let reads_owned = reads.to_vec();
    let (thread_shared, thread_reader, thread_stuck, thread_counters) = (
        Arc::clone(&shared),
        Arc::clone(reader),
        Arc::clone(stuck),
        Arc::clone(counters),
    );
    std::thread::Builder::new()
        .name("kvtier-bounded-read".into())
        .spawn(move || {
            let reader = thread_reader;
            let mut buf = reader.bounce.take(STREAM_PIECE);
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                stream_values(&reader, &reads_owned, &mut buf, &thread_shared)
            }));
            reader.bounce.give_back(buf);
            let mut state = thread_shared.lock();
            if matches!(state.phase, StreamPhase::Abandoned) {
                drop(state);
                release(&thread_stuck, &thread_counters, bytes);
            } else {
                state.phase = StreamPhase::Done;
                thread_shared.changed.notify_all();
            }
        })
        .map_err(|e| format!("could not start a read thread: {e}"))?;
    Ok(Stream {
        shared,
        bytes,
        stuck: Arc::clone(stuck),
        counters: Arc::clone(counters),
    })
}

/// The caller's end of a streamed batch.
struct Stream {
    shared: Arc<StreamShared>,
    /// Buffer bytes the thread holds.
    bytes: u64,
    stuck: Arc<Mutex<Stuck>>,
    counters: Arc<StallCounters>,
}

/// What a streamed batch's caller and thread share.
struct StreamShared {
    state: Mutex<StreamState>,
    /// Signalled when the caller hands its destinations over, and when the
    /// thread gives a value its verdict or leaves.
    changed: Condvar,
}

impl StreamShared {
    /// The state, whatever panicked while holding it: every field is
    /// written whole, and `copied` before the bytes it counts.
    fn lock(&self) -> std::sync::MutexGuard<'_, StreamState> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

struct StreamState {
    phase: StreamPhase,
    /// The caller's destinations, from when it waits for the batch
    /// (`Stream::finish`) until it stops waiting: the thread copies into
    /// them only with this state locked and the phase `Running`.
    sink: Option<SinkPtr>,
    /// Each value's verdict, given by the thread.
    outcomes: Vec<Option<ReadOutcome>>,
    /// Bytes of each value's destination the thread may have written since
    /// they were last all zeroes or the value's verified bytes.
    copied: Vec<usize>,
}

enum StreamPhase {
    Running,
    /// The thread read every value and left.
    Done,
    /// The caller gave up on it; the thread uncounts it when it leaves.
    Abandoned,
}

/// Where the thread of a streamed batch copies values to.
trait Sink {
    /// Copies `bytes` into value `value`'s destination from byte `at` on.
    fn fill(&mut self, value: usize, at: usize, bytes: &[u8]);
    /// Zeroes the first `len` bytes of value `value`'s destination.
    fn zero(&mut self, value: usize, len: usize);
}

/// A batch's destinations as the thread sees them.
struct Dests<'a, D> {
    dests: &'a mut [D],
    /// Copy with non-temporal stores (`bulk_copy::worth_streaming`).
    streamed: bool,
}

impl<D: Destination> Sink for Dests<'_, D> {
    fn fill(&mut self, value: usize, at: usize, bytes: &[u8]) {
        if self.streamed {
            self.dests[value].fill_at_streamed(at, bytes);
        } else {
            self.dests[value].fill_at(at, bytes);
        }
    }

    fn zero(&mut self, value: usize, len: usize) {
        if len > 0 {
            self.dests[value].fill_at(0, &vec![0; len]);
        }
    }
}

/// A caller's `&mut dyn Sink` with its lifetime erased, so that the
/// thread can hold it in the shared state. The caller puts it there when
/// it starts waiting and takes it out (`SinkLent`'s drop) before it
/// returns, each with the state locked, and the thread uses it only with
/// the state locked in between: so every use falls within the borrow.
struct SinkPtr(NonNull<dyn Sink + Send + 'static>);

// SAFETY: the sink is `Send` (every `Destination` is), and it is used by
// one thread at a time: by the stream's thread only with the state locked
// while the caller waits, by the caller only once it has taken it back.
unsafe impl Send for SinkPtr {}

/// The caller's destinations lent to the thread; taken back when dropped
/// (on every way out of `Stream::finish`, a panic included).
struct SinkLent<'s> {
    shared: &'s StreamShared,
}

impl<'s> SinkLent<'s> {
    fn lend(shared: &'s StreamShared, sink: &mut (dyn Sink + Send + '_)) -> Self {
        let ptr = NonNull::from(sink);
        // SAFETY: only the lifetime changes; `Drop` takes the pointer back
        // out of the state before the borrow it was made from ends (see
        // `SinkPtr`).
        let ptr: NonNull<dyn Sink + Send + 'static> = unsafe { std::mem::transmute(ptr) };
        shared.lock().sink = Some(SinkPtr(ptr));
        shared.changed.notify_all();
        SinkLent { shared }
    }
}

impl Drop for SinkLent<'_> {
    fn drop(&mut self) {
        self.shared.lock().sink = None;
    }
}

/// The caller went away: stop reading.
struct CallerGone;

/// How a value's stream ended.
enum Streamed {
    /// Every byte copied out and the checksum matched.
    Verified,
    /// Every byte copied out, and the checksum did not match (what was
    /// copied has been zeroed).
    Mismatch,
    /// Could not be read (what was copied has been zeroed).
    Failed(ReadOutcome),
}

/// The thread of a streamed batch: each value in order, piece by piece;
/// a value that does not verify is dropped from the page cache (it may
/// hold a copy read before another writer's bytes landed) and streamed
/// once more before it is called damaged.
fn stream_values(
    reader: &ValueReader,
    reads: &[Option<ValueRead>],
    buf: &mut AlignedBuf,
    shared: &StreamShared,
) -> Result<(), CallerGone> {
    for (value, read) in reads.iter().enumerate() {
        let Some(read) = read else { continue };
        let outcome = match stream_value(reader, value, read, buf, shared)? {
            Streamed::Verified => ReadOutcome::Verified,
            Streamed::Failed(outcome) => outcome,
            Streamed::Mismatch => {
                let offset = u64::from(read.loc.page()) * PAGE_SIZE;
                super::mount::drop_cached(
                    &read.region.file,
                    offset,
                    page_round_up(read.len as u64),
                );
                match stream_value(reader, value, read, buf, shared)? {
                    Streamed::Verified => {
                        tracing::debug!(
                            value,
                            "a buffered read did not verify from the page cache but did from \
                             the file system: a stale cached copy was dropped"
                        );
                        ReadOutcome::Verified
                    }
                    Streamed::Failed(outcome) => outcome,
                    Streamed::Mismatch => {
                        ReadOutcome::Rejected("checksum or key digest mismatch".into())
                    }
                }
            }
        };
        let mut state = shared.lock();
        if matches!(state.phase, StreamPhase::Abandoned) {
            return Err(CallerGone);
        }
        state.outcomes[value] = Some(outcome);
        shared.changed.notify_all();
    }
    Ok(())
}

/// Streams one value: each piece read into `buf` (the only memory a read
/// that outlives the deadline can write), then copied into the caller's
/// destination if the caller still waits, then checksummed while it is
/// still in this core's cache.
fn stream_value(
    reader: &ValueReader,
    value: usize,
    read: &ValueRead,
    buf: &mut AlignedBuf,
    shared: &StreamShared,
) -> Result<Streamed, CallerGone> {
    let offset = u64::from(read.loc.page()) * PAGE_SIZE;
    let mut checksum = ValueChecksum::new(read.digest);
    let mut at = 0;
    while at < read.len {
        let len = (read.len - at).min(STREAM_PIECE);
        let mut ops = [ReadOp::new(
            &read.region.file,
            offset + at as u64,
            &mut buf.as_mut_slice()[..len],
        )];
        reader.engine.read_batch_then(&mut ops, &|_, _| {});
        let [op] = ops;
        if let Err(e) = op.result {
            zero_copied(shared, value)?;
            return Ok(Streamed::Failed(
                if e.kind() == std::io::ErrorKind::UnexpectedEof {
                    ReadOutcome::Rejected(format!(
                        "value lies past the end of its region file: {e}"
                    ))
                } else {
                    ReadOutcome::Failed(Error::io(
                        format!(
                            "reading region {} page {}",
                            read.loc.region(),
                            read.loc.page()
                        ),
                        e,
                    ))
                },
            ));
        }
        let bytes = &buf.as_slice()[..len];
        {
            let mut state = lent_sink(shared)?;
            state.copied[value] = at + len;
            let sink = state.sink.as_mut().expect("lent_sink returns a lent sink");
            // SAFETY: the sink is lent and the state locked (`SinkPtr`).
            unsafe { sink.0.as_mut() }.fill(value, at, bytes);
        }
        // The thread never writes `buf` between the copy and this: the
        // bytes verified are the bytes copied.
        checksum.update(bytes);
        at += len;
    }
    if checksum.finish() == read.checksum {
        Ok(Streamed::Verified)
    } else {
        zero_copied(shared, value)?;
        Ok(Streamed::Mismatch)
    }
}

/// The state, locked, once the caller's destinations are lent to the
/// thread; `CallerGone` if it gave the batch up.
fn lent_sink(shared: &StreamShared) -> Result<std::sync::MutexGuard<'_, StreamState>, CallerGone> {
    let mut state = shared.lock();
    loop {
        match state.phase {
            StreamPhase::Abandoned => return Err(CallerGone),
            _ if state.sink.is_some() => return Ok(state),
            _ => {
                state = shared
                    .changed
                    .wait(state)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
            }
        }
    }
}

/// Zeroes what the thread copied of `value`, so a value without a verdict
/// of `Verified` leaves nothing of its bytes in the caller's memory.
fn zero_copied(shared: &StreamShared, value: usize) -> Result<(), CallerGone> {
    let mut state = lent_sink(shared)?;
    let copied = std::mem::take(&mut state.copied[value]);
    let sink = state.sink.as_mut().expect("lent_sink returns a lent sink");
    // SAFETY: the sink is lent and the state locked (`SinkPtr`).
    unsafe { sink.0.as_mut() }.zero(value, copied);
    Ok(())
}

impl Stream {
    /// Lends the destinations to the thread and waits for every value's
    /// verdict until `deadline`: then the values without one have what was
    /// copied of them zeroed, and the batch is given up (counted as stuck
    /// until its thread leaves). The outcomes, and whether this batch was
    /// the first held past its deadline since all answered.
    fn finish<D: Destination>(
        self,
        reads: &[Option<ValueRead>],
        dests: &mut [D],
        deadline: Instant,
    ) -> (Vec<Option<ReadOutcome>>, bool) {
        // A batch too large to stay in the caches for its reader is copied
        // with non-temporal stores: the destination's lines are not read
        // first, which leaves the memory bus to the thread's next `pread`.
        let total = reads
            .iter()
            .flatten()
            .fold(0usize, |total, r| total.saturating_add(r.len));
        let mut sink = Dests {
            dests,
            streamed: crate::bulk_copy::worth_streaming(total),
        };
        let mut first_stall = false;
        let mut abandoned = false;
        let (mut outcomes, copied) = {
            let lent = SinkLent::lend(&self.shared, &mut sink);
            let mut state = self.shared.lock();
            loop {
                if matches!(state.phase, StreamPhase::Done) {
                    break;
                }
                let now = Instant::now();
                if now >= deadline {
                    // Counted while the state is locked: the thread, which
                    // uncounts it, sees `Abandoned` only after this.
                    let mut held = self.stuck.lock().unwrap();
                    held.batches += 1;
                    held.bytes += self.bytes;
                    held.since.get_or_insert(now);
                    first_stall = held.batches == 1;
                    drop(held);
                    state.phase = StreamPhase::Abandoned;
                    abandoned = true;
                    break;
                }
                state = self
                    .shared
                    .changed
                    .wait_timeout(state, deadline - now)
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .0;
            }
            let taken = (
                std::mem::take(&mut state.outcomes),
                std::mem::take(&mut state.copied),
            );
            drop(state);
            drop(lent);
            taken
        };
        // The destinations are the caller's again. A value without a
        // verdict (late, or its thread panicked) leaves nothing behind.
        for (value, read) in reads.iter().enumerate() {
            if read.is_some() && outcomes[value].is_none() {
                sink.zero(value, copied[value]);
            }
        }
        if !abandoned {
            for (outcome, read) in outcomes.iter_mut().zip(reads) {
                if read.is_some() && outcome.is_none() {
                    // Done without a verdict for it: the thread panicked.
                    *outcome = Some(ReadOutcome::Failed(Error::io(
                        "a bounded read",
                        std::io::Error::other("the read thread ended early"),
                    )));
                }
            }
        }
        (outcomes, first_stall)
    }
}

/// Finishes a streamed batch: the outcomes, `TimedOut` for each value
/// without a verdict at the deadline.
fn finish_streamed<D: Destination>(
    stream: Stream,
    reads: &[Option<ValueRead>],
    dests: &mut [D],
    deadline: Instant,
    limit: Duration,
) -> Vec<Option<ReadOutcome>> {
    let counters = Arc::clone(&stream.counters);
    let (mut outcomes, first_stall) = stream.finish(reads, dests, deadline);
    let mut late = 0;
    for (outcome, read) in outcomes.iter_mut().zip(reads) {
        if read.is_some() && outcome.is_none() {
            *outcome = Some(ReadOutcome::TimedOut);
            late += 1;
        }
    }
    if late > 0 {
        counters.deadline_misses.fetch_add(late, Ordering::Relaxed);
    }
    if first_stall {
        note_stall(&counters, limit);
    }
    outcomes
}

/// The first batch held past its deadline since every read answered.
fn note_stall(counters: &StallCounters, limit: Duration) {
    counters.stalls.fetch_add(1, Ordering::Relaxed);
    tracing::warn!(
        deadline = ?limit,
        "reads of a file system did not complete within the storage deadline \
         (io_deadline): their values are answered as misses until it answers \
         again (its FUSE daemon or server may be stopped or overloaded)"
    );
}

/// A batch held past its deadline came back.
fn release(stuck: &Mutex<Stuck>, counters: &StallCounters, bytes: u64) {
    let mut stuck = stuck.lock().unwrap();
    stuck.batches = stuck.batches.saturating_sub(1);
    stuck.bytes = stuck.bytes.saturating_sub(bytes);
    if stuck.batches == 0 {
        let held = stuck.since.take().map(|t| t.elapsed()).unwrap_or_default();
        tracing::warn!(
            stalled_for = ?held,
            stalls = counters.stalls.load(Ordering::Relaxed),
            "the file system answered again: every read held past the storage deadline has \
             come back (their values were answered as misses; nothing they read was used)"
        );
    }
}

impl Pending {
    /// Waits for the batch until its deadline. In time: copies each
    /// verified value into its destination and returns the outcomes.
    /// Late: gives the batch up (its reads go on into its own buffers) and
    /// answers `TimedOut` for each of its reads.
    pub(crate) fn finish<D: Destination>(
        self,
        reads: &[Option<ValueRead>],
        dests: &mut [D],
    ) -> Vec<Option<ReadOutcome>> {
        let timed_out = |counters: &StallCounters| -> Vec<Option<ReadOutcome>> {
            let n = reads.iter().flatten().count() as u64;
            counters.deadline_misses.fetch_add(n, Ordering::Relaxed);
            reads
                .iter()
                .map(|r| r.as_ref().map(|_| ReadOutcome::TimedOut))
                .collect()
        };
        let (job, deadline, limit, stuck, counters, reader) = match self.0 {
            Started::Empty => return reads.iter().map(|_| None).collect(),
            Started::Failed(why) => {
                return reads
                    .iter()
                    .map(|r| {
                        r.as_ref().map(|_| {
                            ReadOutcome::Failed(Error::io(
                                "a bounded read",
                                std::io::Error::other(why.clone()),
                            ))
                        })
                    })
                    .collect()
            }
            // Counted like a read past its deadline: the file system holds
            // too many already.
            Started::Refused(counters) => return timed_out(&counters),
            Started::Streaming {
                stream,
                deadline,
                limit,
            } => return finish_streamed(stream, reads, dests, deadline, limit),
            Started::Running {
                job,
                deadline,
                limit,
                stuck,
                counters,
                reader,
            } => (job, deadline, limit, stuck, counters, reader),
        };
        let mut state = job.state.lock().unwrap();
        loop {
            if !matches!(*state, JobState::Running) {
                break;
            }
            let now = Instant::now();
            if now >= deadline {
                // Counted while the job is still locked: its thread, which
                // uncounts it, sees `Abandoned` only after this.
                let first = {
                    let mut stuck = stuck.lock().unwrap();
                    stuck.batches += 1;
                    stuck.bytes += job.bytes;
                    stuck.since.get_or_insert(now);
                    stuck.batches == 1
                };
                *state = JobState::Abandoned;
                drop(state);
                if first {
                    note_stall(&counters, limit);
                }
                return timed_out(&counters);
            }
            state = job.finished.wait_timeout(state, deadline - now).unwrap().0;
        }
        let JobState::Done(outcomes, bufs) = std::mem::replace(&mut *state, JobState::Abandoned)
        else {
            unreachable!(
                "a job leaves Running only as Done or Abandoned, and only the caller abandons it"
            )
        };
        drop(state);
        for (((outcome, buf), dest), read) in
            outcomes.iter().zip(&bufs).zip(dests.iter_mut()).zip(reads)
        {
            if let (Some(ReadOutcome::Verified), Some(buf), Some(read)) = (outcome, buf, read) {
                dest.fill_from(&buf.as_slice()[..read.len]);
            }
        }
        for buf in bufs.into_iter().flatten() {
            reader.bounce.give_back(buf);
        }
        outcomes
    }
}

#[cfg(test)]
mod tests {
    use super::super::test_log::{put, TestLog};
    use super::super::{DiskTier, RecoveryChecks};
    use super::*;
    use crate::config::EngineWrapper;
    use crate::io::faulty::FaultyEngine;
    use crate::io::IoEngine;

    const LEN: usize = 10_000;

    /// A tier whose bounded reads (of every file) go through `faulty`,
    /// its files O_DIRECT or buffered (streamed), with one value of `len`
    /// bytes of 7s written; the read of it.
    fn tier_with(
        faulty: &Arc<FaultyEngine>,
        direct: bool,
        len: usize,
    ) -> (TestLog, DiskTier, ValueRead) {
        let mut log = TestLog::new(64 << 20);
        let wrapped = Arc::clone(faulty);
        log.config = log
            .config
            .clone()
            .direct_io(direct)
            .io_deadline(Duration::from_millis(20))
            .io_deadline_local(true)
            .wrap_bounded_io_engine(EngineWrapper(Arc::new(move |_built: Arc<dyn IoEngine>| {
                Arc::clone(&wrapped) as Arc<dyn IoEngine>
            })));
        let (tier, _, _) = log.open(RecoveryChecks::default());
        let loc = log.write(&tier, &[put(b"a", 1, len, 7)]).unwrap()[0];
        let key = super::super::test_log::qualified(b"a");
        let digest = log.secret.digest_qualified(&key);
        let read = ValueRead {
            digest,
            region: tier.region(loc.region()).unwrap(),
            loc,
            len,
            checksum: crate::key::value_checksum(digest, &vec![7; len]),
        };
        assert!(read.region.bounded());
        assert_eq!(read.region.direct_io(), direct);
        (log, tier, read)
    }

    fn tier_with_value(faulty: &Arc<FaultyEngine>, direct: bool) -> (TestLog, DiskTier, ValueRead) {
        tier_with(faulty, direct, LEN)
    }

    fn faulty() -> Arc<FaultyEngine> {
        FaultyEngine::new(Arc::new(crate::io::PsyncEngine::new(2)))
    }

    #[test]
    fn a_read_in_time_lands_verified_in_the_callers_buffer() {
        for direct in [true, false] {
            read_in_time(direct);
        }
    }

    fn read_in_time(direct: bool) {
        let engine = faulty();
        let (_log, tier, read) = tier_with_value(&engine, direct);
        let bounded = tier.bounded.as_ref().unwrap();
        let reads = [Some(read), None];
        let mut a = vec![0u8; LEN];
        let mut b = [0u8; 1];
        let mut dests = [&mut a[..], &mut b[..]];
        // Generous for a machine under load: nothing here stalls.
        let pending = BoundedReads::new(
            ValueReader::new(engine.clone(), Arc::clone(&bounded.reader.bounce), 1 << 20),
            Duration::from_secs(600),
        )
        .start(&reads);
        let outcomes = pending.finish(&reads, &mut dests);
        assert!(
            matches!(outcomes[0], Some(ReadOutcome::Verified)),
            "{outcomes:?}"
        );
        assert!(outcomes[1].is_none());
        assert!(a.iter().all(|&x| x == 7));
    }

    #[test]
    fn a_stalled_read_times_out_holds_its_buffers_and_too_many_refuse_new_ones() {
        for direct in [true, false] {
            stalled_reads(direct);
        }
    }

    fn stalled_reads(direct: bool) {
        let engine = faulty();
        let (_log, tier, read) = tier_with_value(&engine, direct);
        let bounded = tier.bounded.as_ref().unwrap();
        engine.stall(true, false);
        let reads = [Some(read)];
        let mut dest = vec![0u8; LEN];
        for held in 1..=MAX_STUCK_BATCHES {
            let outcomes = bounded.start(&reads).finish(&reads, &mut [&mut dest[..]]);
            assert!(
                matches!(outcomes[0], Some(ReadOutcome::TimedOut)),
                "{outcomes:?}"
            );
            assert_eq!(bounded.stuck().0, held);
        }
        assert!(
            dest.iter().all(|&x| x == 0),
            "nothing landed in the caller's memory"
        );
        // Every held batch is a thread parked at the gate.
        let until = Instant::now() + Duration::from_secs(120);
        while engine.held().0 < MAX_STUCK_BATCHES && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(engine.held().0, MAX_STUCK_BATCHES);
        // One more is refused without a thread.
        let outcomes = bounded.start(&reads).finish(&reads, &mut [&mut dest[..]]);
        assert!(matches!(outcomes[0], Some(ReadOutcome::TimedOut)));
        assert_eq!(engine.held().1, MAX_STUCK_BATCHES, "no read started");
        assert_eq!(
            bounded.counters.deadline_misses.load(Ordering::Relaxed),
            MAX_STUCK_BATCHES + 1
        );
        assert_eq!(bounded.counters.stalls.load(Ordering::Relaxed), 1);
        // The file system answers again: the threads release what they
        // held, and reads start again.
        engine.resume();
        while bounded.stuck() != (0, 0) && Instant::now() < until {
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(bounded.stuck(), (0, 0));
        assert!(dest.iter().all(|&x| x == 0));
    }

    /// A buffered value of several pieces, streamed into a destination of
    /// odd segments: the first attempt's pieces come back stale (a cached
    /// copy older than the writer's bytes), so the value is read again and
    /// verified; with every attempt stale it is rejected and what was
    /// copied is zeroed.
    #[test]
    fn a_streamed_value_lands_in_segments_and_a_stale_copy_is_read_again() {
        // Copied plain, and (a batch of 16 MiB or more) with non-temporal
        // stores.
        for len in [
            2 * STREAM_PIECE + 12_345,
            crate::bulk_copy::STREAM_BATCH_FROM + 12_345,
        ] {
            streamed_value_into_segments(len);
        }
    }

    fn streamed_value_into_segments(len: usize) {
        assert_eq!(
            crate::bulk_copy::worth_streaming(len),
            len >= crate::bulk_copy::STREAM_BATCH_FROM
        );
        let engine = faulty();
        let (_log, tier, read) = tier_with(&engine, false, len);
        let bounded = BoundedReads::new(
            ValueReader::new(
                engine.clone(),
                Arc::clone(&tier.bounded.as_ref().unwrap().reader.bounce),
                1 << 20,
            ),
            Duration::from_secs(600),
        );
        let reads = [Some(read)];
        let mut whole = vec![0u8; len + 10];
        // Stale pieces: none; some of the first attempt's; every piece of
        // both attempts.
        let pieces = len.div_ceil(STREAM_PIECE) as u64;
        for (stale, verified) in [(0, true), (2, true), (2 * pieces, false)] {
            engine.stale_reads(stale);
            whole.fill(1);
            let (a, rest) = whole.split_at_mut(1000);
            let (b, c) = rest.split_at_mut(STREAM_PIECE + 7);
            let mut segments: [&mut [u8]; 3] = [a, b, c];
            let mut dests = [&mut segments[..]];
            let outcomes = bounded.start(&reads).finish(&reads, &mut dests);
            if verified {
                assert!(
                    matches!(outcomes[0], Some(ReadOutcome::Verified)),
                    "{stale}: {outcomes:?}"
                );
                assert!(whole[..len].iter().all(|&x| x == 7), "{stale}");
            } else {
                assert!(
                    matches!(outcomes[0], Some(ReadOutcome::Rejected(_))),
                    "{outcomes:?}"
                );
                assert!(
                    whole[..len].iter().all(|&x| x == 0),
                    "what was copied is zeroed"
                );
            }
            assert!(
                whole[len..].iter().all(|&x| x == 1),
                "nothing past the value"
            );
        }
    }

    /// A stream stalled after its first piece: the caller answers a miss at
    /// its deadline with what the thread had copied zeroed; the thread,
    /// when the file system answers, finds the batch given up and writes
    /// nothing more into the caller's memory, and gives its buffer back.
    /// The same with the caller late to wait (the thread holds its first
    /// piece until the destinations are lent).
    #[test]
    fn a_stream_stalled_midway_zeroes_what_it_copied_and_writes_nothing_after() {
        for caller_late in [false, true] {
            let len = 3 * STREAM_PIECE;
            let engine = faulty();
            let (_log, tier, read) = tier_with(&engine, false, len);
            let bounded = tier.bounded.as_ref().unwrap();
            // The first piece reads; the second stalls.
            engine.stall_reads_after(1);
            let reads = [Some(read)];
            let mut dest = vec![1u8; len];
            let pending = bounded.start(&reads);
            let until = Instant::now() + Duration::from_secs(120);
            if caller_late {
                while engine.reads_passed() == 0 && Instant::now() < until {
                    std::thread::sleep(Duration::from_millis(1));
                }
                assert_eq!(engine.reads_passed(), 1);
            }
            let outcomes = pending.finish(&reads, &mut [&mut dest[..]]);
            assert!(
                matches!(outcomes[0], Some(ReadOutcome::TimedOut)),
                "{outcomes:?}"
            );
            assert!(
                dest.iter().all(|&x| x == 0 || x == 1),
                "what was copied is zeroed"
            );
            assert!(
                dest[STREAM_PIECE..].iter().all(|&x| x == 1),
                "nothing past the first piece"
            );
            engine.resume();
            while bounded.stuck() != (0, 0) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(bounded.stuck(), (0, 0));
            assert_eq!(engine.held().1, 1, "the second piece was held");
            assert!(
                dest.iter().all(|&x| x == 0 || x == 1),
                "the thread wrote nothing after the caller gave up"
            );
        }
    }
}
