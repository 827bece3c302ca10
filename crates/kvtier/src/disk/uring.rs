//! io_uring engine: every read of a batch is queued on a ring and submitted
//! at once (deep queue, like 3FS's USRBIO), then the caller waits in the
//! kernel for completions (no busy polling). Short transfers are resubmitted
//! for the remainder; a full submission queue is drained by waiting for
//! completions before queueing more.

use super::io::{IoEngine, ReadOp};
use io_uring::{opcode, types, IoUring};
use std::fs::File;
use std::io::{self, IoSlice};
use std::os::unix::io::AsRawFd;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, MutexGuard};

/// Largest single transfer handed to the kernel; bigger ones continue as
/// "short" transfers.
const MAX_TRANSFER: usize = 1 << 30;
/// Bytes per write submission: a batch's values are written as several
/// concurrent writes of about this size, so the device sees a deep queue.
const WRITE_CHUNK: usize = 4 << 20;

pub struct UringEngine {
    rings: Vec<Mutex<IoUring>>,
    next: AtomicUsize,
    depth: usize,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("rings", &self.rings.len())
            .field("depth", &self.depth)
            .finish()
    }
}

impl UringEngine {
    /// Sets up `rings` rings of `depth` entries and proves them with a
    /// no-op, since some sandboxes allow ring setup but refuse operations.
    pub fn new(depth: u32, rings: usize) -> io::Result<Self> {
        let depth = depth.clamp(1, 4096);
        let mut created = Vec::with_capacity(rings.max(1));
        for _ in 0..rings.max(1) {
            let mut ring = IoUring::new(depth)?;
            let nop = opcode::Nop::new().build().user_data(u64::MAX);
            // SAFETY: a no-op references no memory.
            unsafe { ring.submission().push(&nop) }
                .map_err(|_| io::Error::other("io_uring submission queue full at setup"))?;
            ring.submit_and_wait(1)?;
            let result = ring.completion().next().map(|c| c.result());
            match result {
                Some(r) if r < 0 => return Err(io::Error::from_raw_os_error(-r)),
                Some(_) => {}
                None => return Err(io::Error::other("io_uring no-op did not complete")),
            }
            created.push(Mutex::new(ring));
        }
        Ok(UringEngine {
            rings: created,
            next: AtomicUsize::new(0),
            depth: depth as usize,
        })
    }

    /// A ring for this call: a free one if any, else wait for one.
    fn ring(&self) -> MutexGuard<'_, IoUring> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for i in 0..self.rings.len() {
            if let Ok(ring) = self.rings[(start + i) % self.rings.len()].try_lock() {
                return ring;
            }
        }
        self.rings[start % self.rings.len()].lock().unwrap()
    }

    /// Runs transfers to completion on one ring. Each transfer is described
    /// by `prepare(i, done)`, which returns the SQE for the remainder of
    /// transfer `i` after `done` bytes, and `len(i)`, its total length.
    /// Returns each transfer's outcome.
    fn run(
        &self,
        count: usize,
        len: impl Fn(usize) -> usize,
        prepare: impl Fn(usize, usize) -> io_uring::squeue::Entry,
        on_complete: impl Fn(usize),
    ) -> Vec<io::Result<()>> {
        let mut outcomes: Vec<Option<io::Result<()>>> = (0..count)
            .map(|i| (len(i) == 0).then_some(Ok(())))
            .collect();
        let mut done = vec![0usize; count];
        let mut queue: std::collections::VecDeque<usize> =
            (0..count).filter(|&i| len(i) > 0).collect();
        let mut ring = self.ring();
        // Handed to the kernel (or queued on the ring for it): their
        // buffers are in use until they complete.
        let mut in_flight = 0usize;
        while in_flight > 0 || !queue.is_empty() {
            while in_flight < self.depth {
                let Some(&i) = queue.front() else { break };
                let entry = prepare(i, done[i]).user_data(i as u64);
                // SAFETY: the SQE points into buffers that the caller keeps
                // alive until this function returns, and it does not return
                // while any queued operation is unfinished.
                if unsafe { ring.submission().push(&entry) }.is_err() {
                    break; // full: wait for completions first
                }
                queue.pop_front();
                in_flight += 1;
            }
            if let Err(e) = ring.submit_and_wait(1) {
                match e.raw_os_error() {
                    // Interrupted, short of resources, or completions
                    // waiting to be reaped: reap and try again.
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY) => {}
                    _ => {
                        // The ring is unusable while the kernel may still
                        // write into the callers' buffers: stopping the
                        // process is the only memory-safe answer.
                        eprintln!("kvtier: io_uring submission failed with {in_flight} operations queued: {e}");
                        std::process::abort();
                    }
                }
            }
            let completed: Vec<(u64, i32)> = ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result()))
                .collect();
            for (user_data, result) in completed {
                let i = user_data as usize;
                in_flight -= 1;
                if result < 0 {
                    let errno = -result;
                    if errno == libc::EINTR || errno == libc::EAGAIN {
                        queue.push_back(i);
                    } else {
                        outcomes[i] = Some(Err(io::Error::from_raw_os_error(errno)));
                    }
                } else if result == 0 {
                    outcomes[i] = Some(Err(io::Error::new(
                        io::ErrorKind::UnexpectedEof,
                        "transfer made no progress (end of file)",
                    )));
                } else {
                    done[i] += result as usize;
                    if done[i] < len(i) {
                        queue.push_back(i); // short transfer: the rest
                    } else {
                        outcomes[i] = Some(Ok(()));
                        on_complete(i);
                    }
                }
            }
        }
        outcomes
            .into_iter()
            .map(|o| o.unwrap_or_else(|| Err(io::Error::other("transfer was never completed"))))
            .collect()
    }
}

impl IoEngine for UringEngine {
    fn name(&self) -> &'static str {
        "uring"
    }

    fn read_batch_then(&self, reads: &mut [ReadOp<'_>], on_read: &(dyn Fn(usize, &[u8]) + Sync)) {
        let targets: Vec<(i32, u64, *mut u8, usize)> = reads
            .iter_mut()
            .map(|op| {
                (
                    op.file.as_raw_fd(),
                    op.offset,
                    op.buf.as_mut_ptr(),
                    op.buf.len(),
                )
            })
            .collect();
        let outcomes = self.run(
            targets.len(),
            |i| targets[i].3,
            |i, done| {
                let (fd, offset, ptr, len) = targets[i];
                let chunk = (len - done).min(MAX_TRANSFER);
                // SAFETY: `done < len`, so the pointer stays inside the buffer.
                let buf = unsafe { ptr.add(done) };
                opcode::Read::new(types::Fd(fd), buf, chunk as u32)
                    .offset(offset + done as u64)
                    .build()
            },
            |i| {
                let (_, _, ptr, len) = targets[i];
                // SAFETY: read `i` has completed, so the kernel no longer
                // writes its buffer; the caller's borrow keeps it alive, and
                // no one else touches it until this call returns.
                on_read(i, unsafe { std::slice::from_raw_parts(ptr, len) });
            },
        );
        for (op, outcome) in reads.iter_mut().zip(outcomes) {
            op.result = outcome;
        }
    }

    fn write_vectored_at(&self, file: &File, offset: u64, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        // Cut the buffers into chunks of about WRITE_CHUNK bytes (never
        // splitting a buffer), each written by one concurrent submission.
        struct Chunk {
            offset: u64,
            first: usize,
            count: usize,
            len: usize,
        }
        let mut chunks: Vec<Chunk> = Vec::new();
        let mut at = offset;
        let mut i = 0;
        while i < bufs.len() {
            let mut chunk = Chunk {
                offset: at,
                first: i,
                count: 0,
                len: 0,
            };
            while i < bufs.len()
                && (chunk.count == 0 || chunk.len + bufs[i].len() <= WRITE_CHUNK)
                && chunk.count < 1024
            {
                chunk.len += bufs[i].len();
                chunk.count += 1;
                i += 1;
            }
            at += chunk.len as u64;
            chunks.push(chunk);
        }
        let fd = file.as_raw_fd();
        // One iovec array per chunk, rebuilt per submission to skip what a
        // short write already wrote.
        let iovecs: Vec<Mutex<Vec<libc::iovec>>> =
            chunks.iter().map(|_| Mutex::new(Vec::new())).collect();
        let outcomes = self.run(
            chunks.len(),
            |c| chunks[c].len,
            |c, done| {
                let chunk = &chunks[c];
                let mut iov = iovecs[c].lock().unwrap();
                iov.clear();
                let mut skip = done;
                for buf in &bufs[chunk.first..chunk.first + chunk.count] {
                    if skip >= buf.len() {
                        skip -= buf.len();
                        continue;
                    }
                    iov.push(libc::iovec {
                        iov_base: buf[skip..].as_ptr() as *mut libc::c_void,
                        iov_len: buf.len() - skip,
                    });
                    skip = 0;
                }
                opcode::Writev::new(types::Fd(fd), iov.as_ptr(), iov.len() as u32)
                    .offset(chunk.offset + done as u64)
                    .build()
            },
            |_| {},
        );
        outcomes.into_iter().collect()
    }

    fn sync_data(&self, file: &File) -> io::Result<()> {
        file.sync_data()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::disk::io::{AlignedBuf, PsyncEngine};

    fn engines() -> Vec<Box<dyn IoEngine>> {
        // A depth far below the batch sizes below exercises the full
        // submission queue path.
        vec![
            Box::new(UringEngine::new(2, 1).expect("io_uring")),
            Box::new(PsyncEngine::new(3)),
        ]
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    #[test]
    fn vectored_writes_and_batched_reads_round_trip() {
        for engine in engines() {
            let dir = tempfile::tempdir().unwrap();
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.path().join("f"))
                .unwrap();
            // 1,500 small buffers (past IOV_MAX and past one write chunk),
            // then a 9 MiB one.
            let small: Vec<Vec<u8>> = (0..1500).map(|i| pattern(4096, i as u8)).collect();
            let big = pattern(9 << 20, 7);
            let mut slices: Vec<IoSlice<'_>> = small.iter().map(|b| IoSlice::new(b)).collect();
            slices.push(IoSlice::new(&big));
            engine.write_vectored_at(&file, 4096, &slices).unwrap();
            engine.sync_data(&file).unwrap();

            let mut bufs: Vec<Vec<u8>> = (0..1500).map(|_| vec![0u8; 4096]).collect();
            let mut big_back = vec![0u8; 9 << 20];
            let mut ops: Vec<ReadOp<'_>> = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| ReadOp::new(&file, 4096 + i as u64 * 4096, b))
                .collect();
            ops.push(ReadOp::new(&file, 4096 + 1500 * 4096, &mut big_back));
            engine.read_batch(&mut ops);
            assert!(ops.iter().all(|op| op.result.is_ok()), "{}", engine.name());
            drop(ops);
            assert_eq!(bufs, small, "{}", engine.name());
            assert!(big_back == big, "{}", engine.name());
        }
    }

    #[test]
    fn reads_past_the_end_fail_alone() {
        for engine in engines() {
            let dir = tempfile::tempdir().unwrap();
            let path = dir.path().join("f");
            std::fs::write(&path, pattern(10_000, 1)).unwrap();
            let file = File::open(&path).unwrap();
            let mut a = vec![0u8; 5000];
            let mut b = vec![0u8; 5000];
            let mut c = vec![0u8; 100];
            let mut ops = vec![
                ReadOp::new(&file, 0, &mut a),
                ReadOp::new(&file, 8000, &mut b),
                ReadOp::new(&file, 9900, &mut c),
            ];
            engine.read_batch(&mut ops);
            assert!(ops[0].result.is_ok());
            let err = ops[1].result.as_ref().unwrap_err();
            assert_eq!(
                err.kind(),
                io::ErrorKind::UnexpectedEof,
                "{}",
                engine.name()
            );
            assert!(ops[2].result.is_ok());
            drop(ops);
            assert_eq!(a, pattern(10_000, 1)[..5000]);
            assert_eq!(c, pattern(10_000, 1)[9900..]);
        }
    }

    #[test]
    fn direct_io_reads_into_aligned_buffers() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("f");
        std::fs::write(&path, pattern(1 << 20, 3)).unwrap();
        let file = {
            use std::os::unix::fs::OpenOptionsExt;
            match std::fs::OpenOptions::new()
                .read(true)
                .custom_flags(libc::O_DIRECT)
                .open(&path)
            {
                Ok(file) => file,
                Err(_) => return, // a file system without O_DIRECT
            }
        };
        for engine in engines() {
            let mut bufs: Vec<AlignedBuf> = (0..16).map(|_| AlignedBuf::zeroed(64 << 10)).collect();
            let mut ops: Vec<ReadOp<'_>> = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| ReadOp::new(&file, (i as u64) << 16, b.as_mut_slice()))
                .collect();
            engine.read_batch(&mut ops);
            assert!(ops.iter().all(|op| op.result.is_ok()), "{}", engine.name());
            drop(ops);
            let joined: Vec<u8> = bufs.iter().flat_map(|b| b.as_slice().to_vec()).collect();
            assert!(joined == pattern(1 << 20, 3), "{}", engine.name());
        }
    }
}
