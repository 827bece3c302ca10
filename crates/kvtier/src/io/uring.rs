//! io_uring engine: every read of a batch is queued on a ring and submitted
//! at once (deep queue, like 3FS's USRBIO), then the caller waits in the
//! kernel for completions (no busy polling). Short transfers are resubmitted
//! for the remainder; a full submission queue is drained by waiting for
//! completions before queueing more.

use super::{IoEngine, LongLivedMemory, ReadOp};
use io_uring::{opcode, types, IoUring};
use std::collections::HashMap;
use std::fs::File;
use std::io::{self, IoSlice};
use std::os::unix::io::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, RwLock};

/// Largest single transfer handed to the kernel; bigger ones continue as
/// "short" transfers.
const MAX_TRANSFER: usize = 1 << 30;
/// Bytes per write submission: a batch's values are written as several
/// concurrent writes of about this size, so the device sees a deep queue.
pub const WRITE_CHUNK: usize = 4 << 20;
/// Registered-file slots per ring: region files open at once. Files past
/// this many are used through plain descriptors.
const FILE_SLOTS: u32 = 4096;
/// The kernel pins at most 1 GiB per registered buffer, so long-lived
/// memory is registered as consecutive buffers of this size.
const FIXED_BUFFER_LEN: usize = 1 << 30;

/// Which registered-file slot holds each registered descriptor.
#[derive(Debug, Default)]
struct FileTable {
    slots: HashMap<RawFd, u32>,
    free: Vec<u32>,
}

/// Long-lived memory registered as fixed buffers on every ring.
#[derive(Debug)]
struct FixedMemory {
    /// Kept alive so the registered range stays mapped.
    _owner: Arc<dyn LongLivedMemory>,
    start: usize,
    len: usize,
}

impl FixedMemory {
    /// The registered buffer that holds all of `ptr..ptr + len`, if one does.
    fn index_of(&self, ptr: *const u8, len: usize) -> Option<u16> {
        let at = (ptr as usize).checked_sub(self.start)?;
        if len == 0 || at.checked_add(len)? > self.len {
            return None;
        }
        let index = at / FIXED_BUFFER_LEN;
        ((at + len - 1) / FIXED_BUFFER_LEN == index).then_some(index as u16)
    }
}

/// How an operation names its file: a registered slot or a descriptor.
#[derive(Debug, Clone, Copy)]
enum FileTarget {
    Fixed(u32),
    Fd(RawFd),
}

/// Builds an SQE for either kind of file target (the io_uring crate types
/// the two differently).
macro_rules! on_target {
    ($target:expr, $fd:ident => $build:expr) => {
        match $target {
            FileTarget::Fixed(slot) => {
                let $fd = types::Fixed(slot);
                $build
            }
            FileTarget::Fd(raw) => {
                let $fd = types::Fd(raw);
                $build
            }
        }
    };
}

pub struct UringEngine {
    rings: Vec<Mutex<IoUring>>,
    /// The rings' descriptors, for registrations made while a ring is busy
    /// (the kernel serializes them with submissions itself).
    ring_fds: Vec<RawFd>,
    next: AtomicUsize,
    depth: usize,
    /// `None` where the kernel has no sparse file tables (before 5.19).
    files: Option<RwLock<FileTable>>,
    fixed: OnceLock<FixedMemory>,
    /// Whether the kernel has IORING_OP_WRITEV_FIXED (6.15).
    writev_fixed: bool,
    /// Whether to register what callers offer at all.
    registration: bool,
}

impl std::fmt::Debug for UringEngine {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UringEngine")
            .field("rings", &self.rings.len())
            .field("depth", &self.depth)
            .field("registered_files", &self.files.is_some())
            .field("fixed_buffers", &self.fixed.get().is_some())
            .finish()
    }
}

/// IORING_REGISTER_FILES_UPDATE's argument (linux/io_uring.h).
#[repr(C)]
struct FilesUpdate {
    offset: u32,
    resv: u32,
    fds: u64,
}

/// Points registered-file slot `slot` of the ring `ring_fd` at `fd` (or
/// empties it for -1). A raw call on the ring's descriptor, so it needs no
/// lock on a ring another thread may be waiting on.
fn update_file_slot(ring_fd: RawFd, slot: u32, fd: RawFd) -> io::Result<()> {
    const IORING_REGISTER_FILES_UPDATE: libc::c_long = 6;
    let fds = [fd];
    let update = FilesUpdate {
        offset: slot,
        resv: 0,
        fds: fds.as_ptr() as u64,
    };
    // SAFETY: `update` and `fds` are valid for the call, which only reads
    // them.
    let result = unsafe {
        libc::syscall(
            libc::SYS_io_uring_register,
            ring_fd as libc::c_long,
            IORING_REGISTER_FILES_UPDATE,
            &update as *const FilesUpdate,
            1 as libc::c_long,
        )
    };
    match result {
        1 => Ok(()),
        r if r < 0 => Err(io::Error::last_os_error()),
        _ => Err(io::Error::other("registered-file update took no slot")),
    }
}

impl UringEngine {
    /// Sets up `rings` rings of `depth` entries and proves them with a
    /// no-op, since some sandboxes allow ring setup but refuse operations.
    /// With `registration`, files and long-lived memory offered later are
    /// registered with the rings (where the kernel allows it).
    pub fn new(depth: u32, rings: usize, registration: bool) -> io::Result<Self> {
        let depth = depth.clamp(1, 4096);
        let mut created = Vec::with_capacity(rings.max(1));
        let mut sparse_files = registration;
        let mut writev_fixed = false;
        for n in 0..rings.max(1) {
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
            if sparse_files {
                sparse_files = ring.submitter().register_files_sparse(FILE_SLOTS).is_ok();
            }
            if n == 0 {
                let mut probe = io_uring::Probe::new();
                writev_fixed = ring.submitter().register_probe(&mut probe).is_ok()
                    && probe.is_supported(opcode::WritevFixed::CODE);
            }
            created.push(Mutex::new(ring));
        }
        let ring_fds = created
            .iter()
            .map(|r| r.lock().unwrap().as_raw_fd())
            .collect();
        Ok(UringEngine {
            rings: created,
            ring_fds,
            next: AtomicUsize::new(0),
            depth: depth as usize,
            files: sparse_files.then(|| {
                RwLock::new(FileTable {
                    slots: HashMap::new(),
                    free: (0..FILE_SLOTS).rev().collect(),
                })
            }),
            fixed: OnceLock::new(),
            writev_fixed,
            registration,
        })
    }

    fn target(&self, fd: RawFd) -> FileTarget {
        self.files
            .as_ref()
            .and_then(|table| table.read().unwrap().slots.get(&fd).copied())
            .map_or(FileTarget::Fd(fd), FileTarget::Fixed)
    }

    fn fixed_index(&self, ptr: *const u8, len: usize) -> Option<u16> {
        self.fixed.get()?.index_of(ptr, len)
    }

    /// A ring for this call: a free one if any, else wait for one. A ring
    /// whose last user panicked is still sound (`Drain` emptied it before
    /// the lock was released), so poisoning is ignored.
    fn ring(&self) -> MutexGuard<'_, IoUring> {
        let start = self.next.fetch_add(1, Ordering::Relaxed);
        for i in 0..self.rings.len() {
            match self.rings[(start + i) % self.rings.len()].try_lock() {
                Ok(ring) => return ring,
                Err(std::sync::TryLockError::Poisoned(p)) => return p.into_inner(),
                Err(std::sync::TryLockError::WouldBlock) => {}
            }
        }
        self.rings[start % self.rings.len()]
            .lock()
            .unwrap_or_else(|p| p.into_inner())
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
        // Operations handed to the kernel (or queued on the ring for it):
        // their buffers are in use until they complete. `Drain` waits for
        // them if this function unwinds.
        let mut ring = Drain {
            ring: self.ring(),
            in_flight: 0,
        };
        while ring.in_flight > 0 || !queue.is_empty() {
            while ring.in_flight < self.depth {
                let Some(&i) = queue.front() else { break };
                let entry = prepare(i, done[i]).user_data(i as u64);
                // SAFETY: the SQE points into buffers that the caller keeps
                // alive until this function returns, and it does not return
                // while any queued operation is unfinished.
                if unsafe { ring.ring.submission().push(&entry) }.is_err() {
                    break; // full: wait for completions first
                }
                queue.pop_front();
                ring.in_flight += 1;
            }
            if let Err(e) = ring.ring.submit_and_wait(1) {
                match e.raw_os_error() {
                    // Interrupted, short of resources, or completions
                    // waiting to be reaped: reap and try again.
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY) => {}
                    _ => {
                        // The ring is unusable while the kernel may still
                        // write into the callers' buffers: stopping the
                        // process is the only memory-safe answer.
                        eprintln!(
                            "kvtier: io_uring submission failed with {} operations queued: {e}",
                            ring.in_flight
                        );
                        std::process::abort();
                    }
                }
            }
            let completed: Vec<(u64, i32)> = ring
                .ring
                .completion()
                .map(|cqe| (cqe.user_data(), cqe.result()))
                .collect();
            // Counted before any callback runs, so a panic in one leaves
            // an exact count for `Drain`.
            ring.in_flight -= completed.len();
            for (user_data, result) in completed {
                let i = user_data as usize;
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

/// A ring in use by `run`, with the count of operations the kernel still
/// holds. Dropped while unwinding (a panic in `prepare` or `on_complete`),
/// it waits for every one of them, so no transfer outlives the buffers of
/// the stack being unwound; if even that wait fails, the process aborts
/// (the kernel could still write into freed memory).
struct Drain<'a> {
    ring: MutexGuard<'a, IoUring>,
    in_flight: usize,
}

impl Drop for Drain<'_> {
    fn drop(&mut self) {
        while self.in_flight > 0 {
            if let Err(e) = self.ring.submit_and_wait(1) {
                if !matches!(
                    e.raw_os_error(),
                    Some(libc::EINTR) | Some(libc::EAGAIN) | Some(libc::EBUSY)
                ) {
                    eprintln!(
                        "kvtier: io_uring wait failed while unwinding with {} operations in flight: {e}",
                        self.in_flight
                    );
                    std::process::abort();
                }
            }
            let reaped = self.ring.completion().count();
            self.in_flight -= reaped.min(self.in_flight);
        }
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
        let files: Vec<FileTarget> = targets.iter().map(|t| self.target(t.0)).collect();
        let outcomes = self.run(
            targets.len(),
            |i| targets[i].3,
            |i, done| {
                let (_, offset, ptr, len) = targets[i];
                let chunk = (len - done).min(MAX_TRANSFER);
                // SAFETY: `done < len`, so the pointer stays inside the buffer.
                let buf = unsafe { ptr.add(done) };
                let at = offset + done as u64;
                match self.fixed_index(buf, chunk) {
                    Some(index) => on_target!(files[i], file => {
                        opcode::ReadFixed::new(file, buf, chunk as u32, index).offset(at).build()
                    }),
                    None => on_target!(files[i], file => {
                        opcode::Read::new(file, buf, chunk as u32).offset(at).build()
                    }),
                }
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
        let file = self.target(file.as_raw_fd());
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
                let at = chunk.offset + done as u64;
                // A chunk wholly inside one registered buffer (the pool's
                // values, never the batch record) skips per-write pinning.
                let fixed = iov
                    .iter()
                    .map(|v| self.fixed_index(v.iov_base.cast_const().cast(), v.iov_len))
                    .reduce(|a, b| if a == b { a } else { None })
                    .flatten();
                match fixed {
                    Some(index) if iov.len() == 1 => on_target!(file, f => {
                        opcode::WriteFixed::new(f, iov[0].iov_base.cast_const().cast(), iov[0].iov_len as u32, index)
                            .offset(at)
                            .build()
                    }),
                    Some(index) if self.writev_fixed => on_target!(file, f => {
                        opcode::WritevFixed::new(f, iov.as_ptr(), iov.len() as u32, index)
                            .offset(at)
                            .build()
                    }),
                    _ => on_target!(file, f => {
                        opcode::Writev::new(f, iov.as_ptr(), iov.len() as u32).offset(at).build()
                    }),
                }
            },
            |_| {},
        );
        outcomes.into_iter().collect()
    }

    fn sync_data(&self, file: &File) -> io::Result<()> {
        file.sync_data()
    }

    fn register_memory(&self, memory: Arc<dyn LongLivedMemory>) -> bool {
        if !self.registration || self.fixed.get().is_some() {
            return false; // off, or already done (one registration per ring)
        }
        let (start, len) = memory.memory_range();
        if len == 0 || len.div_ceil(FIXED_BUFFER_LEN) > usize::from(u16::MAX) {
            return false;
        }
        let iovecs: Vec<libc::iovec> = (0..len)
            .step_by(FIXED_BUFFER_LEN)
            .map(|at| libc::iovec {
                // SAFETY: `at < len`, inside the memory.
                iov_base: unsafe { start.add(at) }.cast_mut().cast(),
                iov_len: (len - at).min(FIXED_BUFFER_LEN),
            })
            .collect();
        for (n, ring) in self.rings.iter().enumerate() {
            let ring = ring.lock().unwrap();
            // SAFETY: `memory` stays mapped while the engine holds it (the
            // trait's promise), and the engine keeps it until the rings go.
            if let Err(e) = unsafe { ring.submitter().register_buffers(&iovecs) } {
                tracing::info!(error = %e, bytes = len, "io_uring fixed buffers unavailable (pinning refused); transfers pin pages one by one");
                for earlier in &self.rings[..n] {
                    let _ = earlier.lock().unwrap().submitter().unregister_buffers();
                }
                return false;
            }
        }
        let _ = self.fixed.set(FixedMemory {
            _owner: memory,
            start: start as usize,
            len,
        });
        true
    }

    fn uses_fixed_buffers(&self) -> bool {
        self.fixed.get().is_some()
    }

    fn uses_registered_files(&self) -> bool {
        self.files.is_some()
    }

    fn register_file(&self, file: &File) {
        let Some(table) = &self.files else { return };
        let fd = file.as_raw_fd();
        let mut table = table.write().unwrap();
        if table.slots.contains_key(&fd) {
            return;
        }
        let Some(slot) = table.free.pop() else { return };
        for (n, &ring_fd) in self.ring_fds.iter().enumerate() {
            if let Err(e) = update_file_slot(ring_fd, slot, fd) {
                tracing::debug!(error = %e, "registering a file with io_uring failed; using its descriptor");
                for &earlier in &self.ring_fds[..n] {
                    let _ = update_file_slot(earlier, slot, -1);
                }
                table.free.push(slot);
                return;
            }
        }
        table.slots.insert(fd, slot);
    }

    fn hold_until_idle(&self, file: &File) -> bool {
        if self.files.is_some() {
            // A slot of the sparse table every ring shares.
            self.register_file(file);
            return matches!(self.target(file.as_raw_fd()), FileTarget::Fixed(_));
        }
        // No table yet (registration off, or a kernel before sparse
        // tables): a one-file table per ring.
        let fd = file.as_raw_fd();
        let held = self.rings.iter().all(|ring| {
            ring.lock()
                .unwrap()
                .submitter()
                .register_files(&[fd])
                .is_ok()
        });
        if !held {
            for ring in &self.rings {
                let _ = ring.lock().unwrap().submitter().unregister_files();
            }
        }
        held
    }

    fn release_hold(&self, file: &File) {
        if self.files.is_some() {
            self.unregister_file(file);
        } else {
            for ring in &self.rings {
                let _ = ring.lock().unwrap().submitter().unregister_files();
            }
        }
    }

    fn unregister_file(&self, file: &File) {
        let Some(table) = &self.files else { return };
        let mut table = table.write().unwrap();
        let Some(slot) = table.slots.remove(&file.as_raw_fd()) else {
            return;
        };
        for &ring_fd in &self.ring_fds {
            // Failing to empty a slot only keeps the old file open until
            // the ring goes; the slot is not reused in that case.
            if update_file_slot(ring_fd, slot, -1).is_err() {
                return;
            }
        }
        table.free.push(slot);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::io::{AlignedBuf, PsyncEngine};

    fn engines() -> Vec<Box<dyn IoEngine>> {
        // A depth far below the batch sizes below exercises the full
        // submission queue path.
        vec![
            Box::new(UringEngine::new(2, 1, false).expect("io_uring")),
            Box::new(UringEngine::new(2, 2, true).expect("io_uring")),
            Box::new(PsyncEngine::new(3)),
        ]
    }

    /// An empty read-write file in `dir`.
    fn scratch_file(dir: &tempfile::TempDir) -> std::fs::File {
        std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create(true)
            .truncate(true)
            .open(dir.path().join("f"))
            .unwrap()
    }

    fn pattern(len: usize, seed: u8) -> Vec<u8> {
        (0..len)
            .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
            .collect()
    }

    /// A panic in a completion callback unwinds only after every
    /// operation still in the kernel completed: the ring comes back empty,
    /// and the next batch on it reads the right bytes into the right
    /// buffers (a leftover completion would be credited to the wrong one).
    #[test]
    fn a_panicking_callback_leaves_no_operation_in_flight() {
        let engine = UringEngine::new(4, 1, false).expect("io_uring");
        let dir = tempfile::tempdir().unwrap();
        let file = scratch_file(&dir);
        let data = pattern(64 * 4096, 3);
        engine
            .write_vectored_at(&file, 0, &[IoSlice::new(&data)])
            .unwrap();
        for round in 0..3 {
            let unwound = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                let mut bufs: Vec<Vec<u8>> = (0..64).map(|_| vec![0u8; 4096]).collect();
                let mut ops: Vec<ReadOp<'_>> = bufs
                    .iter_mut()
                    .enumerate()
                    .map(|(i, b)| ReadOp::new(&file, (i * 4096) as u64, b))
                    .collect();
                engine.read_batch_then(&mut ops, &|i, _| {
                    if i == round {
                        panic!("verification bug");
                    }
                });
            }));
            assert!(unwound.is_err(), "the callback's panic propagates");
            let mut bufs: Vec<Vec<u8>> = (0..64).map(|_| vec![0u8; 4096]).collect();
            let mut ops: Vec<ReadOp<'_>> = bufs
                .iter_mut()
                .enumerate()
                .rev()
                .map(|(i, b)| ReadOp::new(&file, (i * 4096) as u64, b))
                .collect();
            engine.read_batch_then(&mut ops, &|_, _| {});
            assert!(ops.iter().all(|op| op.result.is_ok()));
            drop(ops);
            assert_eq!(bufs.concat(), data, "round {round}");
        }
    }

    #[test]
    fn vectored_writes_and_batched_reads_round_trip() {
        for engine in engines() {
            let dir = tempfile::tempdir().unwrap();
            let file = scratch_file(&dir);
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
            engine.read_batch_then(&mut ops, &|_, _| {});
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
            engine.read_batch_then(&mut ops, &|_, _| {});
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
                Err(e) => panic!(
                    "O_DIRECT is refused in {} ({e}): these tests need a file system with \
                     direct I/O (ext4, xfs); they never pass on buffered I/O",
                    dir.path().display()
                ),
            }
        };
        for engine in engines() {
            let mut bufs: Vec<AlignedBuf> = (0..16).map(|_| AlignedBuf::zeroed(64 << 10)).collect();
            let mut ops: Vec<ReadOp<'_>> = bufs
                .iter_mut()
                .enumerate()
                .map(|(i, b)| ReadOp::new(&file, (i as u64) << 16, b.as_mut_slice()))
                .collect();
            engine.read_batch_then(&mut ops, &|_, _| {});
            assert!(ops.iter().all(|op| op.result.is_ok()), "{}", engine.name());
            drop(ops);
            let joined: Vec<u8> = bufs.iter().flat_map(|b| b.as_slice().to_vec()).collect();
            assert!(joined == pattern(1 << 20, 3), "{}", engine.name());
        }
    }

    /// Long-lived memory for tests: one aligned buffer.
    #[derive(Debug)]
    struct TestMemory(AlignedBuf);

    impl LongLivedMemory for TestMemory {
        fn memory_range(&self) -> (*const u8, usize) {
            (self.0.as_slice().as_ptr(), self.0.len())
        }
    }

    #[test]
    fn fixed_buffer_index_covers_whole_ranges_only() {
        let owner: Arc<dyn LongLivedMemory> = Arc::new(TestMemory(AlignedBuf::zeroed(4096)));
        let fixed = FixedMemory {
            _owner: owner,
            start: 1 << 40,
            len: 3 * FIXED_BUFFER_LEN + 4096,
        };
        let at = |offset: usize| ((1usize << 40) + offset) as *const u8;
        assert_eq!(fixed.index_of(at(0), 4096), Some(0));
        assert_eq!(fixed.index_of(at(FIXED_BUFFER_LEN - 4096), 4096), Some(0));
        // Straddling two registered buffers: no single index holds it.
        assert_eq!(fixed.index_of(at(FIXED_BUFFER_LEN - 4096), 8192), None);
        assert_eq!(fixed.index_of(at(2 * FIXED_BUFFER_LEN), 4096), Some(2));
        assert_eq!(fixed.index_of(at(3 * FIXED_BUFFER_LEN), 4096), Some(3));
        // Past the end, before the start, empty.
        assert_eq!(fixed.index_of(at(3 * FIXED_BUFFER_LEN), 8192), None);
        assert_eq!(fixed.index_of((1usize << 40) as *const u8, 0), None);
        assert_eq!(
            fixed.index_of(((1usize << 40) - 4096) as *const u8, 4096),
            None
        );
    }

    /// Writes from registered memory (one buffer per write: WRITE_FIXED; many:
    /// WRITEV_FIXED where the kernel has it) and reads into it (READ_FIXED)
    /// through registered files, then checks that a registered slot freed by
    /// one file and taken by the next never reads the old file.
    #[test]
    fn registered_files_and_fixed_buffers_round_trip() {
        let engine = UringEngine::new(4, 2, true).expect("io_uring");
        let memory = Arc::new(TestMemory(AlignedBuf::zeroed(64 << 20)));
        let base = memory.0.as_slice().as_ptr() as *mut u8;
        let registered = engine.register_memory(Arc::clone(&memory) as _);
        if rustix::process::geteuid().is_root() {
            // Root has no memlock limit: the registration must have worked.
            assert!(registered && engine.uses_fixed_buffers());
            assert!(engine.uses_registered_files());
        }
        // SAFETY: the engine keeps `memory` alive; this test is its only
        // user, and each range below is used by one side at a time.
        let region = |offset: usize, len: usize| unsafe {
            std::slice::from_raw_parts_mut(base.add(offset), len)
        };
        let dir = tempfile::tempdir().unwrap();
        for (round, name) in ["a", "b", "c"].into_iter().enumerate() {
            let file = std::fs::OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(true)
                .open(dir.path().join(name))
                .unwrap();
            engine.register_file(&file);
            // One 8 MiB value (a single-buffer write) and 300 values of 8 KiB
            // (gathered into multi-buffer writes).
            let big = pattern(8 << 20, round as u8);
            region(0, big.len()).copy_from_slice(&big);
            let smalls: Vec<Vec<u8>> = (0..300).map(|i| pattern(8192, (i + round) as u8)).collect();
            for (i, small) in smalls.iter().enumerate() {
                region((16 << 20) + i * 8192, 8192).copy_from_slice(small);
            }
            let mut slices: Vec<IoSlice<'_>> = vec![IoSlice::new(region(0, big.len()))];
            slices.extend((0..300).map(|i| IoSlice::new(region((16 << 20) + i * 8192, 8192))));
            engine.write_vectored_at(&file, 0, &slices).unwrap();
            engine.sync_data(&file).unwrap();
            // Read everything back into another part of the memory.
            let back_at = 32 << 20;
            let total = big.len() + 300 * 8192;
            region(back_at, total).fill(0);
            let mut ops = vec![ReadOp::new(&file, 0, region(back_at, big.len()))];
            ops.extend((0..300).map(|i| {
                ReadOp::new(
                    &file,
                    (big.len() + i * 8192) as u64,
                    region(back_at + big.len() + i * 8192, 8192),
                )
            }));
            engine.read_batch_then(&mut ops, &|_, _| {});
            assert!(ops.iter().all(|op| op.result.is_ok()));
            drop(ops);
            assert!(
                region(back_at, big.len()) == big.as_slice(),
                "round {round}"
            );
            for (i, small) in smalls.iter().enumerate() {
                assert!(
                    region(back_at + big.len() + i * 8192, 8192) == small.as_slice(),
                    "round {round}, value {i}"
                );
            }
            engine.unregister_file(&file);
            drop(file);
        }
    }
}
