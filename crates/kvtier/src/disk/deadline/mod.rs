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
//! A batch of values in buffered files is streamed instead (`streamed`).

mod streamed;

use super::read::{Destination, ReadOutcome, ValueRead, ValueReader};
use crate::error::Error;
use crate::io::{AlignedBuf, ReadOp};
use crate::key::ValueChecksum;
use crate::units::{page_round_up, PAGE_SIZE};
use kvtier_governor::{Grant, Pool, Principal, Shares};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};
use streamed::{finish_streamed, Stream, STREAM_PIECE, STREAM_PIECES};

/// Bounded batches that may be held past their deadline at once before
/// new ones answer misses without reading: each holds a thread (parked in
/// the kernel) and its buffers.
pub(crate) const MAX_STUCK_BATCHES: u64 = 64;
/// Buffer bytes that may be held by reads past their deadline before new
/// bounded batches answer misses without reading.
pub(crate) const MAX_STUCK_BYTES: u64 = 1 << 30;
/// Bounded batches that may be running at once, each on its thread: a
/// batch takes its permit before its thread starts and its thread gives it
/// back when it leaves, so the cap counts every thread, those past their
/// deadline too. A batch that finds none waits for one within its
/// deadline, then answers misses.
pub(crate) const MAX_RUNNING_BATCHES: u64 = 64;
/// Buffer bytes the running bounded batches may hold together (a direct
/// batch its values' bounce buffers, a streamed one its ring); a batch
/// larger than this takes all of it.
pub(crate) const MAX_RUNNING_BYTES: u64 = 1 << 30;

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
    /// A read passed its deadline and no read has answered in time since:
    /// new batches answer misses at once, but one at a time is let through
    /// as a probe, and its answering in time (or every held read coming
    /// back) ends this.
    tripped: bool,
    /// The probe is running.
    probing: bool,
}

impl Stuck {
    /// Counts a batch given up at its deadline, holding `bytes`, and trips
    /// the breaker; `true` when it is the first held since all answered.
    fn hold(&mut self, bytes: u64, now: Instant) -> bool {
        self.batches += 1;
        self.bytes += bytes;
        self.since.get_or_insert(now);
        self.tripped = true;
        self.batches == 1
    }
}

/// The one batch let through while the breaker is tripped: when it is
/// dropped the next batch may probe, and if it answered in time the
/// breaker closes.
pub(super) struct Probe {
    stuck: Arc<Mutex<Stuck>>,
    answered: bool,
}

impl Probe {
    fn answered(&mut self) {
        self.answered = true;
    }
}

impl Drop for Probe {
    fn drop(&mut self) {
        let mut stuck = self.stuck.lock().unwrap();
        stuck.probing = false;
        if self.answered {
            stuck.tripped = false;
        }
    }
}

/// What a running batch's thread holds of the running budgets; given back
/// when the thread leaves.
pub(super) struct RunningPermit {
    _batch: Grant,
    _bytes: Grant,
}

/// The bounded reader of one disk tier.
#[derive(Debug)]
pub(crate) struct BoundedReads {
    reader: Arc<ValueReader>,
    deadline: Duration,
    stuck: Arc<Mutex<Stuck>>,
    pub counters: Arc<StallCounters>,
    /// Batches running now, and their buffer bytes (`MAX_RUNNING_*`).
    running: Arc<RunningBudgets>,
}

/// The budgets of running batches (`MAX_RUNNING_BATCHES`,
/// `MAX_RUNNING_BYTES`).
pub(super) struct RunningBudgets {
    batches: Arc<Pool>,
    bytes: Arc<Pool>,
}

impl std::fmt::Debug for RunningBudgets {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "RunningBudgets({} batches, {} bytes)",
            self.batches.used(),
            self.bytes.used()
        )
    }
}

impl RunningBudgets {
    fn new() -> Arc<RunningBudgets> {
        Arc::new(RunningBudgets {
            batches: running_budget("bounded reads", MAX_RUNNING_BATCHES),
            bytes: running_budget("bounded read bytes", MAX_RUNNING_BYTES),
        })
    }

    /// The permit for a batch of `bytes`, waiting for it until `deadline`.
    pub(super) fn permit(&self, bytes: u64, deadline: Instant) -> Option<RunningPermit> {
        let wait = || deadline.saturating_duration_since(Instant::now());
        let batch = self.batches.take_within(Principal::Server, 1, wait())?;
        let bytes = bytes.min(self.bytes.limit());
        let bytes = self.bytes.take_within(Principal::Server, bytes, wait())?;
        Some(RunningPermit {
            _batch: batch,
            _bytes: bytes,
        })
    }
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
        probe: Option<Probe>,
    },
    /// Values of buffered files, streamed piece by piece.
    Streaming {
        stream: Stream,
        deadline: Instant,
        limit: Duration,
        probe: Option<Probe>,
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
            running: RunningBudgets::new(),
        }
    }

    /// Whether a new batch may start: `Err` when the breaker is tripped and
    /// another batch is probing (answer misses at once), `Ok(Some)` when
    /// this batch is the probe.
    fn admit(&self) -> Result<Option<Probe>, ()> {
        let mut stuck = self.stuck.lock().unwrap();
        if stuck.batches >= MAX_STUCK_BATCHES || stuck.bytes >= MAX_STUCK_BYTES {
            return Err(());
        }
        if !stuck.tripped {
            return Ok(None);
        }
        if stuck.probing {
            return Err(());
        }
        stuck.probing = true;
        Ok(Some(Probe {
            stuck: Arc::clone(&self.stuck),
            answered: false,
        }))
    }

    /// Whether new batches answer misses at once (one probing).
    #[cfg(test)]
    fn tripped(&self) -> bool {
        self.stuck.lock().unwrap().tripped
    }

    /// Batches running now (their threads), and their buffer bytes.
    #[cfg(test)]
    pub(crate) fn running(&self) -> (u64, u64) {
        (self.running.batches.used(), self.running.bytes.used())
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
        let refused = || Pending(Started::Refused(Arc::clone(&self.counters)));
        let Ok(probe) = self.admit() else {
            return refused();
        };
        let deadline = Instant::now() + self.deadline;
        let streamed = reads.iter().flatten().all(|r| !r.region.direct_io());
        let bytes = if streamed {
            (STREAM_PIECES * STREAM_PIECE) as u64
        } else {
            reads
                .iter()
                .flatten()
                .map(|r| page_round_up(r.len as u64))
                .sum()
        };
        let Some(permit) = self.running.permit(bytes, deadline) else {
            return refused();
        };
        if streamed {
            return self.start_streamed(reads, deadline, permit, probe);
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
        let spawned = std::thread::Builder::new()
            .name("kvtier-bounded-read".into())
            .spawn(move || {
                // Held until this thread leaves, past the deadline too.
                let _permit = permit;
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
                probe,
            }),
            Err(e) => Pending(Started::Failed(format!(
                "could not start a read thread: {e}"
            ))),
        }
    }
}

/// A running budget of the disk tier: all of it the server's own (the
/// store does not know who asked; the server's governor bounds each
/// principal's requests before they reach it).
fn running_budget(name: &'static str, limit: u64) -> Arc<Pool> {
    let whole = Shares {
        reserve_percent: 0,
        tenant_share_percent: 100,
        anonymous_percent: 100,
    };
    Pool::new(name, limit, 0, whole)
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
        stuck.tripped = false;
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
        let (job, deadline, limit, stuck, counters, reader, mut probe) = match self.0 {
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
                probe,
            } => return finish_streamed(stream, reads, dests, deadline, limit, probe),
            Started::Running {
                job,
                deadline,
                limit,
                stuck,
                counters,
                reader,
                probe,
            } => (job, deadline, limit, stuck, counters, reader, probe),
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
                let first = stuck.lock().unwrap().hold(job.bytes, now);
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
        if let Some(probe) = &mut probe {
            probe.answered();
        }
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
    use super::streamed::STREAM_PIECE;
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

    /// Issue 60, finding "a stalled file system multiplies threads": the
    /// cap counted only batches past their deadline, so every batch
    /// started within the first deadline got a thread (780 with 300
    /// readers). Now a batch takes its running permit before its thread
    /// starts: with 64 threads parked in a stopped file system, the 65th
    /// batch waits for a permit within its deadline and answers misses
    /// without a thread.
    #[test]
    fn running_batches_are_capped_before_their_threads_start() {
        for direct in [true, false] {
            let engine = faulty();
            let (_log, tier, read) = tier_with_value(&engine, direct);
            let bounded = tier.bounded.as_ref().unwrap();
            engine.stall(true, false);
            let reads = [Some(read)];
            let pending: Vec<Pending> = (0..MAX_RUNNING_BATCHES)
                .map(|_| bounded.start(&reads))
                .collect();
            let until = Instant::now() + Duration::from_secs(120);
            while engine.held().0 < MAX_RUNNING_BATCHES && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(engine.held().0, MAX_RUNNING_BATCHES);
            assert_eq!(bounded.running().0, MAX_RUNNING_BATCHES);
            let mut dest = vec![0u8; LEN];
            let outcomes = bounded.start(&reads).finish(&reads, &mut [&mut dest[..]]);
            assert!(matches!(outcomes[0], Some(ReadOutcome::TimedOut)));
            assert_eq!(
                engine.held().1,
                MAX_RUNNING_BATCHES,
                "a 65th thread started"
            );
            for p in pending {
                let outcomes = p.finish(&reads, &mut [&mut dest[..]]);
                assert!(matches!(outcomes[0], Some(ReadOutcome::TimedOut)));
            }
            engine.resume();
            while bounded.running() != (0, 0) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(
                bounded.running(),
                (0, 0),
                "the threads gave their permits back"
            );
            assert_eq!(bounded.stuck(), (0, 0));
        }
    }

    /// Issue 60: once a read passed its deadline, every new batch started
    /// a thread of its own into the stopped file system until 64 were
    /// held. Now one batch at a time probes it and the others answer
    /// misses at once; a probe that answers in time ends that, although
    /// older reads are still held.
    #[test]
    fn after_a_stall_one_probe_reads_and_the_rest_answer_at_once() {
        for direct in [true, false] {
            let engine = faulty();
            let (_log, tier, read) = tier_with_value(&engine, direct);
            let bounded = tier.bounded.as_ref().unwrap();
            let reads = [Some(read)];
            let mut dest = vec![0u8; LEN];
            let read_once = || {
                let mut dest = vec![0u8; LEN];
                let mut outcomes = bounded.start(&reads).finish(&reads, &mut [&mut dest[..]]);
                outcomes.remove(0).unwrap()
            };
            engine.stall(true, false);
            assert!(matches!(read_once(), ReadOutcome::TimedOut));
            let until = Instant::now() + Duration::from_secs(120);
            while engine.held().0 < 1 && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            // The probe starts its thread; while it runs, 50 batches are
            // answered without one.
            let probe = bounded.start(&reads);
            while engine.held().1 < 2 && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(engine.held().1, 2, "the probe reached the file system");
            for _ in 0..50 {
                assert!(matches!(read_once(), ReadOutcome::TimedOut));
            }
            assert_eq!(
                engine.held().1,
                2,
                "a batch beside the probe started a thread"
            );
            assert!(matches!(
                probe.finish(&reads, &mut [&mut dest[..]])[0],
                Some(ReadOutcome::TimedOut)
            ));
            // The file system answers new reads (the two held stay held):
            // the next probe answers and the breaker closes. (On a busy
            // machine a probe may itself pass the 20 ms deadline without a
            // stall; then the next batch probes: until one answers in time.)
            engine.stall_reads_after(u64::MAX);
            let answered = loop {
                match read_once() {
                    ReadOutcome::Verified => break true,
                    ReadOutcome::TimedOut if Instant::now() < until => {}
                    _ => break false,
                }
            };
            assert!(answered, "no probe answered although the file system does");
            assert!(!bounded.tripped(), "an answered probe closes the breaker");
            assert!(bounded.stuck().0 >= 2, "the first two are still held");
            engine.resume();
            while bounded.stuck() != (0, 0) && Instant::now() < until {
                std::thread::sleep(Duration::from_millis(5));
            }
            assert_eq!(bounded.stuck(), (0, 0));
        }
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
    /// its deadline with what it had copied zeroed; the thread, when the
    /// file system answers, finds the caller gone, nothing more lands in
    /// the caller's memory, and the ring is given back. The same with the
    /// caller late to wait (the thread has read its first piece).
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
                "nothing landed after the caller gave up"
            );
        }
    }
}
