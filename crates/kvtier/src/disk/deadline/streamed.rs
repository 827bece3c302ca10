//! Streamed bounded reads: a batch of values in buffered files (network
//! and FUSE file systems in the default read mode) is streamed. Its thread
//! reads the values one after another, in order, in pieces of
//! `STREAM_PIECE` into a ring of `STREAM_PIECES` buffers of its own, and
//! hands the pieces over; the caller checksums and copies each into its
//! destination while the next is read (with non-temporal stores for a
//! batch too large to stay in the caches, `bulk_copy::worth_streaming`),
//! and takes each value's verdict when its last piece is in. So a value's
//! bytes cross memory about as often as in a plain program's `read` (the
//! ring stays in cache), and the file is read as one sequential stream, as
//! readahead likes it. The bound is the same: only the thread writes the
//! ring, only the caller writes its destinations, and a caller past its
//! deadline zeroes what it copied of values without a verdict, answers
//! them as misses, and leaves the ring to the thread.

use super::*;

/// Bytes per piece of a streamed value read.
pub(super) const STREAM_PIECE: usize = 2 << 20;
/// Pieces of a streamed batch in flight: one being read, one being copied
/// out, one spare.
pub(super) const STREAM_PIECES: usize = 3;

/// Bytes of a streamed piece checksummed and then copied out together:
/// small enough to stay in the core's cache between the two.
const COPY_CHUNK: usize = 64 << 10;
/// The same for a batch whose copies are made with non-temporal stores
/// (`bulk_copy::worth_streaming`): as large as such stores start at, and
/// still well within a core's cache.
const STREAMED_COPY_CHUNK: usize = crate::bulk_copy::STREAM_FROM;

impl BoundedReads {
    /// Starts streaming every `Some` of `reads` (values of buffered files)
    /// on a thread of its own.
    pub(super) fn start_streamed(
        &self,
        reads: &[Option<ValueRead>],
        deadline: Instant,
        permit: RunningPermit,
        probe: Option<Probe>,
    ) -> Pending {
        match spawn_stream(
            &self.reader,
            &self.stuck,
            &self.counters,
            &self.running,
            reads,
            permit,
        ) {
            Ok(stream) => Pending(Started::Streaming {
                stream,
                deadline,
                limit: self.deadline,
                probe,
            }),
            Err(why) => Pending(Started::Failed(why)),
        }
    }
}

/// Starts the thread of a streamed batch, with its ring of buffers.
fn spawn_stream(
    reader: &Arc<ValueReader>,
    stuck: &Arc<Mutex<Stuck>>,
    counters: &Arc<StallCounters>,
    running: &Arc<RunningBudgets>,
    reads: &[Option<ValueRead>],
    permit: RunningPermit,
) -> Result<Stream, String> {
    let (free_tx, free_rx) = mpsc::channel();
    for _ in 0..STREAM_PIECES {
        let _ = free_tx.send(reader.bounce.take(STREAM_PIECE));
    }
    let (filled_tx, filled_rx) = mpsc::channel();
    let job = Arc::new(Mutex::new(StreamPhase::Running));
    let bytes = (STREAM_PIECES * STREAM_PIECE) as u64;
    let reads_owned = reads.to_vec();
    let (thread_job, thread_reader, thread_stuck, thread_counters) = (
        Arc::clone(&job),
        Arc::clone(reader),
        Arc::clone(stuck),
        Arc::clone(counters),
    );
    std::thread::Builder::new()
        .name("kvtier-bounded-read".into())
        .spawn(move || {
            // Held until this thread leaves, past the deadline too.
            let _permit = permit;
            let reader = thread_reader;
            let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                stream_values(&reader, &reads_owned, &free_rx, &filled_tx)
            }));
            // Every buffer this side still holds goes back to the pool.
            drop(filled_tx);
            while let Ok(buf) = free_rx.try_recv() {
                reader.bounce.give_back(buf);
            }
            let mut phase = thread_job.lock().unwrap();
            if matches!(*phase, StreamPhase::Abandoned) {
                drop(phase);
                release(&thread_stuck, &thread_counters, bytes);
            } else {
                *phase = StreamPhase::Done;
            }
        })
        .map_err(|e| format!("could not start a read thread: {e}"))?;
    Ok(Stream {
        job,
        free: free_tx,
        filled: filled_rx,
        bytes,
        reader: Arc::clone(reader),
        running: Arc::clone(running),
        stuck: Arc::clone(stuck),
        counters: Arc::clone(counters),
    })
}

/// The caller's end of a streamed batch.
pub(super) struct Stream {
    job: Arc<Mutex<StreamPhase>>,
    /// Buffers handed back to the thread once copied out.
    free: Sender<AlignedBuf>,
    filled: Receiver<StreamMsg>,
    /// Buffer bytes the ring holds.
    bytes: u64,
    reader: Arc<ValueReader>,
    stuck: Arc<Mutex<Stuck>>,
    counters: Arc<StallCounters>,
    running: Arc<RunningBudgets>,
}

enum StreamPhase {
    Running,
    /// The thread read every value and left.
    Done,
    /// The caller gave up on it; the thread uncounts it when it leaves.
    Abandoned,
}

/// What the thread of a streamed batch hands over, in order.
enum StreamMsg {
    /// The value's bytes at `at..at + len`, in `buf`.
    Piece {
        value: usize,
        at: usize,
        len: usize,
        buf: AlignedBuf,
    },
    /// Every piece of the value was handed over.
    Read { value: usize },
    /// The value could not be read (an error, or it lies past the end of
    /// its file).
    Failed { value: usize, outcome: ReadOutcome },
}

/// The caller went away: stop reading.
struct CallerGone;

/// The thread of a streamed batch: each value in order, piece by piece.
/// It only reads; the caller checksums and copies (so the thread's reads
/// go as fast as a plain program's).
fn stream_values(
    reader: &ValueReader,
    reads: &[Option<ValueRead>],
    free: &Receiver<AlignedBuf>,
    filled: &Sender<StreamMsg>,
) -> Result<(), CallerGone> {
    for (value, read) in reads.iter().enumerate() {
        let Some(read) = read else { continue };
        let message = match stream_value(reader, value, read, free, filled)? {
            None => StreamMsg::Read { value },
            Some(outcome) => StreamMsg::Failed { value, outcome },
        };
        filled.send(message).map_err(|_| CallerGone)?;
    }
    Ok(())
}

/// Streams one value's pieces; what went wrong, if anything.
fn stream_value(
    reader: &ValueReader,
    value: usize,
    read: &ValueRead,
    free: &Receiver<AlignedBuf>,
    filled: &Sender<StreamMsg>,
) -> Result<Option<ReadOutcome>, CallerGone> {
    let offset = u64::from(read.loc.page()) * PAGE_SIZE;
    let mut at = 0;
    while at < read.len {
        let mut buf = free.recv().map_err(|_| CallerGone)?;
        let len = (read.len - at).min(STREAM_PIECE);
        let mut ops = [ReadOp::new(
            &read.region.file,
            offset + at as u64,
            &mut buf.as_mut_slice()[..len],
        )];
        reader.engine.read_batch_then(&mut ops, &|_, _| {});
        let [op] = ops;
        if let Err(e) = op.result {
            reader.bounce.give_back(buf);
            return Ok(Some(if e.kind() == std::io::ErrorKind::UnexpectedEof {
                ReadOutcome::Rejected(format!("value lies past the end of its region file: {e}"))
            } else {
                ReadOutcome::Failed(Error::io(
                    format!(
                        "reading region {} page {}",
                        read.loc.region(),
                        read.loc.page()
                    ),
                    e,
                ))
            }));
        }
        filled
            .send(StreamMsg::Piece {
                value,
                at,
                len,
                buf,
            })
            .map_err(|_| CallerGone)?;
        at += len;
    }
    Ok(None)
}

/// How a streamed batch ended for its caller.
struct StreamEnd {
    outcomes: Vec<Option<ReadOutcome>>,
    /// Values whose bytes did not verify (zeroed), for a second look.
    mismatched: Vec<usize>,
    /// The deadline passed; the values without an outcome are late.
    timed_out: bool,
    /// This batch was the first held past its deadline since all answered.
    first_stall: bool,
}

impl Stream {
    /// Checksums and copies pieces out, and takes each value's verdict,
    /// until every value has one or until `deadline`: then the values
    /// without a verdict have what was copied of them zeroed, and the batch
    /// is given up (counted as stuck until its thread leaves).
    fn finish<D: Destination>(
        self,
        reads: &[Option<ValueRead>],
        dests: &mut [D],
        deadline: Instant,
    ) -> StreamEnd {
        let mut end = StreamEnd {
            outcomes: reads.iter().map(|_| None).collect(),
            mismatched: Vec::new(),
            timed_out: false,
            first_stall: false,
        };
        let mut checksums: Vec<Option<ValueChecksum>> = reads
            .iter()
            .map(|r| r.as_ref().map(|r| ValueChecksum::new(r.digest)))
            .collect();
        // Bytes copied into each destination so far (zeroed if its value
        // does not verify or does not finish).
        let mut copied = vec![0usize; reads.len()];
        // A batch too large to stay in the caches for its reader is copied
        // with non-temporal stores: the destination's lines are not read
        // first, which leaves the memory bus to the reading thread's
        // `pread`s on the other core.
        let total = reads
            .iter()
            .flatten()
            .fold(0usize, |total, r| total.saturating_add(r.len));
        let streamed = crate::bulk_copy::worth_streaming(total);
        let chunk_len = if streamed {
            STREAMED_COPY_CHUNK
        } else {
            COPY_CHUNK
        };
        loop {
            let now = Instant::now();
            // Past the deadline, what is already sent is still taken (a
            // thread that has left sent everything, then hung up).
            let message = if now >= deadline {
                self.filled.try_recv().map_err(|e| match e {
                    mpsc::TryRecvError::Empty => RecvTimeoutError::Timeout,
                    mpsc::TryRecvError::Disconnected => RecvTimeoutError::Disconnected,
                })
            } else {
                self.filled.recv_timeout(deadline - now)
            };
            match message {
                Ok(StreamMsg::Piece {
                    value,
                    at,
                    len,
                    buf,
                }) => {
                    // Checksummed and copied a chunk at a time, so the
                    // piece is read from memory once (the copy finds each
                    // chunk in the core's cache), not twice.
                    let bytes = &buf.as_slice()[..len];
                    for (i, chunk) in bytes.chunks(chunk_len).enumerate() {
                        if let Some(checksum) = &mut checksums[value] {
                            checksum.update(chunk);
                        }
                        if streamed {
                            dests[value].fill_at_streamed(at + i * chunk_len, chunk);
                        } else {
                            dests[value].fill_at(at + i * chunk_len, chunk);
                        }
                    }
                    copied[value] = copied[value].max(at + len);
                    if let Err(mpsc::SendError(buf)) = self.free.send(buf) {
                        self.reader.bounce.give_back(buf);
                    }
                }
                Ok(StreamMsg::Read { value }) => {
                    let verified = match (&checksums[value], &reads[value]) {
                        (Some(checksum), Some(read)) => checksum.finish() == read.checksum,
                        _ => false,
                    };
                    if verified {
                        end.outcomes[value] = Some(ReadOutcome::Verified);
                    } else {
                        dests[value].fill_at(0, &vec![0; copied[value]]);
                        end.mismatched.push(value);
                    }
                }
                Ok(StreamMsg::Failed { value, outcome }) => {
                    dests[value].fill_at(0, &vec![0; copied[value]]);
                    end.outcomes[value] = Some(outcome);
                }
                Err(RecvTimeoutError::Disconnected) => break,
                Err(RecvTimeoutError::Timeout) => {
                    let mut phase = self.job.lock().unwrap();
                    if !matches!(*phase, StreamPhase::Running) {
                        // The thread is leaving (it hangs up before it
                        // says so): what it sent is all there is; take it
                        // without waiting.
                        drop(phase);
                        std::thread::yield_now();
                        continue;
                    }
                    // Counted while the phase is locked: the thread, which
                    // uncounts it, sees `Abandoned` only after this.
                    end.first_stall = self.stuck.lock().unwrap().hold(self.bytes, now);
                    *phase = StreamPhase::Abandoned;
                    drop(phase);
                    for (value, read) in reads.iter().enumerate() {
                        if read.is_some() && end.outcomes[value].is_none() {
                            dests[value].fill_at(0, &vec![0; copied[value]]);
                        }
                    }
                    end.mismatched.clear();
                    end.timed_out = true;
                    return end;
                }
            }
        }
        // The thread left without a verdict for these (it panicked).
        for (value, read) in reads.iter().enumerate() {
            if read.is_some() && end.outcomes[value].is_none() && !end.mismatched.contains(&value) {
                dests[value].fill_at(0, &vec![0; copied[value]]);
                end.outcomes[value] = Some(ReadOutcome::Failed(Error::io(
                    "a bounded read",
                    std::io::Error::other("the read thread ended early"),
                )));
            }
        }
        end
    }
}

/// Finishes a streamed batch; values that did not verify are dropped from
/// the page cache (it may hold a copy read before another writer's bytes
/// landed) and streamed once more, within the same deadline, before they
/// are called damaged.
pub(super) fn finish_streamed<D: Destination>(
    stream: Stream,
    reads: &[Option<ValueRead>],
    dests: &mut [D],
    deadline: Instant,
    limit: Duration,
    mut probe: Option<Probe>,
) -> Vec<Option<ReadOutcome>> {
    let (reader, stuck, counters, running) = (
        Arc::clone(&stream.reader),
        Arc::clone(&stream.stuck),
        Arc::clone(&stream.counters),
        Arc::clone(&stream.running),
    );
    let mut end = stream.finish(reads, dests, deadline);
    if !end.mismatched.is_empty() {
        let mut again: Vec<Option<ValueRead>> = reads.iter().map(|_| None).collect();
        for &value in &end.mismatched {
            if let Some(read) = &reads[value] {
                let offset = u64::from(read.loc.page()) * PAGE_SIZE;
                crate::disk::mount::drop_cached(
                    &read.region.file,
                    offset,
                    page_round_up(read.len as u64),
                );
                again[value] = Some(read.clone());
            }
        }
        // A permit for the second stream within the deadline; without
        // one the values are left without a verdict: misses, below.
        let ring = (STREAM_PIECES * STREAM_PIECE) as u64;
        let second = running
            .permit(ring, deadline)
            .map(|permit| spawn_stream(&reader, &stuck, &counters, &running, &again, permit));
        match second {
            None => {
                for &value in &end.mismatched {
                    end.outcomes[value] = None;
                }
                end.timed_out = true;
            }
            Some(Ok(stream)) => {
                let mut second = stream.finish(&again, dests, deadline);
                for &value in &end.mismatched {
                    end.outcomes[value] = if second.mismatched.contains(&value) {
                        Some(ReadOutcome::Rejected(
                            "checksum or key digest mismatch".into(),
                        ))
                    } else {
                        second.outcomes[value].take()
                    };
                    if matches!(end.outcomes[value], Some(ReadOutcome::Verified)) {
                        tracing::debug!(
                            value,
                            "a buffered read did not verify from the page cache but did from \
                             the file system: a stale cached copy was dropped"
                        );
                    }
                }
                end.timed_out |= second.timed_out;
                end.first_stall |= second.first_stall;
            }
            Some(Err(why)) => {
                for &value in &end.mismatched {
                    end.outcomes[value] = Some(ReadOutcome::Failed(Error::io(
                        "a bounded read",
                        std::io::Error::other(why.clone()),
                    )));
                }
            }
        }
    }
    let mut late = 0;
    for (outcome, read) in end.outcomes.iter_mut().zip(reads) {
        if read.is_some() && outcome.is_none() {
            *outcome = Some(ReadOutcome::TimedOut);
            late += 1;
        }
    }
    if late > 0 {
        counters.deadline_misses.fetch_add(late, Ordering::Relaxed);
    }
    if end.first_stall {
        note_stall(&counters, limit);
    }
    if let (Some(probe), false) = (&mut probe, end.timed_out) {
        probe.answered();
    }
    end.outcomes
}
